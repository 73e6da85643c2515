//! Creation, copies, casts and concatenation in host memory.

use super::super::{CopyOps, Cpu};
use crate::device::Device;
use crate::dtype::DType;
use crate::error::Result;
use crate::tensor::dtype::WithDType;
use crate::tensor::ops::reduce::split_at_dim;
use crate::tensor::storage::{match_storage, CpuStorage};
use crate::Tensor;

fn cat_typed<T: WithDType>(parts: &[Tensor], dim: usize, shape: &[usize]) -> Result<CpuStorage> {
    let (outer, _, inner) = split_at_dim(shape, dim);
    let contiguous: Vec<Vec<T>> = parts
        .iter()
        .map(|p| p.to_vec::<T>())
        .collect::<Result<_>>()?;
    let mut out = Vec::with_capacity(shape.iter().product());
    for o in 0..outer {
        for (p, data) in parts.iter().zip(&contiguous) {
            let block = p.shape()[dim] * inner;
            out.extend_from_slice(&data[o * block..(o + 1) * block]);
        }
    }
    Ok(T::into_storage(out))
}

impl CopyOps for Cpu {
    fn full(value: f64, shape: &[usize], dtype: DType, _device: Device) -> Result<Tensor> {
        let n = shape.iter().product();
        let storage = CpuStorage::try_full("Tensor::full", dtype, value, n)?;
        Ok(Tensor::from_cpu(storage, shape))
    }

    fn to_host(t: &Tensor) -> Result<Tensor> {
        Ok(t.detach())
    }

    fn from_host(host: &Tensor, _device: Device) -> Result<Tensor> {
        Ok(host.detach())
    }

    fn contiguous(t: &Tensor) -> Result<Tensor> {
        let guard = t.storage_read();
        let cpu = guard.cpu("contiguous")?;
        let storage = match_storage!(cpu, v => WithDType::into_storage(t.layout().try_gather("contiguous", v)?));
        Ok(Tensor::from_cpu(storage, t.shape()))
    }

    fn cast(t: &Tensor, dtype: DType) -> Result<Tensor> {
        let guard = t.storage_read();
        let cpu = guard.cpu("to_dtype")?;
        let storage = match_storage!(cpu, v => crate::tensor::ops::cast::cast_vec(&t.layout().try_gather("to_dtype", v)?, dtype));
        Ok(Tensor::from_cpu(storage, t.shape()))
    }

    fn copy_into(dst: &Tensor, src: &Tensor) -> Result<()> {
        let src = src.to_host_values()?;
        let mut src = src.cast_values(dst.dtype())?.contiguous_values()?;
        if src.shares_storage_with(dst) {
            // A view of the destination's own storage (`p.copy_from(&p)`, a module loading its
            // own state dict): read out first, since the write below waited for ever on this
            // read's lock.
            src = Self::contiguous(&src)?;
        }
        let guard = src.storage_read();
        let cpu = guard.cpu("copy_from")?;
        match_storage!(cpu, v => dst.update_in_place(|d| d.copy_from_slice(v)))?;
        Ok(())
    }

    fn cat(parts: &[Tensor], dim: usize, shape: &[usize]) -> Result<Tensor> {
        let guard = parts[0].storage_read();
        let probe = guard.cpu("cat")?;
        let storage = match_storage!(probe, v => {
            fn typed<T: WithDType>(_: &[T], parts: &[Tensor], d: usize, shape: &[usize]) -> Result<CpuStorage> {
                cat_typed::<T>(parts, d, shape)
            }
            typed(v, parts, dim, shape)?
        });
        drop(guard);
        Tensor::from_storage(storage, shape)
    }
}
