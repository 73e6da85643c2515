//! Stable radix sort of u64 keys on the device (`kernels/sort.cu`): 8 bits per pass, three
//! launches per pass (tile histograms, a scan per digit, a tile-local sort and scatter). The TBE
//! backward sorts its (row, position) keys with it.

use super::{DeviceBuffer, KernelArgs, LaunchConfig};
use crate::{Error, Result};

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
    let grid = LaunchConfig {
        grid: (tiles as u32, 1, 1),
        block: (THREADS, 1, 1),
        shared_bytes: 0,
    };
    for pass in 0..passes {
        let shift = (low_bit + 8 * pass) as i32;
        let mut args = KernelArgs::new();
        args.buffer(&from).i64(n as i64).i32(shift).buffer(&counts);
        // SAFETY: one block per tile of `from` (n keys); counts holds 256 per tile.
        unsafe { device.launch("radix_histogram", grid, &mut args)? };
        let mut args = KernelArgs::new();
        args.buffer(&counts).i32(tiles as i32).buffer(&digit_totals);
        let per_digit = LaunchConfig {
            grid: (256, 1, 1),
            block: (THREADS, 1, 1),
            shared_bytes: 0,
        };
        // SAFETY: block d scans counts[d·tiles ..][..tiles] in place and writes digit_totals[d].
        unsafe { device.launch("radix_scan_digits", per_digit, &mut args)? };
        let mut args = KernelArgs::new();
        args.buffer(&from)
            .buffer(&to)
            .i64(n as i64)
            .i32(shift)
            .buffer(&counts)
            .buffer(&digit_totals);
        // SAFETY: same grid as the histogram; every slot is < n, so writes stay in `to`.
        unsafe { device.launch("radix_scatter", grid, &mut args)? };
        std::mem::swap(&mut from, &mut to);
    }
    Ok(from)
}
