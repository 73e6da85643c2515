//! Sparse input distribution: bags of ids sent to the ranks that look them up, TorchRec's
//! `KJTAllToAll` in two phases.
//!
//! 1. *splits* — one all-to-all of four `i64` per peer: `[#lengths, #values, flags, stride]`
//!    (flags: bit 0 the bags carry per-sample weights, bit 1 the sender rejected its batch,
//!    the bits above it the batch's number). Every rank learns what it will receive, and every
//!    rank learns the same thing about rejected batches, weights and batch numbers, so all of
//!    them stop together on bad input or on a rank that skipped a batch.
//! 2. *lengths*, *values* (and *weights*) — one all-to-all each, with the sizes of phase 1.
//!
//! The received blocks are `[source][slot][sample]`; they are re-ordered ("recat") to
//! `[slot][source][sample]`: per slot, the global batch, every rank's samples in rank order.

use super::comm::Comm;
use crate::error::{Error, Result};
use crate::sparse::KeyedJaggedTensor;
use crate::{DType, Tensor};

/// Bags for one destination, slot-major: `slots × stride` lengths, then their ids.
#[derive(Clone, Debug, Default, PartialEq)]
pub(crate) struct Bags {
    pub lengths: Vec<i32>,
    pub values: Vec<i64>,
    pub weights: Option<Vec<f32>>,
}

/// What a rank received, re-ordered `[slot][source][sample]`.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Gathered {
    /// Each source's batch size.
    pub strides: Vec<usize>,
    /// `slots × Σ strides` lengths.
    pub lengths: Vec<i32>,
    pub values: Vec<i64>,
    pub weights: Option<Vec<f32>>,
}

impl Gathered {
    /// The global batch size (`Σ strides`).
    pub fn batch(&self) -> usize {
        self.strides.iter().sum()
    }

    /// Offsets of the bags (`lengths.len() + 1` entries).
    pub fn offsets(&self) -> Vec<i64> {
        let mut offsets = Vec::with_capacity(self.lengths.len() + 1);
        offsets.push(0i64);
        let mut at = 0i64;
        for &l in &self.lengths {
            at += i64::from(l);
            offsets.push(at);
        }
        offsets
    }
}

const WEIGHTED: i64 = 1;
const REJECTED: i64 = 2;

/// The flags word of batch number `batch`: the number above two bits, `REJECTED` if
/// `rejected`, `WEIGHTED` if `weighted` (and not rejected).
fn flags_word(batch: u64, rejected: bool, weighted: bool) -> i64 {
    let bits = if rejected {
        REJECTED
    } else if weighted {
        WEIGHTED
    } else {
        0
    };
    ((batch as i64) << 2) | bits
}

/// Every rank's verdict on its batch without bags to send (a plan of data-parallel tables
/// only): one all-gather of the flags word of [`all_to_all_bags`], so that a batch one rank
/// rejects, or a skipped batch, ends every rank here rather than in the backward's collectives.
pub(crate) fn agree_on_batch(comm: &Comm, rejected: Option<Error>, batch: u64) -> Result<()> {
    let (rank, w) = (comm.rank(), comm.size());
    let flags = flags_word(batch, rejected.is_some(), false);
    let got = comm.all_gather_v("input_dist.agree", &[flags], Some(&vec![1; w]))?;
    check_flags(rank, rejected, batch, |s| got[s][0], w)
}

/// This rank's error if it rejected its batch; else an error naming the ranks that rejected
/// theirs, or that are at another batch number than `batch`, from every rank's flags word.
fn check_flags(
    rank: usize,
    rejected: Option<Error>,
    batch: u64,
    flags: impl Fn(usize) -> i64,
    w: usize,
) -> Result<()> {
    if let Some(e) = rejected {
        return Err(e);
    }
    let refused: Vec<usize> = (0..w).filter(|&s| flags(s) & REJECTED != 0).collect();
    if !refused.is_empty() {
        return Err(Error::Distributed(format!(
            "rank {rank}: rank(s) {refused:?} rejected their input batch (see their error); \
             every rank skips this batch"
        )));
    }
    let behind: Vec<(usize, i64)> = (0..w)
        .map(|s| (s, flags(s) >> 2))
        .filter(|&(_, b)| b != batch as i64)
        .collect();
    if !behind.is_empty() {
        return Err(Error::Distributed(format!(
            "rank {rank}: at batch #{batch}, but (rank, batch) {behind:?} — a rank skipped or \
             repeated a batch"
        )));
    }
    Ok(())
}

/// Sends `send[d]` (bags of this rank's `stride` samples for rank `d`'s slots) to every rank
/// and gathers the bags of this rank's `slots` slots from every rank. `rejected`: this rank's
/// batch failed its checks — it still takes part, sends nothing, and gets its error back;
/// every other rank gets an error naming it. `batch`: the batch's number, which every rank
/// must agree on.
pub(crate) fn all_to_all_bags(
    comm: &Comm,
    send: Vec<Bags>,
    stride: usize,
    slots: usize,
    rejected: Option<Error>,
    batch: u64,
) -> Result<Gathered> {
    let (rank, w) = (comm.rank(), comm.size());
    let weighted = send.iter().any(|b| b.weights.is_some());
    let flags = flags_word(batch, rejected.is_some(), weighted);
    let splits: Vec<Vec<i64>> = (0..w)
        .map(|d| match (&rejected, send.get(d)) {
            (None, Some(b)) => vec![
                b.lengths.len() as i64,
                b.values.len() as i64,
                flags,
                stride as i64,
            ],
            _ => vec![0, 0, flags, 0],
        })
        .collect();
    let got = comm.all_to_all_v("input_dist.splits", splits, Some(&vec![4; w]))?;
    check_flags(rank, rejected, batch, |s| got[s][2], w)?;
    let weighted_ranks: Vec<usize> = (0..w).filter(|&s| got[s][2] & WEIGHTED != 0).collect();
    if !weighted_ranks.is_empty() && weighted_ranks.len() != w {
        return Err(Error::Distributed(format!(
            "rank {rank}: only rank(s) {weighted_ranks:?} sent per-sample weights; every rank's \
             batch needs them, or none"
        )));
    }
    let weighted = !weighted_ranks.is_empty();
    let mut strides = Vec::with_capacity(w);
    let mut value_counts = Vec::with_capacity(w);
    for (s, split) in got.iter().enumerate() {
        let (lengths, values, b) = (split[0], split[1], split[3]);
        let expected = usize::try_from(b).ok().and_then(|b| slots.checked_mul(b));
        if lengths < 0 || values < 0 || expected != usize::try_from(lengths).ok() {
            return Err(Error::Distributed(format!(
                "rank {rank}: rank {s} announced {lengths} lengths of a batch of {b} for \
                 {slots} slots (do the ranks run the same plan?)"
            )));
        }
        strides.push(b as usize);
        value_counts.push(values as usize);
    }
    let length_counts: Vec<usize> = strides.iter().map(|b| b * slots).collect();
    let mut lengths_send = Vec::with_capacity(w);
    let mut values_send = Vec::with_capacity(w);
    let mut weights_send = Vec::with_capacity(w);
    for b in send {
        lengths_send.push(b.lengths);
        values_send.push(b.values);
        weights_send.push(b.weights.unwrap_or_default());
    }
    let lengths = comm.all_to_all_v("input_dist.lengths", lengths_send, Some(&length_counts))?;
    let values = comm.all_to_all_v("input_dist.values", values_send, Some(&value_counts))?;
    let weights = if weighted {
        Some(comm.all_to_all_v("input_dist.weights", weights_send, Some(&value_counts))?)
    } else {
        None
    };
    // Check each source's lengths against its values before trusting them.
    for s in 0..w {
        let total: i64 = lengths[s].iter().map(|&l| i64::from(l)).sum();
        if lengths[s].iter().any(|&l| l < 0) || total != values[s].len() as i64 {
            return Err(Error::Distributed(format!(
                "rank {rank}: rank {s} sent lengths summing to {total} with {} ids",
                values[s].len()
            )));
        }
    }
    // Recat: [source][slot][sample] → [slot][source][sample].
    let starts: Vec<Vec<usize>> = (0..w)
        .map(|s| {
            let mut at = 0;
            let mut starts = Vec::with_capacity(slots + 1);
            for slot in 0..slots {
                starts.push(at);
                let b = strides[s];
                at += (lengths[s][slot * b..(slot + 1) * b].iter())
                    .map(|&l| l as usize)
                    .sum::<usize>();
            }
            starts.push(at);
            starts
        })
        .collect();
    let total_values: usize = values.iter().map(Vec::len).sum();
    let mut out = Gathered {
        lengths: Vec::with_capacity(length_counts.iter().sum()),
        values: Vec::with_capacity(total_values),
        weights: weighted.then(|| Vec::with_capacity(total_values)),
        strides,
    };
    for slot in 0..slots {
        for s in 0..w {
            let b = out.strides[s];
            out.lengths
                .extend_from_slice(&lengths[s][slot * b..(slot + 1) * b]);
            let range = starts[s][slot]..starts[s][slot + 1];
            out.values.extend_from_slice(&values[s][range.clone()]);
            if let (Some(o), Some(w)) = (&mut out.weights, &weights) {
                o.extend_from_slice(&w[s][range]);
            }
        }
    }
    Ok(out)
}

/// A KJT's lengths, values and weights on the host, in one integer width.
pub(crate) struct HostKjt {
    pub keys: Vec<String>,
    pub stride: usize,
    pub lengths: Vec<i64>,
    /// `lengths.len() + 1` offsets.
    pub offsets: Vec<i64>,
    pub values: Vec<i64>,
    pub weights: Option<Vec<f32>>,
}

impl HostKjt {
    /// Reads `kjt` (one batch size for every key).
    pub fn new(op: &'static str, kjt: &KeyedJaggedTensor) -> Result<HostKjt> {
        if kjt.variable_stride_per_key() {
            return Err(Error::invalid(
                op,
                "variable-batch KJTs are not supported: every key needs the same batch size",
            ));
        }
        let ints = |t: &Tensor, what: &'static str| -> Result<Vec<i64>> {
            match t.dtype() {
                DType::I32 => Ok(t.to_vec::<i32>()?.into_iter().map(i64::from).collect()),
                DType::I64 => t.to_vec::<i64>(),
                other => Err(Error::UnsupportedDType {
                    op,
                    dtype: other,
                    expected: what,
                }),
            }
        };
        let lengths = ints(kjt.lengths(), "i32 or i64 KJT lengths")?;
        let offsets = ints(kjt.offsets(), "i32 or i64 KJT offsets")?;
        let values = ints(kjt.values(), "i32 or i64 ids in the KJT values")?;
        let weights = kjt
            .weights()
            .map(|w| w.cast_values(DType::F32)?.to_vec::<f32>())
            .transpose()?;
        // A KJT built unchecked may hold lengths and offsets that disagree: refused here, so
        // the batch travels as rejected (read as it was, the receivers' checks failed on some
        // ranks only, or a slice past the values panicked).
        let bags = kjt.keys().len().checked_mul(kjt.stride());
        let consistent = bags == Some(lengths.len())
            && offsets.len() == lengths.len() + 1
            && offsets.first() == Some(&0)
            && offsets.last() == Some(&(values.len() as i64))
            && (offsets.windows(2).zip(&lengths)).all(|(o, &l)| l >= 0 && o[1] - o[0] == l)
            && weights.as_ref().is_none_or(|w| w.len() == values.len());
        if !consistent {
            return Err(Error::invalid(
                op,
                format!(
                    "the KJT's {} lengths, {} offsets, {} values and {} weights disagree \
                     ({} keys × batch {}): lengths ≥ 0, offsets their running sum from 0 to the \
                     values' count",
                    lengths.len(),
                    offsets.len(),
                    values.len(),
                    weights.as_ref().map_or(0, Vec::len),
                    kjt.keys().len(),
                    kjt.stride()
                ),
            ));
        }
        Ok(HostKjt {
            keys: kjt.keys().to_vec(),
            stride: kjt.stride(),
            lengths,
            offsets,
            values,
            weights,
        })
    }

    /// The bags of key `k`: its ids (and weights) and per-sample lengths.
    pub fn key(&self, k: usize) -> (&[i64], Option<&[f32]>, &[i64]) {
        let b = self.stride;
        let (start, end) = (
            self.offsets[k * b] as usize,
            self.offsets[(k + 1) * b] as usize,
        );
        (
            &self.values[start..end],
            self.weights.as_ref().map(|w| &w[start..end]),
            &self.lengths[k * b..(k + 1) * b],
        )
    }
}

/// TorchRec's `KJTAllToAll`: sends the first `splits[0]` keys of `kjt` to rank 0, the next
/// `splits[1]` to rank 1, …, and returns the keys this rank received, each with the bags of
/// every rank's batch in rank order (batch `Σ B_r`). Every rank passes the same keys and
/// splits; batch sizes may differ.
pub fn kjt_all_to_all(
    comm: &Comm,
    kjt: &KeyedJaggedTensor,
    splits: &[usize],
) -> Result<KeyedJaggedTensor> {
    const OP: &str = "kjt_all_to_all";
    let (rank, w) = (comm.rank(), comm.size());
    let checked = (|| {
        if splits.len() != w || crate::tensor::checked_sum(splits) != Some(kjt.keys().len()) {
            return Err(Error::invalid(
                OP,
                format!(
                    "splits {splits:?} must give each of the {w} ranks its keys ({} keys)",
                    kjt.keys().len()
                ),
            ));
        }
        HostKjt::new(OP, kjt)
    })();
    let (send, stride, rejected, keys) = match checked {
        Ok(host) => {
            let mut send = Vec::with_capacity(w);
            let mut first = 0;
            let mut keys = Vec::new();
            for (d, &n) in splits.iter().enumerate() {
                let mut bags = Bags {
                    weights: host.weights.as_ref().map(|_| Vec::new()),
                    ..Bags::default()
                };
                for k in first..first + n {
                    let (ids, weights, lengths) = host.key(k);
                    bags.lengths.extend(lengths.iter().map(|&l| l as i32));
                    bags.values.extend_from_slice(ids);
                    if let (Some(o), Some(wt)) = (&mut bags.weights, weights) {
                        o.extend_from_slice(wt);
                    }
                }
                if d == rank {
                    keys = host.keys[first..first + n].to_vec();
                }
                first += n;
                send.push(bags);
            }
            (send, host.stride, None, keys)
        }
        Err(e) => (Vec::new(), 0, Some(e), Vec::new()),
    };
    // Every rank must pass the same keys and splits (key names never travel: keys in another
    // order were filled with another key's ids): a digest of both, agreed on first.
    let mut text = format!("{splits:?}");
    for k in kjt.keys() {
        text.push('\0');
        text.push_str(k);
    }
    let digest = (super::plan::fnv1a(text.as_bytes()) >> 1) as i64;
    let digests = comm.all_gather_v("kjt_all_to_all.keys", &[digest], Some(&vec![1; w]))?;
    let differ: Vec<usize> = (0..w).filter(|&r| digests[r][0] != digests[0][0]).collect();
    if !differ.is_empty() {
        return Err(Error::Distributed(format!(
            "rank {rank}: {OP}: rank(s) {differ:?} pass other keys or splits than rank 0 (every \
             rank passes the same keys, in the same order, and the same splits)"
        )));
    }
    let slots = keys.len();
    let got = all_to_all_bags(comm, send, stride, slots, rejected, 0)?;
    let n = got.values.len();
    let batch = got.batch();
    let lengths: Vec<i64> = got.lengths.iter().map(|&l| i64::from(l)).collect();
    let weights = got
        .weights
        .map(|wt| Tensor::from_vec(wt, &[n]))
        .transpose()?;
    let total = lengths.len();
    KeyedJaggedTensor::from_lengths(
        keys,
        Tensor::from_vec(got.values, &[n])?,
        Tensor::from_vec(lengths, &[total])?,
        weights,
        Some(batch),
    )
}
