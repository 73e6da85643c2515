//! The model-level CUDA paths against the CPU: dense optimizers, BCE with logits, cat, DLRM's
//! dot interaction, parameter moves, the embedding-bag collection on the device (forward and
//! fused backward) and whole DLRM training steps. Runs on GPU 0 when the machine has one, else
//! on the host emulation (skipped with the reason printed only when no C++ compiler exists,
//! and CI makes that an error).

use embers::embedding::{
    BoundsCheckMode, EmbeddingBagCollection, EmbeddingBagConfig, FusedOptimizer, PoolingMode,
    WeightDecay,
};
use embers::models::interaction::dot_interaction;
use embers::nn::Module;
use embers::optim::{Adagrad, Adam, AdamConfig, Optimizer, Sgd};
use embers::sparse::KeyedJaggedTensor;
use embers::tensor::ops::loss::Reduction;
use embers::tensor::rng::seeded;
use embers::train::{Batch, DenseOptimizer, DlrmConfig};
use embers::{DType, Device, Tensor};

#[path = "support/cuda_device.rs"]
mod cuda_device;
use cuda_device::device;

fn randn(shape: &[usize], seed: u64) -> Tensor {
    Tensor::randn(shape, 0.0, 1.0, DType::F32, &mut seeded(seed))
}

/// Element-wise agreement within `rel` of the magnitude (absolute below 1), compared on the
/// host whatever the devices.
fn assert_close(what: &str, got: &Tensor, expected: &Tensor, rel: f64) {
    assert_eq!(got.shape(), expected.shape(), "{what}: shapes");
    let (g, e) = (got.to_vec_f64().unwrap(), expected.to_vec_f64().unwrap());
    for (i, (a, b)) in g.iter().zip(&e).enumerate() {
        assert!(
            (a - b).abs() <= rel * b.abs().max(1.0),
            "{what} element {i}: CUDA {a} vs CPU {b}"
        );
    }
}

/// Gives `p` (a leaf) the gradient `g` through autograd: `sum(p ⊙ g)`.
fn set_grad(p: &Tensor, g: &Tensor) {
    p.mul(g).unwrap().sum_all().unwrap().backward().unwrap();
}

#[test]
fn dense_optimizers_step_as_on_the_cpu() {
    let Some(dev) = device() else { return };
    type Build = Box<dyn Fn(Vec<Tensor>) -> Box<dyn Optimizer>>;
    let builds: Vec<(&str, Build)> = vec![
        (
            "sgd",
            Box::new(|p| Box::new(Sgd::new(p, 0.1).unwrap()) as Box<dyn Optimizer>),
        ),
        (
            "sgd nesterov momentum weight decay",
            Box::new(|p| {
                Box::new(
                    Sgd::new(p, 0.1)
                        .unwrap()
                        .momentum(0.9)
                        .weight_decay(0.01)
                        .nesterov(true),
                )
            }),
        ),
        (
            "adagrad",
            Box::new(|p| Box::new(Adagrad::new(p, 0.05, 0.1).unwrap())),
        ),
        (
            "adam amsgrad l2",
            Box::new(|p| {
                let c = AdamConfig {
                    lr: 0.01,
                    weight_decay: 0.1,
                    amsgrad: true,
                    ..Default::default()
                };
                Box::new(Adam::new(p, c).unwrap())
            }),
        ),
        (
            "adamw",
            Box::new(|p| {
                let c = AdamConfig {
                    lr: 0.01,
                    weight_decay: 0.1,
                    decoupled_weight_decay: true,
                    ..Default::default()
                };
                Box::new(Adam::new(p, c).unwrap())
            }),
        ),
    ];
    for (name, build) in builds {
        let init = randn(&[7, 5], 1);
        let cpu_p = init.detach().with_requires_grad(true);
        let gpu_p = init.to_device(dev).unwrap().with_requires_grad(true);
        let mut cpu_opt = build(vec![cpu_p.clone()]);
        let mut gpu_opt = build(vec![gpu_p.clone()]);
        for step in 0..3 {
            let g = randn(&[7, 5], 10 + step);
            cpu_opt.zero_grad();
            gpu_opt.zero_grad();
            set_grad(&cpu_p, &g);
            set_grad(&gpu_p, &g.to_device(dev).unwrap());
            cpu_opt.step().unwrap();
            gpu_opt.step().unwrap();
            assert_eq!(gpu_p.device(), dev);
            assert_close(&format!("{name} step {step}"), &gpu_p, &cpu_p, 1e-5);
        }
        // State dicts come back to the host and load onto the device again.
        let (sc, sg) = (cpu_opt.state_dict().unwrap(), gpu_opt.state_dict().unwrap());
        assert_eq!(sc.len(), sg.len(), "{name}: state entries");
        for ((nc, tc), (ng, tg)) in sc.iter().zip(&sg) {
            assert_eq!(nc, ng);
            assert_close(&format!("{name} state {nc}"), tg, tc, 1e-5);
        }
        gpu_opt.load_state_dict(&sc).unwrap();
        let g = randn(&[7, 5], 99);
        set_grad(&cpu_p, &g);
        set_grad(&gpu_p, &g.to_device(dev).unwrap());
        cpu_opt.step().unwrap();
        gpu_opt.step().unwrap();
        assert_close(
            &format!("{name} after a state reload"),
            &gpu_p,
            &cpu_p,
            1e-5,
        );
    }
}

#[test]
fn row_sparse_gradients_step_only_their_rows_as_on_the_cpu() {
    use embers::sparse::ops::index_select_dim0;
    let Some(dev) = device() else { return };
    type Build = Box<dyn Fn(Vec<Tensor>) -> Box<dyn Optimizer>>;
    let adam = |c: AdamConfig| -> Build { Box::new(move |p| Box::new(Adam::new(p, c).unwrap())) };
    // (name, optimizer, whether rows without a gradient keep their values: the sparse updates
    // leave them; momentum and L2 weight decay densify, on the CPU as on the device)
    let builds: Vec<(&str, Build, bool)> = vec![
        (
            "sgd",
            Box::new(|p| Box::new(Sgd::new(p, 0.1).unwrap()) as Box<dyn Optimizer>),
            true,
        ),
        (
            "sgd momentum (densified)",
            Box::new(|p| Box::new(Sgd::new(p, 0.1).unwrap().momentum(0.9))),
            false,
        ),
        (
            "adagrad",
            Box::new(|p| Box::new(Adagrad::new(p, 0.05, 0.1).unwrap())),
            true,
        ),
        (
            "adagrad weight decay (densified)",
            Box::new(|p| {
                let mut a = Adagrad::new(p, 0.05, 0.0).unwrap();
                a.weight_decay = 0.1;
                Box::new(a)
            }),
            false,
        ),
        (
            "lazy adam",
            adam(AdamConfig {
                lr: 0.01,
                ..Default::default()
            }),
            true,
        ),
        (
            "lazy adamw amsgrad",
            adam(AdamConfig {
                lr: 0.01,
                weight_decay: 0.1,
                decoupled_weight_decay: true,
                amsgrad: true,
                ..Default::default()
            }),
            true,
        ),
        (
            "adam l2 (densified)",
            adam(AdamConfig {
                lr: 0.01,
                weight_decay: 0.1,
                ..Default::default()
            }),
            false,
        ),
    ];
    // Repeated, unsorted rows (the gradient is coalesced first).
    let selections: [&[i64]; 3] = [&[5, 0, 5, 2, 9], &[3, 3, 7], &[6, 0, 2, 2, 2]];
    for (name, build, sparse) in builds {
        let init = randn(&[10, 6], 80);
        let cpu_p = init.detach().with_requires_grad(true);
        let gpu_p = init.to_device(dev).unwrap().with_requires_grad(true);
        let mut cpu_opt = build(vec![cpu_p.clone()]);
        let mut gpu_opt = build(vec![gpu_p.clone()]);
        let mut after_first = Vec::new();
        for (step, rows) in selections.iter().enumerate() {
            let idx = Tensor::from_vec(rows.to_vec(), &[rows.len()]).unwrap();
            let w = randn(&[rows.len(), 6], 81 + step as u64);
            cpu_opt.zero_grad();
            gpu_opt.zero_grad();
            set_grad(&index_select_dim0(&cpu_p, &idx).unwrap(), &w);
            set_grad(
                &index_select_dim0(&gpu_p, &idx.to_device(dev).unwrap()).unwrap(),
                &w.to_device(dev).unwrap(),
            );
            assert!(
                matches!(gpu_p.gradient(), Some(embers::Gradient::RowSparse(_))),
                "{name}: the device gradient is row-sparse"
            );
            cpu_opt.step().unwrap();
            gpu_opt.step().unwrap();
            assert_close(&format!("{name} step {step}"), &gpu_p, &cpu_p, 1e-5);
            if step == 0 {
                after_first = gpu_p.to_vec_f64().unwrap();
            }
        }
        let (sc, sg) = (cpu_opt.state_dict().unwrap(), gpu_opt.state_dict().unwrap());
        assert_eq!(sc.len(), sg.len(), "{name}: state entries");
        for ((nc, tc), (ng, tg)) in sc.iter().zip(&sg) {
            assert_eq!(nc, ng);
            assert_close(&format!("{name} state {nc}"), tg, tc, 1e-5);
        }
        // Rows selected only at step 0 (5 and 9) keep their values from then on under the
        // sparse updates and move under the densified ones.
        let got = gpu_p.to_vec_f64().unwrap();
        for row in [5usize, 9] {
            let same = got[row * 6..(row + 1) * 6] == after_first[row * 6..(row + 1) * 6];
            assert_eq!(same, sparse, "{name}: row {row} unchanged after step 0");
        }
    }
}

#[test]
fn strided_row_sparse_gradients_from_custom_ops_step_as_on_the_cpu() {
    use embers::tensor::{record_op, BackwardOp, RowSparseGrad};
    let Some(dev) = device() else { return };
    /// Gives its input the row-sparse gradient `values` (a transposed, strided view) on rows
    /// 1 and 3: already coalesced, so it reaches the optimizer as the op made it.
    struct StridedRows(Tensor);
    impl BackwardOp for StridedRows {
        fn name(&self) -> &'static str {
            "strided rows"
        }
        fn backward(&self, _g: &Tensor) -> embers::Result<Vec<Option<embers::Gradient>>> {
            Ok(vec![Some(embers::Gradient::RowSparse(RowSparseGrad {
                rows: vec![1, 3],
                values: self.0.t()?,
                num_rows: 4,
            }))])
        }
    }
    // Independent copies of the same values (a detached view would share the CPU storage the
    // step updates in place).
    let init = || randn(&[4, 3], 90);
    let g = randn(&[3, 2], 91);
    assert!(!g.t().unwrap().is_contiguous());
    let before = init().to_vec_f64().unwrap();
    let mut stepped = Vec::new();
    for p in [init(), init().to_device(dev).unwrap()] {
        let p = p.with_requires_grad(true);
        let mut opt = Adagrad::new(vec![p.clone()], 0.1, 0.0).unwrap();
        let values = g.to_device(p.device()).unwrap();
        let y = record_op(p.detach(), &[&p], StridedRows(values));
        y.sum_all().unwrap().backward().unwrap();
        opt.step().unwrap();
        stepped.push(p);
    }
    assert_close("adagrad on strided rows", &stepped[1], &stepped[0], 1e-5);
    // Rows 0 and 2 had no gradient and keep their values; rows 1 and 3 moved.
    let after = stepped[1].to_vec_f64().unwrap();
    for row in 0..4 {
        let same = before[row * 3..(row + 1) * 3] == after[row * 3..(row + 1) * 3];
        assert_eq!(same, row % 2 == 0, "row {row} unchanged");
    }
}

#[test]
fn bce_cat_and_dot_interaction_match_the_cpu() {
    let Some(dev) = device() else { return };
    // BCE with logits, large logits included, and its gradient.
    let x = randn(&[33], 2).mul_scalar(8.0).unwrap();
    let y = Tensor::rand_uniform(&[33], 0.0, 1.0, DType::F32, &mut seeded(3));
    let xc = x.detach().with_requires_grad(true);
    let xg = x.to_device(dev).unwrap().with_requires_grad(true);
    let lc = xc.bce_with_logits(&y, None, Reduction::Mean).unwrap();
    let lg = (xg.bce_with_logits(&y.to_device(dev).unwrap(), None, Reduction::Mean)).unwrap();
    assert_eq!(lg.device(), dev);
    assert_close("bce", &lg, &lc, 1e-5);
    lc.backward().unwrap();
    lg.backward().unwrap();
    assert_close("bce grad", &xg.grad().unwrap(), &xc.grad().unwrap(), 1e-5);

    // cat of views (a transposed one included) along both dims, for f32 and i64.
    let a = randn(&[4, 3], 4);
    let b = randn(&[3, 4], 5).t().unwrap();
    let (ad, bd) = (a.to_device(dev).unwrap(), b.to_device(dev).unwrap());
    for dim in [0, 1] {
        let got = Tensor::cat(&[&ad, &bd, &ad], dim).unwrap();
        let want = Tensor::cat(&[&a, &b, &a], dim).unwrap();
        assert_eq!(got.device(), dev);
        assert_close(&format!("cat dim {dim}"), &got, &want, 0.0);
    }
    let ints = Tensor::from_vec((0..12i64).collect(), &[3, 4]).unwrap();
    let got = Tensor::cat(
        &[
            &ints.to_device(dev).unwrap(),
            &ints.narrow(1, 1, 2).unwrap().to_device(dev).unwrap(),
        ],
        1,
    );
    let want = Tensor::cat(&[&ints, &ints.narrow(1, 1, 2).unwrap()], 1).unwrap();
    assert_eq!(
        got.unwrap().to_vec::<i64>().unwrap(),
        want.to_vec::<i64>().unwrap()
    );

    // Dot interaction and its gradients (through cat's backward on the way, too).
    let (bsz, f, d) = (5, 4, 12);
    let dense = randn(&[bsz, d], 6);
    let sparse = randn(&[bsz, f, d], 7);
    let (dc, sc) = (
        dense.with_requires_grad(true),
        sparse.with_requires_grad(true),
    );
    let dg = dense.to_device(dev).unwrap().with_requires_grad(true);
    let sg = sparse.to_device(dev).unwrap().with_requires_grad(true);
    let oc = dot_interaction(&dc, &sc).unwrap();
    let og = dot_interaction(&dg, &sg).unwrap();
    assert_eq!(og.device(), dev);
    assert_close("dot interaction", &og, &oc, 1e-5);
    let w = randn(oc.shape(), 8);
    set_grad(&oc, &w);
    set_grad(&og, &w.to_device(dev).unwrap());
    assert_close(
        "dot interaction dense grad",
        &dg.grad().unwrap(),
        &dc.grad().unwrap(),
        1e-5,
    );
    assert_close(
        "dot interaction sparse grad",
        &sg.grad().unwrap(),
        &sc.grad().unwrap(),
        1e-5,
    );
}

#[test]
fn parameters_move_in_place_and_copy_back() {
    let Some(dev) = device() else { return };
    let p = randn(&[3, 4], 9).with_requires_grad(true);
    let handle = p.clone();
    let before = p.to_vec::<f32>().unwrap();
    p.move_to_device(dev).unwrap();
    assert_eq!(handle.device(), dev, "every handle follows the move");
    assert_eq!(handle.to_vec::<f32>().unwrap(), before);
    let new = randn(&[3, 4], 10);
    handle.copy_from(&new).unwrap();
    assert_eq!(p.to_vec::<f32>().unwrap(), new.to_vec::<f32>().unwrap());
    p.move_to_device(Device::Cpu).unwrap();
    assert_eq!(p.device(), Device::Cpu);
    // A view is not moved in place.
    let err = randn(&[4, 4], 11)
        .narrow(0, 1, 2)
        .unwrap()
        .move_to_device(dev)
        .unwrap_err();
    assert!(err.to_string().contains("in place"), "{err}");
}

/// Two sum-pooled tables (one read by two features) and a mean-pooled one.
fn ebc(optimizer: FusedOptimizer, decay: WeightDecay) -> EmbeddingBagCollection {
    let configs = vec![
        EmbeddingBagConfig::new("a", 50, 8, &["f0", "f1"]),
        EmbeddingBagConfig::new("b", 20, 8, &["f2"]).with_pooling(PoolingMode::Mean),
        EmbeddingBagConfig::new("c", 30, 8, &["f3"]),
    ];
    EmbeddingBagCollection::with_options(
        configs,
        optimizer,
        decay,
        BoundsCheckMode::Error,
        &mut seeded(12),
    )
    .unwrap()
}

/// Every table of [`ebc`]'s collections equal to 1e-5.
fn assert_tables_close(what: &str, got: &EmbeddingBagCollection, want: &EmbeddingBagCollection) {
    for t in ["a", "b", "c"] {
        let (g, w) = (
            got.table_weights(t).unwrap(),
            want.table_weights(t).unwrap(),
        );
        let n = g.len();
        assert_close(
            &format!("{what} table {t}"),
            &Tensor::from_vec(g, &[n]).unwrap(),
            &Tensor::from_vec(w, &[n]).unwrap(),
            1e-5,
        );
    }
}

fn kjt(seed: u64, batch: usize, rows: &[i64]) -> KeyedJaggedTensor {
    use rand::Rng;
    let mut rng = seeded(seed);
    let (mut values, mut lengths) = (Vec::new(), Vec::new());
    for &r in rows {
        for _ in 0..batch {
            let n = rng.random_range(0..4);
            lengths.push(n as i64);
            for _ in 0..n {
                values.push(rng.random_range(0..r));
            }
        }
    }
    let n = values.len();
    KeyedJaggedTensor::from_lengths(
        // Keys in another order than the tables': the collection picks its features.
        vec!["f3".into(), "f0".into(), "f1".into(), "f2".into()],
        Tensor::from_vec(values, &[n]).unwrap(),
        Tensor::from_vec(lengths, &[rows.len() * batch]).unwrap(),
        None,
        Some(batch),
    )
    .unwrap()
}

#[test]
fn embedding_bag_collection_trains_on_the_device_as_on_the_cpu() {
    let Some(dev) = device() else { return };
    let adam = FusedOptimizer::Adam {
        lr: 0.1,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
    };
    for (optimizer, decay) in [
        (FusedOptimizer::Sgd { lr: 0.1 }, WeightDecay::None),
        (
            FusedOptimizer::RowWiseAdagrad { lr: 0.1, eps: 1e-8 },
            WeightDecay::L2(0.01),
        ),
        (adam, WeightDecay::Decoupled(0.1)),
    ] {
        let cpu = ebc(optimizer, decay);
        let gpu = ebc(optimizer, decay);
        gpu.to_device(dev).unwrap();
        for step in 0..2 {
            let input = kjt(20 + step, 6, &[30, 50, 50, 20]);
            let oc = cpu.forward(&input).unwrap();
            let og = gpu.forward(&input).unwrap();
            assert_eq!(og.keys(), oc.keys());
            assert_eq!(og.values().device(), dev);
            let what = format!("{optimizer:?} step {step}");
            assert_close(&format!("{what} pooled"), og.values(), oc.values(), 1e-5);
            let w = randn(oc.values().shape(), 30 + step);
            set_grad(oc.values(), &w);
            set_grad(og.values(), &w.to_device(dev).unwrap());
        }
        gpu.to_device(Device::Cpu).unwrap();
        // The optimizer state and step count come back too: one more step on each CPU copy
        // stays equal.
        let input = kjt(40, 6, &[30, 50, 50, 20]);
        for c in [&cpu, &gpu] {
            let out = c.forward(&input).unwrap();
            set_grad(out.values(), &randn(out.values().shape(), 41));
        }
        assert_tables_close(&format!("{optimizer:?}"), &gpu, &cpu);
    }
    // An out-of-range id is an error naming the feature, position and table size.
    let gpu = ebc(FusedOptimizer::Sgd { lr: 0.1 }, WeightDecay::None);
    gpu.to_device(dev).unwrap();
    let bad = KeyedJaggedTensor::from_lengths(
        vec!["f3".into(), "f0".into(), "f1".into(), "f2".into()],
        Tensor::from_vec(vec![0i64, 1, 2, 20], &[4]).unwrap(),
        Tensor::from_vec(vec![1i64; 4], &[4]).unwrap(),
        None,
        Some(1),
    )
    .unwrap();
    let err = gpu.forward(&bad).unwrap_err().to_string();
    assert!(err.contains("f2") && err.contains("20 rows"), "{err}");
}

#[test]
fn tables_without_an_optimizer_sum_row_sparse_gradients_on_the_device() {
    let Some(dev) = device() else { return };
    let cpu = ebc(FusedOptimizer::None, WeightDecay::None);
    let gpu = ebc(FusedOptimizer::None, WeightDecay::None);
    gpu.to_device(dev).unwrap();
    // Two backward calls sum into the kept gradients, as on the CPU.
    for step in 0..2 {
        let input = kjt(60 + step, 6, &[30, 50, 50, 20]);
        let (oc, og) = (cpu.forward(&input).unwrap(), gpu.forward(&input).unwrap());
        let w = randn(oc.values().shape(), 61 + step);
        set_grad(oc.values(), &w);
        set_grad(og.values(), &w.to_device(dev).unwrap());
    }
    // Dense [rows, dim] forms of both, compared table by table.
    let dense = |rows: &[i64], values: &[f32], num_rows: usize, dim: usize| -> Tensor {
        let mut d = vec![0.0f32; num_rows * dim];
        for (k, &r) in rows.iter().enumerate() {
            for j in 0..dim {
                d[r as usize * dim + j] += values[k * dim + j];
            }
        }
        Tensor::from_vec(d, &[num_rows, dim]).unwrap()
    };
    for (name, num_rows) in [("a", 50), ("b", 20), ("c", 30)] {
        let (tbe, t) = cpu
            .tbes()
            .into_iter()
            .find_map(|tbe| {
                let t = tbe.config().tables.iter().position(|s| s.name == name)?;
                Some((tbe, t))
            })
            .unwrap();
        let expected = tbe
            .sparse_gradient(t)
            .expect("the CPU table has a gradient");
        let got = gpu
            .sparse_gradient(name)
            .unwrap()
            .expect("a gradient on the device");
        assert!(
            got.rows.windows(2).all(|w| w[0] < w[1]),
            "sorted distinct rows"
        );
        assert_eq!(got.values.device(), dev);
        let got_values = got.values.to_vec::<f32>().unwrap();
        assert_close(
            &format!("table {name} row-sparse gradient"),
            &dense(&got.rows, &got_values, num_rows, got.values.shape()[1]),
            &dense(
                &expected.rows,
                &expected.values.to_vec::<f32>().unwrap(),
                num_rows,
                8,
            ),
            1e-5,
        );
    }
    // The tables did not move; zeroing clears the kept gradients; unknown tables are errors.
    assert_tables_close("no optimizer", &gpu, &cpu);
    gpu.zero_sparse_gradients();
    assert!(gpu.sparse_gradient("a").unwrap().is_none());
    assert!(gpu.sparse_gradient("nope").is_err());
}

#[test]
fn per_sample_weights_get_their_gradient_from_the_device() {
    let Some(dev) = device() else { return };
    let opt = FusedOptimizer::RowWiseAdagrad { lr: 0.1, eps: 1e-8 };
    let (cpu, gpu) = (ebc(opt, WeightDecay::None), ebc(opt, WeightDecay::None));
    gpu.to_device(dev).unwrap();
    let plain = kjt(50, 5, &[30, 50, 50, 20]);
    let n = plain.values().numel();
    let w = randn(&[n], 51);
    let mut grads = Vec::new();
    for (model, on_device) in [(None, false), (Some(&gpu), true)] {
        // Fresh leaf weights per run; keys are in another order than the tables' features.
        let weights = w.clone().detach().with_requires_grad(true);
        let input = KeyedJaggedTensor::from_lengths(
            plain.keys().to_vec(),
            plain.values().clone(),
            plain.lengths().clone(),
            Some(weights.clone()),
            Some(5),
        )
        .unwrap();
        let out = match model {
            Some(g) => g.forward(&input).unwrap(),
            None => cpu.forward(&input).unwrap(),
        };
        let g = randn(out.values().shape(), 52);
        let g = if on_device {
            g.to_device(dev).unwrap()
        } else {
            g
        };
        set_grad(out.values(), &g);
        grads.push(weights.grad().expect("the weights got a gradient"));
    }
    assert_eq!(grads[1].device(), Device::Cpu);
    assert_close("per-sample weights' gradient", &grads[1], &grads[0], 1e-5);
    // The rows moved as on the CPU (the weights scale their gradient).
    assert_tables_close("weighted", &gpu, &cpu);
}

#[test]
fn dlrm_training_steps_on_the_device_match_the_cpu() {
    let Some(dev) = device() else { return };
    let features: Vec<(String, usize)> = (0..3).map(|i| (format!("s{i}"), 40)).collect();
    let config = |device| DlrmConfig {
        num_dense: 5,
        sparse_features: features.clone(),
        embedding_dim: 8,
        dense_arch: vec![16],
        over_arch: vec![16],
        tasks: vec!["click".to_string()],
        dcn: None,
        dense_optimizer: DenseOptimizer::Adagrad { lr: 0.05 },
        sparse_optimizer: FusedOptimizer::RowWiseAdagrad {
            lr: 0.05,
            eps: 1e-8,
        },
        seed: 4,
        metrics_window: 1000,
        device,
    };
    let mut cpu = config(Device::Cpu).build().unwrap();
    let mut gpu = config(dev).build().unwrap();
    assert_eq!(gpu.model().device(), dev);
    let batch_size = 16;
    for step in 0..3 {
        use rand::Rng;
        let mut rng = seeded(50 + step);
        let dense = randn(&[batch_size, 5], 60 + step);
        let labels: Vec<f32> = (0..batch_size)
            .map(|_| f32::from(rng.random_bool(0.3)))
            .collect();
        let (mut values, mut lengths) = (Vec::new(), Vec::new());
        for _ in 0..3 * batch_size {
            let n = rng.random_range(1..3);
            lengths.push(n);
            values.extend((0..n).map(|_| rng.random_range(0..40i64)));
        }
        let n = values.len();
        let kjt = KeyedJaggedTensor::from_lengths(
            features.iter().map(|(f, _)| f.clone()).collect(),
            Tensor::from_vec(values, &[n]).unwrap(),
            Tensor::from_vec(lengths, &[3 * batch_size]).unwrap(),
            None,
            Some(batch_size),
        )
        .unwrap();
        let batch =
            Batch::new(dense, kjt, Tensor::from_vec(labels, &[batch_size]).unwrap()).unwrap();
        let lc = cpu.train_step(&batch).unwrap().loss;
        let lg = gpu.train_step(&batch).unwrap().loss;
        assert!(
            (lc - lg).abs() <= 1e-5 * lc.abs().max(1.0),
            "step {step} loss: CUDA {lg} vs CPU {lc}"
        );
    }
    for ((name, pc), (_, pg)) in cpu
        .model()
        .dense
        .named_parameters()
        .iter()
        .zip(&gpu.model().dense.named_parameters())
    {
        assert_eq!(pg.device(), dev);
        assert_close(&format!("dense {name}"), pg, pc, 1e-4);
    }
    for (f, _) in &features {
        let t = format!("t_{f}");
        let (got, want) = (
            gpu.model().sparse_arch.table_weights(&t).unwrap(),
            cpu.model().sparse_arch.table_weights(&t).unwrap(),
        );
        let n = got.len();
        assert_close(
            &format!("table {t}"),
            &Tensor::from_vec(got, &[n]).unwrap(),
            &Tensor::from_vec(want, &[n]).unwrap(),
            1e-4,
        );
    }
}

#[test]
fn jagged_ops_and_row_indexing_match_the_cpu() {
    use embers::sparse::ops::{
        dense_to_jagged, index_select_dim0, jagged_to_padded_dense, permute_2d_sparse_data,
    };
    let Some(dev) = device() else { return };
    // Jagged [N, D] ↔ padded dense, with truncation (max length 3 < the longest bag), an
    // empty bag, and the gradients both ways.
    let offsets = Tensor::from_vec(vec![0i64, 2, 2, 7, 8], &[5]).unwrap();
    let values = randn(&[8, 5], 70);
    let vc = values.with_requires_grad(true);
    let vg = values.to_device(dev).unwrap().with_requires_grad(true);
    let pc = jagged_to_padded_dense(&vc, &[&offsets], &[3], -1.5).unwrap();
    let pg = jagged_to_padded_dense(&vg, &[&offsets], &[3], -1.5).unwrap();
    assert_eq!(pg.device(), dev);
    assert_close("jagged_to_padded_dense", &pg, &pc, 0.0);
    let w = randn(pc.shape(), 71);
    set_grad(&pc, &w);
    set_grad(&pg, &w.to_device(dev).unwrap());
    assert_close(
        "jagged_to_padded_dense grad",
        &vg.grad().unwrap(),
        &vc.grad().unwrap(),
        0.0,
    );
    let dense = randn(&[4, 3, 5], 72);
    let dc = dense.with_requires_grad(true);
    let dg = dense.to_device(dev).unwrap().with_requires_grad(true);
    let jc = dense_to_jagged(&dc, &[&offsets], Some(10)).unwrap();
    let jg = dense_to_jagged(&dg, &[&offsets], Some(10)).unwrap();
    assert_close("dense_to_jagged", &jg, &jc, 0.0);
    let w = randn(jc.shape(), 73);
    set_grad(&jc, &w);
    set_grad(&jg, &w.to_device(dev).unwrap());
    assert_close(
        "dense_to_jagged grad",
        &dg.grad().unwrap(),
        &dc.grad().unwrap(),
        0.0,
    );

    // Two jagged dimensions (3 outer bags of 0..3 inner bags of 0..4 rows), truncated both
    // ways, padding and gradients in both directions.
    let outer = Tensor::from_vec(vec![0i64, 2, 2, 5], &[4]).unwrap();
    let inner = Tensor::from_vec(vec![0i64, 3, 4, 4, 8, 9], &[6]).unwrap();
    let values = randn(&[9, 2], 76);
    let vc = values.with_requires_grad(true);
    let vg = values.to_device(dev).unwrap().with_requires_grad(true);
    let pc = jagged_to_padded_dense(&vc, &[&outer, &inner], &[2, 3], 0.5).unwrap();
    let pg = jagged_to_padded_dense(&vg, &[&outer, &inner], &[2, 3], 0.5).unwrap();
    assert_eq!(pg.shape(), &[3, 2, 3, 2]);
    assert_close("2-D jagged_to_padded_dense", &pg, &pc, 0.0);
    let w = randn(pc.shape(), 77);
    set_grad(&pc, &w);
    set_grad(&pg, &w.to_device(dev).unwrap());
    assert_close(
        "2-D jagged_to_padded_dense grad",
        &vg.grad().unwrap(),
        &vc.grad().unwrap(),
        0.0,
    );
    let dense = randn(&[3, 2, 3, 2], 78);
    let dc = dense.with_requires_grad(true);
    let dg = dense.to_device(dev).unwrap().with_requires_grad(true);
    let jc = dense_to_jagged(&dc, &[&outer, &inner], None).unwrap();
    let jg = dense_to_jagged(&dg, &[&outer, &inner], None).unwrap();
    assert_close("2-D dense_to_jagged", &jg, &jc, 0.0);
    let w = randn(jc.shape(), 79);
    set_grad(&jc, &w);
    set_grad(&jg, &w.to_device(dev).unwrap());
    assert_close(
        "2-D dense_to_jagged grad",
        &dg.grad().unwrap(),
        &dc.grad().unwrap(),
        0.0,
    );

    // index_select_dim0 with repeated rows; the row-sparse gradient densified on the device
    // sums the repeats (and an SGD step applies it).
    let table = randn(&[6, 4], 74);
    let idx = Tensor::from_vec(vec![5i64, 0, 5, 2, 5], &[5]).unwrap();
    let tc = table.with_requires_grad(true);
    let tg = table.to_device(dev).unwrap().with_requires_grad(true);
    let sc = index_select_dim0(&tc, &idx).unwrap();
    let sg = index_select_dim0(&tg, &idx).unwrap();
    assert_close("index_select_dim0", &sg, &sc, 0.0);
    let w = randn(sc.shape(), 75);
    set_grad(&sc, &w);
    set_grad(&sg, &w.to_device(dev).unwrap());
    let (gc, gg) = (tc.gradient().unwrap(), tg.gradient().unwrap());
    assert_close(
        "index_select_dim0 grad",
        &gg.to_dense().unwrap(),
        &gc.to_dense().unwrap(),
        1e-6,
    );
    let (mut oc, mut og) = (
        Sgd::new(vec![tc.clone()], 0.5).unwrap(),
        Sgd::new(vec![tg.clone()], 0.5).unwrap(),
    );
    oc.step().unwrap();
    og.step().unwrap();
    assert_close("sgd on a row-sparse gradient", &tg, &tc, 1e-6);
    let ints = Tensor::from_vec((0..12i64).collect(), &[6, 2]).unwrap();
    let got = index_select_dim0(&ints.to_device(dev).unwrap(), &idx).unwrap();
    assert_eq!(
        got.to_vec::<i64>().unwrap(),
        index_select_dim0(&ints, &idx)
            .unwrap()
            .to_vec::<i64>()
            .unwrap()
    );

    // permute_2D_sparse_data: features reordered, one dropped, one repeated; values, weights
    // and lengths on the device.
    let lengths = Tensor::from_vec(vec![1i32, 2, 0, 3, 1, 1], &[3, 2]).unwrap();
    let vals = Tensor::from_vec((0..8i64).collect(), &[8]).unwrap();
    let wts = randn(&[8], 76);
    let perm = Tensor::from_vec(vec![2i32, 0, 2], &[3]).unwrap();
    let c = permute_2d_sparse_data(&perm, &lengths, &vals, Some(&wts), None).unwrap();
    let g = permute_2d_sparse_data(
        &perm,
        &lengths.to_device(dev).unwrap(),
        &vals.to_device(dev).unwrap(),
        Some(&wts.to_device(dev).unwrap()),
        None,
    )
    .unwrap();
    assert_eq!(g.values.device(), dev);
    assert_eq!(
        g.values.to_vec::<i64>().unwrap(),
        c.values.to_vec::<i64>().unwrap()
    );
    assert_eq!(
        g.lengths.to_vec::<i32>().unwrap(),
        c.lengths.to_vec::<i32>().unwrap()
    );
    assert_close(
        "permuted weights",
        g.weights.as_ref().unwrap(),
        c.weights.as_ref().unwrap(),
        0.0,
    );
}

#[test]
fn device_names_parse_and_bad_ones_are_named() {
    assert_eq!("cpu".parse::<Device>().unwrap(), Device::Cpu);
    assert_eq!("cuda".parse::<Device>().unwrap(), Device::Cuda(0));
    assert_eq!("cuda:3".parse::<Device>().unwrap(), Device::Cuda(3));
    for bad in ["gpu", "cuda:", "cuda:x", "cuda:-1"] {
        let err = bad.parse::<Device>().unwrap_err().to_string();
        assert!(err.contains(&format!("`{bad}`")), "{err}");
    }
}

/// The bucketize options of test case `case` (0..4): each case turns a different set on.
fn options<'a>(
    case: usize,
    w: &'a Tensor,
    bounds: &'a [Tensor],
    total_blocks: &'a Tensor,
) -> embers::sparse::ops::BlockBucketizeOptions<'a> {
    embers::sparse::ops::BlockBucketizeOptions {
        bucketize_pos: case != 2,
        sequence: case != 1,
        weights: (case != 3).then_some(w),
        block_bucketize_pos: (case == 1).then_some(bounds),
        keep_orig_idx: case == 2,
        total_num_blocks: (case == 3).then_some(total_blocks),
        ..Default::default()
    }
}

#[test]
fn block_bucketize_on_the_device_matches_the_cpu() {
    use embers::sparse::ops::{block_bucketize_sparse_features, BlockBucketizeOptions};
    use rand::Rng;
    let Some(dev) = device() else { return };
    let mut rng = seeded(90);
    // 3 features × 7 samples, ids past each feature's block range too (they go cyclically).
    let (t, b, my_size) = (3usize, 7usize, 4usize);
    let lens: Vec<i64> = (0..t * b).map(|_| rng.random_range(0..5)).collect();
    let n = lens.iter().sum::<i64>() as usize;
    let ids: Vec<i64> = (0..n).map(|_| rng.random_range(0..60)).collect();
    let weights = randn(&[n], 91);
    let block_sizes = Tensor::from_vec(vec![5i64, 3, 12], &[t]).unwrap();
    let bounds: Vec<Tensor> = [[0i64, 4, 4, 20, 31], [0, 1, 2, 3, 4], [0, 10, 20, 30, 40]]
        .iter()
        .map(|p| Tensor::from_vec(p.to_vec(), &[5]).unwrap())
        .collect();
    let total_blocks = Tensor::from_vec(vec![8i64, 4, 12], &[t]).unwrap();
    for (case, i32_ids) in [(0, false), (1, true), (2, false), (3, true)] {
        let lengths = Tensor::from_vec(lens.clone(), &[t * b]).unwrap();
        let indices = if i32_ids {
            let v: Vec<i32> = ids.iter().map(|&x| x as i32).collect();
            Tensor::from_vec(v, &[n]).unwrap()
        } else {
            Tensor::from_vec(ids.clone(), &[n]).unwrap()
        };
        let (w_cpu, w_dev) = (weights.clone(), weights.to_device(dev).unwrap());
        let cpu = block_bucketize_sparse_features(
            &lengths,
            &indices,
            &block_sizes,
            my_size,
            &options(case, &w_cpu, &bounds, &total_blocks),
        )
        .unwrap();
        let gpu = block_bucketize_sparse_features(
            &lengths,
            &indices.to_device(dev).unwrap(),
            &block_sizes,
            my_size,
            &options(case, &w_dev, &bounds, &total_blocks),
        )
        .unwrap();
        let what = format!("case {case}");
        assert_eq!(gpu.indices.device(), dev, "{what}");
        assert_eq!(gpu.lengths.dtype(), cpu.lengths.dtype(), "{what}");
        assert_eq!(gpu.indices.dtype(), cpu.indices.dtype(), "{what}");
        let ints = |t: &Tensor| t.to_vec_f64().unwrap();
        assert_eq!(ints(&gpu.lengths), ints(&cpu.lengths), "{what} lengths");
        assert_eq!(ints(&gpu.indices), ints(&cpu.indices), "{what} indices");
        for (name, g, c) in [
            ("positions", &gpu.positions, &cpu.positions),
            (
                "unbucketize_permute",
                &gpu.unbucketize_permute,
                &cpu.unbucketize_permute,
            ),
            ("weights", &gpu.weights, &cpu.weights),
        ] {
            assert_eq!(g.is_some(), c.is_some(), "{what} {name}");
            if let (Some(g), Some(c)) = (g, c) {
                assert_eq!(ints(g), ints(c), "{what} {name}");
            }
        }
    }
    // A negative id is an error naming the feature, sample and position, as on the CPU.
    let mut bad = ids.clone();
    let at = n - 1;
    bad[at] = -3;
    let lengths = Tensor::from_vec(lens.clone(), &[t * b]).unwrap();
    let run = |indices: Tensor| {
        block_bucketize_sparse_features(
            &lengths,
            &indices,
            &block_sizes,
            my_size,
            &BlockBucketizeOptions::default(),
        )
        .unwrap_err()
        .to_string()
    };
    let host = Tensor::from_vec(bad, &[n]).unwrap();
    let (e_gpu, e_cpu) = (run(host.to_device(dev).unwrap()), run(host));
    assert_eq!(e_gpu, e_cpu);
    assert!(e_gpu.contains("id -3 is negative"), "{e_gpu}");
}
