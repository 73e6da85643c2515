//! [`TrainPipeline`]: TorchRec's `TrainPipelineSparseDist` on the CPU — while batch `i`
//! trains, batch `i+1`'s ids travel to their shards and batch `i+2` is being loaded.
//!
//! Three stages, each on its own thread, handing batches on through channels of depth one:
//! * *load* pulls batches from the user's iterator (one ahead of the communication stage);
//! * *communication* runs the input distribution
//!   ([`ShardedEmbeddingBagCollection::distribute_input`]) on a duplicate of the collection's
//!   communicator (collectives on one communicator must not interleave between threads);
//! * *compute* (the calling thread) runs the lookups, the output distribution and the user's
//!   step (dense forward, loss, backward, optimizer) on the collection's communicator.
//!
//! The input distribution reads no table, so running it for batch `i+1` before batch `i`'s
//! backward changes nothing: the pipeline gives the same losses and tables, bit for bit, as
//! the same steps one after the other ([`TrainPipeline::sequential`]).
//!
//! The end of the data is agreed on: before each batch's input distribution the ranks
//! exchange one byte (has a batch / has none / failed to load it), and every rank stops at
//! the first step some rank has no batch for — ranks with more data leave it unused, none
//! waits for a collective that never comes (a common TorchRec hang). A batch a rank fails to
//! load ends the run on every rank with an error naming that rank.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::sync_channel;
use std::time::{Duration, Instant};

use super::comm::Comm;
use super::embedding_bag::{DistributedInput, ShardedEmbeddingBagCollection};
use crate::error::{Error, Result};
use crate::sparse::{KeyedJaggedTensor, KeyedTensor};

/// A batch the pipeline can distribute: it has one KJT of sparse features.
pub trait PipelineBatch: Send {
    /// The sparse features (the collection's input).
    fn sparse(&self) -> &KeyedJaggedTensor;
}

impl PipelineBatch for crate::train::Batch {
    fn sparse(&self) -> &KeyedJaggedTensor {
        &self.sparse
    }
}

impl PipelineBatch for KeyedJaggedTensor {
    fn sparse(&self) -> &KeyedJaggedTensor {
        self
    }
}

/// Where a run's time went on this rank.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PipelineReport {
    /// Steps trained (the same on every rank).
    pub steps: usize,
    /// Batches this rank loaded but did not train: another rank ran out of data first.
    pub unused_batches: usize,
    /// Time the communication stage waited for the loader.
    pub load: Duration,
    /// Time in the input distribution (the end-of-data agreement and any injected delay
    /// included).
    pub input_dist: Duration,
    /// Time the compute stage waited for its next distributed batch.
    pub wait: Duration,
    /// Time in the lookups, the output distribution and the user's steps.
    pub compute: Duration,
}

impl PipelineReport {
    /// The fraction of the load and input-distribution time the compute stage did not wait
    /// for (0 when run one stage after the other, 1 when all of it was hidden).
    pub fn hidden_fraction(&self) -> f64 {
        let exposed = self.wait.as_secs_f64();
        let total = (self.load + self.input_dist).as_secs_f64();
        if total == 0.0 {
            return 1.0;
        }
        (1.0 - exposed / total).clamp(0.0, 1.0)
    }
}

/// A training pipeline over a sharded collection (see the module docs).
#[derive(Debug)]
pub struct TrainPipeline {
    sharded: ShardedEmbeddingBagCollection,
    input_comm: Comm,
    pipelined: bool,
    input_delay: Duration,
    /// Each batch's rows brought into the caches of cached shards once its ids have arrived.
    cache_prefetch: bool,
}

/// What the end-of-data agreement sends: this rank's state for the next step.
const HAS_BATCH: u8 = 1;
const NO_BATCH: u8 = 0;
const LOAD_FAILED: u8 = 2;

impl TrainPipeline {
    /// A pipeline over `sharded` (a collective: every rank calls it, to duplicate the
    /// collection's communicator for the communication stage).
    pub fn new(sharded: &ShardedEmbeddingBagCollection) -> Result<TrainPipeline> {
        let input_comm = sharded.comm().split(0)?;
        Ok(TrainPipeline {
            sharded: sharded.clone(),
            input_comm,
            pipelined: true,
            input_delay: Duration::ZERO,
            cache_prefetch: false,
        })
    }

    /// The same stages one after the other on the calling thread (the reference the pipeline
    /// is measured and checked against).
    pub fn sequential(self) -> TrainPipeline {
        TrainPipeline {
            pipelined: false,
            ..self
        }
    }

    /// Prefetches each batch into the caches of the collection's cached shards (the plan's
    /// `fused_uvm_caching` and `fused_uvm` kernels) in the communication stage, right after
    /// its input distribution — while the batch before trains — as TorchRec's
    /// `PrefetchTrainPipelineSparseDist` does: its lookups then find their rows cached and
    /// locked ([`ShardedEmbeddingBagCollection::prefetch_distributed`]). Changes no value.
    pub fn with_cache_prefetch(self) -> TrainPipeline {
        TrainPipeline {
            cache_prefetch: true,
            ..self
        }
    }

    /// Sleeps `delay` in the communication stage before each input distribution (a slow
    /// network, for measuring the overlap).
    pub fn with_input_delay(self, delay: Duration) -> TrainPipeline {
        TrainPipeline {
            input_delay: delay,
            ..self
        }
    }

    /// Trains on `batches` until some rank has none left: for each, the collection's pooled
    /// output goes to `step` with the batch (which runs the dense forward, the loss, the
    /// backward and the optimizers). A collective: every rank calls it, each with its own
    /// batches (their numbers may differ).
    ///
    /// Errors: `step`'s, the collection's (a bad batch on any rank), a batch that could not be
    /// loaded (on every rank, naming the rank), or a collective past its deadline.
    pub fn run<B, I, F>(&self, batches: I, mut step: F) -> Result<PipelineReport>
    where
        B: PipelineBatch,
        I: IntoIterator<Item = Result<B>>,
        I::IntoIter: Send,
        F: FnMut(&B, KeyedTensor) -> Result<()>,
    {
        let mut report = PipelineReport::default();
        let loaded = AtomicUsize::new(0);
        let mut batches = batches.into_iter();
        if !self.pipelined {
            loop {
                let start = Instant::now();
                let next = batches.next();
                loaded.fetch_add(usize::from(matches!(next, Some(Ok(_)))), Ordering::Relaxed);
                report.load += start.elapsed();
                let start = Instant::now();
                let Some((batch, input)) = self.distribute(report.steps, next)? else {
                    break;
                };
                report.input_dist += start.elapsed();
                let start = Instant::now();
                let pooled = self.sharded.forward_distributed(input)?;
                step(&batch, pooled)?;
                report.compute += start.elapsed();
                report.steps += 1;
            }
            report.wait = report.load + report.input_dist;
            report.unused_batches = loaded.load(Ordering::Relaxed) - report.steps;
            return Ok(report);
        }
        std::thread::scope(|scope| {
            let (load_tx, load_rx) = sync_channel::<Result<B>>(1);
            let (dist_tx, dist_rx) = sync_channel::<Result<(B, DistributedInput)>>(0);
            let loaded = &loaded;
            scope.spawn(move || {
                for next in batches {
                    let ok = next.is_ok();
                    if load_tx.send(next).is_err() {
                        break;
                    }
                    loaded.fetch_add(usize::from(ok), Ordering::Relaxed);
                    if !ok {
                        break;
                    }
                }
            });
            let comm_stage = scope.spawn(move || -> (Duration, Duration) {
                let (mut load, mut input_dist) = (Duration::ZERO, Duration::ZERO);
                for i in 0.. {
                    let start = Instant::now();
                    let next = load_rx.recv().ok();
                    load += start.elapsed();
                    let start = Instant::now();
                    let out = self.distribute(i, next);
                    input_dist += start.elapsed();
                    let stop = !matches!(out, Ok(Some(_)));
                    let sent = match out {
                        Ok(Some(ready)) => dist_tx.send(Ok(ready)),
                        Ok(None) => break,
                        Err(e) => dist_tx.send(Err(e)),
                    };
                    if stop || sent.is_err() {
                        break;
                    }
                }
                (load, input_dist)
            });
            let mut result = Ok(());
            loop {
                let start = Instant::now();
                let Ok(next) = dist_rx.recv() else { break };
                report.wait += start.elapsed();
                let start = Instant::now();
                let trained = next.and_then(|(batch, input)| {
                    let pooled = self.sharded.forward_distributed(input)?;
                    step(&batch, pooled)
                });
                report.compute += start.elapsed();
                if let Err(e) = trained {
                    result = Err(e);
                    break;
                }
                report.steps += 1;
            }
            drop(dist_rx);
            let (load, input_dist) = comm_stage.join().map_err(|_| {
                Error::Distributed("the pipeline's communication stage panicked".into())
            })?;
            report.load = load;
            report.input_dist = input_dist;
            result
        })?;
        report.unused_batches = loaded.load(Ordering::Relaxed) - report.steps;
        Ok(report)
    }

    /// The communication stage: the end-of-data agreement for step `i`, then its batch
    /// (`next`, from the loader) distributed, or `None` when some rank has no batch for it.
    fn distribute<B: PipelineBatch>(
        &self,
        i: usize,
        next: Option<Result<B>>,
    ) -> Result<Option<(B, DistributedInput)>> {
        let comm = &self.input_comm;
        let state = match &next {
            Some(Ok(_)) => HAS_BATCH,
            Some(Err(_)) => LOAD_FAILED,
            None => NO_BATCH,
        };
        let w = comm.size();
        let states = comm.all_gather_v("pipeline.has_batch", &[state], Some(&vec![1; w]))?;
        let failed: Vec<usize> = (0..w).filter(|&r| states[r][0] == LOAD_FAILED).collect();
        let out_of_data = states.iter().any(|s| s[0] == NO_BATCH);
        let batch = match next {
            Some(Err(e)) => return Err(e),
            _ if !failed.is_empty() => {
                return Err(Error::Distributed(format!(
                    "rank {}: rank(s) {failed:?} could not load their batch for step {i}",
                    comm.rank()
                )))
            }
            Some(Ok(batch)) if !out_of_data => batch,
            _ => return Ok(None),
        };
        if !self.input_delay.is_zero() {
            std::thread::sleep(self.input_delay);
        }
        let input = self.sharded.distribute_input(batch.sparse(), comm)?;
        if self.cache_prefetch {
            self.sharded.prefetch_distributed(&input)?;
        }
        Ok(Some((batch, input)))
    }
}
