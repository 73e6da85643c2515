//! Tensor-core semantics: views, autograd behaviour, losses against hand-computed values,
//! optimizers against naive f64 references, dtypes, and errors on bad input.

use std::collections::BTreeMap;

use embers::nn::{Forward, Linear, Module};
use embers::optim::{Adagrad, Adam, AdamConfig, Optimizer, Sgd};
use embers::tensor::rng::seeded;
use embers::tensor::Reduction;
use embers::{no_grad, DType, Device, Error, Gradient, Tensor};
use proptest::prelude::*;

fn t(data: &[f64], shape: &[usize]) -> Tensor {
    Tensor::from_slice(data, shape).unwrap()
}

fn close(a: &[f64], b: &[f64], tol: f64) {
    assert_eq!(a.len(), b.len(), "lengths differ: {a:?} vs {b:?}");
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert!(
            (x - y).abs() <= tol * (1.0 + y.abs()),
            "element {i}: {x} vs {y} (all: {a:?} vs {b:?})"
        );
    }
}

#[test]
fn views_share_storage_and_read_strided() {
    let x = t(&[0., 1., 2., 3., 4., 5.], &[2, 3]);
    let xt = x.t().unwrap();
    assert!(xt.shares_storage_with(&x));
    assert!(!xt.is_contiguous());
    assert_eq!(xt.shape(), &[3, 2]);
    assert_eq!(xt.to_vec::<f64>().unwrap(), vec![0., 3., 1., 4., 2., 5.]);
    let n = x.narrow(1, 1, 2).unwrap();
    assert!(n.shares_storage_with(&x));
    assert_eq!(n.to_vec::<f64>().unwrap(), vec![1., 2., 4., 5.]);
    let e = t(&[7., 8.], &[2, 1]).expand(&[2, 3]).unwrap();
    assert_eq!(e.to_vec::<f64>().unwrap(), vec![7., 7., 7., 8., 8., 8.]);
    let r = x.reshape(&[3, 2]).unwrap();
    assert!(
        r.shares_storage_with(&x),
        "reshape of a contiguous tensor is a view"
    );
    let p = x.reshape(&[1, 2, 3]).unwrap().permute(&[2, 0, 1]).unwrap();
    assert_eq!(p.shape(), &[3, 1, 2]);
    assert_eq!(p.to_vec::<f64>().unwrap(), vec![0., 3., 1., 4., 2., 5.]);
    // An op on a view reads the right elements.
    let s = xt.add(&t(&[10., 20.], &[2])).unwrap();
    assert_eq!(
        s.to_vec::<f64>().unwrap(),
        vec![10., 23., 11., 24., 12., 25.]
    );
}

#[test]
fn losses_match_hand_computed_values() {
    let ln2 = std::f64::consts::LN_2;
    // BCE with logits: x=0,y=1 → ln 2; x=2,y=0 → 2 + ln(1+e^-2); x=-1,y=1 → ln(1+e).
    let x = t(&[0., 2., -1.], &[3]);
    let y = t(&[1., 0., 1.], &[3]);
    let per = x
        .bce_with_logits(&y, None, Reduction::None)
        .unwrap()
        .to_vec::<f64>()
        .unwrap();
    let expected = [
        ln2,
        2.0 + (1.0 + (-2f64).exp()).ln(),
        (1.0 + 1f64.exp()).ln(),
    ];
    close(&per, &expected, 1e-12);
    let mean = x
        .bce_with_logits(&y, None, Reduction::Mean)
        .unwrap()
        .item()
        .unwrap();
    close(&[mean], &[expected.iter().sum::<f64>() / 3.0], 1e-12);
    // Large logits stay finite.
    let big = t(&[1000., -1000.], &[2])
        .bce_with_logits(&t(&[0., 1.], &[2]), None, Reduction::Sum)
        .unwrap();
    close(&[big.item().unwrap()], &[2000.0], 1e-12);
    // Weighted sum.
    let w = t(&[2., 0., 1.], &[3]);
    let ws = x
        .bce_with_logits(&y, Some(&w), Reduction::Sum)
        .unwrap()
        .item()
        .unwrap();
    close(&[ws], &[2.0 * expected[0] + expected[2]], 1e-12);
    // MSE: [1,2,3] vs [1,0,5] → (0+4+4)/3.
    let m = t(&[1., 2., 3.], &[3])
        .mse_loss(&t(&[1., 0., 5.], &[3]), Reduction::Mean)
        .unwrap();
    close(&[m.item().unwrap()], &[8.0 / 3.0], 1e-12);
    // Cross-entropy: uniform logits over 2 classes → ln 2; [1,2,3] with target 2 →
    // ln(1 + e^-1 + e^-2).
    let logits = t(&[0., 0., 0., 1., 2., 3.], &[2, 3]);
    let target = Tensor::from_vec(vec![0i64, 2], &[2]).unwrap();
    let per = logits
        .cross_entropy(&target, Reduction::None)
        .unwrap()
        .to_vec::<f64>()
        .unwrap();
    close(
        &per,
        &[3f64.ln(), (1.0 + (-1f64).exp() + (-2f64).exp()).ln()],
        1e-12,
    );
}

#[test]
fn loss_gradients_match_hand_values() {
    // d/dx mean BCE = (σ(x) − y)/n.
    let x = t(&[0., 2.], &[2]).with_requires_grad(true);
    x.bce_with_logits(&t(&[1., 0.], &[2]), None, Reduction::Mean)
        .unwrap()
        .backward()
        .unwrap();
    let s2 = 1.0 / (1.0 + (-2f64).exp());
    close(
        &x.grad().unwrap().to_vec::<f64>().unwrap(),
        &[(0.5 - 1.0) / 2.0, s2 / 2.0],
        1e-12,
    );
    // d/dx mean MSE = 2(x−y)/n.
    let x = t(&[1., 2., 3.], &[3]).with_requires_grad(true);
    x.mse_loss(&t(&[1., 0., 5.], &[3]), Reduction::Mean)
        .unwrap()
        .backward()
        .unwrap();
    close(
        &x.grad().unwrap().to_vec::<f64>().unwrap(),
        &[0.0, 4.0 / 3.0, -4.0 / 3.0],
        1e-12,
    );
    // Cross-entropy gradient = softmax − onehot.
    let x = t(&[0., 0.], &[1, 2]).with_requires_grad(true);
    x.cross_entropy(
        &Tensor::from_vec(vec![1i64], &[1]).unwrap(),
        Reduction::Mean,
    )
    .unwrap()
    .backward()
    .unwrap();
    close(
        &x.grad().unwrap().to_vec::<f64>().unwrap(),
        &[0.5, -0.5],
        1e-12,
    );
}

#[test]
fn backward_twice_is_a_clear_error_unless_retained() {
    let x = t(&[1., 2.], &[2]).with_requires_grad(true);
    let loss = x.exp().unwrap().sum_all().unwrap();
    loss.backward().unwrap();
    let err = loss.backward().unwrap_err();
    assert!(matches!(err, Error::BackwardTwice { .. }), "{err}");
    assert!(err.to_string().contains("second time"), "{err}");

    let y = t(&[1., 2.], &[2]).with_requires_grad(true);
    let loss = y.mul(&y).unwrap().sum_all().unwrap();
    let one = Tensor::scalar(1.0f64);
    loss.backward_with(&one, true).unwrap();
    loss.backward_with(&one, true).unwrap();
    // Two backward passes accumulate: 2 · 2y.
    assert_eq!(y.grad().unwrap().to_vec::<f64>().unwrap(), vec![4., 8.]);
}

#[test]
fn accumulation_no_grad_and_detach() {
    let w = t(&[3.], &[1]).with_requires_grad(true);
    w.mul_scalar(2.0)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    w.mul_scalar(5.0)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    assert_eq!(w.grad().unwrap().to_vec::<f64>().unwrap(), vec![7.]);
    w.zero_grad();
    assert!(w.grad().is_none());

    let y = no_grad(|| w.exp().unwrap());
    assert!(!y.requires_grad() && y.grad_fn().is_none());
    let d = w.exp().unwrap().detach();
    assert!(!d.requires_grad());
    // A tensor with no grad path cannot be differentiated.
    assert!(matches!(
        d.sum_all().unwrap().backward(),
        Err(Error::Backward(_))
    ));
    // backward() needs a single element.
    assert!(w.expand(&[3]).unwrap().backward().is_err());
}

#[test]
fn custom_ops_plug_into_autograd() {
    use embers::tensor::{record_op, BackwardOp};
    // y = 3x, defined outside the crate.
    struct Triple;
    impl BackwardOp for Triple {
        fn name(&self) -> &'static str {
            "triple"
        }
        fn backward(&self, g: &Tensor) -> embers::Result<Vec<Option<Gradient>>> {
            Ok(vec![Some(Gradient::Dense(g.mul_scalar(3.0)?))])
        }
    }
    let x = t(&[1., 2.], &[2]).with_requires_grad(true);
    let y = record_op(no_grad(|| x.mul_scalar(3.0)).unwrap(), &[&x], Triple);
    assert_eq!(y.grad_fn().unwrap().name(), "triple");
    y.square().unwrap().sum_all().unwrap().backward().unwrap();
    // d/dx (3x)² = 18x
    assert_eq!(x.grad().unwrap().to_vec::<f64>().unwrap(), vec![18., 36.]);

    // A buggy custom op returning a wrongly shaped gradient is reported, not silently used.
    struct Bad;
    impl BackwardOp for Bad {
        fn name(&self) -> &'static str {
            "bad"
        }
        fn backward(&self, _g: &Tensor) -> embers::Result<Vec<Option<Gradient>>> {
            Ok(vec![Some(Gradient::Dense(Tensor::zeros(
                &[5],
                DType::F64,
                Device::Cpu,
            )))])
        }
    }
    let x = t(&[1., 2.], &[2]).with_requires_grad(true);
    let y = record_op(x.detach(), &[&x], Bad);
    let err = y.sum_all().unwrap().backward().unwrap_err().to_string();
    assert!(err.contains("bad") && err.contains("[5]"), "{err}");

    // So is a row-sparse gradient naming a row the input does not have, or a row count that
    // does not match its values.
    struct BadRows(Vec<i64>);
    impl BackwardOp for BadRows {
        fn name(&self) -> &'static str {
            "bad rows"
        }
        fn backward(&self, _g: &Tensor) -> embers::Result<Vec<Option<Gradient>>> {
            Ok(vec![Some(Gradient::RowSparse(
                embers::tensor::RowSparseGrad {
                    rows: self.0.clone(),
                    values: Tensor::zeros(&[2, 3], DType::F64, Device::Cpu),
                    num_rows: 4,
                },
            ))])
        }
    }
    for (rows, expected) in [
        (vec![1, 4], "naming row 4 of an input of 4 rows"),
        (vec![-1, 0], "naming row -1"),
        (vec![0], "1 row numbers for 2 rows"),
    ] {
        let x = Tensor::zeros(&[4, 3], DType::F64, Device::Cpu).with_requires_grad(true);
        let y = record_op(x.detach(), &[&x], BadRows(rows));
        let err = y.sum_all().unwrap().backward().unwrap_err().to_string();
        assert!(err.contains("bad rows") && err.contains(expected), "{err}");
    }
}

#[test]
fn index_select_gives_row_sparse_gradients() {
    let table = Tensor::rand_uniform(&[1000, 4], -1.0, 1.0, DType::F32, &mut seeded(1))
        .with_requires_grad(true);
    let ids = Tensor::from_vec(vec![7i64, 3, 7], &[3]).unwrap();
    table
        .index_select(&ids)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    let Gradient::RowSparse(g) = table.gradient().unwrap() else {
        panic!("expected a row-sparse gradient")
    };
    assert_eq!(g.values.shape(), &[3, 4], "no table-sized buffer");
    let c = g.coalesce().unwrap();
    assert_eq!(c.rows, vec![3, 7]);
    assert_eq!(
        c.values.to_vec::<f32>().unwrap(),
        vec![1., 1., 1., 1., 2., 2., 2., 2.]
    );
    let dense = table.grad().unwrap().to_vec::<f32>().unwrap();
    assert_eq!(dense.iter().sum::<f32>(), 12.0);
    assert_eq!(&dense[28..32], &[2.0; 4]);
}

/// Naive f64 references of the optimizer update rules (PyTorch's definitions).
fn reference_run(kind: &str, w0: &[f64], grads: &[Vec<f64>]) -> Vec<f64> {
    let n = w0.len();
    let mut w = w0.to_vec();
    let (mut m, mut v, mut s) = (vec![0.0; n], vec![0.0; n], vec![0.1; n]);
    for (step, g) in grads.iter().enumerate() {
        let t = (step + 1) as i32;
        for j in 0..n {
            match kind {
                "sgd_momentum" => {
                    let d = g[j] + 0.01 * w[j];
                    m[j] = if step == 0 { d } else { 0.9 * m[j] + d };
                    w[j] -= 0.1 * m[j];
                }
                "adagrad" => {
                    s[j] += g[j] * g[j];
                    w[j] -= 0.5 * g[j] / (s[j].sqrt() + 1e-10);
                }
                "adamw" => {
                    w[j] *= 1.0 - 0.01 * 0.1;
                    m[j] = 0.9 * m[j] + 0.1 * g[j];
                    v[j] = 0.999 * v[j] + 0.001 * g[j] * g[j];
                    let mh = m[j] / (1.0 - 0.9f64.powi(t));
                    let vh = v[j] / (1.0 - 0.999f64.powi(t));
                    w[j] -= 0.01 * mh / (vh.sqrt() + 1e-8);
                }
                _ => unreachable!(),
            }
        }
    }
    w
}

#[test]
fn optimizers_match_reference_updates() {
    let w0 = [0.5, -1.0, 2.0, 0.25];
    let grads = vec![
        vec![0.1, -0.2, 0.3, 0.0],
        vec![-0.4, 0.5, 0.05, 1.0],
        vec![0.2, 0.2, -0.3, -0.1],
    ];
    for kind in ["sgd_momentum", "adagrad", "adamw"] {
        let p = t(&w0, &[2, 2]).with_requires_grad(true);
        let mut opt: Box<dyn Optimizer> = match kind {
            "sgd_momentum" => Box::new(
                Sgd::new(vec![p.clone()], 0.1)
                    .unwrap()
                    .momentum(0.9)
                    .weight_decay(0.01),
            ),
            "adagrad" => Box::new(Adagrad::new(vec![p.clone()], 0.5, 0.1).unwrap()),
            _ => Box::new(
                Adam::new(
                    vec![p.clone()],
                    AdamConfig {
                        weight_decay: 0.1,
                        ..AdamConfig::adamw(0.01)
                    },
                )
                .unwrap(),
            ),
        };
        for g in &grads {
            opt.zero_grad();
            // loss = Σ w ⊙ g has gradient g.
            p.mul(&t(g, &[2, 2]))
                .unwrap()
                .sum_all()
                .unwrap()
                .backward()
                .unwrap();
            opt.step().unwrap();
        }
        close(
            &p.to_vec::<f64>().unwrap(),
            &reference_run(kind, &w0, &grads),
            1e-12,
        );
    }
}

#[test]
fn sparse_gradients_update_only_touched_rows() {
    let table = Tensor::from_vec(vec![1.0f64; 10 * 2], &[10, 2])
        .unwrap()
        .with_requires_grad(true);
    let mut opt = Adagrad::new(vec![table.clone()], 1.0, 0.0).unwrap();
    let ids = Tensor::from_vec(vec![2i64, 2, 5], &[3]).unwrap();
    table
        .index_select(&ids)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    opt.step().unwrap();
    let w = table.to_vec::<f64>().unwrap();
    let state = opt.state()[0].to_vec::<f64>().unwrap();
    for r in 0..10 {
        let touched = r == 2 || r == 5;
        let g: f64 = if r == 2 { 2.0 } else { 1.0 };
        let expected = if touched {
            1.0 - g / ((g * g).sqrt() + 1e-10)
        } else {
            1.0
        };
        close(&w[2 * r..2 * r + 2], &[expected, expected], 1e-12);
        close(
            &state[2 * r..2 * r + 2],
            &[if touched { g * g } else { 0.0 }; 2],
            1e-12,
        );
    }
}

#[test]
fn half_precision_storage_computes_in_f32() {
    let mut rng = seeded(3);
    let a = Tensor::randn(&[8, 16], 0.0, 1.0, DType::F32, &mut rng);
    let b = Tensor::randn(&[16, 4], 0.0, 1.0, DType::F32, &mut rng);
    for dtype in [DType::BF16, DType::F16] {
        let (ah, bh) = (a.to_dtype(dtype).unwrap(), b.to_dtype(dtype).unwrap());
        let out = ah.matmul(&bh).unwrap();
        assert_eq!(out.dtype(), dtype);
        // Reference: the same rounded inputs multiplied in f32, then rounded once.
        let reference = ah
            .to_dtype(DType::F32)
            .unwrap()
            .matmul(&bh.to_dtype(DType::F32).unwrap())
            .unwrap()
            .to_dtype(dtype)
            .unwrap();
        assert_eq!(out.to_vec_f64().unwrap(), reference.to_vec_f64().unwrap());
        // Gradients flow back through the casts in the source dtype.
        let w = a.with_requires_grad(true);
        w.to_dtype(dtype)
            .unwrap()
            .to_dtype(DType::F32)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        assert_eq!(w.grad().unwrap().dtype(), DType::F32);
        assert!(w
            .grad()
            .unwrap()
            .to_vec::<f32>()
            .unwrap()
            .iter()
            .all(|&g| g == 1.0));
    }
    // bf16 rounding is round-to-nearest-even of the f32 value.
    let x = Tensor::from_vec(vec![1.0f32 + 1.0 / 256.0, 1.0 + 3.0 / 256.0], &[2]).unwrap();
    assert_eq!(
        x.to_dtype(DType::BF16).unwrap().to_vec_f64().unwrap(),
        vec![1.0, 1.015625]
    );
}

#[test]
fn errors_name_the_op_and_shapes() {
    let a = Tensor::zeros(&[2, 3], DType::F32, Device::Cpu);
    let b = Tensor::zeros(&[4], DType::F32, Device::Cpu);
    let e = a.add(&b).unwrap_err().to_string();
    assert!(
        e.contains("add") && e.contains("[2, 3]") && e.contains("[4]"),
        "{e}"
    );
    let e = a
        .matmul(&Tensor::zeros(&[4, 2], DType::F32, Device::Cpu))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("matmul") && e.contains("inner dimensions differ: 3 vs 4"),
        "{e}"
    );
    let e = a
        .add(&Tensor::zeros(&[2, 3], DType::F64, Device::Cpu))
        .unwrap_err();
    assert!(matches!(e, Error::DTypeMismatch { op: "add", .. }), "{e}");
    let e = a.reshape(&[5]).unwrap_err().to_string();
    assert!(e.contains("reshape") && e.contains("6 elements"), "{e}");
    assert!(matches!(
        a.narrow(1, 2, 2),
        Err(Error::Invalid { op: "narrow", .. })
    ));
    assert!(matches!(
        a.sum(&[2], false),
        Err(Error::DimOutOfRange {
            op: "sum",
            dim: 2,
            rank: 2
        })
    ));
    assert!(Tensor::from_vec(vec![1.0f32; 5], &[2, 3]).is_err());
    let ids = Tensor::from_vec(vec![0i64, 1, 2], &[3]).unwrap();
    match a.index_select(&ids) {
        Err(Error::IndexOutOfRange {
            op: "index_select",
            index: 2,
            position: 2,
            size: 2,
        }) => {}
        other => panic!("unexpected {other:?}"),
    }
    let neg = Tensor::from_vec(vec![-1i64], &[1]).unwrap();
    assert!(matches!(
        a.index_select(&neg),
        Err(Error::IndexOutOfRange {
            index: -1,
            position: 0,
            ..
        })
    ));
    assert!(Tensor::cat(&[&a, &b], 0).is_err());
    assert!(a.relu().is_ok() && Tensor::zeros(&[2], DType::I64, Device::Cpu).relu().is_err());
    let e = Tensor::from_vec(vec![1i64, 2], &[2])
        .unwrap()
        .div(&Tensor::from_vec(vec![1i64, 0], &[2]).unwrap())
        .unwrap_err()
        .to_string();
    assert!(e.contains("division by zero at position 1"), "{e}");
    assert!(a
        .cross_entropy(
            &Tensor::from_vec(vec![0i64, 3], &[2]).unwrap(),
            Reduction::Mean
        )
        .is_err());
    // No machine has this many GPUs (nor emulates them): a named error, not a panic.
    let e = Device::cuda(1 << 20).unwrap_err().to_string();
    assert!(e.contains("is unavailable") && e.contains("1048576"), "{e}");
}

#[test]
fn state_dict_round_trip_and_errors() {
    let mut rng = seeded(4);
    let a = Linear::new(3, 2, &mut rng).unwrap();
    let b = Linear::new(3, 2, &mut rng).unwrap();
    assert_ne!(
        a.weight.to_vec::<f32>().unwrap(),
        b.weight.to_vec::<f32>().unwrap()
    );
    let snapshot: BTreeMap<String, Tensor> = a
        .state_dict()
        .into_iter()
        .map(|(k, v)| (k, v.detach()))
        .collect();
    b.load_state_dict(&snapshot).unwrap();
    assert_eq!(
        a.weight.to_vec::<f32>().unwrap(),
        b.weight.to_vec::<f32>().unwrap()
    );
    assert_eq!(a.num_parameters(), 8);
    let mut missing = snapshot.clone();
    missing.remove("bias");
    assert!(b
        .load_state_dict(&missing)
        .unwrap_err()
        .to_string()
        .contains("missing parameter `bias`"));
    let mut extra = snapshot.clone();
    extra.insert("foo".into(), Tensor::zeros(&[1], DType::F32, Device::Cpu));
    assert!(b
        .load_state_dict(&extra)
        .unwrap_err()
        .to_string()
        .contains("unexpected parameter `foo`"));
    let mut wrong = snapshot;
    wrong.insert("bias".into(), Tensor::zeros(&[3], DType::F32, Device::Cpu));
    assert!(b.load_state_dict(&wrong).is_err());
}

fn naive_broadcast_add(
    a: &[f64],
    sa: &[usize],
    b: &[f64],
    sb: &[usize],
    out: &[usize],
) -> Vec<f64> {
    let n: usize = out.iter().product();
    let idx = |flat: usize, shape: &[usize]| -> usize {
        // Map an output multi-index onto a broadcast operand.
        let mut rem = flat;
        let mut coords = vec![0; out.len()];
        for d in (0..out.len()).rev() {
            coords[d] = rem % out[d];
            rem /= out[d];
        }
        let lead = out.len() - shape.len();
        let mut off = 0;
        for (d, &s) in shape.iter().enumerate() {
            off = off * s + if s == 1 { 0 } else { coords[d + lead] };
        }
        off
    };
    (0..n).map(|i| a[idx(i, sa)] + b[idx(i, sb)]).collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn broadcast_add_matches_naive(dims in proptest::collection::vec(1usize..5, 1..4), mask_a in 0u8..8, mask_b in 0u8..8, drop in 0usize..2) {
        let sa: Vec<usize> = dims.iter().enumerate().map(|(i, &d)| if mask_a >> i & 1 == 1 { 1 } else { d }).collect();
        let sb: Vec<usize> = dims.iter().enumerate().map(|(i, &d)| if mask_b >> i & 1 == 1 { 1 } else { d }).skip(drop.min(dims.len() - 1)).collect();
        let mut rng = seeded(9);
        let a = Tensor::randn(&sa, 0.0, 1.0, DType::F64, &mut rng);
        let b = Tensor::randn(&sb, 0.0, 1.0, DType::F64, &mut rng);
        let out = a.add(&b).unwrap();
        let expected = naive_broadcast_add(&a.to_vec().unwrap(), &sa, &b.to_vec().unwrap(), &sb, out.shape());
        prop_assert_eq!(out.to_vec::<f64>().unwrap(), expected);
    }

    #[test]
    fn matmul_matches_naive(m in 1usize..40, k in 1usize..40, n in 1usize..40, transpose_b in any::<bool>()) {
        let mut rng = seeded((m * 1600 + k * 40 + n) as u64);
        let a = Tensor::randn(&[m, k], 0.0, 1.0, DType::F64, &mut rng);
        let b = if transpose_b {
            Tensor::randn(&[n, k], 0.0, 1.0, DType::F64, &mut rng).t().unwrap()
        } else {
            Tensor::randn(&[k, n], 0.0, 1.0, DType::F64, &mut rng)
        };
        let (av, bv) = (a.to_vec::<f64>().unwrap(), b.to_vec::<f64>().unwrap());
        let mut expected = vec![0.0; m * n];
        for i in 0..m { for j in 0..n { for p in 0..k { expected[i * n + j] += av[i * k + p] * bv[p * n + j]; } } }
        close(&a.matmul(&b).unwrap().to_vec::<f64>().unwrap(), &expected, 1e-12);
    }
}

#[test]
fn optimizer_hyper_parameters_are_checked() {
    let p = || vec![Tensor::zeros(&[2], DType::F32, Device::Cpu).with_requires_grad(true)];
    let msg = |e: embers::Result<()>| e.unwrap_err().to_string();
    assert!(msg(Sgd::new(p(), f64::NAN).map(|_| ())).contains("lr is NaN"));
    assert!(msg(Adagrad::new(p(), -0.1, 0.0).map(|_| ())).contains("lr is -0.1"));
    assert!(msg(Adagrad::new(p(), 0.1, f64::INFINITY).map(|_| ())).contains("initial_accumulator"));
    let bad_betas = AdamConfig {
        betas: (0.9, 1.0),
        ..Default::default()
    };
    assert!(msg(Adam::new(p(), bad_betas).map(|_| ())).contains("betas"));
    assert!(Adam::new(p(), AdamConfig::default()).is_ok());
}

#[test]
fn f64_to_half_precision_rounds_once() {
    // 1 + 2^-11 + 2^-40 lies just above the midpoint of the f16 neighbours 1 and 1 + 2^-10:
    // rounding it to f32 first lands on the midpoint exactly, which would then tie to 1.
    let p = |e: i32| 2f64.powi(e);
    for (dtype, half_ulp) in [(DType::F16, -11), (DType::BF16, -8)] {
        let above = 1.0 + p(half_ulp) + p(-40);
        let t = Tensor::from_vec(vec![above, -above, 1.0 + p(half_ulp)], &[3]).unwrap();
        let up = 1.0 + p(half_ulp + 1);
        assert_eq!(
            t.to_dtype(dtype).unwrap().to_vec_f64().unwrap(),
            vec![up, -up, 1.0],
            "{dtype:?}"
        );
        assert_eq!(
            Tensor::full(above, &[1], dtype, Device::Cpu)
                .to_vec_f64()
                .unwrap(),
            vec![up],
            "{dtype:?} full"
        );
    }
}

/// Inside `row_invariant`, a row's linear output is bit-identical alone, inside any batch and
/// at any position, and equals an f64 reference to float rounding; the shapes cover gemm's
/// dot-product, matrix-vector and packed paths (n = 1, m·n ≤ 256, depth above 512), the kernel's
/// 4-row and 2-output blocks and their tails, and a depth that is not a multiple of 8.
#[test]
fn row_invariant_linear_rows_do_not_depend_on_the_batch() {
    use embers::tensor::{is_row_invariant, row_invariant};
    let mut rng = seeded(11);
    for &(n, k) in &[
        (1usize, 256usize),
        (64, 256),
        (256, 512),
        (7, 13),
        (3, 1100),
        (512, 415),
    ] {
        for dtype in [DType::F32, DType::F64] {
            let w = Tensor::randn(&[n, k], 0.0, 1.0, dtype, &mut rng);
            let b = Tensor::randn(&[n], 0.0, 1.0, dtype, &mut rng);
            let x = Tensor::randn(&[300, k], 0.0, 1.0, dtype, &mut rng);
            let as_f64 = |t: &Tensor| t.to_dtype(DType::F64).unwrap().to_vec::<f64>().unwrap();
            let (wv, bv, xv) = (as_f64(&w), as_f64(&b), as_f64(&x));
            let full = row_invariant(|| {
                assert!(is_row_invariant());
                x.linear(&w, Some(&b)).unwrap()
            });
            assert!(!is_row_invariant(), "the mode ends with its closure");
            let full_v = as_f64(&full);
            // Against an f64 reference (tolerance: float rounding of a k-term sum).
            let eps = if dtype == DType::F32 { 1e-5 } else { 1e-12 };
            for r in 0..300 {
                for j in 0..n {
                    let exact: f64 =
                        bv[j] + (0..k).map(|i| xv[r * k + i] * wv[j * k + i]).sum::<f64>();
                    let scale: f64 = 1.0
                        + (0..k)
                            .map(|i| (xv[r * k + i] * wv[j * k + i]).abs())
                            .sum::<f64>();
                    let got = full_v[r * n + j];
                    assert!(
                        (got - exact).abs() <= eps * scale,
                        "n={n} k={k} row {r} out {j}: {got} vs {exact}"
                    );
                }
            }
            // Any window of rows, at any offset, gives the same bits as the full batch.
            for &(start, rows) in &[
                (0usize, 1usize),
                (5, 1),
                (299, 1),
                (1, 3),
                (6, 4),
                (10, 7),
                (3, 33),
                (17, 256),
            ] {
                let part = x.narrow(0, start, rows).unwrap();
                let got = row_invariant(|| part.linear(&w, Some(&b)).unwrap());
                assert_eq!(
                    as_f64(&got),
                    full_v[start * n..(start + rows) * n].to_vec(),
                    "{dtype:?} n={n} k={k}: rows {start}..{}",
                    start + rows
                );
            }
            // And the default (gemm) path agrees to rounding.
            let plain = as_f64(&x.linear(&w, Some(&b)).unwrap());
            for (i, (p, f)) in plain.iter().zip(&full_v).enumerate() {
                let r = i / n;
                let scale: f64 = 1.0
                    + (0..k)
                        .map(|c| (xv[r * k + c] * wv[(i % n) * k + c]).abs())
                        .sum::<f64>();
                assert!(
                    (p - f).abs() <= 2.0 * eps * scale,
                    "{dtype:?} n={n} k={k} elem {i}: {p} vs {f}"
                );
            }
        }
    }
}

/// `on_worker` runs on a pool thread with the caller's autograd and row-invariance modes, also
/// when pool threads steal each other's jobs while callers with other modes run concurrently.
#[test]
fn on_worker_carries_the_callers_modes() {
    use embers::tensor::{is_grad_enabled, is_row_invariant, no_grad, on_worker, row_invariant};
    let x = Tensor::ones(&[300, 300], DType::F32, Device::Cpu).with_requires_grad(true);
    std::thread::scope(|s| {
        for t in 0..8 {
            let x = &x;
            s.spawn(move || {
                for _ in 0..20 {
                    // A large op inside makes the pool thread wait, and steal.
                    let check = |grad: bool, rows: bool| {
                        on_worker(|| {
                            let y = x.mul(x).unwrap().sum_all().unwrap();
                            assert_eq!(is_grad_enabled(), grad);
                            assert_eq!(is_row_invariant(), rows);
                            assert_eq!(y.requires_grad(), grad);
                        })
                    };
                    match t % 4 {
                        0 => check(true, false),
                        1 => no_grad(|| check(false, false)),
                        2 => row_invariant(|| check(true, true)),
                        _ => no_grad(|| row_invariant(|| check(false, true))),
                    }
                }
            });
        }
    });
}

/// Memory the allocator refuses is an error naming the allocation, not an abort: tensors of
/// 2^62 bytes (addressable, so past the shape checks, but beyond any machine) from
/// `try_full`/`try_zeros` and from an initialiser.
#[test]
fn allocations_the_allocator_refuses_are_errors() {
    use embers::nn::Init;
    let huge = [1usize << 60];
    for value in [0.0, 1.5] {
        let e = Tensor::try_full(value, &huge, DType::F32, Device::Cpu).unwrap_err();
        assert!(
            e.to_string()
                .contains("out of memory allocating 4611686018427387904 bytes"),
            "{value}: {e}"
        );
    }
    let mut rng = seeded(1);
    for init in [Init::KaimingUniform, Init::Normal { std: 1.0 }, Init::Zeros] {
        let e = init
            .tensor(&[1 << 40, 1 << 19], 1 << 19, 1 << 40, DType::F32, &mut rng)
            .unwrap_err();
        assert!(
            e.to_string().contains("out of memory allocating"),
            "{init:?}: {e}"
        );
    }
    // The same calls at a size that fits still make their tensors.
    let ok = Init::KaimingUniform
        .tensor(&[3, 4], 4, 3, DType::F32, &mut rng)
        .unwrap();
    assert_eq!(ok.shape(), &[3, 4]);
}

/// ReLU keeps NaN, as PyTorch's does (a `max` with 0 turned it into 0, so a model whose weights
/// or inputs went NaN predicted ordinary numbers); its gradient there is 0, as PyTorch's.
#[test]
fn relu_keeps_nan_as_pytorch_does() {
    let x = Tensor::from_vec(vec![-1.0f32, 0.0, 2.0, f32::NAN], &[4])
        .unwrap()
        .with_requires_grad(true);
    let y = x.relu().unwrap();
    let got = y.to_vec::<f32>().unwrap();
    assert_eq!(&got[..3], &[0.0, 0.0, 2.0]);
    assert!(got[3].is_nan());
    y.sum_all().unwrap().backward().unwrap();
    let g = x.grad().unwrap().to_vec::<f32>().unwrap();
    assert_eq!(g, vec![0.0, 0.0, 1.0, 0.0]);
}

/// Random constructors refuse what they cannot sample: a NaN or negative standard deviation
/// (NaN filled the tensor), an empty or infinite uniform range (the sampler panicked).
#[test]
fn random_constructors_refuse_bad_parameters() {
    let mut rng = seeded(5);
    for (mean, std) in [(0.0, f64::NAN), (0.0, -1.0), (f64::INFINITY, 1.0)] {
        let e = Tensor::try_randn(&[3], mean, std, DType::F32, &mut rng)
            .unwrap_err()
            .to_string();
        assert!(e.contains("Tensor::randn"), "{e}");
    }
    for (low, high) in [
        (1.0, 1.0),
        (2.0, 1.0),
        (f64::NAN, 1.0),
        (f64::NEG_INFINITY, f64::INFINITY),
    ] {
        let e = Tensor::try_rand_uniform(&[3], low, high, DType::F32, &mut rng)
            .unwrap_err()
            .to_string();
        assert!(e.contains("is empty or not of a finite width"), "{e}");
    }
    let ok = Tensor::try_randn(&[3], 0.0, 0.0, DType::F32, &mut rng).unwrap();
    assert_eq!(ok.to_vec::<f32>().unwrap(), vec![0.0; 3]);
}

/// `reshape_infer` refuses known dimensions whose product overflows (a panic in debug builds)
/// and negative ones, naming the shape.
#[test]
fn reshape_infer_refuses_overflowing_and_negative_shapes() {
    let t = Tensor::zeros(&[6], DType::F32, Device::Cpu);
    for shape in [&[isize::MAX, 2, -1][..], &[-2, -3], &[-1, -1], &[0, -1]] {
        let e = t.reshape_infer(shape).unwrap_err().to_string();
        assert!(e.contains("invalid target shape"), "{shape:?}: {e}");
    }
    assert_eq!(t.reshape_infer(&[2, -1]).unwrap().shape(), &[2, 3]);
}

/// Runs `f` on a thread and fails (rather than hangs) if it has not returned within 20 s.
fn within_20_s<T: Send + 'static>(what: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(std::time::Duration::from_secs(20))
        .unwrap_or_else(|_| panic!("{what} did not return (it waited on its own lock)"))
}

/// Inputs at the edges of the tensor core: copies of a tensor into itself (they waited for
/// ever on its storage's lock), reductions and softmaxes over dimensions of size 0 (chunks of
/// 0 panicked), shapes of no elements whose strides pass a usize, views past what memory or a
/// usize holds, broadcasts and products whose outputs no memory holds, and a layer norm's eps
/// that is not a number.
#[test]
fn edge_inputs_are_answered_or_refused_never_hung_or_panicked() {
    within_20_s("copy_from of itself", || {
        let p = t(&[1.0, 2.0, 3.0, 4.0], &[2, 2]);
        p.copy_from(&p).unwrap();
        p.copy_from(&p.detach()).unwrap();
        // A view of its own storage, transposed: the values are read before any is written.
        p.copy_from(&p.t().unwrap()).unwrap();
        assert_eq!(p.to_vec::<f64>().unwrap(), vec![1.0, 3.0, 2.0, 4.0]);
        let layer = Linear::new(3, 2, &mut seeded(1)).unwrap();
        let state = layer.state_dict();
        layer.load_state_dict(&state).unwrap();
    });
    let empty = Tensor::zeros(&[3, 0], DType::F32, Device::Cpu);
    assert_eq!(empty.sum(&[0], false).unwrap().shape(), &[0]);
    assert_eq!(empty.mean(&[0], true).unwrap().shape(), &[1, 0]);
    let wide = Tensor::zeros(&[2, 0], DType::F64, Device::Cpu);
    assert_eq!(wide.softmax(-1).unwrap().shape(), &[2, 0]);
    assert_eq!(wide.log_softmax(-1).unwrap().shape(), &[2, 0]);
    // Gradients through broadcasts of empty dimensions reduce over them.
    let leaf = Tensor::zeros(&[1, 0], DType::F32, Device::Cpu).with_requires_grad(true);
    let other = Tensor::zeros(&[4, 0], DType::F32, Device::Cpu);
    leaf.add(&other)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    assert_eq!(leaf.grad().unwrap().shape(), &[1, 0]);
    // No elements, strides past a usize: a shape like any other.
    let none = Tensor::from_vec(Vec::<f32>::new(), &[0, usize::MAX, 2]).unwrap();
    assert_eq!(none.numel(), 0);
    assert_eq!(none.sum_all().unwrap().item().unwrap(), 0.0);
    let reshaped = Tensor::zeros(&[0], DType::F32, Device::Cpu)
        .reshape(&[0, usize::MAX, 2])
        .unwrap();
    assert_eq!(reshaped.contiguous().unwrap().numel(), 0);
    // Views whose element count passes a usize, or whose copy passes any memory.
    let one = Tensor::scalar(0f32);
    let m = one.expand(&[1 << 40, 1 << 40]).unwrap_err().to_string();
    assert!(m.contains("more elements than a usize counts"), "{m}");
    let m = one
        .expand(&[1 << 62])
        .unwrap()
        .contiguous()
        .unwrap_err()
        .to_string();
    assert!(m.contains("out of memory"), "{m}");
    // Outputs far larger than their inputs: refused, not aborted.
    let column = Tensor::zeros(&[1 << 20, 1], DType::F32, Device::Cpu);
    let wide = Tensor::scalar(0f32)
        .reshape(&[1, 1])
        .unwrap()
        .expand(&[1, 1 << 40])
        .unwrap();
    for m in [column.add(&wide), column.matmul(&wide)] {
        let m = m.unwrap_err().to_string();
        assert!(m.contains("out of memory"), "{m}");
    }
    // A linear layer of no input features gives its bias (0 rows came out of numel / 0).
    let x = Tensor::zeros(&[3, 0], DType::F32, Device::Cpu);
    let w = Tensor::zeros(&[5, 0], DType::F32, Device::Cpu);
    let b = t(&[1.0, 2.0, 3.0, 4.0, 5.0], &[5])
        .to_dtype(DType::F32)
        .unwrap();
    let y = x.linear(&w, Some(&b)).unwrap();
    assert_eq!(y.shape(), &[3, 5]);
    assert_eq!(&y.to_vec::<f32>().unwrap()[..5], &[1.0, 2.0, 3.0, 4.0, 5.0]);
    // Upper-triangle indices: an offset near i64::MAX leaves none (it wrapped and gave the
    // whole square); a side whose indices no memory holds is refused.
    let (rows, _) = Tensor::triu_indices(3, i64::MAX).unwrap();
    assert_eq!(rows.numel(), 0);
    let (rows, _) = Tensor::triu_indices(3, -5).unwrap();
    assert_eq!(rows.numel(), 9);
    assert!(Tensor::triu_indices(1 << 40, 0).is_err());
    assert!(Tensor::triu_indices(usize::MAX, 0).is_err());
    // Casts to integers truncate toward zero and saturate, on every device alike.
    assert_eq!(
        t(&[2.7, -2.7, 255.9], &[3])
            .to_dtype(DType::I64)
            .unwrap()
            .to_vec::<i64>()
            .unwrap(),
        vec![2, -2, 255]
    );
    for eps in [-1.0, f64::NAN, f64::INFINITY] {
        let m = t(&[1.0, 1.0], &[1, 2])
            .layer_norm(&[2], None, None, eps)
            .unwrap_err()
            .to_string();
        assert!(m.contains("eps"), "{m}");
    }
    let scalar = embers::tensor::RowSparseGrad {
        rows: vec![],
        values: Tensor::scalar(1f32),
        num_rows: 5,
    };
    assert_eq!(scalar.dense_shape(), vec![5]);
}

/// The error of a backward whose saved tensor was written in place, or a panic naming what
/// came back instead.
fn modified_in_place(result: embers::Result<()>) -> (&'static str, u64, u64) {
    match result {
        Err(Error::ModifiedInPlace { op, saved, now, .. }) => (op, saved, now),
        other => panic!("expected ModifiedInPlace, got {other:?}"),
    }
}

/// Every in-place write counts once on the storage that all views share; ops never count.
#[test]
fn in_place_writes_count_on_the_shared_storage() {
    let x = t(&[1.0, 2.0, 3.0, 4.0], &[2, 2]);
    let view = x.t().unwrap();
    assert_eq!((x.version(), view.version()), (0, 0));
    let _ = x.add(&view).unwrap().exp().unwrap();
    assert_eq!(x.version(), 0, "ops do not write their inputs");
    x.copy_from(&t(&[0.0; 4], &[2, 2])).unwrap();
    assert_eq!(
        (x.version(), view.version(), x.detach().version()),
        (1, 1, 1)
    );
    x.update_in_place(|v: &mut [f64]| v[0] = 5.0).unwrap();
    drop(x.data_mut::<f64>().unwrap());
    assert_eq!(view.version(), 3);
    // Another storage counts apart.
    assert_eq!(
        x.contiguous().unwrap().version(),
        3,
        "contiguous x is x itself"
    );
    assert_eq!(
        view.contiguous().unwrap().version(),
        0,
        "a copy has its own count"
    );
}

/// A backward refuses, naming its op, when a tensor its forward saved was written in place
/// since (PyTorch's "modified by an inplace operation"): an optimizer step between a forward
/// and its backward, a copy into an input or into a view of it, a write into an output the
/// backward reads. What a backward does not read may change: its gradient stays right.
#[test]
fn backwards_refuse_saved_tensors_written_in_place_since_their_forward() {
    // An optimizer step between a forward and its backward: the second loss was computed with
    // the weights the step changed, which the input's gradient reads.
    let layer = Linear::new(3, 2, &mut seeded(4)).unwrap();
    let x = t(&[0.5, -1.0, 2.0, 1.5, 0.25, -0.5], &[2, 3])
        .to_dtype(DType::F32)
        .unwrap()
        .with_requires_grad(true);
    let first = layer.forward(&x).unwrap().sum_all().unwrap();
    let second = layer.forward(&x).unwrap().sum_all().unwrap();
    first.backward().unwrap();
    let mut opt = Sgd::new(layer.parameters(), 0.1).unwrap();
    opt.step().unwrap();
    let (op, saved, now) = modified_in_place(second.backward());
    assert_eq!((op, saved, now), ("linear", 0, 1));

    // A copy into an input that a product's backward reads.
    let w = t(&[1.0, 2.0, 3.0, 4.0], &[2, 2]).with_requires_grad(true);
    let a = t(&[1.0, 0.0, 0.0, 1.0], &[2, 2]);
    let y = a.matmul(&w).unwrap().sum_all().unwrap();
    a.copy_from(&t(&[9.0; 4], &[2, 2])).unwrap();
    assert_eq!(modified_in_place(y.backward()).0, "matmul");
    // The weights themselves may change: dL/dw = aᵀ·1 reads only `a`.
    let a = t(&[1.0, 2.0, 3.0, 4.0], &[2, 2]);
    let y = a.matmul(&w).unwrap().sum_all().unwrap();
    w.copy_from(&t(&[0.0; 4], &[2, 2])).unwrap();
    y.backward().unwrap();
    assert_eq!(
        w.grad().unwrap().to_vec::<f64>().unwrap(),
        vec![4.0, 4.0, 6.0, 6.0]
    );

    // A write through another view of the same storage.
    let p = t(&[1.0, 2.0, 3.0], &[3]).with_requires_grad(true);
    let base = t(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0], &[2, 3]);
    let row = base.narrow(0, 1, 1).unwrap().reshape(&[3]).unwrap();
    let y = p.mul(&row).unwrap().sum_all().unwrap();
    base.update_in_place(|v: &mut [f64]| v[4] = 0.0).unwrap();
    assert_eq!(modified_in_place(y.backward()).0, "mul");
    // A sum reads neither operand.
    let y = p.add(&row).unwrap().sum_all().unwrap();
    base.update_in_place(|v: &mut [f64]| v[4] = 1.0).unwrap();
    y.backward().unwrap();

    // exp's derivative is its output: a changed input is harmless, a changed output is not.
    let x = t(&[0.0, 1.0], &[2]).with_requires_grad(true);
    let y = x.exp().unwrap();
    let loss = y.sum_all().unwrap();
    x.copy_from(&t(&[5.0, 5.0], &[2])).unwrap();
    loss.backward_with(&t(&[1.0], &[]), true).unwrap();
    close(
        &x.grad().unwrap().to_vec::<f64>().unwrap(),
        &[1.0, std::f64::consts::E],
        1e-12,
    );
    y.copy_from(&t(&[0.0, 0.0], &[2])).unwrap();
    assert_eq!(modified_in_place(loss.backward()).0, "exp");

    // softmax keeps its output; a write through data_mut counts like any other.
    let x = t(&[1.0, 2.0, 3.0], &[3]).with_requires_grad(true);
    let y = x.softmax(0).unwrap();
    let loss = y
        .mul(&t(&[1.0, 0.0, 0.0], &[3]))
        .unwrap()
        .sum_all()
        .unwrap();
    y.data_mut::<f64>().unwrap()[0] = 0.5;
    assert_eq!(modified_in_place(loss.backward()).0, "softmax");

    // max's backward routes through the indices it handed out.
    let x = t(&[1.0, 5.0, 2.0, 0.0], &[2, 2]).with_requires_grad(true);
    let (values, indices) = x.max_dim(1, false).unwrap();
    let loss = values.sum_all().unwrap();
    indices
        .copy_from(&Tensor::from_slice(&[0i64, 0], &[2]).unwrap())
        .unwrap();
    assert_eq!(modified_in_place(loss.backward()).0, "max");

    // The message says what happened and what to do.
    let x = t(&[1.0, 2.0], &[2]).with_requires_grad(true);
    let c = t(&[3.0, 4.0], &[2]);
    let loss = x.mul(&c).unwrap().sum_all().unwrap();
    c.copy_from(&t(&[0.0, 0.0], &[2])).unwrap();
    let message = loss.backward().unwrap_err().to_string();
    assert!(
        message.contains("`mul`")
            && message.contains("modified in place")
            && message.contains("[2]"),
        "{message}"
    );
}
