//! Nearest-neighbour search: exact search against an f64 scan, k-means on planted clusters,
//! PQ codes and tables against f64 references, IVF-PQ against exact search over the vectors it
//! reconstructs and in recall against exact search, add/remove, save/load, bad inputs.

use embers::retrieval::{
    kmeans, FlatIndex, IvfPqConfig, IvfPqIndex, Metric, ProductQuantizer, KSUB,
};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rand_distr::StandardNormal;

fn gaussian(n: usize, dim: usize, seed: u64) -> Vec<f32> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..n * dim)
        .map(|_| rng.sample::<f32, _>(StandardNormal))
        .collect()
}

/// `n` points around `centers` random centres (spread 10), each point within noise 0.3.
fn clustered(n: usize, dim: usize, centers: usize, seed: u64) -> (Vec<f32>, Vec<f32>) {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let c: Vec<f32> = (0..centers * dim)
        .map(|_| 10.0 * rng.sample::<f32, _>(StandardNormal))
        .collect();
    let mut x = Vec::with_capacity(n * dim);
    for i in 0..n {
        let at = (i % centers) * dim;
        for d in 0..dim {
            x.push(c[at + d] + 0.3 * rng.sample::<f32, _>(StandardNormal));
        }
    }
    (x, c)
}

fn score64(metric: Metric, a: &[f32], b: &[f32]) -> f64 {
    match metric {
        Metric::InnerProduct => a
            .iter()
            .zip(b)
            .map(|(x, y)| f64::from(*x) * f64::from(*y))
            .sum(),
        Metric::L2 => a
            .iter()
            .zip(b)
            .map(|(x, y)| (f64::from(*x) - f64::from(*y)).powi(2))
            .sum(),
    }
}

/// Checks `got` (ids and scores of one query, best first) against an f64 scan of `base`:
/// every returned score equals that id's f64 score, and the returned scores are the k best.
fn check_exact(
    metric: Metric,
    query: &[f32],
    base: &[f32],
    dim: usize,
    ids: &[i64],
    scores: &[f32],
    what: &str,
) {
    let mut all: Vec<f64> = base
        .chunks_exact(dim)
        .map(|b| score64(metric, query, b))
        .collect();
    let scale: f64 = 1.0 + query.iter().map(|x| f64::from(*x).abs()).sum::<f64>() * 10.0;
    for (&id, &s) in ids.iter().zip(scores) {
        let exact = all[id as usize];
        assert!(
            (f64::from(s) - exact).abs() <= 1e-5 * scale,
            "{what}: id {id} score {s} vs {exact}"
        );
    }
    match metric {
        Metric::InnerProduct => all.sort_by(|a, b| b.total_cmp(a)),
        Metric::L2 => all.sort_by(|a, b| a.total_cmp(b)),
    }
    for (i, &id) in ids.iter().enumerate() {
        let exact = score64(
            metric,
            query,
            &base[id as usize * dim..(id as usize + 1) * dim],
        );
        assert!(
            (exact - all[i]).abs() <= 1e-5 * scale,
            "{what}: rank {i} is id {id} ({exact}), the true rank-{i} score is {}",
            all[i]
        );
    }
    // Best first.
    for w in scores.windows(2) {
        match metric {
            Metric::InnerProduct => assert!(w[0] >= w[1], "{what}: not sorted {scores:?}"),
            Metric::L2 => assert!(w[0] <= w[1], "{what}: not sorted {scores:?}"),
        }
    }
}

#[test]
fn exact_search_matches_an_f64_scan() {
    // More base vectors than one product block (4096) and more queries than one (256).
    let (dim, nb, nq, k) = (24, 9000, 300, 10);
    let base = gaussian(nb, dim, 1);
    let queries = gaussian(nq, dim, 2);
    for metric in [Metric::InnerProduct, Metric::L2] {
        let mut index = FlatIndex::new(dim, metric).unwrap();
        let ids: Vec<i64> = (0..nb as i64).collect();
        index.add(&ids[..5000], &base[..5000 * dim]).unwrap();
        index.add(&ids[5000..], &base[5000 * dim..]).unwrap();
        let found = index.search(&queries, k).unwrap();
        assert_eq!(found.num_queries(), nq);
        for q in 0..nq {
            check_exact(
                metric,
                &queries[q * dim..(q + 1) * dim],
                &base,
                dim,
                found.ids_of(q),
                found.scores_of(q),
                &format!("{metric:?} query {q}"),
            );
        }
        // The whole index as k.
        let all = index.search(&queries[..dim], nb).unwrap();
        let mut sorted = all.ids.clone();
        sorted.sort();
        assert_eq!(sorted, ids);
    }
}

#[test]
fn removed_vectors_are_never_found_and_the_rest_search_as_a_fresh_index() {
    let (dim, nb) = (8, 2000);
    let base = gaussian(nb, dim, 3);
    let queries = gaussian(50, dim, 4);
    let ids: Vec<i64> = (0..nb as i64).map(|i| i * 7 + 3).collect();
    let mut index = FlatIndex::new(dim, Metric::L2).unwrap();
    index.add(&ids, &base).unwrap();
    let gone: Vec<i64> = ids.iter().copied().filter(|id| id % 2 == 0).collect();
    assert_eq!(index.remove(&gone), gone.len());
    assert_eq!(index.remove(&gone), 0, "removing twice removes nothing");
    let mut fresh = FlatIndex::new(dim, Metric::L2).unwrap();
    let (keep_ids, keep): (Vec<i64>, Vec<&[f32]>) = ids
        .iter()
        .zip(base.chunks_exact(dim))
        .filter(|(id, _)| *id % 2 != 0)
        .map(|(id, v)| (*id, v))
        .unzip();
    fresh.add(&keep_ids, &keep.concat()).unwrap();
    let a = index.search(&queries, 20).unwrap();
    let b = fresh.search(&queries, 20).unwrap();
    assert_eq!(a, b);
    assert!(a.ids.iter().all(|id| id % 2 != 0));
}

#[test]
fn kmeans_finds_planted_clusters() {
    let (dim, centers) = (16, 20);
    let (x, c) = clustered(4000, dim, centers, 5);
    let found = kmeans(&x, dim, centers, 25, 0).unwrap();
    // Every planted centre has a centroid within the noise (0.3 per coordinate → ~1.2 radius;
    // the mean of 200 points is far closer).
    for (i, centre) in c.chunks_exact(dim).enumerate() {
        let best = found
            .chunks_exact(dim)
            .map(|f| score64(Metric::L2, centre, f))
            .fold(f64::INFINITY, f64::min);
        assert!(
            best < 0.1,
            "centre {i}: nearest centroid at squared distance {best}"
        );
    }
    assert!(kmeans(&x[..10 * dim], dim, 20, 5, 0)
        .unwrap_err()
        .to_string()
        .contains("at least 20"));
}

#[test]
fn pq_codes_and_tables_match_an_f64_reference() {
    let (dim, m) = (32, 8);
    let dsub = dim / m;
    let train = gaussian(3000, dim, 6);
    let pq = ProductQuantizer::train(&train, dim, m, 10, 0).unwrap();
    assert_eq!(pq.centroids().len(), m * KSUB * dsub);
    let x = gaussian(200, dim, 7);
    let codes = pq.encode(&x).unwrap();
    let decoded = pq.decode(&codes).unwrap();
    for i in 0..200 {
        for j in 0..m {
            let sub = &x[i * dim + j * dsub..i * dim + (j + 1) * dsub];
            let cents = &pq.centroids()[j * KSUB * dsub..(j + 1) * KSUB * dsub];
            let dists: Vec<f64> = cents
                .chunks_exact(dsub)
                .map(|c| score64(Metric::L2, sub, c))
                .collect();
            let best = dists.iter().copied().fold(f64::INFINITY, f64::min);
            let code = codes[i * m + j] as usize;
            assert!(
                dists[code] <= best + 1e-5,
                "vector {i} sub {j}: code {code} at {} but {best} exists",
                dists[code]
            );
            assert_eq!(
                &decoded[i * dim + j * dsub..i * dim + (j + 1) * dsub],
                &cents[code * dsub..(code + 1) * dsub]
            );
        }
    }
    // Tables: entry (j, c) is the sub-vector's score with sub-centroid c; a code's score is the
    // sum, which equals the score with the decoded vector.
    let q = &x[..dim];
    for metric in [Metric::InnerProduct, Metric::L2] {
        let table = pq.table(q, metric).unwrap();
        for i in 0..50 {
            let sum: f64 = (0..m)
                .map(|j| f64::from(table[j * KSUB + codes[i * m + j] as usize]))
                .sum();
            let direct = score64(metric, q, &decoded[i * dim..(i + 1) * dim]);
            assert!(
                (sum - direct).abs() < 1e-4 * (1.0 + direct.abs()),
                "{metric:?} vector {i}: {sum} vs {direct}"
            );
        }
    }
    // A query of another length (it panicked, or was cut to its first `dim` values), and
    // codes that are not whole codes (the tail was dropped).
    for len in [dim - 1, dim + 1, 3] {
        let msg = pq.table(&x[..len], Metric::L2).unwrap_err().to_string();
        assert!(msg.contains(&format!("{len} values")), "{msg}");
    }
    let msg = pq.decode(&codes[..m + 3]).unwrap_err().to_string();
    assert!(msg.contains("not whole codes of m = 8"), "{msg}");
    assert!(ProductQuantizer::train(&train, dim, 5, 10, 0)
        .unwrap_err()
        .to_string()
        .contains("not divisible"));
    assert!(ProductQuantizer::train(&train[..100 * dim], dim, m, 10, 0)
        .unwrap_err()
        .to_string()
        .contains("256"));
}

/// With every list probed, IVF-PQ is an exact search over the vectors it reconstructs (list
/// centroid + decoded residual): same ids (up to ties) and scores.
#[test]
fn ivfpq_with_every_list_probed_is_exact_search_over_its_reconstructions() {
    let (dim, n) = (16, 3000);
    let x = gaussian(n, dim, 8);
    let queries = gaussian(40, dim, 9);
    for metric in [Metric::InnerProduct, Metric::L2] {
        let mut index = IvfPqIndex::train(
            IvfPqConfig {
                coarse_iters: 10,
                pq_iters: 10,
                ..IvfPqConfig::new(16, 4, metric)
            },
            &x,
            dim,
        )
        .unwrap();
        let ids: Vec<i64> = (0..n as i64).collect();
        index.add(&ids, &x).unwrap();
        assert_eq!(index.len(), n);
        assert_eq!(index.list_sizes().iter().sum::<usize>(), n);
        let recon: Vec<f32> = ids
            .iter()
            .flat_map(|&id| index.reconstruct(id).unwrap())
            .collect();
        let found = index.search(&queries, 10, 16).unwrap();
        for q in 0..40 {
            check_exact(
                metric,
                &queries[q * dim..(q + 1) * dim],
                &recon,
                dim,
                found.ids_of(q),
                found.scores_of(q),
                &format!("{metric:?} query {q}"),
            );
        }
    }
}

/// Recall@10 against exact search grows with nprobe and is high on clustered data; the
/// figures are printed (run with --nocapture).
#[test]
fn ivfpq_recall_against_exact_search() {
    let dim = 32;
    for (name, x) in [
        ("gaussian", gaussian(20_000, dim, 10)),
        ("clustered", clustered(20_000, dim, 100, 11).0),
    ] {
        let queries: Vec<f32> = x[..200 * dim].iter().map(|v| v + 0.01).collect();
        let mut exact = FlatIndex::new(dim, Metric::L2).unwrap();
        let ids: Vec<i64> = (0..20_000).collect();
        exact.add(&ids, &x).unwrap();
        let truth = exact.search(&queries, 10).unwrap();
        let mut index = IvfPqIndex::train(
            IvfPqConfig {
                coarse_iters: 10,
                pq_iters: 10,
                ..IvfPqConfig::new(64, 8, Metric::L2)
            },
            &x,
            dim,
        )
        .unwrap();
        index.add(&ids, &x).unwrap();
        let mut last = 0.0;
        let mut line = format!("{name}: recall@10");
        for nprobe in [1, 4, 16, 64] {
            let r = index
                .search(&queries, 10, nprobe)
                .unwrap()
                .recall_at(&truth, 10);
            line += &format!("  nprobe {nprobe}: {r:.3}");
            assert!(
                r + 0.02 >= last,
                "{name}: recall fell from {last} to {r} at nprobe {nprobe}"
            );
            last = r;
        }
        println!("{line}");
        // Each query is its base vector nudged by 0.01: its own id must come first almost always.
        let own = index.search(&queries, 1, 16).unwrap();
        let hits = (0..200).filter(|&q| own.ids_of(q)[0] == q as i64).count();
        match name {
            // 100 tight clusters of 200: PQ (8 bytes for 32 floats) cannot separate points
            // 0.3 apart inside a cluster, but recall@10 among 200 near-identical points is the
            // quantizer's limit; the own-id test is for the gaussian set.
            "clustered" => assert!(last > 0.1, "{name}: recall {last}"),
            _ => {
                assert!(
                    last > 0.5,
                    "{name}: recall@10 {last} with every list probed"
                );
                assert!(hits >= 150, "{name}: own id first for {hits}/200 queries");
            }
        }
    }
}

#[test]
fn ivfpq_add_remove_save_load() {
    let (dim, n) = (16, 2000);
    let x = gaussian(n, dim, 12);
    let ids: Vec<i64> = (0..n as i64).map(|i| 1000 + i).collect();
    let mut index = IvfPqIndex::train(
        IvfPqConfig {
            coarse_iters: 8,
            pq_iters: 8,
            ..IvfPqConfig::new(8, 4, Metric::InnerProduct)
        },
        &x,
        dim,
    )
    .unwrap();
    index.add(&ids[..1500], &x[..1500 * dim]).unwrap();
    index.add(&ids[1500..], &x[1500 * dim..]).unwrap();
    let queries = gaussian(20, dim, 13);
    let before = index.search(&queries, 15, 8).unwrap();
    // Remove every id found, then none of them is found again; add them back, found again.
    let found: Vec<i64> = before.ids.clone();
    let removed = index.remove(&found);
    assert!(removed > 0 && index.len() == n - removed);
    let after = index.search(&queries, 15, 8).unwrap();
    assert!(after.ids.iter().all(|id| !found.contains(id)));
    let back: Vec<usize> = {
        let mut v: Vec<i64> = found.clone();
        v.sort();
        v.dedup();
        v.iter().map(|id| (*id - 1000) as usize).collect()
    };
    let back_ids: Vec<i64> = back.iter().map(|&i| ids[i]).collect();
    let back_x: Vec<f32> = back
        .iter()
        .flat_map(|&i| x[i * dim..(i + 1) * dim].to_vec())
        .collect();
    index.add(&back_ids, &back_x).unwrap();
    assert_eq!(index.search(&queries, 15, 8).unwrap(), before);
    // Save / load: the same answers, also from a file saved over another index's.
    let dir = std::env::temp_dir().join(format!("embers-ivfpq-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("index.safetensors");
    index.save(&path).unwrap();
    let mut other = IvfPqIndex::load(&path).unwrap();
    other.remove(&ids[..ids.len() / 2]);
    other.save(&path).unwrap();
    let answers = other.search(&queries, 15, 8).unwrap();
    assert_ne!(answers, before);
    assert_eq!(
        IvfPqIndex::load(&path)
            .unwrap()
            .search(&queries, 15, 8)
            .unwrap(),
        answers
    );
    index.save(&path).unwrap();
    let loaded = IvfPqIndex::load(&path).unwrap();
    assert_eq!(loaded.search(&queries, 15, 8).unwrap(), before);
    assert_eq!(loaded.config(), index.config());
    // A truncated file and a changed digit in the header (a tensor's shape that no longer
    // fits its bytes) are errors naming the file.
    let bytes = std::fs::read(&path).unwrap();
    std::fs::write(dir.join("short"), &bytes[..bytes.len() - 100]).unwrap();
    let e = IvfPqIndex::load(dir.join("short")).unwrap_err().to_string();
    assert!(e.contains("short"), "{e}");
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header = String::from_utf8(bytes[8..8 + n].to_vec()).unwrap();
    let at = 8 + header.find("\"shape\":[").unwrap() + "\"shape\":[".len();
    let mut flipped = bytes.clone();
    flipped[at] = if flipped[at] == b'9' {
        b'8'
    } else {
        flipped[at] + 1
    };
    std::fs::write(dir.join("flipped"), &flipped).unwrap();
    let e = IvfPqIndex::load(dir.join("flipped"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("flipped"), "{e}");
    std::fs::write(dir.join("junk"), b"not an index").unwrap();
    assert!(IvfPqIndex::load(dir.join("junk")).is_err());
    let mut trainer_ckpt = embers::checkpoint::CheckpointWriter::new();
    trainer_ckpt.set_metadata("format", "something else");
    trainer_ckpt.write(dir.join("other")).unwrap();
    assert!(IvfPqIndex::load(dir.join("other"))
        .unwrap_err()
        .to_string()
        .contains("not an IVF-PQ index"));
}

#[test]
fn bad_inputs_are_named_errors() {
    let dim = 8;
    let x = gaussian(600, dim, 14);
    let mut flat = FlatIndex::new(dim, Metric::L2).unwrap();
    let err = |r: embers::Result<embers::retrieval::Neighbors>| r.unwrap_err().to_string();
    assert!(err(flat.search(&x[..dim], 1)).contains("empty"));
    assert!(flat
        .add(&[0, 1], &x[..dim])
        .unwrap_err()
        .to_string()
        .contains("2 ids for 1 vectors"));
    assert!(flat
        .add(&[0], &x[..dim - 1])
        .unwrap_err()
        .to_string()
        .contains("dimension 8"));
    let mut nan = x[..dim].to_vec();
    nan[3] = f32::NAN;
    assert!(flat
        .add(&[0], &nan)
        .unwrap_err()
        .to_string()
        .contains("vector 0 has NaN at element 3"));
    // Finite values whose squared norm overflows f32's distances (every score was NaN or ±∞;
    // an index trained on them searched garbage).
    let mut huge = x[..dim].to_vec();
    huge[2] = 1e19;
    assert!(flat
        .add(&[0], &huge)
        .unwrap_err()
        .to_string()
        .contains("vector 0 has squared norm 1.000e38"));
    assert!(flat
        .search(&huge, 1)
        .unwrap_err()
        .to_string()
        .contains("FlatIndex::search"));
    assert!(flat
        .add(&[-5], &x[..dim])
        .unwrap_err()
        .to_string()
        .contains("negative"));
    flat.add(&[0, 1], &x[..2 * dim]).unwrap();
    assert!(flat
        .add(&[1], &x[..dim])
        .unwrap_err()
        .to_string()
        .contains("already in the index"));
    assert!(flat
        .add(&[7, 7], &x[..2 * dim])
        .unwrap_err()
        .to_string()
        .contains("already"));
    assert!(err(flat.search(&x[..dim], 3)).contains("k = 3, but the index holds 2"));
    assert!(err(flat.search(&x[..dim], 0)).contains("k = 0"));
    assert!(err(flat.search(&nan, 1)).contains("NaN"));
    assert!(err(flat.search(&x[..dim + 1], 1)).contains("dimension"));
    assert!(FlatIndex::new(0, Metric::L2).is_err());
    let config = IvfPqConfig {
        coarse_iters: 3,
        pq_iters: 3,
        ..IvfPqConfig::new(4, 2, Metric::L2)
    };
    assert!(IvfPqIndex::train(config, &x[..100 * dim], dim)
        .unwrap_err()
        .to_string()
        .contains("at least 256"));
    assert!(IvfPqIndex::train(IvfPqConfig { m: 3, ..config }, &x, dim)
        .unwrap_err()
        .to_string()
        .contains("not divisible"));
    assert!(IvfPqIndex::train(IvfPqConfig { nlist: 0, ..config }, &x, dim).is_err());
    let mut index = IvfPqIndex::train(config, &x, dim).unwrap();
    assert!(err(index.search(&x[..dim], 1, 1)).contains("empty"));
    index.add(&[1, 2, 3], &x[..3 * dim]).unwrap();
    assert!(err(index.search(&x[..dim], 4, 1)).contains("k = 4, but the index holds 3"));
    assert!(err(index.search(&x[..dim], 1, 0)).contains("nprobe = 0"));
    assert!(err(index.search(&x[..dim], 1, 5)).contains("nprobe = 5, must be 1..=4"));
    assert!(err(index.search(&x[..2 * dim - 1], 1, 1)).contains("dimension"));
    assert!(index
        .add(&[2], &x[..dim])
        .unwrap_err()
        .to_string()
        .contains("already"));
    // A query whose probed lists hold fewer than k vectors: padded with -1 and +inf.
    let few = index.search(&x[..dim], 3, 1).unwrap();
    for (id, s) in few.ids.iter().zip(&few.scores) {
        assert!(
            (*id >= 0 && s.is_finite()) || (*id == -1 && *s == f32::INFINITY),
            "{few:?}"
        );
    }
}

#[test]
fn gpu_blocks_out_of_range_are_refused() {
    use embers::retrieval::GpuBlocks;
    let mut index = FlatIndex::new(4, Metric::InnerProduct).unwrap();
    for (queries, chunk) in [(0, 16), (16, 0), (16, (1 << 30) + 1)] {
        let e = index
            .set_gpu_blocks(GpuBlocks { queries, chunk })
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("set_gpu_blocks") && e.contains(&format!("{queries} queries")),
            "{e}"
        );
    }
    index
        .set_gpu_blocks(GpuBlocks {
            queries: 1,
            chunk: 1 << 30,
        })
        .unwrap();
}

/// An index file whose list sizes are each valid counts but whose sum does not fit in a
/// `usize` (here it wraps to the stored ids' length, 2^64 + 300 ≡ 300) is refused by name; it
/// must not panic or slice past the ids.
#[test]
fn ivfpq_load_refuses_list_sizes_past_a_usize() {
    let dim = 8;
    let x = gaussian(300, dim, 15);
    let mut index = IvfPqIndex::train(
        IvfPqConfig {
            coarse_iters: 2,
            pq_iters: 2,
            ..IvfPqConfig::new(4, 2, Metric::L2)
        },
        &x,
        dim,
    )
    .unwrap();
    index.add(&(0..300).collect::<Vec<i64>>(), &x).unwrap();
    let dir = std::env::temp_dir().join(format!("embers-ivfpq-sizes-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let good = dir.join("good.safetensors");
    index.save(&good).unwrap();
    let r = embers::checkpoint::CheckpointReader::open(&good).unwrap();
    let mut w = embers::checkpoint::CheckpointWriter::new();
    for (k, v) in r.names_of_metadata() {
        w.set_metadata(k, v);
    }
    for name in r.names() {
        if name != "list_sizes" {
            w.add_tensor(&name, &r.read_tensor(&name).unwrap()).unwrap();
        }
    }
    let sizes = [i64::MAX, i64::MAX, 2, 300];
    w.add("list_sizes", &[4], &sizes).unwrap();
    let bad = dir.join("sizes.safetensors");
    w.write(&bad).unwrap();
    let e = IvfPqIndex::load(&bad).unwrap_err().to_string();
    assert!(
        e.contains("sizes.safetensors") && e.contains("list sizes"),
        "{e}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}
