//! Memory held back from the tables on every rank, as TorchRec's heuristical reservation does
//! it: a percentage of HBM as margin, the dense model, and the input KJT buffers.

use crate::config::Problem;
use crate::error::{human_bytes, PlannerError};
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

/// What each rank has left for the tables after reservation, or a config error naming what
/// reserves more than the rank has (the dense model, or the KJT buffers of the batch sizes):
/// such a reservation is no plan, and saying so beats blaming the tables.
pub fn reserve(problem: &Problem) -> Result<Vec<Storage>, PlannerError> {
    let t = &problem.topology;
    let r = &problem.reservation;
    let kjt = if r.kjt { kjt_bytes(problem) } else { 0 };
    let hbm = ((1.0 - r.percentage) * t.hbm_cap as f64) as u64;
    // The tier the dense model and the input buffers are held in: HBM on GPUs, DDR on CPUs.
    let (tier, held) = match t.compute_device {
        ComputeDevice::Cuda => ("HBM (after the percentage margin)", hbm),
        ComputeDevice::Cpu => ("DDR", t.ddr_cap),
    };
    // With none left at all, what left none is to blame, not what asks for some.
    let none_left = match t.compute_device {
        ComputeDevice::Cuda if t.hbm_cap == 0 => "topology.hbm_cap",
        ComputeDevice::Cuda => "storage_reservation.percentage",
        ComputeDevice::Cpu => "topology.ddr_cap",
    };
    let short = |field: &str, what: String| PlannerError::Config {
        field: if held == 0 { none_left } else { field }.into(),
        message: format!(
            "{what}, more than the {} of {tier} each rank has",
            human_bytes(held)
        ),
    };
    let left = held.checked_sub(r.dense_bytes).ok_or_else(|| {
        short(
            "storage_reservation.dense_bytes",
            format!(
                "reserves {} for the dense model",
                human_bytes(r.dense_bytes)
            ),
        )
    })?;
    let left = left.checked_sub(kjt).ok_or_else(|| {
        short(
            "batch_size",
            format!(
                "the input KJT buffers ({KJT_MULTIPLIER} batches of ids over every feature's \
                 pooling factor × batch size) take {}, with {} of dense model",
                human_bytes(kjt),
                human_bytes(r.dense_bytes)
            ),
        )
    })?;
    let cap = match t.compute_device {
        ComputeDevice::Cuda => Storage {
            hbm: left,
            ddr: t.ddr_cap,
        },
        ComputeDevice::Cpu => Storage { hbm, ddr: left },
    };
    Ok(vec![cap; t.world_size])
}
