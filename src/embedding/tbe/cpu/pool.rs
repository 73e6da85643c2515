//! Forward kernels: gather, dequantise and pool rows into the output.
//!
//! The work is split over rayon tasks by output rows (samples), and inside a task each feature's
//! bags are walked in order, so the ids read are contiguous and the rows a few lookups ahead can
//! be prefetched. Row accumulation is written as plain element loops the compiler vectorises;
//! on x86-64 the per-feature loop is also compiled for AVX2+FMA+F16C and picked at run time.
//! Every row read is bounds-checked safe Rust: ids were validated once at the boundary
//! ([`validate`](crate::embedding::input)) so the checks never fire and cost little next to the memory
//! latency of a random row. The only `unsafe` blocks are the prefetch hints and the calls into
//! the AVX2 code paths (after the CPU was checked to support them), each with its SAFETY note.

use std::mem::MaybeUninit;

use rayon::prelude::*;

use crate::embedding::config::{PoolingMode, WeightType};
use crate::embedding::input::{Batch, Ids, IndexValue};
use crate::embedding::quantize::row_scale_bias;

/// How many ids ahead to prefetch rows. Measured on the 2-core bench machine (distances 0, 4,
/// 8, 16, 32; whole rows or their first lines): 4 whole rows ahead was fastest for the
/// row-at-a-time kernel (quantised rows); further ahead the prefetches outrun the core's miss
/// buffers and get dropped.
const PREFETCH_DISTANCE: usize = 4;

/// Cache lines the column-block kernel of FP32 rows keeps in flight: each pass over a bag's
/// rows (one column block) prefetches that block of the row `BLOCK_PREFETCH_LINES / lines per
/// block` ids ahead (at least 4, at most 32). Measured on the 2-core bench machine (T=32 B=512
/// E=1e5 L=20, Zipf and uniform ids, 5-7 alternating runs, medians): at D=16 32 rows ahead
/// beat 16 and 8 (Zipf 1.42 / 1.59 / 2.16 ms); at D=64 16 beat 8 (3.32 / 3.72 ms) and 32 was
/// no better. Rows wider than a block were first prefetched whole by the first pass only, and
/// the later passes (which read the bag's rows from the cache) left the memory idle: at D=256
/// (four passes) prefetching each pass's own block 16 rows ahead took the forward from 28.9 to
/// 26.1 ms on uniform ids and from 16.4 to 12.8 ms on Zipf ids (six alternating runs,
/// medians); 32 rows ahead was no better, and D=128 was unchanged (13.9 / 7.7 ms).
const BLOCK_PREFETCH_LINES: usize = 64;

/// How many ids ahead the column-block kernel prefetches blocks of `row_bytes` bytes.
#[inline(always)]
const fn block_prefetch_distance(row_bytes: usize) -> usize {
    let lines = row_bytes.div_ceil(64);
    let d = BLOCK_PREFETCH_LINES / if lines == 0 { 1 } else { lines };
    if d < 4 {
        4
    } else if d > 32 {
        32
    } else {
        d
    }
}

/// Columns pooled at a time by the column-block kernel: 64 f32 stay in registers (8 AVX2
/// registers) while every row of the bag is added, instead of a load and store of the output
/// per row and column.
const BLOCK: usize = 64;

/// Prefetches every cache line of `len` bytes at `start`: into L1, or with `L2` into L2 only.
/// The column-block kernel prefetches into L2: it keeps more rows in flight than L1's miss
/// buffers hold, and the T1 hint took its forward from ~13 to ~7 ms on the bench machine
/// (T=32 B=512 D=128 E=1e5 L=20, side by side with nn.EmbeddingBag).
#[inline(always)]
pub(crate) fn prefetch_lines<const L2: bool>(start: *const u8, len: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0, _MM_HINT_T1};
        let mut offset = 0;
        while offset < len {
            let line = start.wrapping_add(offset) as *const i8;
            // SAFETY: a prefetch is a hint that never faults and reads nothing observable; the
            // address (computed with wrapping arithmetic, so no pointer UB) lies in the row.
            unsafe {
                if L2 {
                    _mm_prefetch::<_MM_HINT_T1>(line)
                } else {
                    _mm_prefetch::<_MM_HINT_T0>(line)
                }
            };
            offset += 64;
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (start, len);
}

/// One table's rows as the kernels see them.
pub(crate) trait TableRows: Copy + Sync {
    /// Starts fetching row `id` into the cache.
    fn prefetch(&self, id: usize);
    /// `out += w · row(id)` (dequantised in f32).
    fn accumulate(&self, id: usize, w: f32, out: &mut [f32]);
    /// Whether [`accumulate_cols`](Self::accumulate_cols) reads columns directly (plain f32
    /// rows), so that bags pool by column blocks.
    const COLUMN_BLOCKS: bool = false;
    /// Columns per row (a constant to the compiler for [`Width`] rows); only called when
    /// `COLUMN_BLOCKS`.
    fn width(&self) -> usize {
        unreachable!("only rows with COLUMN_BLOCKS pool by column blocks")
    }
    /// Starts fetching columns `c0..c0 + width` of row `id` into L2 (the column-block
    /// kernel's prefetch of one block); only called when `COLUMN_BLOCKS`.
    fn prefetch_cols_l2(&self, _id: usize, _c0: usize, _width: usize) {
        unreachable!("only rows with COLUMN_BLOCKS pool by column blocks")
    }
    /// `acc += w · row(id)[c0..c0 + acc.len()]`; only called when `COLUMN_BLOCKS`.
    fn accumulate_cols(&self, _id: usize, _w: f32, _c0: usize, _acc: &mut [f32]) {
        unreachable!("only rows with COLUMN_BLOCKS pool by column blocks")
    }
    /// `acc += w · row(id)[c0..c0 + W]`, or without `WEIGHTED` `acc += row(id)[c0..c0 + W]`:
    /// `W` and the accumulator's size are known to the compiler, so `acc` stays in registers.
    /// Only called when `COLUMN_BLOCKS`.
    fn accumulate_block<const W: usize, const WEIGHTED: bool>(
        &self,
        _id: usize,
        _w: f32,
        _c0: usize,
        _acc: &mut [f32; W],
    ) {
        unreachable!("only rows with COLUMN_BLOCKS pool by column blocks")
    }
}

/// A row width: known only at run time ([`AnyWidth`]) or to the compiler ([`Width`]).
pub(crate) trait RowWidth: Copy + Sync {
    /// Columns per row.
    fn get(self) -> usize;
}

/// A row width known at run time.
#[derive(Clone, Copy)]
pub(crate) struct AnyWidth(pub usize);

impl RowWidth for AnyWidth {
    #[inline(always)]
    fn get(self) -> usize {
        self.0
    }
}

/// A row width known to the compiler: the row address is a shift, the prefetch of a row a
/// fixed run of instructions and the column blocks of a bag a fixed sequence, so a row that
/// is already cached (most of them on Zipf ids) costs fewer instructions.
#[derive(Clone, Copy)]
pub(crate) struct Width<const D: usize>;

impl<const D: usize> RowWidth for Width<D> {
    #[inline(always)]
    fn get(self) -> usize {
        D
    }
}

/// FP32 rows of a training table, `dim` columns each.
#[derive(Clone, Copy)]
pub(crate) struct F32Rows<'a, W: RowWidth = AnyWidth> {
    pub rows: &'a [f32],
    pub dim: W,
}

/// Calls `k` with `rows` as [`F32Rows`] of a width known to the compiler where `dim` is one
/// models use most (16, 32, 64, 128, 256), else of a run-time width.
pub(crate) fn with_f32_rows<R>(
    rows: &[f32],
    dim: usize,
    k: impl FnOnce(&dyn PoolFeature) -> R,
) -> R {
    match dim {
        16 => k(&F32Rows {
            rows,
            dim: Width::<16>,
        }),
        32 => k(&F32Rows {
            rows,
            dim: Width::<32>,
        }),
        64 => k(&F32Rows {
            rows,
            dim: Width::<64>,
        }),
        128 => k(&F32Rows {
            rows,
            dim: Width::<128>,
        }),
        256 => k(&F32Rows {
            rows,
            dim: Width::<256>,
        }),
        _ => k(&F32Rows {
            rows,
            dim: AnyWidth(dim),
        }),
    }
}

impl<W: RowWidth> F32Rows<'_, W> {
    /// Prefetches columns `c0..c0 + width` of row `id` (into L2 with `L2`). The address by
    /// wrapping arithmetic, without the slice's bounds checks: a prefetch never faults (and `id`
    /// was validated at the boundary). Dropping the checks made the forward ~10% faster on Zipf
    /// ids, where most rows are already cached and instructions per row decide.
    #[inline(always)]
    fn prefetch_cols<const L2: bool>(&self, id: usize, c0: usize, width: usize) {
        let at = id.wrapping_mul(self.dim.get()).wrapping_add(c0);
        let first = self.rows.as_ptr().wrapping_add(at) as *const u8;
        // From the line that holds the first column: `prefetch_lines` steps 64 bytes from its
        // start, and from an unaligned start would miss the last line.
        let skew = first as usize & 63;
        prefetch_lines::<L2>(first.wrapping_sub(skew), width * 4 + skew);
    }
}

impl<W: RowWidth> TableRows for F32Rows<'_, W> {
    #[inline(always)]
    fn prefetch(&self, id: usize) {
        self.prefetch_cols::<false>(id, 0, self.dim.get());
    }

    #[inline(always)]
    fn accumulate(&self, id: usize, w: f32, out: &mut [f32]) {
        let dim = self.dim.get();
        let row = &self.rows[id * dim..(id + 1) * dim];
        for (o, &x) in out.iter_mut().zip(row) {
            *o += w * x;
        }
    }

    const COLUMN_BLOCKS: bool = true;

    #[inline(always)]
    fn width(&self) -> usize {
        self.dim.get()
    }

    #[inline(always)]
    fn prefetch_cols_l2(&self, id: usize, c0: usize, width: usize) {
        self.prefetch_cols::<true>(id, c0, width);
    }

    #[inline(always)]
    fn accumulate_cols(&self, id: usize, w: f32, c0: usize, acc: &mut [f32]) {
        let start = id * self.dim.get() + c0;
        let cols = &self.rows[start..start + acc.len()];
        for (a, &x) in acc.iter_mut().zip(cols) {
            *a += w * x;
        }
    }

    #[inline(always)]
    fn accumulate_block<const B: usize, const WEIGHTED: bool>(
        &self,
        id: usize,
        w: f32,
        c0: usize,
        acc: &mut [f32; B],
    ) {
        let start = id * self.dim.get() + c0;
        let cols: &[f32; B] = (self.rows[start..start + B]).try_into().expect("B columns");
        for j in 0..B {
            acc[j] += if WEIGHTED { w * cols[j] } else { cols[j] };
        }
    }
}

/// One bag's columns `c0..c0 + W` (positions `positions` of `ids`): the sum of its rows,
/// weighted by `weights[p]` with `WEIGHTED`. The accumulator is a local array of a size known
/// to the compiler and never sliced, so it lives in registers. Each block prefetches its own
/// columns of the row [`block_prefetch_distance`] ids ahead into L2 (across the bag's end:
/// the next bag's rows arrive while this bag's later blocks are pooled).
#[inline(always)]
fn pool_block<I: IndexValue, R: TableRows, const W: usize, const WEIGHTED: bool>(
    rows: &R,
    ids: &[I],
    weights: &[f32],
    positions: std::ops::Range<usize>,
    end: usize,
    c0: usize,
) -> [f32; W] {
    // A copy in registers: the prefetches would otherwise make the compiler reload the
    // rows' address and length from memory for every row.
    let rows = *rows;
    let mut acc = [0.0f32; W];
    let ahead = block_prefetch_distance(W * 4);
    for p in positions {
        if p + ahead < end {
            rows.prefetch_cols_l2(ids[p + ahead].to_usize(), c0, W);
        }
        let w = if WEIGHTED { weights[p] } else { 1.0 };
        rows.accumulate_block::<W, WEIGHTED>(ids[p].to_usize(), w, c0, &mut acc);
    }
    acc
}

/// Pools one bag into `o` (its `dim` output columns, every one of which it writes) by column blocks of 64, then 32, 16 and 8
/// for what is left, and a last narrower block column by column; `scale` multiplies the sums
/// (mean pooling). (A 128-column block for unweighted bags, all 16 AVX2 registers, was not
/// faster than two passes of 64 on the bench machine.)
#[inline(always)]
fn pool_bag_blocks<I: IndexValue, R: TableRows, const WEIGHTED: bool>(
    rows: &R,
    ids: &[I],
    weights: &[f32],
    positions: std::ops::Range<usize>,
    end: usize,
    o: &mut [MaybeUninit<f32>],
    scale: f32,
) {
    // The rows' width, not `o.len()` (the same number): for `Width` rows the compiler knows it
    // and lays the column blocks out at compile time.
    let dim = rows.width();
    let o = &mut o[..dim];
    let mut c0 = 0;
    macro_rules! blocks {
        ($w:expr) => {
            while dim - c0 >= $w {
                let acc = pool_block::<I, R, { $w }, WEIGHTED>(
                    rows,
                    ids,
                    weights,
                    positions.clone(),
                    end,
                    c0,
                );
                for (x, &a) in o[c0..c0 + $w].iter_mut().zip(&acc) {
                    x.write(a * scale);
                }
                c0 += $w;
            }
        };
    }
    blocks!(BLOCK);
    blocks!(32);
    blocks!(16);
    blocks!(8);
    if c0 < dim {
        let width = dim - c0;
        let mut acc = [0.0f32; 8];
        let ahead = block_prefetch_distance(width * 4);
        for p in positions {
            if p + ahead < end {
                rows.prefetch_cols_l2(ids[p + ahead].to_usize(), c0, width);
            }
            let w = if WEIGHTED { weights[p] } else { 1.0 };
            rows.accumulate_cols(ids[p].to_usize(), w, c0, &mut acc[..width]);
        }
        for (x, &a) in o[c0..].iter_mut().zip(&acc) {
            x.write(a * scale);
        }
    }
}

/// Exact f16 → f32 from the bits, written branch-free so it vectorises.
#[inline(always)]
pub(crate) fn f16_bits_to_f32(h: u16) -> f32 {
    let h = h as u32;
    let sign = (h & 0x8000) << 16;
    let magnitude = h & 0x7fff;
    // Shifted into f32 position the half's value is scaled by 2^-112 (sub-normals included);
    // one exact multiply by 2^112 rebases it. Inf/NaN keep an all-ones exponent instead.
    let shifted = magnitude << 13;
    let finite = (f32::from_bits(shifted) * f32::from_bits(0x7780_0000)).to_bits();
    let special = shifted | 0x7f80_0000;
    f32::from_bits(if magnitude >= 0x7c00 { special } else { finite } | sign)
}

/// Rows of one quantised inference table, decoded by `K`.
#[derive(Clone, Copy)]
pub(crate) struct QuantRows<'a, K> {
    pub bytes: &'a [u8],
    pub row_bytes: usize,
    pub kind: K,
}

/// Decodes one row format.
pub(crate) trait RowDecode: Sync + Copy {
    fn accumulate(self, row: &[u8], w: f32, out: &mut [f32]);
}

#[derive(Clone, Copy)]
pub(crate) struct DecodeF32;
#[derive(Clone, Copy)]
pub(crate) struct DecodeF16;
#[derive(Clone, Copy)]
pub(crate) struct DecodeBf16;
#[derive(Clone, Copy)]
pub(crate) struct DecodeHfp8;
#[derive(Clone, Copy)]
pub(crate) struct DecodeE4m3fn;
#[derive(Clone, Copy)]
pub(crate) struct DecodeInt8;
#[derive(Clone, Copy)]
pub(crate) struct DecodeInt4;
#[derive(Clone, Copy)]
pub(crate) struct DecodeInt2;

impl RowDecode for DecodeF32 {
    #[inline(always)]
    fn accumulate(self, row: &[u8], w: f32, out: &mut [f32]) {
        for (o, b) in out.iter_mut().zip(row.chunks_exact(4)) {
            *o += w * f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        }
    }
}

impl RowDecode for DecodeF16 {
    #[inline(always)]
    fn accumulate(self, row: &[u8], w: f32, out: &mut [f32]) {
        for (o, b) in out.iter_mut().zip(row.chunks_exact(2)) {
            *o += w * f16_bits_to_f32(u16::from_le_bytes([b[0], b[1]]));
        }
    }
}

impl RowDecode for DecodeBf16 {
    #[inline(always)]
    fn accumulate(self, row: &[u8], w: f32, out: &mut [f32]) {
        for (o, b) in out.iter_mut().zip(row.chunks_exact(2)) {
            *o += w * f32::from_bits((u16::from_le_bytes([b[0], b[1]]) as u32) << 16);
        }
    }
}

/// HFP8 with 4 exponent bits and bias 7 (see [`super::quantize::hfp8_to_f32`]).
#[inline(always)]
fn e4_b7_to_f32(byte: u8) -> f32 {
    let sign = ((byte & 0x80) as u32) << 24;
    let shifted = f32::from_bits(((byte & 0x7f) as u32) << 20);
    // 2^(127 − 7)
    f32::from_bits((shifted * f32::from_bits(247 << 23)).to_bits() | sign)
}

impl RowDecode for DecodeHfp8 {
    #[inline(always)]
    fn accumulate(self, row: &[u8], w: f32, out: &mut [f32]) {
        for (o, &b) in out.iter_mut().zip(row) {
            *o += w * e4_b7_to_f32(b);
        }
    }
}

impl RowDecode for DecodeE4m3fn {
    #[inline(always)]
    fn accumulate(self, row: &[u8], w: f32, out: &mut [f32]) {
        for (o, &b) in out.iter_mut().zip(row) {
            let v = if b & 0x7f == 0x7f {
                f32::NAN
            } else {
                e4_b7_to_f32(b)
            };
            *o += w * v;
        }
    }
}

impl RowDecode for DecodeInt8 {
    #[inline(always)]
    fn accumulate(self, row: &[u8], w: f32, out: &mut [f32]) {
        let (scale, bias) = row_scale_bias(row);
        for (o, &c) in out.iter_mut().zip(&row[4..]) {
            *o += w * (c as f32 * scale + bias);
        }
    }
}

impl RowDecode for DecodeInt4 {
    #[inline(always)]
    fn accumulate(self, row: &[u8], w: f32, out: &mut [f32]) {
        let (scale, bias) = row_scale_bias(row);
        let codes = &row[4..];
        let mut pairs = out.chunks_exact_mut(2);
        for (pair, &c) in (&mut pairs).zip(codes) {
            pair[0] += w * ((c & 0x0f) as f32 * scale + bias);
            pair[1] += w * ((c >> 4) as f32 * scale + bias);
        }
        let rest = pairs.into_remainder();
        if let Some(o) = rest.first_mut() {
            let c = codes[codes.len() - 1];
            *o += w * ((c & 0x0f) as f32 * scale + bias);
        }
    }
}

impl RowDecode for DecodeInt2 {
    #[inline(always)]
    fn accumulate(self, row: &[u8], w: f32, out: &mut [f32]) {
        let (scale, bias) = row_scale_bias(row);
        let codes = &row[4..];
        for (j, o) in out.iter_mut().enumerate() {
            let c = (codes[j / 4] >> ((j % 4) * 2)) & 3;
            *o += w * (c as f32 * scale + bias);
        }
    }
}

impl<K: RowDecode> TableRows for QuantRows<'_, K> {
    #[inline(always)]
    fn prefetch(&self, id: usize) {
        // Unchecked address, as for FP32 rows: a prefetch never faults.
        let row = self
            .bytes
            .as_ptr()
            .wrapping_add(id.wrapping_mul(self.row_bytes));
        prefetch_lines::<false>(row, self.row_bytes);
    }

    #[inline(always)]
    fn accumulate(&self, id: usize, w: f32, out: &mut [f32]) {
        let row = &self.bytes[id * self.row_bytes..(id + 1) * self.row_bytes];
        self.kind.accumulate(row, w, out);
    }
}

/// Where a feature's pooled rows go in the output.
#[derive(Clone, Copy, Debug)]
pub(crate) struct FeatureSlot {
    /// First output column.
    pub col: usize,
    /// Width.
    pub dim: usize,
}

/// One task of a pooled lookup: bags `bags` (global bag numbers of one feature, consecutive)
/// pooled into `out`, whose row `i` receives bag `bags.start + i` at columns
/// `slot.col..slot.col + slot.dim`.
pub(crate) struct PoolTask<'a> {
    pub batch: &'a Batch<'a>,
    pub mean: bool,
    pub bags: std::ops::Range<usize>,
    pub out: &'a mut [MaybeUninit<f32>],
    pub out_stride: usize,
    pub slot: FeatureSlot,
}

/// A [`PoolTask`] over one table's rows and the batch's typed ids.
struct PoolBags<'a, I, R> {
    rows: &'a R,
    ids: &'a [I],
    task: PoolTask<'a>,
}

#[inline(always)]
fn pool_bags_body<I: IndexValue, R: TableRows>(args: PoolBags<'_, I, R>) {
    let PoolBags { rows, ids, task } = args;
    let PoolTask {
        batch,
        mean,
        bags,
        out,
        out_stride,
        slot,
    } = task;
    let (offsets, weights): (&[usize], Option<&[f32]>) = (&batch.offsets, batch.weights.as_deref());
    let end = offsets[bags.end];
    if R::COLUMN_BLOCKS {
        for (i, bag) in bags.enumerate() {
            let (s, e) = (offsets[bag], offsets[bag + 1]);
            let o = &mut out[i * out_stride + slot.col..i * out_stride + slot.col + slot.dim];
            let scale = if mean && e > s {
                1.0 / (e - s) as f32
            } else {
                1.0
            };
            match weights {
                None => pool_bag_blocks::<I, R, false>(rows, ids, &[], s..e, end, o, scale),
                Some(w) => pool_bag_blocks::<I, R, true>(rows, ids, w, s..e, end, o, scale),
            }
        }
        return;
    }
    for (i, bag) in bags.enumerate() {
        let (s, e) = (offsets[bag], offsets[bag + 1]);
        let o = zeroed(&mut out[i * out_stride + slot.col..i * out_stride + slot.col + slot.dim]);
        for p in s..e {
            if p + PREFETCH_DISTANCE < end {
                rows.prefetch(ids[p + PREFETCH_DISTANCE].to_usize());
            }
            let w = weights.map_or(1.0, |w| w[p]);
            rows.accumulate(ids[p].to_usize(), w, o);
        }
        if mean && e > s {
            let inv = 1.0 / (e - s) as f32;
            for x in o.iter_mut() {
                *x *= inv;
            }
        }
    }
}

crate::multiversion!(
    fn pool_bags<I: IndexValue, R: TableRows>(args: PoolBags<'_, I, R>) => pool_bags_body
);

/// Zeros `o` and hands it back initialised (the start of a row-at-a-time accumulation).
#[inline(always)]
fn zeroed(o: &mut [MaybeUninit<f32>]) -> &mut [f32] {
    for x in o.iter_mut() {
        x.write(0.0);
    }
    // SAFETY: every element was just written, and `MaybeUninit<f32>` has `f32`'s layout.
    unsafe { &mut *(o as *mut [MaybeUninit<f32>] as *mut [f32]) }
}

/// The kernels' view of an initialised output: they write through it and never read or write
/// anything uninitialised, so it stays initialised.
fn as_output(out: &mut [f32]) -> &mut [MaybeUninit<f32>] {
    // SAFETY: same layout; the kernels of this module write only initialised values (through
    // `MaybeUninit::write` and `zeroed`) and never `MaybeUninit::uninit()`, so every element
    // of `out` stays initialised when the borrow ends.
    unsafe { &mut *(out as *mut [f32] as *mut [MaybeUninit<f32>]) }
}

/// Pooled forward over a validated batch: `out` is `[B, out_stride]` row-major, feature `f`
/// lands in `slots[f]`. `visit(f, |rows| ...)` hands the kernel feature `f`'s table.
pub(crate) fn pooled_forward<V>(
    batch: &Batch<'_>,
    slots: &[FeatureSlot],
    pooling: PoolingMode,
    out: &mut [f32],
    out_stride: usize,
    visit: &V,
) where
    V: Fn(usize, &mut dyn FnMut(&dyn PoolFeature)) + Sync,
{
    pool_into(batch, slots, pooling, as_output(out), out_stride, visit);
}

/// The lookup of a validated batch into a new `[rows, stride]` buffer (pooled: `rows` = B,
/// features in `slots`; pooling NONE: `rows` = the ids, `stride` = D). The buffer is not
/// zero-filled first: the kernels write every element once (as nn.EmbeddingBag's and FBGEMM's
/// outputs are `empty`, not `zeros`). Measured at T=32 B=512 D=256 E=1e5 L=20 on the 2-core
/// bench machine: a zero-filled output made the forward 0.7–7 ms slower than the same kernel
/// into a reused buffer (of 12–30 ms; three runs).
pub(crate) fn forward_new<V>(
    batch: &Batch<'_>,
    slots: &[FeatureSlot],
    pooling: PoolingMode,
    stride: usize,
    visit: &V,
) -> Vec<f32>
where
    V: Fn(usize, &mut dyn FnMut(&dyn PoolFeature)) + Sync,
{
    let rows = batch.output_rows(pooling);
    let n = rows * stride;
    let mut out: Vec<f32> = crate::sparse::ops::output_buffer(n);
    let dst = &mut out.spare_capacity_mut()[..n];
    if pooling == PoolingMode::None {
        sequence_into(batch, stride, dst, visit);
    } else {
        // Every column is some feature's, once, unless the slots leave gaps (not a layout this
        // crate builds, but then the gaps must read as zeros).
        if !slots_tile(slots, stride) {
            zeroed(dst);
        }
        pool_into(batch, slots, pooling, dst, stride, visit);
    }
    // SAFETY: `n` elements fit the capacity, and every one was written: `sequence_into` writes
    // each id's row (the features' positions cover all ids), the pooled kernels each bag's
    // slot of each of the B output rows (the column-block kernel every column of a slot, the
    // row kernel after zeroing it), and the slots tile the row or were zeroed above.
    unsafe { out.set_len(n) };
    out
}

/// Whether `slots` cover columns `0..stride` exactly, each once.
fn slots_tile(slots: &[FeatureSlot], stride: usize) -> bool {
    let mut spans: Vec<(usize, usize)> = slots.iter().map(|s| (s.col, s.dim)).collect();
    spans.sort_unstable();
    let mut next = 0;
    for (col, dim) in spans {
        if col != next {
            return false;
        }
        next += dim;
    }
    next == stride
}

/// [`pooled_forward`] into an output that may not be initialised (every element it writes).
fn pool_into<V>(
    batch: &Batch<'_>,
    slots: &[FeatureSlot],
    pooling: PoolingMode,
    out: &mut [MaybeUninit<f32>],
    out_stride: usize,
    visit: &V,
) where
    V: Fn(usize, &mut dyn FnMut(&dyn PoolFeature)) + Sync,
{
    let b_total = batch.batch_size;
    if b_total == 0 || out_stride == 0 {
        return;
    }
    let mean = pooling == PoolingMode::Mean;
    let threads = rayon::current_num_threads().max(1);
    // One parallel region for all features: each task owns a range of samples (a contiguous
    // block of output rows) and walks every feature's bags for them in feature order. The
    // threads thus move through the tables in step (a table about the size of the last-level
    // cache is still mostly served from it) without a barrier per feature: with one region per
    // feature, 26-32 features meant as many joins, each waiting for the slowest thread, and
    // the forward ran at ~70% of the gather rate it reaches this way.
    let rows_per_task = b_total.div_ceil(threads * 4).max(1);
    out.par_chunks_mut(rows_per_task * out_stride)
        .enumerate()
        .for_each(|(task, chunk)| {
            let b0 = task * rows_per_task;
            let nb = chunk.len() / out_stride;
            for (f, &slot) in slots.iter().enumerate() {
                visit(f, &mut |feature: &dyn PoolFeature| {
                    feature.pool(PoolTask {
                        batch,
                        mean,
                        bags: f * b_total + b0..f * b_total + b0 + nb,
                        out: &mut *chunk,
                        out_stride,
                        slot,
                    })
                });
            }
        });
}

/// Hands the kernels feature `f`'s table: `visit(f, |rows| ...)`.
pub(crate) trait VisitFeature: Fn(usize, &mut dyn FnMut(&dyn PoolFeature)) + Sync {}

impl<T: Fn(usize, &mut dyn FnMut(&dyn PoolFeature)) + Sync> VisitFeature for T {}

/// A table ready to pool one feature's bags (object-safe face of the generic kernels).
pub(crate) trait PoolFeature: Sync {
    fn pool(&self, task: PoolTask<'_>);
    /// `out[i] = w_p · row(id_p)` for the positions `range` (no pooling).
    fn gather(
        &self,
        batch: &Batch<'_>,
        range: std::ops::Range<usize>,
        out: &mut [MaybeUninit<f32>],
    );
}

impl<R: TableRows> PoolFeature for R {
    fn pool(&self, task: PoolTask<'_>) {
        let batch = task.batch;
        match &batch.ids {
            Ids::I32(ids) => pool_bags(PoolBags {
                rows: self,
                ids,
                task,
            }),
            Ids::I64(ids) => pool_bags(PoolBags {
                rows: self,
                ids,
                task,
            }),
        }
    }

    fn gather(
        &self,
        batch: &Batch<'_>,
        range: std::ops::Range<usize>,
        out: &mut [MaybeUninit<f32>],
    ) {
        let dim = out.len() / range.len().max(1);
        for (i, p) in range.enumerate() {
            let o = zeroed(&mut out[i * dim..(i + 1) * dim]);
            let w = batch.weights.as_deref().map_or(1.0, |w| w[p]);
            self.accumulate(batch.ids.get(p), w, o);
        }
    }
}

/// Hands `f` a [`PoolFeature`] for quantised rows of type `ty`.
pub(crate) fn with_quant_rows(
    ty: WeightType,
    bytes: &[u8],
    row_bytes: usize,
    f: &mut dyn FnMut(&dyn PoolFeature),
) {
    macro_rules! call {
        ($k:expr) => {
            f(&QuantRows {
                bytes,
                row_bytes,
                kind: $k,
            })
        };
    }
    match ty {
        // FP32 rows that lie on f32 boundaries (always, in a resident buffer) are the training
        // tables' rows: their column-block kernel, not a decode row at a time (twice as fast).
        WeightType::Fp32 => match bytemuck::try_cast_slice::<u8, f32>(bytes) {
            Ok(rows) => with_f32_rows(rows, row_bytes / 4, |feature| f(feature)),
            Err(_) => call!(DecodeF32),
        },
        WeightType::Fp16 => call!(DecodeF16),
        WeightType::Bf16 => call!(DecodeBf16),
        WeightType::Fp8 => call!(DecodeHfp8),
        WeightType::Fp8E4m3fn => call!(DecodeE4m3fn),
        WeightType::Int8 => call!(DecodeInt8),
        WeightType::Int4 => call!(DecodeInt4),
        WeightType::Int2 => call!(DecodeInt2),
    }
}

/// Sequence (no pooling) forward: `out` is `[N, dim]`, row `p` from id `p` of the feature that
/// owns position `p`.
pub(crate) fn sequence_forward<V>(batch: &Batch<'_>, dim: usize, out: &mut [f32], visit: &V)
where
    V: Fn(usize, &mut dyn FnMut(&dyn PoolFeature)) + Sync,
{
    sequence_into(batch, dim, as_output(out), visit);
}

/// [`sequence_forward`] into an output that may not be initialised (every row it writes: the
/// features' positions are all the batch's ids, and each position's row is zeroed, then added).
fn sequence_into<V>(batch: &Batch<'_>, dim: usize, out: &mut [MaybeUninit<f32>], visit: &V)
where
    V: Fn(usize, &mut dyn FnMut(&dyn PoolFeature)) + Sync,
{
    let b_total = batch.batch_size;
    let feature_ranges: Vec<(usize, std::ops::Range<usize>)> = (0..batch.num_features)
        .map(|f| {
            (
                f,
                batch.offsets[f * b_total]..batch.offsets[(f + 1) * b_total],
            )
        })
        .collect();
    // Split each feature's positions into chunks and process them in parallel.
    const CHUNK: usize = 1024;
    type Work<'o> = (usize, std::ops::Range<usize>, &'o mut [MaybeUninit<f32>]);
    let mut work: Vec<Work<'_>> = Vec::new();
    let mut rest = out;
    for (f, range) in feature_ranges {
        let mut start = range.start;
        while start < range.end {
            let end = (start + CHUNK).min(range.end);
            let (head, tail) = std::mem::take(&mut rest).split_at_mut((end - start) * dim);
            work.push((f, start..end, head));
            rest = tail;
            start = end;
        }
    }
    // Nothing is left for a validated batch (its positions are the output's rows); whatever
    // would be is written too.
    zeroed(rest);
    work.into_par_iter().for_each(|(f, range, chunk)| {
        visit(f, &mut |feature: &dyn PoolFeature| {
            feature.gather(batch, range.clone(), chunk)
        });
    });
}

#[cfg(test)]
mod tests {
    use std::borrow::Cow;
    use std::mem::MaybeUninit;

    use super::*;

    /// Features over tables of `dims` (feature `f` reads table `f % dims.len()`), `b` samples,
    /// bag lengths cycling through 0..4 (empty bags included), ids spread over `e` rows.
    fn batch(features: usize, b: usize, e: usize, weighted: bool) -> Batch<'static> {
        let mut offsets = vec![0];
        let mut ids = Vec::new();
        for bag in 0..features * b {
            for j in 0..bag % 4 {
                ids.push(((bag * 7 + j * 13) % e) as i64);
            }
            offsets.push(ids.len());
        }
        let weights = weighted.then(|| {
            Cow::Owned(
                (0..ids.len())
                    .map(|p| 0.5 + (p % 3) as f32)
                    .collect::<Vec<f32>>(),
            )
        });
        Batch {
            ids: Ids::I64(Cow::Owned(ids)),
            offsets,
            weights,
            batch_size: b,
            num_features: features,
            kept: None,
        }
    }

    /// Output slots filled with NaN, standing for whatever a new buffer holds.
    fn garbage(n: usize) -> Vec<MaybeUninit<f32>> {
        vec![MaybeUninit::new(f32::NAN); n]
    }

    fn read(out: &[MaybeUninit<f32>]) -> Vec<f32> {
        // SAFETY: every slot was initialised (NaN, or what a kernel wrote).
        out.iter().map(|x| unsafe { x.assume_init() }).collect()
    }

    /// Table `t`'s row `id`, value of column `c`.
    fn value(t: usize, id: usize, c: usize) -> f32 {
        ((t * 31 + id * 17 + c * 5) % 23) as f32 * 0.25 - 2.0
    }

    #[test]
    fn the_kernels_write_every_output_element_over_garbage() {
        // The column-block kernel at widths with 64-, 32-, 16-, 8-column blocks and a narrow
        // tail, and the row-at-a-time kernel (FP32 rows decoded as bytes), pooled by sum and
        // mean, weighted or not, and unpooled.
        let dims = [16usize, 7, 256, 24, 120];
        let (e, b) = (11, 6);
        let tables: Vec<Vec<f32>> = (dims.iter().enumerate())
            .map(|(t, &d)| (0..e * d).map(|i| value(t, i / d, i % d)).collect())
            .collect();
        let bytes: Vec<Vec<u8>> = (tables.iter())
            .map(|rows| rows.iter().flat_map(|x| x.to_le_bytes()).collect())
            .collect();
        let features = 7;
        let table_of = |f: usize| f % dims.len();
        for column_blocks in [true, false] {
            let visit = |f: usize, k: &mut dyn FnMut(&dyn PoolFeature)| {
                let t = table_of(f);
                if column_blocks {
                    with_f32_rows(&tables[t], dims[t], k)
                } else {
                    k(&QuantRows {
                        bytes: &bytes[t][..],
                        row_bytes: dims[t] * 4,
                        kind: DecodeF32,
                    })
                }
            };
            for weighted in [false, true] {
                let batch = batch(features, b, e, weighted);
                let weight = |p: usize| batch.weights.as_ref().map_or(1.0, |w| w[p] as f64);
                for pooling in [PoolingMode::Sum, PoolingMode::Mean] {
                    let mut slots = Vec::new();
                    let mut col = 0;
                    for f in 0..features {
                        slots.push(FeatureSlot {
                            col,
                            dim: dims[table_of(f)],
                        });
                        col += dims[table_of(f)];
                    }
                    let stride = col;
                    let mut out = garbage(b * stride);
                    pool_into(&batch, &slots, pooling, &mut out, stride, &visit);
                    let out = read(&out);
                    for (f, &slot) in slots.iter().enumerate() {
                        let t = table_of(f);
                        for s in 0..b {
                            let bag = batch.bag(f * b + s);
                            let n = bag.len().max(1) as f64;
                            for c in 0..slot.dim {
                                let mut want: f64 = (bag.clone())
                                    .map(|p| weight(p) * value(t, batch.ids.get(p), c) as f64)
                                    .sum();
                                if pooling == PoolingMode::Mean {
                                    want /= n;
                                }
                                let got = out[s * stride + slot.col + c];
                                assert!(
                                    (got as f64 - want).abs() <= 1e-5 * (1.0 + want.abs()),
                                    "{pooling:?} weighted {weighted} column blocks \
                                     {column_blocks}: feature {f} sample {s} column {c}: \
                                     {got} != {want}"
                                );
                            }
                        }
                    }
                }
                // Unpooled: every feature of one width (table 3's, 24 columns).
                let visit_24 = |_f: usize, k: &mut dyn FnMut(&dyn PoolFeature)| visit(3, k);
                let n = batch.ids.len();
                let mut out = garbage(n * 24);
                sequence_into(&batch, 24, &mut out, &visit_24);
                let out = read(&out);
                for p in 0..n {
                    for c in 0..24 {
                        let want = weight(p) * value(3, batch.ids.get(p), c) as f64;
                        assert!((out[p * 24 + c] as f64 - want).abs() <= 1e-6);
                    }
                }
            }
        }
    }

    #[test]
    fn slots_tile_only_when_they_cover_the_row_once() {
        let slot = |col, dim| FeatureSlot { col, dim };
        assert!(slots_tile(&[slot(0, 4), slot(4, 2)], 6));
        assert!(slots_tile(&[slot(4, 2), slot(0, 4)], 6));
        assert!(!slots_tile(&[slot(0, 4), slot(5, 1)], 6));
        assert!(!slots_tile(&[slot(0, 4), slot(4, 2)], 7));
        assert!(!slots_tile(&[slot(0, 4), slot(2, 4)], 6));
    }
}
