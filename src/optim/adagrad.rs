//! Adagrad.

use std::sync::Arc;

use rayon::prelude::*;

use super::{check_param, for_each_range, impl_optimizer, touched, Touched};
use crate::cuda::CudaDevice;
use crate::tensor::dtype::FloatElem;
use crate::tensor::ops::{with_float, PAR_THRESHOLD};
use crate::tensor::{run_on, DeviceOp};
use crate::{Gradient, Result, Tensor};

/// Adagrad as `torch.optim.Adagrad`: `s += g²`, `w −= lr_t · g / (√s + eps)` with
/// `lr_t = lr / (1 + (t−1)·lr_decay)`. Sparse gradients update only their rows.
pub struct Adagrad {
    params: Vec<Tensor>,
    sums: Vec<Tensor>,
    steps: Vec<u64>,
    /// Learning rate.
    pub lr: f64,
    /// Learning-rate decay per step.
    pub lr_decay: f64,
    /// L2 penalty added to the gradient (densifies sparse gradients).
    pub weight_decay: f64,
    /// Added to the denominator.
    pub eps: f64,
}

impl Adagrad {
    /// Adagrad with learning rate `lr`, eps 1e-10 and an initial accumulator of
    /// `initial_accumulator_value`.
    pub fn new(params: Vec<Tensor>, lr: f64, initial_accumulator_value: f64) -> Result<Self> {
        super::check_hyper("Adagrad", "lr", lr)?;
        super::check_hyper(
            "Adagrad",
            "initial_accumulator_value",
            initial_accumulator_value,
        )?;
        for p in &params {
            check_param("Adagrad", p)?;
        }
        let sums = params
            .iter()
            .map(|p| Tensor::try_full(initial_accumulator_value, p.shape(), p.dtype(), p.device()))
            .collect::<Result<_>>()?;
        let n = params.len();
        Ok(Adagrad {
            params,
            sums,
            steps: vec![0; n],
            lr,
            lr_decay: 0.0,
            weight_decay: 0.0,
            eps: 1e-10,
        })
    }

    /// Learning rate, its decay, weight decay and eps: finite and not negative (checked at
    /// every step, as they are public fields).
    fn check_settings(&self) -> Result<()> {
        super::check_hypers(
            "Adagrad",
            &[
                ("lr", self.lr),
                ("lr_decay", self.lr_decay),
                ("weight_decay", self.weight_decay),
                ("eps", self.eps),
            ],
        )
    }

    /// The accumulated squared gradients, one per parameter (checkpointable state).
    pub fn state(&self) -> &[Tensor] {
        &self.sums
    }

    fn state_entries(&self) -> Result<Vec<(String, Tensor)>> {
        let mut state = Vec::with_capacity(self.sums.len() + 1);
        for (i, s) in self.sums.iter().enumerate() {
            state.push((format!("sum.{i}"), super::snapshot(s)?));
        }
        state.push(("step".to_string(), super::steps_tensor(&self.steps)?));
        Ok(state)
    }

    fn load_state_entries(&mut self, state: &[(String, Tensor)]) -> Result<()> {
        let sums = (self.sums.iter().enumerate())
            .map(|(i, s)| super::required_entry("Adagrad", state, &format!("sum.{i}"), s))
            .collect::<Result<Vec<_>>>()?;
        let steps = super::state_steps("Adagrad", state, self.params.len())?;
        for (s, new) in self.sums.iter().zip(sums) {
            s.copy_from(new)?;
        }
        self.steps = steps;
        Ok(())
    }

    fn step_param(&mut self, i: usize) -> Result<()> {
        let p = &self.params[i];
        let Some(grad) = p.gradient() else {
            return Ok(());
        };
        self.steps[i] += 1;
        let step = AdagradStep {
            adagrad: self,
            i,
            grad: &grad,
            clr: self.lr / (1.0 + (self.steps[i] - 1) as f64 * self.lr_decay),
        };
        run_on(self.params[i].device(), &step)
    }
}

/// One step of parameter `i` with its gradient.
struct AdagradStep<'a> {
    adagrad: &'a Adagrad,
    i: usize,
    grad: &'a Gradient,
    /// This step's learning rate.
    clr: f64,
}

impl AdagradStep<'_> {
    /// Weight decay touches every element: it densifies sparse gradients.
    fn dense(&self) -> bool {
        self.adagrad.weight_decay != 0.0
    }

    fn cpu_typed<T: FloatElem>(&self) -> Result<()> {
        let a = self.adagrad;
        let p = &a.params[self.i];
        let g = touched::<T>(p, self.grad, self.dense())?;
        let clr = T::from_f64(self.clr);
        let (wd, eps) = (T::from_f64(a.weight_decay), T::from_f64(a.eps));
        let mut w = p.data_mut::<T>()?;
        let mut s = a.sums[self.i].data_mut::<T>()?;
        let update = |w: &mut [T], s: &mut [T], g: &[T]| {
            for ((w, s), &g) in w.iter_mut().zip(s.iter_mut()).zip(g) {
                let d = g + wd * *w;
                *s += d * d;
                *w = *w - clr * d / (s.sqrt() + eps);
            }
        };
        match &g {
            // Large dense updates run in parallel chunks (each element is independent, so the
            // result does not depend on the split).
            Touched::All(g) if g.len() >= PAR_THRESHOLD => {
                const CHUNK: usize = 1 << 14;
                w.par_chunks_mut(CHUNK)
                    .zip(s.par_chunks_mut(CHUNK))
                    .zip(g.par_chunks(CHUNK))
                    .for_each(|((w, s), g)| update(w, s, g));
            }
            _ => for_each_range(p, &g, |range, g| {
                update(&mut w[range.clone()], &mut s[range], g)
            }),
        }
        Ok(())
    }
}

impl DeviceOp for AdagradStep<'_> {
    type Output = ();
    fn cpu(&self) -> Result<()> {
        with_float!(self.adagrad.params[self.i].dtype(), "Adagrad", T => self.cpu_typed::<T>())
    }
    fn cuda(&self, _device: &Arc<CudaDevice>) -> Result<()> {
        let a = self.adagrad;
        let grad = super::cuda::DeviceGrad::new(self.grad, self.dense())?;
        super::cuda::step(
            "Adagrad",
            "adagrad_step_f32",
            &a.params[self.i],
            &[Some(&a.sums[self.i])],
            &grad,
            &crate::args![self.clr as f32, a.weight_decay as f32, a.eps as f32],
        )
    }
}

impl_optimizer!(Adagrad, "Adagrad", lr);
