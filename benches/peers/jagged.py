"""FBGEMM_GPU CPU side of benches/jagged.rs: the same ops on the same inputs (see the Rust
bench's header for the formulas), 2 threads, median of repeated runs in milliseconds."""
import time

import numpy as np
import torch
import fbgemm_gpu  # noqa: F401  (registers torch.ops.fbgemm)

torch.set_num_threads(2)
FEATURES, BATCH, MAX_LENGTH, DIM = 26, 8192, 40, 64


def bag_lengths(n):
    i = np.arange(n, dtype=np.uint64)
    return (((i * np.uint64(2654435761)) % np.uint64(1 << 32)) >> np.uint64(16)).astype(np.int64) % 41


def ids(n):
    j = np.arange(n, dtype=np.uint64)
    with np.errstate(over="ignore"):
        return (((j * np.uint64(0x9E3779B97F4A7C15)) >> np.uint64(33)) % np.uint64(1_000_000)).astype(np.int64)


def values_f32(n):
    return torch.from_numpy((np.arange(n) % 97).astype(np.float32) * 0.125 - 6.0)


def bench(name, fn, reps=30):
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    print(f"{name:70s} {np.median(times) * 1e3:9.3f} ms")


lengths_np = bag_lengths(FEATURES * BATCH)
n = int(lengths_np.sum())
lengths = torch.from_numpy(lengths_np).view(FEATURES, BATCH)
indices = torch.from_numpy(ids(n))
weights = values_f32(n)
permute = torch.arange(FEATURES - 1, -1, -1, dtype=torch.int32)
bench("permute_2D_sparse_data 26x8192 L=20 (ids i64 + weights f32)",
      lambda: torch.ops.fbgemm.permute_2D_sparse_data(permute, lengths, indices, weights, None))

flat_lengths = lengths.reshape(-1).contiguous()
block_sizes = torch.full((FEATURES,), 125_000, dtype=torch.int64)
bench("block_bucketize_sparse_features 26x8192 L=20 my_size=8",
      lambda: torch.ops.fbgemm.block_bucketize_sparse_features(flat_lengths, indices, False, False, block_sizes, 8))

seq_lengths = torch.from_numpy(bag_lengths(BATCH))
offsets = torch.ops.fbgemm.asynchronous_complete_cumsum(seq_lengths)
rows = int(seq_lengths.sum())
values = values_f32(rows * DIM).view(rows, DIM)
bench("jagged_to_padded_dense B=8192 L=20 D=64 max=40",
      lambda: torch.ops.fbgemm.jagged_to_padded_dense(values, [offsets], [MAX_LENGTH], 0.0))
dense = torch.ops.fbgemm.jagged_to_padded_dense(values, [offsets], [MAX_LENGTH], 0.0)
bench("dense_to_jagged B=8192 L=20 D=64 max=40",
      lambda: torch.ops.fbgemm.dense_to_jagged(dense, [offsets]))

all_offsets = torch.ops.fbgemm.asynchronous_complete_cumsum(torch.from_numpy(lengths_np))
flat_values = values_f32(n)
bench("jagged_to_padded_dense 1-D 26x8192 L=20 max=40",
      lambda: torch.ops.fbgemm.jagged_to_padded_dense(flat_values, [all_offsets], [MAX_LENGTH], 0.0))
dense1 = torch.ops.fbgemm.jagged_to_padded_dense(flat_values, [all_offsets], [MAX_LENGTH], 0.0)
bench("dense_to_jagged 1-D 26x8192 L=20 max=40",
      lambda: torch.ops.fbgemm.dense_to_jagged(dense1.unsqueeze(-1), [all_offsets]))  # FBGEMM wants a trailing dim
