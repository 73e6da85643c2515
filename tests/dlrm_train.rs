//! DLRM training end to end: synthetic data → `RawBatch` → `Batch` → `DlrmTrainer`; the AUC
//! reached against the generator's planted best; resume = uninterrupted run, bit for bit;
//! a kill during a checkpoint write leaves the previous checkpoint loadable.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

#[path = "support/config_edit.rs"]
mod config_edit;
#[path = "support/kill.rs"]
mod kill;

use embers::embedding::{CachePolicy, FusedOptimizer, Placement, WeightType};
use embers::nn::Module;
use embers::train::{Batch, DenseOptimizer, DlrmConfig, DlrmTrainer};
use embers::Result;
use embers_datasets::{
    BatchConfig, Batcher, RawBatch, ShuffleConfig, Split, SplitRule, SyntheticCriteo,
    SyntheticCriteoConfig,
};

fn data(num_train: u64, tables: usize, rows: u64) -> SyntheticCriteo {
    SyntheticCriteo::new(SyntheticCriteoConfig {
        seed: 7,
        table_sizes: vec![rows; tables],
        ids_per_feature: vec![1; tables],
        num_train,
        num_validation: 20_000,
        num_test: 20_000,
        ..Default::default()
    })
    .unwrap()
}

fn batches(
    g: &SyntheticCriteo,
    split: Split,
    batch_size: usize,
    seed: u64,
) -> impl Iterator<Item = Result<Batch>> {
    let config = BatchConfig {
        batch_size,
        drop_last: split == Split::Train,
        shuffle: (split == Split::Train).then_some(ShuffleConfig {
            buffer_size: 1024,
            seed,
        }),
        split_rule: SplitRule::All,
        split,
    };
    Batcher::new(g.split(split), config).unwrap().map(|r| {
        r.map_err(embers::Error::from)
            .and_then(RawBatch::into_batch)
    })
}

fn config(g: &SyntheticCriteo, dim: usize) -> DlrmConfig {
    DlrmConfig {
        num_dense: g.schema().num_dense(),
        sparse_features: (g.schema().sparse_keys.iter())
            .zip(&g.config().table_sizes)
            .map(|(k, &rows)| (k.clone(), rows as usize))
            .collect(),
        embedding_dim: dim,
        dense_arch: vec![32],
        over_arch: vec![32],
        tasks: vec!["click".to_string()],
        dcn: None,
        dense_optimizer: DenseOptimizer::Adagrad { lr: 0.05 },
        sparse_optimizer: FusedOptimizer::RowWiseAdagrad {
            lr: 0.05,
            eps: 1e-8,
        },
        seed: 3,
        metrics_window: 10_000,
        device: embers::Device::Cpu,
    }
}

#[test]
fn synthetic_training_reaches_the_planted_best_auc() -> Result<()> {
    // 8 features of 200 ids: small enough for a debug-build test, big enough that the ids'
    // effects must be learned by the tables (the dense features alone give a far lower AUC).
    let g = data(400_000, 8, 200);
    let mut trainer = config(&g, 8).build()?;
    for batch in batches(&g, Split::Train, 256, 1) {
        trainer.train_step(&batch?)?;
    }
    let report = trainer.evaluate(batches(&g, Split::Test, 1024, 0), None)?;
    let best = g.best_auc(Split::Test, None).unwrap();
    let auc = report.get("auc");
    println!("test AUC {auc:.4}, best achievable {best:.4}");
    assert_eq!(report.examples, 20_000);
    assert!(
        auc > best - 0.01 && auc <= best + 0.01,
        "AUC {auc} vs best {best}"
    );
    // Quantized copies of the tables keep the AUC (INT8 within 0.002, INT4 within 0.01).
    for (ty, tol) in [(WeightType::Int8, 0.002), (WeightType::Int4, 0.01)] {
        let q = trainer.model().sparse_arch.quantize(ty)?;
        let qa = trainer
            .evaluate(batches(&g, Split::Test, 1024, 0), Some(&q))?
            .get("auc");
        assert!((qa - auc).abs() < tol, "{ty:?}: {qa} vs {auc}");
    }
    Ok(())
}

#[test]
fn several_tasks_train_one_head_each_with_their_own_metrics() -> Result<()> {
    let g = SyntheticCriteo::new(SyntheticCriteoConfig {
        seed: 7,
        table_sizes: vec![200; 8],
        ids_per_feature: vec![1; 8],
        num_train: 300_000,
        num_validation: 0,
        num_test: 20_000,
        num_tasks: 2,
        ..Default::default()
    })
    .unwrap();
    let tasks = g.schema().tasks.clone();
    assert_eq!(tasks, ["click", "task1"]);
    let mut trainer = DlrmConfig {
        tasks: tasks.clone(),
        ..config(&g, 8)
    }
    .build()?;
    // The loss is the mean over samples and tasks of the BCE, checked in f64 against the
    // probabilities the model gives before the step.
    let first = batches(&g, Split::Train, 256, 1).next().unwrap()?;
    assert_eq!(first.num_tasks(), 2);
    let probs = trainer.predict(&first, None)?;
    let labels = first.labels.to_vec::<f32>()?;
    assert_eq!(probs.len(), 2 * 256);
    let expected = (probs.iter().zip(&labels))
        .map(|(&p, &y)| {
            let (p, y) = (f64::from(p), f64::from(y));
            -(y * p.ln() + (1.0 - y) * (1.0 - p).ln())
        })
        .sum::<f64>()
        / probs.len() as f64;
    let loss = trainer.train_step(&first)?.loss;
    assert!((loss - expected).abs() < 1e-5, "loss {loss} vs {expected}");
    for batch in batches(&g, Split::Train, 256, 1).skip(1) {
        trainer.train_step(&batch?)?;
    }
    let train = trainer.train_metrics();
    assert!(train.contains_key("auc") && train.contains_key("window_auc/task1"));
    // Each task reaches its own planted best AUC.
    let report = trainer.evaluate(batches(&g, Split::Test, 1024, 0), None)?;
    for (t, key) in [(0, "auc"), (1, "auc/task1")] {
        let best = g.best_task_auc(Split::Test, t, None).unwrap();
        let auc = report.get(key);
        println!("task {t}: test AUC {auc:.4}, best achievable {best:.4}");
        assert!(
            auc > best - 0.015 && auc <= best + 0.01,
            "task {t}: {auc} vs {best}"
        );
    }
    // The per-task metrics are those of each task's column alone.
    let mut alone = [Vec::new(), Vec::new()];
    let mut truth = [Vec::new(), Vec::new()];
    for batch in batches(&g, Split::Test, 1024, 0) {
        let batch = batch?;
        let p = trainer.predict(&batch, None)?;
        let y = batch.labels.to_vec::<f32>()?;
        for t in 0..2 {
            alone[t].extend(p.iter().skip(t).step_by(2));
            truth[t].extend(y.iter().skip(t).step_by(2));
        }
    }
    for (t, key) in [(0, "auc"), (1, "auc/task1")] {
        let exact = embers_datasets::tie_corrected_auc(&alone[t], &truth[t]).unwrap();
        assert!(
            (report.get(key) - exact).abs() < 2e-3,
            "task {t}: {} vs {exact}",
            report.get(key)
        );
    }
    // A checkpoint keeps both heads and both tasks' metrics.
    let dir = temp_dir("tasks");
    let path = dir.join("tasks.safetensors");
    trainer.save_checkpoint(&path, &BTreeMap::new())?;
    let mut again = DlrmConfig {
        tasks: tasks.clone(),
        ..config(&g, 8)
    }
    .build()?;
    again.load_checkpoint(&path)?;
    assert!(state_bits(&again) == state_bits(&trainer));
    assert_eq!(again.train_metrics(), trainer.train_metrics());
    // A single-task model refuses this checkpoint (its metrics and over arch differ), and a
    // batch with the wrong number of label columns is an error naming them.
    let mut single = config(&g, 8).build()?;
    assert!(single.load_checkpoint(&path).is_err());
    let message = single.train_step(&first).unwrap_err().to_string();
    assert!(message.contains("2 label column(s)"), "{message}");
    for bad in [
        vec![],
        vec!["a".to_string(), "a".to_string()],
        vec!["a|b".to_string()],
    ] {
        let error = DlrmConfig {
            tasks: bad.clone(),
            ..config(&g, 8)
        }
        .build()
        .err()
        .unwrap_or_else(|| panic!("tasks {bad:?} accepted"));
        assert!(error.to_string().contains("task"), "{error}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
    Ok(())
}

/// Every number that defines the training state, as raw bits.
fn state_bits(t: &DlrmTrainer) -> Vec<(String, Vec<u32>)> {
    let mut out = Vec::new();
    for (name, p) in t.model().dense.named_parameters() {
        out.push((
            name,
            p.to_vec::<f32>()
                .unwrap()
                .iter()
                .map(|x| x.to_bits())
                .collect(),
        ));
    }
    for c in t.model().sparse_arch.configs() {
        let w = t.model().sparse_arch.table_weights(&c.name).unwrap();
        out.push((c.name.clone(), w.iter().map(|x| x.to_bits()).collect()));
    }
    for tbe in t.model().sparse_arch.tbes() {
        for i in 0..tbe.optimizer_state_names().len() {
            for table in 0..tbe.config().tables.len() {
                let s = tbe.optimizer_state(i, table).unwrap();
                out.push((
                    format!("state{i}.{table}"),
                    s.iter().map(|x| x.to_bits()).collect(),
                ));
            }
        }
    }
    out
}

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("embers-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[test]
fn resume_continues_bit_identically() -> Result<()> {
    let g = data(60 * 128, 6, 300);
    let dir = temp_dir("resume");
    let path = dir.join("ckpt.safetensors");
    for (dense, dcn) in [
        (DenseOptimizer::Adagrad { lr: 0.05 }, None),
        (DenseOptimizer::Adam { lr: 0.01 }, Some((2, 4))),
    ] {
        let mut cfg = config(&g, 8);
        cfg.dense_optimizer = dense;
        cfg.dcn = dcn;
        let all: Vec<Batch> = batches(&g, Split::Train, 128, 5).collect::<Result<_>>()?;
        assert_eq!(all.len(), 60);
        // Uninterrupted: 60 steps, checkpoint after 25.
        let mut a = cfg.build()?;
        let mut losses_a = Vec::new();
        for (i, b) in all.iter().enumerate() {
            if i == 25 {
                let user = BTreeMap::from([("batch".to_string(), "25".to_string())]);
                a.save_checkpoint(&path, &user)?;
            }
            losses_a.push(a.train_step(b)?.loss);
        }
        // A fresh trainer (different init seed, so nothing matches by accident) resumes.
        cfg.seed = 99;
        let mut b = cfg.build()?;
        assert_ne!(state_bits(&a), state_bits(&b));
        let user = b.load_checkpoint(&path)?;
        assert_eq!(user.get("batch").map(String::as_str), Some("25"));
        assert_eq!(b.step(), 25);
        let mut losses_b = Vec::new();
        for batch in &all[25..] {
            losses_b.push(b.train_step(batch)?.loss);
        }
        assert_eq!(losses_a[25..], losses_b[..]);
        assert!(
            state_bits(&a) == state_bits(&b),
            "state differs after resume"
        );
        assert_eq!(a.train_metrics(), b.train_metrics());
    }
    std::fs::remove_dir_all(&dir).unwrap();
    Ok(())
}

#[test]
fn tables_in_files_behind_a_small_cache_train_like_tables_in_memory() -> Result<()> {
    // A tenth of each table cached (one 32-way set for the small ones), LRU and LFU: the same
    // losses and the same model, bit for bit; a checkpoint of the cached model resumes into an
    // in-memory one and the other way round.
    let g = data(30 * 128, 6, 3000);
    let dir = temp_dir("cached-dlrm");
    let all: Vec<Batch> = batches(&g, Split::Train, 128, 5).collect::<Result<_>>()?;
    let cfg = config(&g, 8);
    let mut plain = cfg.build()?;
    let losses: Vec<f64> = (all.iter())
        .map(|b| plain.train_step(b).map(|o| o.loss))
        .collect::<Result<_>>()?;
    for policy in [CachePolicy::Lru, CachePolicy::Lfu] {
        let placement =
            Placement::for_kernel("fused_uvm_caching", Some(0.1), dir.join("rows"), policy)?;
        let mut cached = cfg.build_with(&placement)?;
        assert!(cached.model().sparse_arch.tbes()[0].is_cached());
        let got: Vec<f64> = (all.iter())
            .map(|b| cached.train_step(b).map(|o| o.loss))
            .collect::<Result<_>>()?;
        assert_eq!(got, losses, "{policy:?}");
        assert!(state_bits(&cached) == state_bits(&plain), "{policy:?}");
        // Each next batch prefetched once a step's backward is queued (`train_step_then`,
        // as the example does on a GPU): the same losses and model. The closure runs after
        // the backward (the dense weights have gradients) and before the optimizer's step
        // (they have not changed yet).
        let prefetch_rows = dir.join("rows-prefetch");
        let prefetch_placement =
            Placement::for_kernel("fused_uvm_caching", Some(0.1), prefetch_rows, policy)?;
        let mut prefetching = cfg.build_with(&prefetch_placement)?;
        let tables = prefetching.model().sparse_arch.clone();
        let dense = prefetching.model().dense.dense_arch.parameters()[0].clone();
        let mut got = Vec::new();
        for (i, b) in all.iter().enumerate() {
            let before = dense.to_vec::<f32>()?;
            let seen = std::sync::Mutex::new(None);
            let out = prefetching.train_step_then(b, || {
                *seen.lock().unwrap() = Some((dense.grad().is_some(), dense.to_vec::<f32>()?));
                match all.get(i + 1) {
                    Some(next) => tables.prefetch(&next.sparse),
                    None => Ok(()),
                }
            })?;
            let (had_grad, values) = seen.into_inner().unwrap().expect("the closure ran");
            assert!(
                had_grad && values == before,
                "step {i}: not between backward and step"
            );
            assert!(
                dense.to_vec::<f32>()? != before,
                "step {i}: no optimizer step"
            );
            got.push(out.loss);
        }
        assert_eq!(got, losses, "{policy:?} with prefetch");
        assert!(state_bits(&prefetching) == state_bits(&plain), "{policy:?}");
        let prefetched: u64 = (prefetching.model().sparse_arch.tbes().iter())
            .flat_map(|t| t.cache_stats().unwrap())
            .map(|s| s.prefetched)
            .sum();
        assert!(prefetched > 0, "nothing was prefetched");
        // An error from the closure ends the step.
        let err = prefetching
            .train_step_then(&all[0], || Err(embers::Error::invalid("test", "refused")))
            .unwrap_err()
            .to_string();
        assert!(err.contains("refused"), "{err}");
        drop((prefetching, tables));
        let stats = cached.model().sparse_arch.tbes()[0].cache_stats().unwrap();
        assert!(stats.iter().any(|s| s.evictions > 0), "{stats:?}");
        let path = dir.join("ckpt.safetensors");
        cached.save_checkpoint(&path, &BTreeMap::new())?;
        let mut back = cfg.build()?;
        back.load_checkpoint(&path)?;
        assert!(state_bits(&back) == state_bits(&plain));
        // The row files are the first model's while it lives: a second one is refused.
        assert!(cfg.build_with(&placement).is_err());
        drop(cached);
        let mut again = cfg.build_with(&placement)?;
        plain.save_checkpoint(&path, &BTreeMap::new())?;
        again.load_checkpoint(&path)?;
        assert!(state_bits(&again) == state_bits(&plain));

        // A cached model's checkpoint keeps its tables out of the file: their row files and
        // manifests sit in a parts directory beside it, one per checkpoint, the previous one
        // removed only once the new file is in place.
        let path2 = dir.join("ckpt2.safetensors");
        std::fs::create_dir_all(dir.join("ckpt2.safetensors.parts-interrupted")).unwrap();
        again.save_checkpoint(&path2, &BTreeMap::new())?;
        let first = parts_dirs(&dir, "ckpt2.safetensors");
        assert_eq!(first.len(), 1, "{first:?}");
        let names = embers::checkpoint::CheckpointReader::open(&path2)?.names();
        assert!(
            !names.iter().any(|n| n.starts_with("tables.")),
            "tables in the file: {names:?}"
        );
        again.save_checkpoint(&path2, &BTreeMap::new())?;
        let second = parts_dirs(&dir, "ckpt2.safetensors");
        assert!(
            second.len() == 1 && second != first,
            "{first:?} then {second:?}"
        );
        // Read back into a cached model (its own row files) and into one in memory.
        let elsewhere =
            Placement::for_kernel("fused_uvm_caching", Some(0.1), dir.join("rows2"), policy)?;
        let mut third = cfg.build_with(&elsewhere)?;
        third.load_checkpoint(&path2)?;
        assert!(state_bits(&third) == state_bits(&plain), "{policy:?}");
        let mut fourth = cfg.build()?;
        fourth.load_checkpoint(&path2)?;
        assert!(state_bits(&fourth) == state_bits(&plain), "{policy:?}");
        // A damaged row file is named and changes nothing; so is a missing parts directory.
        let rows = (std::fs::read_dir(dir.join(&second[0]).join("tables.group0")).unwrap())
            .flatten()
            .map(|e| e.path())
            .find(|p| p.extension().is_some_and(|x| x == "bin"))
            .expect("a row file");
        let mut bytes = std::fs::read(&rows).unwrap();
        bytes[100] ^= 1;
        std::fs::write(&rows, &bytes).unwrap();
        let mut fresh = cfg.build()?;
        let before = state_bits(&fresh);
        let err = fresh.load_checkpoint(&path2).unwrap_err().to_string();
        assert!(err.contains("corrupt"), "{err}");
        assert!(state_bits(&fresh) == before);
        let err = third.load_checkpoint(&path2).unwrap_err().to_string();
        assert!(err.contains("corrupt"), "{err}");
        assert!(state_bits(&third) == state_bits(&plain));
        std::fs::remove_dir_all(dir.join(&second[0])).unwrap();
        let err = fresh.load_checkpoint(&path2).unwrap_err().to_string();
        assert!(
            err.contains("parts directory") && err.contains("missing"),
            "{err}"
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
    Ok(())
}

/// The parts directories beside checkpoint `file` in `dir`.
fn parts_dirs(dir: &std::path::Path, file: &str) -> Vec<String> {
    let mut found: Vec<String> = (std::fs::read_dir(dir).unwrap().flatten())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(&format!("{file}.parts-")))
        .collect();
    found.sort();
    found
}

#[test]
fn bad_checkpoints_are_refused_and_change_nothing() -> Result<()> {
    let g = data(20 * 64, 4, 100);
    let dir = temp_dir("badckpt");
    let path = dir.join("ckpt.safetensors");
    let cfg = config(&g, 4);
    let mut a = cfg.build()?;
    for b in batches(&g, Split::Train, 64, 1).take(5) {
        a.train_step(&b?)?;
    }
    a.save_checkpoint(&path, &BTreeMap::new())?;
    let bytes = std::fs::read(&path).unwrap();
    let mut other = cfg.build()?;
    let before = state_bits(&other);
    // Truncated.
    std::fs::write(&path, &bytes[..bytes.len() - 100]).unwrap();
    let msg = other.load_checkpoint(&path).unwrap_err().to_string();
    assert!(msg.contains("ckpt.safetensors"), "{msg}");
    // A different model shape (D=8 instead of 4), dense optimizer or learning rate: the
    // configurations differ.
    let mut adam = cfg.clone();
    adam.dense_optimizer = DenseOptimizer::Adam { lr: 0.1 };
    let mut faster = cfg.clone();
    faster.sparse_optimizer = FusedOptimizer::RowWiseAdagrad { lr: 0.5, eps: 1e-8 };
    for (theirs, says) in [
        (config(&g, 8), "embedding_dim: 8"),
        (adam, "Adam { lr: 0.1 }"),
        (faster, "lr: 0.5"),
    ] {
        theirs.build()?.save_checkpoint(&path, &BTreeMap::new())?;
        let msg = other.load_checkpoint(&path).unwrap_err().to_string();
        assert!(
            msg.contains("written for another configuration") && msg.contains(says),
            "{msg}"
        );
    }
    // The same configuration loads, with a learning rate whose JSON text serde_json's default
    // parser read back one unit in the last place off (embers parses floats exactly: its
    // `float_roundtrip` feature).
    let mut odd = cfg.clone();
    odd.dense_optimizer = DenseOptimizer::Adagrad {
        lr: 0.003_827_669_924_472_295_7,
    };
    let text = serde_json::to_string(&0.003_827_669_924_472_295_7f64).unwrap();
    assert_eq!(
        serde_json::from_str::<f64>(&text).unwrap(),
        0.003_827_669_924_472_295_7
    );
    odd.build()?.save_checkpoint(&path, &BTreeMap::new())?;
    odd.build()?.load_checkpoint(&path)?;
    // A step or a table group's step that cannot go on counting (past 2^63).
    for key in ["step", "tables.group0.step"] {
        a.save_checkpoint(&path, &BTreeMap::new())?;
        config_edit::rewrite_metadata(&path, key, |_| u64::MAX.to_string());
        let msg = other.load_checkpoint(&path).unwrap_err().to_string();
        assert!(msg.contains("not a count below 2^63"), "{key}: {msg}");
    }
    // Not a trainer checkpoint at all.
    a.model().sparse_arch.save(&path)?;
    let msg = other.load_checkpoint(&path).unwrap_err().to_string();
    assert!(msg.contains("not a trainer checkpoint"), "{msg}");
    assert!(state_bits(&other) == before);
    assert_eq!(other.step(), 0);
    std::fs::remove_dir_all(&dir).unwrap();
    Ok(())
}

/// A checkpoint's configuration is the first thing a server builds from; one describing a
/// model larger than the file (a few edited bytes of metadata) is refused before anything
/// is built, naming the file, instead of allocating (or overflowing on) what it names. A
/// checkpoint whose tables are row files in its parts directory still reads (the parts
/// count), and a model built from an impossible configuration is an error, not a panic.
#[test]
fn a_configuration_larger_than_its_checkpoint_is_refused_before_building() -> Result<()> {
    let g = data(4 * 64, 4, 100);
    let dir = temp_dir("bigconfig");
    let path = dir.join("ckpt.safetensors");
    let cfg = config(&g, 4);
    cfg.build()?.save_checkpoint(&path, &BTreeMap::new())?;
    let saved = std::fs::read(&path).unwrap();
    assert_eq!(DlrmConfig::from_checkpoint(&path)?, cfg);
    type Edit = fn(&mut serde_json::Value);
    let edits: [(&str, Edit); 6] = [
        ("rows", |j| j["sparse_features"][0][1] = (1u64 << 40).into()),
        ("rows past a u64", |j| {
            j["sparse_features"][0][1] = (1u64 << 62).into();
            j["sparse_features"][1][1] = (1u64 << 62).into();
        }),
        ("dense width", |j| {
            j["dense_arch"][0] = 1_000_000_000_000_000_000u64.into()
        }),
        ("over width", |j| {
            j["over_arch"] = serde_json::json!([1u64 << 40, 1u64 << 40])
        }),
        // (The file holds ~1.1 MB: within it but for the interaction's width, 14, feeding
        // the first over layer, or the cross net's (4+1)·4 × 50000.)
        ("first over layer", |j| {
            j["over_arch"] = serde_json::json!([50000])
        }),
        ("cross layers", |j| j["dcn"] = serde_json::json!([1, 50000])),
    ];
    for (what, edit) in edits {
        std::fs::write(&path, &saved).unwrap();
        config_edit::rewrite(&path, edit);
        let msg = DlrmConfig::from_checkpoint(&path).unwrap_err().to_string();
        assert!(
            msg.contains("ckpt.safetensors") && msg.contains("describes weights"),
            "{what}: {msg}"
        );
        let served = embers::serve::DlrmServable::from_checkpoint(&path, None);
        assert!(served.is_err(), "{what}");
    }
    // Tables in files: the checkpoint's rows are in its parts directory.
    let placement = Placement::for_kernel(
        "fused_uvm_caching",
        Some(0.1),
        dir.join("rows"),
        CachePolicy::Lru,
    )?;
    let cached_path = dir.join("cached.safetensors");
    cfg.build_with(&placement)?
        .save_checkpoint(&cached_path, &BTreeMap::new())?;
    let config = DlrmConfig::from_checkpoint(&cached_path)?;
    config.build()?.load_checkpoint(&cached_path)?;
    // Built directly, impossible sizes are errors.
    let refusal = |c: &DlrmConfig| c.build().err().map(|e| e.to_string()).unwrap_or_default();
    let mut wide = cfg.clone();
    wide.dense_arch = vec![usize::MAX / 2];
    let msg = refusal(&wide);
    assert!(msg.contains("past any memory"), "{msg}");
    let mut tables = cfg.clone();
    tables.sparse_features[0].1 = usize::MAX / 4;
    tables.sparse_features[1].1 = usize::MAX / 4;
    let msg = refusal(&tables);
    assert!(msg.contains("too large"), "{msg}");
    std::fs::remove_dir_all(&dir).unwrap();
    Ok(())
}

const CHILD_ENV: &str = "EMBERS_CHECKPOINT_WRITER_CHILD";

/// Not a test on its own: the body of the child process of
/// `a_kill_during_a_checkpoint_write_leaves_the_previous_one_loadable`. It writes
/// checkpoints in a loop (each after one more training step) until it is killed.
#[test]
fn checkpoint_writer_child() -> Result<()> {
    let Ok(path) = std::env::var(CHILD_ENV) else {
        return Ok(());
    };
    let g = data(1_000_000, 26, 20_000);
    let mut t = config(&g, 16).build()?;
    for (i, b) in batches(&g, Split::Train, 64, 1).enumerate() {
        t.train_step(&b?)?;
        let user = BTreeMap::from([("written".to_string(), i.to_string())]);
        t.save_checkpoint(Path::new(&path), &user)?;
    }
    Ok(())
}

#[test]
fn a_kill_during_a_checkpoint_write_leaves_the_previous_one_loadable() -> Result<()> {
    let g = data(1_000_000, 26, 20_000);
    let dir = temp_dir("kill");
    let path = dir.join("ckpt.safetensors");
    // Each round: start the writer, wait until it has written at least once, kill it (SIGKILL,
    // no cleanup), then load what is on disk. Odd rounds kill at a moment that moves around
    // between rounds; even rounds catch the writer inside a write: when its temporary file
    // appears the child is stopped (SIGSTOP, confirmed in /proc), and killed only if the file
    // is still there while it cannot move (else it is resumed and caught at the next write).
    // Rounds go on until two kills have landed inside a write (a leftover temporary file
    // proves it) or 40 rounds have passed; two must have landed inside a write, and every
    // round's checkpoint must load (and the next save remove the killed writer's leftover).
    // The writer's temporary file: `.ckpt.safetensors.tmp.<pid>-<write>-<clock>`.
    let tmp = |pid: u32| {
        let prefix = format!(".ckpt.safetensors.tmp.{pid}-");
        (std::fs::read_dir(&dir).unwrap().flatten()).any(|e| {
            let name = e.file_name();
            let name = name.to_string_lossy();
            name.strip_prefix(&prefix)
                .is_some_and(|n| n.bytes().all(|b| b.is_ascii_digit() || b == b'-'))
        })
    };
    let loaded = kill::kill_rounds(
        "checkpoint_writer_child",
        (CHILD_ENV, &path),
        &path,
        40,
        tmp,
        |pid, mid_write| -> Result<u64> {
            let mut t = config(&g, 16).build()?;
            let user = t.load_checkpoint(&path)?;
            let written: u64 = user["written"].parse().unwrap();
            assert_eq!(t.step(), written + 1);
            if mid_write {
                // Killed in the middle of a write, the writer left its half-written file
                // behind: the next write of the checkpoint removes it (no one holds it).
                assert!(tmp(pid));
                t.save_checkpoint(&path, &user)?;
                assert!(!tmp(pid), "a dead writer's temporary file is left");
            }
            Ok(written)
        },
    )?;
    println!("checkpoints loaded after kills: {loaded:?}");
    std::fs::remove_dir_all(&dir).unwrap();
    Ok(())
}

#[test]
fn a_diverging_run_is_an_error_naming_the_step() -> Result<()> {
    // Learning rates of 1e38 throw the weights past f32's range after one update: the next
    // loss is not finite, and the step that saw it is named.
    let g = data(20_000, 4, 50);
    let mut cfg = config(&g, 8);
    cfg.dense_optimizer = DenseOptimizer::Adagrad { lr: 1e38 };
    cfg.sparse_optimizer = FusedOptimizer::RowWiseAdagrad {
        lr: 1e38,
        eps: 1e-8,
    };
    let mut trainer = cfg.build()?;
    let mut error = None;
    for (i, batch) in batches(&g, Split::Train, 256, 1).take(10).enumerate() {
        let before = state_bits(&trainer);
        if let Err(e) = trainer.train_step(&batch?) {
            // On the host the diverging step is not taken: nothing it would write (a
            // non-finite gradient into the tables) is written.
            assert!(
                state_bits(&trainer) == before,
                "the diverging step changed the model"
            );
            error = Some((i + 1, e.to_string()));
            break;
        }
    }
    let (step, msg) = error.expect("a non-finite loss within 10 steps");
    assert!(step >= 2, "the first loss is finite (step {step})");
    assert!(
        msg.contains("diverged")
            && msg.contains(&format!("step {step}"))
            && msg.contains("not taken"),
        "{msg}"
    );
    Ok(())
}

/// An empty batch is refused before anything changes (its mean loss is 0/0, reported as
/// divergence after the optimizer had stepped); pooled embeddings of another shape than
/// `[B, F·D]` are refused by `forward_pooled` (a reshape took any tensor of B·F·D elements).
#[test]
fn an_empty_batch_and_misshapen_pooled_embeddings_are_refused() -> Result<()> {
    use embers::sparse::KeyedJaggedTensor;
    use embers::{DType, Device, Tensor};
    let g = data(1_000, 3, 20);
    let cfg = config(&g, 4);
    let mut trainer = cfg.build()?;
    let before = state_bits(&trainer);
    let keys: Vec<String> = cfg.sparse_features.iter().map(|(k, _)| k.clone()).collect();
    let empty = Batch::new(
        Tensor::zeros(&[0, cfg.num_dense], DType::F32, Device::Cpu),
        KeyedJaggedTensor::from_lengths(
            keys,
            Tensor::zeros(&[0], DType::I64, Device::Cpu),
            Tensor::zeros(&[0], DType::I32, Device::Cpu),
            None,
            Some(0),
        )?,
        Tensor::zeros(&[0, 1], DType::F32, Device::Cpu),
    )?;
    let e = trainer.train_step(&empty).unwrap_err().to_string();
    assert!(e.contains("an empty batch"), "{e}");
    assert_eq!(state_bits(&trainer), before);
    let model = trainer.model();
    let dense = Tensor::zeros(&[2, cfg.num_dense], DType::F32, Device::Cpu);
    let fd = 3 * 4;
    model.forward_pooled(&dense, &Tensor::zeros(&[2, fd], DType::F32, Device::Cpu))?;
    for shape in [&[1, 2 * fd][..], &[fd, 2], &[2 * fd]] {
        let pooled = Tensor::zeros(shape, DType::F32, Device::Cpu);
        let e = model
            .forward_pooled(&dense, &pooled)
            .unwrap_err()
            .to_string();
        assert!(e.contains(&format!("[B, {fd}]")), "{e}");
    }
    Ok(())
}
