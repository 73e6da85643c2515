//! Tables bigger than their DRAM cache: training throughput of a TBE whose rows live in a file
//! behind a cache of a quarter of the file (`TableBatchedEmbedding::new_cached`, the file four
//! times the DRAM budget), beside the same tables fully in RAM, on Zipf(1.1) ids; fused
//! row-wise Adagrad, forward + backward. Interleaved batch by batch so drift hits both alike.
//!
//! Reported: median ms per batch of each, their ratio, the miss rate, rows read from and
//! written back to the file per batch, and the limit misses run into: the rate of random
//! one-record copies out of this file's mapping (the page cache holds it here; on a disk that
//! does not fit in RAM, page faults to the disk would set it), and how much of the row files
//! and their logs the kernel maps through huge pages.
//!
//! `EMBERS_CACHE_SHAPE="T B D E L"` changes the shape (default `8 2048 64 1000000 20`),
//! `EMBERS_CACHE_LOAD_FACTOR` the cache (default 0.25), `EMBERS_CACHE_ZIPF` the skew (1.1),
//! `EMBERS_CACHE_POLICY` the policy (`lru`, the default, or `lfu`), `EMBERS_CACHE_DIR` where the
//! file goes (default the temp dir; `memory`: the rows in anonymous host memory, no file).
//!
//! `EMBERS_CACHE_BATCHES="W N"` warms up on W batches and times N (default 100 40).
//! `EMBERS_CACHE_DEVICE=cuda` runs the GPU placements instead (GPU 0): rows in host memory
//! (the file, through the page cache) behind an HBM cache (FBGEMM's `MANAGED_CACHING`), beside
//! the same tables all in HBM, and all of them in managed memory the GPU reads in place
//! (FBGEMM's `MANAGED`, the planner's `fused_uvm`); each step ends with a device synchronize.

use std::time::Instant;

use embers::embedding::{
    CacheConfig, CachePolicy, CacheSize, EmbeddingInit, FusedOptimizer, PoolingMode,
    TableBatchedEmbedding, TableSpec, TbeConfig, TbeInput,
};
use embers::tensor::rng::seeded;
use embers::Tensor;
use rand::Rng as _;

#[path = "support/cache_bench.rs"]
mod cache_bench;

use cache_bench::{env_f64, median};

struct Batch {
    ids: Vec<i64>,
    offsets: Vec<i64>,
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let nums: Vec<usize> = std::env::var("EMBERS_CACHE_SHAPE")
        .unwrap_or_default()
        .split_whitespace()
        .filter_map(|a| a.parse().ok())
        .collect();
    let [t, b, d, e, l] = match nums[..] {
        [t, b, d, e, l] => [t, b, d, e, l],
        _ => [8, 2048, 64, 1_000_000, 20],
    };
    let clf = env_f64("EMBERS_CACHE_LOAD_FACTOR", 0.25);
    let s = env_f64("EMBERS_CACHE_ZIPF", 1.1);
    let in_memory = std::env::var("EMBERS_CACHE_DIR").as_deref() == Ok("memory");
    let dir = std::env::var("EMBERS_CACHE_DIR")
        .ok()
        .filter(|_| !in_memory)
        .map(std::path::PathBuf::from)
        .unwrap_or_else(std::env::temp_dir)
        .join(format!("embers-cache-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let tables: Vec<TableSpec> = (0..t)
        .map(|i| TableSpec::new(format!("t{i}"), e, d))
        .collect();
    let optimizer = FusedOptimizer::RowWiseAdagrad {
        lr: 0.01,
        eps: 1e-8,
    };
    let cfg = TbeConfig::one_feature_per_table(tables, PoolingMode::Sum, optimizer);
    let file_bytes = (t * e * (d + 1) * 4) as f64;
    println!(
        "tables: T={t} B={b} D={d} E={e} L={l}, row-wise Adagrad, Zipf({s}) ids; file {:.0} MiB, \
         cache load factor {clf}, {}",
        file_bytes / (1 << 20) as f64,
        std::env::var("EMBERS_CACHE_POLICY").unwrap_or_else(|_| "lru".into())
    );

    let (device, gpu) = cache_bench::device_from_env();
    let sync = || {
        if let Some(g) = &gpu {
            g.synchronize().unwrap();
        }
    };
    println!(
        "placement: {}",
        match &gpu {
            Some(g) => format!(
                "{}: all rows in HBM vs an HBM cache over host rows",
                g.name()
            ),
            None => "host: all rows in RAM vs a DRAM cache over a file".into(),
        }
    );
    let mem = if gpu.is_some() { "in HBM" } else { "in RAM" };
    let in_ram = TableBatchedEmbedding::new_on(cfg.clone(), device).unwrap();
    let policy = match std::env::var("EMBERS_CACHE_POLICY").as_deref() {
        Ok("lfu") => CachePolicy::Lfu,
        _ => CachePolicy::Lru,
    };
    let rows_in = |name: &str| match in_memory {
        true => CacheConfig::in_host_memory(CacheSize::LoadFactor(clf)),
        false => CacheConfig::new(dir.join(name), CacheSize::LoadFactor(clf)),
    };
    println!(
        "rows: {}",
        match in_memory {
            true => "in anonymous host memory".to_string(),
            false => format!("in files under {}", dir.display()),
        }
    );
    let cache = rows_in("rows.bin").with_policy(policy);
    let cached = TableBatchedEmbedding::new_cached_on(cfg.clone(), cache, device).unwrap();
    // The same cache, each batch's successor prefetched once its backward is queued (FBGEMM's
    // pipeline, one host thread; on a GPU the admission runs on the device's prefetch stream,
    // beside the backward).
    let prefetch_cache = rows_in("rows-prefetch.bin").with_policy(policy);
    let prefetching =
        TableBatchedEmbedding::new_cached_on(cfg.clone(), prefetch_cache, device).unwrap();
    // On a GPU, also the same prefetch on the caller's stream (after the backward, not beside
    // it): what the prefetch stream's overlap is worth, in the same run.
    let serial = gpu.as_ref().map(|_| {
        let cache = rows_in("rows-serial.bin")
            .with_policy(policy)
            .with_prefetch_on_side_stream(false);
        TableBatchedEmbedding::new_cached_on(cfg.clone(), cache, device).unwrap()
    });
    // On a GPU, also the planner's `fused_uvm`: every row in managed memory, read in place.
    let managed = gpu
        .as_ref()
        .map(|_| TableBatchedEmbedding::new_managed(cfg, device).unwrap());
    let init = EmbeddingInit::Uniform {
        low: -0.01,
        high: 0.01,
    };
    in_ram.init_weights(init, &mut seeded(1)).unwrap();
    let t0 = Instant::now();
    cached.init_weights(init, &mut seeded(1)).unwrap();
    prefetching.init_weights(init, &mut seeded(1)).unwrap();
    if let Some(p) = &serial {
        p.init_weights(init, &mut seeded(1)).unwrap();
    }
    if let Some(m) = &managed {
        m.init_weights(init, &mut seeded(1)).unwrap();
    }
    // On the disk before the batches start: the kernel's write-back of the freshly written
    // files would otherwise run through the timed batches, a one-time cost counted as training.
    for c in [Some(&cached), Some(&prefetching), serial.as_ref()]
        .into_iter()
        .flatten()
    {
        c.flush().unwrap();
    }
    println!(
        "memory: {mem} {:.0} MiB, cached {:.0} MiB ({:.2} of the file); file written in {:.1} s",
        in_ram.allocated_bytes() as f64 / (1 << 20) as f64,
        cached.allocated_bytes() as f64 / (1 << 20) as f64,
        cached.allocated_bytes() as f64 / file_bytes,
        t0.elapsed().as_secs_f64()
    );

    if !in_memory {
        // Whether the kernel maps the row files and their logs through huge pages (the host
        // caches do where they stay in memory and the file system has large folios).
        let (pmd, rss) = mapped_kib(&dir);
        println!(
            "row files and logs mapped: {:.0} MiB resident, {:.0} MiB of it through huge pages",
            rss as f64 / 1024.0,
            pmd as f64 / 1024.0
        );
    }

    // The limit measurement's random offsets.
    let mut rng = seeded(8);
    // `EMBERS_CACHE_BATCHES="warm timed"` (default 100 40).
    let counts: Vec<usize> = std::env::var("EMBERS_CACHE_BATCHES")
        .unwrap_or_default()
        .split_whitespace()
        .filter_map(|a| a.parse().ok())
        .collect();
    let (warm, timed) = match counts[..] {
        [w, n] if n > 0 => (w, n),
        _ => (100, 40),
    };
    // Ids: Zipf over ranks, scattered over the table by a multiplicative hash.
    let batches: Vec<Batch> = cache_bench::zipf_batches(warm + timed, [t, b, l], e, s, 7)
        .into_iter()
        .map(|(ids, offsets)| Batch { ids, offsets })
        .collect();
    let grad = (Tensor::from_vec(vec![0.001f32; b * t * d], &[b, t * d]).unwrap())
        .to_device(device)
        .unwrap();
    // Milliseconds of prepare (the cache's admission), lookup and fused backward.
    // With `next`, its rows are prefetched after the backward is queued (counted in the
    // backward); on a GPU whose cache prefetches on its own stream, also the timeline of
    // that backward and that admission (GPU timestamps, ms from the step's start: the
    // backward's start and end on the caller's stream, the admission's on the prefetch
    // stream).
    let mark = || gpu.as_ref().map(|g| g.record_event().unwrap());
    let step_with = |tbe: &TableBatchedEmbedding,
                     batch: &Batch,
                     next: Option<&Batch>|
     -> ([f64; 3], Option<[f64; 4]>) {
        let t0 = Instant::now();
        let origin = mark();
        let input = TbeInput::new(&batch.ids[..], &batch.offsets[..]);
        let prepared = tbe.prepare(input).unwrap();
        let t1 = Instant::now();
        let out = tbe.lookup_batch(&prepared).unwrap();
        std::hint::black_box(&out);
        sync();
        let t2 = Instant::now();
        let backward_start = mark();
        tbe.backward_batch(&prepared, &grad).unwrap();
        let backward_end = mark();
        if let Some(n) = next {
            tbe.prefetch(TbeInput::new(&n.ids[..], &n.offsets[..]))
                .unwrap();
        }
        let span = tbe.take_prefetch_span();
        sync();
        let t3 = Instant::now();
        let timeline = match (origin, backward_start, backward_end, span) {
            (Some(o), Some(b0), Some(b1), Some([p0, p1])) => {
                Some([&b0, &b1, &p0, &p1].map(|e| o.elapsed_ms(e).unwrap()))
            }
            _ => None,
        };
        (
            [t1 - t0, t2 - t1, t3 - t2].map(|d| d.as_secs_f64() * 1e3),
            timeline,
        )
    };
    let step = |tbe: &TableBatchedEmbedding, batch: &Batch| step_with(tbe, batch, None).0;
    for (i, batch) in batches[..warm].iter().enumerate() {
        step(&in_ram, batch);
        step(&cached, batch);
        let _ = step_with(&prefetching, batch, batches.get(i + 1));
        if let Some(p) = &serial {
            let _ = step_with(p, batch, batches.get(i + 1));
        }
        if let Some(m) = &managed {
            step(m, batch);
        }
    }
    cached.reset_cache_stats();
    let (mut ram_ms, mut cache_ms, mut prefetch_ms) = (Vec::new(), Vec::new(), Vec::new());
    let (mut managed_ms, mut serial_ms, mut timelines) = (Vec::new(), Vec::new(), Vec::new());
    for (i, batch) in batches.iter().enumerate().skip(warm) {
        ram_ms.push(step(&in_ram, batch));
        cache_ms.push(step(&cached, batch));
        let (ms, timeline) = step_with(&prefetching, batch, batches.get(i + 1));
        prefetch_ms.push(ms);
        timelines.extend(timeline);
        if let Some(p) = &serial {
            serial_ms.push(step_with(p, batch, batches.get(i + 1)).0);
        }
        if let Some(m) = &managed {
            managed_ms.push(step(m, batch));
        }
    }
    let stats = cached.cache_stats().unwrap();
    let times = cached.cache_times().unwrap();
    let sum = |f: fn(&embers::embedding::CacheStats) -> u64| stats.iter().map(f).sum::<u64>();
    let (ids, uniq, miss, conflicts) = (
        sum(|s| s.requested_ids),
        sum(|s| s.unique_ids),
        sum(|s| s.unique_misses),
        sum(|s| s.conflict_misses),
    );
    let (read, written) = (sum(|s| s.rows_read), sum(|s| s.rows_written));
    let total = |v: &[[f64; 3]]| median(v.iter().map(|p| p.iter().sum()).collect());
    let part = |v: &[[f64; 3]], i: usize| median(v.iter().map(|p| p[i]).collect());
    let (ram, cache, pre) = (total(&ram_ms), total(&cache_ms), total(&prefetch_ms));
    // Means too: a batch that folds the row file's write log into it (every few hundred
    // batches a table) is one slow batch, which a median leaves out.
    let mean =
        |v: &[[f64; 3]]| v.iter().map(|p| p.iter().sum::<f64>()).sum::<f64>() / v.len() as f64;
    let record = ((d + 1) * 4) as f64;
    println!(
        "fwd+bwd median: {mem} {ram:.2} ms, cached {cache:.2} ms: cached at {:.2} of {mem} \
         throughput ({:.2} M lookups/s vs {:.2})",
        ram / cache,
        (t * b * l) as f64 / cache / 1e3,
        (t * b * l) as f64 / ram / 1e3,
    );
    println!(
        "  means: {mem} {:.2} ms, cached {:.2} ms ({:.2}), slowest cached batch {:.2} ms",
        mean(&ram_ms),
        mean(&cache_ms),
        mean(&ram_ms) / mean(&cache_ms),
        cache_ms
            .iter()
            .map(|p| p.iter().sum::<f64>())
            .fold(0.0, f64::max),
    );
    println!(
        "  prepare / lookup / backward medians: {mem} {:.2} / {:.2} / {:.2} ms, cached {:.2} / \
         {:.2} / {:.2} ms",
        part(&ram_ms, 0),
        part(&ram_ms, 1),
        part(&ram_ms, 2),
        part(&cache_ms, 0),
        part(&cache_ms, 1),
        part(&cache_ms, 2),
    );
    println!(
        "  prefetching the next batch once each backward is queued: {pre:.2} ms ({:.2} of \
         {mem}; mean {:.2} ms, {:.2}); prepare / lookup / backward+prefetch medians {:.2} / \
         {:.2} / {:.2} ms",
        ram / pre,
        mean(&prefetch_ms),
        mean(&ram_ms) / mean(&prefetch_ms),
        part(&prefetch_ms, 0),
        part(&prefetch_ms, 1),
        part(&prefetch_ms, 2),
    );
    if !timelines.is_empty() {
        // Per batch: the admission's time beside the backward, and its whole time.
        let beside = |[b0, b1, p0, p1]: [f64; 4]| (b1.min(p1) - b0.max(p0)).max(0.0);
        let at = |i: usize| median(timelines.iter().map(|t| t[i]).collect());
        println!(
            "  prefetch timeline (GPU timestamps, medians of {} batches, ms from the step's \
             start): backward {:.2}–{:.2} on the caller's stream, the next batch's admission \
             {:.2}–{:.2} on the prefetch stream; the admission ran beside the backward for \
             {:.2} of its {:.2} ms (median {:.0}% a batch); first timed batch {:.2?}",
            timelines.len(),
            at(0),
            at(1),
            at(2),
            at(3),
            median(timelines.iter().map(|&t| beside(t)).collect()),
            median(timelines.iter().map(|t| t[3] - t[2]).collect()),
            100.0
                * median(
                    (timelines.iter())
                        .map(|&t| beside(t) / (t[3] - t[2]).max(1e-9))
                        .collect()
                ),
            timelines[0],
        );
    }
    if !serial_ms.is_empty() {
        let p = total(&serial_ms);
        println!(
            "  the same prefetch on the caller's stream (after the backward, not beside it): \
             {p:.2} ms ({:.2} of {mem}); backward+prefetch median {:.2} ms",
            ram / p,
            part(&serial_ms, 2),
        );
    }
    if !managed_ms.is_empty() {
        let m = total(&managed_ms);
        println!(
            "  every row in managed memory (fused_uvm, FBGEMM's MANAGED): {m:.2} ms ({:.2} of \
             {mem}); lookup / backward medians {:.2} / {:.2} ms",
            ram / m,
            part(&managed_ms, 1),
            part(&managed_ms, 2),
        );
    }
    let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3 / timed as f64;
    // A host cache moves its rows while its directories admit them (in `directory`).
    let directory = match gpu.is_some() {
        true => "directory",
        false => "directory and row moves (made together on the host)",
    };
    println!(
        "  cached admission per batch {:.2} ms: {directory} {:.2} ms, moving rows to and from \
         the store {:.2} ms, transfers and gather/scatter kernels {:.2} ms, the rest (sorting \
         ids into the batch, bookkeeping) {:.2} ms",
        ms(times.admission),
        ms(times.directory),
        ms(times.file),
        ms(times.transfer),
        ms(times.admission - times.directory - times.file - times.transfer),
    );
    println!(
        "per batch: {:.0} ids, {:.0} unique, miss rate {:.4} of unique ids ({:.5} of ids), {:.0} \
         conflict misses; {:.0} rows read ({:.1} MiB) and {:.0} written back ({:.1} MiB)",
        ids as f64 / timed as f64,
        uniq as f64 / timed as f64,
        miss as f64 / uniq as f64,
        miss as f64 / ids as f64,
        conflicts as f64 / timed as f64,
        read as f64 / timed as f64,
        read as f64 * record / timed as f64 / (1 << 20) as f64,
        written as f64 / timed as f64,
        written as f64 * record / timed as f64 / (1 << 20) as f64,
    );

    // The limit misses run into: copying random records out of the mapped file, one thread
    // (as the cache does), the file in the page cache (or out of as much host memory).
    drop((in_ram, cached, prefetching, serial, managed));
    let map: Box<dyn std::ops::Deref<Target = [u8]>> = match in_memory {
        true => Box::new(vec![1u8; file_bytes as usize]),
        false => {
            let file = std::fs::File::open(dir.join("rows.bin")).unwrap();
            // SAFETY: the bench's own file, not resized while mapped.
            Box::new(unsafe { memmap2::Mmap::map(&file) }.unwrap())
        }
    };
    let rows = (t * e) as u64;
    let offsets: Vec<usize> = (0..2_000_000)
        .map(|_| (rng.random_range(0..rows) * record as u64) as usize)
        .collect();
    let mut buf = vec![0u8; record as usize];
    // At most 5 s: with the file on the disk each copy is a page fault.
    let start = Instant::now();
    let mut n = 0;
    for chunk in offsets.chunks(1024) {
        for &at in chunk {
            buf.copy_from_slice(&map[at..at + record as usize]);
            std::hint::black_box(&buf);
        }
        n += chunk.len();
        if start.elapsed().as_secs() >= 5 {
            break;
        }
    }
    let secs = start.elapsed().as_secs_f64();
    let per_batch = (read + written) as f64 / timed as f64;
    println!(
        "limit: random record copies from the rows at {:.1} M/s ({:.0} MB/s), one \
         thread: the batch's {per_batch:.0} reads and write-backs take ≥ {:.2} ms",
        n as f64 / secs / 1e6,
        n as f64 * record / secs / 1e6,
        per_batch / (n as f64 / secs) * 1e3,
    );
    drop(map);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// KiB resident and KiB mapped through huge pages (`Rss`, `FilePmdMapped` of
/// `/proc/self/smaps`) of this process's mappings of files under `dir`; zeros off Linux.
fn mapped_kib(dir: &std::path::Path) -> (u64, u64) {
    let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap_or_default();
    let dir = dir.to_string_lossy();
    let (mut pmd, mut rss, mut ours) = (0, 0, false);
    for line in smaps.lines() {
        let mut words = line.split_whitespace();
        match words.next() {
            Some("FilePmdMapped:") if ours => pmd += kib(words.next()),
            Some("Rss:") if ours => rss += kib(words.next()),
            Some(w) if w.contains('-') && !w.ends_with(':') => ours = line.contains(&*dir),
            _ => {}
        }
    }
    (pmd, rss)
}

/// A `smaps` figure in KiB (0 where there is none).
fn kib(w: Option<&str>) -> u64 {
    w.and_then(|w| w.parse().ok()).unwrap_or(0)
}
