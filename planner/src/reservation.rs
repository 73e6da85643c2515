//! Memory held back from the tables on every rank, as TorchRec's heuristical reservation does
//! it: a percentage of HBM as margin, the dense model, and the input KJT buffers.

use crate::config::Problem;
use crate::estimator::perf::INDEX_BYTES;
use crate::types::{ComputeDevice, Storage};

/// TorchRec keeps 20 copies' worth of a batch's input indices for the KJT buffers.
const KJT_MULTIPLIER: u64 = 20;

/// Bytes of input indices per batch summed over every feature of every table, times the KJT
/// multiplier.
pub fn kjt_bytes(problem: &Problem) -> u64 {
    let mut ids = 0.0;
    for t in &problem.tables {
        for (pf, bs) in t.input_lengths.iter().zip(&t.batch_sizes) {
            ids += pf * *bs as f64;
        }
    }
    ((ids * INDEX_BYTES).ceil() as u64).saturating_mul(KJT_MULTIPLIER)
}

/// What each rank has left for the tables after reservation.
pub fn reserve(problem: &Problem) -> Vec<Storage> {
    let t = &problem.topology;
    let r = &problem.reservation;
    let kjt = if r.kjt { kjt_bytes(problem) } else { 0 };
    let hbm = ((1.0 - r.percentage) * t.hbm_cap as f64) as u64;
    let cap = match t.compute_device {
        ComputeDevice::Cuda => Storage {
            hbm: hbm.saturating_sub(r.dense_bytes).saturating_sub(kjt),
            ddr: t.ddr_cap,
        },
        ComputeDevice::Cpu => Storage {
            hbm,
            ddr: t.ddr_cap.saturating_sub(r.dense_bytes).saturating_sub(kjt),
        },
    };
    vec![cap; t.world_size]
}
