//! A small trained DLRM for the serving tests (`serve_batcher.rs`, `serve_http.rs`): synthetic
//! Criteo-shaped data (4 features of 100 rows), its model configuration, training passes and
//! the test split as serving rows.

use std::path::PathBuf;

use embers::embedding::FusedOptimizer;
use embers::serve::DlrmRow;
use embers::train::{DenseOptimizer, DlrmConfig, DlrmTrainer};
use embers_datasets::{BatchConfig, Batcher, RawBatch, Split, SyntheticCriteo};

/// `num_train` / `num_test` examples of `num_tasks` tasks.
pub fn data(num_train: u64, num_test: u64, num_tasks: usize) -> SyntheticCriteo {
    SyntheticCriteo::new(embers_datasets::SyntheticCriteoConfig {
        table_sizes: vec![100; 4],
        ids_per_feature: vec![2, 1, 3, 1],
        num_train,
        num_validation: 0,
        num_test,
        num_tasks,
        ..Default::default()
    })
    .unwrap()
}

/// A DLRM for `g`'s features and tasks (D = 8, MLPs of 16).
pub fn config(g: &SyntheticCriteo) -> DlrmConfig {
    DlrmConfig {
        num_dense: g.schema().num_dense(),
        sparse_features: (g.schema().sparse_keys.iter())
            .map(|k| (k.clone(), 100))
            .collect(),
        embedding_dim: 8,
        dense_arch: vec![16],
        over_arch: vec![16],
        tasks: g.schema().tasks.clone(),
        dcn: None,
        dense_optimizer: DenseOptimizer::Adagrad { lr: 0.05 },
        sparse_optimizer: FusedOptimizer::RowWiseAdagrad {
            lr: 0.05,
            eps: 1e-8,
        },
        seed: 1,
        metrics_window: 100,
        device: embers::Device::Cpu,
    }
}

/// `epochs` passes over the training split in batches of 128.
pub fn train(trainer: &mut DlrmTrainer, g: &SyntheticCriteo, epochs: usize) {
    for _ in 0..epochs {
        let batches = Batcher::new(
            g.split(Split::Train),
            BatchConfig {
                batch_size: 128,
                ..BatchConfig::default()
            },
        )
        .unwrap();
        for batch in batches {
            trainer
                .train_step(&RawBatch::into_batch(batch.unwrap()).unwrap())
                .unwrap();
        }
    }
}

/// A DLRM for `g` trained `epochs` passes and saved as `model.safetensors` in a new temp dir
/// `embers-<name>-<pid>`: its config, trainer, dir and checkpoint path.
#[allow(dead_code)] // not every test file that includes this module trains one
pub fn trained_checkpoint(
    g: &SyntheticCriteo,
    epochs: usize,
    name: &str,
) -> (DlrmConfig, DlrmTrainer, PathBuf, PathBuf) {
    let config = config(g);
    let mut trainer = config.build().unwrap();
    train(&mut trainer, g, epochs);
    let dir = std::env::temp_dir().join(format!("embers-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("model.safetensors");
    trainer.save_checkpoint(&path, &Default::default()).unwrap();
    (config, trainer, dir, path)
}

/// The test split as serving rows.
pub fn rows(g: &SyntheticCriteo) -> Vec<DlrmRow> {
    g.examples(g.split_range(Split::Test))
        .map(|e| {
            let e = e.unwrap();
            let mut ids = Vec::new();
            let mut at = 0;
            for &l in &e.lengths {
                ids.push(e.ids[at..at + l as usize].to_vec());
                at += l as usize;
            }
            DlrmRow {
                dense: e.dense,
                ids,
            }
        })
        .collect()
}
