//! Model-parallel embeddings across processes: a [`ShardingPlan`] (from `embers-plan` or by
//! hand) executed over a [`Comm`] — MPI across processes (feature `mpi`, `mpi_world`) or
//! threads of one process ([`LocalGroup`], for tests and single-process runs).
//!
//! * [`comm`]: the communicator — all-to-all-v, all-gather-v, reduce-scatter-v, all-reduce,
//!   sub-groups — every call numbered, byte-counted and guarded by a deadline.
//! * [`plan`]: sharding plans and their checks.
//! * [`ShardedEmbeddingBagCollection`]: the tables of an EBC spread by a plan, with TorchRec's
//!   input and output distributions for data-parallel, table-wise, column-wise,
//!   table-column-wise, row-wise and table-row-wise tables.
//! * [`ShardedEmbeddingCollection`]: the same for an EC (unpooled lookups): the rows of
//!   each id travel back by one all-to-all, their gradients by its reverse.
//! * [`checkpoint`]: sharded checkpoints that load under any plan, or unsharded.
//! * [`kjt_all_to_all`]: TorchRec's `KJTAllToAll` on its own.
//! * [`codec`]: quantized communication codecs (FP16, BF16, FP8, INT8 row-wise), used by the
//!   pooled collection's output distribution and its backward ([`QCommsConfig`]).
//! * [`pipeline`]: the training pipeline (loading, input distribution and training of three
//!   batches at once, on three threads).
//! * [`global_metrics`]: RecMetrics over every rank's data, as one process would compute them.
//! * [`all_reduce_mean_gradients`]: the dense half's data parallelism (DDP's all-reduce).

pub mod checkpoint;
pub mod codec;
pub mod comm;
pub mod embedding;
pub mod embedding_bag;
mod input_dist;
pub mod metrics;
pub mod pipeline;
pub mod plan;
mod routing;
mod shards;

pub use checkpoint::{
    all_ok, load_into_unsharded, lock_checkpoint_dir, CheckpointDirLock, LoadReport,
    UnshardedTables,
};
pub use codec::{Codec, CommPrecision, QCommsConfig};
#[cfg(feature = "mpi")]
pub use comm::mpi::mpi_world;
pub use comm::{Comm, LocalGroup, OpBytes};
pub use embedding::ShardedEmbeddingCollection;
pub use embedding_bag::{DistributedInput, ShardedEmbeddingBagCollection};
pub use input_dist::kjt_all_to_all;
pub use metrics::global_metrics;
pub use pipeline::{PipelineBatch, PipelineReport, TrainPipeline};
pub use plan::{
    ComputeKernel, Placement, Shard, ShardCaches, ShardingPlan, ShardingType, TableShape,
    TableSharding,
};
pub use shards::{init_table, ShardValues, ShardableTable};

use crate::error::Result;
use crate::{Device, Tensor};

/// Replaces each parameter's gradient by its mean over the ranks of `comm` (DDP's
/// all-reduce; a missing gradient counts as zeros). Every rank passes the same parameters
/// in the same order; the sum runs in rank order, so every rank gets the same bits.
pub fn all_reduce_mean_gradients(comm: &Comm, params: &[Tensor]) -> Result<()> {
    if comm.size() == 1 && params.iter().all(|p| p.grad().is_some()) {
        // The mean over one rank is its gradient.
        return comm.all_reduce_sum("all_reduce.dense_gradients", &mut []);
    }
    let mut flat: Vec<f32> = Vec::with_capacity(params.iter().map(Tensor::numel).sum());
    for p in params {
        match p.grad() {
            Some(g) if g.device() == Device::Cpu && g.dtype() == crate::DType::F32 => {
                g.with_contiguous(|v: &[f32]| flat.extend_from_slice(v))?
            }
            Some(g) => flat.extend(
                g.to_device(Device::Cpu)?
                    .cast_values(crate::DType::F32)?
                    .to_vec::<f32>()?,
            ),
            None => flat.extend(std::iter::repeat_n(0.0f32, p.numel())),
        }
    }
    comm.all_reduce_sum("all_reduce.dense_gradients", &mut flat)?;
    let scale = 1.0 / comm.size() as f32;
    let mut at = 0;
    for p in params {
        let n = p.numel();
        let mean: Vec<f32> = flat[at..at + n].iter().map(|x| x * scale).collect();
        at += n;
        let mut g = Tensor::from_vec(mean, p.shape())?;
        if p.dtype() != crate::DType::F32 {
            g = g.cast_values(p.dtype())?;
        }
        if p.device() != Device::Cpu {
            g = g.to_device(p.device())?;
        }
        p.set_grad(g)?;
    }
    Ok(())
}
