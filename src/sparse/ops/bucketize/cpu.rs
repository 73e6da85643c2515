//! The routing in host memory: bags in parallel tasks, each id written once.

use rayon::prelude::*;

use super::super::{
    int_tensor, with_any_dtype, zeroed_buffer, DisjointWriter, PARALLEL_MIN_ELEMENTS,
};
use super::{BlockBucketized, Bucketize, Router};
use crate::{DType, Error, Result, Tensor};

/// Index element types the router reads and writes.
trait IndexElem: Copy + Send + Sync + Default + crate::tensor::WithDType {
    fn to_i64(self) -> i64;
    fn from_u64(v: u64) -> Self;
}

impl IndexElem for i64 {
    #[inline(always)]
    fn to_i64(self) -> i64 {
        self
    }
    #[inline(always)]
    fn from_u64(v: u64) -> Self {
        v as i64
    }
}

impl IndexElem for i32 {
    #[inline(always)]
    fn to_i64(self) -> i64 {
        i64::from(self)
    }
    #[inline(always)]
    fn from_u64(v: u64) -> Self {
        v as i32
    }
}

/// Bags handled by one task.
const BAGS_PER_TASK: usize = 2048;

struct Routed<I> {
    lengths: Vec<i64>,
    indices: Vec<I>,
    /// New position of every original id (only when some output needs it).
    destination: Option<Vec<i64>>,
}

#[allow(clippy::too_many_arguments)]
fn route_all<I: IndexElem>(
    ids: &[I],
    offsets: &[i64],
    bag_feature: &[usize],
    routers: &[Router],
    my_size: usize,
    keep_orig_idx: bool,
    need_destination: bool,
    feature_names: impl Fn(usize, usize) -> String + Sync,
) -> Result<Routed<I>> {
    const OP: &str = "block_bucketize_sparse_features";
    let total_bags = offsets.len() - 1;
    let num_tasks = total_bags.div_ceil(BAGS_PER_TASK);
    let parallel = ids.len() >= PARALLEL_MIN_ELEMENTS;
    let mut lengths = zeroed_buffer::<i64>(my_size * total_bags);

    // Pass 1: count ids per (bucket, bag) and per (task, bucket).
    let task_counts: Vec<Vec<i64>> = {
        let length_writer = DisjointWriter::new(&mut lengths);
        let count = |task: usize| -> Result<Vec<i64>> {
            let mut per_bucket = vec![0i64; my_size];
            let mut bag_counts = vec![0i64; my_size];
            let bags = task * BAGS_PER_TASK..((task + 1) * BAGS_PER_TASK).min(total_bags);
            for bag in bags {
                let router = &routers[bag_feature[bag]];
                bag_counts.iter_mut().for_each(|c| *c = 0);
                let (start, end) = (offsets[bag] as usize, offsets[bag + 1] as usize);
                for (k, &id) in ids[start..end].iter().enumerate() {
                    let id = id.to_i64();
                    if id < 0 {
                        return Err(Error::invalid(
                            OP,
                            format!(
                                "{}, position {k}: id {id} is negative",
                                feature_names(bag, start + k)
                            ),
                        ));
                    }
                    bag_counts[router.route(id as u64, my_size as u64).0] += 1;
                }
                for (bucket, &c) in bag_counts.iter().enumerate() {
                    // SAFETY: position (bucket, bag) belongs to this bag alone, and each bag is
                    // visited by exactly one task.
                    unsafe { length_writer.write(bucket * total_bags + bag, c) };
                    per_bucket[bucket] += c;
                }
            }
            Ok(per_bucket)
        };
        if parallel {
            (0..num_tasks)
                .into_par_iter()
                .map(count)
                .collect::<Result<_>>()?
        } else {
            (0..num_tasks).map(count).collect::<Result<_>>()?
        }
    };

    // Where each task's ids start in each bucket: bucket-major, then task order.
    let mut task_base = vec![vec![0i64; my_size]; num_tasks];
    let mut running = 0i64;
    for bucket in 0..my_size {
        for task in 0..num_tasks {
            task_base[task][bucket] = running;
            running += task_counts[task][bucket];
        }
    }

    // Pass 2: scatter every id to its slot.
    let mut indices = zeroed_buffer::<I>(ids.len());
    let mut destination = need_destination.then(|| zeroed_buffer::<i64>(ids.len()));
    {
        let index_writer = DisjointWriter::new(&mut indices);
        let destination_writer = destination.as_mut().map(|d| DisjointWriter::new(d));
        let scatter = |task: usize| {
            let mut cursor = task_base[task].clone();
            let bags = task * BAGS_PER_TASK..((task + 1) * BAGS_PER_TASK).min(total_bags);
            for bag in bags {
                let router = &routers[bag_feature[bag]];
                let (start, end) = (offsets[bag] as usize, offsets[bag + 1] as usize);
                for (i, &id) in ids.iter().enumerate().take(end).skip(start) {
                    let raw = id.to_i64() as u64;
                    let (bucket, rebased) = router.route(raw, my_size as u64);
                    let slot = cursor[bucket] as usize;
                    cursor[bucket] += 1;
                    let new_id = if keep_orig_idx {
                        id
                    } else {
                        I::from_u64(rebased)
                    };
                    // SAFETY: slots of (bucket, task) form the disjoint range
                    // task_base[task][bucket] .. + task_counts[task][bucket], and the cursor
                    // stays inside it (pass 1 counted exactly these ids). Destination i is the
                    // original position, owned by this task's bag.
                    unsafe {
                        index_writer.write(slot, new_id);
                        if let Some(w) = &destination_writer {
                            w.write(i, slot as i64);
                        }
                    }
                }
            }
        };
        if parallel {
            (0..num_tasks).into_par_iter().for_each(scatter);
        } else {
            (0..num_tasks).for_each(scatter);
        }
    }
    Ok(Routed {
        lengths,
        indices,
        destination,
    })
}

/// Scatters `values[i]` to `destination[i]` (a permutation), any dtype.
fn scatter_tensor(values: &Tensor, destination: &[i64]) -> Result<Tensor> {
    with_any_dtype!(values.dtype(), T => {
        let out = values.with_contiguous(|v: &[T]| {
            let mut out = vec![T::default(); v.len()];
            for (&d, &x) in destination.iter().zip(v) {
                out[d as usize] = x;
            }
            out
        })?;
        Tensor::from_vec(out, values.shape())
    })
}

pub(super) fn run(op: &Bucketize<'_>) -> Result<BlockBucketized> {
    const OP: &str = "block_bucketize_sparse_features";
    let (indices, lengths, options, my_size) = (op.indices, op.lengths, op.options, op.my_size);
    let (offsets, bag_feature, routers) = (&op.offsets, &op.bag_feature, &op.routers);
    let num_ids = indices.numel();
    let num_bags = offsets.len() - 1;
    let describe = op.describe;
    let need_destination = options.weights.is_some() || options.bucketize_pos || options.sequence;
    let names = |bag: usize, _: usize| describe(bag);
    macro_rules! run {
        ($I:ty) => {{
            let routed = indices.with_contiguous(|ids: &[$I]| {
                route_all(
                    ids,
                    &offsets,
                    &bag_feature,
                    &routers,
                    my_size,
                    options.keep_orig_idx,
                    need_destination,
                    names,
                )
            })??;
            let idx = Tensor::from_vec(routed.indices, &[num_ids])?;
            (routed.lengths, idx, routed.destination)
        }};
    }
    let (new_lengths, new_indices, destination) = match indices.dtype() {
        DType::I64 => run!(i64),
        DType::I32 => run!(i32),
        d => {
            return Err(Error::invalid(
                OP,
                format!("indices must be i64 or i32, got {d:?}"),
            ))
        }
    };
    let n = new_lengths.len();
    let weights = match (options.weights, &destination) {
        (Some(w), Some(dest)) => Some(scatter_tensor(&w.reshape(&[num_ids])?, dest)?),
        _ => None,
    };
    let positions = match (options.bucketize_pos, &destination) {
        (true, Some(dest)) => {
            let mut pos = vec![0i64; num_ids];
            for bag in 0..num_bags {
                for i in offsets[bag] as usize..offsets[bag + 1] as usize {
                    pos[dest[i] as usize] = i as i64 - offsets[bag];
                }
            }
            Some(int_tensor(pos, &[num_ids], indices.dtype())?)
        }
        _ => None,
    };
    let unbucketize_permute = match (options.sequence, destination) {
        (true, Some(dest)) => Some(int_tensor(dest, &[num_ids], indices.dtype())?),
        _ => None,
    };
    Ok(BlockBucketized {
        lengths: int_tensor(new_lengths, &[n], lengths.dtype())?,
        indices: new_indices,
        weights,
        positions,
        unbucketize_permute,
    })
}
