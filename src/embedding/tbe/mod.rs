//! [`TableBatchedEmbedding`]: the training TBE. Many FP32 tables in one flat buffer, looked up
//! by many features in one call, with the optimizer fused into backward — in host memory
//! (`cpu/`) or in a CUDA device's memory (`cuda/`), one type either way
//! ([`TableBatchedEmbedding::to_device`]). Inputs are checked by one validation pass on the
//! host ([`validate`](super::input)) whatever the device.

pub(crate) mod cache;
pub(crate) mod cpu;
pub(crate) mod cuda;
pub(crate) mod sort;

use std::sync::atomic::Ordering;
use std::sync::Arc;

use parking_lot::{Mutex, RwLock};
use rand::Rng as _;
use rand_distr::{Distribution, Normal};

use super::config::{BoundsCheckMode, EmbeddingInit, PoolingMode, TableSpec};
use super::input::{validate, with_tensor_input, Batch, FeatureBounds, SkipCounter, TbeInput};
use super::optimizer::{FusedOptimizer, StateShape, WeightDecay};
use crate::tensor::rng::Rng;
use crate::tensor::{record_op_with_state, BackwardOp, Gradient, RowSparseGrad};
use crate::{DType, Device, Error, Result, Tensor};
pub use cache::trace::{planner_cache_stats, MAX_CACHE_STATS_BINS};
pub use cache::{CacheConfig, CachePolicy, CacheSize, CacheStats, CacheTimes, Placement};
use cache::{CachedBatch, CachedTables};
use cpu::backward::{BackwardOutput, SparseTableGrad};
use cpu::pool::FeatureSlot;
use cpu::HostTables;
use cuda::{BackwardInput, DeviceBatch, DeviceTables, FeatureLayout};

/// Everything that defines a [`TableBatchedEmbedding`].
#[derive(Clone, Debug)]
pub struct TbeConfig {
    /// The tables, in the order of the flat buffer.
    pub tables: Vec<TableSpec>,
    /// Table looked up by each feature (several features may share a table).
    pub feature_table_map: Vec<usize>,
    /// Feature names for messages (default `f0`, `f1`, ...).
    pub feature_names: Option<Vec<String>>,
    /// Pooling of every bag.
    pub pooling: PoolingMode,
    /// The optimizer fused into backward.
    pub optimizer: FusedOptimizer,
    /// Weight decay of the fused optimizer.
    pub weight_decay: WeightDecay,
    /// What to do with out-of-range ids.
    pub bounds_check: BoundsCheckMode,
}

impl TbeConfig {
    /// A config with default feature names, no weight decay and erroring bounds checks.
    pub fn new(
        tables: Vec<TableSpec>,
        feature_table_map: Vec<usize>,
        pooling: PoolingMode,
        optimizer: FusedOptimizer,
    ) -> Self {
        TbeConfig {
            tables,
            feature_table_map,
            feature_names: None,
            pooling,
            optimizer,
            weight_decay: WeightDecay::None,
            bounds_check: BoundsCheckMode::Error,
        }
    }

    /// One feature per table, in table order.
    pub fn one_feature_per_table(
        tables: Vec<TableSpec>,
        pooling: PoolingMode,
        optimizer: FusedOptimizer,
    ) -> Self {
        let map = (0..tables.len()).collect();
        TbeConfig::new(tables, map, pooling, optimizer)
    }
}

/// Where the tables and their optimizer state live.
#[allow(clippy::large_enum_variant)] // one per TBE: boxing would buy nothing
pub(crate) enum Tables {
    /// Host memory.
    Host(HostTables),
    /// A CUDA device's memory.
    Device(DeviceTables),
    /// A file, cached in host memory.
    Cached(CachedTables),
}

/// Tables, optimizer state and the step count, behind one lock.
pub(crate) struct TrainState {
    pub tables: Tables,
    /// Tables on a GPU live in managed memory ([`TableBatchedEmbedding::new_managed`]).
    pub managed: bool,
    /// Backward calls so far (Adam's bias correction).
    pub step: u64,
}

/// Where each table and feature sits: the flat buffers' offsets and the output columns.
pub(crate) struct TbeLayout {
    /// Start of each table in the flat weight buffer (elements); one extra entry at the end.
    pub weight_offsets: Vec<usize>,
    /// First row of each table in the flat row numbering; one extra entry at the end.
    pub row_offsets: Vec<usize>,
    /// Per feature: its output columns.
    pub slots: Vec<FeatureSlot>,
    /// Output width: `ΣD` pooled, `D` unpooled.
    pub out_stride: usize,
}

impl TbeLayout {
    /// The layout of `config` (checked by the caller: ≥ 1 table and feature, features map to
    /// tables, one dim for every feature with pooling NONE).
    pub(crate) fn new(config: &TbeConfig) -> Result<TbeLayout> {
        let dims: Vec<usize> = (config.feature_table_map.iter())
            .map(|&t| config.tables[t].dim)
            .collect();
        let mut slots = Vec::with_capacity(dims.len());
        let mut col = 0usize;
        for &dim in &dims {
            slots.push(FeatureSlot { col, dim });
            col = col
                .checked_add(dim)
                .ok_or_else(|| Error::invalid(OP, "the features' dimensions sum past a usize"))?;
        }
        let out_stride = if config.pooling == PoolingMode::None {
            dims[0]
        } else {
            col
        };
        let mut weight_offsets = vec![0usize];
        let mut row_offsets = vec![0usize];
        for spec in &config.tables {
            let too_large = || {
                let msg = format!(
                    "table `{}` is too large to add to those before it",
                    spec.name
                );
                Error::invalid(OP, msg)
            };
            let (elems, rows) = (weight_offsets.last().unwrap(), row_offsets.last().unwrap());
            let elems = (spec.rows.checked_mul(spec.dim))
                .and_then(|n| n.checked_add(*elems))
                .ok_or_else(too_large)?;
            let rows = spec.rows.checked_add(*rows).ok_or_else(too_large)?;
            weight_offsets.push(elems);
            row_offsets.push(rows);
        }
        Ok(TbeLayout {
            weight_offsets,
            row_offsets,
            slots,
            out_stride,
        })
    }

    /// Elements of all tables together.
    pub(crate) fn total_elements(&self) -> usize {
        *self
            .weight_offsets
            .last()
            .expect("one entry past the last table")
    }

    /// Rows of all tables together.
    pub(crate) fn total_rows(&self) -> usize {
        *self
            .row_offsets
            .last()
            .expect("one entry past the last table")
    }
}

pub(crate) struct TbeInner {
    /// This operator's number ([`next_operator_id`]): prepared batches name it.
    pub id: usize,
    pub config: TbeConfig,
    pub feature_names: Vec<String>,
    pub layout: TbeLayout,
    pub state: RwLock<TrainState>,
    pub skips: SkipCounter,
    /// Leaves that receive row-sparse gradients with [`FusedOptimizer::None`] (on the tables'
    /// device).
    pub sparse_sinks: Mutex<Vec<Tensor>>,
}

/// Table-batched embedding bags for training (FBGEMM's `SplitTableBatchedEmbeddingBagsCodegen`):
/// FP32 rows of every table in one flat buffer, FBGEMM's input layout, and the optimizer fused
/// into the backward. The tables live in host memory or on a CUDA device
/// ([`to_device`](Self::to_device)); every method works on either.
///
/// Cloning is cheap and shares the tables.
#[derive(Clone)]
pub struct TableBatchedEmbedding {
    pub(crate) inner: Arc<TbeInner>,
}

impl std::fmt::Debug for TableBatchedEmbedding {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TableBatchedEmbedding")
            .field("tables", &self.inner.config.tables)
            .field("feature_table_map", &self.inner.config.feature_table_map)
            .field("pooling", &self.inner.config.pooling)
            .field("optimizer", &self.inner.config.optimizer)
            .field("device", &self.device())
            .finish()
    }
}

const OP: &str = "TableBatchedEmbedding";

/// What a batch needs beside its ids: its copy on the tables' device, or its admission to
/// the tables' cache.
type Prepared = (Option<DeviceBatch>, Option<CachedBatch>);

/// Leaves shaped like each table for its row-sparse gradients (stride-0 views of one zero,
/// allocating nothing), on `device`; none with a fused optimizer.
fn sparse_sinks(config: &TbeConfig, device: Device) -> Result<Vec<Tensor>> {
    if config.optimizer != FusedOptimizer::None {
        return Ok(Vec::new());
    }
    (config.tables.iter())
        .map(|spec| {
            Ok(Tensor::try_zeros(&[1, 1], DType::F32, device)?
                .expand(&[spec.rows, spec.dim])?
                .with_requires_grad(true))
        })
        .collect()
}

impl TableBatchedEmbedding {
    /// Builds the operator with all-zero tables and optimizer state in host memory.
    pub fn new(config: TbeConfig) -> Result<Self> {
        Self::new_on(config, Device::Cpu)
    }

    /// Builds the operator with all-zero tables and optimizer state made directly on `device`
    /// (no host copy: for tables larger than host memory wants to hold twice).
    pub fn new_on(config: TbeConfig, device: Device) -> Result<Self> {
        Self::build(config, device, None)
    }

    /// Builds the operator with its tables and optimizer state in a new all-zero file
    /// (`cache.path`, created or replaced) and a DRAM cache of `cache.size` in front of it:
    /// for tables larger than host memory. Training through the cache gives the same tables,
    /// bit for bit, as training the operator built by [`new`](Self::new).
    pub fn new_cached(config: TbeConfig, cache: CacheConfig) -> Result<Self> {
        Self::build(config, Device::Cpu, Some(&cache))
    }

    /// Builds the operator with all-zero tables and optimizer state whose home on a GPU is
    /// managed (unified) memory: kept in host memory and read and updated in place by the
    /// GPU's kernels over the bus, so tables bigger than the GPU's memory train there
    /// (FBGEMM's `MANAGED` placement, the planner's `fused_uvm` kernel: `cudaMallocManaged`
    /// with the host as preferred location, accessed by the GPU). Made on `device`; on the
    /// host they are ordinary host tables, and [`to_device`](Self::to_device) to a GPU puts
    /// them in managed memory. The kernels are the same as for tables in the GPU's memory:
    /// training gives the same tables, bit for bit.
    pub fn new_managed(config: TbeConfig, device: Device) -> Result<Self> {
        Self::build_with(config, device, None, true)
    }

    /// Whether the tables' home on a GPU is managed memory
    /// ([`new_managed`](Self::new_managed)).
    pub fn is_managed(&self) -> bool {
        self.inner.state.read().managed
    }

    /// Builds the operator with its tables and optimizer state in a new all-zero file
    /// (`cache.path`, in host memory through the page cache) and a cache of `cache.size` in
    /// the memory of `device`: on a GPU, FBGEMM's `MANAGED_CACHING` placement (rows in host
    /// memory, the hot ones cached in HBM); on [`Device::Cpu`], [`new_cached`](Self::new_cached).
    /// Training through the cache gives the same tables, bit for bit, as training the operator
    /// built by [`new_on`](Self::new_on) the same device.
    pub fn new_cached_on(config: TbeConfig, cache: CacheConfig, device: Device) -> Result<Self> {
        Self::build(config, device, Some(&cache))
    }

    fn build(config: TbeConfig, device: Device, cache: Option<&CacheConfig>) -> Result<Self> {
        Self::build_with(config, device, cache, false)
    }

    fn build_with(
        config: TbeConfig,
        device: Device,
        cache: Option<&CacheConfig>,
        managed: bool,
    ) -> Result<Self> {
        config.optimizer.validate()?;
        if let WeightDecay::L2(l) | WeightDecay::Decoupled(l) = config.weight_decay {
            // As torch.optim: finite and not negative (a negative decay grows the rows).
            if !(l.is_finite() && l >= 0.0) {
                return Err(Error::invalid(
                    OP,
                    format!(
                        "invalid weight decay {:?}: it must be finite and not negative",
                        config.weight_decay
                    ),
                ));
            }
        }
        if config.tables.is_empty() {
            return Err(Error::invalid(OP, "at least one table is needed"));
        }
        for (t, spec) in config.tables.iter().enumerate() {
            if spec.dim == 0 {
                return Err(Error::invalid(
                    OP,
                    format!("table {t} `{}` has dim 0 (dims must be ≥ 1)", spec.name),
                ));
            }
        }
        if config.feature_table_map.is_empty() {
            return Err(Error::invalid(OP, "at least one feature is needed"));
        }
        for (f, &t) in config.feature_table_map.iter().enumerate() {
            if t >= config.tables.len() {
                return Err(Error::invalid(
                    OP,
                    format!(
                        "feature {f} maps to table {t}, but there are {} tables",
                        config.tables.len()
                    ),
                ));
            }
        }
        let feature_names = match &config.feature_names {
            Some(names) if names.len() != config.feature_table_map.len() => {
                return Err(Error::invalid(
                    OP,
                    format!(
                        "{} feature names for {} features",
                        names.len(),
                        config.feature_table_map.len()
                    ),
                ))
            }
            Some(names) => names.clone(),
            None => (0..config.feature_table_map.len())
                .map(|f| format!("f{f}"))
                .collect(),
        };
        let dims: Vec<usize> = config
            .feature_table_map
            .iter()
            .map(|&t| config.tables[t].dim)
            .collect();
        if config.pooling == PoolingMode::None && dims.iter().any(|&d| d != dims[0]) {
            return Err(Error::invalid(
                OP,
                format!("pooling NONE needs one dim for every feature, got {dims:?}"),
            ));
        }
        let layout = TbeLayout::new(&config)?;
        let tables = match (device, cache) {
            (Device::Cpu, Some(cache)) => {
                Tables::Cached(CachedTables::create(&config, cache, None)?)
            }
            (Device::Cpu, None) => Tables::Host(HostTables::zeros(&layout, &config)?),
            (Device::Cuda(_), Some(cache)) => Tables::Cached(CachedTables::create(
                &config,
                cache,
                Some(crate::cuda::open(device)?),
            )?),
            (Device::Cuda(_), None) => {
                let lens: Vec<usize> = (0..config.optimizer.state_buffers().len())
                    .map(|i| cpu::state_len(&config, &layout, i))
                    .collect();
                Tables::Device(DeviceTables::f32_zeros(
                    crate::cuda::open(device)?,
                    feature_layout(&config, &layout),
                    layout.total_elements(),
                    &lens,
                    managed,
                )?)
            }
        };
        Ok(TableBatchedEmbedding {
            inner: Arc::new(TbeInner {
                id: next_operator_id(),
                sparse_sinks: Mutex::new(sparse_sinks(&config, device)?),
                config,
                feature_names,
                layout,
                state: RwLock::new(TrainState {
                    tables,
                    step: 0,
                    managed,
                }),
                skips: SkipCounter::default(),
            }),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &TbeConfig {
        &self.inner.config
    }

    /// Where the tables live.
    pub fn device(&self) -> Device {
        match &self.inner.state.read().tables {
            Tables::Host(_) => Device::Cpu,
            Tables::Cached(c) => c.device(),
            Tables::Device(d) => Device::Cuda(d.device().ordinal()),
        }
    }

    /// Moves the tables, their optimizer state and the step count to `device` (every clone
    /// follows). Between training steps: a backward recorded before the move refuses to run
    /// after it. Tables cached in a file move their cache: its dirty rows are written back
    /// and an empty cache of the same size is made on `device` over the same rows (on a GPU,
    /// FBGEMM's `MANAGED_CACHING`, as [`new_cached_on`](Self::new_cached_on) makes it); batches
    /// it admitted must be dropped first.
    pub fn to_device(&self, device: Device) -> Result<()> {
        if device == self.device() {
            return Ok(());
        }
        let inner = &self.inner;
        let (cfg, layout) = (&inner.config, &inner.layout);
        let mut state = inner.state.write();
        let open = || crate::cuda::open(device);
        let managed = state.managed;
        let moved = match (&state.tables, device) {
            (Tables::Host(h), Device::Cuda(_)) => {
                Tables::Device(upload(cfg, layout, h, open()?, managed)?)
            }
            (Tables::Device(d), Device::Cpu) => Tables::Host(download(cfg, layout, d)?),
            (Tables::Device(d), Device::Cuda(_)) => {
                let host = download(cfg, layout, d)?;
                Tables::Device(upload(cfg, layout, &host, open()?, managed)?)
            }
            (Tables::Host(_), Device::Cpu) => return Ok(()),
            (Tables::Cached(_), _) => {
                // The cache moves (emptied, its dirty rows written back first); the rows stay
                // in their file or host memory.
                let gpu = match device {
                    Device::Cpu => None,
                    Device::Cuda(_) => Some(open()?),
                };
                let none = HostTables {
                    weights: crate::embedding::RowBuffer::zeros(0)?,
                    m1: crate::embedding::RowBuffer::zeros(0)?,
                    m2: crate::embedding::RowBuffer::zeros(0)?,
                };
                let Tables::Cached(c) = std::mem::replace(&mut state.tables, Tables::Host(none))
                else {
                    unreachable!("matched above");
                };
                match c.moved_to(cfg, gpu) {
                    Ok(moved) => Tables::Cached(moved),
                    Err(failed) => {
                        let (c, e) = *failed;
                        state.tables = Tables::Cached(c);
                        return Err(e);
                    }
                }
            }
        };
        state.tables = moved;
        *inner.sparse_sinks.lock() = sparse_sinks(cfg, device)?;
        Ok(())
    }

    /// A deep copy of this operator — tables, optimizer state and step count — on `device`
    /// (this one stays where it is).
    pub fn clone_to(&self, device: Device) -> Result<Self> {
        let copy = TableBatchedEmbedding::new(self.inner.config.clone())?;
        {
            let state = self.inner.state.read();
            let mut target = copy.inner.state.write();
            let (cfg, layout) = (&self.inner.config, &self.inner.layout);
            let Tables::Host(host) = &mut target.tables else {
                unreachable!("a new operator's tables are on the host");
            };
            match &state.tables {
                Tables::Host(h) => {
                    host.weights.copy_from_slice(&h.weights);
                    for i in 0..cfg.optimizer.state_buffers().len() {
                        host.state_mut(i).copy_from_slice(h.state(i));
                    }
                }
                Tables::Device(d) => *host = download(cfg, layout, d)?,
                Tables::Cached(c) => {
                    for t in 0..cfg.tables.len() {
                        let range = layout.weight_offsets[t]..layout.weight_offsets[t + 1];
                        host.weights[range].copy_from_slice(&c.read_part(t, 0)?);
                        for (i, (_, shape)) in cfg.optimizer.state_buffers().iter().enumerate() {
                            let range = match shape {
                                StateShape::PerRow => {
                                    layout.row_offsets[t]..layout.row_offsets[t + 1]
                                }
                                StateShape::PerElement => {
                                    layout.weight_offsets[t]..layout.weight_offsets[t + 1]
                                }
                            };
                            host.state_mut(i)[range].copy_from_slice(&c.read_part(t, i + 1)?);
                        }
                    }
                }
            }
            target.step = state.step;
            target.managed = state.managed;
        }
        copy.to_device(device)?;
        Ok(copy)
    }

    /// Number of tables.
    pub fn num_tables(&self) -> usize {
        self.inner.config.tables.len()
    }

    /// Number of features.
    pub fn num_features(&self) -> usize {
        self.inner.config.feature_table_map.len()
    }

    /// Output width `Σ D` over features (or the common dim with pooling NONE).
    pub fn output_dim(&self) -> usize {
        self.inner.layout.out_stride
    }

    /// First output column of each feature, plus the total at the end (FBGEMM's `D_offsets`).
    pub fn d_offsets(&self) -> Vec<usize> {
        let slots = &self.inner.layout.slots;
        let mut v: Vec<usize> = slots.iter().map(|s| s.col).collect();
        v.push(slots.iter().map(|s| s.dim).sum());
        v
    }

    /// Start, in the flat weight buffer, of the table each feature reads (in elements; FBGEMM's
    /// per-feature `weights_offsets`).
    pub fn weights_offsets(&self) -> Vec<usize> {
        (self.inner.config.feature_table_map.iter())
            .map(|&t| self.inner.layout.weight_offsets[t])
            .collect()
    }

    /// Ids skipped so far by [`BoundsCheckMode::WarnAndSkip`].
    pub fn bounds_check_warnings(&self) -> u64 {
        self.inner.skips.skipped.load(Ordering::Relaxed)
    }

    /// Number of fused optimizer steps (backward calls) so far.
    pub fn step(&self) -> u64 {
        self.inner.state.read().step
    }

    /// Bytes held by the weights and optimizer state (allocation sizes, padding included), on
    /// whichever device they live.
    pub fn allocated_bytes(&self) -> usize {
        match &self.inner.state.read().tables {
            Tables::Host(h) => h.allocated_bytes(),
            Tables::Device(d) => d.allocated_bytes(),
            Tables::Cached(c) => c.allocated_bytes(),
        }
    }

    fn check_table(&self, t: usize) -> Result<&TableSpec> {
        self.inner.config.tables.get(t).ok_or_else(|| {
            Error::invalid(
                OP,
                format!("table {t} does not exist ({} tables)", self.num_tables()),
            )
        })
    }

    fn weight_range(&self, t: usize) -> std::ops::Range<usize> {
        let offsets = &self.inner.layout.weight_offsets;
        offsets[t]..offsets[t + 1]
    }

    /// A copy of table `t`'s rows, `[rows, dim]` row-major (copied back from a device).
    pub fn table_weights(&self, t: usize) -> Result<Vec<f32>> {
        self.part_rows(t, 0, 0..self.check_table(t)?.rows)
    }

    /// A copy of rows `rows` of table `t`, `[rows.len(), dim]` row-major: a table bigger
    /// than memory (cached in a file) read a chunk at a time.
    pub fn table_weight_rows(&self, t: usize, rows: std::ops::Range<usize>) -> Result<Vec<f32>> {
        self.part_rows(t, 0, rows)
    }

    /// A copy of rows `rows` of optimizer state buffer `index` of table `t` (`[rows.len()]`
    /// for per-row state, else `[rows.len(), dim]`), as
    /// [`table_weight_rows`](Self::table_weight_rows) reads weights.
    pub fn optimizer_state_rows(
        &self,
        index: usize,
        t: usize,
        rows: std::ops::Range<usize>,
    ) -> Result<Vec<f32>> {
        self.part_rows(t, index + 1, rows)
    }

    /// Rows `rows` of table `t`'s weights (`part` 0) or of its optimizer state buffer
    /// `part - 1`.
    fn part_rows(&self, t: usize, part: usize, rows: std::ops::Range<usize>) -> Result<Vec<f32>> {
        let spec = self.check_table(t)?;
        if rows.start > rows.end || rows.end > spec.rows {
            return Err(Error::invalid(
                OP,
                format!(
                    "rows {}..{} of table {t} `{}`, which has {}",
                    rows.start, rows.end, spec.name, spec.rows
                ),
            ));
        }
        let (all, width) = match part {
            0 => (self.weight_range(t), spec.dim),
            _ => match self.state_shape_of(part - 1)? {
                StateShape::PerRow => (self.state_range(t, StateShape::PerRow), 1),
                StateShape::PerElement => (self.weight_range(t), spec.dim),
            },
        };
        let range = all.start + rows.start * width..all.start + rows.end * width;
        match (&self.inner.state.read().tables, part) {
            (Tables::Host(h), 0) => Ok(h.weights[range].to_vec()),
            (Tables::Host(h), i) => Ok(h.state(i - 1)[range].to_vec()),
            (Tables::Device(d), 0) => d.read_weights(range),
            (Tables::Device(d), i) => d.read_state(i - 1, range),
            (Tables::Cached(c), _) => c.read_part_rows(t, part, rows),
        }
    }

    /// Calls `f(first, rows)` with table `t`'s rows `chunk_rows` at a time (`rows`:
    /// `[n, dim]` row-major, rows `first..first + n`), every row once, in order: what reads a
    /// table bigger than memory through (a cached table's directory read once, not per chunk
    /// as [`table_weight_rows`](Self::table_weight_rows) would). The tables' lock is held
    /// throughout (training waits): `f` must not use this operator.
    pub(crate) fn for_each_weight_chunk(
        &self,
        t: usize,
        chunk_rows: usize,
        mut f: impl FnMut(usize, &[f32]) -> Result<()>,
    ) -> Result<()> {
        let spec = self.check_table(t)?;
        let (rows, dim) = (spec.rows, spec.dim);
        let chunk = chunk_rows.max(1);
        let start = self.weight_range(t).start;
        let range = |first: usize| start + first * dim..start + (first + chunk).min(rows) * dim;
        match &self.inner.state.read().tables {
            Tables::Cached(c) => c.read_part_chunks(t, 0, 0..rows, chunk, f),
            Tables::Host(h) => (0..rows)
                .step_by(chunk)
                .try_for_each(|first| f(first, &h.weights[range(first)])),
            Tables::Device(d) => (0..rows)
                .step_by(chunk)
                .try_for_each(|first| f(first, &d.read_weights(range(first))?)),
        }
    }

    /// Overwrites table `t`'s rows (`[rows, dim]` row-major).
    pub fn set_table_weights(&self, t: usize, values: &[f32]) -> Result<()> {
        let spec = self.check_table(t)?;
        let range = self.weight_range(t);
        if values.len() != range.len() {
            return Err(Error::invalid(
                OP,
                format!(
                    "table {t} `{}` is {}×{} = {} values, {} given",
                    spec.name,
                    spec.rows,
                    spec.dim,
                    range.len(),
                    values.len()
                ),
            ));
        }
        match &mut self.inner.state.write().tables {
            Tables::Host(h) => h.weights[range].copy_from_slice(values),
            Tables::Device(d) => d.write_weights(range.start, values)?,
            Tables::Cached(c) => c.write_part(t, 0, values)?,
        }
        Ok(())
    }

    /// Fills every table with `init` from `rng` (tables in order, rows in order).
    pub fn init_weights(&self, init: EmbeddingInit, rng: &mut Rng) -> Result<()> {
        for t in 0..self.num_tables() {
            self.init_table(t, init, rng)?;
        }
        Ok(())
    }

    /// Fills table `t` with `init` from `rng` (rows in order), without a second copy of it.
    pub(crate) fn init_table(&self, t: usize, init: EmbeddingInit, rng: &mut Rng) -> Result<()> {
        let spec = self.check_table(t)?;
        let range = self.weight_range(t);
        {
            match &mut self.inner.state.write().tables {
                Tables::Host(h) => fill_init(&mut h.weights[range], spec.rows, init, rng)?,
                Tables::Device(d) => {
                    let mut values = vec![0.0f32; range.len()];
                    fill_init(&mut values, spec.rows, init, rng)?;
                    d.write_weights(range.start, &values)?;
                }
                // Chunk by chunk: the values are drawn in the same order as for one buffer.
                Tables::Cached(c) => {
                    c.modify_part(t, 0, |_, chunk| fill_init(chunk, spec.rows, init, rng))?
                }
            }
        }
        Ok(())
    }

    fn state_range(&self, t: usize, shape: StateShape) -> std::ops::Range<usize> {
        let layout = &self.inner.layout;
        match shape {
            StateShape::PerRow => layout.row_offsets[t]..layout.row_offsets[t + 1],
            StateShape::PerElement => self.weight_range(t),
        }
    }

    /// Names of the optimizer state buffers (`momentum1`, `momentum2`), per-row or per-element.
    pub fn optimizer_state_names(&self) -> Vec<(&'static str, StateShape)> {
        self.inner.config.optimizer.state_buffers().to_vec()
    }

    fn state_shape_of(&self, index: usize) -> Result<StateShape> {
        let optimizer = &self.inner.config.optimizer;
        let (_, shape) = *optimizer.state_buffers().get(index).ok_or_else(|| {
            Error::invalid(
                OP,
                format!(
                    "optimizer `{}` has no state buffer {index}",
                    optimizer.name()
                ),
            )
        })?;
        Ok(shape)
    }

    /// A copy of optimizer state buffer `index` of table `t` (`[rows]` for per-row state,
    /// `[rows, dim]` for per-element state).
    pub fn optimizer_state(&self, index: usize, t: usize) -> Result<Vec<f32>> {
        self.optimizer_state_rows(index, t, 0..self.check_table(t)?.rows)
    }

    /// Overwrites optimizer state buffer `index` of table `t`.
    pub fn set_optimizer_state(&self, index: usize, t: usize, values: &[f32]) -> Result<()> {
        self.check_table(t)?;
        let range = self.state_range(t, self.state_shape_of(index)?);
        if values.len() != range.len() {
            return Err(Error::invalid(
                OP,
                format!(
                    "optimizer state {index} of table {t} has {} values, {} given",
                    range.len(),
                    values.len()
                ),
            ));
        }
        match &mut self.inner.state.write().tables {
            Tables::Host(h) => h.state_mut(index)[range].copy_from_slice(values),
            Tables::Device(d) => d.write_state(index, range.start, values)?,
            Tables::Cached(c) => c.write_part(t, index + 1, values)?,
        }
        Ok(())
    }

    pub(crate) fn set_step(&self, step: u64) {
        self.inner.state.write().step = step;
    }

    /// Chooses between the FP32 pooled GPU lookup kernels: 16-byte loads (`true`, the default
    /// where every dim is a multiple of 4 and at most 512) or one float per lane. Returns
    /// whether the vectorized kernel is now in use (always `false` for host tables). Both give
    /// the same sums; the choice is for benchmarks.
    pub fn set_vectorized(&self, on: bool) -> bool {
        let dims: Vec<usize> = self.inner.config.tables.iter().map(|s| s.dim).collect();
        match &mut self.inner.state.write().tables {
            Tables::Host(_) | Tables::Cached(_) => false,
            Tables::Device(d) => d.set_vectorized(on, &dims),
        }
    }

    pub(crate) fn validate_input<'a>(&self, input: TbeInput<'a>) -> Result<Batch<'a>> {
        let inner = &self.inner;
        let cfg = &inner.config;
        let bounds: Vec<FeatureBounds<'_>> = (cfg.feature_table_map.iter().enumerate())
            .map(|(f, &t)| FeatureBounds {
                rows: cfg.tables[t].rows,
                feature: &inner.feature_names[f],
                table: &cfg.tables[t].name,
            })
            .collect();
        let sequence = cfg.pooling == PoolingMode::None;
        validate(OP, input, &bounds, cfg.bounds_check, sequence, &inner.skips)
    }

    /// Checks `input` against the tables (the one validation pass, on the host) and copies it
    /// to the tables' device: a batch ready for [`lookup_batch`](Self::lookup_batch) and
    /// [`backward_batch`](Self::backward_batch), as often as wanted. Preparing once takes the
    /// host's checks and the copy off a loop that looks the same batch up again.
    pub fn prepare(&self, input: TbeInput<'_>) -> Result<TbeBatch> {
        self.prepare_validated(self.validate_input(input)?)
    }

    /// A validated batch prepared (copied to the tables' device).
    fn prepare_validated(&self, batch: Batch<'_>) -> Result<TbeBatch> {
        let mut state = self.inner.state.write();
        let (on_device, cached) = match &mut state.tables {
            Tables::Host(_) => (None, None),
            Tables::Device(d) => (Some(DeviceBatch::upload(d.device(), &batch)?), None),
            Tables::Cached(c) => (None, Some(c.admit(&self.inner.config, &batch)?)),
        };
        drop(state);
        Ok(self.owned_batch(batch, (on_device, cached)))
    }

    /// A prepared batch of this operator holding `batch` (copied if borrowed).
    fn owned_batch(&self, batch: Batch<'_>, (on_device, cached): Prepared) -> TbeBatch {
        TbeBatch {
            owner: self.inner.id,
            batch: batch.into_owned(),
            on_device,
            cached,
        }
    }

    /// The lookup of a validated (borrowed) batch on the tables' device, and the batch's copy
    /// there (device tables): no copy of the batch on the host.
    fn lookup_validated(&self, batch: &Batch<'_>) -> Result<(Tensor, Prepared)> {
        let inner = &self.inner;
        {
            let state = inner.state.read();
            match &state.tables {
                Tables::Host(h) => {
                    return Ok((
                        h.forward(&inner.config, &inner.layout, batch)?,
                        (None, None),
                    ))
                }
                Tables::Device(d) => {
                    let on_device = DeviceBatch::upload(d.device(), batch)?;
                    return Ok((d.forward(&on_device)?, (Some(on_device), None)));
                }
                Tables::Cached(_) => {}
            }
        }
        let mut state = inner.state.write();
        let Tables::Cached(c) = &mut state.tables else {
            return Err(moved_error());
        };
        let cached = c.admit(&inner.config, batch)?;
        Ok((c.forward(&cached)?, (None, Some(cached))))
    }

    /// Refuses a batch prepared by another operator, or for the tables' other device.
    fn check_batch(&self, batch: &TbeBatch) -> Result<()> {
        if batch.owner != self.inner.id {
            return Err(Error::invalid(
                OP,
                "the batch was prepared by another operator",
            ));
        }
        let (device, cached) = match &self.inner.state.read().tables {
            Tables::Host(_) => (false, false),
            Tables::Device(_) => (true, false),
            Tables::Cached(_) => (false, true),
        };
        if batch.on_device.is_some() != device || batch.cached.is_some() != cached {
            return Err(moved_error());
        }
        Ok(())
    }

    /// The lookup of a prepared batch without recording autograd: `[B, ΣD]` (or `[N, D]`
    /// with pooling NONE) on the tables' device, queued asynchronously there.
    pub fn lookup_batch(&self, batch: &TbeBatch) -> Result<Tensor> {
        self.check_batch(batch)?;
        let inner = &self.inner;
        if let Some(cached) = &batch.cached {
            let Tables::Cached(c) = &mut inner.state.write().tables else {
                return Err(moved_error());
            };
            return c.forward(cached);
        }
        match (&inner.state.read().tables, &batch.on_device) {
            (Tables::Host(h), None) => h.forward(&inner.config, &inner.layout, &batch.batch),
            (Tables::Device(d), Some(on_device)) => d.forward(on_device),
            _ => Err(moved_error()),
        }
    }

    /// Forward without recording autograd: `[B, ΣD]` (or `[N, D]` with pooling NONE), on the
    /// tables' device.
    pub fn lookup(&self, input: TbeInput<'_>) -> Result<Tensor> {
        let batch = self.validate_input(input)?;
        Ok(self.lookup_validated(&batch)?.0)
    }

    /// The pooled lookup into a caller-provided buffer (no allocation, no autograd), tables on
    /// the host: `out` must hold `B × ΣD` values. For serving loops that reuse their output.
    pub fn forward_into(&self, input: TbeInput<'_>, out: &mut [f32]) -> Result<()> {
        let batch = self.validate_input(input)?;
        batch.check_pooled_buffer(
            OP,
            self.inner.config.pooling,
            self.inner.layout.out_stride,
            out.len(),
        )?;
        let inner = &self.inner;
        match &inner.state.read().tables {
            Tables::Host(h) => {
                h.forward_into(&inner.config, &inner.layout, &batch, out);
                return Ok(());
            }
            Tables::Device(_) => {
                return Err(Error::invalid(
                    OP,
                    "forward_into reads host tables; these live on a GPU (use lookup)",
                ))
            }
            Tables::Cached(_) => {}
        }
        let Tables::Cached(c) = &mut inner.state.write().tables else {
            return Err(moved_error());
        };
        let cached = c.admit(&inner.config, &batch)?;
        c.forward_into(&cached, out)
    }

    /// Forward that takes part in autograd: backward of the result runs the fused optimizer
    /// (or, with [`FusedOptimizer::None`], leaves row-sparse gradients, see
    /// [`TableBatchedEmbedding::sparse_gradient`]) and gives `per_sample_weights` its gradient
    /// when it requires grad. The inputs may live on any device (they are checked on the
    /// host); the output lives on the tables' device.
    pub fn forward(
        &self,
        indices: &Tensor,
        offsets: &Tensor,
        per_sample_weights: Option<&Tensor>,
    ) -> Result<Tensor> {
        with_tensor_input(OP, indices, offsets, per_sample_weights, |input| {
            let batch = self.validate_input(input)?;
            let (out, on_device) = self.lookup_validated(&batch)?;
            if !crate::tensor::is_grad_enabled() {
                // No graph to record: skip keeping the batch for backward.
                return Ok(out);
            }
            let batch = self.owned_batch(batch, on_device);
            let mut inputs: Vec<&Tensor> = Vec::new();
            if let Some(w) = per_sample_weights {
                inputs.push(w);
            }
            let sinks = self.inner.sparse_sinks.lock().clone();
            inputs.extend(sinks.iter());
            Ok(record_op_with_state(
                out,
                &inputs,
                TbeBackward {
                    tbe: self.clone(),
                    batch,
                    weights_device: per_sample_weights.map(Tensor::device),
                    sinks: sinks.len(),
                },
            ))
        })
    }

    /// The fused backward of a prepared batch: `grad_output` is the gradient of its lookup's
    /// output (`[B, ΣD]` or `[N, D]`, f32, on any device). Updates the tables (unless the
    /// optimizer is [`FusedOptimizer::None`]) and returns the per-sample weights' gradient and
    /// the row-sparse gradients, on the tables' device.
    pub fn backward_batch(&self, batch: &TbeBatch, grad_output: &Tensor) -> Result<TbeGradients> {
        self.backward_with(batch, grad_output, self.inner.config.optimizer)
    }

    /// The row-sparse gradient of every table for a prepared batch (coalesced: sorted distinct
    /// rows, values on the tables' device), whatever the fused optimizer: nothing is updated.
    /// With [`apply_row_gradients`](Self::apply_row_gradients), a caller can combine
    /// gradients (e.g. sum them over data-parallel replicas) before the fused update.
    pub fn row_gradients_batch(
        &self,
        batch: &TbeBatch,
        grad_output: &Tensor,
    ) -> Result<Vec<RowSparseGrad>> {
        let grads = self.backward_with(batch, grad_output, FusedOptimizer::None)?;
        let sparse = grads.sparse.ok_or_else(|| {
            Error::invalid(OP, "the backward gave no row-sparse gradients (internal)")
        })?;
        sparse.iter().map(RowSparseGrad::coalesce).collect()
    }

    /// One fused optimizer step with the given row-sparse gradient of each table (one per
    /// table, in table order; rows may repeat, their gradients add up): the update a fused
    /// backward whose rows received these gradients would make.
    pub fn apply_row_gradients(&self, grads: &[RowSparseGrad]) -> Result<()> {
        let cfg = &self.inner.config;
        if grads.len() != cfg.tables.len() {
            return Err(Error::invalid(
                OP,
                format!("{} gradients for {} tables", grads.len(), cfg.tables.len()),
            ));
        }
        if cfg.optimizer == FusedOptimizer::None {
            return Err(Error::invalid(
                OP,
                "the optimizer is None: there is no fused update to apply (its row gradients \
                 go to autograd, for an optimizer of the caller's)",
            ));
        }
        let mut rows_of = Vec::with_capacity(grads.len());
        for (t, (g, spec)) in grads.iter().zip(&cfg.tables).enumerate() {
            // [rows, dim] as given, before coalescing reads it (any shape of the right count
            // was read as rows of the table's width).
            let shaped = g.values.shape() == [g.rows.len(), spec.dim];
            let g = if shaped { g.coalesce()? } else { g.clone() };
            let n = g.rows.len();
            if !shaped
                || g.num_rows != spec.rows
                || g.values.numel() != n * spec.dim
                || g.values.dtype() != DType::F32
                || g.rows.iter().any(|&r| r < 0 || r as usize >= spec.rows)
            {
                return Err(Error::invalid(
                    OP,
                    format!(
                        "the gradient of table {t} `{}` ({n} rows of a {}-row table, values \
                         {:?} {:?}) does not fit the {}×{} table",
                        spec.name,
                        g.num_rows,
                        g.values.dtype(),
                        g.values.shape(),
                        spec.rows,
                        spec.dim
                    ),
                ));
            }
            if n > 0 && !cfg.feature_table_map.contains(&t) {
                return Err(Error::invalid(
                    OP,
                    format!("table {t} `{}` is read by no feature", spec.name),
                ));
            }
            let values = g.values.to_device(Device::Cpu)?.to_vec::<f32>()?;
            rows_of.push((g.rows, values));
        }
        // A batch in which each touched row is one bag of its own id, read by the table's
        // first feature, and whose output gradient is the row's gradient: the fused backward
        // then updates exactly those rows with exactly those gradients.
        let pooled = cfg.pooling != PoolingMode::None;
        let bags = rows_of
            .iter()
            .map(|(r, _)| r.len())
            .max()
            .unwrap_or(0)
            .max(1);
        let first_feature: Vec<Option<usize>> = (0..cfg.tables.len())
            .map(|t| cfg.feature_table_map.iter().position(|&ft| ft == t))
            .collect();
        let features = cfg.feature_table_map.len();
        let mut ids = Vec::new();
        let mut offsets = vec![0i64];
        let width = self.inner.layout.out_stride;
        let mut grad = Vec::new();
        if pooled {
            grad = vec![0.0f32; bags * width];
        }
        for f in 0..features {
            let t = cfg.feature_table_map[f];
            let mine = first_feature[t] == Some(f);
            let dim = cfg.tables[t].dim;
            let col = self.inner.layout.slots[f].col;
            for b in 0..bags {
                if mine && b < rows_of[t].0.len() {
                    ids.push(rows_of[t].0[b]);
                    let g = &rows_of[t].1[b * dim..(b + 1) * dim];
                    if pooled {
                        grad[b * width + col..b * width + col + dim].copy_from_slice(g);
                    } else {
                        grad.extend_from_slice(g);
                    }
                }
                offsets.push(ids.len() as i64);
            }
        }
        if ids.is_empty() {
            return Ok(());
        }
        let batch = self.prepare(TbeInput::new(&ids[..], &offsets[..]))?;
        let rows = if pooled { bags } else { ids.len() };
        let grad = Tensor::from_vec(grad, &[rows, width])?;
        self.backward_batch(&batch, &grad).map(|_| ())
    }

    /// The backward of a prepared batch under `optimizer` (the configured one, or
    /// [`FusedOptimizer::None`] for gradients only, which leaves the step count alone).
    fn backward_with(
        &self,
        batch: &TbeBatch,
        grad_output: &Tensor,
        optimizer: FusedOptimizer,
    ) -> Result<TbeGradients> {
        self.check_batch(batch)?;
        let rows = self.output_rows(&batch.batch);
        if grad_output.numel() != rows * self.output_dim() || grad_output.dtype() != DType::F32 {
            return Err(Error::invalid(
                OP,
                format!(
                    "grad_output is {:?} {:?}, expected f32 {rows}×{}",
                    grad_output.dtype(),
                    grad_output.shape(),
                    self.output_dim()
                ),
            ));
        }
        if let Some(cached) = batch.cached.as_ref().filter(|c| c.is_on_device()) {
            let grad = grad_output.to_device(self.device())?;
            return self.backward_cached_device(&batch.batch, cached, &grad, optimizer);
        }
        match &batch.on_device {
            None => {
                let out = (grad_output.to_device_values(Device::Cpu)?).with_contiguous(
                    |grad: &[f32]| {
                        self.backward_host(&batch.batch, batch.cached.as_ref(), grad, &optimizer)
                    },
                )??;
                let tables = &self.inner.config.tables;
                let per_sample_weights = (out.per_sample_weights_grad)
                    .map(|g| {
                        let n = g.len();
                        Tensor::from_vec(g, &[n])
                    })
                    .transpose()?;
                let sparse = (out.sparse_grads)
                    .map(|grads| {
                        (grads.into_iter().zip(tables))
                            .map(|(g, spec)| {
                                let n = g.rows.len();
                                Ok(RowSparseGrad {
                                    rows: g.rows,
                                    values: Tensor::from_vec(g.values, &[n, spec.dim])?,
                                    num_rows: spec.rows,
                                })
                            })
                            .collect::<Result<Vec<_>>>()
                    })
                    .transpose()?;
                Ok(TbeGradients {
                    per_sample_weights,
                    sparse,
                })
            }
            Some(on_device) => {
                let grad = grad_output.to_device(self.device())?;
                self.backward_device(&batch.batch, on_device, &grad, optimizer)
            }
        }
    }

    /// The fused backward on raw host slices: `grad_output` is `[B, ΣD]` (or `[N, D]`) for the
    /// same `input` as the forward. Updates the tables (unless the optimizer is
    /// [`FusedOptimizer::None`]) and returns the per-sample-weight and sparse gradients.
    pub fn backward_fused(
        &self,
        input: TbeInput<'_>,
        grad_output: &[f32],
    ) -> Result<BackwardOutput> {
        let batch = self.validate_input(input)?;
        let rows = self.output_rows(&batch);
        if grad_output.len() != rows * self.output_dim() {
            return Err(Error::invalid(
                OP,
                format!(
                    "grad_output has {} values, expected {rows}×{}",
                    grad_output.len(),
                    self.output_dim()
                ),
            ));
        }
        if matches!(self.inner.state.read().tables, Tables::Host(_)) {
            return self.backward_host(&batch, None, grad_output, &self.inner.config.optimizer);
        }
        let batch = self.prepare_validated(batch)?;
        let grad = Tensor::from_slice(grad_output, &[rows, self.output_dim()])?;
        let grads = self.backward_batch(&batch, &grad)?;
        let sparse_grads = (grads.sparse)
            .map(|tables| {
                (tables.into_iter())
                    .map(|g| {
                        let dim = g.values.shape()[1];
                        Ok(SparseTableGrad {
                            rows: g.rows,
                            values: g.values.to_vec::<f32>()?,
                            dim,
                        })
                    })
                    .collect::<Result<Vec<_>>>()
            })
            .transpose()?;
        Ok(BackwardOutput {
            per_sample_weights_grad: (grads.per_sample_weights)
                .map(|g| g.to_vec::<f32>())
                .transpose()?,
            sparse_grads,
        })
    }

    /// Rows of the output (and its gradient) for `batch`.
    fn output_rows(&self, batch: &Batch<'_>) -> usize {
        batch.output_rows(self.inner.config.pooling)
    }

    /// The fused backward of host (or cached, with the batch's admission `cached`) tables
    /// under `optimizer` (the configured one, or [`FusedOptimizer::None`] for gradients only,
    /// which leaves the step count alone).
    fn backward_host(
        &self,
        batch: &Batch<'_>,
        cached: Option<&CachedBatch>,
        grad_output: &[f32],
        optimizer: &FusedOptimizer,
    ) -> Result<BackwardOutput> {
        let inner = &self.inner;
        let mut guard = inner.state.write();
        let state = &mut *guard;
        let gradients_only = *optimizer == FusedOptimizer::None;
        let counts = !gradients_only || inner.config.optimizer == FusedOptimizer::None;
        let step = state.step + u64::from(counts);
        let mut out = match (&mut state.tables, cached) {
            (Tables::Host(tables), None) => tables.backward(
                &inner.config,
                &inner.layout,
                batch,
                grad_output,
                optimizer,
                step,
            ),
            (Tables::Cached(tables), Some(cached)) => {
                tables.backward(cached, grad_output, optimizer, step)?
            }
            _ => return Err(moved_error()),
        };
        state.step = step;
        // Tables no feature reads got no entry; give them an empty sparse gradient so the
        // list stays one per table.
        if let Some(grads) = out.sparse_grads.take() {
            let cfg = &inner.config;
            let mut it = grads.into_iter();
            let mut full = Vec::with_capacity(cfg.tables.len());
            for (t, spec) in cfg.tables.iter().enumerate() {
                if cfg.feature_table_map.contains(&t) {
                    full.push(it.next().expect("one gradient per looked-up table"));
                } else {
                    full.push(SparseTableGrad {
                        rows: Vec::new(),
                        values: Vec::new(),
                        dim: spec.dim,
                    });
                }
            }
            out.sparse_grads = Some(full);
        }
        Ok(out)
    }

    /// The fused (or row-sparse) backward of device tables for the batch `on_device` of
    /// `batch`, under `optimizer` (as [`backward_host`](Self::backward_host)).
    fn backward_device(
        &self,
        batch: &Batch<'_>,
        on_device: &DeviceBatch,
        grad_output: &Tensor,
        optimizer: FusedOptimizer,
    ) -> Result<TbeGradients> {
        let inner = &self.inner;
        let cfg = &inner.config;
        let mut guard = inner.state.write();
        let state = &mut *guard;
        let Tables::Device(tables) = &mut state.tables else {
            return Err(moved_error());
        };
        let counts = optimizer != FusedOptimizer::None || cfg.optimizer == FusedOptimizer::None;
        let step = state.step + u64::from(counts);
        let grads = tables.backward(BackwardInput {
            batch: on_device,
            grad_output,
            optimizer,
            decay: cfg.weight_decay,
            step,
            weights_grad: on_device.weights.is_some(),
        })?;
        state.step = step;
        drop(guard);
        let per_sample_weights = restore_kept(grads.weights_grad, batch)?;
        let sparse = match grads.sparse {
            None => None,
            Some((rows, values)) => {
                let row_offsets = &inner.layout.row_offsets;
                let mut per_table = Vec::with_capacity(cfg.tables.len());
                for (t, spec) in cfg.tables.iter().enumerate() {
                    let (first, end) = (row_offsets[t] as i64, row_offsets[t + 1] as i64);
                    let a = rows.partition_point(|&r| r < first);
                    let b = rows.partition_point(|&r| r < end);
                    per_table.push(RowSparseGrad {
                        rows: rows[a..b].iter().map(|&r| r - first).collect(),
                        values: values
                            .narrow(0, a, b - a)?
                            .narrow(1, 0, spec.dim)?
                            .contiguous()?,
                        num_rows: spec.rows,
                    });
                }
                Some(per_table)
            }
        };
        Ok(TbeGradients {
            per_sample_weights,
            sparse,
        })
    }

    /// The fused (or row-sparse) backward of a GPU cache for the admitted batch `cached` of
    /// `batch`, under `optimizer` (as [`backward_host`](Self::backward_host)).
    fn backward_cached_device(
        &self,
        batch: &Batch<'_>,
        cached: &CachedBatch,
        grad_output: &Tensor,
        optimizer: FusedOptimizer,
    ) -> Result<TbeGradients> {
        let cfg = &self.inner.config;
        let mut guard = self.inner.state.write();
        let state = &mut *guard;
        let Tables::Cached(tables) = &mut state.tables else {
            return Err(moved_error());
        };
        let counts = optimizer != FusedOptimizer::None || cfg.optimizer == FusedOptimizer::None;
        let step = state.step + u64::from(counts);
        let (weights_grad, sparse) =
            tables.backward_device(cached, grad_output, optimizer, cfg.weight_decay, step)?;
        state.step = step;
        drop(guard);
        Ok(TbeGradients {
            per_sample_weights: restore_kept(weights_grad, batch)?,
            sparse,
        })
    }

    /// With [`FusedOptimizer::None`]: the row-sparse gradient accumulated on table `t` by
    /// autograd backward calls since the last [`zero_sparse_gradients`](Self::zero_sparse_gradients)
    /// (its values on the tables' device).
    pub fn sparse_gradient(&self, t: usize) -> Option<RowSparseGrad> {
        match self.inner.sparse_sinks.lock().get(t)?.gradient()? {
            Gradient::RowSparse(g) => Some(g),
            Gradient::Dense(_) => None,
        }
    }

    /// Clears the gradients kept for [`sparse_gradient`](Self::sparse_gradient).
    pub fn zero_sparse_gradients(&self) {
        for s in self.inner.sparse_sinks.lock().iter() {
            s.zero_grad();
        }
    }
}

/// The per-sample weights' gradient of `batch` in its caller's positions: where ids were
/// skipped, each kept id's gradient goes back to its position (zeros elsewhere).
fn restore_kept(grad: Option<Tensor>, batch: &Batch<'_>) -> Result<Option<Tensor>> {
    Ok(match (grad, &batch.kept) {
        (Some(g), Some((kept, n))) => {
            let values = g.to_vec::<f32>()?;
            let mut full = vec![0.0f32; *n];
            for (&p, &v) in kept.iter().zip(&values) {
                full[p] = v;
            }
            Some(Tensor::from_vec(full, &[*n])?.to_device(g.device())?)
        }
        (g, _) => g,
    })
}

/// The error of a backward whose tables moved to another device after its forward.
pub(crate) fn moved_error() -> Error {
    Error::invalid(
        OP,
        "the tables moved to another device between this forward and its backward",
    )
}

/// The per-feature layout the device kernels read.
fn feature_layout(cfg: &TbeConfig, layout: &TbeLayout) -> FeatureLayout {
    let ftm = &cfg.feature_table_map;
    FeatureLayout {
        table_offsets: ftm
            .iter()
            .map(|&t| layout.weight_offsets[t] as i64)
            .collect(),
        rows: ftm.iter().map(|&t| cfg.tables[t].rows as i64).collect(),
        dims: ftm.iter().map(|&t| cfg.tables[t].dim as i32).collect(),
        row_starts: ftm.iter().map(|&t| layout.row_offsets[t] as i64).collect(),
        total_rows: layout.total_rows(),
        table_dims: cfg.tables.iter().map(|s| s.dim).collect(),
        pooling: cfg.pooling,
    }
}

/// A device copy of host tables and their optimizer state.
fn upload(
    cfg: &TbeConfig,
    layout: &TbeLayout,
    host: &HostTables,
    device: Arc<crate::cuda::CudaDevice>,
    managed: bool,
) -> Result<DeviceTables> {
    let states: Vec<&[f32]> = (0..cfg.optimizer.state_buffers().len())
        .map(|i| host.state(i))
        .collect();
    let l = feature_layout(cfg, layout);
    DeviceTables::f32(device, l, &host.weights, &states, managed)
}

/// A host copy of device tables and their optimizer state.
fn download(cfg: &TbeConfig, layout: &TbeLayout, device: &DeviceTables) -> Result<HostTables> {
    let mut host = HostTables::zeros(layout, cfg)?;
    host.weights
        .copy_from_slice(&device.read_weights(0..layout.total_elements())?);
    for i in 0..cfg.optimizer.state_buffers().len() {
        let len = cpu::state_len(cfg, layout, i);
        host.state_mut(i)
            .copy_from_slice(&device.read_state(i, 0..len)?);
    }
    Ok(host)
}

pub(crate) fn fill_init(
    rows: &mut [f32],
    num_rows: usize,
    init: EmbeddingInit,
    rng: &mut Rng,
) -> Result<()> {
    match init {
        EmbeddingInit::TorchRecDefault => {
            let a = (1.0 / (num_rows.max(1) as f64).sqrt()) as f32;
            for x in rows.iter_mut() {
                *x = rng.random_range(-a..=a);
            }
        }
        EmbeddingInit::Uniform { low, high } => {
            // Written so that NaN bounds are rejected too; the width must be finite to draw.
            if low
                .partial_cmp(&high)
                .is_none_or(|o| o == std::cmp::Ordering::Greater)
                || !(high - low).is_finite()
            {
                return Err(Error::invalid(
                    OP,
                    format!("uniform init needs finite low ≤ high, got {low}..{high}"),
                ));
            }
            for x in rows.iter_mut() {
                *x = rng.random_range(low..=high);
            }
        }
        EmbeddingInit::Normal { std } => {
            if !(std.is_finite() && std >= 0.0) {
                return Err(Error::invalid(
                    OP,
                    format!("normal init needs a finite std ≥ 0, got {std}"),
                ));
            }
            let normal = Normal::new(0.0f32, std)
                .map_err(|e| Error::invalid(OP, format!("normal init: {e}")))?;
            for x in rows.iter_mut() {
                *x = normal.sample(rng);
            }
        }
        EmbeddingInit::Constant { value } => {
            if !value.is_finite() {
                return Err(Error::invalid(
                    OP,
                    format!("constant init needs a finite value, got {value}"),
                ));
            }
            rows.fill(value)
        }
    }
    Ok(())
}

/// A fresh number for a TBE (training or quantized), which the batches it prepares carry.
pub(crate) fn next_operator_id() -> usize {
    static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// A batch checked against a TBE's tables and copied to their device
/// ([`TableBatchedEmbedding::prepare`], [`QuantizedTableBatchedEmbedding::prepare`](crate::embedding::QuantizedTableBatchedEmbedding::prepare));
/// only that operator takes it.
pub struct TbeBatch {
    /// The preparing operator's number.
    pub(crate) owner: usize,
    pub(crate) batch: Batch<'static>,
    /// The batch's copy on the tables' device (device tables).
    pub(crate) on_device: Option<DeviceBatch>,
    /// The batch admitted to the cache (cached tables): its rows stay cached until it drops.
    pub(crate) cached: Option<CachedBatch>,
}

impl std::fmt::Debug for TbeBatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TbeBatch")
            .field("batch_size", &self.batch.batch_size)
            .field("ids", &self.batch.ids.len())
            .field("on_device", &self.on_device.is_some())
            .finish()
    }
}

/// What [`TableBatchedEmbedding::backward_batch`] returns besides the updated tables.
#[derive(Debug)]
pub struct TbeGradients {
    /// The per-sample weights' gradient (in the caller's positions), when the batch has
    /// weights.
    pub per_sample_weights: Option<Tensor>,
    /// Each table's row-sparse gradient, with [`FusedOptimizer::None`].
    pub sparse: Option<Vec<RowSparseGrad>>,
}

/// Autograd node of [`TableBatchedEmbedding::forward`]: runs the fused update.
struct TbeBackward {
    tbe: TableBatchedEmbedding,
    batch: TbeBatch,
    /// Where the per-sample weights live, when given (their gradient goes there).
    weights_device: Option<Device>,
    /// How many sparse sinks the forward recorded as inputs.
    sinks: usize,
}

impl BackwardOp for TbeBackward {
    fn name(&self) -> &'static str {
        "table_batched_embedding"
    }

    fn backward(&self, grad_output: &Tensor) -> Result<Vec<Option<Gradient>>> {
        let grads = self.tbe.backward_batch(&self.batch, grad_output)?;
        let mut out = Vec::new();
        if let Some(device) = self.weights_device {
            let g = match grads.per_sample_weights {
                Some(g) => g.to_device(device)?,
                None => {
                    let batch = &self.batch.batch;
                    let n = (batch.kept.as_ref()).map_or(batch.ids.len(), |k| k.1);
                    Tensor::try_zeros(&[n], DType::F32, device)?
                }
            };
            out.push(Some(Gradient::Dense(g)));
        }
        match grads.sparse {
            Some(per_table) if per_table.len() == self.sinks => {
                out.extend(per_table.into_iter().map(|g| Some(Gradient::RowSparse(g))));
            }
            _ => out.extend((0..self.sinks).map(|_| None)),
        }
        Ok(out)
    }
}
