// Element-wise f32 kernels over contiguous buffers, one thread per element (grid-stride).

#define GRID_STRIDE(i, n) \
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += (i64)blockDim.x * gridDim.x)

extern "C" __global__ void fill_f32(float* out, float value, i64 n) {
    GRID_STRIDE(i, n) out[i] = value;
}

// op: 0 add, 1 sub, 2 mul, 3 div, 4 max, 5 min.
extern "C" __global__ void binary_f32(const float* a, const float* b, float* out, int op, i64 n) {
    GRID_STRIDE(i, n) {
        float x = a[i], y = b[i];
        float r;
        switch (op) {
        case 0: r = x + y; break;
        case 1: r = x - y; break;
        case 2: r = x * y; break;
        case 3: r = x / y; break;
        case 4: r = fmaxf(x, y); break;
        default: r = fminf(x, y); break;
        }
        out[i] = r;
    }
}

// op: 0 relu, 1 sigmoid, 2 tanh, 3 exp, 4 log, 5 neg.
extern "C" __global__ void unary_f32(const float* a, float* out, int op, i64 n) {
    GRID_STRIDE(i, n) {
        float x = a[i];
        float r;
        switch (op) {
        case 0: r = fmaxf(x, 0.0f); break;
        case 1: r = 1.0f / (1.0f + expf(-x)); break;
        case 2: r = tanhf(x); break;
        case 3: r = expf(x); break;
        case 4: r = logf(x); break;
        default: r = -x; break;
        }
        out[i] = r;
    }
}

// out = a * alpha + b * beta (axpby), the optimizer and gradient-accumulation workhorse.
extern "C" __global__ void axpby_f32(const float* a, float alpha, const float* b, float beta,
                                     float* out, i64 n) {
    GRID_STRIDE(i, n) out[i] = a[i] * alpha + b[i] * beta;
}
