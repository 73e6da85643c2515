//! Inference tables bigger than their DRAM cache: the lookup throughput of a quantized TBE whose
//! rows live in a file behind a cache of the same byte form
//! (`QuantizedTableBatchedEmbedding::new_cached`, the file four times the cache at the default
//! load factor 0.25), beside the same tables fully in RAM, on Zipf(1.1) ids. Interleaved batch
//! by batch so drift hits both alike; each weight type in turn (INT8, INT4, FP16).
//!
//! Reported per type: median ms per batch of each, their ratio, the miss rate (distinct ids),
//! rows read from the file per batch, and the time of the misses' reads alone (the rate of
//! random one-row copies out of the mapping, which the page cache holds here).
//!
//! `EMBERS_CACHE_SHAPE="T B D E L"` changes the shape (default `8 2048 64 1000000 20`),
//! `EMBERS_CACHE_LOAD_FACTOR` the cache (0.25), `EMBERS_CACHE_ZIPF` the skew (1.1),
//! `EMBERS_CACHE_POLICY` the policy (`lru` or `lfu`), `EMBERS_CACHE_DIR` where the files go (the
//! temp dir), `EMBERS_CACHE_BATCHES="W N"` the warm-up and timed batches (default 50 40),
//! `EMBERS_CACHE_TYPES` the weight types (default `int8 int4 fp16`).
//!
//! `EMBERS_CACHE_DEVICE=cuda` runs on GPU 0 instead: the cache in the GPU's memory, beside the
//! same tables all in the GPU's memory (each lookup ending in a device synchronize);
//! `EMBERS_CACHE_DIR=memory` keeps the rows in host memory the GPU reads in place rather than in
//! a file (FBGEMM's `MANAGED_CACHING` for inference).

use std::time::Instant;

use embers::embedding::{
    CacheConfig, CachePolicy, CacheSize, PoolingMode, QuantizedTableBatchedEmbedding, TableSpec,
    TbeInput, WeightType,
};
use embers::tensor::rng::seeded;
use rand::Rng as _;

#[path = "support/cache_bench.rs"]
mod cache_bench;

use cache_bench::{env_f64, median};

fn env_usizes(name: &str) -> Vec<usize> {
    std::env::var(name)
        .unwrap_or_default()
        .split_whitespace()
        .filter_map(|a| a.parse().ok())
        .collect()
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let [t, b, d, e, l] = match env_usizes("EMBERS_CACHE_SHAPE")[..] {
        [t, b, d, e, l] => [t, b, d, e, l],
        _ => [8, 2048, 64, 1_000_000, 20],
    };
    let clf = env_f64("EMBERS_CACHE_LOAD_FACTOR", 0.25);
    let s = env_f64("EMBERS_CACHE_ZIPF", 1.1);
    let (warm, timed) = match env_usizes("EMBERS_CACHE_BATCHES")[..] {
        [w, n] if n > 0 => (w, n),
        _ => (50, 40),
    };
    let policy = match std::env::var("EMBERS_CACHE_POLICY").as_deref() {
        Ok("lfu") => CachePolicy::Lfu,
        _ => CachePolicy::Lru,
    };
    let types: Vec<WeightType> = std::env::var("EMBERS_CACHE_TYPES")
        .unwrap_or_else(|_| "int8 int4 fp16".into())
        .split_whitespace()
        .map(|n| WeightType::from_fbgemm_name(&n.to_ascii_uppercase()).expect("a weight type"))
        .collect();
    let (device, gpu) = cache_bench::device_from_env();
    let in_memory = std::env::var("EMBERS_CACHE_DIR").is_ok_and(|d| d == "memory");
    let dir = std::env::var("EMBERS_CACHE_DIR")
        .ok()
        .filter(|d| d != "memory")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(std::env::temp_dir)
        .join(format!(
            "embers-quantized-cache-bench-{}",
            std::process::id()
        ));
    std::fs::create_dir_all(&dir).unwrap();
    println!(
        "inference tables: T={t} B={b} D={d} E={e} L={l}, Zipf({s}) ids, cache load factor \
         {clf}, {}, on {device:?}, rows {}",
        policy.name(),
        if in_memory {
            "in host memory".to_string()
        } else {
            format!("in files under {}", dir.display())
        }
    );

    let batches = cache_bench::zipf_batches(warm + timed, [t, b, l], e, s, 7);

    for ty in types {
        let tables: Vec<TableSpec> = (0..t)
            .map(|i| TableSpec::new(format!("t{i}"), e, d))
            .collect();
        let types = vec![ty; t];
        let map: Vec<usize> = (0..t).collect();
        let mut in_ram = QuantizedTableBatchedEmbedding::new(
            tables.clone(),
            types.clone(),
            map.clone(),
            PoolingMode::Sum,
        )
        .unwrap();
        let size = CacheSize::LoadFactor(clf);
        let cache = if in_memory {
            CacheConfig::in_host_memory(size)
        } else {
            CacheConfig::new(dir.join("rows.bin"), size)
        }
        .with_policy(policy);
        let mut cached = QuantizedTableBatchedEmbedding::new_cached(
            tables,
            types,
            map,
            PoolingMode::Sum,
            &cache,
        )
        .unwrap();
        // The same rows in both, written a chunk at a time.
        let t0 = Instant::now();
        let chunk = 65_536;
        let mut fill = seeded(1);
        for table in 0..t {
            for first in (0..e).step_by(chunk) {
                let n = chunk.min(e - first);
                let values: Vec<f32> = (0..n * d)
                    .map(|_| fill.random_range(-0.05f32..0.05))
                    .collect();
                in_ram.quantize_rows_from(table, first, &values).unwrap();
                cached.quantize_rows_from(table, first, &values).unwrap();
            }
        }
        in_ram.to_device(device).unwrap();
        cached.to_device(device).unwrap();
        let file_bytes = (t * e * ty.row_bytes(d)) as f64;
        println!(
            "\n{}: rows of {} B; in RAM {:.0} MiB; cached {:.0} MiB ({:.2} of the {:.0} MiB \
             file); written in {:.1} s",
            ty.fbgemm_name(),
            ty.row_bytes(d),
            in_ram.allocated_bytes() as f64 / (1 << 20) as f64,
            cached.allocated_bytes() as f64 / (1 << 20) as f64,
            cached.allocated_bytes() as f64 / file_bytes,
            file_bytes / (1 << 20) as f64,
            t0.elapsed().as_secs_f64()
        );
        let mut out = vec![0.0f32; b * t * d];
        let mut run = |q: &QuantizedTableBatchedEmbedding,
                       (ids, offsets): &(Vec<i64>, Vec<i64>)| {
            let t0 = Instant::now();
            let input = TbeInput::new(&ids[..], &offsets[..]);
            match &gpu {
                // The output stays on the GPU, as a model's next layer would take it.
                Some(g) => {
                    q.forward(input).unwrap();
                    g.synchronize().unwrap();
                }
                None => q.forward_into(input, &mut out).unwrap(),
            }
            t0.elapsed().as_secs_f64() * 1e3
        };
        for batch in &batches[..warm] {
            run(&in_ram, batch);
            run(&cached, batch);
        }
        cached.reset_cache_stats();
        let (mut a, mut c) = (Vec::new(), Vec::new());
        for (i, batch) in batches[warm..].iter().enumerate() {
            // Alternate which goes first.
            if i % 2 == 0 {
                a.push(run(&in_ram, batch));
                c.push(run(&cached, batch));
            } else {
                c.push(run(&cached, batch));
                a.push(run(&in_ram, batch));
            }
        }
        let stats = cached.cache_stats().unwrap();
        let sum = |f: fn(&embers::embedding::CacheStats) -> u64| stats.iter().map(f).sum::<u64>();
        let (unique, misses, read) = (
            sum(|s| s.unique_ids),
            sum(|s| s.unique_misses),
            sum(|s| s.rows_read),
        );
        let (ma, mc) = (median(a), median(c));
        let mem = if gpu.is_some() { "HBM" } else { "RAM" };
        println!(
            "  lookup: all in {mem} {ma:.2} ms, cached {mc:.2} ms per batch: cached / all in {mem} \
             throughput {:.2}",
            ma / mc
        );
        println!(
            "  miss rate {:.3} (distinct ids); {:.0} rows read from the file per batch, {} \
             conflict misses",
            misses as f64 / unique.max(1) as f64,
            read as f64 / timed as f64,
            sum(|s| s.conflict_misses)
        );
        drop(cached);
        let _ = std::fs::remove_file(dir.join("rows.bin"));
    }
    let _ = std::fs::remove_dir_all(&dir);
}
