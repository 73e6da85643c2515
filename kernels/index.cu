// Row indexing of contiguous [rows, row_len] buffers (index_select_dim0 and its gradient), the
// GPU twins of src/tensor/backend/cpu/index.rs. Row numbers were checked on the host.

// out[i, :] = src[rows[i], :], by element size.
#define INDEX_SELECT(NAME, T)                                                               \
extern "C" __global__ void NAME(const T* __restrict__ src, const i64* __restrict__ rows,     \
                                i64 n, i64 row_len, T* __restrict__ out) {                  \
    GRID_STRIDE(i, n * row_len) {                                                            \
        i64 r = i / row_len;                                                                 \
        out[i] = src[rows[r] * row_len + (i - r * row_len)];                                 \
    }                                                                                        \
}
INDEX_SELECT(index_select_b1, u8)
INDEX_SELECT(index_select_b2, u16)
INDEX_SELECT(index_select_b4, unsigned int)
INDEX_SELECT(index_select_b8, unsigned long long)

// dst[unique[u], :] += Σ values[order[k], :] for k in starts[u] .. starts[u + 1]: the host
// sorted the positions by row (stably), so each row's sum runs in a fixed order, with no
// atomics — deterministic. One thread per (unique row, column).
extern "C" __global__ void index_add_rows_f32(float* __restrict__ dst,
                                              const i64* __restrict__ unique,
                                              const i64* __restrict__ starts,
                                              const i64* __restrict__ order,
                                              const float* __restrict__ values, i64 n_unique,
                                              i64 row_len) {
    GRID_STRIDE(i, n_unique * row_len) {
        i64 u = i / row_len;
        i64 c = i - u * row_len;
        float acc = 0.0f;
        for (i64 k = starts[u]; k < starts[u + 1]; ++k) acc += values[order[k] * row_len + c];
        dst[unique[u] * row_len + c] += acc;
    }
}
