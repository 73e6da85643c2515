//! Run an iterator ahead of its consumer on a background thread, behind a bounded queue.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, RecvTimeoutError};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use crate::{DatasetError, Result};

/// Produces items of an iterator on a background thread, at most `depth` ahead of the
/// consumer (plus the one being produced), so memory stays bounded.
///
/// Items come out in the producer's order. An `Err` item is delivered and then the producer
/// stops. Dropping the `Prefetcher` stops the thread (it finishes at most the item it is
/// producing) and joins it, waiting at most [`PREFETCH_DROP_WAIT`]: a thread still inside a long item
/// then ends on its own, detached, rather than hang the consumer. A panic in the producer
/// surfaces as [`DatasetError::WorkerPanicked`] rather than a hang.
pub struct Prefetcher<T: Send + 'static> {
    receiver: Option<Receiver<Result<T>>>,
    worker: Option<JoinHandle<()>>,
    stop: Arc<AtomicBool>,
    /// Disconnected when the thread has ended (its sender is dropped, panics included).
    ended: Receiver<()>,
}

/// How long dropping a [`Prefetcher`] waits for its thread to finish the item in hand.
pub const PREFETCH_DROP_WAIT: Duration = Duration::from_secs(1);

impl<T: Send + 'static> Prefetcher<T> {
    /// Starts the thread. `depth` is the queue capacity (at least 1).
    pub fn spawn<I>(iterator: I, depth: usize) -> Result<Self>
    where
        I: Iterator<Item = Result<T>> + Send + 'static,
    {
        Self::spawn_with_stop(iterator, depth, Arc::new(AtomicBool::new(false)))
    }

    /// [`spawn`](Self::spawn) with the flag set when the `Prefetcher` is dropped, which the
    /// iterator may also watch to stop inside a long item.
    pub(crate) fn spawn_with_stop<I>(
        iterator: I,
        depth: usize,
        stop: Arc<AtomicBool>,
    ) -> Result<Self>
    where
        I: Iterator<Item = Result<T>> + Send + 'static,
    {
        if depth == 0 {
            return Err(DatasetError::InvalidConfig(
                "prefetch depth must be at least 1".to_string(),
            ));
        }
        let (sender, receiver) = sync_channel(depth);
        let stop_flag = Arc::clone(&stop);
        let (ending, ended) = sync_channel::<()>(0);
        let worker = std::thread::Builder::new()
            .name("embers-datasets-prefetch".to_string())
            .spawn(move || {
                let _ending = ending;
                for item in iterator {
                    if stop_flag.load(Ordering::Relaxed) {
                        break;
                    }
                    let is_error = item.is_err();
                    // A send error means the consumer is gone: nothing left to do.
                    if sender.send(item).is_err() || is_error {
                        break;
                    }
                }
            })
            .map_err(|source| DatasetError::Io {
                path: "<prefetch thread>".into(),
                source,
            })?;
        Ok(Prefetcher {
            receiver: Some(receiver),
            worker: Some(worker),
            stop,
            ended,
        })
    }

    fn join_worker(&mut self) -> Option<DatasetError> {
        let worker = self.worker.take()?;
        match worker.join() {
            Ok(()) => None,
            Err(payload) => {
                let message = payload
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| payload.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "unknown panic payload".to_string());
                Some(DatasetError::WorkerPanicked(message))
            }
        }
    }
}

impl<T: Send + 'static> Iterator for Prefetcher<T> {
    type Item = Result<T>;

    fn next(&mut self) -> Option<Self::Item> {
        let receiver = self.receiver.as_ref()?;
        match receiver.recv() {
            Ok(item) => Some(item),
            Err(_) => {
                // The producer hung up: either it finished or it panicked.
                self.receiver = None;
                self.join_worker().map(Err)
            }
        }
    }
}

impl<T: Send + 'static> Drop for Prefetcher<T> {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        // Dropping the receiver first unblocks a producer waiting on a full queue.
        self.receiver = None;
        match self.ended.recv_timeout(PREFETCH_DROP_WAIT) {
            // Ended (or, never, sent to): joining is immediate.
            Ok(()) | Err(RecvTimeoutError::Disconnected) => {
                let _ = self.join_worker();
            }
            // Still in an item: it stops at the item's end, by itself.
            Err(RecvTimeoutError::Timeout) => drop(self.worker.take()),
        }
    }
}
