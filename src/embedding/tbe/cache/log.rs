//! The write log of a training cache's row file: rows written back one at a time (evictions,
//! direct reads, flushes) are appended to a log beside the file instead of written in place,
//! and folded into the file, in row order, when the log is full or the file is wanted whole
//! (a flush, a checkpoint, a GPU taking the moves over).
//!
//! Why: a record (the row with its optimizer state, a few hundred bytes) written in place
//! dirties the whole page that holds it, and each page the kernel writes back costs a page
//! fault when it is dirtied again and a TLB shootdown when it is cleaned: write-backs of
//! scattered rows turn into page-sized disk writes and a kernel busy with them. Appended, a
//! page takes every record it can hold before it is written; a fold dirties each page of the
//! file once for all the records the log gathered in it. (FBGEMM's SSD TBE keeps its rows in a
//! log-structured key-value store for the same reason.)
//!
//! The log has a region per table of as many records as the table has rows (so it is as large
//! as the file), or a half, a quarter or an eighth of that where the disk has less room: it
//! takes at most half the file system's free space, its blocks allocated up front, and with
//! no room even for an eighth the file is written in place. Records gather in a buffer per
//! table (a 16th of its cache rows' bytes, at most [`PENDING_BYTES`]) and reach the log by one
//! `pwrite` each time it fills; the log is mapped read-only, for reading records back, so the
//! kernel never has to write-protect a page of it when it writes it back. Where the file and
//! its log stay in memory, both are read through huge pages: nothing dirties them through their
//! mappings. It has no name: it is unlinked as soon as it is made, so it goes with the process
//! and a crash leaves nothing behind. It is not a checkpoint either: the row file holds the
//! rows once the cache is flushed, which folds the log first. A write to the log that fails
//! (an I/O error) folds what the region holds and writes that table in place from then on.
//!
//! An index of 4 bytes a row says where each row's current copy is: 0 in the file, `k` in the
//! log's record `k - 1` (later appends of a row make its earlier ones garbage).

use std::fs::{File, OpenOptions};
use std::path::Path;

use memmap2::Mmap;

/// Bytes of records a table gathers before they are written to its log region at once.
pub(crate) const PENDING_BYTES: usize = 256 << 10;

/// A fold writes the file in pieces of this many bytes (those holding a logged row).
const FOLD_BYTES: usize = 64 << 10;

#[cfg(test)]
thread_local! {
    /// Records per table region, and bytes gathered before a write, of the logs made on this
    /// thread (tests: folds and writes come sooner).
    pub(crate) static SHAPE: std::cell::Cell<Option<(usize, usize)>> =
        const { std::cell::Cell::new(None) };
    /// Bytes the file system of the logs made on this thread has free (tests: no disk fills).
    pub(crate) static FREE: std::cell::Cell<Option<u64>> = const { std::cell::Cell::new(None) };
}

/// One table's share of the log: its place in the log file, how many records of how many bytes
/// it holds, how many it has taken since it was last folded (the first `written` of them in
/// the file, the rest in `pending`), and where each row's current copy is.
pub(crate) struct LogRegion {
    offset: u64,
    slots: usize,
    record: usize,
    used: usize,
    written: usize,
    pending: Vec<u8>,
    /// Bytes `pending` gathers before they are written.
    spill_at: usize,
    index: Vec<u32>,
    /// A write to the log failed: the table is written in place from then on.
    broken: bool,
    /// Tests: the next write to the log fails.
    #[cfg(test)]
    pub(crate) fail: bool,
}

impl LogRegion {
    /// Where the region's records are in the log's bytes.
    fn range(&self) -> std::ops::Range<usize> {
        self.offset as usize..self.offset as usize + self.slots * self.record
    }

    /// Forgets every record taken: every row's copy is the file's again.
    fn reset(&mut self) {
        self.index.fill(0);
        self.used = 0;
        self.written = 0;
        self.pending.clear();
    }

    /// Logged record `k` (`bytes`: the region's part of the log's mapping).
    fn at<'b>(&'b self, bytes: &'b [u8], k: usize) -> &'b [u8] {
        let n = self.record;
        match k.checked_sub(self.written) {
            Some(p) => &self.pending[p * n..(p + 1) * n],
            None => &bytes[k * n..(k + 1) * n],
        }
    }

    /// Copies the logged rows among rows `first..` (`out`: a whole number of records, the
    /// file's copies) over their file copies.
    pub(crate) fn overlay(&self, bytes: &[u8], first: usize, out: &mut [u8]) {
        let n = self.record;
        if self.used == 0 || n == 0 {
            return;
        }
        let rows = out.len() / n;
        for (i, &k) in self.index[first..first + rows].iter().enumerate() {
            if let Some(k) = (k as usize).checked_sub(1) {
                out[i * n..(i + 1) * n].copy_from_slice(self.at(bytes, k));
            }
        }
    }

    /// Writes the pending records to the log file after the written ones.
    fn spill(&mut self, file: &File) -> std::io::Result<()> {
        #[cfg(test)]
        if std::mem::take(&mut self.fail) {
            return Err(std::io::Error::other("a failing log (test)"));
        }
        write_at(
            file,
            &self.pending,
            self.offset + (self.written * self.record) as u64,
        )?;
        self.written = self.used;
        self.pending.clear();
        Ok(())
    }
}

/// `pwrite` of all of `bytes` at `offset` of `file`.
fn write_at(file: &File, bytes: &[u8], offset: u64) -> std::io::Result<()> {
    #[cfg(unix)]
    {
        std::os::unix::fs::FileExt::write_all_at(file, bytes, offset)
    }
    #[cfg(not(unix))]
    {
        let _ = (file, bytes, offset);
        Err(std::io::Error::from(std::io::ErrorKind::Unsupported))
    }
}

/// The shares of its table's rows a log region may hold records for, tried in turn
/// ([`WriteLog::create`]).
const LOG_SHARES: [usize; 4] = [1, 2, 4, 8];

/// The regions of a log for `tables` (`(rows, bytes per record, bytes gathered)`), each of
/// `1/share` of its table's rows (at least one), and the log's length; `None` if it overflows.
/// Their indexes and buffers are not allocated yet.
fn regions_of(tables: &[(usize, usize, usize)], share: usize) -> Option<(Vec<LogRegion>, usize)> {
    #[cfg(test)]
    let shape = SHAPE.with(|s| s.get());
    #[cfg(not(test))]
    let shape: Option<(usize, usize)> = None;
    let mut regions = Vec::with_capacity(tables.len());
    let mut len = 0usize;
    for &(rows, record, gather) in tables {
        let slots = shape.map_or(rows.div_ceil(share), |(s, _)| s).max(1);
        // Whole records: a buffer spilled only once a record crosses its capacity would
        // have doubled it, past what the byte budget counted.
        let whole = (gather / record.max(1)).max(1) * record;
        let spill_at = shape.map_or(whole, |(_, b)| b);
        regions.push(LogRegion {
            offset: len as u64,
            slots,
            record,
            used: 0,
            written: 0,
            pending: Vec::new(),
            spill_at,
            index: Vec::new(),
            broken: false,
            #[cfg(test)]
            fail: false,
        });
        len = len.checked_add(slots.checked_mul(record)?)?;
    }
    Some((regions, len))
}

/// Bytes free to this process on the file system holding `dir` (`statvfs`); `None` where it
/// cannot be read.
fn free_bytes(dir: &Path) -> Option<u64> {
    #[cfg(test)]
    if let Some(free) = FREE.with(|f| f.get()) {
        return Some(free);
    }
    #[cfg(unix)]
    {
        use std::os::unix::ffi::OsStrExt;
        let c = std::ffi::CString::new(dir.as_os_str().as_bytes()).ok()?;
        let mut st = std::mem::MaybeUninit::<libc::statvfs>::uninit();
        // SAFETY: `c` is a NUL-terminated path; statvfs fills `st` on success only.
        if unsafe { libc::statvfs(c.as_ptr(), st.as_mut_ptr()) } != 0 {
            return None;
        }
        // SAFETY: statvfs returned 0: `st` is filled.
        let st = unsafe { st.assume_init() };
        // The fields are 32 bits wide on some systems.
        #[allow(clippy::unnecessary_cast)]
        Some((st.f_bavail as u64).saturating_mul(st.f_frsize as u64))
    }
    #[cfg(not(unix))]
    {
        let _ = dir;
        None
    }
}

/// The log of a row file: the unlinked file, mapped read-only, and each table's region.
pub(crate) struct WriteLog {
    map: Mmap,
    regions: Vec<LogRegion>,
    file: File,
}

impl WriteLog {
    /// A log beside the row file `path` for tables of `(rows, bytes per record, bytes of
    /// records gathered before they are written)`, read with small pages and no read-ahead
    /// ([`advise_huge`](Self::advise_huge) changes that), or `None` when it cannot be made (no
    /// room on the disk for it, a file system without allocation, a table too large for a
    /// 4-byte index, no Unix): the file is then written in place.
    ///
    /// Its regions hold as many records as their tables have rows, or a half, a quarter or an
    /// eighth of that, the largest that takes at most half the file system's free space
    /// (where `statvfs` cannot tell, the whole size if it can be allocated), a smaller one
    /// where the allocation finds the disk fuller than that: the log is scratch for speed,
    /// and must not take the room rows and checkpoints need. A smaller log folds more often
    /// (each fold writes every piece of the file that holds a logged row), which still costs
    /// far less than writing in place.
    pub(crate) fn create(path: &Path, tables: &[(usize, usize, usize)]) -> Option<Self> {
        if !cfg!(unix) || tables.iter().any(|&(rows, ..)| rows >= u32::MAX as usize) {
            return None;
        }
        // Free space unknown: every size is tried, and the allocation says which fits.
        let dir = path.parent().filter(|d| !d.as_os_str().is_empty());
        let free = free_bytes(dir.unwrap_or(Path::new("."))).unwrap_or(u64::MAX);
        let sizes: Vec<(Vec<LogRegion>, usize)> = (LOG_SHARES.iter())
            .filter_map(|&share| regions_of(tables, share))
            .filter(|&(_, len)| len > 0 && len as u64 <= free / 2)
            .collect();
        if sizes.is_empty() {
            return None;
        }
        let name = path.file_name()?.to_string_lossy();
        let at = path.with_file_name(format!(
            "{name}.log-{}-{:x}.tmp",
            std::process::id(),
            crate::checkpoint::clock_nanos()
        ));
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&at)
            .ok()?;
        // Unnamed from here on: nothing to clean up after a crash.
        let _ = std::fs::remove_file(&at);
        let mut chosen = None;
        for (regions, len) in sizes {
            match super::store::fallocate(&file, len as u64) {
                Ok(()) => {
                    chosen = Some(regions);
                    break;
                }
                // Less room than `statvfs` said (other writers, quotas, reserved blocks): the
                // blocks taken so far given back, the next smaller size is tried.
                Err(e) if matches!(e.raw_os_error(), Some(libc::ENOSPC | libc::EDQUOT)) => {
                    file.set_len(0).ok()?;
                }
                Err(_) => return None,
            }
        }
        let mut regions = chosen?;
        // SAFETY: an unlinked file of this process's own: no other process can open it, and its
        // length never changes.
        let map = unsafe { Mmap::map(&file) }.ok()?;
        super::store::advise_pages(&map, false);
        for (r, &(rows, record, _)) in regions.iter_mut().zip(tables) {
            r.index = vec![0; rows];
            r.pending = Vec::with_capacity(r.spill_at.min(r.slots * record));
        }
        Some(WriteLog { map, regions, file })
    }

    /// Bytes of the log file.
    pub(crate) fn len(&self) -> u64 {
        self.map.len() as u64
    }

    /// Has the log read through huge pages, its page cache filled with them now (the
    /// allocated blocks read as zeros, from no disk) so that the writes land in them. For a
    /// log that [stays in memory](super::store::reserve_huge).
    pub(crate) fn advise_huge(&self) {
        super::store::advise_pages(&self.map, true);
        #[cfg(target_os = "linux")]
        let _ = self.map.advise(memmap2::Advice::PopulateRead);
    }

    /// Bytes of host memory the log takes: its index and its buffers.
    pub(crate) fn host_bytes(&self) -> usize {
        (self.regions.iter())
            .map(|r| r.index.len() * 4 + r.pending.capacity())
            .sum()
    }

    /// Each table's region (its bytes, its state, the log file), in table order.
    pub(crate) fn regions_mut(&mut self) -> Vec<LogPart<'_>> {
        let (map, file) = (&self.map[..], &self.file);
        (self.regions.iter_mut())
            .map(|r| LogPart {
                bytes: &map[r.range()],
                region: r,
                file,
            })
            .collect()
    }

    /// Table `t`'s region as [`regions_mut`](Self::regions_mut) gives it.
    pub(crate) fn part(&mut self, t: usize) -> LogPart<'_> {
        let r = &mut self.regions[t];
        LogPart {
            bytes: &self.map[r.range()],
            region: r,
            file: &self.file,
        }
    }

    /// Table `t`'s region with its bytes.
    pub(crate) fn region(&self, t: usize) -> (&[u8], &LogRegion) {
        let r = &self.regions[t];
        (&self.map[r.range()], r)
    }

    /// Table `t`'s region, to be told to fail (tests).
    #[cfg(test)]
    pub(crate) fn region_mut(&mut self, t: usize) -> &mut LogRegion {
        &mut self.regions[t]
    }

    /// Where the log is mapped (tests).
    #[cfg(test)]
    pub(crate) fn addr(&self) -> usize {
        self.map.as_ptr() as usize
    }

    /// Whether no region holds a record.
    pub(crate) fn is_empty(&self) -> bool {
        self.regions.iter().all(|r| r.used == 0)
    }

    /// Forgets every appended record (the file under the log was replaced).
    pub(crate) fn clear(&mut self) {
        for r in &mut self.regions {
            if r.used > 0 {
                r.reset();
            }
        }
    }
}

/// One table's region of a write log: its bytes in the log's mapping, its state, the log file.
pub(crate) struct LogPart<'a> {
    bytes: &'a [u8],
    region: &'a mut LogRegion,
    file: &'a File,
}

/// One table's records: its part of the row file and, when the file has a write log, its
/// region of the log. Reads find a row's current copy; writes of one record go to the log.
pub(crate) struct TableFile<'a> {
    file: &'a mut [u8],
    record: usize,
    log: Option<LogPart<'a>>,
    /// The file `file` maps and where in it `file` starts, for a fold's writes.
    base: Option<(&'a File, u64)>,
}

impl<'a> TableFile<'a> {
    /// Table records `file` (`record` bytes each; mapped from `base`, the file and where they
    /// start in it, if given) and, if any, their log region.
    pub(crate) fn new(
        file: &'a mut [u8],
        record: usize,
        log: Option<LogPart<'a>>,
        base: Option<(&'a File, u64)>,
    ) -> Self {
        TableFile {
            file,
            record,
            log,
            base,
        }
    }

    /// Row `row`'s current copy.
    pub(crate) fn get(&self, row: u64) -> &[u8] {
        let row = row as usize;
        if let Some(l) = &self.log {
            if let Some(k) = (l.region.index[row] as usize).checked_sub(1) {
                return l.region.at(l.bytes, k);
            }
        }
        &self.file[row * self.record..(row + 1) * self.record]
    }

    /// Whether single records go to a log.
    pub(crate) fn has_log(&self) -> bool {
        self.log.as_ref().is_some_and(|l| !l.region.broken)
    }

    /// Reads row `row`'s current copy into `out`.
    pub(crate) fn read(&self, row: u64, out: &mut [u8]) {
        out.copy_from_slice(self.get(row));
    }

    /// Writes `record` as row `row`: appended to the log (folded first when full), or in
    /// place without one.
    pub(crate) fn write(&mut self, row: u64, record: &[u8]) {
        if !self.has_log() {
            return self.write_range(row as usize, record);
        }
        if self
            .log
            .as_ref()
            .is_some_and(|l| l.region.used == l.region.slots)
        {
            self.fold();
        }
        let l = self.log.as_mut().expect("a log (above)");
        let r = &mut *l.region;
        r.index[row as usize] = r.used as u32 + 1;
        r.pending.extend_from_slice(record);
        r.used += 1;
        if r.pending.len() >= r.spill_at && r.spill(l.file).is_err() {
            // The records stay where they are, and go into the file now.
            self.fold();
            self.log.as_mut().expect("a log (above)").region.broken = true;
        }
    }

    /// Writes every logged row's current copy into the file, in row order, and empties the
    /// log. Each piece of [`FOLD_BYTES`] that holds a logged row is written by one `pwrite`
    /// (no page of the mapping is dirtied through it, so none faults, or needs write-protecting
    /// when the kernel writes it back), or copied into the mapping where that fails or there
    /// is no file.
    pub(crate) fn fold(&mut self) {
        let TableFile {
            file,
            record: n,
            log: Some(l),
            base,
        } = self
        else {
            return;
        };
        let (n, r) = (*n, &mut *l.region);
        if r.used == 0 {
            return;
        }
        let per_piece = (FOLD_BYTES / n.max(1)).max(1);
        let mut piece = Vec::with_capacity(per_piece * n);
        for (p, ks) in r.index.chunks(per_piece).enumerate() {
            if ks.iter().all(|&k| k == 0) {
                continue;
            }
            let first = p * per_piece;
            let bytes = &mut file[first * n..(first + ks.len()) * n];
            piece.clear();
            piece.extend_from_slice(bytes);
            for (i, &k) in ks.iter().enumerate() {
                if let Some(k) = (k as usize).checked_sub(1) {
                    piece[i * n..(i + 1) * n].copy_from_slice(r.at(l.bytes, k));
                }
            }
            let written =
                base.is_some_and(|(f, at)| write_at(f, &piece, at + (first * n) as u64).is_ok());
            if !written {
                bytes.copy_from_slice(&piece);
            }
        }
        r.reset();
    }

    /// Writes rows `first..` from `records` (a whole number of records) in place, their
    /// logged copies dropped.
    pub(crate) fn write_range(&mut self, first: usize, records: &[u8]) {
        let n = self.record;
        self.file[first * n..first * n + records.len()].copy_from_slice(records);
        if let Some(l) = &mut self.log {
            if l.region.used > 0 {
                l.region.index[first..first + records.len() / n].fill(0);
            }
        }
    }

    /// The table's part of the file, the log folded into it first.
    pub(crate) fn folded(&mut self) -> &mut [u8] {
        self.fold();
        self.file
    }
}

#[cfg(test)]
mod tests {
    use super::super::store::RowStore;
    use super::*;
    use crate::embedding::tbe::{TableBatchedEmbedding, Tables};
    use crate::embedding::{
        CacheConfig, CacheSize, EmbeddingInit, FusedOptimizer, PoolingMode, TableSpec, TbeConfig,
        TbeInput,
    };
    use crate::tensor::rng::seeded;
    use crate::Tensor;
    use rand::Rng as _;
    use std::path::PathBuf;

    fn test_dir(what: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("embers-log-{what}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    /// A log of `slots` records per table, writing every `spill_at` bytes, made on this
    /// thread.
    fn with_shape<R>(slots: usize, spill_at: usize, f: impl FnOnce() -> R) -> R {
        SHAPE.with(|s| s.set(Some((slots, spill_at))));
        let r = f();
        SHAPE.with(|s| s.set(None));
        r
    }

    /// Random single-record writes, ranged writes and folds on one table, whose records are
    /// large enough that the log's buffer spills to the file: every read gives the row's last
    /// write (from the file, the buffer or the log file), and a fold leaves them all in the
    /// file. A failing write to the log folds what the region holds and writes in place after.
    #[test]
    fn every_read_gives_the_last_write_through_spills_folds_and_a_failing_log() {
        let dir = test_dir("table-file");
        let (rows, record) = (9usize, 100_000usize);
        let mut log = with_shape(5, PENDING_BYTES, || {
            WriteLog::create(&dir.join("rows.bin"), &[(rows, record, PENDING_BYTES)])
        })
        .expect("a log on the temp dir");
        let mut file = vec![0u8; rows * record];
        let mut want: Vec<Vec<u8>> = vec![vec![0u8; record]; rows];
        let mut rng = seeded(11);
        let mut spilled = false;
        for step in 0..400 {
            let mut parts = log.regions_mut();
            let part = parts.pop().unwrap();
            if step == 300 {
                part.region.fail = true;
            }
            let mut t = TableFile::new(&mut file, record, Some(part), None);
            let row = rng.random_range(0..rows);
            let fill = (step % 251) as u8;
            match rng.random_range(0..10) {
                0 => {
                    let n = rng.random_range(1..=rows - row);
                    let bytes: Vec<u8> = (0..n * record).map(|i| fill ^ (i % 7) as u8).collect();
                    t.write_range(row, &bytes);
                    for (k, r) in bytes.chunks(record).enumerate() {
                        want[row + k] = r.to_vec();
                    }
                }
                1 => t.fold(),
                _ => {
                    let bytes: Vec<u8> = (0..record).map(|i| fill ^ (i % 5) as u8).collect();
                    t.write(row as u64, &bytes);
                    want[row] = bytes;
                }
            }
            assert_eq!(t.has_log(), step < 300, "step {step}");
            let mut out = vec![0u8; record];
            for (r, w) in want.iter().enumerate() {
                t.read(r as u64, &mut out);
                assert!(out == *w, "row {r} at step {step}");
            }
            spilled |= log.regions[0].written > 0;
            // A ranged read through the region (the store's reads) agrees too.
            let (bytes, region) = log.region(0);
            let mut all = file.clone();
            region.overlay(bytes, 0, &mut all);
            assert!(all == want.concat(), "overlay at step {step}");
        }
        assert!(spilled, "no record was read back from the log file");
        let mut parts = log.regions_mut();
        TableFile::new(&mut file, record, parts.pop(), None).fold();
        assert!(file == want.concat());
        // The log has no name: nothing is left beside the row file.
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0);
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A buffer that gathers a number of bytes that is no whole number of records (516-byte
    /// records, 256 KiB) spills at whole records: through many spills it never grows past
    /// what it was made with, which the byte budget counted.
    #[test]
    fn a_log_buffer_never_grows_past_its_budget() {
        let dir = test_dir("buffer");
        let (rows, record) = (4000usize, 516usize);
        let mut log = WriteLog::create(&dir.join("rows.bin"), &[(rows, record, PENDING_BYTES)])
            .expect("a log on the temp dir");
        let made = log.host_bytes();
        assert!(made <= rows * 4 + PENDING_BYTES, "{made}");
        let mut file = vec![0u8; rows * record];
        for k in 0..3 * rows {
            let mut parts = log.regions_mut();
            let mut t = TableFile::new(&mut file, record, parts.pop(), None);
            t.write((k * 7 % rows) as u64, &[k as u8; 516]);
        }
        assert!(log.regions[0].written > 0, "no spill");
        assert_eq!(log.host_bytes(), made);
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A row store with a log: single records are logged (read back, not yet in the file),
    /// ranged writes drop logged copies, a sync puts every current copy in the file on disk,
    /// and a replaced file forgets the log.
    #[test]
    fn a_row_store_logs_single_records_and_syncs_them_into_the_file() {
        let dir = test_dir("store");
        let path = dir.join("rows.bin");
        let mut store = with_shape(4, PENDING_BYTES, || {
            let mut s = RowStore::create(&path, &[(6, 8), (3, 4)]).unwrap();
            s.start_log(&[64, 64]);
            assert!(!s.has_log(), "a log nobody wanted");
            s.want_log(true);
            s.start_log(&[64, 64]);
            s
        });
        assert!(store.has_log());
        store.write_bytes(0, 2, &[7u8; 8]);
        store.write_bytes(1, 1, &[9u8; 4]);
        let mut b = [0u8; 8];
        store.read_bytes(0, 2, &mut b);
        assert_eq!(b, [7u8; 8]);
        let on_disk = std::fs::read(&path).unwrap();
        assert_eq!(&on_disk[16..24], &[0u8; 8], "written in place, not logged");
        // A ranged write over a logged row replaces its logged copy.
        store.write_bytes(0, 1, &[5u8; 16]);
        let mut two = [0u8; 24];
        store.read_bytes(0, 1, &mut two);
        assert_eq!(two[..16], [5u8; 16]);
        assert_eq!(two[16..], [0u8; 8]);
        // Five records into a region of four: the fifth folds the first four.
        for r in 0..5u8 {
            store.write_bytes(0, r as usize, &[r + 1; 8]);
        }
        store.sync().unwrap();
        let on_disk = std::fs::read(&path).unwrap();
        for r in 0..5usize {
            assert_eq!(&on_disk[r * 8..(r + 1) * 8], &[r as u8 + 1; 8]);
        }
        assert_eq!(&on_disk[48 + 4..48 + 8], &[9u8; 4]);
        assert!(store.log_mut().unwrap().is_empty());
        // A logged record, then the file replaced: the record was the old file's.
        store.write_bytes(0, 0, &[42u8; 8]);
        let staged = store.stage_new(|bytes, _| {
            bytes.fill(3);
            Ok(())
        });
        store.commit(staged.unwrap()).unwrap();
        store.read_bytes(0, 0, &mut b);
        assert_eq!(b, [3u8; 8]);
        assert!(store.has_log());
        drop(store);
        let names: Vec<_> = (std::fs::read_dir(&dir).unwrap())
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(names, vec!["rows.bin".to_string()]);
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// Training through a cache over a file whose log holds 3 records per table (written every
    /// second record, folded over and over, and table b's made to fail halfway) gives the
    /// tables and optimizer state of the uncached TBE, bit for bit, and the checkpoint holds
    /// them.
    #[test]
    fn training_through_a_small_log_is_bit_identical_and_checkpoints_whole() {
        let dir = test_dir("train");
        let config = TbeConfig::one_feature_per_table(
            vec![TableSpec::new("a", 90, 4), TableSpec::new("b", 40, 3)],
            PoolingMode::Sum,
            FusedOptimizer::RowWiseAdagrad { lr: 0.1, eps: 1e-8 },
        );
        let init = EmbeddingInit::Normal { std: 0.3 };
        let plain = TableBatchedEmbedding::new(config.clone()).unwrap();
        plain.init_weights(init, &mut seeded(2)).unwrap();
        let cache = CacheConfig::new(dir.join("rows.bin"), CacheSize::LoadFactor(0.1));
        let cached =
            with_shape(3, 20, || TableBatchedEmbedding::new_cached(config, cache)).unwrap();
        cached.init_weights(init, &mut seeded(2)).unwrap();
        let mut rng = seeded(5);
        for step in 0..12 {
            if step == 6 {
                let mut state = cached.inner.state.write();
                let Tables::Cached(c) = &mut state.tables else {
                    panic!("a cached TBE");
                };
                c.store.log_mut().unwrap().region_mut(1).fail = true;
            }
            let ids: Vec<i64> = (0..2 * 16)
                .map(|k| rng.random_range(0..if k < 16 { 90 } else { 40 }))
                .collect();
            let offsets: Vec<i64> = (0..=2 * 8).map(|k| 2 * k).collect();
            let grad = Tensor::from_vec(
                (0..8 * 7).map(|i| (i as f32 * 0.37).sin()).collect(),
                &[8, 7],
            )
            .unwrap();
            for tbe in [&plain, &cached] {
                let batch = tbe.prepare(TbeInput::new(&ids[..], &offsets[..])).unwrap();
                tbe.lookup_batch(&batch).unwrap();
                tbe.backward_batch(&batch, &grad).unwrap();
            }
        }
        let bits = |tbe: &TableBatchedEmbedding| {
            let mut out = Vec::new();
            for t in 0..2 {
                out.extend(tbe.table_weights(t).unwrap().iter().map(|x| x.to_bits()));
                out.extend(
                    tbe.optimizer_state(0, t)
                        .unwrap()
                        .iter()
                        .map(|x| x.to_bits()),
                );
            }
            out
        };
        assert!(bits(&plain) == bits(&cached));
        {
            let mut state = cached.inner.state.write();
            let Tables::Cached(c) = &mut state.tables else {
                panic!("a cached TBE");
            };
            let log = c.store.log_mut().unwrap();
            assert!(log.region_mut(1).broken && !log.region_mut(0).broken);
        }
        let written = cached.cache_stats().unwrap()[0].rows_written;
        assert!(
            written > 3,
            "the log of table a never filled ({written} write-backs)"
        );
        cached.save_cached_checkpoint(dir.join("ckpt")).unwrap();
        let cache = CacheConfig::new(dir.join("back.bin"), CacheSize::LoadFactor(0.1));
        let back = TableBatchedEmbedding::new_cached(cached.config().clone(), cache).unwrap();
        back.load_cached_checkpoint(dir.join("ckpt")).unwrap();
        assert!(bits(&back) == bits(&plain));
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A log for `tables` beside `path`, made on this thread as if the disk had `free` bytes.
    fn with_free(free: u64, path: &Path, tables: &[(usize, usize, usize)]) -> Option<WriteLog> {
        FREE.with(|f| f.set(Some(free)));
        let log = WriteLog::create(path, tables);
        FREE.with(|f| f.set(None));
        log
    }

    /// The log takes at most half the disk's free bytes: the whole table's records where
    /// they fit, else a half, a quarter or an eighth of them (rounded up, each table alike);
    /// with room for none, no log. A log of half the records folds every half table of
    /// writes and reads back every row's last write.
    #[test]
    fn a_disk_short_of_room_gets_a_smaller_log_or_none() {
        let dir = test_dir("room");
        let path = dir.join("rows.bin");
        let tables = [(1000usize, 100usize, 4096usize), (10, 40, 4096)];
        let full = (1000 * 100 + 10 * 40) as u64;
        let made = |free: u64| {
            with_free(free, &path, &tables).map(|l| {
                let slots: Vec<usize> = l.regions.iter().map(|r| r.slots).collect();
                assert_eq!(l.len(), (slots[0] * 100 + slots[1] * 40) as u64);
                assert!(l.len() <= free / 2);
                slots
            })
        };
        assert_eq!(made(2 * full), Some(vec![1000, 10]));
        assert_eq!(made(2 * full - 1), Some(vec![500, 5]));
        assert_eq!(made(full), Some(vec![500, 5]));
        let quarter = 250 * 100 + 3 * 40;
        assert_eq!(made(2 * quarter), Some(vec![250, 3]));
        assert_eq!(made(2 * quarter - 1), Some(vec![125, 2]));
        assert_eq!(made(2 * (125 * 100 + 2 * 40) - 1), None);
        assert_eq!(made(0), None);
        // statvfs said room for the whole log, but the allocation finds less (another writer
        // took it): the largest size that can be allocated, or none when not even an eighth.
        let room = |bytes: u64| {
            super::super::store::ROOM.with(|r| r.set(Some(bytes)));
            let slots = made(2 * full);
            super::super::store::ROOM.with(|r| r.set(None));
            slots
        };
        assert_eq!(room(full - 1), Some(vec![500, 5]));
        assert_eq!(room(quarter), Some(vec![250, 3]));
        assert_eq!(room(125 * 100 + 2 * 40), Some(vec![125, 2]));
        assert_eq!(room(125 * 100 + 2 * 40 - 1), None);
        // The file system's own figure: some bytes for the temp dir, none for a missing dir
        // (a log there is then tried at its whole size).
        assert!(free_bytes(&dir).is_some_and(|b| b > 0));
        assert_eq!(free_bytes(&dir.join("missing")), None);
        // One table, the room for half its records: a fold each 500 writes, and every
        // read gives the last write.
        let mut log = with_free(full, &path, &tables[..1]).expect("a log of half the rows");
        let mut file = vec![0u8; 1000 * 100];
        let mut want = vec![vec![0u8; 100]; 1000];
        let mut rng = seeded(5);
        let mut folds = 0;
        for step in 0..3000 {
            let mut parts = log.regions_mut();
            let mut t = TableFile::new(&mut file, 100, parts.pop(), None);
            let row = rng.random_range(0..1000usize);
            let bytes = vec![(step % 253) as u8 + 1; 100];
            t.write(row as u64, &bytes);
            want[row] = bytes;
            // A write that finds the region full folds it first, then takes record 1.
            folds += usize::from(step > 0 && log.regions[0].used == 1);
        }
        assert_eq!(folds, 3000 / 500 - 1, "a fold each 500 records");
        let mut parts = log.regions_mut();
        let t = TableFile::new(&mut file, 100, parts.pop(), None);
        let mut out = vec![0u8; 100];
        for (r, w) in want.iter().enumerate() {
            t.read(r as u64, &mut out);
            assert!(out == *w, "row {r}");
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A byte budget pays for the log (its index and buffers) where it has room, and a cache
    /// whose budget has none writes in place rather than being refused.
    #[test]
    fn a_byte_budget_pays_for_the_log_or_goes_without() {
        use crate::embedding::CachePolicy;
        let dir = test_dir("budget");
        let config = TbeConfig::one_feature_per_table(
            vec![TableSpec::new("t", 20_000, 16)],
            PoolingMode::Sum,
            FusedOptimizer::RowWiseAdagrad { lr: 0.1, eps: 1e-8 },
        );
        // 120 kB: room for the log's index (80 kB) beside an LRU cache, none beside LFU's
        // access counts (80 kB more), which leave room for the cache alone.
        let budget = 120_000;
        for (policy, logged) in [(CachePolicy::Lru, true), (CachePolicy::Lfu, false)] {
            let cache = CacheConfig::new(dir.join("rows.bin"), CacheSize::Bytes(budget))
                .with_policy(policy);
            let tbe = TableBatchedEmbedding::new_cached(config.clone(), cache).unwrap();
            assert!(tbe.allocated_bytes() as u64 <= budget, "{policy:?}");
            let mut state = tbe.inner.state.write();
            let Tables::Cached(c) = &mut state.tables else {
                panic!("a cached TBE");
            };
            assert_eq!(c.store.log_mut().is_some(), logged, "{policy:?}");
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}
