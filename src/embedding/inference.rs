//! [`QuantizedTableBatchedEmbedding`]: the inference TBE (FBGEMM's
//! `IntNBitTableBatchedEmbeddingBagsCodegen`). Tables of any [`WeightType`] share one byte
//! buffer, each starting on a 128-byte boundary like FBGEMM's host buffer, rows unpadded; rows
//! are dequantised and accumulated in f32 — on the CPU (the pooling kernels of `tbe/cpu`), or
//! on a CUDA device after [`to_device`](QuantizedTableBatchedEmbedding::to_device) (the
//! kernels of `tbe/cuda`, the host bytes kept as the tables' record).
//!
//! Tables bigger than memory: [`new_cached`](QuantizedTableBatchedEmbedding::new_cached) keeps
//! the stored rows in a row file behind a DRAM cache of the same byte form (the training
//! cache's directories, sizes, policies and counters; read-only, so evictions write nothing).

use half::{bf16, f16};

use super::config::{BoundsCheckMode, PoolingMode, TableSpec, WeightType};
use super::input::{validate, Batch, FeatureBounds, SkipCounter, TbeInput};
use super::quantize::{dequantize_row, quantize_row};
use super::storage::RowBuffer;
use super::tbe::cache::bytes::{ByteCache, GpuShape};
use super::tbe::cache::store::StoreTable;
use super::tbe::cache::{CacheConfig, CacheStats};
use super::tbe::cpu::pool::{
    forward_new, pooled_forward, sequence_forward, with_quant_rows, FeatureSlot, PoolFeature,
    VisitFeature,
};
use super::tbe::cuda::{DeviceBatch, DeviceTables, FeatureLayout};
use super::tbe::{next_operator_id, TableBatchedEmbedding, TbeBatch};
use crate::{DType, Device, Error, Result, Tensor};

/// Element type of an inference TBE's output.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum OutputDType {
    /// f32 (the accumulation type).
    #[default]
    F32,
    /// IEEE half, rounded from the f32 result.
    F16,
    /// bfloat16, rounded from the f32 result.
    Bf16,
}

/// Byte alignment of each table's start in the buffer (FBGEMM's host layout).
pub const TABLE_ALIGNMENT: usize = 128;

const OP: &str = "QuantizedTableBatchedEmbedding";

/// Inference table-batched embedding bags over quantised rows.
pub struct QuantizedTableBatchedEmbedding {
    tables: Vec<TableSpec>,
    weight_types: Vec<WeightType>,
    feature_table_map: Vec<usize>,
    feature_names: Vec<String>,
    pooling: PoolingMode,
    output_dtype: OutputDType,
    bounds_check: BoundsCheckMode,
    byte_offsets: Vec<usize>,
    rows: Rows,
    slots: Vec<FeatureSlot>,
    out_stride: usize,
    skips: SkipCounter,
    /// The rows' copy on a CUDA device, where lookups then run.
    on_device: Option<DeviceTables>,
    /// This operator's number (prepared batches carry it).
    id: usize,
}

/// Where an inference TBE's stored rows live.
enum Rows {
    /// One host buffer, tables at [`TABLE_ALIGNMENT`] boundaries (`byte_offsets`).
    Resident(RowBuffer<u8>),
    /// A row file behind a DRAM cache.
    Cached(Box<ByteCache>),
}

impl std::fmt::Debug for QuantizedTableBatchedEmbedding {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct(OP)
            .field("tables", &self.tables)
            .field("weight_types", &self.weight_types)
            .field("pooling", &self.pooling)
            .finish()
    }
}

impl QuantizedTableBatchedEmbedding {
    /// An operator with all-zero row bytes; `tables[t]` is stored as `weight_types[t]`.
    pub fn new(
        tables: Vec<TableSpec>,
        weight_types: Vec<WeightType>,
        feature_table_map: Vec<usize>,
        pooling: PoolingMode,
    ) -> Result<Self> {
        Self::build(tables, weight_types, feature_table_map, pooling, None)
    }

    /// An operator whose all-zero stored rows live in the row file `cache.path` (created or
    /// replaced; anonymous host memory when the path is empty) behind a DRAM cache of
    /// `cache.size` with `cache.policy`: tables far bigger than memory, the hot rows served
    /// from DRAM. Fill it in chunks with [`quantize_rows_from`](Self::quantize_rows_from) or
    /// [`set_rows_bytes`](Self::set_rows_bytes); lookups give exactly what the same rows in
    /// memory give, and [`cache_stats`](Self::cache_stats) counts hits and misses. Lookups
    /// run on the host, or, after [`to_device`](Self::to_device) to a GPU, with the cache in
    /// the GPU's memory.
    pub fn new_cached(
        tables: Vec<TableSpec>,
        weight_types: Vec<WeightType>,
        feature_table_map: Vec<usize>,
        pooling: PoolingMode,
        cache: &CacheConfig,
    ) -> Result<Self> {
        Self::build(
            tables,
            weight_types,
            feature_table_map,
            pooling,
            Some(cache),
        )
    }

    fn build(
        tables: Vec<TableSpec>,
        weight_types: Vec<WeightType>,
        feature_table_map: Vec<usize>,
        pooling: PoolingMode,
        cache: Option<&CacheConfig>,
    ) -> Result<Self> {
        if tables.is_empty() || tables.len() != weight_types.len() {
            return Err(Error::invalid(
                OP,
                format!(
                    "{} tables and {} weight types (need one type per table, at least one table)",
                    tables.len(),
                    weight_types.len()
                ),
            ));
        }
        if feature_table_map.is_empty() {
            return Err(Error::invalid(OP, "at least one feature is needed"));
        }
        let mut byte_offsets = Vec::with_capacity(tables.len() + 1);
        let mut end = 0usize;
        for (t, (spec, ty)) in tables.iter().zip(&weight_types).enumerate() {
            if spec.dim == 0 {
                return Err(Error::invalid(
                    OP,
                    format!("table {t} `{}` has dim 0 (dims must be ≥ 1)", spec.name),
                ));
            }
            // Every size is checked: a dim or row count near usize::MAX must be an error,
            // not a wrapped offset.
            let too_large = || {
                Error::invalid(
                    OP,
                    format!(
                        "table {t} `{}` ({} rows × dim {} of {ty:?}) is past any memory, with \
                         the tables before it",
                        spec.name, spec.rows, spec.dim
                    ),
                )
            };
            let start = end
                .checked_next_multiple_of(TABLE_ALIGNMENT)
                .ok_or_else(too_large)?;
            byte_offsets.push(start);
            end = (ty.checked_row_bytes(spec.dim))
                .and_then(|rb| spec.rows.checked_mul(rb))
                .and_then(|bytes| start.checked_add(bytes))
                .filter(|&e| e <= isize::MAX as usize)
                .ok_or_else(too_large)?;
        }
        byte_offsets.push(end);
        for (f, &t) in feature_table_map.iter().enumerate() {
            if t >= tables.len() {
                return Err(Error::invalid(
                    OP,
                    format!(
                        "feature {f} maps to table {t}, but there are {} tables",
                        tables.len()
                    ),
                ));
            }
        }
        let dims: Vec<usize> = feature_table_map.iter().map(|&t| tables[t].dim).collect();
        if pooling == PoolingMode::None && dims.iter().any(|&d| d != dims[0]) {
            return Err(Error::invalid(
                OP,
                format!("pooling NONE needs one dim for every feature, got {dims:?}"),
            ));
        }
        let mut slots = Vec::new();
        let mut col = 0;
        for &dim in &dims {
            slots.push(FeatureSlot { col, dim });
            col = col.checked_add(dim).ok_or_else(|| {
                Error::invalid(
                    OP,
                    format!("the output row of dims {dims:?} is past any memory"),
                )
            })?;
        }
        let out_stride = if pooling == PoolingMode::None {
            dims[0]
        } else {
            col
        };
        let rows = match cache {
            None => Rows::Resident(RowBuffer::zeros(end)?),
            Some(cache) => {
                let shapes: Vec<(usize, usize)> = (tables.iter().zip(&weight_types))
                    .map(|(s, ty)| (s.rows, ty.row_bytes(s.dim)))
                    .collect();
                let names: Vec<String> = tables.iter().map(|s| s.name.clone()).collect();
                Rows::Cached(Box::new(ByteCache::create(cache, &shapes, &names)?))
            }
        };
        Ok(QuantizedTableBatchedEmbedding {
            feature_names: (0..feature_table_map.len())
                .map(|f| format!("f{f}"))
                .collect(),
            tables,
            weight_types,
            feature_table_map,
            pooling,
            output_dtype: OutputDType::F32,
            bounds_check: BoundsCheckMode::Error,
            rows,
            byte_offsets,
            slots,
            out_stride,
            skips: SkipCounter::default(),
            on_device: None,
            id: next_operator_id(),
        })
    }

    /// Quantises a trained FP32 TBE: table `t` becomes `weight_types[t]`; same features and
    /// pooling.
    pub fn from_trained(tbe: &TableBatchedEmbedding, weight_types: &[WeightType]) -> Result<Self> {
        Self::quantized_from(tbe, weight_types, None)
    }

    /// [`from_trained`](Self::from_trained) into a cached operator
    /// ([`new_cached`](Self::new_cached): the quantized rows in the row file `cache.path`
    /// behind a DRAM cache of `cache.size`): the trained tables — in memory, on a device or
    /// themselves cached in a file — are read and quantized a chunk of rows at a time, so
    /// neither copy is ever held whole. Lookups equal those of [`from_trained`](Self::from_trained)'s
    /// operator, bit for bit.
    pub fn from_trained_cached(
        tbe: &TableBatchedEmbedding,
        weight_types: &[WeightType],
        cache: &CacheConfig,
    ) -> Result<Self> {
        Self::quantized_from(tbe, weight_types, Some(cache))
    }

    /// The operator of [`from_trained`](Self::from_trained) (its rows in memory, or cached as
    /// `cache` says), filled a chunk of rows at a time.
    fn quantized_from(
        tbe: &TableBatchedEmbedding,
        weight_types: &[WeightType],
        cache: Option<&CacheConfig>,
    ) -> Result<Self> {
        let cfg = tbe.config();
        let mut q = Self::build(
            cfg.tables.clone(),
            weight_types.to_vec(),
            cfg.feature_table_map.clone(),
            cfg.pooling,
            cache,
        )?;
        if let Some(names) = &cfg.feature_names {
            q.feature_names = names.clone();
        }
        q.bounds_check = cfg.bounds_check;
        for (t, spec) in cfg.tables.iter().enumerate() {
            // About 4 MiB of FP32 rows at a time.
            let chunk = ((1usize << 20) / spec.dim).max(1);
            tbe.for_each_weight_chunk(t, chunk, |first, rows| {
                q.quantize_rows_from(t, first, rows)
            })?;
        }
        Ok(q)
    }

    /// The same operator producing `dtype` outputs.
    pub fn with_output_dtype(mut self, dtype: OutputDType) -> Self {
        self.output_dtype = dtype;
        self
    }

    /// The same operator with another bounds-check mode.
    pub fn with_bounds_check(mut self, mode: BoundsCheckMode) -> Self {
        self.bounds_check = mode;
        self
    }

    /// The same operator with named features (for messages).
    pub fn with_feature_names(mut self, names: Vec<String>) -> Result<Self> {
        if names.len() != self.feature_table_map.len() {
            return Err(Error::invalid(
                OP,
                format!(
                    "{} feature names for {} features",
                    names.len(),
                    self.feature_table_map.len()
                ),
            ));
        }
        self.feature_names = names;
        Ok(self)
    }

    /// The tables.
    pub fn tables(&self) -> &[TableSpec] {
        &self.tables
    }

    /// Storage type of each table.
    pub fn weight_types(&self) -> &[WeightType] {
        &self.weight_types
    }

    /// Table of each feature.
    pub fn feature_table_map(&self) -> &[usize] {
        &self.feature_table_map
    }

    /// Pooling mode.
    pub fn pooling(&self) -> PoolingMode {
        self.pooling
    }

    /// Byte offset of each table in the buffer (FBGEMM's `weights_physical_offsets`).
    pub fn table_byte_offsets(&self) -> &[usize] {
        &self.byte_offsets[..self.tables.len()]
    }

    /// Bytes of the whole row buffer as allocated (of a cached operator: its cache rows and
    /// directories; the row file is not memory).
    pub fn allocated_bytes(&self) -> usize {
        match &self.rows {
            Rows::Resident(data) => data.allocated_bytes(),
            Rows::Cached(cache) => cache.allocated_bytes(),
        }
    }

    /// A cached operator's counters per table (FBGEMM's cache statistics); `None` when the
    /// rows are in memory.
    pub fn cache_stats(&self) -> Option<Vec<CacheStats>> {
        match &self.rows {
            Rows::Resident(_) => None,
            Rows::Cached(cache) => Some(cache.stats()),
        }
    }

    /// Zeroes a cached operator's counters (nothing otherwise).
    pub fn reset_cache_stats(&self) {
        if let Rows::Cached(cache) = &self.rows {
            cache.reset_stats();
        }
    }

    /// Flushes a cached operator's row file to the disk (nothing when the rows are in memory).
    pub fn sync_rows(&self) -> Result<()> {
        match &self.rows {
            Rows::Resident(_) => Ok(()),
            Rows::Cached(cache) => cache.sync(),
        }
    }

    /// Ids skipped so far by [`BoundsCheckMode::WarnAndSkip`].
    pub fn bounds_check_warnings(&self) -> u64 {
        self.skips
            .skipped
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    fn table_range(&self, t: usize) -> Result<std::ops::Range<usize>> {
        let spec = self.tables.get(t).ok_or_else(|| {
            Error::invalid(
                OP,
                format!("table {t} does not exist ({} tables)", self.tables.len()),
            )
        })?;
        let start = self.byte_offsets[t];
        Ok(start..start + spec.rows * self.weight_types[t].row_bytes(spec.dim))
    }

    /// Where lookups run.
    pub fn device(&self) -> Device {
        match (&self.on_device, &self.rows) {
            (Some(d), _) => Device::Cuda(d.device().ordinal()),
            (None, Rows::Cached(cache)) => cache.device(),
            (None, Rows::Resident(_)) => Device::Cpu,
        }
    }

    /// Makes lookups run on `device`: the rows are copied there (the host bytes stay as the
    /// tables' record, for [`table_bytes`](Self::table_bytes) and checkpoints). Outputs are
    /// then tensors on that device. A cached operator's cache moves there instead (its
    /// directory and cache rows; the row file stays where it is): on a GPU, FBGEMM's
    /// `MANAGED_CACHING` for inference — the cache in the GPU's memory, the rows in the file
    /// or, with [`CacheConfig::in_host_memory`](crate::embedding::CacheConfig::in_host_memory),
    /// in host memory the GPU reads in place.
    pub fn to_device(&mut self, device: Device) -> Result<()> {
        let gpu = match device {
            Device::Cpu => None,
            Device::Cuda(_) => Some(crate::cuda::open(device)?),
        };
        if let Rows::Cached(cache) = &mut self.rows {
            let shape = GpuShape {
                dims: self.tables.iter().map(|s| s.dim).collect(),
                types: self.weight_types.clone(),
                feature_table_map: self.feature_table_map.clone(),
                pooling: self.pooling,
            };
            return cache.move_to(gpu, shape);
        }
        self.on_device = gpu.map(|d| self.device_tables(d)).transpose()?;
        Ok(())
    }

    /// A cached operator whose cache is on a GPU: its cache.
    fn gpu_cache(&self) -> Option<&ByteCache> {
        match &self.rows {
            Rows::Cached(cache) if cache.on_gpu() => Some(cache),
            _ => None,
        }
    }

    /// A device copy of the rows with the per-feature layout the kernels read.
    fn device_tables(
        &self,
        device: std::sync::Arc<crate::cuda::CudaDevice>,
    ) -> Result<DeviceTables> {
        let ftm = &self.feature_table_map;
        let rows: Vec<usize> = self.tables.iter().map(|s| s.rows).collect();
        let dims: Vec<usize> = self.tables.iter().map(|s| s.dim).collect();
        let layout = FeatureLayout::of_tables(ftm, &self.byte_offsets, &rows, &dims, self.pooling);
        let types: Vec<WeightType> = ftm.iter().map(|&t| self.weight_types[t]).collect();
        let Rows::Resident(data) = &self.rows else {
            unreachable!("a cached operator's lookups run on its cache");
        };
        DeviceTables::quantized(device, layout, data, &types)
    }

    /// After the host bytes changed: a fresh device copy, if lookups run on a device.
    fn refresh_device(&mut self) -> Result<()> {
        if let Some(d) = &self.on_device {
            self.on_device = Some(self.device_tables(d.device().clone())?);
        }
        Ok(())
    }

    /// Table `t`'s stored rows, back to back (`rows × row_bytes`; of a cached operator, its
    /// row file's mapping).
    pub fn table_bytes(&self, t: usize) -> Result<&[u8]> {
        let range = self.table_range(t)?;
        Ok(match &self.rows {
            Rows::Resident(data) => &data[range],
            Rows::Cached(cache) => cache.table_bytes(t)?,
        })
    }

    /// Whether the rows are in a file behind a cache (tables that may exceed memory).
    pub(crate) fn is_cached(&self) -> bool {
        matches!(self.rows, Rows::Cached(_))
    }

    /// Replaces every row of a cached operator's tables with what `fill(bytes, layout)` writes
    /// into a staged copy of its row file (table `t`'s row `r` at `layout[t].offset +
    /// r · layout[t].record_bytes`): all of them, or on any error none.
    pub(crate) fn replace_cached_rows(
        &mut self,
        fill: impl FnOnce(&mut [u8], &[StoreTable]) -> Result<()>,
    ) -> Result<()> {
        let Rows::Cached(cache) = &mut self.rows else {
            return Err(Error::invalid(OP, "the tables are not cached in a file"));
        };
        let staged = cache.stage_rows(fill)?;
        cache.commit_rows(staged)?;
        self.refresh_device()
    }

    /// Overwrites table `t`'s stored rows with raw bytes in its row layout.
    pub fn set_table_bytes(&mut self, t: usize, bytes: &[u8]) -> Result<()> {
        let range = self.table_range(t)?;
        if bytes.len() != range.len() {
            return Err(Error::invalid(
                OP,
                format!(
                    "table {t} `{}` takes {} bytes, {} given",
                    self.tables[t].name,
                    range.len(),
                    bytes.len()
                ),
            ));
        }
        self.set_rows_bytes(t, 0, bytes)
    }

    /// Overwrites rows `first..` of table `t` with raw bytes in its row layout (a whole number
    /// of rows): tables bigger than memory are filled a chunk at a time.
    pub fn set_rows_bytes(&mut self, t: usize, first: usize, bytes: &[u8]) -> Result<()> {
        let range = self.table_range(t)?;
        let (spec, rb) = (
            &self.tables[t],
            self.weight_types[t].row_bytes(self.tables[t].dim),
        );
        let n = bytes.len() / rb;
        if bytes.len() % rb != 0 || first.checked_add(n).is_none_or(|end| end > spec.rows) {
            return Err(Error::invalid(
                OP,
                format!(
                    "table {t} `{}` has {} rows of {rb} bytes; {} bytes from row {first} do not \
                     fit it in whole rows",
                    spec.name,
                    spec.rows,
                    bytes.len()
                ),
            ));
        }
        match &mut self.rows {
            Rows::Resident(data) => {
                let at = range.start + first * rb;
                data[at..at + bytes.len()].copy_from_slice(bytes);
            }
            Rows::Cached(cache) => cache.write_rows(t, first, bytes)?,
        }
        self.refresh_device()
    }

    /// Quantises FP32 rows (`[rows, dim]` row-major) into table `t`.
    pub fn quantize_table_from(&mut self, t: usize, values: &[f32]) -> Result<()> {
        self.table_range(t)?;
        let spec = &self.tables[t];
        if values.len() != spec.rows * spec.dim {
            return Err(Error::invalid(
                OP,
                format!(
                    "table {t} `{}` is {}×{}, {} values given",
                    spec.name,
                    spec.rows,
                    spec.dim,
                    values.len()
                ),
            ));
        }
        self.quantize_rows_from(t, 0, values)
    }

    /// Quantises FP32 rows (`[n, dim]` row-major) into rows `first..first + n` of table `t`:
    /// tables bigger than memory are filled a chunk at a time.
    pub fn quantize_rows_from(&mut self, t: usize, first: usize, values: &[f32]) -> Result<()> {
        self.table_range(t)?;
        let (spec, ty) = (&self.tables[t], self.weight_types[t]);
        if values.len() % spec.dim != 0 {
            return Err(Error::invalid(
                OP,
                format!(
                    "table {t} `{}` has dim {}: {} values are not whole rows",
                    spec.name,
                    spec.dim,
                    values.len()
                ),
            ));
        }
        let row_bytes = ty.row_bytes(spec.dim);
        let mut bytes = vec![0u8; values.len() / spec.dim * row_bytes];
        for (r, (src, dst)) in (values.chunks_exact(spec.dim))
            .zip(bytes.chunks_exact_mut(row_bytes))
            .enumerate()
        {
            quantize_row(ty, src, dst)
                .and_then(|()| check_storable(ty, src, dst))
                .map_err(|e| {
                    Error::invalid(
                        OP,
                        format!("table {t} `{}` row {}: {e}", spec.name, first + r),
                    )
                })?;
        }
        self.set_rows_bytes(t, first, &bytes)
    }

    /// Table `t` dequantised to FP32, `[rows, dim]` row-major.
    pub fn dequantize_table(&self, t: usize) -> Result<Vec<f32>> {
        let bytes = self.table_bytes(t)?;
        let (spec, ty) = (&self.tables[t], self.weight_types[t]);
        let mut out = vec![0.0f32; spec.rows * spec.dim];
        if spec.rows > 0 {
            for (src, dst) in bytes
                .chunks_exact(ty.row_bytes(spec.dim))
                .zip(out.chunks_exact_mut(spec.dim))
            {
                dequantize_row(ty, src, dst)?;
            }
        }
        Ok(out)
    }

    fn validate_input<'a>(&self, input: TbeInput<'a>) -> Result<Batch<'a>> {
        let bounds: Vec<FeatureBounds<'_>> = self
            .feature_table_map
            .iter()
            .enumerate()
            .map(|(f, &t)| FeatureBounds {
                rows: self.tables[t].rows,
                feature: &self.feature_names[f],
                table: &self.tables[t].name,
            })
            .collect();
        let sequence = self.pooling == PoolingMode::None;
        validate(OP, input, &bounds, self.bounds_check, sequence, &self.skips)
    }

    /// Checks `input` against the tables and copies it to the device lookups run on: a batch
    /// ready for [`lookup_batch`](Self::lookup_batch), as often as wanted.
    pub fn prepare(&self, input: TbeInput<'_>) -> Result<TbeBatch> {
        let batch = self.validate_input(input)?.into_owned();
        let on_device = (self.on_device.as_ref())
            .map(|d| DeviceBatch::upload(d.device(), &batch))
            .transpose()?;
        Ok(TbeBatch {
            owner: self.id,
            batch,
            on_device,
            cached: None,
        })
    }

    /// The lookup of a prepared batch: `[B, ΣD]` (or `[N, D]` with pooling NONE) in the output
    /// dtype, on the device lookups run on.
    pub fn lookup_batch(&self, batch: &TbeBatch) -> Result<Tensor> {
        if batch.owner != self.id {
            return Err(Error::invalid(
                OP,
                "the batch was prepared by another operator",
            ));
        }
        let out = match (&self.on_device, &batch.on_device) {
            (Some(d), Some(on_device)) => d.forward(on_device)?,
            (None, None) if self.gpu_cache().is_some() => {
                self.gpu_cache().unwrap().forward_on_device(&batch.batch)?
            }
            (None, None) => {
                let (out, shape) = self.forward_f32(&batch.batch)?;
                return match self.output_dtype {
                    OutputDType::F32 => Tensor::from_vec(out, &shape),
                    OutputDType::F16 => Tensor::from_vec(
                        out.iter().map(|&x| f16::from_f32(x)).collect::<Vec<_>>(),
                        &shape,
                    ),
                    OutputDType::Bf16 => Tensor::from_vec(
                        out.iter().map(|&x| bf16::from_f32(x)).collect::<Vec<_>>(),
                        &shape,
                    ),
                };
            }
            _ => {
                return Err(Error::invalid(
                    OP,
                    "the lookups moved to another device since the batch was prepared",
                ))
            }
        };
        match self.output_dtype {
            OutputDType::F32 => Ok(out),
            OutputDType::F16 => out.to_dtype(DType::F16),
            OutputDType::Bf16 => out.to_dtype(DType::BF16),
        }
    }

    /// The lookup: `[B, ΣD]` (or `[N, D]` with pooling NONE) in the output dtype, on the
    /// device lookups run on.
    pub fn forward(&self, input: TbeInput<'_>) -> Result<Tensor> {
        self.lookup_batch(&self.prepare(input)?)
    }

    /// The lookup into a caller-provided f32 buffer (no allocation); `out` must hold
    /// `B × ΣD` values (pooled modes only).
    pub fn forward_into(&self, input: TbeInput<'_>, out: &mut [f32]) -> Result<()> {
        let batch = self.validate_input(input)?;
        batch.check_pooled_buffer(OP, self.pooling, self.out_stride, out.len())?;
        let values = match (&self.on_device, self.gpu_cache()) {
            (Some(d), _) => d.forward(&DeviceBatch::upload(d.device(), &batch)?)?,
            (None, Some(cache)) => cache.forward_on_device(&batch)?,
            (None, None) => return self.pool_into(&batch, out),
        };
        out.copy_from_slice(&values.to_vec::<f32>()?);
        Ok(())
    }

    /// The host lookup into `out`.
    fn pool_into(&self, batch: &Batch<'_>, out: &mut [f32]) -> Result<()> {
        self.with_host_rows(batch, |b, rows_of| {
            let visit = self.visit(rows_of);
            if self.pooling == PoolingMode::None {
                sequence_forward(b, self.out_stride, out, &visit);
            } else {
                pooled_forward(b, &self.slots, self.pooling, out, self.out_stride, &visit);
            }
        })
    }

    /// `lookup(batch, rows_of)` over the host rows: the resident rows, or the cache rows with
    /// the batch admitted (a cached operator's only fallible step) and its ids remapped to them.
    fn with_host_rows<R>(
        &self,
        batch: &Batch<'_>,
        lookup: impl for<'r> FnOnce(&Batch<'_>, &'r (dyn Fn(usize) -> &'r [u8] + Sync)) -> R,
    ) -> Result<R> {
        match &self.rows {
            Rows::Resident(data) => {
                let rows_of =
                    |t: usize| &data[self.table_range(t).expect("a table of the operator")];
                Ok(lookup(batch, &rows_of))
            }
            Rows::Cached(cache) => cache.with_admitted(batch, &self.feature_table_map, lookup),
        }
    }

    /// Hands the kernels feature `f`'s table, table `t`'s rows being `rows_of(t)`.
    fn visit<'s, 'r>(
        &'s self,
        rows_of: &'r (dyn Fn(usize) -> &'r [u8] + Sync),
    ) -> impl VisitFeature + use<'s, 'r> {
        move |f: usize, k: &mut dyn FnMut(&dyn PoolFeature)| {
            let t = self.feature_table_map[f];
            let ty = self.weight_types[t];
            with_quant_rows(ty, rows_of(t), ty.row_bytes(self.tables[t].dim), k)
        }
    }

    fn forward_f32(&self, batch: &Batch<'_>) -> Result<(Vec<f32>, Vec<usize>)> {
        let rows = batch.output_rows(self.pooling);
        // A new buffer the kernels write once, never zero-filled first.
        let out = self.with_host_rows(batch, |b, rows_of| {
            forward_new(
                b,
                &self.slots,
                self.pooling,
                self.out_stride,
                &self.visit(rows_of),
            )
        })?;
        Ok((out, vec![rows, self.out_stride]))
    }
}

/// Whether a row quantized into `row` (from `values`) reads back finite: its values are
/// finite, and for INT8/INT4/INT2 its FP16 scale and bias too, for FP16 every value within
/// FP16's range. `quantize_row` stores what FBGEMM stores (checked against the golden
/// values: an infinite FP16 value or header for a range past ±65504, a NaN coded as the
/// row's minimum); an operator refuses such rows, which would give NaN or infinite lookups.
fn check_storable(ty: WeightType, values: &[f32], row: &[u8]) -> Result<()> {
    if let Some(j) = values.iter().position(|x| !x.is_finite()) {
        return Err(Error::invalid(
            OP,
            format!("value {j} is {}: rows to quantize are finite", values[j]),
        ));
    }
    let finite = match ty {
        WeightType::Int8 | WeightType::Int4 | WeightType::Int2 => {
            let (scale, bias) = super::quantize::row_scale_bias(row);
            scale.is_finite() && bias.is_finite()
        }
        WeightType::Fp16 => {
            (row.chunks_exact(2)).all(|b| half::f16::from_le_bytes([b[0], b[1]]).is_finite())
        }
        WeightType::Bf16 => {
            (row.chunks_exact(2)).all(|b| half::bf16::from_le_bytes([b[0], b[1]]).is_finite())
        }
        _ => true,
    };
    if !finite {
        let (lo, hi) = super::quantize::row_min_max(values);
        return Err(Error::invalid(
            OP,
            format!(
                "the row's values span [{lo}, {hi}]: stored as {} they read back infinite or \
                 NaN (past FP16's ±65504)",
                ty.fbgemm_name()
            ),
        ));
    }
    Ok(())
}
