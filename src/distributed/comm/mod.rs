//! Communicators: the collectives the sharded modules use, over a transport — MPI across
//! processes (`mpi.rs`, feature `mpi`) or threads of one process (`local.rs`) — each call
//! numbered, counted in bytes per op and guarded by a deadline.
//!
//! Reductions are deterministic: every rank sums the same values in rank order, so every rank
//! gets the same bits, whatever the transport (an `MPI_Allreduce` need not).

pub(crate) mod local;
#[cfg(feature = "mpi")]
pub mod mpi;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use crate::error::{Error, Result};

pub use local::LocalGroup;

/// Element types the collectives carry (plain numbers: every bit pattern is a value).
pub trait Pod: bytemuck::Pod + Send + Sync + std::fmt::Debug {}
impl<T: bytemuck::Pod + Send + Sync + std::fmt::Debug> Pod for T {}

/// Why a transport call did not complete.
#[derive(Debug)]
pub(crate) enum TransportError {
    /// The deadline passed; the ranks that had not joined, when the transport knows them.
    Timeout { missing: Vec<usize> },
    /// The transport reported a failure.
    Failed(String),
}

/// How bytes move between the ranks of a group: the collectives the [`Comm`] builds on.
pub(crate) trait Transport: Send + Sync {
    /// This process's (or thread's) rank in the group.
    fn rank(&self) -> usize;
    /// Ranks in the group.
    fn size(&self) -> usize;
    /// All-to-all of byte blocks: `send` holds the blocks for ranks `0..W` back to back, of
    /// `send_sizes`; `recv` receives the block each rank sent here, back to back, of
    /// `recv_sizes` (known from an earlier exchange).
    fn all_to_all_v(
        &self,
        send: &[u8],
        send_sizes: &[usize],
        recv: &mut [u8],
        recv_sizes: &[usize],
        deadline: Instant,
    ) -> std::result::Result<(), TransportError>;
    /// Every rank's block into `recv`, in rank order, back to back, of `recv_sizes`.
    fn all_gather_v(
        &self,
        send: &[u8],
        recv: &mut [u8],
        recv_sizes: &[usize],
        deadline: Instant,
    ) -> std::result::Result<(), TransportError>;
    /// The group of the ranks that passed the same `color` (ordered by rank), from a call
    /// every rank of this group makes.
    fn split(
        &self,
        color: usize,
        deadline: Instant,
    ) -> std::result::Result<Arc<dyn Transport>, TransportError>;
    /// Whether a blocked call can outlive its deadline (MPI): then a watchdog must end the
    /// process; a transport that times out by itself returns [`TransportError::Timeout`].
    fn needs_watchdog(&self) -> bool;
    /// Ends every process of the group (the watchdog's last resort).
    fn abort(&self, code: i32) -> !;
}

/// Bytes one kind of collective moved to and from other ranks (this rank's view).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct OpBytes {
    /// Calls made.
    pub calls: u64,
    /// Bytes sent to other ranks (not counting what a rank sends itself).
    pub sent: u64,
    /// Bytes received from other ranks.
    pub received: u64,
}

/// The op being waited on, for the watchdog.
struct Armed {
    op: &'static str,
    seq: u64,
    deadline: Instant,
}

/// Ends the process group when a collective outlives its deadline (transports whose calls
/// cannot time out by themselves).
struct Watchdog {
    armed: Mutex<Option<Armed>>,
    wake: Condvar,
}

impl Watchdog {
    fn start(transport: Arc<dyn Transport>, timeout: Duration) -> Arc<Watchdog> {
        let dog = Arc::new(Watchdog {
            armed: Mutex::new(None),
            wake: Condvar::new(),
        });
        let watched = Arc::downgrade(&dog);
        let rank = transport.rank();
        // Weak: the communicator's last owner, not this thread, drops (and frees) it.
        let transport = Arc::downgrade(&transport);
        std::thread::Builder::new()
            .name(format!("embers-watchdog-{rank}"))
            .spawn(move || loop {
                let Some(dog) = watched.upgrade() else { return };
                let mut armed = dog.armed.lock();
                match armed.as_ref() {
                    None => {
                        // Wake now and then to notice the communicator is gone.
                        dog.wake.wait_for(&mut armed, Duration::from_millis(500));
                    }
                    Some(a) if Instant::now() >= a.deadline => {
                        eprintln!(
                            "rank {rank}: {} #{} exceeded {:.1} s (a peer died, stalled or \
                             skipped this collective); aborting the job",
                            a.op,
                            a.seq,
                            timeout.as_secs_f64()
                        );
                        // The launcher forwards a rank's stderr through a pipe and stops
                        // reading it once the abort reaches it: give the message time to
                        // leave first (without this pause it was lost now and then).
                        let _ = std::io::Write::flush(&mut std::io::stderr());
                        std::thread::sleep(Duration::from_millis(300));
                        match transport.upgrade() {
                            Some(t) => t.abort(75),
                            None => std::process::exit(75),
                        }
                    }
                    Some(a) => {
                        let deadline = a.deadline;
                        dog.wake.wait_until(&mut armed, deadline);
                    }
                }
            })
            .expect("spawning the communicator's watchdog thread");
        dog
    }

    fn arm(&self, op: &'static str, seq: u64, deadline: Instant) {
        *self.armed.lock() = Some(Armed { op, seq, deadline });
        self.wake.notify_one();
    }

    fn disarm(&self) {
        *self.armed.lock() = None;
    }
}

/// A group of ranks and the collectives between them: numbered, byte-counted and guarded by
/// a deadline ([`Comm::with_timeout`]; `EMBERS_DIST_TIMEOUT_S`, else 300 s). A collective that
/// does not complete in time — a peer died, stalled or skipped it — is an error naming this
/// rank, the op and its number; under MPI, where a blocked call cannot return, the process
/// group is aborted with that message instead (exit code 75).
///
/// Every rank of the group must make the same collectives in the same order.
pub struct Comm {
    transport: Arc<dyn Transport>,
    seq: AtomicU64,
    /// Input distributions on this communicator so far: the batch number every rank must
    /// agree on (one count per communicator, so two pipelines' threads on their own
    /// communicators cannot interleave theirs differently on different ranks).
    batches: AtomicU64,
    /// The lengths every rank agreed on for each [`Comm::all_reduce_sum`] op, at its first call.
    reduce_lengths: Mutex<BTreeMap<&'static str, usize>>,
    timeout: Duration,
    /// Shared with the groups split from this one: a rank's counts cover all its groups.
    bytes: Arc<Mutex<BTreeMap<&'static str, OpBytes>>>,
    watchdog: Option<Arc<Watchdog>>,
}

impl std::fmt::Debug for Comm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Comm(rank {} of {})", self.rank(), self.size())
    }
}

/// The deadline of every collective: `EMBERS_DIST_TIMEOUT_S` seconds (a positive number of
/// seconds a [`Duration`] holds), else 300. A value that is not one is an error naming it, not
/// a quiet fallback to 300.
pub fn default_timeout() -> Result<Duration> {
    timeout_of(std::env::var_os("EMBERS_DIST_TIMEOUT_S").as_deref())
}

/// [`default_timeout`] of the variable's value (`None`: unset).
fn timeout_of(value: Option<&std::ffi::OsStr>) -> Result<Duration> {
    let Some(raw) = value else {
        return Ok(Duration::from_secs(300));
    };
    let raw = raw.to_string_lossy();
    (raw.trim().parse::<f64>().ok())
        .filter(|s| *s > 0.0)
        .and_then(|s| Duration::try_from_secs_f64(s).ok())
        .ok_or_else(|| {
            Error::Distributed(format!(
                "EMBERS_DIST_TIMEOUT_S={raw:?} is not a positive number of seconds \
                 (at most {} s)",
                Duration::MAX.as_secs()
            ))
        })
}

/// `blocks` back to back, and their lengths.
fn concat<T: Pod>(blocks: &[Vec<T>]) -> (Vec<T>, Vec<usize>) {
    let mut flat = Vec::with_capacity(blocks.iter().map(Vec::len).sum());
    for b in blocks {
        flat.extend_from_slice(b);
    }
    (flat, blocks.iter().map(Vec::len).collect())
}

/// Cuts `flat` into blocks of `counts` values.
fn split_blocks<T: Pod>(flat: &[T], counts: &[usize]) -> Vec<Vec<T>> {
    let mut at = 0;
    (counts.iter())
        .map(|&n| {
            at += n;
            flat[at - n..at].to_vec()
        })
        .collect()
}

/// A zeroed buffer of `n` values for a transport to fill.
/// The element-wise sum of `parts` (each of `len` values), added in rank order: the same bits
/// wherever the ranks run.
pub(crate) fn sum_in_rank_order(parts: &[Vec<f32>], len: usize) -> Vec<f32> {
    let mut sum = vec![0.0f32; len];
    for part in parts {
        for (s, &v) in sum.iter_mut().zip(part) {
            *s += v;
        }
    }
    sum
}

/// The receive buffer of blocks of `counts` values: zeros, or an error naming `op` when the
/// counts (given by the caller or by the peers) sum past a `usize` or past the memory.
fn receive_buffer<T: Pod>(op: &'static str, counts: &[usize]) -> Result<Vec<T>> {
    let size = std::mem::size_of::<T>();
    let n = (crate::tensor::checked_sum(counts))
        .filter(|&n| crate::tensor::addressable_bytes(&[n], size).is_some())
        .ok_or_else(|| {
            Error::invalid(
                op,
                format!("blocks of {counts:?} values of {size} bytes are past any memory"),
            )
        })?;
    crate::tensor::storage::try_filled(op, T::zeroed(), n)
}

impl Comm {
    /// A communicator over `transport` with the [`default_timeout`].
    pub(crate) fn new(transport: Arc<dyn Transport>) -> Result<Comm> {
        Ok(Comm::with_transport_timeout(transport, default_timeout()?))
    }

    fn with_transport_timeout(transport: Arc<dyn Transport>, timeout: Duration) -> Comm {
        Comm::build(transport, timeout, Arc::default())
    }

    fn build(
        transport: Arc<dyn Transport>,
        timeout: Duration,
        bytes: Arc<Mutex<BTreeMap<&'static str, OpBytes>>>,
    ) -> Comm {
        let watchdog = transport
            .needs_watchdog()
            .then(|| Watchdog::start(transport.clone(), timeout));
        Comm {
            transport,
            seq: AtomicU64::new(0),
            batches: AtomicU64::new(0),
            reduce_lengths: Mutex::new(BTreeMap::new()),
            timeout,
            bytes,
            watchdog,
        }
    }

    /// The number of this input distribution on this communicator (0, 1, …).
    pub(crate) fn next_batch(&self) -> u64 {
        self.batches.fetch_add(1, Ordering::Relaxed)
    }

    /// The same group with another deadline per collective (seconds in tests, minutes in
    /// production).
    pub fn with_timeout(self, timeout: Duration) -> Comm {
        Comm::build(self.transport, timeout, self.bytes)
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.transport.rank()
    }

    /// Ranks in the group.
    pub fn size(&self) -> usize {
        self.transport.size()
    }

    /// The deadline of each collective.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Bytes moved so far, per kind of collective, by this group and the groups split from
    /// it.
    pub fn bytes(&self) -> BTreeMap<&'static str, OpBytes> {
        self.bytes.lock().clone()
    }

    /// Clears the byte counts.
    pub fn reset_bytes(&self) {
        self.bytes.lock().clear();
    }

    /// Runs one collective `op` with its number, deadline and byte count (`sent`, `received`:
    /// bytes to and from other ranks).
    fn run<R>(
        &self,
        op: &'static str,
        call: impl FnOnce(Instant) -> std::result::Result<R, TransportError>,
        (sent, received): (u64, u64),
    ) -> Result<R> {
        let seq = self.seq.fetch_add(1, Ordering::Relaxed) + 1;
        let deadline = Instant::now() + self.timeout;
        if let Some(dog) = &self.watchdog {
            dog.arm(op, seq, deadline);
        }
        let out = call(deadline);
        if let Some(dog) = &self.watchdog {
            dog.disarm();
        }
        let rank = self.rank();
        let out = out.map_err(|e| match e {
            TransportError::Timeout { missing } => Error::Distributed(format!(
                "rank {rank}: {op} #{seq} exceeded {:.1} s{}",
                self.timeout.as_secs_f64(),
                if missing.is_empty() {
                    String::new()
                } else {
                    format!(" waiting for rank(s) {missing:?}")
                }
            )),
            TransportError::Failed(msg) => {
                Error::Distributed(format!("rank {rank}: {op} #{seq} failed: {msg}"))
            }
        })?;
        let mut bytes = self.bytes.lock();
        let entry = bytes.entry(op).or_default();
        entry.calls += 1;
        entry.sent += sent;
        entry.received += received;
        Ok(out)
    }

    /// All-to-all of variable-size blocks: `send[d]` goes to rank `d`; returns the block from
    /// each rank. `recv_counts` are the values expected from each rank when known (an earlier
    /// exchange gave them); without them the counts are exchanged first (a counted `sizes`
    /// all-to-all).
    pub fn all_to_all_v<T: Pod>(
        &self,
        op: &'static str,
        send: Vec<Vec<T>>,
        recv_counts: Option<&[usize]>,
    ) -> Result<Vec<Vec<T>>> {
        let w = self.size();
        if send.len() != w || recv_counts.is_some_and(|c| c.len() != w) {
            return Err(Error::invalid(
                op,
                format!("an all-to-all over {w} ranks needs {w} blocks and counts"),
            ));
        }
        let exchanged;
        let recv_counts = match recv_counts {
            Some(c) => c,
            None => {
                let sizes: Vec<Vec<u64>> = send.iter().map(|b| vec![b.len() as u64]).collect();
                let got = self.all_to_all_v("sizes", sizes, Some(&vec![1; w]))?;
                exchanged = got.iter().map(|c| c[0] as usize).collect::<Vec<_>>();
                &exchanged
            }
        };
        if w == 1 {
            // One rank: the block to itself is the result (no transport, no copy).
            if recv_counts[0] != send[0].len() {
                return Err(Error::invalid(
                    op,
                    format!(
                        "{} values to itself, {} expected",
                        send[0].len(),
                        recv_counts[0]
                    ),
                ));
            }
            self.run(op, |_| Ok(()), (0, 0))?;
            return Ok(send);
        }
        let mut recv: Vec<T> = receive_buffer(op, recv_counts)?;
        let rank = self.rank();
        let size = std::mem::size_of::<T>();
        let off_rank = |sizes: &mut dyn Iterator<Item = usize>| -> u64 {
            sizes
                .enumerate()
                .filter(|&(r, _)| r != rank)
                .map(|(_, n)| (n * size) as u64)
                .sum()
        };
        let sent = off_rank(&mut send.iter().map(Vec::len));
        let received = off_rank(&mut recv_counts.iter().copied());
        let (flat, send_counts) = concat(&send);
        drop(send);
        let send_sizes: Vec<usize> = send_counts.iter().map(|&n| n * size).collect();
        let recv_sizes: Vec<usize> = recv_counts.iter().map(|&n| n * size).collect();
        self.run(
            op,
            |deadline| {
                self.transport.all_to_all_v(
                    bytemuck::cast_slice(&flat),
                    &send_sizes,
                    bytemuck::cast_slice_mut(&mut recv),
                    &recv_sizes,
                    deadline,
                )
            },
            (sent, received),
        )?;
        Ok(split_blocks(&recv, recv_counts))
    }

    /// Every rank's values, in rank order. `recv_counts` are the values expected from each rank
    /// when known; without them the counts are gathered first (a counted `sizes` all-gather).
    pub fn all_gather_v<T: Pod>(
        &self,
        op: &'static str,
        send: &[T],
        recv_counts: Option<&[usize]>,
    ) -> Result<Vec<Vec<T>>> {
        let (rank, w) = (self.rank(), self.size());
        if recv_counts.is_some_and(|c| c.len() != w || c[rank] != send.len()) {
            return Err(Error::invalid(
                op,
                format!("an all-gather over {w} ranks needs {w} counts, this rank's its own"),
            ));
        }
        let exchanged;
        let recv_counts = match recv_counts {
            Some(c) => c,
            None => {
                let got = self.all_gather_v("sizes", &[send.len() as u64], Some(&vec![1; w]))?;
                exchanged = got.iter().map(|c| c[0] as usize).collect::<Vec<_>>();
                &exchanged
            }
        };
        if w == 1 {
            self.run(op, |_| Ok(()), (0, 0))?;
            return Ok(vec![send.to_vec()]);
        }
        let mut recv: Vec<T> = receive_buffer(op, recv_counts)?;
        let size = std::mem::size_of::<T>();
        let bytes: &[u8] = bytemuck::cast_slice(send);
        let received: u64 = (recv_counts.iter().enumerate())
            .filter(|&(r, _)| r != rank)
            .map(|(_, &n)| (n * size) as u64)
            .sum();
        let recv_sizes: Vec<usize> = recv_counts.iter().map(|&n| n * size).collect();
        self.run(
            op,
            |deadline| {
                (self.transport).all_gather_v(
                    bytes,
                    bytemuck::cast_slice_mut(&mut recv),
                    &recv_sizes,
                    deadline,
                )
            },
            ((bytes.len() * (w - 1)) as u64, received),
        )?;
        Ok(split_blocks(&recv, recv_counts))
    }

    /// Reduce-scatter of variable-size segments: `send[d]` is this rank's part of rank `d`'s
    /// segment; returns the sum, over every rank in rank order, of the parts sent here (all
    /// of one length).
    pub fn reduce_scatter_v(&self, op: &'static str, send: Vec<Vec<f32>>) -> Result<Vec<f32>> {
        let own = send.get(self.rank()).map_or(0, Vec::len);
        let counts = vec![own; self.size()];
        let parts = self.all_to_all_v(op, send, Some(&counts))?;
        Ok(sum_in_rank_order(&parts, own))
    }

    /// Sums `values` over every rank, in place (the same bits on every rank: chunk `r` is
    /// summed by rank `r` in rank order, then gathered).
    ///
    /// Every rank passes as many values: checked at each op's first call (ranks whose lengths
    /// differ, such as dense halves of different shapes, all stop there naming the lengths);
    /// a length that changes later is an error on the rank that changed it.
    pub fn all_reduce_sum(&self, op: &'static str, values: &mut [f32]) -> Result<()> {
        let w = self.size();
        if w == 1 {
            return self.run(op, |_| Ok(()), (0, 0));
        }
        let agreed = self.reduce_lengths.lock().get(op).copied();
        match agreed {
            Some(n) if n == values.len() => {}
            Some(n) => {
                return Err(Error::invalid(
                    op,
                    format!(
                        "rank {}: {} values to sum, where every rank agreed on {n} at the first \
                         call",
                        self.rank(),
                        values.len()
                    ),
                ))
            }
            None => {
                let all = self.all_gather_v(
                    "all_reduce.lengths",
                    &[values.len() as u64],
                    Some(&vec![1; w]),
                )?;
                let lengths: Vec<u64> = all.iter().map(|v| v[0]).collect();
                if lengths.iter().any(|&n| n != lengths[0]) {
                    return Err(Error::Distributed(format!(
                        "rank {}: {op}: the ranks sum different numbers of values {lengths:?} \
                         (do they build the same model?)",
                        self.rank()
                    )));
                }
                self.reduce_lengths.lock().insert(op, values.len());
            }
        }
        self.sum_in_chunks(op, values)
    }

    /// Sums f64 `values` over every rank, in place, as [`all_reduce_sum`](Self::all_reduce_sum)
    /// sums f32s (the same bits on every rank), but without its length exchange: the caller
    /// has checked that every rank passes as many values.
    pub(crate) fn all_reduce_sum_f64(&self, op: &'static str, values: &mut [f64]) -> Result<()> {
        if self.size() == 1 {
            return self.run(op, |_| Ok(()), (0, 0));
        }
        self.sum_in_chunks(op, values)
    }

    /// The exchange of an all-reduce sum, lengths agreed: chunk `r` of `values` is summed by
    /// rank `r` in rank order (an all-to-all), then every chunk gathered.
    fn sum_in_chunks<T: Pod + Default + std::ops::AddAssign>(
        &self,
        op: &'static str,
        values: &mut [T],
    ) -> Result<()> {
        let w = self.size();
        let chunk = values.len().div_ceil(w.max(1));
        let counts: Vec<usize> = (0..w)
            .map(|r| chunk.min(values.len().saturating_sub(r * chunk)))
            .collect();
        let send: Vec<Vec<T>> = (0..w)
            .map(|r| {
                let start = (r * chunk).min(values.len());
                values[start..start + counts[r]].to_vec()
            })
            .collect();
        let own = counts[self.rank()];
        let parts = self.all_to_all_v(op, send, Some(&vec![own; w]))?;
        let mut mine = vec![T::default(); own];
        for part in &parts {
            for (s, &v) in mine.iter_mut().zip(part) {
                *s += v;
            }
        }
        let gathered = self.all_gather_v(op, &mine, Some(&counts))?;
        let mut at = 0;
        for part in gathered {
            values[at..at + part.len()].copy_from_slice(&part);
            at += part.len();
        }
        Ok(())
    }

    /// Waits for every rank.
    pub fn barrier(&self, op: &'static str) -> Result<()> {
        let w = self.size();
        self.all_gather_v::<u8>(op, &[1], Some(&vec![1; w]))
            .map(|_| ())
    }

    /// Checks that every rank passed the same `digest` of `what` (a plan, a list of keys):
    /// an error naming the ranks that differ from rank 0.
    pub fn check_same(&self, what: &str, digest: u64) -> Result<()> {
        let all = self.all_gather_v("check_same", &[digest], Some(&vec![1; self.size()]))?;
        let differ: Vec<usize> = (all.iter().enumerate())
            .filter(|(_, d)| d.first() != all[0].first())
            .map(|(r, _)| r)
            .collect();
        if !differ.is_empty() {
            return Err(Error::Distributed(format!(
                "rank {}: {what} differs between rank 0 and rank(s) {differ:?}",
                self.rank()
            )));
        }
        Ok(())
    }

    /// The group of the ranks that pass the same `color`, ranked as here (a call every rank
    /// makes, as a collective).
    pub fn split(&self, color: usize) -> Result<Comm> {
        let transport = self.run(
            "split",
            |deadline| self.transport.split(color, deadline),
            (0, 0),
        )?;
        Ok(Comm::build(transport, self.timeout, self.bytes.clone()))
    }
}

#[cfg(test)]
mod tests {
    use std::ffi::OsStr;
    use std::time::Duration;

    use super::timeout_of;

    #[test]
    fn the_timeout_variable_is_a_deadline_or_an_error_naming_it() {
        assert_eq!(timeout_of(None).unwrap(), Duration::from_secs(300));
        let at = |s: &str| timeout_of(Some(OsStr::new(s)));
        assert_eq!(at(" 2.5 ").unwrap(), Duration::from_millis(2500));
        // Past a `Duration` (it panicked), not a number, zero, negative, NaN, infinite: named,
        // where they used to fall back to 300 s without a word.
        for bad in ["1e20", "5m", "", "0", "-3", "NaN", "inf"] {
            let e = at(bad).unwrap_err().to_string();
            assert!(
                e.contains(&format!("EMBERS_DIST_TIMEOUT_S={bad:?}")),
                "{bad}: {e}"
            );
        }
    }
}
