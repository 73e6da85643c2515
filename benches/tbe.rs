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
//! The limit it reports each figure against is the gather roofline of the figure's own id trace
//! and row width (`gather_roofline`): the time all threads need just to read those rows, laid out
//! as the tables are, with rows kept in flight by software prefetch on huge pages and nothing
//! done with them but adding their words. A kernel's time over it is the fraction of the memory
//! system it uses. The sequential read bandwidth is printed beside it for scale.

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

/// The gather roofline of one id trace: the shortest time found in which all threads read
/// every row the trace names (rows of `row_bytes`, laid out as the TBE lays them out: T tables
/// of E rows, one after another, on huge pages) and do nothing with them but add their words
/// into registers. Threads take shares of 2048 consecutive lookups and keep rows in flight
/// with software prefetch; distances of 0–64 rows, into L1 or into L2 only, are tried and the
/// fastest kept (median of 10 passes each). No pooling kernel that reads these rows can finish
/// sooner: its time over this one is the fraction of the memory system it uses. For Zipf ids
/// the roofline includes the cache hits the trace's repeats earn, exactly as the kernel does.
#[derive(Clone, Copy)]
struct Roofline {
    time: Duration,
    row_bytes: usize,
    distance: usize,
    l2: bool,
}

fn gather_roofline(shape: Shape, row_bytes: usize, ids: &[i64]) -> Roofline {
    use rayon::prelude::*;
    let words = row_bytes.div_ceil(4);
    let mut table = embers::embedding::RowBuffer::<f32>::zeros(shape.t * shape.e * words)
        .expect("allocate gather table");
    for (i, x) in table.iter_mut().enumerate() {
        *x = (i % 7) as f32;
    }
    let table = &table[..];
    let per_table = shape.b * shape.l;
    let starts: Vec<usize> = ids
        .iter()
        .enumerate()
        .map(|(k, &id)| ((k / per_table) * shape.e + id as usize) * words)
        .collect();
    // Shares of 2048 rows, so work stealing keeps every thread busy to the end of a pass (a
    // VM's thread can stall for a while; half the trace per thread would wait on it).
    let pass = |distance: usize, l2: bool| {
        starts
            .par_chunks(2048)
            .map(|chunk| gather_sum(table, chunk, words, distance, l2))
            .reduce(|| 0, u32::wrapping_add)
    };
    let mut best: Option<Roofline> = None;
    for l2 in [false, true] {
        for distance in [0, 2, 4, 8, 16, 32, 64] {
            let time = median_time(10, || {
                black_box(pass(distance, l2));
            });
            if best.as_ref().is_none_or(|b| time < b.time) {
                best = Some(Roofline {
                    time,
                    row_bytes,
                    distance,
                    l2,
                });
            }
        }
    }
    best.expect("at least one variant ran")
}

/// Sums the rows starting at `starts` (each `words` long) with `distance` rows prefetched ahead;
/// compiled for AVX2 where the CPU has it, so the adds are never the limit.
fn gather_sum(table: &[f32], starts: &[usize], words: usize, distance: usize, l2: bool) -> u32 {
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx2") {
        #[target_feature(enable = "avx2")]
        unsafe fn avx2(t: &[f32], s: &[usize], w: usize, d: usize, l2: bool) -> u32 {
            gather_sum_body(t, s, w, d, l2)
        }
        // SAFETY: the CPU has AVX2 (checked above); the body is safe code.
        return unsafe { avx2(table, starts, words, distance, l2) };
    }
    gather_sum_body(table, starts, words, distance, l2)
}

#[inline(always)]
fn gather_sum_body(
    table: &[f32],
    starts: &[usize],
    words: usize,
    distance: usize,
    l2: bool,
) -> u32 {
    // Integer adds of the words' bits: one cycle each and independent across the 64 lanes, so
    // neither their latency nor a row's last partial block (quantized rows) can be the limit.
    let mut acc = [0u32; 64];
    for (k, &start) in starts.iter().enumerate() {
        if distance > 0 {
            if let Some(&next) = starts.get(k + distance) {
                prefetch_row(&table[next..next + words], l2);
            }
        }
        let mut blocks = table[start..start + words].chunks_exact(64);
        for block in &mut blocks {
            for (a, x) in acc.iter_mut().zip(block) {
                *a = a.wrapping_add(x.to_bits());
            }
        }
        for (a, x) in acc.iter_mut().zip(blocks.remainder()) {
            *a = a.wrapping_add(x.to_bits());
        }
    }
    acc.iter().fold(0, |s, &a| s.wrapping_add(a))
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
#[inline(always)]
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
    // Measured first and freed, so their buffers do not add to the peak RSS of the TBE runs.
    let fp32_roofs: Vec<Roofline> = inputs
        .iter()
        .map(|(_, (ids, _))| gather_roofline(shape, 4 * shape.d, ids))
        .collect();
    let mut roofs: Vec<(String, Roofline)> = Vec::new();
    // A buffer 8× a large L3 at least, at most the table set (or 4 GiB).
    let table_set = shape.t * shape.e * shape.d * 4;
    let stream = read_bandwidth(table_set.clamp(256 << 20, 4 << 30));
    let rss_before = current_rss_mib();
    // (line, median time, bytes per parameter, the roofline time of the rows it reads)
    let mut summary: Vec<(String, Duration, f64, Option<Duration>)> = Vec::new();

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
    for ((dist, (ids, offsets)), roof) in inputs.iter().zip(&fp32_roofs) {
        roofs.push((format!("fp32 rows, {dist} ids"), *roof));
        let roof = Some(roof.time);
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
        summary.push((format!("embers fp32 fwd {dist}"), t, 4.0, roof));
        // The same into a reused buffer (what a serving loop does; the line above allocates
        // its output every call, as nn.EmbeddingBag and FBGEMM do).
        let mut reused = vec![0.0f32; shape.b * shape.t * shape.d];
        let t = median_time(20, || tbe.forward_into(input, &mut reused).unwrap());
        summary.push((
            format!("embers fp32 fwd into reused buffer {dist}"),
            t,
            4.0,
            roof,
        ));
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
        summary.push((
            format!("embers fp32 fwd+bwd(rwAdagrad) {dist}"),
            t,
            4.0,
            roof,
        ));
        // Breakdown: the fused backward alone, on raw slices.
        let grad = vec![1.0f32; shape.b * shape.t * shape.d];
        let t = median_time(10, || {
            black_box(tbe.backward_fused(input, &grad).unwrap());
        });
        summary.push((format!("  (of which fused bwd alone) {dist}"), t, 4.0, roof));
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
        // The roofline of rows of this type's width (FP32's was measured above), measured before
        // the tables exist so its buffer does not count in their memory overhead.
        let type_roofs: Vec<Roofline> = if ty == WeightType::Fp32 {
            fp32_roofs.clone()
        } else {
            inputs
                .iter()
                .map(|(_, (ids, _))| gather_roofline(shape, ty.row_bytes(shape.d), ids))
                .collect()
        };
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
        for ((dist, (ids, offsets)), roof) in inputs.iter().zip(type_roofs) {
            if ty != WeightType::Fp32 {
                roofs.push((format!("{name} rows, {dist} ids"), roof));
            }
            let roof = Some(roof.time);
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
            summary.push((format!("embers {name} inference fwd {dist}"), t, bpp, roof));
            let t = median_time(20, || q.forward_into(input, &mut out).unwrap());
            summary.push((
                format!("embers {name} inference fwd into reused buffer {dist}"),
                t,
                bpp,
                roof,
            ));
        }
    }

    println!("\n== summary (median; GB/s counts rows read + output written, like tbe.py)");
    for (name, t, bpp, _) in &summary {
        report(name, shape, *t, *bpp);
    }
    println!(
        "memory limit: sequential read {stream:.2} GB/s (all threads, huge pages, {} MiB)",
        table_set.clamp(256 << 20, 4 << 30) >> 20
    );
    for (what, roof) in &roofs {
        let rows = shape.lookups() as f64 * roof.row_bytes as f64;
        println!(
            "gather roofline, {what}: {:.2} ms = {:.2} GB/s of {} B rows (prefetch {} rows \
             ahead into {})",
            roof.time.as_secs_f64() * 1e3,
            rows / roof.time.as_secs_f64() / 1e9,
            roof.row_bytes,
            roof.distance,
            if roof.l2 { "L2" } else { "L1" }
        );
    }
    // Every line as a fraction of the roofline of the rows it reads: the time to gather them
    // over the time it took. The fused backward reads each row and writes it back (3 row passes
    // with its forward, 2 alone); a pass that writes is counted at the gather's read rate, so
    // those fractions are upper bounds.
    println!("fraction of the gather roofline (its time over the line's, row passes counted):");
    for (name, t, _, roof) in &summary {
        let Some(roof) = roof else { continue };
        let passes = if name.contains("fwd+bwd") {
            3.0
        } else if name.contains("bwd") {
            2.0
        } else {
            1.0
        };
        println!(
            "  {name:44} {:3.0}% of the roofline",
            100.0 * passes * roof.as_secs_f64() / t.as_secs_f64()
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
