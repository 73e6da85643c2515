//! Retrieval: nearest-neighbour search over item embeddings, the first stage of a two-stage
//! recommender (retrieve a few hundred candidates out of millions, then rank them).
//!
//! - [`FlatIndex`]: exact search, every query against every vector — blocked products on the
//!   tensor core's matmul, then a bounded selection per query (on the CPU, or on a CUDA GPU
//!   with `kernels/topk.cu`);
//! - [`IvfPqIndex`]: FAISS's IVF-PQ — a k-means coarse quantizer ([`kmeans`]) splits the
//!   vectors into `nlist` inverted lists, each vector's residual from its list centroid is
//!   stored as `m` one-byte codes of a [`ProductQuantizer`], and a query scans only its
//!   `nprobe` nearest lists with per-query distance tables (asymmetric distances);
//!
//! both for inner product (larger is closer) and squared L2 (smaller is closer), with batched
//! queries, items added and removed without retraining, and atomic save/load (IVF-PQ).
//! Results come as [`Neighbors`]: `k` ids and scores per query, best first.

pub(crate) mod cuda;
mod flat;
mod ivfpq;
mod kmeans;
mod pq;
mod select;

pub use cuda::{GpuBlocks, MAX_K as MAX_GPU_K};
pub use flat::FlatIndex;
pub use ivfpq::{IvfPqConfig, IvfPqIndex};
pub use kmeans::kmeans;
pub use pq::{ProductQuantizer, KSUB};

use crate::{Error, Result};

/// Anything that answers "the `k` nearest of each query" over stored vectors: [`FlatIndex`],
/// or an [`IvfPqIndex`] at a chosen `nprobe` ([`IvfPqIndex::with_nprobe`]).
pub trait Search {
    /// The stored vectors' dimension.
    fn dim(&self) -> usize;
    /// The `k` nearest stored vectors of each query (rows of [`dim`](Self::dim)), best first.
    fn search_k(&self, queries: &[f32], k: usize) -> Result<Neighbors>;
}

impl Search for FlatIndex {
    fn dim(&self) -> usize {
        FlatIndex::dim(self)
    }
    fn search_k(&self, queries: &[f32], k: usize) -> Result<Neighbors> {
        self.search(queries, k)
    }
}

/// An [`IvfPqIndex`] searched at a fixed `nprobe`.
#[derive(Clone, Copy, Debug)]
pub struct Probed<'a> {
    /// The index.
    pub index: &'a IvfPqIndex,
    /// Lists scanned per query.
    pub nprobe: usize,
}

impl Search for Probed<'_> {
    fn dim(&self) -> usize {
        self.index.dim()
    }
    fn search_k(&self, queries: &[f32], k: usize) -> Result<Neighbors> {
        self.index.search(queries, k, self.nprobe)
    }
}

/// How closeness is measured.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Metric {
    /// Inner product: larger is closer (cosine similarity on L2-normalised vectors).
    InnerProduct,
    /// Squared Euclidean distance: smaller is closer.
    L2,
}

impl Metric {
    /// The name stored in saved indexes (`ip`, `l2`).
    pub fn name(self) -> &'static str {
        match self {
            Metric::InnerProduct => "ip",
            Metric::L2 => "l2",
        }
    }

    /// The metric of a [`name`](Self::name).
    pub fn from_name(name: &str) -> Option<Metric> {
        match name {
            "ip" => Some(Metric::InnerProduct),
            "l2" => Some(Metric::L2),
            _ => None,
        }
    }
}

/// The `k` nearest neighbours of each query, best first (`[queries × k]` row-major). Where
/// fewer than `k` vectors were scanned (IVF-PQ with few probed lists), the rest of a row is id
/// `-1` with score `-∞` (inner product) or `+∞` (L2).
#[derive(Clone, Debug, PartialEq)]
pub struct Neighbors {
    /// Neighbours per query.
    pub k: usize,
    /// Ids, `[queries × k]`.
    pub ids: Vec<i64>,
    /// Inner products or squared L2 distances, `[queries × k]`.
    pub scores: Vec<f32>,
}

impl Neighbors {
    /// Queries answered.
    pub fn num_queries(&self) -> usize {
        self.ids.len().checked_div(self.k).unwrap_or(0)
    }

    /// The ids found for query `q`, best first.
    ///
    /// # Panics
    /// When `q` is not one of the queries, as a slice's index does.
    pub fn ids_of(&self, q: usize) -> &[i64] {
        &self.ids[q * self.k..(q + 1) * self.k]
    }

    /// The scores of query `q`'s neighbours, best first.
    ///
    /// # Panics
    /// When `q` is not one of the queries, as a slice's index does.
    pub fn scores_of(&self, q: usize) -> &[f32] {
        &self.scores[q * self.k..(q + 1) * self.k]
    }

    /// Recall@k against `truth` (e.g. an exact search): the share of each query's true `k`
    /// nearest ids found among this result's first `k`, averaged over queries.
    pub fn recall_at(&self, truth: &Neighbors, k: usize) -> f64 {
        let n = self.num_queries().min(truth.num_queries());
        if n == 0 || k == 0 {
            return 0.0;
        }
        let k = k.min(self.k).min(truth.k);
        let mut hits = 0usize;
        for q in 0..n {
            let found = &self.ids_of(q)[..k];
            hits += truth.ids_of(q)[..k]
                .iter()
                .filter(|id| **id >= 0 && found.contains(id))
                .count();
        }
        hits as f64 / (n * k) as f64
    }
}

/// Checks `vectors` as rows of `dim` finite floats; returns how many rows.
pub(crate) fn check_vectors(what: &'static str, vectors: &[f32], dim: usize) -> Result<usize> {
    if dim == 0 {
        return Err(Error::invalid(what, "the dimension must be at least 1"));
    }
    if vectors.len() % dim != 0 {
        return Err(Error::invalid(
            what,
            format!(
                "{} values are not whole vectors of dimension {dim}",
                vectors.len()
            ),
        ));
    }
    // Distances and products of two vectors within this norm stay finite in f32
    // (‖a − b‖² ≤ 2‖a‖² + 2‖b‖²); past it they overflow, and every score is NaN or ±∞.
    let limit = f32::MAX as f64 / 4.0;
    // One pass: a non-finite value anywhere is reported before a norm past the limit.
    let mut too_long = None;
    for (i, v) in vectors.chunks_exact(dim).enumerate() {
        let norm: f64 = v.iter().map(|&x| x as f64 * x as f64).sum();
        if !norm.is_finite() {
            let j = v
                .iter()
                .position(|x| !x.is_finite())
                .expect("a non-finite value");
            return Err(Error::invalid(
                what,
                format!("vector {i} has {} at element {j}", v[j]),
            ));
        }
        if norm > limit && too_long.is_none() {
            too_long = Some((i, norm));
        }
    }
    if let Some((i, norm)) = too_long {
        return Err(Error::invalid(
            what,
            format!(
                "vector {i} has squared norm {norm:.3e}, past the {limit:.3e} whose distances \
                 f32 holds"
            ),
        ));
    }
    Ok(vectors.len() / dim)
}

/// Checks ids: one per vector, none negative (−1 marks "no neighbour"), none repeated.
pub(crate) fn check_new_ids(
    what: &'static str,
    ids: &[i64],
    n: usize,
    present: impl Fn(i64) -> bool,
) -> Result<()> {
    if ids.len() != n {
        return Err(Error::invalid(
            what,
            format!("{} ids for {n} vectors", ids.len()),
        ));
    }
    let mut seen = std::collections::HashSet::with_capacity(ids.len());
    for (i, &id) in ids.iter().enumerate() {
        if id < 0 {
            return Err(Error::invalid(
                what,
                format!("id {id} (vector {i}) is negative"),
            ));
        }
        if present(id) || !seen.insert(id) {
            return Err(Error::invalid(
                what,
                format!("id {id} (vector {i}) is already in the index"),
            ));
        }
    }
    Ok(())
}
