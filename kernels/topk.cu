// Row-wise top-k selection: the `k` largest scores of every row of a [rows x cols] matrix
// (exact nearest-neighbour search: query x base products from cuBLAS), with their ids, best
// first; ties keep the smaller id (ids compared as unsigned, so the padding id -1 loses every
// tie), as the CPU's `retrieval::select::TopK` does. One block per row:
//   1. radix selection of the k-th largest score: 4 passes of 8 bits over the scores' order
//      keys (floats mapped to unsigned integers that sort the same way, -0 below +0 as
//      `f32::total_cmp`), each pass a 256-bin histogram of the keys that share the digits found
//      so far (warp-aggregated atomics: lanes with the same bin add once);
//   2. if more scores tie with the k-th than are needed, the same selection over the tied
//      scores' ids (8 passes of 8 bits) finds which of them to keep;
//   3. the k kept entries are gathered into shared memory and sorted (bitonic, best first).
// Every pass reads the row again (coalesced); deterministic (atomics only count or hand out
// slots of entries that are sorted afterwards).

#define TOPK_THREADS 256
#define TOPK_MAX 1024
#define TOPK_RADIX 256

// Unsigned keys ordered as the floats are (total order: -0 below +0).
__device__ __forceinline__ unsigned topk_key(float x) {
    unsigned u = __float_as_uint(x);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__device__ __forceinline__ float topk_value(unsigned key) {
    return __uint_as_float((key & 0x80000000u) ? (key & 0x7fffffffu) : ~key);
}

// Column j's score in a row: the product, or with `bias` (squared L2 as a score to maximise)
// alpha * product - bias[col_offset + j].
__device__ __forceinline__ float topk_score(const float* row, const float* bias, float alpha, i64 col_offset, i64 j) {
    return bias ? alpha * row[j] - bias[col_offset + j] : row[j];
}

// Column j's id (unsigned) in row r: ids[r * ids_ld + col_offset + j], or col_offset + j.
__device__ __forceinline__ unsigned long long topk_id(const i64* ids, i64 ids_ld, i64 col_offset, i64 r, i64 j) {
    return (unsigned long long)(ids ? ids[r * ids_ld + col_offset + j] : col_offset + j);
}

// Adds 1 to hist[bin] for every lane of the warp with `take` set, one atomic per distinct bin.
// Every lane of the warp must call it.
__device__ __forceinline__ void topk_count(unsigned* hist, unsigned bin, bool take) {
    unsigned b = take ? bin : 0xffffffffu;
    unsigned peers = __match_any_sync(0xffffffffu, b);
    int lane = threadIdx.x & 31;
    if (take && lane == __ffs(peers) - 1) atomicAdd(&hist[bin], (unsigned)__popc(peers));
}

// Thread 0's walk over the histogram: from the top digit down (largest first) or from the
// bottom up, the digit where the running count reaches *need; subtracts the counts passed.
__device__ __forceinline__ int topk_pick_digit(const unsigned* hist, unsigned* need, bool from_top) {
    unsigned passed = 0;
    for (int i = 0; i < TOPK_RADIX - 1; ++i) {
        int d = from_top ? TOPK_RADIX - 1 - i : i;
        if (passed + hist[d] >= *need) {
            *need -= passed;
            return d;
        }
        passed += hist[d];
    }
    *need -= passed;
    return from_top ? 0 : TOPK_RADIX - 1;
}

// `a` ranks before `b`: a larger key, or the same key and a smaller id.
__device__ __forceinline__ bool topk_before(unsigned ka, unsigned long long ia, unsigned kb, unsigned long long ib) {
    return ka > kb || (ka == kb && ia < ib);
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
    __shared__ unsigned hist[TOPK_RADIX];
    __shared__ unsigned s_prefix, s_need, s_ties;
    __shared__ unsigned long long s_id_prefix;
    __shared__ unsigned s_taken, s_tied_taken;
    __shared__ unsigned top_key[TOPK_MAX];
    __shared__ unsigned long long top_id[TOPK_MAX];
    const i64 r = blockIdx.x;
    const float* row = scores + r * ld;
    const int want = cols < (i64)k ? (int)cols : k;
    const int tid = threadIdx.x;
    // Loops step over whole blocks so every lane of a warp takes part in the warp collectives.
    const i64 span = (cols + blockDim.x - 1) / blockDim.x * blockDim.x;

    // 1. The want-th largest key T, and how many of the keys equal to T to keep.
    unsigned prefix = 0, mask = 0, need = (unsigned)want;
    for (int shift = 24; shift >= 0 && want > 0; shift -= 8) {
        for (int d = tid; d < TOPK_RADIX; d += blockDim.x) hist[d] = 0;
        __syncthreads();
        for (i64 j0 = 0; j0 < span; j0 += blockDim.x) {
            i64 j = j0 + tid;
            unsigned key = j < cols ? topk_key(topk_score(row, bias, alpha, col_offset, j)) : 0u;
            topk_count(hist, (key >> shift) & 255u, j < cols && (key & mask) == prefix);
        }
        __syncthreads();
        if (tid == 0) {
            unsigned n = need;
            int d = topk_pick_digit(hist, &n, true);
            s_prefix = prefix | ((unsigned)d << shift);
            s_need = n;
            s_ties = hist[d];  // after the last pass: how many keys equal T
        }
        __syncthreads();
        prefix = s_prefix;
        need = s_need;
        mask |= 255u << shift;
    }
    const unsigned threshold = prefix;
    const bool choose_ties = want > 0 && s_ties > need;

    // 2. Among the keys equal to T, the need-th smallest id (unsigned): keep the tied entries
    // with smaller ids, and `need` minus those of the ones with exactly that id.
    unsigned long long id_prefix = 0, id_mask = 0;
    unsigned id_need = need;
    if (choose_ties) {
        for (int shift = 56; shift >= 0; shift -= 8) {
            for (int d = tid; d < TOPK_RADIX; d += blockDim.x) hist[d] = 0;
            __syncthreads();
            for (i64 j0 = 0; j0 < span; j0 += blockDim.x) {
                i64 j = j0 + tid;
                bool tied = j < cols && topk_key(topk_score(row, bias, alpha, col_offset, j)) == threshold;
                unsigned long long id = tied ? topk_id(ids, ids_ld, col_offset, r, j) : 0ull;
                topk_count(hist, (unsigned)((id >> shift) & 255u), tied && (id & id_mask) == id_prefix);
            }
            __syncthreads();
            if (tid == 0) {
                unsigned n = id_need;
                int d = topk_pick_digit(hist, &n, false);
                s_id_prefix = id_prefix | ((unsigned long long)d << shift);
                s_need = n;
            }
            __syncthreads();
            id_prefix = s_id_prefix;
            id_need = s_need;
            id_mask |= 255ull << shift;
        }
    }

    // 3. Gather the kept entries and sort them, best first.
    if (tid == 0) {
        s_taken = 0;
        s_tied_taken = 0;
    }
    __syncthreads();
    for (i64 j = tid; j < cols && want > 0; j += blockDim.x) {
        unsigned key = topk_key(topk_score(row, bias, alpha, col_offset, j));
        bool keep = key > threshold;
        if (key == threshold) {
            if (!choose_ties) {
                keep = true;
            } else {
                unsigned long long id = topk_id(ids, ids_ld, col_offset, r, j);
                keep = id < id_prefix || (id == id_prefix && atomicAdd(&s_tied_taken, 1u) < id_need);
            }
        }
        if (keep) {
            unsigned slot = atomicAdd(&s_taken, 1u);
            top_key[slot] = key;
            top_id[slot] = topk_id(ids, ids_ld, col_offset, r, j);
        }
    }
    __syncthreads();
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
                    bool j_first = topk_before(top_key[j], top_id[j], top_key[i], top_id[i]);
                    if (ascending == j_first) {
                        unsigned tk = top_key[i];
                        top_key[i] = top_key[j];
                        top_key[j] = tk;
                        unsigned long long ti = top_id[i];
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
        out_scores[r * out_ld + out_col + i] = real ? topk_value(top_key[i]) : __uint_as_float(0xff800000u);  // -inf
        out_ids[r * out_ld + out_col + i] = real ? (i64)top_id[i] : (i64)-1;
    }
}
