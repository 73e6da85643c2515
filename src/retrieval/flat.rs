//! Exact search: blocked query × base products on the tensor core's matmul, then a bounded
//! selection per query.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};

use rayon::prelude::*;

use super::cuda::{DeviceBase, GpuBlocks, MAX_CHUNK};
use super::select::TopK;
use super::{check_new_ids, check_vectors, Metric, Neighbors};
use crate::tensor::backend::cpu::linear_into;
use crate::{Device, Error, Result};

/// Queries per product block.
const QUERY_BLOCK: usize = 256;
/// Base vectors per product block.
const BASE_BLOCK: usize = 4096;

/// `queries · baseᵀ` (rows of `dim`) in blocks of `block` queries by [`BASE_BLOCK`] base rows,
/// each product block (`[qn × bn]`, row-major) handed to `f(q0, b0, bn, products)`: one
/// products buffer serves every block (fresh multi-megabyte buffers page-fault each time).
fn product_blocks(
    queries: &[f32],
    base: &[f32],
    dim: usize,
    block: usize,
    mut f: impl FnMut(usize, usize, usize, &[f32]),
) {
    let nq = queries.len() / dim;
    let nb = base.len() / dim;
    let mut buffer = vec![0f32; block.min(nq) * BASE_BLOCK.min(nb)];
    for q0 in (0..nq).step_by(block) {
        let qn = block.min(nq - q0);
        let q = &queries[q0 * dim..(q0 + qn) * dim];
        for b0 in (0..nb).step_by(BASE_BLOCK) {
            let bn = BASE_BLOCK.min(nb - b0);
            let products = &mut buffer[..qn * bn];
            linear_into(q, &base[b0 * dim..(b0 + bn) * dim], qn, bn, dim, products);
            f(q0, b0, bn, products);
        }
    }
}

/// The `k` best of `base` (rows of `dim`) for every query, as per-query [`TopK`]s of scores to
/// maximise: the inner product, or for L2 `2⟨q,b⟩ − ‖b‖²` (the distance is `‖q‖²` minus it).
/// `norms` are the base rows' squared norms (L2 only); `ids` name the rows (their index when
/// `None`).
pub(crate) fn scan(
    queries: &[f32],
    base: &[f32],
    dim: usize,
    norms: Option<&[f32]>,
    ids: Option<&[i64]>,
    metric: Metric,
    k: usize,
) -> Vec<TopK> {
    let nq = queries.len() / dim;
    let mut tops: Vec<TopK> = (0..nq).map(|_| TopK::new(k)).collect();
    product_blocks(queries, base, dim, QUERY_BLOCK, |q0, b0, bn, products| {
        tops[q0..q0 + products.len() / bn]
            .par_iter_mut()
            .zip(products.par_chunks(bn))
            .for_each(|(top, row)| {
                for (j, &p) in row.iter().enumerate() {
                    let score = match (metric, norms) {
                        (Metric::L2, Some(n)) => 2.0 * p - n[b0 + j],
                        _ => p,
                    };
                    if score >= top.threshold() {
                        let id = ids.map_or((b0 + j) as i64, |ids| ids[b0 + j]);
                        top.push(score, id);
                    }
                }
            });
    });
    tops
}

/// The nearest row of `base` (squared L2; `norms` its rows' squared norms) to each row of
/// `data`: `(index, ‖x‖² − (2⟨x,b⟩ − ‖b‖²))` per data row. The k = 1 case of [`scan`] without a
/// heap: k-means, PQ encoding and list assignment call it for every vector. Rows of at most
/// [`DIRECT_MAX_DIM`] columns (PQ sub-vectors) skip the matmul: their scores are summed in
/// registers and never stored.
pub(crate) fn nearest(data: &[f32], base: &[f32], dim: usize, norms: &[f32]) -> Vec<(usize, f32)> {
    if dim <= DIRECT_MAX_DIM {
        return nearest_direct(data, base, dim);
    }
    let mut best = vec![(0usize, f32::NEG_INFINITY); data.len() / dim];
    product_blocks(data, base, dim, QUERY_BLOCK * 4, |q0, b0, bn, products| {
        let norms = &norms[b0..b0 + bn];
        best[q0..q0 + products.len() / bn]
            .par_iter_mut()
            .zip(products.par_chunks(bn))
            .for_each(|(best, row)| {
                for (j, (&p, &nb)) in row.iter().zip(norms).enumerate() {
                    let score = 2.0 * p - nb;
                    if score > best.1 {
                        *best = (b0 + j, score);
                    }
                }
            });
    });
    best.into_iter()
        .zip(data.chunks_exact(dim))
        .map(|((i, score), x)| (i, (x.iter().map(|v| v * v).sum::<f32>() - score).max(0.0)))
        .collect()
}

/// The widest rows [`nearest`] scores directly instead of through a matmul:
/// PQ sub-vectors, whose few columns make a matmul mostly the writing and rereading of its
/// products.
const DIRECT_MAX_DIM: usize = 16;

/// Centroids per register block of the direct kernel (two AVX2 registers; the AVX2 kernel's
/// row arithmetic shifts by 4 for it).
const LANES: usize = 16;
const _: () = assert!(LANES == 16);

/// One direct-kernel call: `out.len()` rows of `dim` values, row `r` at `data[r · stride..]`,
/// against the `nb` rows of `base` stored dimension-major (`by_dim`, `[dim × nb]`) with their
/// squared norms halved and negated (`neg_half_norms`); `nb` is a multiple of [`LANES`], the
/// padding rows zero with a norm of −∞, so they never win.
struct Direct<'a> {
    data: &'a [f32],
    stride: usize,
    by_dim: &'a [f32],
    neg_half_norms: &'a [f32],
    nb: usize,
    dim: usize,
    out: &'a mut [(usize, f32)],
}

/// The direct kernel with the dimension fixed at compile time where it is a common PQ width
/// (`$rows::<0>` takes it at run time).
macro_rules! by_width {
    ($rows:ident, $a:expr) => {
        match $a.dim {
            1 => $rows::<1>($a),
            2 => $rows::<2>($a),
            4 => $rows::<4>($a),
            8 => $rows::<8>($a),
            16 => $rows::<16>($a),
            _ => $rows::<0>($a),
        }
    };
}

#[inline(always)]
fn direct_portable(a: Direct<'_>) {
    by_width!(direct_rows, a)
}

#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn direct_avx2(a: Direct<'_>) {
    by_width!(direct_rows_avx2, a)
}

/// [`direct_rows`] in AVX2 intrinsics, two rows at a time (they share every load of the base
/// rows): the same fused multiply-adds in the same order, so the same results.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn direct_rows_avx2<const D: usize>(a: Direct<'_>) {
    use std::arch::x86_64::*;
    let dim = if D == 0 { a.dim } else { D };
    let nb = a.nb;
    assert!(nb % LANES == 0 && a.neg_half_norms.len() == nb && a.by_dim.len() == dim * nb);
    let Direct {
        data,
        stride,
        by_dim,
        neg_half_norms,
        out: outs,
        ..
    } = a;
    let rows = outs.len();
    for (p, out) in outs.chunks_exact_mut(2).enumerate() {
        let (x0, x1) = (
            &data[2 * p * stride..][..dim],
            &data[(2 * p + 1) * stride..][..dim],
        );
        // SAFETY: AVX2 and FMA were detected before this runs (multiversion!); block b reads
        // neg_half_norms[16b..16b+16] and by_dim[d·nb + 16b..][..16] for d < dim, inside the
        // lengths asserted above since 16b + 16 ≤ nb.
        unsafe {
            let lo = _mm256_set1_ps(f32::NEG_INFINITY);
            let mut best = [[lo; 2]; 2];
            let mut at = [[_mm256_setzero_si256(); 2]; 2];
            for b in 0..nb / LANES {
                let h = neg_half_norms.as_ptr().add(b * LANES);
                let h = [_mm256_loadu_ps(h), _mm256_loadu_ps(h.add(8))];
                let mut acc = [h, h];
                for d in 0..dim {
                    let col = by_dim.as_ptr().add(d * nb + b * LANES);
                    let c = [_mm256_loadu_ps(col), _mm256_loadu_ps(col.add(8))];
                    for (acc, x) in acc.iter_mut().zip([x0, x1]) {
                        let xd = _mm256_set1_ps(*x.get_unchecked(d));
                        acc[0] = _mm256_fmadd_ps(xd, c[0], acc[0]);
                        acc[1] = _mm256_fmadd_ps(xd, c[1], acc[1]);
                    }
                }
                let here = _mm256_set1_epi32(b as i32);
                for r in 0..2 {
                    for h in 0..2 {
                        let better = _mm256_cmp_ps::<_CMP_GT_OQ>(acc[r][h], best[r][h]);
                        best[r][h] = _mm256_blendv_ps(best[r][h], acc[r][h], better);
                        at[r][h] = _mm256_blendv_epi8(at[r][h], here, _mm256_castps_si256(better));
                    }
                }
            }
            let iota = [
                _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
                _mm256_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15),
            ];
            for (r, x) in [x0, x1].into_iter().enumerate() {
                // The best score over the 16 lanes, then the smallest row among the lanes
                // holding it (row = block · 16 + lane): ties to the first row.
                let top = _mm256_max_ps(best[r][0], best[r][1]);
                let top = _mm256_max_ps(top, _mm256_permute2f128_ps::<1>(top, top));
                let top = _mm256_max_ps(top, _mm256_shuffle_ps::<0b01_00_11_10>(top, top));
                let top = _mm256_max_ps(top, _mm256_shuffle_ps::<0b10_11_00_01>(top, top));
                let none = _mm256_set1_epi32(i32::MAX);
                let mut rows = none;
                for h in 0..2 {
                    let row = _mm256_add_epi32(_mm256_slli_epi32::<4>(at[r][h]), iota[h]);
                    let holds = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_EQ_OQ>(best[r][h], top));
                    rows = _mm256_min_epi32(rows, _mm256_blendv_epi8(none, row, holds));
                }
                let rows = _mm256_min_epi32(rows, _mm256_permute2x128_si256::<1>(rows, rows));
                let rows = _mm256_min_epi32(rows, _mm256_shuffle_epi32::<0b01_00_11_10>(rows));
                let rows = _mm256_min_epi32(rows, _mm256_shuffle_epi32::<0b10_11_00_01>(rows));
                let row = _mm256_cvtsi256_si32(rows) as usize;
                let score = _mm256_cvtss_f32(top);
                let norm: f32 = x.iter().map(|v| v * v).sum();
                out[r] = (row, (norm - 2.0 * score).max(0.0));
            }
        }
    }
    if rows % 2 == 1 {
        direct_rows::<D>(Direct {
            data: &data[(rows - 1) * stride..],
            stride,
            by_dim,
            neg_half_norms,
            nb,
            dim,
            out: &mut outs[rows - 1..],
        });
    }
}

/// The winner of the lanes' bests (ties to the first row) as `(row, squared distance)`.
#[inline(always)]
fn reduce_lanes(x: &[f32], best: &[f32; LANES], at: &[u32; LANES]) -> (usize, f32) {
    let mut win = 0;
    for i in 1..LANES {
        if best[i] > best[win] || (best[i] == best[win] && at[i] < at[win]) {
            win = i;
        }
    }
    let norm: f32 = x.iter().map(|v| v * v).sum();
    (at[win] as usize, (norm - 2.0 * best[win]).max(0.0))
}

/// For each row `x`, the base row maximising `⟨x, b⟩ − ‖b‖²/2` (the nearest), 16 base rows at a
/// time: their scores are fused multiply-adds over the columns, in column order, kept in
/// registers, and each lane keeps its best and where it was. Ties go to the first row, as in
/// [`nearest`]'s matmul path. `D` is the dimension, or 0 for `a.dim` at run time.
#[inline(always)]
fn direct_rows<const D: usize>(a: Direct<'_>) {
    let dim = if D == 0 { a.dim } else { D };
    let nb = a.nb;
    for (r, out) in a.out.iter_mut().enumerate() {
        let x = &a.data[r * a.stride..][..dim];
        let mut best = [f32::NEG_INFINITY; LANES];
        let mut at = [0u32; LANES];
        for (b, neg_half) in a.neg_half_norms.chunks_exact(LANES).enumerate() {
            let mut acc: [f32; LANES] = neg_half.try_into().expect("LANES values");
            for (d, &xd) in x.iter().enumerate().take(dim) {
                let col: &[f32; LANES] = a.by_dim[d * nb + b * LANES..][..LANES]
                    .try_into()
                    .expect("LANES values");
                for (s, &c) in acc.iter_mut().zip(col) {
                    *s = xd.mul_add(c, *s);
                }
            }
            let base = (b * LANES) as u32;
            for (i, ((best, at), &s)) in best.iter_mut().zip(&mut at).zip(&acc).enumerate() {
                let better = s > *best;
                *best = if better { s } else { *best };
                *at = if better { base + i as u32 } else { *at };
            }
        }
        *out = reduce_lanes(x, &best, &at);
    }
}

#[cfg(target_arch = "x86_64")]
crate::multiversion!(
    fn direct_block(args: Direct<'_>) => avx2: direct_avx2, portable: direct_portable
);
#[cfg(not(target_arch = "x86_64"))]
fn direct_block(args: Direct<'_>) {
    direct_portable(args)
}

/// `rows` (of `dim` values) dimension-major: value `d` of row `i` at `d · padded + i`, with
/// `padded ≥` the row count (the padding zero).
pub(crate) fn dimension_major(rows: &[f32], dim: usize, padded: usize) -> Vec<f32> {
    let mut out = vec![0f32; dim * padded];
    for (i, row) in rows.chunks_exact(dim).enumerate() {
        for (d, &v) in row.iter().enumerate() {
            out[d * padded + i] = v;
        }
    }
    out
}

/// A base (rows of at most [`DIRECT_MAX_DIM`] columns) as the direct kernel reads it:
/// dimension-major, padded to a multiple of [`LANES`] rows, with its rows' negated half squared
/// norms. A product quantizer keeps one per sub-quantizer.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct DirectBase {
    by_dim: Vec<f32>,
    neg_half_norms: Vec<f32>,
    nb: usize,
    dim: usize,
}

impl DirectBase {
    /// `base`'s rows of `dim` values.
    pub(crate) fn new(base: &[f32], dim: usize) -> Self {
        let nb = (base.len() / dim).div_ceil(LANES) * LANES;
        let by_dim = dimension_major(base, dim, nb);
        let mut neg_half_norms = vec![f32::NEG_INFINITY; nb];
        for (h, row) in neg_half_norms.iter_mut().zip(base.chunks_exact(dim)) {
            *h = -0.5 * row.iter().map(|v| v * v).sum::<f32>();
        }
        DirectBase {
            by_dim,
            neg_half_norms,
            nb,
            dim,
        }
    }

    /// Value `d` of every base row (padding included): `nb` values.
    pub(crate) fn column(&self, d: usize) -> &[f32] {
        &self.by_dim[d * self.nb..(d + 1) * self.nb]
    }

    /// The nearest base row of each of `out.len()` rows, row `r` being
    /// `data[r · stride..][..dim]`, as `(index, squared distance)` (on this thread).
    pub(crate) fn nearest_rows(&self, data: &[f32], stride: usize, out: &mut [(usize, f32)]) {
        direct_block(Direct {
            data,
            stride,
            by_dim: &self.by_dim,
            neg_half_norms: &self.neg_half_norms,
            nb: self.nb,
            dim: self.dim,
            out,
        })
    }
}

/// [`nearest`] for rows of at most [`DIRECT_MAX_DIM`] columns.
fn nearest_direct(data: &[f32], base: &[f32], dim: usize) -> Vec<(usize, f32)> {
    let base = DirectBase::new(base, dim);
    let mut out = vec![(0usize, 0f32); data.len() / dim];
    const ROWS: usize = 256;
    out.par_chunks_mut(ROWS)
        .zip(data.par_chunks(ROWS * dim))
        .for_each(|(out, data)| base.nearest_rows(data, dim, out));
    out
}

/// Squared norms of the rows of `vectors`.
pub(crate) fn squared_norms(vectors: &[f32], dim: usize) -> Vec<f32> {
    vectors
        .chunks_exact(dim)
        .map(|v| v.iter().map(|x| x * x).sum())
        .collect()
}

/// Turns per-query rows of `k` maximised `(score, id)`s, best first, into [`Neighbors`] in the
/// metric's own units.
pub(crate) fn to_neighbors(
    rows: impl ExactSizeIterator<Item = Vec<(f32, i64)>>,
    queries: &[f32],
    dim: usize,
    metric: Metric,
    k: usize,
) -> Neighbors {
    let mut ids = Vec::with_capacity(rows.len() * k);
    let mut scores = Vec::with_capacity(rows.len() * k);
    for (q, row) in rows.enumerate() {
        let qnorm: f32 = queries[q * dim..(q + 1) * dim].iter().map(|x| x * x).sum();
        for (score, id) in row {
            ids.push(id);
            scores.push(match metric {
                Metric::InnerProduct => score,
                // Clamped at 0: rounding can take ‖q‖² − (2⟨q,b⟩ − ‖b‖²) just below it.
                Metric::L2 if id >= 0 => (qnorm - score).max(0.0),
                Metric::L2 => f32::INFINITY,
            });
        }
    }
    Neighbors { k, ids, scores }
}

/// Exact nearest-neighbour search: every query against every stored vector (FAISS's
/// `IndexFlatIP` / `IndexFlatL2`, with ids), on the CPU or, after
/// [`to_device`](Self::to_device), on a CUDA GPU (products on cuBLAS, selection by
/// `kernels/topk.cu`, `k` up to [`MAX_GPU_K`](crate::retrieval::MAX_GPU_K)).
#[derive(Debug)]
pub struct FlatIndex {
    dim: usize,
    metric: Metric,
    vectors: Vec<f32>,
    ids: Vec<i64>,
    norms: Vec<f32>,
    present: HashSet<i64>,
    device: Device,
    gpu_blocks: GpuBlocks,
    /// The vectors in device memory (CUDA devices): copied at the first search after a change.
    on_device: Mutex<Option<Arc<DeviceBase>>>,
}

impl Clone for FlatIndex {
    fn clone(&self) -> Self {
        FlatIndex {
            dim: self.dim,
            metric: self.metric,
            vectors: self.vectors.clone(),
            ids: self.ids.clone(),
            norms: self.norms.clone(),
            present: self.present.clone(),
            device: self.device,
            gpu_blocks: self.gpu_blocks,
            on_device: Mutex::new(self.device_copy_if_current()),
        }
    }
}

impl FlatIndex {
    /// An empty index of `dim`-dimensional vectors.
    pub fn new(dim: usize, metric: Metric) -> Result<Self> {
        if dim == 0 {
            return Err(Error::invalid(
                "FlatIndex",
                "the dimension must be at least 1",
            ));
        }
        Ok(FlatIndex {
            dim,
            metric,
            vectors: Vec::new(),
            ids: Vec::new(),
            norms: Vec::new(),
            present: HashSet::new(),
            device: Device::Cpu,
            gpu_blocks: GpuBlocks::default(),
            on_device: Mutex::new(None),
        })
    }

    /// The index searching on `device`: the CPU, or a CUDA GPU (opened here; an error says why
    /// it cannot be used). The vectors stay on the host too (for `remove` and copies); the
    /// device holds a copy, refreshed at the first search after an `add` or `remove`.
    pub fn to_device(mut self, device: Device) -> Result<Self> {
        if device.is_cuda() {
            crate::cuda::open(device)?;
        }
        self.device = device;
        *self.on_device.get_mut().unwrap_or_else(|e| e.into_inner()) = None;
        Ok(self)
    }

    /// Where searches run.
    pub fn device(&self) -> Device {
        self.device
    }

    /// Sets how a GPU search splits its work (memory per product block against launches):
    /// at least one query per block, and 1 to 2^30 vectors per chunk (the kernel numbers a
    /// chunk's columns in 32 bits); anything else is refused.
    pub fn set_gpu_blocks(&mut self, blocks: GpuBlocks) -> Result<()> {
        if blocks.queries == 0 || blocks.chunk == 0 || blocks.chunk > MAX_CHUNK {
            return Err(Error::invalid(
                "FlatIndex::set_gpu_blocks",
                format!(
                    "{} queries per block and {} vectors per chunk: each must be at least 1, \
                     the chunk at most {MAX_CHUNK}",
                    blocks.queries, blocks.chunk
                ),
            ));
        }
        self.gpu_blocks = blocks;
        Ok(())
    }

    /// The device copy, if one is current.
    fn device_copy_if_current(&self) -> Option<Arc<DeviceBase>> {
        self.on_device
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// The device copy of the vectors, made now if none is current (the index is not empty).
    fn device_copy(&self) -> Result<Arc<DeviceBase>> {
        let mut slot = self.on_device.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(copy) = &*slot {
            return Ok(copy.clone());
        }
        let copy = Arc::new(DeviceBase::upload(
            self.device,
            &self.vectors,
            self.dim,
            &self.norms,
            &self.ids,
        )?);
        *slot = Some(copy.clone());
        Ok(copy)
    }

    /// Forgets the device copy (the vectors changed).
    fn invalidate(&mut self) {
        *self.on_device.get_mut().unwrap_or_else(|e| e.into_inner()) = None;
    }

    /// The vectors' dimension.
    pub fn dim(&self) -> usize {
        self.dim
    }

    /// Vectors stored.
    pub fn len(&self) -> usize {
        self.ids.len()
    }

    /// Whether no vector is stored.
    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }

    /// Adds `vectors` (rows of `dim`) under `ids` (unique, non-negative, new).
    pub fn add(&mut self, ids: &[i64], vectors: &[f32]) -> Result<()> {
        let n = check_vectors("FlatIndex::add", vectors, self.dim)?;
        check_new_ids("FlatIndex::add", ids, n, |id| self.present.contains(&id))?;
        self.vectors.extend_from_slice(vectors);
        self.norms.extend(squared_norms(vectors, self.dim));
        self.ids.extend_from_slice(ids);
        self.present.extend(ids.iter().copied());
        self.invalidate();
        Ok(())
    }

    /// Removes the vectors with these ids (ids not stored are ignored); returns how many went.
    pub fn remove(&mut self, ids: &[i64]) -> usize {
        let gone: HashSet<i64> = ids
            .iter()
            .copied()
            .filter(|id| self.present.contains(id))
            .collect();
        if gone.is_empty() {
            return 0;
        }
        let dim = self.dim;
        let mut keep = 0;
        for i in 0..self.ids.len() {
            if !gone.contains(&self.ids[i]) {
                self.ids[keep] = self.ids[i];
                self.norms[keep] = self.norms[i];
                self.vectors.copy_within(i * dim..(i + 1) * dim, keep * dim);
                keep += 1;
            }
        }
        self.ids.truncate(keep);
        self.norms.truncate(keep);
        self.vectors.truncate(keep * dim);
        self.present.retain(|id| !gone.contains(id));
        self.invalidate();
        gone.len()
    }

    /// The `k` nearest stored vectors of each query (rows of `dim`), best first.
    pub fn search(&self, queries: &[f32], k: usize) -> Result<Neighbors> {
        check_vectors("FlatIndex::search", queries, self.dim)?;
        check_k("FlatIndex::search", k, self.len())?;
        if self.device.is_cuda() {
            let l2 = self.metric == Metric::L2;
            let rows = self
                .device_copy()?
                .search(queries, self.dim, l2, k, self.gpu_blocks)?;
            return Ok(to_neighbors(
                rows.into_iter(),
                queries,
                self.dim,
                self.metric,
                k,
            ));
        }
        let norms = (self.metric == Metric::L2).then_some(&self.norms[..]);
        let tops = scan(
            queries,
            &self.vectors,
            self.dim,
            norms,
            Some(&self.ids),
            self.metric,
            k,
        );
        Ok(to_neighbors(
            tops.into_iter().map(TopK::into_sorted),
            queries,
            self.dim,
            self.metric,
            k,
        ))
    }
}

/// `k` must be at least 1 and at most the vectors stored.
pub(crate) fn check_k(what: &'static str, k: usize, stored: usize) -> Result<()> {
    if stored == 0 {
        return Err(Error::invalid(what, "the index is empty"));
    }
    if k == 0 || k > stored {
        return Err(Error::invalid(
            what,
            format!("k = {k}, but the index holds {stored} vectors (k must be 1..={stored})"),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    /// The direct kernel at every width up to the limit (the compiled-in widths and the run-time
    /// one), with base counts that need padding: the AVX2 and portable versions return the same
    /// rows and distances bit for bit, and each row is an f64 nearest (ties to the first).
    #[test]
    fn direct_kernels_agree_with_each_other_and_an_f64_argmin() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(3);
        for dim in 1..=DIRECT_MAX_DIM {
            for nb in [1, 5, 16, 37, 256] {
                let data: Vec<f32> = (0..301 * dim)
                    .map(|_| rng.random_range(-4..=4) as f32 * 0.5)
                    .collect();
                let base: Vec<f32> = (0..nb * dim)
                    .map(|_| rng.random_range(-4..=4) as f32 * 0.5)
                    .collect();
                let direct = DirectBase::new(&base, dim);
                let run = |kernel: fn(Direct<'_>)| {
                    let mut out = vec![(usize::MAX, f32::NAN); 301];
                    kernel(Direct {
                        data: &data,
                        stride: dim,
                        by_dim: &direct.by_dim,
                        neg_half_norms: &direct.neg_half_norms,
                        nb: direct.nb,
                        dim,
                        out: &mut out,
                    });
                    out
                };
                let portable = run(direct_portable);
                #[cfg(target_arch = "x86_64")]
                if crate::simd::has_avx2() {
                    // `direct_block` picks the AVX2 kernel on this CPU.
                    let avx2 = run(direct_block);
                    for (a, p) in avx2.iter().zip(&portable) {
                        assert_eq!((a.0, a.1.to_bits()), (p.0, p.1.to_bits()), "dim {dim}");
                    }
                }
                assert_eq!(nearest_direct(&data, &base, dim), portable);
                // Rows read with a stride (inside wider rows, as PQ encoding reads them).
                let wide: Vec<f32> = data
                    .chunks_exact(dim)
                    .flat_map(|x| [&[9.0][..], x, &[7.0, 7.0][..]].concat())
                    .collect();
                let mut strided = vec![(usize::MAX, f32::NAN); 301];
                direct.nearest_rows(&wide[1..], dim + 3, &mut strided);
                assert_eq!(strided, portable);
                for (x, &(at, dist)) in data.chunks_exact(dim).zip(&portable) {
                    let d64: Vec<f64> = base
                        .chunks_exact(dim)
                        .map(|b| {
                            x.iter()
                                .zip(b)
                                .map(|(x, b)| (f64::from(*x) - f64::from(*b)).powi(2))
                                .sum()
                        })
                        .collect();
                    let best = d64.iter().copied().fold(f64::INFINITY, f64::min);
                    // Half-integer inputs: every product and sum is exact, so the kernel's
                    // winner is the first exact minimum and its distance is exact.
                    let first = d64.iter().position(|&d| d == best).unwrap();
                    assert_eq!((at, f64::from(dist)), (first, best), "dim {dim} nb {nb}");
                }
            }
        }
    }
}
