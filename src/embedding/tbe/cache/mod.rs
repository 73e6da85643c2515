//! Tables bigger than the memory that computes on them: every row (with its optimizer state)
//! lives in a backing file ([`store`]), and a set-associative cache ([`directory`]) holds the
//! rows in use, in DRAM or in a GPU's memory (FBGEMM's `MANAGED_CACHING`). The cache's buffers
//! are ordinary tables ([`HostTables`] or [`DeviceTables`]) whose table `t` has
//! `slots_t + scratch_t` rows, so forward and the fused backward are the host or GPU kernels
//! themselves, run on a copy of the batch whose ids are cache slots. A host cache's directory
//! and admission run on the host. A GPU cache admits on the GPU ([`device_directory`]: the
//! same decisions, made by kernels, the batch's ids turned into cache rows in place); its row
//! moves are made by a kernel over rows in host memory registered with the GPU, or, for rows in
//! a file (whose pages cannot be pinned), listed for the host and crossing in one pinned
//! transfer each way ([`gpu`], `cuda::records`). The host directory stays the one that
//! flushes, checkpoints and serves direct reads: the two directories are copied into each
//! other when the work changes sides (`EMBERS_CACHE_HOST_DIRECTORY=1` keeps a GPU cache's
//! directory on the host, as before).
//!
//! The life of a batch:
//! * **admission** (at `prepare`, `forward` or `prefetch`): each table's unique ids are looked
//!   up; hits are locked, misses take the least-wanted unlocked way of their set (LRU or LFU),
//!   writing its old row back to the file if dirty and reading the new one. A miss whose set is
//!   wholly locked by in-flight batches (a *conflict miss*) is served by direct reads instead:
//!   a scratch row after the slots, filled from the row's current copy at each use. An
//!   admission made by `prefetch` is kept, and the same batch's `prepare` or `forward` takes it
//!   instead of admitting again. A GPU cache's prefetch runs on its device's prefetch stream, beside the
//!   backward of the batch in flight (which touches only its own locked slots); the unlock of
//!   a released batch waits for that batch's last lookup or backward, and a lookup of a
//!   prefetched batch for the prefetch stream.
//! * **forward / backward** run on the slots; the backward marks its slots dirty and writes
//!   scratch rows back where the row now lives (its slot, if a later admission cached it
//!   meanwhile — the stale-copy race of a prefetch pipeline — or else the file).
//! * the batch's locks are released when it is dropped.
//!
//! The authoritative copy of a row is its slot when cached, else the file; scratch rows are
//! working copies refreshed at every use. Everything runs under the TBE's state lock, so the
//! values seen and updated are exactly those of the uncached TBE, bit for bit.
//!
//! Unlike FBGEMM, which shares one cache among all tables of a TBE, each table gets its own
//! share (`cache_load_factor × rows`, at least one set): the planner's per-table load factor
//! then means what it says, and no table can evict another's rows.

pub(crate) mod api;
pub(crate) mod bytes;
mod config;
mod device_directory;
pub(crate) mod directory;
mod gpu;
mod log;
mod memory;
pub(crate) mod store;
#[cfg(test)]
mod stream_tests;
pub(crate) mod trace;
mod view;

use std::sync::Arc;

use parking_lot::Mutex;

use super::cpu::backward::BackwardOutput;
use super::cpu::HostTables;
use super::cuda::records::{RecordAt, RecordStaging};
use super::cuda::{DeviceBatch, DeviceTables};
use super::{TbeConfig, TbeLayout};
use crate::cuda::{CudaDevice, DeviceBuffer, DeviceEvent, MappedHost, Stream};
use crate::embedding::input::{Batch, Ids};
use crate::embedding::optimizer::FusedOptimizer;
use crate::{Device, Error, Result, Tensor};
use device_directory::DeviceDirectory;
use directory::TableAdmission;
use directory::{Directory, SLOT_BYTES, WAYS};
use rayon::prelude::*;
use store::RowStore;
use view::TableView;

const OP: &str = "cached TBE";

pub use config::{CacheConfig, CachePolicy, CacheSize, CacheStats, CacheTimes, Placement};

/// A row served by direct reads: table, row, its scratch row in the cache buffers.
#[derive(Clone, Copy, Debug)]
struct Fallback {
    table: usize,
    row: u64,
    pos: usize,
}

/// The slots a batch locked: per table, on the host (the host directory admitted it), or as
/// global slot numbers on the GPU (the device directory did).
enum Locks {
    Host(Vec<Vec<usize>>),
    Device(DeviceBuffer<i64>, usize),
}

/// A dropped batch's locks, the point of the GPU stream after its last lookup or backward
/// (the locks are released on the GPU only once it is reached), and the tick of its admission.
type Released = (Locks, Option<DeviceEvent>, u64);

#[cfg(test)]
thread_local! {
    /// Makes the next release of finished batches' slots on this thread fail.
    static FAIL_RELEASE: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    /// Makes the next write-back after a backward on this thread fail.
    static FAIL_WRITE_BACK: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// The slots an admitted batch locked (released when it is dropped) and its direct reads.
struct Lease {
    locked: Locks,
    fallback: Vec<Fallback>,
    /// A GPU cache: the point of its stream after the batch's last lookup or backward. Its
    /// slots may take other rows only after it (the release waits for it), while an
    /// admission on another stream runs beside the batch's backward.
    last_use: Mutex<Option<DeviceEvent>>,
    /// The admission's tick.
    tick: u64,
    released: Arc<Mutex<Vec<Released>>>,
}

impl Drop for Lease {
    fn drop(&mut self) {
        // Deferred to the next admission: a drop may happen while the TBE's lock is held.
        let locked = std::mem::replace(&mut self.locked, Locks::Host(Vec::new()));
        let last_use = self.last_use.get_mut().take();
        self.released.lock().push((locked, last_use, self.tick));
    }
}

/// Which copy of a GPU cache's directory is current.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Home {
    Host,
    Device,
}

/// A batch admitted to the cache: its ids as cache rows (copied to the GPU for a GPU cache),
/// and its lease.
pub(crate) struct CachedBatch {
    pub remapped: Batch<'static>,
    /// The [generation](CachedTables::generation) of the cache that admitted it.
    generation: u64,
    on_device: Option<DeviceBatch>,
    lease: Lease,
    /// A prefetched admission on a GPU: the point of the prefetch stream after its last
    /// work (the batch's lookup waits for it).
    ready: Option<DeviceEvent>,
}

impl CachedBatch {
    /// Whether the batch was admitted to a GPU cache.
    pub(crate) fn is_on_device(&self) -> bool {
        self.on_device.is_some()
    }

    /// Notes that work on the calling thread's current stream of `device` uses the batch's
    /// GPU buffers (allocated on the prefetch stream when prefetched): their memory waits for
    /// that work when freed.
    fn used_here(&self, device: &CudaDevice) {
        let stream = device.current_stream_id();
        if let Some(b) = &self.on_device {
            b.ids.note_stream(stream);
            b.offsets.note_stream(stream);
            if let Some(w) = &b.weights {
                w.note_stream(stream);
            }
        }
        if let Locks::Device(slots, _) = &self.lease.locked {
            slots.note_stream(stream);
        }
    }

    /// Records the point of the calling thread's stream after work on the batch (its locks
    /// are released on the GPU only after it).
    fn mark_used(&self, device: &CudaDevice) -> Result<()> {
        self.used_here(device);
        *self.lease.last_use.lock() = Some(device.record_marker()?);
        Ok(())
    }
}

/// The cache rows (cache-shaped tables: table `t` has `slots_t + scratch_t` rows), in host
/// memory or in a GPU's memory.
#[allow(clippy::large_enum_variant)] // one per TBE
pub(crate) enum CacheRows {
    Host(HostTables),
    Device(DeviceTables),
}

/// A batch's id positions by table: for each table, the bags of the features reading it.
pub(crate) struct TablePositions(Vec<Vec<std::ops::Range<usize>>>);

impl TablePositions {
    /// The positions in `batch` of each of `tables` tables' ids.
    pub(crate) fn new(feature_table_map: &[usize], tables: usize, batch: &Batch<'_>) -> Self {
        let b = batch.batch_size;
        TablePositions(
            (0..tables)
                .map(|t| {
                    (feature_table_map.iter().enumerate())
                        .filter(|(_, &ft)| ft == t)
                        .map(|(f, _)| batch.offsets[f * b]..batch.offsets[(f + 1) * b])
                        .collect()
                })
                .collect(),
        )
    }

    /// Whether any feature reads table `t`.
    pub(crate) fn read(&self, t: usize) -> bool {
        !self.0[t].is_empty()
    }

    /// How many ids of the batch read table `t`.
    pub(crate) fn len(&self, t: usize) -> usize {
        self.0[t].iter().map(|r| r.len()).sum()
    }

    fn positions(&self, t: usize) -> impl Iterator<Item = usize> + '_ {
        self.0[t].iter().cloned().flatten()
    }

    /// Table `t`'s ids, in batch order.
    pub(crate) fn ids(&self, t: usize, batch: &Batch<'_>) -> Vec<u64> {
        self.positions(t).map(|p| batch.ids.get(p) as u64).collect()
    }

    /// Writes each table's cache rows (`admitted[t]`'s `loc`, in the order of
    /// [`ids`](Self::ids); `None` for a table no feature reads) into the remapped ids at their
    /// positions, the tables in parallel (each feature's ids are one span of the batch, so the
    /// tables' spans are disjoint).
    pub(crate) fn place(&self, admitted: &[Option<TableAdmission>], remapped: &mut [i64]) {
        let mut spans: Vec<(usize, usize, usize)> = (self.0.iter().enumerate())
            .flat_map(|(t, rs)| rs.iter().map(move |r| (r.start, r.end, t)))
            .collect();
        spans.sort_unstable();
        let mut chunks: Vec<Vec<&mut [i64]>> = self.0.iter().map(|_| Vec::new()).collect();
        let (mut rest, mut at) = (remapped, 0);
        for (start, end, t) in spans {
            let (_, tail) = std::mem::take(&mut rest).split_at_mut(start - at);
            let (chunk, tail) = tail.split_at_mut(end - start);
            chunks[t].push(chunk);
            (rest, at) = (tail, end);
        }
        chunks
            .into_par_iter()
            .zip(admitted)
            .for_each(|(chunks, a)| {
                let Some(mut loc) = a.as_ref().map(|a| &a.loc[..]) else {
                    return;
                };
                for chunk in chunks {
                    let (head, tail) = loc.split_at(chunk.len());
                    chunk.copy_from_slice(head);
                    loc = tail;
                }
                assert!(loc.is_empty(), "one cache row per id");
            });
    }
}

/// Adds a device admission's counters (per table: hits locked, rows installed, direct reads,
/// evictions, dirty rows written back) to FBGEMM's statistics of the tables the batch read
/// (moved rows are counted by the caller, where they were moved).
pub(crate) fn add_device_counts(
    stats: &mut [CacheStats],
    counts: &[[u64; device_directory::PER_TABLE]],
    ranges: &TablePositions,
) {
    for (t, (stats, &[hits, installed, direct, evictions, _])) in
        stats.iter_mut().zip(counts).enumerate()
    {
        if !ranges.read(t) {
            continue;
        }
        stats.calls += 1;
        stats.requested_ids += ranges.len(t) as u64;
        stats.unique_ids += hits + installed + direct;
        stats.unique_misses += installed + direct;
        stats.conflict_misses += direct;
        stats.evictions += evictions;
    }
}

/// A moved row: its slot, the dirty row it evicts (written back first), the row read in.
pub(crate) type Move = (usize, Option<u64>, u64);

/// Where a record's parts sit in the cache buffers.
#[derive(Clone, Copy)]
pub(crate) struct Parts {
    dim: usize,
    state: [usize; 2],
}

impl Parts {
    fn record(&self) -> usize {
        self.dim + self.state[0] + self.state[1]
    }
    /// Range of part `p` (0 weights, 1 and 2 the state buffers) in a record.
    fn range(&self, p: usize) -> std::ops::Range<usize> {
        let start = [0, self.dim, self.dim + self.state[0]][p];
        let len = [self.dim, self.state[0], self.state[1]][p];
        start..start + len
    }
}

/// Where each table's record parts sit (weights, then the optimizer's per-row state).
fn parts_of(config: &TbeConfig) -> Vec<Parts> {
    parts_for(&config.optimizer, config.tables.iter().map(|s| s.dim))
}

/// [`parts_of`] for tables of widths `dims` trained by `optimizer`.
fn parts_for(optimizer: &FusedOptimizer, dims: impl Iterator<Item = usize>) -> Vec<Parts> {
    dims.map(|dim| Parts {
        dim,
        state: [0, 1].map(|i| optimizer.state_len(i, 1, dim)),
    })
    .collect()
}

/// Each table's rows and bytes per record in the store, for records laid out as `parts`.
fn records_of(config: &TbeConfig, parts: &[Parts]) -> Vec<(usize, usize)> {
    records_for(config.tables.iter().map(|s| s.rows), parts)
}

/// The bytes each table's write log gathers before writing them: a 16th of its cache rows'
/// bytes, at most [`log::PENDING_BYTES`].
fn log_buffers(dirs: &[Directory], records: &[(usize, usize)]) -> Vec<usize> {
    (dirs.iter().zip(records))
        .map(|(d, &(_, b))| (d.slots() * b / 16).min(log::PENDING_BYTES))
        .collect()
}

/// [`records_of`] for tables of `rows`.
fn records_for(rows: impl Iterator<Item = usize>, parts: &[Parts]) -> Vec<(usize, usize)> {
    rows.zip(parts).map(|(n, p)| (n, p.record() * 4)).collect()
}

/// Whether a cache on `device` keeps its directory there too: on a GPU, unless
/// `EMBERS_CACHE_HOST_DIRECTORY=1` keeps it on the host.
fn wants_device_dir(device: Option<&Arc<CudaDevice>>) -> bool {
    device.is_some() && !std::env::var("EMBERS_CACHE_HOST_DIRECTORY").is_ok_and(|v| v == "1")
}

/// Tables in a file, cached in DRAM.
pub(crate) struct CachedTables {
    /// A GPU cache's rows in host memory, registered with the GPU so that its kernels make
    /// the moves themselves (declared before `store`: unregistered before the memory goes).
    mapped: Option<MappedHost>,
    store: RowStore,
    policy: CachePolicy,
    dirs: Vec<Directory>,
    /// The cache-shaped config: table `t` has `slots + scratch` rows.
    cfg: TbeConfig,
    layout: TbeLayout,
    rows: CacheRows,
    scratch: Vec<usize>,
    parts: Vec<Parts>,
    tick: u64,
    stats: Vec<CacheStats>,
    /// The locked slots of dropped batches, not yet unlocked.
    released: Arc<Mutex<Vec<Released>>>,
    /// A GPU cache's directory on the GPU (admissions run there), unless
    /// `EMBERS_CACHE_HOST_DIRECTORY=1` asked for the host's.
    device_dir: Option<DeviceDirectory>,
    /// Which directory is current: `dirs`, or `device_dir`'s buffers.
    home: Home,
    /// Why the cache is unusable: a GPU admission failed after deciding (its locks and
    /// installed rows may disagree with the cache rows). Everything but a checkpoint load
    /// ([`invalidate`](Self::invalidate)) is refused meanwhile.
    poisoned: Option<String>,
    /// A GPU cache's pinned staging buffers, and the point of the stream after the moves
    /// that last used them.
    staging: RecordStaging,
    moves_done: Option<DeviceEvent>,
    /// Where the admissions' time went.
    times: CacheTimes,
    /// Admissions made by `prefetch`, oldest first, with the ids and offsets they admitted:
    /// the admission of the same batch takes one instead of admitting it again.
    prefetched: std::collections::VecDeque<(Vec<i64>, Vec<usize>, CachedBatch)>,
    /// A GPU cache's prefetch stream (its device's, shared by every cache there; taken at
    /// the first prefetch): a prefetched admission runs there, beside the backward of the
    /// batch before on the caller's stream.
    prefetch_stream: Option<Stream>,
    /// Whether a GPU cache prefetches on the prefetch stream (else on the caller's).
    prefetch_on_side_stream: bool,
    /// Timed events on the prefetch stream at the start and end of the last prefetch's
    /// admission there, until taken ([`take_prefetch_span`](Self::take_prefetch_span)).
    prefetch_span: Option<[DeviceEvent; 2]>,
    /// While a prefetch admits on the prefetch stream: its span's start, recorded by the
    /// device directory's admission once its waits for other streams are queued (`Some(None)`
    /// until then; it stays so when the host admits the batch: no span).
    span_start: Option<Option<DeviceEvent>>,
    /// Which cache this is: a new number whenever its slots are made anew (built, moved to
    /// another device, emptied by a load). A batch admitted by another generation is
    /// refused: its cache rows and direct reads are another cache's.
    generation: u64,
}

/// A generation number no cache of this process had before.
fn new_generation() -> u64 {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

/// Prefetched admissions kept at most (a pipeline one batch deep needs one).
const MAX_PREFETCHED: usize = 2;

/// Sets per table for `size`, tables given as `(rows, bytes per cached row)`; a byte budget
/// also pays `per_row` bytes for every row of the tables, cached or not (LFU's access counts).
pub(crate) fn sets_for(
    size: CacheSize,
    tables: &[(usize, usize)],
    per_row: usize,
) -> Result<Vec<usize>> {
    let full = |rows: usize| rows.div_ceil(WAYS).max(1);
    size.check()?;
    match size {
        CacheSize::LoadFactor(f) => Ok(tables
            .iter()
            .map(|&(rows, _)| {
                let want = (f * rows as f64 / WAYS as f64).ceil() as usize;
                want.clamp(1, full(rows))
            })
            .collect()),
        CacheSize::Bytes(budget) => {
            // Every row's fixed cost first (LFU's counts), then a slot costs its record and its
            // directory entry.
            let fixed: u64 = (tables.iter())
                .map(|&(rows, _)| (rows as u64).saturating_mul(per_row as u64))
                .fold(0, u64::saturating_add);
            let b = budget.saturating_sub(fixed);
            let slot = |record_bytes: usize| (record_bytes + SLOT_BYTES) as f64;
            let total: f64 = (tables.iter())
                .map(|&(rows, record)| rows as f64 * slot(record))
                .sum();
            let f = b as f64 / total.max(1.0);
            let min_bytes: u64 = (tables.iter())
                .map(|&(_, record)| (WAYS as f64 * slot(record)) as u64)
                .sum();
            if b < min_bytes {
                let counts = if fixed > 0 {
                    format!(" after LFU's access counts of every row ({fixed} bytes)")
                } else {
                    String::new()
                };
                return Err(Error::invalid(
                    OP,
                    format!(
                        "a cache budget of {budget} bytes is below one 32-way set per table \
                         ({min_bytes} bytes){counts}"
                    ),
                ));
            }
            Ok(tables
                .iter()
                .map(|&(rows, _)| {
                    let want = (f.min(1.0) * rows as f64 / WAYS as f64).floor() as usize;
                    want.clamp(1, full(rows))
                })
                .collect())
        }
    }
}

impl CachedTables {
    /// Has the row file removed when the cache goes ([`RowStore::discard_on_drop`]).
    pub(crate) fn discard_on_drop(&mut self) {
        self.store.discard_on_drop();
    }

    /// A cache over a new all-zero store at `cache.path` for the (logical) tables of `config`,
    /// its rows in host memory or, given `device`, in that GPU's memory.
    pub(crate) fn create(
        config: &TbeConfig,
        cache: &CacheConfig,
        device: Option<Arc<CudaDevice>>,
    ) -> Result<Self> {
        let tables = records_of(config, &parts_of(config));
        // A GPU cache keeps its directory on the device too: its slots cost that copy's bytes
        // as well.
        let with_device_dir = wants_device_dir(device.as_ref());
        let extra = if with_device_dir {
            device_directory::SLOT_BYTES
        } else {
            0
        };
        let sized: Vec<(usize, usize)> = tables.iter().map(|&(r, b)| (r, b + extra)).collect();
        // LFU counts every row's accesses, in each directory.
        let lfu_copies = if with_device_dir { 2 } else { 1 };
        let per_row = if cache.policy == CachePolicy::Lfu {
            4 * lfu_copies
        } else {
            0
        };
        // A host cache over a file logs its write-backs where the budget has room for the
        // log: its index takes 4 bytes a row, its buffer a 16th of the cache rows' bytes
        // ([`log_buffers`]).
        let logged = cache.write_log && device.is_none() && !cache.path.as_os_str().is_empty();
        let with_log: Vec<(usize, usize)> = (sized.iter())
            .map(|&(r, b)| (r, b + b.div_ceil(16)))
            .collect();
        let (sets, logged) = match logged.then(|| sets_for(cache.size, &with_log, per_row + 4)) {
            Some(Ok(sets)) => (sets, true),
            _ => (sets_for(cache.size, &sized, per_row)?, false),
        };
        let mut store = RowStore::create(&cache.path, &tables)?;
        store.want_log(logged);
        let mut tables = (Self::over(config, store, &sets, cache.policy, device, with_device_dir))
            .map_err(|f| {
                let (store, e) = *f;
                store.discard();
                e
            })?;
        tables.prefetch_on_side_stream = cache.prefetch_on_side_stream;
        Ok(tables)
    }

    /// An empty cache of `sets` sets per table over `store` (the rows of the logical tables
    /// of `config`), as [`create`](Self::create) makes it.
    fn over(
        config: &TbeConfig,
        store: RowStore,
        sets: &[usize],
        policy: CachePolicy,
        device: Option<Arc<CudaDevice>>,
        with_device_dir: bool,
    ) -> std::result::Result<Self, Box<(RowStore, Error)>> {
        let parts = parts_of(config);
        let built = (|| {
            let dirs: Vec<Directory> = (sets.iter().zip(&config.tables))
                .map(|(&n, s)| Directory::new(n, s.rows, policy))
                .collect::<Result<_>>()?;
            let scratch = vec![0; config.tables.len()];
            let (cfg, layout, rows) = Self::buffers(config, &dirs, &scratch, device.as_ref())?;
            let device_dir = match &device {
                Some(d) if with_device_dir => {
                    let rows: Vec<usize> = config.tables.iter().map(|s| s.rows).collect();
                    Some(DeviceDirectory::new(
                        d,
                        &dirs,
                        &rows,
                        &config.feature_table_map,
                        policy,
                    )?)
                }
                _ => None,
            };
            Ok((dirs, scratch, cfg, layout, rows, device_dir))
        })();
        let (dirs, scratch, cfg, layout, rows, device_dir) = match built {
            Ok(b) => b,
            Err(e) => return Err(Box::new((store, e))),
        };
        // The host makes a host cache's moves, record by record: its write-backs are logged.
        // A GPU cache's moves write the file in place, in parallel.
        let mut store = store;
        match device {
            None => store.start_log(&log_buffers(&dirs, &records_of(config, &parts))),
            Some(_) => store.stop_log(),
        }
        let stats = (config.tables.iter().zip(&dirs))
            .map(|(s, d)| CacheStats::empty(s.name.clone(), d.slots()))
            .collect();
        let mut tables = CachedTables {
            mapped: None,
            store,
            policy,
            dirs,
            cfg,
            layout,
            rows,
            scratch,
            parts,
            tick: 0,
            stats,
            released: Arc::new(Mutex::new(Vec::new())),
            device_dir,
            home: Home::Host,
            poisoned: None,
            staging: RecordStaging::default(),
            moves_done: None,
            times: CacheTimes::default(),
            prefetched: Default::default(),
            prefetch_stream: None,
            prefetch_span: None,
            span_start: None,
            prefetch_on_side_stream: true,
            generation: new_generation(),
        };
        tables.mapped = tables.map_store();
        Ok(tables)
    }

    /// This cache moved to `device` (`None`: the host): its dirty rows written back, then an
    /// empty cache of the same sets per table made there over the same store (rows in a file
    /// stay in it; rows in host memory stay there, registered with the new GPU). The
    /// counters carry over. Refused while batches it admitted are alive.
    pub(crate) fn moved_to(
        mut self,
        config: &TbeConfig,
        device: Option<Arc<CudaDevice>>,
    ) -> std::result::Result<Self, Box<(Self, Error)>> {
        if let Err(e) = (|| {
            self.flush()?;
            self.check_idle()
        })() {
            return Err(Box::new((self, e)));
        }
        let sets: Vec<usize> = self.dirs.iter().map(|d| d.sets).collect();
        let with_device_dir = wants_device_dir(device.as_ref());
        // Unregistered before the store changes hands.
        self.mapped = None;
        let empty =
            RowStore::create(std::path::Path::new(""), &[]).expect("an empty store needs nothing");
        let store = std::mem::replace(&mut self.store, empty);
        match Self::over(config, store, &sets, self.policy, device, with_device_dir) {
            Ok(mut moved) => {
                moved.stats = std::mem::take(&mut self.stats);
                moved.times = self.times;
                moved.prefetch_on_side_stream = self.prefetch_on_side_stream;
                Ok(moved)
            }
            Err(failed) => {
                // Back as it was (its dirty rows written back).
                let (store, e) = *failed;
                self.store = store;
                self.mapped = self.map_store();
                Err(Box::new((self, e)))
            }
        }
    }

    /// The registration of a GPU cache's rows in host memory with its GPU, when the device
    /// directory admits batches and the rows are not in a file (a file's pages cannot be
    /// pinned). `None` also when the driver refuses: the moves then cross in staged copies.
    fn map_store(&mut self) -> Option<MappedHost> {
        let device = self.gpu()?.clone();
        let aligned = (0..self.dirs.len()).all(|t| self.store.table(t).offset % 4 == 0);
        if self.device_dir.is_none() || !self.store.in_memory() || !aligned {
            return None;
        }
        let bytes = self.store.bytes_mut();
        if bytes.is_empty() {
            return None;
        }
        // SAFETY: the mapping lives as long as the store's memory: `mapped` is dropped first
        // (field order) and before the memory is replaced (`commit_store`); the host touches
        // the rows only between admissions, and an admission waits for its moves.
        unsafe { MappedHost::register(&device, bytes.as_mut_ptr(), bytes.len()) }.ok()
    }

    /// Makes staged rows the store's (a checkpoint's), the registration with the GPU moved
    /// to the new memory.
    pub(crate) fn commit_store(&mut self, staged: store::Staged) -> Result<()> {
        self.unmapped(|store| store.commit(staged))
    }

    /// [`commit_store`](Self::commit_store), keeping the rows it replaces
    /// ([`store::RowStore::commit_keeping`]).
    pub(crate) fn commit_store_keeping(
        &mut self,
        staged: store::Staged,
    ) -> Result<store::Previous> {
        self.unmapped(|store| store.commit_keeping(staged))
    }

    /// Puts back the rows a [`commit_store_keeping`](Self::commit_store_keeping) replaced.
    pub(crate) fn restore_store(&mut self, previous: store::Previous) -> Result<()> {
        self.unmapped(|store| store.restore(previous))
    }

    /// Runs `f` on the store with its registration with the GPU (if any) withdrawn, then
    /// registers its memory (perhaps new) again.
    fn unmapped<R>(&mut self, f: impl FnOnce(&mut RowStore) -> Result<R>) -> Result<R> {
        let was_mapped = self.mapped.take().is_some();
        let done = f(&mut self.store);
        if was_mapped {
            self.mapped = self.map_store();
        }
        done
    }

    /// The cache-shaped config, layout and zero buffers for `scratch` rows per table (on
    /// `device`, when given).
    fn buffers(
        logical: &TbeConfig,
        dirs: &[Directory],
        scratch: &[usize],
        device: Option<&Arc<CudaDevice>>,
    ) -> Result<(TbeConfig, TbeLayout, CacheRows)> {
        let mut cfg = logical.clone();
        for ((spec, d), &s) in cfg.tables.iter_mut().zip(dirs).zip(scratch) {
            spec.rows = d.slots() + s;
        }
        let layout = TbeLayout::new(&cfg)?;
        let rows = match device {
            None => CacheRows::Host(HostTables::zeros(&layout, &cfg)?),
            Some(device) => {
                let lens: Vec<usize> = (0..cfg.optimizer.state_buffers().len())
                    .map(|i| super::cpu::state_len(&cfg, &layout, i))
                    .collect();
                CacheRows::Device(DeviceTables::f32_zeros(
                    device.clone(),
                    super::feature_layout(&cfg, &layout),
                    layout.total_elements(),
                    &lens,
                    false,
                )?)
            }
        };
        Ok((cfg, layout, rows))
    }

    /// Where the cache rows live.
    pub(crate) fn device(&self) -> Device {
        match &self.rows {
            CacheRows::Host(_) => Device::Cpu,
            CacheRows::Device(d) => Device::Cuda(d.device().ordinal()),
        }
    }

    /// The GPU holding the cache rows, if any.
    fn gpu(&self) -> Option<&Arc<CudaDevice>> {
        match &self.rows {
            CacheRows::Host(_) => None,
            CacheRows::Device(d) => Some(d.device()),
        }
    }

    /// The replacement policy.
    pub(crate) fn policy(&self) -> CachePolicy {
        self.policy
    }

    /// Bytes held by the cache buffers (scratch included; in host or GPU memory) and the
    /// directories (host memory).
    pub(crate) fn allocated_bytes(&self) -> usize {
        let rows = match &self.rows {
            CacheRows::Host(h) => h.allocated_bytes(),
            CacheRows::Device(d) => d.allocated_bytes(),
        };
        rows + self.dirs.iter().map(Directory::bytes).sum::<usize>()
            + self.device_dir.as_ref().map_or(0, DeviceDirectory::bytes)
            + self.store.log_host_bytes()
    }

    /// The counters of every table.
    pub(crate) fn stats(&self) -> Vec<CacheStats> {
        self.stats.clone()
    }

    /// Zeroes the counters.
    pub(crate) fn reset_stats(&mut self) {
        for s in &mut self.stats {
            s.reset();
        }
        self.times = CacheTimes::default();
    }

    /// Where the admissions' time went.
    pub(crate) fn times(&self) -> CacheTimes {
        self.times
    }

    /// Slots locked by in-flight batches, per table.
    pub(crate) fn locked_slots(&mut self) -> Result<Vec<usize>> {
        self.on_host()?;
        Ok(self.dirs.iter().map(Directory::locked_slots).collect())
    }

    /// Why the cache is unusable, if it is: "after a failed admission (…)", or what else lost
    /// its rows.
    pub(crate) fn poisoned(&self) -> Option<&str> {
        self.poisoned.as_deref()
    }

    /// Makes the cache unusable, saying why (a phrase such as "after …"), until a checkpoint
    /// is loaded (a load undone after the cache's own rows were lost).
    pub(crate) fn poison(&mut self, why: String) {
        self.poisoned = Some(why);
    }

    /// Refuses a batch this cache cannot run: the cache unusable, or the batch admitted
    /// before the cache was moved, emptied or reloaded (its direct reads hold no lock, so
    /// such a batch may outlive [`check_idle`](Self::check_idle)).
    pub(crate) fn check_admitted(&self, batch: &CachedBatch) -> Result<()> {
        self.check_usable()?;
        if batch.generation != self.generation {
            return Err(Error::invalid(
                OP,
                "the batch was admitted before the cache was moved, emptied or reloaded; \
                 prepare it again",
            ));
        }
        Ok(())
    }

    /// Refuses when the cache is unusable (a failed admission, lost rows).
    fn check_usable(&self) -> Result<()> {
        match &self.poisoned {
            None => Ok(()),
            Some(why) => Err(Error::invalid(
                OP,
                format!("the cache is unusable {why}; load a checkpoint to continue"),
            )),
        }
    }

    /// Makes the host directories the current ones (copied back from the GPU when the
    /// device directory was).
    fn on_host(&mut self) -> Result<()> {
        if self.home == Home::Device {
            let d = (self.device_dir.as_mut()).expect("a device home has a device directory");
            d.pull(&mut self.dirs)?;
            self.home = Home::Host;
        }
        Ok(())
    }

    /// Makes the device directory the current one (copied from the host's when they were);
    /// false without one.
    fn on_device(&mut self) -> Result<bool> {
        let Some(d) = self.device_dir.as_mut() else {
            return Ok(false);
        };
        if self.home == Home::Host {
            d.push(&self.dirs)?;
            self.home = Home::Device;
        }
        Ok(true)
    }

    /// Per table, the slots of `locks` (read back from the GPU for a device lease).
    fn locks_by_table(&self, locks: &Locks) -> Result<Vec<Vec<usize>>> {
        match locks {
            Locks::Host(per_table) => Ok(per_table.clone()),
            Locks::Device(slots, n) => {
                let d = (self.device_dir.as_ref()).expect("a device lease has a device directory");
                let mut global = vec![0i64; *n];
                d.device()
                    .read_bytes(slots, 0, bytemuck::cast_slice_mut(&mut global))?;
                let mut per_table = vec![Vec::new(); self.dirs.len()];
                for s in global {
                    let (t, local) = d.local(s as usize);
                    per_table[t].push(local);
                }
                Ok(per_table)
            }
        }
    }

    /// Applies `op` (the device directory's unlock or mark_dirty) to the slots of `locks` on
    /// the GPU (a host lease's slots copied up first).
    fn on_device_slots(
        &mut self,
        locks: &Locks,
        op: fn(&mut DeviceDirectory, &DeviceBuffer<i64>, usize) -> Result<()>,
    ) -> Result<()> {
        let d = (self.device_dir.as_mut()).expect("a device home has a device directory");
        match locks {
            Locks::Device(slots, n) => {
                // Allocated on the stream that admitted the batch, perhaps not this one.
                slots.note_stream(d.device().current_stream_id());
                op(d, slots, *n)
            }
            Locks::Host(per_table) => {
                let slots = (per_table.iter().enumerate())
                    .flat_map(|(t, ss)| ss.iter().map(move |&s| (t, s)));
                match d.upload_slots(slots)? {
                    Some((slots, n)) => op(d, &slots, n),
                    None => Ok(()),
                }
            }
        }
    }

    /// Floats of table `t`'s cache rows: weights, state 0, state 1.
    fn lens(&self, t: usize) -> [usize; 3] {
        let (rows, p) = (self.cfg.tables[t].rows, self.parts[t]);
        [rows * p.dim, rows * p.state[0], rows * p.state[1]]
    }

    /// Every table's share of the cache, the file, the directories and the counters (a GPU
    /// cache's rows are not in host memory: its views have empty rows and defer their moves).
    fn views(&mut self) -> Vec<TableView<'_>> {
        let n = self.dirs.len();
        let on_host = matches!(self.rows, CacheRows::Host(_));
        let lens: Vec<[usize; 3]> = (0..n)
            .map(|t| if on_host { self.lens(t) } else { [0; 3] })
            .collect();
        let (mut w, mut a, mut b): (&mut [f32], &mut [f32], &mut [f32]) = match &mut self.rows {
            CacheRows::Host(HostTables { weights, m1, m2 }) => (weights, m1, m2),
            CacheRows::Device(_) => (&mut [], &mut [], &mut []),
        };
        let mut files = self.store.tables_mut().into_iter();
        let mut views = Vec::with_capacity(n);
        for (((t, dir), stats), len) in (0..n).zip(&mut self.dirs).zip(&mut self.stats).zip(&lens) {
            let (wt, rest) = std::mem::take(&mut w).split_at_mut(len[0]);
            w = rest;
            let (at, rest) = std::mem::take(&mut a).split_at_mut(len[1]);
            a = rest;
            let (bt, rest) = std::mem::take(&mut b).split_at_mut(len[2]);
            b = rest;
            let ft = files.next().expect("a file part per table");
            views.push(TableView {
                parts: self.parts[t],
                weights: wt,
                state: [at, bt],
                file: ft,
                dir,
                stats,
                defer: !on_host,
            });
        }
        views
    }

    /// Element offsets of every table's first cache row in the weights and the two state
    /// buffers.
    fn starts(&self) -> Vec<[usize; 3]> {
        let mut at = [0usize; 3];
        (0..self.dirs.len())
            .map(|t| {
                let start = at;
                for (a, l) in at.iter_mut().zip(self.lens(t)) {
                    *a += l;
                }
                start
            })
            .collect()
    }

    /// Where the records of cache rows `rows` ((table, cache row) pairs) sit in the buffers.
    fn record_at(&self, starts: &[[usize; 3]], rows: &[(usize, usize)]) -> Vec<RecordAt> {
        (rows.iter())
            .map(|&(t, idx)| {
                let (p, s) = (self.parts[t], starts[t]);
                RecordAt {
                    weights: (s[0] + idx * p.dim, p.dim),
                    state: [0, 1].map(|i| (s[i + 1] + idx * p.state[i], p.state[i])),
                }
            })
            .collect()
    }

    /// The records (weights, then state) of cache rows `rows`, back to back.
    fn take(&self, rows: &[(usize, usize)]) -> Result<Vec<f32>> {
        let at = self.record_at(&self.starts(), rows);
        match &self.rows {
            CacheRows::Host(h) => {
                let mut out = Vec::with_capacity(at.iter().map(RecordAt::len).sum());
                for r in &at {
                    out.extend_from_slice(&h.weights[r.weights.0..][..r.weights.1]);
                    out.extend_from_slice(&h.m1[r.state[0].0..][..r.state[0].1]);
                    out.extend_from_slice(&h.m2[r.state[1].0..][..r.state[1].1]);
                }
                Ok(out)
            }
            CacheRows::Device(d) => {
                self.after_moves()?;
                d.take_records(&at)
            }
        }
    }

    /// A GPU cache: makes the calling thread's stream wait for the last writes to the cache
    /// rows outside a batch's own slots, and the releases on the host (`moves_done`), perhaps
    /// queued on another stream.
    fn after_moves(&self) -> Result<()> {
        match (&self.moves_done, self.gpu()) {
            (Some(done), Some(d)) => d.wait_event(done),
            _ => Ok(()),
        }
    }

    /// A GPU cache: the calling thread's stream, having waited for the previous fence
    /// ([`after_moves`](Self::after_moves)), becomes the one later moves and admissions wait
    /// for, from its current point.
    fn fence(&mut self) -> Result<()> {
        if let Some(d) = self.gpu().cloned() {
            self.after_moves()?;
            self.moves_done = Some(d.record_marker()?);
        }
        Ok(())
    }

    /// Writes `records` (back to back, as [`take`](Self::take) gives them) into cache rows
    /// `rows`.
    fn put(&mut self, rows: &[(usize, usize)], records: &[f32]) -> Result<()> {
        let at = self.record_at(&self.starts(), rows);
        match &mut self.rows {
            CacheRows::Host(h) => {
                let mut rec = records;
                for r in &at {
                    let copy = |dst: &mut [f32], (start, len): (usize, usize), rec: &mut &[f32]| {
                        dst[start..start + len].copy_from_slice(&rec[..len]);
                        *rec = &rec[len..];
                    };
                    copy(&mut h.weights, r.weights, &mut rec);
                    copy(&mut h.m1, r.state[0], &mut rec);
                    copy(&mut h.m2, r.state[1], &mut rec);
                }
                Ok(())
            }
            CacheRows::Device(_) => {
                self.after_moves()?;
                let CacheRows::Device(d) = &mut self.rows else {
                    unreachable!("matched above");
                };
                d.put_records(&at, records)?;
                // Perhaps into slots of other batches (a direct read's row cached since):
                // later moves on another stream wait for it.
                self.fence()
            }
        }
    }

    /// Reads row `row` of table `t` from the file into `rec` (counted).
    fn read_row(&mut self, t: usize, row: u64, rec: &mut [f32]) {
        self.store.read_rows(t, row as usize, rec);
        self.stats[t].rows_read += 1;
    }

    /// Writes `rec` as row `row` of table `t` in the file (counted).
    fn write_row(&mut self, t: usize, row: u64, rec: &[f32]) {
        self.store.write_rows(t, row as usize, rec);
        self.stats[t].rows_written += 1;
    }

    /// Releases the locks of dropped batches.
    pub(crate) fn drain_released(&mut self) -> Result<()> {
        self.drain_released_before(u64::MAX)
    }

    /// What an admission releases first: every dropped batch on the host; on a GPU, those
    /// admitted before the last admission. The batch admitted last stays locked through this
    /// admission even if dropped, so that the admission need not wait for its backward (the
    /// release waits for it): a pipeline prefetching batch `i + 1` once batch `i`'s backward
    /// is queued overlaps the two also when batch `i` is dropped first (as a training step
    /// drops its graph). The choice depends only on the order of the calls, never on timing.
    fn drain_for_admission(&mut self) -> Result<()> {
        match self.gpu() {
            Some(_) => self.drain_released_before(self.tick),
            None => self.drain_released(),
        }
    }

    /// Releases the locks of the dropped batches admitted before tick `tick`; the others stay
    /// locked (listed as released) until a later drain.
    fn drain_released_before(&mut self, tick: u64) -> Result<()> {
        let released = {
            let mut list = self.released.lock();
            let (now, later): (Vec<Released>, Vec<Released>) = std::mem::take(&mut *list)
                .into_iter()
                .partition(|r| r.2 < tick);
            *list = later;
            now
        };
        if released.is_empty() {
            return Ok(());
        }
        // Taken off the list: a release that stops part-way leaves slots locked for good.
        let done = self.release(&released);
        if let Err(e) = &done {
            self.poisoned = Some(format!("after a failed release of finished batches ({e})"));
        }
        done
    }

    /// Unlocks the slots of `released` batches.
    fn release(&mut self, released: &[Released]) -> Result<()> {
        #[cfg(test)]
        if FAIL_RELEASE.with(|f| f.replace(false)) {
            return Err(Error::invalid(OP, "a failure made by a test"));
        }
        // A GPU cache: what comes next on this stream (the unlocks, the admission's moves over
        // the slots they free) waits for the batches' last lookups and backwards, wherever
        // they were queued.
        if let Some(d) = self.gpu() {
            for event in released.iter().filter_map(|(_, e, _)| e.as_ref()) {
                d.wait_event(event)?;
            }
        }
        if self.home == Home::Device {
            for (locks, _, _) in released {
                self.on_device_slots(locks, DeviceDirectory::unlock)?;
            }
            return Ok(());
        }
        // Unlocked on the host at once: moves on another stream into the slots freed wait
        // for the batches' work (waited for above) through the fence.
        self.fence()?;
        let released = (released.iter())
            .map(|(l, _, _)| self.locks_by_table(l))
            .collect::<Result<Vec<_>>>()?;
        (self.dirs.par_iter_mut().enumerate()).for_each(|(t, dir)| {
            for lease in &released {
                for &s in &lease[t] {
                    dir.unlock(s);
                }
            }
        });
        Ok(())
    }

    /// Admits a validated batch: caches (and locks) its rows and gives its ids as cache rows.
    /// Tables are admitted in parallel.
    pub(crate) fn admit(&mut self, logical: &TbeConfig, batch: &Batch<'_>) -> Result<CachedBatch> {
        let start = std::time::Instant::now();
        let admitted = self.admit_timed(logical, batch);
        self.times.admission += start.elapsed();
        admitted
    }

    fn admit_timed(&mut self, logical: &TbeConfig, batch: &Batch<'_>) -> Result<CachedBatch> {
        self.store.check_len()?;
        self.check_usable()?;
        if let Some(k) = (self.prefetched.iter())
            .position(|(ids, offsets, _)| *offsets == batch.offsets && same_ids(ids, &batch.ids))
        {
            // Prefetched: its rows are cached and locked already; the weights are this batch's.
            let (_, _, mut admitted) = self.prefetched.remove(k).expect("a queued admission");
            let ranges =
                TablePositions::new(&logical.feature_table_map, logical.tables.len(), batch);
            for (t, stats) in self.stats.iter_mut().enumerate() {
                if ranges.read(t) {
                    stats.prefetched += 1;
                }
            }
            admitted.remapped.weights = batch.weights.clone().map(|w| w.into_owned().into());
            admitted.remapped.kept = batch.kept.clone();
            if let Some(d) = self.gpu() {
                // Admitted on the prefetch stream: this stream's work on the batch comes after
                // that stream's.
                if let Some(ready) = admitted.ready.take() {
                    d.wait_event(&ready)?;
                }
                admitted.used_here(d);
            }
            // The GPU copy's weights are this batch's too.
            if let Some(on_device) = admitted.on_device.as_mut() {
                on_device.set_weights(batch.weights.as_deref())?;
            }
            return Ok(admitted);
        }
        let ranges = TablePositions::new(&logical.feature_table_map, logical.tables.len(), batch);
        if self
            .device_dir
            .as_ref()
            .is_some_and(|d| d.fits(batch.ids.len()))
        {
            return self.admit_on_device(logical, batch, &ranges);
        }
        self.on_host()?;
        self.drain_for_admission()?;
        self.tick += 1;
        let tick = self.tick;
        let t0 = std::time::Instant::now();
        let admitted: Vec<Option<TableAdmission>> = self
            .views()
            .into_par_iter()
            .enumerate()
            .map(|(t, mut view)| {
                ranges
                    .read(t)
                    .then(|| view.admit(&ranges.ids(t, batch), tick))
            })
            .collect();
        self.times.directory += t0.elapsed();
        let mut remapped = vec![0i64; batch.ids.len()];
        let mut locked = vec![Vec::new(); logical.tables.len()];
        let mut fallback = Vec::new();
        let mut fallbacks = vec![0; logical.tables.len()];
        let mut moves = vec![Vec::new(); logical.tables.len()];
        ranges.place(&admitted, &mut remapped);
        for (t, a) in admitted.into_iter().enumerate() {
            let Some(a) = a else { continue };
            moves[t] = a.moves;
            locked[t] = a.locked;
            fallbacks[t] = a.fallback.len();
            fallback.extend((a.fallback.into_iter()).map(|(row, pos)| Fallback {
                table: t,
                row,
                pos,
            }));
        }
        let lease = Lease {
            locked: Locks::Host(locked),
            fallback,
            last_use: Mutex::new(None),
            tick,
            released: self.released.clone(),
        };
        // A host cache made its moves while admitting; a GPU cache's are deferred to here.
        let moves = self.gpu().is_some().then_some(moves);
        self.finish_admission(logical, batch, lease, &fallbacks, moves, remapped, None)
    }

    /// The end of an admission made by either directory, its locks in `lease` (dropping it
    /// on an error releases them): room for `fallbacks[t]` direct reads of each table, the
    /// `moves` left to the host (if any), and the batch with its ids as cache rows — `ids`,
    /// or, when they are on the GPU already, `on_device` (a GPU cache's batch otherwise goes
    /// up here).
    #[allow(clippy::too_many_arguments)]
    fn finish_admission(
        &mut self,
        logical: &TbeConfig,
        batch: &Batch<'_>,
        lease: Lease,
        fallbacks: &[usize],
        moves: Option<Vec<Vec<Move>>>,
        ids: Vec<i64>,
        on_device: Option<DeviceBatch>,
    ) -> Result<CachedBatch> {
        // The moves first: the directory holds them already, so a failure from here on
        // (scratch rows that cannot grow, an upload) leaves the cache whole. Moves made in
        // part leave slots that disagree with it: unusable until a load.
        if let Some(moves) = moves {
            if let Err(e) = self.apply_moves(&moves) {
                self.poisoned = Some(format!("after a failed admission ({e})"));
                return Err(e);
            }
        }
        for (t, &n) in fallbacks.iter().enumerate() {
            if n > self.scratch[t] {
                self.grow_scratch(logical, t, n)?;
            }
        }
        let remapped = Batch {
            ids: Ids::I64(ids.into()),
            offsets: batch.offsets.clone(),
            weights: batch.weights.clone().map(|w| w.into_owned().into()),
            batch_size: batch.batch_size,
            num_features: batch.num_features,
            kept: batch.kept.clone(),
        };
        let on_device = match (on_device, self.gpu()) {
            (Some(b), _) => Some(b),
            (None, Some(d)) => {
                let t0 = std::time::Instant::now();
                let uploaded = DeviceBatch::upload(d, &remapped)?;
                self.times.transfer += t0.elapsed();
                Some(uploaded)
            }
            (None, None) => None,
        };
        Ok(CachedBatch {
            remapped,
            generation: self.generation,
            on_device,
            lease,
            ready: None,
        })
    }

    /// Admits a validated batch with the device directory: its ids go up as they are and
    /// become cache rows on the GPU; the moves and direct reads come back to the host.
    fn admit_on_device(
        &mut self,
        logical: &TbeConfig,
        batch: &Batch<'_>,
        ranges: &TablePositions,
    ) -> Result<CachedBatch> {
        // After the host's writes into the cache rows, wherever queued.
        self.after_moves()?;
        self.on_device()?;
        self.drain_for_admission()?;
        self.tick += 1;
        let tick = self.tick;
        let device = self.gpu().expect("a device directory has a GPU").clone();
        if let Some(start @ None) = &mut self.span_start {
            // A prefetch's span starts where the stream has met every wait for other streams
            // (the directory's too, queued here first), not where it began waiting.
            (self.device_dir.as_ref().expect("admitting on the device")).wait_for_last()?;
            *start = Some(device.record_event()?);
        }
        let t0 = std::time::Instant::now();
        let mut on_device = DeviceBatch::upload(&device, batch)?;
        self.times.transfer += t0.elapsed();
        let t0 = std::time::Instant::now();
        let starts = self.starts();
        let in_place = match (&self.mapped, &self.rows) {
            (Some(host), CacheRows::Device(d)) => Some(device_directory::MovesInPlace::Records {
                buffers: d.record_buffers(),
                host,
                host_first: (0..self.parts.len())
                    .map(|t| (self.store.table(t).offset / 4) as i64)
                    .collect(),
                part_start: starts.iter().flatten().map(|&x| x as i64).collect(),
                part_len: (self.parts.iter())
                    .flat_map(|p| [p.dim, p.state[0], p.state[1]])
                    .map(|x| x as i64)
                    .collect(),
            }),
            _ => None,
        };
        let moved = in_place.is_some();
        let dir = self.device_dir.as_mut().expect("admitting on the device");
        // Nothing has changed before the directory kernels (a failed upload, a GPU short of
        // memory). From them until the lease holds their locks, a failure leaves rows locked
        // and installed that no lease or move accounts for: the cache is then unusable. After,
        // a failure drops the lease, whose locks the next admission releases.
        let decided = (dir.admit(&mut on_device, tick, in_place.as_ref())).and_then(|a| {
            let host_moves = (!moved).then(|| a.moves(self.dirs.len())).transpose()?;
            Ok((a, host_moves))
        });
        let (a, host_moves) = match decided {
            Ok(decided) => decided,
            Err(e) => {
                self.poisoned = Some(format!("after a failed admission ({e})"));
                return Err(e);
            }
        };
        self.times.directory += a.decided;
        self.times.file += a.moved;
        self.times.transfer += t0.elapsed() - a.decided - a.moved;
        add_device_counts(&mut self.stats, &a.counts, ranges);
        if moved {
            for (stats, &[_, installed, _, _, written]) in self.stats.iter_mut().zip(&a.counts) {
                stats.rows_read += installed;
                stats.rows_written += written;
            }
        }
        let mut fallbacks = vec![0; logical.tables.len()];
        let fallback = (a.direct.iter())
            .map(|&(table, row, pos)| {
                fallbacks[table] += 1;
                Fallback { table, row, pos }
            })
            .collect();
        let lease = Lease {
            locked: Locks::Device(a.locked, a.locked_len),
            fallback,
            last_use: Mutex::new(None),
            tick,
            released: self.released.clone(),
        };
        // The cache rows are on the device only: the host batch keeps no ids.
        let (ids, on_device) = (Vec::new(), Some(on_device));
        self.finish_admission(
            logical, batch, lease, &fallbacks, host_moves, ids, on_device,
        )
    }

    /// Gives table `t` room for `need` scratch rows (keeping every cached row). A GPU cache's
    /// rows are rearranged on the GPU (no copy of the cache in host memory), once every
    /// stream's work on them is done (a prefetch's admission may run beside a backward), on
    /// the default stream as the buffers they replace (not the prefetch stream's pool, which
    /// would hand their memory out again before the caller's work on them is done when they
    /// are freed). Growing is rare: a batch with more conflict misses than ever before. On an
    /// error nothing has changed.
    fn grow_scratch(&mut self, logical: &TbeConfig, t: usize, need: usize) -> Result<()> {
        let mut scratch = self.scratch.clone();
        scratch[t] = need.max(scratch[t] * 2);
        let gpu = self.gpu().cloned();
        let (cfg, layout, mut rows) = match &gpu {
            None => Self::buffers(logical, &self.dirs, &scratch, None)?,
            Some(d) => {
                d.synchronize()?;
                (d.default_stream())
                    .run(|| Self::buffers(logical, &self.dirs, &scratch, gpu.as_ref()))?
            }
        };
        // In each buffer, every table's slot rows move to the table's new start (scratch rows
        // are working copies, filled at each use): (buffer, from, to, values).
        let mut copies = Vec::new();
        for p in 0..3 {
            let (mut from, mut to) = (0, 0);
            for u in 0..self.dirs.len() {
                let (part, slots) = (self.parts[u], self.dirs[u].slots());
                copies.push((p, from, to, slots * part.range(p).len()));
                from += self.cfg.tables[u].rows * part.range(p).len();
                to += cfg.tables[u].rows * part.range(p).len();
            }
        }
        match (&self.rows, &mut rows) {
            (CacheRows::Host(old), CacheRows::Host(new)) => {
                let old = [&old.weights, &old.m1, &old.m2];
                let HostTables { weights, m1, m2 } = new;
                let new = [weights, m1, m2];
                for (p, from, to, len) in copies {
                    new[p][to..to + len].copy_from_slice(&old[p][from..from + len]);
                }
            }
            (CacheRows::Device(old), CacheRows::Device(new)) => {
                let d = gpu.as_ref().expect("device rows have a GPU");
                (d.default_stream()).run(|| {
                    (copies.iter()).try_for_each(|&(p, from, to, len)| {
                        new.copy_values_from(old, p, from, to, len)
                    })
                })?;
                // Landed before any stream's work on them.
                d.synchronize()?;
            }
            _ => unreachable!("buffers made where the cache rows are"),
        }
        (self.cfg, self.layout, self.scratch, self.rows) = (cfg, layout, scratch, rows);
        Ok(())
    }

    /// Moves the scratch rows of `fallback` between them and each row's current copy (its
    /// slot if cached, else the file): `into_scratch` fills them (before a forward or
    /// backward); otherwise they go back (after a backward), a cached slot marked dirty.
    fn sync_scratch(&mut self, fallback: &[Fallback], into_scratch: bool) -> Result<()> {
        if fallback.is_empty() {
            return Ok(());
        }
        if into_scratch {
            self.store.check_len()?;
        }
        // Where each row lives now, from the current directory (looked up on the GPU when
        // that one is current: no copy of the whole directory).
        let current: Vec<Option<usize>> = match (self.home, &mut self.device_dir) {
            (Home::Device, Some(d)) => {
                let rows: Vec<(usize, u64)> = fallback.iter().map(|f| (f.table, f.row)).collect();
                d.find(&rows)?
            }
            _ => (fallback.iter())
                .map(|f| self.dirs[f.table].find(f.row))
                .collect(),
        };
        let scratch_rows: Vec<(usize, usize)> = fallback.iter().map(|f| (f.table, f.pos)).collect();
        let cached: Vec<(usize, usize)> = (fallback.iter().zip(&current))
            .filter_map(|(f, s)| Some((f.table, (*s)?)))
            .collect();
        if into_scratch {
            let from_slots = self.take(&cached)?;
            let mut from_slots = from_slots.as_slice();
            let mut records = Vec::new();
            for (f, s) in fallback.iter().zip(&current) {
                let n = self.parts[f.table].record();
                let at = records.len();
                records.resize(at + n, 0.0);
                match s {
                    Some(_) => {
                        records[at..].copy_from_slice(&from_slots[..n]);
                        from_slots = &from_slots[n..];
                    }
                    None => self.read_row(f.table, f.row, &mut records[at..]),
                }
            }
            self.put(&scratch_rows, &records)
        } else {
            let records = self.take(&scratch_rows)?;
            let mut rec = records.as_slice();
            let mut to_slots = Vec::new();
            for (f, s) in fallback.iter().zip(&current) {
                let (this, rest) = rec.split_at(self.parts[f.table].record());
                rec = rest;
                match s {
                    Some(_) => to_slots.extend_from_slice(this),
                    None => self.write_row(f.table, f.row, this),
                }
            }
            self.put(&cached, &to_slots)?;
            match (self.home, &mut self.device_dir) {
                (Home::Device, Some(d)) => d.set_dirty(&cached),
                _ => {
                    for &(t, s) in &cached {
                        self.dirs[t].set_dirty(s, true);
                    }
                    Ok(())
                }
            }
        }
    }

    /// The lookup of an admitted batch into `out` (a host cache).
    pub(crate) fn forward_into(&mut self, batch: &CachedBatch, out: &mut [f32]) -> Result<()> {
        self.check_admitted(batch)?;
        self.sync_scratch(&batch.lease.fallback, true)?;
        match &self.rows {
            CacheRows::Host(h) => {
                h.forward_into(&self.cfg, &self.layout, &batch.remapped, out);
                Ok(())
            }
            CacheRows::Device(_) => Err(Error::invalid(
                OP,
                "forward_into reads host tables; this cache lives on a GPU (use lookup)",
            )),
        }
    }

    /// The lookup of an admitted batch (on the cache's device).
    pub(crate) fn forward(&mut self, batch: &CachedBatch) -> Result<Tensor> {
        self.check_admitted(batch)?;
        self.sync_scratch(&batch.lease.fallback, true)?;
        match (&self.rows, &batch.on_device) {
            (CacheRows::Host(h), None) => h.forward(&self.cfg, &self.layout, &batch.remapped),
            (CacheRows::Device(d), Some(on_device)) => {
                let out = d.forward(on_device)?;
                batch.mark_used(d.device())?;
                Ok(out)
            }
            _ => Err(super::moved_error()),
        }
    }

    /// After a backward's kernel: with a fused update (`updated`), the updated rows marked
    /// dirty and the scratch rows written back where their rows live now; on a GPU, the
    /// batch's slots released only after this point of the stream. A failure leaves updates
    /// no write-back will find, or slots a move may take while the kernel still runs: the
    /// cache is then unusable.
    fn after_backward(&mut self, batch: &CachedBatch, updated: bool) -> Result<()> {
        let done = (|| {
            #[cfg(test)]
            if FAIL_WRITE_BACK.with(|f| f.replace(false)) {
                return Err(Error::invalid(OP, "a failure made by a test"));
            }
            if updated {
                self.mark_dirty(batch)?;
                self.sync_scratch(&batch.lease.fallback, false)?;
            }
            match self.gpu() {
                Some(d) => batch.mark_used(d),
                None => Ok(()),
            }
        })();
        if let Err(e) = &done {
            self.poisoned = Some(format!("after a failed write-back of a backward ({e})"));
        }
        done
    }

    /// Marks the slots of an admitted batch dirty (its backward updated them).
    fn mark_dirty(&mut self, batch: &CachedBatch) -> Result<()> {
        if self.home == Home::Device {
            return self.on_device_slots(&batch.lease.locked, DeviceDirectory::mark_dirty);
        }
        let downloaded;
        let per_table = match &batch.lease.locked {
            Locks::Host(per_table) => per_table,
            locks => {
                downloaded = self.locks_by_table(locks)?;
                &downloaded
            }
        };
        for (dir, locked) in self.dirs.iter_mut().zip(per_table) {
            for &s in locked {
                dir.set_dirty(s, true);
            }
        }
        Ok(())
    }

    /// Table `t`'s cache rows `idx` as the table rows they hold for a batch whose direct reads
    /// are `fallback`, each with its position in `idx`, sorted by table row.
    fn by_table_row(
        &self,
        t: usize,
        idx: impl Iterator<Item = usize>,
        fallback: &[Fallback],
    ) -> Result<Vec<(i64, usize)>> {
        let slots = self.dirs[t].slots();
        // The rows in the slots, from the current directory.
        let device_tags = match (self.home, &self.device_dir) {
            (Home::Device, Some(d)) => Some(d.tags_of(t)?),
            _ => None,
        };
        let row_of = |i: usize| match &device_tags {
            Some(tags) => Some(tags[i]).filter(|&r| r != u64::MAX),
            None => self.dirs[t].row_of(i),
        };
        // Scratch row → the row it serves.
        let mut scratch = vec![0u64; self.scratch[t]];
        for f in fallback.iter().filter(|f| f.table == t) {
            scratch[f.pos - slots] = f.row;
        }
        let mut order: Vec<(i64, usize)> = (idx.enumerate())
            .map(|(k, i)| {
                let row = match i < slots {
                    true => row_of(i).expect("a locked slot holds its row"),
                    false => scratch[i - slots],
                };
                (row as i64, k)
            })
            .collect();
        order.sort_unstable();
        Ok(order)
    }

    /// The fused backward of an admitted batch on a host cache; sparse gradients come back
    /// in table rows.
    pub(crate) fn backward(
        &mut self,
        batch: &CachedBatch,
        grad_output: &[f32],
        optimizer: &FusedOptimizer,
        step: u64,
    ) -> Result<BackwardOutput> {
        self.check_admitted(batch)?;
        let fallback = &batch.lease.fallback;
        // Checked once, before anything changes: the write-back after the kernel cannot fail.
        self.store.check_len()?;
        self.sync_scratch(fallback, true)?;
        let CacheRows::Host(host) = &mut self.rows else {
            return Err(super::moved_error());
        };
        let mut out = host.backward(
            &self.cfg,
            &self.layout,
            &batch.remapped,
            grad_output,
            optimizer,
            step,
        );
        self.after_backward(batch, *optimizer != FusedOptimizer::None)?;
        if let Some(grads) = out.sparse_grads.as_mut() {
            // One per table read by a feature, in table order; rows are cache rows.
            let mut read: Vec<usize> = self.cfg.feature_table_map.clone();
            read.sort_unstable();
            read.dedup();
            for (g, &t) in grads.iter_mut().zip(&read) {
                let dim = g.dim;
                let order = self.by_table_row(t, g.rows.iter().map(|&i| i as usize), fallback)?;
                let mut values = Vec::with_capacity(g.values.len());
                for &(_, k) in &order {
                    values.extend_from_slice(&g.values[k * dim..(k + 1) * dim]);
                }
                g.rows = order.iter().map(|&(r, _)| r).collect();
                g.values = values;
            }
        }
        Ok(out)
    }

    /// Writes every dirty cached row back to the file and syncs it.
    pub(crate) fn flush(&mut self) -> Result<()> {
        self.store.check_len()?;
        self.check_usable()?;
        self.on_host()?;
        let dirty: Vec<(usize, usize, u64)> = (self.dirs.iter().enumerate())
            .flat_map(|(t, d)| {
                (d.occupied())
                    .filter(|&(s, _)| d.is_dirty(s))
                    .map(move |(s, r)| (t, s, r))
            })
            .collect();
        let slots: Vec<(usize, usize)> = dirty.iter().map(|&(t, s, _)| (t, s)).collect();
        let records = self.take(&slots)?;
        let mut rec = records.as_slice();
        for &(t, s, r) in &dirty {
            let (this, rest) = rec.split_at(self.parts[t].record());
            rec = rest;
            self.write_row(t, r, this);
            self.dirs[t].set_dirty(s, false);
        }
        self.store.sync()
    }

    /// Part `p` (0 weights, 1/2 optimizer state) of every row of table `t`, in row order.
    pub(crate) fn read_part(&self, t: usize, p: usize) -> Result<Vec<f32>> {
        self.read_part_rows(t, p, 0..self.store.table(t).rows)
    }

    /// Part `p` of rows `rows` of table `t` (in range: checked by the caller), in row order:
    /// the file's copy, or the cache's where the row is cached.
    pub(crate) fn read_part_rows(
        &self,
        t: usize,
        p: usize,
        rows: std::ops::Range<usize>,
    ) -> Result<Vec<f32>> {
        let mut out = Vec::with_capacity(rows.len() * self.parts[t].range(p).len());
        // About 1 MiB of records read at a time.
        let chunk = (1 << 20) / self.parts[t].record().max(1) + 1;
        self.read_part_chunks(t, p, rows, chunk, |_, values| {
            out.extend_from_slice(values);
            Ok(())
        })?;
        Ok(out)
    }

    /// Calls `f(first, values)` with part `p` of rows `rows` of table `t` (in range: checked
    /// by the caller), `chunk_rows` at a time (`values`: rows `first..`, row order), every row
    /// once, in order: the file's copy, or the cache's where the row is cached. The cache's
    /// directory is read once, not per chunk.
    pub(crate) fn read_part_chunks(
        &self,
        t: usize,
        p: usize,
        rows: std::ops::Range<usize>,
        chunk_rows: usize,
        mut f: impl FnMut(usize, &[f32]) -> Result<()>,
    ) -> Result<()> {
        self.store.check_len()?;
        self.check_usable()?;
        let parts = self.parts[t];
        let (rec, width) = (parts.record(), parts.range(p).len());
        let chunk = chunk_rows.max(1);
        // The cached rows in the range, in row order: their slots hold the current copies.
        let occupied = match (self.home, &self.device_dir) {
            (Home::Device, Some(d)) => d.occupied(t)?,
            _ => self.dirs[t].occupied().collect(),
        };
        let wanted = rows.start as u64..rows.end as u64;
        let mut occupied: Vec<(usize, u64)> = (occupied.into_iter())
            .filter(|(_, r)| wanted.contains(r))
            .collect();
        occupied.sort_unstable_by_key(|&(_, r)| r);
        let (mut buf, mut out) = (Vec::new(), Vec::new());
        let mut next = 0;
        for first in rows.clone().step_by(chunk) {
            let end = (first + chunk).min(rows.end);
            buf.resize((end - first) * rec, 0.0);
            self.store.read_rows(t, first, &mut buf);
            out.clear();
            for r in buf.chunks(rec.max(1)) {
                out.extend_from_slice(&r[parts.range(p)]);
            }
            let from = next;
            while next < occupied.len() && occupied[next].1 < end as u64 {
                next += 1;
            }
            let these = &occupied[from..next];
            let slots: Vec<(usize, usize)> = these.iter().map(|&(s, _)| (t, s)).collect();
            let records = self.take(&slots)?;
            for (&(_, r), record) in these.iter().zip(records.chunks(rec.max(1))) {
                let r = r as usize - first;
                out[r * width..(r + 1) * width].copy_from_slice(&record[parts.range(p)]);
            }
            f(first, &out)?;
        }
        Ok(())
    }

    /// Overwrites part `p` of table `t` with `values` (every row, row order, checked by the
    /// caller), in the file and in the cache.
    pub(crate) fn write_part(&mut self, t: usize, p: usize, values: &[f32]) -> Result<()> {
        self.modify_part(t, p, |offset, chunk| {
            chunk.copy_from_slice(&values[offset..offset + chunk.len()]);
            Ok(())
        })
    }

    /// Rewrites part `p` of table `t` chunk by chunk, in row order: `fill(offset, values)`
    /// overwrites the part's elements `offset..offset + values.len()`.
    pub(crate) fn modify_part(
        &mut self,
        t: usize,
        p: usize,
        mut fill: impl FnMut(usize, &mut [f32]) -> Result<()>,
    ) -> Result<()> {
        self.store.check_len()?;
        self.check_usable()?;
        self.on_host()?;
        let parts = self.parts[t];
        let rows = self.store.table(t).rows;
        let (rec, width) = (parts.record(), parts.range(p).len());
        let chunk = (1 << 20) / rec.max(1) + 1;
        let mut buf = vec![0.0f32; chunk * rec];
        let mut part = vec![0.0f32; chunk * width];
        let mut first = 0;
        while first < rows {
            let n = chunk.min(rows - first);
            self.store.read_rows(t, first, &mut buf[..n * rec]);
            let part = &mut part[..n * width];
            fill(first * width, part)?;
            for (r, v) in buf[..n * rec]
                .chunks_mut(rec)
                .zip(part.chunks(width.max(1)))
            {
                r[parts.range(p)].copy_from_slice(v);
            }
            self.store.write_rows(t, first, &buf[..n * rec]);
            // Cached copies of these rows take the new values too.
            let cached: Vec<(usize, u64)> = (self.dirs[t].occupied())
                .filter(|&(_, r)| (first..first + n).contains(&(r as usize)))
                .collect();
            let slots: Vec<(usize, usize)> = cached.iter().map(|&(s, _)| (t, s)).collect();
            let mut records = self.take(&slots)?;
            for (&(_, r), record) in cached.iter().zip(records.chunks_mut(rec.max(1))) {
                let k = r as usize - first;
                record[parts.range(p)].copy_from_slice(&part[k * width..(k + 1) * width]);
            }
            self.put(&slots, &records)?;
            first += n;
        }
        Ok(())
    }

    /// Forgets every cached row without writing it back (after the file was replaced).
    pub(crate) fn invalidate(&mut self, logical: &TbeConfig) -> Result<()> {
        self.check_idle()?;
        let dirs = (self.dirs.iter().zip(&logical.tables))
            .map(|(d, s)| Directory::new(d.sets, s.rows, self.policy))
            .collect::<Result<Vec<_>>>()?;
        self.dirs = dirs;
        // The device directory is stale now; the next admission copies these up.
        self.home = Home::Host;
        // Batches still alive (only after a failed admission: check_idle) release into a
        // list no one drains: their slots are not these directories'.
        self.released = Arc::new(Mutex::new(Vec::new()));
        self.poisoned = None;
        self.generation = new_generation();
        Ok(())
    }

    /// Admits `batch` now and keeps the admission for the admission of the same batch (its
    /// rows stay cached and locked meanwhile); the oldest kept admission beyond
    /// [`MAX_PREFETCHED`] is dropped.
    pub(crate) fn prefetch(&mut self, logical: &TbeConfig, batch: &Batch<'_>) -> Result<()> {
        let admitted = match self.gpu().cloned() {
            Some(_) if !self.prefetch_on_side_stream => self.admit(logical, batch)?,
            None => self.admit(logical, batch)?,
            Some(d) => {
                let stream = match &self.prefetch_stream {
                    Some(s) => s.clone(),
                    None => self.prefetch_stream.insert(d.prefetch_stream()?).clone(),
                };
                stream.run(|| -> Result<CachedBatch> {
                    self.prefetch_span = None;
                    self.span_start = Some(None);
                    let admitted = self.admit(logical, batch);
                    let start = self.span_start.take().flatten();
                    let mut admitted = admitted?;
                    admitted.ready = Some(d.record_marker()?);
                    if let Some(start) = start {
                        self.prefetch_span = Some([start, d.record_event()?]);
                    }
                    // Its work done (the staged moves' copies too) before it returns: no
                    // work of the prefetch stream is ever left in flight (the host waits for
                    // this stream only, the backward goes on).
                    d.synchronize_current()?;
                    Ok(admitted)
                })?
            }
        };
        let ids = (0..batch.ids.len())
            .map(|p| batch.ids.get(p) as i64)
            .collect();
        self.prefetched
            .push_back((ids, batch.offsets.clone(), admitted));
        while self.prefetched.len() > MAX_PREFETCHED {
            self.prefetched.pop_front();
        }
        Ok(())
    }

    /// The timed events bracketing the last prefetch's admission on the prefetch stream, once
    /// (see [`TableBatchedEmbedding::take_prefetch_span`]).
    pub(crate) fn take_prefetch_span(&mut self) -> Option<[DeviceEvent; 2]> {
        self.prefetch_span.take()
    }

    /// Refuses while batches admitted to the cache are alive (their rows are locked).
    /// Prefetched admissions are forgotten first.
    pub(crate) fn check_idle(&mut self) -> Result<()> {
        self.prefetched.clear();
        if self.poisoned.is_some() {
            // The directories are to be rebuilt (invalidate): their locks do not matter.
            return Ok(());
        }
        self.drain_released()?;
        self.on_host()?;
        if self.dirs.iter().any(|d| d.locked_slots() > 0) {
            return Err(Error::invalid(
                OP,
                "batches it admitted are still alive (drop them before a checkpoint load or a move)",
            ));
        }
        Ok(())
    }

    /// The row store.
    pub(crate) fn store(&self) -> &RowStore {
        &self.store
    }
}

/// Whether `ids` holds the same values as `batch`.
fn same_ids(ids: &[i64], batch: &Ids<'_>) -> bool {
    match batch {
        Ids::I64(b) => ids == &b[..],
        Ids::I32(b) => {
            ids.len() == b.len() && ids.iter().zip(b.iter()).all(|(&a, &b)| a == b as i64)
        }
    }
}
