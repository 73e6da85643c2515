//! Adam and AdamW.

use std::sync::Arc;

use super::{check_param, for_each_range, impl_optimizer, touched};
use crate::cuda::CudaDevice;
use crate::tensor::dtype::FloatElem;
use crate::tensor::ops::with_float;
use crate::tensor::{run_on, DeviceOp};
use crate::{Gradient, Result, Tensor};

/// Hyper-parameters of [`Adam`].
#[derive(Clone, Copy, Debug)]
pub struct AdamConfig {
    /// Learning rate.
    pub lr: f64,
    /// Decay rates of the first and second moment.
    pub betas: (f64, f64),
    /// Added to the denominator.
    pub eps: f64,
    /// Weight decay: an L2 term in the gradient (Adam) or decoupled shrinkage (AdamW).
    pub weight_decay: f64,
    /// Decoupled weight decay (AdamW) instead of L2.
    pub decoupled_weight_decay: bool,
    /// Keep the running maximum of the second moment (AMSGrad).
    pub amsgrad: bool,
}

impl Default for AdamConfig {
    fn default() -> Self {
        AdamConfig {
            lr: 1e-3,
            betas: (0.9, 0.999),
            eps: 1e-8,
            weight_decay: 0.0,
            decoupled_weight_decay: false,
            amsgrad: false,
        }
    }
}

impl AdamConfig {
    /// AdamW defaults (`weight_decay` 0.01, decoupled), as `torch.optim.AdamW`.
    pub fn adamw(lr: f64) -> Self {
        AdamConfig {
            lr,
            weight_decay: 0.01,
            decoupled_weight_decay: true,
            ..Default::default()
        }
    }
}

/// Adam / AdamW as `torch.optim.Adam(W)`. With a row-sparse gradient only the touched rows'
/// moments are updated (lazy, as `SparseAdam`), with the parameter's global step count.
pub struct Adam {
    params: Vec<Tensor>,
    exp_avg: Vec<Tensor>,
    exp_avg_sq: Vec<Tensor>,
    max_exp_avg_sq: Vec<Option<Tensor>>,
    steps: Vec<u64>,
    /// Hyper-parameters.
    pub config: AdamConfig,
}

/// Learning rate, eps and weight decay finite and not negative; betas in [0, 1).
fn check_config(config: &AdamConfig) -> Result<()> {
    super::check_hypers(
        "Adam",
        &[
            ("lr", config.lr),
            ("eps", config.eps),
            ("weight_decay", config.weight_decay),
        ],
    )?;
    if !(0.0..1.0).contains(&config.betas.0) || !(0.0..1.0).contains(&config.betas.1) {
        return Err(crate::Error::invalid(
            "Adam",
            format!("betas {:?} must lie in [0, 1)", config.betas),
        ));
    }
    Ok(())
}

impl Adam {
    /// The settings, checked again at every step: see [`check_config`].
    fn check_settings(&self) -> Result<()> {
        check_config(&self.config)
    }

    /// A new optimizer over `params`.
    pub fn new(params: Vec<Tensor>, config: AdamConfig) -> Result<Self> {
        check_config(&config)?;
        for p in &params {
            check_param("Adam", p)?;
        }
        let n = params.len();
        Ok(Adam {
            exp_avg: params
                .iter()
                .map(Tensor::try_zeros_like)
                .collect::<Result<_>>()?,
            exp_avg_sq: params
                .iter()
                .map(Tensor::try_zeros_like)
                .collect::<Result<_>>()?,
            max_exp_avg_sq: params
                .iter()
                .map(|p| config.amsgrad.then(|| p.try_zeros_like()).transpose())
                .collect::<Result<_>>()?,
            steps: vec![0; n],
            params,
            config,
        })
    }

    fn state_entries(&self) -> Result<Vec<(String, Tensor)>> {
        let mut state = Vec::new();
        for i in 0..self.params.len() {
            state.push((format!("exp_avg.{i}"), super::snapshot(&self.exp_avg[i])?));
            state.push((
                format!("exp_avg_sq.{i}"),
                super::snapshot(&self.exp_avg_sq[i])?,
            ));
            if let Some(m) = &self.max_exp_avg_sq[i] {
                state.push((format!("max_exp_avg_sq.{i}"), super::snapshot(m)?));
            }
        }
        state.push(("step".to_string(), super::steps_tensor(&self.steps)?));
        Ok(state)
    }

    fn load_state_entries(&mut self, state: &[(String, Tensor)]) -> Result<()> {
        let mut staged = Vec::new();
        for i in 0..self.params.len() {
            let get = |name: &str, like: &Tensor| {
                super::required_entry("Adam", state, &format!("{name}.{i}"), like)
            };
            staged.push((&self.exp_avg[i], get("exp_avg", &self.exp_avg[i])?));
            staged.push((&self.exp_avg_sq[i], get("exp_avg_sq", &self.exp_avg_sq[i])?));
            if let Some(m) = &self.max_exp_avg_sq[i] {
                staged.push((m, get("max_exp_avg_sq", m)?));
            }
        }
        let steps = super::state_steps("Adam", state, self.params.len())?;
        for (dst, src) in staged {
            dst.copy_from(src)?;
        }
        self.steps = steps;
        Ok(())
    }

    fn step_param(&mut self, i: usize) -> Result<()> {
        let p = &self.params[i];
        let Some(grad) = p.gradient() else {
            return Ok(());
        };
        self.steps[i] = self.steps[i].saturating_add(1);
        let step = AdamStep {
            adam: self,
            i,
            grad: &grad,
            // Past 2^31 steps β^t is 0 in any float: the count saturates (a cast wrapped it
            // negative, and the bias correction to NaN).
            t: self.steps[i].min(i32::MAX as u64) as i32,
        };
        run_on(self.params[i].device(), &step)
    }
}

/// One step of parameter `i` with its gradient.
struct AdamStep<'a> {
    adam: &'a Adam,
    i: usize,
    grad: &'a Gradient,
    /// This step's number (bias correction).
    t: i32,
}

impl AdamStep<'_> {
    /// An L2 term in the gradient touches every element: it densifies sparse gradients.
    fn l2(&self) -> bool {
        let c = &self.adam.config;
        c.weight_decay != 0.0 && !c.decoupled_weight_decay
    }

    /// The factor decoupled weight decay shrinks the parameter by before the update.
    fn decay(&self) -> f64 {
        let c = &self.adam.config;
        if c.decoupled_weight_decay {
            1.0 - c.lr * c.weight_decay
        } else {
            1.0
        }
    }

    fn cpu_typed<T: FloatElem>(&self) -> Result<()> {
        let (a, i, t, l2) = (self.adam, self.i, self.t, self.l2());
        let c = a.config;
        let p = &a.params[i];
        let g = touched::<T>(p, self.grad, l2)?;
        let f = T::from_f64;
        let (b1, b2) = (f(c.betas.0), f(c.betas.1));
        let bc1 = f(1.0 - c.betas.0.powi(t));
        let bc2_sqrt = f((1.0 - c.betas.1.powi(t)).sqrt());
        let (lr, eps, wd) = (f(c.lr), f(c.eps), f(c.weight_decay));
        let decay = if c.decoupled_weight_decay {
            f(1.0 - c.lr * c.weight_decay)
        } else {
            T::one()
        };
        let mut w = p.data_mut::<T>()?;
        let mut m = a.exp_avg[i].data_mut::<T>()?;
        let mut v = a.exp_avg_sq[i].data_mut::<T>()?;
        let mut vmax = match &a.max_exp_avg_sq[i] {
            Some(t) => Some(t.data_mut::<T>()?),
            None => None,
        };
        for_each_range(p, &g, |range, g| {
            for (k, j) in range.enumerate() {
                let gj = if l2 { g[k] + wd * w[j] } else { g[k] };
                w[j] *= decay;
                m[j] = b1 * m[j] + (T::one() - b1) * gj;
                v[j] = b2 * v[j] + (T::one() - b2) * gj * gj;
                let second = match vmax.as_mut() {
                    Some(vm) => {
                        vm[j] = vm[j].max(v[j]);
                        vm[j]
                    }
                    None => v[j],
                };
                let denom = second.sqrt() / bc2_sqrt + eps;
                w[j] = w[j] - lr / bc1 * m[j] / denom;
            }
        });
        Ok(())
    }
}

impl DeviceOp for AdamStep<'_> {
    type Output = ();
    fn cpu(&self) -> Result<()> {
        with_float!(self.adam.params[self.i].dtype(), "Adam", T => self.cpu_typed::<T>())
    }
    fn cuda(&self, _device: &Arc<CudaDevice>) -> Result<()> {
        let (a, i, t) = (self.adam, self.i, self.t);
        let c = a.config;
        let grad = super::cuda::DeviceGrad::new(self.grad, self.l2())?;
        super::cuda::step(
            "Adam",
            "adam_step_f32",
            &a.params[i],
            &[
                Some(&a.exp_avg[i]),
                Some(&a.exp_avg_sq[i]),
                a.max_exp_avg_sq[i].as_ref(),
            ],
            &grad,
            &crate::args![
                c.betas.0 as f32,
                c.betas.1 as f32,
                (1.0 - c.betas.0.powi(t)) as f32,
                (1.0 - c.betas.1.powi(t)).sqrt() as f32,
                c.lr as f32,
                c.eps as f32,
                c.weight_decay as f32,
                i32::from(self.l2()),
                self.decay() as f32
            ],
        )
    }
}

impl_optimizer!(Adam, "Adam", config.lr);
