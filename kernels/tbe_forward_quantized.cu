// Quantized (inference) TBE forward over FBGEMM's TBE row bytes, the GPU twin of
// src/embedding/tbe/cpu/pool.rs. Feature f's table starts at byte `table_offsets[f]`, has
// `rows[f]` rows of `row_bytes[f]` bytes, dim `dims[f]` and weight type `types[f]`:
//   0 FP32, 1 FP16, 2 BF16, 3 FP8 (HFP8, 4 exponent bits, bias 7), 4 FP8 E4M3FN,
//   5 INT8, 6 INT4, 7 INT2 — the integer rows start with [fp16 scale][fp16 bias], then the
//   codes (n-bit codes packed low bits first); a value is code * scale + bias in f32.
// Same bag layout, warp-per-bag scheme and bad-id reporting as tbe_forward.cu.

__device__ __forceinline__ float load_quantized(const u8* row, int type, int d) {
    switch (type) {
    case 0: {
        unsigned int bits = (unsigned int)row[4 * d] | ((unsigned int)row[4 * d + 1] << 8) |
                            ((unsigned int)row[4 * d + 2] << 16) |
                            ((unsigned int)row[4 * d + 3] << 24);
        return __uint_as_float(bits);
    }
    case 1: return f16_to_f32((u16)(row[2 * d] | (row[2 * d + 1] << 8)));
    case 2: return bf16_to_f32((u16)(row[2 * d] | (row[2 * d + 1] << 8)));
    case 3: return hfp8_to_f32(row[d], 4, 7);
    case 4: {
        u8 byte = row[d];
        if ((byte & 0x7f) == 0x7f) return __uint_as_float(0x7fc00000u);
        return hfp8_to_f32(byte, 4, 7);
    }
    default: {
        float scale = f16_to_f32((u16)(row[0] | (row[1] << 8)));
        float bias = f16_to_f32((u16)(row[2] | (row[3] << 8)));
        const u8* codes = row + 4;
        unsigned int code;
        if (type == 5) {
            code = codes[d];
        } else {
            int bits = type == 6 ? 4 : 2;
            int per_byte = 8 / bits;
            code = (codes[d / per_byte] >> ((d % per_byte) * bits)) & ((1u << bits) - 1);
        }
        return (float)code * scale + bias;
    }
    }
}

extern "C" __global__ void tbe_forward_quantized(
    const u8* __restrict__ weights, const i64* __restrict__ table_offsets,
    const i64* __restrict__ rows, const int* __restrict__ row_bytes,
    const int* __restrict__ dims, const int* __restrict__ types,
    const int* __restrict__ out_offsets, int out_stride, int B, int F,
    const i64* __restrict__ indices, const i64* __restrict__ offsets,
    const float* __restrict__ per_sample_weights, int mean, float* __restrict__ out,
    i64* first_bad) {
    int bag = blockIdx.x * blockDim.y + threadIdx.y;
    if (bag >= B * F) return;
    int f = bag / B;
    int b = bag - f * B;
    i64 start = offsets[bag];
    i64 end = offsets[bag + 1];
    int D = dims[f];
    int type = types[f];
    i64 stride = row_bytes[f];
    const u8* table = weights + table_offsets[f];
    i64 nrows = rows[f];
    float scale = (mean && end > start) ? 1.0f / (float)(end - start) : 1.0f;
    float* dst = out + (i64)b * out_stride + out_offsets[f];
    for (int d = threadIdx.x; d < D; d += 32) {
        float acc = 0.0f;
        for (i64 l = start; l < end; ++l) {
            i64 id = indices[l];
            if (id < 0 || id >= nrows) {
                if (d == threadIdx.x) report_bad_index(first_bad, l);
                continue;
            }
            float w = per_sample_weights ? per_sample_weights[l] : 1.0f;
            acc += w * load_quantized(table + id * stride, type, d);
        }
        dst[d] = acc * scale;
    }
}

// Unpooled (PoolingMode::None) lookup of quantized rows: output row l (of [N, D], one D for
// every feature) is row indices[l] of its feature's table dequantized, times its per-sample
// weight. The layout and the bag search are tbe_sequence_f32's (tbe_forward.cu).
extern "C" __global__ void tbe_sequence_quantized(
    const u8* __restrict__ weights, const i64* __restrict__ table_offsets,
    const i64* __restrict__ rows, const int* __restrict__ row_bytes,
    const int* __restrict__ types, int D, int B, int F, const i64* __restrict__ indices,
    const i64* __restrict__ offsets, const float* __restrict__ per_sample_weights, i64 n,
    float* __restrict__ out, i64* first_bad) {
    i64 l = (i64)blockIdx.x * blockDim.y + threadIdx.y;
    if (l >= n) return;
    int f = bag_of_position(offsets, B * F, l) / B;
    i64 id = indices[l];
    float* dst = out + l * D;
    if (id < 0 || id >= rows[f]) {
        if (threadIdx.x == 0) report_bad_index(first_bad, l);
        for (int d = threadIdx.x; d < D; d += 32) dst[d] = 0.0f;
        return;
    }
    float w = per_sample_weights ? per_sample_weights[l] : 1.0f;
    const u8* row = weights + table_offsets[f] + id * (i64)row_bytes[f];
    int type = types[f];
    for (int d = threadIdx.x; d < D; d += 32) dst[d] = w * load_quantized(row, type, d);
}
