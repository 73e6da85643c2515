//! Row and element indexing in host memory: index_select, take (a gather by flat offsets),
//! its adjoint put_add, and the row scatter-add.

use super::super::{Cpu, IndexOps};
use rayon::prelude::*;

use crate::error::Result;
use crate::tensor::dtype::{NumElem, WithDType};
use crate::tensor::ops::{float_compute, with_num, PAR_THRESHOLD};
use crate::tensor::storage::match_storage;
use crate::Tensor;

impl IndexOps for Cpu {
    fn index_select(t: &Tensor, rows: &[usize], shape: &[usize]) -> Result<Tensor> {
        let row_len: usize = t.shape()[1..].iter().product();
        crate::tensor::storage::ensure_allocatable(
            "index_select",
            shape,
            t.dtype().size_in_bytes(),
        )?;
        let src = t.contiguous_values()?;
        let guard = src.storage_read();
        let cpu = guard.cpu("index_select")?;
        let storage = match_storage!(cpu, v => {
            let mut out = vec![Default::default(); rows.len() * row_len];
            if row_len > 0 {
                let copy = |(dst, &r): (&mut [_], &usize)| dst.copy_from_slice(&v[r * row_len..(r + 1) * row_len]);
                if out.len() >= PAR_THRESHOLD {
                    out.par_chunks_mut(row_len).zip(rows.par_iter()).for_each(copy);
                } else {
                    out.chunks_mut(row_len).zip(rows.iter()).for_each(copy);
                }
            }
            WithDType::into_storage(out)
        });
        drop(guard);
        Tensor::from_storage(storage, shape)
    }

    fn take(src: &Tensor, sources: &[usize], shape: &[usize]) -> Result<Tensor> {
        let src = src.contiguous_values()?;
        let guard = src.storage_read();
        let cpu = guard.cpu("gather")?;
        let storage = match_storage!(cpu, v => {
            let out: Vec<_> = sources.iter().map(|&s| v[s]).collect();
            WithDType::into_storage(out)
        });
        drop(guard);
        Tensor::from_storage(storage, shape)
    }

    fn put_add(g: &Tensor, targets: &[usize], shape: &[usize]) -> Result<Tensor> {
        let (gc, storage) = float_compute("gather", g)?;
        let out = with_num!(gc.dtype(), "gather", T => {
            let mut out = vec![T::ZERO; shape.iter().product()];
            gc.with_contiguous(|gs: &[T]| {
                for (&v, &target) in gs.iter().zip(targets) {
                    out[target] += v;
                }
            })?;
            Tensor::from_vec(out, shape)?
        });
        out.cast_values(storage)
    }

    fn index_add_rows(t: &Tensor, rows: &[usize], values: &Tensor) -> Result<Tensor> {
        let (dst, storage) = if t.dtype().is_float() {
            float_compute("index_add_rows", t)?
        } else {
            (t.clone(), t.dtype())
        };
        let src = values.cast_values(dst.dtype())?;
        let row_len: usize = t.shape()[1..].iter().product();
        let out = with_num!(dst.dtype(), "index_add_rows", T => {
            let mut out: Vec<T> = dst.to_vec()?;
            src.with_contiguous(|vs: &[T]| {
                for (i, &r) in rows.iter().enumerate() {
                    let d = &mut out[r * row_len..(r + 1) * row_len];
                    d.iter_mut().zip(&vs[i * row_len..(i + 1) * row_len]).for_each(|(a, &b)| *a += b);
                }
            })?;
            Tensor::from_vec(out, t.shape())?
        });
        out.cast_values(storage)
    }
}
