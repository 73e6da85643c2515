//! What saving and loading a checkpoint costs in memory and time: the peak resident memory
//! (`VmHWM`) of a process that builds one table with its row-wise Adagrad state, then saves it
//! (`TableBatchedEmbedding::save`) or loads it (`load`), beside a process that only builds it;
//! and a process whose table lives in a row file behind a DRAM cache of a tenth of its rows,
//! loading the same checkpoint (tables saved as tensors, read into a new row file). Each case
//! runs in a process of its own, so each peak is its own.
//!
//! Reported per case: seconds, the file's bytes over those seconds, and the peak memory above
//! the process that only builds the table (what the checkpoint costs; the least possible is
//! about nothing, the table already being in memory). The save ends with an fsync: its rate is
//! bounded by the disk's write rate; the load reads a file the save just wrote (in the page
//! cache), bounded by a memory copy.
//!
//! `EMBERS_CKPT_SHAPE="E D"` changes the table (default `4000000 64`: 1 GiB of weights),
//! `EMBERS_CKPT_DIR` where the files go (default the temp dir).

use std::process::Command;
use std::time::Instant;

use embers::embedding::{
    CacheConfig, CacheSize, EmbeddingInit, FusedOptimizer, PoolingMode, TableBatchedEmbedding,
    TableSpec, TbeConfig,
};
use embers::tensor::rng::seeded;

const CHILD: &str = "EMBERS_CKPT_CHILD";

fn shape() -> (usize, usize) {
    let nums: Vec<usize> = std::env::var("EMBERS_CKPT_SHAPE")
        .unwrap_or_default()
        .split_whitespace()
        .filter_map(|a| a.parse().ok())
        .collect();
    match nums[..] {
        [e, d] => (e, d),
        _ => (4_000_000, 64),
    }
}

fn dir() -> std::path::PathBuf {
    std::env::var("EMBERS_CKPT_DIR")
        .map(Into::into)
        .unwrap_or_else(|_| std::env::temp_dir())
        .join(format!("embers-ckpt-memory-{}", std::process::id()))
}

/// This process's peak resident memory in KiB.
fn peak_kib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
    (status.lines())
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmHWM")
}

/// One case, in this (child) process: prints `peak_kib seconds`.
fn child(case: &str, dir: &std::path::Path) {
    let (e, d) = shape();
    let cfg = TbeConfig::new(
        vec![TableSpec::new("t", e, d)],
        vec![0],
        PoolingMode::Sum,
        FusedOptimizer::RowWiseAdagrad { lr: 0.1, eps: 1e-8 },
    );
    let ckpt = dir.join("table.safetensors");
    let tbe = if case.starts_with("cached") {
        let cache = CacheConfig::new(dir.join("rows.bin"), CacheSize::LoadFactor(0.1));
        TableBatchedEmbedding::new_cached(cfg, cache).unwrap()
    } else {
        TableBatchedEmbedding::new(cfg).unwrap()
    };
    // Every page of the table touched, as in a trained model.
    let init = EmbeddingInit::Uniform {
        low: -0.1,
        high: 0.1,
    };
    tbe.init_weights(init, &mut seeded(1)).unwrap();
    let start = Instant::now();
    match case {
        "model" | "cached model" => {}
        "save" => tbe.save(&ckpt).unwrap(),
        "load" | "cached load" => tbe.load(&ckpt).unwrap(),
        other => panic!("unknown case {other}"),
    }
    println!("{} {}", peak_kib(), start.elapsed().as_secs_f64());
}

fn run(case: &str, dir: &std::path::Path) -> (f64, f64) {
    let out = Command::new(std::env::current_exe().unwrap())
        .env(CHILD, case)
        .env("EMBERS_CKPT_DIR_CHILD", dir)
        .output()
        .unwrap();
    assert!(out.status.success(), "{case}: {out:?}");
    let text = String::from_utf8_lossy(&out.stdout);
    let v: Vec<f64> = (text.lines().last().unwrap_or(""))
        .split_whitespace()
        .map(|x| x.parse().unwrap())
        .collect();
    (v[0] / 1024.0, v[1])
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    if let Ok(case) = std::env::var(CHILD) {
        let dir = std::env::var("EMBERS_CKPT_DIR_CHILD").expect("the parent's directory");
        child(&case, std::path::Path::new(&dir));
        return;
    }
    let (e, d) = shape();
    let dir = dir();
    std::fs::create_dir_all(&dir).unwrap();
    println!("one table of {e} rows x {d} (f32) with row-wise Adagrad state; peaks in MiB");
    let (model, _) = run("model", &dir);
    let (cached_model, _) = run("cached model", &dir);
    let (save_peak, save_s) = run("save", &dir);
    let bytes = std::fs::metadata(dir.join("table.safetensors"))
        .unwrap()
        .len() as f64;
    println!(
        "table in memory: {model:.0} MiB peak; cached (a tenth of the rows): {cached_model:.0} MiB; \
         checkpoint {:.0} MiB",
        bytes / (1 << 20) as f64
    );
    println!("| case | seconds | GB/s of the file | peak above the table alone |");
    println!("|---|---|---|---|");
    let row = |case: &str, peak: f64, base: f64, s: f64| {
        println!(
            "| {case} | {s:.2} | {:.2} | {:.0} MiB |",
            bytes / s / 1e9,
            peak - base
        )
    };
    row("save", save_peak, model, save_s);
    let (load_peak, load_s) = run("load", &dir);
    row("load", load_peak, model, load_s);
    let (cached_peak, cached_s) = run("cached load", &dir);
    row(
        "load into cached tables",
        cached_peak,
        cached_model,
        cached_s,
    );
    let _ = std::fs::remove_dir_all(&dir);
}
