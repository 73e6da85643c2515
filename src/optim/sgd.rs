//! Stochastic gradient descent.

use super::{check_param, for_each_range, impl_optimizer, touched};
use crate::tensor::dtype::FloatElem;
use crate::{Result, Tensor};

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

    fn step_param<T: FloatElem>(&mut self, i: usize) -> Result<()> {
        let p = &self.params[i];
        let Some(grad) = p.gradient() else {
            return Ok(());
        };
        let use_momentum = self.momentum != 0.0;
        // Momentum and weight decay touch every element: densify sparse gradients for them.
        let first = self.momentum_buffers[i].is_none();
        if use_momentum && first {
            self.momentum_buffers[i] = Some(p.zeros_like());
        }
        let dense = use_momentum || self.weight_decay != 0.0;
        if let Some(g) = super::cuda_grad(p, &grad, dense)? {
            let buf = self.momentum_buffers[i].as_ref().filter(|_| use_momentum);
            let (lr, mom, damp, wd) = (self.lr, self.momentum, self.dampening, self.weight_decay);
            let nesterov = self.nesterov;
            return crate::tensor::cuda::optimizer_step(
                "Sgd",
                "sgd_step_f32",
                p,
                &[buf],
                &g.values,
                g.rows.as_deref(),
                |a| {
                    a.f32(lr as f32)
                        .f32(mom as f32)
                        .f32(damp as f32)
                        .f32(wd as f32)
                        .i32(i32::from(nesterov))
                        .i32(i32::from(first));
                },
            );
        }
        let g = touched::<T>(p, &grad, dense)?;
        let (lr, mom, damp, wd) = (
            T::from_f64(self.lr),
            T::from_f64(self.momentum),
            T::from_f64(self.dampening),
            T::from_f64(self.weight_decay),
        );
        let mut w = p.data_mut::<T>()?;
        let mut buf = match &self.momentum_buffers[i] {
            Some(b) if use_momentum => Some(b.data_mut::<T>()?),
            _ => None,
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
                    d = if self.nesterov { d + mom * b[j] } else { b[j] };
                }
                w[j] = w[j] - lr * d;
            }
        });
        Ok(())
    }
}

impl_optimizer!(Sgd, "Sgd", lr);
