//! The tensor core on CUDA devices: storage in device memory, host↔device moves, and the value
//! kernels behind the ops that have a CUDA path — strided copies (any dtype), broadcasting
//! binary arithmetic, the float functions and their derivatives, sums over dimensions and
//! matrix products (f32). The ops in `ops/` call these when their operands live on a CUDA
//! device; autograd needs nothing more, since backward passes are built from the same ops. An
//! op without a CUDA path fails with an error naming it and the device.

use std::sync::Arc;

use super::dtype::DType;
use super::storage::{CpuStorage, Storage};
use crate::cuda::{self, CudaDevice, DeviceBuffer, KernelArgs, LaunchConfig};
use crate::{Device, Error, Result, Tensor};

/// Threads per block of the element-wise launches.
const THREADS: u32 = 256;

/// A tensor's storage in device memory: raw bytes of `len` elements of `dtype`.
pub struct CudaStorage {
    pub(crate) buffer: DeviceBuffer<u8>,
    pub(crate) dtype: DType,
    pub(crate) len: usize,
}

impl std::fmt::Debug for CudaStorage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "CudaStorage(cuda:{}, {:?} x {})",
            self.buffer.device().ordinal(),
            self.dtype,
            self.len
        )
    }
}

impl CudaStorage {
    /// The device holding the storage.
    pub fn device(&self) -> &Arc<CudaDevice> {
        self.buffer.device()
    }
}

/// The open device behind `Device::Cuda(n)`.
pub(crate) fn open(device: Device) -> Result<Arc<CudaDevice>> {
    match device {
        Device::Cuda(n) => cuda::device(n),
        Device::Cpu => Err(Error::invalid("cuda", "the CPU is not a CUDA device")),
    }
}

/// Device, base address (of element 0 of the storage) of a CUDA tensor.
fn raw(t: &Tensor) -> Result<(Arc<CudaDevice>, u64)> {
    let guard = t.storage_read();
    match &*guard {
        Storage::Cuda(s) => Ok((s.device().clone(), s.buffer.ptr())),
        Storage::Cpu(_) => Err(Error::invalid("cuda", "the tensor is on the CPU")),
    }
}

/// Address of the first element of `t`'s view.
fn view_ptr(t: &Tensor) -> Result<(Arc<CudaDevice>, u64)> {
    let (d, base) = raw(t)?;
    Ok((
        d,
        base + (t.layout().offset() * t.dtype().size_in_bytes()) as u64,
    ))
}

/// A new uninitialised contiguous tensor on `device`.
fn empty(device: &Arc<CudaDevice>, dtype: DType, shape: &[usize]) -> Result<Tensor> {
    let len: usize = shape.iter().product();
    let buffer = device.alloc::<u8>(len * dtype.size_in_bytes())?;
    Ok(Tensor::from_cuda(CudaStorage { buffer, dtype, len }, shape))
}

/// The `meta` array the strided kernels take: rank, shape, then strides and offset per operand.
fn meta(
    device: &Arc<CudaDevice>,
    shape: &[usize],
    operands: &[(&[usize], usize)],
) -> Result<DeviceBuffer<i64>> {
    let mut m = vec![shape.len() as i64];
    m.extend(shape.iter().map(|&s| s as i64));
    for (strides, offset) in operands {
        m.extend(strides.iter().map(|&s| s as i64));
        m.push(*offset as i64);
    }
    device.htod(&m)
}

fn expect_f32(op: &'static str, t: &Tensor) -> Result<()> {
    if t.dtype() != DType::F32 {
        return Err(Error::UnsupportedDType {
            op,
            dtype: t.dtype(),
            expected: "f32 on CUDA devices (other dtypes: move to the CPU)",
        });
    }
    Ok(())
}

/// `t`'s values on `device` (no autograd history).
pub(crate) fn move_values(t: &Tensor, device: Device) -> Result<Tensor> {
    match (t.device(), device) {
        (a, b) if a == b => Ok(t.detach()),
        (Device::Cpu, Device::Cuda(_)) => {
            let dev = open(device)?;
            let host = t.contiguous_values()?;
            let guard = host.storage_read();
            let cpu = guard.cpu("to_device")?;
            let out = empty(&dev, t.dtype(), t.shape())?;
            {
                let g = out.storage_read();
                let Storage::Cuda(s) = &*g else {
                    unreachable!("just made on a CUDA device")
                };
                dev.copy_from_host(s.buffer.ptr(), cpu_bytes(cpu))?;
            }
            Ok(out)
        }
        (Device::Cuda(_), Device::Cpu) => {
            let c = contiguous(t)?;
            let (dev, ptr) = view_ptr(&c)?;
            let mut host = CpuStorage::zeros(t.dtype(), t.numel());
            dev.copy_to_host(cpu_bytes_mut(&mut host), ptr)?;
            Ok(Tensor::from_cpu(host, t.shape()))
        }
        (Device::Cuda(_), Device::Cuda(_)) => move_values(&move_values(t, Device::Cpu)?, device),
        (Device::Cpu, Device::Cpu) => unreachable!("equal devices returned above"),
    }
}

#[allow(clippy::unnecessary_cast)] // the u8 arm of the macro
fn cpu_bytes(s: &CpuStorage) -> &[u8] {
    super::storage::match_storage!(s, v => {
        // SAFETY: plain numeric elements viewed as their bytes.
        unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, std::mem::size_of_val(&v[..])) }
    })
}

#[allow(clippy::unnecessary_cast)] // the u8 arm of the macro
fn cpu_bytes_mut(s: &mut CpuStorage) -> &mut [u8] {
    super::storage::match_storage!(s, v => {
        // SAFETY: as above; every bit pattern is a valid element.
        unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr() as *mut u8, std::mem::size_of_val(&v[..])) }
    })
}

/// A contiguous copy of a CUDA tensor's view (the same tensor if already contiguous from the
/// start of its storage).
pub(crate) fn contiguous(t: &Tensor) -> Result<Tensor> {
    let (dev, base) = raw(t)?;
    let l = t.layout();
    if l.is_contiguous() && l.offset() == 0 && storage_len(t) == t.numel() {
        return Ok(t.detach());
    }
    let out = empty(&dev, t.dtype(), t.shape())?;
    let n = t.numel();
    if n == 0 {
        return Ok(out);
    }
    let m = meta(&dev, t.shape(), &[(l.strides(), l.offset())])?;
    let kernel = match t.dtype().size_in_bytes() {
        1 => "gather_b1",
        2 => "gather_b2",
        4 => "gather_b4",
        _ => "gather_b8",
    };
    let (_, dst) = raw(&out)?;
    let mut args = KernelArgs::new();
    args.pointer(base).pointer(dst).i64(n as i64).buffer(&m);
    // SAFETY: `meta` describes a view inside the source storage; the output holds n elements.
    unsafe { dev.launch(kernel, LaunchConfig::linear(n, THREADS), &mut args)? };
    Ok(out)
}

fn storage_len(t: &Tensor) -> usize {
    match &*t.storage_read() {
        Storage::Cuda(s) => s.len,
        Storage::Cpu(s) => s.len(),
    }
}

fn same_device(op: &'static str, a: &Tensor, b: &Tensor) -> Result<()> {
    if a.device() != b.device() {
        return Err(Error::DeviceMismatch {
            op,
            lhs: a.device(),
            rhs: b.device(),
        });
    }
    Ok(())
}

/// Broadcasting `a op b` (op codes of `kernels/elementwise.cu`: add, sub, mul, div, max, min).
pub(crate) fn binary_f32(op: &'static str, code: i32, a: &Tensor, b: &Tensor) -> Result<Tensor> {
    same_device(op, a, b)?;
    expect_f32(op, a)?;
    expect_f32(op, b)?;
    let shape = super::layout::broadcast_shapes(op, a.shape(), b.shape())?;
    let (dev, pa) = raw(a)?;
    let (_, pb) = raw(b)?;
    let out = empty(&dev, DType::F32, &shape)?;
    let n: usize = shape.iter().product();
    if n == 0 {
        return Ok(out);
    }
    let (sa, sb) = (
        a.layout().broadcast_strides(&shape),
        b.layout().broadcast_strides(&shape),
    );
    let m = meta(
        &dev,
        &shape,
        &[(&sa, a.layout().offset()), (&sb, b.layout().offset())],
    )?;
    let (_, po) = raw(&out)?;
    let mut args = KernelArgs::new();
    args.pointer(pa)
        .pointer(pb)
        .pointer(po)
        .i32(code)
        .i64(n as i64)
        .buffer(&m);
    // SAFETY: the views lie inside their storages; the output holds n elements.
    unsafe {
        dev.launch(
            "binary_strided_f32",
            LaunchConfig::linear(n, THREADS),
            &mut args,
        )?
    };
    Ok(out)
}

/// The code of a float function in `kernels/elementwise.cu`, by the op's name.
pub(crate) fn unary_code(name: &str) -> Option<i32> {
    Some(match name {
        "neg" => 0,
        "exp" => 1,
        "log" => 2,
        "sqrt" => 3,
        "abs" => 4,
        "relu" => 5,
        "tanh" => 6,
        "sigmoid" => 7,
        "gelu" => 8,
        "gelu_tanh" => 9,
        "affine" => 10,
        "pow" => 11,
        "clamp" => 12,
        _ => return None,
    })
}

fn unary_code_or_err(name: &'static str) -> Result<i32> {
    unary_code(name).ok_or_else(|| {
        Error::invalid(
            name,
            "this function has no CUDA kernel yet (move the tensor to the CPU)",
        )
    })
}

/// `f(x)` for float function `name` with parameters `p`.
pub(crate) fn unary_f32(name: &'static str, p: (f64, f64), x: &Tensor) -> Result<Tensor> {
    expect_f32(name, x)?;
    let code = unary_code_or_err(name)?;
    let x = contiguous(x)?;
    let (dev, px) = raw(&x)?;
    let out = empty(&dev, DType::F32, x.shape())?;
    let n = x.numel();
    if n > 0 {
        let (_, po) = raw(&out)?;
        let mut args = KernelArgs::new();
        args.pointer(px)
            .pointer(po)
            .i32(code)
            .f32(p.0 as f32)
            .f32(p.1 as f32)
            .i64(n as i64);
        // SAFETY: contiguous input and output of n elements.
        unsafe { dev.launch("unary_fn_f32", LaunchConfig::linear(n, THREADS), &mut args)? };
    }
    Ok(out)
}

/// `g · f'(x, y)` for float function `name`.
pub(crate) fn unary_backward_f32(
    name: &'static str,
    p: (f64, f64),
    x: &Tensor,
    y: &Tensor,
    g: &Tensor,
) -> Result<Tensor> {
    let code = unary_code_or_err(name)?;
    for t in [x, y, g] {
        expect_f32(name, t)?;
        same_device(name, x, t)?;
    }
    let (x, y, g) = (contiguous(x)?, contiguous(y)?, contiguous(g)?);
    let (dev, px) = raw(&x)?;
    let out = empty(&dev, DType::F32, x.shape())?;
    let n = x.numel();
    if n > 0 {
        let (_, py) = raw(&y)?;
        let (_, pg) = raw(&g)?;
        let (_, po) = raw(&out)?;
        let mut args = KernelArgs::new();
        args.pointer(px)
            .pointer(py)
            .pointer(pg)
            .pointer(po)
            .i32(code)
            .f32(p.0 as f32)
            .f32(p.1 as f32)
            .i64(n as i64);
        // SAFETY: contiguous inputs and output of n elements each.
        unsafe {
            dev.launch(
                "unary_backward_f32",
                LaunchConfig::linear(n, THREADS),
                &mut args,
            )?
        };
    }
    Ok(out)
}

/// Sum over `dims` (sorted, distinct), keeping them as size 1.
pub(crate) fn sum_dims_f32(x: &Tensor, dims: &[usize]) -> Result<Tensor> {
    expect_f32("sum", x)?;
    let mut cur = contiguous(x)?;
    for &d in dims {
        let shape = cur.shape().to_vec();
        let (outer, r, inner) = super::ops::reduce::split_at_dim(&shape, d);
        let (dev, pi) = raw(&cur)?;
        let mut out_shape = shape.clone();
        out_shape[d] = 1;
        let out = empty(&dev, DType::F32, &out_shape)?;
        if outer * inner > 0 {
            let (_, po) = raw(&out)?;
            let mut args = KernelArgs::new();
            args.pointer(pi)
                .pointer(po)
                .i64(outer as i64)
                .i64(r as i64)
                .i64(inner as i64);
            // SAFETY: contiguous [outer, r, inner] input and [outer, inner] output.
            unsafe {
                dev.launch(
                    "sum_middle_f32",
                    LaunchConfig::linear(outer * inner, THREADS),
                    &mut args,
                )?
            };
        }
        cur = out;
    }
    Ok(cur)
}

/// `a · b` over the last two dimensions with broadcast batch dimensions (f32).
pub(crate) fn matmul_f32(a: &Tensor, b: &Tensor, batch: &[usize]) -> Result<Tensor> {
    same_device("matmul", a, b)?;
    expect_f32("matmul", a)?;
    expect_f32("matmul", b)?;
    let (ar, br) = (a.rank(), b.rank());
    let (m, k, n) = (a.shape()[ar - 2], a.shape()[ar - 1], b.shape()[br - 1]);
    let nb: usize = batch.iter().product();
    // An operand without batch dimensions is shared by every product (stride 0); otherwise it
    // is expanded to the full batch and made contiguous.
    let operand = |t: &Tensor, rows: usize, cols: usize| -> Result<(Tensor, usize)> {
        if t.rank() == 2 {
            return Ok((contiguous(t)?, 0));
        }
        let mut full = batch.to_vec();
        full.extend([rows, cols]);
        Ok((contiguous(&t.expand(&full)?.detach())?, rows * cols))
    };
    let (ac, stride_a) = operand(a, m, k)?;
    let (bc, stride_b) = operand(b, k, n)?;
    let mut shape = batch.to_vec();
    shape.extend([m, n]);
    let (dev, pa) = raw(&ac)?;
    let (_, pb) = raw(&bc)?;
    let out = empty(&dev, DType::F32, &shape)?;
    if k == 0 {
        // An empty inner dimension: the product is all zeros.
        let g = out.storage_read();
        if let Storage::Cuda(s) = &*g {
            dev.zero_bytes(s.buffer.ptr(), s.buffer.bytes())?;
        }
        drop(g);
        return Ok(out);
    }
    let (_, pc) = raw(&out)?;
    dev.gemm_f32(&cuda::Gemm {
        batch: nb,
        m,
        n,
        k,
        a: pa,
        stride_a,
        b: pb,
        stride_b,
        c: pc,
    })?;
    Ok(out)
}

/// A tensor of `shape` filled with `value` on CUDA device `device`.
pub(crate) fn full(value: f64, shape: &[usize], dtype: DType, device: Device) -> Result<Tensor> {
    let dev = open(device)?;
    let out = empty(&dev, dtype, shape)?;
    if value == 0.0 {
        let g = out.storage_read();
        if let Storage::Cuda(s) = &*g {
            dev.zero_bytes(s.buffer.ptr(), s.buffer.bytes())?;
        }
        drop(g);
        return Ok(out);
    }
    // Other values: made on the host (one copy), for every dtype alike.
    let host = Tensor::full(value, shape, dtype, Device::Cpu);
    move_values(&host, device)
}

struct ToDeviceBackward {
    source: Device,
}

impl super::autograd::BackwardOp for ToDeviceBackward {
    fn name(&self) -> &'static str {
        "to_device"
    }
    fn backward(&self, g: &Tensor) -> Result<Vec<Option<super::autograd::Gradient>>> {
        Ok(vec![Some(super::autograd::Gradient::Dense(move_values(
            g,
            self.source,
        )?))])
    }
}

impl Tensor {
    /// This tensor's values on `device` (the same tensor when already there). Differentiable:
    /// the gradient moves back to this tensor's device.
    pub fn to_device(&self, device: Device) -> Result<Tensor> {
        if self.device() == device {
            return Ok(self.clone());
        }
        let out = move_values(self, device)?;
        Ok(super::autograd::record_op(
            out,
            &[self],
            ToDeviceBackward {
                source: self.device(),
            },
        ))
    }
}
