//! Nearest-neighbour search: exact (`FlatIndex`, L2 and inner product) and IVF-PQ (`IvfPqIndex`)
//! on 100k vectors of dimension 64 drawn around 1000 random centres, 1000 queries, L2 — build
//! time, queries/s and
//! recall@10 against exact search at several `nprobe`. Side by side with FAISS (same vectors,
//! same nlist/m/nbits/nprobe, 2 threads): `benches/peers/ann.sh`.
//!
//! `EMBERS_ANN_DUMP=<dir>` writes the vectors (`base.f32`, `queries.f32`, raw little-endian)
//! for the peer script and exits. `EMBERS_ANN_N` changes the number of base vectors.

use std::time::Instant;

use embers::retrieval::{FlatIndex, IvfPqConfig, IvfPqIndex, Metric};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rand_distr::StandardNormal;

const DIM: usize = 64;
const QUERIES: usize = 1000;
const NLIST: usize = 256;
const M: usize = 16;
const K: usize = 10;

/// `n` vectors: one of 1000 centres (N(0, 1) per coordinate) plus N(0, 0.5²) noise.
fn data(n: usize, seed: u64) -> Vec<f32> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let centres: Vec<f32> = (0..1000 * DIM)
        .map(|_| rng.sample(StandardNormal))
        .collect();
    let mut out = Vec::with_capacity(n * DIM);
    for _ in 0..n {
        let c = rng.random_range(0..1000) * DIM;
        for d in 0..DIM {
            out.push(centres[c + d] + 0.5 * rng.sample::<f32, _>(StandardNormal));
        }
    }
    out
}

fn main() {
    let n: usize = std::env::var("EMBERS_ANN_N")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(100_000);
    let all = data(n + QUERIES, 0);
    let (base, queries) = all.split_at(n * DIM);
    if let Ok(dir) = std::env::var("EMBERS_ANN_DUMP") {
        let bytes = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
        std::fs::write(format!("{dir}/base.f32"), bytes(base)).expect("write base");
        std::fs::write(format!("{dir}/queries.f32"), bytes(queries)).expect("write queries");
        println!("wrote {n} base and {QUERIES} query vectors of dimension {DIM} to {dir}");
        return;
    }
    let threads = rayon::current_num_threads();
    println!("embers ANN: {n} x {DIM} base, {QUERIES} queries, L2, k={K}, {threads} threads");
    let ids: Vec<i64> = (0..n as i64).collect();
    let t = Instant::now();
    let mut flat = FlatIndex::new(DIM, Metric::L2).expect("flat");
    flat.add(&ids, base).expect("add");
    let build = t.elapsed().as_secs_f64();
    let t = Instant::now();
    let truth = flat.search(queries, K).expect("exact");
    let secs = t.elapsed().as_secs_f64();
    // One scan of the base per query block: 2·n·d flops per query.
    let gflops = 2.0 * (n * DIM * QUERIES) as f64 / secs / 1e9;
    println!(
        "exact (flat)  build {build:.3} s  {:.0} queries/s  ({gflops:.1} GFLOP/s)",
        QUERIES as f64 / secs
    );
    // Exact inner-product search (FAISS's IndexFlatIP) over the same vectors.
    let mut flat_ip = FlatIndex::new(DIM, Metric::InnerProduct).expect("flat");
    flat_ip.add(&ids, base).expect("add");
    let t = Instant::now();
    flat_ip.search(queries, K).expect("exact ip");
    let secs = t.elapsed().as_secs_f64();
    println!(
        "exact inner product (flat)  {:.0} queries/s  ({:.1} GFLOP/s)",
        QUERIES as f64 / secs,
        2.0 * (n * DIM * QUERIES) as f64 / secs / 1e9
    );
    let t = Instant::now();
    let mut index =
        IvfPqIndex::train(IvfPqConfig::new(NLIST, M, Metric::L2), base, DIM).expect("train");
    let train = t.elapsed().as_secs_f64();
    let t = Instant::now();
    index.add(&ids, base).expect("add");
    let add = t.elapsed().as_secs_f64();
    println!("ivfpq nlist={NLIST} m={M} nbits=8  train {train:.2} s  add {add:.2} s");
    for nprobe in [1, 4, 16, 64] {
        let t = Instant::now();
        let found = index.search(queries, K, nprobe).expect("search");
        let secs = t.elapsed().as_secs_f64();
        println!(
            "ivfpq nprobe={nprobe:<3} {:>9.0} queries/s  recall@10 {:.4}",
            QUERIES as f64 / secs,
            found.recall_at(&truth, K)
        );
    }
}
