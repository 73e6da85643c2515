// block_bucketize_sparse_features on the device, the twin of src/sparse/ops/bucketize/cpu.rs: every
// id is routed to the bucket (rank) owning its block of rows and rebased into that rank's rows;
// the output is bucket-major, then bag, ids of a bag in their original order (deterministic).
//   block_bucketize_count_*:   one thread per bag counts its ids per bucket into
//                              counts[bucket * bags + bag] (zeroed by the caller) and reports
//                              the first negative id;
//   scan_exclusive_i64 (sort.cu) turns the counts into each (bucket, bag)'s first slot;
//   block_bucketize_scatter_*: one thread per bag writes each id to its slot (the slot starts
//                              are its cursors: each (bucket, bag) belongs to one thread).
// Routers, per feature f: kind[f] 0 = uniform, params[4f..4f+4) = (bucket span, blocks per
// bucket, total blocks, range); kind 1 = explicit boundaries bounds[f * (my_size + 1) ..].

__device__ __forceinline__ void bucketize_route(i64 id, int f, const int* kind, const i64* params,
                                                const i64* bounds, int my_size, int* bucket,
                                                i64* rebased) {
    if (kind[f] == 0) {
        i64 span = params[4 * f], per_bucket = params[4 * f + 1];
        i64 total_blocks = params[4 * f + 2], range = params[4 * f + 3];
        if (id < range) {
            i64 b = id / span;
            *bucket = (int)b;
            *rebased = id - b * span;
        } else {
            *bucket = (int)((id % total_blocks) / per_bucket);
            *rebased = id / total_blocks;
        }
    } else {
        const i64* pos = bounds + (i64)f * (my_size + 1);
        if (id >= pos[my_size]) {
            *bucket = (int)(id % my_size);
            *rebased = id / my_size;
        } else {
            // The last boundary <= id: pos[0] = 0 <= id < pos[my_size].
            int lo = 0, hi = my_size;
            while (hi - lo > 1) {
                int mid = (lo + hi) / 2;
                if (pos[mid] <= id) lo = mid; else hi = mid;
            }
            *bucket = lo;
            *rebased = id - pos[lo];
        }
    }
}

#define BUCKETIZE_KERNELS(I, S)                                                                   \
    extern "C" __global__ void block_bucketize_count_##S(                                         \
        const I* __restrict__ ids, const i64* __restrict__ offsets,                               \
        const int* __restrict__ bag_feature, i64 bags, const int* __restrict__ kind,              \
        const i64* __restrict__ params, const i64* __restrict__ bounds, int my_size,              \
        i64* __restrict__ counts, i64* first_bad) {                                               \
        i64 bag = (i64)blockIdx.x * blockDim.x + threadIdx.x;                                     \
        if (bag >= bags) return;                                                                  \
        int f = bag_feature[bag];                                                                 \
        for (i64 i = offsets[bag]; i < offsets[bag + 1]; ++i) {                                   \
            i64 id = (i64)ids[i];                                                                 \
            if (id < 0) {                                                                         \
                report_bad_index(first_bad, i);                                                   \
                continue;                                                                         \
            }                                                                                     \
            int bucket;                                                                           \
            i64 rebased;                                                                          \
            bucketize_route(id, f, kind, params, bounds, my_size, &bucket, &rebased);             \
            counts[(i64)bucket * bags + bag] += 1;                                                \
        }                                                                                         \
    }                                                                                             \
    /* destination / positions / weights (nullable): where each id went, its position in its  \
       bag, f32 weights moved with their ids. */                                                  \
    extern "C" __global__ void block_bucketize_scatter_##S(                                       \
        const I* __restrict__ ids, const i64* __restrict__ offsets,                               \
        const int* __restrict__ bag_feature, i64 bags, const int* __restrict__ kind,              \
        const i64* __restrict__ params, const i64* __restrict__ bounds, int my_size,              \
        int keep_orig_idx, i64* __restrict__ cursor, I* __restrict__ out_ids,                     \
        I* __restrict__ destination, I* __restrict__ positions,                                   \
        const float* __restrict__ weights, float* __restrict__ out_weights) {                     \
        i64 bag = (i64)blockIdx.x * blockDim.x + threadIdx.x;                                     \
        if (bag >= bags) return;                                                                  \
        int f = bag_feature[bag];                                                                 \
        for (i64 i = offsets[bag]; i < offsets[bag + 1]; ++i) {                                   \
            i64 id = (i64)ids[i];                                                                 \
            int bucket;                                                                           \
            i64 rebased;                                                                          \
            bucketize_route(id, f, kind, params, bounds, my_size, &bucket, &rebased);             \
            i64 slot = cursor[(i64)bucket * bags + bag]++;                                        \
            out_ids[slot] = keep_orig_idx ? ids[i] : (I)rebased;                                  \
            if (destination) destination[i] = (I)slot;                                            \
            if (positions) positions[slot] = (I)(i - offsets[bag]);                               \
            if (weights) out_weights[slot] = weights[i];                                          \
        }                                                                                         \
    }

BUCKETIZE_KERNELS(i64, i64)
BUCKETIZE_KERNELS(int, i32)
