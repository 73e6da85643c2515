//! Recommendation models: DLRM with the dot interaction or the DCNv2 low-rank cross network,
//! with TorchRec's shapes and layer semantics.

pub mod dlrm;
pub mod interaction;

pub use dlrm::{
    DenseArch, Dlrm, DlrmDense, Interaction, InteractionArch, LowRankCrossNet, OverArch,
};
