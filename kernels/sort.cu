// Stable LSD radix sort of u64 keys by a range of their bits, 8 bits per pass (the TBE
// backward sorts (row << 24 | position) keys by their row bits; stability keeps each row's
// occurrences in position order). One pass over n keys:
//   radix_histogram: per tile of SORT_TILE keys, how many have each digit value;
//   radix_scan_digits: one block per digit scans that digit's tile counts (its first slot
//                    among the digit's keys, per tile) and writes the digit's total;
//   radix_scatter:   each tile scans the 256 digit totals (the digit's first output slot),
//                    sorts itself by the digit in shared memory (8 stable one-bit splits) and
//                    writes every key to its slot.
// Deterministic: no atomics decide an order (the histogram's atomics only count).

#define SORT_THREADS 256
#define SORT_ITEMS 4  // small tiles: more blocks in flight for the latency-bound splits
#define SORT_TILE (SORT_THREADS * SORT_ITEMS)
#define RADIX 256

// out[i] = in[0] + ... + in[i - 1] over m values, by one block of 1024 threads (each thread
// scans a contiguous chunk; the chunk sums are scanned across the block). `out` may be `in`.
template <class T>
__device__ __forceinline__ void block_scan_chunks(const T* in, T* out, i64 m, T* scratch) {
    i64 chunk = (m + blockDim.x - 1) / blockDim.x;
    i64 from = threadIdx.x * chunk;
    i64 to = from + chunk < m ? from + chunk : m;
    T sum = 0;
    for (i64 i = from; i < to; ++i) sum += in[i];
    T total;
    T running = block_exclusive_scan(sum, scratch, &total);
    for (i64 i = from; i < to; ++i) {
        T c = in[i];
        out[i] = running;
        running += c;
    }
}

// Exclusive scan of i64 values (one block of 1024 threads): bucketize's slot starts.
extern "C" __global__ void __launch_bounds__(1024) scan_exclusive_i64(const i64* in, i64* out, i64 m) {
    __shared__ i64 scratch[32];
    block_scan_chunks(in, out, m, scratch);
}

__device__ __forceinline__ int digit_of(unsigned long long key, int shift) {
    return (int)((key >> shift) & (RADIX - 1));
}

// counts[d * tiles + tile] = number of keys of `tile` whose digit at `shift` is d.
// Grid: one block of SORT_THREADS per tile.
extern "C" __global__ void __launch_bounds__(SORT_THREADS) radix_histogram(const unsigned long long* __restrict__ keys, i64 n,
                                           int shift, int* __restrict__ counts) {
    __shared__ int hist[RADIX];
    for (int d = threadIdx.x; d < RADIX; d += blockDim.x) hist[d] = 0;
    __syncthreads();
    i64 base = (i64)blockIdx.x * SORT_TILE;
    for (int k = 0; k < SORT_ITEMS; ++k) {
        i64 i = base + k * SORT_THREADS + threadIdx.x;
        if (i < n) atomicAdd(&hist[digit_of(keys[i], shift)], 1);
    }
    __syncthreads();
    for (int d = threadIdx.x; d < RADIX; d += blockDim.x) counts[(i64)d * gridDim.x + blockIdx.x] = hist[d];
}

// Block d (one per digit, RADIX blocks): the exclusive scan, in place, of digit d's counts
// over the `tiles` tiles, and the digit's total in digit_totals[d]. Coalesced, and RADIX
// blocks share the work that one block would do alone.
extern "C" __global__ void __launch_bounds__(SORT_THREADS) radix_scan_digits(int* __restrict__ counts, int tiles,
                                                                             int* __restrict__ digit_totals) {
    __shared__ int scratch[32];
    int* row = counts + (i64)blockIdx.x * tiles;
    int carry = 0;
    for (int base = 0; base < tiles; base += blockDim.x) {  // uniform: every thread scans
        int i = base + threadIdx.x;
        int v = i < tiles ? row[i] : 0;
        int total;
        int before = block_exclusive_scan(v, scratch, &total);
        if (i < tiles) row[i] = carry + before;
        carry += total;
    }
    if (threadIdx.x == 0) digit_totals[blockIdx.x] = carry;
}

// Writes every key of the tile to out[first slot of its digit + slots[digit * tiles + tile]
// + its rank among the tile's keys of that digit], ranks in input order (stable); the digits'
// first slots are the exclusive scan of digit_totals. Grid: one block of SORT_THREADS
// (= RADIX) per tile.
extern "C" __global__ void __launch_bounds__(SORT_THREADS) radix_scatter(const unsigned long long* __restrict__ keys_in,
                                         unsigned long long* __restrict__ keys_out, i64 n,
                                         int shift, const int* __restrict__ slots,
                                         const int* __restrict__ digit_totals) {
    static_assert(SORT_THREADS == RADIX, "one thread per digit scans the digit totals");
    __shared__ unsigned long long tile[SORT_TILE];
    __shared__ int scratch[32];
    __shared__ int start[RADIX];
    __shared__ int digit_first[RADIX];
    {
        int all;
        digit_first[threadIdx.x] = block_exclusive_scan(digit_totals[threadIdx.x], scratch, &all);
    }
    i64 base = (i64)blockIdx.x * SORT_TILE;
    int count = n - base < SORT_TILE ? (int)(n - base) : SORT_TILE;
    int first = threadIdx.x * SORT_ITEMS;  // this thread's items: first .. first + SORT_ITEMS
    unsigned long long key[SORT_ITEMS];
    // Past the end: digit RADIX - 1 and last in the tile, so they stay at its end.
    for (int k = 0; k < SORT_ITEMS; ++k)
        key[k] = first + k < count ? keys_in[base + first + k] : ~0ull;
    for (int bit = 0; bit < 8; ++bit) {
        int zeros = 0;
        for (int k = 0; k < SORT_ITEMS; ++k) zeros += !((key[k] >> (shift + bit)) & 1);
        int total_zeros;
        int zeros_before = block_exclusive_scan(zeros, scratch, &total_zeros);
        int ones_before = first - zeros_before;
        for (int k = 0; k < SORT_ITEMS; ++k) {
            if ((key[k] >> (shift + bit)) & 1)
                tile[total_zeros + ones_before++] = key[k];
            else
                tile[zeros_before++] = key[k];
        }
        __syncthreads();
        for (int k = 0; k < SORT_ITEMS; ++k) key[k] = tile[first + k];
        // The next split's scan synchronises before anyone writes the tile again.
    }
    for (int k = 0; k < SORT_ITEMS; ++k) {
        int j = first + k;
        if (j < count && (j == 0 || digit_of(tile[j - 1], shift) != digit_of(key[k], shift)))
            start[digit_of(key[k], shift)] = j;
    }
    __syncthreads();
    for (int k = 0; k < SORT_ITEMS; ++k) {
        int j = first + k;
        if (j >= count) continue;
        int d = digit_of(key[k], shift);
        keys_out[digit_first[d] + slots[(i64)d * gridDim.x + blockIdx.x] + (j - start[d])] = key[k];
    }
}
