//! `--plan`: the DLRM trained across MPI processes (`mpiexec -n W`), its tables sharded by a
//! plan (`embers-plan`'s JSON, or `auto`: planned here by the planner for W CPU ranks), the
//! dense half data-parallel.
//!
//! Each rank trains on its own slice of the data (batch `i` of the shuffled stream goes to
//! rank `i mod W`; `--batch-size` is per rank) through the training pipeline (loading, input
//! distribution and training of three batches at once; `--no-pipeline` runs them one after
//! the other). Rank 0 shows the progress bar, the validations (global AUC, NE, … over every
//! rank's slice) and the final report, and writes `metrics.json`. Checkpoints go to
//! `<out>/checkpoint/`: the tables as a sharded checkpoint (loadable under any plan and world
//! size), and per rank its dense half, dense optimizer state and metrics; written in
//! `checkpoint.partial/` and renamed, so a crash leaves the previous one. `--resume <dir>`
//! continues bit-identically on the same world size; on another, the tables load under the
//! new plan and the dense half from rank 0's file, the metrics start again.

use std::path::Path;

use embers::{Error, Result};
use serde_json::json;

use crate::Args;
use embers::train::DlrmConfig;

/// The planner's input for this model on `ranks` CPU ranks (one host): the tables, one id
/// per sample and feature, the per-rank batch size and the fused optimizer.
pub fn planner_config(args: &Args, config: &DlrmConfig, ranks: usize) -> serde_json::Value {
    use embers::embedding::FusedOptimizer as F;
    let kind = match config.sparse_optimizer {
        F::Sgd { .. } => "sgd",
        F::Adagrad { .. } => "adagrad",
        F::RowWiseAdagrad { .. } => "row_wise_adagrad",
        F::Adam { .. } => "adam",
        F::PartialRowWiseAdam { .. } => "partial_row_wise_adam",
        F::Lamb { .. } => "lamb",
        F::PartialRowWiseLamb { .. } => "partial_row_wise_lamb",
        F::None => "none",
    };
    let tables: Vec<serde_json::Value> = (config.sparse_features.iter())
        .map(|(f, rows)| {
            json!({
                "name": format!("t_{f}"),
                "rows": rows,
                "dim": config.embedding_dim,
                "features": [{ "name": f, "pooling_factor": 1.0 }],
            })
        })
        .collect();
    json!({
        "batch_size": args.batch_size,
        "topology": {
            "world_size": ranks,
            "local_world_size": ranks,
            "compute_device": "cpu",
        },
        "optimizer": { "kind": kind },
        "tables": tables,
    })
}

/// Writes [`planner_config`] to `path` (the input of `embers-plan plan`).
pub fn write_planner_config(args: &Args, config: &DlrmConfig, path: &Path) -> Result<()> {
    let text = serde_json::to_string_pretty(&planner_config(args, config, args.ranks))
        .map_err(|e| Error::invalid("dlrm", e.to_string()))?;
    embers::checkpoint::write_atomically(path, text.as_bytes())?;
    println!(
        "wrote the planner config for {} ranks to {} (embers-plan plan {} --format json -o plan.json)",
        args.ranks,
        path.display(),
        path.display()
    );
    Ok(())
}

#[cfg(not(feature = "mpi"))]
pub fn run(_args: &Args, _data: &crate::Data, _config: &DlrmConfig) -> Result<()> {
    Err(Error::Distributed(
        "--plan trains across MPI processes: build with the mpi feature (cargo build --release \
         --example dlrm --features mpi) and launch with mpiexec -n W"
            .into(),
    ))
}

#[cfg(feature = "mpi")]
pub use with_mpi::run;

#[cfg(feature = "mpi")]
mod with_mpi {
    use super::*;

    use std::collections::BTreeMap;
    use std::path::PathBuf;
    use std::time::Instant;

    use embers::checkpoint::{CheckpointReader, CheckpointWriter};
    use embers::distributed::{
        all_reduce_mean_gradients, global_metrics, mpi_world, Comm, QCommsConfig,
        ShardedEmbeddingBagCollection, ShardingPlan, TrainPipeline,
    };
    use embers::embedding::EmbeddingBagConfig;
    use embers::metrics::{MetricKind, RecMetrics};
    use embers::models::DlrmDense;
    use embers::nn::Module;
    use embers::optim::Optimizer;
    use embers::tensor::{no_grad, rng::seeded, Reduction};
    use embers::train::Batch;
    use embers_datasets::Split;
    use indicatif::{ProgressBar, ProgressStyle};

    use crate::{CommPrec, Data};

    /// The comm precision of a flag value.
    fn precision(p: CommPrec) -> embers::distributed::CommPrecision {
        use embers::distributed::CommPrecision as P;
        match p {
            CommPrec::Fp32 => P::Fp32,
            CommPrec::Fp16 => P::Fp16,
            CommPrec::Bf16 => P::Bf16,
            CommPrec::Fp8 => P::Fp8,
            CommPrec::Int8 => P::Int8,
        }
    }

    type Batches = Box<dyn Iterator<Item = Result<Batch>> + Send>;

    /// Rank `rank`'s slice of `batches`: every `world`-th batch.
    fn slice(batches: crate::Batches, rank: usize, world: usize) -> Batches {
        Box::new(
            batches
                .enumerate()
                .filter(move |(i, _)| i % world == rank)
                .map(|(_, b)| b),
        )
    }

    /// The lifetime metrics under short names (`auc`, `ne`, …).
    fn short(all: BTreeMap<String, f64>) -> BTreeMap<String, f64> {
        all.into_iter()
            .filter_map(|(k, v)| {
                let (_, rest) = k.split_once('|')?;
                Some((rest.strip_prefix("lifetime_")?.to_string(), v))
            })
            .collect()
    }

    fn io(p: &Path, e: std::io::Error) -> Error {
        Error::Io {
            path: p.display().to_string(),
            source: e,
        }
    }

    struct Model {
        sharded: ShardedEmbeddingBagCollection,
        dense: DlrmDense,
        optimizer: Box<dyn Optimizer + Send>,
        features: usize,
        dim: usize,
    }

    impl Model {
        /// Pooled embeddings → logits `[B]`.
        fn logits(&self, batch: &Batch, pooled: &embers::Tensor) -> Result<embers::Tensor> {
            let b = batch.batch_size();
            let embedded = pooled.reshape(&[b, self.features, self.dim])?;
            self.dense.forward(&batch.dense, &embedded)?.reshape(&[b])
        }
    }

    /// Global metrics of `split` (every rank its slice; they stop together at the first
    /// step some rank has no batch for).
    fn evaluate(
        model: &Model,
        pipeline: &TrainPipeline,
        batches: Batches,
    ) -> Result<(BTreeMap<String, f64>, u64)> {
        let mut metrics = RecMetrics::new(&["click"], &MetricKind::all(), 1)?;
        let mut examples = 0u64;
        no_grad(|| {
            pipeline.run(batches, |batch: &Batch, pooled| {
                let probs = model.logits(batch, pooled.values())?.sigmoid()?;
                let labels = batch.labels.to_vec::<f32>()?;
                metrics.update(&[&probs.to_vec::<f32>()?], &[&labels], None)?;
                examples += batch.batch_size() as u64;
                Ok(())
            })
        })?;
        let comm = model.sharded.comm();
        let total = comm.all_gather_v("eval.examples", &[examples], None)?;
        let examples = total.iter().map(|v| v[0]).sum();
        Ok((short(global_metrics(comm, &metrics)?), examples))
    }

    /// Writes the checkpoint of step `step` into `<out>/checkpoint/` (see the module docs).
    fn save(model: &Model, metrics: &RecMetrics, out: &Path, step: u64) -> Result<()> {
        let comm = model.sharded.comm();
        let (rank, world) = (comm.rank(), comm.size());
        let partial = out.join("checkpoint.partial");
        let last = out.join("checkpoint");
        if rank == 0 {
            let _ = std::fs::remove_dir_all(&partial);
            std::fs::create_dir_all(&partial).map_err(|e| io(&partial, e))?;
        }
        comm.barrier("checkpoint.begin")?;
        model.sharded.save(partial.join("tables"))?;
        let mut w = CheckpointWriter::new();
        w.set_metadata("step", step.to_string());
        w.set_metadata("world", world.to_string());
        for (name, p) in model.dense.named_parameters() {
            w.add_tensor(format!("dense.{name}"), &p)?;
        }
        for (name, t) in model.optimizer.state_dict()? {
            w.add_tensor(format!("optim.{name}"), &t)?;
        }
        for (name, values) in metrics.state_dict() {
            w.add(format!("metrics.{name}"), &[values.len()], &values)?;
        }
        w.write(partial.join(format!("rank{rank}.safetensors")))?;
        comm.barrier("checkpoint.written")?;
        if rank == 0 {
            let old = out.join("checkpoint.old");
            let _ = std::fs::remove_dir_all(&old);
            if last.exists() {
                std::fs::rename(&last, &old).map_err(|e| io(&last, e))?;
            }
            std::fs::rename(&partial, &last).map_err(|e| io(&partial, e))?;
            let _ = std::fs::remove_dir_all(&old);
        }
        comm.barrier("checkpoint.end")
    }

    /// Restores `dir` (a checkpoint of [`save`]): the step it was taken at.
    fn resume(model: &mut Model, metrics: &mut RecMetrics, dir: &Path) -> Result<u64> {
        let comm = model.sharded.comm();
        let (rank, world) = (comm.rank(), comm.size());
        model.sharded.load(dir.join("tables"))?;
        let own = dir.join(format!("rank{rank}.safetensors"));
        let r0 = CheckpointReader::open(dir.join("rank0.safetensors"))?;
        let saved_world = r0.required_metadata("world")?.to_string();
        let same_world = saved_world == world.to_string();
        let r = if same_world {
            CheckpointReader::open(&own)?
        } else {
            r0
        };
        let step: u64 = r.required_metadata("step")?.parse().map_err(|_| {
            Error::invalid("checkpoint", format!("{}: a bad step", r.path().display()))
        })?;
        let dense = (model.dense.named_parameters().into_iter())
            .map(|(name, p)| Ok((p.clone(), r.read_like(&format!("dense.{name}"), &p)?)))
            .collect::<Result<Vec<_>>>()?;
        let mut names = r.names();
        names.sort();
        let optim = (names.iter())
            .filter_map(|n| Some((n, n.strip_prefix("optim.")?)))
            .map(|(full, short)| Ok((short.to_string(), r.read_tensor(full)?)))
            .collect::<Result<Vec<_>>>()?;
        if same_world {
            let mut state = BTreeMap::new();
            for name in &names {
                if let Some(short) = name.strip_prefix("metrics.") {
                    let len = r.shape(name).unwrap_or_default().iter().product::<usize>();
                    state.insert(short.to_string(), r.read::<f64>(name, &[len])?);
                }
            }
            metrics.load_state_dict(&state)?;
        }
        model.optimizer.load_state_dict(&optim)?;
        for (p, new) in dense {
            p.copy_from(&new)?;
        }
        if rank == 0 && !same_world {
            println!(
                "resumed a checkpoint of {saved_world} ranks on {world}: tables resharded, dense \
                 half from rank 0, metrics restart"
            );
        }
        Ok(step)
    }

    /// The sharding plan: `embers-plan`'s JSON file, or `auto`.
    fn plan_of(args: &Args, config: &DlrmConfig, comm: &Comm) -> Result<ShardingPlan> {
        let spec = args.plan.as_deref().unwrap_or("auto");
        if spec != "auto" {
            return ShardingPlan::load(spec);
        }
        let text = planner_config(args, config, comm.size()).to_string();
        let problem = embers_planner::Config::from_json(&text)
            .and_then(|c| c.resolve())
            .map_err(|e| Error::invalid("embers-plan", e.to_string()))?;
        let plan = embers_planner::plan_problem(&problem, embers_planner::CostModel::Torchrec)
            .map_err(|e| Error::invalid("embers-plan", e.to_string()))?;
        ShardingPlan::from_planner(&plan)
    }

    pub fn run(args: &Args, data: &Data, config: &DlrmConfig) -> Result<()> {
        let comm = mpi_world()?;
        let (rank, world) = (comm.rank(), comm.size());
        let lead = rank == 0;
        if lead {
            std::fs::create_dir_all(&args.out).map_err(|e| io(&args.out, e))?;
        }
        let plan = plan_of(args, config, &comm)?;
        let configs: Vec<EmbeddingBagConfig> = (config.sparse_features.iter())
            .map(|(f, rows)| {
                EmbeddingBagConfig::new(format!("t_{f}"), *rows, config.embedding_dim, &[f])
            })
            .collect();
        let sharded = ShardedEmbeddingBagCollection::new(
            configs,
            &plan,
            config.sparse_optimizer,
            comm,
            config.seed,
        )?;
        let (fwd, bwd) = match args.comm_precision[..] {
            [f] => (f, f),
            [f, b] => (f, b),
            _ => {
                return Err(Error::invalid(
                    "dlrm",
                    "--comm-precision takes one precision or forward,backward",
                ))
            }
        };
        sharded.set_qcomms(QCommsConfig::new(precision(fwd), precision(bwd)))?;
        let mut dense_sizes = config.dense_arch.clone();
        dense_sizes.push(config.embedding_dim);
        let mut over_sizes = config.over_arch.clone();
        over_sizes.push(1);
        let features = config.sparse_features.len();
        let mut rng = seeded(config.seed);
        let dense = match config.dcn {
            None => DlrmDense::dot(
                config.num_dense,
                &dense_sizes,
                features,
                &over_sizes,
                embers::DType::F32,
                &mut rng,
            )?,
            Some((layers, r)) => DlrmDense::dcn(
                config.num_dense,
                &dense_sizes,
                features,
                &over_sizes,
                layers,
                r,
                embers::DType::F32,
                &mut rng,
            )?,
        };
        let optimizer = config.dense_optimizer.build(dense.parameters())?;
        let mut model = Model {
            sharded,
            dense,
            optimizer,
            features,
            dim: config.embedding_dim,
        };
        let mut metrics = RecMetrics::new(&["click"], &MetricKind::all(), config.metrics_window)?;
        let start_step = match &args.resume {
            Some(dir) => resume(&mut model, &mut metrics, dir)?,
            None => 0,
        };
        let mut train_pipeline = TrainPipeline::new(&model.sharded)?;
        let mut eval_pipeline = TrainPipeline::new(&model.sharded)?;
        if args.no_pipeline {
            train_pipeline = train_pipeline.sequential();
            eval_pipeline = eval_pipeline.sequential();
        }
        if lead {
            println!(
                "DLRM on {world} processes: {} tables sharded by {} ({}), {} dense parameters \
                 (data-parallel), B={} per rank, comms {fwd:?}/{bwd:?}, {}",
                plan.tables.len(),
                args.plan.as_deref().unwrap_or("auto"),
                plan_summary(&plan),
                model.dense.num_parameters(),
                args.batch_size,
                if args.no_pipeline {
                    "no pipeline"
                } else {
                    "pipelined"
                }
            );
            if let Some(b) = data.best_auc(Split::Test, None) {
                println!("synthetic data: best achievable test AUC {b:.4}");
            }
        }

        // Training: every epoch's batches in one stream, this rank's slice, from the step the
        // checkpoint was taken at.
        let steps_per_epoch = match data {
            Data::Synthetic(_) => {
                Some(args.synthetic_train / (args.batch_size as u64 * world as u64))
            }
            Data::Files { .. } => None,
        };
        let total = match (args.steps, steps_per_epoch) {
            (Some(s), _) => Some(s),
            (None, Some(per)) => Some(per * args.epochs),
            (None, None) => None,
        };
        let mut epochs: Vec<crate::Batches> = Vec::new();
        for epoch in 0..args.epochs {
            epochs.push(data.batches(Split::Train, epoch, args.batch_size, args.seed)?);
        }
        let stream: crate::Batches = Box::new(epochs.into_iter().flatten());
        let mine = slice(stream, rank, world).skip(start_step as usize);
        let mine: Batches = match total {
            Some(t) => Box::new(mine.take(t.saturating_sub(start_step) as usize)),
            None => Box::new(mine),
        };
        let bar = if lead && !args.no_progress {
            let bar = total.map_or_else(ProgressBar::new_spinner, ProgressBar::new);
            bar.set_style(
                ProgressStyle::with_template(
                    "{elapsed_precise} [{bar:30}] {pos}/{len} steps {msg}",
                )
                .expect("valid template")
                .progress_chars("=> "),
            );
            bar.set_position(start_step);
            bar
        } else {
            ProgressBar::hidden()
        };
        let validation = |model: &Model| -> Result<(BTreeMap<String, f64>, u64)> {
            let limit = if args.validation_examples == 0 {
                usize::MAX
            } else {
                (args.validation_examples as usize).div_ceil(args.batch_size * world)
            };
            let batches = data.batches(Split::Validation, 0, args.batch_size, args.seed)?;
            let batches: Batches = Box::new(slice(batches, rank, world).take(limit));
            evaluate(model, &eval_pipeline, batches)
        };
        let started = Instant::now();
        let mut step = start_step;
        let mut history = Vec::new();
        let (mut loss_sum, mut loss_count) = (0.0f64, 0u64);
        let report = train_pipeline.run(mine, |batch: &Batch, pooled| {
            let model = &mut model;
            model.optimizer.zero_grad();
            let logits = model.logits(batch, pooled.values())?;
            let loss = logits.bce_with_logits(&batch.labels, None, Reduction::Mean)?;
            let probs = no_grad(|| logits.detach().sigmoid())?;
            loss.backward()?;
            all_reduce_mean_gradients(model.sharded.comm(), &model.dense.parameters())?;
            model.optimizer.step()?;
            let loss = loss.item()?;
            if !loss.is_finite() {
                return Err(Error::invalid(
                    "dlrm",
                    format!("rank {rank}: the loss of step {step} is {loss}: training diverged"),
                ));
            }
            let labels = batch.labels.to_vec::<f32>()?;
            metrics.update(&[&probs.to_vec::<f32>()?], &[&labels], None)?;
            (loss_sum, loss_count) = (loss_sum + loss, loss_count + 1);
            step += 1;
            bar.set_position(step);
            if args.validate_every > 0 && step % args.validate_every == 0 {
                let (val, n) = validation(model)?;
                let train = short(global_metrics(model.sharded.comm(), &metrics)?);
                if lead {
                    say(&bar, format!(
                        "step {step}: loss {:.4}, train AUC {:.4}, validation AUC {:.4} NE {:.4} ({n} examples)",
                        loss_sum / loss_count.max(1) as f64,
                        train.get("auc").copied().unwrap_or(f64::NAN),
                        val.get("auc").copied().unwrap_or(f64::NAN),
                        val.get("ne").copied().unwrap_or(f64::NAN),
                    ));
                }
                history.push(json!({ "step": step, "train": train, "validation": val }));
                (loss_sum, loss_count) = (0.0, 0);
                save(model, &metrics, &args.out, step)?;
            }
            Ok(())
        })?;
        bar.finish_and_clear();
        let elapsed = started.elapsed().as_secs_f64();
        let trained = step - start_step;
        save(&model, &metrics, &args.out, step)?;
        let (val, val_n) = validation(&model)?;
        let test = data.batches(Split::Test, 0, args.batch_size, args.seed)?;
        let (test, test_n) = evaluate(&model, &eval_pipeline, slice(test, rank, world))?;
        let train = short(global_metrics(model.sharded.comm(), &metrics)?);
        let bytes = model.sharded.comm().bytes();
        let sent: u64 = bytes.values().map(|b| b.sent).sum();
        let all_sent = model
            .sharded
            .comm()
            .all_gather_v("report.bytes", &[sent], None)?;
        if lead {
            let samples = trained as f64 * (args.batch_size * world) as f64;
            println!(
                "trained {trained} steps on {world} ranks in {elapsed:.1} s: {:.0} samples/s; \
                 input distribution {:.0}% hidden behind compute on rank 0",
                samples / elapsed,
                report.hidden_fraction() * 100.0
            );
            println!(
                "train AUC {:.4}; validation AUC {:.4} ({val_n} examples); test AUC {:.4} NE \
                 {:.4} ({test_n} examples)",
                train.get("auc").copied().unwrap_or(f64::NAN),
                val.get("auc").copied().unwrap_or(f64::NAN),
                test.get("auc").copied().unwrap_or(f64::NAN),
                test.get("ne").copied().unwrap_or(f64::NAN),
            );
            if let Some(b) = data.best_auc(Split::Test, None) {
                println!("best achievable test AUC {b:.4}");
            }
            let out = json!({
                "world_size": world,
                "plan": plan_summary(&plan),
                "steps": step,
                "samples_per_second": samples / elapsed,
                "hidden_input_distribution": report.hidden_fraction(),
                "bytes_sent_per_rank": all_sent.iter().map(|v| v[0]).collect::<Vec<_>>(),
                "train": train,
                "validation": val,
                "test": test,
                "history": history,
            });
            let path: PathBuf = args.out.join("metrics.json");
            let text = serde_json::to_string_pretty(&out)
                .map_err(|e| Error::invalid("dlrm", e.to_string()))?;
            embers::checkpoint::write_atomically(&path, text.as_bytes())?;
            println!(
                "wrote {} and {}",
                path.display(),
                args.out.join("checkpoint").display()
            );
        }
        Ok(())
    }

    /// A line above the progress bar, or on its own without one.
    fn say(bar: &ProgressBar, line: String) {
        if bar.is_hidden() {
            println!("{line}");
        } else {
            bar.println(line);
        }
    }

    /// How many tables each sharding type got.
    fn plan_summary(plan: &ShardingPlan) -> String {
        let mut count: BTreeMap<String, usize> = BTreeMap::new();
        for t in &plan.tables {
            *count.entry(format!("{:?}", t.sharding_type)).or_default() += 1;
        }
        (count.iter())
            .map(|(k, n)| format!("{n} {k}"))
            .collect::<Vec<_>>()
            .join(", ")
    }
}
