//! The training pipeline's scenario, shared by `tests/dist_pipeline.rs` (threads over
//! `LocalGroup`) and the MPI worker (`src/bin/embers-dist-worker.rs`): the `mixed_adagrad` case
//! of `dist_scenarios` on 2 ranks with a linear head, trained through a `TrainPipeline`.
#![allow(dead_code)]

use super::dist_scenarios::{case, kjt_of, rank_batch, sharded_of, tables, RankBatch, SEED};
use embers::distributed::{
    all_reduce_mean_gradients, Comm, PipelineBatch, PipelineReport, TrainPipeline,
};
use embers::nn::{Forward, Linear, Module};
use embers::optim::{Optimizer, Sgd};
use embers::sparse::KeyedJaggedTensor;
use embers::tensor::rng::seeded;
use embers::tensor::Reduction;
use embers::Tensor;

/// One rank's batch: its features and labels.
pub struct Step {
    pub kjt: KeyedJaggedTensor,
    pub labels: Vec<f32>,
}

impl PipelineBatch for Step {
    fn sparse(&self) -> &KeyedJaggedTensor {
        &self.kjt
    }
}

/// Rank `rank`'s batch for step `step` of the `mixed_adagrad` case on 2 ranks.
pub fn step(rank: usize, step: usize) -> embers::Result<Step> {
    Ok(step_of(raw_step(rank, step)))
}

/// The ids, weights and labels of [`step`]'s batch, before they become a KJT.
pub fn raw_step(rank: usize, step: usize) -> RankBatch {
    let c = case(2, "mixed_adagrad").unwrap();
    rank_batch(rank, step, c.batches[rank])
}

/// `batch` as a pipeline batch.
pub fn step_of(batch: RankBatch) -> Step {
    Step {
        kjt: kjt_of(&[&batch], false),
        labels: batch.labels,
    }
}

/// What a run leaves: each step's loss and the final tables and head, as bits.
#[derive(Debug, PartialEq)]
pub struct Outcome {
    pub losses: Vec<u32>,
    pub tables: Vec<Vec<u32>>,
    pub head: Vec<Vec<u32>>,
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Trains the `mixed_adagrad` case (table-wise, row-wise, table-row-wise and data-parallel
/// tables, row-wise Adagrad) with a linear head on `data`, pipelined or not.
pub fn train(
    comm: Comm,
    pipelined: bool,
    data: Vec<embers::Result<Step>>,
) -> embers::Result<(Outcome, PipelineReport)> {
    train_case(comm, "mixed_adagrad", pipelined, false, data).map(|(o, r, _)| (o, r))
}

/// [`train`] with case `name` of `dist_scenarios` (its plan and caches), and the cached
/// shards' rows prefetched in the communication stage when `prefetch` says so; also how many
/// of this rank's cached-table lookups took a prefetched admission.
pub fn train_case(
    comm: Comm,
    name: &str,
    pipelined: bool,
    prefetch: bool,
    data: Vec<embers::Result<Step>>,
) -> embers::Result<(Outcome, PipelineReport, u64)> {
    let c = case(2, name).unwrap();
    let sharded = sharded_of(comm, &c).unwrap();
    let width: usize = sharded.output_keys_and_dims().1.iter().sum();
    let head = Linear::new(width, 1, &mut seeded(SEED))?;
    let mut opt = Sgd::new(head.parameters(), 0.1)?;
    let mut pipeline = TrainPipeline::new(&sharded)?;
    if !pipelined {
        pipeline = pipeline.sequential();
    }
    if prefetch {
        pipeline = pipeline.with_cache_prefetch();
    }
    let mut losses = Vec::new();
    let report = pipeline.run(data, |batch: &Step, pooled| {
        let b = batch.labels.len();
        let logits = head.forward(pooled.values())?;
        let labels = Tensor::from_vec(batch.labels.clone(), &[b, 1])?;
        let loss = logits.bce_with_logits(&labels, None, Reduction::Mean)?;
        loss.backward()?;
        all_reduce_mean_gradients(sharded.comm(), &head.parameters())?;
        opt.step()?;
        opt.zero_grad();
        losses.push(loss.to_vec::<f32>()?[0].to_bits());
        Ok(())
    })?;
    let tables = (tables().iter())
        .map(|t| sharded.table_weights(&t.name).map(|w| bits(&w)))
        .collect::<embers::Result<_>>()?;
    let head = (head.parameters().iter())
        .map(|p| p.to_vec::<f32>().map(|v| bits(&v)))
        .collect::<embers::Result<_>>()?;
    let prefetched = sharded.cache_stats().iter().map(|s| s.prefetched).sum();
    Ok((
        Outcome {
            losses,
            tables,
            head,
        },
        report,
        prefetched,
    ))
}
