//! The caching allocator's policy over a fake device (no GPU needed): rounding, pools,
//! reuse without raw calls, splitting and merging, per-stream pools, out-of-memory retry,
//! and random alloc/free sequences checked for overlaps and exact byte accounting.

use std::collections::BTreeMap;

use embers::cuda::allocator::{Block, CachingAllocator, RawAllocator};
use embers::Device;
use proptest::prelude::*;

/// Hands out increasing addresses (with a gap after each segment) within a byte budget and
/// remembers what is live.
#[derive(Debug, Default)]
struct FakeDevice {
    next: u64,
    live: BTreeMap<u64, usize>,
    budget: usize,
}

impl FakeDevice {
    fn with_budget(budget: usize) -> Self {
        FakeDevice {
            next: 1 << 32,
            live: BTreeMap::new(),
            budget,
        }
    }
    fn used(&self) -> usize {
        self.live.values().sum()
    }
}

impl RawAllocator for FakeDevice {
    fn alloc(&mut self, bytes: usize) -> Option<u64> {
        if self.used() + bytes > self.budget {
            return None;
        }
        let p = self.next;
        self.next += bytes as u64 + 4096;
        self.live.insert(p, bytes);
        Some(p)
    }
    fn free(&mut self, ptr: u64, bytes: usize) {
        assert_eq!(
            self.live.remove(&ptr),
            Some(bytes),
            "raw free of an unknown segment"
        );
    }
}

const MIB: usize = 1 << 20;

fn allocator(budget: usize) -> CachingAllocator<FakeDevice> {
    CachingAllocator::new(FakeDevice::with_budget(budget), Device::Cuda(0))
}

#[test]
fn small_requests_are_rounded_and_share_a_segment() {
    let mut a = allocator(1 << 30);
    let x = a.alloc(1, 0).unwrap();
    let y = a.alloc(1000, 0).unwrap();
    assert_eq!((x.size, y.size), (512, 1024));
    assert_eq!(y.ptr, x.ptr + 512);
    let s = a.stats();
    assert_eq!((s.raw_allocs, s.reserved, s.allocated), (1, 2 * MIB, 1536));
}

#[test]
fn the_hot_path_reuses_blocks_without_raw_calls() {
    let mut a = allocator(1 << 30);
    let first = a.alloc(3 * MIB, 0).unwrap();
    a.free(first).unwrap();
    for _ in 0..100 {
        let b = a.alloc(3 * MIB, 0).unwrap();
        assert_eq!(b.ptr, first.ptr);
        a.free(b).unwrap();
    }
    let s = a.stats();
    assert_eq!((s.raw_allocs, s.raw_frees), (1, 0));
    assert_eq!(
        s.reserved,
        20 * MIB,
        "a request under 10 MiB gets a 20 MiB segment"
    );
    assert_eq!(s.peak_allocated, 3 * MIB);
}

#[test]
fn large_requests_round_to_2_mib_and_split_only_big_remainders() {
    let mut a = allocator(1 << 30);
    let big = a.alloc(11 * MIB + 1, 0).unwrap();
    assert_eq!(a.stats().reserved, 12 * MIB);
    // The 1 MiB - 512 B remainder is not worth a block: the whole segment is used.
    assert_eq!(big.size, 12 * MIB);
    let mid = a.alloc(2 * MIB, 0).unwrap();
    assert_eq!(mid.size, 2 * MIB, "split off a 20 MiB segment");
    let next = a.alloc(5 * MIB, 0).unwrap();
    assert_eq!(
        next.ptr,
        mid.ptr + (2 * MIB) as u64,
        "carved from the same segment"
    );
    assert_eq!(a.stats().raw_allocs, 2);
}

#[test]
fn freed_neighbours_merge_and_empty_cache_releases_whole_segments() {
    let mut a = allocator(1 << 30);
    let blocks: Vec<Block> = (0..3).map(|_| a.alloc(100 * 1024, 0).unwrap()).collect();
    let other = a.alloc(2 * MIB, 0).unwrap(); // large pool, its own segment
                                              // Free out of order: middle, first, last.
    for i in [1, 0, 2] {
        a.free(blocks[i]).unwrap();
    }
    // The three blocks merged back into one free block spanning the small segment, so a
    // 1 MiB request (the largest the small pool serves) starts at the first block's address.
    let whole = a.alloc(MIB, 0).unwrap();
    assert_eq!(whole.ptr, blocks[0].ptr);
    a.free(whole).unwrap();
    a.empty_cache();
    let s = a.stats();
    assert_eq!(
        s.reserved,
        20 * MIB,
        "only the large segment with a live block is kept"
    );
    assert_eq!(s.raw_frees, 1);
    a.free(other).unwrap();
    a.empty_cache();
    assert_eq!(a.stats().reserved, 0);
    assert!(a.raw().live.is_empty());
}

#[test]
fn blocks_are_not_shared_across_streams() {
    let mut a = allocator(1 << 30);
    let x = a.alloc(4096, 1).unwrap();
    a.free(x).unwrap();
    let y = a.alloc(4096, 2).unwrap();
    assert_ne!(y.ptr, x.ptr);
    assert_eq!(a.stats().raw_allocs, 2);
    let z = a.alloc(4096, 1).unwrap();
    assert_eq!(z.ptr, x.ptr);
}

#[test]
fn out_of_memory_frees_the_cache_retries_then_names_the_request() {
    let mut a = allocator(40 * MIB);
    let x = a.alloc(15 * MIB, 0).unwrap(); // 16 MiB segment
    a.free(x).unwrap();
    // 30 MiB needs a new segment: the cached 16 MiB one is released to make room.
    let y = a.alloc(30 * MIB, 0).unwrap();
    assert_eq!(a.stats().raw_frees, 1);
    assert_eq!(a.stats().reserved, 30 * MIB);
    let err = a.alloc(20 * MIB, 0).unwrap_err().to_string();
    assert!(
        err.contains("out of memory") && err.contains("20971520"),
        "{err}"
    );
    assert!(err.contains("cuda:0"), "{err}");
    // Nothing changed for the live block.
    a.free(y).unwrap();
}

#[test]
fn double_and_foreign_frees_are_errors() {
    let mut a = allocator(1 << 30);
    let x = a.alloc(4096, 0).unwrap();
    a.free(x).unwrap();
    assert!(a.free(x).unwrap_err().to_string().contains("double free"));
    let foreign = Block {
        ptr: 12345,
        size: 512,
        stream: 0,
    };
    assert!(a.free(foreign).is_err());
    assert_eq!(a.stats().allocated, 0);
}

proptest! {
    #[test]
    fn random_sequences_never_overlap_and_account_exactly(
        ops in proptest::collection::vec((0usize..3, 1usize..6_000_000, 0u64..2, any::<prop::sample::Index>()), 1..200)
    ) {
        let mut a = allocator(1 << 34);
        let mut live: Vec<Block> = Vec::new();
        for (kind, bytes, stream, pick) in ops {
            if kind < 2 || live.is_empty() {
                let b = a.alloc(bytes, stream).unwrap();
                prop_assert!(b.size >= bytes && b.size % 512 == 0);
                prop_assert_eq!(b.stream, stream);
                live.push(b);
            } else {
                let b = live.swap_remove(pick.index(live.len()));
                a.free(b).unwrap();
            }
            // No two live blocks overlap, and every one lies inside a raw segment.
            let mut sorted = live.clone();
            sorted.sort_by_key(|b| b.ptr);
            for w in sorted.windows(2) {
                prop_assert!(w[0].ptr + w[0].size as u64 <= w[1].ptr);
            }
            for b in &live {
                let (&base, &len) = a.raw().live.range(..=b.ptr).next_back().unwrap();
                prop_assert!(b.ptr + b.size as u64 <= base + len as u64);
            }
            let s = a.stats();
            prop_assert_eq!(s.allocated, live.iter().map(|b| b.size).sum::<usize>());
            prop_assert_eq!(s.reserved, a.raw().used());
        }
        for b in live.drain(..) {
            a.free(b).unwrap();
        }
        a.empty_cache();
        prop_assert_eq!(a.stats().reserved, 0);
        prop_assert!(a.raw().live.is_empty());
    }
}
