//! The sharded == unsharded scenarios, shared by the in-process tests (threads over
//! `LocalGroup`) and by the MPI worker (`src/bin/embers-dist-worker.rs`, one process per rank).
//!
//! Every rank builds the sharded collection of a case and, beside it, the unsharded
//! reference: the same tables (both initialised by `init_table`), the same dense head, and the
//! global batch — every rank's batch concatenated in rank order (every rank can generate every
//! rank's batch: they come from seeds). Each step:
//! * sharded: this rank's batch, BCE averaged over it, dense gradients all-reduced (mean);
//! * unsharded: the global batch, each sample's loss weighted by `1/(W·B_r)` — the mean over
//!   ranks of each rank's mean, which is what TorchRec's gradient division computes (with equal
//!   batches, the plain global mean).
//!
//! Predictions must agree every step and every table (gathered from its shards) after the
//! last, within `|a−b| ≤ 1e-5 + 1.3e-6·|b|` (TorchRec's `assert_close` for f32). The bytes each
//! collective moved in the last step must equal the closed forms of the design note, computed
//! here from the plan's shapes and the batches — independently of `src/distributed`.
#![allow(dead_code)]

use std::collections::BTreeMap;

use embers::distributed::{
    all_reduce_mean_gradients, init_table, load_into_unsharded, Comm, ComputeKernel, LoadReport,
    Placement, ShardCaches, ShardedEmbeddingBagCollection, ShardingPlan, TableShape,
};
use embers::embedding::{
    CachePolicy, EmbeddingBagCollection, EmbeddingBagConfig, FusedOptimizer, PoolingMode,
    WeightDecay,
};
use embers::nn::{Forward, Linear, Module};
use embers::optim::{Optimizer, Sgd};
use embers::sparse::KeyedJaggedTensor;
use embers::tensor::rng::{seeded, Rng};
use embers::tensor::Reduction;
use embers::Tensor;
use rand::Rng as _;

/// Seed of the tables and of the dense head.
pub const SEED: u64 = 2024;

/// One scenario: tables, plan, optimizer, batch shapes.
#[derive(Clone, Debug)]
pub struct Case {
    pub name: String,
    pub world: usize,
    pub local: usize,
    pub placements: Vec<(String, Placement)>,
    pub optimizer: FusedOptimizer,
    pub weighted: bool,
    /// Batch size of each rank.
    pub batches: Vec<usize>,
    /// Where the sharded tables live (the unsharded reference stays on the CPU).
    pub device: embers::Device,
    /// Tables given another compute kernel than the hand-written plan's `fused` (`dense` for
    /// data-parallel tables), with the cache load factor.
    pub kernels: Vec<(String, ComputeKernel, Option<f64>)>,
    /// Where shards of cached kernels keep their rows.
    pub caches: ShardCaches,
}

/// The tables (TorchRec's test shapes: rows `(i+1)·10`, dims `(i+2)·8`, then one small one),
/// SUM and MEAN pooled, the first read by two features.
pub fn tables() -> Vec<EmbeddingBagConfig> {
    vec![
        EmbeddingBagConfig::new("t0", 10, 16, &["f0", "f0b"]),
        EmbeddingBagConfig::new("t1", 20, 24, &["f1"]).with_pooling(PoolingMode::Mean),
        EmbeddingBagConfig::new("t2", 30, 32, &["f2"]),
        EmbeddingBagConfig::new("t3", 40, 40, &["f3"]).with_pooling(PoolingMode::Mean),
        EmbeddingBagConfig::new("t4", 50, 8, &["f4"]),
    ]
}

pub fn shapes() -> Vec<TableShape> {
    (tables().iter())
        .map(|c| TableShape::new(&c.name, c.num_embeddings, c.embedding_dim))
        .collect()
}

fn all(placement: impl Fn(usize) -> Placement) -> Vec<(String, Placement)> {
    (0..tables().len())
        .map(|i| (format!("t{i}"), placement(i)))
        .collect()
}

/// Every case at world size `world` (hosts of 2 ranks when `world` is 4, one host at 2).
pub fn cases(world: usize) -> Vec<Case> {
    let local = if world >= 4 { 2 } else { world };
    let hosts = world / local;
    let sgd = FusedOptimizer::Sgd { lr: 0.1 };
    let rw_adagrad = FusedOptimizer::RowWiseAdagrad { lr: 0.1, eps: 1e-8 };
    let batches: Vec<usize> = (0..world).map(|r| 3 + r % 3).collect();
    let case = |name: &str, placements: Vec<(String, Placement)>, optimizer| Case {
        name: name.to_string(),
        world,
        local,
        placements,
        optimizer,
        weighted: false,
        batches: batches.clone(),
        device: embers::Device::Cpu,
        kernels: Vec::new(),
        caches: ShardCaches::default(),
    };
    let mixed = vec![
        (
            "t0".to_string(),
            Placement::TableRowWise { host: hosts - 1 },
        ),
        ("t1".to_string(), Placement::TableWise { rank: world - 1 }),
        ("t2".to_string(), Placement::RowWise),
        (
            "t3".to_string(),
            Placement::TableColumnWise {
                ranks: vec![0, 1 % world],
            },
        ),
        ("t4".to_string(), Placement::DataParallel),
    ];
    let mut out = vec![
        case("data_parallel", all(|_| Placement::DataParallel), sgd),
        case(
            "table_wise",
            all(|i| Placement::TableWise { rank: i % world }),
            sgd,
        ),
        case(
            "column_wise",
            // The last table puts both of its blocks on one rank.
            all(|i| Placement::ColumnWise {
                ranks: if i == 4 {
                    vec![0, 0]
                } else {
                    vec![i % world, (i + 1) % world]
                },
            }),
            sgd,
        ),
        case(
            "table_column_wise",
            all(|i| {
                let first = (i % hosts) * local;
                Placement::TableColumnWise {
                    ranks: vec![(first + 1) % world, first],
                }
            }),
            sgd,
        ),
        case("row_wise", all(|_| Placement::RowWise), sgd),
        case(
            "table_row_wise",
            all(|i| Placement::TableRowWise { host: i % hosts }),
            sgd,
        ),
        case("mixed", mixed.clone(), sgd),
        case("row_wise_adagrad", all(|_| Placement::RowWise), rw_adagrad),
        case("mixed_adagrad", mixed.clone(), rw_adagrad),
    ];
    // Row-wise Adagrad with column blocks is left out: each block keeps its own per-row
    // statistic over its columns (FBGEMM's rule), which the unsharded table cannot match.
    out.iter_mut()
        .find(|c| c.name == "mixed_adagrad")
        .expect("case")
        .placements[3]
        .1 = Placement::TableWise { rank: 0 };
    let mut weighted = case("mixed_weighted", mixed, sgd);
    weighted.weighted = true;
    out.push(weighted);
    // Uneven and empty batches: the last rank has none.
    let mut empty = case("mixed_empty_rank", out[6].placements.clone(), sgd);
    empty.batches[world - 1] = 0;
    out.push(empty);
    // The plan's cached kernels: every sharded table of the mixed plan behind a cache over
    // rows in host memory (the smallest cache, or a fraction of the rows), the optimizer's
    // state kept with the rows; then row-wise shards in files, under LFU.
    let adagrad = out
        .iter()
        .find(|c| c.name == "mixed_adagrad")
        .expect("case");
    let mut cached = case("mixed_cached", adagrad.placements.clone(), rw_adagrad);
    cached.kernels = vec![
        ("t0".into(), ComputeKernel::FusedUvmCaching, Some(0.5)),
        ("t1".into(), ComputeKernel::FusedUvm, None),
        ("t2".into(), ComputeKernel::FusedUvmCaching, None),
        ("t3".into(), ComputeKernel::FusedUvm, None),
    ];
    out.push(cached);
    let mut files = case("row_wise_cached_files", all(|_| Placement::RowWise), sgd);
    files.kernels = (tables().iter())
        .map(|t| (t.name.clone(), ComputeKernel::FusedUvm, None))
        .collect();
    files.caches = ShardCaches {
        dir: std::env::temp_dir()
            .join(format!("embers-dist-cached-{world}-{}", std::process::id())),
        policy: CachePolicy::Lfu,
        ..ShardCaches::default()
    };
    out.push(files);
    out
}

/// The case called `name` at world size `world`.
pub fn case(world: usize, name: &str) -> Option<Case> {
    cases(world).into_iter().find(|c| c.name == name)
}

/// One rank's batch at one step: per feature (KJT key order), per sample, its ids and
/// weights; and the labels.
#[derive(Clone, Debug)]
pub struct RankBatch {
    pub ids: Vec<Vec<Vec<i64>>>,
    pub weights: Vec<Vec<Vec<f32>>>,
    pub labels: Vec<f32>,
}

pub fn feature_keys() -> Vec<String> {
    tables()
        .iter()
        .flat_map(|c| c.feature_names.clone())
        .collect()
}

/// Rank `rank`'s batch of `b` samples at `step` (0–3 ids per bag, some bags empty).
pub fn rank_batch(rank: usize, step: usize, b: usize) -> RankBatch {
    let mut rng: Rng = seeded(1_000 + 97 * rank as u64 + 7_919 * step as u64);
    let configs = tables();
    let mut ids = Vec::new();
    let mut weights = Vec::new();
    for c in &configs {
        for _ in &c.feature_names {
            let mut per_sample = Vec::new();
            let mut per_sample_w = Vec::new();
            for _ in 0..b {
                let n = rng.random_range(0..4usize);
                per_sample.push(
                    (0..n)
                        .map(|_| rng.random_range(0..c.num_embeddings as i64))
                        .collect(),
                );
                per_sample_w.push((0..n).map(|_| rng.random_range(0.5f32..1.5)).collect());
            }
            ids.push(per_sample);
            weights.push(per_sample_w);
        }
    }
    let labels = (0..b).map(|_| rng.random_range(0..2u8) as f32).collect();
    RankBatch {
        ids,
        weights,
        labels,
    }
}

/// The KJT of several ranks' batches concatenated (samples in rank order).
pub fn kjt_of(batches: &[&RankBatch], weighted: bool) -> KeyedJaggedTensor {
    let keys = feature_keys();
    let mut values = Vec::new();
    let mut lengths = Vec::new();
    let mut weights = Vec::new();
    for f in 0..keys.len() {
        for batch in batches {
            for (s, ids) in batch.ids[f].iter().enumerate() {
                values.extend_from_slice(ids);
                weights.extend_from_slice(&batch.weights[f][s]);
                lengths.push(ids.len() as i64);
            }
        }
    }
    let b: usize = batches.iter().map(|r| r.labels.len()).sum();
    let (n, l) = (values.len(), lengths.len());
    KeyedJaggedTensor::from_lengths(
        keys,
        Tensor::from_vec(values, &[n]).unwrap(),
        Tensor::from_vec(lengths, &[l]).unwrap(),
        weighted.then(|| Tensor::from_vec(weights, &[n]).unwrap()),
        Some(b),
    )
    .unwrap()
}

fn close(a: f32, b: f32) -> bool {
    (a - b).abs() <= 1e-5 + 1.3e-6 * b.abs()
}

/// The first pair outside tolerance, as a message.
pub fn compare(what: &str, got: &[f32], want: &[f32]) -> Result<(), String> {
    if got.len() != want.len() {
        return Err(format!(
            "{what}: {} values, expected {}",
            got.len(),
            want.len()
        ));
    }
    match (got.iter().zip(want).enumerate()).find(|(_, (a, b))| !close(**a, **b)) {
        Some((i, (a, b))) => Err(format!("{what}: value {i} is {a}, expected {b}")),
        None => Ok(()),
    }
}

/// What a rank checked.
#[derive(Debug, Default)]
pub struct Report {
    pub predictions: usize,
    pub table_values: usize,
    pub bytes_checked: usize,
    /// Ids this rank's caches were asked for (0 without cached kernels).
    pub cached_ids: u64,
    /// This rank's TBEs with their tables in managed memory.
    pub managed_tbes: usize,
}

/// What is wrong with the caches of `case` after a run whose rank reports are `reports`: the
/// plan's cached kernels put some rank's shards behind a cache, and only they; a case with a
/// cache directory keeps their rows in files there (`files` of them after the run).
pub fn cache_failures(
    case: &Case,
    reports: &[Result<Report, String>],
    files: usize,
) -> Vec<String> {
    let mut failures = Vec::new();
    if reports.iter().any(|r| r.is_err()) {
        return failures;
    }
    // On a GPU with `caches.device` set, `fused_uvm` shards live in managed memory instead.
    let managed_uvm = matches!(case.caches.device, embers::Device::Cuda(_));
    let uvm = |k: &ComputeKernel| *k == ComputeKernel::FusedUvm;
    let expect_managed = managed_uvm && case.kernels.iter().any(|k| uvm(&k.1));
    let expect_cached = case.kernels.iter().any(|k| !(managed_uvm && uvm(&k.1)));
    let managed: usize = (reports.iter().flatten()).map(|r| r.managed_tbes).sum();
    if expect_managed != (managed > 0) {
        failures.push(format!(
            "{}: {managed} TBEs in managed memory, with kernels {:?} and caches on {:?}",
            case.name, case.kernels, case.caches.device
        ));
    }
    let cached: u64 = (reports.iter().flatten()).map(|r| r.cached_ids).sum();
    if expect_cached != (cached > 0) {
        failures.push(format!(
            "{}: {cached} ids looked up through caches, with kernels {:?}",
            case.name, case.kernels
        ));
    }
    if !case.caches.dir.as_os_str().is_empty() && files == 0 {
        failures.push(format!(
            "{}: no row files in {}",
            case.name,
            case.caches.dir.display()
        ));
    }
    failures
}

/// The row files in `case`'s cache directory, which is then removed (none without one).
pub fn remove_cache_files(case: &Case) -> usize {
    let dir = &case.caches.dir;
    if dir.as_os_str().is_empty() {
        return 0;
    }
    let files = std::fs::read_dir(dir).map_or(0, |d| d.flatten().count());
    let _ = std::fs::remove_dir_all(dir);
    files
}

/// Runs `case` on this rank for `steps` steps and compares it with the unsharded run.
pub fn run_case(comm: Comm, case: &Case, steps: usize) -> Result<Report, String> {
    let e = |e: embers::Error| e.to_string();
    let mut trained = train(comm, case, 0..steps, None)?;
    for c in &tables() {
        let got = trained.sharded.table_weights(&c.name).map_err(e)?;
        let want = trained.reference.table_weights(&c.name).map_err(e)?;
        compare(
            &format!("{} rank {} table {}", case.name, trained.rank, c.name),
            &got,
            &want,
        )?;
        trained.report.table_values += got.len();
    }
    trained.report.cached_ids = (trained.sharded.cache_stats().iter())
        .map(|s| s.requested_ids)
        .sum();
    trained.report.managed_tbes = trained.sharded.managed_tbes();
    Ok(trained.report)
}

/// The plan of `case`.
pub fn plan_of(case: &Case) -> Result<ShardingPlan, String> {
    let placements: Vec<(&str, Placement)> = (case.placements.iter())
        .map(|(n, p)| (n.as_str(), p.clone()))
        .collect();
    let mut plan = ShardingPlan::construct(&shapes(), &placements, case.world, case.local)
        .map_err(|e| e.to_string())?;
    for (table, kernel, load) in &case.kernels {
        plan = plan
            .with_kernel(table, *kernel, *load)
            .map_err(|e| e.to_string())?;
    }
    Ok(plan)
}

/// The sharded collection of `case` under `plan`.
fn build_sharded(
    comm: Comm,
    case: &Case,
    plan: &ShardingPlan,
) -> embers::Result<ShardedEmbeddingBagCollection> {
    ShardedEmbeddingBagCollection::with_caches(
        tables(),
        plan,
        case.optimizer,
        WeightDecay::None,
        &case.caches,
        comm,
        SEED,
    )
}

/// The sharded collection of `case` (its plan), initialised from `SEED`.
pub fn sharded_of(comm: Comm, case: &Case) -> Result<ShardedEmbeddingBagCollection, String> {
    build_sharded(comm, case, &plan_of(case)?).map_err(|e| e.to_string())
}

/// Every optimizer state buffer of `table` in an unsharded collection.
pub fn state_of(ebc: &EmbeddingBagCollection, table: &str) -> Result<Vec<Vec<f32>>, String> {
    for tbe in ebc.tbes() {
        if let Some(t) = tbe.config().tables.iter().position(|s| s.name == table) {
            return (0..tbe.optimizer_state_names().len())
                .map(|i| tbe.optimizer_state(i, t).map_err(|e| e.to_string()))
                .collect();
        }
    }
    Err(format!("no table {table}"))
}

/// Loads checkpoint `path` into a fresh unsharded collection (initialised from another seed)
/// and checks its weights and optimizer state against `reference`: the collection and what
/// the load reported.
pub fn load_whole_and_compare(
    path: &std::path::Path,
    reference: &EmbeddingBagCollection,
    optimizer: FusedOptimizer,
) -> Result<(EmbeddingBagCollection, LoadReport), String> {
    let e = |e: embers::Error| e.to_string();
    let whole = EmbeddingBagCollection::new(tables(), optimizer, &mut seeded(77)).map_err(e)?;
    let report = load_into_unsharded(&whole, path).map_err(e)?;
    for c in tables() {
        compare(
            &format!("the saved {}", c.name),
            &whole.table_weights(&c.name).map_err(e)?,
            &reference.table_weights(&c.name).map_err(e)?,
        )?;
        let (got, want) = (state_of(&whole, &c.name)?, state_of(reference, &c.name)?);
        if got.len() != want.len() {
            return Err(format!(
                "{}: {} state buffers, {} expected",
                c.name,
                got.len(),
                want.len()
            ));
        }
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            compare(&format!("the saved state {i} of {}", c.name), g, w)?;
        }
    }
    Ok((whole, report))
}

/// A case trained sharded and unsharded in step.
pub struct Trained {
    pub rank: usize,
    pub sharded: ShardedEmbeddingBagCollection,
    pub reference: EmbeddingBagCollection,
    pub report: Report,
}

/// Trains `case` sharded on this rank and unsharded on the global batch over `steps` (the
/// step numbers pick the batches), checking the predictions every step. With `resume`, both
/// first load that checkpoint (the sharded one under this case's plan, the reference whole).
pub fn train(
    comm: Comm,
    case: &Case,
    steps: std::ops::Range<usize>,
    resume: Option<&std::path::Path>,
) -> Result<Trained, String> {
    let e = |e: embers::Error| e.to_string();
    let (rank, w) = (comm.rank(), comm.size());
    if w != case.world {
        return Err(format!(
            "rank {rank}: a world of {w}, the case needs {}",
            case.world
        ));
    }
    let configs = tables();
    let plan = plan_of(case)?;
    let sharded = build_sharded(comm, case, &plan).map_err(e)?;
    let reference =
        EmbeddingBagCollection::new(configs.clone(), case.optimizer, &mut seeded(1)).map_err(e)?;
    for c in &configs {
        reference
            .set_table_weights(&c.name, &init_table(c, SEED).map_err(e)?)
            .map_err(e)?;
    }
    sharded.to_device(case.device).map_err(e)?;
    if let Some(path) = resume {
        sharded.load(path).map_err(e)?;
        load_into_unsharded(&reference, path).map_err(e)?;
    }
    let width: usize = sharded.output_keys_and_dims().1.iter().sum();
    let head = Linear::new(width, 1, &mut seeded(SEED)).map_err(e)?;
    let ref_head = Linear::new(width, 1, &mut seeded(SEED)).map_err(e)?;
    let mut opt = Sgd::new(head.parameters(), 0.1).map_err(e)?;
    let mut ref_opt = Sgd::new(ref_head.parameters(), 0.1).map_err(e)?;
    let mut report = Report::default();
    let start: usize = case.batches[..rank].iter().sum();
    let b = case.batches[rank];
    let last = steps.end.saturating_sub(1);
    for step in steps {
        let batches: Vec<RankBatch> = (0..w)
            .map(|r| rank_batch(r, step, case.batches[r]))
            .collect();
        let sharded_comm = sharded.comm();
        sharded_comm.reset_bytes();
        // Sharded.
        let local = kjt_of(&[&batches[rank]], case.weighted);
        let pooled = sharded.forward(&local).map_err(e)?;
        // The dense head on the CPU (a device collection's output comes back through autograd).
        let embedded = pooled.values().to_device(embers::Device::Cpu).map_err(e)?;
        let logits = head.forward(&embedded).map_err(e)?;
        let labels = Tensor::from_vec(batches[rank].labels.clone(), &[b, 1]).map_err(e)?;
        let loss = logits
            .bce_with_logits(&labels, None, Reduction::Mean)
            .map_err(e)?;
        if b > 0 {
            loss.backward().map_err(e)?;
        } else {
            // No samples: a zero gradient still takes part in the collectives.
            let zero = pooled
                .values()
                .sum_all()
                .map_err(e)?
                .mul_scalar(0.0)
                .map_err(e)?;
            zero.backward().map_err(e)?;
        }
        all_reduce_mean_gradients(sharded_comm, &head.parameters()).map_err(e)?;
        opt.step().map_err(e)?;
        opt.zero_grad();
        if step == last {
            report.bytes_checked += check_bytes(case, &plan, &batches, rank, sharded_comm)?;
        }
        // Unsharded, on the global batch.
        let refs: Vec<&RankBatch> = batches.iter().collect();
        let global = kjt_of(&refs, case.weighted);
        let total: usize = case.batches.iter().sum();
        let ref_pooled = reference.forward(&global).map_err(e)?;
        let ref_logits = ref_head.forward(ref_pooled.values()).map_err(e)?;
        let all_labels: Vec<f32> = batches.iter().flat_map(|r| r.labels.clone()).collect();
        let sample_weights: Vec<f32> = (0..w)
            .flat_map(|r| {
                let n = case.batches[r];
                std::iter::repeat_n(1.0 / (w * n.max(1)) as f32, n)
            })
            .collect();
        let ref_loss = ref_logits
            .bce_with_logits(
                &Tensor::from_vec(all_labels, &[total, 1]).map_err(e)?,
                Some(&Tensor::from_vec(sample_weights, &[total, 1]).map_err(e)?),
                Reduction::Sum,
            )
            .map_err(e)?;
        ref_loss.backward().map_err(e)?;
        ref_opt.step().map_err(e)?;
        ref_opt.zero_grad();
        let got = logits.to_vec::<f32>().map_err(e)?;
        let want = ref_logits.to_vec::<f32>().map_err(e)?;
        compare(
            &format!("{} rank {rank} step {step} predictions", case.name),
            &got,
            &want[start..start + b],
        )?;
        report.predictions += got.len();
    }
    Ok(Trained {
        rank,
        sharded,
        reference,
        report,
    })
}

/// Checks the bytes this rank sent in the step just run against the closed forms.
fn check_bytes(
    case: &Case,
    plan: &ShardingPlan,
    batches: &[RankBatch],
    rank: usize,
    comm: &Comm,
) -> Result<usize, String> {
    let want = expected_sent(case, plan, batches, rank);
    check_sent(&format!("{} rank {rank}", case.name), want, comm)
}

/// Compares the bytes `comm` counted as sent per op with `want` (ops of 0 bytes left out):
/// how many ops were checked.
pub fn check_sent(what: &str, want: BTreeMap<String, u64>, comm: &Comm) -> Result<usize, String> {
    let got: BTreeMap<String, u64> = (comm.bytes().into_iter())
        .map(|(op, b)| (op.to_string(), b.sent))
        .filter(|(_, sent)| *sent > 0)
        .collect();
    let want: BTreeMap<String, u64> = want.into_iter().filter(|(_, v)| *v > 0).collect();
    if got != want {
        return Err(format!(
            "{what}: bytes sent per op {got:?}, closed forms {want:?}"
        ));
    }
    Ok(want.len())
}

/// With rows in files (which can fail to read or write on one rank), one byte to each other
/// rank to agree on the remote lookups (`any_slots`: there are some), and one on the remote
/// update before a replicated step (`replicated`: there is one).
pub fn cached_agreements_sent(
    add: &mut dyn FnMut(&str, u64),
    plan: &ShardingPlan,
    any_slots: bool,
    replicated: bool,
    world: usize,
) {
    let cached = (plan.tables.iter()).any(|t| {
        use embers::distributed::ComputeKernel as K;
        matches!(t.compute_kernel, K::FusedUvm | K::FusedUvmCaching)
    });
    if cached && any_slots {
        add("forward.lookups", world as u64 - 1);
        if replicated {
            add("backward.remote", world as u64 - 1);
        }
    }
}

/// The data-parallel tables' bytes (`dp`: their indices; `features[t]`: each table's feature
/// indices; `dims[t]`: widths): the rows this rank touched (a count per table, then the rows)
/// and their gradients, to every other rank, after the sizes of both.
pub fn replicated_sent(
    add: &mut dyn FnMut(&str, u64),
    dp: &[usize],
    features: &[Vec<usize>],
    dims: &[usize],
    batch: &RankBatch,
    world: usize,
) {
    if dp.is_empty() || world == 1 {
        return;
    }
    let (mut rows, mut floats) = (dp.len() as u64, 0u64);
    for &t in dp {
        let mut touched: Vec<i64> = (features[t].iter())
            .flat_map(|&f| batch.ids[f].iter().flatten().copied())
            .collect();
        touched.sort_unstable();
        touched.dedup();
        rows += touched.len() as u64;
        floats += touched.len() as u64 * dims[t] as u64;
    }
    add("backward.replicated_rows", (world as u64 - 1) * rows * 8);
    add(
        "backward.replicated_values",
        (world as u64 - 1) * floats * 4,
    );
    add("sizes", (world as u64 - 1) * 8);
}

/// Per table, the indices of its features in KJT key order.
pub fn table_features() -> Vec<Vec<usize>> {
    let mut next = 0;
    (tables().iter())
        .map(|c| {
            next += c.feature_names.len();
            (next - c.feature_names.len()..next).collect()
        })
        .collect()
}

/// How many of `batch`'s ids of feature `f` lie in rows `[lo, hi)`.
pub fn ids_in(batch: &RankBatch, f: usize, lo: usize, hi: usize) -> u64 {
    (batch.ids[f].iter().flatten())
        .filter(|&&i| i as usize >= lo && (i as usize) < hi)
        .count() as u64
}

/// The design note's closed forms: bytes rank `rank` sends to other ranks in one training
/// step, per op (4-byte lengths, 8-byte ids, 4-byte weights and floats).
pub fn expected_sent(
    case: &Case,
    plan: &ShardingPlan,
    batches: &[RankBatch],
    rank: usize,
) -> BTreeMap<String, u64> {
    let configs = tables();
    let w = case.world;
    let local = case.local;
    let hosts = w / local;
    let host_of = |r: usize| r / local;
    let bsz = |r: usize| batches[r].labels.len() as u64;
    let features = table_features();
    let ids_in = |r: usize, f: usize, lo: usize, hi: usize| ids_in(&batches[r], f, lo, hi);
    let mut out: BTreeMap<String, u64> = BTreeMap::new();
    let mut add = |op: &str, n: u64| *out.entry(op.to_string()).or_default() += n;
    let mut any_slots = false;
    // Ids travel as 8-byte values, their weights (if any) as 4-byte floats in their own op.
    let weighted = case.weighted;
    let add_ids = |add: &mut dyn FnMut(&str, u64), n: u64| {
        add("input_dist.values", n * 8);
        if weighted {
            add("input_dist.weights", n * 4);
        }
    };
    let b_me = bsz(rank);
    let mut rw_width = 0u64;
    let mut twrw_width = vec![0u64; hosts];
    for (t, c) in configs.iter().enumerate() {
        let p = plan.table(&c.name).unwrap();
        let nf = features[t].len() as u64;
        let dim = c.embedding_dim as u64;
        use embers::distributed::ShardingType as T;
        match p.sharding_type {
            T::DataParallel => {}
            T::TableWise | T::ColumnWise | T::TableColumnWise => {
                any_slots = true;
                for s in &p.shards {
                    let cols = s.cols as u64;
                    if s.rank != rank {
                        // Input: this rank's bags of every feature of the table, whole.
                        add("input_dist.lengths", nf * b_me * 4);
                        for &f in &features[t] {
                            add_ids(&mut add, ids_in(rank, f, 0, usize::MAX));
                        }
                        // Backward: this rank's gradient columns of the shard.
                        add("backward.owned", nf * b_me * cols * 4);
                    } else {
                        // Output: every other rank's rows of the shard.
                        let others: u64 = (0..w).filter(|&d| d != rank).map(bsz).sum();
                        add("output_dist.owned", nf * others * cols * 4);
                    }
                }
            }
            T::RowWise => {
                any_slots = true;
                rw_width += nf * dim;
                for s in &p.shards {
                    if s.rank != rank {
                        add("input_dist.lengths", nf * b_me * 4);
                        for &f in &features[t] {
                            add_ids(
                                &mut add,
                                ids_in(rank, f, s.row_offset, s.row_offset + s.rows),
                            );
                        }
                    }
                }
            }
            T::TableRowWise => {
                any_slots = true;
                let h = host_of(p.shards[0].rank);
                twrw_width[h] += nf * dim;
                for s in &p.shards {
                    if s.rank != rank {
                        add("input_dist.lengths", nf * b_me * 4);
                        for &f in &features[t] {
                            add_ids(
                                &mut add,
                                ids_in(rank, f, s.row_offset, s.row_offset + s.rows),
                            );
                        }
                    }
                }
            }
            T::GridShard => unreachable!("not planned"),
        }
    }
    let others: u64 = (0..w).filter(|&d| d != rank).map(bsz).sum();
    if any_slots {
        add("input_dist.splits", (w as u64 - 1) * 4 * 8);
    } else {
        // Without bags to send, the flags word alone (every rank's verdict on its batch).
        add("input_dist.agree", (w as u64 - 1) * 8);
    }
    if rw_width > 0 {
        // Reduce-scatter of partial sums; all-gather of the gradient.
        add("output_dist.row_wise", others * rw_width * 4);
        add("backward.row_wise", (w as u64 - 1) * b_me * rw_width * 4);
    }
    let (h, l) = (host_of(rank), rank % local);
    if twrw_width.iter().any(|&x| x > 0) {
        let t = twrw_width[h];
        // Inside the host: the rows of the samples of every other local rank's sources.
        let intra: u64 = (0..local)
            .filter(|&to| to != l)
            .map(|to| (0..hosts).map(|g| bsz(g * local + to)).sum::<u64>())
            .sum();
        add("output_dist.twrw_intra", intra * t * 4);
        // Across hosts: this rank's sum for each other host's same-index rank.
        let cross: u64 = (0..hosts)
            .filter(|&g| g != h)
            .map(|g| bsz(g * local + l))
            .sum();
        add("output_dist.twrw_cross", cross * t * 4);
        let back_cross: u64 = (0..hosts).filter(|&g| g != h).map(|g| twrw_width[g]).sum();
        add("backward.twrw_cross", b_me * back_cross * 4);
        let mine: u64 = (0..hosts).map(|g| bsz(g * local + l)).sum();
        add("backward.twrw_intra", (local as u64 - 1) * mine * t * 4);
    }
    let dp: Vec<usize> = (0..configs.len())
        .filter(|&t| {
            plan.table(&configs[t].name).unwrap().sharding_type
                == embers::distributed::ShardingType::DataParallel
        })
        .collect();
    let dims: Vec<usize> = configs.iter().map(|c| c.embedding_dim).collect();
    replicated_sent(&mut add, &dp, &features, &dims, &batches[rank], w);
    cached_agreements_sent(&mut add, plan, any_slots, !dp.is_empty(), w);
    // The dense head's all-reduce: a reduce-scatter then an all-gather of chunks.
    let params: u64 = configs
        .iter()
        .map(|c| (c.embedding_dim * c.feature_names.len()) as u64)
        .sum::<u64>()
        + 1;
    let chunk = params.div_ceil(w as u64);
    let mine = chunk.min(params.saturating_sub(rank as u64 * chunk));
    let rs: u64 = (0..w as u64)
        .filter(|&d| d != rank as u64)
        .map(|d| chunk.min(params.saturating_sub(d * chunk)))
        .sum();
    add(
        "all_reduce.dense_gradients",
        (rs + (w as u64 - 1) * mine) * 4,
    );
    out
}

/// Runs `f` on every rank of a `LocalGroup` of `world`, each in its own thread with a
/// deadline of `timeout` on its collectives: every rank's result, in rank order.
pub fn on_ranks<T: Send>(
    world: usize,
    timeout: std::time::Duration,
    f: impl Fn(Comm) -> T + Sync,
) -> Vec<T> {
    let comms = embers::distributed::LocalGroup::comms(world).expect("a local group");
    std::thread::scope(|s| {
        let handles: Vec<_> = (comms.into_iter())
            .map(|c| c.with_timeout(timeout))
            .map(|c| s.spawn(|| f(c)))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// Runs one case on `world` threads over a `LocalGroup`: each rank's report, or the errors (a
/// rank whose check failed stops early: the others then end at the deadline).
pub fn run_local(case: &Case, steps: usize) -> Vec<Result<Report, String>> {
    on_ranks(case.world, std::time::Duration::from_secs(10), |comm| {
        run_case(comm, case, steps)
    })
}
