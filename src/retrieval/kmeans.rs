//! k-means (Lloyd's iterations), as FAISS trains its coarse and product quantizers.

use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rayon::prelude::*;

use super::check_vectors;
use super::flat::{nearest, squared_norms};
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
            .zip(nearest(&sample, &centroids, dim, &norms)?)
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

/// k-means++ seeding: the first seed uniformly, each next one with probability proportional to
/// a point's squared distance to its nearest seed so far.
fn plus_plus(data: &[f32], dim: usize, k: usize, rng: &mut ChaCha8Rng) -> Vec<f32> {
    let n = data.len() / dim;
    let mut seeds = Vec::with_capacity(k * dim);
    let first = rng.random_range(0..n);
    seeds.extend_from_slice(&data[first * dim..(first + 1) * dim]);
    let mut nearest = vec![f32::INFINITY; n];
    for s in 1..=k {
        let seed = &seeds[(s - 1) * dim..s * dim];
        nearest
            .par_iter_mut()
            .zip(data.par_chunks_exact(dim))
            .for_each(|(d, x)| {
                let dist: f32 = x.iter().zip(seed).map(|(a, b)| (a - b) * (a - b)).sum();
                *d = d.min(dist);
            });
        if s == k {
            break;
        }
        let total: f64 = nearest.iter().map(|&d| f64::from(d)).sum();
        let next = if total > 0.0 {
            let mut target = rng.random::<f64>() * total;
            let mut pick = n - 1;
            for (i, &d) in nearest.iter().enumerate() {
                target -= f64::from(d);
                if target < 0.0 {
                    pick = i;
                    break;
                }
            }
            pick
        } else {
            // Every point coincides with a seed: any point will do.
            rng.random_range(0..n)
        };
        seeds.extend_from_slice(&data[next * dim..(next + 1) * dim]);
    }
    seeds
}
