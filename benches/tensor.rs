//! Dense kernels of the tensor core, at the shapes `benches/peers/matmul.py` measures for
//! PyTorch CPU (run both with `benches/peers/tensor.sh` to get the ratio in one run).

use criterion::{criterion_group, criterion_main, Criterion};
use embers::nn::{Activation, Forward, Mlp, Module};
use embers::tensor::rng::seeded;
use embers::{DType, Tensor};

fn matmul(c: &mut Criterion) {
    let mut rng = seeded(0);
    for (m, k, n) in [(512, 512, 512), (512, 415, 512), (2048, 1024, 1024)] {
        let a = Tensor::randn(&[m, k], 0.0, 1.0, DType::F32, &mut rng);
        let b = Tensor::randn(&[k, n], 0.0, 1.0, DType::F32, &mut rng);
        c.bench_function(&format!("matmul f32 {m}x{k}x{n}"), |bench| {
            bench.iter(|| a.matmul(&b).unwrap())
        });
    }
}

fn dlrm_mlps(c: &mut Criterion) {
    let mut rng = seeded(1);
    let batch = 512;
    let bottom = Mlp::new(13, &[512, 256, 64], Activation::Relu, &mut rng).unwrap();
    // As the peer script: ReLU after every layer except the final 1-wide one.
    let top = Mlp::new(415, &[512, 512, 256, 1], Activation::Relu, &mut rng)
        .unwrap()
        .activate_last(false);
    let xd = Tensor::randn(&[batch, 13], 0.0, 1.0, DType::F32, &mut rng);
    let xt = Tensor::randn(&[batch, 415], 0.0, 1.0, DType::F32, &mut rng);
    c.bench_function("DLRM MLPs fwd+bwd B=512", |bench| {
        bench.iter(|| {
            let loss = bottom
                .forward(&xd)
                .unwrap()
                .sum_all()
                .unwrap()
                .add(&top.forward(&xt).unwrap().sum_all().unwrap())
                .unwrap();
            loss.backward().unwrap();
            bottom.zero_grad();
            top.zero_grad();
        })
    });
}

fn dot_interaction(c: &mut Criterion) {
    let (batch, features, dim) = (512, 27, 64);
    let z = Tensor::randn(
        &[batch, features, dim],
        0.0,
        1.0,
        DType::F32,
        &mut seeded(2),
    )
    .with_requires_grad(true);
    let (rows, cols) = Tensor::triu_indices(features, 1).expect("a small side");
    let flat: Vec<i64> = rows
        .to_vec::<i64>()
        .unwrap()
        .iter()
        .zip(cols.to_vec::<i64>().unwrap())
        .map(|(r, c)| r * features as i64 + c)
        .collect();
    let pairs = flat.len();
    let flat = Tensor::from_vec(flat, &[pairs]).unwrap();
    c.bench_function("dot interaction fwd+bwd B=512 F=27 D=64", |bench| {
        bench.iter(|| {
            let zz = z.matmul(&z.transpose(1, 2).unwrap()).unwrap();
            let upper = zz
                .reshape(&[batch, features * features])
                .unwrap()
                .t()
                .unwrap()
                .index_select(&flat)
                .unwrap();
            upper.sum_all().unwrap().backward().unwrap();
            z.zero_grad();
        })
    });
    // The same interaction through DLRM's fused op (upper triangle only, own backward).
    let dense = z
        .narrow(1, 0, 1)
        .unwrap()
        .reshape(&[batch, dim])
        .unwrap()
        .detach();
    let dense = dense.with_requires_grad(true);
    let sparse = z.narrow(1, 1, features - 1).unwrap().detach();
    let sparse = sparse.with_requires_grad(true);
    let arch = embers::models::InteractionArch::new(features - 1);
    c.bench_function("fused dot interaction fwd+bwd B=512 F=27 D=64", |bench| {
        bench.iter(|| {
            let out = arch.forward(&dense, &sparse).unwrap();
            out.sum_all().unwrap().backward().unwrap();
            dense.zero_grad();
            sparse.zero_grad();
        })
    });
}

/// Inference `linear` (no grad) at serving shapes: the default gemm path against the
/// row-invariant kernel serving runs in (`embers::tensor::row_invariant`).
fn linear_row_invariant(c: &mut Criterion) {
    let mut rng = seeded(3);
    for (rows, k, n) in [
        (256, 367, 64),
        (256, 64, 32),
        (256, 415, 512),
        (1, 415, 512),
    ] {
        let x = Tensor::randn(&[rows, k], 0.0, 1.0, DType::F32, &mut rng);
        let w = Tensor::randn(&[n, k], 0.0, 1.0, DType::F32, &mut rng);
        let b = Tensor::randn(&[n], 0.0, 1.0, DType::F32, &mut rng);
        embers::no_grad(|| {
            c.bench_function(&format!("linear gemm {rows}x{k}->{n}"), |bench| {
                bench.iter(|| x.linear(&w, Some(&b)).unwrap())
            });
            c.bench_function(&format!("linear row-invariant {rows}x{k}->{n}"), |bench| {
                bench.iter(|| embers::tensor::row_invariant(|| x.linear(&w, Some(&b)).unwrap()))
            });
        });
    }
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(20).measurement_time(std::time::Duration::from_secs(4));
    targets = matmul, dlrm_mlps, dot_interaction, linear_row_invariant
}
criterion_main!(benches);
