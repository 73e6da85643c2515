//! The routing on a CUDA device (`kernels/bucketize.cu`): a count per (bucket, bag), a device
//! exclusive scan, then a per-bag scatter in the CPU's order (deterministic).

use std::sync::Arc;

use super::{BlockBucketized, Bucketize, Router};
use crate::args;
use crate::cuda::{scan_exclusive_i64, CudaDevice, LaunchConfig};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::sparse::ops::int_tensor;
use crate::tensor::backend::cuda::empty;
use crate::Tensor;

crate::kernel_source!(
    pub(crate) static BUCKETIZE = "bucketize.cu",
    [
        "block_bucketize_count_i64",
        "block_bucketize_count_i32",
        "block_bucketize_scatter_i64",
        "block_bucketize_scatter_i32",
    ];
);

/// The routers flattened for the kernels: per feature a kind (0 uniform, 1 boundaries), four
/// uniform parameters (bucket span, blocks per bucket, total blocks, range) and `my_size + 1`
/// boundaries.
#[derive(Default)]
struct RouterTable {
    kind: Vec<i32>,
    params: Vec<i64>,
    bounds: Vec<i64>,
}

impl RouterTable {
    fn new(routers: &[Router], my_size: usize) -> Self {
        let mut table = RouterTable::default();
        for r in routers {
            match r {
                Router::Uniform {
                    bucket_span,
                    blocks_per_bucket,
                    total_blocks,
                    range,
                } => {
                    table.kind.push(0);
                    let p = [
                        bucket_span.divisor,
                        *blocks_per_bucket,
                        *total_blocks,
                        *range,
                    ];
                    table
                        .params
                        .extend(p.map(|v| v.min(i64::MAX as u64) as i64));
                    table.bounds.extend(std::iter::repeat_n(0, my_size + 1));
                }
                Router::Boundaries(pos) => {
                    table.kind.push(1);
                    table.params.extend([1, 1, 1, 0]);
                    table.bounds.extend_from_slice(pos);
                }
            }
        }
        table
    }
}

/// Element `i` of an i64/i32 device tensor (for error messages).
fn read_back_int(t: &Tensor, i: usize) -> Result<i64> {
    Ok(match t.dtype() {
        DType::I32 => i64::from(t.narrow(0, i, 1)?.to_vec::<i32>()?[0]),
        _ => t.narrow(0, i, 1)?.to_vec::<i64>()?[0],
    })
}

pub(super) fn run(op: &Bucketize<'_>, device: &Arc<CudaDevice>) -> Result<BlockBucketized> {
    const OP: &str = "block_bucketize_sparse_features";
    let (options, my_size, offsets) = (op.options, op.my_size, &op.offsets);
    let ids = op.indices.contiguous_values()?;
    let (dtype, count_kernel, scatter_kernel) = match ids.dtype() {
        DType::I64 => (
            DType::I64,
            "block_bucketize_count_i64",
            "block_bucketize_scatter_i64",
        ),
        DType::I32 => (
            DType::I32,
            "block_bucketize_count_i32",
            "block_bucketize_scatter_i32",
        ),
        d => {
            return Err(Error::invalid(
                OP,
                format!("indices must be i64 or i32, got {d:?}"),
            ))
        }
    };
    let n = ids.numel();
    let bags = offsets.len() - 1;
    let weights = match options.weights {
        Some(w) if w.dtype() != DType::F32 => {
            return Err(Error::invalid(
                OP,
                format!("weights on a CUDA device must be f32, got {:?}", w.dtype()),
            ))
        }
        Some(w) => Some(w.to_device(ids.device())?.contiguous_values()?),
        None => None,
    };
    let table = RouterTable::new(&op.routers, my_size);
    let bag_feature: Vec<i32> = op.bag_feature.iter().map(|&f| f as i32).collect();
    let d_offsets = device.htod(offsets)?;
    let d_features = device.htod(&bag_feature)?;
    let d_kind = device.htod(&table.kind)?;
    let d_params = device.htod(&table.params)?;
    let d_bounds = device.htod(&table.bounds)?;
    let counts = device.zeros::<i64>((my_size * bags).max(1))?;
    let first_bad = device.htod(&[i64::MAX])?;
    let grid = LaunchConfig::covering(bags, 128);
    // Both kernels start with the ids, their bags and the routers.
    let route = args![
        ids,
        d_offsets,
        d_features,
        bags as i64,
        d_kind,
        d_params,
        d_bounds,
        my_size as i32
    ];
    // One thread per bag; offsets (checked on the host) index the n ids; counts holds my_size
    // slots per bag and every routed bucket is < my_size.
    device.launch(
        BUCKETIZE.kernel(count_kernel),
        grid,
        &[&route[..], &args![counts, first_bad]].concat(),
    )?;
    let bad = first_bad.to_host()?[0];
    if bad != i64::MAX {
        let id = read_back_int(&ids, bad as usize)?;
        let bag = offsets.partition_point(|&o| o <= bad) - 1;
        return Err(Error::invalid(
            OP,
            format!(
                "{}, position {}: id {id} is negative",
                (op.describe)(bag),
                bad - offsets[bag]
            ),
        ));
    }
    let mut cursor = device.alloc::<i64>((my_size * bags).max(1))?;
    scan_exclusive_i64(&counts, &mut cursor, my_size * bags)?;
    let mut lengths = counts.to_host()?;
    lengths.truncate(my_size * bags);
    let out_ids = empty(device, dtype, &[n])?;
    let destination = (options.sequence)
        .then(|| empty(device, dtype, &[n]))
        .transpose()?;
    let positions = (options.bucketize_pos)
        .then(|| empty(device, dtype, &[n]))
        .transpose()?;
    let out_weights = (weights.as_ref())
        .map(|_| empty(device, DType::F32, &[n]))
        .transpose()?;
    // As the count launch; the cursors start at each (bucket, bag)'s first slot and advance
    // over exactly the ids counted there, so every slot is < n and written once; the optional
    // outputs (absent: null) hold n values of the ids' type (weights f32).
    let scatter = args![
        i32::from(options.keep_orig_idx),
        cursor,
        out_ids,
        destination.as_ref(),
        positions.as_ref(),
        weights.as_ref(),
        out_weights.as_ref()
    ];
    device.launch(
        BUCKETIZE.kernel(scatter_kernel),
        grid,
        &[&route[..], &scatter[..]].concat(),
    )?;
    let count = lengths.len();
    Ok(BlockBucketized {
        lengths: int_tensor(lengths, &[count], op.lengths.dtype())?.to_device(ids.device())?,
        indices: out_ids,
        weights: out_weights,
        positions,
        unbucketize_permute: destination,
    })
}
