//! Weak scaling of a table-wise sharded DLRM across MPI processes (`cargo bench --bench
//! dist_dlrm --features mpi`): the model of `benches/dlrm.rs` (26 tables × 100k rows, D=64,
//! bottom MLP 13-512-256-64, top MLP 512-512-256-1, fused row-wise Adagrad on the tables,
//! Adagrad on the dense half), its tables placed table-wise round-robin over the ranks (what
//! embers-plan gives for equal tables with table-wise sharding), the dense half data-parallel
//! (gradients all-reduced). Every rank trains on its own batch of `B` samples (weak scaling:
//! the global batch grows with the ranks) with one thread (`RAYON_NUM_THREADS=1`).
//!
//! The driver launches `mpiexec -n W` of itself for each world size in
//! `EMBERS_DIST_BENCH_WORLDS` (default `1,2,4`), `EMBERS_DIST_BENCH_ROUNDS` (3) interleaved
//! rounds each (a world larger than the cores once), and prints, per W, the median round: the
//! step time, the global samples/s, the efficiency `T(1)/T(W)` (one rank's step time over W
//! ranks'; 1.0 is perfect weak scaling), and the bytes each rank sent in one step beside the minimum for the
//! plan (each id once to the rank that holds its table, each pooled row once to its sample's
//! rank and its gradient once back, the dense gradients' reduce-scatter + all-gather). At W=1
//! it also times the same model with an unsharded collection (the cost of the sharded path);
//! at W>1, interleaved with the sharded steps, every rank trains that unsharded model on its
//! own batch at the same time with no communication (what W processes get from the machine
//! before any exchange). At W>1 it also times each pair of comm codecs (forward / backward:
//! FP16/BF16, BF16, FP8, INT8 row-wise) interleaved with FP32 in the same rounds, with the
//! embedding bytes each sends per step; and the training pipeline against the same steps one
//! after the other, without and with 20 ms injected into the input distribution (a slow
//! network), with the fraction of the input distribution it hid behind compute.
//!
//! Not criterion: criterion times one process, this times W of them in lockstep. Side by side
//! with TorchRec's DistributedModelParallel on the same model: `benches/peers/dist_dlrm.sh`.
//! Env: `EMBERS_DIST_BENCH_STEPS` (default 20), `EMBERS_DIST_BENCH_BATCH` (512),
//! `EMBERS_DIST_BENCH_ROWS` (100000).

use std::collections::BTreeMap;
use std::process::Command;
use std::time::{Duration, Instant};

use embers::distributed::{
    all_reduce_mean_gradients, mpi_world, Comm, CommPrecision, PipelineBatch, Placement,
    QCommsConfig, ShardedEmbeddingBagCollection, ShardingPlan, TableShape, TrainPipeline,
};
use embers::embedding::{EmbeddingBagCollection, EmbeddingBagConfig, FusedOptimizer};
use embers::models::DlrmDense;
use embers::nn::Module;
use embers::optim::{Adagrad, Optimizer};
use embers::sparse::{KeyedJaggedTensor, KeyedTensor};
use embers::tensor::rng::seeded;
use embers::tensor::Reduction;
use embers::{DType, Tensor};
use rand::Rng;
use rand_distr::StandardNormal;

const D: usize = 64;
const F: usize = 26;
const DENSE: usize = 13;

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if let Some(i) = args.iter().position(|a| a == "--rank-child") {
        let world: usize = args[i + 1].parse().expect("world size");
        if let Err(e) = child(world) {
            eprintln!("{e}");
            std::process::exit(1);
        }
        return;
    }
    driver();
}

/// What each rank of one run reported, by (rank, name).
type RankResults = BTreeMap<(usize, String), f64>;

/// One rank's result line: `RESULT <rank> <what> <value>`.
fn result(rank: usize, what: &str, value: impl std::fmt::Display) {
    println!("RESULT {rank} {what} {value}");
}

fn driver() {
    let Some(mpiexec) = ["mpiexec", "mpirun"].into_iter().find(|exe| {
        Command::new(exe)
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success())
    }) else {
        println!("SKIP: no mpiexec (Debian: mpich libmpich-dev libclang-dev)");
        return;
    };
    let me = std::env::current_exe().expect("the bench's path");
    let worlds: Vec<usize> = std::env::var("EMBERS_DIST_BENCH_WORLDS")
        .unwrap_or_else(|_| "1,2,4".into())
        .split(',')
        .map(|w| {
            w.trim()
                .parse()
                .expect("EMBERS_DIST_BENCH_WORLDS: e.g. 1,2,4")
        })
        .collect();
    let (b, rows) = (
        env_usize("EMBERS_DIST_BENCH_BATCH", 512),
        env_usize("EMBERS_DIST_BENCH_ROWS", 100_000),
    );
    println!(
        "== embers TW-sharded DLRM, B={b} per rank, D={D}, {F} tables x {rows} rows, one thread per rank"
    );
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let rounds = env_usize("EMBERS_DIST_BENCH_ROUNDS", 3);
    // Interleaved rounds (W=1, W=2, W=1, W=2, ...; oversubscribed worlds once, last): the
    // machine drifts between runs, so each figure is the median round.
    let mut order: Vec<usize> = Vec::new();
    for round in 0..rounds {
        order.extend(worlds.iter().filter(|&&w| w <= cores || round == 0));
    }
    order.sort_by_key(|&w| w > cores);
    let mut runs: BTreeMap<usize, Vec<RankResults>> = BTreeMap::new();
    for w in order {
        let out = Command::new(mpiexec)
            .args(["-n", &w.to_string()])
            .arg(&me)
            .args(["--rank-child", &w.to_string()])
            .env("RAYON_NUM_THREADS", "1")
            .env("MPIEXEC_TIMEOUT", "1200")
            .output()
            .expect("mpiexec runs");
        let stdout = String::from_utf8_lossy(&out.stdout);
        if !out.status.success() {
            panic!(
                "W={w}: exit {:?}\n{stdout}\n{}",
                out.status.code(),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        let mut per_rank = RankResults::new();
        for line in stdout.lines() {
            let parts: Vec<&str> = line.split_whitespace().collect();
            if let ["RESULT", rank, what, value] = parts[..] {
                per_rank.insert(
                    (rank.parse().unwrap(), what.to_string()),
                    value.parse().unwrap(),
                );
            }
        }
        // Ranks step in lockstep (the collectives): the slowest rank's median is the step.
        let step = (0..w)
            .filter_map(|r| per_rank.get(&(r, "step_ms".to_string())).copied())
            .fold(0.0f64, f64::max);
        println!("  round: W={w} {step:.1} ms/step");
        runs.entry(w).or_default().push(per_rank);
    }
    let median = |w: usize, rank: usize, what: &str| -> Option<f64> {
        let mut v: Vec<f64> = (runs.get(&w)?.iter())
            .filter_map(|r| r.get(&(rank, what.to_string())).copied())
            .collect();
        v.sort_by(f64::total_cmp);
        v.get(v.len() / 2).copied()
    };
    let step_ms = |w: usize| -> f64 {
        let mut v: Vec<f64> = (runs[&w].iter())
            .map(|r| {
                (0..w)
                    .filter_map(|k| r.get(&(k, "step_ms".to_string())).copied())
                    .fold(0.0f64, f64::max)
            })
            .collect();
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let t1 = runs.contains_key(&1).then(|| step_ms(1));
    let unsharded = median(1, 0, "unsharded_step_ms");
    for &w in runs.keys() {
        let ms = step_ms(w);
        let note = if w > cores {
            format!(" (oversubscribed: {w} ranks on {cores} cores, correctness only)")
        } else {
            format!(" (median of {} rounds)", runs[&w].len())
        };
        println!(
            "W={w}: {ms:.1} ms/step, {:.0} samples/s{note}",
            (w * b) as f64 / (ms / 1e3)
        );
        if w == 1 {
            if let Some(u) = unsharded {
                println!("     unsharded collection, same model, 1 thread: {u:.1} ms/step");
            }
            continue;
        }
        if let Some(t1) = t1 {
            print!("     weak-scaling efficiency T(1)/T({w}): {:.2}", t1 / ms);
            if let Some(u) = unsharded {
                print!(" (against the unsharded single process: {:.2})", u / ms);
            }
            println!();
        }
        let alone = (0..w)
            .filter_map(|r| median(w, r, "independent_step_ms"))
            .fold(0.0f64, f64::max);
        if alone > 0.0 {
            print!("     {w} independent unsharded processes at once, no communication: {alone:.1} ms/step");
            if let Some(u) = unsharded {
                print!(
                    " (the machine's own ceiling on the efficiency: {:.2})",
                    u / alone
                );
            }
            println!();
        }
        let (sent, min) = (0..w).fold((0.0, 0.0), |(s, m), r| {
            (
                s + median(w, r, "sparse_bytes").unwrap_or(0.0),
                m + median(w, r, "sparse_min_bytes").unwrap_or(0.0),
            )
        });
        let dense = median(w, 0, "dense_bytes").unwrap_or(0.0);
        let dense_min = median(w, 0, "dense_min_bytes").unwrap_or(0.0);
        println!(
            "     bytes sent per step, all ranks: embeddings {:.2} MB (minimum {:.2} MB, x{:.3}); \
             rank 0's dense all-reduce {:.2} MB (minimum {:.2} MB)",
            sent / 1e6,
            min / 1e6,
            sent / min,
            dense / 1e6,
            dense_min / 1e6
        );
        let slowest = |what: &str| {
            (0..w)
                .filter_map(|r| median(w, r, what))
                .fold(0.0f64, f64::max)
        };
        for delay in ["0ms", "20ms"] {
            let off = slowest(&format!("pipeline_off_{delay}.step_ms"));
            let on = slowest(&format!("pipeline_on_{delay}.step_ms"));
            let hidden = (0..w)
                .filter_map(|r| median(w, r, &format!("pipeline_on_{delay}.hidden")))
                .fold(1.0f64, f64::min);
            println!(
                "     pipeline, {delay} injected into the input distribution: sequential \
                 {off:.1} ms/step, pipelined {on:.1} ms/step ({:.1} ms shorter; at least \
                 {:.0}% of the input distribution hidden on every rank)",
                off - on,
                hidden * 100.0
            );
        }
        let fp32 = slowest("codec_step_ms.FP32/FP32");
        for name in CODECS.map(|(n, _)| n) {
            let ms = slowest(&format!("codec_step_ms.{name}"));
            let bytes: f64 = (0..w)
                .filter_map(|r| median(w, r, &format!("codec_sparse_bytes.{name}")))
                .sum();
            println!(
                "     comms {name} (forward/backward): {ms:.1} ms/step ({:.2}x FP32's {fp32:.1} \
                 in the same rounds), embeddings {:.2} MB/step",
                fp32 / ms,
                bytes / 1e6
            );
        }
    }
}

/// The tables: `t<i>` read by feature `f<i>`.
fn configs(rows: usize) -> Vec<EmbeddingBagConfig> {
    (0..F)
        .map(|i| EmbeddingBagConfig::new(format!("t{i}"), rows, D, &[&format!("f{i}")]))
        .collect()
}

/// A rank's 8 batches: dense features, one id per feature per sample, labels.
fn batches(rank: usize, b: usize, rows: usize) -> Vec<(Tensor, KeyedJaggedTensor, Tensor)> {
    let mut rng = seeded(100 + rank as u64);
    (0..8)
        .map(|_| {
            let dense: Vec<f32> = (0..b * DENSE).map(|_| rng.sample(StandardNormal)).collect();
            let ids: Vec<i64> = (0..F * b)
                .map(|_| rng.random_range(0..rows as i64))
                .collect();
            let labels: Vec<f32> = (0..b).map(|_| rng.random_range(0..2) as f32).collect();
            let kjt = KeyedJaggedTensor::from_lengths(
                (0..F).map(|i| format!("f{i}")).collect(),
                Tensor::from_vec(ids, &[F * b]).unwrap(),
                Tensor::from_vec(vec![1i64; F * b], &[F * b]).unwrap(),
                None,
                Some(b),
            )
            .unwrap();
            (
                Tensor::from_vec(dense, &[b, DENSE]).unwrap(),
                kjt,
                Tensor::from_vec(labels, &[b, 1]).unwrap(),
            )
        })
        .collect()
}

/// DLRM after the lookup: bottom MLP 13-512-256-64, dot interaction, top MLP 512-512-256-1.
fn dense_half() -> embers::Result<DlrmDense> {
    DlrmDense::dot(
        DENSE,
        &[512, 256, D],
        F,
        &[512, 512, 256, 1],
        DType::F32,
        &mut seeded(7),
    )
}

type Lookup<'a> = &'a dyn Fn(&KeyedJaggedTensor) -> embers::Result<KeyedTensor>;

/// Times `steps` training steps (after 3 warm-up steps): the median step in ms.
fn time_steps(
    lookup: Lookup<'_>,
    comm: Option<&Comm>,
    steps: usize,
    b: usize,
    data: &[(Tensor, KeyedJaggedTensor, Tensor)],
) -> embers::Result<f64> {
    let dense = dense_half()?;
    let params = dense.parameters();
    let mut opt = Adagrad::new(params.clone(), 0.01, 0.0)?;
    let mut times = Vec::new();
    for i in 0..steps + 3 {
        let (x, kjt, y) = &data[i % data.len()];
        let start = Instant::now();
        let pooled = lookup(kjt)?;
        let embedded = pooled.values().reshape(&[b, F, D])?;
        let logits = dense.forward(x, &embedded)?;
        let loss = logits.bce_with_logits(y, None, Reduction::Mean)?;
        loss.backward()?;
        if let Some(comm) = comm {
            all_reduce_mean_gradients(comm, &params)?;
        }
        opt.step()?;
        opt.zero_grad();
        if i >= 3 {
            times.push(start.elapsed().as_secs_f64() * 1e3);
        }
    }
    times.sort_by(f64::total_cmp);
    Ok(times[times.len() / 2])
}

fn child(world: usize) -> embers::Result<()> {
    let comm = mpi_world()?;
    if comm.size() != world {
        return Err(embers::Error::Distributed(format!(
            "launched as rank {} of {}, expected {world} ranks (is this mpiexec the MPI embers \
             was built against?)",
            comm.rank(),
            comm.size()
        )));
    }
    let rank = comm.rank();
    let steps = env_usize("EMBERS_DIST_BENCH_STEPS", 20);
    let b = env_usize("EMBERS_DIST_BENCH_BATCH", 512);
    let rows = env_usize("EMBERS_DIST_BENCH_ROWS", 100_000);
    let optimizer = FusedOptimizer::RowWiseAdagrad {
        lr: 0.01,
        eps: 1e-8,
    };
    let shapes: Vec<TableShape> = (0..F)
        .map(|i| TableShape::new(format!("t{i}"), rows, D))
        .collect();
    let names: Vec<String> = (0..F).map(|i| format!("t{i}")).collect();
    let placements: Vec<(&str, Placement)> = (0..F)
        .map(|i| (names[i].as_str(), Placement::TableWise { rank: i % world }))
        .collect();
    let plan = ShardingPlan::construct(&shapes, &placements, world, world)?;
    let data = batches(rank, b, rows);

    let sharded = ShardedEmbeddingBagCollection::new(configs(rows), &plan, optimizer, comm, 1)?;
    let comm = sharded.comm();
    let sharded_step = || time_steps(&|kjt| sharded.forward(kjt), Some(comm), steps, b, &data);
    let ms = if world == 1 {
        // Interleaved with the unsharded collection, three rounds each: the median round.
        let ebc = EmbeddingBagCollection::new(configs(rows), optimizer, &mut seeded(1))?;
        let (mut mine, mut theirs) = (Vec::new(), Vec::new());
        for _ in 0..3 {
            theirs.push(time_steps(&|kjt| ebc.forward(kjt), None, steps, b, &data)?);
            mine.push(sharded_step()?);
        }
        theirs.sort_by(f64::total_cmp);
        mine.sort_by(f64::total_cmp);
        result(rank, "unsharded_step_ms", theirs[1]);
        mine[1]
    } else {
        // Interleaved with every rank training an unsharded collection on its own batch with
        // no communication at all, at the same time: what W processes get from this machine
        // (its shared memory bandwidth and caches) before any exchange.
        let ebc = EmbeddingBagCollection::new(configs(rows), optimizer, &mut seeded(1))?;
        let (mut mine, mut alone) = (Vec::new(), Vec::new());
        for _ in 0..3 {
            comm.barrier("bench.sync")?;
            alone.push(time_steps(&|kjt| ebc.forward(kjt), None, steps, b, &data)?);
            comm.barrier("bench.sync")?;
            mine.push(sharded_step()?);
        }
        alone.sort_by(f64::total_cmp);
        mine.sort_by(f64::total_cmp);
        result(rank, "independent_step_ms", alone[1]);
        mine[1]
    };
    result(rank, "step_ms", ms);

    // One more step, counted.
    comm.reset_bytes();
    time_steps(&|kjt| sharded.forward(kjt), Some(comm), 1, b, &data[..1])?;
    // time_steps ran 4 steps (3 warm-up): bytes per step are a quarter.
    let bytes = comm.bytes();
    let dense_bytes = bytes
        .iter()
        .filter(|(op, _)| op.starts_with("all_reduce"))
        .map(|(_, b)| b.sent)
        .sum::<u64>() as f64
        / 4.0;
    let sparse_bytes = bytes
        .iter()
        .filter(|(op, _)| !op.starts_with("all_reduce"))
        .map(|(_, b)| b.sent)
        .sum::<u64>() as f64
        / 4.0;
    // The minimum: this rank's ids of tables elsewhere (8 bytes each, the KJT's i64), the
    // pooled rows of its tables for other ranks' samples and the gradients of its samples'
    // rows from other ranks' tables (4 bytes a value).
    let owned = (0..F).filter(|i| i % world == rank).count();
    let remote = F - owned;
    let sparse_min =
        (b * remote * 8) as f64 + ((world - 1) * b * owned * D * 4 + b * remote * D * 4) as f64;
    let params: usize = dense_half()?.parameters().iter().map(|p| p.numel()).sum();
    let dense_min = 2.0 * (world - 1) as f64 / world as f64 * params as f64 * 4.0;
    result(rank, "sparse_bytes", sparse_bytes);
    result(rank, "sparse_min_bytes", sparse_min);
    result(rank, "dense_bytes", dense_bytes);
    result(rank, "dense_min_bytes", dense_min);
    for (op, b) in &bytes {
        println!("rank {rank} {op}: {} bytes sent in 4 steps", b.sent);
    }

    // The pipeline: sequential and pipelined steps, without and with a 20 ms delay injected
    // into the input distribution, interleaved.
    if world > 1 {
        let mut times: BTreeMap<String, Vec<(f64, f64)>> = BTreeMap::new();
        for _ in 0..3 {
            for delay_ms in [0u64, 20] {
                for pipelined in [false, true] {
                    let mut pipeline = TrainPipeline::new(&sharded)?
                        .with_input_delay(Duration::from_millis(delay_ms));
                    if !pipelined {
                        pipeline = pipeline.sequential();
                    }
                    comm.barrier("bench.sync")?;
                    let (ms, hidden) = time_pipeline(&sharded, &pipeline, steps, b, &data)?;
                    let name = format!(
                        "pipeline_{}_{delay_ms}ms",
                        if pipelined { "on" } else { "off" }
                    );
                    times.entry(name).or_default().push((ms, hidden));
                }
            }
        }
        for (name, mut t) in times {
            t.sort_by(|a, b| a.0.total_cmp(&b.0));
            result(rank, &format!("{name}.step_ms"), t[1].0);
            result(rank, &format!("{name}.hidden"), t[1].1);
        }
    }

    // The quantized comms: each codec pair interleaved with FP32 in the same rounds.
    if world > 1 {
        let mut times: BTreeMap<&str, Vec<f64>> = BTreeMap::new();
        for _ in 0..3 {
            for (name, q) in CODECS {
                sharded.set_qcomms(q)?;
                comm.barrier("bench.sync")?;
                let ms = time_steps(&|kjt| sharded.forward(kjt), Some(comm), steps, b, &data)?;
                times.entry(name).or_default().push(ms);
            }
        }
        for (name, q) in CODECS {
            let t = times.get_mut(name).expect("timed");
            t.sort_by(f64::total_cmp);
            result(rank, &format!("codec_step_ms.{name}"), t[1]);
            sharded.set_qcomms(q)?;
            comm.reset_bytes();
            time_steps(&|kjt| sharded.forward(kjt), Some(comm), 1, b, &data[..1])?;
            let sparse: u64 = (comm.bytes().iter())
                .filter(|(op, _)| !op.starts_with("all_reduce"))
                .map(|(_, b)| b.sent)
                .sum();
            result(
                rank,
                &format!("codec_sparse_bytes.{name}"),
                sparse as f64 / 4.0,
            );
        }
    }
    Ok(())
}

/// A batch for the pipeline.
struct Sample(Tensor, KeyedJaggedTensor, Tensor);

impl PipelineBatch for Sample {
    fn sparse(&self) -> &KeyedJaggedTensor {
        &self.1
    }
}

/// Runs `steps` training steps (after 3 warm-up steps) through `pipeline`: the mean step in ms
/// and the fraction of the input distribution hidden behind compute.
fn time_pipeline(
    sharded: &ShardedEmbeddingBagCollection,
    pipeline: &TrainPipeline,
    steps: usize,
    b: usize,
    data: &[(Tensor, KeyedJaggedTensor, Tensor)],
) -> embers::Result<(f64, f64)> {
    let dense = dense_half()?;
    let params = dense.parameters();
    let mut opt = Adagrad::new(params.clone(), 0.01, 0.0)?;
    let batches = |n: usize| {
        (0..n).map(|i| {
            let (x, kjt, y) = &data[i % data.len()];
            Ok(Sample(x.clone(), kjt.clone(), y.clone()))
        })
    };
    let mut step = |batch: &Sample, pooled: KeyedTensor| -> embers::Result<()> {
        let embedded = pooled.values().reshape(&[b, F, D])?;
        let logits = dense.forward(&batch.0, &embedded)?;
        let loss = logits.bce_with_logits(&batch.2, None, Reduction::Mean)?;
        loss.backward()?;
        all_reduce_mean_gradients(sharded.comm(), &params)?;
        opt.step()?;
        opt.zero_grad();
        Ok(())
    };
    pipeline.run(batches(3), &mut step)?;
    let start = Instant::now();
    let report = pipeline.run(batches(steps), &mut step)?;
    let ms = start.elapsed().as_secs_f64() * 1e3 / steps as f64;
    Ok((ms, report.hidden_fraction()))
}

/// The comm codecs timed at W > 1: forward / backward precisions.
const CODECS: [(&str, QCommsConfig); 5] = {
    use CommPrecision::*;
    [
        ("FP32/FP32", QCommsConfig::new(Fp32, Fp32)),
        ("FP16/BF16", QCommsConfig::new(Fp16, Bf16)),
        ("BF16/BF16", QCommsConfig::new(Bf16, Bf16)),
        ("FP8/FP8", QCommsConfig::new(Fp8, Fp8)),
        ("INT8/INT8", QCommsConfig::new(Int8, Int8)),
    ]
};
