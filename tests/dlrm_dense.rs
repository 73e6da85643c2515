//! DLRM's dense half: shapes as TorchRec's DLRM / DLRM_DCN, the interaction against a naive
//! computation, and finite-difference gradients for inputs and every parameter.

use embers::models::{DlrmDense, InteractionArch};
use embers::nn::Module;
use embers::tensor::rng::seeded;
use embers::tensor::testing::check_gradients;
use embers::{no_grad, DType, Device, Result, Tensor};

#[test]
fn dot_interaction_matches_naive_and_torchrec_layout() -> Result<()> {
    let (b, f, d) = (3, 4, 5);
    let mut rng = seeded(1);
    let dense = Tensor::randn(&[b, d], 0.0, 1.0, DType::F64, &mut rng);
    let sparse = Tensor::randn(&[b, f, d], 0.0, 1.0, DType::F64, &mut rng);
    let arch = InteractionArch::new(f);
    let out = arch.forward(&dense, &sparse)?;
    assert_eq!(out.shape(), &[b, d + f * (f + 1) / 2]);
    assert_eq!(arch.out_features(d), d + 10);
    let (dv, sv, ov) = (
        dense.to_vec::<f64>()?,
        sparse.to_vec::<f64>()?,
        out.to_vec::<f64>()?,
    );
    let width = out.shape()[1];
    for s in 0..b {
        // Row 0 of the combined matrix is the dense vector, rows 1..=F the embeddings.
        let row = |i: usize| -> Vec<f64> {
            if i == 0 {
                dv[s * d..(s + 1) * d].to_vec()
            } else {
                sv[(s * f + i - 1) * d..(s * f + i) * d].to_vec()
            }
        };
        assert_eq!(&ov[s * width..s * width + d], &dv[s * d..(s + 1) * d]);
        let mut k = d;
        for i in 0..=f {
            for j in i + 1..=f {
                let dot: f64 = row(i).iter().zip(row(j)).map(|(a, b)| a * b).sum();
                assert!((ov[s * width + k] - dot).abs() < 1e-12);
                k += 1;
            }
        }
    }
    // Wrong shapes are errors.
    assert!(arch
        .forward(
            &dense,
            &Tensor::zeros(&[b, f + 1, d], DType::F64, embers::Device::Cpu)
        )
        .is_err());
    Ok(())
}

#[test]
fn shapes_match_torchrec_dlrm_and_dcn() -> Result<()> {
    let mut rng = seeded(2);
    // The peers' DLRM: 13 dense, 26 sparse of dim 64, 512-256-64 bottom, 512-512-256-1 top.
    let dlrm = DlrmDense::dot(
        13,
        &[512, 256, 64],
        26,
        &[512, 512, 256, 1],
        DType::F32,
        &mut rng,
    )?;
    let dense = Tensor::randn(&[8, 13], 0.0, 1.0, DType::F32, &mut rng);
    let sparse = Tensor::randn(&[8, 26, 64], 0.0, 1.0, DType::F32, &mut rng);
    assert_eq!(dlrm.forward(&dense, &sparse)?.shape(), &[8, 1]);
    // The over arch's input is 64 + 27·26/2 = 415, as in TorchRec.
    let names: Vec<(String, Vec<usize>)> = dlrm
        .named_parameters()
        .into_iter()
        .map(|(n, t)| (n, t.shape().to_vec()))
        .collect();
    assert!(names.contains(&("over_arch.mlp.layers.0.weight".into(), vec![512, 415])));
    let dcn = DlrmDense::dcn(
        13,
        &[512, 256, 64],
        26,
        &[512, 512, 256, 1],
        3,
        16,
        DType::F32,
        &mut rng,
    )?;
    assert_eq!(dcn.forward(&dense, &sparse)?.shape(), &[8, 1]);
    assert!(dcn
        .named_parameters()
        .iter()
        .any(|(n, t)| n == "inter_arch.crossnet.layers.2.w.weight" && t.shape() == [27 * 64, 16]));
    Ok(())
}

/// Finite differences on a few elements of every parameter against autograd.
fn check_parameters(model: &DlrmDense, dense: &Tensor, sparse: &Tensor) -> Result<()> {
    let loss = || -> Result<f64> {
        no_grad(|| model.forward(dense, sparse)?.sigmoid()?.sum_all()?.item())
    };
    model.zero_grad();
    model
        .forward(dense, sparse)?
        .sigmoid()?
        .sum_all()?
        .backward()?;
    let eps = 1e-6;
    for (name, p) in model.named_parameters() {
        let grad = p
            .grad()
            .expect("every parameter gets a gradient")
            .to_vec::<f64>()?;
        for j in [0, p.numel() / 2, p.numel() - 1] {
            let orig = p.to_vec::<f64>()?[j];
            p.update_in_place(|w: &mut [f64]| w[j] = orig + eps)?;
            let plus = loss()?;
            p.update_in_place(|w: &mut [f64]| w[j] = orig - eps)?;
            let minus = loss()?;
            p.update_in_place(|w: &mut [f64]| w[j] = orig)?;
            let numeric = (plus - minus) / (2.0 * eps);
            assert!(
                (numeric - grad[j]).abs() <= 1e-6 * (1.0 + numeric.abs()),
                "{name}[{j}]: autograd {} vs numeric {numeric}",
                grad[j]
            );
        }
    }
    Ok(())
}

#[test]
fn tiny_dlrm_gradients_match_finite_differences() -> Result<()> {
    let mut rng = seeded(3);
    let dense = Tensor::randn(&[4, 3], 0.0, 1.0, DType::F64, &mut rng);
    let sparse = Tensor::randn(&[4, 2, 4], 0.0, 0.5, DType::F64, &mut rng);
    for model in [
        DlrmDense::dot(3, &[6, 4], 2, &[5, 1], DType::F64, &mut rng)?,
        DlrmDense::dcn(3, &[6, 4], 2, &[5, 1], 2, 3, DType::F64, &mut rng)?,
    ] {
        // Inputs, including the pooled embeddings (whose gradient feeds the embedding bags).
        check_gradients(
            |x| model.forward(&x[0], &x[1]),
            &[
                dense.with_requires_grad(true),
                sparse.with_requires_grad(true),
            ],
            1e-6,
            1e-6,
        )?;
        check_parameters(&model, &dense, &sparse)?;
    }
    Ok(())
}

#[test]
fn full_dlrm_trains_tables_and_dense_layers_together() -> Result<()> {
    use embers::embedding::{EmbeddingBagCollection, EmbeddingBagConfig, FusedOptimizer};
    use embers::models::Dlrm;
    use embers::optim::{Optimizer, Sgd};
    use embers::sparse::KeyedJaggedTensor;
    use embers::tensor::Reduction;
    let mut rng = seeded(4);
    let (b, d) = (8, 4);
    let configs = vec![
        EmbeddingBagConfig::new("t0", 10, d, &["f0"]),
        EmbeddingBagConfig::new("t1", 20, d, &["f1"]),
    ];
    let ebc = EmbeddingBagCollection::new(configs, FusedOptimizer::Sgd { lr: 0.5 }, &mut rng)?;
    let dense = DlrmDense::dot(3, &[6, d], 2, &[5, 1], DType::F32, &mut rng)?;
    let model = Dlrm::new(ebc, dense)?;
    // One id per feature per sample, key-major.
    let ids: Vec<i64> = (0..b as i64)
        .map(|i| i % 10)
        .chain((0..b as i64).map(|i| (3 * i) % 20))
        .collect();
    let kjt = KeyedJaggedTensor::from_lengths(
        vec!["f0".into(), "f1".into()],
        Tensor::from_vec(ids, &[2 * b])?,
        Tensor::from_vec(vec![1i64; 2 * b], &[2 * b])?,
        None,
        None,
    )?;
    let x = Tensor::randn(&[b, 3], 0.0, 1.0, DType::F32, &mut rng);
    let y = Tensor::from_vec((0..b).map(|i| (i % 2) as f32).collect(), &[b, 1])?;
    let before = model.sparse_arch.table_weights("t1")?;
    let mut opt = Sgd::new(model.dense.parameters(), 0.2)?;
    let loss_at = |m: &Dlrm| -> Result<f64> {
        no_grad(|| {
            m.forward(&x, &kjt)?
                .bce_with_logits(&y, None, Reduction::Mean)?
                .item()
        })
    };
    let first = loss_at(&model)?;
    for _ in 0..200 {
        opt.zero_grad();
        model
            .forward(&x, &kjt)?
            .bce_with_logits(&y, None, Reduction::Mean)?
            .backward()?;
        opt.step()?;
    }
    let last = loss_at(&model)?;
    assert!(last < 0.5 * first, "loss {first} → {last}");
    // Rows looked up moved (fused update); rows never looked up did not.
    let after = model.sparse_arch.table_weights("t1")?;
    let touched: Vec<usize> = (0..b).map(|i| (3 * i) % 20).collect();
    for row in 0..20 {
        let moved = before[row * d..(row + 1) * d] != after[row * d..(row + 1) * d];
        assert_eq!(moved, touched.contains(&row), "row {row}");
    }
    // Mismatched dims are refused.
    let ebc = EmbeddingBagCollection::new(
        vec![EmbeddingBagConfig::new("t", 5, d + 1, &["f0"])],
        FusedOptimizer::Sgd { lr: 0.1 },
        &mut rng,
    )?;
    assert!(Dlrm::new(
        ebc,
        DlrmDense::dot(3, &[6, d], 1, &[5, 1], DType::F32, &mut rng)?
    )
    .is_err());
    Ok(())
}

#[test]
fn fused_interaction_gradients_match_finite_differences_for_wide_rows() -> Result<()> {
    // D = 11 exercises both the 8-wide vector loop and its tail; 5 features, 3 samples.
    let mut rng = seeded(8);
    let dense = Tensor::randn(&[3, 11], 0.0, 1.0, DType::F64, &mut rng).with_requires_grad(true);
    let sparse =
        Tensor::randn(&[3, 5, 11], 0.0, 1.0, DType::F64, &mut rng).with_requires_grad(true);
    let arch = InteractionArch::new(5);
    check_gradients(
        |x| arch.forward(&x[0], &x[1])?.tanh()?.sum_all(),
        &[dense, sparse],
        1e-6,
        1e-6,
    )
}

#[test]
fn f32_interaction_matches_f64_forward_and_backward() -> Result<()> {
    // TorchRec's Criteo shape (26 features, D = 64) with a batch that is not a multiple of the
    // per-task chunk, so the vectorised f32 path and the chunking are both covered.
    let (b, f, d) = (37, 26, 64);
    let mut rng = seeded(9);
    let dense64 = Tensor::randn(&[b, d], 0.0, 1.0, DType::F64, &mut rng);
    let sparse64 = Tensor::randn(&[b, f, d], 0.0, 1.0, DType::F64, &mut rng);
    let weights = Tensor::randn(&[b, d + f * (f + 1) / 2], 0.0, 1.0, DType::F64, &mut rng);
    let arch = InteractionArch::new(f);
    let run = |dtype: DType| -> Result<(Vec<f64>, Vec<f64>, Vec<f64>)> {
        let dense = dense64.to_dtype(dtype)?.with_requires_grad(true);
        let sparse = sparse64.to_dtype(dtype)?.with_requires_grad(true);
        let out = arch.forward(&dense, &sparse)?;
        out.mul(&weights.to_dtype(dtype)?)?.sum_all()?.backward()?;
        Ok((
            out.to_vec_f64()?,
            dense.grad().unwrap().to_vec_f64()?,
            sparse.grad().unwrap().to_vec_f64()?,
        ))
    };
    let (o64, gd64, gs64) = run(DType::F64)?;
    let (o32, gd32, gs32) = run(DType::F32)?;
    for (name, a, b) in [
        ("output", &o32, &o64),
        ("dense grad", &gd32, &gd64),
        ("sparse grad", &gs32, &gs64),
    ] {
        assert_eq!(a.len(), b.len());
        for (i, (x, y)) in a.iter().zip(b.iter()).enumerate() {
            assert!(
                (x - y).abs() <= 1e-4 * (1.0 + y.abs()),
                "{name}[{i}]: f32 {x} vs f64 {y}"
            );
        }
    }
    Ok(())
}

/// The public fused op checks its shapes itself (a batch or dim that disagrees read past the
/// smaller input on CUDA and dropped samples on the CPU), and with no sparse feature its output
/// is the dense input, gradient included (rayon refused a zero-sized work split).
#[test]
fn dot_interaction_checks_shapes_and_takes_no_sparse_feature() -> Result<()> {
    use embers::models::interaction::dot_interaction;
    let mut rng = seeded(3);
    let dense = Tensor::randn(&[4, 8], 0.0, 1.0, DType::F32, &mut rng);
    for shape in [&[2, 3, 8][..], &[4, 3, 4], &[4, 8], &[4, 3, 8, 1]] {
        let sparse = Tensor::zeros(shape, DType::F32, Device::Cpu);
        let e = dot_interaction(&dense, &sparse).unwrap_err().to_string();
        assert!(
            e.contains("dot_interaction") && e.contains("[B, F, D]"),
            "{e}"
        );
    }
    let e = dot_interaction(
        &Tensor::zeros(&[4], DType::F32, Device::Cpu),
        &Tensor::zeros(&[4, 3, 8], DType::F32, Device::Cpu),
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("[B, D]"), "{e}");

    let dense = dense.with_requires_grad(true);
    let out = dot_interaction(&dense, &Tensor::zeros(&[4, 0, 8], DType::F32, Device::Cpu))?;
    assert_eq!(out.shape(), &[4, 8]);
    assert_eq!(out.to_vec::<f32>()?, dense.to_vec::<f32>()?);
    out.sum_all()?.backward()?;
    assert_eq!(
        dense.grad().expect("a gradient").to_vec::<f32>()?,
        vec![1.0; 32]
    );
    let model = DlrmDense::dot(4, &[8], 0, &[1], DType::F32, &mut rng)?;
    let logits = model.forward(
        &Tensor::randn(&[2, 4], 0.0, 1.0, DType::F32, &mut rng),
        &Tensor::zeros(&[2, 0, 8], DType::F32, Device::Cpu),
    )?;
    assert_eq!(logits.shape(), &[2, 1]);
    Ok(())
}
