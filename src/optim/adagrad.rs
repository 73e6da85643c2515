//! Adagrad.

use rayon::prelude::*;

use super::{check_param, for_each_range, impl_optimizer, touched, Touched};
use crate::tensor::dtype::FloatElem;
use crate::tensor::ops::PAR_THRESHOLD;
use crate::{Result, Tensor};

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
            .map(|p| Tensor::full(initial_accumulator_value, p.shape(), p.dtype(), p.device()))
            .collect();
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

    fn step_param<T: FloatElem>(&mut self, i: usize) -> Result<()> {
        let p = &self.params[i];
        let Some(grad) = p.gradient() else {
            return Ok(());
        };
        self.steps[i] += 1;
        let clr = self.lr / (1.0 + (self.steps[i] - 1) as f64 * self.lr_decay);
        let dense = self.weight_decay != 0.0;
        if let Some(g) = super::cuda_grad(p, &grad, dense)? {
            let (wd, eps) = (self.weight_decay, self.eps);
            let sums = Some(&self.sums[i]);
            return crate::tensor::cuda::optimizer_step(
                "Adagrad",
                "adagrad_step_f32",
                p,
                &[sums],
                &g.values,
                g.rows.as_deref(),
                |a| {
                    a.f32(clr as f32).f32(wd as f32).f32(eps as f32);
                },
            );
        }
        let g = touched::<T>(p, &grad, dense)?;
        let clr = T::from_f64(clr);
        let (wd, eps) = (T::from_f64(self.weight_decay), T::from_f64(self.eps));
        let mut w = p.data_mut::<T>()?;
        let mut s = self.sums[i].data_mut::<T>()?;
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

impl_optimizer!(Adagrad, "Adagrad", lr);
