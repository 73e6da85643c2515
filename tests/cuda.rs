//! The CUDA backend: the device probe, NVRTC compilation of every kernel in `kernels/` (needs
//! NVRTC, not a GPU; CI installs it and sets `EMBERS_REQUIRE_NVRTC=1` so this cannot silently
//! skip there), and the kernels against their CPU twins — on the GPU when the machine has one,
//! and always on the host emulation (`cuda::simulated_device`, the same kernel sources built by
//! the system C++ compiler; CI sets `EMBERS_REQUIRE_CUDA_SIM=1` so that cannot skip either).

use embers::cuda::{self, CudaTbe, KERNELS};
use embers::embedding::{FusedOptimizer, QuantizedTableBatchedEmbedding, TbeInput, WeightType};
use embers::embedding::{PoolingMode, TableBatchedEmbedding, TableSpec, TbeConfig, WeightDecay};
use embers::{Device, Error, Tensor};

#[test]
fn the_device_probe_says_what_is_missing() {
    let err = match Device::cuda(0) {
        Ok(device) => {
            // A machine with a GPU, its driver and NVRTC: the device works and says so.
            assert_eq!(device, Device::Cuda(0));
            assert!(cuda::device_count().unwrap() >= 1);
            assert!(cuda::nvrtc_present());
            let err = Device::cuda(1000).unwrap_err().to_string();
            assert!(err.contains("cuda:1000"), "{err}");
            return;
        }
        Err(err) => err,
    };
    let Error::DeviceUnavailable { device, reason } = &err else {
        panic!("unexpected error {err}");
    };
    assert_eq!(*device, Device::Cuda(0));
    if !cuda::driver_present() {
        assert!(reason.contains("libcuda"), "{reason}");
        assert!(cuda::device_count().is_err());
    } else {
        match cuda::device_count() {
            Ok(0) => assert!(reason.contains("no GPU"), "{reason}"),
            Ok(_) => assert!(
                reason.contains("not implemented") || reason.contains("NVRTC"),
                "{reason}"
            ),
            Err(e) => assert!(reason.contains("initialise"), "{reason} / {e}"),
        }
    }
    // An ordinal past the last device is refused whatever the machine has.
    let err = Device::cuda(1000).unwrap_err().to_string();
    assert!(err.contains("cuda:1000"), "{err}");
}

#[test]
fn every_kernel_compiles_to_ptx_with_nvrtc() {
    if !cuda::nvrtc_present() {
        let required = std::env::var("EMBERS_REQUIRE_NVRTC").is_ok_and(|v| v == "1");
        assert!(
            !required,
            "EMBERS_REQUIRE_NVRTC=1 but libnvrtc.so cannot be loaded (LD_LIBRARY_PATH?)"
        );
        println!("skipped: NVRTC (libnvrtc.so) not found; CI installs it from PyPI");
        // Compiling without NVRTC is a clear error, not a panic.
        let err = cuda::compile_ptx("tbe_forward.cu", "compute_80").unwrap_err();
        assert!(err.to_string().contains("NVRTC"), "{err}");
        return;
    }
    for arch in ["compute_80", "compute_90"] {
        for (file, _, entries) in KERNELS {
            let ptx = cuda::compile_ptx(file, arch)
                .unwrap_or_else(|e| panic!("{file} does not compile for {arch}: {e}"))
                .to_src();
            let target = format!(".target sm_{}", &arch["compute_".len()..]);
            assert!(ptx.contains(&target), "{file}: no `{target}` in the PTX");
            for entry in *entries {
                assert!(
                    ptx.contains(&format!(".entry {entry}(")),
                    "{file} for {arch}: no entry point `{entry}`"
                );
            }
        }
    }
    // A name that is not a kernel file is an error naming it.
    let err = cuda::compile_ptx("nope.cu", "compute_90").unwrap_err();
    assert!(err.to_string().contains("nope.cu"), "{err}");
    // The PTX was kept on disk; a damaged cache file is recompiled and replaced.
    if let Some(dir) = cuda::kernel_cache_dir() {
        let first = cuda::compile_ptx("sort.cu", "compute_90").unwrap().to_src();
        let file = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .find(|p| {
                let name = p.file_name().unwrap().to_string_lossy().into_owned();
                name.starts_with("sort.cu-compute_90-")
                    && std::fs::read_to_string(p).is_ok_and(|t| t.ends_with(&first))
            })
            .expect("sort.cu's PTX in the kernel cache");
        let whole = std::fs::read_to_string(&file).unwrap();
        assert!(
            whole.starts_with("// embers kernel cache "),
            "{}",
            file.display()
        );
        std::fs::write(&file, &whole[..whole.len() / 2]).unwrap();
        let again = cuda::compile_ptx("sort.cu", "compute_90").unwrap().to_src();
        assert_eq!(again, first);
        assert_eq!(std::fs::read_to_string(&file).unwrap(), whole);
    }
}

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
    for device in devices()? {
        tbe_forward_on(device)?;
    }
    Ok(())
}

fn tbe_forward_on(device: std::sync::Arc<cuda::CudaDevice>) -> embers::Result<()> {
    let c = case();
    for pooling in [PoolingMode::Sum, PoolingMode::Mean] {
        // The CPU reference: an FP32 TBE with per-sample weights.
        let cpu = c.cpu_tbe(pooling, FusedOptimizer::None, WeightDecay::None)?;
        let expected = c.cpu_forward(&cpu)?;
        let gpu = CudaTbe::from_trained(&cpu, device.clone())?;
        let got = gpu.forward_host(&c.indices, &c.offsets, Some(&c.weights))?;
        let on = device.name();
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
            let gpu_q = CudaTbe::from_quantized(&q, device.clone())?;
            let got = gpu_q.forward_host(&c.indices, &c.offsets, Some(&c.weights))?;
            assert_close(&format!("{on}: {types:?} {pooling:?}"), &got, &expected);
        }

        // An out-of-range id is an error naming it, not a read past the table.
        let mut bad = c.indices.clone();
        bad[3] = 1_000_000;
        let err = gpu
            .forward_host(&bad, &c.offsets, None)
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
            let mut gpu = CudaTbe::from_trained(&cpu, device.clone())?;
            assert!(
                gpu.set_vectorized(true),
                "dims 64, 12, {c_dim} allow 16-byte loads"
            );
            let vec4 = gpu.forward_host(&c.indices, &c.offsets, Some(&c.weights))?;
            assert_close(
                &format!("{}: v4 {pooling:?} dim {c_dim}", device.name()),
                &vec4,
                &expected,
            );
            let mut bad = c.indices.clone();
            bad[7] = -1;
            let err = gpu.forward_host(&bad, &c.offsets, None).unwrap_err();
            assert!(err.to_string().contains("position 7"), "{err}");
            assert!(!gpu.set_vectorized(false));
            let scalar = gpu.forward_host(&c.indices, &c.offsets, Some(&c.weights))?;
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
    for device in devices()? {
        tbe_backward_on(device)?;
    }
    Ok(())
}

fn tbe_backward_on(device: std::sync::Arc<cuda::CudaDevice>) -> embers::Result<()> {
    // Dims up to 130 (the general kernel): every optimizer with every decay; up to 128 (the
    // kernel for small dims): every optimizer without decay (emulation time).
    for (c_dim, all_decays) in [(130, true), (128, false)] {
        tbe_backward_steps(&device, &case_with_dim(c_dim), all_decays)?;
    }
    let c = case();
    // A forward-only copy (no fused optimizer) refuses a backward by saying why.
    let cpu = c.cpu_tbe(PoolingMode::Sum, FusedOptimizer::None, WeightDecay::None)?;
    let mut gpu = CudaTbe::from_trained(&cpu, device.clone())?;
    let grad = vec![0.0f32; c.batch * gpu.out_stride()];
    let err = gpu
        .backward_host(&c.indices, &c.offsets, None, &grad)
        .unwrap_err();
    assert!(err.to_string().contains("fused optimizer"), "{err}");
    // A per-sample-weight gradient needs per-sample weights, and room for one value per id;
    // a refused call changes nothing.
    let cpu = c.cpu_tbe(
        PoolingMode::Sum,
        FusedOptimizer::Sgd { lr: 0.1 },
        WeightDecay::None,
    )?;
    let mut gpu = CudaTbe::from_trained(&cpu, device.clone())?;
    let before = gpu.table_state(0)?;
    let n = c.indices.len();
    let indices = device.htod(&c.indices)?;
    let offsets = device.htod(&c.offsets)?;
    let weights = device.htod(&c.weights)?;
    let grad = device.htod(&vec![0.5f32; c.batch * gpu.out_stride()])?;
    let mut room = device.alloc::<f32>(n)?;
    let err = gpu
        .backward(&indices, &offsets, None, &grad, c.batch, Some(&mut room))
        .unwrap_err();
    assert!(err.to_string().contains("per-sample weights"), "{err}");
    let mut short = device.alloc::<f32>(n - 1)?;
    let err = gpu
        .backward(
            &indices,
            &offsets,
            Some(&weights),
            &grad,
            c.batch,
            Some(&mut short),
        )
        .unwrap_err();
    assert!(err.to_string().contains(&format!("room for {n}")), "{err}");
    assert_eq!(gpu.table_state(0)?, before);
    assert_eq!(gpu.step(), 0);
    Ok(())
}

/// Three steps of every fused optimizer (with every weight decay when `all_decays`, else
/// none), sum and mean pooling, on the CPU and the device, compared after each.
fn tbe_backward_steps(
    device: &std::sync::Arc<cuda::CudaDevice>,
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
                let mut gpu = CudaTbe::from_trained(&cpu, device.clone())?;
                // Three steps: the later ones see the accumulators and Adam's bias correction.
                for step in 0..3 {
                    let what = format!(
                        "{}: {optimizer:?} {decay:?} {pooling:?} max dim {} step {step}",
                        device.name(),
                        c.tables.iter().map(|t| t.dim).max().unwrap_or(0)
                    );
                    // The middle step without per-sample weights.
                    step_both(&what, c, &cpu, &mut gpu, &mut rng, step != 1)?;
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
    gpu: &mut CudaTbe,
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
    let got = gpu.forward_host(&c.indices, &c.offsets, host_weights)?;
    assert_close(&format!("{what} forward"), &got, &out.to_vec::<f32>()?);
    let grad = Tensor::randn(out.shape(), 0.0, 1.0, embers::DType::F32, rng);
    out.backward_with(&grad, false)?;
    let weights_grad =
        gpu.backward_host(&c.indices, &c.offsets, host_weights, &grad.to_vec::<f32>()?)?;
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
        let (w, state) = gpu.table_state(t)?;
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

/// The devices to check the kernels on: GPU 0 when there is one, and the host emulation (skipped
/// with the reason printed when no C++ compiler is found, unless `EMBERS_REQUIRE_CUDA_SIM=1`;
/// on a GPU machine also with `EMBERS_SKIP_CUDA_SIM=1`, as `.ci/gpu-check run` sets: CI checks
/// the emulation).
fn devices() -> embers::Result<Vec<std::sync::Arc<cuda::CudaDevice>>> {
    let mut out = Vec::new();
    match cuda::device_count() {
        Ok(n) if n > 0 && cuda::emulated_devices() == 0 => out.push(cuda::device(0)?),
        Ok(_) => println!("no GPU: the CUDA driver reports none"),
        Err(e) => println!("no GPU: {e}"),
    }
    if !out.is_empty() && std::env::var("EMBERS_SKIP_CUDA_SIM").is_ok_and(|v| v == "1") {
        println!("skipped the host emulation: EMBERS_SKIP_CUDA_SIM=1");
        println!("checking on {} ({})", out[0].name(), out[0].arch());
        return Ok(out);
    }
    match cuda::simulated_device(0) {
        Ok(d) => out.push(d),
        Err(e) => {
            let required = std::env::var("EMBERS_REQUIRE_CUDA_SIM").is_ok_and(|v| v == "1");
            assert!(!required, "EMBERS_REQUIRE_CUDA_SIM=1 but {e}");
            println!("skipped the host emulation: {e}");
        }
    }
    for d in &out {
        println!("checking on {} ({})", d.name(), d.arch());
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
    for device in devices()? {
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
            let mut gpu = CudaTbe::from_trained(&cpu, device.clone())?;
            assert_eq!(gpu.output_len(c.batch, n), n * 24);
            let mut rng = embers::tensor::rng::seeded(8);
            for step in 0..2 {
                let what = format!("{}: unpooled {optimizer:?} step {step}", device.name());
                let out = step_both(&what, &c, &cpu, &mut gpu, &mut rng, step == 0)?;
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
            let gpu_q = CudaTbe::from_quantized(&q, device.clone())?;
            let got = gpu_q.forward_host(&c.indices, &c.offsets, Some(&c.weights))?;
            assert_eq!(got.len(), n * 24);
            assert_close(
                &format!("{}: unpooled {types:?}", device.name()),
                &got,
                &expected,
            );
            let mut bad = c.indices.clone();
            bad[5] = -2;
            let err = gpu_q.forward_host(&bad, &c.offsets, None).unwrap_err();
            assert!(err.to_string().contains("position 5"), "{err}");
        }
    }
    Ok(())
}

#[test]
fn radix_sort_is_a_stable_sort_by_the_chosen_bits() -> embers::Result<()> {
    use rand::Rng;
    for device in devices()? {
        let mut rng = embers::tensor::rng::seeded(21);
        // One partial tile, and several tiles with a ragged end; few distinct digits, so
        // stability is visible (the low bits record the input order).
        for (n, low, bits) in [
            (300usize, 24u32, 11u32),
            (2048 * 3 + 17, 24, 20),
            (5000, 0, 64),
        ] {
            let keys: Vec<u64> = (0..n as u64)
                .map(|i| {
                    let field = if bits == 64 {
                        rng.random::<u64>()
                    } else {
                        rng.random_range(0..50u64) << low
                    };
                    if rng.random_range(0..20) == 0 {
                        u64::MAX // out-of-range ids' key
                    } else {
                        field | (i & ((1 << low.max(1)) - 1))
                    }
                })
                .collect();
            let sorted = cuda::radix_sort_u64(device.htod(&keys)?, low, bits)?.to_host()?;
            let mask = if low + bits >= 64 {
                u64::MAX >> low
            } else {
                (1u64 << bits) - 1
            };
            let mut expected = keys.clone();
            expected.sort_by_key(|k| (k >> low) & mask); // stable
            assert_eq!(
                sorted,
                expected,
                "{}: n {n}, bits {low}+{bits}",
                device.name()
            );
        }
        // Bits beyond a u64 are an error.
        let err = cuda::radix_sort_u64(device.htod(&[1u64, 0])?, 60, 8).unwrap_err();
        assert!(err.to_string().contains("u64"), "{err}");
    }
    Ok(())
}

#[test]
fn pinned_buffers_copy_both_ways_and_staged_uploads_keep_their_bytes() -> embers::Result<()> {
    for device in devices()? {
        // Host -> pinned -> device -> pinned -> host, with the host reusing the source right
        // after queuing (writing waits for the copy).
        let n = 10_000;
        let mut up = device.pinned::<f32>(n)?;
        assert_eq!((up.len(), up.bytes()), (n, 4 * n));
        assert!(
            up.as_slice()?.iter().all(|&v| v == 0.0),
            "pinned memory starts zeroed"
        );
        for (i, v) in up.as_mut_slice()?.iter_mut().enumerate() {
            *v = i as f32 * 0.5;
        }
        let mut on_device = device.alloc::<f32>(n)?;
        on_device.copy_from_pinned(&up)?;
        up.as_mut_slice()?.fill(-1.0); // after the upload: the device keeps the old values
        let mut down = device.pinned::<f32>(n)?;
        on_device.copy_to_pinned(&mut down)?;
        let expected: Vec<f32> = (0..n).map(|i| i as f32 * 0.5).collect();
        assert_eq!(down.as_slice()?, &expected[..], "{}", device.name());
        // Many small uploads from pageable memory (through the 16 MiB staging ring on a GPU,
        // about three times around it), each source dropped at once, and one upload too large
        // for a staging chunk: every buffer keeps its own bytes.
        let buffers: Vec<_> = (0..3000u64)
            .map(|i| device.htod(&vec![i; 1 + (i as usize * 37) % 4000]))
            .chain([device.htod(&vec![3000u64; 300_000])])
            .collect::<embers::Result<_>>()?;
        for (i, b) in buffers.iter().enumerate() {
            assert!(b.to_host()?.iter().all(|&v| v == i as u64), "upload {i}");
        }
        // Lengths must agree.
        let short = device.pinned::<f32>(n - 1)?;
        let err = on_device.copy_from_pinned(&short).unwrap_err();
        assert!(err.to_string().contains("copy_from_pinned"), "{err}");
    }
    Ok(())
}

#[test]
fn row_sparse_gradients_of_tables_without_an_optimizer_match_the_cpu() -> embers::Result<()> {
    for device in devices()? {
        let mut c = case();
        // Rows that repeat across bags and across the two features sharing table 0.
        for id in c.indices.iter_mut().step_by(3) {
            *id %= 7;
        }
        for pooling in [PoolingMode::Sum, PoolingMode::Mean] {
            let what = format!("{}: row-sparse {pooling:?}", device.name());
            let cpu = c.cpu_tbe(pooling, FusedOptimizer::None, WeightDecay::None)?;
            let mut gpu = CudaTbe::from_trained(&cpu, device.clone())?;
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
            let before = gpu.forward_host(&c.indices, &c.offsets, None)?;
            let (grads, weights_grad) = gpu.backward_sparse_host(
                &c.indices,
                &c.offsets,
                Some(&c.weights),
                &grad.to_vec::<f32>()?,
            )?;
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
            // The tables did not move, the step was counted; a fused backward is refused.
            let after = gpu.forward_host(&c.indices, &c.offsets, None)?;
            assert_eq!(before, after, "{what}: tables unchanged");
            assert_eq!(gpu.step(), 1);
            let err = gpu
                .backward_host(&c.indices, &c.offsets, None, &grad.to_vec::<f32>()?)
                .unwrap_err();
            assert!(err.to_string().contains("fused optimizer"), "{err}");
        }
        // Tables with a fused optimizer refuse the row-sparse backward.
        let cpu = c.cpu_tbe(
            PoolingMode::Sum,
            FusedOptimizer::Sgd { lr: 0.1 },
            WeightDecay::None,
        )?;
        let mut gpu = CudaTbe::from_trained(&cpu, device.clone())?;
        let grad = vec![0.0f32; c.batch * gpu.out_stride()];
        let err = gpu
            .backward_sparse_host(&c.indices, &c.offsets, None, &grad)
            .unwrap_err();
        assert!(
            err.to_string().contains("without a fused optimizer"),
            "{err}"
        );
    }
    Ok(())
}
