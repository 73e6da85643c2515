//! DLRM training throughput in the configuration of `benches/peers/dlrm.py`: B=512, D=64,
//! 26 tables × 100k rows, bottom MLP 13-512-256-64, top MLP 512-512-256-1, fused row-wise
//! Adagrad (lr 0.01) on the tables, Adagrad (lr 0.01) on the dense half, random dense
//! features, uniform ids (one per feature) and random labels, 8 pre-built batches cycled.
//!
//! After criterion's run a summary prints samples/s (from the median step time of a separate
//! timed loop) and the process's peak RSS. `EMBERS_DLRM_QUICK=1` skips criterion.
//! Side by side with TorchRec: `benches/peers/dlrm.sh`.

use std::time::{Duration, Instant};

use criterion::Criterion;
use embers::embedding::FusedOptimizer;
use embers::tensor::rng::seeded;
use embers::train::{Batch, DenseOptimizer, DlrmConfig, DlrmTrainer};
use rand::Rng;
use rand_distr::StandardNormal;

const B: usize = 512;
const D: usize = 64;
const E: usize = 100_000;
const F: usize = 26;

fn trainer() -> DlrmTrainer {
    DlrmConfig {
        num_dense: 13,
        sparse_features: (0..F).map(|i| (format!("f{i}"), E)).collect(),
        embedding_dim: D,
        dense_arch: vec![512, 256],
        over_arch: vec![512, 512, 256],
        tasks: vec!["click".to_string()],
        dcn: None,
        dense_optimizer: DenseOptimizer::Adagrad { lr: 0.01 },
        sparse_optimizer: FusedOptimizer::RowWiseAdagrad {
            lr: 0.01,
            eps: 1e-8,
        },
        seed: 0,
        metrics_window: 100 * B,
        device: device(),
    }
    .build()
    .expect("valid config")
}

/// The device from `EMBERS_DLRM_DEVICE` (default: the CPU).
fn device() -> embers::Device {
    std::env::var("EMBERS_DLRM_DEVICE")
        .map(|d| d.parse().expect("EMBERS_DLRM_DEVICE: cpu, cuda or cuda:N"))
        .unwrap_or_default()
}

fn batches() -> Vec<Batch> {
    let mut rng = seeded(0);
    (0..8)
        .map(|_| {
            let dense: Vec<f32> = (0..B * 13).map(|_| rng.sample(StandardNormal)).collect();
            let ids: Vec<i64> = (0..F * B).map(|_| rng.random_range(0..E as i64)).collect();
            let labels: Vec<f32> = (0..B).map(|_| rng.random_range(0..2) as f32).collect();
            Batch::from_parts(
                dense,
                13,
                (0..F).map(|i| format!("f{i}")).collect(),
                ids,
                vec![1; F * B],
                labels,
                1,
            )
            .expect("valid batch")
        })
        .collect()
}

fn peak_rss_mib() -> Option<f64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    Some(line.split_whitespace().nth(1)?.parse::<f64>().ok()? / 1024.0)
}

fn main() {
    let data = batches();
    let mut t = trainer();
    let mut i = 0;
    let mut step = |t: &mut DlrmTrainer| {
        t.train_step(&data[i % data.len()]).expect("step");
        i += 1;
    };
    for _ in 0..3 {
        step(&mut t);
    }
    if std::env::var_os("EMBERS_DLRM_QUICK").is_none() {
        let mut criterion = Criterion::default()
            .configure_from_args()
            .sample_size(30)
            .measurement_time(Duration::from_secs(15));
        criterion.bench_function("dlrm train step B=512 D=64 26x100k", |b| {
            b.iter(|| step(&mut t))
        });
        criterion.final_summary();
    }
    // Summary: median of 30 steps (after 3 more warm-up steps).
    for _ in 0..3 {
        step(&mut t);
    }
    let mut times: Vec<Duration> = (0..30)
        .map(|_| {
            let start = Instant::now();
            step(&mut t);
            start.elapsed()
        })
        .collect();
    times.sort();
    let median = times[times.len() / 2];
    println!("\n== summary");
    println!(
        "embers DLRM {} B={B} D={D} E={E} tables={F}: {:.0} samples/s ({:.1} ms/step, median of 30)",
        device(),
        B as f64 / median.as_secs_f64(),
        median.as_secs_f64() * 1e3
    );
    if let Some(rss) = peak_rss_mib() {
        println!("peak RSS {rss:.0} MiB");
    }
}
