//! The tensor core on CUDA devices: storage in device memory, host↔device moves, and the value
//! kernels behind the ops that have a CUDA path — strided copies, dtype casts, comparisons,
//! `where`, gather and arithmetic for every dtype (integers wrap around), and for f32, f16 and
//! bf16 (computed in f32, rounded once, as on the CPU) the float functions and their
//! derivatives, sums, maxima and softmax over dimensions and matrix products (cuBLAS). The ops
//! in `ops/` call these when their operands live on a CUDA device; autograd needs nothing
//! more, since backward passes are built from the same ops. An op without a CUDA path fails
//! with an error naming it and the device.

use std::sync::Arc;

use super::device::same_device;
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

/// A new contiguous tensor of zeros on `device`.
fn zeroed(device: &Arc<CudaDevice>, dtype: DType, shape: &[usize]) -> Result<Tensor> {
    let out = empty(device, dtype, shape)?;
    device.zero_bytes(raw(&out)?.1, out.numel() * dtype.size_in_bytes())?;
    Ok(out)
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

/// The three instantiations (f32, f16, bf16) of a float kernel of `kernels/elementwise.cu`.
macro_rules! float_kernels {
    ($base:literal) => {
        [
            concat!($base, "_f32"),
            concat!($base, "_f16"),
            concat!($base, "_bf16"),
        ]
    };
}

/// The instantiation of `kernels` (see [`float_kernels`]) for `t`'s dtype; other dtypes are
/// refused naming `op`.
/// The `meta` of `operands` broadcast to `shape` (each by its own strides and offset).
fn broadcast_meta(
    device: &Arc<CudaDevice>,
    shape: &[usize],
    operands: &[&Tensor],
) -> Result<DeviceBuffer<i64>> {
    let strides: Vec<(Vec<usize>, usize)> = (operands.iter())
        .map(|t| (t.layout().broadcast_strides(shape), t.layout().offset()))
        .collect();
    let views: Vec<(&[usize], usize)> = strides.iter().map(|(s, o)| (&s[..], *o)).collect();
    meta(device, shape, &views)
}

fn float_kernel(op: &'static str, t: &Tensor, kernels: [&'static str; 3]) -> Result<&'static str> {
    match t.dtype() {
        DType::F32 => Ok(kernels[0]),
        DType::F16 => Ok(kernels[1]),
        DType::BF16 => Ok(kernels[2]),
        dtype => Err(Error::Device {
            device: t.device(),
            op,
            msg: format!(
                "no CUDA kernel for {dtype:?} tensors (f32, f16 and bf16 have one; move other \
                 dtypes to the CPU with to_device)"
            ),
        }),
    }
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
            dev.copy_from_host(raw(&out)?.1, cpu_bytes(cpu))?;
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

/// Broadcasting `a op b` (op codes of `kernels/elementwise.cu`: add, sub, mul, div, max, min)
/// of tensors of one dtype (the caller checks that they match): floats computed in f32,
/// integers wrapping around, an integer division by zero an error (as on the CPU).
pub(crate) fn binary(op: &'static str, code: i32, a: &Tensor, b: &Tensor) -> Result<Tensor> {
    same_device(op, a, b)?;
    let kernel = match a.dtype() {
        DType::I64 => "binary_strided_i64",
        DType::I32 => "binary_strided_i32",
        DType::U8 => "binary_strided_u8",
        _ => float_kernel(op, a, float_kernels!("binary_strided"))?,
    };
    if code == 3 && !a.dtype().is_float() {
        // Integer division: find a zero divisor before dividing (reads the divisor back).
        let zeros = compare("div", 0, b, &Tensor::zeros(&[], b.dtype(), b.device()))?;
        let host = zeros.contiguous_values()?.to_vec::<u8>()?;
        if let Some(p) = host.iter().position(|&z| z != 0) {
            return Err(Error::invalid(
                op,
                format!("integer division by zero at position {p} of the divisor"),
            ));
        }
    }
    let shape = super::layout::broadcast_shapes(op, a.shape(), b.shape())?;
    let (dev, pa) = raw(a)?;
    let (_, pb) = raw(b)?;
    let out = empty(&dev, a.dtype(), &shape)?;
    let n: usize = shape.iter().product();
    if n == 0 {
        return Ok(out);
    }
    let m = broadcast_meta(&dev, &shape, &[a, b])?;
    let (_, po) = raw(&out)?;
    let mut args = KernelArgs::new();
    args.pointer(pa)
        .pointer(pb)
        .pointer(po)
        .i32(code)
        .i64(n as i64)
        .buffer(&m);
    // SAFETY: the views lie inside their storages; the output holds n elements.
    unsafe { dev.launch(kernel, LaunchConfig::linear(n, THREADS), &mut args)? };
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
pub(crate) fn unary_float(name: &'static str, p: (f64, f64), x: &Tensor) -> Result<Tensor> {
    let kernel = float_kernel(name, x, float_kernels!("unary_fn"))?;
    let code = unary_code_or_err(name)?;
    let x = contiguous(x)?;
    let (dev, px) = raw(&x)?;
    let out = empty(&dev, x.dtype(), x.shape())?;
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
        unsafe { dev.launch(kernel, LaunchConfig::linear(n, THREADS), &mut args)? };
    }
    Ok(out)
}

/// `g · f'(x, y)` for float function `name` (all three of one float dtype).
pub(crate) fn unary_backward_float(
    name: &'static str,
    p: (f64, f64),
    x: &Tensor,
    y: &Tensor,
    g: &Tensor,
) -> Result<Tensor> {
    let code = unary_code_or_err(name)?;
    let kernel = float_kernel(name, x, float_kernels!("unary_backward"))?;
    for t in [y, g] {
        same_device(name, x, t)?;
        if t.dtype() != x.dtype() {
            return Err(Error::DTypeMismatch {
                op: name,
                lhs: x.dtype(),
                rhs: t.dtype(),
            });
        }
    }
    let (x, y, g) = (contiguous(x)?, contiguous(y)?, contiguous(g)?);
    let (dev, px) = raw(&x)?;
    let out = empty(&dev, x.dtype(), x.shape())?;
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
        unsafe { dev.launch(kernel, LaunchConfig::linear(n, THREADS), &mut args)? };
    }
    Ok(out)
}

/// Sum over `dims` (sorted, distinct), keeping them as size 1: floats with f64 accumulation,
/// rounded to f32 and then to the dtype of `x`; integers wrapping around, as on the CPU.
pub(crate) fn sum_dims(x: &Tensor, dims: &[usize]) -> Result<Tensor> {
    let kernel = match x.dtype() {
        DType::I64 => "sum_middle_i64",
        DType::I32 => "sum_middle_i32",
        DType::U8 => "sum_middle_u8",
        _ => float_kernel("sum", x, float_kernels!("sum_middle"))?,
    };
    // Float rows along the last dimension: a warp per row.
    let rows_kernel = x
        .dtype()
        .is_float()
        .then(|| float_kernel("sum", x, float_kernels!("sum_rows")))
        .transpose()?;
    let mut cur = contiguous(x)?;
    for &d in dims {
        let shape = cur.shape().to_vec();
        let (outer, r, inner) = super::ops::reduce::split_at_dim(&shape, d);
        let (dev, pi) = raw(&cur)?;
        let mut out_shape = shape.clone();
        out_shape[d] = 1;
        let out = empty(&dev, x.dtype(), &out_shape)?;
        if let (Some(rows_kernel), 1, true) = (rows_kernel, inner, outer > 0 && r >= 64) {
            let (_, po) = raw(&out)?;
            let mut args = KernelArgs::new();
            args.pointer(pi).pointer(po).i64(outer as i64).i64(r as i64);
            // SAFETY: contiguous [outer, r] input and [outer] output.
            unsafe {
                dev.launch(
                    rows_kernel,
                    LaunchConfig::warp_per_item(outer, 4),
                    &mut args,
                )?
            };
        } else if outer * inner > 0 {
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
                    kernel,
                    LaunchConfig::linear(outer * inner, THREADS),
                    &mut args,
                )?
            };
        }
        cur = out;
    }
    Ok(cur)
}

/// `a · b` over the last two dimensions with broadcast batch dimensions, for f32 (TF32 when
/// the device allows it) and f16/bf16 (f32 accumulation, one rounding of each result); the
/// operands have one dtype (the caller checks).
pub(crate) fn matmul_float(a: &Tensor, b: &Tensor, batch: &[usize]) -> Result<Tensor> {
    same_device("matmul", a, b)?;
    let dtype = a.dtype();
    float_kernel("matmul", a, ["f32", "f16", "bf16"])?;
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
    if k == 0 {
        // An empty inner dimension: the product is all zeros.
        return zeroed(&dev, dtype, &shape);
    }
    let out = empty(&dev, dtype, &shape)?;
    let (_, pc) = raw(&out)?;
    dev.gemm(&cuda::Gemm {
        dtype,
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

/// `t`'s values converted to `dtype` on its device, as the CPU's `to_dtype` converts them
/// (`kernels/elementwise.cu`, `cast_strided`).
pub(crate) fn cast(t: &Tensor, dtype: DType) -> Result<Tensor> {
    let (dev, base) = raw(t)?;
    let out = empty(&dev, dtype, t.shape())?;
    let n = t.numel();
    if n == 0 {
        return Ok(out);
    }
    let l = t.layout();
    let m = meta(&dev, t.shape(), &[(l.strides(), l.offset())])?;
    let (_, dst) = raw(&out)?;
    let mut args = KernelArgs::new();
    args.pointer(base)
        .i32(dtype_code(t.dtype()))
        .pointer(dst)
        .i32(dtype_code(dtype))
        .i64(n as i64)
        .buffer(&m);
    // SAFETY: `meta` describes a view inside the source storage; the output holds n elements.
    unsafe { dev.launch("cast_strided", LaunchConfig::linear(n, THREADS), &mut args)? };
    Ok(out)
}

/// `a op b` as a u8 mask over broadcast operands of one dtype (any dtype; op codes of
/// `compare_strided`: 0 ==, 1 <, 2 <=, 3 >, 4 >=).
pub(crate) fn compare(op: &'static str, code: i32, a: &Tensor, b: &Tensor) -> Result<Tensor> {
    same_device(op, a, b)?;
    let shape = super::layout::broadcast_shapes(op, a.shape(), b.shape())?;
    let (dev, pa) = raw(a)?;
    let (_, pb) = raw(b)?;
    let out = empty(&dev, DType::U8, &shape)?;
    let n: usize = shape.iter().product();
    if n == 0 {
        return Ok(out);
    }
    let m = broadcast_meta(&dev, &shape, &[a, b])?;
    let (_, po) = raw(&out)?;
    let mut args = KernelArgs::new();
    args.pointer(pa)
        .pointer(pb)
        .i32(dtype_code(a.dtype()))
        .pointer(po)
        .i32(code)
        .i64(n as i64)
        .buffer(&m);
    // SAFETY: the views lie inside their storages; the output holds n bytes.
    unsafe {
        dev.launch(
            "compare_strided",
            LaunchConfig::linear(n, THREADS),
            &mut args,
        )?
    };
    Ok(out)
}

/// `cond ? a : b` broadcast to `shape` (cond u8; a and b of one dtype, any).
pub(crate) fn where_cond(cond: &Tensor, a: &Tensor, b: &Tensor, shape: &[usize]) -> Result<Tensor> {
    same_device("where", cond, a)?;
    same_device("where", a, b)?;
    let (dev, pc) = raw(cond)?;
    let (_, pa) = raw(a)?;
    let (_, pb) = raw(b)?;
    let out = empty(&dev, a.dtype(), shape)?;
    let n: usize = shape.iter().product();
    if n == 0 {
        return Ok(out);
    }
    let m = broadcast_meta(&dev, shape, &[cond, a, b])?;
    let kernel = match a.dtype().size_in_bytes() {
        1 => "where_b1",
        2 => "where_b2",
        4 => "where_b4",
        _ => "where_b8",
    };
    let (_, po) = raw(&out)?;
    let mut args = KernelArgs::new();
    args.pointer(pc)
        .pointer(pa)
        .pointer(pb)
        .pointer(po)
        .i64(n as i64)
        .buffer(&m);
    // SAFETY: the views lie inside their storages; the output holds n elements.
    unsafe { dev.launch(kernel, LaunchConfig::linear(n, THREADS), &mut args)? };
    Ok(out)
}

/// softmax (or log_softmax) of `x` along dimension `d`, no autograd.
pub(crate) fn softmax(x: &Tensor, d: usize, log: bool) -> Result<Tensor> {
    let op = if log { "log_softmax" } else { "softmax" };
    let kernel = float_kernel(op, x, float_kernels!("softmax_middle"))?;
    let rows_kernel = float_kernel(op, x, float_kernels!("softmax_rows"))?;
    let x = contiguous(x)?;
    let (outer, r, inner) = super::ops::reduce::split_at_dim(x.shape(), d);
    let (dev, px) = raw(&x)?;
    let out = empty(&dev, x.dtype(), x.shape())?;
    if inner == 1 && outer > 0 && r > 0 {
        // Along the last dimension: a warp per row.
        let (_, po) = raw(&out)?;
        let mut args = KernelArgs::new();
        args.pointer(px)
            .pointer(po)
            .i64(outer as i64)
            .i64(r as i64)
            .i32(i32::from(log));
        // SAFETY: contiguous [outer, r] input and output.
        unsafe {
            dev.launch(
                rows_kernel,
                LaunchConfig::warp_per_item(outer, 4),
                &mut args,
            )?
        };
    } else if outer * inner > 0 && r > 0 {
        let (_, po) = raw(&out)?;
        let mut args = KernelArgs::new();
        args.pointer(px)
            .pointer(po)
            .i64(outer as i64)
            .i64(r as i64)
            .i64(inner as i64)
            .i32(i32::from(log));
        // SAFETY: contiguous [outer, r, inner] input and output.
        unsafe {
            dev.launch(
                kernel,
                LaunchConfig::linear(outer * inner, THREADS),
                &mut args,
            )?
        };
    }
    Ok(out)
}

/// The maximum of `x` along dimension `d` (non-empty) and the index of its first occurrence,
/// both shaped `[outer, inner]` (the caller reshapes); no autograd.
pub(crate) fn max_dim(x: &Tensor, d: usize) -> Result<(Tensor, Tensor)> {
    let kernel = float_kernel("max", x, float_kernels!("max_middle"))?;
    let rows_kernel = float_kernel("max", x, float_kernels!("max_rows"))?;
    let x = contiguous(x)?;
    let (outer, r, inner) = super::ops::reduce::split_at_dim(x.shape(), d);
    let (dev, px) = raw(&x)?;
    let values = empty(&dev, x.dtype(), &[outer, inner])?;
    let indices = empty(&dev, DType::I64, &[outer, inner])?;
    if inner == 1 && outer > 0 {
        // Along the last dimension: a warp per row.
        let (_, pv) = raw(&values)?;
        let (_, pi) = raw(&indices)?;
        let mut args = KernelArgs::new();
        args.pointer(px)
            .pointer(pv)
            .pointer(pi)
            .i64(outer as i64)
            .i64(r as i64);
        // SAFETY: contiguous [outer, r] input (r ≥ 1, checked by the caller), outputs of
        // `outer` values.
        unsafe {
            dev.launch(
                rows_kernel,
                LaunchConfig::warp_per_item(outer, 4),
                &mut args,
            )?
        };
    } else if outer * inner > 0 {
        let (_, pv) = raw(&values)?;
        let (_, pi) = raw(&indices)?;
        let mut args = KernelArgs::new();
        args.pointer(px)
            .pointer(pv)
            .pointer(pi)
            .i64(outer as i64)
            .i64(r as i64)
            .i64(inner as i64);
        // SAFETY: contiguous [outer, r, inner] input, [outer, inner] outputs.
        unsafe {
            dev.launch(
                kernel,
                LaunchConfig::linear(outer * inner, THREADS),
                &mut args,
            )?
        };
    }
    Ok((values, indices))
}

/// The gradient of [`max_dim`]: `g` (`[outer, inner]` values in order) placed at the maxima
/// `indices` of an `input_shape` tensor of zeros.
pub(crate) fn max_dim_backward(
    g: &Tensor,
    indices: &Tensor,
    input_shape: &[usize],
    d: usize,
) -> Result<Tensor> {
    let kernel = float_kernel("max", g, float_kernels!("max_middle_backward"))?;
    let g = contiguous(g)?;
    let (outer, r, inner) = super::ops::reduce::split_at_dim(input_shape, d);
    let (dev, pg) = raw(&g)?;
    let (_, pi) = raw(indices)?;
    let gx = zeroed(&dev, g.dtype(), input_shape)?;
    if outer * inner > 0 {
        let (_, px) = raw(&gx)?;
        let mut args = KernelArgs::new();
        args.pointer(pg)
            .pointer(pi)
            .pointer(px)
            .i64(outer as i64)
            .i64(r as i64)
            .i64(inner as i64);
        // SAFETY: g and indices hold outer·inner values (indices < r), gx the input's shape.
        unsafe {
            dev.launch(
                kernel,
                LaunchConfig::linear(outer * inner, THREADS),
                &mut args,
            )?
        };
    }
    Ok(gx)
}

/// `out[i] = src[sources[i]]` (flat offsets into `src`'s contiguous values, checked by the
/// caller), shaped `shape`.
pub(crate) fn take(src: &Tensor, sources: &[i64], shape: &[usize]) -> Result<Tensor> {
    let src = contiguous(src)?;
    let (dev, ps) = raw(&src)?;
    let out = empty(&dev, src.dtype(), shape)?;
    let n = sources.len();
    if n == 0 {
        return Ok(out);
    }
    let offsets = dev.htod(sources)?;
    let kernel = match src.dtype().size_in_bytes() {
        1 => "take_b1",
        2 => "take_b2",
        4 => "take_b4",
        _ => "take_b8",
    };
    let (_, po) = raw(&out)?;
    let mut args = KernelArgs::new();
    args.pointer(ps).buffer(&offsets).pointer(po).i64(n as i64);
    // SAFETY: every offset lies inside `src` (the caller's check); the output holds n values.
    unsafe { dev.launch(kernel, LaunchConfig::linear(n, THREADS), &mut args)? };
    Ok(out)
}

/// The adjoint of [`take`]: a zero tensor of `shape` with `g[p]` added at `targets[p]`,
/// duplicates summed in position order (deterministic; f32, f16 or bf16).
pub(crate) fn put_add(g: &Tensor, targets: &[i64], shape: &[usize]) -> Result<Tensor> {
    let kernel = float_kernel("gather", g, float_kernels!("put_add_sorted"))?;
    let g = contiguous(g)?;
    let (dev, pg) = raw(&g)?;
    let out = zeroed(&dev, g.dtype(), shape)?;
    if targets.is_empty() {
        return Ok(out);
    }
    // Positions grouped by target (a stable sort keeps each group in position order).
    let mut positions: Vec<i64> = (0..targets.len() as i64).collect();
    positions.sort_by_key(|&p| targets[p as usize]);
    let (mut starts, mut distinct) = (Vec::new(), Vec::new());
    for (k, &p) in positions.iter().enumerate() {
        let t = targets[p as usize];
        if distinct.last() != Some(&t) {
            starts.push(k as i64);
            distinct.push(t);
        }
    }
    starts.push(positions.len() as i64);
    let m = distinct.len();
    let (positions, starts, distinct) = (
        dev.htod(&positions)?,
        dev.htod(&starts)?,
        dev.htod(&distinct)?,
    );
    let (_, po) = raw(&out)?;
    let mut args = KernelArgs::new();
    args.pointer(pg)
        .buffer(&positions)
        .buffer(&starts)
        .buffer(&distinct)
        .pointer(po)
        .i64(m as i64);
    // SAFETY: positions index g, targets lie inside the output (the caller's check).
    unsafe { dev.launch(kernel, LaunchConfig::linear(m, THREADS), &mut args)? };
    Ok(out)
}

/// The dtype codes of `kernels/elementwise.cu` (`cast_strided`).
fn dtype_code(dtype: DType) -> i32 {
    match dtype {
        DType::F32 => 0,
        DType::F64 => 1,
        DType::F16 => 2,
        DType::BF16 => 3,
        DType::I64 => 4,
        DType::I32 => 5,
        DType::U8 => 6,
    }
}

/// A tensor of `shape` filled with `value` on CUDA device `device`.
pub(crate) fn full(value: f64, shape: &[usize], dtype: DType, device: Device) -> Result<Tensor> {
    if value == 0.0 {
        return zeroed(&open(device)?, dtype, shape);
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
    /// Notes that work queued on `stream` uses this CUDA tensor's memory (PyTorch's
    /// `record_stream`): when the storage is freed, the memory is not handed out again before
    /// that work is done. Needed when a tensor made on one stream is used on another.
    pub fn record_stream(&self, stream: &cuda::Stream) -> Result<()> {
        let guard = self.storage_read();
        match &*guard {
            Storage::Cuda(s) if Arc::ptr_eq(s.device(), stream.device()) => {
                s.buffer.note_stream(stream.id());
                Ok(())
            }
            _ => Err(Error::DeviceMismatch {
                op: "record_stream",
                lhs: self.device(),
                rhs: Device::Cuda(stream.device().ordinal()),
            }),
        }
    }

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

/// Address of `t`, checked to be a contiguous f32 tensor of `like`'s device and element count.
pub(crate) fn f32_operand(op: &'static str, what: &str, t: &Tensor, like: &Tensor) -> Result<u64> {
    expect_f32(op, t)?;
    same_device(op, like, t)?;
    if !t.is_contiguous() || t.numel() != like.numel() {
        return Err(Error::invalid(
            op,
            format!(
                "{what} must be a contiguous tensor of {} elements, got shape {:?}",
                like.numel(),
                t.shape()
            ),
        ));
    }
    Ok(view_ptr(t)?.1)
}

/// One in-place optimizer step on a CUDA parameter: launches `kernel` of `kernels/optim.cu`
/// with `(w, state…, g, n, rows, row_len, scalars…)`, where absent state buffers are null
/// pointers. With `rows` (sorted distinct row numbers of a coalesced row-sparse gradient),
/// `grad` holds just those rows and only they are updated; otherwise it is dense like `w`.
pub(crate) fn optimizer_step(
    op: &'static str,
    kernel: &'static str,
    w: &Tensor,
    state: &[Option<&Tensor>],
    grad: &Tensor,
    rows: Option<&[i64]>,
    scalars: impl FnOnce(&mut KernelArgs),
) -> Result<()> {
    let (dev, pw) = view_ptr(w)?;
    f32_operand(op, "the parameter", w, w)?;
    let grad = contiguous(grad)?;
    let mut args = KernelArgs::new();
    args.pointer(pw);
    for s in state {
        match s {
            Some(t) => args.pointer(f32_operand(op, "optimizer state", t, w)?),
            None => args.pointer(0),
        };
    }
    let num_rows = w.shape().first().copied().unwrap_or(1);
    let row_len = w.numel().checked_div(num_rows).unwrap_or(0);
    let rows_on_device = match rows {
        None => {
            args.pointer(f32_operand(op, "the gradient", &grad, w)?);
            None
        }
        Some(rows) => {
            expect_f32(op, &grad)?;
            same_device(op, w, &grad)?;
            if grad.numel() != rows.len() * row_len {
                return Err(Error::invalid(
                    op,
                    format!(
                        "a row-sparse gradient of {} rows of {row_len} elements has shape {:?}",
                        rows.len(),
                        grad.shape()
                    ),
                ));
            }
            if let Some((k, &r)) = (rows.iter().enumerate())
                .find(|&(k, &r)| r < 0 || r as usize >= num_rows || (k > 0 && rows[k - 1] >= r))
            {
                return Err(Error::invalid(
                    op,
                    format!(
                        "row-sparse gradient entry {k} names row {r}: rows must be sorted, \
                         distinct and below the parameter's {num_rows}"
                    ),
                ));
            }
            args.pointer(view_ptr(&grad)?.1);
            (!rows.is_empty()).then(|| dev.htod(rows)).transpose()?
        }
    };
    let n = grad.numel();
    args.i64(n as i64)
        .opt_buffer(rows_on_device.as_ref())
        .i64(row_len as i64);
    scalars(&mut args);
    if n == 0 {
        return Ok(());
    }
    // SAFETY: the parameter and its state are contiguous f32 buffers of w.numel() elements on
    // `dev`; the gradient holds n elements, either all of w's or `rows` (checked in range) of
    // row_len each.
    unsafe { dev.launch(kernel, LaunchConfig::linear(n, THREADS), &mut args) }
}

/// Binary cross-entropy with logits per element and its derivative in `x` (f32).
pub(crate) fn bce_logits_f32(x: &Tensor, y: &Tensor) -> Result<(Tensor, Tensor)> {
    const OP: &str = "bce_with_logits";
    expect_f32(OP, x)?;
    same_device(OP, x, y)?;
    let (x, y) = (contiguous(x)?, contiguous(y)?);
    let (dev, px) = raw(&x)?;
    let py = f32_operand(OP, "the target", &y, &x)?;
    let loss = empty(&dev, DType::F32, x.shape())?;
    let dx = empty(&dev, DType::F32, x.shape())?;
    let n = x.numel();
    if n > 0 {
        let mut args = KernelArgs::new();
        args.pointer(px)
            .pointer(py)
            .pointer(raw(&loss)?.1)
            .pointer(raw(&dx)?.1)
            .i64(n as i64);
        // SAFETY: contiguous inputs and outputs of n elements each.
        unsafe {
            dev.launch(
                "bce_logits_f32",
                LaunchConfig::linear(n, THREADS),
                &mut args,
            )?
        };
    }
    Ok((loss, dx))
}

/// The strict upper triangle's pairs `(i, j)` of `n` rows, row-major, as two device arrays.
fn interaction_pairs(
    dev: &Arc<CudaDevice>,
    n: usize,
) -> Result<(DeviceBuffer<i32>, DeviceBuffer<i32>)> {
    let (mut pi, mut pj) = (Vec::new(), Vec::new());
    for i in 0..n {
        for j in i + 1..n {
            pi.push(i as i32);
            pj.push(j as i32);
        }
    }
    Ok((dev.htod(&pi)?, dev.htod(&pj)?))
}

/// DLRM's dot interaction (values only): `dense [B, D]`, `sparse [B, F, D]` →
/// `[B, D + F(F+1)/2]`.
pub(crate) fn dot_interaction_f32(dense: &Tensor, sparse: &Tensor) -> Result<Tensor> {
    const OP: &str = "dot_interaction";
    expect_f32(OP, dense)?;
    expect_f32(OP, sparse)?;
    same_device(OP, dense, sparse)?;
    let (b, d, f) = (dense.shape()[0], dense.shape()[1], sparse.shape()[1]);
    let p = (f + 1) * f / 2;
    let (dense, sparse) = (contiguous(dense)?, contiguous(sparse)?);
    let (dev, pd) = raw(&dense)?;
    let (_, ps) = raw(&sparse)?;
    let out = empty(&dev, DType::F32, &[b, d + p])?;
    if b == 0 {
        return Ok(out);
    }
    let (pair_i, pair_j) = interaction_pairs(&dev, f + 1)?;
    let mut args = KernelArgs::new();
    args.pointer(pd)
        .pointer(ps)
        .i32(f as i32)
        .i32(d as i32)
        .buffer(&pair_i)
        .buffer(&pair_j)
        .i32(p as i32)
        .pointer(raw(&out)?.1);
    let config = LaunchConfig {
        grid: (b as u32, 1, 1),
        block: (128, 1, 1),
        shared_bytes: 0,
    };
    // SAFETY: contiguous [B, D] and [B, F, D] inputs, [B, D + P] output, P pairs.
    unsafe { dev.launch("dot_interaction_f32", config, &mut args)? };
    Ok(out)
}

/// Gradients of [`dot_interaction_f32`] in `dense` and `sparse` from the output's gradient.
pub(crate) fn dot_interaction_backward_f32(
    dense: &Tensor,
    sparse: &Tensor,
    grad: &Tensor,
) -> Result<(Tensor, Tensor)> {
    const OP: &str = "dot_interaction";
    expect_f32(OP, grad)?;
    same_device(OP, dense, grad)?;
    let (b, d, f) = (dense.shape()[0], dense.shape()[1], sparse.shape()[1]);
    let (dense, sparse, grad) = (contiguous(dense)?, contiguous(sparse)?, contiguous(grad)?);
    let (dev, pd) = raw(&dense)?;
    let gd = empty(&dev, DType::F32, &[b, d])?;
    let gs = empty(&dev, DType::F32, &[b, f, d])?;
    if b == 0 {
        return Ok((gd, gs));
    }
    let mut args = KernelArgs::new();
    args.pointer(pd)
        .pointer(raw(&sparse)?.1)
        .i32(f as i32)
        .i32(d as i32)
        .pointer(raw(&grad)?.1)
        .pointer(raw(&gd)?.1)
        .pointer(raw(&gs)?.1);
    let config = LaunchConfig {
        grid: (b as u32, 1, 1),
        block: (128, 1, 1),
        shared_bytes: 0,
    };
    // SAFETY: contiguous inputs as in the forward, gradient [B, D + P], outputs [B, D] and
    // [B, F, D].
    unsafe { dev.launch("dot_interaction_backward_f32", config, &mut args)? };
    Ok((gd, gs))
}

/// Overwrites the values of `dst` (a contiguous CUDA tensor) with those of `src` (same shape,
/// any device, cast to `dst`'s dtype).
pub(crate) fn copy_into(dst: &Tensor, src: &Tensor) -> Result<()> {
    if !dst.is_contiguous() {
        return Err(Error::invalid(
            "copy_from",
            "the destination on a CUDA device must be contiguous",
        ));
    }
    let host = move_values(src, Device::Cpu)?
        .cast_values(dst.dtype())?
        .contiguous_values()?;
    let (dev, ptr) = view_ptr(dst)?;
    let guard = host.storage_read();
    let cpu = guard.cpu("copy_from")?;
    dev.copy_from_host(ptr, cpu_bytes(cpu))
}

/// Concatenation along `dim` of same-device CUDA tensors (shapes checked by the caller) into a
/// new contiguous tensor of `shape`: each part is written into its slice of the output.
pub(crate) fn cat(parts: &[Tensor], dim: usize, shape: &[usize]) -> Result<Tensor> {
    let first = &parts[0];
    let (dev, _) = raw(first)?;
    let out = empty(&dev, first.dtype(), shape)?;
    let (_, base) = raw(&out)?;
    let strides = out.layout().strides().to_vec();
    let kernel = match first.dtype().size_in_bytes() {
        1 => "scatter_b1",
        2 => "scatter_b2",
        4 => "scatter_b4",
        _ => "scatter_b8",
    };
    let mut start = 0;
    for p in parts {
        same_device("cat", first, p)?;
        let n = p.numel();
        if n > 0 {
            let src = contiguous(p)?;
            let (_, ps) = raw(&src)?;
            let m = meta(&dev, p.shape(), &[(&strides, start * strides[dim])])?;
            let mut args = KernelArgs::new();
            args.pointer(ps).pointer(base).i64(n as i64).buffer(&m);
            // SAFETY: the part's slice of the output (its shape at offset `start` along `dim`,
            // the output's strides) lies inside the output; the source holds n elements.
            unsafe { dev.launch(kernel, LaunchConfig::linear(n, THREADS), &mut args)? };
        }
        start += p.shape()[dim];
    }
    Ok(out)
}

/// A contiguous f32 tensor of `shape` over a device buffer holding exactly its values.
pub(crate) fn from_buffer_f32(buffer: DeviceBuffer<f32>, shape: &[usize]) -> Result<Tensor> {
    let len: usize = shape.iter().product();
    if buffer.len() != len {
        return Err(Error::invalid(
            "cuda",
            format!("a buffer of {} values for shape {shape:?}", buffer.len()),
        ));
    }
    let buffer = buffer.into_bytes();
    Ok(Tensor::from_cuda(
        CudaStorage {
            buffer,
            dtype: DType::F32,
            len,
        },
        shape,
    ))
}

/// Rows `rows` (checked by the caller) of a CUDA tensor, any dtype: `[rows.len(), ...]`.
pub(crate) fn index_select(t: &Tensor, rows: &[usize], shape: &[usize]) -> Result<Tensor> {
    let src = contiguous(t)?;
    let (dev, ps) = raw(&src)?;
    let out = empty(&dev, t.dtype(), shape)?;
    let row_len: usize = t.shape()[1..].iter().product();
    let n = rows.len() * row_len;
    if n == 0 {
        return Ok(out);
    }
    let rows: Vec<i64> = rows.iter().map(|&r| r as i64).collect();
    let d_rows = dev.htod(&rows)?;
    let kernel = match t.dtype().size_in_bytes() {
        1 => "index_select_b1",
        2 => "index_select_b2",
        4 => "index_select_b4",
        _ => "index_select_b8",
    };
    let mut args = KernelArgs::new();
    args.pointer(ps)
        .buffer(&d_rows)
        .i64(rows.len() as i64)
        .i64(row_len as i64)
        .pointer(raw(&out)?.1);
    // SAFETY: every row number is below the source's row count (checked by the caller); the
    // output holds rows.len() rows of row_len elements.
    unsafe { dev.launch(kernel, LaunchConfig::linear(n, THREADS), &mut args)? };
    Ok(out)
}

/// `t` with `values[i]` added to row `rows[i]` (rows checked by the caller; repeats summed in
/// position order, deterministic), f32.
pub(crate) fn index_add_rows_f32(t: &Tensor, rows: &[usize], values: &Tensor) -> Result<Tensor> {
    const OP: &str = "index_add_rows";
    expect_f32(OP, t)?;
    expect_f32(OP, values)?;
    same_device(OP, t, values)?;
    // A fresh copy of `t` to add into.
    let out = {
        let c = contiguous(t)?;
        let (dev, pc) = raw(&c)?;
        let out = empty(&dev, DType::F32, t.shape())?;
        dev.copy_on_device(raw(&out)?.1, pc, t.numel() * 4)?;
        out
    };
    let row_len: usize = t.shape()[1..].iter().product();
    if rows.is_empty() || row_len == 0 {
        return Ok(out);
    }
    let mut order: Vec<i64> = (0..rows.len() as i64).collect();
    order.sort_by_key(|&k| rows[k as usize]);
    let (mut unique, mut starts) = (Vec::new(), Vec::new());
    for (k, &p) in order.iter().enumerate() {
        let r = rows[p as usize] as i64;
        if unique.last() != Some(&r) {
            unique.push(r);
            starts.push(k as i64);
        }
    }
    starts.push(order.len() as i64);
    let values = contiguous(values)?;
    let (dev, pv) = raw(&values)?;
    let (du, ds, dord) = (dev.htod(&unique)?, dev.htod(&starts)?, dev.htod(&order)?);
    let mut args = KernelArgs::new();
    args.pointer(raw(&out)?.1)
        .buffer(&du)
        .buffer(&ds)
        .buffer(&dord)
        .pointer(pv)
        .i64(unique.len() as i64)
        .i64(row_len as i64);
    let n = unique.len() * row_len;
    // SAFETY: unique rows lie inside `out` (checked by the caller), `order` indexes the
    // `values` rows, `starts` has unique.len() + 1 entries ending at order.len().
    unsafe {
        dev.launch(
            "index_add_rows_f32",
            LaunchConfig::linear(n, THREADS),
            &mut args,
        )?
    };
    Ok(out)
}

/// The rows `start .. start + len` of each range, back to back (one device copy per range).
pub(crate) fn gather_row_ranges(
    src: &Tensor,
    ranges: &[(usize, usize)],
    shape: &[usize],
) -> Result<Tensor> {
    let c = contiguous(src)?;
    let (dev, ps) = raw(&c)?;
    let out = empty(&dev, src.dtype(), shape)?;
    let (_, po) = raw(&out)?;
    let row_bytes = src.shape()[1..].iter().product::<usize>() * src.dtype().size_in_bytes();
    let mut at = 0;
    for &(start, len) in ranges {
        if len > 0 && row_bytes > 0 {
            dev.copy_on_device(
                po + (at * row_bytes) as u64,
                ps + (start * row_bytes) as u64,
                len * row_bytes,
            )?;
        }
        at += len;
    }
    Ok(out)
}

/// Jagged `[N, D]` f32 values with `offsets` (`[B + 1]`, checked) padded to `[B, max_len, D]`,
/// or the reverse (`to_dense` false: `dense [B, max_len, D]` → `[total, D]`, positions past
/// `max_len` zero).
pub(crate) fn jagged_dense_f32(
    src: &Tensor,
    offsets: &[i64],
    max_len: usize,
    d: usize,
    padding: f64,
    to_dense: bool,
    total: usize,
) -> Result<Tensor> {
    const OP: &str = "jagged_to_padded_dense";
    expect_f32(OP, src)?;
    let c = contiguous(src)?;
    let (dev, ps) = raw(&c)?;
    let b = offsets.len() - 1;
    let d_offsets = dev.htod(offsets)?;
    let mut args = KernelArgs::new();
    let (out, n, kernel) = if to_dense {
        let out = empty(&dev, DType::F32, &[b, max_len, d])?;
        args.pointer(ps)
            .buffer(&d_offsets)
            .i32(b as i32)
            .i32(max_len as i32)
            .i32(d as i32)
            .f32(padding as f32)
            .pointer(raw(&out)?.1);
        (out, b * max_len * d, "jagged_to_padded_dense_f32")
    } else {
        let out = empty(&dev, DType::F32, &[total, d])?;
        args.pointer(ps)
            .buffer(&d_offsets)
            .i32(b as i32)
            .i32(max_len as i32)
            .i32(d as i32)
            .i64(total as i64)
            .pointer(raw(&out)?.1);
        (out, total * d, "dense_to_jagged_f32")
    };
    if n == 0 {
        return Ok(out);
    }
    // SAFETY: offsets are validated (start at 0, never decrease, end ≤ the jagged rows);
    // shapes as in kernels/jagged.cu. The kernels take no grid-stride loop: `covering`.
    unsafe { dev.launch(kernel, LaunchConfig::covering(n, THREADS), &mut args)? };
    Ok(out)
}

/// What [`block_bucketize`] computes on the device.
pub(crate) struct DeviceBucketized {
    /// `[my_size · bags]` counts, bucket-major (read back: small).
    pub lengths: Vec<i64>,
    pub indices: Tensor,
    pub weights: Option<Tensor>,
    pub positions: Option<Tensor>,
    /// `unbucketize_permute`, when `options.sequence`.
    pub destination: Option<Tensor>,
}

/// `block_bucketize_sparse_features` of device `indices` (i64/i32) whose bag `offsets` and
/// per-bag features were checked on the host: routing, rebasing and the bucket-major scatter
/// run on the device (`kernels/bucketize.cu`). A negative id is an error naming
/// `describe(bag)` and its position.
pub(crate) fn block_bucketize(
    indices: &Tensor,
    offsets: &[i64],
    bag_feature: &[i32],
    routers: &crate::sparse::ops::RouterTable,
    my_size: usize,
    options: &crate::sparse::ops::BlockBucketizeOptions<'_>,
    describe: &dyn Fn(usize) -> String,
) -> Result<DeviceBucketized> {
    const OP: &str = "block_bucketize_sparse_features";
    let ids = contiguous(indices)?;
    let (dev, pi) = raw(&ids)?;
    let (dtype, count_kernel, scatter_kernel) = match ids.dtype() {
        DType::I64 => (
            DType::I64,
            "block_bucketize_count_i64",
            "block_bucketize_scatter_i64",
        ),
        DType::I32 => (
            DType::I32,
            "block_bucketize_count_i32",
            "block_bucketize_scatter_i32",
        ),
        d => {
            return Err(Error::invalid(
                OP,
                format!("indices must be i64 or i32, got {d:?}"),
            ))
        }
    };
    let n = ids.numel();
    let bags = offsets.len() - 1;
    let weights = match options.weights {
        Some(w) if w.dtype() != DType::F32 => {
            return Err(Error::invalid(
                OP,
                format!("weights on a CUDA device must be f32, got {:?}", w.dtype()),
            ))
        }
        Some(w) => Some(contiguous(&w.to_device(indices.device())?)?),
        None => None,
    };
    let d_offsets = dev.htod(offsets)?;
    let d_features = dev.htod(bag_feature)?;
    let d_kind = dev.htod(&routers.kind)?;
    let d_params = dev.htod(&routers.params)?;
    let d_bounds = dev.htod(&routers.bounds)?;
    let counts = dev.zeros::<i64>((my_size * bags).max(1))?;
    let first_bad = dev.htod(&[i64::MAX])?;
    let grid = LaunchConfig::covering(bags, 128);
    let route_args = |args: &mut KernelArgs| {
        args.pointer(pi)
            .buffer(&d_offsets)
            .buffer(&d_features)
            .i64(bags as i64)
            .buffer(&d_kind)
            .buffer(&d_params)
            .buffer(&d_bounds)
            .i32(my_size as i32);
    };
    let mut args = KernelArgs::new();
    route_args(&mut args);
    args.buffer(&counts).buffer(&first_bad);
    // SAFETY: one thread per bag; offsets (checked on the host) index the n ids; counts holds
    // my_size slots per bag and every routed bucket is < my_size.
    unsafe { dev.launch(count_kernel, grid, &mut args)? };
    let bad = first_bad.to_host()?[0];
    if bad != i64::MAX {
        let id = read_back_int(&ids, bad as usize)?;
        let bag = offsets.partition_point(|&o| o <= bad) - 1;
        return Err(Error::invalid(
            OP,
            format!(
                "{}, position {}: id {id} is negative",
                describe(bag),
                bad - offsets[bag]
            ),
        ));
    }
    let cursor = dev.alloc::<i64>((my_size * bags).max(1))?;
    let mut args = KernelArgs::new();
    args.buffer(&counts)
        .buffer(&cursor)
        .i64((my_size * bags) as i64);
    let one_block = LaunchConfig::single_block(1024);
    // SAFETY: scans my_size·bags counts into cursor.
    unsafe { dev.launch("scan_exclusive_i64", one_block, &mut args)? };
    let mut lengths = counts.to_host()?;
    lengths.truncate(my_size * bags);
    let out_ids = empty(&dev, dtype, &[n])?;
    let destination = options
        .sequence
        .then(|| empty(&dev, dtype, &[n]))
        .transpose()?;
    let positions = options
        .bucketize_pos
        .then(|| empty(&dev, dtype, &[n]))
        .transpose()?;
    let out_weights = weights
        .as_ref()
        .map(|_| empty(&dev, DType::F32, &[n]))
        .transpose()?;
    let address = |t: &Option<Tensor>| t.as_ref().map(|t| raw(t).map(|r| r.1)).transpose();
    let mut args = KernelArgs::new();
    route_args(&mut args);
    args.i32(i32::from(options.keep_orig_idx))
        .buffer(&cursor)
        .pointer(raw(&out_ids)?.1)
        .pointer(address(&destination)?.unwrap_or(0))
        .pointer(address(&positions)?.unwrap_or(0))
        .pointer(address(&weights)?.unwrap_or(0))
        .pointer(address(&out_weights)?.unwrap_or(0));
    // SAFETY: as the count launch; the cursors start at each (bucket, bag)'s first slot and
    // advance over exactly the ids counted there, so every slot is < n and written once; the
    // optional outputs (0: absent) hold n values of the ids' type (weights f32).
    unsafe { dev.launch(scatter_kernel, grid, &mut args)? };
    Ok(DeviceBucketized {
        lengths,
        indices: out_ids,
        weights: out_weights,
        positions,
        destination,
    })
}

/// Element `i` of an i64/i32 device tensor (for error messages).
fn read_back_int(t: &Tensor, i: usize) -> Result<i64> {
    Ok(match t.dtype() {
        DType::I32 => i64::from(t.narrow(0, i, 1)?.to_vec::<i32>()?[0]),
        _ => t.narrow(0, i, 1)?.to_vec::<i64>()?[0],
    })
}

/// `[map.len(), row_len]` f32 rows: row `r` is row `map[r]` of `src` (`[*, row_len]`, rows
/// checked by the caller), or `fill` where `map[r] < 0`. The several-jagged-dimension layouts
/// of `jagged_to_padded_dense` / `dense_to_jagged` use it both ways.
pub(crate) fn gather_rows_or_fill_f32(
    src: &Tensor,
    map: &[i64],
    row_len: usize,
    fill: f64,
) -> Result<Tensor> {
    expect_f32("jagged_to_padded_dense", src)?;
    let c = contiguous(src)?;
    let (dev, ps) = raw(&c)?;
    let out = empty(&dev, DType::F32, &[map.len(), row_len])?;
    let n = map.len() * row_len;
    if n == 0 {
        return Ok(out);
    }
    let d_map = dev.htod(map)?;
    let mut args = KernelArgs::new();
    args.pointer(ps)
        .buffer(&d_map)
        .i64(map.len() as i64)
        .i64(row_len as i64)
        .f32(fill as f32)
        .pointer(raw(&out)?.1);
    // SAFETY: every non-negative map entry is a row of `src` (the caller's layout); the
    // output holds map.len() rows of row_len values.
    unsafe {
        dev.launch(
            "gather_rows_or_fill_f32",
            LaunchConfig::linear(n, THREADS),
            &mut args,
        )?
    };
    Ok(out)
}
