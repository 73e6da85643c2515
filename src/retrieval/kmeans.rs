//! k-means (Lloyd's iterations), as FAISS trains its coarse and product quantizers.

use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rayon::prelude::*;

use super::check_vectors;
use super::flat::{dimension_major, nearest, squared_norms};
use crate::{Error, Result};

/// Training points per centroid at most (FAISS's `max_points_per_centroid`): larger sets are
/// subsampled.
const MAX_POINTS_PER_CENTROID: usize = 256;

/// `k` centroids of `data` (rows of `dim`) under squared L2: initialised by k-means++ (each
/// next seed drawn with probability proportional to its squared distance from the seeds so far,
/// so well-separated clusters each get one), then `iters` rounds of assign-to-nearest and move-to-mean. A cluster left
/// empty takes half of the largest one (its centroid copied with a small opposite nudge to
/// each), as FAISS does. More than 256·k points are subsampled. Deterministic for a `seed`.
/// Returns the centroids, `[k × dim]`.
pub fn kmeans(data: &[f32], dim: usize, k: usize, iters: usize, seed: u64) -> Result<Vec<f32>> {
    let n = check_vectors("kmeans", data, dim)?;
    if k == 0 || n < k {
        return Err(Error::invalid(
            "kmeans",
            format!("{k} centroids need at least {k} training vectors, got {n}"),
        ));
    }
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut order: Vec<usize> = (0..n).collect();
    order.shuffle(&mut rng);
    let sample: Vec<f32> = if n > MAX_POINTS_PER_CENTROID * k {
        order[..MAX_POINTS_PER_CENTROID * k]
            .iter()
            .flat_map(|&i| data[i * dim..(i + 1) * dim].iter().copied())
            .collect()
    } else {
        data.to_vec()
    };
    let n = sample.len() / dim;
    let mut centroids = plus_plus(&sample, dim, k, &mut rng);
    let mut assign = vec![0usize; n];
    for _ in 0..iters {
        let norms = squared_norms(&centroids, dim);
        for (a, (c, _)) in assign
            .iter_mut()
            .zip(nearest(&sample, &centroids, dim, &norms))
        {
            *a = c;
        }
        let mut sums = vec![0f64; k * dim];
        let mut counts = vec![0usize; k];
        for (i, &c) in assign.iter().enumerate() {
            counts[c] += 1;
            for (s, &x) in sums[c * dim..(c + 1) * dim]
                .iter_mut()
                .zip(&sample[i * dim..(i + 1) * dim])
            {
                *s += f64::from(x);
            }
        }
        for c in 0..k {
            if counts[c] > 0 {
                for (dst, s) in centroids[c * dim..(c + 1) * dim]
                    .iter_mut()
                    .zip(&sums[c * dim..(c + 1) * dim])
                {
                    *dst = (s / counts[c] as f64) as f32;
                }
            }
        }
        // Empty clusters: split the largest.
        for c in 0..k {
            if counts[c] > 0 {
                continue;
            }
            let big = (0..k).max_by_key(|&j| counts[j]).expect("k >= 1");
            const EPS: f32 = 1.0 / 1024.0;
            for d in 0..dim {
                let v = centroids[big * dim + d];
                let nudge = if d % 2 == 0 { EPS } else { -EPS };
                centroids[c * dim + d] = v * (1.0 + nudge);
                centroids[big * dim + d] = v * (1.0 - nudge);
            }
            counts[c] = counts[big] / 2;
            counts[big] -= counts[c];
        }
    }
    Ok(centroids)
}

/// Points per k-means++ chunk: each seed's pass keeps one partial sum per chunk, so drawing the
/// next seed scans the chunk sums and then one chunk instead of every point.
const SEED_CHUNK: usize = 1024;

/// k-means++ seeding: the first seed uniformly, each next one with probability proportional to
/// a point's squared distance to its nearest seed so far. The points are copied
/// dimension-major once, so each seed's pass runs across points ([`seed_pass`]).
fn plus_plus(data: &[f32], dim: usize, k: usize, rng: &mut ChaCha8Rng) -> Vec<f32> {
    let n = data.len() / dim;
    let cols = dimension_major(data, dim, n);
    let mut seeds = Vec::with_capacity(k * dim);
    let first = rng.random_range(0..n);
    seeds.extend_from_slice(&data[first * dim..(first + 1) * dim]);
    let mut nearest = vec![f32::INFINITY; n];
    let mut sums = vec![0f64; n.div_ceil(SEED_CHUNK)];
    for s in 1..=k {
        let seed = &seeds[(s - 1) * dim..s * dim];
        nearest
            .par_chunks_mut(SEED_CHUNK)
            .zip(sums.par_iter_mut())
            .enumerate()
            .for_each(|(c, (nearest, sum))| {
                *sum = seed_pass(SeedPass {
                    cols: &cols,
                    stride: n,
                    start: c * SEED_CHUNK,
                    seed,
                    nearest,
                });
            });
        if s == k {
            break;
        }
        let total: f64 = sums.iter().sum();
        let next = if total > 0.0 {
            draw(&nearest, &sums, rng.random::<f64>() * total)
        } else {
            // Every point coincides with a seed: any point will do.
            rng.random_range(0..n)
        };
        seeds.extend_from_slice(&data[next * dim..(next + 1) * dim]);
    }
    seeds
}

/// One chunk of a k-means++ pass: points `start..start + nearest.len()` of `cols`
/// (dimension-major, `stride` points per dimension) against a new `seed`.
struct SeedPass<'a> {
    cols: &'a [f32],
    stride: usize,
    start: usize,
    seed: &'a [f32],
    nearest: &'a mut [f32],
}

/// Lowers each point's distance to its nearest seed to its distance to the new seed where that
/// is nearer; returns the chunk's new total (eight partial sums, so it vectorises).
#[inline(always)]
fn seed_chunk(a: SeedPass<'_>) -> f64 {
    let len = a.nearest.len();
    let mut dist = [0f32; SEED_CHUNK];
    let dist = &mut dist[..len];
    for (d, &s) in a.seed.iter().enumerate() {
        let col = &a.cols[d * a.stride + a.start..][..len];
        for (o, &c) in dist.iter_mut().zip(col) {
            let t = c - s;
            *o += t * t;
        }
    }
    let mut lanes = [0f32; 8];
    let (near8, dist8) = (a.nearest.chunks_exact_mut(8), dist.chunks_exact(8));
    for (near, dist) in near8.zip(dist8) {
        for ((n, &d), l) in near.iter_mut().zip(dist).zip(lanes.iter_mut()) {
            *n = if d < *n { d } else { *n };
            *l += *n;
        }
    }
    let tail = len / 8 * 8;
    for (n, &d) in a.nearest[tail..].iter_mut().zip(&dist[tail..]) {
        *n = if d < *n { d } else { *n };
        lanes[0] += *n;
    }
    lanes.iter().map(|&l| f64::from(l)).sum()
}

crate::multiversion!(
    fn seed_pass(args: SeedPass<'_>) -> f64 => seed_chunk
);

/// The point where the running sum of `weights` passes `target`: the chunk first (its partial
/// sums), then the point inside it; the last point with weight if rounding runs past the end.
fn draw(weights: &[f32], sums: &[f64], mut target: f64) -> usize {
    let mut last = weights.iter().rposition(|&w| w > 0.0).unwrap_or(0);
    for (c, &sum) in sums.iter().enumerate() {
        if target >= sum {
            target -= sum;
            continue;
        }
        let chunk = &weights[c * SEED_CHUNK..((c + 1) * SEED_CHUNK).min(weights.len())];
        for (i, &w) in chunk.iter().enumerate() {
            target -= f64::from(w);
            if target < 0.0 {
                return c * SEED_CHUNK + i;
            }
        }
        // Rounding between the chunk's sum and its points: its last point with weight.
        if let Some(i) = chunk.iter().rposition(|&w| w > 0.0) {
            last = c * SEED_CHUNK + i;
        }
        break;
    }
    last
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Drawing by chunk sums picks the same point as one running sum over every point, across
    /// chunk edges, zero weights and targets at the very end.
    #[test]
    fn draw_by_chunks_equals_a_running_sum() {
        let n = 3 * SEED_CHUNK + 77;
        let weights: Vec<f32> = (0..n)
            .map(|i| {
                if i % 7 == 3 {
                    0.0
                } else {
                    (i % 5) as f32 * 0.25
                }
            })
            .collect();
        let sums: Vec<f64> = weights
            .chunks(SEED_CHUNK)
            .map(|c| c.iter().map(|&w| f64::from(w)).sum())
            .collect();
        let total: f64 = sums.iter().sum();
        let reference = |mut target: f64| {
            for (i, &w) in weights.iter().enumerate() {
                target -= f64::from(w);
                if target < 0.0 {
                    return i;
                }
            }
            weights.iter().rposition(|&w| w > 0.0).unwrap()
        };
        for step in 0..=2000 {
            let target = total * step as f64 / 2000.0;
            let got = draw(&weights, &sums, target);
            assert_eq!(got, reference(target), "target {target}");
            assert!(weights[got] > 0.0);
        }
    }
}
