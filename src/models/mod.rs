//! Recommendation models: DLRM with the dot interaction or the DCNv2 low-rank cross network,
//! and the TwoTower retrieval model, with TorchRec's shapes and layer semantics.

pub mod dlrm;
pub mod interaction;
pub mod two_tower;

pub use dlrm::{
    DenseArch, Dlrm, DlrmDense, Interaction, InteractionArch, LowRankCrossNet, OverArch,
};
pub use two_tower::{Tower, TwoTower};
