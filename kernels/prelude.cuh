// Shared helpers for every kernel in kernels/: prepended to each source before NVRTC compiles
// it (NVRTC gets no system headers, so fp16/bf16 conversions are done with PTX and bit moves),
// and before the host emulation compiles it (EMBERS_HOST_SIM, see host_sim.hpp).
typedef long long i64;
typedef unsigned char u8;
typedef unsigned short u16;

#ifdef EMBERS_HOST_SIM
// The host emulation (kernels/host_sim.hpp): the compiler's own IEEE half type.
__device__ __forceinline__ float f16_to_f32(u16 h) {
    _Float16 v;
    memcpy(&v, &h, 2);
    return (float)v;
}

__device__ __forceinline__ u16 f32_to_f16(float f) {
    _Float16 v = (_Float16)f;
    u16 h;
    memcpy(&h, &v, 2);
    return h;
}
#else
__device__ __forceinline__ float f16_to_f32(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ u16 f32_to_f16(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

// `DYNAMIC_SHARED(float, buf)` declares the dynamic shared memory buffer of a launch.
#define DYNAMIC_SHARED(T, name)                                                    \
    extern __shared__ __align__(16) unsigned char embers_dynamic_shared_[];        \
    T* name = reinterpret_cast<T*>(embers_dynamic_shared_)
#endif

__device__ __forceinline__ float bf16_to_f32(u16 b) {
    return __uint_as_float(((unsigned int)b) << 16);
}

// f32 -> bf16, round to nearest even; a NaN stays a (quiet) NaN. As half::bf16::from_f32.
__device__ __forceinline__ u16 f32_to_bf16(float f) {
    unsigned int x = __float_as_uint(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (u16)((x >> 16) | 0x40u);
    return (u16)((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

// f64 -> f32 rounded to odd (truncate, then set the last bit if anything was cut off): rounding
// that result to f16/bf16 is then the correctly rounded f64 -> f16/bf16 (24 >= 11 + 2 bits).
// src/tensor/dtype.rs does the same on the CPU, so both agree bit for bit.
__device__ __forceinline__ float f64_to_f32_odd(double d) {
    float f = (float)d;
    if ((double)f == d || d != d) return f;
    unsigned int b = __float_as_uint(f);
    if (fabs((double)f) > fabs(d)) b -= 1u;  // f was rounded away from zero: step back
    return __uint_as_float(b | 1u);
}

__device__ __forceinline__ u16 f64_to_f16(double d) { return f32_to_f16(f64_to_f32_odd(d)); }
__device__ __forceinline__ u16 f64_to_bf16(double d) { return f32_to_bf16(f64_to_f32_odd(d)); }

// The storage types of float tensors, each loaded to and stored from the f32 it computes in.
struct F32Elem {
    typedef float T;
    static __device__ __forceinline__ float load(float v) { return v; }
    static __device__ __forceinline__ float store(float v) { return v; }
};
struct F16Elem {
    typedef u16 T;
    static __device__ __forceinline__ float load(u16 v) { return f16_to_f32(v); }
    static __device__ __forceinline__ u16 store(float v) { return f32_to_f16(v); }
};
struct BF16Elem {
    typedef u16 T;
    static __device__ __forceinline__ float load(u16 v) { return bf16_to_f32(v); }
    static __device__ __forceinline__ u16 store(float v) { return f32_to_bf16(v); }
};

// FBGEMM's HFP8 (no inf/NaN): the 7 magnitude bits moved to where an f32 keeps exponent and
// mantissa give value * 2^(bias - 127); one exact multiply rebases it (sub-normals included).
__device__ __forceinline__ float hfp8_to_f32(u8 byte, int ebits, int bias) {
    unsigned int sign = ((unsigned int)(byte & 0x80)) << 24;
    float shifted = __uint_as_float(((unsigned int)(byte & 0x7f)) << (16 + ebits));
    float rebase = __uint_as_float(((unsigned int)(127 + (127 - bias))) << 23);
    return __uint_as_float(__float_as_uint(shifted * rebase) | sign);
}

// Records the first bad position of an input (smallest index wins) for the host to report.
__device__ __forceinline__ void report_bad_index(i64* first_bad, i64 position) {
    atomicMin((unsigned long long*)first_bad, (unsigned long long)position);
}

// The bag holding position l: the last bag b of `bags` with offsets[b] <= l (binary search;
// offsets has bags + 1 monotone entries and l < offsets[bags]).
__device__ __forceinline__ int bag_of_position(const i64* offsets, int bags, i64 l) {
    int lo = 0, hi = bags;
    while (hi - lo > 1) {
        int mid = (lo + hi) / 2;
        if (offsets[mid] <= l) lo = mid; else hi = mid;
    }
    return lo;
}

// Grid-stride loop over 0 .. n: `GRID_STRIDE(i, n) body;` (launched with LaunchConfig::linear).
#define GRID_STRIDE(i, n) \
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += (i64)blockDim.x * gridDim.x)

// Sum of `v` over the 32 lanes of a (fully active) warp, in every lane.
__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Exclusive prefix sum of one value per thread over the block (blockDim.x a multiple of 32,
// at most 1024; every thread must call it). `scratch` is shared, 32 values. Sets *total.
template <class T>
__device__ __forceinline__ T block_exclusive_scan(T v, T* scratch, T* total) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    T x = v;
    for (int o = 1; o < 32; o <<= 1) {
        T y = __shfl_up_sync(0xffffffffu, x, o);
        if (lane >= o) x += y;
    }
    if (lane == 31) scratch[warp] = x;
    __syncthreads();
    if (warp == 0) {
        T t = lane < warps ? scratch[lane] : (T)0;
        for (int o = 1; o < 32; o <<= 1) {
            T y = __shfl_up_sync(0xffffffffu, t, o);
            if (lane >= o) t += y;
        }
        scratch[lane] = t;
    }
    __syncthreads();
    T before = warp > 0 ? scratch[warp - 1] : (T)0;
    *total = scratch[warps - 1];
    __syncthreads();  // scratch is free again for the next call
    return before + x - v;
}
