//! Optimizers for dense parameters: SGD (momentum, Nesterov, weight decay), Adagrad, Adam and
//! AdamW. Each accepts dense and row-sparse gradients; with a row-sparse gradient only the
//! touched rows (and their state) change, as PyTorch's sparse Adagrad and SparseAdam do.
//! (Embedding tables use the optimizers fused into the embedding-bag backward instead.)

mod adagrad;
mod adam;
pub(crate) mod cuda;
mod sgd;

pub use adagrad::Adagrad;
pub use adam::{Adam, AdamConfig};
pub use sgd::Sgd;

use crate::tensor::dtype::FloatElem;
use crate::tensor::ops::with_float;
use crate::{Error, Gradient, Result, Tensor};

/// A dense-parameter optimizer.
pub trait Optimizer {
    /// Applies one update from the parameters' accumulated gradients (parameters without a
    /// gradient are left alone).
    fn step(&mut self) -> Result<()>;
    /// Clears the parameters' gradients.
    fn zero_grad(&self);
    /// Current learning rate.
    fn learning_rate(&self) -> f64;
    /// Sets the learning rate (for schedules).
    fn set_learning_rate(&mut self, lr: f64);
    /// The optimizer's state as named tensors (per-parameter buffers such as `sum.3`, and
    /// `step`, the per-parameter step counts), for checkpoints. The tensors are copies.
    fn state_dict(&self) -> Result<Vec<(String, Tensor)>>;
    /// Restores what [`state_dict`](Optimizer::state_dict) returned for the same parameters.
    /// Every name, dtype and shape is checked before anything changes.
    fn load_state_dict(&mut self, state: &[(String, Tensor)]) -> Result<()>;
}

/// Implements [`Optimizer`] for a type with `params: Vec<Tensor>`, a learning-rate field and
/// a `step_param(i)` that updates parameter `i` (its CPU or CUDA half, by the parameter's
/// device).
macro_rules! impl_optimizer {
    ($ty:ident, $name:literal, $($lr:ident).+) => {
        impl $crate::optim::Optimizer for $ty {
            fn step(&mut self) -> $crate::Result<()> {
                // Settings are public fields and `set_learning_rate`: checked before any update
                // (a NaN learning rate or momentum made every parameter NaN).
                self.check_settings()?;
                for i in 0..self.params.len() {
                    self.step_param(i)?;
                }
                Ok(())
            }
            fn zero_grad(&self) {
                self.params.iter().for_each($crate::Tensor::zero_grad);
            }
            fn learning_rate(&self) -> f64 {
                self.$($lr).+
            }
            fn set_learning_rate(&mut self, lr: f64) {
                self.$($lr).+ = lr;
            }
            fn state_dict(&self) -> $crate::Result<Vec<(String, $crate::Tensor)>> {
                self.state_entries()
            }
            fn load_state_dict(&mut self, state: &[(String, $crate::Tensor)]) -> $crate::Result<()> {
                self.load_state_entries(state)
            }
        }
    };
}
pub(crate) use impl_optimizer;

/// Where an update applies: the whole parameter, or some rows of it.
pub(crate) enum Touched<T> {
    /// Dense gradient over every element.
    All(Vec<T>),
    /// Sorted unique rows and their gradients `[rows.len() * row_len]`.
    Rows(Vec<usize>, Vec<T>),
}

/// Reads a parameter's gradient as contiguous `T` values, coalescing sparse ones. `dense`
/// forces sparse gradients into dense form (for updates that touch every element anyway).
pub(crate) fn touched<T: FloatElem>(
    param: &Tensor,
    grad: &Gradient,
    dense: bool,
) -> Result<Touched<T>> {
    match grad {
        Gradient::RowSparse(s) if !dense => {
            let s = s.coalesce()?;
            let rows = s.rows.iter().map(|&r| r as usize).collect();
            Ok(Touched::Rows(
                rows,
                s.values.cast_values(param.dtype())?.to_vec()?,
            ))
        }
        g => Ok(Touched::All(
            g.to_dense()?.cast_values(param.dtype())?.to_vec()?,
        )),
    }
}

/// Runs `update(range, grad)` over either every element or each touched row's element range.
pub(crate) fn for_each_range<T: Copy>(
    param: &Tensor,
    touched: &Touched<T>,
    mut update: impl FnMut(std::ops::Range<usize>, &[T]),
) {
    match touched {
        Touched::All(g) => update(0..g.len(), g),
        Touched::Rows(rows, g) => {
            let row_len = param.numel() / param.shape().first().copied().unwrap_or(1).max(1);
            for (i, &r) in rows.iter().enumerate() {
                update(
                    r * row_len..(r + 1) * row_len,
                    &g[i * row_len..(i + 1) * row_len],
                );
            }
        }
    }
}

/// Checks a hyper-parameter is finite and not negative (a NaN learning rate would silently
/// turn every parameter into NaN at the first step).
pub(crate) fn check_hyper(op: &'static str, name: &str, value: f64) -> Result<()> {
    if value.is_finite() && value >= 0.0 {
        Ok(())
    } else {
        Err(Error::invalid(
            op,
            format!("{name} is {value}; it must be finite and not negative"),
        ))
    }
}

/// [`check_hyper`] of each named setting, in order.
pub(crate) fn check_hypers(op: &'static str, settings: &[(&str, f64)]) -> Result<()> {
    settings
        .iter()
        .try_for_each(|&(name, value)| check_hyper(op, name, value))
}

/// Checks a parameter can be optimised (a contiguous float leaf).
pub(crate) fn check_param(op: &'static str, p: &Tensor) -> Result<()> {
    if !p.is_leaf() || !p.is_contiguous() {
        return Err(Error::invalid(
            op,
            format!(
                "parameters must be contiguous leaf tensors (shape {:?})",
                p.shape()
            ),
        ));
    }
    with_float!(p.dtype(), op, T => { let _ = std::mem::size_of::<T>(); Ok(()) })
}

/// A deep copy of a state buffer (state dicts must not alias the optimizer's buffers).
pub(crate) fn snapshot(t: &Tensor) -> Result<Tensor> {
    crate::tensor::ops::with_any_dtype!(t.dtype(), T => Tensor::from_vec(t.to_vec::<T>()?, t.shape()))
}

/// Per-parameter step counts as an `I64 [n]` tensor.
pub(crate) fn steps_tensor(steps: &[u64]) -> Result<Tensor> {
    Tensor::from_vec(steps.iter().map(|&s| s as i64).collect(), &[steps.len()])
}

/// The entry `name` of a state dict, if present, checked to have `like`'s dtype and shape.
pub(crate) fn state_entry<'a>(
    op: &'static str,
    state: &'a [(String, Tensor)],
    name: &str,
    like: &Tensor,
) -> Result<Option<&'a Tensor>> {
    let Some((_, t)) = state.iter().find(|(n, _)| n == name) else {
        return Ok(None);
    };
    if t.dtype() != like.dtype() || t.shape() != like.shape() {
        return Err(Error::invalid(
            op,
            format!(
                "state `{name}` is {:?} {:?}, the optimizer holds {:?} {:?}",
                t.dtype(),
                t.shape(),
                like.dtype(),
                like.shape()
            ),
        ));
    }
    Ok(Some(t))
}

/// Like [`state_entry`] but the entry must exist.
pub(crate) fn required_entry<'a>(
    op: &'static str,
    state: &'a [(String, Tensor)],
    name: &str,
    like: &Tensor,
) -> Result<&'a Tensor> {
    state_entry(op, state, name, like)?
        .ok_or_else(|| Error::invalid(op, format!("state `{name}` is missing")))
}

/// The `step` entry: one non-negative count per parameter.
pub(crate) fn state_steps(
    op: &'static str,
    state: &[(String, Tensor)],
    n: usize,
) -> Result<Vec<u64>> {
    let like = Tensor::try_zeros(&[n], crate::DType::I64, crate::Device::Cpu)?;
    let steps = required_entry(op, state, "step", &like)?.to_vec::<i64>()?;
    steps
        .iter()
        .map(|&s| {
            u64::try_from(s).map_err(|_| Error::invalid(op, format!("state `step` holds {s}")))
        })
        .collect()
}
