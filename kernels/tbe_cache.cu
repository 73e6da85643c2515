// Row records of a cached TBE moved between its cache rows in device memory and a packed
// buffer that crosses to the host (src/embedding/tbe/cuda/records.rs). A record is a row's
// weights followed by its optimizer state (up to two buffers), each part at its own element
// offset in its buffer. `at` holds 7 values per record: its offset in `packed`, then the
// (offset, length) of its weights, state 0 and state 1. All offsets were computed on the host
// from the cache's layout. One warp per record; the lanes stride over each part.

__device__ __forceinline__ void record_parts(const i64* at, i64 r, i64* p) {
    for (int k = 0; k < 7; ++k) p[k] = at[r * 7 + k];
}

// packed[record r] = weights, state 0, state 1 of its cache row.
extern "C" __global__ void cache_records_take(const float* w, const float* s0, const float* s1,
                                              const i64* __restrict__ at, i64 n,
                                              float* __restrict__ packed) {
    i64 r = (i64)blockIdx.x * blockDim.y + threadIdx.y;
    if (r >= n) return;
    i64 p[7];
    record_parts(at, r, p);
    float* out = packed + p[0];
    for (i64 j = threadIdx.x; j < p[2]; j += 32) out[j] = w[p[1] + j];
    out += p[2];
    for (i64 j = threadIdx.x; j < p[4]; j += 32) out[j] = s0[p[3] + j];
    out += p[4];
    for (i64 j = threadIdx.x; j < p[6]; j += 32) out[j] = s1[p[5] + j];
}

// The cache row of record r = its packed weights, state 0, state 1.
extern "C" __global__ void cache_records_put(float* w, float* s0, float* s1,
                                             const i64* __restrict__ at, i64 n,
                                             const float* __restrict__ packed) {
    i64 r = (i64)blockIdx.x * blockDim.y + threadIdx.y;
    if (r >= n) return;
    i64 p[7];
    record_parts(at, r, p);
    const float* in = packed + p[0];
    for (i64 j = threadIdx.x; j < p[2]; j += 32) w[p[1] + j] = in[j];
    in += p[2];
    for (i64 j = threadIdx.x; j < p[4]; j += 32) s0[p[3] + j] = in[j];
    in += p[4];
    for (i64 j = threadIdx.x; j < p[6]; j += 32) s1[p[5] + j] = in[j];
}
