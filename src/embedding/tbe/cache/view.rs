//! One table's share of everything a cache holds — its cache rows, its records in the file,
//! its directory and counters — borrowed apart from the other tables' so that tables are
//! admitted in parallel, and the admission of one table's ids.

use super::directory::Directory;
use super::{CacheStats, Move, Parts};

/// How many rows ahead lookups and data moves fetch their memory.
const AHEAD: usize = 8;

/// One table's cache rows (slots, then scratch rows), file records, directory and counters.
pub(crate) struct TableView<'a> {
    pub parts: Parts,
    pub weights: &'a mut [f32],
    pub state: [&'a mut [f32]; 2],
    /// The table's records in the file (`rows × record` floats, as bytes).
    pub file: &'a mut [u8],
    pub dir: &'a mut Directory,
    pub stats: &'a mut CacheStats,
    /// The cache rows are elsewhere (a GPU's memory; `weights` and `state` are empty): an
    /// admission returns its moves instead of making them.
    pub defer: bool,
}

/// What admitting one table's ids decided.
pub(crate) struct TableAdmission {
    /// The cache row of each id, in the order given.
    pub loc: Vec<i64>,
    /// Slots locked for the batch.
    pub locked: Vec<usize>,
    /// Rows served by direct reads and their scratch rows.
    pub fallback: Vec<(u64, usize)>,
    /// The data moves left to the caller (a deferring view), in order.
    pub moves: Vec<Move>,
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

    fn file_range(&self, row: u64) -> std::ops::Range<usize> {
        let bytes = self.parts.record() * 4;
        row as usize * bytes..(row as usize + 1) * bytes
    }

    /// Reads row `row`'s record from the file into `rec`.
    pub fn read(&self, row: u64, rec: &mut [f32]) {
        let range = self.file_range(row);
        bytemuck::cast_slice_mut::<f32, u8>(rec).copy_from_slice(&self.file[range]);
    }

    /// Writes `rec` as row `row`'s record in the file.
    pub fn write(&mut self, row: u64, rec: &[f32]) {
        let range = self.file_range(row);
        self.file[range].copy_from_slice(bytemuck::cast_slice(rec));
        self.stats.rows_written += 1;
    }

    /// Writes cache row `slot` back to the file as row `row`.
    pub fn write_back(&mut self, slot: usize, row: u64, rec: &mut [f32]) {
        self.gather(slot, rec);
        self.write(row, rec);
    }

    /// Asks the CPU to fetch what moving `new` into `slot` touches: the slot, and the records
    /// of `new` and of the slot's dirty row `old`, if any.
    fn prefetch_move(&self, slot: usize, old: Option<u64>, new: u64) {
        let prefetch = crate::embedding::tbe::cpu::pool::prefetch_lines::<false>;
        let dim = self.parts.dim;
        let bytes = self.parts.record() * 4;
        prefetch(self.weights[slot * dim..].as_ptr() as *const u8, dim * 4);
        for row in old.into_iter().chain([new]) {
            let at = self.file_range(row).start;
            prefetch(self.file[at..].as_ptr(), bytes);
        }
    }

    /// Reads row `row` from the file into cache row `idx`.
    pub fn load(&mut self, row: u64, idx: usize, rec: &mut [f32]) {
        self.read(row, rec);
        self.scatter(idx, rec);
        self.stats.rows_read += 1;
    }

    /// Admits the ids `ids` (rows of this table, in batch order) at `tick`: each distinct row
    /// is looked up; hits are locked first, so that no miss of the batch can evict them; then
    /// each miss (in row order) takes its set's victim, the victim written back if dirty, or
    /// is served by a scratch row (numbered from `slots`) when every way is locked.
    pub fn admit(&mut self, ids: &[u64], tick: u64) -> TableAdmission {
        let n = ids.len();
        // Sort (row, position) pairs, packed into one u64 when they fit.
        let narrow = n < (1 << 24) && ids.iter().all(|&r| r < (1 << 40));
        let pairs: Vec<(u64, usize)> = if narrow {
            let mut keys: Vec<u64> = (ids.iter().enumerate())
                .map(|(k, &r)| (r << 24) | k as u64)
                .collect();
            keys.sort_unstable();
            keys.iter()
                .map(|&x| (x >> 24, (x & 0xff_ffff) as usize))
                .collect()
        } else {
            let mut pairs: Vec<(u64, usize)> = ids.iter().copied().zip(0..).collect();
            pairs.sort_unstable();
            pairs
        };
        // Distinct rows and where each one's run of pairs starts.
        let mut rows = Vec::new();
        let mut starts = Vec::new();
        for (i, &(r, _)) in pairs.iter().enumerate() {
            if rows.last() != Some(&r) {
                rows.push(r);
                starts.push(i);
            }
        }
        starts.push(pairs.len());
        let slots = self.dir.slots();
        let mut loc = vec![0usize; rows.len()];
        let mut locked = Vec::new();
        let mut misses = Vec::new();
        // Sets are far apart in the directory: fetch a few rows ahead.
        for &r in rows.iter().take(AHEAD) {
            self.dir.prefetch(r);
        }
        for (k, &r) in rows.iter().enumerate() {
            if let Some(&next) = rows.get(k + AHEAD) {
                self.dir.prefetch(next);
            }
            self.dir.count(r);
            match self.dir.find(r) {
                Some(s) => {
                    self.dir.touch_and_lock(s, tick);
                    locked.push(s);
                    loc[k] = s;
                }
                None => misses.push(k),
            }
        }
        // First every miss's slot (directory only), then the data: each eviction written back
        // and each new row read in, with the rows a few moves ahead fetched meanwhile (they
        // are scattered over the file and the cache: every access a cache and TLB miss).
        let mut fallback = Vec::new();
        let mut moves: Vec<Move> = Vec::with_capacity(misses.len());
        for &k in &misses {
            let r = rows[k];
            match self.dir.victim(r) {
                Some(s) => {
                    let old = self.dir.row_of(s);
                    if old.is_some() {
                        self.stats.evictions += 1;
                    }
                    let dirty = old.filter(|_| self.dir.is_dirty(s));
                    moves.push((s, dirty, r));
                    self.dir.install(s, r);
                    self.dir.touch_and_lock(s, tick);
                    locked.push(s);
                    loc[k] = s;
                }
                None => {
                    loc[k] = slots + fallback.len();
                    fallback.push((r, loc[k]));
                }
            }
        }
        let mut rec = vec![0.0f32; self.parts.record()];
        let made = if self.defer { &[][..] } else { &moves[..] };
        for (i, &(s, old, r)) in made.iter().enumerate() {
            if let Some(&(s, old, r)) = moves.get(i + AHEAD) {
                self.prefetch_move(s, old, r);
            }
            if let Some(old) = old {
                self.write_back(s, old, &mut rec);
            }
            self.load(r, s, &mut rec);
        }
        let st = &mut *self.stats;
        st.calls += 1;
        st.requested_ids += n as u64;
        st.unique_ids += rows.len() as u64;
        st.unique_misses += misses.len() as u64;
        st.conflict_misses += fallback.len() as u64;
        let mut out = vec![0i64; n];
        for (k, w) in starts.windows(2).enumerate() {
            for &(_, pos) in &pairs[w[0]..w[1]] {
                out[pos] = loc[k] as i64;
            }
        }
        TableAdmission {
            loc: out,
            locked,
            fallback,
            moves: if self.defer { moves } else { Vec::new() },
        }
    }
}
