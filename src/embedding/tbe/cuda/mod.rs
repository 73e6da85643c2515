//! The TBE's device half: tables (FP32 rows with their optimizer state, or FBGEMM's quantized
//! row bytes) in a CUDA device's memory, the per-feature layout the kernels read, the forward
//! kernels of `kernels/tbe_forward*.cu` (`forward.rs`) and the fused backward of
//! `kernels/tbe_backward.cu` (`backward.rs`). Inputs are validated on the host first (the same
//! pass as the CPU's), so a lookup never needs a read-back; the kernels still skip an
//! out-of-range id rather than read outside a table.

pub(crate) mod backward;
pub(crate) mod forward;
pub(crate) mod records;

use std::sync::Arc;

use parking_lot::Mutex;

pub(crate) use backward::BackwardInput;

use crate::cuda::{CudaDevice, DeviceBuffer, DeviceElem};
use crate::embedding::config::{PoolingMode, WeightType};
use crate::embedding::input::{Batch, Ids};
use crate::error::{Error, Result};

/// The weights of [`DeviceTables`]: FP32 rows or FBGEMM's quantized row bytes.
#[allow(clippy::large_enum_variant)] // one per TBE: boxing would buy nothing
enum Weights {
    F32(DeviceBuffer<f32>),
    Quantized {
        bytes: DeviceBuffer<u8>,
        /// Per feature: bytes of one row, and the kernel's code of its weight type.
        row_bytes: DeviceBuffer<i32>,
        types: DeviceBuffer<i32>,
        /// When every table holds FP16 (or every one BF16) rows: the typed pooled kernel
        /// (no per-value type switch) and the features' table offsets in 2-byte elements.
        half: Option<(&'static str, DeviceBuffer<i64>)>,
    },
}

/// Per feature, what the kernels read about its table and its output slot.
pub(crate) struct FeatureLayout {
    /// Element (FP32) or byte (quantized) offset of the feature's table in the weights.
    pub table_offsets: Vec<i64>,
    /// Rows of the feature's table.
    pub rows: Vec<i64>,
    /// Dim of the feature's table.
    pub dims: Vec<i32>,
    /// Number of the first row of the feature's table among all tables' rows.
    pub row_starts: Vec<i64>,
    /// Rows of all tables together.
    pub total_rows: usize,
    /// Every table's dim (the vectorised kernels need all of them multiples of 4).
    pub table_dims: Vec<usize>,
    pub pooling: PoolingMode,
}

impl FeatureLayout {
    /// The layout of tables given per table — where each starts (`offsets`), its rows and
    /// dim — as read by features `feature_table_map`.
    pub(crate) fn of_tables(
        feature_table_map: &[usize],
        offsets: &[usize],
        rows: &[usize],
        dims: &[usize],
        pooling: PoolingMode,
    ) -> Self {
        let mut row_starts = vec![0i64; rows.len()];
        for t in 1..rows.len() {
            row_starts[t] = row_starts[t - 1] + rows[t - 1] as i64;
        }
        let ftm = feature_table_map;
        FeatureLayout {
            table_offsets: ftm.iter().map(|&t| offsets[t] as i64).collect(),
            rows: ftm.iter().map(|&t| rows[t] as i64).collect(),
            dims: ftm.iter().map(|&t| dims[t] as i32).collect(),
            row_starts: ftm.iter().map(|&t| row_starts[t]).collect(),
            total_rows: rows.iter().sum(),
            table_dims: dims.to_vec(),
            pooling,
        }
    }
}

/// A TBE's tables in device memory, with the layout the kernels read.
pub(crate) struct DeviceTables {
    device: Arc<CudaDevice>,
    weights: Weights,
    table_offsets: DeviceBuffer<i64>,
    rows: DeviceBuffer<i64>,
    dims: DeviceBuffer<i32>,
    out_offsets: DeviceBuffer<i32>,
    row_starts: DeviceBuffer<i64>,
    /// Per feature: rows of its table.
    host_rows: Vec<i64>,
    host_dims_max: usize,
    total_rows: usize,
    out_stride: usize,
    mean: bool,
    /// Unpooled (PoolingMode::None): one output row per id.
    sequence: bool,
    /// The FP32 pooled lookups use `tbe_forward_f32_v4` (16-byte loads).
    vectorized: bool,
    /// The optimizer's state buffers ([`FusedOptimizer::state_buffers`](crate::embedding::FusedOptimizer::state_buffers))
    /// over every table: per-row state indexed by row number, per-element state laid out as
    /// the weights.
    state: Vec<DeviceBuffer<f32>>,
    /// The first out-of-range position a lookup met (`i64::MAX`: none); inputs are validated
    /// on the host, so it stays unset.
    first_bad: Mutex<DeviceBuffer<i64>>,
}

/// The kernel's code of a weight type (see `kernels/tbe_forward_quantized.cu`).
fn type_code(ty: WeightType) -> i32 {
    match ty {
        WeightType::Fp32 => 0,
        WeightType::Fp16 => 1,
        WeightType::Bf16 => 2,
        WeightType::Fp8 => 3,
        WeightType::Fp8E4m3fn => 4,
        WeightType::Int8 => 5,
        WeightType::Int4 => 6,
        WeightType::Int2 => 7,
    }
}

/// A device buffer holding `host`, at least one element long (no zero-sized allocations).
fn upload<T: DeviceElem + Default>(
    device: &Arc<CudaDevice>,
    host: &[T],
) -> Result<DeviceBuffer<T>> {
    if host.is_empty() {
        return device.htod(&[T::default()]);
    }
    device.htod(host)
}

/// [`upload`] into managed memory ([`CudaDevice::managed_zeros`]).
fn upload_managed(device: &Arc<CudaDevice>, host: &[f32]) -> Result<DeviceBuffer<f32>> {
    let mut b = device.managed_zeros::<f32>(host.len().max(1))?;
    if !host.is_empty() {
        b.copy_from_host(host)?;
    }
    Ok(b)
}

impl DeviceTables {
    fn build(device: Arc<CudaDevice>, weights: Weights, l: FeatureLayout) -> Result<Self> {
        let sequence = l.pooling == PoolingMode::None;
        let mut out_offsets = Vec::with_capacity(l.dims.len());
        let mut stride = 0;
        for &d in &l.dims {
            out_offsets.push(stride);
            stride += d;
        }
        let out_stride = if sequence {
            let d0 = l.dims.first().copied().unwrap_or(0);
            if l.dims.iter().any(|&d| d != d0) {
                return Err(Error::invalid(
                    "TableBatchedEmbedding",
                    format!(
                        "pooling NONE needs one dim for every feature, got {:?}",
                        l.dims
                    ),
                ));
            }
            d0 as usize
        } else {
            stride as usize
        };
        // Every table's dim a multiple of 4 keeps every table (and output slice) 16-byte
        // aligned, unused tables included.
        let vectorized = matches!(weights, Weights::F32(_))
            && l.table_dims.iter().all(|&d| d % 4 == 0 && d <= 512);
        Ok(DeviceTables {
            table_offsets: upload(&device, &l.table_offsets)?,
            rows: upload(&device, &l.rows)?,
            dims: upload(&device, &l.dims)?,
            out_offsets: upload(&device, &out_offsets)?,
            row_starts: upload(&device, &l.row_starts)?,
            host_dims_max: l.dims.iter().copied().max().unwrap_or(0) as usize,
            host_rows: l.rows,
            total_rows: l.total_rows,
            out_stride,
            mean: l.pooling == PoolingMode::Mean,
            sequence,
            vectorized,
            weights,
            state: Vec::new(),
            first_bad: Mutex::new(device.htod(&[i64::MAX])?),
            device,
        })
    }

    /// FP32 tables (`weights`, all tables back to back) and optimizer state buffers `state`
    /// copied to `device`: into its memory, or `managed` memory the host keeps and the
    /// device's kernels read and write in place (FBGEMM's `MANAGED` placement).
    pub(crate) fn f32(
        device: Arc<CudaDevice>,
        layout: FeatureLayout,
        weights: &[f32],
        state: &[&[f32]],
        managed: bool,
    ) -> Result<Self> {
        let put = |host: &[f32]| match managed {
            true => upload_managed(&device, host),
            false => upload(&device, host),
        };
        let w = put(weights)?;
        let state = (state.iter()).map(|s| put(s)).collect::<Result<Vec<_>>>()?;
        let mut tables = Self::build(device, Weights::F32(w), layout)?;
        tables.state = state;
        Ok(tables)
    }

    /// FP32 tables of zeros with zero optimizer state (`state_lens` values per buffer) made on
    /// the device (in its memory, or `managed` memory), without a host copy.
    pub(crate) fn f32_zeros(
        device: Arc<CudaDevice>,
        layout: FeatureLayout,
        elements: usize,
        state_lens: &[usize],
        managed: bool,
    ) -> Result<Self> {
        let zeros = |n: usize| match managed {
            true => device.managed_zeros::<f32>(n.max(1)),
            false => device.zeros::<f32>(n.max(1)),
        };
        let w = zeros(elements)?;
        let state = (state_lens.iter())
            .map(|&n| zeros(n))
            .collect::<Result<Vec<_>>>()?;
        let mut tables = Self::build(device, Weights::F32(w), layout)?;
        tables.state = state;
        Ok(tables)
    }

    /// Quantized rows (`bytes`, FBGEMM's row layout; `layout.table_offsets` in bytes) of
    /// `feature_types[f]` per feature `f`, copied to `device`.
    pub(crate) fn quantized(
        device: Arc<CudaDevice>,
        layout: FeatureLayout,
        bytes: &[u8],
        feature_types: &[WeightType],
    ) -> Result<Self> {
        let bytes = upload(&device, bytes)?;
        Self::quantized_in(device, layout, bytes, feature_types)
    }

    /// As [`quantized`](Self::quantized), over rows already in device memory.
    pub(crate) fn quantized_in(
        device: Arc<CudaDevice>,
        layout: FeatureLayout,
        bytes: DeviceBuffer<u8>,
        feature_types: &[WeightType],
    ) -> Result<Self> {
        let row_bytes: Vec<i32> = (feature_types.iter().zip(&layout.dims))
            .map(|(ty, &d)| ty.row_bytes(d as usize) as i32)
            .collect();
        let types: Vec<i32> = feature_types.iter().map(|&t| type_code(t)).collect();
        let all = |ty: WeightType| feature_types.iter().all(|&t| t == ty);
        let half_kernel = if all(WeightType::Fp16) {
            Some("tbe_forward_f16")
        } else if all(WeightType::Bf16) {
            Some("tbe_forward_bf16")
        } else {
            None
        };
        let half = match half_kernel {
            Some(kernel) => {
                let elements: Vec<i64> = layout.table_offsets.iter().map(|&b| b / 2).collect();
                Some((kernel, upload(&device, &elements)?))
            }
            None => None,
        };
        let weights = Weights::Quantized {
            bytes,
            row_bytes: upload(&device, &row_bytes)?,
            types: upload(&device, &types)?,
            half,
        };
        Self::build(device, weights, layout)
    }

    /// The quantized rows' bytes (`None` for FP32 tables).
    pub(crate) fn quantized_bytes(&self) -> Option<&DeviceBuffer<u8>> {
        match &self.weights {
            Weights::Quantized { bytes, .. } => Some(bytes),
            Weights::F32(_) => None,
        }
    }

    /// The device the tables live on.
    pub(crate) fn device(&self) -> &Arc<CudaDevice> {
        &self.device
    }

    /// Bytes of device memory the weights and state hold.
    pub(crate) fn allocated_bytes(&self) -> usize {
        let weights = match &self.weights {
            Weights::F32(w) => w.bytes(),
            Weights::Quantized { bytes, .. } => bytes.bytes(),
        };
        weights + self.state.iter().map(DeviceBuffer::bytes).sum::<usize>()
    }

    /// Chooses between the FP32 pooled lookup kernels: 16-byte loads (`true`, the default
    /// where every dim is a multiple of 4 and at most 512) or one float per lane. Returns
    /// whether the vectorized kernel is now in use.
    pub(crate) fn set_vectorized(&mut self, on: bool, table_dims: &[usize]) -> bool {
        let allowed = matches!(self.weights, Weights::F32(_))
            && table_dims.iter().all(|&d| d % 4 == 0 && d <= 512);
        self.vectorized = on && allowed;
        self.vectorized
    }

    fn f32_weights(&self) -> Result<&DeviceBuffer<f32>> {
        match &self.weights {
            Weights::F32(w) => Ok(w),
            Weights::Quantized { .. } => Err(Error::invalid(
                "TableBatchedEmbedding",
                "the device tables hold quantized rows, not FP32 ones",
            )),
        }
    }

    /// The FP32 weights `range` (elements), copied back.
    pub(crate) fn read_weights(&self, range: std::ops::Range<usize>) -> Result<Vec<f32>> {
        read_range(self.f32_weights()?, range)
    }

    /// Overwrites FP32 weights from element `start` on with `values`.
    pub(crate) fn write_weights(&self, start: usize, values: &[f32]) -> Result<()> {
        write_range(self.f32_weights()?, start, values)
    }

    /// Elements `range` of optimizer state buffer `i`, copied back.
    pub(crate) fn read_state(&self, i: usize, range: std::ops::Range<usize>) -> Result<Vec<f32>> {
        read_range(self.state_buffer(i)?, range)
    }

    /// Overwrites optimizer state buffer `i` from element `start` on with `values`.
    pub(crate) fn write_state(&self, i: usize, start: usize, values: &[f32]) -> Result<()> {
        write_range(self.state_buffer(i)?, start, values)
    }

    fn state_buffer(&self, i: usize) -> Result<&DeviceBuffer<f32>> {
        self.state.get(i).ok_or_else(|| {
            Error::invalid(
                "TableBatchedEmbedding",
                format!("the device tables have no optimizer state buffer {i}"),
            )
        })
    }
}

/// Elements `range` of `buffer`, copied back.
fn read_range(buffer: &DeviceBuffer<f32>, range: std::ops::Range<usize>) -> Result<Vec<f32>> {
    let mut out = vec![0.0f32; range.len()];
    let bytes: &mut [u8] = bytemuck_f32_mut(&mut out);
    buffer.device().read_bytes(buffer, range.start * 4, bytes)?;
    Ok(out)
}

/// Overwrites `buffer` from element `start` on with `values`.
fn write_range(buffer: &DeviceBuffer<f32>, start: usize, values: &[f32]) -> Result<()> {
    // SAFETY: f32 values viewed as their bytes.
    let bytes = unsafe {
        std::slice::from_raw_parts(values.as_ptr() as *const u8, std::mem::size_of_val(values))
    };
    buffer.device().write_bytes(buffer, start * 4, bytes)
}

fn bytemuck_f32_mut(v: &mut [f32]) -> &mut [u8] {
    // SAFETY: every byte pattern is a valid f32; the slice covers exactly the values.
    unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr() as *mut u8, std::mem::size_of_val(v)) }
}

/// A validated batch's inputs in device memory.
pub(crate) struct DeviceBatch {
    pub ids: DeviceBuffer<i64>,
    pub offsets: DeviceBuffer<i64>,
    pub weights: Option<DeviceBuffer<f32>>,
    pub batch_size: usize,
    pub num_ids: usize,
}

impl DeviceBatch {
    /// The inputs of `batch` (validated on the host) copied to `device`.
    pub(crate) fn upload(device: &Arc<CudaDevice>, batch: &Batch<'_>) -> Result<Self> {
        // 64-bit ids go up from where they are (no host copy).
        let ids = match &batch.ids {
            Ids::I64(ids) => upload(device, ids)?,
            Ids::I32(ids) => upload(
                device,
                &ids.iter().map(|&i| i64::from(i)).collect::<Vec<_>>(),
            )?,
        };
        let offsets: Vec<i64> = batch.offsets.iter().map(|&o| o as i64).collect();
        Ok(DeviceBatch {
            num_ids: batch.ids.len(),
            ids,
            offsets: device.htod(&offsets)?,
            weights: (batch.weights.as_deref())
                .map(|w| upload(device, w))
                .transpose()?,
            batch_size: batch.batch_size,
        })
    }

    /// Replaces the per-sample weights (`None`: none).
    pub(crate) fn set_weights(&mut self, weights: Option<&[f32]>) -> Result<()> {
        let device = self.offsets.device().clone();
        self.weights = weights.map(|w| upload(&device, w)).transpose()?;
        Ok(())
    }
}
