//! FBGEMM's jagged and sparse op set on CPU, one family of ops per file with each op's forward
//! and backward side by side. Differentiable ops join the autograd graph through
//! [`record_op`](crate::tensor::record_op); index, length and offset arguments accept i64 or
//! i32 tensors.

mod baddbmm;
mod bmm;
pub(crate) mod bucketize;
mod cumsum;
pub(crate) mod dense;
mod elementwise;
mod permute;
mod row_ranges;
mod segment;
mod select;
mod softmax;

pub use baddbmm::permute102_baddbmm_permute102;
pub use bmm::{batched_dense_vec_jagged_2d_mul, jagged_dense_bmm, jagged_jagged_bmm};
pub use bucketize::{block_bucketize_sparse_features, BlockBucketizeOptions, BlockBucketized};
pub use cumsum::{complete_cumsum, exclusive_cumsum, inclusive_cumsum};
pub use dense::{
    dense_to_jagged, jagged_1d_to_dense, jagged_2d_to_dense, jagged_to_padded_dense,
    stacked_jagged_1d_to_dense,
};
pub use elementwise::{
    jagged_dense_dense_elementwise_add_jagged_output, jagged_dense_elementwise_add,
    jagged_dense_elementwise_add_jagged_output, jagged_dense_elementwise_mul,
};
pub use permute::{expand_into_jagged_permute, permute_2d_sparse_data, PermutedSparseData};
pub use segment::segment_sum_csr;
pub use select::{
    index_select_dim0, jagged_1d_to_truncated_values, jagged_index_select, jagged_slice,
    keyed_jagged_index_select_dim1, masked_select_jagged_1d, KeyedJaggedSelection,
};
pub use softmax::jagged_softmax;

pub(crate) use helpers::*;
pub(crate) use row_ranges::gather_row_ranges_tensor;

mod helpers {
    use std::mem::MaybeUninit;

    use rayon::prelude::*;

    use crate::{DType, Error, Result, Tensor};

    /// Element count above which the jagged kernels split their work across rayon threads
    /// (the tensor core's threshold).
    pub(crate) const PARALLEL_MIN_ELEMENTS: usize = crate::tensor::ops::PAR_THRESHOLD;

    pub(crate) use crate::tensor::ops::with_any_dtype;

    /// Bytes above which an output buffer asks the kernel for transparent huge pages.
    const HUGE_PAGE_MIN_BYTES: usize = 4 << 20;

    /// Asks the kernel to back a large, not yet touched buffer with transparent huge pages
    /// (Linux `madvise(MADV_HUGEPAGE)`). Fresh multi-megabyte buffers are otherwise filled one
    /// 4 KiB page fault at a time, which costs more than the copy itself on a VM. Purely
    /// advisory: contents and validity of the memory are unchanged, and failure is ignored.
    pub(crate) fn advise_huge_pages<T>(buf: &mut Vec<T>) {
        let bytes = buf.capacity() * std::mem::size_of::<T>();
        if bytes < HUGE_PAGE_MIN_BYTES {
            return;
        }
        #[cfg(target_os = "linux")]
        {
            const PAGE: usize = 4096;
            const MADV_HUGEPAGE: i32 = 14;
            extern "C" {
                fn madvise(addr: *mut std::ffi::c_void, len: usize, advice: i32) -> i32;
            }
            let start = buf.as_mut_ptr() as usize;
            let aligned = start.next_multiple_of(PAGE);
            let end = (start + bytes) / PAGE * PAGE;
            if end > aligned {
                // SAFETY: [aligned, end) lies inside this vector's allocation and is
                // page-aligned; MADV_HUGEPAGE only changes how the kernel backs the pages.
                unsafe {
                    madvise(
                        aligned as *mut std::ffi::c_void,
                        end - aligned,
                        MADV_HUGEPAGE,
                    );
                }
            }
        }
    }

    /// An empty vector with room for `n` elements, advised to use huge pages when large.
    pub(crate) fn output_buffer<T>(n: usize) -> Vec<T> {
        let mut out = Vec::with_capacity(n);
        advise_huge_pages(&mut out);
        out
    }

    /// A zero-filled (default-filled) vector of `n` elements; for zero-representable types
    /// the allocator hands out untouched pages, which are advised to use huge pages.
    pub(crate) fn zeroed_buffer<T: Clone + Default>(n: usize) -> Vec<T> {
        let mut out = vec![T::default(); n];
        advise_huge_pages(&mut out);
        out
    }

    /// Reads an integer tensor (i64 or i32, any shape) as i64 in row-major order.
    pub(crate) fn read_ints(op: &'static str, what: &str, t: &Tensor) -> Result<Vec<i64>> {
        match t.dtype() {
            DType::I64 => t.to_vec::<i64>(),
            DType::I32 => Ok(t.to_vec::<i32>()?.into_iter().map(i64::from).collect()),
            d => Err(Error::invalid(
                op,
                format!("{what} must be an i64 or i32 tensor, got {d:?}"),
            )),
        }
    }

    /// An integer tensor of `dtype` (i32 keeps the caller's narrower index type, anything
    /// else gives i64).
    /// A value past `i32` is an error (it wrapped: offsets past 2^31 values read negative).
    pub(crate) fn int_tensor(values: Vec<i64>, shape: &[usize], dtype: DType) -> Result<Tensor> {
        match dtype {
            DType::I32 => {
                let narrow = (values.iter())
                    .map(|&v| i32::try_from(v))
                    .collect::<std::result::Result<Vec<_>, _>>()
                    .map_err(|_| {
                        Error::invalid(
                            "jagged",
                            "offsets or indices past i32::MAX in an i32 tensor: give i64 \
                             lengths",
                        )
                    })?;
                Tensor::from_vec(narrow, shape)
            }
            _ => Tensor::from_vec(values, shape),
        }
    }

    /// Checks that `t` is an i64/i32 index tensor.
    pub(crate) fn expect_int(op: &'static str, what: &str, t: &Tensor) -> Result<()> {
        match t.dtype() {
            DType::I64 | DType::I32 => Ok(()),
            d => Err(Error::invalid(
                op,
                format!("{what} must be an i64 or i32 tensor, got {d:?}"),
            )),
        }
    }

    /// Offsets (`lengths.len() + 1` entries, starting at 0) from lengths, rejecting negative
    /// lengths; `describe(i)` names position `i` in the error (e.g. its key and sample).
    pub(crate) fn offsets_from_lengths(
        op: &'static str,
        lengths: &[i64],
        describe: impl Fn(usize) -> String,
    ) -> Result<Vec<i64>> {
        let mut offsets = Vec::with_capacity(lengths.len() + 1);
        let mut total = 0i64;
        offsets.push(0);
        for (i, &len) in lengths.iter().enumerate() {
            if len < 0 {
                return Err(Error::invalid(
                    op,
                    format!("{}: length {len} is negative", describe(i)),
                ));
            }
            total = total.checked_add(len).ok_or_else(|| {
                Error::invalid(op, format!("{}: the lengths sum past an i64", describe(i)))
            })?;
            offsets.push(total);
        }
        Ok(offsets)
    }

    /// Checks that offsets start at 0 and never decrease; `describe(i)` names the bag whose end
    /// is `offsets[i + 1]`.
    pub(crate) fn validate_offsets(
        op: &'static str,
        offsets: &[i64],
        describe: impl Fn(usize) -> String,
    ) -> Result<()> {
        match offsets.first() {
            None => {
                return Err(Error::invalid(
                    op,
                    "offsets are empty; expected at least one entry (0)",
                ))
            }
            Some(&first) if first != 0 => {
                return Err(Error::invalid(
                    op,
                    format!("offsets must start at 0, but offsets[0] = {first}"),
                ))
            }
            _ => {}
        }
        for (i, w) in offsets.windows(2).enumerate() {
            if w[1] < w[0] {
                return Err(Error::invalid(
                    op,
                    format!(
                        "{}: offsets decrease at position {} ({} after {}); offsets must be \
                         non-decreasing",
                        describe(i),
                        i + 1,
                        w[1],
                        w[0]
                    ),
                ));
            }
        }
        Ok(())
    }

    /// Checks that the last offset equals the number of rows of `values`.
    pub(crate) fn expect_total(
        op: &'static str,
        what: &str,
        total: i64,
        rows: usize,
    ) -> Result<()> {
        if total != rows as i64 {
            return Err(Error::invalid(
                op,
                format!("{what} add up to {total} but values has {rows} rows"),
            ));
        }
        Ok(())
    }

    /// Lengths from offsets (consecutive differences).
    pub(crate) fn lengths_from_offsets(offsets: &[i64]) -> Vec<i64> {
        // (Wrapping: offsets not yet checked may decrease past i64; they are refused after.)
        offsets
            .windows(2)
            .map(|w| w[1].wrapping_sub(w[0]))
            .collect()
    }

    /// Reads validated offsets of a jagged dimension from an i64/i32 tensor.
    pub(crate) fn read_offsets(op: &'static str, offsets: &Tensor) -> Result<Vec<i64>> {
        if offsets.rank() != 1 {
            return Err(Error::invalid(
                op,
                format!("offsets must be 1-D, got shape {:?}", offsets.shape()),
            ));
        }
        let v = read_ints(op, "offsets", offsets)?;
        validate_offsets(op, &v, |i| format!("bag {i}"))?;
        Ok(v)
    }

    /// Reads lengths (1-D, non-negative) and returns them with their offsets.
    pub(crate) fn read_lengths(op: &'static str, lengths: &Tensor) -> Result<(Vec<i64>, Vec<i64>)> {
        let v = read_ints(op, "lengths", lengths)?;
        let offsets = offsets_from_lengths(op, &v, |i| format!("bag {i}"))?;
        Ok((v, offsets))
    }

    /// Elements per row of a tensor whose first dimension counts rows.
    pub(crate) fn row_len(t: &Tensor) -> usize {
        t.shape().iter().skip(1).product()
    }

    /// Copies `src` into the uninitialised `dst` of the same length.
    #[inline]
    pub(crate) fn copy_to_uninit<T: Copy>(dst: &mut [MaybeUninit<T>], src: &[T]) {
        assert_eq!(dst.len(), src.len(), "copy_to_uninit: length mismatch");
        // SAFETY: equal lengths (checked), `MaybeUninit<T>` has `T`'s layout, and the regions
        // cannot overlap because `dst` is borrowed mutably.
        unsafe {
            std::ptr::copy_nonoverlapping(src.as_ptr(), dst.as_mut_ptr().cast::<T>(), src.len())
        }
    }

    /// Rows of `src` (each `row_len` long) picked by `map`; a negative entry yields a row of
    /// `fill`. Every output element is written exactly once, so the buffer is never
    /// zero-initialised first.
    pub(crate) fn gather_rows<T: Copy + Send + Sync>(
        src: &[T],
        row_len: usize,
        map: &[i64],
        fill: T,
    ) -> Vec<T> {
        let n = map.len() * row_len;
        let mut out: Vec<T> = output_buffer(n);
        if row_len > 0 {
            let dst = &mut out.spare_capacity_mut()[..n];
            let work = |(rows_out, rows_map): (&mut [MaybeUninit<T>], &[i64])| {
                for (row, &m) in rows_out.chunks_exact_mut(row_len).zip(rows_map) {
                    if m >= 0 {
                        copy_to_uninit(row, &src[m as usize * row_len..(m as usize + 1) * row_len]);
                    } else {
                        for d in row {
                            d.write(fill);
                        }
                    }
                }
            };
            if n >= PARALLEL_MIN_ELEMENTS {
                let rows_per_task = (16_384 / row_len.max(1)).max(1);
                dst.par_chunks_mut(rows_per_task * row_len)
                    .zip(map.par_chunks(rows_per_task))
                    .for_each(work);
            } else {
                work((dst, map));
            }
        }
        // SAFETY: the loops above wrote all `n` elements (each of the `map.len()` rows of
        // `row_len` elements, either copied or filled); a panic before this point leaks the
        // allocation but never exposes uninitialised memory.
        unsafe { out.set_len(n) };
        out
    }

    /// Concatenation of the ranges `(start, len)` of `src` (in elements), copied in parallel when
    /// large. Like [`gather_rows`], writes each output element once.
    pub(crate) fn gather_ranges<T: Copy + Send + Sync>(
        src: &[T],
        ranges: &[(usize, usize)],
    ) -> Vec<T> {
        let n: usize = ranges.iter().map(|r| r.1).sum();
        let mut out: Vec<T> = output_buffer(n);
        {
            let mut rest = &mut out.spare_capacity_mut()[..n];
            let mut pieces = Vec::with_capacity(ranges.len());
            for &(start, len) in ranges {
                let (head, tail) = rest.split_at_mut(len);
                pieces.push((head, &src[start..start + len]));
                rest = tail;
            }
            let copy = |(dst, s): (&mut [MaybeUninit<T>], &[T])| {
                copy_to_uninit(dst, s);
            };
            if n >= PARALLEL_MIN_ELEMENTS {
                // Split big ranges so two large features don't serialise on one thread.
                let mut chunks = Vec::new();
                for (dst, s) in pieces {
                    for (d, c) in dst.chunks_mut(65_536).zip(s.chunks(65_536)) {
                        chunks.push((d, c));
                    }
                }
                chunks.into_par_iter().for_each(copy);
            } else {
                pieces.into_iter().for_each(copy);
            }
        }
        // SAFETY: the ranges' lengths add up to `n` and the pieces tile `[0, n)`, so every
        // element was written above.
        unsafe { out.set_len(n) };
        out
    }

    /// A raw view of an output buffer that several threads write at provably disjoint
    /// positions (the bucketize scatter). Writes are bounds-checked.
    pub(crate) struct DisjointWriter<T> {
        ptr: *mut T,
        len: usize,
    }

    // SAFETY: the writer only hands out writes to distinct positions, one thread per position
    // (the caller's contract on `write`).
    unsafe impl<T: Send> Sync for DisjointWriter<T> {}
    unsafe impl<T: Send> Send for DisjointWriter<T> {}

    impl<T: Copy> DisjointWriter<T> {
        /// Wraps `buf` for the lifetime of the scatter.
        pub(crate) fn new(buf: &mut [T]) -> Self {
            DisjointWriter {
                ptr: buf.as_mut_ptr(),
                len: buf.len(),
            }
        }

        /// Writes `value` at `index`.
        ///
        /// # Safety
        /// No other thread may read or write `index` during the scatter, and the buffer given
        /// to [`DisjointWriter::new`] must outlive every call.
        #[inline]
        pub(crate) unsafe fn write(&self, index: usize, value: T) {
            assert!(
                index < self.len,
                "scatter position {index} out of {}",
                self.len
            );
            // SAFETY: in bounds (checked above) and exclusive per the caller's contract.
            unsafe { self.ptr.add(index).write(value) };
        }
    }
}
