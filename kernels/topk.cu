// Row-wise top-k selection: the `k` largest scores of every row of a [rows x cols] matrix
// (exact nearest-neighbour search: query x base products from cuBLAS), with their ids, best
// first; ties keep the smaller id (ids compared as unsigned, so the padding id -1 loses every
// tie), as the CPU's `retrieval::select::TopK` does. One block per row; scores are compared as
// order keys (floats mapped to unsigned integers that sort the same way, -0 below +0 as
// `f32::total_cmp`):
//   0. a lower bound of the k-th largest from a sample of the row (its first columns), and one
//      read of the row copying every key at or above the bound into shared memory, where the
//      selection finishes (steps 3-4) — unless more keys pass than shared memory holds; then
//   1. one read of the row: a histogram of the keys' top 11 bits (warp-aggregated shared
//      atomics: lanes with the same bin add once); a block-wide scan finds the bin holding the
//      k-th largest key;
//   2. a second read: keys above that bin are kept outright; the keys in it (usually few: the
//      k-th largest sits in the sparse tail) are copied into shared memory, where the
//      remaining 21 bits are selected (8 + 8 + 5 bit passes) without touching the row again.
//      When that bin holds more keys than shared memory takes (massive ties), the remaining
//      passes read the row instead;
//   3. if more keys tie with the k-th than are needed, the same selection over the tied keys'
//      ids (8 passes of 8 bits) finds which of them to keep;
//   4. the k kept entries are sorted in shared memory (bitonic, best first) and written.
// Deterministic: atomics only count, or hand out slots of entries that are sorted afterwards.

#define TOPK_THREADS 256
#define TOPK_MAX 1024
#define TOPK_TOP_BITS 11
#define TOPK_TOP_BINS (1 << TOPK_TOP_BITS)
#define TOPK_BINS 256
#define TOPK_CANDIDATES 3072
#define TOPK_MIN_SAMPLE 256
#define TOPK_UNROLL 8

typedef unsigned long long u64;

// Unsigned keys ordered as the floats are (total order: -0 below +0).
__device__ __forceinline__ unsigned topk_key(float x) {
    unsigned u = __float_as_uint(x);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__device__ __forceinline__ float topk_value(unsigned key) {
    return __uint_as_float((key & 0x80000000u) ? (key & 0x7fffffffu) : ~key);
}

// One row's scores and ids: column j's score is the product, or with `bias` (squared L2 as a
// score to maximise) alpha * product - bias[col_offset + j]; its id ids[r * ids_ld +
// col_offset + j], or col_offset + j without ids.
struct RowSource {
    const float* row;
    const float* bias;
    float alpha;
    const i64* ids;
    i64 ids_ld, col_offset, r, n;
    __device__ __forceinline__ unsigned key(i64 j) const {
        return topk_key(bias ? alpha * row[j] - bias[col_offset + j] : row[j]);
    }
    __device__ __forceinline__ u64 id(i64 j) const {
        return (u64)(ids ? ids[r * ids_ld + col_offset + j] : col_offset + j);
    }
};

// Candidates copied into shared memory: their keys and columns in the row.
struct SharedSource {
    const unsigned* keys;
    const unsigned* cols;
    RowSource row;
    i64 n;
    __device__ __forceinline__ unsigned key(i64 j) const { return keys[j]; }
    __device__ __forceinline__ u64 id(i64 j) const { return row.id(cols[j]); }
};

// Adds 1 to hist[bin] for every lane of the warp with `take` set, one atomic per distinct bin.
// Every lane of the warp must call it.
__device__ __forceinline__ void topk_count(unsigned* hist, unsigned bin, bool take) {
    unsigned b = take ? bin : 0xffffffffu;
    unsigned peers = __match_any_sync(0xffffffffu, b);
    if (take && (int)(threadIdx.x & 31) == __ffs(peers) - 1) atomicAdd(&hist[bin], (unsigned)__popc(peers));
}

// A slot of `*counter` for every lane of the warp with `take` set, one atomic per warp (the
// lanes' slots are consecutive, in lane order). Every lane of the warp must call it; lanes
// without `take` get an unspecified value.
__device__ __forceinline__ unsigned topk_claim(unsigned* counter, bool take) {
    unsigned lanes = __ballot_sync(0xffffffffu, take);
    int lane = threadIdx.x & 31;
    unsigned base = 0;
    if (lanes != 0 && lane == __ffs(lanes) - 1) base = atomicAdd(counter, (unsigned)__popc(lanes));
    base = __shfl_sync(0xffffffffu, base, lanes != 0 ? __ffs(lanes) - 1 : 0);
    return base + (unsigned)__popc(lanes & ((1u << lane) - 1u));
}

// The shared state of one row's selection.
struct TopkShared {
    unsigned scan[32];
    unsigned digit, need, count;  // find_digit's answer
    unsigned taken, tied_taken;
};

// Over `bins` counts (from the largest digit down, or from the smallest up), the digit where
// the running count reaches `need`: sets sh->digit, sh->need (how many of that digit's keys
// are still needed) and sh->count (that digit's count). Every thread must call it; the answer
// is read after it returns.
__device__ void topk_find_digit(const unsigned* hist, int bins, unsigned need, bool from_top, TopkShared* sh) {
    int per = bins / (int)blockDim.x;  // bins is a multiple of blockDim.x
    int first = threadIdx.x * per;
    unsigned local = 0;
    for (int i = first; i < first + per; ++i) local += hist[from_top ? bins - 1 - i : i];
    unsigned total;
    unsigned before = block_exclusive_scan(local, sh->scan, &total);
    if (before < need && need <= before + local) {
        unsigned passed = before;
        for (int i = first; i < first + per; ++i) {
            int d = from_top ? bins - 1 - i : i;
            if (passed + hist[d] >= need) {
                sh->digit = (unsigned)d;
                sh->need = need - passed;
                sh->count = hist[d];
                break;
            }
            passed += hist[d];
        }
    }
    __syncthreads();
}

// Refines the selection of the need-th largest key among `src`'s keys that match (prefix,
// mask), over the `rem` low bits still unknown (8 bits per pass): returns the key T, with
// *need the number of keys equal to T to keep and *ties how many there are.
template <class S>
__device__ unsigned topk_select_key(const S& src, unsigned prefix, unsigned mask, int rem, unsigned* need,
                                    unsigned* ties, unsigned* hist, TopkShared* sh) {
    const i64 span = (src.n + blockDim.x - 1) / blockDim.x * blockDim.x;
    while (rem > 0) {
        int width = rem < 8 ? rem : 8;
        int low = rem - width;
        for (int d = threadIdx.x; d < TOPK_BINS; d += blockDim.x) hist[d] = 0;
        __syncthreads();
        for (i64 j0 = 0; j0 < span; j0 += blockDim.x) {
            i64 j = j0 + threadIdx.x;
            unsigned key = j < src.n ? src.key(j) : 0u;
            topk_count(hist, (key >> low) & ((1u << width) - 1), j < src.n && (key & mask) == prefix);
        }
        __syncthreads();
        topk_find_digit(hist, TOPK_BINS, *need, true, sh);
        prefix |= sh->digit << low;
        mask |= ((1u << width) - 1) << low;
        *need = sh->need;
        *ties = sh->count;
        __syncthreads();
        rem = low;
    }
    return prefix;
}

// Among `src`'s keys equal to T, the need-th smallest id (unsigned): returns it, with *need
// set to how many entries of exactly that id to keep (ids repeat only as padding, -1).
template <class S>
__device__ u64 topk_select_id(const S& src, unsigned threshold, unsigned* need, unsigned* hist, TopkShared* sh) {
    const i64 span = (src.n + blockDim.x - 1) / blockDim.x * blockDim.x;
    u64 prefix = 0, mask = 0;
    for (int low = 56; low >= 0; low -= 8) {
        for (int d = threadIdx.x; d < TOPK_BINS; d += blockDim.x) hist[d] = 0;
        __syncthreads();
        for (i64 j0 = 0; j0 < span; j0 += blockDim.x) {
            i64 j = j0 + threadIdx.x;
            bool tied = j < src.n && src.key(j) == threshold;
            u64 id = tied ? src.id(j) : 0ull;
            topk_count(hist, (unsigned)((id >> low) & 255u), tied && (id & mask) == prefix);
        }
        __syncthreads();
        topk_find_digit(hist, TOPK_BINS, *need, false, sh);
        prefix |= (u64)sh->digit << low;
        mask |= 255ull << low;
        *need = sh->need;
        __syncthreads();
    }
    return prefix;
}

// Appends to top_* every entry of `src` above T, and of those equal to T the ones kept: all
// of them, or (choose_ties) those with ids below id_t and id_need of those with id id_t.
template <class S>
__device__ void topk_gather(const S& src, unsigned threshold, bool choose_ties, u64 id_t, unsigned id_need,
                            unsigned* top_key, u64* top_id, TopkShared* sh) {
    for (i64 j = threadIdx.x; j < src.n; j += blockDim.x) {
        unsigned key = src.key(j);
        bool keep = key > threshold;
        if (key == threshold) {
            if (!choose_ties) {
                keep = true;
            } else {
                u64 id = src.id(j);
                keep = id < id_t || (id == id_t && atomicAdd(&sh->tied_taken, 1u) < id_need);
            }
        }
        if (keep) {
            unsigned slot = atomicAdd(&sh->taken, 1u);
            top_key[slot] = key;
            top_id[slot] = src.id(j);
        }
    }
}

// Selects, among the keys of `src` matching (prefix, mask) with `rem` bits unknown, the `need`
// best (ties to the smaller id) and appends them to top_*.
template <class S>
__device__ void topk_finish(const S& src, unsigned prefix, unsigned mask, int rem, unsigned need, unsigned* hist,
                            unsigned* top_key, u64* top_id, TopkShared* sh) {
    unsigned ties = 0;
    unsigned threshold = topk_select_key(src, prefix, mask, rem, &need, &ties, hist, sh);
    bool choose_ties = ties > need;
    u64 id_t = 0;
    unsigned id_need = need;
    if (choose_ties) id_t = topk_select_id(src, threshold, &id_need, hist, sh);
    topk_gather(src, threshold, choose_ties, id_t, id_need, top_key, top_id, sh);
}

// Loads the keys of columns j0 + u * blockDim.x + threadIdx.x (u < TOPK_UNROLL) of `row`, 0
// past `n`: TOPK_UNROLL loads in flight per thread (the row loops are latency-bound otherwise).
__device__ __forceinline__ void topk_load(const RowSource& row, i64 j0, i64 n, unsigned* keys) {
#pragma unroll
    for (int u = 0; u < TOPK_UNROLL; ++u) {
        i64 j = j0 + u * blockDim.x + threadIdx.x;
        keys[u] = j < n ? row.key(j) : 0u;
    }
}

// hist (TOPK_TOP_BINS) = counts of the top TOPK_TOP_BITS bits of the keys of the row's first
// `n` columns. Every thread must call it (whole steps: every lane takes part in the warp
// collectives).
__device__ void topk_top_histogram(const RowSource& row, i64 n, unsigned* hist) {
    const int low = 32 - TOPK_TOP_BITS;
    const i64 step = (i64)TOPK_UNROLL * blockDim.x;
    for (int d = threadIdx.x; d < TOPK_TOP_BINS; d += blockDim.x) hist[d] = 0;
    __syncthreads();
    for (i64 j0 = 0; j0 < n; j0 += step) {
        unsigned keys[TOPK_UNROLL];
        topk_load(row, j0, n, keys);
#pragma unroll
        for (int u = 0; u < TOPK_UNROLL; ++u) {
            i64 j = j0 + u * blockDim.x + threadIdx.x;
            topk_count(hist, keys[u] >> low, j < n);
        }
    }
    __syncthreads();
}

// out_scores / out_ids rows (stride out_ld, from column out_col) get row r's min(k, cols)
// best, best first, then (-inf, -1) up to k. scores: [rows x cols], row stride ld; bias: null
// or indexed from col_offset; ids: null (ids are col_offset + j) or rows of stride ids_ld
// (0: one id row for all rows) indexed from col_offset.
// Grid: one block of TOPK_THREADS per row; 1 <= k <= TOPK_MAX.
extern "C" __global__ void __launch_bounds__(TOPK_THREADS) topk_rows_f32(
    const float* __restrict__ scores, i64 ld, i64 cols, const float* __restrict__ bias, float alpha,
    const i64* __restrict__ ids, i64 ids_ld, i64 col_offset, int k, float* __restrict__ out_scores,
    i64* __restrict__ out_ids, i64 out_ld, i64 out_col) {
    __shared__ unsigned hist[TOPK_TOP_BINS];
    __shared__ TopkShared sh;
    __shared__ unsigned cand_key[TOPK_CANDIDATES];
    __shared__ unsigned cand_col[TOPK_CANDIDATES];
    __shared__ unsigned n_cand;
    __shared__ unsigned top_key[TOPK_MAX];
    __shared__ u64 top_id[TOPK_MAX];
    const int tid = threadIdx.x;
    RowSource row{scores + (i64)blockIdx.x * ld, bias, alpha, ids, ids_ld, col_offset, (i64)blockIdx.x, cols};
    const int want = cols < (i64)k ? (int)cols : k;
    if (tid == 0) {
        sh.taken = 0;
        sh.tied_taken = 0;
    }
    const int low = 32 - TOPK_TOP_BITS;
    // Row loops go in whole steps of TOPK_UNROLL loads per thread (topk_load).
    const i64 step = (i64)TOPK_UNROLL * blockDim.x;
    bool done = want == 0;
    // 0. A lower bound of the want-th largest key from a sample (the first columns): the
    // lower edge of the top-11-bit bin holding the sample's want-th largest. One read of the
    // row then copies every key at or above it to shared memory (expected: about
    // want * cols / sample of them), where the selection finishes. Skipped when the sample
    // would be half the row; abandoned when the bound lets through more than shared memory
    // holds.
    // The bound passes about want * cols / sample keys, times the looseness of a bin's lower
    // edge and of a small sample's estimate: an eighth of the row at least, and enough that
    // the expectation stays well inside shared memory.
    i64 sample = 8 * (i64)want * cols / TOPK_CANDIDATES;
    sample = sample > cols / 8 ? sample : cols / 8;
    sample = sample > TOPK_MIN_SAMPLE ? sample : TOPK_MIN_SAMPLE;
    if (!done && 2 * sample <= cols) {
        if (tid == 0) n_cand = 0;
        topk_top_histogram(row, sample, hist);
        topk_find_digit(hist, TOPK_TOP_BINS, (unsigned)want, true, &sh);
        const unsigned bound = sh.digit << low;
        for (i64 j0 = 0; j0 < cols; j0 += step) {
            unsigned keys[TOPK_UNROLL];
            topk_load(row, j0, cols, keys);
#pragma unroll
            for (int u = 0; u < TOPK_UNROLL; ++u) {
                i64 j = j0 + u * blockDim.x + tid;
                bool take = j < cols && keys[u] >= bound;
                unsigned slot = topk_claim(&n_cand, take);
                if (take && slot < TOPK_CANDIDATES) {
                    cand_key[slot] = keys[u];
                    cand_col[slot] = (unsigned)j;
                }
            }
        }
        __syncthreads();
        const unsigned found = n_cand;
        if (found <= TOPK_CANDIDATES) {
            // Every key of the want best is at or above the bound: select among the copies.
            SharedSource cand{cand_key, cand_col, row, (i64)found};
            topk_finish(cand, 0u, 0u, 32, (unsigned)want, hist, top_key, top_id, &sh);
            done = true;
        }
        __syncthreads();
    }
    if (!done) {
        // 1. The bin of the top 11 bits holding the want-th largest key.
        topk_top_histogram(row, cols, hist);
        topk_find_digit(hist, TOPK_TOP_BINS, (unsigned)want, true, &sh);
        const unsigned bin = sh.digit, need = sh.need, in_bin = sh.count;
        const unsigned prefix = bin << low, mask = ~0u << low;
        __syncthreads();
        if (in_bin <= TOPK_CANDIDATES) {
            // 2. Keys above the bin are kept; the bin's keys move to shared memory.
            if (tid == 0) n_cand = 0;
            __syncthreads();
            for (i64 j0 = 0; j0 < cols; j0 += step) {
                unsigned keys[TOPK_UNROLL];
                topk_load(row, j0, cols, keys);
#pragma unroll
                for (int u = 0; u < TOPK_UNROLL; ++u) {
                    i64 j = j0 + u * blockDim.x + tid;
                    unsigned b = keys[u] >> low;
                    if (j >= cols || b < bin) continue;
                    if (b > bin) {
                        unsigned slot = atomicAdd(&sh.taken, 1u);
                        top_key[slot] = keys[u];
                        top_id[slot] = row.id(j);
                    } else {
                        unsigned slot = atomicAdd(&n_cand, 1u);
                        cand_key[slot] = keys[u];
                        cand_col[slot] = (unsigned)j;
                    }
                }
            }
            __syncthreads();
            SharedSource cand{cand_key, cand_col, row, (i64)in_bin};
            topk_finish(cand, prefix, mask, low, need, hist, top_key, top_id, &sh);
        } else {
            // The bin is too full for shared memory: refine over the row itself.
            topk_finish(row, prefix, mask, low, need, hist, top_key, top_id, &sh);
        }
    }
    __syncthreads();

    // 4. Sort the kept entries, best first.
    int n2 = 1;
    while (n2 < want) n2 <<= 1;
    for (int i = want + tid; i < n2; i += blockDim.x) {
        top_key[i] = 0u;  // below every real key: sorts last
        top_id[i] = ~0ull;
    }
    __syncthreads();
    for (int size = 2; size <= n2; size <<= 1) {
        for (int stride = size >> 1; stride > 0; stride >>= 1) {
            for (int i = tid; i < n2; i += blockDim.x) {
                int j = i ^ stride;
                if (j > i) {
                    bool ascending = (i & size) == 0;  // "ascending": best first
                    bool j_first = top_key[j] > top_key[i] || (top_key[j] == top_key[i] && top_id[j] < top_id[i]);
                    if (ascending == j_first) {
                        unsigned tk = top_key[i];
                        top_key[i] = top_key[j];
                        top_key[j] = tk;
                        u64 ti = top_id[i];
                        top_id[i] = top_id[j];
                        top_id[j] = ti;
                    }
                }
            }
            __syncthreads();
        }
    }
    for (int i = tid; i < k; i += blockDim.x) {
        bool real = i < want;
        out_scores[(i64)blockIdx.x * out_ld + out_col + i] = real ? topk_value(top_key[i]) : __uint_as_float(0xff800000u);  // -inf
        out_ids[(i64)blockIdx.x * out_ld + out_col + i] = real ? (i64)top_id[i] : (i64)-1;
    }
}
