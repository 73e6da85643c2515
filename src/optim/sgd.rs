//! Stochastic gradient descent.

use std::sync::Arc;

use super::{check_param, for_each_range, impl_optimizer, touched};
use crate::cuda::CudaDevice;
use crate::tensor::dtype::FloatElem;
use crate::tensor::ops::with_float;
use crate::tensor::{run_on, DeviceOp};
use crate::{Gradient, Result, Tensor};

/// SGD with optional momentum (dampening, Nesterov) and L2 weight decay, as `torch.optim.SGD`.
pub struct Sgd {
    params: Vec<Tensor>,
    momentum_buffers: Vec<Option<Tensor>>,
    /// Learning rate.
    pub lr: f64,
    /// Momentum factor (0 disables).
    pub momentum: f64,
    /// Dampening of the momentum.
    pub dampening: f64,
    /// L2 penalty added to the gradient.
    pub weight_decay: f64,
    /// Nesterov momentum.
    pub nesterov: bool,
}

impl Sgd {
    /// Plain SGD with learning rate `lr`.
    pub fn new(params: Vec<Tensor>, lr: f64) -> Result<Self> {
        super::check_hyper("Sgd", "lr", lr)?;
        for p in &params {
            check_param("Sgd", p)?;
        }
        let n = params.len();
        Ok(Sgd {
            params,
            momentum_buffers: vec![None; n],
            lr,
            momentum: 0.0,
            dampening: 0.0,
            weight_decay: 0.0,
            nesterov: false,
        })
    }

    /// Learning rate, momentum, dampening and weight decay finite and not negative; Nesterov
    /// momentum with a momentum and no dampening (it would run as plain SGD). Checked at every
    /// step, as the settings are public fields.
    fn check_settings(&self) -> Result<()> {
        super::check_hypers(
            "Sgd",
            &[
                ("lr", self.lr),
                ("momentum", self.momentum),
                ("dampening", self.dampening),
                ("weight_decay", self.weight_decay),
            ],
        )?;
        if self.nesterov && (self.momentum <= 0.0 || self.dampening != 0.0) {
            return Err(crate::Error::invalid(
                "Sgd",
                format!(
                    "Nesterov momentum takes a momentum above 0 and dampening 0 (momentum {}, \
                     dampening {})",
                    self.momentum, self.dampening
                ),
            ));
        }
        Ok(())
    }

    /// Sets momentum.
    pub fn momentum(mut self, momentum: f64) -> Self {
        self.momentum = momentum;
        self
    }

    /// Sets L2 weight decay.
    pub fn weight_decay(mut self, wd: f64) -> Self {
        self.weight_decay = wd;
        self
    }

    /// Enables Nesterov momentum.
    pub fn nesterov(mut self, yes: bool) -> Self {
        self.nesterov = yes;
        self
    }

    fn state_entries(&self) -> Result<Vec<(String, Tensor)>> {
        let mut state = Vec::new();
        for (i, b) in self.momentum_buffers.iter().enumerate() {
            if let Some(b) = b {
                state.push((format!("momentum_buffer.{i}"), super::snapshot(b)?));
            }
        }
        Ok(state)
    }

    fn load_state_entries(&mut self, state: &[(String, Tensor)]) -> Result<()> {
        let buffers = (self.params.iter().enumerate())
            .map(|(i, p)| {
                super::state_entry("Sgd", state, &format!("momentum_buffer.{i}"), p)?
                    .map(|t| super::snapshot(t)?.to_device(p.device()))
                    .transpose()
            })
            .collect::<Result<Vec<_>>>()?;
        self.momentum_buffers = buffers;
        Ok(())
    }

    fn step_param(&mut self, i: usize) -> Result<()> {
        let p = &self.params[i];
        let Some(grad) = p.gradient() else {
            return Ok(());
        };
        let use_momentum = self.momentum != 0.0;
        let first = self.momentum_buffers[i].is_none();
        if use_momentum && first {
            self.momentum_buffers[i] = Some(p.try_zeros_like()?);
        }
        let step = SgdStep {
            sgd: self,
            i,
            grad: &grad,
            first,
        };
        run_on(self.params[i].device(), &step)
    }
}

/// One step of parameter `i` with its gradient.
struct SgdStep<'a> {
    sgd: &'a Sgd,
    i: usize,
    grad: &'a Gradient,
    /// The momentum buffer was just made (it takes the first update as is).
    first: bool,
}

impl SgdStep<'_> {
    fn momentum_buffer(&self) -> Option<&Tensor> {
        let s = self.sgd;
        s.momentum_buffers[self.i]
            .as_ref()
            .filter(|_| s.momentum != 0.0)
    }

    /// Momentum and weight decay touch every element: they densify sparse gradients.
    fn dense(&self) -> bool {
        self.sgd.momentum != 0.0 || self.sgd.weight_decay != 0.0
    }

    fn cpu_typed<T: FloatElem>(&self) -> Result<()> {
        let (s, first) = (self.sgd, self.first);
        let p = &s.params[self.i];
        let g = touched::<T>(p, self.grad, self.dense())?;
        let (lr, mom, damp, wd) = (
            T::from_f64(s.lr),
            T::from_f64(s.momentum),
            T::from_f64(s.dampening),
            T::from_f64(s.weight_decay),
        );
        let mut w = p.data_mut::<T>()?;
        let mut buf = match self.momentum_buffer() {
            Some(b) => Some(b.data_mut::<T>()?),
            None => None,
        };
        for_each_range(p, &g, |range, g| {
            for (k, j) in range.enumerate() {
                let mut d = g[k] + wd * w[j];
                if let Some(b) = buf.as_mut() {
                    b[j] = if first {
                        d
                    } else {
                        mom * b[j] + (T::one() - damp) * d
                    };
                    d = if s.nesterov { d + mom * b[j] } else { b[j] };
                }
                w[j] = w[j] - lr * d;
            }
        });
        Ok(())
    }
}

impl DeviceOp for SgdStep<'_> {
    type Output = ();
    fn cpu(&self) -> Result<()> {
        with_float!(self.sgd.params[self.i].dtype(), "Sgd", T => self.cpu_typed::<T>())
    }
    fn cuda(&self, _device: &Arc<CudaDevice>) -> Result<()> {
        let s = self.sgd;
        let grad = super::cuda::DeviceGrad::new(self.grad, self.dense())?;
        super::cuda::step(
            "Sgd",
            "sgd_step_f32",
            &s.params[self.i],
            &[self.momentum_buffer()],
            &grad,
            &crate::args![
                s.lr as f32,
                s.momentum as f32,
                s.dampening as f32,
                s.weight_decay as f32,
                i32::from(s.nesterov),
                i32::from(self.first)
            ],
        )
    }
}

impl_optimizer!(Sgd, "Sgd", lr);
