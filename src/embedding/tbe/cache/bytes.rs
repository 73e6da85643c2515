//! The byte-form cache of an inference TBE: every table's stored rows (FP32 down to INT2, in
//! their quantized bytes) live in a row file ([`RowStore`]), and a DRAM cache of the same form
//! holds the rows in use — FBGEMM's inference cache, on a host, over a file.
//!
//! Same directories, sizes, policies and counters as the training cache, but read-only: rows
//! change only through the operator's setters, which write the file and refresh any cached copy,
//! so no cached row is ever dirty and an eviction is a directory change only. A lookup admits
//! its rows (hits locked first, then each miss read into its set's victim; a miss whose set is
//! wholly locked by the same lookup — a conflict miss — read into a scratch row after the
//! slots), runs the host quantized kernels on the cache rows with the batch's ids remapped to
//! them, and unlocks. When the first rows of an admission come slowly (the file is not in the
//! page cache: each a page fault to the disk), the kernel is asked for all the others' pages at
//! once, so the disk serves them together — 4.5× faster on the bench machine's disk than one
//! fault at a time, and skipped when the file is cached, where the hints would cost more than
//! the copies. Lookups take the cache's lock for their whole length, so concurrent
//! lookups of one operator run one after another.

use parking_lot::Mutex;
use rayon::prelude::*;

use super::directory::{Directory, TableAdmission, AHEAD, WAYS};
use super::store::{DiskProbe, RowStore, Staged, StoreTable, PROBE};
use super::{sets_for, CacheConfig, CachePolicy, CacheStats, TablePositions, OP};
use crate::embedding::input::{Batch, Ids};
use crate::embedding::storage::RowBuffer;
use crate::embedding::tbe::cpu::pool::prefetch_lines;
use crate::{Error, Result};

mod gpu;

pub(crate) use gpu::GpuShape;

/// Tables of quantized rows in a file, cached in DRAM or in a GPU's memory.
pub(crate) struct ByteCache {
    /// Declared before `store`: a GPU cache's registration of the store's memory goes first.
    state: Mutex<CacheState>,
    store: RowStore,
    /// Bytes per row, per table.
    row_bytes: Vec<usize>,
    policy: CachePolicy,
}

/// What a lookup changes: directories, counters and cache rows.
struct CacheState {
    dirs: Vec<Directory>,
    stats: Vec<CacheStats>,
    /// Scratch rows per table (after its slots).
    scratch: Vec<usize>,
    /// Every table's cache rows (slots, then scratch rows), table `t` from `starts[t]` (none
    /// while the cache is on a GPU).
    rows: RowBuffer<u8>,
    starts: Vec<usize>,
    tick: u64,
    /// The cache on a GPU: its rows and directory there, current rather than the above.
    gpu: Option<gpu::GpuRows>,
}

/// Byte offsets of each table's cache rows (`slots + scratch` rows of `row_bytes`, each table
/// starting at a multiple of `align`), and the end.
fn starts_for(
    slots: &[usize],
    scratch: &[usize],
    row_bytes: &[usize],
    align: usize,
) -> Result<Vec<usize>> {
    let mut starts = Vec::with_capacity(slots.len() + 1);
    let mut at = 0usize;
    let overflow = || Error::invalid(OP, "the cache's size overflows");
    for ((&n, &s), &rb) in slots.iter().zip(scratch).zip(row_bytes) {
        at = at.checked_next_multiple_of(align).ok_or_else(overflow)?;
        starts.push(at);
        at = (n + s)
            .checked_mul(rb)
            .and_then(|n| n.checked_add(at))
            .ok_or_else(overflow)?;
    }
    starts.push(at);
    Ok(starts)
}

/// Slots per table.
fn slots_of(dirs: &[Directory]) -> Vec<usize> {
    dirs.iter().map(Directory::slots).collect()
}

/// Scratch rows per table giving each table `t` room for `need[t]` at least: a table that
/// needs more gets that many, or twice what it had.
fn grown_scratch(scratch: &[usize], need: &[usize]) -> Vec<usize> {
    (scratch.iter().zip(need))
        .map(|(&s, &n)| if n > s { n.max(s * 2) } else { s })
        .collect()
}

impl ByteCache {
    /// A cache of `cache.size` over a new all-zero row file at `cache.path` (anonymous host
    /// memory when empty) for tables of `(rows, bytes per row)` called `names`.
    pub(crate) fn create(
        cache: &CacheConfig,
        tables: &[(usize, usize)],
        names: &[String],
    ) -> Result<Self> {
        let per_row = if cache.policy == CachePolicy::Lfu {
            4
        } else {
            0
        };
        let sets = sets_for(cache.size, tables, per_row)?;
        // The directories and cache rows first: one refused (no memory for them) leaves no
        // file.
        let dirs: Vec<Directory> = (sets.iter().zip(tables))
            .map(|(&n, &(rows, _))| Directory::new(n, rows, cache.policy))
            .collect::<Result<_>>()?;
        let row_bytes: Vec<usize> = tables.iter().map(|&(_, b)| b).collect();
        let scratch = vec![0; tables.len()];
        let starts = starts_for(&slots_of(&dirs), &scratch, &row_bytes, 1)?;
        let rows = RowBuffer::zeros(starts[tables.len()])?;
        let store = RowStore::create(&cache.path, tables)?;
        let stats = (names.iter().zip(&dirs))
            .map(|(name, d)| CacheStats::empty(name.clone(), d.slots()))
            .collect();
        Ok(ByteCache {
            store,
            row_bytes,
            policy: cache.policy,
            state: Mutex::new(CacheState {
                dirs,
                stats,
                scratch,
                rows,
                starts,
                tick: 0,
                gpu: None,
            }),
        })
    }

    /// Table `t`'s rows as the file holds them (always current: cached rows are never dirty);
    /// a file of the wrong length (truncated under the operator) is an error naming it, not
    /// a read past its end.
    pub(crate) fn table_bytes(&self, t: usize) -> Result<&[u8]> {
        self.store.check_len()?;
        Ok(self.store.table_bytes(t))
    }

    /// Writes rows `first..` of table `t` (whole rows of its stored bytes) to the file, and
    /// the cached copies of those rows, if any.
    pub(crate) fn write_rows(&mut self, t: usize, first: usize, bytes: &[u8]) -> Result<()> {
        self.store.check_len()?;
        let rb = self.row_bytes[t];
        self.store.write_bytes(t, first, bytes);
        let n = (bytes.len() / rb) as u64;
        if self.refresh_on_gpu(t, first, n as usize)? {
            return Ok(());
        }
        let st = self.state.get_mut();
        let start = st.starts[t];
        let rows = first as u64..first as u64 + n;
        let dir = &st.dirs[t];
        // Few rows (a chunk of a big table): each looked up in its set; many: one pass over
        // the directory.
        let cached: Vec<(usize, u64)> = if n.saturating_mul(WAYS as u64) < dir.slots() as u64 {
            (rows.clone())
                .filter_map(|r| dir.find(r).map(|s| (s, r)))
                .collect()
        } else {
            (dir.occupied()).filter(|(_, r)| rows.contains(r)).collect()
        };
        for (slot, row) in cached {
            let at = start + slot * rb;
            let from = (row - first as u64) as usize * rb;
            st.rows[at..at + rb].copy_from_slice(&bytes[from..from + rb]);
        }
        Ok(())
    }

    /// Stages new rows for every table beside the live ones (a new row file, or anonymous
    /// memory): `fill(bytes, layout)` writes them, table `t`'s row `r` at
    /// `layout[t].offset + r · layout[t].record_bytes`. Nothing changes until
    /// [`commit_rows`](Self::commit_rows); an error removes what was staged.
    pub(crate) fn stage_rows(
        &self,
        fill: impl FnOnce(&mut [u8], &[StoreTable]) -> Result<()>,
    ) -> Result<Staged> {
        self.store.stage_new(fill)
    }

    /// Makes staged rows the live ones (a rename: on an error nothing changed) and the cached
    /// copies theirs.
    pub(crate) fn commit_rows(&mut self, staged: Staged) -> Result<()> {
        self.store.commit(staged)?;
        if self.forget_on_gpu() {
            return Ok(());
        }
        let st = self.state.get_mut();
        for (t, dir) in st.dirs.iter().enumerate() {
            let (start, rb) = (st.starts[t], self.row_bytes[t]);
            for (slot, row) in dir.occupied() {
                let at = start + slot * rb;
                self.store
                    .read_bytes(t, row as usize, &mut st.rows[at..at + rb]);
            }
        }
        Ok(())
    }

    /// Flushes the file to the disk.
    pub(crate) fn sync(&self) -> Result<()> {
        self.store.sync_file()
    }

    /// The counters of every table.
    pub(crate) fn stats(&self) -> Vec<CacheStats> {
        self.state.lock().stats.clone()
    }

    /// Zeroes the counters.
    pub(crate) fn reset_stats(&self) {
        for s in &mut self.state.lock().stats {
            s.reset();
        }
    }

    /// Bytes of the cache rows (scratch included) and the directories, on the host and, when
    /// the cache is on a GPU, there.
    pub(crate) fn allocated_bytes(&self) -> usize {
        let st = self.state.lock();
        st.rows.allocated_bytes()
            + st.dirs.iter().map(Directory::bytes).sum::<usize>()
            + Self::gpu_bytes(&st)
    }

    /// Runs `lookup` on the cache with `batch` (validated against the logical tables) admitted:
    /// `lookup` gets the batch with its ids remapped to cache rows and each table's cache rows
    /// (`table_rows(t)`: slots then scratch rows, in the stored form). The batch's slots are
    /// unlocked when it returns.
    pub(crate) fn with_admitted<R>(
        &self,
        batch: &Batch<'_>,
        feature_table_map: &[usize],
        lookup: impl for<'r> FnOnce(&Batch<'_>, &'r (dyn Fn(usize) -> &'r [u8] + Sync)) -> R,
    ) -> Result<R> {
        self.store.check_len()?;
        let mut guard = self.state.lock();
        let st = &mut *guard;
        if st.gpu.is_some() {
            return Err(Error::invalid(
                OP,
                "the cache is on a GPU: lookups run there",
            ));
        }
        st.tick += 1;
        let tick = st.tick;
        let tables = self.row_bytes.len();
        let ranges = TablePositions::new(feature_table_map, tables, batch);
        // Decide every table's slots (in parallel), then give room to the conflict misses.
        let admitted: Vec<_> = (st.dirs.par_iter_mut().zip(&mut st.stats).enumerate())
            .map(|(t, (dir, stats))| {
                ranges
                    .read(t)
                    .then(|| dir.admit(&ranges.ids(t, batch), tick, stats))
            })
            .collect();
        let need: Vec<usize> = (admitted.iter())
            .map(|a| a.as_ref().map_or(0, |a| a.fallback.len()))
            .collect();
        let grown = match need.iter().zip(&st.scratch).any(|(n, s)| n > s) {
            true => st.grow_scratch(&need, &self.row_bytes),
            false => Ok(()),
        };
        // Read every new row into its slot or scratch row, tables in parallel. Without room
        // for the scratch rows, the slots' rows are read all the same before the error: the
        // directories name them already, and later lookups would find another row's bytes.
        let fallbacks = grown.is_ok();
        let mut rest: &mut [u8] = &mut st.rows;
        let mut table_rows = Vec::with_capacity(tables);
        for t in 0..tables {
            let (head, tail) =
                std::mem::take(&mut rest).split_at_mut(st.starts[t + 1] - st.starts[t]);
            table_rows.push(head);
            rest = tail;
        }
        let store = &self.store;
        let row_bytes = &self.row_bytes;
        (table_rows
            .into_par_iter()
            .zip(&admitted)
            .zip(&mut st.stats)
            .enumerate())
        .for_each(|(t, ((rows, a), stats))| {
            let Some(a) = a else { return };
            let rb = row_bytes[t];
            let file = store.table_bytes(t);
            let reads: Vec<(u64, usize)> = (a.moves.iter())
                .map(|&(slot, _, row)| (row, slot))
                .chain(a.fallback.iter().copied().filter(|_| fallbacks))
                .collect();
            let probe = DiskProbe::start();
            for (i, &(row, at)) in reads.iter().enumerate() {
                if probe.slow_at(i) {
                    // Page faults to the disk: ask for every other page now, so the reads
                    // wait on the disk together rather than one after another.
                    store.will_need(t, reads[PROBE..].iter().map(|&(row, _)| row));
                }
                if let Some(&(next, _)) = reads.get(i + AHEAD) {
                    prefetch_lines::<false>(file[next as usize * rb..].as_ptr(), rb);
                }
                let from = row as usize * rb;
                rows[at * rb..(at + 1) * rb].copy_from_slice(&file[from..from + rb]);
            }
            stats.rows_read += reads.len() as u64;
        });
        if let Err(e) = grown {
            st.unlock(&admitted);
            return Err(e);
        }
        let mut remapped = vec![0i64; batch.ids.len()];
        ranges.place(&admitted, &mut remapped);
        let remapped = Batch {
            ids: Ids::I64(remapped.into()),
            offsets: batch.offsets.clone(),
            weights: batch.weights.clone(),
            batch_size: batch.batch_size,
            num_features: batch.num_features,
            kept: batch.kept.clone(),
        };
        let (rows, starts) = (&st.rows, &st.starts);
        let out = lookup(&remapped, &|t| &rows[starts[t]..starts[t + 1]]);
        st.unlock(&admitted);
        Ok(out)
    }
}

impl CacheState {
    /// Releases the slots an admission locked.
    fn unlock(&mut self, admitted: &[Option<TableAdmission>]) {
        for (dir, a) in self.dirs.iter_mut().zip(admitted) {
            for &s in a.iter().flat_map(|a| &a.locked) {
                dir.unlock(s);
            }
        }
    }

    /// Gives each table `t` room for `need[t]` scratch rows at least (keeping every cached row).
    fn grow_scratch(&mut self, need: &[usize], row_bytes: &[usize]) -> Result<()> {
        #[cfg(test)]
        if FAIL_GROWTH.with(|f| f.take()) {
            return Err(Error::invalid(OP, "no memory for scratch rows (test)"));
        }
        let scratch = grown_scratch(&self.scratch, need);
        let starts = starts_for(&slots_of(&self.dirs), &scratch, row_bytes, 1)?;
        let mut rows = RowBuffer::zeros(starts[self.dirs.len()])?;
        for (t, d) in self.dirs.iter().enumerate() {
            let len = d.slots() * row_bytes[t];
            rows[starts[t]..starts[t] + len]
                .copy_from_slice(&self.rows[self.starts[t]..self.starts[t] + len]);
        }
        (self.scratch, self.rows, self.starts) = (scratch, rows, starts);
        Ok(())
    }
}

#[cfg(test)]
thread_local! {
    /// Makes the next growth of scratch rows on this thread fail (as an allocation would).
    static FAIL_GROWTH: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

#[cfg(test)]
mod tests {
    use super::FAIL_GROWTH;
    use crate::embedding::{
        CacheConfig, CacheSize, PoolingMode, QuantizedTableBatchedEmbedding, TableSpec, TbeInput,
        WeightType,
    };

    /// A lookup whose conflict misses need more scratch rows than the allocator gives fails,
    /// and leaves the cache whole: the rows it had admitted are read into their slots, so the
    /// next lookups (hits for them) equal those of the rows in memory. A truncated row file
    /// read whole is an error naming it.
    #[test]
    fn a_failed_scratch_growth_leaves_no_slot_without_its_row() {
        let tables = vec![TableSpec::new("a", 200, 8)];
        let types = vec![WeightType::Int8];
        let make = |cache: Option<&CacheConfig>| match cache {
            None => QuantizedTableBatchedEmbedding::new(
                tables.clone(),
                types.clone(),
                vec![0],
                PoolingMode::Sum,
            ),
            Some(c) => QuantizedTableBatchedEmbedding::new_cached(
                tables.clone(),
                types.clone(),
                vec![0],
                PoolingMode::Sum,
                c,
            ),
        };
        let dir = std::env::temp_dir().join(format!("embers-scratch-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        // One set of 32 slots for 200 rows.
        let cache = CacheConfig::new(dir.join("a.rows"), CacheSize::LoadFactor(0.01));
        let (mut memory, mut cached) = (make(None).unwrap(), make(Some(&cache)).unwrap());
        let values: Vec<f32> = (0..200 * 8).map(|i| (i % 37) as f32 / 9.0 - 2.0).collect();
        memory.quantize_table_from(0, &values).unwrap();
        cached.quantize_table_from(0, &values).unwrap();
        // 40 distinct rows: 32 installed, 8 conflict misses needing scratch rows.
        let ids: Vec<i64> = (0..40).map(|i| i * 5).collect();
        let offsets: Vec<i64> = (0..=40).step_by(4).collect();
        let input = || TbeInput::new(&ids[..], &offsets[..]);
        FAIL_GROWTH.with(|f| f.set(true));
        let err = cached.forward(input()).unwrap_err().to_string();
        assert!(err.contains("scratch rows (test)"), "{err}");
        let want = memory.forward(input()).unwrap().to_vec::<f32>().unwrap();
        for _ in 0..2 {
            let got = cached.forward(input()).unwrap().to_vec::<f32>().unwrap();
            assert!(got == want, "lookups after the failure differ");
        }
        assert!(cached.cache_stats().unwrap()[0].unique_ids > 0);
        (std::fs::OpenOptions::new().write(true))
            .open(dir.join("a.rows"))
            .unwrap()
            .set_len(10)
            .unwrap();
        let err = cached.table_bytes(0).unwrap_err().to_string();
        assert!(
            err.contains("a.rows: 10 bytes") && err.contains("truncated"),
            "{err}"
        );
        drop(cached);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
