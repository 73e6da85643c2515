//! A GPU cache's directory on the GPU: the host [`Directory`]'s tags and slot state for every
//! table in device buffers, and its admission as kernels (`kernels/tbe_cache_directory.cu`),
//! so that a batch's 10⁶ ids are looked up, locked and given victims where the cache rows are,
//! instead of on the host. The decisions are the host directory's, bit for bit (hits locked
//! at their row's first occurrence, distinct misses taking victims in row order, the same
//! policies and ties); the host directory stays the one that flushes, checkpoints and serves
//! direct reads, and the two are copied into each other when the work changes sides
//! ([`push`](DeviceDirectory::push), [`pull`](DeviceDirectory::pull)).

use std::sync::Arc;

use super::directory::{Directory, WAYS};
use super::{CachePolicy, Move};
use crate::cuda::{CudaDevice, DeviceBuffer, DeviceEvent, LaunchConfig, MappedHost};
use crate::embedding::tbe::cuda::DeviceBatch;
use crate::{args, Result};

crate::kernel_source!(
    pub(crate) static DIRECTORY = "tbe_cache_directory.cu",
    [
        "cache_dir_find",
        "cache_dir_heads",
        "cache_dir_install",
        "cache_dir_place",
        "cache_dir_unlock",
        "cache_dir_mark_dirty",
        "cache_dir_moves",
        "cache_dir_moves_bytes",
        "cache_bytes_scatter",
        "cache_dir_lookup",
    ];
);

/// Threads per block of the one-thread-per-item kernels.
const THREADS: u32 = 256;
/// Warps per block of the find kernel (a warp per bag).
const FIND_WARPS: u32 = 8;
/// Counters before the per-table ones (`kernels/tbe_cache_directory.cu`).
const HEAD: usize = 4;
/// Counters per table: hits locked, rows installed, direct reads, evictions, dirty rows
/// written back.
pub(crate) const PER_TABLE: usize = 5;

/// Device bytes per slot: its tag, stamp, locks and dirtiness.
pub(crate) const SLOT_BYTES: usize = 8 + 8 + 4 + 4;

/// Bits needed to write every value up to `v`.
fn bits_for(v: u64) -> u32 {
    64 - v.leading_zeros()
}

/// Where an admission's moves go when the GPU makes them itself: the rows in mapped host memory
/// and the cache buffers (`cache_dir_moves` and `cache_dir_moves_bytes` in
/// `kernels/tbe_cache_directory.cu`).
pub(crate) enum MovesInPlace<'a> {
    /// A training cache's FP32 records.
    Records {
        /// The cache rows' weights and two state buffers.
        buffers: [&'a DeviceBuffer<f32>; 3],
        /// The row store.
        host: &'a MappedHost,
        /// Per table, the float offset of its first record in the store.
        host_first: Vec<i64>,
        /// Per table and part (weights, state 0, state 1): the float offset of its first
        /// cache row in the part's buffer, and its floats per row.
        part_start: Vec<i64>,
        part_len: Vec<i64>,
    },
    /// An inference cache's stored rows (read only: no victim is written back).
    Bytes {
        /// Every table's cache rows.
        cache: &'a DeviceBuffer<u8>,
        /// The row store.
        host: &'a MappedHost,
        /// Per table: the byte offset of its first row in the store and in `cache`, and its
        /// bytes per row.
        host_first: Vec<i64>,
        cache_first: Vec<i64>,
        row_bytes: Vec<i64>,
    },
}

impl MovesInPlace<'_> {
    /// Launches the kernel that makes the `counters[1]` moves listed in `moves`.
    fn launch(
        &self,
        d: &Arc<CudaDevice>,
        moves: &DeviceBuffer<i64>,
        counters: &DeviceBuffer<u64>,
        missed: usize,
    ) -> Result<()> {
        let grid = LaunchConfig::warp_per_item(missed.min(65_535 * 8), 8);
        match self {
            MovesInPlace::Records {
                buffers: [w, s0, s1],
                host,
                host_first,
                part_start,
                part_len,
            } => {
                let (first, starts, lens) =
                    (d.htod(host_first)?, d.htod(part_start)?, d.htod(part_len)?);
                d.launch(
                    DIRECTORY.kernel("cache_dir_moves"),
                    grid,
                    &args![*moves, *counters, **w, **s0, **s1, **host, first, starts, lens],
                )
            }
            MovesInPlace::Bytes {
                cache,
                host,
                host_first,
                cache_first,
                row_bytes,
            } => {
                let (host_first, cache_first, row_bytes) = (
                    d.htod(host_first)?,
                    d.htod(cache_first)?,
                    d.htod(row_bytes)?,
                );
                d.launch(
                    DIRECTORY.kernel("cache_dir_moves_bytes"),
                    grid,
                    &args![
                        *moves,
                        *counters,
                        **cache,
                        **host,
                        host_first,
                        cache_first,
                        row_bytes
                    ],
                )
            }
        }
    }
}

/// Copies rows staged in `src` into `dst`: row `i` is `rows[i] = (offset in src, offset in
/// dst, bytes)` (`cache_bytes_scatter`).
pub(crate) fn scatter_bytes(
    src: &DeviceBuffer<u8>,
    dst: &DeviceBuffer<u8>,
    rows: &[(usize, usize, usize)],
) -> Result<()> {
    if rows.is_empty() {
        return Ok(());
    }
    let d = dst.device();
    let column =
        |k: usize| -> Vec<i64> { (rows.iter()).map(|r| [r.0, r.1, r.2][k] as i64).collect() };
    let (src_off, dst_off, len) = (
        d.htod(&column(0))?,
        d.htod(&column(1))?,
        d.htod(&column(2))?,
    );
    d.launch(
        DIRECTORY.kernel("cache_bytes_scatter"),
        LaunchConfig::warp_per_item(rows.len().min(65_535 * 8), 8),
        &args![*src, src_off, *dst, dst_off, len, rows.len() as i64],
    )
}

/// What a device admission decided, read back to the host.
pub(crate) struct DeviceAdmission {
    /// Slots locked for the batch (global slot numbers, on the device), and how many.
    pub locked: DeviceBuffer<i64>,
    pub locked_len: usize,
    /// The data moves, 4 values each (table, cache row, dirty row written back or -1, row
    /// read in), on the device, and how many; already made when the admission was given
    /// [`MovesInPlace`].
    moves: DeviceBuffer<i64>,
    moves_len: usize,
    /// Direct reads: (table, row, scratch row).
    pub direct: Vec<(usize, u64, usize)>,
    /// Per table: hits locked, rows installed, direct reads, evictions, dirty rows written
    /// back.
    pub counts: Vec<[u64; PER_TABLE]>,
    /// Time until the directory's decisions were made, and then until the moves in place
    /// were made (zero without them).
    pub decided: std::time::Duration,
    pub moved: std::time::Duration,
}

impl DeviceAdmission {
    /// Per table, the data moves (cache row, dirty row written back, row read in), in the
    /// order of the rows read (as the host directory lists them), read back from the device.
    pub(crate) fn moves(&self, tables: usize) -> Result<Vec<Vec<Move>>> {
        let mut raw = vec![0i64; 4 * self.moves_len];
        (self.moves.device()).read_bytes(&self.moves, 0, bytemuck::cast_slice_mut(&mut raw))?;
        let mut moves = vec![Vec::new(); tables];
        for m in raw.chunks_exact(4) {
            let old = u64::try_from(m[2]).ok();
            moves[m[0] as usize].push((m[1] as usize, old, m[3] as u64));
        }
        for m in &mut moves {
            m.sort_unstable_by_key(|mv| mv.2);
        }
        Ok(moves)
    }
}

/// Every table's directory in device buffers.
pub(crate) struct DeviceDirectory {
    device: Arc<CudaDevice>,
    policy: CachePolicy,
    /// Per table: sets, first set, first global row (and the total after the last).
    sets: Vec<usize>,
    set_base: Vec<usize>,
    row_base: Vec<usize>,
    d_sets: DeviceBuffer<i64>,
    d_set_base: DeviceBuffer<i64>,
    d_row_base: DeviceBuffer<i64>,
    /// Feature → table.
    d_feature_table: DeviceBuffer<i64>,
    tags: DeviceBuffer<u64>,
    stamp: DeviceBuffer<u64>,
    locks: DeviceBuffer<u32>,
    dirty: DeviceBuffer<u32>,
    /// LFU: every table's access counts, by global row (one element otherwise).
    counts: DeviceBuffer<u32>,
    /// The stream of the last operation on the buffers: an operation from another stream
    /// waits for it (an admission on the prefetch stream after one on the caller's). Dirty
    /// marks are not such operations (below).
    last_stream: Option<crate::cuda::allocator::StreamId>,
    /// The dirty marks of backwards (per stream, the point after the last one) that no copy
    /// to the host has waited for yet. A mark touches only slots locked by its batch, which
    /// no admission reads or changes while the batch is alive, so an admission on another
    /// stream does not wait for it (it runs beside the backward); a batch's unlock waits for
    /// its backward ([`super::CachedBatch`]), and [`pull`](Self::pull) for all of them. The
    /// one mark outside a batch's locks, [`set_dirty`](Self::set_dirty) on the cached rows of
    /// its direct reads, follows the [`find`](Self::find) that located them on the same
    /// stream, which later admissions order after.
    marks: Vec<(crate::cuda::allocator::StreamId, DeviceEvent)>,
}

impl DeviceDirectory {
    /// Buffers for `dirs` (tables of `rows` rows, read by features as `feature_table` says) on
    /// `device`; their contents are set by [`push`](Self::push).
    pub(crate) fn new(
        device: &Arc<CudaDevice>,
        dirs: &[Directory],
        rows: &[usize],
        feature_table: &[usize],
        policy: CachePolicy,
    ) -> Result<Self> {
        let sets: Vec<usize> = dirs.iter().map(|d| d.sets).collect();
        let mut set_base = vec![0usize];
        for &s in &sets {
            set_base.push(set_base.last().unwrap() + s);
        }
        let mut row_base = vec![0usize];
        for &r in rows {
            row_base.push(row_base.last().unwrap() + r);
        }
        let slots = set_base[sets.len()] * WAYS;
        let total_rows = row_base[rows.len()];
        let i64s = |v: &[usize]| v.iter().map(|&x| x as i64).collect::<Vec<i64>>();
        let counts_len = if policy == CachePolicy::Lfu {
            total_rows.max(1)
        } else {
            1
        };
        Ok(DeviceDirectory {
            d_sets: device.htod(&i64s(&sets))?,
            d_set_base: device.htod(&i64s(&set_base))?,
            d_row_base: device.htod(&i64s(&row_base))?,
            d_feature_table: device.htod(
                &i64s(feature_table)
                    .into_iter()
                    .chain([0])
                    .collect::<Vec<_>>(),
            )?,
            tags: device.alloc(slots.max(1))?,
            stamp: device.alloc(slots.max(1))?,
            locks: device.alloc(slots.max(1))?,
            dirty: device.alloc(slots.max(1))?,
            counts: device.alloc(counts_len)?,
            last_stream: None,
            marks: Vec::new(),
            device: device.clone(),
            policy,
            sets,
            set_base,
            row_base,
        })
    }

    /// Orders this operation (on the calling thread's stream) after the previous one on the
    /// buffers, whatever stream that was on.
    fn order(&mut self) -> Result<()> {
        self.last_stream = Some(self.wait_for_last()?);
        Ok(())
    }

    /// Makes the calling thread's stream (returned) wait for the previous operation on the
    /// buffers, without ordering later operations after this one.
    pub(crate) fn wait_for_last(&self) -> Result<crate::cuda::allocator::StreamId> {
        let current = self.device.current_stream_id();
        if let Some(last) = self.last_stream.filter(|&l| l != current) {
            self.device.stream_wait(current, last)?;
        }
        Ok(current)
    }

    /// Bytes of the device buffers.
    pub(crate) fn bytes(&self) -> usize {
        self.tags.bytes()
            + self.stamp.bytes()
            + self.locks.bytes()
            + self.dirty.bytes()
            + self.counts.bytes()
    }

    /// Global slot `slot` as (table, slot of the table).
    pub(crate) fn local(&self, slot: usize) -> (usize, usize) {
        let first = slot / WAYS;
        let t = self.set_base.partition_point(|&b| b <= first) - 1;
        (t, slot - self.set_base[t] * WAYS)
    }

    /// Table `t`'s slot `slot` as a global slot.
    pub(crate) fn global(&self, t: usize, slot: usize) -> usize {
        self.set_base[t] * WAYS + slot
    }

    /// Copies the host directories into the device buffers.
    pub(crate) fn push(&mut self, dirs: &[Directory]) -> Result<()> {
        // No dirty mark still in flight may land on what is copied up.
        for (_, mark) in std::mem::take(&mut self.marks) {
            self.device.wait_event(&mark)?;
        }
        self.order()?;
        let slots = self.tags.len();
        let (mut tags, mut stamp, mut locks, mut dirty) = (
            Vec::with_capacity(slots),
            Vec::with_capacity(slots),
            Vec::with_capacity(slots),
            Vec::with_capacity(slots),
        );
        let mut counts = Vec::with_capacity(self.counts.len());
        for d in dirs {
            let raw = d.raw();
            tags.extend_from_slice(raw.tags);
            stamp.extend(raw.meta.iter().map(|m| m.stamp));
            locks.extend(raw.meta.iter().map(|m| m.locks));
            dirty.extend(raw.meta.iter().map(|m| u32::from(m.dirty)));
            counts.extend_from_slice(raw.counts);
        }
        // The buffers' spare element (no slots, or no LFU counts).
        for (v, fill) in [(&mut tags, u64::MAX), (&mut stamp, 0)] {
            v.resize(slots, fill);
        }
        locks.resize(slots, 0);
        dirty.resize(slots, 0);
        counts.resize(self.counts.len(), 0);
        self.tags.copy_from_host(&tags)?;
        self.stamp.copy_from_host(&stamp)?;
        self.locks.copy_from_host(&locks)?;
        self.dirty.copy_from_host(&dirty)?;
        self.counts.copy_from_host(&counts)
    }

    /// The slot (of its table) holding each `(table, row)`, if cached: a lookup on the device
    /// (the host directory stays as it is). It becomes the operation later ones order after,
    /// so that they also wait for what the caller queues after it on its stream (its writes
    /// into the slots found, their dirty marks).
    pub(crate) fn find(&mut self, rows: &[(usize, u64)]) -> Result<Vec<Option<usize>>> {
        if rows.is_empty() {
            return Ok(Vec::new());
        }
        self.order()?;
        let d = &self.device;
        let tables: Vec<i64> = rows.iter().map(|&(t, _)| t as i64).collect();
        let ids: Vec<i64> = rows.iter().map(|&(_, r)| r as i64).collect();
        let (tables, ids) = (d.htod(&tables)?, d.htod(&ids)?);
        let out = d.alloc::<i64>(rows.len())?;
        d.launch(
            DIRECTORY.kernel("cache_dir_lookup"),
            LaunchConfig::linear(rows.len(), THREADS),
            &args![
                tables,
                ids,
                rows.len() as i64,
                self.d_sets,
                self.d_set_base,
                self.tags,
                out
            ],
        )?;
        Ok(out
            .to_host()?
            .into_iter()
            .map(|s| usize::try_from(s).ok())
            .collect())
    }

    /// `slots` ((table, slot of the table) pairs) as global slot numbers on the device, and
    /// how many (`None` when there are none).
    pub(crate) fn upload_slots(
        &self,
        slots: impl Iterator<Item = (usize, usize)>,
    ) -> Result<Option<(DeviceBuffer<i64>, usize)>> {
        let global: Vec<i64> = slots.map(|(t, s)| self.global(t, s) as i64).collect();
        if global.is_empty() {
            return Ok(None);
        }
        Ok(Some((self.device.htod(&global)?, global.len())))
    }

    /// Marks slots `slots` ((table, slot of the table) pairs) dirty: slots found by a
    /// [`find`](Self::find) just before on the calling thread's stream, which orders later
    /// admissions after this mark too.
    pub(crate) fn set_dirty(&mut self, slots: &[(usize, usize)]) -> Result<()> {
        match self.upload_slots(slots.iter().copied())? {
            Some((global, n)) => self.mark_dirty(&global, n),
            None => Ok(()),
        }
    }

    /// The row in each slot of table `t` (`u64::MAX`: none), read from the device.
    pub(crate) fn tags_of(&self, t: usize) -> Result<Vec<u64>> {
        // Reads wait for the work queued before on the calling thread's stream; the work of
        // another stream is waited for too.
        if let Some(last) = self.last_stream.filter(|&l| l != self.device.at().stream) {
            self.device.synchronize_stream(last)?;
        }
        let first = self.set_base[t] * WAYS;
        let mut tags = vec![0u64; self.sets[t] * WAYS];
        self.device
            .read_bytes(&self.tags, first * 8, bytemuck::cast_slice_mut(&mut tags))?;
        Ok(tags)
    }

    /// Table `t`'s occupied slots and their rows, read from the device.
    pub(crate) fn occupied(&self, t: usize) -> Result<Vec<(usize, u64)>> {
        Ok((self.tags_of(t)?.into_iter().enumerate())
            .filter(|&(_, r)| r != u64::MAX)
            .collect())
    }

    /// Copies the device buffers into the host directories.
    pub(crate) fn pull(&mut self, dirs: &mut [Directory]) -> Result<()> {
        for (_, mark) in std::mem::take(&mut self.marks) {
            self.device.wait_event(&mark)?;
        }
        self.order()?;
        let (tags, stamp, locks, dirty) = (
            self.tags.to_host()?,
            self.stamp.to_host()?,
            self.locks.to_host()?,
            self.dirty.to_host()?,
        );
        let counts = match self.policy {
            CachePolicy::Lfu => self.counts.to_host()?,
            CachePolicy::Lru => Vec::new(),
        };
        for (t, d) in dirs.iter_mut().enumerate() {
            let slots = self.set_base[t] * WAYS..self.set_base[t + 1] * WAYS;
            let rows = self.row_base[t]..self.row_base[t + 1];
            d.set_raw(
                &tags[slots.clone()],
                &stamp[slots.clone()],
                &locks[slots.clone()],
                &dirty[slots],
                counts.get(rows).unwrap_or(&[]),
            );
        }
        Ok(())
    }

    /// Whether a batch of `n` ids fits the kernels' keys (else the host admits it).
    pub(crate) fn fits(&self, n: usize) -> bool {
        let total_rows = *self.row_base.last().unwrap() as u64;
        let total_sets = *self.set_base.last().unwrap() as u64;
        let (pbits, gbits) = (bits_for(n.max(2) as u64 - 1), bits_for(total_rows));
        n < (1 << 32)
            && pbits + 8 * gbits.div_ceil(8) <= 64
            && 32 + 8 * bits_for(total_sets).div_ceil(8) <= 64
    }

    /// Admits `batch` (uploaded with its table rows as ids, validated; [`fits`](Self::fits))
    /// at `tick`: its ids become cache rows in place, its rows are locked, the moves are made
    /// when `in_place` says where (else listed for the host), and the direct reads and
    /// counters come back.
    pub(crate) fn admit(
        &mut self,
        batch: &mut DeviceBatch,
        tick: u64,
        in_place: Option<&MovesInPlace<'_>>,
    ) -> Result<DeviceAdmission> {
        let start = std::time::Instant::now();
        self.order()?;
        let d = self.device.clone();
        let n = batch.num_ids;
        let tables = self.sets.len();
        let total_rows = *self.row_base.last().unwrap() as u64;
        let total_sets = *self.set_base.last().unwrap() as u64;
        let pbits = bits_for(n.max(2) as u64 - 1);
        let gbits = bits_for(total_rows);
        let sentinel2 = total_sets << 32;
        let lfu = i32::from(self.policy == CachePolicy::Lfu);
        let len = n.max(1);
        let counters = d.zeros::<u64>(HEAD + PER_TABLE * tables)?;
        let scratch_next = d.zeros::<u32>(tables.max(1))?;
        let locked = d.alloc::<i64>(len)?;
        let keys = d.alloc::<u64>(len)?;
        let bags = batch.offsets.len() - 1;
        if n > 0 && bags > 0 {
            d.launch(
                DIRECTORY.kernel("cache_dir_find"),
                LaunchConfig::warp_per_item(bags.min(65_535 * FIND_WARPS as usize), FIND_WARPS),
                &args![
                    batch.offsets,
                    batch.ids,
                    bags as i64,
                    batch.batch_size as i64,
                    self.d_feature_table,
                    self.d_sets,
                    self.d_set_base,
                    self.d_row_base,
                    self.tags,
                    self.stamp,
                    self.locks,
                    self.counts,
                    lfu,
                    tick,
                    keys,
                    pbits as i32,
                    locked,
                    counters
                ],
            )?;
        }
        // The missed ids, appended by the find: only they are sorted.
        let mut head = [0u64; HEAD];
        d.read_bytes(&counters, 0, bytemuck::cast_slice_mut(&mut head))?;
        let missed = head[3] as usize;
        let moves = d.alloc::<i64>(4 * len)?;
        let direct = d.alloc::<i64>(3 * len)?;
        if missed > 0 {
            let compact = d.alloc::<u64>(missed)?;
            d.copy_bytes(&compact, 0, &keys, 0, 8 * missed)?;
            drop(keys);
            let keys = crate::cuda::radix_sort_u64(compact, pbits, gbits)?;
            let keys2 = d.alloc::<u64>(missed)?;
            let grid = LaunchConfig::linear(missed, THREADS);
            d.launch(
                DIRECTORY.kernel("cache_dir_heads"),
                grid,
                &args![
                    keys,
                    missed as i64,
                    pbits as i32,
                    self.d_row_base,
                    tables as i32,
                    self.d_sets,
                    self.d_set_base,
                    keys2,
                    sentinel2
                ],
            )?;
            let keys2 = crate::cuda::radix_sort_u64(keys2, 32, bits_for(total_sets))?;
            let head_slot = d.alloc::<i64>(missed)?;
            d.launch(
                DIRECTORY.kernel("cache_dir_install"),
                grid,
                &args![
                    keys2,
                    missed as i64,
                    sentinel2,
                    keys,
                    pbits as i32,
                    self.d_row_base,
                    tables as i32,
                    self.d_sets,
                    self.d_set_base,
                    self.tags,
                    self.stamp,
                    self.locks,
                    self.dirty,
                    self.counts,
                    lfu,
                    tick,
                    head_slot,
                    locked,
                    moves,
                    direct,
                    scratch_next,
                    counters
                ],
            )?;
            d.launch(
                DIRECTORY.kernel("cache_dir_place"),
                grid,
                &args![keys, missed as i64, pbits as i32, head_slot, batch.ids],
            )?;
        }
        let mut decided = start.elapsed();
        let mut moved = std::time::Duration::ZERO;
        if let Some(m) = in_place.filter(|_| missed > 0) {
            // This stream only: a backward on another may still run beside it.
            d.synchronize_current()?;
            decided = start.elapsed();
            m.launch(&d, &moves, &counters, missed)?;
            d.synchronize_current()?;
            moved = start.elapsed() - decided;
        }
        let c = counters.to_host()?;
        let (locked_len, moves_len, direct_len) = (c[0] as usize, c[1] as usize, c[2] as usize);
        let mut raw_direct = vec![0i64; 3 * direct_len];
        d.read_bytes(&direct, 0, bytemuck::cast_slice_mut(&mut raw_direct))?;
        let direct_reads = (raw_direct.chunks_exact(3))
            .map(|f| (f[0] as usize, f[1] as u64, f[2] as usize))
            .collect();
        let counts = (0..tables)
            .map(|t| std::array::from_fn(|k| c[HEAD + PER_TABLE * t + k]))
            .collect();
        Ok(DeviceAdmission {
            locked,
            locked_len,
            moves,
            moves_len,
            direct: direct_reads,
            counts,
            decided,
            moved,
        })
    }

    /// Releases one lock of each of the first `n` global slots of `slots`.
    pub(crate) fn unlock(&mut self, slots: &DeviceBuffer<i64>, n: usize) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        self.order()?;
        self.launch_over_slots("cache_dir_unlock", slots, n, &self.locks)
    }

    /// Marks the first `n` global slots of `slots` (locked by a live batch) dirty, on the
    /// calling thread's stream, without ordering later admissions after it (the `marks`
    /// field says why).
    pub(crate) fn mark_dirty(&mut self, slots: &DeviceBuffer<i64>, n: usize) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        // After the earlier operations on the buffers (an admission or unlock elsewhere).
        let current = self.wait_for_last()?;
        self.launch_over_slots("cache_dir_mark_dirty", slots, n, &self.dirty)?;
        let mark = self.device.record_marker()?;
        self.marks.retain(|(s, _)| *s != current);
        self.marks.push((current, mark));
        Ok(())
    }

    fn launch_over_slots<T: crate::cuda::DeviceElem>(
        &self,
        kernel: &'static str,
        slots: &DeviceBuffer<i64>,
        n: usize,
        target: &DeviceBuffer<T>,
    ) -> Result<()> {
        self.device.launch(
            DIRECTORY.kernel(kernel),
            LaunchConfig::linear(n, THREADS),
            &args![*slots, n as i64, *target],
        )
    }

    /// The device.
    pub(crate) fn device(&self) -> &Arc<CudaDevice> {
        &self.device
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use crate::embedding::input::{Batch, Ids};
    use crate::embedding::tbe::cache::{CacheStats, TablePositions};
    use rand::{Rng, SeedableRng};

    /// The emulated device, or `None` (reason printed; a failure under
    /// `EMBERS_REQUIRE_CUDA_SIM=1`).
    pub(in crate::embedding::tbe::cache) fn emulated() -> Option<Arc<CudaDevice>> {
        match crate::cuda::simulated_device(0) {
            Ok(d) => Some(d),
            Err(e) => {
                let required = std::env::var("EMBERS_REQUIRE_CUDA_SIM").is_ok_and(|v| v == "1");
                assert!(!required, "EMBERS_REQUIRE_CUDA_SIM=1 but {e}");
                println!("skipped: no host emulation: {e}");
                None
            }
        }
    }

    /// Admissions on the device decide what the host directory decides: the same cache rows,
    /// locks, victims, moves (dirty write-backs included), direct reads, counters and
    /// directory contents, batch after batch, under both policies, with sets small enough
    /// that many are wholly locked.
    #[test]
    fn device_admissions_equal_the_host_directorys() {
        let Some(device) = emulated() else { return };
        for policy in [CachePolicy::Lru, CachePolicy::Lfu] {
            let rows = [300usize, 500];
            let feature_table = [0usize, 1, 1];
            let b = 16;
            let mut host: Vec<Directory> = [2, 3]
                .iter()
                .zip(&rows)
                .map(|(&sets, &r)| Directory::new(sets, r, policy).unwrap())
                .collect();
            let mut dev =
                DeviceDirectory::new(&device, &host, &rows, &feature_table, policy).unwrap();
            dev.push(&host).unwrap();
            let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(11);
            let mut stats = vec![CacheStats::empty(String::new(), 0); 2];
            let mut held: Vec<(Vec<Vec<usize>>, DeviceBuffer<i64>, usize)> = Vec::new();
            for tick in 1..=8u64 {
                let mut offsets = vec![0usize];
                let mut ids = Vec::new();
                for f in 0..feature_table.len() {
                    let r = rows[feature_table[f]] as u64;
                    for _ in 0..b {
                        for _ in 0..rng.random_range(0..12) {
                            // Skewed: low rows come back often.
                            let x: f64 = rng.random();
                            ids.push((x * x * x * r as f64) as i64);
                        }
                        offsets.push(ids.len());
                    }
                }
                let batch = Batch {
                    ids: Ids::I64(ids.clone().into()),
                    offsets,
                    weights: None,
                    batch_size: b,
                    num_features: feature_table.len(),
                    kept: None,
                };
                let ranges = TablePositions::new(&feature_table, 2, &batch);
                let before = stats.clone();
                let admitted: Vec<_> = (0..2)
                    .map(|t| {
                        let table_ids = ranges.ids(t, &batch);
                        Some(host[t].admit(&table_ids, tick, &mut stats[t]))
                    })
                    .collect();
                let mut host_loc = vec![0i64; ids.len()];
                ranges.place(&admitted, &mut host_loc);
                let mut on_device = DeviceBatch::upload(&device, &batch).unwrap();
                let a = dev.admit(&mut on_device, tick, None).unwrap();
                let moves = a.moves(2).unwrap();
                let dev_loc = on_device.ids.to_host().unwrap();
                // Scratch rows may be numbered in another order: compare the rows they serve.
                let serve = |t: usize, loc: i64, direct: &[(u64, usize)]| -> (bool, u64) {
                    let slots = host[t].slots() as i64;
                    if loc < slots {
                        return (false, loc as u64);
                    }
                    let row = direct.iter().find(|&&(_, p)| p as i64 == loc).unwrap().0;
                    (true, row)
                };
                for t in 0..2 {
                    let host_direct = &admitted[t].as_ref().unwrap().fallback;
                    let dev_direct: Vec<(u64, usize)> = (a.direct.iter())
                        .filter(|d| d.0 == t)
                        .map(|&(_, r, p)| (r, p))
                        .collect();
                    let mut sorted_host = host_direct.iter().map(|d| d.0).collect::<Vec<_>>();
                    let mut sorted_dev = dev_direct.iter().map(|d| d.0).collect::<Vec<_>>();
                    sorted_host.sort_unstable();
                    sorted_dev.sort_unstable();
                    assert_eq!(sorted_host, sorted_dev, "{policy:?} tick {tick} table {t}");
                    for p in ranges.positions(t) {
                        assert_eq!(
                            serve(t, host_loc[p], host_direct),
                            serve(t, dev_loc[p], &dev_direct),
                            "{policy:?} tick {tick} table {t} position {p}"
                        );
                    }
                    assert_eq!(
                        admitted[t].as_ref().unwrap().moves,
                        moves[t],
                        "{policy:?} tick {tick} table {t}"
                    );
                    let [hits, installed, direct, evictions, written] = a.counts[t];
                    let dirty = moves[t].iter().filter(|m| m.1.is_some()).count();
                    assert_eq!(written, dirty as u64);
                    let s = &stats[t];
                    assert_eq!(
                        s.unique_ids - before[t].unique_ids,
                        hits + installed + direct
                    );
                    assert_eq!(
                        s.unique_misses - before[t].unique_misses,
                        installed + direct
                    );
                    assert_eq!(s.conflict_misses - before[t].conflict_misses, direct);
                    assert_eq!(s.evictions - before[t].evictions, evictions);
                }
                let locked: Vec<Vec<usize>> =
                    admitted.into_iter().map(|a| a.unwrap().locked).collect();
                // Every other batch updates its rows (dirty) and every third is dropped at once.
                if tick % 2 == 1 {
                    for (t, l) in locked.iter().enumerate() {
                        for &s in l {
                            host[t].set_dirty(s, true);
                        }
                    }
                    dev.mark_dirty(&a.locked, a.locked_len).unwrap();
                }
                held.push((locked, a.locked, a.locked_len));
                if tick % 3 != 0 {
                    let (locked, slots, n) = held.remove(0);
                    for (t, l) in locked.iter().enumerate() {
                        for &s in l {
                            host[t].unlock(s);
                        }
                    }
                    dev.unlock(&slots, n).unwrap();
                }
                // Lookups of single rows agree too (cached or not).
                let probe: Vec<(usize, u64)> = (0..40)
                    .map(|k| (k % 2, rng.random_range(0..rows[k % 2] as u64)))
                    .collect();
                let want: Vec<Option<usize>> =
                    probe.iter().map(|&(t, r)| host[t].find(r)).collect();
                assert_eq!(dev.find(&probe).unwrap(), want, "{policy:?} tick {tick}");
                assert!(want.iter().any(Option::is_some) && want.iter().any(Option::is_none));
                let mut pulled: Vec<Directory> = [2, 3]
                    .iter()
                    .zip(&rows)
                    .map(|(&sets, &r)| Directory::new(sets, r, policy).unwrap())
                    .collect();
                dev.pull(&mut pulled).unwrap();
                for (h, p) in host.iter().zip(&pulled) {
                    let (h, p) = (h.raw(), p.raw());
                    assert_eq!(h.tags, p.tags, "{policy:?} tick {tick}");
                    assert_eq!(h.counts, p.counts, "{policy:?} tick {tick}");
                    for (x, y) in h.meta.iter().zip(p.meta) {
                        assert_eq!(
                            (x.stamp, x.locks, x.dirty),
                            (y.stamp, y.locks, y.dirty),
                            "{policy:?} tick {tick}"
                        );
                    }
                }
            }
            let conflicts: u64 = stats.iter().map(|s| s.conflict_misses).sum();
            let evictions: u64 = stats.iter().map(|s| s.evictions).sum();
            assert!(conflicts > 0 && evictions > 0, "{conflicts} {evictions}");
        }
    }
}
