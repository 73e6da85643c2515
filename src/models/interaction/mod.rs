//! DLRM's dot interaction as one fused op with its own backward.
//!
//! With `rows = [dense_b, sparse_b,0, …, sparse_b,F−1]` (`n = F+1` rows of dim `D`) the output
//! of sample `b` is `dense_b` followed by `⟨rows_i, rows_j⟩` for `i < j` in row-major order
//! (TorchRec's `triu_indices(n, n, offset=1)`). Only those `n(n−1)/2` dot products are computed
//! (half of the `n×n` batched matmul), and the backward is
//! `∂rows_i = Σ_{j≠i} g_ij · rows_j` (plus the pass-through gradient of `dense_b`), again
//! per sample. Samples are independent, so the work is split over threads by sample and the
//! result does not depend on the split.

mod cpu;
pub(crate) mod cuda;

use std::sync::Arc;

use crate::cuda::CudaDevice;
use crate::tensor::{record_op, run_on, BackwardOp, DeviceOp, SavedTensor};
use crate::{DType, Error, Gradient, Result, Tensor};

const OP: &str = "dot_interaction";
/// Samples per parallel task.
const SAMPLES_PER_TASK: usize = 16;

/// The interaction's values: `dense [B, D]`, `sparse [B, F, D]` → `[B, D + F(F+1)/2]`.
struct DotInteraction<'a> {
    dense: &'a Tensor,
    sparse: &'a Tensor,
}

impl DeviceOp for DotInteraction<'_> {
    type Output = Tensor;
    fn cpu(&self) -> Result<Tensor> {
        let (dense, sparse) = (self.dense, self.sparse);
        let (b, d) = (dense.shape()[0], dense.shape()[1]);
        let n = sparse.shape()[1] + 1;
        let width = d + n * (n - 1) / 2;
        match dense.dtype() {
            DType::F32 => Tensor::from_vec(cpu::run::<f32>(dense, sparse, b, n, d)?, &[b, width]),
            DType::F64 => Tensor::from_vec(cpu::run::<f64>(dense, sparse, b, n, d)?, &[b, width]),
            other => Err(Error::UnsupportedDType {
                op: OP,
                dtype: other,
                expected: "f32 or f64",
            }),
        }
    }
    fn cuda(&self, device: &Arc<CudaDevice>) -> Result<Tensor> {
        cuda::forward(device, self.dense, self.sparse)
    }
}

/// The saved inputs of the interaction; its gradients in `dense` and `sparse` from the
/// output's gradient.
struct DotInteractionBackward {
    dense: SavedTensor,
    sparse: SavedTensor,
    n: usize,
    d: usize,
}

/// The interaction's inputs as its backward reads them (checked unchanged since the forward).
struct SavedInputs<'a> {
    dense: &'a Tensor,
    sparse: &'a Tensor,
    n: usize,
    d: usize,
}

/// The backward's values for one output gradient.
struct InteractionGrads<'a> {
    saved: SavedInputs<'a>,
    grad_output: &'a Tensor,
}

impl DeviceOp for InteractionGrads<'_> {
    type Output = (Tensor, Tensor);
    fn cpu(&self) -> Result<(Tensor, Tensor)> {
        let s = &self.saved;
        let (n, d) = (s.n, s.d);
        let b = s.dense.shape()[0];
        let grad_output = self.grad_output.to_dtype(s.dense.dtype())?;
        match s.dense.dtype() {
            DType::F32 => {
                let (gd, gs) = cpu::run_backward::<f32>(s, &grad_output)?;
                Ok((
                    Tensor::from_vec(gd, &[b, d])?,
                    Tensor::from_vec(gs, &[b, n - 1, d])?,
                ))
            }
            DType::F64 => {
                let (gd, gs) = cpu::run_backward::<f64>(s, &grad_output)?;
                Ok((
                    Tensor::from_vec(gd, &[b, d])?,
                    Tensor::from_vec(gs, &[b, n - 1, d])?,
                ))
            }
            other => Err(Error::UnsupportedDType {
                op: OP,
                dtype: other,
                expected: "f32 or f64",
            }),
        }
    }
    fn cuda(&self, device: &Arc<CudaDevice>) -> Result<(Tensor, Tensor)> {
        cuda::backward(
            device,
            self.saved.dense,
            self.saved.sparse,
            self.grad_output,
        )
    }
}

impl BackwardOp for DotInteractionBackward {
    fn name(&self) -> &'static str {
        OP
    }

    fn backward(&self, grad_output: &Tensor) -> Result<Vec<Option<Gradient>>> {
        let grads = InteractionGrads {
            saved: SavedInputs {
                dense: self.dense.get(OP)?,
                sparse: self.sparse.get(OP)?,
                n: self.n,
                d: self.d,
            },
            grad_output,
        };
        let (grad_dense, grad_sparse) = run_on(self.dense.device(), &grads)?;
        Ok(vec![
            Some(Gradient::Dense(grad_dense)),
            Some(Gradient::Dense(grad_sparse)),
        ])
    }
}

/// The fused dot interaction: `dense [B, D]`, `sparse [B, F, D]` (same float dtype) →
/// `[B, D + F(F+1)/2]`, differentiable in both inputs. With no sparse feature (`F = 0`) the
/// output is the dense input's values, as TorchRec's.
pub fn dot_interaction(dense: &Tensor, sparse: &Tensor) -> Result<Tensor> {
    if dense.rank() != 2
        || sparse.rank() != 3
        || sparse.shape()[0] != dense.shape()[0]
        || sparse.shape()[2] != dense.shape()[1]
    {
        return Err(Error::ShapeMismatch {
            op: OP,
            lhs: dense.shape().to_vec(),
            rhs: sparse.shape().to_vec(),
            detail: "expected dense [B, D] and sparse [B, F, D]".into(),
        });
    }
    let d = dense.shape()[1];
    let n = sparse.shape()[1] + 1;
    if dense.dtype() != sparse.dtype() {
        return Err(Error::DTypeMismatch {
            op: OP,
            lhs: dense.dtype(),
            rhs: sparse.dtype(),
        });
    }
    if d == 0 {
        return Err(Error::invalid(OP, "the embedding dim must be at least 1"));
    }
    crate::tensor::device::same_device(OP, dense, sparse)?;
    if n == 1 {
        // No pair to take a product of (the kernels' work splits assume one).
        return dense.mul_scalar(1.0);
    }
    let out = run_on(dense.device(), &DotInteraction { dense, sparse })?;
    Ok(record_op(
        out,
        &[dense, sparse],
        DotInteractionBackward {
            dense: SavedTensor::new(&dense.detach()),
            sparse: SavedTensor::new(&sparse.detach()),
            n,
            d,
        },
    ))
}
