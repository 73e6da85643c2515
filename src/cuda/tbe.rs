//! Table-batched embedding bags on a GPU: a device copy of a CPU TBE's FP32 tables (or of a
//! quantized TBE's rows), the forward kernels of `kernels/tbe_forward*.cu` and the fused
//! backward of `kernels/tbe_backward.cu` (every [`FusedOptimizer`] but `None`, with
//! [`WeightDecay`], the same update rules as the CPU TBE).
//!
//! Inputs and outputs are device buffers ([`DeviceBuffer`]); [`CudaTbe::forward_host`] wraps the
//! copies for tests and small callers. An out-of-range id is never read: the kernel records
//! the first bad position and the call returns an error naming feature, bag and id.

use std::sync::Arc;

use super::{CudaDevice, DeviceBuffer, KernelArgs, LaunchConfig};
use crate::embedding::{
    bias_corrections, FusedOptimizer, PoolingMode, QuantizedTableBatchedEmbedding, SparseTableGrad,
    StateShape, TableBatchedEmbedding, WeightDecay, WeightType,
};
use crate::{Error, Result};

const OP: &str = "CudaTbe";

/// The weights of a [`CudaTbe`]: FP32 rows or FBGEMM's quantized row bytes.
#[allow(clippy::large_enum_variant)] // one per TBE: boxing would buy nothing
enum Weights {
    F32(DeviceBuffer<f32>),
    Quantized {
        bytes: DeviceBuffer<u8>,
        row_bytes: DeviceBuffer<i32>,
        types: DeviceBuffer<i32>,
        /// When every table holds FP16 (or every one BF16) rows: the typed pooled kernel
        /// (`tbe_forward_f16`/`_bf16`, no per-value type switch) and the features' table
        /// offsets in 2-byte elements.
        half: Option<(&'static str, DeviceBuffer<i64>)>,
    },
}

/// A pooled TBE whose tables live on a GPU.
pub struct CudaTbe {
    device: Arc<CudaDevice>,
    weights: Weights,
    /// Per feature: element (FP32) or byte (quantized) offset of its table.
    table_offsets: DeviceBuffer<i64>,
    rows: DeviceBuffer<i64>,
    dims: DeviceBuffer<i32>,
    out_offsets: DeviceBuffer<i32>,
    host_rows: Vec<i64>,
    host_dims_max: usize,
    /// First out-of-range position seen by any lookup since the last check (`i64::MAX`: none).
    first_bad: parking_lot::Mutex<DeviceBuffer<i64>>,
    feature_names: Vec<String>,
    /// Per feature: its table.
    feature_tables: Vec<usize>,
    /// Per table: rows and dim.
    table_shapes: Vec<(usize, usize)>,
    out_stride: usize,
    mean: bool,
    /// Unpooled (PoolingMode::None): one output row per id.
    sequence: bool,
    /// The FP32 pooled lookups use `tbe_forward_f32_v4` (16-byte loads).
    vectorized: bool,
    /// Training state (FP32 tables only).
    train: Option<TrainState>,
}

/// What the fused backward needs beyond the forward's layout.
struct TrainState {
    optimizer: FusedOptimizer,
    decay: WeightDecay,
    /// Backward calls so far (Adam's bias correction), as the CPU TBE's `step`.
    step: u64,
    /// Per feature: number of the first row of its table among all tables' rows.
    row_starts: DeviceBuffer<i64>,
    /// The optimizer's state buffers ([`FusedOptimizer::state_buffers`]) over every table:
    /// per-row state indexed by row number, per-element state laid out as the weights.
    state: Vec<DeviceBuffer<f32>>,
    /// Per table: (first element, rows, dim, first row), for reading tables back.
    tables: Vec<(usize, usize, usize, usize)>,
}

/// Table `t`'s slice of a state buffer of shape `shape`.
fn state_range(shape: StateShape, table: (usize, usize, usize, usize)) -> std::ops::Range<usize> {
    let (start, rows, dim, first_row) = table;
    match shape {
        StateShape::PerRow => first_row..first_row + rows,
        StateShape::PerElement => start..start + rows * dim,
    }
}

/// Refuses the optimizers the fused GPU backward does not run.
fn check_optimizer(optimizer: FusedOptimizer) -> Result<()> {
    if optimizer == FusedOptimizer::None {
        return Err(Error::invalid(
            OP,
            "with_optimizer needs a fused optimizer (tables without one give row-sparse \
             gradients through backward_sparse)",
        ));
    }
    optimizer.validate()
}

/// Per-feature layout shared by both weight kinds.
struct Layout {
    table_offsets: Vec<i64>,
    rows: Vec<i64>,
    dims: Vec<i32>,
    out_offsets: Vec<i32>,
    out_stride: usize,
    feature_tables: Vec<usize>,
    table_shapes: Vec<(usize, usize)>,
}

fn layout(
    feature_table_map: &[usize],
    table_starts: &[i64],
    rows: &[usize],
    dims: &[usize],
) -> Layout {
    let mut out_offsets = Vec::with_capacity(feature_table_map.len());
    let mut stride = 0;
    for &t in feature_table_map {
        out_offsets.push(stride as i32);
        stride += dims[t];
    }
    Layout {
        table_offsets: feature_table_map.iter().map(|&t| table_starts[t]).collect(),
        rows: feature_table_map.iter().map(|&t| rows[t] as i64).collect(),
        dims: feature_table_map.iter().map(|&t| dims[t] as i32).collect(),
        out_offsets,
        out_stride: stride,
        feature_tables: feature_table_map.to_vec(),
        table_shapes: rows.iter().copied().zip(dims.iter().copied()).collect(),
    }
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

impl CudaTbe {
    fn build(
        device: Arc<CudaDevice>,
        weights: Weights,
        mut l: Layout,
        names: Vec<String>,
        pooling: PoolingMode,
    ) -> Result<Self> {
        let mean = pooling == PoolingMode::Mean;
        let sequence = pooling == PoolingMode::None;
        if sequence {
            let d0 = l.dims.first().copied().unwrap_or(0);
            if l.dims.iter().any(|&d| d != d0) {
                return Err(Error::invalid(
                    OP,
                    format!(
                        "pooling NONE needs one dim for every feature, got {:?}",
                        l.dims
                    ),
                ));
            }
            l.out_stride = d0 as usize;
        }
        // Every table's dim a multiple of 4 keeps every table (and output slice) 16-byte
        // aligned, unused tables included.
        let vectorized = matches!(weights, Weights::F32(_))
            && l.table_shapes.iter().all(|&(_, d)| d % 4 == 0 && d <= 512);
        Ok(CudaTbe {
            sequence,
            vectorized,
            weights,
            table_offsets: device.htod(&l.table_offsets)?,
            rows: device.htod(&l.rows)?,
            dims: device.htod(&l.dims)?,
            out_offsets: device.htod(&l.out_offsets)?,
            host_dims_max: l.dims.iter().copied().max().unwrap_or(0) as usize,
            host_rows: l.rows,
            first_bad: parking_lot::Mutex::new(device.htod(&[i64::MAX])?),
            feature_names: names,
            feature_tables: l.feature_tables,
            table_shapes: l.table_shapes,
            out_stride: l.out_stride,
            mean,
            train: None,
            device,
        })
    }

    /// A GPU copy of a training TBE's FP32 tables (same features, pooling), its fused
    /// optimizer, weight decay, optimizer state and step count (a TBE without a fused
    /// optimizer gives a forward-only copy).
    pub fn from_trained(tbe: &TableBatchedEmbedding, device: Arc<CudaDevice>) -> Result<Self> {
        let cfg = tbe.config();
        let mut flat = Vec::new();
        let mut starts = Vec::new();
        for t in 0..cfg.tables.len() {
            starts.push(flat.len() as i64);
            flat.extend_from_slice(&tbe.table_weights(t)?);
        }
        let rows: Vec<usize> = cfg.tables.iter().map(|s| s.rows).collect();
        let dims: Vec<usize> = cfg.tables.iter().map(|s| s.dim).collect();
        let l = layout(&cfg.feature_table_map, &starts, &rows, &dims);
        let names = cfg.feature_names.clone().unwrap_or_else(|| {
            (0..cfg.feature_table_map.len())
                .map(|f| format!("feature {f}"))
                .collect()
        });
        let weights = Weights::F32(device.htod(&flat)?);
        let mut gpu = Self::build(device, weights, l, names, cfg.pooling)?;
        // Training state: row numbering across tables and the optimizer's state buffers
        // (none without a fused optimizer: a forward-only copy).
        if cfg.optimizer == FusedOptimizer::None {
            return Ok(gpu);
        }
        let mut tables = Vec::new();
        let mut first_row = 0;
        for (t, spec) in cfg.tables.iter().enumerate() {
            tables.push((starts[t] as usize, spec.rows, spec.dim, first_row));
            first_row += spec.rows;
        }
        let mut state = Vec::new();
        for i in 0..cfg.optimizer.state_buffers().len() {
            let mut host = Vec::new();
            for t in 0..cfg.tables.len() {
                host.extend_from_slice(&tbe.optimizer_state(i, t)?);
            }
            host.push(0.0); // never empty
            state.push(gpu.device.htod(&host)?);
        }
        gpu.train = Some(TrainState::new(
            &gpu,
            cfg.optimizer,
            cfg.weight_decay,
            tbe.step(),
            state,
            tables,
        )?);
        Ok(gpu)
    }

    /// Makes FP32 tables trainable on the device with `optimizer` and `decay` (state buffers
    /// start at zero, step 0), e.g. for tables made by [`zeros`](Self::zeros).
    pub fn with_optimizer(mut self, optimizer: FusedOptimizer, decay: WeightDecay) -> Result<Self> {
        check_optimizer(optimizer)?;
        if !matches!(self.weights, Weights::F32(_)) {
            return Err(Error::invalid(OP, "only FP32 tables train"));
        }
        let tables = self.table_layout();
        let (first_row, start) = tables
            .last()
            .map_or((0, 0), |&(s, r, d, f)| (f + r, s + r * d));
        let state = (optimizer.state_buffers().iter())
            .map(|&(_, shape)| match shape {
                StateShape::PerRow => self.device.zeros::<f32>(first_row + 1),
                StateShape::PerElement => self.device.zeros::<f32>(start + 1),
            })
            .collect::<Result<Vec<_>>>()?;
        self.train = Some(TrainState::new(&self, optimizer, decay, 0, state, tables)?);
        Ok(self)
    }

    /// Per table: (first element, rows, dim, first row among all tables' rows).
    fn table_layout(&self) -> Vec<(usize, usize, usize, usize)> {
        let mut tables = Vec::new();
        let (mut first_row, mut start) = (0usize, 0usize);
        for &(r, d) in &self.table_shapes {
            tables.push((start, r, d, first_row));
            first_row += r;
            start += r * d;
        }
        tables
    }

    /// True when the tables train with a fused optimizer ([`backward`](Self::backward));
    /// false for tables whose backward is [`backward_sparse`](Self::backward_sparse).
    pub fn has_fused_optimizer(&self) -> bool {
        self.train
            .as_ref()
            .is_some_and(|t| t.optimizer != FusedOptimizer::None)
    }

    /// Backward calls so far (none: 0); a copy from [`from_trained`](Self::from_trained)
    /// continues the CPU TBE's count.
    pub fn step(&self) -> u64 {
        self.train.as_ref().map_or(0, |t| t.step)
    }

    /// Fused backward on device buffers (FP32 tables made by
    /// [`from_trained`](Self::from_trained) or [`with_optimizer`](Self::with_optimizer), any
    /// fused optimizer and weight decay): `grad_output` is the
    /// `[B, out_stride]` gradient of the last forward's output for the same `indices`,
    /// `offsets` and weights. Each row's gradient is summed once in a fixed order (sort by
    /// row, then position) and the row updated in place: deterministic. With `weights_grad`
    /// (per-sample weights given), each occurrence's per-sample-weight gradient is written
    /// there (row before the update · its output gradient, / bag length with mean pooling; 0
    /// for out-of-range ids).
    pub fn backward(
        &mut self,
        indices: &DeviceBuffer<i64>,
        offsets: &DeviceBuffer<i64>,
        per_sample_weights: Option<&DeviceBuffer<f32>>,
        grad_output: &DeviceBuffer<f32>,
        batch_size: usize,
        weights_grad: Option<&mut DeviceBuffer<f32>>,
    ) -> Result<()> {
        if !Arc::ptr_eq(grad_output.device(), &self.device) {
            return Err(Error::invalid(OP, "the gradient is on another device"));
        }
        // SAFETY: the address and length are those of a live buffer on this device.
        unsafe {
            self.backward_raw(
                indices,
                offsets,
                per_sample_weights,
                grad_output.ptr(),
                grad_output.len(),
                batch_size,
                weights_grad,
            )
        }
    }

    /// [`backward`](Self::backward) with the gradient given by its device address and length.
    ///
    /// # Safety
    /// `grad_output` must address `grad_len` f32 values on this TBE's device that stay
    /// allocated until the queued work has run.
    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn backward_raw(
        &mut self,
        indices: &DeviceBuffer<i64>,
        offsets: &DeviceBuffer<i64>,
        per_sample_weights: Option<&DeviceBuffer<f32>>,
        grad_output: u64,
        grad_len_given: usize,
        batch_size: usize,
        weights_grad: Option<&mut DeviceBuffer<f32>>,
    ) -> Result<()> {
        // SAFETY: per this function's contract.
        unsafe {
            self.backward_inner(
                indices,
                offsets,
                per_sample_weights,
                grad_output,
                grad_len_given,
                batch_size,
                weights_grad,
                false,
            )
        }
        .map(|_| ())
    }

    /// The backward of a TBE without a fused optimizer (a [`from_trained`](Self::from_trained)
    /// copy of one, or tables from [`zeros`](Self::zeros)): the tables stay as they are and
    /// each table's row-sparse gradient comes back — its distinct rows, sorted, and their
    /// summed gradients, as the CPU TBE's [`sparse_gradient`](TableBatchedEmbedding::sparse_gradient).
    /// Arguments as [`backward`](Self::backward). Reads the number of distinct rows back, so
    /// it waits for the device.
    pub fn backward_sparse(
        &mut self,
        indices: &DeviceBuffer<i64>,
        offsets: &DeviceBuffer<i64>,
        per_sample_weights: Option<&DeviceBuffer<f32>>,
        grad_output: &DeviceBuffer<f32>,
        batch_size: usize,
        weights_grad: Option<&mut DeviceBuffer<f32>>,
    ) -> Result<Vec<SparseTableGrad>> {
        if !Arc::ptr_eq(grad_output.device(), &self.device) {
            return Err(Error::invalid(OP, "the gradient is on another device"));
        }
        // SAFETY: the address and length are those of a live buffer on this device.
        unsafe {
            self.backward_sparse_raw(
                indices,
                offsets,
                per_sample_weights,
                grad_output.ptr(),
                grad_output.len(),
                batch_size,
                weights_grad,
            )
        }
    }

    /// [`backward_sparse`](Self::backward_sparse) with the gradient given by its device
    /// address and length.
    ///
    /// # Safety
    /// As [`backward_raw`](Self::backward_raw).
    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn backward_sparse_raw(
        &mut self,
        indices: &DeviceBuffer<i64>,
        offsets: &DeviceBuffer<i64>,
        per_sample_weights: Option<&DeviceBuffer<f32>>,
        grad_output: u64,
        grad_len: usize,
        batch_size: usize,
        weights_grad: Option<&mut DeviceBuffer<f32>>,
    ) -> Result<Vec<SparseTableGrad>> {
        if self.train.is_none() && matches!(self.weights, Weights::F32(_)) {
            let tables = self.table_layout();
            self.train = Some(TrainState::new(
                self,
                FusedOptimizer::None,
                WeightDecay::None,
                0,
                Vec::new(),
                tables,
            )?);
        }
        // SAFETY: per this function's contract.
        let grads = unsafe {
            self.backward_inner(
                indices,
                offsets,
                per_sample_weights,
                grad_output,
                grad_len,
                batch_size,
                weights_grad,
                true,
            )?
        };
        Ok(grads.expect("the sparse mode returns the gradients"))
    }

    /// [`backward_sparse`](Self::backward_sparse) on host slices: the per-table gradients and,
    /// with per-sample weights, their gradient.
    pub fn backward_sparse_host(
        &mut self,
        indices: &[i64],
        offsets: &[i64],
        per_sample_weights: Option<&[f32]>,
        grad_output: &[f32],
    ) -> Result<(Vec<SparseTableGrad>, Option<Vec<f32>>)> {
        let mut u = self.upload_backward(indices, offsets, per_sample_weights, grad_output)?;
        let grads = self.backward_sparse(
            &u.indices,
            &u.offsets,
            u.weights.as_ref(),
            &u.grad,
            u.batch,
            u.weights_grad.as_mut(),
        )?;
        Ok((grads, u.weights_grad.map(|g| g.to_host()).transpose()?))
    }

    /// A host backward's inputs checked and on the device, with room for the per-sample
    /// weights' gradient when there are weights.
    fn upload_backward(
        &self,
        indices: &[i64],
        offsets: &[i64],
        per_sample_weights: Option<&[f32]>,
        grad_output: &[f32],
    ) -> Result<BackwardUpload> {
        let batch = self.check_host_input(indices, offsets, per_sample_weights)?;
        let weights = per_sample_weights
            .map(|w| self.device.htod(w))
            .transpose()?;
        let weights_grad = weights
            .as_ref()
            .map(|w| self.device.alloc::<f32>(w.len()))
            .transpose()?;
        Ok(BackwardUpload {
            batch,
            indices: self.device.htod(indices)?,
            offsets: self.device.htod(offsets)?,
            grad: self.device.htod(grad_output)?,
            weights,
            weights_grad,
        })
    }

    /// The fused (`sparse` false) or row-sparse backward.
    ///
    /// # Safety
    /// As [`backward_raw`](Self::backward_raw).
    #[allow(clippy::too_many_arguments)]
    unsafe fn backward_inner(
        &mut self,
        indices: &DeviceBuffer<i64>,
        offsets: &DeviceBuffer<i64>,
        per_sample_weights: Option<&DeviceBuffer<f32>>,
        grad_output: u64,
        grad_len_given: usize,
        batch_size: usize,
        mut weights_grad: Option<&mut DeviceBuffer<f32>>,
        sparse: bool,
    ) -> Result<Option<Vec<SparseTableGrad>>> {
        let train =
            match self.train.as_ref() {
                Some(t) if sparse == (t.optimizer == FusedOptimizer::None) => t,
                _ if sparse => return Err(Error::invalid(
                    OP,
                    "backward_sparse is for FP32 tables without a fused optimizer (these update \
                     themselves in backward)",
                )),
                _ => {
                    return Err(Error::invalid(
                        OP,
                        "backward needs FP32 tables with a fused optimizer (from_trained of a TBE \
                     with one, or with_optimizer; without one, backward_sparse)",
                    ))
                }
            };
        let Weights::F32(weights) = &self.weights else {
            return Err(Error::invalid(OP, "backward needs FP32 tables"));
        };
        if self.host_dims_max > 512 {
            return Err(Error::invalid(
                OP,
                "dims above 512 are not supported by the GPU backward",
            ));
        }
        let f = self.host_rows.len();
        let grad_len = self.output_len(batch_size, indices.len());
        if offsets.len() != f * batch_size + 1 || grad_len_given < grad_len {
            return Err(Error::invalid(
                OP,
                format!(
                    "expected {} offsets and a gradient of {grad_len} values, got {} and {}",
                    f * batch_size + 1,
                    offsets.len(),
                    grad_len_given
                ),
            ));
        }
        if per_sample_weights.is_some_and(|w| w.len() < indices.len()) {
            return Err(Error::invalid(
                OP,
                "one per-sample weight per index is needed",
            ));
        }
        if let Some(g) = weights_grad.as_deref_mut() {
            if per_sample_weights.is_none() || g.len() < indices.len() {
                return Err(Error::invalid(
                    OP,
                    format!(
                        "a per-sample-weight gradient needs per-sample weights and room for {} \
                         values (got {})",
                        indices.len(),
                        g.len()
                    ),
                ));
            }
            if !Arc::ptr_eq(g.device(), &self.device) {
                return Err(Error::invalid(
                    OP,
                    "the weight gradient is on another device",
                ));
            }
            g.fill_zero()?;
        }
        let n = indices.len();
        if n >= 1 << 24 {
            return Err(Error::invalid(
                OP,
                format!("{n} ids: the GPU backward takes at most 2^24 − 1 per batch"),
            ));
        }
        let step = train.step + 1;
        if n == 0 {
            let empty = sparse.then(|| split_sparse(&train.tables, &[], &[], 0));
            self.train.as_mut().expect("checked above").step = step;
            return Ok(empty);
        }
        let device = &self.device;
        let keys = device.alloc::<u64>(n)?;
        // When nothing needs an occurrence's position (pooled, no per-sample weights, no weight
        // gradient) the keys carry its bag instead and the bag_of table is not needed.
        let key_is_bag = !self.sequence
            && per_sample_weights.is_none()
            && weights_grad.is_none()
            && f * batch_size < 1 << 24;
        let bag_of = if key_is_bag {
            None
        } else {
            Some(device.alloc::<i32>(n)?)
        };
        let (bi, fi) = (batch_size as i32, f as i32);
        let mut args = KernelArgs::new();
        args.buffer(indices)
            .buffer(offsets)
            .i32(bi)
            .i32(fi)
            .buffer(&train.row_starts)
            .buffer(&self.rows)
            .buffer(&keys)
            .opt_buffer(bag_of.as_ref())
            .i32(i32::from(key_is_bag));
        // SAFETY: arguments as in kernels/tbe_backward.cu; keys and (unless key_is_bag, when
        // bags < 2^24) bag_of have n entries, offsets F·B+1 (checked above).
        unsafe {
            device.launch(
                "tbe_backward_keys",
                LaunchConfig::warp_per_item(f * batch_size, 8),
                &mut args,
            )?
        };
        // Sort by the row bits: enough bits that the all-ones pattern (the key of an
        // out-of-range id) lies above every row number.
        let total_rows = train.tables.last().map_or(0, |t| t.3 + t.1) as u64;
        if total_rows >= 1 << 40 {
            return Err(Error::invalid(
                OP,
                format!("{total_rows} rows: the GPU backward numbers at most 2^40 rows"),
            ));
        }
        let keys = super::sort::radix_sort_u64(keys, 24, 64 - total_rows.leading_zeros())?;
        let mut args = KernelArgs::new();
        args.buffer(&keys)
            .i64(n as i64)
            .opt_buffer(bag_of.as_ref())
            .i32(i32::from(key_is_bag))
            .buffer(offsets)
            .i32(bi)
            .opt_buffer(per_sample_weights)
            .i32(i32::from(self.mean))
            .i32(i32::from(self.sequence))
            .pointer(grad_output)
            .i32(self.out_stride as i32)
            .buffer(&self.out_offsets)
            .buffer(&self.dims)
            .buffer(&self.table_offsets)
            .buffer(&train.row_starts)
            .buffer(weights);
        let h = Hyper::of(train.optimizer, train.decay, step);
        let m2 = train.state.get(1).or(train.state.first());
        args.opt_buffer(train.state.first())
            .opt_buffer(m2)
            .i32(if sparse { 7 } else { h.code })
            .f32(h.lr)
            .f32(h.eps)
            .f32(h.beta1)
            .f32(h.beta2)
            .f32(h.correction1)
            .f32(h.correction2)
            .i32(h.decay)
            .f32(h.lambda)
            .opt_buffer(weights_grad.as_deref());
        let sparse_out = if sparse {
            Some(self.sparse_slots(&keys, n)?)
        } else {
            None
        };
        match &sparse_out {
            Some((slots, rows_out, values_out, max_dim, _)) => args
                .buffer(slots)
                .buffer(rows_out)
                .buffer(values_out)
                .i32(*max_dim as i32),
            None => args
                .opt_buffer::<i64>(None)
                .opt_buffer::<i64>(None)
                .opt_buffer::<f32>(None)
                .i32(0),
        };
        // SAFETY: arguments as in kernels/tbe_backward.cu; the state buffers have the shapes
        // the optimizer code reads (per row: every row number; per element: as the weights);
        // every row is written by one warp; in sparse mode every distinct row has its slot
        // below the outputs' row count.
        unsafe {
            // Tables of dims up to 128 take the variant with 4 values per lane (fewer registers,
            // more warps in flight).
            let kernel = if self.host_dims_max <= 128 {
                "tbe_backward_update_d128"
            } else {
                "tbe_backward_update"
            };
            device.launch(kernel, LaunchConfig::warp_per_item(n, 4), &mut args)?
        };
        let train = self.train.as_mut().expect("checked above");
        train.step = step;
        let Some((_, rows_out, values_out, max_dim, distinct)) = sparse_out else {
            return Ok(None);
        };
        let (rows, values) = (rows_out.to_host()?, values_out.to_host()?);
        Ok(Some(split_sparse(
            &train.tables,
            &rows[..distinct],
            &values[..distinct * max_dim],
            max_dim,
        )))
    }

    /// The distinct rows of sorted `keys` (n of them): per key its slot among the distinct
    /// rows, and zeroed outputs for their numbers and `[rows, max_dim]` gradients. Reads the
    /// count back (waits for the device): (slots, rows, values, max_dim, distinct rows).
    #[allow(clippy::type_complexity)]
    fn sparse_slots(
        &self,
        keys: &DeviceBuffer<u64>,
        n: usize,
    ) -> Result<(
        DeviceBuffer<i64>,
        DeviceBuffer<i64>,
        DeviceBuffer<f32>,
        usize,
        usize,
    )> {
        let device = &self.device;
        let heads = device.alloc::<i64>(n)?;
        let mut args = KernelArgs::new();
        args.buffer(keys).i64(n as i64).buffer(&heads);
        // SAFETY: keys and heads hold n values.
        unsafe { device.launch("tbe_sparse_heads", LaunchConfig::linear(n, 256), &mut args)? };
        let slots = device.alloc::<i64>(n)?;
        let mut args = KernelArgs::new();
        args.buffer(&heads).buffer(&slots).i64(n as i64);
        // SAFETY: scans n heads into n slots.
        unsafe {
            device.launch(
                "scan_exclusive_i64",
                LaunchConfig::single_block(1024),
                &mut args,
            )?
        };
        let mut last = [0u8; 16];
        device.copy_to_host(&mut last[..8], slots.ptr_at(n - 1))?;
        device.copy_to_host(&mut last[8..], heads.ptr_at(n - 1))?;
        let word = |b: &[u8]| i64::from_le_bytes(b.try_into().expect("8 bytes"));
        let distinct = (word(&last[..8]) + word(&last[8..])) as usize;
        let max_dim = self.host_dims_max;
        let rows_out = device.zeros::<i64>(distinct.max(1))?;
        let values_out = device.zeros::<f32>((distinct * max_dim).max(1))?;
        Ok((slots, rows_out, values_out, max_dim, distinct))
    }

    /// [`backward`](Self::backward) from host memory; returns the per-sample weights'
    /// gradient when weights are given.
    pub fn backward_host(
        &mut self,
        indices: &[i64],
        offsets: &[i64],
        per_sample_weights: Option<&[f32]>,
        grad_output: &[f32],
    ) -> Result<Option<Vec<f32>>> {
        let mut u = self.upload_backward(indices, offsets, per_sample_weights, grad_output)?;
        self.backward(
            &u.indices,
            &u.offsets,
            u.weights.as_ref(),
            &u.grad,
            u.batch,
            u.weights_grad.as_mut(),
        )?;
        u.weights_grad.map(|g| g.to_host()).transpose()
    }

    /// Table `t`'s rows and its optimizer state buffers (in the order of
    /// [`FusedOptimizer::state_buffers`], shaped as the CPU TBE's), copied back to the host.
    pub fn table_state(&self, t: usize) -> Result<(Vec<f32>, Vec<Vec<f32>>)> {
        let Weights::F32(w) = &self.weights else {
            return Err(Error::invalid(OP, "only FP32 tables can be read back"));
        };
        let layout = self.table_layout();
        let (optimizer, state): (FusedOptimizer, &[DeviceBuffer<f32>]) = match &self.train {
            Some(train) => (train.optimizer, &train.state),
            None => (FusedOptimizer::None, &[]),
        };
        let &table = layout
            .get(t)
            .ok_or_else(|| Error::invalid(OP, format!("no table {t}")))?;
        let weights = w.to_host()?[state_range(StateShape::PerElement, table)].to_vec();
        let state = (optimizer.state_buffers().iter())
            .zip(state)
            .map(|(&(_, shape), buf)| Ok(buf.to_host()?[state_range(shape, table)].to_vec()))
            .collect::<Result<Vec<_>>>()?;
        Ok((weights, state))
    }

    /// FP32 tables of zeros made directly on the GPU (no host copy): for benchmarks of tables
    /// larger than host memory wants to hold twice.
    pub fn zeros(
        tables: &[crate::embedding::TableSpec],
        feature_table_map: &[usize],
        pooling: PoolingMode,
        device: Arc<CudaDevice>,
    ) -> Result<Self> {
        if let Some(&t) = feature_table_map.iter().find(|&&t| t >= tables.len()) {
            return Err(Error::invalid(
                OP,
                format!("feature maps to table {t} of {}", tables.len()),
            ));
        }
        let mut starts = Vec::new();
        let mut total = 0usize;
        for spec in tables {
            starts.push(total as i64);
            total += spec.rows * spec.dim;
        }
        let rows: Vec<usize> = tables.iter().map(|s| s.rows).collect();
        let dims: Vec<usize> = tables.iter().map(|s| s.dim).collect();
        let l = layout(feature_table_map, &starts, &rows, &dims);
        let names = (0..feature_table_map.len())
            .map(|f| format!("feature {f}"))
            .collect();
        let weights = Weights::F32(device.zeros::<f32>(total)?);
        Self::build(device, weights, l, names, pooling)
    }

    /// A GPU copy of a quantized TBE's rows (FBGEMM's TBE row bytes, any weight types).
    pub fn from_quantized(
        q: &QuantizedTableBatchedEmbedding,
        device: Arc<CudaDevice>,
    ) -> Result<Self> {
        let mut bytes = Vec::new();
        let mut starts = Vec::new();
        for t in 0..q.tables().len() {
            starts.push(bytes.len() as i64);
            bytes.extend_from_slice(q.table_bytes(t)?);
        }
        let rows: Vec<usize> = q.tables().iter().map(|s| s.rows).collect();
        let dims: Vec<usize> = q.tables().iter().map(|s| s.dim).collect();
        let ftm = q.feature_table_map();
        let l = layout(ftm, &starts, &rows, &dims);
        let row_bytes: Vec<i32> = (ftm.iter())
            .map(|&t| q.weight_types()[t].row_bytes(dims[t]) as i32)
            .collect();
        let types: Vec<i32> = ftm
            .iter()
            .map(|&t| type_code(q.weight_types()[t]))
            .collect();
        let names = (0..ftm.len()).map(|f| format!("feature {f}")).collect();
        let all = |ty: WeightType| q.weight_types().iter().all(|&t| t == ty);
        let half_kernel = if all(WeightType::Fp16) {
            Some("tbe_forward_f16")
        } else if all(WeightType::Bf16) {
            Some("tbe_forward_bf16")
        } else {
            None
        };
        let half = match half_kernel {
            Some(kernel) => {
                let elements: Vec<i64> = l.table_offsets.iter().map(|&b| b / 2).collect();
                Some((kernel, device.htod(&elements)?))
            }
            None => None,
        };
        let weights = Weights::Quantized {
            bytes: device.htod(&bytes)?,
            row_bytes: device.htod(&row_bytes)?,
            types: device.htod(&types)?,
            half,
        };
        Self::build(device, weights, l, names, q.pooling())
    }

    /// Chooses between the FP32 pooled lookup kernels: 16-byte loads (`true`, the default
    /// where every dim is a multiple of 4 and at most 512) or one float per lane. Returns
    /// whether the vectorized kernel is now in use (`false` when the layout does not allow
    /// it). Both give the same sums; the choice is for benchmarks.
    pub fn set_vectorized(&mut self, on: bool) -> bool {
        let allowed = matches!(self.weights, Weights::F32(_))
            && self
                .table_shapes
                .iter()
                .all(|&(_, d)| d % 4 == 0 && d <= 512);
        self.vectorized = on && allowed;
        self.vectorized
    }

    /// The device the tables live on.
    pub fn device(&self) -> &Arc<CudaDevice> {
        &self.device
    }

    /// Output width: `ΣD` of one sample pooled, `D` unpooled.
    pub fn out_stride(&self) -> usize {
        self.out_stride
    }

    /// Pooled lookup on device buffers: `indices` (i64), `offsets` (`F·B + 1`, i64, checked
    /// on the host by the caller or by [`forward_host`](Self::forward_host)), optional
    /// per-sample weights; writes `out` (`B × out_stride` f32). Asynchronous on the device's
    /// stream: out-of-range ids are skipped and remembered on the device;
    /// [`check_ids`](Self::check_ids) (which synchronises) reports them.
    pub fn forward(
        &self,
        indices: &DeviceBuffer<i64>,
        offsets: &DeviceBuffer<i64>,
        per_sample_weights: Option<&DeviceBuffer<f32>>,
        batch_size: usize,
        out: &mut DeviceBuffer<f32>,
    ) -> Result<()> {
        let f = self.host_rows.len();
        let out_len = self.output_len(batch_size, indices.len());
        if out.len() < out_len || offsets.len() != f * batch_size + 1 {
            return Err(Error::invalid(
                OP,
                format!(
                    "expected {} offsets and an output of {out_len} values, got {} and {}",
                    f * batch_size + 1,
                    offsets.len(),
                    out.len()
                ),
            ));
        }
        if per_sample_weights.is_some_and(|w| w.len() < indices.len()) {
            return Err(Error::invalid(
                OP,
                "one per-sample weight per index is needed",
            ));
        }
        let first_bad = self.first_bad.lock();
        let mut args = KernelArgs::new();
        if self.sequence {
            let n = indices.len();
            let kernel = match &self.weights {
                Weights::F32(w) => {
                    args.buffer(w)
                        .buffer(&self.table_offsets)
                        .buffer(&self.rows);
                    "tbe_sequence_f32"
                }
                Weights::Quantized {
                    bytes,
                    row_bytes,
                    types,
                    ..
                } => {
                    args.buffer(bytes)
                        .buffer(&self.table_offsets)
                        .buffer(&self.rows)
                        .buffer(row_bytes)
                        .buffer(types);
                    "tbe_sequence_quantized"
                }
            };
            args.i32(self.out_stride as i32)
                .i32(batch_size as i32)
                .i32(f as i32)
                .buffer(indices)
                .buffer(offsets)
                .opt_buffer(per_sample_weights)
                .i64(n as i64)
                .buffer(out)
                .buffer(&*first_bad);
            if n == 0 {
                return Ok(());
            }
            // SAFETY: arguments as in kernels/tbe_forward*.cu (tbe_sequence_*); offsets F·B+1
            // ending at n (the caller's contract, checked by forward_host), output N·D.
            return unsafe {
                self.device
                    .launch(kernel, LaunchConfig::warp_per_item(n, 4), &mut args)
            };
        }
        let kernel = match &self.weights {
            Weights::F32(w) => {
                args.buffer(w)
                    .buffer(&self.table_offsets)
                    .buffer(&self.rows)
                    .buffer(&self.dims);
                if self.vectorized && self.host_dims_max <= 128 {
                    "tbe_forward_f32_v4_d128"
                } else if self.vectorized {
                    "tbe_forward_f32_v4"
                } else {
                    "tbe_forward_f32"
                }
            }
            Weights::Quantized {
                bytes,
                half: Some((kernel, element_offsets)),
                ..
            } => {
                // SAFETY (of the launch below): FP16/BF16 rows are `2·dim` bytes, so the
                // bytes are the tables' u16 values and the offsets count them.
                args.pointer(bytes.ptr())
                    .buffer(element_offsets)
                    .buffer(&self.rows)
                    .buffer(&self.dims);
                kernel
            }
            Weights::Quantized {
                bytes,
                row_bytes,
                types,
                half: None,
            } => {
                args.buffer(bytes)
                    .buffer(&self.table_offsets)
                    .buffer(&self.rows)
                    .buffer(row_bytes)
                    .buffer(&self.dims)
                    .buffer(types);
                "tbe_forward_quantized"
            }
        };
        args.buffer(&self.out_offsets)
            .i32(self.out_stride as i32)
            .i32(batch_size as i32)
            .i32(f as i32)
            .buffer(indices)
            .buffer(offsets)
            .opt_buffer(per_sample_weights)
            .i32(i32::from(self.mean))
            .buffer(out)
            .buffer(&*first_bad);
        // SAFETY: the arguments follow the kernels' signatures in kernels/tbe_forward*.cu; the
        // sizes were checked above (offsets F·B+1, output B·ΣD, weights per index).
        unsafe {
            self.device.launch(
                kernel,
                LaunchConfig::warp_per_item(f * batch_size, 4),
                &mut args,
            )
        }
    }

    /// Values the output of a lookup holds: `B × ΣD` pooled, `N × D` unpooled.
    pub fn output_len(&self, batch_size: usize, num_ids: usize) -> usize {
        if self.sequence {
            num_ids * self.out_stride
        } else {
            batch_size * self.out_stride
        }
    }

    /// Waits for the lookups so far and fails if any of them met an out-of-range id, naming the
    /// first one (given the inputs of that lookup to describe it); the record is then cleared.
    pub fn check_ids(
        &self,
        indices: &DeviceBuffer<i64>,
        offsets: &DeviceBuffer<i64>,
        batch_size: usize,
    ) -> Result<()> {
        let mut first_bad = self.first_bad.lock();
        let bad = first_bad.to_host()?[0];
        if bad == i64::MAX {
            return Ok(());
        }
        first_bad.copy_from_host(&[i64::MAX])?;
        Err(self.bad_id_error(bad, offsets, indices, batch_size))
    }

    fn bad_id_error(
        &self,
        position: i64,
        offsets: &DeviceBuffer<i64>,
        indices: &DeviceBuffer<i64>,
        batch_size: usize,
    ) -> Error {
        let offs = offsets.to_host().unwrap_or_default();
        let ids = indices.to_host().unwrap_or_default();
        let bag = offs.partition_point(|&o| o <= position).saturating_sub(1);
        let id = ids.get(position as usize).copied().unwrap_or(-1);
        self.out_of_range(id, position as usize, bag, batch_size)
    }

    /// The error for id `id` at `position`, in bag `bag` of a batch of `batch_size`.
    fn out_of_range(&self, id: i64, position: usize, bag: usize, batch_size: usize) -> Error {
        let f = bag / batch_size.max(1);
        Error::invalid(
            OP,
            format!(
                "{}: id {id} at position {position} (bag {bag} of sample {}) is out of range for {} rows",
                self.feature_names.get(f).map_or("?", String::as_str),
                bag % batch_size.max(1),
                self.host_rows.get(f).copied().unwrap_or(0)
            ),
        )
    }

    /// Checks host inputs (offsets form `F·B + 1` entries from 0, never decrease, end at the
    /// number of ids; one weight per id) and returns the batch size.
    fn check_host_input(
        &self,
        indices: &[i64],
        offsets: &[i64],
        per_sample_weights: Option<&[f32]>,
    ) -> Result<usize> {
        let f = self.host_rows.len();
        if offsets.is_empty() || (offsets.len() - 1) % f != 0 {
            return Err(Error::invalid(
                OP,
                format!("{} offsets do not form F·B+1 with F = {f}", offsets.len()),
            ));
        }
        if offsets[0] != 0
            || offsets.windows(2).any(|w| w[1] < w[0])
            || *offsets.last().unwrap() as usize != indices.len()
        {
            return Err(Error::invalid(
                OP,
                "offsets must start at 0, never decrease and end at the number of indices",
            ));
        }
        if per_sample_weights.is_some_and(|w| w.len() != indices.len()) {
            return Err(Error::invalid(
                OP,
                "one per-sample weight per index is needed",
            ));
        }
        Ok((offsets.len() - 1) / f)
    }

    /// Checks a lookup's host inputs completely (as `check_host_input`, and every id in range
    /// of its feature's table, naming the first that is not), so that the device lookup needs
    /// no read-back; returns the batch size.
    pub(crate) fn check_host_lookup(
        &self,
        indices: &[i64],
        offsets: &[i64],
        per_sample_weights: Option<&[f32]>,
    ) -> Result<usize> {
        let b = self.check_host_input(indices, offsets, per_sample_weights)?;
        for (bag, w) in offsets.windows(2).enumerate() {
            let rows = self.host_rows[bag / b.max(1)];
            let (start, end) = (w[0] as usize, w[1] as usize);
            for (p, &id) in (start..end).zip(&indices[start..end]) {
                if id < 0 || id >= rows {
                    return Err(self.out_of_range(id, p, bag, b));
                }
            }
        }
        Ok(b)
    }

    /// [`forward`](Self::forward) from and to host memory (offsets are checked here first).
    pub fn forward_host(
        &self,
        indices: &[i64],
        offsets: &[i64],
        per_sample_weights: Option<&[f32]>,
    ) -> Result<Vec<f32>> {
        let b = self.check_host_input(indices, offsets, per_sample_weights)?;
        let d_indices = self.device.htod(indices)?;
        let d_offsets = self.device.htod(offsets)?;
        let d_weights = per_sample_weights
            .map(|w| self.device.htod(w))
            .transpose()?;
        let mut out = self
            .device
            .alloc::<f32>(self.output_len(b, indices.len()))?;
        self.forward(&d_indices, &d_offsets, d_weights.as_ref(), b, &mut out)?;
        self.check_ids(&d_indices, &d_offsets, b)?;
        out.to_host()
    }
}

impl TrainState {
    fn new(
        tbe: &CudaTbe,
        optimizer: FusedOptimizer,
        decay: WeightDecay,
        step: u64,
        state: Vec<DeviceBuffer<f32>>,
        tables: Vec<(usize, usize, usize, usize)>,
    ) -> Result<Self> {
        let lambda_ok = match decay {
            WeightDecay::None => true,
            WeightDecay::L2(l) | WeightDecay::Decoupled(l) => l.is_finite(),
        };
        if !lambda_ok {
            return Err(Error::invalid(
                OP,
                format!("invalid weight decay {decay:?}"),
            ));
        }
        let row_starts: Vec<i64> = (tbe.feature_tables.iter())
            .map(|&t| tables[t].3 as i64)
            .collect();
        Ok(TrainState {
            optimizer,
            decay,
            step,
            row_starts: tbe.device.htod(&row_starts)?,
            state,
            tables,
        })
    }
}

/// The device copies of a host backward's inputs ([`CudaTbe::upload_backward`]).
struct BackwardUpload {
    batch: usize,
    indices: DeviceBuffer<i64>,
    offsets: DeviceBuffer<i64>,
    grad: DeviceBuffer<f32>,
    weights: Option<DeviceBuffer<f32>>,
    weights_grad: Option<DeviceBuffer<f32>>,
}

/// Splits the row-sparse output (the distinct global row numbers, sorted, and their
/// `[rows, max_dim]` values) by table: local ids and `[rows, dim]` values each.
fn split_sparse(
    tables: &[(usize, usize, usize, usize)],
    rows: &[i64],
    values: &[f32],
    max_dim: usize,
) -> Vec<SparseTableGrad> {
    let mut out: Vec<SparseTableGrad> = (tables.iter())
        .map(|&(_, _, dim, _)| SparseTableGrad {
            rows: Vec::new(),
            values: Vec::new(),
            dim,
        })
        .collect();
    for (u, &row) in rows.iter().enumerate() {
        let row = row as usize;
        let t = tables.partition_point(|&(_, _, _, first)| first <= row) - 1;
        let (_, _, dim, first) = tables[t];
        out[t].rows.push((row - first) as i64);
        out[t]
            .values
            .extend_from_slice(&values[u * max_dim..u * max_dim + dim]);
    }
    out
}

/// The scalar arguments of `tbe_backward_update` for one step.
struct Hyper {
    code: i32,
    lr: f32,
    eps: f32,
    beta1: f32,
    beta2: f32,
    correction1: f32,
    correction2: f32,
    decay: i32,
    lambda: f32,
}

impl Hyper {
    /// `step` is 1-based (this backward's number), as the CPU's bias correction.
    fn of(optimizer: FusedOptimizer, decay: WeightDecay, step: u64) -> Self {
        let (decay, lambda) = match decay {
            WeightDecay::None => (0, 0.0),
            WeightDecay::L2(l) => (1, l),
            WeightDecay::Decoupled(l) => (2, l),
        };
        let mut h = Hyper {
            code: 0,
            lr: 0.0,
            eps: 0.0,
            beta1: 0.0,
            beta2: 0.0,
            correction1: 1.0,
            correction2: 1.0,
            decay,
            lambda,
        };
        match optimizer {
            FusedOptimizer::None => {}
            FusedOptimizer::Sgd { lr } => h.lr = lr,
            FusedOptimizer::RowWiseAdagrad { lr, eps } => (h.code, h.lr, h.eps) = (1, lr, eps),
            FusedOptimizer::Adagrad { lr, eps } => (h.code, h.lr, h.eps) = (2, lr, eps),
            FusedOptimizer::Adam { .. }
            | FusedOptimizer::Lamb { .. }
            | FusedOptimizer::PartialRowWiseLamb { .. }
            | FusedOptimizer::PartialRowWiseAdam { .. } => {
                let (beta1, beta2, eps) = optimizer.moments().expect("the Adam family");
                // The same f32 values as the CPU's update_row.
                let (correction1, correction2) = bias_corrections(beta1, beta2, step);
                h = Hyper {
                    code: match optimizer {
                        FusedOptimizer::Adam { .. } => 3,
                        FusedOptimizer::Lamb { .. } => 4,
                        FusedOptimizer::PartialRowWiseLamb { .. } => 5,
                        _ => 6,
                    },
                    lr: optimizer.lr(),
                    eps,
                    beta1,
                    beta2,
                    correction1,
                    correction2,
                    ..h
                };
            }
        }
        h
    }
}
