//! The lookups on the device: pooled FP32 (one float per lane, 16-byte loads, a dims ≤ 128
//! variant), FP16/BF16 and FBGEMM's quantized rows, and unpooled lookups; a warp per bag (or
//! per id, unpooled).

use super::{DeviceBatch, DeviceTables, Weights};
use crate::args;
use crate::cuda::{KernelArg, LaunchConfig};
use crate::dtype::DType;
use crate::error::Result;
use crate::tensor::backend::cuda::empty;
use crate::Tensor;

crate::kernel_source!(
    pub(crate) static FORWARD = "tbe_forward.cu",
    [
        "tbe_forward_f32",
        "tbe_forward_f32_v4",
        "tbe_forward_f32_v4_d128",
        "tbe_forward_f16",
        "tbe_forward_bf16",
        "tbe_sequence_f32",
    ];
);

crate::kernel_source!(
    pub(crate) static FORWARD_QUANTIZED = "tbe_forward_quantized.cu",
    ["tbe_forward_quantized", "tbe_sequence_quantized"];
);

impl DeviceTables {
    /// Rows of a lookup's output: `B` pooled, one per id unpooled.
    pub(crate) fn output_rows(&self, batch: &DeviceBatch) -> usize {
        if self.sequence {
            batch.num_ids
        } else {
            batch.batch_size
        }
    }

    /// The lookup of `batch` (validated, `F·B + 1` offsets): a new `[rows, out_stride]` f32
    /// tensor on the device, queued asynchronously.
    pub(crate) fn forward(&self, batch: &DeviceBatch) -> Result<Tensor> {
        let f = self.host_rows.len();
        let b = batch.batch_size;
        let out = empty(
            &self.device,
            DType::F32,
            &[self.output_rows(batch), self.out_stride],
        )?;
        if out.numel() == 0 {
            return Ok(out);
        }
        let first_bad = self.first_bad.lock();
        let (ids, offsets, weights) = (&batch.ids, &batch.offsets, batch.weights.as_ref());
        if self.sequence {
            let n = batch.num_ids;
            let (kernel, table): (_, Vec<&dyn KernelArg>) = match &self.weights {
                Weights::F32(w) => (
                    FORWARD.kernel("tbe_sequence_f32"),
                    vec![w, &self.table_offsets, &self.rows],
                ),
                Weights::Quantized {
                    bytes,
                    row_bytes,
                    types,
                    ..
                } => (
                    FORWARD_QUANTIZED.kernel("tbe_sequence_quantized"),
                    vec![bytes, &self.table_offsets, &self.rows, row_bytes, types],
                ),
            };
            let rest = args![
                self.out_stride as i32,
                b as i32,
                f as i32,
                ids,
                offsets,
                weights,
                n as i64,
                out,
                *first_bad
            ];
            // Arguments as in kernels/tbe_forward*.cu (tbe_sequence_*); offsets F·B+1 ending at
            // n (validated on the host), output N·D.
            return self
                .device
                .launch(
                    kernel,
                    LaunchConfig::warp_per_item(n, 4),
                    &[table, rest.to_vec()].concat(),
                )
                .map(|()| out);
        }
        let (kernel, table): (_, Vec<&dyn KernelArg>) = match &self.weights {
            Weights::F32(w) => {
                let name = if self.vectorized && self.host_dims_max <= 128 {
                    "tbe_forward_f32_v4_d128"
                } else if self.vectorized {
                    "tbe_forward_f32_v4"
                } else {
                    "tbe_forward_f32"
                };
                (
                    FORWARD.kernel(name),
                    vec![w, &self.table_offsets, &self.rows, &self.dims],
                )
            }
            // FP16/BF16 rows are `2·dim` bytes: the bytes are the tables' 2-byte values and the
            // element offsets count them.
            Weights::Quantized {
                bytes,
                half: Some((name, element_offsets)),
                ..
            } => (
                FORWARD.kernel(name),
                vec![bytes, element_offsets, &self.rows, &self.dims],
            ),
            Weights::Quantized {
                bytes,
                row_bytes,
                types,
                half: None,
            } => (
                FORWARD_QUANTIZED.kernel("tbe_forward_quantized"),
                vec![
                    bytes,
                    &self.table_offsets,
                    &self.rows,
                    row_bytes,
                    &self.dims,
                    types,
                ],
            ),
        };
        let rest = args![
            self.out_offsets,
            self.out_stride as i32,
            b as i32,
            f as i32,
            ids,
            offsets,
            weights,
            i32::from(self.mean),
            out,
            *first_bad
        ];
        // The arguments follow the kernels' signatures in kernels/tbe_forward*.cu; offsets are
        // F·B+1 (validated on the host), the output B·ΣD, the weights one per id.
        self.device.launch(
            kernel,
            LaunchConfig::warp_per_item(f * b, 4),
            &[table, rest.to_vec()].concat(),
        )?;
        Ok(out)
    }
}
