// Dense-parameter optimizer steps over contiguous f32 buffers, one thread per element
// (grid-stride), the GPU twins of src/optim (same formulas and order of operations, f32).
//
// Every kernel takes `rows` (nullable) and `row_len`: with `rows`, the gradient `g` holds only
// the rows `rows[k]` of the parameter (sorted, distinct: a coalesced row-sparse gradient), and
// only those rows of the parameter and its state are read and written; n counts g's elements.

// The parameter element that gradient element i belongs to.
__device__ __forceinline__ i64 param_index(const i64* rows, i64 row_len, i64 i) {
    return rows ? rows[i / row_len] * row_len + i % row_len : i;
}

// torch.optim.SGD: d = g + wd·w; with momentum (buf nullable) buf = d on the first step, else
// mom·buf + (1 − damp)·d, and d = d + mom·buf (Nesterov) or buf; w −= lr·d.
extern "C" __global__ void sgd_step_f32(float* w, float* buf, const float* g, i64 n,
                                        const i64* rows, i64 row_len, float lr, float mom,
                                        float damp, float wd, int nesterov, int first) {
    GRID_STRIDE(i, n) {
        i64 j = param_index(rows, row_len, i);
        float d = g[i] + wd * w[j];
        if (buf) {
            float b = first ? d : mom * buf[j] + (1.0f - damp) * d;
            buf[j] = b;
            d = nesterov ? d + mom * b : b;
        }
        w[j] = w[j] - lr * d;
    }
}

// torch.optim.Adagrad: d = g + wd·w; s += d²; w −= clr·d / (√s + eps).
extern "C" __global__ void adagrad_step_f32(float* w, float* s, const float* g, i64 n,
                                            const i64* rows, i64 row_len, float clr,
                                            float wd, float eps) {
    GRID_STRIDE(i, n) {
        i64 j = param_index(rows, row_len, i);
        float d = g[i] + wd * w[j];
        float si = s[j] + d * d;
        s[j] = si;
        w[j] = w[j] - clr * d / (sqrtf(si) + eps);
    }
}

// torch.optim.Adam / AdamW (decay = 1 − lr·wd when decoupled, else 1 and l2 = 1 adds wd·w to
// the gradient); vmax (nullable) keeps the running maximum of v (AMSGrad).
extern "C" __global__ void adam_step_f32(float* w, float* m, float* v, float* vmax,
                                         const float* g, i64 n, const i64* rows,
                                         i64 row_len, float b1, float b2, float bc1,
                                         float bc2_sqrt, float lr, float eps, float wd, int l2,
                                         float decay) {
    GRID_STRIDE(i, n) {
        i64 j = param_index(rows, row_len, i);
        float gi = l2 ? g[i] + wd * w[j] : g[i];
        float wi = w[j] * decay;
        float mi = b1 * m[j] + (1.0f - b1) * gi;
        float vi = b2 * v[j] + (1.0f - b2) * gi * gi;
        m[j] = mi;
        v[j] = vi;
        float second = vi;
        if (vmax) {
            second = fmaxf(vmax[j], vi);
            vmax[j] = second;
        }
        float denom = sqrtf(second) / bc2_sqrt + eps;
        w[j] = wi - lr / bc1 * mi / denom;
    }
}
