//! The CUDA backend as far as it exists: the device probe, NVRTC compilation of every kernel in
//! `kernels/` (needs NVRTC, not a GPU; CI installs it and sets `EMBERS_REQUIRE_NVRTC=1` so this
//! cannot silently skip there), and — on a machine with a GPU — the TBE forward kernels against
//! the CPU TBE. Without a GPU the GPU test prints why it is skipped.

use embers::cuda::{self, KERNELS};
use embers::embedding::{FusedOptimizer, QuantizedTableBatchedEmbedding, TbeInput, WeightType};
use embers::embedding::{PoolingMode, TableBatchedEmbedding, TableSpec, TbeConfig};
use embers::{Device, Error, Tensor};

#[test]
fn the_device_probe_says_what_is_missing() {
    let err = Device::cuda(0).unwrap_err();
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

fn case() -> Case {
    use rand::Rng;
    let mut rng = embers::tensor::rng::seeded(11);
    let tables = vec![
        TableSpec::new("a", 1000, 64),
        TableSpec::new("b", 300, 12),
        TableSpec::new("c", 50, 130),
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
fn tbe_forward_kernels_match_the_cpu_tbe_on_a_gpu() {
    let count = match cuda::device_count() {
        Ok(n) if n > 0 => n,
        Ok(_) => return println!("skipped: the CUDA driver reports no GPU"),
        Err(e) => return println!("skipped: {e}"),
    };
    assert!(count >= 1);
    gpu::tbe_forward_matches_cpu(&case()).unwrap();
}

mod gpu {
    use super::*;
    use cudarc::driver::{LaunchConfig, PushKernelArg};

    type R<T> = std::result::Result<T, Box<dyn std::error::Error>>;

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

    pub fn tbe_forward_matches_cpu(c: &Case) -> R<()> {
        let device = cuda::device(0)?;
        let stream = device.context().default_stream();
        let f = c.feature_table_map.len();
        let b = c.batch;
        // The CPU reference: FP32 TBE, sum pooling, per-sample weights.
        let cpu = TableBatchedEmbedding::new(TbeConfig::new(
            c.tables.clone(),
            c.feature_table_map.clone(),
            PoolingMode::Sum,
            FusedOptimizer::None,
        ))?;
        let mut rng = embers::tensor::rng::seeded(5);
        let mut flat = Vec::new();
        let mut table_start = Vec::new();
        for (t, spec) in c.tables.iter().enumerate() {
            let w = Tensor::randn(
                &[spec.rows, spec.dim],
                0.0,
                1.0,
                embers::DType::F32,
                &mut rng,
            )
            .to_vec::<f32>()?;
            cpu.set_table_weights(t, &w)?;
            table_start.push(flat.len() as i64);
            flat.extend_from_slice(&w);
        }
        let n = c.indices.len();
        let expected = cpu
            .forward(
                &Tensor::from_vec(c.indices.clone(), &[n])?,
                &Tensor::from_vec(c.offsets.clone(), &[f * b + 1])?,
                Some(&Tensor::from_vec(c.weights.clone(), &[n])?),
            )?
            .to_vec::<f32>()?;
        let dims: Vec<i32> = (c.feature_table_map.iter())
            .map(|&t| c.tables[t].dim as i32)
            .collect();
        let rows: Vec<i64> = (c.feature_table_map.iter())
            .map(|&t| c.tables[t].rows as i64)
            .collect();
        let table_offsets: Vec<i64> = c
            .feature_table_map
            .iter()
            .map(|&t| table_start[t])
            .collect();
        let mut out_offsets = vec![0i32];
        for d in &dims {
            out_offsets.push(out_offsets.last().unwrap() + d);
        }
        let out_stride = out_offsets.pop().unwrap();
        let module = device.module("tbe_forward.cu")?;
        let kernel = module.load_function("tbe_forward_f32")?;
        let d_weights = stream.clone_htod(&flat)?;
        let d_table_offsets = stream.clone_htod(&table_offsets)?;
        let d_rows = stream.clone_htod(&rows)?;
        let d_dims = stream.clone_htod(&dims)?;
        let d_out_offsets = stream.clone_htod(&out_offsets)?;
        let d_indices = stream.clone_htod(&c.indices)?;
        let d_offsets = stream.clone_htod(&c.offsets)?;
        let d_psw = stream.clone_htod(&c.weights)?;
        let mut d_out = stream.alloc_zeros::<f32>(b * out_stride as usize)?;
        let mut d_bad = stream.clone_htod(&[i64::MAX])?;
        let (bi, fi, mean) = (b as i32, f as i32, 0i32);
        let bags = (f * b) as u32;
        let cfg = LaunchConfig {
            grid_dim: (bags.div_ceil(4), 1, 1),
            block_dim: (32, 4, 1),
            shared_mem_bytes: 0,
        };
        let mut launch = stream.launch_builder(&kernel);
        launch
            .arg(&d_weights)
            .arg(&d_table_offsets)
            .arg(&d_rows)
            .arg(&d_dims)
            .arg(&d_out_offsets)
            .arg(&out_stride)
            .arg(&bi)
            .arg(&fi)
            .arg(&d_indices)
            .arg(&d_offsets)
            .arg(&d_psw)
            .arg(&mean)
            .arg(&mut d_out)
            .arg(&mut d_bad);
        // SAFETY: the arguments match the kernel's signature in kernels/tbe_forward.cu.
        unsafe { launch.launch(cfg) }?;
        let got = stream.clone_dtoh(&d_out)?;
        let bad = stream.clone_dtoh(&d_bad)?;
        assert_eq!(bad[0], i64::MAX, "no id was out of range");
        assert_close("FP32", &got, &expected);

        // The quantized inference kernel (INT8, INT4, FP8 tables) against the CPU quantized TBE.
        let types = [WeightType::Int8, WeightType::Int4, WeightType::Fp8];
        let q = QuantizedTableBatchedEmbedding::from_trained(&cpu, &types)?;
        let input = TbeInput::new(&c.indices[..], &c.offsets[..]).with_weights(&c.weights);
        let expected = q.forward(input)?.to_vec::<f32>()?;
        let mut bytes = Vec::new();
        let mut byte_start = Vec::new();
        for t in 0..c.tables.len() {
            byte_start.push(bytes.len() as i64);
            bytes.extend_from_slice(q.table_bytes(t)?);
        }
        let code = |ty: WeightType| match ty {
            WeightType::Int8 => 5i32,
            WeightType::Int4 => 6,
            _ => 3,
        };
        let per_feature = |g: &dyn Fn(usize) -> i64| -> Vec<i64> {
            c.feature_table_map.iter().map(|&t| g(t)).collect()
        };
        let q_offsets = per_feature(&|t| byte_start[t]);
        let row_bytes: Vec<i32> = (c.feature_table_map.iter())
            .map(|&t| types[t].row_bytes(c.tables[t].dim) as i32)
            .collect();
        let type_codes: Vec<i32> = c
            .feature_table_map
            .iter()
            .map(|&t| code(types[t]))
            .collect();
        let kernel = device
            .module("tbe_forward_quantized.cu")?
            .load_function("tbe_forward_quantized")?;
        let d_bytes = stream.clone_htod(&bytes)?;
        let d_q_offsets = stream.clone_htod(&q_offsets)?;
        let d_row_bytes = stream.clone_htod(&row_bytes)?;
        let d_types = stream.clone_htod(&type_codes)?;
        let mut d_out = stream.alloc_zeros::<f32>(b * out_stride as usize)?;
        let mut launch = stream.launch_builder(&kernel);
        launch
            .arg(&d_bytes)
            .arg(&d_q_offsets)
            .arg(&d_rows)
            .arg(&d_row_bytes)
            .arg(&d_dims)
            .arg(&d_types)
            .arg(&d_out_offsets)
            .arg(&out_stride)
            .arg(&bi)
            .arg(&fi)
            .arg(&d_indices)
            .arg(&d_offsets)
            .arg(&d_psw)
            .arg(&mean)
            .arg(&mut d_out)
            .arg(&mut d_bad);
        // SAFETY: the arguments match kernels/tbe_forward_quantized.cu.
        unsafe { launch.launch(cfg) }?;
        let got = stream.clone_dtoh(&d_out)?;
        assert_close("INT8/INT4/FP8", &got, &expected);
        Ok(())
    }
}
