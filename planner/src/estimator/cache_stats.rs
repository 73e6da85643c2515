//! Expected cache miss rate from an LRU miss-ratio-curve histogram.
//!
//! TorchRec evaluates this with float32 tensors; the arithmetic here is done in `f32` in the
//! same order so the prefetch cost it feeds matches to the last bit.

use crate::config::CacheStats;

/// `n` evenly spaced `f32` points from `start` to `end`, computed the way PyTorch's CPU
/// `linspace` does (forward from the start for the first half, backward from the end after).
fn linspace_f32(start: f32, end: f32, n: usize) -> Vec<f32> {
    if n == 1 {
        return vec![start];
    }
    let step = (end - start) / (n - 1) as f32;
    let half = n / 2;
    (0..n)
        .map(|i| {
            if i < half {
                start + step * i as f32
            } else {
                end - step * (n - i - 1) as f32
            }
        })
        .collect()
}

/// Fraction of lookups expected to miss a cache holding `load_factor x height` rows.
pub fn expected_miss_rate(stats: &CacheStats, load_factor: f64) -> f64 {
    let hist: Vec<f32> = stats.mrc_hist_counts.iter().map(|&v| v as f32).collect();
    let mut cum = Vec::with_capacity(hist.len());
    let mut acc = 0.0f32;
    for h in &hist {
        acc += h;
        cum.push(acc);
    }
    let total = *cum.last().unwrap_or(&0.0);
    if total == 0.0 {
        return 0.0;
    }
    // Miss ratio per bin, plus the two sentinels for sizes beyond either end.
    let mut miss: Vec<f32> = cum.iter().map(|c| 1.0f32 - c / total).collect();
    miss.push(0.0);
    miss.push(1.0);
    let bins = linspace_f32(0.0, stats.height as f32, hist.len() + 1);
    // A cache of k rows hits every reuse distance up to k - 1.
    let x = (load_factor * stats.height as f64) as f32 - 1.0f32;
    let upper = bins.iter().take_while(|&&b| b <= x).count();
    let idx = if upper == 0 {
        miss.len() - 1
    } else {
        upper - 1
    };
    miss[idx] as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn miss_rate_steps_through_histogram() {
        let stats = CacheStats {
            expected_lookups: 100.0,
            mrc_hist_counts: vec![1.0, 1.0, 1.0, 1.0],
            height: 400,
            cacheability: None,
        };
        // 149 lands in the second bin: TorchRec reads the miss ratio after two bins.
        assert_eq!(expected_miss_rate(&stats, 150.0 / 400.0), 0.5);
        assert_eq!(expected_miss_rate(&stats, 1.0), 0.0);
        assert_eq!(expected_miss_rate(&stats, 0.0), 1.0);
    }
}
