//! Exact search: blocked query × base products on the tensor core's matmul, then a bounded
//! selection per query.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};

use rayon::prelude::*;

use super::cuda::{DeviceBase, GpuBlocks, MAX_CHUNK};
use super::select::TopK;
use super::{check_new_ids, check_vectors, Metric, Neighbors};
use crate::tensor::no_grad;
use crate::{Device, Error, Result, Tensor};

/// Queries per product block.
const QUERY_BLOCK: usize = 256;
/// Base vectors per product block.
const BASE_BLOCK: usize = 4096;

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
) -> Result<Vec<TopK>> {
    let nq = queries.len() / dim;
    let nb = base.len() / dim;
    let mut tops: Vec<TopK> = (0..nq).map(|_| TopK::new(k)).collect();
    no_grad(|| -> Result<()> {
        for q0 in (0..nq).step_by(QUERY_BLOCK) {
            let qn = QUERY_BLOCK.min(nq - q0);
            let q = Tensor::from_slice(&queries[q0 * dim..(q0 + qn) * dim], &[qn, dim])?;
            for b0 in (0..nb).step_by(BASE_BLOCK) {
                let bn = BASE_BLOCK.min(nb - b0);
                let b = Tensor::from_slice(&base[b0 * dim..(b0 + bn) * dim], &[bn, dim])?;
                // [qn, bn] = q · bᵀ
                let products = q.linear(&b, None)?.to_vec::<f32>()?;
                tops[q0..q0 + qn]
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
            }
        }
        Ok(())
    })?;
    Ok(tops)
}

/// The nearest row of `base` (squared L2; `norms` its rows' squared norms) to each row of
/// `data`: `(index, ‖x‖² − (2⟨x,b⟩ − ‖b‖²))` per data row. The k = 1 case of [`scan`] without a
/// heap: k-means, PQ encoding and list assignment call it for every vector.
pub(crate) fn nearest(
    data: &[f32],
    base: &[f32],
    dim: usize,
    norms: &[f32],
) -> Result<Vec<(usize, f32)>> {
    let n = data.len() / dim;
    let nb = base.len() / dim;
    let mut best = vec![(0usize, f32::NEG_INFINITY); n];
    no_grad(|| -> Result<()> {
        for q0 in (0..n).step_by(QUERY_BLOCK * 4) {
            let qn = (QUERY_BLOCK * 4).min(n - q0);
            let q = Tensor::from_slice(&data[q0 * dim..(q0 + qn) * dim], &[qn, dim])?;
            for b0 in (0..nb).step_by(BASE_BLOCK) {
                let bn = BASE_BLOCK.min(nb - b0);
                let b = Tensor::from_slice(&base[b0 * dim..(b0 + bn) * dim], &[bn, dim])?;
                let products = q.linear(&b, None)?.to_vec::<f32>()?;
                let norms = &norms[b0..b0 + bn];
                best[q0..q0 + qn]
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
            }
        }
        Ok(())
    })?;
    Ok(best
        .into_iter()
        .zip(data.chunks_exact(dim))
        .map(|((i, score), x)| (i, (x.iter().map(|v| v * v).sum::<f32>() - score).max(0.0)))
        .collect())
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
        )?;
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
