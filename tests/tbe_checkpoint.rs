//! Tables and optimizer state round-trip through safetensors; files are written atomically and
//! a bad file is rejected without touching the operator.

use embers::embedding::{
    EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingInit, FusedOptimizer, PoolingMode,
    QuantizedTableBatchedEmbedding, TableBatchedEmbedding, TableSpec, TbeConfig, TbeInput,
    WeightType,
};
use embers::tensor::rng::seeded;

#[path = "support/config_edit.rs"]
mod config_edit;

fn tmp_dir(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("embers-tbe-ckpt-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn adam_tbe() -> TableBatchedEmbedding {
    tbe_with(FusedOptimizer::Adam {
        lr: 0.01,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
    })
}

fn tbe_with(optimizer: FusedOptimizer) -> TableBatchedEmbedding {
    TableBatchedEmbedding::new(TbeConfig::new(
        vec![TableSpec::new("users", 7, 3), TableSpec::new("items", 5, 6)],
        vec![0, 1, 0],
        PoolingMode::Sum,
        optimizer,
    ))
    .unwrap()
}

fn step(tbe: &TableBatchedEmbedding, seed: i64) {
    let ids = [1i64, 2, (seed % 7), 4, 0, 3, 3];
    let offsets = [0i64, 2, 3, 5, 5, 6, 7];
    let grad: Vec<f32> = (0..2 * 12)
        .map(|i| ((i as i64 * 31 + seed) % 11) as f32 / 5.0 - 1.0)
        .collect();
    tbe.backward_fused(TbeInput::new(&ids[..], &offsets[..]), &grad)
        .unwrap();
}

fn snapshot(tbe: &TableBatchedEmbedding) -> Vec<Vec<f32>> {
    let mut v = Vec::new();
    for t in 0..2 {
        v.push(tbe.table_weights(t).unwrap());
        v.push(tbe.optimizer_state(0, t).unwrap());
        v.push(tbe.optimizer_state(1, t).unwrap());
    }
    v
}

#[test]
fn training_state_round_trips_and_training_continues_identically() {
    let dir = tmp_dir("train");
    let path = dir.join("tbe.safetensors");
    let a = adam_tbe();
    a.init_weights(EmbeddingInit::Normal { std: 0.3 }, &mut seeded(1))
        .unwrap();
    step(&a, 1);
    step(&a, 2);
    a.save(&path).unwrap();
    // Only the checkpoint is left in the directory: the temporary file was renamed.
    let entries: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(entries, vec![std::ffi::OsString::from("tbe.safetensors")]);

    let b = adam_tbe();
    b.load(&path).unwrap();
    assert_eq!(snapshot(&a), snapshot(&b));
    assert_eq!(b.step(), 2);
    // Adam's bias correction depends on the step: continuing must agree bit for bit.
    step(&a, 3);
    step(&b, 3);
    assert_eq!(snapshot(&a), snapshot(&b));

    // Overwriting an existing checkpoint is atomic too.
    a.save(&path).unwrap();
    b.load(&path).unwrap();
    assert_eq!(snapshot(&a), snapshot(&b));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn bad_files_are_rejected_and_change_nothing() {
    let dir = tmp_dir("bad");
    let path = dir.join("tbe.safetensors");
    let a = adam_tbe();
    a.init_weights(EmbeddingInit::Normal { std: 0.3 }, &mut seeded(2))
        .unwrap();
    a.save(&path).unwrap();

    let b = adam_tbe();
    b.init_weights(EmbeddingInit::Constant { value: 0.25 }, &mut seeded(0))
        .unwrap();
    let before = snapshot(&b);
    // Truncated file.
    let bytes = std::fs::read(&path).unwrap();
    std::fs::write(&path, &bytes[..bytes.len() / 2]).unwrap();
    assert!(b.load(&path).is_err());
    assert_eq!(snapshot(&b), before);
    // Different optimizer.
    let sgd = TableBatchedEmbedding::new(TbeConfig::new(
        vec![TableSpec::new("users", 7, 3), TableSpec::new("items", 5, 6)],
        vec![0, 1, 0],
        PoolingMode::Sum,
        FusedOptimizer::Sgd { lr: 0.1 },
    ))
    .unwrap();
    sgd.save(&path).unwrap();
    let msg = b.load(&path).unwrap_err().to_string();
    assert!(msg.contains("saved with optimizer `sgd`"), "{msg}");
    // Different shapes.
    let other = TableBatchedEmbedding::new(TbeConfig::new(
        vec![TableSpec::new("users", 8, 3), TableSpec::new("items", 5, 6)],
        vec![0, 1],
        PoolingMode::Sum,
        FusedOptimizer::Adam {
            lr: 0.01,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
        },
    ))
    .unwrap();
    other.save(&path).unwrap();
    let msg = b.load(&path).unwrap_err().to_string();
    assert!(msg.contains("users.weight"), "{msg}");
    assert_eq!(snapshot(&b), before);
    // Missing file.
    assert!(b
        .load(dir.join("absent.safetensors"))
        .unwrap_err()
        .to_string()
        .contains("absent.safetensors"));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn quantized_tables_round_trip_byte_for_byte() {
    let dir = tmp_dir("quant");
    let path = dir.join("q.safetensors");
    let tables = vec![
        TableSpec::new("a", 5, 7),
        TableSpec::new("b", 3, 4),
        TableSpec::new("c", 4, 9),
    ];
    let types = vec![WeightType::Int4, WeightType::Fp8, WeightType::Int2];
    let mut q = QuantizedTableBatchedEmbedding::new(
        tables.clone(),
        types.clone(),
        vec![0, 1, 2],
        PoolingMode::Sum,
    )
    .unwrap();
    for (t, spec) in tables.iter().enumerate() {
        let v: Vec<f32> = (0..spec.rows * spec.dim)
            .map(|i| (i as f32 * 0.37).sin())
            .collect();
        q.quantize_table_from(t, &v).unwrap();
    }
    q.save(&path).unwrap();
    let mut r =
        QuantizedTableBatchedEmbedding::new(tables.clone(), types, vec![0, 1, 2], PoolingMode::Sum)
            .unwrap();
    r.load(&path).unwrap();
    for t in 0..3 {
        assert_eq!(q.table_bytes(t).unwrap(), r.table_bytes(t).unwrap());
    }
    let mut wrong = QuantizedTableBatchedEmbedding::new(
        tables,
        vec![WeightType::Int8, WeightType::Fp8, WeightType::Int2],
        vec![0, 1, 2],
        PoolingMode::Sum,
    )
    .unwrap();
    assert!(wrong.load(&path).unwrap_err().to_string().contains("INT4"));
    // A weight type embers does not know: named with the file and table.
    let odd = dir.join("odd.safetensors");
    std::fs::copy(&path, &odd).unwrap();
    let name = "b".to_string();
    config_edit::rewrite_metadata(&odd, &format!("{name}.weight_type"), |_| "INT3".into());
    let err = r.load(&odd).unwrap_err().to_string();
    assert!(
        err.contains("odd.safetensors")
            && err.contains(&format!("table `{name}`"))
            && err.contains("INT3"),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn collections_save_all_their_tables_in_one_file() {
    let dir = tmp_dir("ebc");
    let path = dir.join("ebc.safetensors");
    let configs = vec![
        EmbeddingBagConfig::new("t0", 6, 3, &["a", "b"]),
        EmbeddingBagConfig::new("t1", 4, 5, &["c"]).with_pooling(PoolingMode::Mean),
    ];
    let opt = FusedOptimizer::RowWiseAdagrad { lr: 0.1, eps: 1e-3 };
    let a = EmbeddingBagCollection::new(configs.clone(), opt, &mut seeded(1)).unwrap();
    let b = EmbeddingBagCollection::new(configs, opt, &mut seeded(2)).unwrap();
    assert_ne!(
        a.table_weights("t0").unwrap(),
        b.table_weights("t0").unwrap()
    );
    a.save(&path).unwrap();
    // Tables under a prefix (a trainer's checkpoint), or a file without a group's step: named
    // errors that change nothing (the first said "saved with optimizer ``", the second loaded
    // with step 0, restarting bias correction over the loaded moments).
    use embers::checkpoint::{CheckpointReader, CheckpointWriter};
    let before = b.table_weights("t0").unwrap();
    let prefixed = dir.join("prefixed.safetensors");
    let mut w = CheckpointWriter::new();
    a.checkpoint_into(&mut w, "tables.").unwrap();
    w.write(&prefixed).unwrap();
    let err = b.load(&prefixed).unwrap_err().to_string();
    assert!(err.contains("no embedding tables under ``"), "{err}");
    let r = CheckpointReader::open(&path).unwrap();
    let mut no_step = CheckpointWriter::new();
    for name in r.names() {
        no_step
            .add_tensor(name.clone(), &r.read_tensor(&name).unwrap())
            .unwrap();
    }
    for (k, v) in r.names_of_metadata() {
        if k != "group0.step" {
            no_step.set_metadata(k, v);
        }
    }
    let no_step_path = dir.join("no-step.safetensors");
    no_step.write(&no_step_path).unwrap();
    let err = b.load(&no_step_path).unwrap_err().to_string();
    assert!(err.contains("`group0.step` is missing"), "{err}");
    assert_eq!(b.table_weights("t0").unwrap(), before);
    b.load(&path).unwrap();
    for t in ["t0", "t1"] {
        assert_eq!(a.table_weights(t).unwrap(), b.table_weights(t).unwrap());
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_trained_table_quantises_into_every_weight_type() {
    let tbe = TableBatchedEmbedding::new(TbeConfig::one_feature_per_table(
        vec![TableSpec::new("t", 6, 5)],
        PoolingMode::Sum,
        FusedOptimizer::Sgd { lr: 0.1 },
    ))
    .unwrap();
    tbe.init_weights(
        EmbeddingInit::Uniform {
            low: -1.0,
            high: 1.0,
        },
        &mut seeded(7),
    )
    .unwrap();
    let ids = [0i64, 5, 5, 2];
    let offsets = [0i64, 3, 4];
    let fp32 = tbe
        .lookup(TbeInput::new(&ids[..], &offsets[..]))
        .unwrap()
        .to_vec::<f32>()
        .unwrap();
    for ty in WeightType::ALL {
        let q = QuantizedTableBatchedEmbedding::from_trained(&tbe, &[ty]).unwrap();
        let deq = q.dequantize_table(0).unwrap();
        // The quantised lookup equals the FP32 lookup over the dequantised table.
        let expected: Vec<f32> = (0..2)
            .flat_map(|b| {
                let range = offsets[b] as usize..offsets[b + 1] as usize;
                let deq = &deq;
                (0..5).map(move |j| {
                    range
                        .clone()
                        .map(|p| deq[ids[p] as usize * 5 + j])
                        .sum::<f32>()
                })
            })
            .collect();
        let got = q
            .forward(TbeInput::new(&ids[..], &offsets[..]))
            .unwrap()
            .to_vec::<f32>()
            .unwrap();
        for (g, e) in got.iter().zip(&expected) {
            assert!(
                (g - e).abs() <= 1e-6 * (1.0 + e.abs()),
                "{ty:?}: {g} vs {e}"
            );
        }
        let tol = match ty {
            WeightType::Fp32 => 0.0,
            WeightType::Fp16 | WeightType::Bf16 => 0.03,
            WeightType::Fp8 | WeightType::Fp8E4m3fn => 0.4,
            WeightType::Int8 => 0.05,
            WeightType::Int4 => 0.5,
            WeightType::Int2 => 2.0,
        };
        for (g, e) in got.iter().zip(&fp32) {
            assert!((g - e).abs() <= tol, "{ty:?}: {g} vs fp32 {e}");
        }
    }
}

#[test]
fn per_row_and_per_element_state_side_by_side_round_trip() {
    // Partial row-wise LAMB keeps momentum1 per element and momentum2 per row.
    let lamb = FusedOptimizer::PartialRowWiseLamb {
        lr: 0.01,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-6,
    };
    let dir = tmp_dir("lamb");
    let path = dir.join("tbe.safetensors");
    let a = tbe_with(lamb);
    a.init_weights(EmbeddingInit::Normal { std: 0.3 }, &mut seeded(2))
        .unwrap();
    step(&a, 1);
    step(&a, 2);
    assert_eq!(a.optimizer_state(0, 1).unwrap().len(), 5 * 6);
    assert_eq!(a.optimizer_state(1, 1).unwrap().len(), 5);
    assert!(a.optimizer_state(1, 0).unwrap().iter().any(|&v| v > 0.0));
    a.save(&path).unwrap();
    let b = tbe_with(lamb);
    b.load(&path).unwrap();
    assert_eq!(snapshot(&a), snapshot(&b));
    step(&a, 3);
    step(&b, 3);
    assert_eq!(snapshot(&a), snapshot(&b));
    // A checkpoint of another optimizer is refused.
    let c = adam_tbe();
    let err = c.load(&path).unwrap_err().to_string();
    assert!(err.contains("partial_rowwise_lamb"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A cached TBE's checkpoint keeps its rows in a parts directory beside the file. A writer
/// whose parts were made for another path refuses to write and leaves no parts behind; a
/// checkpoint whose metadata names something else than a parts directory is refused by name
/// and changes nothing.
#[test]
fn parts_directories_are_checked_on_write_and_on_load() {
    use embers::checkpoint::{CheckpointReader, CheckpointWriter};
    use embers::embedding::{CacheConfig, CacheSize, Placement};
    let dir = tmp_dir("parts");
    let cached = |seed: u64| {
        let cfg = TbeConfig::new(
            vec![TableSpec::new("users", 300, 4)],
            vec![0],
            PoolingMode::Sum,
            FusedOptimizer::Sgd { lr: 0.1 },
        );
        let cache = CacheConfig::in_host_memory(CacheSize::LoadFactor(0.2));
        let tbe = TableBatchedEmbedding::new_cached(cfg, cache).unwrap();
        let init = EmbeddingInit::Uniform {
            low: -1.0,
            high: 1.0,
        };
        tbe.init_weights(init, &mut seeded(seed)).unwrap();
        tbe
    };
    let a = cached(1);
    let path = dir.join("a.safetensors");
    a.save(&path).unwrap();
    let parts = |name: &str| -> Vec<String> {
        (std::fs::read_dir(&dir).unwrap().flatten())
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with(&format!("{name}.parts-")))
            .collect()
    };
    assert_eq!(parts("a.safetensors").len(), 1);

    // Parts made for one path, the file written to another: refused, and no parts remain.
    let ebc = EmbeddingBagCollection::with_placement(
        vec![EmbeddingBagConfig::new("items", 200, 4, &["f"])],
        FusedOptimizer::Sgd { lr: 0.1 },
        &Placement::for_kernel("fused_uvm_caching", Some(0.2), "", Default::default()).unwrap(),
        &mut seeded(2),
    )
    .unwrap();
    let mut w = CheckpointWriter::new();
    w.parts_beside(dir.join("b.safetensors"));
    ebc.checkpoint_into(&mut w, "tables.").unwrap();
    assert_eq!(
        parts("b.safetensors").len(),
        1,
        "the cached table's rows went there"
    );
    let err = w.write(dir.join("c.safetensors")).unwrap_err().to_string();
    assert!(err.contains("parts were made for"), "{err}");
    // A prefix that would put a cached group's rows outside the parts directory, or in a
    // directory no load accepts: refused as it is written (it saved, and never loaded).
    for prefix in ["../", "sparse/", ".x"] {
        let mut w = CheckpointWriter::new();
        w.parts_beside(dir.join("d.safetensors"));
        let err = ebc.checkpoint_into(&mut w, prefix).unwrap_err().to_string();
        assert!(
            err.contains(&format!("the name prefix `{prefix}`")),
            "{err}"
        );
    }
    assert!(!dir.join("group0").exists());
    assert!(
        parts("b.safetensors").is_empty(),
        "the unwritten checkpoint's parts stay"
    );
    assert!(!dir.join("c.safetensors").exists());

    // A checkpoint naming a parts directory outside its own: refused by name.
    let r = CheckpointReader::open(&path).unwrap();
    let mut forged = CheckpointWriter::new();
    for name in r.names() {
        forged
            .add_tensor(name.clone(), &r.read_tensor(&name).unwrap())
            .unwrap();
    }
    for (k, v) in r.names_of_metadata() {
        let v = if k == "parts_dir" {
            "../elsewhere.parts-1".to_string()
        } else {
            v
        };
        forged.set_metadata(k, v);
    }
    let forged_path = dir.join("forged.safetensors");
    forged.write(&forged_path).unwrap();
    let b = cached(3);
    let before = b.table_weights(0).unwrap();
    let err = b.load(&forged_path).unwrap_err().to_string();
    assert!(err.contains("not a parts directory name"), "{err}");
    assert_eq!(b.table_weights(0).unwrap(), before);
    // The real one loads.
    b.load(&path).unwrap();
    assert_eq!(b.table_weights(0).unwrap(), a.table_weights(0).unwrap());
    std::fs::remove_dir_all(&dir).unwrap();
}
