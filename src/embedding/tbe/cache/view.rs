//! One table's share of everything a cache holds — its cache rows, its records in the file,
//! its directory and counters — borrowed apart from the other tables' so that tables are
//! admitted in parallel, and the admission of one table's ids.

use super::directory::{Directory, TableAdmission, AHEAD};
use super::log::TableFile;
use super::store::{will_need, DiskProbe, PROBE};
use super::{CacheStats, Parts};

/// One table's cache rows (slots, then scratch rows), file records, directory and counters.
pub(crate) struct TableView<'a> {
    pub parts: Parts,
    pub weights: &'a mut [f32],
    pub state: [&'a mut [f32]; 2],
    /// The table's records in the file (`rows × record` floats, as bytes), and its write log.
    pub file: TableFile<'a>,
    pub dir: &'a mut Directory,
    pub stats: &'a mut CacheStats,
    /// The cache rows are elsewhere (a GPU's memory; `weights` and `state` are empty): an
    /// admission returns its moves instead of making them.
    pub defer: bool,
}

impl TableView<'_> {
    /// Copies cache row `idx` (weights, then state) into `rec`.
    pub fn gather(&self, idx: usize, rec: &mut [f32]) {
        let p = self.parts;
        rec[p.range(0)].copy_from_slice(&self.weights[idx * p.dim..(idx + 1) * p.dim]);
        for i in 0..2 {
            let n = p.state[i];
            rec[p.range(i + 1)].copy_from_slice(&self.state[i][idx * n..(idx + 1) * n]);
        }
    }

    /// Writes `rec` into cache row `idx`.
    pub fn scatter(&mut self, idx: usize, rec: &[f32]) {
        let p = self.parts;
        self.weights[idx * p.dim..(idx + 1) * p.dim].copy_from_slice(&rec[p.range(0)]);
        for i in 0..2 {
            let n = p.state[i];
            self.state[i][idx * n..(idx + 1) * n].copy_from_slice(&rec[p.range(i + 1)]);
        }
    }

    /// Reads row `row`'s record from the file (or its log) into `rec`.
    pub fn read(&self, row: u64, rec: &mut [f32]) {
        self.file.read(row, bytemuck::cast_slice_mut(rec));
    }

    /// Writes `rec` as row `row`'s record (to the log, if the file has one).
    pub fn write(&mut self, row: u64, rec: &[f32]) {
        self.file.write(row, bytemuck::cast_slice(rec));
        self.stats.rows_written += 1;
    }

    /// Writes cache row `slot` back to the file as row `row`.
    pub fn write_back(&mut self, slot: usize, row: u64, rec: &mut [f32]) {
        self.gather(slot, rec);
        self.write(row, rec);
    }

    /// Asks the CPU to fetch what moving `new` into `slot` touches: the slot, the record of
    /// `new` and, written in place, that of the slot's dirty row `old` (a log's tail needs
    /// no fetching).
    fn prefetch_move(&self, slot: usize, old: Option<u64>, new: u64) {
        let prefetch = crate::embedding::tbe::cpu::pool::prefetch_lines::<false>;
        let dim = self.parts.dim;
        let bytes = self.parts.record() * 4;
        prefetch(self.weights[slot * dim..].as_ptr() as *const u8, dim * 4);
        let old = old.filter(|_| !self.file.has_log());
        for row in old.into_iter().chain([new]) {
            prefetch(self.file.get(row).as_ptr(), bytes);
        }
    }

    /// Reads row `row` from the file into cache row `idx`.
    pub fn load(&mut self, row: u64, idx: usize, rec: &mut [f32]) {
        self.read(row, rec);
        self.scatter(idx, rec);
        self.stats.rows_read += 1;
    }

    /// Admits the ids `ids` (rows of this table, in batch order) at `tick`
    /// ([`Directory::admit`]), then makes its moves — each eviction written back if dirty, each
    /// new row read in — with the rows a few moves ahead fetched meanwhile (they are scattered
    /// over the file and the cache: every access a cache and TLB miss). When the first moves
    /// come slowly (the file is not in the page cache), the kernel is asked for every other
    /// move's pages at once ([`DiskProbe`]). A deferring view returns its moves instead.
    pub fn admit(&mut self, ids: &[u64], tick: u64) -> TableAdmission {
        let mut admission = self.dir.admit(ids, tick, self.stats);
        if self.defer {
            return admission;
        }
        let moves = std::mem::take(&mut admission.moves);
        let mut rec = vec![0.0f32; self.parts.record()];
        let probe = DiskProbe::start();
        for (i, &(s, old, r)) in moves.iter().enumerate() {
            if probe.slow_at(i) {
                // Page faults to the disk: ask for the pages of every other move's records
                // (the write-backs' too, written in place: writing a record reads its page
                // first).
                for &(_, old, r) in &moves[PROBE..] {
                    let old = old.filter(|_| !self.file.has_log());
                    for row in old.into_iter().chain([r]) {
                        will_need(self.file.get(row));
                    }
                }
            }
            if let Some(&(s, old, r)) = moves.get(i + AHEAD) {
                self.prefetch_move(s, old, r);
            }
            if let Some(old) = old {
                self.write_back(s, old, &mut rec);
            }
            self.load(r, s, &mut rec);
        }
        admission
    }
}
