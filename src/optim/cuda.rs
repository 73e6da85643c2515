//! The CUDA half of the dense optimizers' steps (`kernels/optim.cu`): the same formulas and
//! order of operations as their CPU halves, over contiguous f32 buffers on the device, on the
//! whole parameter or on just the rows of a row-sparse gradient.

use crate::cuda::{KernelArg, LaunchConfig};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::tensor::backend::cuda::{device_of, expect_f32};
use crate::tensor::device::same_device;
use crate::{Gradient, Tensor};

crate::kernel_source!(
    pub(crate) static OPTIM = "optim.cu",
    ["sgd_step_f32", "adagrad_step_f32", "adam_step_f32"];
);

/// Threads per block.
const THREADS: u32 = 256;

/// A CUDA parameter's gradient as the kernels take it: dense like the parameter, or (for a
/// row-sparse gradient the update does not densify) just the rows `rows`, coalesced.
pub(super) struct DeviceGrad {
    values: Tensor,
    /// Sorted distinct rows (`None`: dense).
    rows: Option<Vec<i64>>,
}

impl DeviceGrad {
    /// `grad` of a parameter, row-sparse gradients kept so unless `dense` asks for every
    /// element (as the CPU's `touched`).
    pub(super) fn new(grad: &Gradient, dense: bool) -> Result<Self> {
        Ok(match grad {
            Gradient::Dense(g) => DeviceGrad {
                values: g.clone(),
                rows: None,
            },
            Gradient::RowSparse(s) if !dense => {
                let s = s.coalesce()?;
                DeviceGrad {
                    values: s.values,
                    rows: Some(s.rows),
                }
            }
            Gradient::RowSparse(s) => DeviceGrad {
                values: s.to_dense()?,
                rows: None,
            },
        })
    }
}

/// Checks `t` is a contiguous f32 tensor of `like`'s device and element count.
fn f32_like(op: &'static str, what: &str, t: &Tensor, like: &Tensor) -> Result<()> {
    expect_f32(op, t)?;
    same_device(op, like, t)?;
    if !t.is_contiguous() || t.numel() != like.numel() {
        return Err(Error::invalid(
            op,
            format!(
                "{what} must be a contiguous tensor of {} elements, got shape {:?}",
                like.numel(),
                t.shape()
            ),
        ));
    }
    Ok(())
}

/// One in-place step of `kernel` on CUDA parameter `w`: the kernel takes
/// `(w, state…, g, n, rows, row_len, scalars…)`, absent state buffers as null pointers. With
/// a row-sparse `grad` only its rows (checked sorted, distinct and in range) are updated.
pub(super) fn step(
    op: &'static str,
    kernel: &'static str,
    w: &Tensor,
    state: &[Option<&Tensor>],
    grad: &DeviceGrad,
    scalars: &[&dyn KernelArg],
) -> Result<()> {
    f32_like(op, "the parameter", w, w)?;
    for s in state.iter().flatten() {
        f32_like(op, "optimizer state", s, w)?;
    }
    let device = device_of(w)?;
    let values = grad.values.contiguous_values()?;
    let num_rows = w.shape().first().copied().unwrap_or(1);
    let row_len = w.numel().checked_div(num_rows).unwrap_or(0);
    let rows = match &grad.rows {
        None => {
            f32_like(op, "the gradient", &values, w)?;
            None
        }
        Some(rows) => {
            expect_f32(op, &values)?;
            same_device(op, w, &values)?;
            if values.numel() != rows.len() * row_len {
                return Err(Error::invalid(
                    op,
                    format!(
                        "a row-sparse gradient of {} rows of {row_len} elements has shape {:?}",
                        rows.len(),
                        values.shape()
                    ),
                ));
            }
            if let Some((k, &r)) = (rows.iter().enumerate())
                .find(|&(k, &r)| r < 0 || r as usize >= num_rows || (k > 0 && rows[k - 1] >= r))
            {
                return Err(Error::invalid(
                    op,
                    format!(
                        "row-sparse gradient entry {k} names row {r}: rows must be sorted, \
                         distinct and below the parameter's {num_rows}"
                    ),
                ));
            }
            (!rows.is_empty()).then(|| device.htod(rows)).transpose()?
        }
    };
    let n = values.numel();
    if n == 0 {
        return Ok(());
    }
    debug_assert_eq!(values.dtype(), DType::F32);
    let mut args: Vec<&dyn KernelArg> = vec![w];
    args.extend(state.iter().map(|s| s as &dyn KernelArg));
    let (n, row_len, rows) = (n as i64, row_len as i64, rows.as_ref());
    args.extend([&values as &dyn KernelArg, &n, &rows, &row_len]);
    args.extend_from_slice(scalars);
    // The parameter and its state are contiguous f32 buffers of w.numel() elements; the
    // gradient holds n elements, either all of w's or `rows` (checked above) of row_len each.
    device.launch(
        OPTIM.kernel(kernel),
        LaunchConfig::linear(n as usize, THREADS),
        &args,
    )?;
    // Writes in place: counted for the backwards that saved them (`Tensor::version`).
    w.mark_modified();
    state.iter().flatten().for_each(|s| s.mark_modified());
    Ok(())
}
