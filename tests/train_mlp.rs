//! A small model trains to a stated accuracy on built-in data: an MLP on three interleaved
//! spirals reaches ≥ 97% training accuracy, where a linear model cannot pass 60%.

use embers::nn::{toy, Activation, Forward, Linear, Mlp};
use embers::optim::{Adam, AdamConfig, Optimizer};
use embers::tensor::rng::seeded;
use embers::tensor::Reduction;
use embers::{no_grad, Result, Tensor};

fn train(model: &dyn Forward, x: &Tensor, y: &Tensor, steps: usize) -> Result<f64> {
    let mut opt = Adam::new(
        model.parameters(),
        AdamConfig {
            lr: 0.01,
            ..Default::default()
        },
    )?;
    for _ in 0..steps {
        opt.zero_grad();
        model
            .forward(x)?
            .cross_entropy(y, Reduction::Mean)?
            .backward()?;
        opt.step()?;
    }
    no_grad(|| {
        let pred = model.forward(x)?.argmax(1, false)?;
        let hits = pred
            .eq(y)?
            .to_vec::<u8>()?
            .iter()
            .filter(|&&h| h == 1)
            .count();
        Ok(hits as f64 / y.numel() as f64)
    })
}

#[test]
fn mlp_learns_spirals_a_linear_model_cannot() -> Result<()> {
    let mut rng = seeded(0);
    let (x, y) = toy::spirals(200, 3, 0.05, &mut rng)?;
    let mlp = Mlp::new(2, &[64, 64, 3], Activation::Relu, &mut rng)?.activate_last(false);
    let acc = train(&mlp, &x, &y, 500)?;
    assert!(acc >= 0.97, "MLP accuracy {acc}");
    let linear = Linear::new(2, 3, &mut rng)?;
    let lin_acc = train(&linear, &x, &y, 500)?;
    assert!(
        lin_acc < 0.6,
        "a linear model should not separate spirals: {lin_acc}"
    );
    Ok(())
}

/// Adam's step count past 2^31 (a long run, or a loaded state) keeps bias correction 1 as the
/// count grows: the step is the one of any large count, and finite (the count was cast to an
/// `i32`, which wrapped negative and made every parameter NaN).
#[test]
fn adam_past_two_to_the_31_steps_stays_finite() -> Result<()> {
    use embers::{DType, Device};
    let after = |step: i64| -> Result<Vec<f32>> {
        let p = Tensor::from_vec(vec![1.0f32, -2.0, 3.0], &[3])?.with_requires_grad(true);
        let mut opt = Adam::new(vec![p.clone()], AdamConfig::default())?;
        let mut state = opt.state_dict()?;
        for (name, t) in state.iter_mut() {
            if name.starts_with("step") {
                *t = Tensor::from_vec(vec![step], &[1])?;
            } else {
                // Moments as after a long run.
                *t = Tensor::full(0.5, t.shape(), DType::F32, Device::Cpu);
            }
        }
        opt.load_state_dict(&state)?;
        p.mul_scalar(2.0)?.sum_all()?.backward()?;
        opt.step()?;
        p.to_vec::<f32>()
    };
    let big = after(i64::from(i32::MAX) + 1)?;
    assert!(big.iter().all(|v| v.is_finite()), "{big:?}");
    assert_eq!(big, after(1_000_000)?);
    assert_eq!(after(i64::MAX - 1)?, big);
    Ok(())
}

/// Settings changed after construction (public fields, `set_learning_rate`) are checked at
/// the step, before any parameter changes (a NaN momentum or learning rate made every
/// parameter NaN; Nesterov without momentum ran as plain SGD).
#[test]
fn optimizer_settings_are_checked_at_every_step() -> Result<()> {
    use embers::optim::{Adagrad, Sgd};
    let param = || -> Result<Tensor> {
        Ok(Tensor::from_vec(vec![1.0f32, -2.0], &[2])?.with_requires_grad(true))
    };
    let cases: Vec<(Box<dyn Optimizer>, Tensor, &str)> = {
        let mut v: Vec<(Box<dyn Optimizer>, Tensor, &str)> = Vec::new();
        let p = param()?;
        v.push((
            Box::new(Sgd::new(vec![p.clone()], 0.1)?.momentum(f64::NAN)),
            p,
            "momentum is NaN",
        ));
        let p = param()?;
        v.push((
            Box::new(Sgd::new(vec![p.clone()], 0.1)?.weight_decay(-1.0)),
            p,
            "weight_decay is -1",
        ));
        let p = param()?;
        v.push((
            Box::new(Sgd::new(vec![p.clone()], 0.1)?.nesterov(true)),
            p,
            "Nesterov momentum takes",
        ));
        let p = param()?;
        let mut adagrad = Adagrad::new(vec![p.clone()], 0.1, 0.0)?;
        adagrad.lr_decay = -1.0;
        v.push((Box::new(adagrad), p, "lr_decay is -1"));
        let p = param()?;
        let mut adam = Adam::new(vec![p.clone()], AdamConfig::default())?;
        adam.config.betas.0 = 1.0;
        v.push((Box::new(adam), p, "betas (1.0, 0.999)"));
        let p = param()?;
        let mut adam = Adam::new(vec![p.clone()], AdamConfig::default())?;
        adam.set_learning_rate(f64::NAN);
        v.push((Box::new(adam), p, "lr is NaN"));
        v
    };
    for (mut opt, p, expected) in cases {
        p.mul_scalar(3.0)?.sum_all()?.backward()?;
        let e = opt.step().unwrap_err().to_string();
        assert!(e.contains(expected), "{e}");
        assert_eq!(p.to_vec::<f32>()?, vec![1.0, -2.0]);
    }
    Ok(())
}
