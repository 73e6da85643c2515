//! Tensors on a CUDA device against the same ops on the CPU: moves for every dtype (views
//! included), broadcasting arithmetic, the float functions and their derivatives, sums,
//! matrix products (cuBLAS on a GPU) and a whole autograd step through a small MLP. Runs on
//! GPU 0 when the machine has one, else on the host emulation (`cuda::use_emulation`; skipped
//! with the reason printed only when no C++ compiler exists, and CI makes that an error).

use embers::nn::{Activation, Forward, Mlp, Module};
use embers::tensor::rng::seeded;
use embers::{DType, Device, Error, Tensor};

#[path = "support/cuda_device.rs"]
mod cuda_device;
use cuda_device::device;

fn randn(shape: &[usize], seed: u64) -> Tensor {
    Tensor::randn(shape, 0.0, 1.0, DType::F32, &mut seeded(seed))
}

/// Element-wise agreement within `rel` of the magnitude (absolute below 1).
fn assert_close(what: &str, got: &Tensor, expected: &Tensor, rel: f64) {
    assert_eq!(got.shape(), expected.shape(), "{what}: shapes");
    assert_eq!(got.device(), Device::Cpu, "{what}: compare on the host");
    let (g, e) = (got.to_vec_f64().unwrap(), expected.to_vec_f64().unwrap());
    for (i, (a, b)) in g.iter().zip(&e).enumerate() {
        let ok = (a - b).abs() <= rel * b.abs().max(1.0) || (a.is_nan() && b.is_nan());
        assert!(ok, "{what} element {i}: CUDA {a} vs CPU {b}");
    }
}

type BinaryOp = fn(&Tensor, &Tensor) -> embers::Result<Tensor>;

/// The broadcasting binary ops with a CUDA kernel.
const BINARY_OPS: [(&str, BinaryOp); 6] = [
    ("add", Tensor::add),
    ("sub", Tensor::sub),
    ("mul", Tensor::mul),
    ("div", Tensor::div),
    ("maximum", Tensor::maximum),
    ("minimum", Tensor::minimum),
];

fn host(t: &Tensor) -> Tensor {
    t.to_device(Device::Cpu).unwrap()
}

#[test]
fn moves_keep_every_dtype_and_view_exact() {
    let Some(dev) = device() else { return };
    let base = randn(&[4, 6], 1);
    for dtype in [
        DType::F32,
        DType::F64,
        DType::F16,
        DType::BF16,
        DType::I64,
        DType::I32,
        DType::U8,
    ] {
        let t = base.affine(10.0, 50.0).unwrap().to_dtype(dtype).unwrap();
        let d = t.to_device(dev).unwrap();
        assert_eq!(d.device(), dev);
        assert_eq!(d.dtype(), dtype);
        assert_eq!(host(&d).to_vec_f64().unwrap(), t.to_vec_f64().unwrap());
        // A strided view read on the device (transpose, narrow) comes back element-exact.
        let view = d.t().unwrap().narrow(0, 1, 3).unwrap();
        let expected = t.t().unwrap().narrow(0, 1, 3).unwrap();
        assert_eq!(view.to_vec_f64().unwrap(), expected.to_vec_f64().unwrap());
    }
    // Filled tensors are made on the device.
    let z = Tensor::zeros(&[3, 2], DType::F32, dev);
    assert_eq!(z.device(), dev);
    assert_eq!(z.to_vec::<f32>().unwrap(), vec![0.0; 6]);
    let o = Tensor::full(2.5, &[5], DType::I32, dev);
    assert_eq!(o.to_vec::<i32>().unwrap(), vec![2; 5]);
}

#[test]
fn arithmetic_functions_and_sums_match_the_cpu() {
    let Some(dev) = device() else { return };
    let a = randn(&[3, 4, 5], 2);
    let b = randn(&[4, 1], 3);
    let (da, db) = (a.to_device(dev).unwrap(), b.to_device(dev).unwrap());
    for (name, op) in BINARY_OPS {
        assert_close(
            name,
            &host(&op(&da, &db).unwrap()),
            &op(&a, &b).unwrap(),
            1e-6,
        );
        // Operands swapped, and a transposed view as an operand.
        assert_close(
            name,
            &host(&op(&db, &da).unwrap()),
            &op(&b, &a).unwrap(),
            1e-6,
        );
        let at = a.transpose(1, 2).unwrap();
        let dat = da.transpose(1, 2).unwrap();
        let c = randn(&[5, 4], 4);
        let dc = c.to_device(dev).unwrap();
        assert_close(
            name,
            &host(&op(&dat, &dc).unwrap()),
            &op(&at, &c).unwrap(),
            1e-6,
        );
    }
    // Positive inputs for log/sqrt/pow.
    let p = a.abs().unwrap().add_scalar(0.1).unwrap();
    let dp = p.to_device(dev).unwrap();
    type Fun = fn(&Tensor) -> embers::Result<Tensor>;
    let funs: [(&str, Fun, bool); 14] = [
        ("neg", Tensor::neg, false),
        ("exp", Tensor::exp, false),
        ("log", Tensor::log, true),
        ("sqrt", Tensor::sqrt, true),
        ("abs", Tensor::abs, false),
        ("relu", Tensor::relu, false),
        ("tanh", Tensor::tanh, false),
        ("sigmoid", Tensor::sigmoid, false),
        ("gelu", Tensor::gelu, false),
        ("gelu_tanh", Tensor::gelu_tanh, false),
        ("affine", |t| t.affine(1.5, -0.25), false),
        ("pow", |t| t.pow_scalar(2.5), true),
        ("clamp", |t| t.clamp(-0.5, 0.7), false),
        ("square", Tensor::square, false),
    ];
    for (name, f, positive) in funs {
        let (x, dx) = if positive { (&p, &dp) } else { (&a, &da) };
        // Value and derivative: d/dx Σ f(x)·w for random w.
        let w = randn(x.shape(), 9);
        let dw = w.to_device(dev).unwrap();
        let xg = x.with_requires_grad(true);
        let dxg = dx.detach().with_requires_grad(true);
        let y = f(&xg).unwrap();
        let dy = f(&dxg).unwrap();
        assert_close(name, &host(&dy), &y, 2e-6);
        y.mul(&w).unwrap().sum_all().unwrap().backward().unwrap();
        dy.mul(&dw).unwrap().sum_all().unwrap().backward().unwrap();
        let (g, dg) = (xg.grad().unwrap(), dxg.grad().unwrap());
        assert_eq!(dg.device(), dev, "{name}: the gradient stays on the device");
        assert_close(&format!("{name} gradient"), &host(&dg), &g, 1e-5);
    }
    for dims in [vec![0isize], vec![1], vec![2], vec![0, 2], vec![0, 1, 2]] {
        for keep in [false, true] {
            let s = a.sum(&dims, keep).unwrap();
            let ds = da.sum(&dims, keep).unwrap();
            assert_close(&format!("sum {dims:?} {keep}"), &host(&ds), &s, 1e-5);
        }
    }
    let m = a.mean(&[1], false).unwrap();
    assert_close("mean", &host(&da.mean(&[1], false).unwrap()), &m, 1e-6);
}

/// |got − expected| ≤ 1e-5 · Σ_k |a_ik|·|b_kj| + 1e-6: the error bound of an f32 dot product.
fn assert_matmul_close(what: &str, got: &Tensor, a: &Tensor, b: &Tensor) {
    let expected = a.matmul(b).unwrap();
    let bound = a.abs().unwrap().matmul(&b.abs().unwrap()).unwrap();
    let (g, e, m) = (
        got.to_vec_f64().unwrap(),
        expected.to_vec_f64().unwrap(),
        bound.to_vec_f64().unwrap(),
    );
    assert_eq!(got.shape(), expected.shape(), "{what}");
    for i in 0..g.len() {
        assert!(
            (g[i] - e[i]).abs() <= 1e-5 * m[i] + 1e-6,
            "{what} element {i}: CUDA {} vs CPU {}",
            g[i],
            e[i]
        );
    }
}

#[test]
fn matrix_products_match_the_cpu() {
    let Some(dev) = device() else { return };
    let cases: [(&[usize], &[usize]); 5] = [
        (&[7, 33], &[33, 5]),
        (&[1, 1], &[1, 1]),
        (&[3, 4, 9], &[3, 9, 6]),
        (&[4, 9], &[2, 9, 6]),
        (&[2, 1, 4, 9], &[3, 9, 2]),
    ];
    for (i, (sa, sb)) in cases.iter().enumerate() {
        let (a, b) = (randn(sa, 10 + i as u64), randn(sb, 20 + i as u64));
        let got = a
            .to_device(dev)
            .unwrap()
            .matmul(&b.to_device(dev).unwrap())
            .unwrap();
        assert_matmul_close(&format!("{sa:?}·{sb:?}"), &host(&got), &a, &b);
    }
    // Transposed operands (views) and an empty inner dimension.
    let (a, b) = (randn(&[9, 7], 30), randn(&[5, 9], 31));
    let got = a
        .to_device(dev)
        .unwrap()
        .t()
        .unwrap()
        .matmul(&b.to_device(dev).unwrap().t().unwrap())
        .unwrap();
    assert_matmul_close("aᵀ·bᵀ", &host(&got), &a.t().unwrap(), &b.t().unwrap());
    let e = Tensor::zeros(&[3, 0], DType::F32, dev)
        .matmul(&Tensor::zeros(&[0, 2], DType::F32, dev))
        .unwrap();
    assert_eq!(e.to_vec::<f32>().unwrap(), vec![0.0; 6]);
}

#[test]
fn an_mlp_training_step_matches_the_cpu() {
    let Some(dev) = device() else { return };
    let mut rng = seeded(40);
    let cpu = Mlp::new(13, &[32, 16, 1], Activation::Relu, &mut rng)
        .unwrap()
        .activate_last(false);
    let mut rng = seeded(40);
    let gpu = Mlp::new(13, &[32, 16, 1], Activation::Relu, &mut rng)
        .unwrap()
        .activate_last(false);
    let x = randn(&[64, 13], 41);
    let t = Tensor::rand_uniform(&[64, 1], 0.0, 1.0, DType::F32, &mut seeded(42));
    let loss = |m: &Mlp, x: &Tensor, t: &Tensor| -> Tensor {
        let y = m.forward(x).unwrap().sigmoid().unwrap();
        y.sub(t)
            .unwrap()
            .square()
            .unwrap()
            .mean(&[0, 1], false)
            .unwrap()
    };
    let l_cpu = loss(&cpu, &x, &t);
    l_cpu.backward().unwrap();
    // The same model evaluated on the device: parameters moved with autograd, so gradients
    // flow back to the host leaves through `to_device`.
    let gpu_params = gpu.parameters();
    let moved: Vec<Tensor> = gpu_params
        .iter()
        .map(|p| p.to_device(dev).unwrap())
        .collect();
    let dx = x.to_device(dev).unwrap();
    let dt = t.to_device(dev).unwrap();
    // Run the MLP's layers by hand on the moved parameters (Linear = x·Wᵀ + b).
    let mut h = dx;
    let layers = moved.len() / 2;
    for l in 0..layers {
        h = h.linear(&moved[2 * l], Some(&moved[2 * l + 1])).unwrap();
        if l + 1 < layers {
            h = h.relu().unwrap();
        }
    }
    let l_gpu = h
        .sigmoid()
        .unwrap()
        .sub(&dt)
        .unwrap()
        .square()
        .unwrap()
        .mean(&[0, 1], false)
        .unwrap();
    assert_eq!(l_gpu.device(), dev);
    assert!((l_gpu.item().unwrap() - l_cpu.item().unwrap()).abs() < 1e-6);
    l_gpu.backward().unwrap();
    for (i, (pc, pg)) in cpu.parameters().iter().zip(&gpu_params).enumerate() {
        let (gc, gg) = (pc.grad().unwrap(), pg.grad().unwrap());
        assert_eq!(gg.device(), Device::Cpu, "the leaf is on the host");
        // Gradients are small: compare against the tensor's largest magnitude.
        let (g, e) = (gg.to_vec_f64().unwrap(), gc.to_vec_f64().unwrap());
        let scale = e.iter().fold(0.0f64, |m, v| m.max(v.abs()));
        assert!(scale > 0.0, "parameter {i}: a zero gradient proves nothing");
        for (j, (a, b)) in g.iter().zip(&e).enumerate() {
            assert!(
                (a - b).abs() <= 2e-5 * scale,
                "parameter {i} gradient element {j}: CUDA {a} vs CPU {b} (scale {scale})"
            );
        }
    }
}

#[test]
fn ops_without_a_cuda_path_and_mixed_devices_are_errors() {
    let Some(dev) = device() else { return };
    let a = randn(&[4, 5], 50);
    let da = a.to_device(dev).unwrap();
    let err = da.add(&a).unwrap_err();
    assert!(matches!(err, Error::DeviceMismatch { .. }), "{err}");
    // Host views of device memory do not exist: the error says to move the tensor.
    let err = da.data_mut::<f32>().map(|_| ()).unwrap_err().to_string();
    assert!(
        err.contains(&dev.to_string()) && err.contains("to_device"),
        "{err}"
    );
    // Float functions of integers have no kernel (nor a CPU path): the error names the op,
    // dtype and device.
    let di = da.to_dtype(DType::I32).unwrap();
    let err = di.exp().unwrap_err().to_string();
    assert!(
        err.contains(&dev.to_string()) && err.contains("exp") && err.contains("I32"),
        "{err}"
    );
}

/// Bit-level equality of two tensors' values (NaN equal to NaN, the sign of zero kept).
fn assert_same_values(what: &str, got: &Tensor, expected: &Tensor) {
    assert_eq!(got.shape(), expected.shape(), "{what}: shapes");
    assert_eq!(got.dtype(), expected.dtype(), "{what}: dtypes");
    let (g, e) = (
        host(got).to_vec_f64().unwrap(),
        expected.to_vec_f64().unwrap(),
    );
    for (i, (a, b)) in g.iter().zip(&e).enumerate() {
        let same = a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan());
        assert!(same, "{what} element {i}: CUDA {a:e} vs CPU {b:e}");
    }
}

const ALL_DTYPES: [DType; 7] = [
    DType::F32,
    DType::F64,
    DType::F16,
    DType::BF16,
    DType::I64,
    DType::I32,
    DType::U8,
];

#[test]
fn casts_between_every_dtype_match_the_cpu_bit_for_bit() {
    let Some(dev) = device() else { return };
    // Random values at several scales, and the edges of every conversion: NaN, infinities,
    // signed zeros, overflow and underflow of each float format, f16/bf16 sub-normals, ties
    // (1 + 2^-11 is halfway between two f16 values; with 2^-40 added it lies just above, which
    // rounding through f32 first would lose), and integers past i32/u8/i64 ranges.
    let mut values: Vec<f64> = randn(&[96], 60)
        .to_vec_f64()
        .unwrap()
        .iter()
        .enumerate()
        .map(|(i, v)| v * [1e-6, 1e-2, 1.0, 3e2, 7e4, 1e9][i % 6])
        .collect();
    let p = |e: i32| 2f64.powi(e);
    values.extend([
        f64::NAN,
        f64::INFINITY,
        f64::NEG_INFINITY,
        0.0,
        -0.0,
        1e300,
        -1e300,
        1e-300,
        3.4e38,
        3.5e38,
        65504.0,
        65520.0,
        6e-8,
        3e-8,
        1e-40,
        1.0 + p(-11),
        1.0 + p(-11) + p(-40),
        1.0 + 3.0 * p(-11),
        1.0 + p(-8),
        1.0 + p(-8) + p(-40),
        -2.5,
        -0.7,
        255.5,
        256.0,
        -1.0,
        2147483647.0,
        2147483648.0,
        -2147483649.0,
        9.3e18,
        -9.3e18,
        4096.5,
        0.1,
    ]);
    let n = values.len();
    assert_eq!(n % 8, 0);
    let base = Tensor::from_vec(values, &[n]).unwrap();
    for src in ALL_DTYPES {
        let s = base.to_dtype(src).unwrap();
        let ds = s.to_device(dev).unwrap();
        for dst in ALL_DTYPES {
            let what = format!("{src:?} -> {dst:?}");
            assert_same_values(&what, &ds.to_dtype(dst).unwrap(), &s.to_dtype(dst).unwrap());
        }
        // A strided view converts as its values.
        let view = s.reshape(&[n / 8, 8]).unwrap().t().unwrap();
        let dview = ds.reshape(&[n / 8, 8]).unwrap().t().unwrap();
        for dst in [DType::F32, DType::F16, DType::I64] {
            let what = format!("{src:?} view -> {dst:?}");
            assert_same_values(
                &what,
                &dview.to_dtype(dst).unwrap(),
                &view.to_dtype(dst).unwrap(),
            );
        }
    }
}

/// Within `ulps` units in the last place of the storage format (f16: 2^-10, bf16: 2^-7
/// relative), measured against the larger of |expected| and `floor`.
fn assert_close_ulps(what: &str, got: &Tensor, expected: &Tensor, ulps: f64, floor: f64) {
    let unit = match expected.dtype() {
        DType::F16 => 2f64.powi(-10),
        DType::BF16 => 2f64.powi(-7),
        _ => 2f64.powi(-23),
    };
    assert_eq!(got.shape(), expected.shape(), "{what}: shapes");
    assert_eq!(got.dtype(), expected.dtype(), "{what}: dtypes");
    let (g, e) = (
        host(got).to_vec_f64().unwrap(),
        expected.to_vec_f64().unwrap(),
    );
    for (i, (a, b)) in g.iter().zip(&e).enumerate() {
        let ok = (a - b).abs() <= ulps * unit * b.abs().max(floor) || (a.is_nan() && b.is_nan());
        assert!(ok, "{what} element {i}: CUDA {a} vs CPU {b}");
    }
}

#[test]
fn half_precision_math_matches_the_cpu() {
    let Some(dev) = device() else { return };
    for dtype in [DType::F16, DType::BF16] {
        let a = randn(&[3, 4, 5], 61).to_dtype(dtype).unwrap();
        let b = randn(&[4, 1], 62).to_dtype(dtype).unwrap();
        let (da, db) = (a.to_device(dev).unwrap(), b.to_device(dev).unwrap());
        // f32 arithmetic rounded once: exact, as on the CPU.
        for (name, op) in BINARY_OPS {
            let what = format!("{dtype:?} {name}");
            assert_same_values(&what, &op(&da, &db).unwrap(), &op(&a, &b).unwrap());
            // A transposed view against the broadcast operand, and the operands swapped.
            let dat = da.transpose(0, 2).unwrap();
            let at = a.transpose(0, 2).unwrap();
            assert_same_values(&what, &op(&dat, &db).unwrap(), &op(&at, &b).unwrap());
            assert_same_values(&what, &op(&db, &dat).unwrap(), &op(&b, &at).unwrap());
        }
        // The float functions: f32 libm and CUDA's differ by an f32 ulp or two, which can move
        // the rounded result by one unit of the storage format.
        let p = a.abs().unwrap().add_scalar(0.1).unwrap();
        let dp = p.to_device(dev).unwrap();
        type Fun = fn(&Tensor) -> embers::Result<Tensor>;
        let funs: [(&str, Fun); 8] = [
            ("exp", Tensor::exp),
            ("log", Tensor::log),
            ("sqrt", Tensor::sqrt),
            ("tanh", Tensor::tanh),
            ("sigmoid", Tensor::sigmoid),
            ("relu", Tensor::relu),
            ("gelu", Tensor::gelu),
            ("neg", Tensor::neg),
        ];
        for (name, f) in funs {
            let what = format!("{dtype:?} {name}");
            assert_close_ulps(&what, &f(&dp).unwrap(), &f(&p).unwrap(), 1.0, 1e-3);
        }
        // Sums (f64 accumulation on the device, f32 on the CPU, both rounded once to f32).
        for dims in [&[0][..], &[1, 2], &[0, 1, 2]] {
            let what = format!("{dtype:?} sum over {dims:?}");
            let got = da.sum(dims, false).unwrap();
            assert_close_ulps(&what, &got, &a.sum(dims, false).unwrap(), 1.0, 1e-3);
        }
        // Matrix products: f32 accumulation, one rounding of each result.
        let cases: [(&[usize], &[usize]); 3] = [
            (&[7, 33], &[33, 5]),
            (&[3, 4, 9], &[3, 9, 6]),
            (&[4, 9], &[2, 9, 6]),
        ];
        for (i, (sa, sb)) in cases.iter().enumerate() {
            let x = randn(sa, 70 + i as u64).to_dtype(dtype).unwrap();
            let y = randn(sb, 80 + i as u64).to_dtype(dtype).unwrap();
            let got = x
                .to_device(dev)
                .unwrap()
                .matmul(&y.to_device(dev).unwrap())
                .unwrap();
            let what = format!("{dtype:?} {sa:?}·{sb:?}");
            assert_close_ulps(&what, &got, &x.matmul(&y).unwrap(), 1.0, 1.0);
        }
    }
}

#[test]
fn mixed_precision_gradients_match_the_cpu() {
    // An f32 master weight cast to bf16/f16 for the forward pass, as mixed-precision training
    // does: the gradient flows back through the casts, products and functions in half
    // precision and arrives in f32.
    let Some(dev) = device() else { return };
    for dtype in [DType::F16, DType::BF16] {
        let x = randn(&[16, 12], 90).to_dtype(dtype).unwrap();
        let w_host = randn(&[12, 8], 91).affine(0.3, 0.0).unwrap();
        let run = |device: Device| -> Tensor {
            let w = w_host.to_device(device).unwrap().with_requires_grad(true);
            let y = x
                .to_device(device)
                .unwrap()
                .matmul(&w.to_dtype(dtype).unwrap())
                .unwrap()
                .tanh()
                .unwrap()
                .mul_scalar(0.5)
                .unwrap()
                .sum(&[0, 1], false)
                .unwrap();
            assert_eq!(y.dtype(), dtype);
            y.backward().unwrap();
            let g = w.grad().unwrap();
            assert_eq!((g.dtype(), g.device()), (DType::F32, device));
            host(&g)
        };
        let (g_dev, g_cpu) = (run(dev), run(Device::Cpu));
        let (g, e) = (g_dev.to_vec_f64().unwrap(), g_cpu.to_vec_f64().unwrap());
        let scale = e.iter().fold(0.0f64, |m, v| m.max(v.abs()));
        assert!(scale > 0.0, "a zero gradient proves nothing");
        // Each gradient is a half-precision product of 16 terms: a few units of the format.
        let unit = if dtype == DType::F16 {
            2f64.powi(-10)
        } else {
            2f64.powi(-7)
        };
        for (i, (a, b)) in g.iter().zip(&e).enumerate() {
            assert!(
                (a - b).abs() <= 4.0 * unit * scale,
                "{dtype:?} gradient element {i}: CUDA {a} vs CPU {b}"
            );
        }
    }
}

#[test]
fn side_streams_run_ops_and_keep_their_own_memory_pools() {
    let Some(dev) = device() else { return };
    let cuda = embers::cuda::device(0).unwrap();
    let side = cuda.new_stream().unwrap();
    let other = cuda.new_stream().unwrap();
    assert_ne!(side.id(), other.id());
    assert_ne!(side.id(), cuda.default_stream().id());
    // `run` makes a stream current for the closure only, nested runs included.
    assert_eq!(cuda.current_stream(), cuda.default_stream());
    side.run(|| {
        assert_eq!(cuda.current_stream(), side);
        other.run(|| assert_eq!(cuda.current_stream(), other));
        assert_eq!(cuda.current_stream(), side);
    });
    assert_eq!(cuda.current_stream(), cuda.default_stream());
    let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        side.run(|| panic!("inside run"));
    }));
    assert!(caught.is_err());
    assert_eq!(
        cuda.current_stream(),
        cuda.default_stream(),
        "restored after a panic"
    );

    // Work on a side stream: inputs made on the default stream, the side stream waits for
    // them, the default stream waits for the result; then the values agree with the CPU.
    let (a, b) = (randn(&[6, 5], 100), randn(&[5, 3], 101));
    let (da, db) = (a.to_device(dev).unwrap(), b.to_device(dev).unwrap());
    side.wait_for(&cuda.default_stream()).unwrap();
    let dc = side.run(|| {
        da.record_stream(&side).unwrap();
        db.record_stream(&side).unwrap();
        da.matmul(&db).unwrap().tanh().unwrap()
    });
    cuda.default_stream().wait_for(&side).unwrap();
    side.synchronize().unwrap();
    assert_close(
        "matmul + tanh on a side stream",
        &host(&dc),
        &a.matmul(&b).unwrap().tanh().unwrap(),
        1e-5,
    );
    drop((da, db, dc));

    // A block freed on one stream is not handed to another: allocating on a fresh stream
    // takes a new segment even though the default stream's cache has room.
    let fresh = cuda.new_stream().unwrap();
    let before = cuda.memory_stats().raw_allocs;
    drop(cuda.alloc::<f32>(1000).unwrap());
    let after_default = cuda.memory_stats().raw_allocs;
    fresh.run(|| drop(cuda.alloc::<f32>(1000).unwrap()));
    assert_eq!(cuda.memory_stats().raw_allocs, after_default + 1);
    assert!(after_default <= before + 1);
    // Recording a CPU tensor is an error.
    assert!(a.record_stream(&side).is_err());
}

#[test]
fn comparisons_selection_softmax_and_max_match_the_cpu() {
    let Some(dev) = device() else { return };
    let d = |t: &Tensor| t.to_device(dev).unwrap();
    // Comparisons of every kind, broadcasting, with NaN and ties, in f32, f16 and i64: exact.
    let mut av = randn(&[4, 6], 110).to_vec::<f32>().unwrap();
    av[3] = f32::NAN;
    av[7] = 0.5;
    let a = Tensor::from_vec(av, &[4, 6]).unwrap();
    let b = Tensor::from_vec(vec![0.5f32, -0.25, f32::NAN, 0.0, 1.0, -1.0], &[1, 6]).unwrap();
    type Cmp = fn(&Tensor, &Tensor) -> embers::Result<Tensor>;
    let cmps: [(&str, Cmp); 5] = [
        ("eq", Tensor::eq),
        ("lt", Tensor::lt),
        ("le", Tensor::le),
        ("gt", Tensor::gt),
        ("ge", Tensor::ge),
    ];
    for dtype in [DType::F32, DType::F16, DType::I64] {
        let (a, b) = (a.to_dtype(dtype).unwrap(), b.to_dtype(dtype).unwrap());
        for (name, cmp) in cmps {
            let what = format!("{dtype:?} {name}");
            assert_same_values(&what, &cmp(&d(&a), &d(&b)).unwrap(), &cmp(&a, &b).unwrap());
            let (at, bt) = (a.t().unwrap(), b.t().unwrap());
            assert_same_values(
                &what,
                &cmp(&d(&at), &d(&bt)).unwrap(),
                &cmp(&at, &bt).unwrap(),
            );
        }
    }
    // Selection: where_cond and masked_fill with broadcasting, values of two sizes, and the
    // gradients of maximum/minimum (built from comparisons and where_cond).
    let mask = a.gt_scalar(0.0).unwrap();
    let x = randn(&[4, 6], 111);
    let y = randn(&[6], 112);
    let got = Tensor::where_cond(&d(&mask), &d(&x), &d(&y)).unwrap();
    assert_same_values(
        "where f32",
        &got,
        &Tensor::where_cond(&mask, &x, &y).unwrap(),
    );
    let (xi, yi) = (
        x.to_dtype(DType::I64).unwrap(),
        y.to_dtype(DType::I64).unwrap(),
    );
    let got = Tensor::where_cond(
        &d(&mask.t().unwrap()),
        &d(&xi.t().unwrap()),
        &d(&yi.unsqueeze(1).unwrap()),
    );
    let expected = Tensor::where_cond(
        &mask.t().unwrap(),
        &xi.t().unwrap(),
        &yi.unsqueeze(1).unwrap(),
    );
    assert_same_values("where i64", &got.unwrap(), &expected.unwrap());
    assert!(
        Tensor::where_cond(&mask, &d(&x), &d(&y)).is_err(),
        "mixed devices"
    );
    let grads = |device: Device| -> Vec<Tensor> {
        let xs = x.to_device(device).unwrap().with_requires_grad(true);
        let ys = y.to_device(device).unwrap().with_requires_grad(true);
        let m = mask.to_device(device).unwrap();
        let z = xs
            .maximum(&ys)
            .unwrap()
            .add(&xs.minimum(&ys).unwrap().mul_scalar(3.0).unwrap())
            .unwrap()
            .masked_fill(&m, 2.0)
            .unwrap()
            .tanh()
            .unwrap()
            .sum_all()
            .unwrap();
        z.backward().unwrap();
        vec![host(&xs.grad().unwrap()), host(&ys.grad().unwrap())]
    };
    for (g, e) in grads(dev).iter().zip(grads(Device::Cpu)) {
        assert_close("maximum/minimum/masked_fill gradient", g, &e, 1e-5);
    }
    // softmax / log_softmax along every dimension, values and gradients.
    let s = randn(&[3, 5, 7], 113).affine(3.0, 0.0).unwrap();
    for dim in [0isize, 1, -1] {
        for log in [false, true] {
            let run = |device: Device| -> (Tensor, Tensor) {
                let xs = s.to_device(device).unwrap().with_requires_grad(true);
                let y = if log {
                    xs.log_softmax(dim).unwrap()
                } else {
                    xs.softmax(dim).unwrap()
                };
                let w = randn(s.shape(), 114).to_device(device).unwrap();
                y.mul(&w).unwrap().sum_all().unwrap().backward().unwrap();
                (host(&y), host(&xs.grad().unwrap()))
            };
            let ((y, g), (ey, eg)) = (run(dev), run(Device::Cpu));
            let what = format!("softmax dim {dim} log {log}");
            assert_close(&what, &y, &ey, 1e-5);
            assert_close(&format!("{what} gradient"), &g, &eg, 1e-5);
        }
    }
    let h = s.to_dtype(DType::BF16).unwrap();
    assert_close_ulps(
        "bf16 softmax",
        &d(&h).softmax(-1).unwrap(),
        &h.softmax(-1).unwrap(),
        1.0,
        1e-2,
    );
    // max along a dimension: values, first index of the maximum (ties, NaN), gradient.
    let mut mv = randn(&[4, 5, 3], 115).to_vec::<f32>().unwrap();
    mv[4] = mv[1]; // a tie along dim 1 (positions 1 and 4 of line (0, 1))
    mv[20] = f32::NAN;
    let m = Tensor::from_vec(mv, &[4, 5, 3]).unwrap();
    for dim in [0isize, 1, 2] {
        for keepdim in [false, true] {
            let run = |device: Device| -> (Tensor, Tensor, Tensor) {
                let xs = m.to_device(device).unwrap().with_requires_grad(true);
                let (v, i) = xs.max_dim(dim, keepdim).unwrap();
                let w = Tensor::full(1.5, v.shape(), DType::F32, device);
                v.mul(&w).unwrap().sum_all().unwrap().backward().unwrap();
                (host(&v), host(&i), host(&xs.grad().unwrap()))
            };
            let ((v, i, g), (ev, ei, eg)) = (run(dev), run(Device::Cpu));
            let what = format!("max dim {dim} keepdim {keepdim}");
            assert_same_values(&what, &v, &ev);
            assert_eq!(
                i.to_vec::<i64>().unwrap(),
                ei.to_vec::<i64>().unwrap(),
                "{what}"
            );
            assert_same_values(&format!("{what} gradient"), &g, &eg);
        }
    }
    // Rows longer than a warp: ties across lanes go to the first index, a NaN wins, and a
    // row of -inf keeps index 0; softmax of the same rows.
    let mut long = randn(&[4, 100], 116).to_vec::<f32>().unwrap();
    long[10] = 9.0;
    long[70] = 9.0;
    long[100 + 80] = f32::NAN;
    long[100 + 50] = f32::NAN;
    long[200..300].fill(f32::NEG_INFINITY);
    long[300 + 33] = 5.0;
    long[300 + 1] = 5.0;
    let long = Tensor::from_vec(long, &[4, 100]).unwrap();
    let (v, i) = d(&long).max_dim(-1, false).unwrap();
    let (ev, ei) = long.max_dim(-1, false).unwrap();
    assert_same_values("long rows max", &v, &ev);
    assert_eq!(
        host(&i).to_vec::<i64>().unwrap(),
        ei.to_vec::<i64>().unwrap()
    );
    assert_eq!(ei.to_vec::<i64>().unwrap(), vec![10, 50, 0, 1]);
    let finite = long.narrow(0, 0, 1).unwrap();
    assert_close(
        "long rows softmax",
        &host(&d(&finite).log_softmax(-1).unwrap()),
        &finite.log_softmax(-1).unwrap(),
        1e-5,
    );
    // Sums of long rows (a warp per row) and of one long vector.
    for shape in [&[4usize, 100][..], &[5000]] {
        let t = randn(shape, 117);
        let got = d(&t).sum(&[-1], false).unwrap();
        assert_close(
            "long rows sum",
            &host(&got),
            &t.sum(&[-1], false).unwrap(),
            1e-5,
        );
        let h = t.to_dtype(DType::F16).unwrap();
        let got = d(&h).sum(&[-1], false).unwrap();
        assert_close_ulps(
            "f16 long rows sum",
            &got,
            &h.sum(&[-1], false).unwrap(),
            1.0,
            1.0,
        );
    }
    let argmax = d(&m).argmax(-1, false).unwrap();
    assert_eq!(
        host(&argmax).to_vec::<i64>().unwrap(),
        m.argmax(-1, false).unwrap().to_vec::<i64>().unwrap()
    );
    let dm = d(&m.abs().unwrap().narrow(0, 1, 3).unwrap());
    assert_same_values(
        "max_all",
        &dm.max_all().unwrap(),
        &m.abs().unwrap().narrow(0, 1, 3).unwrap().max_all().unwrap(),
    );
}

#[test]
fn gather_and_cross_entropy_match_the_cpu_with_gradients() {
    let Some(dev) = device() else { return };
    // Gather along dim 0 with repeated indices (the gradient sums them in order), in f32 and
    // i64 (values only), and cross-entropy (log_softmax + gather) with its gradient.
    let x = randn(&[5, 4, 3], 120);
    let index = Tensor::from_vec(
        vec![4i64, 0, 4, 1, 2, 4, 0, 0, 3, 3, 1, 4, 2, 2, 0, 1, 4, 4],
        &[3, 2, 3],
    )
    .unwrap();
    let run = |device: Device| -> (Tensor, Tensor) {
        let xs = x.to_device(device).unwrap().with_requires_grad(true);
        let y = xs.gather(&index.to_device(device).unwrap()).unwrap();
        let w = randn(y.shape(), 121).to_device(device).unwrap();
        y.mul(&w).unwrap().sum_all().unwrap().backward().unwrap();
        (host(&y), host(&xs.grad().unwrap()))
    };
    let ((y, g), (ey, eg)) = (run(dev), run(Device::Cpu));
    assert_same_values("gather", &y, &ey);
    assert_close("gather gradient", &g, &eg, 1e-6);
    let xi = x.affine(10.0, 0.0).unwrap().to_dtype(DType::I64).unwrap();
    let got = xi
        .to_device(dev)
        .unwrap()
        .gather(&index.to_device(dev).unwrap())
        .unwrap();
    assert_same_values("gather i64", &got, &xi.gather(&index).unwrap());
    let bad = Tensor::from_vec(vec![5i64; 18], &[3, 2, 3]).unwrap();
    assert!(x
        .to_device(dev)
        .unwrap()
        .gather(&bad.to_device(dev).unwrap())
        .is_err());

    let logits = randn(&[16, 10], 122).affine(2.0, 0.0).unwrap();
    let target = Tensor::from_vec((0..16).map(|i| (i * 7 % 10) as i64).collect(), &[16]).unwrap();
    let run = |device: Device| -> (Tensor, Tensor) {
        let l = logits.to_device(device).unwrap().with_requires_grad(true);
        let loss = l
            .cross_entropy(
                &target.to_device(device).unwrap(),
                embers::tensor::Reduction::Mean,
            )
            .unwrap();
        loss.backward().unwrap();
        (host(&loss), host(&l.grad().unwrap()))
    };
    let ((loss, g), (eloss, eg)) = (run(dev), run(Device::Cpu));
    assert_close("cross entropy", &loss, &eloss, 1e-6);
    assert_close("cross entropy gradient", &g, &eg, 1e-6);
}

#[test]
fn integer_arithmetic_wraps_and_checks_divisors_as_on_the_cpu() {
    let Some(dev) = device() else { return };
    let d = |t: &Tensor| t.to_device(dev).unwrap();
    let a = Tensor::from_vec(
        vec![i64::MAX, i64::MIN, -7, 7, 0, 123_456_789_012, -1, 5],
        &[2, 4],
    )
    .unwrap();
    let b = Tensor::from_vec(vec![1i64, -1, 2, -3], &[1, 4]).unwrap();
    for dtype in [DType::I64, DType::I32, DType::U8] {
        let (a, b) = (a.to_dtype(dtype).unwrap(), b.to_dtype(dtype).unwrap());
        for (name, op) in BINARY_OPS {
            if name == "div" && dtype == DType::U8 {
                continue; // u8 casts of the divisors above include a 0
            }
            let what = format!("{dtype:?} {name}");
            assert_same_values(&what, &op(&d(&a), &d(&b)).unwrap(), &op(&a, &b).unwrap());
            // Swapped and transposed: a holds a 0, so b / a is the CPU's error on both.
            let (at, bt) = (a.t().unwrap(), b.t().unwrap());
            match (op(&d(&bt), &d(&at)), op(&bt, &at)) {
                (Ok(got), Ok(expected)) => assert_same_values(&what, &got, &expected),
                (Err(e), Err(expected)) => assert_eq!(e.to_string(), expected.to_string()),
                (got, expected) => panic!("{what}: CUDA {got:?} vs CPU {expected:?}"),
            }
        }
    }
    // Sums over every set of dimensions, wrapping in the element type.
    for dtype in [DType::I64, DType::I32, DType::U8] {
        let big = a.to_dtype(dtype).unwrap();
        for dims in [&[0isize][..], &[1], &[0, 1]] {
            let what = format!("{dtype:?} sum over {dims:?}");
            let got = d(&big).sum(dims, false).unwrap();
            assert_same_values(&what, &got, &big.sum(dims, false).unwrap());
        }
    }
    // The i32 edges: MAX + 1 and MIN · −1 wrap, MIN / −1 = MIN.
    let edge = Tensor::from_vec(vec![i32::MAX, i32::MIN, i32::MIN], &[3]).unwrap();
    let by = Tensor::from_vec(vec![1i32, -1, -1], &[3]).unwrap();
    for (name, op) in BINARY_OPS {
        let what = format!("i32 edge {name}");
        assert_same_values(
            &what,
            &op(&d(&edge), &d(&by)).unwrap(),
            &op(&edge, &by).unwrap(),
        );
    }
    // Division by zero is an error naming the position, on the device as on the CPU.
    let zero = Tensor::from_vec(vec![3i64, 0, 1], &[3]).unwrap();
    let num = Tensor::from_vec(vec![9i64, 9, 9], &[3]).unwrap();
    let err = d(&num).div(&d(&zero)).unwrap_err().to_string();
    assert_eq!(err, num.div(&zero).unwrap_err().to_string());
    assert!(err.contains("position 1"), "{err}");
}

/// `copy_from` into a device tensor takes strided and self-overlapping sources (a transposed
/// device source was refused), counts one write on success and none on a refusal, and a
/// backward that saved the destination refuses it afterwards, as on the CPU.
#[test]
fn copies_into_device_tensors_count_as_writes() {
    let Some(dev) = device() else {
        return;
    };
    let values = randn(&[3, 4], 71);
    let dst = values.to_device(dev).unwrap();
    let src = randn(&[4, 3], 72).to_device(dev).unwrap();
    dst.copy_from(&src.t().unwrap()).unwrap();
    assert_eq!(dst.version(), 1);
    assert_close(
        "copy of a transposed device source",
        &host(&dst),
        &host(&src).t().unwrap().contiguous().unwrap(),
        0.0,
    );
    // Its own transpose (a square view of its storage): read whole before any is written.
    let square = randn(&[3, 3], 73).to_device(dev).unwrap();
    let before = host(&square);
    square.copy_from(&square.t().unwrap()).unwrap();
    assert_close(
        "copy of its own transpose",
        &host(&square),
        &before.t().unwrap().contiguous().unwrap(),
        0.0,
    );
    // A refused copy writes nothing and counts nothing.
    assert!(dst.copy_from(&randn(&[2, 2], 74)).is_err());
    assert_eq!(dst.version(), 1);
    // A product's backward that reads the destination refuses it once written.
    let w = randn(&[4, 2], 75)
        .to_device(dev)
        .unwrap()
        .with_requires_grad(true);
    let loss = dst.matmul(&w).unwrap().sum_all().unwrap();
    dst.copy_from(&values).unwrap();
    match loss.backward() {
        Err(Error::ModifiedInPlace { op, saved, now, .. }) => {
            assert_eq!((op, saved, now), ("matmul", 1, 2));
        }
        other => panic!("expected ModifiedInPlace, got {other:?}"),
    }
}
