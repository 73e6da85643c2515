//! The readers of files a user hands embers, fuzzed (`tests/support/fuzz.rs`): checkpoints
//! (the safetensors reader; a DLRM trainer's full restore: header, metadata, every tensor's
//! dtype, shape and bytes, into a trainer of its own or of the configuration the file
//! carries, as a server loads it; a TwoTower trainer's, likewise), sharding plans
//! (`embers-plan` JSON, checked against the tables), IVF-PQ index files (loaded, then
//! searched), and the manifests of cached tables' and of sharded checkpoints.
//! No input may panic, hang or allocate without bound; errors must say what is wrong.

#[path = "support/checksums.rs"]
mod checksums;
#[path = "support/fuzz.rs"]
mod fuzz;

use embers::checkpoint::CheckpointReader;
use embers::distributed::{ShardingPlan, TableShape};
use embers::embedding::FusedOptimizer;
use embers::train::{DenseOptimizer, DlrmConfig};
use std::collections::BTreeMap;

#[global_allocator]
static ALLOC: fuzz::CountingAlloc = fuzz::CountingAlloc;

/// Writes fuzz input `bytes` to `path`: every other one with its data checksums made again
/// (where its header still holds them), so that the checks behind them (values, shapes,
/// metadata) are fuzzed too, not only the checksums.
fn write_input(path: &std::path::Path, bytes: &[u8], count: &std::cell::Cell<u64>) {
    count.set(count.get() + 1);
    let again = (count.get() % 2 == 0).then(|| checksums::restamped(bytes));
    std::fs::write(path, again.flatten().as_deref().unwrap_or(bytes)).unwrap();
}

/// An error as a fuzz target returns it, checked to name `what` (its file or directory).
fn naming(what: &'static str) -> impl Fn(embers::Error) -> String + Copy {
    move |e| {
        let msg = e.to_string();
        assert!(msg.contains(what), "the error does not name {what}: {msg}");
        msg
    }
}

fn dlrm() -> DlrmConfig {
    DlrmConfig {
        num_dense: 3,
        sparse_features: vec![("a".into(), 40), ("b".into(), 25)],
        embedding_dim: 4,
        dense_arch: vec![8],
        over_arch: vec![8],
        tasks: vec!["click".to_string()],
        dcn: None,
        dense_optimizer: DenseOptimizer::Adagrad { lr: 0.05 },
        sparse_optimizer: FusedOptimizer::RowWiseAdagrad {
            lr: 0.05,
            eps: 1e-8,
        },
        seed: 3,
        metrics_window: 100,
        device: embers::Device::Cpu,
    }
}

/// A trainer checkpoint as the seed; each input is restored into a fresh trainer.
#[test]
fn checkpoints() {
    let dir = std::env::temp_dir().join(format!("embers-fuzz-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let seed_path = dir.join("seed.safetensors");
    let user = BTreeMap::from([("epoch".to_string(), "1".to_string())]);
    dlrm()
        .build()
        .unwrap()
        .save_checkpoint(&seed_path, &user)
        .unwrap();
    let seeds = vec![std::fs::read(&seed_path).unwrap()];
    let count = std::cell::Cell::new(0);
    let path = dir.join("ckpt.safetensors");
    let named = naming("ckpt.safetensors");
    fuzz::run("checkpoint-reader", &seeds, |bytes| {
        write_input(&path, bytes, &count);
        let r = CheckpointReader::open(&path).map_err(named)?;
        for name in r.names() {
            r.read_tensor(&name).map_err(named)?;
        }
        Ok(())
    });
    fuzz::run("checkpoint-dlrm", &seeds, |bytes| {
        write_input(&path, bytes, &count);
        let mut trainer = dlrm().build().unwrap();
        trainer.load_checkpoint(&path).map(|_| ()).map_err(named)
    });
    // As a server loads a model: built from the configuration the file carries.
    fuzz::run("checkpoint-dlrm-own-config", &seeds, |bytes| {
        write_input(&path, bytes, &count);
        let config = DlrmConfig::from_checkpoint(&path).map_err(named)?;
        let mut trainer = config.build().map_err(|e| e.to_string())?;
        trainer.load_checkpoint(&path).map(|_| ()).map_err(named)
    });
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn sharding_plans() {
    let config = embers_planner::Config::from_toml(
        r#"
        batch_size = 64
        [topology]
        world_size = 4
        local_world_size = 2
        [[tables]]
        name = "a"
        rows = 400
        dim = 16
        [[tables]]
        name = "b"
        rows = 90
        dim = 8
        [[tables]]
        name = "c"
        rows = 3000
        dim = 32
        "#,
    )
    .unwrap()
    .resolve()
    .unwrap();
    let plan = embers_planner::plan_problem(&config, embers_planner::CostModel::Torchrec).unwrap();
    let seeds = vec![plan.to_json().into_bytes()];
    let tables = [
        TableShape::new("a", 400, 16),
        TableShape::new("b", 90, 8),
        TableShape::new("c", 3000, 32),
    ];
    fuzz::run("sharding-plan", &seeds, |bytes| {
        let text = std::str::from_utf8(bytes).map_err(|e| e.to_string())?;
        let plan = ShardingPlan::from_json(text).map_err(|e| e.to_string())?;
        plan.check(&tables).map_err(|e| e.to_string())
    });
}

/// A TwoTower trainer checkpoint as the seed; each input's configuration is built and the
/// checkpoint restored into it, as a retrieval server loads its model.
#[test]
fn two_tower_checkpoints() {
    use embers::train::{DenseOptimizer, TwoTowerConfig, TwoTowerLoss};
    let dir = std::env::temp_dir().join(format!("embers-fuzz-tt-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let config = TwoTowerConfig {
        query_features: vec![("user".into(), 30)],
        candidate_features: vec![("item".into(), 20)],
        embedding_dim: 4,
        layers: vec![8, 4],
        normalize: true,
        temperature: 0.2,
        loss: TwoTowerLoss::Pointwise,
        estimator_buckets: 64,
        estimator_alpha: 0.05,
        sparse_optimizer: FusedOptimizer::RowWiseAdagrad {
            lr: 0.05,
            eps: 1e-8,
        },
        dense_optimizer: DenseOptimizer::Adam { lr: 0.01 },
        seed: 5,
        device: embers::Device::Cpu,
    };
    let seed_path = dir.join("seed.ckpt");
    (config.build().unwrap())
        .save_checkpoint(&seed_path, &BTreeMap::new())
        .unwrap();
    let seeds = vec![std::fs::read(&seed_path).unwrap()];
    let count = std::cell::Cell::new(0);
    let path = dir.join("tt.ckpt");
    fuzz::run("checkpoint-two-tower-own-config", &seeds, |bytes| {
        write_input(&path, bytes, &count);
        let named = naming("tt.ckpt");
        let config = TwoTowerConfig::from_checkpoint(&path).map_err(named)?;
        let mut trainer = config.build().map_err(|e| e.to_string())?;
        trainer.load_checkpoint(&path).map(|_| ()).map_err(named)
    });
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The manifest of a cached table's checkpoint (`manifest.json`: tables, step, row file,
/// its length and checksum) as the seed; each input replaces it beside the saved row file
/// and the checkpoint is loaded into a TBE of the same tables.
#[test]
fn cached_table_manifests() {
    use embers::embedding::{
        CacheConfig, CacheSize, PoolingMode, TableBatchedEmbedding, TableSpec, TbeConfig,
    };
    let dir = std::env::temp_dir().join(format!("embers-fuzz-cached-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let config = TbeConfig::new(
        vec![TableSpec::new("a", 300, 8), TableSpec::new("b", 40, 4)],
        vec![0, 1],
        PoolingMode::Sum,
        FusedOptimizer::RowWiseAdagrad {
            lr: 0.05,
            eps: 1e-8,
        },
    );
    let cached = |name: &str| {
        let cache = CacheConfig::new(dir.join(name), CacheSize::LoadFactor(0.2));
        TableBatchedEmbedding::new_cached(config.clone(), cache).unwrap()
    };
    let ckpt = dir.join("ckpt");
    cached("saved.bin").save_cached_checkpoint(&ckpt).unwrap();
    let manifest = ckpt.join("manifest.json");
    let seeds = vec![std::fs::read(&manifest).unwrap()];
    let tbe = cached("loaded.bin");
    fuzz::run("cached-table-manifest", &seeds, |bytes| {
        std::fs::write(&manifest, bytes).unwrap();
        tbe.load_cached_checkpoint(&ckpt).map_err(naming("ckpt"))
    });
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The manifest of a sharded checkpoint (2 ranks: a row-wise and a table-wise table) as the
/// seed; each input replaces it beside the rank files and the checkpoint is loaded into one
/// unsharded collection.
#[test]
fn sharded_checkpoint_manifests() {
    use embers::distributed::{
        load_into_unsharded, LocalGroup, Placement, ShardedEmbeddingBagCollection,
    };
    use embers::embedding::{EmbeddingBagCollection, EmbeddingBagConfig};
    let dir = std::env::temp_dir().join(format!("embers-fuzz-sharded-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let tables = vec![
        EmbeddingBagConfig::new("a", 40, 8, &["fa"]),
        EmbeddingBagConfig::new("b", 30, 4, &["fb"]),
    ];
    let optimizer = FusedOptimizer::RowWiseAdagrad {
        lr: 0.05,
        eps: 1e-8,
    };
    let plan = ShardingPlan::construct(
        &[TableShape::new("a", 40, 8), TableShape::new("b", 30, 4)],
        &[
            ("a", Placement::RowWise),
            ("b", Placement::TableWise { rank: 1 }),
        ],
        2,
        2,
    )
    .unwrap();
    let ckpt = dir.join("ckpt");
    std::thread::scope(|s| {
        for comm in LocalGroup::comms(2).unwrap() {
            let (tables, plan, ckpt) = (tables.clone(), &plan, &ckpt);
            s.spawn(move || {
                let sharded =
                    ShardedEmbeddingBagCollection::new(tables, plan, optimizer, comm, 3).unwrap();
                sharded.save(ckpt).unwrap();
            });
        }
    });
    let manifest = ckpt.join("manifest.safetensors");
    let seeds = vec![std::fs::read(&manifest).unwrap()];
    let count = std::cell::Cell::new(0);
    let whole = EmbeddingBagCollection::new(tables, optimizer, &mut embers::tensor::rng::seeded(1))
        .unwrap();
    fuzz::run("sharded-checkpoint-manifest", &seeds, |bytes| {
        write_input(&manifest, bytes, &count);
        load_into_unsharded(&whole, &ckpt)
            .map(|_| ())
            .map_err(naming("ckpt"))
    });
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A small saved IVF-PQ index as the seed; each input is loaded and, when accepted, searched.
#[test]
fn ivfpq_indexes() {
    use embers::retrieval::{IvfPqConfig, IvfPqIndex, Metric};
    let dir = std::env::temp_dir().join(format!("embers-fuzz-ivfpq-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (dim, n) = (8, 300);
    let mut rng = fuzz::Rng::new(7);
    let x: Vec<f32> = (0..n * dim)
        .map(|_| (rng.next() >> 40) as f32 / (1u64 << 24) as f32 - 0.5)
        .collect();
    let config = IvfPqConfig {
        coarse_iters: 2,
        pq_iters: 2,
        ..IvfPqConfig::new(4, 2, Metric::L2)
    };
    let mut index = IvfPqIndex::train(config, &x, dim).unwrap();
    index.add(&(0..n as i64).collect::<Vec<_>>(), &x).unwrap();
    let seed_path = dir.join("seed.safetensors");
    index.save(&seed_path).unwrap();
    let seeds = vec![std::fs::read(&seed_path).unwrap()];
    let count = std::cell::Cell::new(0);
    let path = dir.join("index.safetensors");
    fuzz::run("ivfpq-index", &seeds, |bytes| {
        write_input(&path, bytes, &count);
        let loaded = IvfPqIndex::load(&path).map_err(naming("index.safetensors"))?;
        let queries = vec![0.25f32; loaded.dim() * 2];
        loaded
            .search(&queries, 5, 4)
            .map(|_| ())
            .map_err(|e| e.to_string())
    });
    std::fs::remove_dir_all(&dir).unwrap();
}
