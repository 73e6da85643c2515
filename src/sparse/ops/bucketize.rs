//! `block_bucketize_sparse_features`: the row-wise sharding router. Every id of every feature is
//! sent to the bucket (rank) that owns its block of rows and rebased into that rank's local row
//! space; the output is laid out bucket-major, then feature, then sample, so each rank's part
//! is one contiguous slice.

use rayon::prelude::*;

use super::{
    int_tensor, read_ints, with_any_dtype, zeroed_buffer, DisjointWriter, PARALLEL_MIN_ELEMENTS,
};
use crate::{DType, Error, Result, Tensor};

/// Optional inputs of [`block_bucketize_sparse_features`] (FBGEMM's keyword arguments).
#[derive(Clone, Copy, Debug, Default)]
pub struct BlockBucketizeOptions<'a> {
    /// Also return each id's position within its original bag.
    pub bucketize_pos: bool,
    /// Also return `unbucketize_permute` (original position → bucketized position), used to
    /// restore the original order of sequence embeddings.
    pub sequence: bool,
    /// Per-id weights, routed with their ids.
    pub weights: Option<&'a Tensor>,
    /// Variable batch: the batch size of each feature (`lengths` then holds `Σ B_f` entries).
    pub batch_size_per_feature: Option<&'a Tensor>,
    /// Upper bound of the per-feature batch sizes (checked when given).
    pub max_batch_size: Option<usize>,
    /// Per feature, `my_size + 1` non-decreasing boundaries starting at 0: bucket `r` owns ids
    /// in `[pos[r], pos[r+1])` (replaces the uniform `block_sizes` split).
    pub block_bucketize_pos: Option<&'a [Tensor]>,
    /// Keep ids unchanged instead of rebasing them into the bucket's local row space.
    pub keep_orig_idx: bool,
    /// Per feature, the number of logical blocks (a multiple of `my_size`); each bucket owns
    /// `total_num_blocks / my_size` consecutive blocks.
    pub total_num_blocks: Option<&'a Tensor>,
}

/// The outputs of [`block_bucketize_sparse_features`].
#[derive(Clone, Debug)]
pub struct BlockBucketized {
    /// `[my_size · Σ B_f]` lengths: bucket-major, then feature, then sample.
    pub lengths: Tensor,
    /// The routed (rebased unless `keep_orig_idx`) ids in the same order.
    pub indices: Tensor,
    /// Weights routed with their ids, when weights were given.
    pub weights: Option<Tensor>,
    /// Each routed id's position within its original bag, when `bucketize_pos`.
    pub positions: Option<Tensor>,
    /// For every original position, where its id went, when `sequence`.
    pub unbucketize_permute: Option<Tensor>,
}

/// Integer division by a fixed divisor through a float reciprocal, corrected to the exact
/// quotient: several times faster than a hardware 64-bit division in the routing loop.
#[derive(Clone, Copy, Debug)]
struct FastDivisor {
    divisor: u64,
    reciprocal: f64,
}

impl FastDivisor {
    fn new(divisor: u64) -> Self {
        FastDivisor {
            divisor,
            reciprocal: 1.0 / divisor as f64,
        }
    }

    #[inline(always)]
    fn quotient(&self, n: u64) -> u64 {
        // Below 2^50 the float estimate is off by at most one, fixed up below.
        if n >= 1 << 50 {
            return n / self.divisor;
        }
        let mut q = (n as f64 * self.reciprocal) as u64;
        if q * self.divisor > n {
            q -= 1;
        } else if (q + 1) * self.divisor <= n {
            q += 1;
        }
        q
    }
}

/// How one feature's ids map to (bucket, new id).
#[derive(Clone, Debug)]
enum Router {
    /// `bucket_span = block_size · blocks_per_bucket` consecutive ids per bucket up to
    /// `range`; ids past it are spread cyclically over the `total_blocks` blocks.
    Uniform {
        bucket_span: FastDivisor,
        blocks_per_bucket: u64,
        total_blocks: u64,
        range: u64,
    },
    /// Explicit boundaries, `my_size + 1` of them; ids past the last go cyclically.
    Boundaries(Vec<i64>),
}

impl Router {
    #[inline(always)]
    fn route(&self, id: u64, my_size: u64) -> (usize, u64) {
        match self {
            Router::Uniform {
                bucket_span,
                blocks_per_bucket,
                total_blocks,
                range,
            } => {
                if id < *range {
                    let bucket = bucket_span.quotient(id);
                    (bucket as usize, id - bucket * bucket_span.divisor)
                } else {
                    (
                        (((id % total_blocks) / blocks_per_bucket) as usize),
                        id / total_blocks,
                    )
                }
            }
            Router::Boundaries(pos) => {
                let last = pos[pos.len() - 1] as u64;
                if id >= last {
                    ((id % my_size) as usize, id / my_size)
                } else {
                    let bucket = pos.partition_point(|&p| p as u64 <= id) - 1;
                    (bucket, id - pos[bucket] as u64)
                }
            }
        }
    }
}

/// The routers flattened for the device kernels (`kernels/bucketize.cu`): per feature a kind
/// (0 uniform, 1 boundaries), four uniform parameters (bucket span, blocks per bucket, total
/// blocks, range) and `my_size + 1` boundaries.
pub(crate) struct RouterTable {
    pub kind: Vec<i32>,
    pub params: Vec<i64>,
    pub bounds: Vec<i64>,
}

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

/// Routes the ids of feature-major sparse data (`lengths`: `T·B` entries, or `Σ B_f` with a
/// variable batch; `indices`: the ids) to `my_size` buckets. Feature `f` splits its rows into
/// blocks of `block_sizes[f]`: id `x < block_sizes[f] · my_size` goes to bucket
/// `x / block_sizes[f]` as local row `x % block_sizes[f]`; larger ids go to bucket
/// `x % my_size` as row `x / my_size`. See [`BlockBucketizeOptions`] for weights, positions,
/// sequence permutation, explicit boundaries and `total_num_blocks`. Runs in parallel over
/// bags; every id lands in exactly one bucket.
pub fn block_bucketize_sparse_features(
    lengths: &Tensor,
    indices: &Tensor,
    block_sizes: &Tensor,
    my_size: usize,
    options: &BlockBucketizeOptions<'_>,
) -> Result<BlockBucketized> {
    const OP: &str = "block_bucketize_sparse_features";
    if my_size == 0 {
        return Err(Error::invalid(OP, "my_size must be at least 1"));
    }
    let sizes = read_ints(OP, "block_sizes", block_sizes)?;
    let num_features = sizes.len();
    let lens = read_ints(OP, "lengths", lengths)?;
    // Batch size of every feature.
    let batch_sizes: Vec<usize> = match options.batch_size_per_feature {
        Some(b) => {
            let b = read_ints(OP, "batch_size_per_feature", b)?;
            if b.len() != num_features || b.iter().any(|&x| x < 0) {
                return Err(Error::invalid(
                    OP,
                    format!(
                        "batch_size_per_feature {b:?} must hold {num_features} non-negative sizes"
                    ),
                ));
            }
            if let (Some(max_b), Some(&largest)) = (options.max_batch_size, b.iter().max()) {
                if largest as usize > max_b {
                    return Err(Error::invalid(
                        OP,
                        format!("a feature has batch size {largest} > max_B = {max_b}"),
                    ));
                }
            }
            b.into_iter().map(|x| x as usize).collect()
        }
        None => {
            if num_features == 0 || lens.len() % num_features != 0 {
                return Err(Error::invalid(
                    OP,
                    format!(
                        "{} lengths are not a whole batch for {num_features} features",
                        lens.len()
                    ),
                ));
            }
            vec![lens.len() / num_features; num_features]
        }
    };
    let mut feature_bag_start = vec![0usize];
    for &b in &batch_sizes {
        feature_bag_start.push(feature_bag_start.last().unwrap() + b);
    }
    if feature_bag_start[num_features] != lens.len() {
        return Err(Error::invalid(
            OP,
            format!(
                "the batch sizes add up to {} bags but lengths has {}",
                feature_bag_start[num_features],
                lens.len()
            ),
        ));
    }
    let bag_feature: Vec<usize> = (0..num_features)
        .flat_map(|f| std::iter::repeat_n(f, batch_sizes[f]))
        .collect();
    let describe = |bag: usize| {
        let f = bag_feature.get(bag).copied().unwrap_or(0);
        format!("feature {f}, sample {}", bag - feature_bag_start[f])
    };
    let offsets = super::offsets_from_lengths(OP, &lens, describe)?;
    let num_ids = indices.numel();
    super::expect_total(OP, "lengths", offsets[lens.len()], num_ids)?;

    let total_blocks: Vec<i64> = match options.total_num_blocks {
        Some(t) => read_ints(OP, "total_num_blocks", t)?,
        None => vec![my_size as i64; num_features],
    };
    if total_blocks.len() != num_features {
        return Err(Error::invalid(
            OP,
            format!(
                "total_num_blocks has {} entries for {num_features} features",
                total_blocks.len()
            ),
        ));
    }
    let routers: Vec<Router> = (0..num_features)
        .map(|f| {
            if let Some(all_pos) = options.block_bucketize_pos {
                let pos = read_ints(OP, "block_bucketize_pos", all_pos.get(f).ok_or_else(|| {
                    Error::invalid(OP, format!("block_bucketize_pos has no entry for feature {f}"))
                })?)?;
                if pos.len() != my_size + 1 || pos[0] != 0 || pos.windows(2).any(|w| w[1] < w[0]) {
                    return Err(Error::invalid(
                        OP,
                        format!("feature {f}: block_bucketize_pos {pos:?} must be {} non-decreasing boundaries starting at 0", my_size + 1),
                    ));
                }
                return Ok(Router::Boundaries(pos));
            }
            let (block, blocks) = (sizes[f], total_blocks[f]);
            if block <= 0 || blocks <= 0 || blocks % my_size as i64 != 0 {
                return Err(Error::invalid(
                    OP,
                    format!("feature {f}: block size {block} must be positive and total_num_blocks {blocks} a positive multiple of my_size {my_size}"),
                ));
            }
            let per_bucket = blocks as u64 / my_size as u64;
            Ok(Router::Uniform {
                bucket_span: FastDivisor::new(block as u64 * per_bucket),
                blocks_per_bucket: per_bucket,
                total_blocks: blocks as u64,
                range: block as u64 * blocks as u64,
            })
        })
        .collect::<Result<_>>()?;
    if let Some(w) = options.weights {
        if w.numel() != num_ids {
            return Err(Error::invalid(
                OP,
                format!(
                    "weights have {} entries but there are {num_ids} ids",
                    w.numel()
                ),
            ));
        }
    }

    if indices.device().is_cuda() {
        let mut table = RouterTable {
            kind: Vec::new(),
            params: Vec::new(),
            bounds: Vec::new(),
        };
        for r in &routers {
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
        let bag_feature: Vec<i32> = bag_feature.iter().map(|&f| f as i32).collect();
        let routed = crate::tensor::cuda::block_bucketize(
            indices,
            &offsets,
            &bag_feature,
            &table,
            my_size,
            options,
            &describe,
        )?;
        let n = routed.lengths.len();
        return Ok(BlockBucketized {
            lengths: int_tensor(routed.lengths, &[n], lengths.dtype())?
                .to_device(indices.device())?,
            indices: routed.indices,
            weights: routed.weights,
            positions: routed.positions,
            unbucketize_permute: routed.destination,
        });
    }

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
            for bag in 0..lens.len() {
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
