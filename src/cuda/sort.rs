//! Device primitives over plain integers: a stable radix sort of u64 keys (8 bits per pass,
//! three launches per pass: tile histograms, a scan per digit, a tile-local sort and scatter)
//! and an exclusive scan (`kernels/sort.cu`). The TBE backward sorts its (row, position) keys
//! with the first; bucketize and the row-sparse backward number their outputs with the second.

use super::{DeviceBuffer, LaunchConfig};
use crate::error::{Error, Result};

crate::kernel_source!(
    pub(crate) static SORT = "sort.cu",
    ["radix_histogram", "radix_scan_digits", "radix_scatter", "scan_exclusive_i64"];
);

/// Keys per tile (one block): `SORT_TILE` in `kernels/sort.cu`.
const TILE: usize = 1024;
/// Threads per tile block: `SORT_THREADS`.
const THREADS: u32 = 256;

/// Sorts `keys` stably by bits `low_bit .. low_bit + bits` (rounded up to whole bytes; the
/// other bits ride along), ascending. Takes the buffer to use it as one of the two ping-pong
/// buffers; returns the sorted keys (this buffer or the other one).
pub fn radix_sort_u64(
    keys: DeviceBuffer<u64>,
    low_bit: u32,
    bits: u32,
) -> Result<DeviceBuffer<u64>> {
    let passes = bits.div_ceil(8);
    if low_bit + 8 * passes > 64 {
        return Err(Error::invalid(
            "radix_sort_u64",
            format!(
                "bits {low_bit}..{} are not all in a u64",
                low_bit + 8 * passes
            ),
        ));
    }
    let n = keys.len();
    if n < 2 || passes == 0 {
        return Ok(keys);
    }
    let device = keys.device().clone();
    let tiles = n.div_ceil(TILE);
    if tiles > i32::MAX as usize {
        return Err(Error::invalid(
            "radix_sort_u64",
            format!("{n} keys are too many"),
        ));
    }
    let counts = device.alloc::<i32>(256 * tiles)?;
    let digit_totals = device.alloc::<i32>(256)?;
    let mut from = keys;
    let mut to = device.alloc::<u64>(n)?;
    let grid = LaunchConfig::blocks(tiles, THREADS);
    for pass in 0..passes {
        let shift = (low_bit + 8 * pass) as i32;
        // One block per tile of `from` (n keys); counts holds 256 per tile.
        device.launch(
            SORT.kernel("radix_histogram"),
            grid,
            &crate::args![from, n as i64, shift, counts],
        )?;
        // Block d scans counts[d·tiles ..][..tiles] in place and writes digit_totals[d].
        device.launch(
            SORT.kernel("radix_scan_digits"),
            LaunchConfig::blocks(256, THREADS),
            &crate::args![counts, tiles as i32, digit_totals],
        )?;
        // Same grid as the histogram; every slot is < n, so writes stay in `to`.
        device.launch(
            SORT.kernel("radix_scatter"),
            grid,
            &crate::args![from, to, n as i64, shift, counts, digit_totals],
        )?;
        std::mem::swap(&mut from, &mut to);
    }
    Ok(from)
}

/// `out[i] = Σ input[..i]` over the first `n` values (both buffers hold at least `n`), on one
/// block of the device.
pub fn scan_exclusive_i64(
    input: &DeviceBuffer<i64>,
    out: &mut DeviceBuffer<i64>,
    n: usize,
) -> Result<()> {
    if input.len() < n || out.len() < n {
        return Err(Error::invalid(
            "scan_exclusive_i64",
            format!(
                "{n} values to scan, buffers of {} and {}",
                input.len(),
                out.len()
            ),
        ));
    }
    input.device().launch(
        SORT.kernel("scan_exclusive_i64"),
        LaunchConfig::single_block(1024),
        &crate::args![input, out, n as i64],
    )
}
