//! Jagged ops at recommendation sizes, paired with FBGEMM_GPU CPU on the same inputs
//! (`benches/peers/jagged.py`; `benches/peers/jagged.sh` runs both side by side).
//!
//! Inputs (identical formulas in the Python script):
//! - sparse batch: 26 features × B = 8192, length of bag `i` (feature-major) =
//!   `((i · 2654435761) mod 2^32 >> 16) mod 41` (uniform 0..=40, mean 20; ≈ 4.26 M ids), id `j` =
//!   `((j · 0x9E3779B97F4A7C15) mod 2^64 >> 33) mod 1_000_000`, f32 weights.
//! - `permute_2D_sparse_data`: reverse the 26 features, lengths/ids i64, weights f32.
//! - `block_bucketize_sparse_features`: 8 buckets, block size 125 000 (a 1 M-row table per
//!   feature split row-wise over 8 ranks), no weights.
//! - `jagged_to_padded_dense` / `dense_to_jagged`: one sequence feature, B = 8192 bags with the
//!   first 8192 lengths above (≈ 164 k rows), D = 64 f32, max length 40; and the 1-D case over
//!   all 26 × 8192 bags.

use criterion::{criterion_group, criterion_main, Criterion};
use embers::sparse::ops::{
    block_bucketize_sparse_features, dense_to_jagged, jagged_to_padded_dense,
    permute_2d_sparse_data, BlockBucketizeOptions,
};
use embers::Tensor;

const FEATURES: usize = 26;
const BATCH: usize = 8192;
const MAX_LENGTH: usize = 40;
const DIM: usize = 64;

fn bag_length(i: u64) -> i64 {
    (((i.wrapping_mul(2_654_435_761)) % (1 << 32)) >> 16) as i64 % 41
}

fn id(j: u64) -> i64 {
    ((j.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 33) % 1_000_000) as i64
}

struct SparseBatch {
    lengths: Vec<i64>,
    ids: Vec<i64>,
}

fn sparse_batch(bags: usize) -> SparseBatch {
    let lengths: Vec<i64> = (0..bags as u64).map(bag_length).collect();
    let total: i64 = lengths.iter().sum();
    SparseBatch {
        lengths,
        ids: (0..total as u64).map(id).collect(),
    }
}

fn offsets_of(lengths: &[i64]) -> Tensor {
    let mut offsets = vec![0i64];
    for &l in lengths {
        offsets.push(offsets.last().unwrap() + l);
    }
    let n = offsets.len();
    Tensor::from_vec(offsets, &[n]).unwrap()
}

fn values_f32(n: usize) -> Vec<f32> {
    (0..n).map(|i| (i % 97) as f32 * 0.125 - 6.0).collect()
}

fn sparse_ops(c: &mut Criterion) {
    let batch = sparse_batch(FEATURES * BATCH);
    let n = batch.ids.len();
    let lengths = Tensor::from_vec(batch.lengths.clone(), &[FEATURES, BATCH]).unwrap();
    let ids = Tensor::from_vec(batch.ids.clone(), &[n]).unwrap();
    let weights = Tensor::from_vec(values_f32(n), &[n]).unwrap();
    let permute =
        Tensor::from_vec((0..FEATURES as i32).rev().collect::<Vec<_>>(), &[FEATURES]).unwrap();
    c.bench_function(
        "permute_2D_sparse_data 26x8192 L=20 (ids i64 + weights f32)",
        |b| {
            b.iter(|| {
                permute_2d_sparse_data(&permute, &lengths, &ids, Some(&weights), None).unwrap()
            })
        },
    );

    let flat_lengths = lengths.reshape(&[FEATURES * BATCH]).unwrap();
    let block_sizes = Tensor::from_vec(vec![125_000i64; FEATURES], &[FEATURES]).unwrap();
    let options = BlockBucketizeOptions::default();
    c.bench_function(
        "block_bucketize_sparse_features 26x8192 L=20 my_size=8",
        |b| {
            b.iter(|| {
                block_bucketize_sparse_features(&flat_lengths, &ids, &block_sizes, 8, &options)
                    .unwrap()
            })
        },
    );
}

fn dense_ops(c: &mut Criterion) {
    let sequence = sparse_batch(BATCH);
    let rows: usize = sequence.lengths.iter().sum::<i64>() as usize;
    let offsets = offsets_of(&sequence.lengths);
    let values = Tensor::from_vec(values_f32(rows * DIM), &[rows, DIM]).unwrap();
    c.bench_function("jagged_to_padded_dense B=8192 L=20 D=64 max=40", |b| {
        b.iter(|| jagged_to_padded_dense(&values, &[&offsets], &[MAX_LENGTH], 0.0).unwrap())
    });
    let dense = jagged_to_padded_dense(&values, &[&offsets], &[MAX_LENGTH], 0.0).unwrap();
    c.bench_function("dense_to_jagged B=8192 L=20 D=64 max=40", |b| {
        b.iter(|| dense_to_jagged(&dense, &[&offsets], None).unwrap())
    });

    let all = sparse_batch(FEATURES * BATCH);
    let n = all.ids.len();
    let offsets = offsets_of(&all.lengths);
    let values = Tensor::from_vec(values_f32(n), &[n]).unwrap();
    c.bench_function("jagged_to_padded_dense 1-D 26x8192 L=20 max=40", |b| {
        b.iter(|| jagged_to_padded_dense(&values, &[&offsets], &[MAX_LENGTH], 0.0).unwrap())
    });
    let dense = jagged_to_padded_dense(&values, &[&offsets], &[MAX_LENGTH], 0.0).unwrap();
    c.bench_function("dense_to_jagged 1-D 26x8192 L=20 max=40", |b| {
        b.iter(|| dense_to_jagged(&dense, &[&offsets], None).unwrap())
    });
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(20).measurement_time(std::time::Duration::from_secs(3));
    targets = sparse_ops, dense_ops
}
criterion_main!(benches);
