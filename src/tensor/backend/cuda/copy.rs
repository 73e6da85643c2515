//! Creation, host↔device moves, strided copies, casts and concatenation on a CUDA device.

use super::super::{CopyOps, Cpu, Cuda};
use super::{by_size, device_of, dtype_code, empty, meta, zeroed, Base, ELEMENTWISE, THREADS};
use crate::args;
use crate::cuda::LaunchConfig;
use crate::device::Device;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::tensor::device::same_device;
use crate::tensor::storage::{match_storage, CpuStorage};
use crate::Tensor;

#[allow(clippy::unnecessary_cast)] // the u8 arm of the macro
fn cpu_bytes(s: &CpuStorage) -> &[u8] {
    match_storage!(s, v => {
        // SAFETY: plain numeric elements viewed as their bytes.
        unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, std::mem::size_of_val(&v[..])) }
    })
}

#[allow(clippy::unnecessary_cast)] // the u8 arm of the macro
fn cpu_bytes_mut(s: &mut CpuStorage) -> &mut [u8] {
    match_storage!(s, v => {
        // SAFETY: as above; every bit pattern is a valid element.
        unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr() as *mut u8, std::mem::size_of_val(&v[..])) }
    })
}

/// Copies `n` elements of `src`'s contiguous values from element `src_at` to `dst`'s from
/// element `dst_at` (both CUDA tensors of one dtype and device, contiguous; the ranges are
/// checked to lie inside their views).
pub(crate) fn copy_elements(
    src: &Tensor,
    src_at: usize,
    dst: &Tensor,
    dst_at: usize,
    n: usize,
) -> Result<()> {
    const OP: &str = "copy";
    same_device(OP, src, dst)?;
    if src.dtype() != dst.dtype() || !src.is_contiguous() || !dst.is_contiguous() {
        return Err(Error::invalid(
            OP,
            "device copies need contiguous tensors of one dtype",
        ));
    }
    if src_at + n > src.numel() || dst_at + n > dst.numel() {
        return Err(Error::invalid(
            OP,
            format!(
                "{n} elements from {src_at} of {} into {dst_at} of {}",
                src.numel(),
                dst.numel()
            ),
        ));
    }
    if n == 0 {
        return Ok(());
    }
    let size = src.dtype().size_in_bytes();
    let (s, d) = (
        src.layout().offset() + src_at,
        dst.layout().offset() + dst_at,
    );
    device_of(dst)?.copy_bytes(&Base(dst), d * size, &Base(src), s * size, n * size)
}

impl CopyOps for Cuda {
    fn from_host(t: &Tensor, device: Device) -> Result<Tensor> {
        let dev = crate::cuda::open(device)?;
        let host = t.contiguous_values()?;
        let guard = host.storage_read();
        let cpu = guard.cpu("to_device")?;
        let out = empty(&dev, t.dtype(), t.shape())?;
        dev.write_bytes(&Base(&out), 0, cpu_bytes(cpu))?;
        Ok(out)
    }

    fn to_host(t: &Tensor) -> Result<Tensor> {
        let c = Self::contiguous(t)?;
        let mut host = CpuStorage::zeros(t.dtype(), t.numel());
        device_of(&c)?.read_bytes(&Base(&c), 0, cpu_bytes_mut(&mut host))?;
        Ok(Tensor::from_cpu(host, t.shape()))
    }

    /// A contiguous copy of a CUDA tensor's view (the same tensor if already contiguous from the
    /// start of its storage).
    fn contiguous(t: &Tensor) -> Result<Tensor> {
        let dev = device_of(t)?;
        let l = t.layout();
        if l.is_contiguous() && l.offset() == 0 && t.storage_len() == t.numel() {
            return Ok(t.detach());
        }
        let out = empty(&dev, t.dtype(), t.shape())?;
        let n = t.numel();
        if n == 0 {
            return Ok(out);
        }
        let m = meta(&dev, t.shape(), &[(l.strides(), l.offset())])?;
        let kernel = by_size(
            &ELEMENTWISE,
            ["gather_b1", "gather_b2", "gather_b4", "gather_b8"],
            t.dtype(),
        );
        // `meta` describes a view inside the source storage; the output holds n elements.
        dev.launch(
            kernel,
            LaunchConfig::linear(n, THREADS),
            &args![Base(t), out, n as i64, m],
        )?;
        Ok(out)
    }

    /// `t`'s values converted to `dtype` on its device, as the CPU's `to_dtype` converts them.
    fn cast(t: &Tensor, dtype: DType) -> Result<Tensor> {
        let dev = device_of(t)?;
        let out = empty(&dev, dtype, t.shape())?;
        let n = t.numel();
        if n == 0 {
            return Ok(out);
        }
        let l = t.layout();
        let m = meta(&dev, t.shape(), &[(l.strides(), l.offset())])?;
        // `meta` describes a view inside the source storage; the output holds n elements.
        dev.launch(
            ELEMENTWISE.kernel("cast_strided"),
            LaunchConfig::linear(n, THREADS),
            &args![
                Base(t),
                dtype_code(t.dtype()),
                out,
                dtype_code(dtype),
                n as i64,
                m
            ],
        )?;
        Ok(out)
    }

    /// A tensor of `shape` filled with `value` on CUDA device `device`.
    fn full(value: f64, shape: &[usize], dtype: DType, device: Device) -> Result<Tensor> {
        if value == 0.0 {
            return zeroed(&crate::cuda::open(device)?, dtype, shape);
        }
        // Other values: made on the host (one copy), for every dtype alike.
        let host = <Cpu as CopyOps>::full(value, shape, dtype, Device::Cpu)?;
        Self::from_host(&host, device)
    }

    /// Overwrites the values of `dst` (a contiguous CUDA tensor) with those of `src` (same shape,
    /// any device, cast to `dst`'s dtype).
    fn copy_into(dst: &Tensor, src: &Tensor) -> Result<()> {
        if !dst.is_contiguous() {
            return Err(Error::invalid(
                "copy_from",
                "the destination on a CUDA device must be contiguous",
            ));
        }
        // Contiguous (a transposed or expanded source on the device was refused), and a copy
        // of its own when it views the destination's storage (read before any is written).
        let src = src
            .to_device_values(dst.device())?
            .cast_values(dst.dtype())?;
        let own = src.shares_storage_with(dst);
        if !(own && src.layout() == dst.layout()) {
            // (A view of the destination itself is a copy of nothing.)
            let src = if src.is_contiguous() && !own {
                src
            } else {
                Self::contiguous(&src)?
            };
            copy_elements(&src, 0, dst, 0, dst.numel())?;
        }
        // A write in place: counted for the backwards that saved `dst` (`Tensor::version`).
        dst.mark_modified();
        Ok(())
    }

    /// Concatenation along `dim` of same-device CUDA tensors (shapes checked by the caller) into a
    /// new contiguous tensor of `shape`: each part is written into its slice of the output.
    fn cat(parts: &[Tensor], dim: usize, shape: &[usize]) -> Result<Tensor> {
        let first = &parts[0];
        let dev = device_of(first)?;
        let out = empty(&dev, first.dtype(), shape)?;
        let strides = out.layout().strides().to_vec();
        let kernel = by_size(
            &ELEMENTWISE,
            ["scatter_b1", "scatter_b2", "scatter_b4", "scatter_b8"],
            first.dtype(),
        );
        let mut start = 0;
        for p in parts {
            same_device("cat", first, p)?;
            let n = p.numel();
            if n > 0 {
                let src = Self::contiguous(p)?;
                let m = meta(&dev, p.shape(), &[(&strides, start * strides[dim])])?;
                // The part's slice of the output (its shape at offset `start` along `dim`, the
                // output's strides) lies inside the output; the source holds n elements.
                dev.launch(
                    kernel,
                    LaunchConfig::linear(n, THREADS),
                    &args![src, Base(&out), n as i64, m],
                )?;
            }
            start += p.shape()[dim];
        }
        Ok(out)
    }
}
