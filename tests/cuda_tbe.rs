//! The TBE on a CUDA device against the CPU TBE: lookups of FP32 rows (every kernel variant)
//! and of every quantized row type, pooled and unpooled; the fused backward with every
//! optimizer and weight decay; row-sparse gradients without an optimizer. On GPU 0 when the
//! machine has one, else on the host emulation (CI sets `EMBERS_REQUIRE_CUDA_SIM=1`, so it
//! cannot skip there).

use embers::cuda;
use embers::embedding::{FusedOptimizer, QuantizedTableBatchedEmbedding, TbeInput, WeightType};
use embers::embedding::{PoolingMode, TableBatchedEmbedding, TableSpec, TbeConfig, WeightDecay};
use embers::{Device, Tensor};

#[path = "support/cuda_device.rs"]
mod support;

/// Random tables and bags for the GPU comparison.
struct Case {
    tables: Vec<TableSpec>,
    feature_table_map: Vec<usize>,
    batch: usize,
    indices: Vec<i64>,
    offsets: Vec<i64>,
    weights: Vec<f32>,
}

impl Case {
    /// The CPU TBE of this case's tables, filled with seeded normal values.
    fn cpu_tbe(
        &self,
        pooling: PoolingMode,
        optimizer: FusedOptimizer,
        decay: WeightDecay,
    ) -> embers::Result<TableBatchedEmbedding> {
        let mut config = TbeConfig::new(
            self.tables.clone(),
            self.feature_table_map.clone(),
            pooling,
            optimizer,
        );
        config.weight_decay = decay;
        let cpu = TableBatchedEmbedding::new(config)?;
        let mut rng = embers::tensor::rng::seeded(5);
        for (t, spec) in self.tables.iter().enumerate() {
            let w = Tensor::randn(
                &[spec.rows, spec.dim],
                0.0,
                1.0,
                embers::DType::F32,
                &mut rng,
            );
            cpu.set_table_weights(t, &w.to_vec::<f32>()?)?;
        }
        Ok(cpu)
    }
}

impl Case {
    /// The CPU TBE's forward of the case's batch, with its per-sample weights.
    fn cpu_forward(&self, cpu: &TableBatchedEmbedding) -> embers::Result<Vec<f32>> {
        let (n, f) = (self.indices.len(), self.feature_table_map.len());
        cpu.forward(
            &Tensor::from_vec(self.indices.clone(), &[n])?,
            &Tensor::from_vec(self.offsets.clone(), &[f * self.batch + 1])?,
            Some(&Tensor::from_vec(self.weights.clone(), &[n])?),
        )?
        .to_vec::<f32>()
    }
}

/// A lookup of host inputs by `tbe` (on any device), copied back.
fn lookup_host(
    tbe: &TableBatchedEmbedding,
    indices: &[i64],
    offsets: &[i64],
    weights: Option<&[f32]>,
) -> embers::Result<Vec<f32>> {
    let mut input = TbeInput::new(indices, offsets);
    if let Some(w) = weights {
        input = input.with_weights(w);
    }
    tbe.lookup(input)?.to_vec::<f32>()
}

/// The quantized TBE's lookup of host inputs, copied back.
fn lookup_quantized(
    q: &QuantizedTableBatchedEmbedding,
    indices: &[i64],
    offsets: &[i64],
    weights: Option<&[f32]>,
) -> embers::Result<Vec<f32>> {
    let mut input = TbeInput::new(indices, offsets);
    if let Some(w) = weights {
        input = input.with_weights(w);
    }
    q.forward(input)?.to_vec::<f32>()
}

/// Table `t`'s rows and its optimizer state buffers, copied back.
fn table_state(tbe: &TableBatchedEmbedding, t: usize) -> embers::Result<(Vec<f32>, Vec<Vec<f32>>)> {
    let state = (0..tbe.optimizer_state_names().len())
        .map(|i| tbe.optimizer_state(i, t))
        .collect::<embers::Result<Vec<_>>>()?;
    Ok((tbe.table_weights(t)?, state))
}

/// The device the TBE tests run on (GPU 0, else the host emulation), or `None` (skipped).
fn tbe_device() -> Option<(Device, String)> {
    let d = support::device()?;
    let name = cuda::device(0).expect("device 0").name().to_string();
    Some((d, name))
}

fn case() -> Case {
    case_with_dim(130)
}

/// The test case with table "c" of dim `c_dim` (130: the kernels' general variants; up to
/// 128: the TBE backward's variant for tables of dims up to 128).
fn case_with_dim(c_dim: usize) -> Case {
    use rand::Rng;
    let mut rng = embers::tensor::rng::seeded(11);
    let tables = vec![
        TableSpec::new("a", 1000, 64),
        TableSpec::new("b", 300, 12),
        TableSpec::new("c", 50, c_dim),
    ];
    let feature_table_map = vec![0, 1, 2, 0];
    let batch = 37;
    let mut indices = Vec::new();
    let mut offsets = vec![0i64];
    for &t in &feature_table_map {
        for _ in 0..batch {
            for _ in 0..rng.random_range(0..6) {
                indices.push(rng.random_range(0..tables[t].rows as i64));
            }
            offsets.push(indices.len() as i64);
        }
    }
    let weights = (0..indices.len())
        .map(|_| rng.random_range(-1.0f32..1.0))
        .collect();
    Case {
        tables,
        feature_table_map,
        batch,
        indices,
        offsets,
        weights,
    }
}

#[test]
fn tbe_forward_kernels_match_the_cpu_tbe() -> embers::Result<()> {
    let Some((device, name)) = tbe_device() else {
        return Ok(());
    };
    let c = case();
    for pooling in [PoolingMode::Sum, PoolingMode::Mean] {
        // The CPU reference: an FP32 TBE with per-sample weights.
        let cpu = c.cpu_tbe(pooling, FusedOptimizer::None, WeightDecay::None)?;
        let expected = c.cpu_forward(&cpu)?;
        let gpu = cpu.clone_to(device)?;
        let got = lookup_host(&gpu, &c.indices, &c.offsets, Some(&c.weights))?;
        let on = &name;
        assert_close(&format!("{on}: FP32 {pooling:?}"), &got, &expected);

        // Rows of every weight type (FBGEMM's row layouts) against the CPU quantized TBE.
        use WeightType::*;
        // All-FP16 and all-BF16 tables take the typed kernels (tbe_forward_f16/_bf16).
        for types in [
            [Int8, Int4, Fp8],
            [Fp16, Bf16, Int2],
            [Fp32, Fp8E4m3fn, Int8],
            [Fp16; 3],
            [Bf16; 3],
        ] {
            let q = QuantizedTableBatchedEmbedding::from_trained(&cpu, &types)?;
            let input = TbeInput::new(&c.indices[..], &c.offsets[..]).with_weights(&c.weights);
            let expected = q.forward(input)?.to_vec::<f32>()?;
            let mut gpu_q = q;
            gpu_q.to_device(device)?;
            let got = lookup_quantized(&gpu_q, &c.indices, &c.offsets, Some(&c.weights))?;
            assert_close(&format!("{on}: {types:?} {pooling:?}"), &got, &expected);
        }

        // An out-of-range id is an error naming it, not a read past the table.
        let mut bad = c.indices.clone();
        bad[3] = 1_000_000;
        let err = lookup_host(&gpu, &bad, &c.offsets, None)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("1000000") && err.contains("position 3"),
            "{err}"
        );
    }
    // Dims that are multiples of 4: the 16-byte-load kernels (dims up to 512, and up to 128),
    // against the CPU and bit for bit against the one-float-per-lane kernel, with an
    // out-of-range id reported as before.
    for c_dim in [132, 128] {
        let mut c = case();
        c.tables[2].dim = c_dim;
        for pooling in [PoolingMode::Sum, PoolingMode::Mean] {
            let cpu = c.cpu_tbe(pooling, FusedOptimizer::None, WeightDecay::None)?;
            let expected = c.cpu_forward(&cpu)?;
            let gpu = cpu.clone_to(device)?;
            assert!(
                gpu.set_vectorized(true),
                "dims 64, 12, {c_dim} allow 16-byte loads"
            );
            let vec4 = lookup_host(&gpu, &c.indices, &c.offsets, Some(&c.weights))?;
            assert_close(
                &format!("{name}: v4 {pooling:?} dim {c_dim}"),
                &vec4,
                &expected,
            );
            let mut bad = c.indices.clone();
            bad[7] = -1;
            let err = lookup_host(&gpu, &bad, &c.offsets, None).unwrap_err();
            assert!(err.to_string().contains("position 7"), "{err}");
            assert!(!gpu.set_vectorized(false));
            let scalar = lookup_host(&gpu, &c.indices, &c.offsets, Some(&c.weights))?;
            assert_eq!(
                vec4, scalar,
                "the two kernels add the same terms in the same order"
            );
        }
    }
    Ok(())
}

#[test]
fn tbe_fused_backward_matches_the_cpu_tbe() -> embers::Result<()> {
    let Some((device, name)) = tbe_device() else {
        return Ok(());
    };
    // Dims up to 130 (the general kernel): every optimizer with every decay; up to 128 (the
    // kernel for small dims): every optimizer without decay (emulation time).
    for (c_dim, all_decays) in [(130, true), (128, false)] {
        tbe_backward_steps(device, &name, &case_with_dim(c_dim), all_decays)?;
    }
    // A refused call (an output gradient of the wrong size) changes nothing.
    let c = case();
    let cpu = c.cpu_tbe(
        PoolingMode::Sum,
        FusedOptimizer::Sgd { lr: 0.1 },
        WeightDecay::None,
    )?;
    let gpu = cpu.clone_to(device)?;
    let before = table_state(&gpu, 0)?;
    let short = vec![0.5f32; c.batch * gpu.output_dim() - 1];
    let input = TbeInput::new(&c.indices[..], &c.offsets[..]).with_weights(&c.weights);
    let err = gpu.backward_fused(input, &short).unwrap_err();
    assert!(err.to_string().contains("grad_output"), "{err}");
    assert_eq!(table_state(&gpu, 0)?, before);
    assert_eq!(gpu.step(), 0);
    Ok(())
}

/// Three steps of every fused optimizer (with every weight decay when `all_decays`, else
/// none), sum and mean pooling, on the CPU and the device, compared after each.
fn tbe_backward_steps(
    device: Device,
    name: &str,
    c: &Case,
    all_decays: bool,
) -> embers::Result<()> {
    // Every fused optimizer, each with every kind of weight decay, sum and mean pooling.
    let optimizers = [
        FusedOptimizer::Sgd { lr: 0.1 },
        FusedOptimizer::RowWiseAdagrad {
            lr: 0.05,
            eps: 1e-8,
        },
        FusedOptimizer::Adagrad {
            lr: 0.05,
            eps: 1e-6,
        },
        FusedOptimizer::Adam {
            lr: 0.01,
            beta1: 0.9,
            beta2: 0.99,
            eps: 1e-8,
        },
        FusedOptimizer::PartialRowWiseAdam {
            lr: 0.01,
            beta1: 0.9,
            beta2: 0.99,
            eps: 1e-8,
        },
        FusedOptimizer::Lamb {
            lr: 0.01,
            beta1: 0.9,
            beta2: 0.99,
            eps: 1e-6,
        },
        FusedOptimizer::PartialRowWiseLamb {
            lr: 0.01,
            beta1: 0.9,
            beta2: 0.99,
            eps: 1e-6,
        },
    ];
    let decays = [
        WeightDecay::None,
        WeightDecay::L2(0.01),
        WeightDecay::Decoupled(0.1),
    ];
    let decays = if all_decays {
        &decays[..]
    } else {
        &decays[..1]
    };
    for (i, optimizer) in optimizers.into_iter().enumerate() {
        for (j, &decay) in decays.iter().enumerate() {
            // Both poolings for the first decay, alternating for the others (emulation time).
            let poolings: &[PoolingMode] = match j {
                0 => &[PoolingMode::Sum, PoolingMode::Mean],
                _ if (i + j) % 2 == 0 => &[PoolingMode::Sum],
                _ => &[PoolingMode::Mean],
            };
            for &pooling in poolings {
                let cpu = c.cpu_tbe(pooling, optimizer, decay)?;
                let mut rng = embers::tensor::rng::seeded(6);
                let gpu = cpu.clone_to(device)?;
                // Three steps: the later ones see the accumulators and Adam's bias correction.
                for step in 0..3 {
                    let what = format!(
                        "{name}: {optimizer:?} {decay:?} {pooling:?} max dim {} step {step}",
                        c.tables.iter().map(|t| t.dim).max().unwrap_or(0)
                    );
                    // The middle step without per-sample weights.
                    step_both(&what, c, &cpu, &gpu, &mut rng, step != 1)?;
                }
                assert_eq!(gpu.step(), cpu.step(), "step count");
            }
        }
    }
    Ok(())
}

/// One training step on both TBEs: the CPU forward (compared with the GPU's) and autograd
/// backward, the GPU's fused backward with the same output gradient; then the per-sample
/// weights' gradients, every table and every optimizer state buffer compared. Returns the CPU
/// forward's output. Without `with_weights` no per-sample weights (the backward's keys then
/// carry bags, not positions).
fn step_both(
    what: &str,
    c: &Case,
    cpu: &TableBatchedEmbedding,
    gpu: &TableBatchedEmbedding,
    rng: &mut embers::tensor::rng::Rng,
    with_weights: bool,
) -> embers::Result<Tensor> {
    let (n, f) = (c.indices.len(), c.feature_table_map.len());
    let weights = Tensor::from_vec(c.weights.clone(), &[n])?.with_requires_grad(true);
    let out = cpu.forward(
        &Tensor::from_vec(c.indices.clone(), &[n])?,
        &Tensor::from_vec(c.offsets.clone(), &[f * c.batch + 1])?,
        with_weights.then_some(&weights),
    )?;
    let host_weights = with_weights.then_some(&c.weights[..]);
    let got = lookup_host(gpu, &c.indices, &c.offsets, host_weights)?;
    assert_close(&format!("{what} forward"), &got, &out.to_vec::<f32>()?);
    let grad = Tensor::randn(out.shape(), 0.0, 1.0, embers::DType::F32, rng);
    out.backward_with(&grad, false)?;
    let mut input = TbeInput::new(&c.indices[..], &c.offsets[..]);
    if let Some(w) = host_weights {
        input = input.with_weights(w);
    }
    let weights_grad = gpu
        .backward_fused(input, &grad.to_vec::<f32>()?)?
        .per_sample_weights_grad;
    if with_weights {
        assert_close(
            &format!("{what} per-sample weights' gradient"),
            &weights_grad.expect("weights were given"),
            &weights
                .grad()
                .expect("CPU weight gradient")
                .to_vec::<f32>()?,
        );
    } else {
        assert!(
            weights_grad.is_none(),
            "{what}: a weight gradient without weights"
        );
    }
    for t in 0..c.tables.len() {
        let (w, state) = table_state(gpu, t)?;
        assert_close(&format!("{what} table {t}"), &w, &cpu.table_weights(t)?);
        assert_eq!(state.len(), cpu.optimizer_state_names().len(), "{what}");
        for (i, m) in state.iter().enumerate() {
            assert_close(
                &format!("{what} table {t} state {i}"),
                m,
                &cpu.optimizer_state(i, t)?,
            );
        }
    }
    Ok(out)
}

/// Same length and every element within 1e-5 relative (absolute below 1).
fn assert_close(what: &str, got: &[f32], expected: &[f32]) {
    assert_eq!(got.len(), expected.len(), "{what}: lengths");
    for (i, (g, e)) in got.iter().zip(expected).enumerate() {
        assert!(
            (g - e).abs() <= 1e-5 * e.abs().max(1.0),
            "{what} element {i}: GPU {g} vs CPU {e}"
        );
    }
}

#[test]
fn unpooled_lookups_and_their_backward_match_the_cpu_tbe() -> embers::Result<()> {
    if let Some((device, name)) = tbe_device() {
        let mut c = case();
        // Pooling NONE needs one dim for every table.
        for spec in &mut c.tables {
            spec.dim = 24;
        }
        let n = c.indices.len();
        let optimizers = [
            FusedOptimizer::Sgd { lr: 0.1 },
            FusedOptimizer::RowWiseAdagrad {
                lr: 0.05,
                eps: 1e-8,
            },
        ];
        for optimizer in optimizers {
            let cpu = c.cpu_tbe(PoolingMode::None, optimizer, WeightDecay::None)?;
            let gpu = cpu.clone_to(device)?;
            assert_eq!(gpu.output_dim() * n, n * 24);
            let mut rng = embers::tensor::rng::seeded(8);
            for step in 0..2 {
                let what = format!("{name}: unpooled {optimizer:?} step {step}");
                let out = step_both(&what, &c, &cpu, &gpu, &mut rng, step == 0)?;
                assert_eq!(out.shape(), &[n, 24]);
            }
        }
        // Quantized rows of every type, unpooled, with per-sample weights, against the CPU
        // quantized TBE; an out-of-range id is reported, not read.
        let cpu = c.cpu_tbe(PoolingMode::None, FusedOptimizer::None, WeightDecay::None)?;
        use WeightType::*;
        for types in [
            [Int8, Int4, Fp8],
            [Fp16, Bf16, Int2],
            [Fp32, Fp8E4m3fn, Int4],
        ] {
            let q = QuantizedTableBatchedEmbedding::from_trained(&cpu, &types)?;
            let input = TbeInput::new(&c.indices[..], &c.offsets[..]).with_weights(&c.weights);
            let expected = q.forward(input)?.to_vec::<f32>()?;
            let mut gpu_q = q;
            gpu_q.to_device(device)?;
            let got = lookup_quantized(&gpu_q, &c.indices, &c.offsets, Some(&c.weights))?;
            assert_eq!(got.len(), n * 24);
            assert_close(&format!("{name}: unpooled {types:?}"), &got, &expected);
            let mut bad = c.indices.clone();
            bad[5] = -2;
            let err = lookup_quantized(&gpu_q, &bad, &c.offsets, None).unwrap_err();
            assert!(err.to_string().contains("position 5"), "{err}");
        }
    }
    Ok(())
}

#[test]
fn row_sparse_gradients_of_tables_without_an_optimizer_match_the_cpu() -> embers::Result<()> {
    if let Some((device, name)) = tbe_device() {
        let mut c = case();
        // Rows that repeat across bags and across the two features sharing table 0.
        for id in c.indices.iter_mut().step_by(3) {
            *id %= 7;
        }
        for pooling in [PoolingMode::Sum, PoolingMode::Mean] {
            let what = format!("{name}: row-sparse {pooling:?}");
            let cpu = c.cpu_tbe(pooling, FusedOptimizer::None, WeightDecay::None)?;
            let gpu = cpu.clone_to(device)?;
            let (n, f) = (c.indices.len(), c.feature_table_map.len());
            let weights = Tensor::from_vec(c.weights.clone(), &[n])?.with_requires_grad(true);
            let out = cpu.forward(
                &Tensor::from_vec(c.indices.clone(), &[n])?,
                &Tensor::from_vec(c.offsets.clone(), &[f * c.batch + 1])?,
                Some(&weights),
            )?;
            let mut rng = embers::tensor::rng::seeded(9);
            let grad = Tensor::randn(out.shape(), 0.0, 1.0, embers::DType::F32, &mut rng);
            out.backward_with(&grad, false)?;
            let before = lookup_host(&gpu, &c.indices, &c.offsets, None)?;
            let input = TbeInput::new(&c.indices[..], &c.offsets[..]).with_weights(&c.weights);
            let out = gpu.backward_fused(input, &grad.to_vec::<f32>()?)?;
            let (grads, weights_grad) = (
                out.sparse_grads
                    .expect("row-sparse gradients without an optimizer"),
                out.per_sample_weights_grad,
            );
            assert_eq!(grads.len(), c.tables.len());
            for (t, g) in grads.iter().enumerate() {
                let expected = cpu.sparse_gradient(t).expect("every table is read");
                assert_eq!(g.rows, expected.rows, "{what} table {t} rows");
                assert_eq!(g.dim, c.tables[t].dim);
                assert_close(
                    &format!("{what} table {t} values"),
                    &g.values,
                    &expected.values.to_vec::<f32>()?,
                );
            }
            assert_close(
                &format!("{what} per-sample weights' gradient"),
                &weights_grad.expect("weights were given"),
                &weights
                    .grad()
                    .expect("CPU weight gradient")
                    .to_vec::<f32>()?,
            );
            // The tables did not move, the step was counted.
            let after = lookup_host(&gpu, &c.indices, &c.offsets, None)?;
            assert_eq!(before, after, "{what}: tables unchanged");
            assert_eq!(gpu.step(), 1);
        }
    }
    Ok(())
}
