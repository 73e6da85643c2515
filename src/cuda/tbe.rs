//! Table-batched embedding bags on a GPU: a device copy of a CPU TBE's FP32 tables (or of a
//! quantized TBE's rows) and the pooled forward kernels of `kernels/tbe_forward*.cu`.
//!
//! Inputs and outputs are device buffers ([`CudaSlice`]); [`CudaTbe::forward_host`] wraps the
//! copies for tests and small callers. An out-of-range id is never read: the kernel records
//! the first bad position and the call returns an error naming feature, bag and id.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, LaunchConfig, PushKernelArg};

use super::CudaDevice;
use crate::embedding::{
    FusedOptimizer, PoolingMode, QuantizedTableBatchedEmbedding, TableBatchedEmbedding, WeightType,
};
use crate::{Device, Error, Result};

const OP: &str = "CudaTbe";

fn driver(ordinal: usize, what: &str, e: impl std::fmt::Display) -> Error {
    Error::DeviceUnavailable {
        device: Device::Cuda(ordinal),
        reason: format!("{OP}: {what}: {e}"),
    }
}

/// The weights of a [`CudaTbe`]: FP32 rows or FBGEMM's quantized row bytes.
enum Weights {
    F32(CudaSlice<f32>),
    Quantized {
        bytes: CudaSlice<u8>,
        row_bytes: CudaSlice<i32>,
        types: CudaSlice<i32>,
    },
}

/// A pooled TBE whose tables live on a GPU.
pub struct CudaTbe {
    device: Arc<CudaDevice>,
    stream: Arc<CudaStream>,
    weights: Weights,
    /// Per feature: element (FP32) or byte (quantized) offset of its table.
    table_offsets: CudaSlice<i64>,
    rows: CudaSlice<i64>,
    dims: CudaSlice<i32>,
    out_offsets: CudaSlice<i32>,
    host_rows: Vec<i64>,
    host_dims_max: usize,
    /// First out-of-range position seen by any lookup since the last check (`i64::MAX`: none).
    first_bad: parking_lot::Mutex<CudaSlice<i64>>,
    feature_names: Vec<String>,
    out_stride: usize,
    mean: bool,
    /// Training state (FP32 tables only).
    train: Option<TrainState>,
}

/// What the fused backward needs beyond the forward's layout.
struct TrainState {
    optimizer: FusedOptimizer,
    /// Per feature: number of the first row of its table among all tables' rows.
    row_starts: CudaSlice<i64>,
    /// Row-wise Adagrad accumulators of every row of every table (one value if unused).
    momentum: CudaSlice<f32>,
    /// Per table: (first element, rows, dim, first row), for reading tables back.
    tables: Vec<(usize, usize, usize, usize)>,
}

/// Per-feature layout shared by both weight kinds.
struct Layout {
    table_offsets: Vec<i64>,
    rows: Vec<i64>,
    dims: Vec<i32>,
    out_offsets: Vec<i32>,
    out_stride: usize,
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

fn pooled(op: &'static str, pooling: PoolingMode) -> Result<bool> {
    match pooling {
        PoolingMode::Sum => Ok(false),
        PoolingMode::Mean => Ok(true),
        PoolingMode::None => Err(Error::invalid(
            op,
            "unpooled (PoolingMode::None) lookups are not on the GPU yet",
        )),
    }
}

impl CudaTbe {
    fn build(
        device: Arc<CudaDevice>,
        weights: impl FnOnce(&Arc<CudaStream>) -> Result<Weights>,
        l: Layout,
        names: Vec<String>,
        mean: bool,
    ) -> Result<Self> {
        let ordinal = device.ordinal();
        let stream = device.context().default_stream();
        let up = |what: &str, e| driver(ordinal, what, e);
        Ok(CudaTbe {
            weights: weights(&stream)?,
            table_offsets: stream
                .clone_htod(&l.table_offsets)
                .map_err(|e| up("copy", e))?,
            rows: stream.clone_htod(&l.rows).map_err(|e| up("copy", e))?,
            dims: stream.clone_htod(&l.dims).map_err(|e| up("copy", e))?,
            out_offsets: stream
                .clone_htod(&l.out_offsets)
                .map_err(|e| up("copy", e))?,
            host_dims_max: l.dims.iter().copied().max().unwrap_or(0) as usize,
            host_rows: l.rows,
            first_bad: parking_lot::Mutex::new(
                stream.clone_htod(&[i64::MAX]).map_err(|e| up("copy", e))?,
            ),
            feature_names: names,
            out_stride: l.out_stride,
            mean,
            train: None,
            stream,
            device,
        })
    }

    /// A GPU copy of a training TBE's FP32 tables (same features, pooling).
    pub fn from_trained(tbe: &TableBatchedEmbedding, device: Arc<CudaDevice>) -> Result<Self> {
        let cfg = tbe.config();
        let mean = pooled(OP, cfg.pooling)?;
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
        let ordinal = device.ordinal();
        let mut gpu = Self::build(
            device,
            |s| {
                Ok(Weights::F32(
                    s.clone_htod(&flat)
                        .map_err(|e| driver(ordinal, "copy", e))?,
                ))
            },
            l,
            names,
            mean,
        )?;
        // Training state: row numbering across tables and the row-wise accumulators.
        let mut table_info = Vec::new();
        let mut first_row = 0;
        let mut momentum = Vec::new();
        for (t, spec) in cfg.tables.iter().enumerate() {
            table_info.push((starts[t] as usize, spec.rows, spec.dim, first_row));
            first_row += spec.rows;
            if let FusedOptimizer::RowWiseAdagrad { .. } = cfg.optimizer {
                momentum.extend_from_slice(&tbe.optimizer_state(0, t)?);
            }
        }
        if momentum.is_empty() {
            momentum.push(0.0);
        }
        let row_starts: Vec<i64> = (cfg.feature_table_map.iter())
            .map(|&t| table_info[t].3 as i64)
            .collect();
        let up = |e| driver(ordinal, "copy", e);
        gpu.train = Some(TrainState {
            optimizer: cfg.optimizer,
            row_starts: gpu.stream.clone_htod(&row_starts).map_err(up)?,
            momentum: gpu.stream.clone_htod(&momentum).map_err(up)?,
            tables: table_info,
        });
        Ok(gpu)
    }

    /// Fused backward on device buffers (FP32 tables made by
    /// [`from_trained`](Self::from_trained), SGD or row-wise Adagrad): `grad_output` is the
    /// `[B, out_stride]` gradient of the last forward's output for the same `indices`,
    /// `offsets` and weights. Each row's gradient is summed once in a fixed order (sort by
    /// row, then position) and the row updated in place: deterministic.
    pub fn backward(
        &mut self,
        indices: &CudaSlice<i64>,
        offsets: &CudaSlice<i64>,
        per_sample_weights: Option<&CudaSlice<f32>>,
        grad_output: &CudaSlice<f32>,
        batch_size: usize,
    ) -> Result<()> {
        let ordinal = self.device.ordinal();
        let up = |what: &str, e| driver(ordinal, what, e);
        let Some(train) = self.train.as_mut() else {
            return Err(Error::invalid(
                OP,
                "backward needs FP32 tables made by from_trained",
            ));
        };
        let (code, lr, eps) = match train.optimizer {
            FusedOptimizer::Sgd { lr } => (0i32, lr, 0.0f32),
            FusedOptimizer::RowWiseAdagrad { lr, eps } => (1, lr, eps),
            other => {
                return Err(Error::invalid(
                    OP,
                    format!("the {} optimizer is not on the GPU yet", other.name()),
                ))
            }
        };
        let Weights::F32(weights) = &mut self.weights else {
            return Err(Error::invalid(OP, "backward needs FP32 tables"));
        };
        if self.host_dims_max > 512 {
            return Err(Error::invalid(
                OP,
                "dims above 512 are not supported by the GPU backward",
            ));
        }
        let f = self.host_rows.len();
        let n = indices.len();
        if n == 0 || n >= 1 << 24 {
            return Err(Error::invalid(
                OP,
                format!("{n} ids: the GPU backward takes 1 to 2^24 − 1 per batch"),
            ));
        }
        if offsets.len() != f * batch_size + 1 || grad_output.len() < batch_size * self.out_stride {
            return Err(Error::invalid(
                OP,
                "offsets or grad_output do not fit the batch size",
            ));
        }
        let npad = n.next_power_of_two();
        let stream = &self.stream;
        let mut keys = stream
            .alloc_zeros::<u64>(npad)
            .map_err(|e| up("alloc", e))?;
        let mut bag_of = stream.alloc_zeros::<i32>(n).map_err(|e| up("alloc", e))?;
        let module = self.device.module("tbe_backward.cu")?;
        let load = |name: &str| {
            module
                .load_function(name)
                .map_err(|e| up("loading a kernel", e))
        };
        let linear = |threads: usize| LaunchConfig {
            grid_dim: (threads.div_ceil(256).max(1) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let (bi, fi) = (batch_size as i32, f as i32);
        let keys_fn = load("tbe_backward_keys")?;
        let mut launch = stream.launch_builder(&keys_fn);
        launch
            .arg(indices)
            .arg(offsets)
            .arg(&bi)
            .arg(&fi)
            .arg(&train.row_starts)
            .arg(&self.rows)
            .arg(&mut keys)
            .arg(&mut bag_of);
        // SAFETY: arguments as in kernels/tbe_backward.cu; keys has npad ≥ n entries, bag_of n.
        unsafe { launch.launch(linear(f * batch_size)) }.map_err(|e| up("launch", e))?;
        let (n64, npad64) = (n as i64, npad as i64);
        if npad > n {
            let pad = load("tbe_backward_pad")?;
            let mut launch = stream.launch_builder(&pad);
            launch.arg(&mut keys).arg(&n64).arg(&npad64);
            // SAFETY: fills keys[n..npad).
            unsafe { launch.launch(linear(npad - n)) }.map_err(|e| up("launch", e))?;
        }
        let step = load("bitonic_step_u64")?;
        let mut k = 2i64;
        while k <= npad64 {
            let mut j = k / 2;
            while j > 0 {
                let mut launch = stream.launch_builder(&step);
                launch.arg(&mut keys).arg(&npad64).arg(&j).arg(&k);
                // SAFETY: one thread per key of the padded array.
                unsafe { launch.launch(linear(npad)) }.map_err(|e| up("launch", e))?;
                j /= 2;
            }
            k *= 2;
        }
        let update = load("tbe_backward_update")?;
        let null = 0u64;
        let mean = i32::from(self.mean);
        let out_stride = self.out_stride as i32;
        let mut launch = stream.launch_builder(&update);
        launch
            .arg(&keys)
            .arg(&npad64)
            .arg(&bag_of)
            .arg(offsets)
            .arg(&bi);
        match per_sample_weights {
            Some(w) => launch.arg(w),
            None => launch.arg(&null),
        };
        launch
            .arg(&mean)
            .arg(grad_output)
            .arg(&out_stride)
            .arg(&self.out_offsets)
            .arg(&self.dims)
            .arg(&self.table_offsets)
            .arg(&train.row_starts)
            .arg(&train.row_starts)
            .arg(weights)
            .arg(&mut train.momentum)
            .arg(&code)
            .arg(&lr)
            .arg(&eps);
        let cfg = LaunchConfig {
            grid_dim: (npad.div_ceil(4) as u32, 1, 1),
            block_dim: (32, 4, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: arguments as in kernels/tbe_backward.cu; every row is written by one warp.
        unsafe { launch.launch(cfg) }.map_err(|e| up("launch", e))?;
        Ok(())
    }

    /// [`backward`](Self::backward) from host memory.
    pub fn backward_host(
        &mut self,
        indices: &[i64],
        offsets: &[i64],
        per_sample_weights: Option<&[f32]>,
        grad_output: &[f32],
    ) -> Result<()> {
        let f = self.host_rows.len();
        let b = offsets.len().saturating_sub(1) / f.max(1);
        let ordinal = self.device.ordinal();
        let up = |e| driver(ordinal, "copy", e);
        let d_indices = self.stream.clone_htod(indices).map_err(up)?;
        let d_offsets = self.stream.clone_htod(offsets).map_err(up)?;
        let d_weights = per_sample_weights
            .map(|w| self.stream.clone_htod(w))
            .transpose()
            .map_err(up)?;
        let d_grad = self.stream.clone_htod(grad_output).map_err(up)?;
        self.backward(&d_indices, &d_offsets, d_weights.as_ref(), &d_grad, b)
    }

    /// Table `t`'s rows and, for row-wise Adagrad, its accumulators, copied back to the host.
    pub fn table_state(&self, t: usize) -> Result<(Vec<f32>, Vec<f32>)> {
        let ordinal = self.device.ordinal();
        let (Some(train), Weights::F32(w)) = (&self.train, &self.weights) else {
            return Err(Error::invalid(
                OP,
                "only FP32 training tables can be read back",
            ));
        };
        let &(start, rows, dim, first_row) = train
            .tables
            .get(t)
            .ok_or_else(|| Error::invalid(OP, format!("no table {t}")))?;
        let all = self
            .stream
            .clone_dtoh(w)
            .map_err(|e| driver(ordinal, "copy", e))?;
        let momentum = self
            .stream
            .clone_dtoh(&train.momentum)
            .map_err(|e| driver(ordinal, "copy", e))?;
        let m = if momentum.len() > first_row {
            momentum[first_row..first_row + rows].to_vec()
        } else {
            Vec::new()
        };
        Ok((all[start..start + rows * dim].to_vec(), m))
    }

    /// FP32 tables of zeros made directly on the GPU (no host copy): for benchmarks of tables
    /// larger than host memory wants to hold twice.
    pub fn zeros(
        tables: &[crate::embedding::TableSpec],
        feature_table_map: &[usize],
        pooling: PoolingMode,
        device: Arc<CudaDevice>,
    ) -> Result<Self> {
        let mean = pooled(OP, pooling)?;
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
        let ordinal = device.ordinal();
        Self::build(
            device,
            |s| {
                Ok(Weights::F32(s.alloc_zeros::<f32>(total.max(1)).map_err(
                    |e| driver(ordinal, "allocating the tables", e),
                )?))
            },
            l,
            names,
            mean,
        )
    }

    /// A GPU copy of a quantized TBE's rows (FBGEMM's TBE row bytes, any weight types).
    pub fn from_quantized(
        q: &QuantizedTableBatchedEmbedding,
        device: Arc<CudaDevice>,
    ) -> Result<Self> {
        let mean = pooled(OP, q.pooling())?;
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
        let ordinal = device.ordinal();
        Self::build(
            device,
            |s| {
                let up = |e| driver(ordinal, "copy", e);
                Ok(Weights::Quantized {
                    bytes: s.clone_htod(&bytes).map_err(up)?,
                    row_bytes: s.clone_htod(&row_bytes).map_err(up)?,
                    types: s.clone_htod(&types).map_err(up)?,
                })
            },
            l,
            names,
            mean,
        )
    }

    /// The stream the lookups run on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Output width `ΣD` of one sample.
    pub fn out_stride(&self) -> usize {
        self.out_stride
    }

    /// Pooled lookup on device buffers: `indices` (i64), `offsets` (`F·B + 1`, i64, checked
    /// on the host by the caller or by [`forward_host`](Self::forward_host)), optional
    /// per-sample weights; writes `out` (`B × out_stride` f32). Asynchronous on
    /// [`stream`](Self::stream): out-of-range ids are skipped and remembered on the device;
    /// [`check_ids`](Self::check_ids) (which synchronises) reports them.
    pub fn forward(
        &self,
        indices: &CudaSlice<i64>,
        offsets: &CudaSlice<i64>,
        per_sample_weights: Option<&CudaSlice<f32>>,
        batch_size: usize,
        out: &mut CudaSlice<f32>,
    ) -> Result<()> {
        let ordinal = self.device.ordinal();
        let up = |what: &str, e| driver(ordinal, what, e);
        let f = self.host_rows.len();
        if out.len() < batch_size * self.out_stride || offsets.len() != f * batch_size + 1 {
            return Err(Error::invalid(
                OP,
                format!(
                    "expected {} offsets and an output of {} values, got {} and {}",
                    f * batch_size + 1,
                    batch_size * self.out_stride,
                    offsets.len(),
                    out.len()
                ),
            ));
        }
        let mut first_bad = self.first_bad.lock();
        let (b, fi, mean) = (batch_size as i32, f as i32, i32::from(self.mean));
        let out_stride = self.out_stride as i32;
        let null = 0u64;
        let bags = (f * batch_size) as u32;
        let cfg = LaunchConfig {
            grid_dim: (bags.div_ceil(4).max(1), 1, 1),
            block_dim: (32, 4, 1),
            shared_mem_bytes: 0,
        };
        let (module, name) = match &self.weights {
            Weights::F32(_) => ("tbe_forward.cu", "tbe_forward_f32"),
            Weights::Quantized { .. } => ("tbe_forward_quantized.cu", "tbe_forward_quantized"),
        };
        let kernel = self
            .device
            .module(module)?
            .load_function(name)
            .map_err(|e| up("loading the kernel", e))?;
        let mut launch = self.stream.launch_builder(&kernel);
        match &self.weights {
            Weights::F32(w) => {
                launch
                    .arg(w)
                    .arg(&self.table_offsets)
                    .arg(&self.rows)
                    .arg(&self.dims);
            }
            Weights::Quantized {
                bytes,
                row_bytes,
                types,
            } => {
                launch
                    .arg(bytes)
                    .arg(&self.table_offsets)
                    .arg(&self.rows)
                    .arg(row_bytes)
                    .arg(&self.dims)
                    .arg(types);
            }
        }
        launch
            .arg(&self.out_offsets)
            .arg(&out_stride)
            .arg(&b)
            .arg(&fi)
            .arg(indices)
            .arg(offsets);
        match per_sample_weights {
            Some(w) => launch.arg(w),
            None => launch.arg(&null),
        };
        launch.arg(&mean).arg(out).arg(&mut *first_bad);
        // SAFETY: the arguments follow the kernels' signatures in kernels/tbe_forward*.cu; the
        // sizes were checked above (offsets F·B+1, output B·ΣD).
        unsafe { launch.launch(cfg) }.map_err(|e| up("launch", e))?;
        Ok(())
    }

    /// Waits for the lookups so far and fails if any of them met an out-of-range id, naming the
    /// first one (given the inputs of that lookup to describe it); the record is then cleared.
    pub fn check_ids(
        &self,
        indices: &CudaSlice<i64>,
        offsets: &CudaSlice<i64>,
        batch_size: usize,
    ) -> Result<()> {
        let ordinal = self.device.ordinal();
        let up = |e| driver(ordinal, "copy", e);
        let mut first_bad = self.first_bad.lock();
        let bad = self.stream.clone_dtoh(&*first_bad).map_err(up)?[0];
        if bad == i64::MAX {
            return Ok(());
        }
        self.stream
            .memcpy_htod(&[i64::MAX], &mut *first_bad)
            .map_err(up)?;
        Err(self.bad_id_error(bad, offsets, indices, batch_size))
    }

    fn bad_id_error(
        &self,
        position: i64,
        offsets: &CudaSlice<i64>,
        indices: &CudaSlice<i64>,
        batch_size: usize,
    ) -> Error {
        let offs = self.stream.clone_dtoh(offsets).unwrap_or_default();
        let ids = self.stream.clone_dtoh(indices).unwrap_or_default();
        let bag = offs.partition_point(|&o| o <= position).saturating_sub(1);
        let f = bag / batch_size.max(1);
        Error::invalid(
            OP,
            format!(
                "{}: id {} at position {position} (bag {} of sample {}) is out of range for {} rows",
                self.feature_names.get(f).map_or("?", String::as_str),
                ids.get(position as usize).copied().unwrap_or(-1),
                bag,
                bag % batch_size.max(1),
                self.host_rows.get(f).copied().unwrap_or(0)
            ),
        )
    }

    /// [`forward`](Self::forward) from and to host memory (offsets are checked here first).
    pub fn forward_host(
        &self,
        indices: &[i64],
        offsets: &[i64],
        per_sample_weights: Option<&[f32]>,
    ) -> Result<Vec<f32>> {
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
        let b = (offsets.len() - 1) / f;
        let ordinal = self.device.ordinal();
        let up = |e| driver(ordinal, "copy", e);
        // Empty inputs still need a valid device buffer.
        let ids: Vec<i64> = if indices.is_empty() {
            vec![0]
        } else {
            indices.to_vec()
        };
        let d_indices = self.stream.clone_htod(&ids).map_err(up)?;
        let d_offsets = self.stream.clone_htod(offsets).map_err(up)?;
        let d_weights = per_sample_weights
            .map(|w| self.stream.clone_htod(w))
            .transpose()
            .map_err(up)?;
        let mut out = self
            .stream
            .alloc_zeros::<f32>((b * self.out_stride).max(1))
            .map_err(up)?;
        self.forward(&d_indices, &d_offsets, d_weights.as_ref(), b, &mut out)?;
        self.check_ids(&d_indices, &d_offsets, b)?;
        let mut host = self.stream.clone_dtoh(&out).map_err(up)?;
        host.truncate(b * self.out_stride);
        Ok(host)
    }
}
