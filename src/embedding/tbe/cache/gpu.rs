//! The GPU half of a cache: an admission's deferred row moves (dirty victims down from the
//! device and into the store, new rows from the store and up, each in one pinned transfer; the
//! store's side in chunks over every core) and the backward on the GPU cache rows.

use rayon::prelude::*;

use super::{CacheRows, CachedBatch, CachedTables, Move, Parts};
use crate::embedding::optimizer::{FusedOptimizer, WeightDecay};
use crate::embedding::tbe::cuda::BackwardInput;
use crate::tensor::RowSparseGrad;
use crate::{Result, Tensor};

/// One table's records in the mapped file, read and written from several threads at once, each
/// record by one thread only.
struct FileRows {
    ptr: *mut u8,
    len: usize,
    /// Floats per record.
    record: usize,
}

// SAFETY: the callers of `read` and `write` keep every record to one thread at a time.
unsafe impl Sync for FileRows {}

impl FileRows {
    fn range(&self, row: u64) -> std::ops::Range<usize> {
        let bytes = self.record * 4;
        let start = row as usize * bytes;
        assert!(
            start + bytes <= self.len,
            "row {row} is outside the table's records"
        );
        start..start + bytes
    }

    /// Writes `rec` as row `row`'s record.
    ///
    /// # Safety
    /// No other thread reads or writes row `row` meanwhile.
    unsafe fn write(&self, row: u64, rec: &[f32]) {
        let range = self.range(row);
        let src = bytemuck::cast_slice::<f32, u8>(rec);
        assert_eq!(src.len(), range.len());
        // SAFETY: the range lies inside the mapping (checked) and only this thread uses it.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), self.ptr.add(range.start), src.len()) }
    }

    /// Reads row `row`'s record into `rec`.
    ///
    /// # Safety
    /// No other thread writes row `row` meanwhile.
    unsafe fn read(&self, row: u64, rec: &mut [f32]) {
        let range = self.range(row);
        let dst = bytemuck::cast_slice_mut::<f32, u8>(rec);
        assert_eq!(dst.len(), range.len());
        // SAFETY: as in write.
        unsafe {
            std::ptr::copy_nonoverlapping(self.ptr.add(range.start), dst.as_mut_ptr(), dst.len())
        }
    }
}

impl CachedTables {
    /// Carries out the moves a GPU cache's admission deferred: the dirty victims come down
    /// in one transfer, then the moves (in chunks over every core) write the victims to the
    /// store and read the new rows into the staging buffer, which goes up in one transfer.
    pub(super) fn apply_moves(&mut self, moves: &[Vec<Move>]) -> Result<()> {
        let evicted: Vec<(usize, usize)> = (moves.iter().enumerate())
            .flat_map(|(t, m)| (m.iter()).filter_map(move |&(s, old, _)| old.map(|_| (t, s))))
            .collect();
        let loaded: Vec<(usize, usize)> = (moves.iter().enumerate())
            .flat_map(|(t, m)| m.iter().map(move |&(s, _, _)| (t, s)))
            .collect();
        let starts = self.starts();
        let (evicted_at, loaded_at) = (
            self.record_at(&starts, &evicted),
            self.record_at(&starts, &loaded),
        );
        let record: Vec<usize> = self.parts.iter().map(Parts::record).collect();
        let load_len = loaded.iter().map(|&(t, _)| record[t]).sum();
        // The staging buffers' last moves, and other writes into the cache rows, may have
        // been queued on another stream (the prefetch stream, or the caller's).
        self.after_moves()?;
        let mut staging = std::mem::take(&mut self.staging);
        let CacheRows::Device(d) = &self.rows else {
            unreachable!("only a GPU cache defers its moves");
        };
        let t0 = std::time::Instant::now();
        let victims = d.take_staged(&evicted_at, &mut staging.at, &mut staging.down)?;
        let loads = d.stage_up(load_len, &mut staging.up)?;
        let t1 = std::time::Instant::now();
        // Every table's moves in chunks, all in parallel: the rows written (the victims,
        // cached rows, each in one slot) and the rows read (misses, not cached) are distinct
        // rows, so no two chunks touch the same record.
        let mut files = Vec::with_capacity(moves.len());
        for mut view in self.views() {
            // A GPU cache's store has no log; folded, were there one.
            let file = view.file.folded();
            files.push(FileRows {
                ptr: file.as_mut_ptr(),
                len: file.len(),
                record: view.parts.record(),
            });
        }
        // Each chunk's share of the victims' records and of the loaded records (both in move
        // order, table by table).
        const CHUNK: usize = 1024;
        let (mut v, mut l) = (victims, &mut loads[..]);
        let mut chunks = Vec::new();
        for (t, m) in moves.iter().enumerate() {
            let n = record[t];
            for m in m.chunks(CHUNK) {
                let dirty = m.iter().filter(|mv| mv.1.is_some()).count();
                let (vc, rest) = v.split_at(dirty * n);
                v = rest;
                let (lc, rest) = std::mem::take(&mut l).split_at_mut(m.len() * n);
                l = rest;
                chunks.push((t, m, vc, lc));
            }
        }
        chunks.into_par_iter().for_each(|(t, m, v, l)| {
            let (file, n) = (&files[t], record[t]);
            let mut victims = v.chunks(n);
            for (&(_, old, new), rec) in m.iter().zip(l.chunks_mut(n)) {
                if let Some(old) = old {
                    let victim = victims.next().expect("one record per dirty victim");
                    // SAFETY: distinct rows (above); the file outlives the loop.
                    unsafe { file.write(old, victim) };
                }
                // SAFETY: as above.
                unsafe { file.read(new, rec) };
            }
        });
        for (t, m) in moves.iter().enumerate() {
            self.stats[t].rows_read += m.len() as u64;
            self.stats[t].rows_written += m.iter().filter(|mv| mv.1.is_some()).count() as u64;
        }
        let t2 = std::time::Instant::now();
        let CacheRows::Device(d) = &self.rows else {
            unreachable!("only a GPU cache defers its moves");
        };
        let put = d.put_staged(&loaded_at, &mut staging.at, &mut staging.up);
        self.staging = staging;
        self.fence()?;
        self.times.transfer += t1 - t0 + t2.elapsed();
        self.times.file += t2 - t1;
        put
    }

    /// The fused backward of an admitted batch on a GPU cache (`grad_output` on the GPU):
    /// the per-sample weights' gradient (the kernel's, in kept positions) and, with
    /// [`FusedOptimizer::None`], every table's row-sparse gradient in table rows.
    pub(crate) fn backward_device(
        &mut self,
        batch: &CachedBatch,
        grad_output: &Tensor,
        optimizer: FusedOptimizer,
        decay: WeightDecay,
        step: u64,
    ) -> Result<(Option<Tensor>, Option<Vec<RowSparseGrad>>)> {
        self.check_admitted(batch)?;
        let fallback = &batch.lease.fallback;
        self.store.check_len()?;
        self.sync_scratch(fallback, true)?;
        let (CacheRows::Device(tables), Some(on_device)) = (&mut self.rows, &batch.on_device)
        else {
            return Err(crate::embedding::tbe::moved_error());
        };
        let grads = tables.backward(BackwardInput {
            batch: on_device,
            grad_output,
            optimizer,
            decay,
            step,
            weights_grad: on_device.weights.is_some(),
        })?;
        self.after_backward(batch, optimizer != FusedOptimizer::None)?;
        let sparse = match grads.sparse {
            None => None,
            Some((rows, values)) => {
                let row_offsets = &self.layout.row_offsets;
                let mut per_table = Vec::with_capacity(self.cfg.tables.len());
                for (t, spec) in self.cfg.tables.iter().enumerate() {
                    let (first, end) = (row_offsets[t] as i64, row_offsets[t + 1] as i64);
                    let a = rows.partition_point(|&r| r < first);
                    let b = rows.partition_point(|&r| r < end);
                    let idx = rows[a..b].iter().map(|&r| (r - first) as usize);
                    let order = self.by_table_row(t, idx, fallback)?;
                    let positions: Vec<i64> = order.iter().map(|&(_, k)| k as i64).collect();
                    let positions =
                        Tensor::from_vec(positions, &[order.len()])?.to_device(self.device())?;
                    let values = (values.narrow(0, a, b - a)?.narrow(1, 0, spec.dim)?)
                        .contiguous()?
                        .index_select(&positions)?;
                    per_table.push(RowSparseGrad {
                        rows: order.iter().map(|&(r, _)| r).collect(),
                        values,
                        // The logical table's rows (the spec here is cache-shaped).
                        num_rows: self.store.table(t).rows,
                    });
                }
                Some(per_table)
            }
        };
        Ok((grads.weights_grad, sparse))
    }
}
