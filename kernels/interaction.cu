// DLRM's dot interaction (src/models/interaction/): per sample the rows are
// [dense (D), sparse_0 (D), …, sparse_{F-1} (D)], n = F + 1 of them; the output is the dense
// row followed by the strict upper triangle, row-major, of the n×n matrix of their dot
// products. One block per sample.

__device__ __forceinline__ const float* interaction_row(const float* dense, const float* sparse,
                                                        i64 b, int r, int F, int D) {
    return r == 0 ? dense + b * D : sparse + (b * F + (r - 1)) * (i64)D;
}

// out [B, D + P]; pair_i/pair_j [P] list the triangle's (i, j), i < j, in output order.
// blockDim.x is a multiple of 32: one warp per pair.
extern "C" __global__ void dot_interaction_f32(const float* __restrict__ dense,
                                               const float* __restrict__ sparse, int F, int D,
                                               const int* __restrict__ pair_i,
                                               const int* __restrict__ pair_j, int P,
                                               float* __restrict__ out) {
    i64 b = blockIdx.x;
    float* o = out + b * (i64)(D + P);
    for (int d = threadIdx.x; d < D; d += blockDim.x) o[d] = dense[b * D + d];
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    for (int p = warp; p < P; p += warps) {
        const float* x = interaction_row(dense, sparse, b, pair_i[p], F, D);
        const float* y = interaction_row(dense, sparse, b, pair_j[p], F, D);
        float acc = 0.0f;
        for (int d = lane; d < D; d += 32) acc += x[d] * y[d];
        acc = warp_sum(acc);
        if (lane == 0) o[D + p] = acc;
    }
}

// With G the symmetric n×n matrix of the output gradient's triangle entries (zero diagonal),
// ∂row_r = Σ_j G[r][j] · row_j, plus the pass-through columns for the dense row. One thread
// per (row, column) of the sample, summing in j order (deterministic).
extern "C" __global__ void dot_interaction_backward_f32(
    const float* __restrict__ dense, const float* __restrict__ sparse, int F, int D,
    const float* __restrict__ grad_out, float* __restrict__ grad_dense,
    float* __restrict__ grad_sparse) {
    i64 b = blockIdx.x;
    int n = F + 1;
    int P = n * (n - 1) / 2;
    const float* g = grad_out + b * (i64)(D + P);
    for (int t = threadIdx.x; t < n * D; t += blockDim.x) {
        int r = t / D, d = t - (t / D) * D;
        float acc = r == 0 ? g[d] : 0.0f;
        for (int j = 0; j < n; ++j) {
            if (j == r) continue;
            int i0 = r < j ? r : j, j0 = r < j ? j : r;
            int k = i0 * n - i0 * (i0 + 1) / 2 + (j0 - i0 - 1);
            acc += g[D + k] * interaction_row(dense, sparse, b, j, F, D)[d];
        }
        if (r == 0) grad_dense[b * D + d] = acc;
        else grad_sparse[(b * F + (r - 1)) * (i64)D + d] = acc;
    }
}
