//! Trains a small MLP on built-in synthetic data (three interleaved spirals) with Adam and
//! reports the accuracy: a two-minute tour of the tensor core, `nn` and `optim`.
//!
//! `cargo run --release --example train_mlp -- [steps] [seed]`

use embers::nn::{toy, Activation, Forward, Mlp, Module};
use embers::optim::{Adam, AdamConfig, Optimizer};
use embers::tensor::rng::seeded;
use embers::tensor::Reduction;
use embers::{no_grad, Result};

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let steps: usize = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(600);
    let seed: u64 = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(0);
    let mut rng = seeded(seed);
    let (x, y) = toy::spirals(300, 3, 0.05, &mut rng)?;
    let model = Mlp::new(2, &[64, 64, 3], Activation::Relu, &mut rng)?.activate_last(false);
    let mut opt = Adam::new(
        model.parameters(),
        AdamConfig {
            lr: 0.01,
            ..Default::default()
        },
    )?;
    println!(
        "spirals: {} points, 3 classes; MLP 2-64-64-3 ({} parameters)",
        y.numel(),
        model.num_parameters()
    );
    let start = std::time::Instant::now();
    for step in 1..=steps {
        opt.zero_grad();
        let loss = model.forward(&x)?.cross_entropy(&y, Reduction::Mean)?;
        loss.backward()?;
        opt.step()?;
        if step % 100 == 0 || step == steps {
            println!(
                "step {step:5}  loss {:.4}  accuracy {:.3}",
                loss.item()?,
                accuracy(&model, &x, &y)?
            );
        }
    }
    println!(
        "final accuracy {:.3} after {steps} steps in {:.2?}",
        accuracy(&model, &x, &y)?,
        start.elapsed()
    );
    Ok(())
}

fn accuracy(model: &Mlp, x: &embers::Tensor, y: &embers::Tensor) -> Result<f64> {
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
