//! The CUDA runtime: the device probe, NVRTC compilation of every kernel in `kernels/` (needs
//! NVRTC, not a GPU; CI installs it and sets `EMBERS_REQUIRE_NVRTC=1` so this cannot silently
//! skip there), the device radix sort and pinned copies — on the GPU when the machine has one,
//! and always on the host emulation (`cuda::simulated_device`, the same kernel sources built by
//! the system C++ compiler; CI sets `EMBERS_REQUIRE_CUDA_SIM=1` so that cannot skip either).
//! The TBE's kernels against the CPU TBE are in `cuda_tbe.rs`.

use embers::cuda;
use embers::{kernels, Device, Error};

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
        let err = kernels::compile_ptx("tbe_forward.cu", "compute_80").unwrap_err();
        assert!(err.to_string().contains("NVRTC"), "{err}");
        return;
    }
    for arch in ["compute_80", "compute_90"] {
        for source in kernels::ALL {
            let (file, entries) = (source.file, source.entries);
            let ptx = cuda::compile_ptx(source, arch)
                .unwrap_or_else(|e| panic!("{file} does not compile for {arch}: {e}"))
                .to_src();
            let target = format!(".target sm_{}", &arch["compute_".len()..]);
            assert!(ptx.contains(&target), "{file}: no `{target}` in the PTX");
            for entry in entries {
                assert!(
                    ptx.contains(&format!(".entry {entry}(")),
                    "{file} for {arch}: no entry point `{entry}`"
                );
            }
        }
    }
    // A name that is not a kernel file is an error naming it.
    let err = kernels::compile_ptx("nope.cu", "compute_90").unwrap_err();
    assert!(err.to_string().contains("nope.cu"), "{err}");
    // The PTX was kept on disk; a damaged cache file is recompiled and replaced.
    if let Some(dir) = cuda::kernel_cache_dir() {
        let first = kernels::compile_ptx("sort.cu", "compute_90")
            .unwrap()
            .to_src();
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
        let again = kernels::compile_ptx("sort.cu", "compute_90")
            .unwrap()
            .to_src();
        assert_eq!(again, first);
        assert_eq!(std::fs::read_to_string(&file).unwrap(), whole);
    }
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
