//! `KeyedTensor`: pooled embeddings of several keys side by side in one `[B, ΣD]` tensor, and
//! `regroup`, which rearranges the columns of several keyed tensors into groups in one copy.

use std::sync::Arc;

use rayon::prelude::*;

use super::ops::{with_any_dtype, PARALLEL_MIN_ELEMENTS};
use crate::tensor::ops::with_float;
use crate::tensor::{record_op, BackwardOp, Gradient, WithDType};
use crate::{DType, Error, Result, Tensor};

/// `keys` with per-key widths (`length_per_key`) over one `[B, Σ widths]` tensor; key `k`
/// owns columns `offset_per_key[k] .. offset_per_key[k+1]` (TorchRec's `KeyedTensor` with
/// `key_dim = 1`).
#[derive(Clone, Debug)]
pub struct KeyedTensor {
    keys: Vec<String>,
    length_per_key: Vec<usize>,
    offset_per_key: Vec<usize>,
    values: Tensor,
}

/// One copied block: `width` columns from input `source` at `from` to output column `to`.
#[derive(Clone, Copy, Debug)]
struct ColumnBlock {
    source: usize,
    from: usize,
    to: usize,
    width: usize,
}

impl KeyedTensor {
    /// Wraps `values` (`[B, Σ length_per_key]`). Errors if the widths don't add up to the
    /// number of columns or the key and width counts differ.
    pub fn new(keys: Vec<String>, length_per_key: Vec<usize>, values: Tensor) -> Result<Self> {
        const OP: &str = "KeyedTensor::new";
        if keys.len() != length_per_key.len() {
            return Err(Error::invalid(
                OP,
                format!("{} keys but {} widths", keys.len(), length_per_key.len()),
            ));
        }
        let Some(total) = crate::tensor::checked_sum(&length_per_key) else {
            return Err(Error::invalid(
                OP,
                format!("the key widths {length_per_key:?} sum past a usize"),
            ));
        };
        if values.rank() != 2 || values.shape()[1] != total {
            return Err(Error::invalid(
                OP,
                format!(
                    "values have shape {:?}; expected [B, {total}] (the sum of the key widths)",
                    values.shape()
                ),
            ));
        }
        let mut offset_per_key = vec![0];
        for &w in &length_per_key {
            offset_per_key.push(offset_per_key.last().unwrap() + w);
        }
        Ok(KeyedTensor {
            keys,
            length_per_key,
            offset_per_key,
            values,
        })
    }

    /// Concatenates one `[B, D_k]` tensor per key along the columns. Differentiable.
    pub fn from_tensor_list(keys: Vec<String>, tensors: &[Tensor]) -> Result<Self> {
        const OP: &str = "KeyedTensor::from_tensor_list";
        if keys.len() != tensors.len() || tensors.is_empty() {
            return Err(Error::invalid(
                OP,
                format!(
                    "{} keys for {} tensors (need at least one)",
                    keys.len(),
                    tensors.len()
                ),
            ));
        }
        if let Some(i) = tensors
            .iter()
            .position(|t| t.rank() != 2 || t.shape()[0] != tensors[0].shape()[0])
        {
            return Err(Error::invalid(
                OP,
                format!(
                    "key `{}`: tensor has shape {:?}; expected [B = {}, D]",
                    keys[i],
                    tensors[i].shape(),
                    tensors[0].shape()[0]
                ),
            ));
        }
        let widths = tensors.iter().map(|t| t.shape()[1]).collect();
        let refs: Vec<&Tensor> = tensors.iter().collect();
        KeyedTensor::new(keys, widths, Tensor::cat(&refs, 1)?)
    }

    /// The keys.
    pub fn keys(&self) -> &[String] {
        &self.keys
    }

    /// Columns per key.
    pub fn length_per_key(&self) -> &[usize] {
        &self.length_per_key
    }

    /// Where each key's columns start (`keys + 1` entries).
    pub fn offset_per_key(&self) -> &[usize] {
        &self.offset_per_key
    }

    /// The `[B, ΣD]` values.
    pub fn values(&self) -> &Tensor {
        &self.values
    }

    /// The dimension keys are laid out along (always 1).
    pub fn key_dim(&self) -> usize {
        1
    }

    /// The `[B, D_k]` columns of `key` (a view; a repeated key's last occurrence, as TorchRec's
    /// `kt[key]`). An unknown key is an error listing the keys.
    pub fn get(&self, key: &str) -> Result<Tensor> {
        // The last occurrence of a repeated key, as TorchRec's `_key_indices` dict.
        let k = self.keys.iter().rposition(|k| k == key).ok_or_else(|| {
            Error::invalid(
                "KeyedTensor::get",
                format!("unknown key `{key}`; the keys are {:?}", self.keys),
            )
        })?;
        self.values
            .narrow(1, self.offset_per_key[k], self.length_per_key[k])
    }

    /// Every key's columns, in key order (views); a repeated key once, at its first place,
    /// with its last occurrence's columns (TorchRec's dict).
    pub fn to_dict(&self) -> Result<Vec<(String, Tensor)>> {
        let mut out: Vec<(String, Tensor)> = Vec::with_capacity(self.keys.len());
        for (k, key) in self.keys.iter().enumerate() {
            if self.keys[..k].contains(key) {
                continue;
            }
            let last = self.keys.iter().rposition(|x| x == key).expect("present");
            let columns =
                (self.values).narrow(1, self.offset_per_key[last], self.length_per_key[last])?;
            out.push((key.clone(), columns));
        }
        Ok(out)
    }

    /// For each group of keys (looked up across `keyed_tensors`, the last occurrence winning
    /// as in TorchRec, whose lookup is a dict filled in order), the
    /// concatenation of their columns in group order: `[B, Σ widths of the group]`. All groups
    /// are written by one parallel copy into one buffer and returned as views of it; keys may
    /// appear in several groups or not at all. Differentiable.
    pub fn regroup(keyed_tensors: &[KeyedTensor], groups: &[Vec<String>]) -> Result<Vec<Tensor>> {
        const OP: &str = "KeyedTensor::regroup";
        if keyed_tensors.is_empty() {
            return Err(Error::invalid(OP, "no keyed tensors given"));
        }
        let batch = keyed_tensors[0].values.shape()[0];
        let dtype = keyed_tensors[0].values.dtype();
        for (i, kt) in keyed_tensors.iter().enumerate() {
            if kt.values.shape()[0] != batch || kt.values.dtype() != dtype {
                return Err(Error::invalid(
                    OP,
                    format!(
                        "keyed tensor {i} is {:?} {:?}; expected batch {batch} and {dtype:?} like keyed tensor 0",
                        kt.values.shape(),
                        kt.values.dtype()
                    ),
                ));
            }
        }
        let mut blocks = Vec::new();
        let mut group_bounds = Vec::with_capacity(groups.len());
        let mut width = 0;
        for (g, group) in groups.iter().enumerate() {
            let start = width;
            for (p, key) in group.iter().enumerate() {
                let found = (keyed_tensors.iter().enumerate().rev())
                    .find_map(|(s, kt)| kt.keys.iter().rposition(|k| k == key).map(|k| (s, k)));
                let Some((source, k)) = found else {
                    return Err(Error::invalid(
                        OP,
                        format!("group {g}, position {p}: unknown key `{key}`"),
                    ));
                };
                let kt = &keyed_tensors[source];
                blocks.push(ColumnBlock {
                    source,
                    from: kt.offset_per_key[k],
                    to: width,
                    width: kt.length_per_key[k],
                });
                width += kt.length_per_key[k];
            }
            group_bounds.push((start, width - start));
        }
        let inputs: Vec<Tensor> = keyed_tensors
            .iter()
            .map(|kt| kt.values.contiguous_values())
            .collect::<Result<_>>()?;
        let input_widths: Vec<usize> = inputs.iter().map(|t| t.shape()[1]).collect();
        let out = with_any_dtype!(dtype, T => {
            let guards: Vec<_> = inputs.iter().map(|t| t.storage_read()).collect();
            let slices: Vec<&[T]> = guards
                .iter()
                .map(|g| Ok(<T as WithDType>::slice(g.cpu(OP)?).expect("dtype checked above")))
                .collect::<Result<_>>()?;
            let mut out = vec![T::default(); batch * width];
            let fill_row = |(b, row): (usize, &mut [T])| {
                for blk in &blocks {
                    let w = input_widths[blk.source];
                    let src = &slices[blk.source][b * w + blk.from..b * w + blk.from + blk.width];
                    row[blk.to..blk.to + blk.width].copy_from_slice(src);
                }
            };
            if width > 0 {
                if out.len() >= PARALLEL_MIN_ELEMENTS {
                    out.par_chunks_mut(width).enumerate().for_each(fill_row);
                } else {
                    out.chunks_mut(width).enumerate().for_each(fill_row);
                }
            }
            Tensor::from_vec(out, &[batch, width])?
        });
        let value_refs: Vec<&Tensor> = keyed_tensors.iter().map(|kt| &kt.values).collect();
        let out = if dtype.is_float() {
            record_op(
                out,
                &value_refs,
                RegroupBackward {
                    blocks: Arc::new(blocks),
                    input_widths,
                    batch,
                    dtype,
                },
            )
        } else {
            out
        };
        group_bounds
            .iter()
            .map(|&(s, w)| out.narrow(1, s, w))
            .collect()
    }

    /// [`regroup`](Self::regroup) with a name per group.
    pub fn regroup_as_dict(
        keyed_tensors: &[KeyedTensor],
        groups: &[Vec<String>],
        names: &[String],
    ) -> Result<Vec<(String, Tensor)>> {
        if names.len() != groups.len() {
            return Err(Error::invalid(
                "KeyedTensor::regroup_as_dict",
                format!("{} names for {} groups", names.len(), groups.len()),
            ));
        }
        Ok(names
            .iter()
            .cloned()
            .zip(Self::regroup(keyed_tensors, groups)?)
            .collect())
    }
}

/// Routes each output block's gradient back to its source columns (summing keys used twice).
struct RegroupBackward {
    blocks: Arc<Vec<ColumnBlock>>,
    input_widths: Vec<usize>,
    batch: usize,
    dtype: DType,
}

impl BackwardOp for RegroupBackward {
    fn name(&self) -> &'static str {
        "KeyedTensor::regroup"
    }
    fn backward(&self, grad_output: &Tensor) -> Result<Vec<Option<Gradient>>> {
        let compute = self.dtype.compute_dtype();
        let g = grad_output.cast_values(compute)?;
        let width = g.shape()[1];
        let grads = with_float!(compute, "KeyedTensor::regroup", T => {
            let gv = g.to_vec::<T>()?;
            let mut grads: Vec<Vec<T>> = self.input_widths.iter().map(|&w| vec![T::default(); self.batch * w]).collect();
            for blk in self.blocks.iter() {
                let w = self.input_widths[blk.source];
                let dst = &mut grads[blk.source];
                for b in 0..self.batch {
                    for c in 0..blk.width {
                        dst[b * w + blk.from + c] += gv[b * width + blk.to + c];
                    }
                }
            }
            grads
                .into_iter()
                .zip(&self.input_widths)
                .map(|(v, &w)| Tensor::from_vec(v, &[self.batch, w]))
                .collect::<Result<Vec<_>>>()?
        });
        grads
            .into_iter()
            .map(|t| Ok(Some(Gradient::Dense(t.cast_values(self.dtype)?))))
            .collect()
    }
}
