//! [`TableBatchedEmbedding`]: the training TBE. Many FP32 tables in one flat, huge-page-friendly
//! buffer, looked up by many features in one call, with the optimizer fused into backward.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use parking_lot::RwLock;
use rand::Rng as _;
use rand_distr::{Distribution, Normal};

use super::backward::{fused_backward, BackwardOutput, TableUpdate};
use super::config::{BoundsCheckMode, EmbeddingInit, PoolingMode, TableSpec};
use super::input::{validate, with_tensor_input, Batch, FeatureBounds, SkipCounter, TbeInput};
use super::kernels::{pooled_forward, sequence_forward, F32Rows, FeatureSlot, PoolFeature};
use super::optimizer::{FusedOptimizer, StateShape, WeightDecay};
use super::storage::RowBuffer;
use crate::tensor::rng::Rng;
use crate::tensor::{record_op_with_state, BackwardOp, Gradient, RowSparseGrad};
use crate::{DType, Device, Error, Result, Tensor};

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

/// Weights and optimizer state, behind one lock.
pub(crate) struct TrainState {
    pub weights: RowBuffer<f32>,
    pub m1: RowBuffer<f32>,
    pub m2: RowBuffer<f32>,
    /// Backward calls so far (Adam's bias correction).
    pub step: u64,
}

pub(crate) struct TbeInner {
    pub config: TbeConfig,
    pub feature_names: Vec<String>,
    /// Start of each table in the flat weight buffer (elements); one extra entry at the end.
    pub weight_offsets: Vec<usize>,
    /// First row of each table in the flat row numbering; one extra entry at the end.
    pub row_offsets: Vec<usize>,
    pub slots: Vec<FeatureSlot>,
    pub out_stride: usize,
    pub state: RwLock<TrainState>,
    pub skips: SkipCounter,
    /// Leaves that receive row-sparse gradients with [`FusedOptimizer::None`].
    pub sparse_sinks: Vec<Tensor>,
}

/// Table-batched embedding bags for training (FBGEMM's `SplitTableBatchedEmbeddingBagsCodegen`
/// on CPU): FP32 rows of every table in one flat buffer, FBGEMM's input layout, and the
/// optimizer fused into the backward.
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
            .finish()
    }
}

const OP: &str = "TableBatchedEmbedding";

impl TableBatchedEmbedding {
    /// Builds the operator with all-zero tables and optimizer state.
    pub fn new(config: TbeConfig) -> Result<Self> {
        config.optimizer.validate()?;
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
        let mut slots = Vec::with_capacity(dims.len());
        let mut col = 0;
        for &dim in &dims {
            slots.push(FeatureSlot { col, dim });
            col += dim;
        }
        let out_stride = if config.pooling == PoolingMode::None {
            dims[0]
        } else {
            col
        };
        let mut weight_offsets = vec![0];
        let mut row_offsets = vec![0];
        for spec in &config.tables {
            let elems = spec
                .rows
                .checked_mul(spec.dim)
                .ok_or_else(|| Error::invalid(OP, format!("table `{}` is too large", spec.name)))?;
            weight_offsets.push(weight_offsets.last().unwrap() + elems);
            row_offsets.push(row_offsets.last().unwrap() + spec.rows);
        }
        let total_elems = *weight_offsets.last().unwrap();
        let total_rows = *row_offsets.last().unwrap();
        let state_len = |shape: Option<&(&str, StateShape)>| match shape {
            Some((_, StateShape::PerRow)) => total_rows,
            Some((_, StateShape::PerElement)) => total_elems,
            None => 0,
        };
        let buffers = config.optimizer.state_buffers();
        let state = TrainState {
            weights: RowBuffer::zeros(total_elems)?,
            m1: RowBuffer::zeros(state_len(buffers.first()))?,
            m2: RowBuffer::zeros(state_len(buffers.get(1)))?,
            step: 0,
        };
        let sparse_sinks = if config.optimizer == FusedOptimizer::None {
            config
                .tables
                .iter()
                .map(|spec| {
                    // A stride-0 view of one zero: shaped like the table, allocating nothing.
                    Ok(Tensor::zeros(&[1, 1], DType::F32, Device::Cpu)
                        .expand(&[spec.rows, spec.dim])?
                        .with_requires_grad(true))
                })
                .collect::<Result<Vec<_>>>()?
        } else {
            Vec::new()
        };
        Ok(TableBatchedEmbedding {
            inner: Arc::new(TbeInner {
                config,
                feature_names,
                weight_offsets,
                row_offsets,
                slots,
                out_stride,
                state: RwLock::new(state),
                skips: SkipCounter::default(),
                sparse_sinks,
            }),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &TbeConfig {
        &self.inner.config
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
        self.inner.out_stride
    }

    /// First output column of each feature, plus the total at the end (FBGEMM's `D_offsets`).
    pub fn d_offsets(&self) -> Vec<usize> {
        let mut v: Vec<usize> = self.inner.slots.iter().map(|s| s.col).collect();
        v.push(self.inner.slots.iter().map(|s| s.dim).sum());
        v
    }

    /// Start, in the flat weight buffer, of the table each feature reads (in elements; FBGEMM's
    /// per-feature `weights_offsets`).
    pub fn weights_offsets(&self) -> Vec<usize> {
        self.inner
            .config
            .feature_table_map
            .iter()
            .map(|&t| self.inner.weight_offsets[t])
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

    /// Bytes held by the weights and optimizer state (allocation sizes, padding included).
    pub fn allocated_bytes(&self) -> usize {
        let s = self.inner.state.read();
        s.weights.allocated_bytes() + s.m1.allocated_bytes() + s.m2.allocated_bytes()
    }

    fn check_table(&self, t: usize) -> Result<&TableSpec> {
        self.inner.config.tables.get(t).ok_or_else(|| {
            Error::invalid(
                OP,
                format!("table {t} does not exist ({} tables)", self.num_tables()),
            )
        })
    }

    /// A copy of table `t`'s rows, `[rows, dim]` row-major.
    pub fn table_weights(&self, t: usize) -> Result<Vec<f32>> {
        self.check_table(t)?;
        let (a, b) = (
            self.inner.weight_offsets[t],
            self.inner.weight_offsets[t + 1],
        );
        Ok(self.inner.state.read().weights[a..b].to_vec())
    }

    /// Overwrites table `t`'s rows (`[rows, dim]` row-major).
    pub fn set_table_weights(&self, t: usize, values: &[f32]) -> Result<()> {
        let spec = self.check_table(t)?;
        let (a, b) = (
            self.inner.weight_offsets[t],
            self.inner.weight_offsets[t + 1],
        );
        if values.len() != b - a {
            return Err(Error::invalid(
                OP,
                format!(
                    "table {t} `{}` is {}×{} = {} values, {} given",
                    spec.name,
                    spec.rows,
                    spec.dim,
                    b - a,
                    values.len()
                ),
            ));
        }
        self.inner.state.write().weights[a..b].copy_from_slice(values);
        Ok(())
    }

    /// Fills every table with `init` from `rng` (tables in order, rows in order).
    pub fn init_weights(&self, init: EmbeddingInit, rng: &mut Rng) -> Result<()> {
        let mut state = self.inner.state.write();
        for (t, spec) in self.inner.config.tables.iter().enumerate() {
            let (a, b) = (
                self.inner.weight_offsets[t],
                self.inner.weight_offsets[t + 1],
            );
            fill_init(&mut state.weights[a..b], spec.rows, init, rng)?;
        }
        Ok(())
    }

    fn state_range(&self, t: usize, shape: StateShape) -> (usize, usize) {
        match shape {
            StateShape::PerRow => (self.inner.row_offsets[t], self.inner.row_offsets[t + 1]),
            StateShape::PerElement => (
                self.inner.weight_offsets[t],
                self.inner.weight_offsets[t + 1],
            ),
        }
    }

    /// Names of the optimizer state buffers (`momentum1`, `momentum2`), per-row or per-element.
    pub fn optimizer_state_names(&self) -> Vec<(&'static str, StateShape)> {
        self.inner.config.optimizer.state_buffers().to_vec()
    }

    /// A copy of optimizer state buffer `index` of table `t` (`[rows]` for per-row state,
    /// `[rows, dim]` for per-element state).
    pub fn optimizer_state(&self, index: usize, t: usize) -> Result<Vec<f32>> {
        self.check_table(t)?;
        let (_, shape) = *self
            .inner
            .config
            .optimizer
            .state_buffers()
            .get(index)
            .ok_or_else(|| {
                Error::invalid(
                    OP,
                    format!(
                        "optimizer `{}` has no state buffer {index}",
                        self.inner.config.optimizer.name()
                    ),
                )
            })?;
        let (a, b) = self.state_range(t, shape);
        let s = self.inner.state.read();
        let buf = if index == 0 { &s.m1 } else { &s.m2 };
        Ok(buf[a..b].to_vec())
    }

    /// Overwrites optimizer state buffer `index` of table `t`.
    pub fn set_optimizer_state(&self, index: usize, t: usize, values: &[f32]) -> Result<()> {
        let expected = self.optimizer_state(index, t)?.len();
        if values.len() != expected {
            return Err(Error::invalid(
                OP,
                format!(
                    "optimizer state {index} of table {t} has {expected} values, {} given",
                    values.len()
                ),
            ));
        }
        let (_, shape) = self.inner.config.optimizer.state_buffers()[index];
        let (a, b) = self.state_range(t, shape);
        let mut s = self.inner.state.write();
        let buf = if index == 0 { &mut s.m1 } else { &mut s.m2 };
        buf[a..b].copy_from_slice(values);
        Ok(())
    }

    pub(crate) fn set_step(&self, step: u64) {
        self.inner.state.write().step = step;
    }

    pub(crate) fn validate_input<'a>(&self, input: TbeInput<'a>) -> Result<Batch<'a>> {
        let cfg = &self.inner.config;
        let bounds: Vec<FeatureBounds<'_>> = cfg
            .feature_table_map
            .iter()
            .enumerate()
            .map(|(f, &t)| FeatureBounds {
                rows: cfg.tables[t].rows,
                feature: &self.inner.feature_names[f],
                table: &cfg.tables[t].name,
            })
            .collect();
        validate(OP, input, &bounds, cfg.bounds_check, &self.inner.skips)
    }

    fn forward_batch(&self, batch: &Batch<'_>) -> Result<Tensor> {
        let inner = &self.inner;
        let cfg = &inner.config;
        let state = inner.state.read();
        let visit = |f: usize, k: &mut dyn FnMut(&dyn PoolFeature)| {
            let t = cfg.feature_table_map[f];
            let rows = F32Rows {
                rows: &state.weights[inner.weight_offsets[t]..inner.weight_offsets[t + 1]],
                dim: cfg.tables[t].dim,
            };
            k(&rows)
        };
        if cfg.pooling == PoolingMode::None {
            let n = batch.ids.len();
            let mut out = vec![0.0f32; n * inner.out_stride];
            sequence_forward(batch, inner.out_stride, &mut out, &visit);
            return Tensor::from_vec(out, &[n, inner.out_stride]);
        }
        let mut out = vec![0.0f32; batch.batch_size * inner.out_stride];
        pooled_forward(
            batch,
            &inner.slots,
            cfg.pooling,
            &mut out,
            inner.out_stride,
            &visit,
        );
        Tensor::from_vec(out, &[batch.batch_size, inner.out_stride])
    }

    /// Forward without recording autograd: `[B, ΣD]` (or `[N, D]` with pooling NONE).
    pub fn lookup(&self, input: TbeInput<'_>) -> Result<Tensor> {
        let batch = self.validate_input(input)?;
        self.forward_batch(&batch)
    }

    /// Forward that takes part in autograd: backward of the result runs the fused optimizer
    /// (or, with [`FusedOptimizer::None`], leaves row-sparse gradients, see
    /// [`TableBatchedEmbedding::sparse_gradient`]) and gives `per_sample_weights` its gradient
    /// when it requires grad.
    pub fn forward(
        &self,
        indices: &Tensor,
        offsets: &Tensor,
        per_sample_weights: Option<&Tensor>,
    ) -> Result<Tensor> {
        with_tensor_input(OP, indices, offsets, per_sample_weights, |input| {
            let batch = self.validate_input(input)?;
            let out = self.forward_batch(&batch)?;
            if !crate::tensor::is_grad_enabled() {
                // No graph to record: skip keeping a copy of the batch for backward.
                return Ok(out);
            }
            let mut inputs: Vec<&Tensor> = Vec::new();
            if let Some(w) = per_sample_weights {
                inputs.push(w);
            }
            inputs.extend(self.inner.sparse_sinks.iter());
            Ok(record_op_with_state(
                out,
                &inputs,
                TbeBackward {
                    tbe: self.clone(),
                    batch: batch.into_owned(),
                    has_weights: per_sample_weights.is_some(),
                },
            ))
        })
    }

    /// The fused backward on raw slices: `grad_output` is `[B, ΣD]` (or `[N, D]`) for the
    /// same `input` as the forward. Updates the tables (unless the optimizer is
    /// [`FusedOptimizer::None`]) and returns the per-sample-weight and sparse gradients.
    pub fn backward_fused(
        &self,
        input: TbeInput<'_>,
        grad_output: &[f32],
    ) -> Result<BackwardOutput> {
        let batch = self.validate_input(input)?;
        self.backward_batch(&batch, grad_output)
    }

    pub(crate) fn backward_batch(
        &self,
        batch: &Batch<'_>,
        grad_output: &[f32],
    ) -> Result<BackwardOutput> {
        let inner = &self.inner;
        let cfg = &inner.config;
        let rows_out = if cfg.pooling == PoolingMode::None {
            batch.ids.len()
        } else {
            batch.batch_size
        };
        if grad_output.len() != rows_out * inner.out_stride {
            return Err(Error::invalid(
                OP,
                format!(
                    "grad_output has {} values, expected {rows_out}×{}",
                    grad_output.len(),
                    inner.out_stride
                ),
            ));
        }
        let mut guard = inner.state.write();
        let state = &mut *guard;
        state.step += 1;
        let step = state.step;
        let state_len = |i: usize, rows: usize, elems: usize| match cfg.optimizer.state_shape(i) {
            None => 0,
            Some(StateShape::PerRow) => rows,
            Some(StateShape::PerElement) => elems,
        };
        let mut weights_rest: &mut [f32] = &mut state.weights;
        let mut m1_rest: &mut [f32] = &mut state.m1;
        let mut m2_rest: &mut [f32] = &mut state.m2;
        let mut updates = Vec::with_capacity(cfg.tables.len());
        for (t, spec) in cfg.tables.iter().enumerate() {
            let elems = spec.rows * spec.dim;
            let (w, rest) = std::mem::take(&mut weights_rest).split_at_mut(elems);
            weights_rest = rest;
            let (m1, rest) =
                std::mem::take(&mut m1_rest).split_at_mut(state_len(0, spec.rows, elems));
            m1_rest = rest;
            let (m2, rest) =
                std::mem::take(&mut m2_rest).split_at_mut(state_len(1, spec.rows, elems));
            m2_rest = rest;
            let features: Vec<(usize, usize)> = cfg
                .feature_table_map
                .iter()
                .enumerate()
                .filter(|(_, &ft)| ft == t)
                .map(|(f, _)| (f, inner.slots[f].col))
                .collect();
            if features.is_empty() {
                continue;
            }
            updates.push(TableUpdate {
                weights: w,
                m1,
                m2,
                dim: spec.dim,
                features,
            });
        }
        let mut out = fused_backward(
            batch,
            cfg.pooling,
            grad_output,
            inner.out_stride,
            updates,
            &cfg.optimizer,
            cfg.weight_decay,
            step,
        );
        // Tables no feature reads got no entry above; give them an empty sparse gradient so the
        // list stays one per table.
        if let Some(grads) = out.sparse_grads.take() {
            let mut it = grads.into_iter();
            let mut full = Vec::with_capacity(cfg.tables.len());
            for (t, spec) in cfg.tables.iter().enumerate() {
                if cfg.feature_table_map.contains(&t) {
                    full.push(it.next().expect("one gradient per looked-up table"));
                } else {
                    full.push(super::backward::SparseTableGrad {
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

    /// With [`FusedOptimizer::None`]: the row-sparse gradient accumulated on table `t` by
    /// autograd backward calls since the last [`zero_sparse_gradients`](Self::zero_sparse_gradients).
    pub fn sparse_gradient(&self, t: usize) -> Option<RowSparseGrad> {
        match self.inner.sparse_sinks.get(t)?.gradient()? {
            Gradient::RowSparse(g) => Some(g),
            Gradient::Dense(_) => None,
        }
    }

    /// Clears the gradients kept for [`sparse_gradient`](Self::sparse_gradient).
    pub fn zero_sparse_gradients(&self) {
        for s in &self.inner.sparse_sinks {
            s.zero_grad();
        }
    }
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
            // Written so that NaN bounds are rejected too.
            if low
                .partial_cmp(&high)
                .is_none_or(|o| o == std::cmp::Ordering::Greater)
            {
                return Err(Error::invalid(
                    OP,
                    format!("uniform init needs low ≤ high, got {low}..{high}"),
                ));
            }
            for x in rows.iter_mut() {
                *x = rng.random_range(low..=high);
            }
        }
        EmbeddingInit::Normal { std } => {
            let normal = Normal::new(0.0f32, std)
                .map_err(|e| Error::invalid(OP, format!("normal init: {e}")))?;
            for x in rows.iter_mut() {
                *x = normal.sample(rng);
            }
        }
        EmbeddingInit::Constant { value } => rows.fill(value),
    }
    Ok(())
}

/// Autograd node of [`TableBatchedEmbedding::forward`]: runs the fused update.
struct TbeBackward {
    tbe: TableBatchedEmbedding,
    batch: Batch<'static>,
    has_weights: bool,
}

impl BackwardOp for TbeBackward {
    fn name(&self) -> &'static str {
        "table_batched_embedding"
    }

    fn backward(&self, grad_output: &Tensor) -> Result<Vec<Option<Gradient>>> {
        let out = grad_output
            .with_contiguous(|grad: &[f32]| self.tbe.backward_batch(&self.batch, grad))??;
        let mut grads = Vec::new();
        if self.has_weights {
            let psw = out.per_sample_weights_grad.unwrap_or_default();
            let n = psw.len();
            grads.push(Some(Gradient::Dense(Tensor::from_vec(psw, &[n])?)));
        }
        if let Some(sparse) = out.sparse_grads {
            for (g, spec) in sparse.into_iter().zip(&self.tbe.inner.config.tables) {
                let n = g.rows.len();
                grads.push(Some(Gradient::RowSparse(RowSparseGrad {
                    rows: g.rows,
                    values: Tensor::from_vec(g.values, &[n, spec.dim])?,
                    num_rows: spec.rows,
                })));
            }
        }
        Ok(grads)
    }
}
