// Dense-parameter optimizer steps over contiguous f32 buffers, one thread per element
// (grid-stride), the GPU twins of src/optim (same formulas and order of operations, f32).

// torch.optim.SGD: d = g + wd·w; with momentum (buf nullable) buf = d on the first step, else
// mom·buf + (1 − damp)·d, and d = d + mom·buf (Nesterov) or buf; w −= lr·d.
extern "C" __global__ void sgd_step_f32(float* w, float* buf, const float* g, i64 n, float lr,
                                        float mom, float damp, float wd, int nesterov,
                                        int first) {
    GRID_STRIDE(i, n) {
        float d = g[i] + wd * w[i];
        if (buf) {
            float b = first ? d : mom * buf[i] + (1.0f - damp) * d;
            buf[i] = b;
            d = nesterov ? d + mom * b : b;
        }
        w[i] = w[i] - lr * d;
    }
}

// torch.optim.Adagrad: d = g + wd·w; s += d²; w −= clr·d / (√s + eps).
extern "C" __global__ void adagrad_step_f32(float* w, float* s, const float* g, i64 n,
                                            float clr, float wd, float eps) {
    GRID_STRIDE(i, n) {
        float d = g[i] + wd * w[i];
        float si = s[i] + d * d;
        s[i] = si;
        w[i] = w[i] - clr * d / (sqrtf(si) + eps);
    }
}

// torch.optim.Adam / AdamW (decay = 1 − lr·wd when decoupled, else 1 and l2 = 1 adds wd·w to
// the gradient); vmax (nullable) keeps the running maximum of v (AMSGrad).
extern "C" __global__ void adam_step_f32(float* w, float* m, float* v, float* vmax,
                                         const float* g, i64 n, float b1, float b2, float bc1,
                                         float bc2_sqrt, float lr, float eps, float wd, int l2,
                                         float decay) {
    GRID_STRIDE(i, n) {
        float gi = l2 ? g[i] + wd * w[i] : g[i];
        float wi = w[i] * decay;
        float mi = b1 * m[i] + (1.0f - b1) * gi;
        float vi = b2 * v[i] + (1.0f - b2) * gi * gi;
        m[i] = mi;
        v[i] = vi;
        float second = vi;
        if (vmax) {
            second = fmaxf(vmax[i], vi);
            vmax[i] = second;
        }
        float denom = sqrtf(second) / bc2_sqrt + eps;
        w[i] = wi - lr / bc1 * mi / denom;
    }
}
