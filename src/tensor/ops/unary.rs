//! Elementwise float functions. Each is declared once with its value and its derivative side by
//! side; one generic forward and one generic backward serve them all.

use crate::tensor::autograd::{record_op, BackwardOp, Gradient, SavedTensor};
use crate::tensor::backend::{with_backend, ElementwiseOps};
use crate::tensor::dtype::FloatElem;
use crate::{Error, Result, Tensor};

/// An elementwise function `y = f(x)` with its derivative written in terms of `x` and `y`.
pub(crate) trait UnaryFn: Send + Sync + 'static {
    const NAME: &'static str;
    fn f<T: FloatElem>(&self, x: T) -> T;
    fn df<T: FloatElem>(&self, x: T, y: T) -> T;
    /// Whether `df` reads `x` (the backward then keeps the input, and refuses it changed).
    const USES_X: bool = true;
    /// Whether `df` reads `y` (the backward then keeps the output, and refuses it changed).
    const USES_Y: bool = true;
    /// The function's parameters, as the CUDA kernels take them.
    fn params(&self) -> (f64, f64) {
        (0.0, 0.0)
    }
}

fn c<T: FloatElem>(v: f64) -> T {
    T::from_f64(v)
}

macro_rules! unary_fn {
    ($name:ident, $str:literal, uses($ux:literal, $uy:literal), |$s:ident, $x:ident| $f:expr, |$s2:ident, $x2:ident, $y2:ident| $df:expr) => {
        struct $name;
        impl UnaryFn for $name {
            const NAME: &'static str = $str;
            const USES_X: bool = $ux;
            const USES_Y: bool = $uy;
            #[inline(always)]
            fn f<T: FloatElem>(&self, $x: T) -> T {
                let $s = self;
                let _ = $s;
                $f
            }
            #[inline(always)]
            fn df<T: FloatElem>(&self, $x2: T, $y2: T) -> T {
                let $s2 = self;
                let _ = ($s2, $x2, $y2);
                $df
            }
        }
    };
}

unary_fn!(Neg, "neg", uses(false, false), |s, x| -x, |s, x, y| c(-1.0));
unary_fn!(Exp, "exp", uses(false, true), |s, x| x.exp(), |s, x, y| y);
unary_fn!(Log, "log", uses(true, false), |s, x| x.ln(), |s, x, y| x
    .recip());
unary_fn!(
    Sqrt,
    "sqrt",
    uses(false, true),
    |s, x| x.sqrt(),
    |s, x, y| c::<T>(0.5) / y
);
unary_fn!(
    Abs,
    "abs",
    uses(true, false),
    |s, x| x.abs(),
    |s, x, y| if x > c(0.0) {
        c(1.0)
    } else if x < c(0.0) {
        c(-1.0)
    } else {
        c(0.0)
    }
);
unary_fn!(
    Relu,
    "relu",
    // The output says as much as the input (y > 0 exactly where x > 0, NaN included): it
    // alone is kept, as PyTorch keeps it, so a layer's pre-activation is freed.
    uses(false, true),
    // NaN stays NaN, as PyTorch's relu keeps it (a `max` with 0 made it 0: a model whose
    // weights or inputs went NaN predicted numbers).
    |s, x| if x <= c(0.0) { c(0.0) } else { x },
    |s, x, y| if y > c(0.0) { c(1.0) } else { c(0.0) }
);
unary_fn!(
    Tanh,
    "tanh",
    uses(false, true),
    |s, x| x.tanh(),
    |s, x, y| c::<T>(1.0) - y * y
);
unary_fn!(
    Sigmoid,
    "sigmoid",
    uses(false, true),
    |s, x| if x >= c(0.0) {
        c::<T>(1.0) / (c::<T>(1.0) + (-x).exp())
    } else {
        let e = x.exp();
        e / (c::<T>(1.0) + e)
    },
    |s, x, y| y * (c::<T>(1.0) - y)
);
// Exact GELU: x·Φ(x), Φ the standard normal CDF (PyTorch's default `approximate='none'`).
unary_fn!(
    Gelu,
    "gelu",
    uses(true, false),
    |s, x| x * c(0.5 * (1.0 + libm::erf(x.to_f64() * std::f64::consts::FRAC_1_SQRT_2))),
    |s, x, y| {
        let xf = x.to_f64();
        let cdf = 0.5 * (1.0 + libm::erf(xf * std::f64::consts::FRAC_1_SQRT_2));
        let pdf = (-0.5 * xf * xf).exp() / (2.0 * std::f64::consts::PI).sqrt();
        c(cdf + xf * pdf)
    }
);
// GELU with the tanh approximation (`approximate='tanh'`).
unary_fn!(
    GeluTanh,
    "gelu_tanh",
    uses(true, false),
    |s, x| {
        let k = (2.0 / std::f64::consts::PI).sqrt();
        let xf = x.to_f64();
        c(0.5 * xf * (1.0 + (k * (xf + 0.044715 * xf * xf * xf)).tanh()))
    },
    |s, x, y| {
        let k = (2.0 / std::f64::consts::PI).sqrt();
        let xf = x.to_f64();
        let t = (k * (xf + 0.044715 * xf * xf * xf)).tanh();
        c(0.5 * (1.0 + t) + 0.5 * xf * (1.0 - t * t) * k * (1.0 + 3.0 * 0.044715 * xf * xf))
    }
);

pub(crate) struct Affine {
    pub(crate) mul: f64,
    pub(crate) add: f64,
}
impl UnaryFn for Affine {
    const NAME: &'static str = "affine";
    fn f<T: FloatElem>(&self, x: T) -> T {
        x * c(self.mul) + c(self.add)
    }
    fn df<T: FloatElem>(&self, _x: T, _y: T) -> T {
        c(self.mul)
    }
    const USES_X: bool = false;
    const USES_Y: bool = false;
    fn params(&self) -> (f64, f64) {
        (self.mul, self.add)
    }
}

struct Powf {
    exponent: f64,
}
impl UnaryFn for Powf {
    const NAME: &'static str = "pow";
    fn f<T: FloatElem>(&self, x: T) -> T {
        x.powf(c(self.exponent))
    }
    fn df<T: FloatElem>(&self, x: T, _y: T) -> T {
        c::<T>(self.exponent) * x.powf(c(self.exponent - 1.0))
    }
    const USES_Y: bool = false;
    fn params(&self) -> (f64, f64) {
        (self.exponent, 0.0)
    }
}

struct Clamp {
    min: f64,
    max: f64,
}
impl UnaryFn for Clamp {
    const NAME: &'static str = "clamp";
    fn f<T: FloatElem>(&self, x: T) -> T {
        if x < c(self.min) {
            c(self.min)
        } else if x > c(self.max) {
            c(self.max)
        } else {
            x
        }
    }
    fn df<T: FloatElem>(&self, x: T, _y: T) -> T {
        if x >= c(self.min) && x <= c(self.max) {
            c(1.0)
        } else {
            c(0.0)
        }
    }
    const USES_Y: bool = false;
    fn params(&self) -> (f64, f64) {
        (self.min, self.max)
    }
}

/// The backward of `y = f(x)`: keeps only what `df` reads (as PyTorch saves only what a
/// derivative needs: exp keeps its output, not its input).
struct UnaryBackward<F: UnaryFn> {
    f: F,
    x: Option<SavedTensor>,
    y: Option<SavedTensor>,
}

impl<F: UnaryFn> BackwardOp for UnaryBackward<F> {
    fn name(&self) -> &'static str {
        F::NAME
    }
    fn backward(&self, g: &Tensor) -> Result<Vec<Option<Gradient>>> {
        // A value `df` does not read is stood in for by `g` (same shape, dtype and device).
        let x = self.x.as_ref().map(|x| x.get(F::NAME)).transpose()?;
        let y = self.y.as_ref().map(|y| y.get(F::NAME)).transpose()?;
        let gx = with_backend!(g.device(), B => {
            B::unary_backward(&self.f, x.unwrap_or(g), y.unwrap_or(g), g)
        })?;
        Ok(vec![Some(Gradient::Dense(gx))])
    }
}

fn unary<F: UnaryFn>(x: &Tensor, f: F) -> Result<Tensor> {
    let y = with_backend!(x.device(), B => B::unary(&f, x))?;
    if !x.requires_grad() {
        return Ok(y);
    }
    let saved = UnaryBackward {
        x: F::USES_X.then(|| SavedTensor::new(&x.detach())),
        y: F::USES_Y.then(|| SavedTensor::new(&y.detach())),
        f,
    };
    Ok(record_op(y, &[x], saved))
}

impl Tensor {
    /// `-x`.
    pub fn neg(&self) -> Result<Tensor> {
        unary(self, Neg)
    }
    /// `e^x`.
    pub fn exp(&self) -> Result<Tensor> {
        unary(self, Exp)
    }
    /// Natural logarithm.
    pub fn log(&self) -> Result<Tensor> {
        unary(self, Log)
    }
    /// Square root.
    pub fn sqrt(&self) -> Result<Tensor> {
        unary(self, Sqrt)
    }
    /// Absolute value (subgradient 0 at 0).
    pub fn abs(&self) -> Result<Tensor> {
        unary(self, Abs)
    }
    /// `max(x, 0)`, NaN kept (gradient 0 at 0 and at NaN, as PyTorch).
    pub fn relu(&self) -> Result<Tensor> {
        unary(self, Relu)
    }
    /// Hyperbolic tangent.
    pub fn tanh(&self) -> Result<Tensor> {
        unary(self, Tanh)
    }
    /// Logistic sigmoid, computed without overflow for large |x|.
    pub fn sigmoid(&self) -> Result<Tensor> {
        unary(self, Sigmoid)
    }
    /// Exact GELU, `x·Φ(x)`.
    pub fn gelu(&self) -> Result<Tensor> {
        unary(self, Gelu)
    }
    /// GELU with the tanh approximation.
    pub fn gelu_tanh(&self) -> Result<Tensor> {
        unary(self, GeluTanh)
    }
    /// `x^exponent`.
    pub fn pow_scalar(&self, exponent: f64) -> Result<Tensor> {
        unary(self, Powf { exponent })
    }
    /// `x²`.
    pub fn square(&self) -> Result<Tensor> {
        self.mul(self)
    }
    /// `mul·x + add` in one pass.
    pub fn affine(&self, mul: f64, add: f64) -> Result<Tensor> {
        unary(self, Affine { mul, add })
    }
    /// Clamps into `[min, max]` (gradient 1 inside, 0 outside).
    pub fn clamp(&self, min: f64, max: f64) -> Result<Tensor> {
        if min > max || min.is_nan() || max.is_nan() {
            return Err(Error::invalid(
                "clamp",
                format!("empty range [{min}, {max}]"),
            ));
        }
        unary(self, Clamp { min, max })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `df` reads only what its `USES_X`/`USES_Y` say: the backward keeps only those (and
    /// hands the gradient in place of the other), so a derivative that read a value it
    /// declared unused would compute from the gradient's values.
    fn reads_only_what_it_declares<F: UnaryFn>(f: F) {
        for x in [-2.5f64, -0.5, 0.0, 0.25, 0.5, 1.5, 3.0] {
            let y = f.f(x);
            if !y.is_finite() {
                continue;
            }
            let want = f.df(x, y);
            for junk in [f64::NAN, 7.0, -7.0] {
                if !F::USES_Y {
                    let got = f.df(x, junk);
                    assert!(
                        got.to_bits() == want.to_bits(),
                        "{} read y at x = {x}",
                        F::NAME
                    );
                }
                if !F::USES_X {
                    let got = f.df(junk, y);
                    assert!(
                        got.to_bits() == want.to_bits(),
                        "{} read x at x = {x}",
                        F::NAME
                    );
                }
            }
        }
    }

    #[test]
    fn derivatives_read_only_the_values_they_declare() {
        reads_only_what_it_declares(Neg);
        reads_only_what_it_declares(Exp);
        reads_only_what_it_declares(Log);
        reads_only_what_it_declares(Sqrt);
        reads_only_what_it_declares(Abs);
        reads_only_what_it_declares(Relu);
        reads_only_what_it_declares(Tanh);
        reads_only_what_it_declares(Sigmoid);
        reads_only_what_it_declares(Gelu);
        reads_only_what_it_declares(GeluTanh);
        reads_only_what_it_declares(Affine { mul: 2.0, add: 1.0 });
        reads_only_what_it_declares(Powf { exponent: 3.0 });
        reads_only_what_it_declares(Clamp {
            min: -1.0,
            max: 1.0,
        });
    }
}
