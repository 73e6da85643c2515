//! TBE bench at FBGEMM's benchmark defaults (T=32 B=512 D=128 E=100000 L=20), uniform ids and
//! Zipf(1.15) ids: FP32 forward, forward + backward with fused row-wise Adagrad, and FP16 / INT8
//! / INT4 / FP8 inference forward; plus this machine's random-row gather bandwidth, peak RSS and
//! table memory overhead.
//!
//! After criterion's runs a summary prints one line per measurement in the format of
//! `benches/peers/tbe.py` (median ms, GB/s, M lookups/s) so `benches/peers/tbe.sh` can put the
//! two side by side. `EMBERS_TBE_SHAPE="T B D E L"` changes the shape (criterion refuses extra
//! arguments); `EMBERS_TBE_QUICK=1` skips criterion and prints only the summary;
//! `EMBERS_TBE_FORWARD_ONLY=1` measures the FP32 forward only (for shapes whose training state
//! or quantized copies would not fit beside the tables, e.g. E=1e7).
//!
//! The memory limit it reports is this machine's sequential read bandwidth (all threads, huge
//! pages, a buffer far larger than the caches): no gather of whole rows can read DRAM faster
//! than streaming it. Each figure is given as a fraction of it (rows read; the fused backward
//! also writes every row it reads).

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{Criterion, Throughput};
use embers::embedding::{
    EmbeddingInit, FusedOptimizer, PoolingMode, QuantizedTableBatchedEmbedding,
    TableBatchedEmbedding, TableSpec, TbeConfig, TbeInput, WeightType,
};
use embers::tensor::rng::seeded;
use embers::Tensor;
use rand::Rng as _;
use rand_distr::{Distribution, Zipf};

#[derive(Clone, Copy)]
struct Shape {
    t: usize,
    b: usize,
    d: usize,
    e: usize,
    l: usize,
}

impl Shape {
    fn lookups(&self) -> usize {
        self.t * self.b * self.l
    }
    /// Bytes moved, as tbe.py counts them: rows read plus the f32 output written.
    fn bytes(&self, bytes_per_param: f64) -> f64 {
        self.lookups() as f64 * self.d as f64 * bytes_per_param
            + (self.t * self.b * self.d * 4) as f64
    }
}

fn parse_shape() -> Shape {
    let nums: Vec<usize> = std::env::var("EMBERS_TBE_SHAPE")
        .unwrap_or_default()
        .split_whitespace()
        .filter_map(|a| a.parse().ok())
        .collect();
    if nums.len() >= 5 {
        Shape {
            t: nums[0],
            b: nums[1],
            d: nums[2],
            e: nums[3],
            l: nums[4],
        }
    } else {
        Shape {
            t: 32,
            b: 512,
            d: 128,
            e: 100_000,
            l: 20,
        }
    }
}

fn make_ids(shape: Shape, zipf: bool, seed: u64) -> (Vec<i64>, Vec<i64>) {
    let mut rng = seeded(seed);
    let n = shape.lookups();
    let ids: Vec<i64> = if zipf {
        let dist = Zipf::new(shape.e as f64, 1.15).expect("valid Zipf");
        // Zipf ranks 1..=E; scatter ranks over rows so hot rows are not neighbours.
        let perm = |r: u64| (r.wrapping_mul(0x9E37_79B9_7F4A_7C15) % shape.e as u64) as i64;
        (0..n)
            .map(|_| perm(dist.sample(&mut rng) as u64 - 1))
            .collect()
    } else {
        (0..n)
            .map(|_| rng.random_range(0..shape.e as i64))
            .collect()
    };
    let offsets = (0..=shape.t * shape.b)
        .map(|i| (i * shape.l) as i64)
        .collect();
    (ids, offsets)
}

fn median_time(iters: usize, mut f: impl FnMut()) -> Duration {
    f();
    f();
    let mut times: Vec<Duration> = (0..iters)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed()
        })
        .collect();
    times.sort();
    times[times.len() / 2]
}

fn report(name: &str, shape: Shape, t: Duration, bytes_per_param: f64) {
    let s = t.as_secs_f64();
    println!(
        "{name:32} {:9.2} ms  {:7.2} GB/s  {:8.1} Mlookups/s",
        s * 1e3,
        shape.bytes(bytes_per_param) / s / 1e9,
        shape.lookups() as f64 / s / 1e6
    );
}

/// The gather roofline of this machine: the fastest rate found at which all threads read
/// random whole rows of the bench's size from a table set as large as the bench's (huge
/// pages), summing them. Each thread keeps several rows in flight with software prefetch
/// (distances 0, 4, 8, 16 and 32 rows, into L1 or L2 only, tried; the best kept) and adds rows
/// in register-sized column blocks, so nothing but the memory system limits it. Returns
/// (GB/s, best distance, whether the best prefetched into L2 only).
fn gather_bandwidth(shape: Shape) -> (f64, usize, bool) {
    use rayon::prelude::*;
    let mut table = embers::embedding::RowBuffer::<f32>::zeros(shape.t * shape.e * shape.d)
        .expect("allocate gather table");
    for (i, x) in table.iter_mut().enumerate() {
        *x = (i % 7) as f32;
    }
    let table = &table[..];
    let rows = table.len() / shape.d;
    let (ids, _) = make_ids(
        Shape {
            t: 1,
            b: shape.t * shape.b,
            ..shape
        },
        false,
        99,
    );
    let ids: Vec<usize> = ids.iter().map(|&i| (i as usize * 7919) % rows).collect();
    let d = shape.d;
    let threads = rayon::current_num_threads().max(1);
    let per_thread = ids.len().div_ceil(threads);
    let run = |dist: usize, l2: bool| {
        ids.par_chunks(per_thread)
            .map(|chunk| {
                let mut acc = [0.0f32; 64];
                for (k, &id) in chunk.iter().enumerate() {
                    if dist > 0 {
                        if let Some(&next) = chunk.get(k + dist) {
                            prefetch_row(&table[next * d..(next + 1) * d], l2);
                        }
                    }
                    for block in table[id * d..(id + 1) * d].chunks(64) {
                        for (a, x) in acc.iter_mut().zip(block) {
                            *a += x;
                        }
                    }
                }
                acc.iter().sum::<f32>()
            })
            .sum::<f32>()
    };
    let mut best = (0.0, 0, false);
    for l2 in [false, true] {
        for dist in [0, 4, 8, 16, 32] {
            let t = median_time(10, || {
                black_box(run(dist, l2));
            });
            let rate = (ids.len() * d * 4) as f64 / t.as_secs_f64() / 1e9;
            if rate > best.0 {
                best = (rate, dist, l2);
            }
        }
    }
    best
}

/// This machine's sequential read bandwidth in GB/s: all threads sum contiguous slices of a
/// `bytes`-sized buffer on huge pages (8 independent 16-lane accumulators per thread, so the
/// adds never limit it), median of 10 passes after 2 warm-up passes.
fn read_bandwidth(bytes: usize) -> f64 {
    use rayon::prelude::*;
    let n = bytes / 4;
    let mut buffer = embers::embedding::RowBuffer::<f32>::zeros(n).expect("allocate read buffer");
    for (i, x) in buffer.iter_mut().enumerate() {
        *x = (i % 5) as f32;
    }
    let buffer = &buffer[..];
    let per_thread = n.div_ceil(rayon::current_num_threads().max(1) * 4);
    let t = median_time(10, || {
        let total: f32 = buffer
            .par_chunks(per_thread)
            .map(|chunk| {
                let mut acc = [[0.0f32; 16]; 8];
                let mut blocks = chunk.chunks_exact(128);
                for block in &mut blocks {
                    for (a, lane) in acc.iter_mut().zip(block.chunks_exact(16)) {
                        for (x, y) in a.iter_mut().zip(lane) {
                            *x += y;
                        }
                    }
                }
                let tail: f32 = blocks.remainder().iter().sum();
                acc.iter().flatten().sum::<f32>() + tail
            })
            .sum();
        black_box(total);
    });
    (n * 4) as f64 / t.as_secs_f64() / 1e9
}

/// Starts fetching every cache line of `row`, into L1 or (`l2`) into L2 only.
fn prefetch_row(row: &[f32], l2: bool) {
    #[cfg(target_arch = "x86_64")]
    for line in row.chunks(16) {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0, _MM_HINT_T1};
        let p = line.as_ptr() as *const i8;
        // SAFETY: a prefetch is a hint that never faults; the address lies in `row`.
        unsafe {
            if l2 {
                _mm_prefetch::<_MM_HINT_T1>(p)
            } else {
                _mm_prefetch::<_MM_HINT_T0>(p)
            }
        };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (row, l2);
}

fn proc_status_mib(key: &str) -> Option<f64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with(key))?;
    let kib: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib / 1024.0)
}

fn peak_rss_mib() -> Option<f64> {
    proc_status_mib("VmHWM:")
}

/// Memory backed by transparent huge pages right now.
fn anon_huge_pages_mib() -> Option<f64> {
    let rollup = std::fs::read_to_string("/proc/self/smaps_rollup").ok()?;
    let line = rollup.lines().find(|l| l.starts_with("AnonHugePages:"))?;
    let kib: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib / 1024.0)
}

fn current_rss_mib() -> Option<f64> {
    proc_status_mib("VmRSS:")
}

fn training_tbe(shape: Shape) -> TableBatchedEmbedding {
    let tables = (0..shape.t)
        .map(|t| TableSpec::new(format!("t{t}"), shape.e, shape.d))
        .collect();
    let tbe = TableBatchedEmbedding::new(TbeConfig::one_feature_per_table(
        tables,
        PoolingMode::Sum,
        FusedOptimizer::RowWiseAdagrad {
            lr: 0.01,
            eps: 1e-8,
        },
    ))
    .expect("build TBE");
    tbe.init_weights(EmbeddingInit::TorchRecDefault, &mut seeded(0))
        .expect("init");
    tbe
}

fn main() {
    let shape = parse_shape();
    let quick = std::env::var("EMBERS_TBE_QUICK").is_ok_and(|v| v == "1");
    let forward_only = std::env::var("EMBERS_TBE_FORWARD_ONLY").is_ok_and(|v| v == "1");
    let mut criterion = Criterion::default()
        .sample_size(10)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3))
        .configure_from_args();
    println!(
        "embers TBE bench: T={} B={} D={} E={} L={}, {} rayon threads",
        shape.t,
        shape.b,
        shape.d,
        shape.e,
        shape.l,
        rayon::current_num_threads()
    );
    let inputs = [
        ("uniform", make_ids(shape, false, 0)),
        ("zipf1.15", make_ids(shape, true, 0)),
    ];
    // Measured first and freed, so its buffer does not add to the peak RSS of the TBE runs.
    let gather = gather_bandwidth(shape);
    // A buffer 8× a large L3 at least, at most the table set (or 4 GiB).
    let table_set = shape.t * shape.e * shape.d * 4;
    let stream = read_bandwidth(table_set.clamp(256 << 20, 4 << 30));
    let rss_before = current_rss_mib();
    let mut summary: Vec<(String, Duration, f64)> = Vec::new();

    // ----- training: FP32 forward, forward + backward with fused row-wise Adagrad ----------
    // Memory overhead measured, not computed: the RSS the process grew by while the tables
    // were built (every row written), over the bytes the rows and optimizer state need.
    let rss_empty = current_rss_mib();
    let tbe = training_tbe(shape);
    let rss_built = current_rss_mib();
    let table_bytes = (shape.t * shape.e * shape.d * 4) as f64;
    let tbe_mib = (table_bytes + (shape.t * shape.e * 4) as f64) / (1 << 20) as f64;
    let overhead = rss_empty
        .zip(rss_built)
        .map(|(a, b)| (b - a) / tbe_mib - 1.0);
    for (dist, (ids, offsets)) in &inputs {
        let input = TbeInput::new(&ids[..], &offsets[..]);
        if !quick {
            let mut g = criterion.benchmark_group(format!("tbe_fp32_{dist}"));
            g.throughput(Throughput::Bytes(shape.bytes(4.0) as u64));
            g.bench_function("forward", |b| {
                b.iter(|| black_box(tbe.lookup(input).unwrap()))
            });
            g.finish();
        }
        let t = median_time(20, || {
            black_box(tbe.lookup(input).unwrap());
        });
        summary.push((format!("embers fp32 fwd {dist}"), t, 4.0));
        // The same into a reused buffer (what a serving loop does; the line above allocates
        // its output every call, as nn.EmbeddingBag and FBGEMM do).
        let mut reused = vec![0.0f32; shape.b * shape.t * shape.d];
        let t = median_time(20, || tbe.forward_into(input, &mut reused).unwrap());
        summary.push((format!("embers fp32 fwd into reused buffer {dist}"), t, 4.0));
        if forward_only {
            continue;
        }

        let ids_t = Tensor::from_vec(ids.clone(), &[ids.len()]).unwrap();
        let off_t = Tensor::from_vec(offsets.clone(), &[offsets.len()]).unwrap();
        let ones = Tensor::ones(
            &[shape.b, shape.t * shape.d],
            embers::DType::F32,
            embers::Device::Cpu,
        );
        let fwd_bwd = || {
            let out = tbe.forward(&ids_t, &off_t, None).unwrap();
            out.backward_with(&ones, false).unwrap();
        };
        if !quick {
            let mut g = criterion.benchmark_group(format!("tbe_fp32_{dist}"));
            g.bench_function("forward_backward_rowwise_adagrad", |b| b.iter(fwd_bwd));
            g.finish();
        }
        let t = median_time(10, fwd_bwd);
        summary.push((format!("embers fp32 fwd+bwd(rwAdagrad) {dist}"), t, 4.0));
        // Breakdown: the fused backward alone, on raw slices.
        let grad = vec![1.0f32; shape.b * shape.t * shape.d];
        let t = median_time(10, || {
            black_box(tbe.backward_fused(input, &grad).unwrap());
        });
        summary.push((format!("  (of which fused bwd alone) {dist}"), t, 4.0));
    }
    let rss_with_tbe = current_rss_mib();
    let huge_with_tbe = anon_huge_pages_mib();
    drop(tbe);

    // ----- inference: FP16 / INT8 / INT4 / FP8 ---------------------------------------------
    let source = {
        let mut rng = seeded(1);
        (0..shape.e * shape.d)
            .map(|_| rng.random_range(-0.05f32..0.05))
            .collect::<Vec<f32>>()
    };
    let mut inference_overhead = Vec::new();
    let types = [
        (WeightType::Fp32, 4.0),
        (WeightType::Fp16, 2.0),
        (WeightType::Int8, 1.0),
        (WeightType::Int4, 0.5),
        (WeightType::Fp8, 1.0),
    ];
    for (ty, bpp) in types.into_iter().filter(|_| !forward_only) {
        let tables: Vec<TableSpec> = (0..shape.t)
            .map(|t| TableSpec::new(format!("t{t}"), shape.e, shape.d))
            .collect();
        let rss_empty = current_rss_mib();
        let mut q = QuantizedTableBatchedEmbedding::new(
            tables,
            vec![ty; shape.t],
            (0..shape.t).collect(),
            PoolingMode::Sum,
        )
        .unwrap();
        for t in 0..shape.t {
            q.quantize_table_from(t, &source).unwrap();
        }
        let stored_mib = (shape.t * shape.e * ty.row_bytes(shape.d)) as f64 / (1 << 20) as f64;
        if let (Some(a), Some(b)) = (rss_empty, current_rss_mib()) {
            inference_overhead.push((ty, (b - a) / stored_mib - 1.0));
        }
        let name = ty.fbgemm_name().to_ascii_lowercase();
        for (dist, (ids, offsets)) in &inputs {
            let ids32: Vec<i32> = ids.iter().map(|&i| i as i32).collect();
            let off32: Vec<i32> = offsets.iter().map(|&i| i as i32).collect();
            let input = TbeInput::new(&ids32[..], &off32[..]);
            let mut out = vec![0.0f32; shape.b * shape.t * shape.d];
            if !quick {
                let mut g = criterion.benchmark_group(format!("tbe_{name}_{dist}"));
                g.throughput(Throughput::Bytes(shape.bytes(bpp) as u64));
                g.bench_function("inference_forward", |b| {
                    b.iter(|| q.forward_into(input, &mut out).unwrap())
                });
                g.finish();
            }
            // Allocating its output every call, as FBGEMM does (the like-for-like figure), and
            // into a reused buffer (what a serving loop does).
            let t = median_time(20, || {
                black_box(q.forward(input).unwrap());
            });
            summary.push((format!("embers {name} inference fwd {dist}"), t, bpp));
            let t = median_time(20, || q.forward_into(input, &mut out).unwrap());
            summary.push((
                format!("embers {name} inference fwd into reused buffer {dist}"),
                t,
                bpp,
            ));
        }
    }

    println!("\n== summary (median; GB/s counts rows read + output written, like tbe.py)");
    for (name, t, bpp) in &summary {
        report(name, shape, *t, *bpp);
    }
    let (gathered, best_distance, l2) = gather;
    let limit = stream.max(gathered);
    println!(
        "memory limit: sequential read {stream:.2} GB/s (all threads, huge pages, {} MiB); a \
         plain gather of random {} B rows (prefetch {best_distance} rows ahead into {}) reaches \
         {gathered:.2} GB/s of rows",
        table_set.clamp(256 << 20, 4 << 30) >> 20,
        shape.d * 4,
        if l2 { "L2" } else { "L1" }
    );
    // Every line as a fraction of the limit, counting the row bytes it must move: rows read
    // (at their stored width), and for the fused backward rows read and written back.
    println!("fraction of the memory limit ({limit:.2} GB/s), row bytes moved:");
    for (name, t, bpp) in &summary {
        let passes = if name.contains("bwd") { 2.0 } else { 1.0 };
        let passes = if name.contains("fwd+bwd") {
            3.0
        } else {
            passes
        };
        let row_bytes = shape.lookups() as f64 * shape.d as f64 * bpp * passes;
        let rate = row_bytes / t.as_secs_f64() / 1e9;
        println!(
            "  {name:44} rows at {rate:6.2} GB/s = {:3.0}% of the limit",
            100.0 * rate / limit
        );
    }
    if let Some(o) = overhead {
        println!(
            "fp32 tables + row-wise Adagrad state: {tbe_mib:.1} MiB; RSS grew by {:.2}% more \
             while they were built (page rounding, allocator, index buffers)",
            o * 100.0
        );
    }
    if let (Some(before), Some(with)) = (rss_before, rss_with_tbe) {
        // Everything the process grew by while the TBE lived (tables, state, outputs, ids,
        // autograd buffers) over the bytes the tables and state need.
        println!(
            "RSS growth with the training TBE alive: {:.1} MiB = {:.2}% over tables + state",
            with - before,
            ((with - before) / tbe_mib - 1.0) * 100.0
        );
    }
    for (ty, o) in inference_overhead {
        println!(
            "{} tables: RSS grew by {:.2}% more than the packed rows while they were built",
            ty.fbgemm_name(),
            o * 100.0
        );
    }
    if let Some(h) = huge_with_tbe {
        println!(
            "transparent huge pages backing the process with the training TBE alive: {h:.1} MiB"
        );
    }
    if let Some(rss) = peak_rss_mib() {
        println!("peak RSS {rss:.1} MiB");
    }
    if !quick {
        criterion.final_summary();
    }
}
