// Fused TBE backward for FP32 tables, the GPU twin of src/embedding/backward.rs: every
// occurrence of a row in the batch is found by sorting (row, position) keys, each row's
// gradient is summed once, in position order, by one warp, and the optimizer updates the row
// in place. Deterministic: no atomics on weights, a fixed summation order.
//
// Keys: (global_row << 24) | position, global_row = row_starts[f] + id (rows of all tables
// numbered back to back), so positions must be < 2^24 (the host checks). Ids out of range get
// the key ~0 and sort to the end (the forward already reported them). The keys are sorted by
// their row bits with the stable radix sort of sort.cu (equal rows stay in position order).

#define POSITION_BITS 24
#define POSITION_MASK ((1ull << POSITION_BITS) - 1)
#define NO_KEY 0xffffffffffffffffull
#define MAX_PER_LANE 16   // dims up to 32 * 16 = 512

// One thread per bag (f, b): writes the keys of its ids and bag_of[position].
extern "C" __global__ void tbe_backward_keys(
    const i64* __restrict__ indices, const i64* __restrict__ offsets, int B, int F,
    const i64* __restrict__ row_starts, const i64* __restrict__ rows,
    unsigned long long* __restrict__ keys, int* __restrict__ bag_of) {
    int bag = blockIdx.x * blockDim.x + threadIdx.x;
    if (bag >= B * F) return;
    int f = bag / B;
    for (i64 l = offsets[bag]; l < offsets[bag + 1]; ++l) {
        i64 id = indices[l];
        bag_of[l] = bag;
        keys[l] = (id < 0 || id >= rows[f])
            ? NO_KEY
            : (((unsigned long long)(row_starts[f] + id)) << POSITION_BITS) | (unsigned long long)l;
    }
}

// heads[s] = 1 where sorted key s is the first of its row (out-of-range ids' keys: 0), else 0;
// their exclusive scan numbers the distinct rows (the row-sparse gradient's slots).
extern "C" __global__ void tbe_sparse_heads(const unsigned long long* __restrict__ keys, i64 n,
                                            i64* __restrict__ heads) {
    GRID_STRIDE(s, n) {
        unsigned long long key = keys[s];
        unsigned long long row = key >> POSITION_BITS;
        heads[s] = key != NO_KEY && (s == 0 || (keys[s - 1] >> POSITION_BITS) != row) ? 1 : 0;
    }
}

// One warp per sorted key; the warp that holds the first key of a row sums that row's
// gradient over all its occurrences and applies the optimizer (src/embedding/optimizer.rs has
// the same rules for the CPU):
//   optimizer 0: SGD              w -= lr * g
//   optimizer 1: row-wise Adagrad m += mean(g^2) (m1 per row); w -= lr / (sqrt(m) + eps) * g
//   optimizer 2: Adagrad          m += g^2 (m1 per element);  w -= lr * g / (sqrt(m) + eps)
//   optimizer 3: lazy Adam        m = b1 m + (1-b1) g, v = b2 v + (1-b2) g^2 (m1, m2 per
//                                 element); w -= lr * (m/c1) / (sqrt(v/c2) + eps)
//   optimizer 4: LAMB             Adam's moments; r = (m/c1) / (sqrt(v/c2) + eps) (+ lambda w
//                                 with decoupled decay); w -= lr * (|w| / |r|) * r, row norms,
//                                 ratio 1 when either norm is 0
//   optimizer 5: partial row-wise LAMB: as 4 with one v per row (m2 per row),
//                                 v = b2 v + (1-b2) mean(g^2)
//   optimizer 6: partial row-wise Adam: as 3 with that per-row v
//   optimizer 7: no update — the row's summed gradient goes to the row-sparse output instead:
//                rows_out[slots[s]] = global row, values_out[slots[s] * max_dim + d] = g[d]
//                (slots: the exclusive scan of tbe_sparse_heads; decay is not applied)
// Weight decay: decay 1 (L2) adds lambda * w to g first; decay 2 (decoupled) also subtracts
// lr * lambda * w (w before the step), except for LAMB (above).
// grad_output is [B, out_stride]; feature f's columns start at out_offsets[f]. With mean
// pooling each occurrence is scaled by 1 / bag length; per-sample weights (nullable) scale it.
// Unpooled (sequence != 0): grad_output is [N, D], occurrence l's gradient is its row l.
// Per-element state sits at the weight's own offset; per-row state at the row's number.
// weights_grad (nullable, zeroed by the caller): each occurrence's per-sample-weight gradient,
// row . its output gradient (/ bag length with mean pooling), with the row before its update.
extern "C" __global__ void tbe_backward_update(
    const unsigned long long* __restrict__ keys, i64 n, const int* __restrict__ bag_of,
    const i64* __restrict__ offsets, int B,
    const float* __restrict__ per_sample_weights, int mean, int sequence,
    const float* __restrict__ grad_output, int out_stride, const int* __restrict__ out_offsets,
    const int* __restrict__ dims, const i64* __restrict__ table_offsets,
    const i64* __restrict__ row_starts, float* __restrict__ weights,
    float* __restrict__ m1, float* __restrict__ m2, int optimizer, float lr, float eps,
    float beta1, float beta2, float correction1, float correction2, int decay, float lambda,
    float* __restrict__ weights_grad, const i64* __restrict__ slots, i64* __restrict__ rows_out,
    float* __restrict__ values_out, int max_dim) {
    i64 s = (i64)blockIdx.x * blockDim.y + threadIdx.y;
    if (s >= n) return;
    unsigned long long key = keys[s];
    if (key == NO_KEY) return;
    unsigned long long row = key >> POSITION_BITS;
    if (s > 0 && (keys[s - 1] >> POSITION_BITS) == row) return;
    int lane = threadIdx.x;
    int first_bag = bag_of[key & POSITION_MASK];
    int f0 = first_bag / B;
    int D = dims[f0];
    i64 id = (i64)row - row_starts[f0];
    i64 base = table_offsets[f0] + id * D;
    float* w = weights + base;
    float g[MAX_PER_LANE];
    for (int k = 0; k < MAX_PER_LANE; ++k) g[k] = 0.0f;
    for (i64 t = s; t < n && keys[t] != NO_KEY && (keys[t] >> POSITION_BITS) == row; ++t) {
        i64 l = (i64)(keys[t] & POSITION_MASK);
        int bag = bag_of[l];
        int f = bag / B;
        int b = bag - f * B;
        float scale = per_sample_weights ? per_sample_weights[l] : 1.0f;
        if (mean) scale /= (float)(offsets[bag + 1] - offsets[bag]);
        const float* go = sequence ? grad_output + l * out_stride
                                   : grad_output + (i64)b * out_stride + out_offsets[f];
        float dot = 0.0f;
        for (int k = 0; k < MAX_PER_LANE; ++k) {
            int d = lane + 32 * k;
            if (d < D) {
                g[k] += scale * go[d];
                dot += w[d] * go[d];
            }
        }
        if (weights_grad) {
            dot = warp_sum(dot);
            if (mean) dot /= (float)(offsets[bag + 1] - offsets[bag]);
            if (lane == 0) weights_grad[l] = dot;
        }
    }
    if (optimizer == 7) {
        i64 slot = slots[s];
        if (lane == 0) rows_out[slot] = (i64)row;
        float* dst = values_out + slot * max_dim;
        for (int k = 0; k < MAX_PER_LANE; ++k) {
            int d = lane + 32 * k;
            if (d < D) dst[d] = g[k];
        }
        return;
    }
    if (decay == 1) {
        for (int k = 0; k < MAX_PER_LANE; ++k) {
            int d = lane + 32 * k;
            if (d < D) g[k] += lambda * w[d];
        }
    }
    float decoupled = decay == 2 ? lr * lambda : 0.0f;
    // The per-row second moment of the partial row-wise rules: Adam's denominator.
    float row_denom = 0.0f;
    if (optimizer == 5 || optimizer == 6) {
        float sq = 0.0f;
        for (int k = 0; k < MAX_PER_LANE; ++k) sq += g[k] * g[k];
        sq = warp_sum(sq);
        float v = beta2 * m2[row] + (1.0f - beta2) * (sq / (float)D);
        __syncwarp();
        if (lane == 0) m2[row] = v;
        row_denom = sqrtf(v / correction2) + eps;
    }
    if (optimizer == 4 || optimizer == 5) {
        // LAMB: the direction r replaces g, then one step scaled by the row's trust ratio.
        float lam = decay == 2 ? lambda : 0.0f;
        float w_sq = 0.0f, r_sq = 0.0f;
        for (int k = 0; k < MAX_PER_LANE; ++k) {
            int d = lane + 32 * k;
            if (d >= D) continue;
            float m = beta1 * m1[base + d] + (1.0f - beta1) * g[k];
            m1[base + d] = m;
            float denom = row_denom;
            if (optimizer == 4) {
                float v = beta2 * m2[base + d] + (1.0f - beta2) * g[k] * g[k];
                m2[base + d] = v;
                denom = sqrtf(v / correction2) + eps;
            }
            float wd = w[d];
            g[k] = (m / correction1) / denom + lam * wd;
            w_sq += wd * wd;
            r_sq += g[k] * g[k];
        }
        float w_norm = sqrtf(warp_sum(w_sq));
        float r_norm = sqrtf(warp_sum(r_sq));
        float ratio = (w_norm > 0.0f && r_norm > 0.0f) ? w_norm / r_norm : 1.0f;
        float size = lr * ratio;
        __syncwarp();
        for (int k = 0; k < MAX_PER_LANE; ++k) {
            int d = lane + 32 * k;
            if (d < D) w[d] -= size * g[k];
        }
        return;
    }
    float step = lr;
    if (optimizer == 1) {
        float sq = 0.0f;
        for (int k = 0; k < MAX_PER_LANE; ++k) sq += g[k] * g[k];
        sq = warp_sum(sq);
        float* m = m1 + row;
        float updated = *m + sq / (float)D;
        __syncwarp();
        if (lane == 0) *m = updated;
        step = lr / (sqrtf(updated) + eps);
    }
    for (int k = 0; k < MAX_PER_LANE; ++k) {
        int d = lane + 32 * k;
        if (d >= D) continue;
        float wd = w[d];
        float delta;
        if (optimizer == 2) {
            float m = m1[base + d] + g[k] * g[k];
            m1[base + d] = m;
            delta = lr * g[k] / (sqrtf(m) + eps);
        } else if (optimizer == 3) {
            float m = beta1 * m1[base + d] + (1.0f - beta1) * g[k];
            float v = beta2 * m2[base + d] + (1.0f - beta2) * g[k] * g[k];
            m1[base + d] = m;
            m2[base + d] = v;
            delta = lr * (m / correction1) / (sqrtf(v / correction2) + eps);
        } else if (optimizer == 6) {
            float m = beta1 * m1[base + d] + (1.0f - beta1) * g[k];
            m1[base + d] = m;
            delta = lr * (m / correction1) / row_denom;
        } else {
            delta = step * g[k];
        }
        w[d] = wd - (delta + decoupled * wd);
    }
}
