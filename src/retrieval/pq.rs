//! Product quantization: a vector cut into `m` sub-vectors, each stored as the one-byte index
//! of its nearest of 256 sub-centroids (FAISS's `ProductQuantizer` with `nbits = 8`).

use rayon::prelude::*;

use super::flat::DirectBase;
use super::{check_vectors, kmeans, Metric};
use crate::{Error, Result};

/// Sub-centroids per sub-quantizer (8-bit codes).
pub const KSUB: usize = 256;

/// `m` sub-quantizers of `dim / m` dimensions, 256 centroids each.
#[derive(Clone, Debug, PartialEq)]
pub struct ProductQuantizer {
    dim: usize,
    m: usize,
    /// `[m × 256 × dsub]`.
    centroids: Vec<f32>,
    /// Each sub-quantizer's centroids dimension-major, as encoding's direct kernel reads them
    /// and as the distance tables run (across the 256 centroids).
    bases: Vec<DirectBase>,
}

impl ProductQuantizer {
    /// Trains the `m` sub-quantizers on `data` (rows of `dim`; `dim` divisible by `m`, at least
    /// 256 rows) with `iters` k-means rounds each.
    pub fn train(data: &[f32], dim: usize, m: usize, iters: usize, seed: u64) -> Result<Self> {
        let n = check_vectors("ProductQuantizer::train", data, dim)?;
        if m == 0 || dim % m != 0 {
            return Err(Error::invalid(
                "ProductQuantizer::train",
                format!("dimension {dim} is not divisible into m = {m} sub-vectors"),
            ));
        }
        if n < KSUB {
            return Err(Error::invalid(
                "ProductQuantizer::train",
                format!(
                    "256 centroids per sub-quantizer need at least 256 training vectors, got {n}"
                ),
            ));
        }
        let dsub = dim / m;
        let subs: Vec<Vec<f32>> = (0..m)
            .map(|j| sub_vectors(data, dim, j * dsub, dsub))
            .collect();
        let trained: Vec<Result<Vec<f32>>> = subs
            .par_iter()
            .enumerate()
            .map(|(j, sub)| kmeans(sub, dsub, KSUB, iters, seed.wrapping_add(j as u64)))
            .collect();
        let mut centroids = Vec::with_capacity(m * KSUB * dsub);
        for t in trained {
            centroids.extend(t?);
        }
        Ok(ProductQuantizer::new(dim, m, centroids))
    }

    fn new(dim: usize, m: usize, centroids: Vec<f32>) -> Self {
        let dsub = dim / m;
        let bases = centroids
            .chunks_exact(KSUB * dsub)
            .map(|sub| DirectBase::new(sub, dsub))
            .collect();
        ProductQuantizer {
            dim,
            m,
            centroids,
            bases,
        }
    }

    /// A quantizer from stored centroids (`[m × 256 × dim/m]`, finite).
    pub fn from_centroids(dim: usize, m: usize, centroids: Vec<f32>) -> Result<Self> {
        let expected = dim.checked_mul(KSUB);
        if dim == 0 || m == 0 || dim % m != 0 || expected != Some(centroids.len()) {
            return Err(Error::invalid(
                "ProductQuantizer",
                format!(
                    "{} centroid values for dimension {dim} and m = {m} (expected {}, with m \
                     dividing a dimension of at least 1)",
                    centroids.len(),
                    expected.map_or("more than a usize holds".to_string(), |e| e.to_string())
                ),
            ));
        }
        check_vectors("ProductQuantizer", &centroids, dim / m)?;
        Ok(ProductQuantizer::new(dim, m, centroids))
    }

    /// The vectors' dimension.
    pub fn dim(&self) -> usize {
        self.dim
    }

    /// Sub-quantizers (code bytes per vector).
    pub fn m(&self) -> usize {
        self.m
    }

    /// Dimensions per sub-vector.
    pub fn dsub(&self) -> usize {
        self.dim / self.m
    }

    /// The centroids, `[m × 256 × dsub]`.
    pub fn centroids(&self) -> &[f32] {
        &self.centroids
    }

    fn sub_centroids(&self, j: usize) -> &[f32] {
        let size = KSUB * self.dsub();
        &self.centroids[j * size..(j + 1) * size]
    }

    /// The codes of `vectors` (rows of `dim`): `m` bytes per vector, each the nearest (L2)
    /// sub-centroid of that sub-vector.
    pub fn encode(&self, vectors: &[f32]) -> Result<Vec<u8>> {
        let n = check_vectors("ProductQuantizer::encode", vectors, self.dim)?;
        let (dim, dsub, m) = (self.dim, self.dsub(), self.m);
        let mut codes = vec![0u8; n * m];
        // Chunks of rows, every sub-quantizer on each while its rows are in cache; each
        // sub-vector is read in place (stride `dim`), not copied out.
        const ROWS: usize = 256;
        codes
            .par_chunks_mut(ROWS * m)
            .zip(vectors.par_chunks(ROWS * dim))
            .for_each(|(codes, rows)| {
                let mut near = vec![(0usize, 0f32); rows.len() / dim];
                for (j, base) in self.bases.iter().enumerate() {
                    base.nearest_rows(&rows[j * dsub..], dim, &mut near);
                    for (code, &(c, _)) in codes.chunks_exact_mut(m).zip(&near) {
                        code[j] = c as u8;
                    }
                }
            });
        Ok(codes)
    }

    /// The vectors `codes` stand for (each sub-vector its sub-centroid): `codes` holds whole
    /// codes of `m` bytes each.
    pub fn decode(&self, codes: &[u8]) -> Result<Vec<f32>> {
        if codes.len() % self.m != 0 {
            return Err(Error::invalid(
                "ProductQuantizer::decode",
                format!(
                    "{} code bytes are not whole codes of m = {} bytes",
                    codes.len(),
                    self.m
                ),
            ));
        }
        Ok(self.decode_codes(codes))
    }

    /// [`decode`](Self::decode) of whole codes.
    pub(crate) fn decode_codes(&self, codes: &[u8]) -> Vec<f32> {
        let dsub = self.dsub();
        let mut out = Vec::with_capacity(codes.len() / self.m * self.dim);
        for code in codes.chunks_exact(self.m) {
            for (j, &c) in code.iter().enumerate() {
                let at = c as usize * dsub;
                out.extend_from_slice(&self.sub_centroids(j)[at..at + dsub]);
            }
        }
        out
    }

    /// The distance table of one query (`dim` values): `[m × 256]`, entry `(j, c)` the inner
    /// product (or squared L2 distance) of sub-vector `j` with sub-centroid `c`; a code's
    /// score is the sum of its `m` entries.
    pub fn table(&self, query: &[f32], metric: Metric) -> Result<Vec<f32>> {
        if query.len() != self.dim {
            return Err(Error::invalid(
                "ProductQuantizer::table",
                format!(
                    "the query has {} values, the quantizer's vectors {}",
                    query.len(),
                    self.dim
                ),
            ));
        }
        Ok(self.table_of(query, metric))
    }

    /// [`table`](Self::table) of a query of `dim` values.
    pub(crate) fn table_of(&self, query: &[f32], metric: Metric) -> Vec<f32> {
        let dsub = self.dsub();
        let mut table = vec![0f32; self.m * KSUB];
        // Entry by entry the same sums as Σ_d over the sub-vector, in the same order; laid out
        // so the loop runs across the 256 centroids.
        for (j, out) in table.chunks_exact_mut(KSUB).enumerate() {
            let q = &query[j * dsub..(j + 1) * dsub];
            for (d, &qd) in q.iter().enumerate() {
                // 256 centroids are a whole number of the kernel's blocks: no padding.
                let col = self.bases[j].column(d);
                match metric {
                    Metric::InnerProduct => {
                        for (o, &c) in out.iter_mut().zip(col) {
                            *o += qd * c;
                        }
                    }
                    Metric::L2 => {
                        for (o, &c) in out.iter_mut().zip(col) {
                            let t = qd - c;
                            *o += t * t;
                        }
                    }
                }
            }
        }
        table
    }
}

/// Columns `start..start+width` of every row of `data` (rows of `dim`).
fn sub_vectors(data: &[f32], dim: usize, start: usize, width: usize) -> Vec<f32> {
    data.chunks_exact(dim)
        .flat_map(|row| row[start..start + width].iter().copied())
        .collect()
}
