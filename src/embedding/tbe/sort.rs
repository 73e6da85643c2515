//! Sorting a batch's packed `(row << low) | position` keys by row, as the CPU backward and the
//! cache directories do for every batch: a stable least-significant-digit radix sort of the
//! row field, a few linear passes where a comparison sort makes `log n` of them.

/// Bits of row sorted per pass (2048 buckets: the counts stay in L1).
const DIGIT: u32 = 11;

/// Below this many keys a comparison sort is as fast.
const SMALL: usize = 2048;

/// Sorts `keys` ascending, where each key is `(row << low) | position` and the positions (the
/// `low` bits) rise through `keys` as given: the rows are sorted stably, which keeps each row's
/// positions in order, so the result is what `keys.sort_unstable()` gives, in passes over the
/// row's significant bits only.
pub(crate) fn sort_keys_by_row(keys: &mut Vec<u64>, low: u32) {
    let n = keys.len();
    if n < SMALL || n > u32::MAX as usize {
        keys.sort_unstable();
        return;
    }
    let max_row = keys.iter().fold(0, |m, &k| m.max(k >> low));
    let bits = 64 - max_row.leading_zeros();
    let passes = bits.div_ceil(DIGIT) as usize;
    let mask = (1u64 << DIGIT) - 1;
    let digit = |k: u64, p: usize| ((k >> (low + p as u32 * DIGIT)) & mask) as usize;
    let mut counts = vec![[0u32; 1 << DIGIT]; passes];
    for &k in keys.iter() {
        for (p, c) in counts.iter_mut().enumerate() {
            c[digit(k, p)] += 1;
        }
    }
    let mut from = std::mem::take(keys);
    let mut to = vec![0u64; n];
    for (p, c) in counts.iter_mut().enumerate() {
        if c.iter().any(|&x| x as usize == n) {
            continue; // every key has this digit: the pass would copy
        }
        let mut sum = 0;
        for x in c.iter_mut() {
            (*x, sum) = (sum, sum + *x);
        }
        for &k in &from {
            let d = &mut c[digit(k, p)];
            to[*d as usize] = k;
            *d += 1;
        }
        std::mem::swap(&mut from, &mut to);
    }
    *keys = from;
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    #[test]
    fn the_radix_sort_orders_keys_as_a_comparison_sort() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
        // Rows of 1 to 40 bits (one to four passes, digits with a single bucket skipped),
        // batches around the comparison-sort cut-off, repeated rows.
        for (n, row_bits, low) in [
            (100, 20, 24),
            (SMALL, 1, 24),
            (5000, 11, 24),
            (5000, 12, 24),
            (20000, 20, 24),
            (20000, 32, 32),
            (30000, 40, 24),
        ] {
            let mut keys: Vec<u64> = (0..n as u64)
                .map(|pos| {
                    let row =
                        rng.random_range(0..1u64 << row_bits) >> rng.random_range(0..row_bits);
                    (row << low) | pos
                })
                .collect();
            let mut expected = keys.clone();
            expected.sort_unstable();
            sort_keys_by_row(&mut keys, low);
            assert_eq!(keys, expected, "n {n}, {row_bits}-bit rows");
        }
    }
}
