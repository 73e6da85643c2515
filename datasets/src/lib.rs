//! Datasets for embers (in progress).
