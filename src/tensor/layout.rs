//! Shapes, strides and offsets: how a tensor's logical elements map onto its storage. Views
//! (reshape, transpose, narrow, expand) only build a new `Layout`.

use crate::{Error, Result};

/// Shape, element strides and starting offset of a tensor view.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Layout {
    shape: Vec<usize>,
    strides: Vec<usize>,
    offset: usize,
}

/// Row-major strides of a contiguous tensor of `shape`. Saturating: only a shape of no
/// elements can have a stride past a `usize` ([0, usize::MAX, 2]; every other shape's element
/// count is checked to fit), and its strides never address anything.
pub fn contiguous_strides(shape: &[usize]) -> Vec<usize> {
    let mut strides = vec![1usize; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        strides[i] = strides[i + 1].saturating_mul(shape[i + 1]);
    }
    strides
}

/// Resolves a possibly negative dimension index against `rank`.
pub fn resolve_dim(op: &'static str, dim: isize, rank: usize) -> Result<usize> {
    let d = if dim < 0 { dim + rank as isize } else { dim };
    if d < 0 || d as usize >= rank {
        Err(Error::DimOutOfRange { op, dim, rank })
    } else {
        Ok(d as usize)
    }
}

/// The broadcast of two shapes (numpy rules), or an error naming `op`.
pub fn broadcast_shapes(op: &'static str, a: &[usize], b: &[usize]) -> Result<Vec<usize>> {
    let rank = a.len().max(b.len());
    let mut out = vec![0; rank];
    for i in 0..rank {
        let da = if i + a.len() >= rank {
            a[i + a.len() - rank]
        } else {
            1
        };
        let db = if i + b.len() >= rank {
            b[i + b.len() - rank]
        } else {
            1
        };
        out[i] = if da == db || db == 1 {
            da
        } else if da == 1 {
            db
        } else {
            return Err(Error::ShapeMismatch {
                op,
                lhs: a.to_vec(),
                rhs: b.to_vec(),
                detail: format!("dimension {i} of the broadcast: {da} vs {db}"),
            });
        };
    }
    Ok(out)
}

impl Layout {
    /// A contiguous layout of `shape` starting at 0.
    pub fn contiguous(shape: &[usize]) -> Self {
        Layout {
            shape: shape.to_vec(),
            strides: contiguous_strides(shape),
            offset: 0,
        }
    }

    /// Builds a layout from parts (used by views).
    pub fn new(shape: Vec<usize>, strides: Vec<usize>, offset: usize) -> Self {
        Layout {
            shape,
            strides,
            offset,
        }
    }

    /// The shape.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// Element strides per dimension (0 for broadcast dimensions).
    pub fn strides(&self) -> &[usize] {
        &self.strides
    }

    /// Offset of the first element in the storage.
    pub fn offset(&self) -> usize {
        self.offset
    }

    /// Number of elements (0 when any dimension is 0, whatever the others; views are built
    /// with element counts that fit a `usize`).
    pub fn numel(&self) -> usize {
        if self.shape.contains(&0) {
            return 0;
        }
        self.shape.iter().product()
    }

    /// True when elements are laid out row-major without gaps.
    pub fn is_contiguous(&self) -> bool {
        let mut expected = 1;
        for (&d, &s) in self.shape.iter().zip(&self.strides).rev() {
            if d != 1 && s != expected {
                return false;
            }
            expected = expected.saturating_mul(d);
        }
        true
    }

    /// Strides of this layout broadcast to `shape` (0 where this layout's dimension is 1 or
    /// missing). The caller has checked that the shapes broadcast.
    pub fn broadcast_strides(&self, shape: &[usize]) -> Vec<usize> {
        let rank = shape.len();
        let own = self.shape.len();
        (0..rank)
            .map(|i| {
                if i + own < rank {
                    0
                } else {
                    let j = i + own - rank;
                    if self.shape[j] == 1 && shape[i] != 1 {
                        0
                    } else {
                        self.strides[j]
                    }
                }
            })
            .collect()
    }

    /// Storage index of every element, in row-major logical order.
    pub fn offsets(&self) -> Vec<usize> {
        let mut out = Vec::with_capacity(self.numel());
        for_each_row(
            &self.shape,
            &[&self.strides],
            &[self.offset],
            |n, base, st| {
                let (b, s) = (base[0], st[0]);
                out.extend((0..n).map(|i| b + i * s));
            },
        );
        out
    }

    /// Copies the viewed elements of `data` into a new contiguous vector.
    pub fn gather<T: Copy + Send + Sync>(&self, data: &[T]) -> Vec<T> {
        let mut out = Vec::with_capacity(self.numel());
        self.gather_into(data, &mut out);
        out
    }

    /// [`gather`](Self::gather) into a vector allocated fallibly: an error naming `op` when
    /// the allocator refuses the elements (an expanded view of 2^40 elements made
    /// contiguous aborted the process).
    pub(crate) fn try_gather<T: Copy + Send + Sync>(
        &self,
        op: &'static str,
        data: &[T],
    ) -> Result<Vec<T>> {
        let mut out = crate::tensor::storage::try_with_capacity(op, self.numel())?;
        self.gather_into(data, &mut out);
        Ok(out)
    }

    /// Appends the elements in row-major order to `out` (which has room for them).
    fn gather_into<T: Copy + Send + Sync>(&self, data: &[T], out: &mut Vec<T>) {
        let n = self.numel();
        if self.is_contiguous() {
            out.extend_from_slice(&data[self.offset..self.offset + n]);
            return;
        }
        if self.gather_transposed(data, out) {
            return;
        }
        for_each_row(
            &self.shape,
            &[&self.strides],
            &[self.offset],
            |len, base, st| {
                let (b, s) = (base[0], st[0]);
                if s == 1 {
                    out.extend_from_slice(&data[b..b + len]);
                } else {
                    out.extend((0..len).map(|i| data[b + i * s]));
                }
            },
        );
    }
}

impl Layout {
    /// Fast path of [`Layout::gather`] for views whose two innermost (collapsed) dimensions
    /// are transposed (`x.t()`, `x.transpose(1, 2)`): copies in square tiles so that both the
    /// reads and the writes stay in cache, instead of striding through memory per element.
    fn gather_transposed<T: Copy + Send + Sync>(&self, data: &[T], out: &mut Vec<T>) -> bool {
        const TILE: usize = 16;
        let (shape, strides) = collapse(&self.shape, &[&self.strides]);
        let st = &strides[0];
        let r = shape.len();
        if r < 2 || st[r - 2] != 1 || st[r - 1] == 1 {
            return false;
        }
        let (rows, cols, col_stride) = (shape[r - 2], shape[r - 1], st[r - 1]);
        let copy_matrix = |out: &mut Vec<T>, base: usize| {
            let start = out.len();
            out.resize(start + rows * cols, data[base]);
            // One band of TILE output rows: read TILE×TILE blocks so both the strided reads and
            // the writes stay within a few cache lines.
            let band = |(b, dst): (usize, &mut [T])| {
                let i0 = b * TILE;
                for j0 in (0..cols).step_by(TILE) {
                    let j1 = (j0 + TILE).min(cols);
                    for (di, row) in dst.chunks_mut(cols).enumerate() {
                        let src = &data[base + i0 + di + j0 * col_stride..];
                        for (k, d) in row[j0..j1].iter_mut().enumerate() {
                            *d = src[k * col_stride];
                        }
                    }
                }
            };
            let dst = &mut out[start..];
            if rows * cols >= 1 << 16 {
                use rayon::prelude::*;
                dst.par_chunks_mut(TILE * cols).enumerate().for_each(band);
            } else {
                dst.chunks_mut(TILE * cols).enumerate().for_each(band);
            }
        };
        if r == 2 {
            copy_matrix(out, self.offset);
        } else {
            let outer_strides = st[..r - 2].to_vec();
            for_each_row(
                &shape[..r - 2],
                &[&outer_strides],
                &[self.offset],
                |len, base, step| {
                    for k in 0..len {
                        copy_matrix(out, base[0] + k * step[0]);
                    }
                },
            );
        }
        true
    }
}

/// Merges adjacent dimensions that are contiguous with respect to every operand and drops
/// size-1 dimensions, so strided loops run over as few, as long rows as possible.
fn collapse(shape: &[usize], strides: &[&[usize]]) -> (Vec<usize>, Vec<Vec<usize>>) {
    let k = strides.len();
    let mut out_shape: Vec<usize> = Vec::with_capacity(shape.len());
    let mut out_strides: Vec<Vec<usize>> = vec![Vec::with_capacity(shape.len()); k];
    for (d, &size) in shape.iter().enumerate() {
        if size == 1 {
            continue;
        }
        if let Some(&last) = out_shape.last() {
            let mergeable = (0..k).all(|o| {
                let prev = *out_strides[o].last().expect("same length as out_shape");
                prev == strides[o][d] * size
            });
            if mergeable {
                *out_shape.last_mut().expect("non-empty") = last * size;
                for (o, st) in out_strides.iter_mut().enumerate() {
                    *st.last_mut().expect("non-empty") = strides[o][d];
                }
                continue;
            }
        }
        out_shape.push(size);
        for (o, st) in out_strides.iter_mut().enumerate() {
            st.push(strides[o][d]);
        }
    }
    (out_shape, out_strides)
}

/// Walks a shape row by row for several operands at once. For every run of the innermost
/// (collapsed) dimension calls `f(len, bases, inner_strides)` with each operand's storage index
/// of the run's first element and its stride along the run. Rows come in row-major order.
pub fn for_each_row(
    shape: &[usize],
    strides: &[&[usize]],
    offsets: &[usize],
    mut f: impl FnMut(usize, &[usize], &[usize]),
) {
    if shape.contains(&0) {
        return;
    }
    let k = strides.len();
    let (shape, strides) = collapse(shape, strides);
    if shape.is_empty() {
        f(1, offsets, &vec![0; k]);
        return;
    }
    let rank = shape.len();
    let inner = shape[rank - 1];
    let inner_strides: Vec<usize> = strides.iter().map(|s| s[rank - 1]).collect();
    let mut idx = vec![0usize; rank - 1];
    let mut bases = offsets.to_vec();
    loop {
        f(inner, &bases, &inner_strides);
        // Advance the multi-index over the outer dimensions.
        let mut d = rank - 1;
        loop {
            if d == 0 {
                return;
            }
            d -= 1;
            idx[d] += 1;
            for o in 0..k {
                bases[o] += strides[o][d];
            }
            if idx[d] < shape[d] {
                break;
            }
            for o in 0..k {
                bases[o] -= strides[o][d] * shape[d];
            }
            idx[d] = 0;
        }
    }
}
