//! Cost models: TorchRec's reference estimators and embers' improved variant.

pub mod cache_stats;
pub mod perf;
pub mod storage;

use crate::types::Perf;
use serde::{Deserialize, Serialize};

/// Which cost model ranks plans.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum CostModel {
    /// TorchRec 1.9.2's model, reproduced exactly: a shard costs the sum of its forward and
    /// backward compute and communication and its prefetch.
    #[default]
    Torchrec,
    /// embers' model: the same terms, but communication overlaps with compute on each
    /// pass (NCCL runs on its own stream), so a pass costs the larger of the two, and input
    /// distribution, which TorchRec reports but leaves out, is charged.
    Overlap,
}

impl CostModel {
    /// The name used on the command line and in plans.
    pub fn as_str(self) -> &'static str {
        match self {
            CostModel::Torchrec => "torchrec",
            CostModel::Overlap => "overlap",
        }
    }

    /// The cost of one shard under this model, in milliseconds.
    pub fn shard_cost(self, p: &Perf) -> f64 {
        match self {
            CostModel::Torchrec => p.total(),
            CostModel::Overlap => {
                p.fwd_compute.max(p.fwd_comms + p.input_dist_comms)
                    + p.bwd_compute.max(p.bwd_comms)
                    + p.prefetch_compute
            }
        }
    }
}
