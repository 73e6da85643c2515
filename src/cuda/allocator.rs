//! A caching device-memory allocator with PyTorch's policy, so the hot path never calls
//! `cuMemAlloc`/`cuMemFree`:
//!
//! - sizes are rounded up to 512 bytes;
//! - requests of at most 1 MiB come from the *small* pool, carved out of 2 MiB segments;
//!   larger ones from the *large* pool: a 20 MiB segment for requests under 10 MiB, else the
//!   request rounded up to 2 MiB;
//! - a free block is found best-fit among the free blocks of the same pool **and stream** (a
//!   block freed on one stream is not handed to another, whose work might still be reading it);
//! - a block larger than needed is split when the remainder is worth keeping (≥ 512 bytes in
//!   the small pool, > 1 MiB in the large one); freed blocks merge with free neighbours of the
//!   same segment;
//! - when the device is out of memory, every wholly free segment is released and the request
//!   retried once before an error naming the request and the allocator's state.
//!
//! The policy is independent of CUDA: [`CachingAllocator`] works over any [`RawAllocator`]
//! (tests use a fake one; [`DriverAllocator`] is the CUDA driver's).

use std::collections::{BTreeMap, BTreeSet};

use crate::{Device, Error, Result};

const ROUND: usize = 512;
const SMALL_REQUEST: usize = 1 << 20;
const SMALL_SEGMENT: usize = 2 << 20;
const LARGE_REQUEST_SHARED: usize = 10 << 20;
const LARGE_SEGMENT: usize = 20 << 20;
const LARGE_ROUND: usize = 2 << 20;

/// Where segments come from: whole device allocations, rarely.
pub trait RawAllocator {
    /// Allocates `bytes` of device memory, returning its address (`None`: out of memory).
    fn alloc(&mut self, bytes: usize) -> Option<u64>;
    /// Frees an allocation made by [`alloc`](RawAllocator::alloc) of `bytes`.
    fn free(&mut self, ptr: u64, bytes: usize);
}

/// Identifies the stream a block belongs to.
pub type StreamId = u64;

/// A live allocation: `size` bytes (the rounded request) at `ptr`, usable on `stream`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Block {
    /// Device address.
    pub ptr: u64,
    /// Bytes reserved for this block (the request rounded up, or a whole unsplit block).
    pub size: usize,
    /// The stream it was allocated for.
    pub stream: StreamId,
}

/// Byte counts of the allocator.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AllocatorStats {
    /// Bytes in live blocks.
    pub allocated: usize,
    /// Bytes held from the device (live + cached).
    pub reserved: usize,
    /// Highest `allocated` seen.
    pub peak_allocated: usize,
    /// Highest `reserved` seen.
    pub peak_reserved: usize,
    /// Calls to the raw allocator's `alloc` (segments created).
    pub raw_allocs: u64,
    /// Calls to the raw allocator's `free` (segments released).
    pub raw_frees: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Pool {
    Small,
    Large,
}

#[derive(Debug)]
struct Segment {
    size: usize,
    stream: StreamId,
    pool: Pool,
    /// Block start → (size, free).
    blocks: BTreeMap<u64, (usize, bool)>,
}

/// The caching allocator (see the module docs for the policy).
#[derive(Debug)]
pub struct CachingAllocator<R: RawAllocator> {
    raw: R,
    device: Device,
    /// Segment base → segment.
    segments: BTreeMap<u64, Segment>,
    /// Free blocks by (pool, stream, size, ptr), for best-fit search.
    free: BTreeSet<(Pool, StreamId, usize, u64)>,
    stats: AllocatorStats,
}

fn round_up(x: usize, to: usize) -> usize {
    x.div_ceil(to) * to
}

impl<R: RawAllocator> CachingAllocator<R> {
    /// An empty allocator drawing segments from `raw` (on `device`, for error messages).
    pub fn new(raw: R, device: Device) -> Self {
        CachingAllocator {
            raw,
            device,
            segments: BTreeMap::new(),
            free: BTreeSet::new(),
            stats: AllocatorStats::default(),
        }
    }

    /// Current byte counts.
    pub fn stats(&self) -> AllocatorStats {
        self.stats
    }

    /// The raw allocator.
    pub fn raw(&self) -> &R {
        &self.raw
    }

    /// A block of at least `bytes` usable on `stream`.
    pub fn alloc(&mut self, bytes: usize, stream: StreamId) -> Result<Block> {
        let size = round_up(bytes.max(1), ROUND);
        let pool = if size <= SMALL_REQUEST {
            Pool::Small
        } else {
            Pool::Large
        };
        let found = self
            .free
            .range((pool, stream, size, 0)..)
            .next()
            .filter(|&&(p, s, _, _)| p == pool && s == stream)
            .copied();
        let (ptr, block_size) = match found {
            Some(key) => {
                self.free.remove(&key);
                (key.3, key.2)
            }
            None => {
                let segment_size = match pool {
                    Pool::Small => SMALL_SEGMENT,
                    Pool::Large if size < LARGE_REQUEST_SHARED => LARGE_SEGMENT,
                    Pool::Large => round_up(size, LARGE_ROUND),
                };
                let base = self.new_segment(segment_size, stream, pool, size)?;
                (base, segment_size)
            }
        };
        let segment = self.segment_of_mut(ptr);
        let remainder = block_size - size;
        let split = match pool {
            Pool::Small => remainder >= ROUND,
            Pool::Large => remainder > SMALL_REQUEST,
        };
        let used = if split { size } else { block_size };
        segment.blocks.insert(ptr, (used, false));
        if split {
            let rest = ptr + size as u64;
            segment.blocks.insert(rest, (remainder, true));
            self.free.insert((pool, stream, remainder, rest));
        }
        self.stats.allocated += used;
        self.stats.peak_allocated = self.stats.peak_allocated.max(self.stats.allocated);
        Ok(Block {
            ptr,
            size: used,
            stream,
        })
    }

    fn new_segment(
        &mut self,
        segment_size: usize,
        stream: StreamId,
        pool: Pool,
        request: usize,
    ) -> Result<u64> {
        let base = match self.raw.alloc(segment_size) {
            Some(p) => p,
            None => {
                // Out of memory: give back every wholly free segment, then try once more.
                self.empty_cache();
                self.raw
                    .alloc(segment_size)
                    .ok_or_else(|| Error::DeviceUnavailable {
                        device: self.device,
                        reason: format!(
                        "out of memory: a {request}-byte request needs a new {segment_size}-byte \
                         segment; {} bytes allocated, {} reserved after freeing the cache",
                        self.stats.allocated, self.stats.reserved
                    ),
                    })?
            }
        };
        self.stats.raw_allocs += 1;
        self.stats.reserved += segment_size;
        self.stats.peak_reserved = self.stats.peak_reserved.max(self.stats.reserved);
        self.segments.insert(
            base,
            Segment {
                size: segment_size,
                stream,
                pool,
                blocks: BTreeMap::from([(base, (segment_size, true))]),
            },
        );
        Ok(base)
    }

    fn segment_of_mut(&mut self, ptr: u64) -> &mut Segment {
        self.segments
            .range_mut(..=ptr)
            .next_back()
            .map(|(_, s)| s)
            .expect("every block lies in a segment")
    }

    /// Returns a block to the cache (merging it with free neighbours). Freeing a block that
    /// is not live is an error and changes nothing.
    pub fn free(&mut self, block: Block) -> Result<()> {
        let Some((&base, segment)) = self.segments.range_mut(..=block.ptr).next_back() else {
            return Err(Error::invalid(
                "CachingAllocator::free",
                format!("{:#x} was not allocated here", block.ptr),
            ));
        };
        match segment.blocks.get(&block.ptr) {
            Some(&(size, false)) if size == block.size && segment.stream == block.stream => {}
            _ => {
                return Err(Error::invalid(
                    "CachingAllocator::free",
                    format!("{block:?} is not a live block of this allocator (double free?)"),
                ))
            }
        }
        let (pool, stream) = (segment.pool, segment.stream);
        let mut start = block.ptr;
        let mut size = block.size;
        // Merge with the previous block if it is free.
        if let Some((&prev, &(prev_size, true))) = segment.blocks.range(..start).next_back() {
            segment.blocks.remove(&prev);
            self.free.remove(&(pool, stream, prev_size, prev));
            start = prev;
            size += prev_size;
        }
        segment.blocks.remove(&block.ptr);
        // Merge with the next block if it is free.
        let next = block.ptr + block.size as u64;
        if let Some(&(next_size, true)) = segment.blocks.get(&next) {
            segment.blocks.remove(&next);
            self.free.remove(&(pool, stream, next_size, next));
            size += next_size;
        }
        segment.blocks.insert(start, (size, true));
        debug_assert!(start >= base && start + size as u64 <= base + segment.size as u64);
        self.free.insert((pool, stream, size, start));
        self.stats.allocated -= block.size;
        Ok(())
    }

    /// Releases every segment none of whose bytes are in use back to the device.
    pub fn empty_cache(&mut self) {
        let idle: Vec<u64> = self
            .segments
            .iter()
            .filter(|(_, s)| s.blocks.len() == 1 && s.blocks.values().all(|&(_, free)| free))
            .map(|(&base, _)| base)
            .collect();
        for base in idle {
            let s = self.segments.remove(&base).expect("listed above");
            self.free.remove(&(s.pool, s.stream, s.size, base));
            self.raw.free(base, s.size);
            self.stats.reserved -= s.size;
            self.stats.raw_frees += 1;
        }
    }
}

/// The CUDA driver as a [`RawAllocator`] (`cuMemAlloc` / `cuMemFree` on the current context).
pub struct DriverAllocator {
    context: std::sync::Arc<cudarc::driver::CudaContext>,
}

impl DriverAllocator {
    /// Allocates in `context`.
    pub fn new(context: std::sync::Arc<cudarc::driver::CudaContext>) -> Self {
        DriverAllocator { context }
    }
}

impl<R: RawAllocator + ?Sized> RawAllocator for Box<R> {
    fn alloc(&mut self, bytes: usize) -> Option<u64> {
        (**self).alloc(bytes)
    }

    fn free(&mut self, ptr: u64, bytes: usize) {
        (**self).free(ptr, bytes)
    }
}

impl RawAllocator for DriverAllocator {
    fn alloc(&mut self, bytes: usize) -> Option<u64> {
        self.context.bind_to_thread().ok()?;
        // SAFETY: a plain device allocation in a bound context; freed only through `free`.
        unsafe { cudarc::driver::result::malloc_sync(bytes) }.ok()
    }

    fn free(&mut self, ptr: u64, _bytes: usize) {
        if self.context.bind_to_thread().is_ok() {
            // SAFETY: `ptr` came from `alloc` above and is freed once (the caching allocator
            // releases a segment only when all of it is free).
            let _ = unsafe { cudarc::driver::result::free_sync(ptr) };
        }
    }
}
