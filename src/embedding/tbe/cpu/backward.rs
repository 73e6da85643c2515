//! The TBE backward with the optimizer fused into it.
//!
//! Per table (tables run in parallel): every occurrence of an id, over all the features that
//! share the table, becomes an entry `(id, position, where its output gradient is, scale)`;
//! entries are sorted by `(id, position)`, so the gradient of each distinct row is summed in a
//! fixed order whatever the thread count (deterministic), and the row is then updated exactly
//! once. Per-sample-weight gradients are dot products with the row *before* its update.
//!
//! Differences from FBGEMM's CPU backward, all deliberate (FBGEMM's GPU kernels agree with
//! embers on the first two):
//! * MEAN pooling with per-sample weights: the forward divides by the bag length L, so the
//!   backward does too (row gradient `w_k/L · ∂out`, weight gradient `row_k·∂out / L`); FBGEMM's
//!   CPU backward drops the 1/L.
//! * Shared tables: the gradients of all features using a table are summed and the optimizer
//!   runs once per row; FBGEMM's CPU build steps once per feature.
//! * Weight decay is applied (FBGEMM's CPU build ignores it).

use rayon::prelude::*;

use crate::embedding::config::PoolingMode;
use crate::embedding::input::Batch;
use crate::embedding::optimizer::{
    dot, state_row, state_row_range, update_row, FusedOptimizer, RowState, WeightDecay,
};

/// What the optimizer needs to update one table.
pub(crate) struct TableUpdate<'a> {
    /// The table's rows, `[rows, dim]` row-major.
    pub weights: &'a mut [f32],
    /// First state buffer (per row or per element), empty if none.
    pub m1: &'a mut [f32],
    /// Second state buffer, empty if none.
    pub m2: &'a mut [f32],
    /// Row width.
    pub dim: usize,
    /// Features (indices into the batch's features) that look this table up, with the first
    /// output column of each.
    pub features: Vec<(usize, usize)>,
}

/// Gradient of the rows one backward touched in one table (optimizer [`FusedOptimizer::None`]).
#[derive(Clone, Debug, PartialEq)]
pub struct SparseTableGrad {
    /// Sorted distinct rows.
    pub rows: Vec<i64>,
    /// `[rows.len(), dim]` summed gradients.
    pub values: Vec<f32>,
    /// Row width.
    pub dim: usize,
}

impl SparseTableGrad {
    /// Adds `other` (same dim) into this gradient: the sorted union of the rows, the values of
    /// rows in both summed.
    pub fn accumulate(&mut self, other: &SparseTableGrad) {
        debug_assert_eq!(self.dim, other.dim);
        let d = self.dim;
        let (mut rows, mut values) = (Vec::new(), Vec::new());
        let (mut i, mut j) = (0, 0);
        while i < self.rows.len() || j < other.rows.len() {
            let take_self =
                j == other.rows.len() || (i < self.rows.len() && self.rows[i] <= other.rows[j]);
            let take_other =
                i == self.rows.len() || (j < other.rows.len() && other.rows[j] <= self.rows[i]);
            let start = values.len();
            if take_self {
                rows.push(self.rows[i]);
                values.extend_from_slice(&self.values[i * d..(i + 1) * d]);
                i += 1;
            }
            if take_other {
                let src = &other.values[j * d..(j + 1) * d];
                if take_self {
                    for (v, &o) in values[start..].iter_mut().zip(src) {
                        *v += o;
                    }
                } else {
                    rows.push(other.rows[j]);
                    values.extend_from_slice(src);
                }
                j += 1;
            }
        }
        self.rows = rows;
        self.values = values;
    }
}

/// Results of one fused backward.
#[derive(Clone, Debug, Default)]
pub struct BackwardOutput {
    /// Gradient of each per-sample weight (in the caller's positions), when weights were given.
    pub per_sample_weights_grad: Option<Vec<f32>>,
    /// Per-table row-sparse gradients, only with [`FusedOptimizer::None`].
    pub sparse_grads: Option<Vec<SparseTableGrad>>,
}

/// Where one occurrence's output gradient lives and how it is scaled.
/// Per table: `(position, gradient)` of each per-sample weight, and the sparse gradient.
type TableResult = (Vec<(usize, f32)>, Option<SparseTableGrad>);

struct Occurrence {
    pos: usize,
    grad_offset: usize,
    scale: f32,
    dot_scale: f32,
}

/// How many distinct rows ahead the update loop prefetches.
const PREFETCH_GROUPS: usize = 4;

#[inline(always)]
fn prefetch_f32(row: &[f32]) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        let start = row.as_ptr() as *const u8;
        let mut offset = 0;
        while offset < std::mem::size_of_val(row) {
            // SAFETY: a prefetch never faults; the address (wrapping arithmetic) is in `row`.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(start.wrapping_add(offset) as *const i8) };
            offset += 64;
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = row;
}

/// One fused backward's inputs besides the tables: `grad_out` is `[B, out_stride]` for pooled
/// modes or `[N, dim]` for [`PoolingMode::None`].
pub(crate) struct BackwardStep<'a> {
    pub batch: &'a Batch<'a>,
    pub pooling: PoolingMode,
    pub grad_out: &'a [f32],
    pub out_stride: usize,
    pub optimizer: &'a FusedOptimizer,
    pub decay: WeightDecay,
    /// This backward's number (1-based; Adam's bias correction).
    pub step: u64,
}

/// Runs the fused backward for every table.
pub(crate) fn fused_backward(
    step: &BackwardStep<'_>,
    tables: Vec<TableUpdate<'_>>,
) -> BackwardOutput {
    let (batch, optimizer) = (step.batch, step.optimizer);
    let want_psw = batch.weights.is_some();
    let results: Vec<TableResult> = tables
        .into_par_iter()
        .map(|table| {
            backward_table(TableBackward {
                step,
                table,
                want_psw,
            })
        })
        .collect();
    let mut out = BackwardOutput::default();
    if want_psw {
        let (n, kept) = match &batch.kept {
            Some((kept, n)) => (*n, Some(kept)),
            None => (batch.ids.len(), None),
        };
        let mut psw = vec![0.0f32; n];
        for (pairs, _) in &results {
            for &(p, g) in pairs {
                psw[kept.map_or(p, |k| k[p])] = g;
            }
        }
        out.per_sample_weights_grad = Some(psw);
    }
    if matches!(optimizer, FusedOptimizer::None) {
        out.sparse_grads = Some(
            results
                .into_iter()
                .map(|(_, s)| s.expect("sparse gradient produced for every table"))
                .collect(),
        );
    }
    out
}

/// One table's share of a fused backward.
struct TableBackward<'a> {
    step: &'a BackwardStep<'a>,
    table: TableUpdate<'a>,
    want_psw: bool,
}

crate::multiversion!(
    fn backward_table(args: TableBackward<'_>) -> TableResult => backward_table_body
);

#[inline(always)]
fn backward_table_body(args: TableBackward<'_>) -> TableResult {
    let TableBackward {
        step,
        table,
        want_psw,
    } = args;
    let BackwardStep {
        batch,
        pooling,
        grad_out,
        out_stride,
        optimizer,
        decay,
        step,
    } = *step;
    let dim = table.dim;
    let shapes = [optimizer.state_shape(0), optimizer.state_shape(1)];
    let b_total = batch.batch_size;
    let weights = batch.weights.as_deref();
    // Occurrences in (feature, bag, position) order; keys sort them by (row, that order), so
    // duplicates are summed in a fixed order. Packing both into one u64 keeps the sort cheap.
    let mut occurrences = Vec::new();
    let mut keys: Vec<u64> = Vec::new();
    let mut wide_keys: Vec<(usize, usize)> = Vec::new();
    // Pooled modes: copy this table's output-gradient columns into one contiguous block first.
    // Read in place they are D-wide strips Σ D apart, a stride that maps every strip onto the
    // same few cache sets; contiguous they stay in L2 while the rows are updated.
    let pooled = pooling != PoolingMode::None;
    let mut local_grad: Vec<f32> = Vec::new();
    if pooled {
        local_grad.reserve(table.features.len() * b_total * dim);
        for &(_, col) in &table.features {
            for b in 0..b_total {
                local_grad
                    .extend_from_slice(&grad_out[b * out_stride + col..b * out_stride + col + dim]);
            }
        }
    }
    let grad_src: &[f32] = if pooled { &local_grad } else { grad_out };
    for (k, &(f, _)) in table.features.iter().enumerate() {
        for b in 0..b_total {
            let range = batch.bag(f * b_total + b);
            let inv_len = match pooling {
                PoolingMode::Mean if !range.is_empty() => 1.0 / range.len() as f32,
                _ => 1.0,
            };
            for p in range {
                let w = weights.map_or(1.0, |w| w[p]);
                let grad_offset = if pooled {
                    (k * b_total + b) * dim
                } else {
                    p * dim
                };
                let id = batch.ids.get(p);
                let local = occurrences.len();
                if id < (1 << 32) && local < (1 << 32) {
                    keys.push(((id as u64) << 32) | local as u64);
                } else {
                    wide_keys.push((id, local));
                }
                occurrences.push(Occurrence {
                    pos: p,
                    grad_offset,
                    scale: w * inv_len,
                    dot_scale: inv_len,
                });
            }
        }
    }
    let order: Vec<(usize, usize)> = if wide_keys.is_empty() {
        crate::embedding::tbe::sort::sort_keys_by_row(&mut keys, 32);
        keys.iter()
            .map(|&k| ((k >> 32) as usize, (k & 0xffff_ffff) as usize))
            .collect()
    } else {
        wide_keys.extend(
            keys.iter()
                .map(|&k| ((k >> 32) as usize, (k & 0xffff_ffff) as usize)),
        );
        wide_keys.sort_unstable();
        wide_keys
    };

    let mut psw_grads = Vec::new();
    let sparse = matches!(optimizer, FusedOptimizer::None);
    let mut sparse_rows = Vec::new();
    let mut sparse_values = Vec::new();
    let mut grad = vec![0.0f32; dim];
    let mut start = 0;
    while start < order.len() {
        let id = order[start].0;
        let mut end = start + 1;
        while end < order.len() && order[end].0 == id {
            end += 1;
        }
        // Rows are visited in increasing id order but far apart: fetch a few ahead.
        if let Some(&(ahead, _)) = order.get(end + PREFETCH_GROUPS) {
            prefetch_f32(&table.weights[ahead * dim..(ahead + 1) * dim]);
            for (buf, shape) in [(&*table.m1, shapes[0]), (&*table.m2, shapes[1])] {
                if let Some(shape) = shape {
                    prefetch_f32(&buf[state_row_range(shape, ahead, dim)]);
                }
            }
        }
        let row = &mut table.weights[id * dim..(id + 1) * dim];
        grad.fill(0.0);
        for &(_, local) in &order[start..end] {
            let e = &occurrences[local];
            let g_out = &grad_src[e.grad_offset..e.grad_offset + dim];
            for (g, &x) in grad.iter_mut().zip(g_out) {
                *g += e.scale * x;
            }
            if want_psw {
                psw_grads.push((e.pos, dot(row, g_out) * e.dot_scale));
            }
        }
        if sparse {
            sparse_rows.push(id as i64);
            sparse_values.extend_from_slice(&grad);
        } else {
            let state = RowState {
                m1: state_row(&mut *table.m1, shapes[0], id, dim),
                m2: state_row(&mut *table.m2, shapes[1], id, dim),
            };
            update_row(optimizer, decay, step, row, &mut grad, state);
        }
        start = end;
    }
    let sparse_grad = sparse.then_some(SparseTableGrad {
        rows: sparse_rows,
        values: sparse_values,
        dim,
    });
    (psw_grads, sparse_grad)
}

#[cfg(test)]
mod tests {
    use super::SparseTableGrad;

    #[test]
    fn accumulating_merges_sorted_rows_and_sums_shared_ones() {
        let mut a = SparseTableGrad {
            rows: vec![1, 4, 7],
            values: vec![1.0, 1.0, 4.0, 4.0, 7.0, 7.0],
            dim: 2,
        };
        let b = SparseTableGrad {
            rows: vec![0, 4, 9],
            values: vec![0.5, 0.5, 0.25, -4.0, 9.0, 9.0],
            dim: 2,
        };
        a.accumulate(&b);
        assert_eq!(a.rows, vec![0, 1, 4, 7, 9]);
        assert_eq!(
            a.values,
            vec![0.5, 0.5, 1.0, 1.0, 4.25, 0.0, 7.0, 7.0, 9.0, 9.0]
        );
        let empty = SparseTableGrad {
            rows: vec![],
            values: vec![],
            dim: 2,
        };
        let before = a.clone();
        a.accumulate(&empty);
        assert_eq!(a, before);
    }
}
