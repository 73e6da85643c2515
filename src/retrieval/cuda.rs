//! Exact search on a CUDA device: the stored vectors, their ids and squared norms live in device
//! memory; a block of queries is multiplied with a chunk of them on cuBLAS (the tensor core's
//! `linear`), and `kernels/topk.cu` selects each query's `k` best of the chunk (radix
//! selection, ties to the smaller id, as on the CPU). With several chunks the per-chunk bests
//! are merged by the same kernel. Only the `k` results per query come back to the host.

use std::sync::Arc;

use crate::args;
use crate::cuda::{CudaDevice, DeviceBuffer, LaunchConfig};
use crate::tensor::no_grad;
use crate::{Device, Error, Result, Tensor};

crate::kernel_source!(
    /// Row-wise top-k selection (exact search's selection on the GPU).
    pub(crate) static TOPK = "topk.cu",
    ["topk_rows_f32"];
);

/// The largest `k` the selection kernel keeps per query (`TOPK_MAX` in `kernels/topk.cu`).
pub const MAX_K: usize = 1024;
/// The most vectors per chunk: the kernel numbers a chunk's columns in 32 bits.
pub(crate) const MAX_CHUNK: usize = 1 << 30;
/// Threads per row (`TOPK_THREADS`).
const THREADS: u32 = 256;
/// How the GPU search splits its work: queries per product block and stored vectors per chunk
/// (each block × chunk product is one `[queries, chunk]` f32 matrix in device memory).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GpuBlocks {
    /// Queries multiplied at once.
    pub queries: usize,
    /// Stored vectors per chunk (at least `k` are taken).
    pub chunk: usize,
}

impl Default for GpuBlocks {
    /// 1024 queries × 65,536 vectors: a 256 MiB product block (the fastest of those measured
    /// on an H200, `benches/cuda_flat.rs`).
    fn default() -> Self {
        GpuBlocks {
            queries: 1024,
            chunk: 1 << 16,
        }
    }
}

/// A [`super::FlatIndex`]'s vectors in device memory.
pub(crate) struct DeviceBase {
    device: Device,
    cuda: Arc<CudaDevice>,
    /// `[n, dim]`.
    base: Tensor,
    norms: DeviceBuffer<f32>,
    ids: DeviceBuffer<i64>,
}

impl std::fmt::Debug for DeviceBase {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DeviceBase({}, {:?})", self.device, self.base.shape())
    }
}

impl DeviceBase {
    /// Copies `vectors` (rows of `dim`, at least one), their squared `norms` and `ids` to
    /// `device` (a CUDA device).
    pub(crate) fn upload(
        device: Device,
        vectors: &[f32],
        dim: usize,
        norms: &[f32],
        ids: &[i64],
    ) -> Result<Self> {
        let cuda = crate::cuda::open(device)?;
        let n = ids.len();
        let base = Tensor::from_slice(vectors, &[n, dim])?.to_device(device)?;
        Ok(DeviceBase {
            device,
            norms: cuda.htod(norms)?,
            ids: cuda.htod(ids)?,
            cuda,
            base,
        })
    }

    /// The `k` best stored vectors of each query as rows of `(score, id)`, best first, with
    /// scores to maximise (inner product, or `2⟨q,b⟩ − ‖b‖²` for L2).
    pub(crate) fn search(
        &self,
        queries: &[f32],
        dim: usize,
        l2: bool,
        k: usize,
        blocks: GpuBlocks,
    ) -> Result<Vec<Vec<(f32, i64)>>> {
        if k > MAX_K {
            return Err(Error::invalid(
                "FlatIndex::search",
                format!(
                    "k = {k} on {}: the GPU selection keeps at most {MAX_K}",
                    self.device
                ),
            ));
        }
        let n = self.base.shape()[0];
        let nq = queries.len() / dim;
        // Both at least 1 and the chunk at most MAX_CHUNK (FlatIndex::set_gpu_blocks checks).
        let chunk = blocks.chunk.max(k).min(n);
        let query_block = blocks.queries;
        let chunks = n.div_ceil(chunk);
        let bias = l2.then_some(&self.norms);
        let (alpha, kk) = (if l2 { 2.0f32 } else { 1.0f32 }, k as i32);
        let mut rows = Vec::with_capacity(nq);
        no_grad(|| -> Result<()> {
            for q0 in (0..nq).step_by(query_block) {
                let qn = query_block.min(nq - q0);
                let q = Tensor::from_slice(&queries[q0 * dim..(q0 + qn) * dim], &[qn, dim])?
                    .to_device(self.device)?;
                let grid = LaunchConfig::blocks(qn, THREADS);
                let width = chunks * k;
                let mut cand_scores = self.cuda.alloc::<f32>(qn * width)?;
                let mut cand_ids = self.cuda.alloc::<i64>(qn * width)?;
                for c in 0..chunks {
                    let (b0, bn) = (c * chunk, chunk.min(n - c * chunk));
                    // [qn, bn] contiguous: row stride bn.
                    let products = q.linear(&self.base.narrow(0, b0, bn)?, None)?;
                    // Row r's chunk-c best go to columns c·k .. (c+1)·k of the candidates.
                    self.cuda.launch(
                        TOPK.kernel("topk_rows_f32"),
                        grid,
                        &args![
                            products,
                            bn as i64,
                            bn as i64,
                            bias,
                            alpha,
                            Some(&self.ids),
                            0i64,
                            b0 as i64,
                            kk,
                            cand_scores,
                            cand_ids,
                            width as i64,
                            (c * k) as i64
                        ],
                    )?;
                }
                if chunks > 1 {
                    let mut best_scores = self.cuda.alloc::<f32>(qn * k)?;
                    let mut best_ids = self.cuda.alloc::<i64>(qn * k)?;
                    // The candidates' own ids, row r's at r·width.
                    self.cuda.launch(
                        TOPK.kernel("topk_rows_f32"),
                        grid,
                        &args![
                            cand_scores,
                            width as i64,
                            width as i64,
                            None::<&DeviceBuffer<f32>>,
                            1.0f32,
                            Some(&cand_ids),
                            width as i64,
                            0i64,
                            kk,
                            best_scores,
                            best_ids,
                            k as i64,
                            0i64
                        ],
                    )?;
                    std::mem::swap(&mut cand_scores, &mut best_scores);
                    std::mem::swap(&mut cand_ids, &mut best_ids);
                }
                let (scores, ids) = (cand_scores.to_host()?, cand_ids.to_host()?);
                rows.extend(
                    scores
                        .chunks_exact(k)
                        .zip(ids.chunks_exact(k))
                        .map(|(s, i)| s.iter().copied().zip(i.iter().copied()).collect()),
                );
            }
            Ok(())
        })?;
        Ok(rows)
    }
}
