// Table-batched embedding bag forward (pooled), the GPU twin of src/embedding/tbe/cpu/pool.rs.
//
// Layout (as the CPU TBE): every table's rows back to back in one buffer; feature f reads the
// table at element offset `table_offsets[f]` with `rows[f]` rows of `dims[f]` values and writes
// columns `out_offsets[f] .. out_offsets[f] + dims[f]` of the `[B, out_stride]` output.
// Indices are i64; `offsets` has F*B+1 entries, bag (f, b) is offsets[f*B+b] .. offsets[f*B+b+1].
//
// One warp per bag (blockDim = (32, 4)); lanes stride over the dim. An out-of-range id is not
// read: its position goes to `first_bad` (initialised to INT64_MAX by the host, which then
// returns an error naming feature, bag and id). Per-sample weights are optional (null).
// mean != 0 divides by the bag length (empty bags give zeros).

#define TBE_FORWARD(NAME, T, LOAD)                                                            \
extern "C" __global__ void NAME(                                                              \
    const T* __restrict__ weights, const i64* __restrict__ table_offsets,                     \
    const i64* __restrict__ rows, const int* __restrict__ dims,                               \
    const int* __restrict__ out_offsets, int out_stride, int B, int F,                        \
    const i64* __restrict__ indices, const i64* __restrict__ offsets,                         \
    const float* __restrict__ per_sample_weights, int mean, float* __restrict__ out,          \
    i64* first_bad) {                                                                         \
    int bag = blockIdx.x * blockDim.y + threadIdx.y;                                          \
    if (bag >= B * F) return;                                                                 \
    int f = bag / B;                                                                          \
    int b = bag - f * B;                                                                      \
    i64 start = offsets[bag];                                                                 \
    i64 end = offsets[bag + 1];                                                               \
    int D = dims[f];                                                                          \
    i64 base = table_offsets[f];                                                              \
    i64 nrows = rows[f];                                                                      \
    float scale = (mean && end > start) ? 1.0f / (float)(end - start) : 1.0f;                 \
    float* dst = out + (i64)b * out_stride + out_offsets[f];                                  \
    for (int d = threadIdx.x; d < D; d += 32) {                                               \
        float acc = 0.0f;                                                                     \
        for (i64 l = start; l < end; ++l) {                                                   \
            i64 id = indices[l];                                                              \
            if (id < 0 || id >= nrows) {                                                      \
                if (d == threadIdx.x) report_bad_index(first_bad, l);                         \
                continue;                                                                     \
            }                                                                                 \
            float w = per_sample_weights ? per_sample_weights[l] : 1.0f;                      \
            acc += w * LOAD(weights[base + id * D + d]);                                      \
        }                                                                                     \
        dst[d] = acc * scale;                                                                 \
    }                                                                                         \
}

#define LOAD_F32(x) (x)
#define LOAD_F16(x) f16_to_f32(x)
#define LOAD_BF16(x) bf16_to_f32(x)

TBE_FORWARD(tbe_forward_f32, float, LOAD_F32)
TBE_FORWARD(tbe_forward_f16, u16, LOAD_F16)
TBE_FORWARD(tbe_forward_bf16, u16, LOAD_BF16)

// Unpooled (sequence) lookup, PoolingMode::None: output row l (of [N, D], one D for every
// feature) is row indices[l] of its feature's table, times its per-sample weight. One warp per
// position; the position's bag (hence feature) is found by binary search in the offsets. An
// out-of-range id gives a zero row and is reported like the pooled kernel's.
#define TBE_SEQUENCE(NAME, T, LOAD)                                                           \
extern "C" __global__ void NAME(                                                              \
    const T* __restrict__ weights, const i64* __restrict__ table_offsets,                     \
    const i64* __restrict__ rows, int D, int B, int F,                                        \
    const i64* __restrict__ indices, const i64* __restrict__ offsets,                         \
    const float* __restrict__ per_sample_weights, i64 n, float* __restrict__ out,             \
    i64* first_bad) {                                                                         \
    i64 l = (i64)blockIdx.x * blockDim.y + threadIdx.y;                                       \
    if (l >= n) return;                                                                       \
    int f = bag_of_position(offsets, B * F, l) / B;                                           \
    i64 id = indices[l];                                                                      \
    float* dst = out + l * D;                                                                 \
    if (id < 0 || id >= rows[f]) {                                                            \
        if (threadIdx.x == 0) report_bad_index(first_bad, l);                                 \
        for (int d = threadIdx.x; d < D; d += 32) dst[d] = 0.0f;                              \
        return;                                                                               \
    }                                                                                         \
    float w = per_sample_weights ? per_sample_weights[l] : 1.0f;                              \
    const T* src = weights + table_offsets[f] + id * D;                                       \
    for (int d = threadIdx.x; d < D; d += 32) dst[d] = w * LOAD(src[d]);                      \
}

TBE_SEQUENCE(tbe_sequence_f32, float, LOAD_F32)

// The FP32 pooled forward with 16-byte loads, for tables whose dims are multiples of 4 (every
// row, and every output slice, then starts 16-byte aligned) and at most 512: lane `lane` owns
// the float4 columns lane, lane + 32, ... (up to 4) and keeps their sums in registers. The
// bag's ids and weights are read 32 at a time, one per lane, coalesced, and handed round the
// warp with shuffles, so the row loads of consecutive ids have no index load before them and
// the unrolled loop keeps several rows in flight. Same arguments and results as
// tbe_forward_f32 (the same f32 additions in the same order per column).
// V float4 columns per lane at most: tbe_forward_f32_v4 4 (dims up to 512),
// tbe_forward_f32_v4_d128 1 (dims up to 128: fewer registers, so 8 rows in flight per warp).
template <int V, int UNROLL>
__device__ __forceinline__ void forward_f32_v4(
    const float* __restrict__ weights, const i64* __restrict__ table_offsets,
    const i64* __restrict__ rows, const int* __restrict__ dims,
    const int* __restrict__ out_offsets, int out_stride, int B, int F,
    const i64* __restrict__ indices, const i64* __restrict__ offsets,
    const float* __restrict__ per_sample_weights, int mean, float* __restrict__ out,
    i64* first_bad) {
    int bag = blockIdx.x * blockDim.y + threadIdx.y;
    if (bag >= B * F) return;
    int lane = threadIdx.x;
    int f = bag / B;
    int b = bag - f * B;
    i64 start = offsets[bag];
    i64 end = offsets[bag + 1];
    int D4 = dims[f] / 4;
    const float4* table = reinterpret_cast<const float4*>(weights + table_offsets[f]);
    i64 nrows = rows[f];
    float4 acc[V];
    for (int k = 0; k < V; ++k) acc[k] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    for (i64 l0 = start; l0 < end; l0 += 32) {
        int count = (int)(end - l0 < 32 ? end - l0 : 32);
        i64 my_id = -1;
        float my_w = 1.0f;
        if (lane < count) {
            my_id = indices[l0 + lane];
            if (per_sample_weights) my_w = per_sample_weights[l0 + lane];
            if (my_id < 0 || my_id >= nrows) {
                report_bad_index(first_bad, l0 + lane);
                my_id = -1;
            }
        }
#pragma unroll UNROLL
        for (int j = 0; j < count; ++j) {
            i64 id = __shfl_sync(0xffffffffu, my_id, j);
            float w = __shfl_sync(0xffffffffu, my_w, j);
            if (id < 0) continue;
            const float4* row = table + id * D4;
            for (int k = 0; k < V; ++k) {
                int v = lane + 32 * k;
                if (v < D4) {
                    float4 x = row[v];
                    acc[k].x += w * x.x;
                    acc[k].y += w * x.y;
                    acc[k].z += w * x.z;
                    acc[k].w += w * x.w;
                }
            }
        }
    }
    float scale = (mean && end > start) ? 1.0f / (float)(end - start) : 1.0f;
    float4* dst = reinterpret_cast<float4*>(out + (i64)b * out_stride + out_offsets[f]);
    for (int k = 0; k < V; ++k) {
        int v = lane + 32 * k;
        if (v < D4) {
            dst[v] = make_float4(acc[k].x * scale, acc[k].y * scale, acc[k].z * scale,
                                 acc[k].w * scale);
        }
    }
}

#define TBE_FORWARD_F32_V4(NAME, V, UNROLL)                                                      \
    extern "C" __global__ void NAME(                                                             \
        const float* __restrict__ weights, const i64* __restrict__ table_offsets,                \
        const i64* __restrict__ rows, const int* __restrict__ dims,                              \
        const int* __restrict__ out_offsets, int out_stride, int B, int F,                       \
        const i64* __restrict__ indices, const i64* __restrict__ offsets,                        \
        const float* __restrict__ per_sample_weights, int mean, float* __restrict__ out,         \
        i64* first_bad) {                                                                        \
        forward_f32_v4<V, UNROLL>(weights, table_offsets, rows, dims, out_offsets, out_stride,   \
                                  B, F, indices, offsets, per_sample_weights, mean, out,         \
                                  first_bad);                                                    \
    }
TBE_FORWARD_F32_V4(tbe_forward_f32_v4, 4, 4)
TBE_FORWARD_F32_V4(tbe_forward_f32_v4_d128, 1, 8)
