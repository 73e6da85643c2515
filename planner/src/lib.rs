//! The embers sharding planner (work in progress).
