//! The backing file of a DRAM-cached TBE: one fixed-size record per row, tables one after
//! another. A training TBE's record is the row with its optimizer state (`dim` weights, then
//! each state buffer's per-row part, little-endian f32); an inference TBE's is the row's stored
//! bytes (FP16, INT8 with its scale and bias, ...).
//!
//! The file is mapped and records are copied in and out of the mapping: with small pages and
//! no read-ahead (random access advised), or, for a file with a write log that stays in
//! memory, through huge pages ([`advise_pages`]). Its blocks are allocated when it is created
//! (`posix_fallocate`), so a full disk is an error then, never a fault when a dirty page is
//! written back; its length is checked at open and before every batch, so a file truncated
//! under a running operator is an error naming it. (A truncation racing a batch's copies can
//! still fault: the rule of every mapped file.)
//!
//! Given an empty path, the store is anonymous host memory instead (FBGEMM's rows in host
//! memory behind a GPU cache): no file, no page-cache write-back, gone with the process;
//! checkpoints still write and read the same row files.

use std::fs::{File, OpenOptions};
use std::path::{Path, PathBuf};

use memmap2::MmapMut;

use super::log::{TableFile, WriteLog};
use super::memory::available_memory;
use crate::checkpoint::{clock_nanos, try_lock};
use crate::{Error, Result};

const OP: &str = "TBE row store";

/// Record copies an admission makes before judging whether the file is read from the disk.
pub(crate) const PROBE: usize = 32;

/// A record copy slower than this on average came from the disk (a copy out of the page cache
/// takes well under a microsecond; a page fault to a disk, tens of microseconds or more).
const SLOW_COPY: std::time::Duration = std::time::Duration::from_micros(2);

/// Times an admission's first [`PROBE`] record copies. Hints for every other page are worth
/// giving only when those copies came from the disk: with the file in the page cache the hints
/// (a system call per record) would cost more than the copies.
pub(crate) struct DiskProbe(std::time::Instant);

impl DiskProbe {
    /// Starts timing, before the first copy.
    pub(crate) fn start() -> Self {
        Self(std::time::Instant::now())
    }

    /// Whether copy `i` is the first after the probe and the probe's copies came slowly.
    pub(crate) fn slow_at(&self, i: usize) -> bool {
        i == PROBE && self.0.elapsed() > PROBE as u32 * SLOW_COPY
    }
}

/// Asks the kernel to start reading the pages that hold `bytes`, part of a mapped file
/// (`madvise(WILLNEED)`, which returns at once): the misses of a batch then reach the disk
/// together rather than one page fault at a time. Only a hint; errors are ignored.
pub(crate) fn will_need(bytes: &[u8]) {
    if bytes.is_empty() {
        return;
    }
    // SAFETY: sysconf reads a constant of the system.
    let page = (unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).max(4096) as usize;
    let first = bytes.as_ptr() as usize & !(page - 1);
    let len = bytes.as_ptr() as usize + bytes.len() - first;
    // SAFETY: `madvise(WILLNEED)` reads nothing and writes nothing the program can observe; the
    // range runs from the page holding the first byte (a mapping starts on a page boundary, so
    // that page is in the same mapping) to the last byte of `bytes`.
    unsafe { libc::madvise(first as *mut libc::c_void, len, libc::MADV_WILLNEED) };
}

/// Advises the kernel how a mapped file is read. `huge`: through huge pages — the page cache
/// fills with 2 MiB folios as the file is faulted in (file systems with large folios, ext4
/// and XFS on recent kernels), each mapped by one TLB entry, so that a random record read
/// from a file that stays in memory costs no page walk of its own (about a third of a host
/// cache's admission time over 4 KiB pages). Else small pages and no read-ahead: a fault to
/// the disk reads the record's page, not 2 MiB. A hint: errors, and systems without huge
/// pages, change speed, never results.
pub(crate) fn advise_pages(map: &[u8], huge: bool) {
    if map.is_empty() {
        return;
    }
    #[cfg(target_os = "linux")]
    let advice = match huge {
        true => [libc::MADV_RANDOM, libc::MADV_HUGEPAGE],
        false => [libc::MADV_NOHUGEPAGE, libc::MADV_RANDOM],
    };
    #[cfg(all(unix, not(target_os = "linux")))]
    let advice = [libc::MADV_RANDOM];
    #[cfg(unix)]
    for a in advice {
        // SAFETY: madvise changes how the kernel pages a mapping of this process's (`map`
        // starts one: mappings start on a page boundary); it reads or writes no user memory.
        unsafe { libc::madvise(map.as_ptr() as *mut libc::c_void, map.len(), a) };
    }
    #[cfg(not(target_os = "linux"))]
    let _ = huge;
}

/// Bytes of file pages this process's stores hold through huge pages (each its file's and its
/// log's, while it has them).
static HUGE_BYTES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Reserves `bytes` of file pages to be held through huge pages, where they stay in the page
/// cache beside those reserved already: all of them at most half the memory this process may
/// still fill ([`available_memory`]: the system's, or what its memory cgroups leave it under
/// their limits where that is less). Off Linux, no. Given back by [`release_huge`].
pub(crate) fn reserve_huge(bytes: u64) -> bool {
    use std::sync::atomic::Ordering::SeqCst;
    let Some(available) = available_memory() else {
        return false;
    };
    (HUGE_BYTES.fetch_update(SeqCst, SeqCst, |held| {
        held.checked_add(bytes).filter(|&all| all <= available / 2)
    }))
    .is_ok()
}

/// Gives back what [`reserve_huge`] reserved.
fn release_huge(bytes: u64) {
    HUGE_BYTES.fetch_sub(bytes, std::sync::atomic::Ordering::SeqCst);
}

/// Drops `file`'s clean pages that no mapping holds from the page cache
/// (`posix_fadvise(DONTNEED)`). A hint.
fn drop_page_cache(file: &File) {
    #[cfg(target_os = "linux")]
    {
        use std::os::unix::io::AsRawFd;
        // SAFETY: posix_fadvise reads no user memory; the descriptor is open.
        unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    }
    #[cfg(not(target_os = "linux"))]
    let _ = file;
}

/// The record layout of one table in the file.
#[derive(Clone, Debug)]
pub(crate) struct StoreTable {
    /// Byte offset of row 0.
    pub offset: u64,
    /// Rows.
    pub rows: usize,
    /// Bytes per record.
    pub record_bytes: usize,
}

/// A file (or anonymous host memory) holding the rows and optimizer state of a TBE's tables.
pub(crate) struct RowStore {
    /// `None`: anonymous host memory.
    file: Option<File>,
    map: Option<MmapMut>,
    path: PathBuf,
    tables: Vec<StoreTable>,
    len: u64,
    /// Where single records are written, if [`start_log`](Self::start_log) made one.
    log: Option<WriteLog>,
    /// Whether [`start_log`](Self::start_log) makes one.
    log_wanted: bool,
    /// Bytes of pages (the file's and its log's) it holds through huge pages
    /// ([`advise_pages`], [`reserve_huge`]); 0: small pages. Only with a write log: nothing
    /// then dirties the file's pages through the mapping.
    huge: u64,
    /// Whether the file goes when the store does ([`discard`](Self::discard)).
    discarded: bool,
}

/// An I/O error of `path` while doing `what`, with "the disk is full" and "the file is
/// truncated" said in words.
pub(crate) fn io_error(path: &Path, what: &str, e: std::io::Error) -> Error {
    let why = match e.kind() {
        std::io::ErrorKind::StorageFull => "the disk is full".to_string(),
        std::io::ErrorKind::UnexpectedEof => {
            "the file ends early (truncated while in use?)".to_string()
        }
        _ => e.to_string(),
    };
    Error::invalid(OP, format!("{}: {what}: {why}", path.display()))
}

/// Takes an exclusive advisory lock on `file` (held while it is open): a second operator
/// given the same row file is refused instead of sharing, and zeroing, the first one's rows.
fn lock_exclusively(file: &File, path: &Path) -> Result<()> {
    match try_lock(file) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => Err(Error::invalid(
            OP,
            format!(
                "{}: another operator (or process) already uses this row file",
                path.display()
            ),
        )),
        Err(e) => Err(io_error(path, "locking the row store", e)),
    }
}

/// Refuses when the file `file` (opened, then locked, by path) is no longer the one at `path`:
/// another process renamed a new one over it in between, and the inode locked is that
/// process's old file (its kept rows, say), not to be emptied.
fn same_file(file: &File, path: &Path) -> Result<()> {
    #[cfg(unix)]
    {
        use std::os::unix::fs::MetadataExt;
        let open = file
            .metadata()
            .map_err(|e| io_error(path, "reading the row store's identity", e))?;
        let now = std::fs::metadata(path)
            .map_err(|e| io_error(path, "reading the row store's identity", e))?;
        if (open.dev(), open.ino()) != (now.dev(), now.ino()) {
            return Err(Error::invalid(
                OP,
                format!(
                    "{}: replaced by another process while being opened (is another operator \
                     using this row file?)",
                    path.display()
                ),
            ));
        }
    }
    #[cfg(not(unix))]
    let _ = (file, path);
    Ok(())
}

/// Removes what a process killed while loading a checkpoint into the store at `path` left
/// beside it: its staged copies (`<file name>.restore-<process>-<n>.tmp`) and the rows a load
/// was replacing (`<file name>.previous-…`). Called with the store's lock held, so no live process
/// uses them; only other processes' are removed. Best effort: what cannot be removed stays.
fn remove_leftovers(path: &Path) {
    let (Some(dir), Some(file)) = (path.parent(), path.file_name()) else {
        return;
    };
    let dir = if dir.as_os_str().is_empty() {
        Path::new(".")
    } else {
        dir
    };
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    let file = file.to_string_lossy();
    let ours = std::process::id().to_string();
    for entry in entries.flatten() {
        let name = entry.file_name();
        let name = name.to_string_lossy();
        let Some(rest) = (name.strip_prefix(&*file))
            .and_then(|r| r.strip_prefix('.'))
            .and_then(|r| r.strip_suffix(".tmp"))
        else {
            continue;
        };
        let Some(tail) = (rest.strip_prefix("restore-")).or_else(|| rest.strip_prefix("previous-"))
        else {
            continue;
        };
        let Some((pid, n)) = tail.split_once('-') else {
            continue;
        };
        let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
        if digits(pid) && digits(n) && pid != ours {
            let _ = std::fs::remove_file(entry.path());
        }
    }
}

/// `std::fs::hard_link`, failing in tests that ask it to (a file system without hard links).
fn hard_link(from: &Path, to: &Path) -> std::io::Result<()> {
    #[cfg(test)]
    if NO_HARD_LINKS.with(|n| n.get()) {
        return Err(std::io::Error::new(
            std::io::ErrorKind::Unsupported,
            "no hard links here (test)",
        ));
    }
    std::fs::hard_link(from, to)
}

#[cfg(test)]
thread_local! {
    /// Makes [`hard_link`] fail on this thread.
    pub(crate) static NO_HARD_LINKS: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    /// Bytes a [`fallocate`] on this thread can take before the disk is full (tests: less
    /// room than `statvfs` says, or a disk too small for a store).
    pub(crate) static ROOM: std::cell::Cell<Option<u64>> = const { std::cell::Cell::new(None) };
    /// Makes the next [`RowStore::replace_with`] on this thread fail at its rename.
    pub(crate) static FAIL_REPLACE: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Creates (or opens) the file `path` and takes an exclusive lock on it, held while the
/// returned file is open: what [`in_use`](crate::checkpoint::in_use) then sees, from any process.
pub(crate) fn hold_lock(path: &Path) -> Result<File> {
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(path)
        .map_err(|e| io_error(path, "creating a lock file", e))?;
    lock_exclusively(&file, path)?;
    Ok(file)
}

/// Allocates every block of `file` up to `len` bytes, so writes through a mapping never need
/// space the disk may not have.
fn allocate(file: &File, path: &Path, len: u64) -> Result<()> {
    #[cfg(unix)]
    {
        if libc::off_t::try_from(len).is_err() {
            return Err(Error::invalid(
                OP,
                format!("{}: {len} bytes is too large", path.display()),
            ));
        }
        match fallocate(file, len) {
            // Some file systems (tmpfs of old kernels, network ones) cannot: the space is then
            // claimed as pages are written, like any sparse file.
            Err(e) if !matches!(e.raw_os_error(), Some(libc::EOPNOTSUPP | libc::EINVAL)) => {
                return Err(io_error(path, &format!("allocating {len} bytes"), e));
            }
            _ => {}
        }
    }
    #[cfg(not(unix))]
    let _ = (file, path, len);
    Ok(())
}

/// `posix_fallocate` of the first `len` bytes of `file`: every block allocated, or the error
/// (off Unix, always unsupported; in tests, ENOSPC beyond `ROOM`).
pub(crate) fn fallocate(file: &File, len: u64) -> std::io::Result<()> {
    #[cfg(test)]
    if ROOM.with(|r| r.get()).is_some_and(|room| len > room) {
        return Err(std::io::Error::from_raw_os_error(libc::ENOSPC));
    }
    #[cfg(unix)]
    {
        use std::os::unix::io::AsRawFd;
        let len = libc::off_t::try_from(len)
            .map_err(|_| std::io::Error::from(std::io::ErrorKind::InvalidInput))?;
        // SAFETY: posix_fallocate reads no user memory; the descriptor is open for writing.
        match unsafe { libc::posix_fallocate(file.as_raw_fd(), 0, len) } {
            0 => Ok(()),
            rc => Err(std::io::Error::from_raw_os_error(rc)),
        }
    }
    #[cfg(not(unix))]
    {
        let _ = (file, len);
        Err(std::io::Error::from(std::io::ErrorKind::Unsupported))
    }
}

impl RowStore {
    /// The layout of tables of `(rows, bytes per record)`, and the file length it needs.
    pub(crate) fn layout(tables: &[(usize, usize)]) -> Result<(Vec<StoreTable>, u64)> {
        let mut offset = 0u64;
        let mut out = Vec::with_capacity(tables.len());
        for &(rows, record_bytes) in tables {
            out.push(StoreTable {
                offset,
                rows,
                record_bytes,
            });
            offset = (rows as u64)
                .checked_mul(record_bytes as u64)
                .and_then(|b| b.checked_add(offset))
                .ok_or_else(|| Error::invalid(OP, "the tables' size overflows 64 bits"))?;
        }
        Ok((out, offset))
    }

    /// Creates (or replaces) `path` as an all-zero store for `tables` (`(rows, bytes per
    /// record)`), its blocks allocated.
    pub(crate) fn create(path: &Path, tables: &[(usize, usize)]) -> Result<Self> {
        let (tables, len) = Self::layout(tables)?;
        if path.as_os_str().is_empty() {
            return Self::anonymous(tables, len);
        }
        #[allow(clippy::suspicious_open_options)] // emptied below, once locked
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .open(path)
            .map_err(|e| io_error(path, "creating the row store", e))?;
        lock_exclusively(&file, path)?;
        same_file(&file, path)?;
        remove_leftovers(path);
        file.set_len(0)
            .and_then(|()| file.set_len(len))
            .map_err(|e| io_error(path, &format!("sizing the row store to {len} bytes"), e))?;
        if let Err(e) = allocate(&file, path, len) {
            // The blocks taken before the disk filled go back (to a smaller cache, a
            // checkpoint); the file is no store.
            let _ = file.set_len(0);
            return Err(e);
        }
        Self::mapped(file, path, tables, len)
    }

    /// Removes a store [created](Self::create) for a cache or collection that could not be
    /// built: its file goes, with the blocks it took (a table bigger than memory takes a
    /// disk's worth), when the store is dropped — after its cache, which may hold the mapping
    /// registered with a GPU.
    pub(crate) fn discard_on_drop(&mut self) {
        self.discarded = true;
    }

    /// [`discard_on_drop`](Self::discard_on_drop), and dropped now.
    pub(crate) fn discard(mut self) {
        self.discard_on_drop();
    }

    /// Opens an existing store for `tables`, refusing a file of the wrong length.
    #[cfg(test)]
    pub(crate) fn open(path: &Path, tables: &[(usize, usize)]) -> Result<Self> {
        let (tables, len) = Self::layout(tables)?;
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .map_err(|e| io_error(path, "opening the row store", e))?;
        let store = Self::mapped(file, path, tables, len)?;
        store.check_len()?;
        Ok(store)
    }

    /// An all-zero store in anonymous host memory.
    fn anonymous(tables: Vec<StoreTable>, len: u64) -> Result<Self> {
        let path = PathBuf::from("<host memory>");
        let map = match len {
            0 => None,
            _ => Some(Self::anonymous_map(&path, len)?),
        };
        Ok(RowStore {
            file: None,
            map,
            path,
            tables,
            len,
            log: None,
            log_wanted: false,
            huge: 0,
            discarded: false,
        })
    }

    /// `len` zero bytes of anonymous memory, refused in words when the host lacks them.
    fn anonymous_map(path: &Path, len: u64) -> Result<MmapMut> {
        let bytes = usize::try_from(len)
            .map_err(|_| Error::invalid(OP, format!("{len} bytes do not fit in memory")))?;
        MmapMut::map_anon(bytes).map_err(|e| io_error(path, &format!("allocating {len} bytes"), e))
    }

    fn mapped(file: File, path: &Path, tables: Vec<StoreTable>, len: u64) -> Result<Self> {
        let map = if len == 0 {
            None
        } else {
            // SAFETY: the file is this store's own (created or opened by it); a change of its
            // length by another process is checked for before every batch (see the module docs).
            let map = unsafe { MmapMut::map_mut(&file) }
                .map_err(|e| io_error(path, "mapping the row store", e))?;
            advise_pages(&map, false);
            Some(map)
        };
        Ok(RowStore {
            file: Some(file),
            map,
            path: path.to_path_buf(),
            tables,
            len,
            log: None,
            log_wanted: false,
            huge: 0,
            discarded: false,
        })
    }

    /// Refuses a file whose length is not the store's (truncated, or replaced, under it).
    pub(crate) fn check_len(&self) -> Result<()> {
        match self.file_len()? {
            have if have != self.len => Err(self.wrong_length(have)),
            _ => Ok(()),
        }
    }

    /// The error of a file `have` bytes long, not the store's length.
    pub(crate) fn wrong_length(&self, have: u64) -> Error {
        Error::invalid(
            OP,
            format!(
                "{}: {have} bytes, but these tables need {} (truncated, or not this model's \
                 file)",
                self.path.display(),
                self.len
            ),
        )
    }

    /// The length of the file as it is now (the store's own length for anonymous memory): not
    /// the store's when the file was truncated under it.
    pub(crate) fn file_len(&self) -> Result<u64> {
        let Some(file) = &self.file else {
            return Ok(self.len);
        };
        Ok(file
            .metadata()
            .map_err(|e| io_error(&self.path, "reading the row store's size", e))?
            .len())
    }

    /// The file's length in bytes.
    pub(crate) fn len(&self) -> u64 {
        self.len
    }

    /// The layout of table `t`.
    pub(crate) fn table(&self, t: usize) -> &StoreTable {
        &self.tables[t]
    }

    /// The range of `n` bytes of records from row `first` of table `t`.
    fn range(&self, t: usize, first: usize, n: usize) -> std::ops::Range<usize> {
        let s = &self.tables[t];
        let start = (s.offset + first as u64 * s.record_bytes as u64) as usize;
        let end = start + n;
        assert!(
            end as u64 <= s.offset + s.rows as u64 * s.record_bytes as u64,
            "records past the end of table {t} (internal)"
        );
        start..end
    }

    /// Reads the records of rows `first..` of table `t` into `buf` (a whole number of records).
    pub(crate) fn read_rows(&self, t: usize, first: usize, buf: &mut [f32]) {
        self.read_bytes(t, first, bytemuck::cast_slice_mut(buf));
    }

    /// Writes the records of rows `first..` of table `t` from `buf`.
    pub(crate) fn write_rows(&mut self, t: usize, first: usize, buf: &[f32]) {
        self.write_bytes(t, first, bytemuck::cast_slice(buf));
    }

    /// Reads the records of rows `first..` of table `t` into `buf`, as bytes (their current
    /// copies: the log's where a row was logged).
    pub(crate) fn read_bytes(&self, t: usize, first: usize, buf: &mut [u8]) {
        if let Some(map) = &self.map {
            buf.copy_from_slice(&map[self.range(t, first, buf.len())]);
        }
        if let Some(log) = &self.log {
            let (bytes, region) = log.region(t);
            region.overlay(bytes, first, buf);
        }
    }

    /// Writes the records of rows `first..` of table `t` from `buf`, as bytes: a single
    /// record to the log, if the store has one; more in place.
    pub(crate) fn write_bytes(&mut self, t: usize, first: usize, buf: &[u8]) {
        let _ = self.range(t, first, buf.len()); // the records are the table's (checked)
        let single = buf.len() == self.tables[t].record_bytes;
        let mut file = self.table_file(t);
        if single {
            file.write(first as u64, buf);
        } else {
            file.write_range(first, buf);
        }
    }

    /// Appends later single-record writes to a write log beside the file
    /// ([`super::log`]), folded in when full or when the file is wanted whole. Nothing unless
    /// [wanted](Self::want_log), for anonymous memory, a store that has one, or when no log
    /// can be made (the file is then written in place). Each table's log gathers `buffers[t]`
    /// bytes of records before writing them.
    ///
    /// With a log, nothing dirties the file's pages through its mapping record by record,
    /// so where the file and its log [stay in memory](reserve_huge) both are read through
    /// huge pages ([`remap`](Self::remap)).
    pub(crate) fn start_log(&mut self, buffers: &[usize]) {
        if self.log_wanted && self.file.is_some() && self.log.is_none() {
            let tables: Vec<(usize, usize, usize)> = (self.tables.iter().zip(buffers))
                .map(|(s, &b)| (s.rows, s.record_bytes, b))
                .collect();
            self.log = WriteLog::create(&self.path, &tables);
            if let Some(log) = &self.log {
                let pages = self.len.saturating_add(log.len());
                if reserve_huge(pages) {
                    log.advise_huge();
                    self.huge = pages;
                    self.remap(true);
                }
            }
        }
    }

    /// Whether [`start_log`](Self::start_log) makes a log (not until told so).
    pub(crate) fn want_log(&mut self, on: bool) {
        self.log_wanted = on;
    }

    /// Folds the log into the file and writes in place from now on (mapped with small
    /// pages again: [`remap`](Self::remap)).
    pub(crate) fn stop_log(&mut self) {
        self.fold();
        self.log = None;
        if self.huge > 0 {
            release_huge(std::mem::take(&mut self.huge));
            self.remap(false);
        }
    }

    /// Maps the file again, advised `huge` pages or small ones ([`advise_pages`]), its pages
    /// first written back and dropped from the page cache so that they come back as the new
    /// advice makes them: a huge folio dirtied through the mapping (a record written in
    /// place) is written back whole, 2 MiB for a few hundred bytes, and the small folios of a
    /// file read so far would keep it from huge pages. Best effort: where the write-back or
    /// the new mapping fails, the mapping stays and is advised anew (speed changes, never the
    /// rows).
    fn remap(&mut self, huge: bool) {
        let (Some(file), Some(_)) = (&self.file, &self.map) else {
            return;
        };
        if self.sync_file().is_ok() {
            // SAFETY: as in `mapped`: the store's own file, its length checked before every
            // batch. The old mapping goes at the assignment, before the pages are dropped.
            if let Ok(new) = unsafe { MmapMut::map_mut(file) } {
                self.map = Some(new);
                drop_page_cache(file);
            }
        }
        if let Some(map) = &self.map {
            advise_pages(map, huge);
        }
    }

    /// The write log, if any (tests).
    #[cfg(test)]
    pub(crate) fn log_mut(&mut self) -> Option<&mut WriteLog> {
        self.log.as_mut()
    }

    /// Whether single records go to a write log.
    #[cfg(test)]
    pub(crate) fn has_log(&self) -> bool {
        self.log.is_some()
    }

    /// Whether the write log holds records (tests).
    #[cfg(test)]
    pub(crate) fn log_holds_records(&self) -> bool {
        self.log.as_ref().is_some_and(|l| !l.is_empty())
    }

    /// Bytes of host memory the write log takes, its index and buffers (0 without one).
    pub(crate) fn log_host_bytes(&self) -> usize {
        self.log.as_ref().map_or(0, WriteLog::host_bytes)
    }

    /// Writes every logged record into the file, which then holds every row's current copy.
    pub(crate) fn fold(&mut self) {
        for mut f in self.tables_mut() {
            f.fold();
        }
    }

    /// Every table's records (and log region), apart, in table order.
    pub(crate) fn tables_mut(&mut self) -> Vec<TableFile<'_>> {
        let mut rest: &mut [u8] = match &mut self.map {
            Some(m) => &mut m[..],
            None => &mut [],
        };
        let mut logs = self.log.as_mut().map(|l| l.regions_mut().into_iter());
        let mut out = Vec::with_capacity(self.tables.len());
        for s in &self.tables {
            let (mine, after) = std::mem::take(&mut rest).split_at_mut(s.rows * s.record_bytes);
            rest = after;
            let log = logs.as_mut().and_then(Iterator::next);
            let base = self.file.as_ref().map(|f| (f, s.offset));
            out.push(TableFile::new(mine, s.record_bytes, log, base));
        }
        out
    }

    /// Table `t`'s records (and log region), [`tables_mut`](Self::tables_mut)'s `t`-th
    /// without the others: a record written alone (a flush writes one a dirty row) costs no
    /// walk over every table.
    fn table_file(&mut self, t: usize) -> TableFile<'_> {
        let s = &self.tables[t];
        let bytes: &mut [u8] = match &mut self.map {
            Some(m) => &mut m[s.offset as usize..][..s.rows * s.record_bytes],
            None => &mut [],
        };
        let log = self.log.as_mut().map(|l| l.part(t));
        let base = self.file.as_ref().map(|f| (f, s.offset));
        TableFile::new(bytes, s.record_bytes, log, base)
    }

    /// Asks the kernel to start reading the pages of table `t`'s records at `rows` (`madvise`
    /// `WILLNEED`, which returns at once): a batch's misses then reach the disk together, not
    /// one page fault at a time, when the file is not in the page cache. Only a hint.
    pub(crate) fn will_need(&self, t: usize, rows: impl Iterator<Item = u64>) {
        let Some(map) = &self.map else { return };
        debug_assert!(
            self.log.is_none(),
            "inference stores have no write log (internal)"
        );
        let s = &self.tables[t];
        for row in rows {
            let at = s.offset as usize + row as usize * s.record_bytes;
            will_need(&map[at..at + s.record_bytes]);
        }
    }

    /// Table `t`'s records, back to back (a store without a write log: an inference
    /// cache's).
    pub(crate) fn table_bytes(&self, t: usize) -> &[u8] {
        assert!(
            self.log.is_none(),
            "a store with a write log read whole (internal)"
        );
        let s = &self.tables[t];
        match &self.map {
            Some(m) => &m[self.range(t, 0, s.rows * s.record_bytes)],
            None => &[],
        }
    }

    /// Whether the rows are in anonymous host memory (not a file).
    pub(crate) fn in_memory(&self) -> bool {
        self.file.is_none()
    }

    /// The whole file's bytes, to be split among the tables (the log folded in first).
    pub(crate) fn bytes_mut(&mut self) -> &mut [u8] {
        self.fold();
        match &mut self.map {
            Some(m) => &mut m[..],
            None => &mut [],
        }
    }

    /// Folds the write log into the file, then flushes everything written to the disk
    /// ([`sync_file`](Self::sync_file)).
    pub(crate) fn sync(&mut self) -> Result<()> {
        self.fold();
        self.sync_file()
    }

    /// Flushes everything written to the file to the disk (`msync`, then `fsync`): all of the
    /// rows for a store without a write log (an inference cache's).
    pub(crate) fn sync_file(&self) -> Result<()> {
        let Some(file) = &self.file else {
            return Ok(());
        };
        if let Some(map) = &self.map {
            map.flush()
                .map_err(|e| io_error(&self.path, "writing the row store back", e))?;
        }
        file.sync_all()
            .map_err(|e| io_error(&self.path, "syncing the row store", e))
    }

    /// Copies the rows to a new file `dst` (synced) and returns the copy's checksum
    /// ([`copy_with_checksum`]); with `finite`, refuses rows of f32 words that are not all
    /// finite (a checkpoint's). The write log must have been folded ([`sync`](Self::sync)).
    pub(crate) fn copy_to(&self, dst: &Path, finite: bool) -> Result<u64> {
        assert!(
            self.log.as_ref().is_none_or(|l| l.is_empty()),
            "a row file copied with records in its log (internal)"
        );
        if self.file.is_some() {
            return copy_with_checksum(&self.path, dst, finite);
        }
        let bytes: &[u8] = self.map.as_deref().unwrap_or(&[]);
        let mut output = File::create(dst).map_err(|e| io_error(dst, "creating", e))?;
        checksum_copy(bytes, &self.path, &mut output, dst, finite)
    }

    /// Reads a complete store for these tables from `source` (checked for length; with
    /// `finite`, its f32 words too), ready to [`commit`](Self::commit) once its checksum is
    /// accepted: a copy of it beside the live file (to be renamed over it), or a new
    /// anonymous mapping holding it.
    pub(crate) fn stage(&self, source: &Path, finite: bool) -> Result<Staged> {
        if self.file.is_some() {
            let tmp = self.beside("restore");
            let checksum = copy_with_checksum(source, &tmp, finite).inspect_err(|_| {
                let _ = std::fs::remove_file(&tmp);
            })?;
            return Ok(Staged::File(tmp, checksum));
        }
        let input = File::open(source).map_err(|e| io_error(source, "opening", e))?;
        if self.len == 0 {
            let checksum = checksum_copy(input, source, &mut [][..], &self.path, finite)?;
            return Ok(Staged::Memory(None, checksum));
        }
        let mut map = Self::anonymous_map(&self.path, self.len)?;
        let checksum = checksum_copy(input, source, &mut map[..], &self.path, finite)?;
        Ok(Staged::Memory(Some(map), checksum))
    }

    /// A new store for these tables, staged beside the live one as [`stage`](Self::stage)
    /// stages a copy (a file to be renamed over it, or anonymous memory), every byte written by
    /// `fill` (given the store's bytes, all zero, and the tables' layout) and, for a file,
    /// synced to disk. Its checksum is not computed (0).
    pub(crate) fn stage_new(
        &self,
        fill: impl FnOnce(&mut [u8], &[StoreTable]) -> Result<()>,
    ) -> Result<Staged> {
        if self.file.is_none() {
            if self.len == 0 {
                fill(&mut [], &self.tables)?;
                return Ok(Staged::Memory(None, 0));
            }
            let mut map = Self::anonymous_map(&self.path, self.len)?;
            fill(&mut map[..], &self.tables)?;
            return Ok(Staged::Memory(Some(map), 0));
        }
        let tmp = self.beside("restore");
        let staged = Staged::File(tmp.clone(), 0); // removes the file on an early return
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&tmp)
            .map_err(|e| io_error(&tmp, "creating", e))?;
        file.set_len(self.len)
            .map_err(|e| io_error(&tmp, "sizing", e))?;
        allocate(&file, &tmp, self.len)?;
        if self.len == 0 {
            fill(&mut [], &self.tables)?;
        } else {
            // SAFETY: a new file of this process's, under a name no other store uses.
            let mut map =
                unsafe { MmapMut::map_mut(&file) }.map_err(|e| io_error(&tmp, "mapping", e))?;
            fill(&mut map[..], &self.tables)?;
            map.flush()
                .map_err(|e| io_error(&tmp, "writing the staged rows", e))?;
        }
        file.sync_all()
            .map_err(|e| io_error(&tmp, "syncing the staged rows", e))?;
        Ok(staged)
    }

    /// A new name beside the file, `<file name>.<what>-<process>-<n>.tmp`, used by no other
    /// staging (two stagings of one store at once each have their own).
    fn beside(&self, what: &str) -> PathBuf {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let name = self.path.file_name().unwrap_or_default().to_string_lossy();
        (self.path).with_file_name(format!("{name}.{what}-{}-{n}.tmp", std::process::id()))
    }

    /// [`commit`](Self::commit), keeping the rows it replaces so that
    /// [`restore`](Self::restore) can put them back: the file's old inode under a second name
    /// (a hard link, or a copy where the file system has none; removed when the [`Previous`]
    /// is dropped), or the old memory. Nothing changes on an error.
    pub(crate) fn commit_keeping(&mut self, staged: Staged) -> Result<Previous> {
        if self.file.is_none() {
            let old = self.map.take();
            if let Err(e) = self.commit(staged) {
                self.map = old;
                return Err(e);
            }
            return Ok(Previous::Memory(old));
        }
        // The rows kept are the file's: every current copy in it.
        self.fold();
        let backup = self.beside("previous");
        if let Err(link) = hard_link(&self.path, &backup) {
            // FAT, exFAT and some network or FUSE file systems have no hard links: a copy
            // (the rows were just written back, and nothing writes them meanwhile).
            if let Err(e) = self.copy_to(&backup, false) {
                let _ = std::fs::remove_file(&backup);
                return Err(Error::invalid(
                    OP,
                    format!(
                        "{e} (keeping the rows a load replaces: a hard link failed too: {link})"
                    ),
                ));
            }
        }
        let previous = Previous::File(backup);
        self.commit(staged)?;
        Ok(previous)
    }

    /// Puts back the rows a [`commit_keeping`](Self::commit_keeping) replaced. On an error
    /// they are left in their file, which the error names.
    pub(crate) fn restore(&mut self, mut previous: Previous) -> Result<()> {
        match &mut previous {
            Previous::Memory(old) => {
                self.map = old.take();
                Ok(())
            }
            Previous::File(backup) => match self.replace_with(backup) {
                Ok(()) => {
                    // Renamed into place: nothing to remove.
                    *backup = PathBuf::new();
                    Ok(())
                }
                Err(e) => Err(previous.abandon(e)),
            },
        }
    }

    /// Makes the staged rows the store's (nothing changes on an error).
    pub(crate) fn commit(&mut self, mut staged: Staged) -> Result<()> {
        match &mut staged {
            Staged::Memory(map, _) => {
                self.map = map.take();
                Ok(())
            }
            Staged::File(tmp, _) => {
                self.replace_with(tmp)?;
                // Renamed into place: nothing to remove.
                *tmp = PathBuf::new();
                Ok(())
            }
        }
    }

    /// Replaces the file with `source` (a complete store for these tables, on the same file
    /// system: it is renamed over the file) and maps it instead. Nothing changes unless every
    /// step succeeds.
    pub(crate) fn replace_with(&mut self, source: &Path) -> Result<()> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(source)
            .map_err(|e| io_error(source, "opening the new row store", e))?;
        lock_exclusively(&file, source)?;
        let mut new = Self::mapped(file, source, self.tables.clone(), self.len)?;
        new.check_len()?;
        #[cfg(test)]
        if FAIL_REPLACE.with(|f| f.replace(false)) {
            let e = std::io::Error::other("a failure made by a test");
            return Err(io_error(&self.path, "replacing the row store", e));
        }
        std::fs::rename(source, &self.path)
            .map_err(|e| io_error(&self.path, "replacing the row store", e))?;
        // The mapping follows the file (same inode) under its new name; the old file and its
        // mapping go with `new`. The log's records were the old file's rows.
        std::mem::swap(&mut self.file, &mut new.file);
        std::mem::swap(&mut self.map, &mut new.map);
        drop(new);
        if let Some(l) = &mut self.log {
            l.clear();
        }
        if self.huge > 0 {
            self.remap(true);
        }
        Ok(())
    }
}

impl Drop for RowStore {
    fn drop(&mut self) {
        release_huge(self.huge);
        if self.discarded {
            self.map = None;
            if let Some(file) = self.file.take() {
                let _ = file.set_len(0);
                let _ = std::fs::remove_file(&self.path);
            }
        }
    }
}

/// The rows a [`RowStore::commit_keeping`] replaced: the old file under a second name
/// (removed when dropped), or the old memory.
pub(crate) enum Previous {
    File(PathBuf),
    Memory(Option<MmapMut>),
}

impl Previous {
    /// `e`, for an operation that could not put these rows back: a file is left where it is
    /// (the only copy of those rows), and the error names it.
    pub(crate) fn abandon(mut self, e: Error) -> Error {
        match &mut self {
            Previous::File(p) => {
                let mut kept = std::mem::take(p);
                // Out of the names a new store removes as a dead load's leftovers
                // (`.previous-…tmp`), never over another file:
                // `<file name>.kept-<process>-<n>-<clock>`.
                let name = kept.file_name().unwrap_or_default().to_string_lossy();
                let safe = (name.strip_suffix(".tmp")).map(|n| {
                    let kept = n.replacen(".previous-", ".kept-", 1);
                    format!("{kept}-{:x}", clock_nanos())
                });
                let mut warning = String::new();
                match safe.map(|n| kept.with_file_name(n)) {
                    Some(to) if hard_link(&kept, &to).is_ok() => {
                        let _ = std::fs::remove_file(&kept);
                        kept = to;
                    }
                    _ => {
                        warning = "; move it away before this row file is opened again, which \
                                   removes it as a leftover"
                            .to_string()
                    }
                }
                Error::invalid(
                    OP,
                    format!(
                        "{e} (the rows it replaced are kept in {}; rename it over the row \
                         file to use them{warning})",
                        kept.display()
                    ),
                )
            }
            Previous::Memory(_) => e,
        }
    }
}

impl Drop for Previous {
    fn drop(&mut self) {
        if let Previous::File(p) = self {
            if !p.as_os_str().is_empty() {
                let _ = std::fs::remove_file(p);
            }
        }
    }
}

/// Rows read for a restore, not yet the store's, with their checksum: a file beside the live
/// one (removed unless committed), or anonymous memory.
pub(crate) enum Staged {
    File(PathBuf, u64),
    Memory(Option<MmapMut>, u64),
}

impl Staged {
    /// The checksum of the rows read.
    pub(crate) fn checksum(&self) -> u64 {
        match self {
            Staged::File(_, h) | Staged::Memory(_, h) => *h,
        }
    }
}

impl Drop for Staged {
    fn drop(&mut self) {
        // A committed file was renamed away and its path taken.
        if let Staged::File(p, _) = self {
            if !p.as_os_str().is_empty() {
                let _ = std::fs::remove_file(p);
            }
        }
    }
}

/// Where [`checksum_copy`] writes: a new file, or memory of exactly the input's length.
trait CopyTarget {
    /// Writes `bytes` at byte `at` (the bytes so far).
    fn put(&mut self, bytes: &[u8], at: usize) -> std::io::Result<()>;
    /// Called once all `len` bytes are written.
    fn finish(&mut self, len: usize) -> std::io::Result<()>;
}

impl CopyTarget for File {
    fn put(&mut self, bytes: &[u8], _at: usize) -> std::io::Result<()> {
        std::io::Write::write_all(self, bytes)
    }
    fn finish(&mut self, _len: usize) -> std::io::Result<()> {
        self.sync_all()
    }
}

impl CopyTarget for std::io::Sink {
    fn put(&mut self, _bytes: &[u8], _at: usize) -> std::io::Result<()> {
        Ok(())
    }
    fn finish(&mut self, _len: usize) -> std::io::Result<()> {
        Ok(())
    }
}

impl CopyTarget for [u8] {
    fn put(&mut self, bytes: &[u8], at: usize) -> std::io::Result<()> {
        let len = self.len();
        let dst = self.get_mut(at..at + bytes.len()).ok_or_else(|| {
            std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("longer than the tables' {len} bytes"),
            )
        })?;
        dst.copy_from_slice(bytes);
        Ok(())
    }
    fn finish(&mut self, len: usize) -> std::io::Result<()> {
        if len != self.len() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                format!("{len} bytes, the tables need {}", self.len()),
            ));
        }
        Ok(())
    }
}

/// Reads the file `src`, which must be `len` bytes long, into memory, with its checksum (as
/// [`copy_with_checksum`]).
pub(crate) fn read_with_checksum(src: &Path, len: u64) -> Result<(Vec<u8>, u64)> {
    let input = File::open(src).map_err(|e| io_error(src, "opening to read", e))?;
    let len = usize::try_from(len)
        .map_err(|_| Error::invalid(OP, format!("{len} bytes do not fit in memory")))?;
    let mut bytes = vec![0u8; len];
    let h = checksum_copy(input, src, &mut bytes[..], Path::new("<memory>"), false)?;
    Ok((bytes, h))
}

/// The checksum of the open file `file` (called `src` in messages; as
/// [`copy_with_checksum`]'s), read through from its start and kept nowhere.
pub(crate) fn checksum_of(mut file: &File, src: &Path) -> Result<u64> {
    use std::io::Seek;
    file.seek(std::io::SeekFrom::Start(0))
        .map_err(|e| io_error(src, "reading", e))?;
    checksum_copy(
        file,
        src,
        &mut std::io::sink(),
        Path::new("<nowhere>"),
        false,
    )
}

/// Copies `src` to a new file `dst` (flushed to disk) and returns the copy's checksum, a
/// 64-bit FNV-1a over the file's 8-byte words (a final partial word zero-padded). With
/// `finite`, the file is f32 words (a training operator's rows and optimizer state), every
/// one finite: a NaN or infinity is an error naming its byte.
pub(crate) fn copy_with_checksum(src: &Path, dst: &Path, finite: bool) -> Result<u64> {
    let input = File::open(src).map_err(|e| io_error(src, "opening to copy", e))?;
    let mut output = File::create(dst).map_err(|e| io_error(dst, "creating", e))?;
    checksum_copy(input, src, &mut output, dst, finite)
}

/// Copies everything `input` (called `src` in messages) holds into `output` (called `dst`) and
/// returns its checksum (as [`copy_with_checksum`], `finite` too).
fn checksum_copy(
    mut input: impl std::io::Read,
    src: &Path,
    output: &mut (impl CopyTarget + ?Sized),
    dst: &Path,
    finite: bool,
) -> Result<u64> {
    let mut buf = vec![0u8; 8 << 20];
    let mut hash = 0xcbf2_9ce4_8422_2325u64;
    let mut written = 0;
    loop {
        let mut n = 0;
        while n < buf.len() {
            match input.read(&mut buf[n..]) {
                Ok(0) => break,
                Ok(k) => n += k,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(io_error(src, "reading to copy", e)),
            }
        }
        if n == 0 {
            break;
        }
        for word in buf[..n].chunks(8) {
            let mut w = [0u8; 8];
            w[..word.len()].copy_from_slice(word);
            hash = (hash ^ u64::from_le_bytes(w)).wrapping_mul(0x0000_0100_0000_01b3);
        }
        // Every buffer but the last is whole, so words never straddle two.
        if finite {
            refuse_non_finite_rows(src, &buf[..n], written as u64)?;
        }
        output
            .put(&buf[..n], written)
            .map_err(|e| copy_error(src, dst, "writing a copy", e))?;
        written += n;
        if n < buf.len() {
            break;
        }
    }
    output
        .finish(written)
        .map_err(|e| copy_error(src, dst, "finishing a copy", e))?;
    Ok(hash)
}

/// Refuses rows (little-endian f32 words read from byte `at` of `file`) holding a NaN or an
/// infinity, as a checkpoint's tensors are refused: they would spread through every later
/// step, or every answer served.
pub(crate) fn refuse_non_finite_rows(file: &Path, bytes: &[u8], at: u64) -> Result<()> {
    match crate::checkpoint::first_non_finite_f32(bytes) {
        Some((i, v)) => Err(Error::invalid(
            OP,
            format!(
                "{}: the f32 at byte {} is {v}: a checkpoint's rows and optimizer state are \
                 finite",
                file.display(),
                at + 4 * i as u64
            ),
        )),
        None => Ok(()),
    }
}

/// An error of [`checksum_copy`]'s output: the source's wrong length, which a copy into memory
/// finds (`InvalidData`, `UnexpectedEof`), named as the source's; else the output's error.
fn copy_error(src: &Path, dst: &Path, what: &str, e: std::io::Error) -> Error {
    use std::io::ErrorKind::{InvalidData, UnexpectedEof};
    match e.kind() {
        InvalidData | UnexpectedEof => Error::invalid(
            OP,
            format!("{}: {e} (changed while it was read?)", src.display()),
        ),
        _ => io_error(dst, what, e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An allocation the file refuses (here: opened read-only) is an error naming the file
    /// and the bytes, as is a length no file can have; the log's allocation sees the refusal.
    #[cfg(unix)]
    #[test]
    fn an_allocation_the_file_refuses_is_an_error_naming_it() {
        let dir = test_dir("allocate");
        let path = dir.join("rows.bin");
        std::fs::write(&path, b"").unwrap();
        let read_only = File::open(&path).unwrap();
        let err = allocate(&read_only, &path, 4096).unwrap_err().to_string();
        assert!(err.contains("rows.bin: allocating 4096 bytes"), "{err}");
        let err = allocate(&read_only, &path, u64::MAX)
            .unwrap_err()
            .to_string();
        assert!(err.contains("bytes is too large"), "{err}");
        assert!(fallocate(&read_only, 4096).is_err());
        assert!(fallocate(&read_only, u64::MAX).is_err());
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A store larger than the disk's room is refused in words naming the file and the
    /// full disk, and gives back the blocks taken (its file emptied); with room, made, and
    /// discarded, gone.
    #[cfg(unix)]
    #[test]
    fn a_store_the_disk_cannot_hold_is_refused_and_gives_its_blocks_back() {
        let dir = test_dir("no-room");
        let path = dir.join("rows.bin");
        let tables = [(1000usize, 64usize)];
        ROOM.with(|r| r.set(Some(64_000 - 1)));
        let err = RowStore::create(&path, &tables)
            .err()
            .map(|e| e.to_string());
        ROOM.with(|r| r.set(None));
        let err = err.expect("a store bigger than the room");
        assert!(
            err.contains("rows.bin: allocating 64000 bytes") && err.contains("the disk is full"),
            "{err}"
        );
        assert_eq!(std::fs::metadata(&path).unwrap().len(), 0);
        ROOM.with(|r| r.set(Some(64_000)));
        let made = RowStore::create(&path, &tables);
        ROOM.with(|r| r.set(None));
        let made = made.unwrap();
        assert_eq!(made.len(), 64_000);
        // A store whose cache could not be built goes, file and blocks.
        made.discard();
        assert!(!path.exists());
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A file read into memory that is shorter or longer than the tables (changed after its
    /// length was checked) is an error naming that file and both lengths.
    #[test]
    fn a_copy_into_memory_names_the_source_of_the_wrong_length() {
        let dir = test_dir("copy-length");
        let src = dir.join("rows-7.bin");
        std::fs::write(&src, vec![1u8; 100]).unwrap();
        let (bytes, h) = read_with_checksum(&src, 100).unwrap();
        assert_eq!(
            (bytes.len(), h),
            (100, checksum_of(&File::open(&src).unwrap(), &src).unwrap())
        );
        for (len, says) in [
            (200, "100 bytes, the tables need 200"),
            (40, "longer than the tables' 40 bytes"),
        ] {
            let err = read_with_checksum(&src, len).unwrap_err().to_string();
            assert!(err.contains(&format!("rows-7.bin: {says}")), "{err}");
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_full_disk_is_named_as_such() {
        // /dev/full answers every write with ENOSPC.
        use std::io::Write;
        let Ok(mut f) = OpenOptions::new().write(true).open("/dev/full") else {
            return;
        };
        let e = f
            .write_all(&[0u8; 64])
            .and_then(|()| f.flush())
            .unwrap_err();
        let err = io_error(Path::new("/dev/full"), "writing row 3", e).to_string();
        assert!(err.contains("the disk is full"), "{err}");
        assert!(err.contains("/dev/full: writing row 3"), "{err}");
    }

    /// The kernel's flags (`VmFlags` of `/proc/self/smaps`) of the mapping that starts at
    /// `addr`.
    #[cfg(target_os = "linux")]
    fn vm_flags(addr: usize) -> Vec<String> {
        let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
        let mut lines = smaps.lines();
        let start = format!("{addr:x}-");
        lines.find(|l| l.starts_with(&start)).expect("the mapping");
        let flags = lines.find_map(|l| l.strip_prefix("VmFlags:")).unwrap();
        flags.split_whitespace().map(String::from).collect()
    }

    /// A store with a write log that stays in memory is read through huge pages, its log too
    /// (`hg`, random reads `rr`); written in place again (the log stopped), it is mapped anew
    /// with small pages (`nh`), its rows kept; a file loaded into a store with huge pages
    /// gets them too. Rows read back right through every change.
    #[cfg(target_os = "linux")]
    #[test]
    fn a_logged_store_in_memory_is_mapped_huge_and_small_again_without_its_log() {
        if !Path::new("/sys/kernel/mm/transparent_hugepage").exists() {
            eprintln!("skipped: this kernel has no transparent huge pages");
            return;
        }
        let (dir, path, mut store) = store_of_tens("huge");
        assert!(!reserve_huge(u64::MAX));
        let flags = |s: &RowStore| vm_flags(s.map.as_ref().unwrap().as_ptr() as usize);
        assert!(flags(&store).contains(&"nh".into()), "{:?}", flags(&store));
        store.want_log(true);
        store.start_log(&[8]);
        for f in ["hg", "rr"] {
            assert!(
                flags(&store).contains(&f.into()),
                "{f}: {:?}",
                flags(&store)
            );
        }
        let log = store.log.as_ref().unwrap().addr();
        assert!(vm_flags(log).contains(&"hg".into()), "{:?}", vm_flags(log));
        store.write_bytes(0, 3, &[77; 4]);
        assert_eq!(row(&store, 3), 77);
        store.stop_log();
        let small = flags(&store);
        assert!(
            small.contains(&"nh".into()) && small.contains(&"rr".into()),
            "{small:?}"
        );
        assert!(!small.contains(&"hg".into()), "{small:?}");
        assert_eq!(row(&store, 3), 77);
        assert_eq!(std::fs::read(&path).unwrap()[12..16], [77; 4]);
        store.start_log(&[8]);
        store.commit(staged_with(&store, 30)).unwrap();
        assert!(flags(&store).contains(&"hg".into()), "{:?}", flags(&store));
        assert_eq!(row(&store, 3), 33);
        drop(store);
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A dir of its own for a store test.
    fn test_dir(what: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("embers-{what}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    /// A copy of f32 rows for a checkpoint refuses a non-finite word past the first buffer
    /// (naming its byte, and leaving the copy to its caller to remove); other copies (the
    /// backup of live rows, quantized bytes) take any bytes.
    #[test]
    fn checkpoint_copies_refuse_non_finite_rows() {
        let dir = test_dir("finite-copy");
        let (src, dst) = (dir.join("rows.bin"), dir.join("copy.bin"));
        let mut words = vec![0.5f32; (9 << 20) / 4];
        let at = words.len() - 3;
        words[at] = f32::INFINITY;
        let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
        std::fs::write(&src, &bytes).unwrap();
        let err = copy_with_checksum(&src, &dst, true)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains(&format!("the f32 at byte {} is inf", at * 4)),
            "{err}"
        );
        copy_with_checksum(&src, &dst, false).unwrap();
        assert_eq!(std::fs::read(&dst).unwrap(), bytes);
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// The rows of a store of one table of 8 rows of 4 bytes: row `r` holds `r + fill`.
    fn staged_with(store: &RowStore, fill: u8) -> Staged {
        store
            .stage_new(|bytes, _| {
                for (r, row) in bytes.chunks_mut(4).enumerate() {
                    row.fill(r as u8 + fill);
                }
                Ok(())
            })
            .unwrap()
    }

    /// A store `rows.bin` in a test dir of its own (returned with the file's path) of one
    /// table of 8 rows of 4 bytes, row `r` holding `r + 10`.
    fn store_of_tens(what: &str) -> (PathBuf, PathBuf, RowStore) {
        let dir = test_dir(what);
        let path = dir.join("rows.bin");
        let mut store = RowStore::create(&path, &[(8, 4)]).unwrap();
        store.commit(staged_with(&store, 10)).unwrap();
        (dir, path, store)
    }

    fn row(store: &RowStore, r: usize) -> u8 {
        let mut b = [0u8; 4];
        store.read_bytes(0, r, &mut b);
        b[0]
    }

    /// Where the file system has no hard links, the rows a load replaces are kept as a copy,
    /// and put back; the copy is gone after.
    #[test]
    fn without_hard_links_the_replaced_rows_are_kept_as_a_copy() {
        let (dir, _, mut store) = store_of_tens("no-links");
        NO_HARD_LINKS.with(|n| n.set(true));
        let second = staged_with(&store, 50);
        let previous = store.commit_keeping(second);
        NO_HARD_LINKS.with(|n| n.set(false));
        let previous = previous.unwrap();
        assert_eq!(row(&store, 3), 53);
        store.restore(previous).unwrap();
        assert_eq!(row(&store, 3), 13);
        let names: Vec<_> = (std::fs::read_dir(&dir).unwrap())
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(names, vec!["rows.bin".to_string()]);
        drop(store);
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A restore that fails leaves the kept rows' file in place (the only copy of them) and
    /// names it; renamed over the row file by hand, they are back.
    #[test]
    fn a_failed_restore_keeps_the_replaced_rows_and_names_their_file() {
        let (dir, path, mut store) = store_of_tens("failed-restore");
        let second = staged_with(&store, 50);
        let previous = store.commit_keeping(second).unwrap();
        let Previous::File(kept) = &previous else {
            panic!("a file store keeps a file");
        };
        let kept = kept.clone();
        // The kept file grows by a byte: putting it back is refused (wrong length).
        let f = OpenOptions::new().write(true).open(&kept).unwrap();
        f.set_len(33).unwrap();
        let err = store.restore(previous).unwrap_err().to_string();
        assert!(err.contains("the rows it replaced are kept in"), "{err}");
        // Renamed out of the names a new store removes as a dead load's leftovers.
        let name = kept.file_name().unwrap().to_string_lossy().into_owned();
        let prefix = name.replace(".previous-", ".kept-").replace(".tmp", "-");
        let safe: Vec<PathBuf> = (std::fs::read_dir(&dir).unwrap())
            .map(|e| e.unwrap().path())
            .filter(|p| {
                p.file_name()
                    .unwrap()
                    .to_string_lossy()
                    .starts_with(&prefix)
            })
            .collect();
        let [safe] = &safe[..] else {
            panic!("{safe:?}: {err}");
        };
        assert!(err.contains(&safe.display().to_string()), "{err}");
        assert!(!kept.exists(), "{err}");
        assert_eq!(row(&store, 3), 53, "a failed restore changed the store");
        f.set_len(32).unwrap();
        drop(store);
        // A new store there (a job restarted, so another process) leaves them alone.
        let theirs = dir.join("rows.bin.kept-4000000000-0");
        std::fs::copy(safe, &theirs).unwrap();
        drop(RowStore::create(&dir.join("rows.bin"), &[(8, 4)]).unwrap());
        assert!(theirs.exists(), "the kept rows were removed by a new store");
        std::fs::rename(safe, &path).unwrap();
        let store = RowStore::open(&path, &[(8, 4)]).unwrap();
        assert_eq!(row(&store, 3), 13);
        drop(store);
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// Creating a store removes what killed processes left beside its file (staged copies,
    /// kept rows), and nothing else: this process's, another file's, other names.
    #[test]
    fn a_new_store_removes_what_dead_loads_left_beside_it() {
        let dir = test_dir("leftovers");
        let ours = std::process::id();
        let names = [
            ("rows.bin.restore-4000000000-0.tmp", false),
            ("rows.bin.previous-4000000001-12.tmp", false),
            (&*format!("rows.bin.restore-{ours}-7.tmp"), true),
            ("rows.bin2.restore-4000000000-0.tmp", true),
            ("rows.restore-4000000000-0.tmp", true),
            ("rows.bin.restore-x-0.tmp", true),
            ("rows.bin.restore-4000000000-0.tmp.keep", true),
        ]
        .map(|(n, stays)| (n.to_string(), stays));
        for (n, _) in &names {
            std::fs::write(dir.join(n), b"x").unwrap();
        }
        let store = RowStore::create(&dir.join("rows.bin"), &[(8, 4)]).unwrap();
        for (n, stays) in &names {
            assert_eq!(dir.join(n).exists(), *stays, "{n}");
        }
        drop(store);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_truncated_store_is_refused_at_open_and_before_use() {
        let dir = std::env::temp_dir().join(format!("embers-store-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("rows.bin");
        let mut store = RowStore::create(&path, &[(10, 16), (5, 12)]).unwrap();
        assert_eq!(store.len(), (10 * 4 + 5 * 3) * 4);
        store.write_rows(1, 2, &[1.0, 2.0, 3.0]);
        let mut back = [0.0f32; 3];
        store.read_rows(1, 2, &mut back);
        assert_eq!(back, [1.0, 2.0, 3.0]);
        // A read-ahead hint (rows of both tables, the last row included) changes nothing.
        store.will_need(0, [0, 9].into_iter());
        store.will_need(1, 0..5);
        let mut bytes = [0u8; 12];
        store.read_bytes(1, 2, &mut bytes);
        assert_eq!(bytes, *bytemuck::cast_slice::<f32, u8>(&[1.0, 2.0, 3.0]));
        assert_eq!(store.table_bytes(1).len(), 5 * 12);
        store.sync().unwrap();
        assert!(store.check_len().is_ok());
        // Cut the file while open: the next check names it.
        std::fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .unwrap()
            .set_len(100)
            .unwrap();
        let err = store.check_len().unwrap_err().to_string();
        assert!(
            err.contains("100 bytes") && err.contains("truncated"),
            "{err}"
        );
        drop(store);
        let err = RowStore::open(&path, &[(10, 16), (5, 12)])
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("100 bytes") && err.contains("220"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
