// Jagged <-> padded dense for 2-D jagged values [N, D] with offsets [B+1] (i64), the GPU twins
// of src/sparse/ops/dense (jagged_to_padded_dense / dense_to_jagged). One thread per output element.

// out[b, j, d] = values[offsets[b] + j, d] for j < len(b) (and j < max_len), else padding.
extern "C" __global__ void jagged_to_padded_dense_f32(
    const float* __restrict__ values, const i64* __restrict__ offsets, int B, int max_len,
    int D, float padding, float* __restrict__ out) {
    i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    i64 total = (i64)B * max_len * D;
    if (i >= total) return;
    int d = (int)(i % D);
    i64 row = i / D;
    int j = (int)(row % max_len);
    int b = (int)(row / max_len);
    i64 start = offsets[b];
    i64 len = offsets[b + 1] - start;
    out[i] = j < len ? values[(start + j) * D + d] : padding;
}

// values[offsets[b] + j, d] = dense[b, j, d] for j < len(b); rows past max_len (or past the
// last bag) get 0.
extern "C" __global__ void dense_to_jagged_f32(
    const float* __restrict__ dense, const i64* __restrict__ offsets, int B, int max_len,
    int D, i64 N, float* __restrict__ values) {
    i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= N * D) return;
    i64 n = i / D;
    int d = (int)(i % D);
    if (n >= offsets[B]) {  // rows past the last bag (total_L larger than the last offset)
        values[i] = 0.0f;
        return;
    }
    // Binary search for the bag holding row n.
    int lo = 0, hi = B;
    while (hi - lo > 1) {
        int mid = (lo + hi) / 2;
        if (offsets[mid] <= n) lo = mid; else hi = mid;
    }
    i64 j = n - offsets[lo];
    values[i] = j < max_len ? dense[((i64)lo * max_len + j) * D + d] : 0.0f;
}

// Several jagged dimensions: out[r, d] = src[map[r], d], or `fill` where map[r] < 0 (the host
// builds the slot -> row map for padding and the row -> slot map for the reverse).
extern "C" __global__ void gather_rows_or_fill_f32(
    const float* __restrict__ src, const i64* __restrict__ map, i64 rows, i64 row_len,
    float fill, float* __restrict__ out) {
    GRID_STRIDE(i, rows * row_len) {
        i64 m = map[i / row_len];
        out[i] = m >= 0 ? src[m * row_len + i % row_len] : fill;
    }
}
