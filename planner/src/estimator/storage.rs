//! TorchRec 1.9.2's memory model of one shard: weights (their share of the table), optimizer
//! state, cache bookkeeping for cached kernels, and the input/output buffers of one batch.

use crate::config::Table;
use crate::estimator::perf::{batch_inputs, batch_outputs, DEFAULT_CACHE_LOAD_FACTOR, INDEX_BYTES};
use crate::types::{ComputeDevice, ComputeKernel, ShardingType, Storage};

/// Bytes of the whole table's weights.
pub fn table_bytes(table: &Table) -> u64 {
    (table.rows as u128 * table.dim as u128 * table.data_type.bits() as u128).div_ceil(8) as u64
}

/// `ceil(a / b)` the way Python evaluates `math.ceil(a / b)` on integers (true division to the
/// nearest double first).
fn ceil_div_like_python(a: u128, b: u128) -> u64 {
    let q = a / b;
    let r = a % b;
    if q < (1u128 << 53) {
        (q + u128::from(r != 0)) as u64
    } else {
        (a as f64 / b as f64).ceil() as u64
    }
}

/// Python's `round()` of a non-negative float (ties to even).
fn round_half_even(x: f64) -> u64 {
    let f = x.floor();
    let diff = x - f;
    let r = if diff > 0.5 || (diff == 0.5 && (f as u64) % 2 == 1) {
        f + 1.0
    } else {
        f
    };
    r as u64
}

/// Input and output buffer bytes of each shard.
fn io_sizes(
    table: &Table,
    st: ShardingType,
    world: usize,
    local: usize,
    sizes: &[[u64; 2]],
) -> Vec<(u64, u64)> {
    let out_elem = match table.constraints.output_dtype {
        Some(dt) => dt.bits() as f64 / 8.0,
        None => table.data_type.element_size() as f64,
    };
    let bo = batch_outputs(table);
    let bi_total = batch_inputs(table);
    let w = world as f64;
    let dim = table.dim as f64;
    match st {
        ShardingType::DataParallel => {
            let i = (bi_total * INDEX_BYTES).ceil() as u64;
            let o = (bo * dim * out_elem).ceil() as u64;
            vec![(i, o); sizes.len()]
        }
        ShardingType::TableWise => {
            let i = (bi_total * w * INDEX_BYTES).ceil() as u64;
            let o = (bo * w * dim * out_elem).ceil() as u64;
            vec![(i, o); sizes.len()]
        }
        ShardingType::ColumnWise | ShardingType::TableColumnWise => {
            let i = (bi_total * w * INDEX_BYTES).ceil() as u64;
            sizes
                .iter()
                .map(|s| (i, (bo * w * s[1] as f64 * out_elem).ceil() as u64))
                .collect()
        }
        ShardingType::RowWise | ShardingType::TableRowWise | ShardingType::GridShard => {
            let div = if st == ShardingType::RowWise {
                w
            } else {
                local as f64
            };
            let bi = bi_total / div;
            let bo = if table.pooled { bo } else { bi };
            sizes
                .iter()
                .map(|s| {
                    if s[0] * s[1] == 0 {
                        (0, 0)
                    } else {
                        (
                            (bi * w * INDEX_BYTES).ceil() as u64,
                            (bo * w * s[1] as f64 * out_elem).ceil() as u64,
                        )
                    }
                })
                .collect()
        }
    }
}

/// Storage of each shard (`[rows, cols]` sizes) of `table`, as TorchRec's
/// `EmbeddingStorageEstimator` computes it for training with no pipeline.
pub fn shard_storages(
    device: ComputeDevice,
    world: usize,
    local: usize,
    table: &Table,
    st: ShardingType,
    kernel: ComputeKernel,
    sizes: &[[u64; 2]],
) -> Vec<Storage> {
    let io = io_sizes(table, st, world, local, sizes);
    // Quantized rows carry a 4-byte scale/bias header each.
    let bytes = table_bytes(table)
        + if kernel == ComputeKernel::Quant {
            table.rows * 4
        } else {
            0
        };
    let in_ddr = matches!(
        kernel,
        ComputeKernel::FusedUvm | ComputeKernel::FusedUvmCaching
    ) || device == ComputeDevice::Cpu;
    let (mut hbm_tensor, ddr_tensor) = if in_ddr { (0, bytes) } else { (bytes, 0) };
    let clf = table
        .constraints
        .cache_load_factor
        .unwrap_or(DEFAULT_CACHE_LOAD_FACTOR);
    let cached = kernel.is_cached();
    if cached {
        hbm_tensor = round_half_even(ddr_tensor as f64 * clf);
    }
    let full = table.rows as u128 * table.dim as u128;
    let specific = |storage: u64, with_cache: bool| -> Vec<u64> {
        sizes
            .iter()
            .map(|s| {
                let tensor = if st == ShardingType::DataParallel {
                    storage
                } else {
                    ceil_div_like_python(storage as u128 * (s[0] as u128 * s[1] as u128), full)
                };
                let optimizer = (tensor as f64 * table.optimizer_multiplier).ceil() as u64;
                let aux = if with_cache {
                    (s[0] as f64 * (4.0 + clf * 16.0)).ceil() as u64
                } else {
                    0
                };
                // Saturating: absurd inputs (a pooling factor of 1e20) give sizes that cannot fit
                // anywhere, not an overflow.
                aux.saturating_add(tensor).saturating_add(optimizer)
            })
            .collect()
    };
    let hbm_specific = specific(hbm_tensor, cached);
    let ddr_specific = specific(ddr_tensor, false);
    io.iter()
        .zip(hbm_specific.iter().zip(&ddr_specific))
        .map(|(&(i, o), (&h, &d))| match device {
            ComputeDevice::Cuda => Storage {
                hbm: h.saturating_add(i).saturating_add(o),
                ddr: d,
            },
            ComputeDevice::Cpu => Storage {
                hbm: 0,
                ddr: i.saturating_add(o).saturating_add(d),
            },
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn python_rounding_helpers() {
        assert_eq!(round_half_even(2.5), 2);
        assert_eq!(round_half_even(3.5), 4);
        assert_eq!(round_half_even(3.4), 3);
        assert_eq!(ceil_div_like_python(10, 4), 3);
        assert_eq!(ceil_div_like_python(12, 4), 3);
    }
}
