//! `block_bucketize_sparse_features`: the row-wise sharding router. Every id of every feature is
//! sent to the bucket (rank) that owns its block of rows and rebased into that rank's local row
//! space; the output is laid out bucket-major, then feature, then sample, so each rank's part
//! is one contiguous slice. The routing itself ([`Bucketize`]) has its CPU half in `cpu.rs` and its
//! CUDA half in `cuda.rs` (`kernels/bucketize.cu`).

mod cpu;
pub(crate) mod cuda;

use std::sync::Arc;

use super::read_ints;
use crate::cuda::CudaDevice;
use crate::tensor::{run_on, DeviceOp};
use crate::{Error, Result, Tensor};

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

/// The routing of validated inputs, run on the ids' device.
struct Bucketize<'a> {
    lengths: &'a Tensor,
    indices: &'a Tensor,
    /// Bag `b`'s ids are `offsets[b] .. offsets[b + 1]`.
    offsets: Vec<i64>,
    /// The feature of each bag.
    bag_feature: &'a [usize],
    /// Per feature.
    routers: Vec<Router>,
    my_size: usize,
    options: &'a BlockBucketizeOptions<'a>,
    /// Names bag `b` in messages (feature and sample).
    describe: &'a (dyn Fn(usize) -> String + Sync),
}

impl DeviceOp for Bucketize<'_> {
    type Output = BlockBucketized;
    fn cpu(&self) -> Result<BlockBucketized> {
        cpu::run(self)
    }
    fn cuda(&self, device: &Arc<CudaDevice>) -> Result<BlockBucketized> {
        cuda::run(self, device)
    }
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
    // The output lengths are [my_size, bags] of 8 bytes (and each task counts per bucket).
    if crate::tensor::addressable_bytes(&[my_size, lens.len().max(1)], 8).is_none() {
        return Err(Error::invalid(
            OP,
            format!(
                "my_size {my_size} buckets of {} bags are past any memory",
                lens.len()
            ),
        ));
    }
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
        let next = feature_bag_start.last().and_then(|&at| at.checked_add(b));
        feature_bag_start.push(
            next.ok_or_else(|| Error::invalid(OP, "the batch sizes per feature sum past a usize"))?,
        );
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
            // (Checked: the span of all blocks must be a u64.)
            let range = (block as u64).checked_mul(blocks as u64).ok_or_else(|| {
                Error::invalid(
                    OP,
                    format!("feature {f}: block size {block} × total_num_blocks {blocks} pass a u64"),
                )
            })?;
            Ok(Router::Uniform {
                bucket_span: FastDivisor::new(block as u64 * per_bucket),
                blocks_per_bucket: per_bucket,
                total_blocks: blocks as u64,
                range,
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

    let op = Bucketize {
        lengths,
        indices,
        offsets,
        bag_feature: &bag_feature,
        routers,
        my_size,
        options,
        describe: &describe,
    };
    run_on(indices.device(), &op)
}
