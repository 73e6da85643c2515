//! What configures a cache and what it reports: the replacement policy, the size, the backing
//! store, the placements the planner's kernels ask for, and the counters and times.

use std::path::PathBuf;

use super::{store, OP};
use crate::embedding::tbe::{TableBatchedEmbedding, TbeConfig};
use crate::{Device, Error, Result};

/// Which cached row makes room for a new one.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum CachePolicy {
    /// Least recently used (the row whose last batch is oldest).
    #[default]
    Lru,
    /// Least frequently used (fewest accesses since the TBE was built, counted for every row,
    /// cached or not; ties go to the least recently used).
    Lfu,
}

impl CachePolicy {
    /// `lru` or `lfu` (FBGEMM's `CacheAlgorithm` names in lower case).
    pub fn name(self) -> &'static str {
        match self {
            CachePolicy::Lru => "lru",
            CachePolicy::Lfu => "lfu",
        }
    }

    /// The policy called `name` (`lru` or `lfu`).
    pub fn from_name(name: &str) -> Result<Self> {
        match name {
            "lru" => Ok(CachePolicy::Lru),
            "lfu" => Ok(CachePolicy::Lfu),
            _ => Err(Error::invalid(
                OP,
                format!("unknown cache policy `{name}` (lru or lfu)"),
            )),
        }
    }
}

/// How large the DRAM cache is.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum CacheSize {
    /// A fraction of every table's rows (the planner's `cache_load_factor`, in (0, 1]),
    /// rounded up to whole 32-way sets, at least one set per table.
    LoadFactor(f64),
    /// A byte budget for cached rows, their optimizer state and the directory (24 bytes a
    /// slot), shared among the tables in proportion to their sizes (rounded down to whole
    /// sets, at least one set per table). LFU's access counts (4 bytes per table row) and
    /// scratch rows for conflict misses come on top.
    Bytes(u64),
}

impl CacheSize {
    /// Refuses a load factor outside (0, 1], as plans and the planner do (above 1 would be
    /// more slots than rows; a byte budget is checked against the tables when the cache is
    /// sized).
    pub(crate) fn check(self) -> Result<()> {
        match self {
            CacheSize::LoadFactor(f) if !(f > 0.0 && f <= 1.0) => Err(Error::invalid(
                OP,
                format!(
                    "cache load factor {f} is not in (0, 1] (a fraction of the rows; 1 caches \
                     every row)"
                ),
            )),
            _ => Ok(()),
        }
    }
}

/// The cache of a [`TableBatchedEmbedding`](crate::embedding::TableBatchedEmbedding) whose
/// rows live in a file (or in host memory).
#[derive(Clone, Debug, PartialEq)]
pub struct CacheConfig {
    /// The backing file (created, or replaced, when the TBE is built); empty: the rows live in
    /// anonymous host memory instead ([`in_host_memory`](Self::in_host_memory)).
    pub path: PathBuf,
    /// The cache's size.
    pub size: CacheSize,
    /// The replacement policy.
    pub policy: CachePolicy,
    /// A cache on a GPU: whether `prefetch` admits on the device's prefetch stream, beside
    /// the caller's work (the default), or on the caller's stream, after it.
    pub prefetch_on_side_stream: bool,
    /// A training cache on the host over a file: whether rows written back one at a time are
    /// appended to a write log beside the file (the default; as large as the file, or a half,
    /// a quarter or an eighth of it, the largest in half the disk's free space; unnamed,
    /// folded into the file when full and at every flush), or written in place. The log turns
    /// the page-sized disk writes of scattered records into sequential ones.
    pub write_log: bool,
}

impl CacheConfig {
    /// A cache of `size` over the file `path`, LRU, prefetching on a GPU's prefetch stream.
    pub fn new(path: impl Into<PathBuf>, size: CacheSize) -> Self {
        CacheConfig {
            path: path.into(),
            size,
            policy: CachePolicy::Lru,
            prefetch_on_side_stream: true,
            write_log: true,
        }
    }

    /// A cache of `size` over rows kept in anonymous host memory, not a file, LRU: FBGEMM's
    /// `MANAGED_CACHING` rows for a GPU cache (no page-cache write-back of evicted rows; gone
    /// with the process — checkpoints still write and read row files).
    pub fn in_host_memory(size: CacheSize) -> Self {
        CacheConfig::new(PathBuf::new(), size)
    }

    /// The same cache with `policy`.
    pub fn with_policy(mut self, policy: CachePolicy) -> Self {
        self.policy = policy;
        self
    }

    /// The same cache, prefetching on a GPU's prefetch stream (`true`, the default) or on the
    /// caller's stream (`false`: the admission then runs after the work queued before it,
    /// as a comparison for the overlap).
    pub fn with_prefetch_on_side_stream(mut self, on: bool) -> Self {
        self.prefetch_on_side_stream = on;
        self
    }

    /// The same cache, its write-backs logged beside the file (`true`, the default) or
    /// written in place (`false`: no second file, up to as large as the first, on the disk).
    pub fn with_write_log(mut self, on: bool) -> Self {
        self.write_log = on;
        self
    }
}

/// Where the tables of a collection live (the placement the planner's compute kernel asks
/// for, on a host).
#[derive(Clone, Debug, Default, PartialEq)]
#[non_exhaustive]
pub enum Placement {
    /// In the memory of the device the model runs on (the planner's `fused`).
    #[default]
    Memory,
    /// The planner's `fused_uvm`. For a collection built for a GPU
    /// ([`EmbeddingBagCollection::with_placement_on`](crate::embedding::EmbeddingBagCollection::with_placement_on)
    /// with a CUDA device): in managed (unified) memory once the collection moves there
    /// (`to_device`; built on the host like [`Memory`](Self::Memory)), kept on the host and
    /// read and updated in place by the GPU's kernels (FBGEMM's `MANAGED` placement;
    /// [`TableBatchedEmbedding::new_managed`](crate::embedding::TableBatchedEmbedding::new_managed)).
    /// Built for the host, where memory is one level down: in files under `dir` (empty: host
    /// memory), each behind the smallest cache (one set per table, so almost every row is
    /// read from the file) with `policy`; moved to a GPU later, that cache moves there.
    /// Sharded collections say which with
    /// [`ShardCaches::device`](crate::distributed::ShardCaches).
    Managed {
        /// Directory of the row files on the host (created if needed); empty: host memory.
        dir: PathBuf,
        /// The replacement policy of the host's cache.
        policy: CachePolicy,
    },
    /// In files under `dir` (one per table group), each behind a DRAM cache of `size`
    /// (the planner's `fused_uvm_caching`).
    Cached {
        /// Directory of the row files (created if needed); empty: the rows live in anonymous
        /// host memory ([`CacheConfig::in_host_memory`]).
        dir: PathBuf,
        /// Each group's cache size.
        size: CacheSize,
        /// The replacement policy.
        policy: CachePolicy,
    },
}

impl Placement {
    /// The placement the planner's kernel `kernel` asks for: `dense` and `fused`
    /// [`Memory`](Self::Memory), `fused_uvm` [`Managed`](Self::Managed), `fused_uvm_caching`
    /// [`Cached`](Self::Cached) with its `cache_load_factor` (FBGEMM's default 0.2 when none);
    /// row files under `dir`.
    pub fn for_kernel(
        kernel: &str,
        cache_load_factor: Option<f64>,
        dir: impl Into<PathBuf>,
        policy: CachePolicy,
    ) -> Result<Placement> {
        let size = match kernel {
            "dense" | "fused" => return Ok(Placement::Memory),
            "fused_uvm" => {
                return Ok(Placement::Managed {
                    dir: dir.into(),
                    policy,
                })
            }
            "fused_uvm_caching" => CacheSize::LoadFactor(cache_load_factor.unwrap_or(0.2)),
            _ => {
                return Err(Error::invalid(
                    OP,
                    format!(
                        "no placement for compute kernel `{kernel}` (dense, fused, fused_uvm, \
                         fused_uvm_caching)"
                    ),
                ))
            }
        };
        Ok(Placement::Cached {
            dir: dir.into(),
            size,
            policy,
        })
    }

    /// The TBE of `cfg` this placement makes for a collection that will run on `runs_on`:
    /// in memory on the host; on a GPU, [`Managed`](Self::Managed) tables in managed memory
    /// once moved there; otherwise cached tables in the row file called `name`, their cache
    /// made on `cache_on`.
    pub(crate) fn tbe(
        &self,
        cfg: TbeConfig,
        name: &str,
        runs_on: Device,
        cache_on: Device,
    ) -> Result<TableBatchedEmbedding> {
        if let (Placement::Managed { .. }, Device::Cuda(_)) = (self, runs_on) {
            return TableBatchedEmbedding::new_managed(cfg, Device::Cpu);
        }
        match self.cache_for(name)? {
            None => TableBatchedEmbedding::new(cfg),
            Some(cache) => TableBatchedEmbedding::new_cached_on(cfg, cache, cache_on),
        }
    }

    /// The cache of the group whose row file is called `name`, if cached.
    pub(crate) fn cache_for(&self, name: &str) -> Result<Option<CacheConfig>> {
        match self {
            Placement::Memory => Ok(None),
            Placement::Managed { dir, policy } => Placement::Cached {
                dir: dir.clone(),
                size: CacheSize::LoadFactor(f64::MIN_POSITIVE),
                policy: *policy,
            }
            .cache_for(name),
            Placement::Cached { dir, size, policy } if dir.as_os_str().is_empty() => Ok(Some(
                CacheConfig::in_host_memory(*size).with_policy(*policy),
            )),
            Placement::Cached { dir, size, policy } => {
                std::fs::create_dir_all(dir)
                    .map_err(|e| store::io_error(dir, "creating the row files' directory", e))?;
                Ok(Some(
                    CacheConfig::new(dir.join(name), *size).with_policy(*policy),
                ))
            }
        }
    }
}

/// One table's cache counters, as FBGEMM's cache statistics report them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// The table.
    pub table: String,
    /// Slots of the cache (sets × 32).
    pub slots: usize,
    /// Admissions (batches prepared, looked up or prefetched) that read this table.
    pub calls: u64,
    /// Ids looked up, duplicates included.
    pub requested_ids: u64,
    /// Distinct ids per admission, summed.
    pub unique_ids: u64,
    /// Distinct ids not cached when their admission began, summed.
    pub unique_misses: u64,
    /// Misses that found every way of their set locked by in-flight batches and were served
    /// by direct reads (not cached).
    pub conflict_misses: u64,
    /// Cached rows evicted to make room.
    pub evictions: u64,
    /// Row records read from the file.
    pub rows_read: u64,
    /// Row records written to the file.
    pub rows_written: u64,
    /// Batches reading this table whose admission an earlier
    /// [`prefetch`](crate::embedding::TableBatchedEmbedding::prefetch) had made (their rows
    /// already cached and locked; that prefetch counted the call).
    pub prefetched: u64,
}

impl CacheStats {
    /// Zero counters for table `table`'s cache of `slots` slots.
    pub(crate) fn empty(table: String, slots: usize) -> Self {
        CacheStats {
            table,
            slots,
            ..CacheStats::default()
        }
    }

    /// The counters zeroed (the table and its slots kept).
    pub(crate) fn reset(&mut self) {
        *self = CacheStats::empty(std::mem::take(&mut self.table), self.slots);
    }

    /// `unique_misses / unique_ids` (0 before any lookup).
    pub fn miss_rate(&self) -> f64 {
        if self.unique_ids == 0 {
            0.0
        } else {
            self.unique_misses as f64 / self.unique_ids as f64
        }
    }
}

/// Where a cache's admissions spent their time (wall clock, summed since the operator was
/// built or [`reset_cache_stats`](crate::embedding::TableBatchedEmbedding::reset_cache_stats)
/// was called).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct CacheTimes {
    /// Admissions in all (`prepare`, `forward`, `prefetch`), the parts below included.
    pub admission: std::time::Duration,
    /// Moving rows between the row store (a file, or host memory) and the cache (a GPU
    /// cache: the host's copies to and from the staging buffers, or the GPU's own moves over
    /// rows in mapped host memory; a host cache moves rows while admitting, counted in
    /// `admission` only).
    pub file: std::time::Duration,
    /// Copies between host and GPU (staged rows, the batch's ids, the admission's results)
    /// and the kernels that gather and scatter staged rows (a GPU cache).
    pub transfer: std::time::Duration,
    /// Looking the batch's rows up in the directories and choosing victims (the tables in
    /// parallel; a host cache's row moves included).
    pub directory: std::time::Duration,
}
