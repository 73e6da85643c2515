//! The fused backward on the device: one key per occurrence (row, then position or bag),
//! radix-sorted by row; one warp per occurrence walks its row's run of keys in order, so each
//! row's gradient is summed in a fixed order (deterministic) and the row updated once in place
//! with the fused optimizer — the CPU's update rules. Without a fused optimizer the same warps
//! write each distinct row's summed gradient instead (row-sparse gradients).

use super::{DeviceBatch, DeviceTables};
use crate::args;
use crate::cuda::{radix_sort_u64, scan_exclusive_i64, DeviceBuffer, LaunchConfig};
use crate::dtype::DType;
use crate::embedding::optimizer::{bias_corrections, FusedOptimizer, WeightDecay};
use crate::error::{Error, Result};
use crate::tensor::backend::cuda::{empty, from_buffer};
use crate::Tensor;

crate::kernel_source!(
    pub(crate) static BACKWARD = "tbe_backward.cu",
    [
        "tbe_backward_keys",
        "tbe_sparse_heads",
        "tbe_backward_update",
        "tbe_backward_update_d128",
    ];
);

const OP: &str = "TableBatchedEmbedding";

/// One backward: the forward's inputs (on the device), the gradient of its output, and the
/// optimizer step to take.
pub(crate) struct BackwardInput<'a> {
    pub batch: &'a DeviceBatch,
    /// `[rows, out_stride]` f32 on the tables' device (the forward output's gradient).
    pub grad_output: &'a Tensor,
    /// The fused optimizer, or [`FusedOptimizer::None`] for row-sparse gradients.
    pub optimizer: FusedOptimizer,
    pub decay: WeightDecay,
    /// This backward's number (1-based; Adam's bias correction).
    pub step: u64,
    /// Compute the per-sample weights' gradient (the batch has weights).
    pub weights_grad: bool,
}

/// What a backward returns besides the updated tables.
pub(crate) struct DeviceGrads {
    /// `[num_ids]` f32: each occurrence's per-sample-weight gradient (row before its update ·
    /// its output gradient, / bag length with mean pooling).
    pub weights_grad: Option<Tensor>,
    /// Without a fused optimizer: the distinct rows touched (global numbers, sorted) and their
    /// summed gradients `[rows, max_dim]` on the device.
    pub sparse: Option<(Vec<i64>, Tensor)>,
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
            // Row-sparse gradients: the kernel writes them instead of updating.
            FusedOptimizer::None => h.code = 7,
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

/// Where the row-sparse backward writes: per sorted key its slot among the distinct rows, and
/// zeroed outputs for their numbers and `[rows, max_dim]` gradients.
struct SparseSlots {
    slots: DeviceBuffer<i64>,
    rows: DeviceBuffer<i64>,
    values: DeviceBuffer<f32>,
    distinct: usize,
}

impl DeviceTables {
    /// The distinct rows of sorted `keys` (n of them). Reads the count back (waits for the
    /// device).
    fn sparse_slots(&self, keys: &DeviceBuffer<u64>, n: usize) -> Result<SparseSlots> {
        let device = &self.device;
        let heads = device.alloc::<i64>(n)?;
        // keys and heads hold n values.
        device.launch(
            BACKWARD.kernel("tbe_sparse_heads"),
            LaunchConfig::linear(n, 256),
            &args![keys, n as i64, heads],
        )?;
        let mut slots = device.alloc::<i64>(n)?;
        scan_exclusive_i64(&heads, &mut slots, n)?;
        let mut last = [0u8; 16];
        device.read_bytes(&slots, (n - 1) * 8, &mut last[..8])?;
        device.read_bytes(&heads, (n - 1) * 8, &mut last[8..])?;
        let word = |b: &[u8]| i64::from_le_bytes(b.try_into().expect("8 bytes"));
        let distinct = (word(&last[..8]) + word(&last[8..])) as usize;
        Ok(SparseSlots {
            slots,
            rows: device.zeros::<i64>(distinct.max(1))?,
            values: device.zeros::<f32>((distinct * self.host_dims_max).max(1))?,
            distinct,
        })
    }

    /// One fused (or, with [`FusedOptimizer::None`], row-sparse) backward of FP32 tables for
    /// `input` (the batch of the forward whose output `grad_output` is the gradient of).
    pub(crate) fn backward(&mut self, input: BackwardInput<'_>) -> Result<DeviceGrads> {
        let BackwardInput {
            batch,
            grad_output,
            optimizer,
            decay,
            step,
            weights_grad: want_weights_grad,
        } = input;
        let sparse = optimizer == FusedOptimizer::None;
        let weights = self.f32_weights()?;
        if self.host_dims_max > 512 {
            return Err(Error::invalid(
                OP,
                "dims above 512 are not supported by the GPU backward",
            ));
        }
        let (f, b, n) = (self.host_rows.len(), batch.batch_size, batch.num_ids);
        let grad_len = self.output_rows(batch) * self.out_stride;
        if grad_output.dtype() != DType::F32 || grad_output.numel() != grad_len {
            return Err(Error::invalid(
                OP,
                format!(
                    "the output gradient must be {grad_len} f32 values, got {:?} {:?}",
                    grad_output.dtype(),
                    grad_output.shape()
                ),
            ));
        }
        let grad_output = grad_output.contiguous_values()?;
        if want_weights_grad && batch.weights.is_none() {
            return Err(Error::invalid(
                OP,
                "a per-sample-weight gradient needs per-sample weights",
            ));
        }
        if n >= 1 << 24 {
            return Err(Error::invalid(
                OP,
                format!("{n} ids: the GPU backward takes at most 2^24 − 1 per batch"),
            ));
        }
        let weights_grad = if want_weights_grad {
            Some(crate::tensor::backend::cuda::zeroed(
                &self.device,
                DType::F32,
                &[n],
            )?)
        } else {
            None
        };
        if n == 0 {
            let nothing = (
                Vec::new(),
                empty(&self.device, DType::F32, &[0, self.host_dims_max])?,
            );
            return Ok(DeviceGrads {
                weights_grad,
                sparse: sparse.then_some(nothing),
            });
        }
        let device = &self.device;
        let keys = device.alloc::<u64>(n)?;
        // When nothing needs an occurrence's position (pooled, no per-sample weights, no weight
        // gradient) the keys carry its bag instead and the bag_of table is not needed.
        let key_is_bag =
            !self.sequence && batch.weights.is_none() && weights_grad.is_none() && f * b < 1 << 24;
        let bag_of = if key_is_bag {
            None
        } else {
            Some(device.alloc::<i32>(n)?)
        };
        // keys and (unless key_is_bag, when bags < 2^24) bag_of have n entries, offsets F·B+1.
        device.launch(
            BACKWARD.kernel("tbe_backward_keys"),
            LaunchConfig::warp_per_item(f * b, 8),
            &args![
                batch.ids,
                batch.offsets,
                b as i32,
                f as i32,
                self.row_starts,
                self.rows,
                keys,
                bag_of.as_ref(),
                i32::from(key_is_bag)
            ],
        )?;
        // Sort by the row bits: enough bits that the all-ones pattern (the key of an
        // out-of-range id) lies above every row number.
        let total_rows = self.total_rows as u64;
        if total_rows >= 1 << 40 {
            return Err(Error::invalid(
                OP,
                format!("{total_rows} rows: the GPU backward numbers at most 2^40 rows"),
            ));
        }
        let keys = radix_sort_u64(keys, 24, 64 - total_rows.leading_zeros())?;
        let h = Hyper::of(optimizer, decay, step);
        let m1 = self.state.first();
        let m2 = self.state.get(1).or(m1);
        let slots = sparse.then(|| self.sparse_slots(&keys, n)).transpose()?;
        let (slot_of, rows_out, values_out) = match &slots {
            Some(s) => (Some(&s.slots), Some(&s.rows), Some(&s.values)),
            None => (None, None, None),
        };
        // Tables of dims up to 128 take the variant with 4 values per lane (fewer registers,
        // more warps in flight).
        let kernel = if self.host_dims_max <= 128 {
            "tbe_backward_update_d128"
        } else {
            "tbe_backward_update"
        };
        // Arguments as in kernels/tbe_backward.cu; the state buffers have the shapes the
        // optimizer code reads (per row: every row number; per element: as the weights); every
        // row is written by one warp; in sparse mode every distinct row has its slot below the
        // outputs' row count.
        device.launch(
            BACKWARD.kernel(kernel),
            LaunchConfig::warp_per_item(n, 4),
            &args![
                keys,
                n as i64,
                bag_of.as_ref(),
                i32::from(key_is_bag),
                batch.offsets,
                b as i32,
                batch.weights.as_ref(),
                i32::from(self.mean),
                i32::from(self.sequence),
                grad_output,
                self.out_stride as i32,
                self.out_offsets,
                self.dims,
                self.table_offsets,
                self.row_starts,
                weights,
                m1,
                m2,
                h.code,
                h.lr,
                h.eps,
                h.beta1,
                h.beta2,
                h.correction1,
                h.correction2,
                h.decay,
                h.lambda,
                weights_grad.as_ref(),
                slot_of,
                rows_out,
                values_out,
                self.host_dims_max as i32
            ],
        )?;
        let sparse = match slots {
            None => None,
            Some(s) => {
                let mut rows = s.rows.to_host()?;
                rows.truncate(s.distinct);
                let values = if s.distinct == 0 {
                    empty(device, DType::F32, &[0, self.host_dims_max])?
                } else {
                    from_buffer(s.values, &[s.distinct, self.host_dims_max])?
                };
                Some((rows, values))
            }
        };
        Ok(DeviceGrads {
            weights_grad,
            sparse,
        })
    }
}
