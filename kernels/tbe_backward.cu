// Fused TBE backward for FP32 tables, the GPU twin of src/embedding/tbe/cpu/backward.rs: every
// occurrence of a row in the batch is found by sorting (row, position) keys, each row's
// gradient is summed once, in position order, by one warp, and the optimizer updates the row
// in place. Deterministic: no atomics on weights, a fixed summation order.
//
// Keys: (global_row << 24) | position, global_row = row_starts[f] + id (rows of all tables
// numbered back to back), so positions must be < 2^24 (the host checks). With key_is_bag the
// low bits hold the occurrence's bag instead (bags < 2^24), which saves the update a lookup
// per occurrence; the host asks for that when nothing needs the position (no per-sample
// weights, no weight gradient, pooled lookups). Either way equal rows stay in position order. Ids out of range get
// the key ~0 and sort to the end (the forward already reported them). The keys are sorted by
// their row bits with the stable radix sort of sort.cu (equal rows stay in position order).

#define POSITION_BITS 24
#define POSITION_MASK ((1ull << POSITION_BITS) - 1)
#define NO_KEY 0xffffffffffffffffull

// One warp per bag (f, b) (block (32, warps)): its lanes write the keys of the bag's ids and
// (unless key_is_bag) bag_of[position], coalesced.
extern "C" __global__ void tbe_backward_keys(
    const i64* __restrict__ indices, const i64* __restrict__ offsets, int B, int F,
    const i64* __restrict__ row_starts, const i64* __restrict__ rows,
    unsigned long long* __restrict__ keys, int* __restrict__ bag_of, int key_is_bag) {
    int bag = blockIdx.x * blockDim.y + threadIdx.y;
    if (bag >= B * F) return;
    int f = bag / B;
    for (i64 l = offsets[bag] + threadIdx.x; l < offsets[bag + 1]; l += 32) {
        i64 id = indices[l];
        if (!key_is_bag) bag_of[l] = bag;
        unsigned long long low = key_is_bag ? (unsigned long long)bag : (unsigned long long)l;
        keys[l] = (id < 0 || id >= rows[f])
            ? NO_KEY
            : (((unsigned long long)(row_starts[f] + id)) << POSITION_BITS) | low;
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
// gradient over all its occurrences and applies the optimizer. KPL values per lane: dims up
// to 32 * KPL (tbe_backward_update_d128: 4, for tables of dims up to 128; tbe_backward_update:
// 16, up to 512). The loads that do not depend on each other are issued together (the row's
// per-row state with the first occurrence, each next key with the current occurrence's
// gradient, the row's weights as soon as its address is known), since a warp's time here is
// mostly waiting on memory (src/embedding/optimizer.rs has
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
template <int KPL>
__device__ __forceinline__ void backward_update(
    const unsigned long long* __restrict__ keys, i64 n, const int* __restrict__ bag_of,
    int key_is_bag, const i64* __restrict__ offsets, int B,
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
    unsigned long long before = s > 0 ? keys[s - 1] : NO_KEY;
    if (key == NO_KEY) return;
    unsigned long long row = key >> POSITION_BITS;
    if (s > 0 && (before >> POSITION_BITS) == row) return;
    int lane = threadIdx.x;
    // Per-row state, read now so that its latency overlaps the occurrence loads.
    float row_state = optimizer == 1 ? m1[row] : (optimizer == 5 || optimizer == 6) ? m2[row] : 0.0f;
    i64 l = (i64)(key & POSITION_MASK);
    int bag = key_is_bag ? (int)l : bag_of[l];
    int f0 = bag / B;
    int D = dims[f0];
    i64 id = (i64)row - row_starts[f0];
    i64 base = table_offsets[f0] + id * D;
    float* w = weights + base;
    // The row before its update (only this warp writes it).
    float wv[KPL];
    float g[KPL];
#pragma unroll
    for (int k = 0; k < KPL; ++k) {
        int d = lane + 32 * k;
        wv[k] = d < D ? w[d] : 0.0f;
        g[k] = 0.0f;
    }
    for (i64 t = s;;) {
        unsigned long long next = t + 1 < n ? keys[t + 1] : NO_KEY;
        int f = bag / B;
        int b = bag - f * B;
        float scale = per_sample_weights ? per_sample_weights[l] : 1.0f;
        if (mean) scale /= (float)(offsets[bag + 1] - offsets[bag]);
        const float* go = sequence ? grad_output + l * out_stride
                                   : grad_output + (i64)b * out_stride + out_offsets[f];
        float dot = 0.0f;
#pragma unroll
        for (int k = 0; k < KPL; ++k) {
            int d = lane + 32 * k;
            if (d < D) {
                float gd = go[d];
                g[k] += scale * gd;
                if (weights_grad) dot += wv[k] * gd;
            }
        }
        if (weights_grad) {
            dot = warp_sum(dot);
            if (mean) dot /= (float)(offsets[bag + 1] - offsets[bag]);
            if (lane == 0) weights_grad[l] = dot;
        }
        if (next == NO_KEY || (next >> POSITION_BITS) != row) break;
        t += 1;
        l = (i64)(next & POSITION_MASK);
        bag = key_is_bag ? (int)l : bag_of[l];
    }
    if (optimizer == 7) {
        i64 slot = slots[s];
        if (lane == 0) rows_out[slot] = (i64)row;
        float* dst = values_out + slot * max_dim;
#pragma unroll
        for (int k = 0; k < KPL; ++k) {
            int d = lane + 32 * k;
            if (d < D) dst[d] = g[k];
        }
        return;
    }
    if (decay == 1) {
#pragma unroll
        for (int k = 0; k < KPL; ++k) {
            int d = lane + 32 * k;
            if (d < D) g[k] += lambda * wv[k];
        }
    }
    float decoupled = decay == 2 ? lr * lambda : 0.0f;
    // The per-row second moment of the partial row-wise rules: Adam's denominator.
    float row_denom = 0.0f;
    if (optimizer == 5 || optimizer == 6) {
        float sq = 0.0f;
#pragma unroll
        for (int k = 0; k < KPL; ++k) sq += g[k] * g[k];
        sq = warp_sum(sq);
        float v = beta2 * row_state + (1.0f - beta2) * (sq / (float)D);
        __syncwarp();
        if (lane == 0) m2[row] = v;
        row_denom = sqrtf(v / correction2) + eps;
    }
    if (optimizer == 4 || optimizer == 5) {
        // LAMB: the direction r replaces g, then one step scaled by the row's trust ratio.
        float lam = decay == 2 ? lambda : 0.0f;
        float w_sq = 0.0f, r_sq = 0.0f;
#pragma unroll
        for (int k = 0; k < KPL; ++k) {
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
            float wd = wv[k];
            g[k] = (m / correction1) / denom + lam * wd;
            w_sq += wd * wd;
            r_sq += g[k] * g[k];
        }
        float w_norm = sqrtf(warp_sum(w_sq));
        float r_norm = sqrtf(warp_sum(r_sq));
        float ratio = (w_norm > 0.0f && r_norm > 0.0f) ? w_norm / r_norm : 1.0f;
        float size = lr * ratio;
        __syncwarp();
#pragma unroll
        for (int k = 0; k < KPL; ++k) {
            int d = lane + 32 * k;
            if (d < D) w[d] = wv[k] - size * g[k];
        }
        return;
    }
    float step = lr;
    if (optimizer == 1) {
        float sq = 0.0f;
#pragma unroll
        for (int k = 0; k < KPL; ++k) sq += g[k] * g[k];
        sq = warp_sum(sq);
        float updated = row_state + sq / (float)D;
        __syncwarp();
        if (lane == 0) m1[row] = updated;
        step = lr / (sqrtf(updated) + eps);
    }
#pragma unroll
    for (int k = 0; k < KPL; ++k) {
        int d = lane + 32 * k;
        if (d >= D) continue;
        float wd = wv[k];
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

#define TBE_BACKWARD_UPDATE(NAME, KPL)                                                            \
    extern "C" __global__ void NAME(                                                              \
        const unsigned long long* __restrict__ keys, i64 n, const int* __restrict__ bag_of,       \
        int key_is_bag, const i64* __restrict__ offsets, int B,                                   \
        const float* __restrict__ per_sample_weights,                                             \
        int mean, int sequence, const float* __restrict__ grad_output, int out_stride,            \
        const int* __restrict__ out_offsets, const int* __restrict__ dims,                        \
        const i64* __restrict__ table_offsets, const i64* __restrict__ row_starts,                \
        float* __restrict__ weights, float* __restrict__ m1, float* __restrict__ m2,              \
        int optimizer, float lr, float eps, float beta1, float beta2, float correction1,          \
        float correction2, int decay, float lambda, float* __restrict__ weights_grad,             \
        const i64* __restrict__ slots, i64* __restrict__ rows_out,                                \
        float* __restrict__ values_out, int max_dim) {                                            \
        backward_update<KPL>(keys, n, bag_of, key_is_bag, offsets, B, per_sample_weights, mean,   \
                             sequence,                                                            \
                             grad_output, out_stride, out_offsets, dims, table_offsets,           \
                             row_starts, weights, m1, m2, optimizer, lr, eps, beta1, beta2,       \
                             correction1, correction2, decay, lambda, weights_grad, slots,        \
                             rows_out, values_out, max_dim);                                      \
    }
TBE_BACKWARD_UPDATE(tbe_backward_update, 16)
TBE_BACKWARD_UPDATE(tbe_backward_update_d128, 4)
