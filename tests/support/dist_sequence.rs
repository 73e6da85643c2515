//! Sharded == unsharded for the unpooled collection (`ShardedEmbeddingCollection` against
//! `EmbeddingCollection`), on the cases, tables and batches of `dist_scenarios.rs` (included
//! beside this file as `dist_scenarios`).
//!
//! Each rank's loss is `(1/B_r) Σ_f Σ_rows (row · u_f)²` over the rows of its own batch (`u_f`
//! a fixed vector per feature); the unsharded reference weighs each row of the global batch by
//! `1/(W·B_r)` of its sample's rank — what TorchRec's gradient division computes. Every step,
//! this rank's rows must equal the reference's rows of its samples; after the last, every
//! table; and the bytes each collective moved in the last step must equal the closed forms
//! below (computed from the plan and the batches, independently of `src/distributed`).
#![allow(dead_code)]

use std::collections::BTreeMap;

use embers::distributed::{init_table, Comm, ShardedEmbeddingCollection, ShardingType};
use embers::embedding::{EmbeddingCollection, EmbeddingConfig};
use embers::sparse::JaggedTensor;
use embers::tensor::rng::seeded;
use embers::Tensor;
use rand::Rng as _;

use super::dist_scenarios::{
    cached_agreements_sent, check_sent, compare, ids_in, kjt_of, on_ranks, plan_of, rank_batch,
    replicated_sent, table_features, tables, Case, RankBatch, Report, SEED,
};

/// The tables of `dist_scenarios::tables`, unpooled.
pub fn ec_tables() -> Vec<EmbeddingConfig> {
    (tables().into_iter())
        .map(|c| {
            let features: Vec<&str> = c.feature_names.iter().map(String::as_str).collect();
            EmbeddingConfig::new(c.name.clone(), c.num_embeddings, c.embedding_dim, &features)
        })
        .collect()
}

/// The fixed vector `u_f` of each feature (KJT key order).
fn directions() -> Vec<Vec<f32>> {
    let mut rng = seeded(SEED + 1);
    (ec_tables().iter())
        .flat_map(|c| c.feature_names.iter().map(move |_| c.embedding_dim))
        .map(|d| (0..d).map(|_| rng.random_range(-1.0f32..1.0)).collect())
        .collect()
}

/// `Σ_f Σ_rows w_row (row · u_f)²` over the features' rows, `w_row` per feature and row.
fn loss_of(rows: &[(String, JaggedTensor)], weights: &[Vec<f32>]) -> embers::Result<Tensor> {
    let u = directions();
    let mut total: Option<Tensor> = None;
    for (f, (_, jt)) in rows.iter().enumerate() {
        let n = jt.values().shape()[0];
        let dim = u[f].len();
        let proj = jt
            .values()
            .to_device(embers::Device::Cpu)?
            .matmul(&Tensor::from_vec(u[f].clone(), &[dim, 1])?)?;
        let term = proj
            .square()?
            .mul(&Tensor::from_vec(weights[f].clone(), &[n, 1])?)?
            .sum_all()?;
        total = Some(match total {
            Some(t) => t.add(&term)?,
            None => term,
        });
    }
    Ok(total.expect("at least one feature"))
}

/// How many ids feature `f` has in `batch`.
fn ids_of(batch: &RankBatch, f: usize) -> usize {
    batch.ids[f].iter().map(Vec::len).sum()
}

/// A sharded EC trained beside its unsharded reference.
pub struct TrainedEc {
    pub rank: usize,
    pub sharded: ShardedEmbeddingCollection,
    pub reference: EmbeddingCollection,
    pub report: Report,
}

/// Trains `case` unpooled, sharded on this rank and unsharded on the global batch, for
/// `steps` steps, checking this rank's rows every step.
pub fn train_ec(comm: Comm, case: &Case, steps: usize) -> Result<TrainedEc, String> {
    let e = |e: embers::Error| e.to_string();
    let (rank, w) = (comm.rank(), comm.size());
    let configs = ec_tables();
    let sharded = ShardedEmbeddingCollection::with_caches(
        configs.clone(),
        &plan_of(case)?,
        case.optimizer,
        &case.caches,
        comm,
        SEED,
    )
    .map_err(e)?;
    let reference =
        EmbeddingCollection::new(configs.clone(), case.optimizer, &mut seeded(1)).map_err(e)?;
    for c in &configs {
        reference
            .set_table_weights(&c.name, &init_table(c, SEED).map_err(e)?)
            .map_err(e)?;
    }
    sharded.to_device(case.device).map_err(e)?;
    let features = directions().len();
    let mut report = Report::default();
    for step in 0..steps {
        let batches: Vec<RankBatch> = (0..w)
            .map(|r| rank_batch(r, step, case.batches[r]))
            .collect();
        sharded.comm().reset_bytes();
        // Sharded: this rank's batch, its mean.
        let b = case.batches[rank];
        let rows = sharded
            .forward(&kjt_of(&[&batches[rank]], case.weighted))
            .map_err(e)?;
        let mine: Vec<Vec<f32>> = (0..features)
            .map(|f| vec![1.0 / b.max(1) as f32; ids_of(&batches[rank], f)])
            .collect();
        let loss = loss_of(&rows, &mine).map_err(e)?;
        let loss = if b > 0 {
            loss
        } else {
            loss.mul_scalar(0.0).map_err(e)?
        };
        loss.backward().map_err(e)?;
        if step + 1 == steps {
            report.bytes_checked += check_bytes_ec(case, &batches, rank, sharded.comm())?;
        }
        // Unsharded: the global batch, each row weighted by 1/(W·B_r).
        let refs: Vec<&RankBatch> = batches.iter().collect();
        let ref_rows = reference
            .forward(&kjt_of(&refs, case.weighted))
            .map_err(e)?;
        let weights: Vec<Vec<f32>> = (0..features)
            .map(|f| {
                (0..w)
                    .flat_map(|r| {
                        let scale = 1.0 / (w * case.batches[r].max(1)) as f32;
                        std::iter::repeat_n(scale, ids_of(&batches[r], f))
                    })
                    .collect()
            })
            .collect();
        loss_of(&ref_rows, &weights)
            .and_then(|l| l.backward())
            .map_err(e)?;
        // This rank's rows against the reference's rows of its samples.
        for f in 0..features {
            let (key, got) = &rows[f];
            let (ref_key, want) = &ref_rows[f];
            if key != ref_key {
                return Err(format!("feature {f}: key {key}, the reference's {ref_key}"));
            }
            let dim = want.values().shape()[1];
            let before: usize = (0..rank).map(|r| ids_of(&batches[r], f)).sum();
            let n = ids_of(&batches[rank], f);
            let got = got.values().to_vec::<f32>().map_err(e)?;
            let want = want.values().to_vec::<f32>().map_err(e)?;
            compare(
                &format!("{} rank {rank} step {step} rows of {key}", case.name),
                &got,
                &want[before * dim..(before + n) * dim],
            )?;
            let lengths = rows[f].1.lengths().to_vec::<i64>().map_err(e)?;
            let want_lengths: Vec<i64> = batches[rank].ids[f]
                .iter()
                .map(|s| s.len() as i64)
                .collect();
            if lengths != want_lengths {
                return Err(format!(
                    "{key}: lengths {lengths:?}, expected {want_lengths:?}"
                ));
            }
            report.predictions += got.len();
        }
    }
    Ok(TrainedEc {
        rank,
        sharded,
        reference,
        report,
    })
}

/// Runs `case` unpooled on this rank and compares it with the unsharded run, tables included.
pub fn run_ec_case(comm: Comm, case: &Case, steps: usize) -> Result<Report, String> {
    let e = |e: embers::Error| e.to_string();
    let mut trained = train_ec(comm, case, steps)?;
    for c in &ec_tables() {
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

/// Runs one case unpooled on `world` threads over a `LocalGroup`.
pub fn run_ec_local(case: &Case, steps: usize) -> Vec<Result<Report, String>> {
    on_ranks(case.world, std::time::Duration::from_secs(10), |comm| {
        run_ec_case(comm, case, steps)
    })
}

/// Checks the bytes this rank sent in the step just run against the closed forms.
fn check_bytes_ec(
    case: &Case,
    batches: &[RankBatch],
    rank: usize,
    comm: &Comm,
) -> Result<usize, String> {
    let want = expected_sent_ec(case, batches, rank)?;
    check_sent(&format!("{} (unpooled) rank {rank}", case.name), want, comm)
}

/// The closed forms for the unpooled collection: bytes rank `rank` sends to other ranks in one
/// step, per op. Input: 4-byte lengths per sample and shard, 8-byte ids (weights never travel:
/// they apply where the rows land). Output: each id's row (its shard's columns) back to the
/// id's rank, 4 bytes a value; backward: the same gradients the other way. Data-parallel
/// tables: the row gradients this rank touched, as the pooled collection's.
pub fn expected_sent_ec(
    case: &Case,
    batches: &[RankBatch],
    rank: usize,
) -> Result<BTreeMap<String, u64>, String> {
    let plan = plan_of(case)?;
    let configs = ec_tables();
    let w = case.world;
    let b_me = batches[rank].labels.len() as u64;
    let features = table_features();
    let ids_in = |r: usize, f: usize, lo: usize, hi: usize| ids_in(&batches[r], f, lo, hi);
    let mut out: BTreeMap<String, u64> = BTreeMap::new();
    let mut add = |op: &str, n: u64| *out.entry(op.to_string()).or_default() += n;
    let mut any_slots = false;
    let mut dp = Vec::new();
    for (t, c) in configs.iter().enumerate() {
        let p = plan.table(&c.name).ok_or("no plan for a table")?;
        if p.sharding_type == ShardingType::DataParallel {
            dp.push(t);
            continue;
        }
        any_slots = true;
        let blocks = matches!(
            p.sharding_type,
            ShardingType::RowWise | ShardingType::TableRowWise
        );
        for s in &p.shards {
            let (lo, hi) = if blocks {
                (s.row_offset, s.row_offset + s.rows)
            } else {
                (0, usize::MAX)
            };
            let cols = s.cols as u64;
            for &f in &features[t] {
                if s.rank != rank {
                    let n = ids_in(rank, f, lo, hi);
                    add("input_dist.lengths", b_me * 4);
                    add("input_dist.values", n * 8);
                    add("backward.sequence", n * cols * 4);
                } else {
                    let others: u64 = (0..w)
                        .filter(|&d| d != rank)
                        .map(|d| ids_in(d, f, lo, hi))
                        .sum();
                    add("output_dist.sequence", others * cols * 4);
                }
            }
        }
    }
    if any_slots {
        add("input_dist.splits", (w as u64 - 1) * 4 * 8);
    } else {
        // Without bags to send, the flags word alone (every rank's verdict on its batch).
        add("input_dist.agree", (w as u64 - 1) * 8);
    }
    let dims: Vec<usize> = configs.iter().map(|c| c.embedding_dim).collect();
    replicated_sent(&mut add, &dp, &features, &dims, &batches[rank], w);
    cached_agreements_sent(&mut add, &plan, any_slots, !dp.is_empty(), w);
    Ok(out.into_iter().filter(|(_, v)| *v > 0).collect())
}
