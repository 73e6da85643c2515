// The directory of a GPU cache on the GPU (src/embedding/tbe/cache/device_directory.rs): the
// same set-associative directory as the host's (src/embedding/tbe/cache/directory.rs) and the
// same admission decisions, made by kernels over every table's slots at once.
//
// Slots are numbered across tables: table t's slots are set_base[t]·32 .. (set_base[t] +
// sets[t])·32, and slot = set·32 + way. A row's set is MurmurHash3's 64-bit finaliser of its
// id modulo the table's sets (FBGEMM's cache_slot). Rows are numbered across tables too:
// g = row_base[t] + row (row_base has one entry per table and the total at the end).
//
// One admission (tick `tick`), in order:
//   cache_dir_find:    each id looks its row up; a hit's slot is locked at its row's first
//                      occurrence (the one thread that swaps the slot's stamp to `tick`) and
//                      the id becomes its cache row; a miss appends the key (g << pbits | p).
//   radix sort of the miss keys by g (a row's ids in any order: they all get its cache row).
//   cache_dir_heads:   each distinct missed row (the first key of its run) writes
//                      (set << 32 | its index); the others write the sentinel.
//   radix sort of those by set (stable: within a set, row order).
//   cache_dir_install: one thread per set takes its distinct missed rows in row order, each
//                      the first empty way, else the unlocked way its policy likes least (LRU:
//                      oldest stamp; LFU: fewest accesses, then oldest stamp; ties to the
//                      lowest way) — installed, locked, its move (dirty victim, new row)
//                      listed — or, when every way is locked, a scratch row of its table.
//   cache_dir_place:   each missed id becomes its row's cache row.
//   cache_dir_moves:   (rows in mapped host memory) the moves, made by the GPU
//                      (cache_dir_moves_bytes for a byte-form inference cache).
// Sets are independent and each set's misses are taken in row order, so the decisions are the
// host directory's, which takes all misses in row order.
//
// `counters` (u64): [0] slots locked, [1] moves, [2] direct reads, [3] missed ids, then per
// table t, at 4 + 5t: hits locked, rows installed, direct reads, evictions, dirty rows written
// back.

#define EMPTY_ROW 0xffffffffffffffffull
#define WAYS 32

__device__ __forceinline__ unsigned long long fmix64(unsigned long long h) {
    h ^= h >> 33;
    h *= 0xff51afd7ed558ccdull;
    h ^= h >> 33;
    h *= 0xc4ceb9fe1a85ec53ull;
    return h ^ (h >> 33);
}

// The table of global row g (row_base: tables + 1 ascending entries).
__device__ __forceinline__ int table_of_row(const i64* row_base, int tables, i64 g) {
    int lo = 0, hi = tables - 1;
    while (lo < hi) {
        int mid = (lo + hi + 1) / 2;
        if (row_base[mid] <= g) lo = mid; else hi = mid - 1;
    }
    return lo;
}

// One saturating access count (LFU); one thread per row and admission touches it.
__device__ __forceinline__ void count_access(unsigned* counts, i64 g) {
    if (counts[g] != 0xffffffffu) counts[g] += 1u;
}

// One warp per bag (grid-stride), its lanes over the bag's ids.
extern "C" __global__ void cache_dir_find(
    const i64* __restrict__ offsets, i64* ids, i64 bags, i64 batch_size,
    const i64* __restrict__ feature_table, const i64* __restrict__ sets,
    const i64* __restrict__ set_base, const i64* __restrict__ row_base,
    const unsigned long long* __restrict__ tags, unsigned long long* stamp, unsigned* locks,
    unsigned* counts, int lfu, unsigned long long tick, unsigned long long* miss_keys, int pbits,
    i64* locked, unsigned long long* counters) {
    i64 warps = (i64)gridDim.x * blockDim.y;
    for (i64 bag = (i64)blockIdx.x * blockDim.y + threadIdx.y; bag < bags; bag += warps) {
        i64 t = feature_table[bag / batch_size];
        i64 n_sets = sets[t];
        i64 first_set = set_base[t];
        for (i64 p = offsets[bag] + threadIdx.x; p < offsets[bag + 1]; p += 32) {
            unsigned long long row = (unsigned long long)ids[p];
            i64 set = (i64)(fmix64(row) % (unsigned long long)n_sets);
            i64 base = (first_set + set) * WAYS;
            int way = -1;
            for (int w = 0; w < WAYS; ++w) {
                if (tags[base + w] == row) { way = w; break; }
            }
            if (way < 0) {
                miss_keys[atomicAdd(&counters[3], 1ull)] =
                    ((unsigned long long)(row_base[t] + (i64)row) << pbits) |
                    (unsigned long long)p;
                continue;
            }
            i64 slot = base + way;
            ids[p] = set * WAYS + way;
            if (atomicExch(&stamp[slot], tick) != tick) {
                if (lfu) count_access(counts, row_base[t] + (i64)row);
                atomicAdd(&locks[slot], 1u);
                locked[atomicAdd(&counters[0], 1ull)] = slot;
                atomicAdd(&counters[4 + 5 * t], 1ull);
            }
        }
    }
}

// keys2[i] = set << 32 | i for the first key of each missed row's run, else sentinel2.
extern "C" __global__ void cache_dir_heads(
    const unsigned long long* __restrict__ keys, i64 n, int pbits,
    const i64* __restrict__ row_base, int tables, const i64* __restrict__ sets,
    const i64* __restrict__ set_base, unsigned long long* __restrict__ keys2,
    unsigned long long sentinel2) {
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (i64)gridDim.x * blockDim.x) {
        unsigned long long k = keys[i];
        i64 g = (i64)(k >> pbits);
        bool head = i == 0 || (i64)(keys[i - 1] >> pbits) != g;
        if (!head) {
            keys2[i] = sentinel2;
            continue;
        }
        int t = table_of_row(row_base, tables, g);
        unsigned long long row = (unsigned long long)(g - row_base[t]);
        i64 set = set_base[t] + (i64)(fmix64(row) % (unsigned long long)sets[t]);
        keys2[i] = ((unsigned long long)set << 32) | (unsigned long long)i;
    }
}

// One thread per set with misses (the first entry of its run in keys2).
extern "C" __global__ void cache_dir_install(
    const unsigned long long* __restrict__ keys2, i64 n, unsigned long long sentinel2,
    const unsigned long long* __restrict__ keys, int pbits, const i64* __restrict__ row_base,
    int tables, const i64* __restrict__ sets, const i64* __restrict__ set_base,
    unsigned long long* tags, unsigned long long* stamp, unsigned* locks, unsigned* dirty,
    unsigned* counts, int lfu, unsigned long long tick, i64* __restrict__ head_slot,
    i64* __restrict__ locked, i64* __restrict__ moves, i64* __restrict__ direct,
    unsigned* scratch_next, unsigned long long* counters) {
    for (i64 j = (i64)blockIdx.x * blockDim.x + threadIdx.x; j < n;
         j += (i64)gridDim.x * blockDim.x) {
        unsigned long long k2 = keys2[j];
        if (k2 >= sentinel2) continue;
        unsigned long long set = k2 >> 32;
        if (j > 0 && (keys2[j - 1] >> 32) == set) continue;
        i64 base = (i64)set * WAYS;
        for (i64 jj = j; jj < n && keys2[jj] < sentinel2 && (keys2[jj] >> 32) == set; ++jj) {
            i64 i = (i64)(keys2[jj] & 0xffffffffull);
            i64 g = (i64)(keys[i] >> pbits);
            int t = table_of_row(row_base, tables, g);
            i64 row = g - row_base[t];
            if (lfu) count_access(counts, g);
            int victim = -1;
            for (int w = 0; w < WAYS; ++w) {
                if (tags[base + w] == EMPTY_ROW) { victim = w; break; }
            }
            if (victim < 0) {
                unsigned long long best_count = 0, best_stamp = 0;
                for (int w = 0; w < WAYS; ++w) {
                    i64 s = base + w;
                    if (locks[s] != 0) continue;
                    unsigned long long c =
                        lfu ? counts[row_base[t] + (i64)tags[s]] : 0ull;
                    unsigned long long st = stamp[s];
                    if (victim < 0 || c < best_count || (c == best_count && st < best_stamp)) {
                        victim = w;
                        best_count = c;
                        best_stamp = st;
                    }
                }
            }
            if (victim < 0) {
                // Every way locked: a direct read through a scratch row after the slots.
                i64 pos = sets[t] * WAYS + (i64)atomicAdd(&scratch_next[t], 1u);
                i64 d = (i64)atomicAdd(&counters[2], 1ull);
                direct[3 * d] = t;
                direct[3 * d + 1] = row;
                direct[3 * d + 2] = pos;
                head_slot[i] = pos;
                atomicAdd(&counters[4 + 5 * t + 2], 1ull);
                continue;
            }
            i64 s = base + victim;
            unsigned long long old = tags[s];
            i64 written = -1;
            if (old != EMPTY_ROW) {
                atomicAdd(&counters[4 + 5 * t + 3], 1ull);
                if (dirty[s]) {
                    written = (i64)old;
                    atomicAdd(&counters[4 + 5 * t + 4], 1ull);
                }
            }
            i64 local = s - set_base[t] * WAYS;
            i64 m = (i64)atomicAdd(&counters[1], 1ull);
            moves[4 * m] = t;
            moves[4 * m + 1] = local;
            moves[4 * m + 2] = written;
            moves[4 * m + 3] = row;
            tags[s] = (unsigned long long)row;
            dirty[s] = 0u;
            stamp[s] = tick;
            locks[s] += 1u;
            locked[atomicAdd(&counters[0], 1ull)] = s;
            atomicAdd(&counters[4 + 5 * t + 1], 1ull);
            head_slot[i] = local;
        }
    }
}

// Every missed id (its key's position) takes its row's cache row: one thread per run.
extern "C" __global__ void cache_dir_place(const unsigned long long* __restrict__ keys, i64 n,
                                           int pbits, const i64* __restrict__ head_slot,
                                           i64* ids) {
    unsigned long long pmask = (1ull << pbits) - 1ull;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (i64)gridDim.x * blockDim.x) {
        unsigned long long k = keys[i];
        unsigned long long g = k >> pbits;
        if (i > 0 && (keys[i - 1] >> pbits) == g) continue;
        i64 slot = head_slot[i];
        for (i64 j = i; j < n && (keys[j] >> pbits) == g; ++j) ids[keys[j] & pmask] = slot;
    }
}

// One lock of each slot in `slots` released (each slot at most once in the list).
extern "C" __global__ void cache_dir_unlock(const i64* __restrict__ slots, i64 n,
                                            unsigned* locks) {
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (i64)gridDim.x * blockDim.x) {
        i64 s = slots[i];
        if (locks[s] != 0u) locks[s] -= 1u;
    }
}

// Each slot in `slots` marked as differing from the store.
extern "C" __global__ void cache_dir_mark_dirty(const i64* __restrict__ slots, i64 n,
                                                unsigned* dirty) {
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (i64)gridDim.x * blockDim.x) {
        dirty[slots[i]] = 1u;
    }
}

// `len` floats from `src` to `dst` by one warp. (Eight loads in flight per lane before the
// stores measured no faster on an H200: the moves are bound by the PCIe traffic.)
__device__ __forceinline__ void warp_copy(float* dst, const float* src, i64 len) {
    for (i64 j = threadIdx.x; j < len; j += 32) dst[j] = src[j];
}

// An admission's row moves between the cache rows and the rows in mapped host memory (rows in
// host memory that the GPU reads and writes in place): one warp per move, `counters[1]` of
// them. The dirty victim's record (if any) is written back to its row, then the new row's
// record is read into the slot. A record in host memory is weights, state 0, state 1 back to
// back, at host_first[t] + row · record floats; in the cache buffers, part k of table t
// starts at part_start[3t + k] and has part_len[3t + k] floats per cache row.
extern "C" __global__ void cache_dir_moves(const i64* __restrict__ moves,
                                           const unsigned long long* __restrict__ counters,
                                           float* w, float* s0, float* s1, float* host,
                                           const i64* __restrict__ host_first,
                                           const i64* __restrict__ part_start,
                                           const i64* __restrict__ part_len) {
    i64 n = (i64)counters[1];
    i64 warps = (i64)gridDim.x * blockDim.y;
    for (i64 m = (i64)blockIdx.x * blockDim.y + threadIdx.y; m < n; m += warps) {
        i64 t = moves[4 * m], slot = moves[4 * m + 1], old = moves[4 * m + 2];
        i64 row = moves[4 * m + 3];
        float* parts[3] = {w, s0, s1};
        i64 record = part_len[3 * t] + part_len[3 * t + 1] + part_len[3 * t + 2];
        if (old >= 0) {
            float* dst = host + host_first[t] + old * record;
            for (int k = 0; k < 3; ++k) {
                i64 len = part_len[3 * t + k];
                warp_copy(dst, parts[k] + part_start[3 * t + k] + slot * len, len);
                dst += len;
            }
        }
        // The victim's values are read (above) before the slot is overwritten: each lane
        // copies the same elements both ways.
        const float* src = host + host_first[t] + row * record;
        for (int k = 0; k < 3; ++k) {
            i64 len = part_len[3 * t + k];
            warp_copy(parts[k] + part_start[3 * t + k] + slot * len, src, len);
            src += len;
        }
    }
}

// `len` bytes from `src` to `dst` by one warp, a word per lane when both ends and the length
// allow it.
__device__ __forceinline__ void warp_copy_bytes(u8* dst, const u8* src,
                                                i64 len) {
    if ((((unsigned long long)dst | (unsigned long long)src | (unsigned long long)len) & 3ull) ==
        0ull) {
        unsigned* d = (unsigned*)dst;
        const unsigned* s = (const unsigned*)src;
        for (i64 j = threadIdx.x; j < len / 4; j += 32) d[j] = s[j];
    } else {
        for (i64 j = threadIdx.x; j < len; j += 32) dst[j] = src[j];
    }
}

// A byte-form (inference) cache's moves over rows in mapped host memory: one warp per move,
// `counters[1]` of them, each new row's row_bytes[t] bytes read from host_first[t] + row ·
// row_bytes[t] into its cache row at cache_first[t] + slot · row_bytes[t]. Cached rows never
// differ from the store's, so no victim is written back.
extern "C" __global__ void cache_dir_moves_bytes(const i64* __restrict__ moves,
                                                 const unsigned long long* __restrict__ counters,
                                                 u8* cache,
                                                 const u8* __restrict__ host,
                                                 const i64* __restrict__ host_first,
                                                 const i64* __restrict__ cache_first,
                                                 const i64* __restrict__ row_bytes) {
    i64 n = (i64)counters[1];
    i64 warps = (i64)gridDim.x * blockDim.y;
    for (i64 m = (i64)blockIdx.x * blockDim.y + threadIdx.y; m < n; m += warps) {
        i64 t = moves[4 * m], slot = moves[4 * m + 1], row = moves[4 * m + 3];
        i64 rb = row_bytes[t];
        warp_copy_bytes(cache + cache_first[t] + slot * rb, host + host_first[t] + row * rb, rb);
    }
}

// Rows staged in `src` (row i: len[i] bytes at src_off[i]) copied to dst_off[i] in `dst`: one
// warp per row.
extern "C" __global__ void cache_bytes_scatter(const u8* __restrict__ src,
                                               const i64* __restrict__ src_off,
                                               u8* dst,
                                               const i64* __restrict__ dst_off,
                                               const i64* __restrict__ len, i64 n) {
    i64 warps = (i64)gridDim.x * blockDim.y;
    for (i64 i = (i64)blockIdx.x * blockDim.y + threadIdx.y; i < n; i += warps) {
        warp_copy_bytes(dst + dst_off[i], src + src_off[i], len[i]);
    }
}

// out[i] = the cache row (slot of its table) holding row rows[i] of table tables[i], or -1.
extern "C" __global__ void cache_dir_lookup(const i64* __restrict__ tables,
                                            const i64* __restrict__ rows, i64 n,
                                            const i64* __restrict__ sets,
                                            const i64* __restrict__ set_base,
                                            const unsigned long long* __restrict__ tags,
                                            i64* __restrict__ out) {
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (i64)gridDim.x * blockDim.x) {
        i64 t = tables[i];
        unsigned long long row = (unsigned long long)rows[i];
        i64 set = (i64)(fmix64(row) % (unsigned long long)sets[t]);
        i64 base = (set_base[t] + set) * WAYS;
        i64 found = -1;
        for (int w = 0; w < WAYS; ++w) {
            if (tags[base + w] == row) { found = set * WAYS + w; break; }
        }
        out[i] = found;
    }
}
