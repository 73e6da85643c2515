// Element-wise kernels behind the tensor core's ops (`src/tensor/backend/cuda`), one thread per
// element (grid-stride): strided copies and casts, arithmetic, comparisons, `where`, the float
// functions and their derivatives, reductions, softmax, max, gather and its adjoint, BCE.

// ---- Strided views (the tensor core's layouts) ----------------------------------------------
// `meta` describes a view: [rank, shape[rank], then per operand strides[rank] and an offset],
// all in elements. Element i of the (row-major) output is found at strided_offset(i, meta, k)
// in operand k; a broadcast dimension has stride 0.
__device__ __forceinline__ i64 strided_offset(i64 i, const i64* meta, int operand) {
    int rank = (int)meta[0];
    const i64* shape = meta + 1;
    const i64* strides = meta + 1 + rank + operand * (rank + 1);
    i64 off = strides[rank];
    for (int d = rank - 1; d >= 0; --d) {
        i64 s = shape[d];
        off += (i % s) * strides[d];
        i /= s;
    }
    return off;
}

// Contiguous copy of a strided view, by element size (1, 2, 4, 8 bytes).
#define GATHER(NAME, T)                                                                  \
extern "C" __global__ void NAME(const T* src, T* out, i64 n, const i64* meta) {           \
    GRID_STRIDE(i, n) out[i] = src[strided_offset(i, meta, 0)];                           \
}
GATHER(gather_b1, u8)
GATHER(gather_b2, u16)
GATHER(gather_b4, unsigned int)
GATHER(gather_b8, unsigned long long)

// Contiguous source written into a strided view of the destination (cat, copies into views).
#define SCATTER(NAME, T)                                                                 \
extern "C" __global__ void NAME(const T* src, T* dst, i64 n, const i64* meta) {           \
    GRID_STRIDE(i, n) dst[strided_offset(i, meta, 0)] = src[i];                           \
}
SCATTER(scatter_b1, u8)
SCATTER(scatter_b2, u16)
SCATTER(scatter_b4, unsigned int)
SCATTER(scatter_b8, unsigned long long)

__device__ __forceinline__ float binary_op(int op, float x, float y) {
    switch (op) {
    case 0: return x + y;
    case 1: return x - y;
    case 2: return x * y;
    case 3: return x / y;
    case 4: return (x >= y || y != y) ? x : y;  // maximum (NaN in y propagates, as on the CPU)
    default: return (x <= y || y != y) ? x : y;  // minimum
    }
}


// The tensor core's float functions, value and derivative side by side (src/tensor/ops/unary.rs):
// 0 neg, 1 exp, 2 log, 3 sqrt, 4 abs, 5 relu, 6 tanh, 7 sigmoid, 8 gelu, 9 gelu_tanh,
// 10 affine (x·p0 + p1), 11 pow (x^p0), 12 clamp (p0 ≤ x ≤ p1).
__device__ __forceinline__ float unary_value(int op, float x, float p0, float p1) {
    switch (op) {
    case 0: return -x;
    case 1: return expf(x);
    case 2: return logf(x);
    case 3: return sqrtf(x);
    case 4: return fabsf(x);
    case 5: return x <= 0.0f ? 0.0f : x;  // NaN kept, as PyTorch
    case 6: return tanhf(x);
    case 7: {
        if (x >= 0.0f) return 1.0f / (1.0f + expf(-x));
        float e = expf(x);
        return e / (1.0f + e);
    }
    case 8: return x * 0.5f * (1.0f + erff(x * 0.70710678118654752f));
    case 9: {
        const float k = 0.79788456080286536f;
        return 0.5f * x * (1.0f + tanhf(k * (x + 0.044715f * x * x * x)));
    }
    case 10: return x * p0 + p1;
    case 11: return powf(x, p0);
    default: return x < p0 ? p0 : (x > p1 ? p1 : x);
    }
}

__device__ __forceinline__ float unary_derivative(int op, float x, float y, float p0, float p1) {
    switch (op) {
    case 0: return -1.0f;
    case 1: return y;
    case 2: return 1.0f / x;
    case 3: return 0.5f / y;
    case 4: return x > 0.0f ? 1.0f : (x < 0.0f ? -1.0f : 0.0f);
    case 5: return y > 0.0f ? 1.0f : 0.0f;  // relu: its output is what the backward keeps
    case 6: return 1.0f - y * y;
    case 7: return y * (1.0f - y);
    case 8: {
        float cdf = 0.5f * (1.0f + erff(x * 0.70710678118654752f));
        float pdf = expf(-0.5f * x * x) * 0.39894228040143268f;
        return cdf + x * pdf;
    }
    case 9: {
        const float k = 0.79788456080286536f;
        float t = tanhf(k * (x + 0.044715f * x * x * x));
        return 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * k * (1.0f + 3.0f * 0.044715f * x * x);
    }
    case 10: return p0;
    case 11: return p0 * powf(x, p0 - 1.0f);
    default: return (x >= p0 && x <= p1) ? 1.0f : 0.0f;
    }
}

// ---- Float tensors of every storage type (f32, f16, bf16), computed in f32 --------------------
// Each value is loaded to f32, computed on, and rounded once to the storage type, as the CPU
// does for f16/bf16 (src/tensor/ops: compute in f32, cast back), so both agree bit for bit
// wherever the f32 arithmetic itself does.

// out[i] = a[..] op b[..] over broadcast strided operands (meta: two operands).
template <class E>
__device__ __forceinline__ void binary_strided(const typename E::T* a, const typename E::T* b,
                                               typename E::T* out, int op, i64 n,
                                               const i64* meta) {
    GRID_STRIDE(i, n) out[i] = E::store(binary_op(op, E::load(a[strided_offset(i, meta, 0)]),
                                                  E::load(b[strided_offset(i, meta, 1)])));
}

template <class E>
__device__ __forceinline__ void unary_fn(const typename E::T* x, typename E::T* y, int op,
                                         float p0, float p1, i64 n) {
    GRID_STRIDE(i, n) y[i] = E::store(unary_value(op, E::load(x[i]), p0, p1));
}

// gx = g · f'(x, y).
template <class E>
__device__ __forceinline__ void unary_backward(const typename E::T* x, const typename E::T* y,
                                               const typename E::T* g, typename E::T* gx, int op,
                                               float p0, float p1, i64 n) {
    GRID_STRIDE(i, n) {
        float d = unary_derivative(op, E::load(x[i]), E::load(y[i]), p0, p1);
        gx[i] = E::store(E::load(g[i]) * d);
    }
}

// Sums a contiguous [outer, r, inner] buffer over its middle dimension, one thread per output,
// in index order with a double accumulator (deterministic, no atomics), rounded to f32 and then
// to the storage type.
template <class E>
__device__ __forceinline__ void sum_middle(const typename E::T* x, typename E::T* out, i64 outer,
                                           i64 r, i64 inner) {
    GRID_STRIDE(i, outer * inner) {
        i64 o = i / inner;
        i64 j = i - o * inner;
        const typename E::T* p = x + o * r * inner + j;
        double acc = 0.0;
        for (i64 k = 0; k < r; ++k) acc += (double)E::load(p[k * inner]);
        out[i] = E::store((float)acc);
    }
}

#define FLOAT_KERNELS(S, E)                                                                       \
extern "C" __global__ void binary_strided_##S(const E::T* a, const E::T* b, E::T* out, int op,    \
                                              i64 n, const i64* meta) {                          \
    binary_strided<E>(a, b, out, op, n, meta);                                                    \
}                                                                                                 \
extern "C" __global__ void unary_fn_##S(const E::T* x, E::T* y, int op, float p0, float p1,       \
                                        i64 n) {                                                  \
    unary_fn<E>(x, y, op, p0, p1, n);                                                             \
}                                                                                                 \
extern "C" __global__ void unary_backward_##S(const E::T* x, const E::T* y, const E::T* g,        \
                                              E::T* gx, int op, float p0, float p1, i64 n) {     \
    unary_backward<E>(x, y, g, gx, op, p0, p1, n);                                                \
}                                                                                                 \
extern "C" __global__ void sum_middle_##S(const E::T* x, E::T* out, i64 outer, i64 r, i64 inner) { \
    sum_middle<E>(x, out, outer, r, inner);                                                       \
}
FLOAT_KERNELS(f32, F32Elem)
FLOAT_KERNELS(f16, F16Elem)
FLOAT_KERNELS(bf16, BF16Elem)

// ---- Casts between any two dtypes -----------------------------------------------------------
// Dtype codes in DType's order: 0 f32, 1 f64, 2 f16, 3 bf16, 4 i64, 5 i32, 6 u8. As on the CPU
// (src/tensor/ops/cast.rs) every value is widened to f64 and rounded once: floats to nearest
// (f16/bf16 through f64_to_f32_odd), integers as Rust's `as` does (toward zero, saturating,
// NaN to 0).
__device__ __forceinline__ double load_as_f64(const u8* base, int dt, i64 i) {
    switch (dt) {
    case 0: return (double)reinterpret_cast<const float*>(base)[i];
    case 1: return reinterpret_cast<const double*>(base)[i];
    case 2: return (double)f16_to_f32(reinterpret_cast<const u16*>(base)[i]);
    case 3: return (double)bf16_to_f32(reinterpret_cast<const u16*>(base)[i]);
    case 4: return (double)reinterpret_cast<const i64*>(base)[i];
    case 5: return (double)reinterpret_cast<const int*>(base)[i];
    default: return (double)base[i];
    }
}

__device__ __forceinline__ double saturate(double v, double lo, double hi) {
    return v != v ? 0.0 : (v <= lo ? lo : (v >= hi ? hi : v));
}

__device__ __forceinline__ void store_from_f64(u8* base, int dt, i64 i, double v) {
    switch (dt) {
    case 0: reinterpret_cast<float*>(base)[i] = (float)v; break;
    case 1: reinterpret_cast<double*>(base)[i] = v; break;
    case 2: reinterpret_cast<u16*>(base)[i] = f64_to_f16(v); break;
    case 3: reinterpret_cast<u16*>(base)[i] = f64_to_bf16(v); break;
    case 4: {
        // 2^63 is the first double past i64::MAX.
        i64 r;
        if (v != v) r = 0;
        else if (v >= 9223372036854775808.0) r = 0x7fffffffffffffffLL;
        else if (v <= -9223372036854775808.0) r = (-0x7fffffffffffffffLL - 1);
        else r = (i64)v;
        reinterpret_cast<i64*>(base)[i] = r;
        break;
    }
    case 5: reinterpret_cast<int*>(base)[i] = (int)saturate(v, -2147483648.0, 2147483647.0); break;
    default: base[i] = (u8)saturate(v, 0.0, 255.0); break;
    }
}

// out[i] (contiguous, dtype dst_type) = the strided view `meta` of src (dtype src_type).
extern "C" __global__ void cast_strided(const u8* src, int src_type, u8* out, int dst_type,
                                        i64 n, const i64* meta) {
    GRID_STRIDE(i, n) store_from_f64(out, dst_type, i, load_as_f64(src, src_type, strided_offset(i, meta, 0)));
}

// Binary cross-entropy with logits per element, and its derivative in x (sigmoid(x) − y),
// written as src/tensor/ops/loss.rs does (stable for large |x|).
extern "C" __global__ void bce_logits_f32(const float* x, const float* y, float* loss,
                                          float* dx, i64 n) {
    GRID_STRIDE(i, n) {
        float xi = x[i], yi = y[i];
        loss[i] = fmaxf(xi, 0.0f) - xi * yi + log1pf(expf(-fabsf(xi)));
        float sig;
        if (xi >= 0.0f) {
            sig = 1.0f / (1.0f + expf(-xi));
        } else {
            float e = expf(xi);
            sig = e / (1.0f + e);
        }
        dx[i] = sig - yi;
    }
}

// ---- Comparisons, selection, softmax, max along a dimension ---------------------------------

// out[i] = a[..] op b[..] as a u8 mask, over broadcast strided operands of one dtype (codes as
// cast_strided), both widened to f64 as the CPU compares them. op: 0 ==, 1 <, 2 <=, 3 >, 4 >=.
extern "C" __global__ void compare_strided(const u8* a, const u8* b, int dtype, u8* out, int op,
                                           i64 n, const i64* meta) {
    GRID_STRIDE(i, n) {
        double x = load_as_f64(a, dtype, strided_offset(i, meta, 0));
        double y = load_as_f64(b, dtype, strided_offset(i, meta, 1));
        bool r;
        switch (op) {
        case 0: r = x == y; break;
        case 1: r = x < y; break;
        case 2: r = x <= y; break;
        case 3: r = x > y; break;
        default: r = x >= y; break;
        }
        out[i] = r ? 1 : 0;
    }
}

// out[i] = cond[..] ? a[..] : b[..] over three broadcast strided operands (meta: cond, a, b),
// by element size.
#define WHERE(NAME, T)                                                                    \
extern "C" __global__ void NAME(const u8* cond, const T* a, const T* b, T* out, i64 n,      \
                                const i64* meta) {                                          \
    GRID_STRIDE(i, n) out[i] = cond[strided_offset(i, meta, 0)] ? a[strided_offset(i, meta, 1)] \
                                                                : b[strided_offset(i, meta, 2)]; \
}
WHERE(where_b1, u8)
WHERE(where_b2, u16)
WHERE(where_b4, unsigned int)
WHERE(where_b8, unsigned long long)

// softmax (log != 0: log_softmax) of a contiguous [outer, r, inner] buffer along its middle
// dimension, one thread per (outer, inner) line, in f32 as the CPU: the maximum subtracted
// (NaNs skipped by fmaxf, as f32::max), exponentials summed in index order.
template <class E>
__device__ __forceinline__ void softmax_middle(const typename E::T* x, typename E::T* y,
                                               i64 outer, i64 r, i64 inner, int log) {
    GRID_STRIDE(i, outer * inner) {
        i64 o = i / inner;
        i64 j = i - o * inner;
        const typename E::T* p = x + o * r * inner + j;
        typename E::T* q = y + o * r * inner + j;
        float m = __uint_as_float(0xff800000u);  // -inf
        for (i64 k = 0; k < r; ++k) m = fmaxf(m, E::load(p[k * inner]));
        float s = 0.0f;
        for (i64 k = 0; k < r; ++k) s += expf(E::load(p[k * inner]) - m);
        float ls = logf(s);
        for (i64 k = 0; k < r; ++k) {
            float z = E::load(p[k * inner]) - m;
            q[k * inner] = E::store(log ? z - ls : expf(z) / s);
        }
    }
}

// The maximum of each (outer, inner) line of a contiguous [outer, r, inner] buffer and the
// index of its first occurrence (a NaN wins, as on the CPU and in PyTorch).
template <class E>
__device__ __forceinline__ void max_middle(const typename E::T* x, typename E::T* values,
                                           i64* indices, i64 outer, i64 r, i64 inner) {
    GRID_STRIDE(i, outer * inner) {
        i64 o = i / inner;
        i64 j = i - o * inner;
        const typename E::T* p = x + o * r * inner + j;
        float best = E::load(p[0]);
        i64 at = 0;
        for (i64 k = 1; k < r; ++k) {
            float v = E::load(p[k * inner]);
            if (v > best || (v != v && best == best)) {
                best = v;
                at = k;
            }
        }
        values[i] = E::store(best);
        indices[i] = at;
    }
}

// The gradient of max_middle: gx (zeroed, [outer, r, inner]) gets g[i] at line i's maximum.
template <class E>
__device__ __forceinline__ void max_middle_backward(const typename E::T* g, const i64* indices,
                                                    typename E::T* gx, i64 outer, i64 r,
                                                    i64 inner) {
    GRID_STRIDE(i, outer * inner) {
        i64 o = i / inner;
        i64 j = i - o * inner;
        gx[(o * r + indices[i]) * inner + j] = g[i];
    }
}

#define REDUCE_KERNELS(S, E)                                                                      \
extern "C" __global__ void softmax_middle_##S(const E::T* x, E::T* y, i64 outer, i64 r, i64 inner, \
                                              int log) {                                          \
    softmax_middle<E>(x, y, outer, r, inner, log);                                                \
}                                                                                                 \
extern "C" __global__ void max_middle_##S(const E::T* x, E::T* values, i64* indices, i64 outer,   \
                                          i64 r, i64 inner) {                                     \
    max_middle<E>(x, values, indices, outer, r, inner);                                           \
}                                                                                                 \
extern "C" __global__ void max_middle_backward_##S(const E::T* g, const i64* indices, E::T* gx,   \
                                                   i64 outer, i64 r, i64 inner) {                 \
    max_middle_backward<E>(g, indices, gx, outer, r, inner);                                      \
}
REDUCE_KERNELS(f32, F32Elem)
REDUCE_KERNELS(f16, F16Elem)
REDUCE_KERNELS(bf16, BF16Elem)

// ---- Gather by flat offsets and its deterministic adjoint --------------------------------------

// out[i] = src[offsets[i]], by element size (gather along dim 0 with host-checked offsets).
#define TAKE(NAME, T)                                                                     \
extern "C" __global__ void NAME(const T* src, const i64* offsets, T* out, i64 n) {         \
    GRID_STRIDE(i, n) out[i] = src[offsets[i]];                                            \
}
TAKE(take_b1, u8)
TAKE(take_b2, u16)
TAKE(take_b4, unsigned int)
TAKE(take_b8, unsigned long long)

// The adjoint of take: for each of m distinct targets t, out[targets[t]] = the f32 sum, in
// order, of g[positions[k]] for k in starts[t] .. starts[t + 1] (positions grouped by target on
// the host, so no atomics and a fixed order); other elements of out are left (zero).
template <class E>
__device__ __forceinline__ void put_add_sorted(const typename E::T* g, const i64* positions,
                                               const i64* starts, const i64* targets,
                                               typename E::T* out, i64 m) {
    GRID_STRIDE(t, m) {
        float acc = 0.0f;
        for (i64 k = starts[t]; k < starts[t + 1]; ++k) acc += E::load(g[positions[k]]);
        out[targets[t]] = E::store(acc);
    }
}

#define PUT_ADD(S, E)                                                                         \
extern "C" __global__ void put_add_sorted_##S(const E::T* g, const i64* positions,              \
                                              const i64* starts, const i64* targets, E::T* out, \
                                              i64 m) {                                          \
    put_add_sorted<E>(g, positions, starts, targets, out, m);                                   \
}
PUT_ADD(f32, F32Elem)
PUT_ADD(f16, F16Elem)
PUT_ADD(bf16, BF16Elem)

// ---- Integer arithmetic ------------------------------------------------------------------------
// out[i] = a[..] op b[..] for integer tensors (broadcast strided operands, meta: two), with the
// CPU's semantics: + − · wrap around, / truncates toward zero and wraps (MIN / −1 = MIN; the
// host rules out a zero divisor first), maximum and minimum. Ops as binary_strided_*.
template <class T, class U>
__device__ __forceinline__ T int_op(int op, T x, T y) {
    switch (op) {
    case 0: return (T)((U)x + (U)y);
    case 1: return (T)((U)x - (U)y);
    case 2: return (T)((U)x * (U)y);
    case 3: {
        if (y == 0) return 0;  // unreachable: the host checks divisors
        // x / −1 of a signed type: negate with wrap-around (MIN stays MIN, as wrapping_div).
        if ((T)-1 < (T)0 && y == (T)-1) return (T)((U)0 - (U)x);
        return x / y;
    }
    case 4: return x >= y ? x : y;
    default: return x <= y ? x : y;
    }
}

#define INT_BINARY(S, T, U)                                                                   \
extern "C" __global__ void binary_strided_##S(const T* a, const T* b, T* out, int op, i64 n,   \
                                              const i64* meta) {                              \
    GRID_STRIDE(i, n) out[i] = int_op<T, U>(op, a[strided_offset(i, meta, 0)],                 \
                                            b[strided_offset(i, meta, 1)]);                    \
}
INT_BINARY(i64, i64, unsigned long long)
INT_BINARY(i32, int, unsigned int)
INT_BINARY(u8, u8, u8)

// Integer sums over the middle dimension of a contiguous [outer, r, inner] buffer, wrapping
// around in the element type as the CPU's (modular, so the order does not matter).
#define INT_SUM(S, T, U)                                                                      \
extern "C" __global__ void sum_middle_##S(const T* x, T* out, i64 outer, i64 r, i64 inner) {   \
    GRID_STRIDE(i, outer * inner) {                                                           \
        i64 o = i / inner;                                                                    \
        const T* p = x + o * r * inner + (i - o * inner);                                     \
        U acc = 0;                                                                            \
        for (i64 k = 0; k < r; ++k) acc += (U)p[k * inner];                                   \
        out[i] = (T)acc;                                                                      \
    }                                                                                         \
}
INT_SUM(i64, i64, unsigned long long)
INT_SUM(i32, int, unsigned int)
INT_SUM(u8, u8, u8)

// ---- Row-wise (last-dimension) softmax and max: one warp per row ----------------------------
// The common case (inner == 1): the 32 lanes stride along the row, so its loads coalesce, and
// the partial results meet in warp shuffles. Same results as the per-line kernels above up to
// the order of the sums (softmax); the maximum and its first index exactly.

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

template <class E>
__device__ __forceinline__ void softmax_rows(const typename E::T* x, typename E::T* y, i64 rows,
                                             i64 r, int log) {
    i64 row = (i64)blockIdx.x * blockDim.y + threadIdx.y;
    if (row >= rows) return;
    int lane = threadIdx.x;
    const typename E::T* p = x + row * r;
    typename E::T* q = y + row * r;
    float m = __uint_as_float(0xff800000u);  // -inf
    for (i64 k = lane; k < r; k += 32) m = fmaxf(m, E::load(p[k]));
    m = warp_max(m);
    float s = 0.0f;
    for (i64 k = lane; k < r; k += 32) s += expf(E::load(p[k]) - m);
    s = warp_sum(s);
    float ls = logf(s);
    for (i64 k = lane; k < r; k += 32) {
        float z = E::load(p[k]) - m;
        q[k] = E::store(log ? z - ls : expf(z) / s);
    }
}

// Whether (v, i) comes before (w, j) as the row's maximum: the larger value, a NaN over a
// number, and of equals (or two NaNs) the smaller index — the first occurrence.
__device__ __forceinline__ bool max_before(float v, i64 i, float w, i64 j) {
    bool vn = v != v, wn = w != w;
    if (vn || wn) return vn && (!wn || i < j);
    return v > w || (v == w && i < j);
}

template <class E>
__device__ __forceinline__ void max_rows(const typename E::T* x, typename E::T* values,
                                         i64* indices, i64 rows, i64 r) {
    i64 row = (i64)blockIdx.x * blockDim.y + threadIdx.y;
    if (row >= rows) return;
    int lane = threadIdx.x;
    const typename E::T* p = x + row * r;
    float best = __uint_as_float(0x7fc00000u);
    i64 at = -1;  // none yet (lanes past the row's end keep it)
    for (i64 k = lane; k < r; k += 32) {
        float v = E::load(p[k]);
        if (at < 0 || max_before(v, k, best, at)) {
            best = v;
            at = k;
        }
    }
    for (int o = 16; o > 0; o >>= 1) {
        float w = __shfl_xor_sync(0xffffffffu, best, o);
        i64 j = __shfl_xor_sync(0xffffffffu, at, o);
        if (j >= 0 && (at < 0 || max_before(w, j, best, at))) {
            best = w;
            at = j;
        }
    }
    if (lane == 0) {
        values[row] = E::store(best);
        indices[row] = at;
    }
}

#define ROW_KERNELS(S, E)                                                                      \
extern "C" __global__ void softmax_rows_##S(const E::T* x, E::T* y, i64 rows, i64 r, int log) { \
    softmax_rows<E>(x, y, rows, r, log);                                                       \
}                                                                                              \
extern "C" __global__ void max_rows_##S(const E::T* x, E::T* values, i64* indices, i64 rows,   \
                                        i64 r) {                                               \
    max_rows<E>(x, values, indices, rows, r);                                                  \
}
ROW_KERNELS(f32, F32Elem)
ROW_KERNELS(f16, F16Elem)
ROW_KERNELS(bf16, BF16Elem)

// Sums along the last dimension (inner == 1), a warp per row: each lane adds its stride of the
// row in f64, the 32 partial sums meet in a fixed shuffle tree (deterministic), rounded to f32
// and then to the storage type, as sum_middle_*.
template <class E>
__device__ __forceinline__ void sum_rows(const typename E::T* x, typename E::T* out, i64 rows,
                                         i64 r) {
    i64 row = (i64)blockIdx.x * blockDim.y + threadIdx.y;
    if (row >= rows) return;
    const typename E::T* p = x + row * r;
    double acc = 0.0;
    for (i64 k = threadIdx.x; k < r; k += 32) acc += (double)E::load(p[k]);
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    if (threadIdx.x == 0) out[row] = E::store((float)acc);
}

#define SUM_ROWS(S, E)                                                                         \
extern "C" __global__ void sum_rows_##S(const E::T* x, E::T* out, i64 rows, i64 r) {           \
    sum_rows<E>(x, out, rows, r);                                                              \
}
SUM_ROWS(f32, F32Elem)
SUM_ROWS(f16, F16Elem)
SUM_ROWS(bf16, BF16Elem)
