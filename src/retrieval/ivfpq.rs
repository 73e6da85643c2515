//! IVF-PQ: inverted lists over a k-means coarse quantizer, residuals stored as PQ codes.

use std::collections::HashMap;
use std::path::Path;

use rayon::prelude::*;

use super::flat::{check_k, nearest, scan, squared_norms};
use super::select::TopK;
use super::{check_new_ids, check_vectors, kmeans, Metric, Neighbors, ProductQuantizer, KSUB};
use crate::checkpoint::{CheckpointReader, CheckpointWriter};
use crate::{Error, Result};

const FORMAT: &str = "embers.ivfpq.v1";

/// The shape of an [`IvfPqIndex`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IvfPqConfig {
    /// Inverted lists (coarse centroids).
    pub nlist: usize,
    /// Sub-quantizers: code bytes per vector (the dimension must divide by it).
    pub m: usize,
    /// Inner product or squared L2.
    pub metric: Metric,
    /// k-means rounds of the coarse quantizer (FAISS's `IndexIVF` default: 10).
    pub coarse_iters: usize,
    /// k-means rounds of each sub-quantizer (FAISS's `ProductQuantizer` default: 25).
    pub pq_iters: usize,
    /// Seed of both k-means.
    pub seed: u64,
}

impl IvfPqConfig {
    /// `nlist` lists, `m` sub-quantizers, FAISS's k-means rounds (10 coarse, 25 per
    /// sub-quantizer), seed 0.
    pub fn new(nlist: usize, m: usize, metric: Metric) -> Self {
        IvfPqConfig {
            nlist,
            m,
            metric,
            coarse_iters: 10,
            pq_iters: 25,
            seed: 0,
        }
    }

    /// Checks that an index of this configuration can be trained on `n` vectors of `dim`:
    /// at least one list, `dim` divisible into `m` sub-vectors, and at least `nlist` and 256
    /// vectors (what [`IvfPqIndex::train`] needs; a caller can check before computing them).
    pub fn check(&self, dim: usize, n: usize) -> Result<()> {
        if self.nlist == 0 {
            return Err(Error::invalid(
                "IvfPqIndex::train",
                "nlist must be at least 1",
            ));
        }
        if self.m == 0 || dim % self.m != 0 {
            return Err(Error::invalid(
                "IvfPqIndex::train",
                format!(
                    "dimension {dim} is not divisible into m = {} sub-vectors",
                    self.m
                ),
            ));
        }
        if n < self.nlist.max(KSUB) {
            return Err(Error::invalid(
                "IvfPqIndex::train",
                format!(
                    "{} lists and 256 PQ centroids need at least {} training vectors, got {n}",
                    self.nlist,
                    self.nlist.max(KSUB)
                ),
            ));
        }
        Ok(())
    }
}

/// One inverted list: ids and their `m`-byte codes, in the same order.
#[derive(Clone, Debug, Default, PartialEq)]
struct InvList {
    ids: Vec<i64>,
    codes: Vec<u8>,
}

/// Approximate nearest-neighbour search (FAISS's `IndexIVFPQ` with 8-bit codes, residuals
/// encoded): each vector lives in the list of its nearest coarse centroid as `m` PQ codes of
/// its residual; a query scans its `nprobe` best lists with one distance table per query
/// (inner product) or per probed list (L2).
#[derive(Clone, Debug)]
pub struct IvfPqIndex {
    config: IvfPqConfig,
    dim: usize,
    coarse: Vec<f32>,
    coarse_norms: Vec<f32>,
    pq: ProductQuantizer,
    lists: Vec<InvList>,
    list_of: HashMap<i64, u32>,
    /// L2 only, when it fits in [`PRECOMPUTED_MAX_BYTES`]: `[nlist × m × 256]`, entry
    /// `(l, j, c)` = `‖r_jc‖² + 2⟨c_l,j, r_jc⟩` (sub-centroid `r_jc`, list centroid `c_l`), so a
    /// query needs one inner-product table instead of one L2 table per probed list (FAISS's
    /// precomputed tables).
    precomputed: Option<Vec<f32>>,
    /// What computed the vectors (a model's id), when the builder said.
    source: Option<String>,
}

/// The largest precomputed L2 term table kept (bytes).
const PRECOMPUTED_MAX_BYTES: usize = 256 << 20;

impl IvfPqIndex {
    /// Trains the coarse quantizer on `vectors` (rows of `dim`; at least `nlist` and 256 of
    /// them) and the product quantizer on their residuals. The index starts empty: [`add`]
    /// the vectors to serve.
    ///
    /// [`add`]: Self::add
    pub fn train(config: IvfPqConfig, vectors: &[f32], dim: usize) -> Result<Self> {
        let n = check_vectors("IvfPqIndex::train", vectors, dim)?;
        config.check(dim, n)?;
        let coarse = kmeans(vectors, dim, config.nlist, config.coarse_iters, config.seed)?;
        let coarse_norms = squared_norms(&coarse, dim);
        let mut index = IvfPqIndex {
            config,
            dim,
            coarse,
            coarse_norms,
            // Replaced below once the residuals exist.
            pq: ProductQuantizer::from_centroids(dim, config.m, vec![0.0; dim * KSUB])?,
            lists: vec![InvList::default(); config.nlist],
            list_of: HashMap::new(),
            precomputed: None,
            source: None,
        };
        let lists = index.assign(vectors);
        let residuals = index.residuals(vectors, &lists);
        index.pq = ProductQuantizer::train(
            &residuals,
            dim,
            config.m,
            config.pq_iters,
            config.seed.wrapping_add(1),
        )?;
        index.precomputed = index.precompute();
        Ok(index)
    }

    /// The precomputed L2 term table (see the field), if L2 and small enough.
    fn precompute(&self) -> Option<Vec<f32>> {
        let (nlist, m, dim) = (self.config.nlist, self.config.m, self.dim);
        if self.config.metric != Metric::L2 || nlist * m * KSUB * 4 > PRECOMPUTED_MAX_BYTES {
            return None;
        }
        let dsub = dim / m;
        let sub = self.pq.centroids();
        let mut table = vec![0f32; nlist * m * KSUB];
        table
            .par_chunks_mut(m * KSUB)
            .enumerate()
            .for_each(|(l, out)| {
                let c = &self.coarse[l * dim..(l + 1) * dim];
                for j in 0..m {
                    let cj = &c[j * dsub..(j + 1) * dsub];
                    for k in 0..KSUB {
                        let r = &sub[(j * KSUB + k) * dsub..(j * KSUB + k + 1) * dsub];
                        out[j * KSUB + k] =
                            r.iter().zip(cj).map(|(r, c)| r * r + 2.0 * c * r).sum();
                    }
                }
            });
        Some(table)
    }

    /// The configuration.
    pub fn config(&self) -> IvfPqConfig {
        self.config
    }

    /// The vectors' dimension.
    pub fn dim(&self) -> usize {
        self.dim
    }

    /// Records what computed the vectors (e.g. [`TwoTowerTrainer::model_id`]), saved with
    /// the index: a server refuses to pair the index with a model of another id.
    ///
    /// [`TwoTowerTrainer::model_id`]: crate::train::TwoTowerTrainer::model_id
    pub fn set_source(&mut self, source: impl Into<String>) {
        self.source = Some(source.into());
    }

    /// What computed the vectors, when recorded ([`set_source`](Self::set_source)).
    pub fn source(&self) -> Option<&str> {
        self.source.as_deref()
    }

    /// Vectors stored.
    pub fn len(&self) -> usize {
        self.list_of.len()
    }

    /// Whether no vector is stored.
    pub fn is_empty(&self) -> bool {
        self.list_of.is_empty()
    }

    /// Vectors in each inverted list.
    pub fn list_sizes(&self) -> Vec<usize> {
        self.lists.iter().map(|l| l.ids.len()).collect()
    }

    /// The product quantizer.
    pub fn pq(&self) -> &ProductQuantizer {
        &self.pq
    }

    /// The nearest coarse centroid of each vector (by the index's metric).
    fn assign(&self, vectors: &[f32]) -> Vec<usize> {
        if self.config.metric == Metric::L2 {
            let near = nearest(vectors, &self.coarse, self.dim, &self.coarse_norms);
            return near.into_iter().map(|(c, _)| c).collect();
        }
        let tops = scan(
            vectors,
            &self.coarse,
            self.dim,
            None,
            None,
            self.config.metric,
            1,
        );
        tops.into_iter()
            .map(|t| t.into_sorted()[0].1 as usize)
            .collect()
    }

    fn residuals(&self, vectors: &[f32], lists: &[usize]) -> Vec<f32> {
        let dim = self.dim;
        let mut out = Vec::with_capacity(vectors.len());
        for (v, &l) in vectors.chunks_exact(dim).zip(lists) {
            let c = &self.coarse[l * dim..(l + 1) * dim];
            out.extend(v.iter().zip(c).map(|(x, c)| x - c));
        }
        out
    }

    /// Adds `vectors` (rows of `dim`) under `ids` (unique, non-negative, new) to the lists of
    /// their nearest centroids; the quantizers are not retrained.
    pub fn add(&mut self, ids: &[i64], vectors: &[f32]) -> Result<()> {
        let n = check_vectors("IvfPqIndex::add", vectors, self.dim)?;
        check_new_ids("IvfPqIndex::add", ids, n, |id| {
            self.list_of.contains_key(&id)
        })?;
        let lists = self.assign(vectors);
        let codes = self.pq.encode(&self.residuals(vectors, &lists))?;
        let m = self.config.m;
        for (i, (&id, &l)) in ids.iter().zip(&lists).enumerate() {
            let list = &mut self.lists[l];
            list.ids.push(id);
            list.codes.extend_from_slice(&codes[i * m..(i + 1) * m]);
            self.list_of.insert(id, l as u32);
        }
        Ok(())
    }

    /// The vector id `id` stands for in the index: its list's centroid plus its decoded
    /// residual (what search scores against); `None` if the id is not stored.
    pub fn reconstruct(&self, id: i64) -> Option<Vec<f32>> {
        let l = *self.list_of.get(&id)? as usize;
        let list = &self.lists[l];
        let at = list.ids.iter().position(|&x| x == id)?;
        let m = self.config.m;
        let residual = self.pq.decode_codes(&list.codes[at * m..(at + 1) * m]);
        let c = &self.coarse[l * self.dim..(l + 1) * self.dim];
        Some(residual.iter().zip(c).map(|(r, c)| r + c).collect())
    }

    /// Removes the vectors with these ids (ids not stored are ignored); returns how many went.
    pub fn remove(&mut self, ids: &[i64]) -> usize {
        let m = self.config.m;
        let mut removed = 0;
        for id in ids {
            let Some(l) = self.list_of.remove(id) else {
                continue;
            };
            let list = &mut self.lists[l as usize];
            let at = list
                .ids
                .iter()
                .position(|x| x == id)
                .expect("list_of names the list holding the id");
            let last = list.ids.len() - 1;
            list.ids.swap_remove(at);
            list.codes.copy_within(last * m..(last + 1) * m, at * m);
            list.codes.truncate(last * m);
            removed += 1;
        }
        removed
    }

    /// The `k` nearest stored vectors of each query (rows of `dim`) among the `nprobe` lists
    /// nearest to it, best first (approximate: scores come from the PQ codes).
    pub fn search(&self, queries: &[f32], k: usize, nprobe: usize) -> Result<Neighbors> {
        let nq = check_vectors("IvfPqIndex::search", queries, self.dim)?;
        check_k("IvfPqIndex::search", k, self.len())?;
        if nprobe == 0 || nprobe > self.config.nlist {
            return Err(Error::invalid(
                "IvfPqIndex::search",
                format!("nprobe = {nprobe}, must be 1..={}", self.config.nlist),
            ));
        }
        let metric = self.config.metric;
        let norms = (metric == Metric::L2).then_some(&self.coarse_norms[..]);
        let probes = scan(queries, &self.coarse, self.dim, norms, None, metric, nprobe);
        let dim = self.dim;
        let results: Vec<Vec<(f32, i64)>> = probes
            .into_par_iter()
            .enumerate()
            .map(|(q, probe)| {
                let query = &queries[q * dim..(q + 1) * dim];
                let qnorm: f32 = query.iter().map(|x| x * x).sum();
                let mut top = TopK::new(k);
                // Inner product, and L2 with precomputed terms: one ⟨q, r⟩ table per query.
                let ip_table = (metric == Metric::InnerProduct || self.precomputed.is_some())
                    .then(|| self.pq.table_of(query, Metric::InnerProduct));
                let mut table = vec![0f32; self.config.m * KSUB];
                let mut residual = vec![0f32; dim];
                for (coarse_score, l) in probe.into_sorted() {
                    if l < 0 || self.lists[l as usize].ids.is_empty() {
                        continue;
                    }
                    let l = l as usize;
                    let (scores, base, sign): (&[f32], f32, f32) =
                        match (metric, &ip_table, &self.precomputed) {
                            // ⟨q, c + r⟩ = ⟨q, c⟩ + Σ_j ⟨q_j, r_j⟩: the query's own table.
                            (Metric::InnerProduct, Some(ip), _) => (ip, coarse_score, 1.0),
                            // ‖q − c − r‖² = ‖q − c‖² + Σ_j (‖r_j‖² + 2⟨c_j, r_j⟩ − 2⟨q_j, r_j⟩);
                            // the coarse score is 2⟨q,c⟩ − ‖c‖², so ‖q − c‖² = ‖q‖² − it.
                            (_, Some(ip), Some(pre)) => {
                                let terms = &pre[l * table.len()..(l + 1) * table.len()];
                                for ((t, p), i) in table.iter_mut().zip(terms).zip(ip.iter()) {
                                    *t = p - 2.0 * i;
                                }
                                (&table, -(qnorm - coarse_score), -1.0)
                            }
                            // ‖q − c − r‖² = Σ_j ‖(q − c)_j − r_j‖², a table per list.
                            _ => {
                                let c = &self.coarse[l * dim..(l + 1) * dim];
                                for ((r, x), c) in residual.iter_mut().zip(query).zip(c) {
                                    *r = x - c;
                                }
                                table = self.pq.table_of(&residual, Metric::L2);
                                (&table, 0.0, -1.0)
                            }
                        };
                    scan_list(&self.lists[l], scores, self.config.m, base, sign, &mut top);
                }
                top.into_sorted()
            })
            .collect();
        let mut ids = Vec::with_capacity(nq * k);
        let mut scores = Vec::with_capacity(nq * k);
        for row in results {
            for (score, id) in row {
                ids.push(id);
                scores.push(match metric {
                    Metric::InnerProduct => score,
                    Metric::L2 => -score,
                });
            }
        }
        Ok(Neighbors { k, ids, scores })
    }

    /// This index searched at `nprobe` lists per query, as a [`Search`](super::Search).
    pub fn with_nprobe(&self, nprobe: usize) -> super::Probed<'_> {
        super::Probed {
            index: self,
            nprobe,
        }
    }

    /// Writes the index to `path` atomically (temporary file, fsync, rename): a crash leaves
    /// the previous file whole.
    pub fn save(&self, path: impl AsRef<Path>) -> Result<()> {
        let mut w = CheckpointWriter::new();
        w.set_metadata("format", FORMAT);
        w.set_metadata("metric", self.config.metric.name());
        w.set_metadata("dim", self.dim.to_string());
        w.set_metadata("nlist", self.config.nlist.to_string());
        w.set_metadata("m", self.config.m.to_string());
        w.set_metadata("coarse_iters", self.config.coarse_iters.to_string());
        w.set_metadata("pq_iters", self.config.pq_iters.to_string());
        w.set_metadata("seed", self.config.seed.to_string());
        if let Some(source) = &self.source {
            w.set_metadata("source", source.clone());
        }
        w.add("coarse", &[self.config.nlist, self.dim], &self.coarse)?;
        w.add(
            "pq",
            &[self.config.m, KSUB, self.pq.dsub()],
            self.pq.centroids(),
        )?;
        let sizes: Vec<i64> = self.lists.iter().map(|l| l.ids.len() as i64).collect();
        let ids: Vec<i64> = self
            .lists
            .iter()
            .flat_map(|l| l.ids.iter().copied())
            .collect();
        let codes: Vec<u8> = self
            .lists
            .iter()
            .flat_map(|l| l.codes.iter().copied())
            .collect();
        w.add("list_sizes", &[self.config.nlist], &sizes)?;
        w.add("ids", &[ids.len()], &ids)?;
        w.add("codes", &[ids.len(), self.config.m], &codes)?;
        w.write(path)
    }

    /// Reads an index written by [`save`](Self::save); a truncated, corrupt or inconsistent
    /// file is an error naming it.
    pub fn load(path: impl AsRef<Path>) -> Result<Self> {
        let r = CheckpointReader::open(path)?;
        let bad = |msg: String| {
            Error::invalid("IvfPqIndex::load", format!("{}: {msg}", r.path().display()))
        };
        if r.metadata("format") != Some(FORMAT) {
            return Err(bad(format!(
                "not an IVF-PQ index (format {:?})",
                r.metadata("format")
            )));
        }
        let number = |key: &str| -> Result<usize> {
            let v = r.required_metadata(key)?;
            v.parse()
                .map_err(|_| bad(format!("metadata `{key}` = `{v}` is not a count")))
        };
        let (dim, nlist, m) = (number("dim")?, number("nlist")?, number("m")?);
        let metric = Metric::from_name(r.required_metadata("metric")?)
            .ok_or_else(|| bad("metric is neither `ip` nor `l2`".into()))?;
        if dim == 0 || nlist == 0 || m == 0 || dim % m != 0 {
            return Err(bad(format!(
                "dim {dim}, nlist {nlist}, m {m} do not fit together"
            )));
        }
        let config = IvfPqConfig {
            nlist,
            m,
            metric,
            coarse_iters: number("coarse_iters")?,
            pq_iters: number("pq_iters")?,
            seed: number("seed")? as u64,
        };
        let coarse: Vec<f32> = r.read("coarse", &[nlist, dim])?;
        check_vectors("IvfPqIndex::load", &coarse, dim).map_err(|e| bad(e.to_string()))?;
        let pq = ProductQuantizer::from_centroids(dim, m, r.read("pq", &[m, KSUB, dim / m])?)
            .map_err(|e| bad(e.to_string()))?;
        let sizes: Vec<i64> = r.read("list_sizes", &[nlist])?;
        let total = sizes
            .iter()
            .try_fold(0usize, |sum, &s| sum.checked_add(usize::try_from(s).ok()?))
            .ok_or_else(|| bad("list sizes are negative or sum past a usize".into()))?;
        let ids: Vec<i64> = r.read("ids", &[total])?;
        let codes: Vec<u8> = r.read("codes", &[total, m])?;
        let mut lists = Vec::with_capacity(nlist);
        let mut list_of = HashMap::with_capacity(total);
        let mut at = 0;
        for (l, &size) in sizes.iter().enumerate() {
            let size = size as usize;
            let list = InvList {
                ids: ids[at..at + size].to_vec(),
                codes: codes[at * m..(at + size) * m].to_vec(),
            };
            for &id in &list.ids {
                if id < 0 || list_of.insert(id, l as u32).is_some() {
                    return Err(bad(format!("id {id} is negative or stored twice")));
                }
            }
            lists.push(list);
            at += size;
        }
        let mut index = IvfPqIndex {
            config,
            dim,
            coarse_norms: squared_norms(&coarse, dim),
            coarse,
            pq,
            lists,
            list_of,
            precomputed: None,
            source: r.metadata("source").map(str::to_string),
        };
        index.precomputed = index.precompute();
        Ok(index)
    }
}

/// Codes summed side by side in [`scan_list`]: independent addition chains, so the table
/// loads of several codes overlap instead of each code waiting on its own sum.
const INTERLEAVE: usize = 4;

/// Scores every entry of `list` as `base + sign · Σ_j table[j][code_j]` into `top`. Each sum
/// runs over `j` in order, [`INTERLEAVE`] codes at a time.
fn scan_list(list: &InvList, table: &[f32], m: usize, base: f32, sign: f32, top: &mut TopK) {
    let tables: Vec<&[f32; KSUB]> = table
        .chunks_exact(KSUB)
        .map(|t| t.try_into().expect("KSUB entries"))
        .collect();
    let mut offer = |sum: f32, id: i64| {
        let score = base + sign * sum;
        if score >= top.threshold() {
            top.push(score, id);
        }
    };
    let groups = list.codes.chunks_exact(m * INTERLEAVE);
    let rest = groups.remainder();
    let mut ids = list.ids.chunks_exact(INTERLEAVE);
    for (codes, ids) in groups.zip(&mut ids) {
        let mut sums = [0f32; INTERLEAVE];
        for (j, t) in tables.iter().enumerate() {
            for (g, sum) in sums.iter_mut().enumerate() {
                *sum += t[codes[g * m + j] as usize];
            }
        }
        for (&sum, &id) in sums.iter().zip(ids) {
            offer(sum, id);
        }
    }
    for (code, &id) in rest.chunks_exact(m).zip(ids.remainder()) {
        let mut sum = 0f32;
        for (t, &c) in tables.iter().zip(code) {
            sum += t[c as usize];
        }
        offer(sum, id);
    }
}
