//! The dynamic batcher (see the [module docs](super)).

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;

use super::Histogram;

/// A model the batcher can run: rows in, one output per row out, in order.
pub trait BatchModel: Send + Sync + 'static {
    /// One input row (e.g. one sample's features).
    type Row: Send + 'static;
    /// What one row yields (e.g. a click probability).
    type Output: Send + 'static;
    /// Checks one request's rows before they join a batch: a bad row fails its own request
    /// only, never a batch shared with other clients. The message names what is wrong.
    fn validate(&self, rows: &[Self::Row]) -> Result<(), String>;
    /// Runs one batch (rows already validated); returns one output per row, in order. Called on
    /// a blocking thread, one batch at a time.
    fn run(&self, rows: Vec<Self::Row>) -> crate::Result<Vec<Self::Output>>;
}

/// When a batch closes and how much may wait.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BatcherConfig {
    /// A batch closes when it holds this many rows (a request larger than this runs alone).
    pub max_batch_rows: usize,
    /// … or this long after its first request arrived, whichever comes first (tokio's
    /// timers have 1 ms resolution; 0: the batch is whatever is queued when the previous one
    /// finishes, so an idle server answers at once and a busy one still batches). At most
    /// [`MAX_DELAY`].
    pub max_delay: Duration,
    /// Rows queued or running at most; a request that would exceed it is refused
    /// ([`ServeError::Overloaded`]).
    pub max_queued_rows: usize,
}

/// The longest [`BatcherConfig::max_delay`]: a request kept waiting longer than this for
/// others to batch with is a misconfiguration (and far past it, a deadline no clock holds).
pub const MAX_DELAY: Duration = Duration::from_secs(60);

impl Default for BatcherConfig {
    /// 256 rows, 2 ms, 8192 rows queued.
    fn default() -> Self {
        BatcherConfig {
            max_batch_rows: 256,
            max_delay: Duration::from_millis(2),
            max_queued_rows: 8192,
        }
    }
}

/// Why a request got no outputs.
#[derive(Debug, thiserror::Error, Clone, PartialEq)]
pub enum ServeError {
    /// The request's own rows are invalid (the client's fault; nothing else was affected).
    #[error("invalid request: {0}")]
    Invalid(String),
    /// The queue is full: try again after `retry_after`.
    #[error("overloaded: {queued_rows} rows queued (limit {limit}); retry after {retry_after:?}")]
    Overloaded {
        /// Rows queued or running when the request came.
        queued_rows: usize,
        /// The configured limit.
        limit: usize,
        /// A hint: about the time the queue needs to drain one batch.
        retry_after: Duration,
    },
    /// The request alone holds more rows than may queue: it would never fit.
    #[error("the request holds {rows} rows; at most {limit} may queue")]
    TooLarge {
        /// The request's rows.
        rows: usize,
        /// The configured limit.
        limit: usize,
    },
    /// The model failed on the batch this request was part of.
    #[error("the model failed on the batch: {0}")]
    Model(String),
    /// The batcher was shut down before the request ran.
    #[error("the batcher is shut down")]
    ShuttingDown,
}

/// Counters of what the batcher did (all since it started).
#[derive(Debug)]
pub struct BatchStats {
    /// Requests answered with outputs.
    pub requests: AtomicU64,
    /// Requests refused as invalid, or as too large to queue.
    pub invalid: AtomicU64,
    /// Requests refused because the queue was full.
    pub overloaded: AtomicU64,
    /// Requests whose batch failed in the model.
    pub model_errors: AtomicU64,
    /// Requests whose client went away before their batch ran: dropped unrun.
    pub abandoned: AtomicU64,
    /// Batches run.
    pub batches: AtomicU64,
    /// Rows run, over all batches.
    pub rows: AtomicU64,
    /// The largest batch run, in rows.
    pub max_batch_rows: AtomicU64,
    /// Rows per batch run (bounds 1, 2, 4, …, 4096).
    pub batch_rows: Histogram,
}

impl Default for BatchStats {
    fn default() -> Self {
        BatchStats {
            requests: AtomicU64::new(0),
            invalid: AtomicU64::new(0),
            overloaded: AtomicU64::new(0),
            model_errors: AtomicU64::new(0),
            abandoned: AtomicU64::new(0),
            batches: AtomicU64::new(0),
            rows: AtomicU64::new(0),
            max_batch_rows: AtomicU64::new(0),
            batch_rows: Histogram::exponential(1.0, 2.0, 13),
        }
    }
}

type Reply<O> = oneshot::Sender<Result<Vec<O>, ServeError>>;

/// One client's request waiting for its batch.
struct Job<M: BatchModel> {
    rows: Vec<M::Row>,
    reply: Reply<M::Output>,
    /// When it was queued: its batch runs at most `max_delay` after.
    arrived: Instant,
}

/// Batches requests for a [`BatchModel`]; cheap to clone (clones share the queue). Dropping the
/// last clone lets the worker finish every request already queued, then stop.
pub struct DynamicBatcher<M: BatchModel> {
    model: Arc<M>,
    sender: mpsc::UnboundedSender<Job<M>>,
    queued: Arc<AtomicUsize>,
    stats: Arc<BatchStats>,
    config: BatcherConfig,
}

impl<M: BatchModel> Clone for DynamicBatcher<M> {
    fn clone(&self) -> Self {
        DynamicBatcher {
            model: self.model.clone(),
            sender: self.sender.clone(),
            queued: self.queued.clone(),
            stats: self.stats.clone(),
            config: self.config,
        }
    }
}

impl<M: BatchModel> DynamicBatcher<M> {
    /// Starts the batcher's worker on the current tokio runtime. Errors on a configuration
    /// that could never run a batch (zero rows).
    pub fn new(model: M, config: BatcherConfig) -> crate::Result<Self> {
        if config.max_batch_rows == 0 || config.max_queued_rows == 0 {
            return Err(crate::Error::invalid(
                "DynamicBatcher",
                format!("max_batch_rows and max_queued_rows must be at least 1, got {config:?}"),
            ));
        }
        if config.max_delay > MAX_DELAY {
            return Err(crate::Error::invalid(
                "DynamicBatcher",
                format!(
                    "max_delay {:?} is longer than {MAX_DELAY:?}: requests would wait that long \
                     for others to batch with",
                    config.max_delay
                ),
            ));
        }
        let model = Arc::new(model);
        let (sender, receiver) = mpsc::unbounded_channel();
        let queued = Arc::new(AtomicUsize::new(0));
        let stats = Arc::new(BatchStats::default());
        tokio::spawn(worker(
            model.clone(),
            receiver,
            queued.clone(),
            stats.clone(),
            config,
        ));
        Ok(DynamicBatcher {
            model,
            sender,
            queued,
            stats,
            config,
        })
    }

    /// The configuration.
    pub fn config(&self) -> BatcherConfig {
        self.config
    }

    /// The model it runs (shared with the batches running on it).
    pub fn model(&self) -> &Arc<M> {
        &self.model
    }

    /// What the batcher has done so far.
    pub fn stats(&self) -> &BatchStats {
        &self.stats
    }

    /// Rows queued or running now.
    pub fn queued_rows(&self) -> usize {
        self.queued.load(Ordering::Relaxed)
    }

    /// Refuses (`TooLarge`, counted as invalid) a request of more rows than may ever queue:
    /// what a batch of it holds (a retrieval's k neighbours a row) is bounded by the limit,
    /// not by the body's size. [`submit`](Self::submit) checks it; a server may first, before
    /// it builds the rows.
    pub fn check_size(&self, rows: usize) -> Result<(), ServeError> {
        let limit = self.config.max_queued_rows;
        if rows > limit {
            self.stats.invalid.fetch_add(1, Ordering::Relaxed);
            return Err(ServeError::TooLarge { rows, limit });
        }
        Ok(())
    }

    /// Runs `rows` in the next batch that has room and returns their outputs, in order. Invalid
    /// rows and a full queue are refused at once, without waiting.
    pub async fn submit(&self, rows: Vec<M::Row>) -> Result<Vec<M::Output>, ServeError> {
        if let Err(message) = self.model.validate(&rows) {
            self.stats.invalid.fetch_add(1, Ordering::Relaxed);
            return Err(ServeError::Invalid(message));
        }
        if rows.is_empty() {
            self.stats.requests.fetch_add(1, Ordering::Relaxed);
            return Ok(Vec::new());
        }
        let n = rows.len();
        let limit = self.config.max_queued_rows;
        self.check_size(n)?;
        let before = self.queued.fetch_add(n, Ordering::AcqRel);
        if before > 0 && before + n > limit {
            self.queued.fetch_sub(n, Ordering::AcqRel);
            self.stats.overloaded.fetch_add(1, Ordering::Relaxed);
            let batches_ahead = before.div_ceil(self.config.max_batch_rows).max(1) as u32;
            return Err(ServeError::Overloaded {
                queued_rows: before,
                limit,
                retry_after: self.config.max_delay.saturating_mul(batches_ahead),
            });
        }
        let (reply, answer) = oneshot::channel();
        let job = Job {
            rows,
            reply,
            arrived: Instant::now(),
        };
        if self.sender.send(job).is_err() {
            self.queued.fetch_sub(n, Ordering::AcqRel);
            return Err(ServeError::ShuttingDown);
        }
        answer.await.unwrap_or(Err(ServeError::ShuttingDown))
    }
}

/// Forms batches from the queue and runs them, one at a time, until every sender is gone and
/// the queue is empty.
async fn worker<M: BatchModel>(
    model: Arc<M>,
    mut receiver: mpsc::UnboundedReceiver<Job<M>>,
    queued: Arc<AtomicUsize>,
    stats: Arc<BatchStats>,
    config: BatcherConfig,
) {
    // A request that did not fit into the last batch opens the next one.
    let mut carried: Option<Job<M>> = None;
    // A request whose client went away (its reply is closed) is dropped unrun: it no longer
    // takes a place in the queue or the batch.
    let live = |job: Job<M>| {
        if job.reply.is_closed() {
            queued.fetch_sub(job.rows.len(), Ordering::AcqRel);
            stats.abandoned.fetch_add(1, Ordering::Relaxed);
            None
        } else {
            Some(job)
        }
    };
    loop {
        let first = match carried.take() {
            Some(job) => job,
            None => match receiver.recv().await {
                Some(job) => job,
                None => break,
            },
        };
        let Some(first) = live(first) else {
            continue;
        };
        // `max_delay` after the first request arrived, not after the worker took it (under
        // load it waited for the batch before).
        let deadline = first.arrived + config.max_delay;
        let mut rows = first.rows.len();
        let mut jobs = vec![first];
        while rows < config.max_batch_rows {
            // What is already queued joins without a timer: tokio's timers tick in whole
            // milliseconds, so even an elapsed deadline would cost up to 1 ms (with
            // `max_delay` 0 the batch is exactly what was queued).
            let next = match receiver.try_recv() {
                Ok(job) => Some(job),
                Err(mpsc::error::TryRecvError::Disconnected) => None,
                Err(mpsc::error::TryRecvError::Empty) if Instant::now() >= deadline => None,
                Err(mpsc::error::TryRecvError::Empty) => {
                    tokio::time::timeout_at(deadline, receiver.recv())
                        .await
                        .ok()
                        .flatten()
                }
            };
            let next = match next {
                Some(job) => match live(job) {
                    Some(job) => Some(job),
                    None => continue,
                },
                None => None,
            };
            match next {
                Some(job) if rows + job.rows.len() > config.max_batch_rows => {
                    carried = Some(job);
                    break;
                }
                Some(job) => {
                    rows += job.rows.len();
                    jobs.push(job);
                }
                // Closed or past the deadline: run what there is.
                None => break,
            }
        }
        // Clients that went away while the batch gathered.
        let jobs: Vec<Job<M>> = jobs.into_iter().filter_map(live).collect();
        let rows: usize = jobs.iter().map(|j| j.rows.len()).sum();
        if !jobs.is_empty() {
            run_batch(&model, jobs, rows, &queued, &stats).await;
        }
    }
    // Usually the model's last holder: dropping it can take long (a model's row files
    // unmapped and removed), which must not stall an async thread.
    tokio::task::spawn_blocking(move || drop(model));
}

/// Runs one batch on a blocking thread and answers each of its requests. Its rows leave the
/// queue count before the answers go out: a client that has its answer sees them gone.
async fn run_batch<M: BatchModel>(
    model: &Arc<M>,
    jobs: Vec<Job<M>>,
    rows: usize,
    queued: &AtomicUsize,
    stats: &BatchStats,
) {
    let mut all = Vec::with_capacity(rows);
    let mut replies = Vec::with_capacity(jobs.len());
    for job in jobs {
        replies.push((job.reply, job.rows.len()));
        all.extend(job.rows);
    }
    let runner = model.clone();
    let result = match tokio::task::spawn_blocking(move || runner.run(all)).await {
        Ok(Ok(outputs)) if outputs.len() == rows => Ok(outputs),
        Ok(Ok(outputs)) => Err(format!(
            "the model returned {} outputs for {rows} rows",
            outputs.len()
        )),
        Ok(Err(e)) => Err(e.to_string()),
        Err(e) => Err(format!("the model panicked: {e}")),
    };
    queued.fetch_sub(rows, Ordering::AcqRel);
    stats.batches.fetch_add(1, Ordering::Relaxed);
    stats.rows.fetch_add(rows as u64, Ordering::Relaxed);
    stats
        .max_batch_rows
        .fetch_max(rows as u64, Ordering::Relaxed);
    stats.batch_rows.observe(rows as f64);
    match result {
        Ok(outputs) => {
            let mut outputs = outputs.into_iter();
            for (reply, n) in replies {
                stats.requests.fetch_add(1, Ordering::Relaxed);
                // A client that went away no longer wants its answer.
                let _ = reply.send(Ok(outputs.by_ref().take(n).collect()));
            }
        }
        Err(message) => {
            for (reply, _) in replies {
                stats.model_errors.fetch_add(1, Ordering::Relaxed);
                let _ = reply.send(Err(ServeError::Model(message.clone())));
            }
        }
    }
}
