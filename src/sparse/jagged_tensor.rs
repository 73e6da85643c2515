//! `JaggedTensor`: one feature's variable-length rows (TorchRec's `JaggedTensor`).

use super::ops::{
    dense_to_jagged, expect_int, expect_total, int_tensor, jagged_to_padded_dense,
    lengths_from_offsets, offsets_from_lengths, read_ints, validate_offsets,
};
use crate::{Error, Result, Tensor};

/// Variable-length rows stored back to back: `values` (`[total, ...]`), optional per-row
/// `weights` (`[total]`), and `lengths` (rows per sample, i64 or i32) with their `offsets`
/// (exclusive cumsum, one entry longer). Both are kept, computed once at construction.
#[derive(Clone, Debug)]
pub struct JaggedTensor {
    values: Tensor,
    weights: Option<Tensor>,
    lengths: Tensor,
    offsets: Tensor,
}

fn check_weights(op: &'static str, values: &Tensor, weights: Option<&Tensor>) -> Result<()> {
    if let Some(w) = weights {
        let rows = values.shape().first().copied().unwrap_or(0);
        if w.rank() != 1 || w.shape()[0] != rows {
            return Err(Error::invalid(
                op,
                format!(
                    "weights have shape {:?}; expected one weight per value ([{rows}])",
                    w.shape()
                ),
            ));
        }
    }
    Ok(())
}

fn check_values(op: &'static str, values: &Tensor) -> Result<()> {
    if values.rank() == 0 {
        return Err(Error::invalid(
            op,
            "values must have at least one dimension",
        ));
    }
    Ok(())
}

/// A jagged tensor's lengths or offsets are one list: a 2-D tensor of the same elements was
/// read flat, its shape kept (and later ops indexed it as 1-D).
fn expect_1d(op: &'static str, what: &str, t: &Tensor) -> Result<()> {
    if t.rank() != 1 {
        return Err(Error::invalid(
            op,
            format!("{what} must be 1-D, got shape {:?}", t.shape()),
        ));
    }
    Ok(())
}

impl JaggedTensor {
    /// Builds from `lengths` (1-D i64/i32). Errors if a length is negative (naming the
    /// sample), the lengths don't add up to the rows of `values`, or `weights` is not one per
    /// value.
    pub fn new(values: Tensor, lengths: Tensor, weights: Option<Tensor>) -> Result<Self> {
        const OP: &str = "JaggedTensor::new";
        check_values(OP, &values)?;
        expect_int(OP, "lengths", &lengths)?;
        expect_1d(OP, "lengths", &lengths)?;
        let lens = read_ints(OP, "lengths", &lengths)?;
        let offsets = offsets_from_lengths(OP, &lens, |i| format!("sample {i}"))?;
        expect_total(OP, "lengths", offsets[lens.len()], values.shape()[0])?;
        check_weights(OP, &values, weights.as_ref())?;
        let offsets = int_tensor(offsets, &[lens.len() + 1], lengths.dtype())?;
        Ok(JaggedTensor {
            values,
            weights,
            lengths,
            offsets,
        })
    }

    /// Builds from `offsets` (1-D, starting at 0, non-decreasing, ending at the number of
    /// rows of `values`).
    pub fn from_offsets(values: Tensor, offsets: Tensor, weights: Option<Tensor>) -> Result<Self> {
        const OP: &str = "JaggedTensor::from_offsets";
        check_values(OP, &values)?;
        expect_int(OP, "offsets", &offsets)?;
        expect_1d(OP, "offsets", &offsets)?;
        let offs = read_ints(OP, "offsets", &offsets)?;
        validate_offsets(OP, &offs, |i| format!("sample {i}"))?;
        expect_total(OP, "offsets", offs[offs.len() - 1], values.shape()[0])?;
        check_weights(OP, &values, weights.as_ref())?;
        let n = offs.len() - 1;
        let lengths = int_tensor(lengths_from_offsets(&offs), &[n], offsets.dtype())?;
        Ok(JaggedTensor {
            values,
            weights,
            lengths,
            offsets,
        })
    }

    /// Builds without validating: for hot paths whose inputs were validated upstream.
    /// `offsets` must be the complete cumsum of `lengths` and end at the rows of `values`;
    /// otherwise later operations give wrong results or an error/panic (never undefined
    /// behaviour).
    pub fn new_unchecked(
        values: Tensor,
        lengths: Tensor,
        offsets: Tensor,
        weights: Option<Tensor>,
    ) -> Self {
        JaggedTensor {
            values,
            weights,
            lengths,
            offsets,
        }
    }

    /// Builds from one tensor per sample (`[len_i, ...]`, same trailing shape), concatenated;
    /// `weights`, when given, is one `[len_i]` tensor per sample.
    pub fn from_dense(values: &[Tensor], weights: Option<&[Tensor]>) -> Result<Self> {
        const OP: &str = "JaggedTensor::from_dense";
        if values.is_empty() {
            return Err(Error::invalid(
                OP,
                "no samples given; the dtype of the values is unknown",
            ));
        }
        let lengths: Vec<i64> = values
            .iter()
            .map(|v| v.shape().first().copied().unwrap_or(0) as i64)
            .collect();
        let refs: Vec<&Tensor> = values.iter().collect();
        let cat = Tensor::cat(&refs, 0)?;
        let weights = match weights {
            Some(w) => {
                if w.len() != values.len() {
                    return Err(Error::invalid(
                        OP,
                        format!("{} weight tensors for {} samples", w.len(), values.len()),
                    ));
                }
                for (i, (wi, &len)) in w.iter().zip(&lengths).enumerate() {
                    if wi.shape() != [len as usize] {
                        return Err(Error::invalid(
                            OP,
                            format!(
                                "sample {i}: weights have shape {:?}, expected [{len}]",
                                wi.shape()
                            ),
                        ));
                    }
                }
                let wr: Vec<&Tensor> = w.iter().collect();
                Some(Tensor::cat(&wr, 0)?)
            }
            None => None,
        };
        let n = lengths.len();
        JaggedTensor::new(cat, Tensor::from_vec(lengths, &[n])?, weights)
    }

    /// Builds from a padded dense `[B, N, ...]` tensor keeping the first `lengths[b]` rows of
    /// each sample (each at most N); `weights`, when given, is `[B, N]` and kept the same way.
    /// Differentiable in `values` and `weights`.
    pub fn from_dense_lengths(
        values: &Tensor,
        lengths: &Tensor,
        weights: Option<&Tensor>,
    ) -> Result<Self> {
        const OP: &str = "JaggedTensor::from_dense_lengths";
        expect_int(OP, "lengths", lengths)?;
        if values.rank() < 2 {
            return Err(Error::invalid(
                OP,
                format!("values must be [B, N, ...], got {:?}", values.shape()),
            ));
        }
        if let Some(w) = weights {
            // (Narrower weights padded the rows past them with zero weights.)
            if w.shape() != &values.shape()[..2] {
                return Err(Error::invalid(
                    OP,
                    format!(
                        "weights have shape {:?}; expected [B, N] = {:?}, as the values",
                        w.shape(),
                        &values.shape()[..2]
                    ),
                ));
            }
        }
        let lens = read_ints(OP, "lengths", lengths)?;
        if lens.len() != values.shape()[0] {
            return Err(Error::invalid(
                OP,
                format!(
                    "{} lengths for a batch of {}",
                    lens.len(),
                    values.shape()[0]
                ),
            ));
        }
        let max = values.shape()[1];
        if let Some(b) = lens.iter().position(|&l| l > max as i64) {
            return Err(Error::invalid(
                OP,
                format!(
                    "sample {b}: length {} exceeds the padded length {max}",
                    lens[b]
                ),
            ));
        }
        let offsets = offsets_from_lengths(OP, &lens, |i| format!("sample {i}"))?;
        let offsets_t = Tensor::from_vec(offsets, &[lens.len() + 1])?;
        let jagged_values = dense_to_jagged(values, &[&offsets_t], None)?;
        let jagged_weights = weights
            .map(|w| dense_to_jagged(w, &[&offsets_t], None))
            .transpose()?;
        JaggedTensor::new(jagged_values, lengths.clone(), jagged_weights)
    }

    /// The values, `[total, ...]`.
    pub fn values(&self) -> &Tensor {
        &self.values
    }

    /// The per-value weights, if any.
    pub fn weights(&self) -> Option<&Tensor> {
        self.weights.as_ref()
    }

    /// Rows per sample.
    pub fn lengths(&self) -> &Tensor {
        &self.lengths
    }

    /// Exclusive cumsum of the lengths (one entry longer).
    pub fn offsets(&self) -> &Tensor {
        &self.offsets
    }

    /// Number of samples.
    pub fn num_samples(&self) -> usize {
        self.lengths.numel()
    }

    /// The lengths as a host vector.
    pub fn lengths_vec(&self) -> Result<Vec<i64>> {
        read_ints("JaggedTensor::lengths_vec", "lengths", &self.lengths)
    }

    /// The offsets as a host vector.
    pub fn offsets_vec(&self) -> Result<Vec<i64>> {
        read_ints("JaggedTensor::offsets_vec", "offsets", &self.offsets)
    }

    fn padded(
        &self,
        t: &Tensor,
        desired_length: Option<usize>,
        padding_value: f64,
    ) -> Result<Tensor> {
        let length = match desired_length {
            Some(l) => l,
            None => self.lengths_vec()?.into_iter().max().unwrap_or(0) as usize,
        };
        jagged_to_padded_dense(t, &[&self.offsets], &[length], padding_value)
    }

    /// `[B, L, ...]` dense values: each sample's rows, truncated or padded with
    /// `padding_value` to `desired_length` (default: the longest sample). Differentiable.
    pub fn to_padded_dense(
        &self,
        desired_length: Option<usize>,
        padding_value: f64,
    ) -> Result<Tensor> {
        self.padded(&self.values, desired_length, padding_value)
    }

    /// The weights padded like [`to_padded_dense`](Self::to_padded_dense), if there are weights.
    pub fn to_padded_dense_weights(
        &self,
        desired_length: Option<usize>,
        padding_value: f64,
    ) -> Result<Option<Tensor>> {
        self.weights
            .as_ref()
            .map(|w| self.padded(w, desired_length, padding_value))
            .transpose()
    }

    fn per_sample(&self, t: &Tensor) -> Result<Vec<Tensor>> {
        let offsets = self.offsets_vec()?;
        offsets
            .windows(2)
            .map(|w| t.narrow(0, w[0] as usize, (w[1] - w[0]) as usize))
            .collect()
    }

    /// One tensor per sample (views of the values, no copy).
    pub fn to_dense(&self) -> Result<Vec<Tensor>> {
        self.per_sample(&self.values)
    }

    /// One weight tensor per sample, if there are weights.
    pub fn to_dense_weights(&self) -> Result<Option<Vec<Tensor>>> {
        self.weights
            .as_ref()
            .map(|w| self.per_sample(w))
            .transpose()
    }
}
