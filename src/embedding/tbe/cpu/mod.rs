//! The TBE's host half: FP32 tables and optimizer state in host memory, the pooling kernels
//! (`pool.rs`, shared with the quantized TBE) and the fused backward (`backward.rs`).

pub(crate) mod backward;
pub(crate) mod pool;

use super::{TbeConfig, TbeLayout};
use crate::embedding::config::PoolingMode;
use crate::embedding::input::Batch;
use crate::embedding::optimizer::{FusedOptimizer, StateShape};
use crate::embedding::storage::RowBuffer;
use crate::error::Result;
use crate::Tensor;
use backward::{fused_backward, BackwardOutput, BackwardStep, TableUpdate};
use pool::{
    forward_new, pooled_forward, sequence_forward, with_f32_rows, PoolFeature, VisitFeature,
};

/// FP32 tables and optimizer state in host memory (huge-page friendly buffers).
pub(crate) struct HostTables {
    pub weights: RowBuffer<f32>,
    pub m1: RowBuffer<f32>,
    pub m2: RowBuffer<f32>,
}

impl HostTables {
    /// Zero tables and state for `layout`.
    pub(crate) fn zeros(layout: &TbeLayout, config: &TbeConfig) -> Result<Self> {
        let len = |i: usize| state_len(config, layout, i);
        Ok(HostTables {
            weights: RowBuffer::zeros(layout.total_elements())?,
            m1: RowBuffer::zeros(len(0))?,
            m2: RowBuffer::zeros(len(1))?,
        })
    }

    /// State buffer `i` (0 or 1).
    pub(crate) fn state(&self, i: usize) -> &[f32] {
        if i == 0 {
            &self.m1
        } else {
            &self.m2
        }
    }

    /// State buffer `i` (0 or 1), mutably.
    pub(crate) fn state_mut(&mut self, i: usize) -> &mut [f32] {
        if i == 0 {
            &mut self.m1
        } else {
            &mut self.m2
        }
    }

    /// Bytes held (allocation sizes, padding included).
    pub(crate) fn allocated_bytes(&self) -> usize {
        self.weights.allocated_bytes() + self.m1.allocated_bytes() + self.m2.allocated_bytes()
    }

    /// Pooled (or unpooled) lookup of a validated batch.
    pub(crate) fn forward(
        &self,
        cfg: &TbeConfig,
        layout: &TbeLayout,
        batch: &Batch<'_>,
    ) -> Result<Tensor> {
        let stride = layout.out_stride;
        let rows = batch.output_rows(cfg.pooling);
        // A new buffer the kernels write once (huge pages where large: its first writes fault
        // in 2 MiB at a time, not 4 KiB), never zero-filled first.
        let out = forward_new(
            batch,
            &layout.slots,
            cfg.pooling,
            stride,
            &self.visit(cfg, layout),
        );
        Tensor::from_vec(out, &[rows, stride])
    }

    /// [`forward`](Self::forward) into `out` (`rows × out_stride`, checked by the caller),
    /// every element of which it writes.
    pub(crate) fn forward_into(
        &self,
        cfg: &TbeConfig,
        layout: &TbeLayout,
        batch: &Batch<'_>,
        out: &mut [f32],
    ) {
        let visit = self.visit(cfg, layout);
        let stride = layout.out_stride;
        if cfg.pooling == PoolingMode::None {
            sequence_forward(batch, stride, out, &visit);
        } else {
            pooled_forward(batch, &layout.slots, cfg.pooling, out, stride, &visit);
        }
    }

    /// Hands the kernels feature `f`'s table.
    fn visit<'s>(&'s self, cfg: &'s TbeConfig, layout: &'s TbeLayout) -> impl VisitFeature + 's {
        move |f: usize, k: &mut dyn FnMut(&dyn PoolFeature)| {
            let t = cfg.feature_table_map[f];
            let rows = &self.weights[layout.weight_offsets[t]..layout.weight_offsets[t + 1]];
            with_f32_rows(rows, cfg.tables[t].dim, k)
        }
    }

    /// The fused backward of step `step` (1-based) for `grad_output` (`[rows_out, out_stride]`,
    /// checked by the caller).
    pub(crate) fn backward(
        &mut self,
        cfg: &TbeConfig,
        layout: &TbeLayout,
        batch: &Batch<'_>,
        grad_output: &[f32],
        optimizer: &FusedOptimizer,
        step: u64,
    ) -> BackwardOutput {
        // State slices follow the configured optimizer's layout, whatever `optimizer` runs.
        let state_len = |i: usize, rows: usize, dim: usize| cfg.optimizer.state_len(i, rows, dim);
        let mut weights_rest: &mut [f32] = &mut self.weights;
        let mut m1_rest: &mut [f32] = &mut self.m1;
        let mut m2_rest: &mut [f32] = &mut self.m2;
        let mut updates = Vec::with_capacity(cfg.tables.len());
        for (t, spec) in cfg.tables.iter().enumerate() {
            let elems = spec.rows * spec.dim;
            let (w, rest) = std::mem::take(&mut weights_rest).split_at_mut(elems);
            weights_rest = rest;
            let (m1, rest) =
                std::mem::take(&mut m1_rest).split_at_mut(state_len(0, spec.rows, spec.dim));
            m1_rest = rest;
            let (m2, rest) =
                std::mem::take(&mut m2_rest).split_at_mut(state_len(1, spec.rows, spec.dim));
            m2_rest = rest;
            let features: Vec<(usize, usize)> = (cfg.feature_table_map.iter().enumerate())
                .filter(|(_, &ft)| ft == t)
                .map(|(f, _)| (f, layout.slots[f].col))
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
        let step = BackwardStep {
            batch,
            pooling: cfg.pooling,
            grad_out: grad_output,
            out_stride: layout.out_stride,
            optimizer,
            decay: cfg.weight_decay,
            step,
        };
        fused_backward(&step, updates)
    }
}

/// Elements of optimizer state buffer `i` over every table (0 if the optimizer has none).
pub(crate) fn state_len(config: &TbeConfig, layout: &TbeLayout, i: usize) -> usize {
    match config.optimizer.state_shape(i) {
        Some(StateShape::PerRow) => layout.total_rows(),
        Some(StateShape::PerElement) => layout.total_elements(),
        None => 0,
    }
}
