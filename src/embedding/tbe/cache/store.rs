//! The backing file of a DRAM-cached TBE: every row of every table with its optimizer state,
//! one fixed-size record per row (`dim` weights, then each state buffer's per-row part), tables
//! one after another. Read and written with positioned I/O (`pread`/`pwrite`), never mapped: a
//! truncated or vanished file is then an error naming the file, never a `SIGBUS`.

use std::fs::{File, OpenOptions};
use std::path::{Path, PathBuf};

use crate::{Error, Result};

const OP: &str = "TBE row store";

/// The record layout of one table in the file.
#[derive(Clone, Debug)]
pub(crate) struct StoreTable {
    /// Byte offset of row 0.
    pub offset: u64,
    /// Rows.
    pub rows: usize,
    /// Floats per record.
    pub record: usize,
}

/// A file holding the rows and optimizer state of a TBE's tables.
pub(crate) struct RowStore {
    file: File,
    path: PathBuf,
    tables: Vec<StoreTable>,
    len: u64,
}

/// Positioned reads and writes (Unix `pread`/`pwrite`, Windows `seek_read`/`seek_write`).
#[cfg(unix)]
mod pos {
    use std::os::unix::fs::FileExt;
    pub fn read_exact_at(f: &std::fs::File, buf: &mut [u8], at: u64) -> std::io::Result<()> {
        f.read_exact_at(buf, at)
    }
    pub fn write_all_at(f: &std::fs::File, buf: &[u8], at: u64) -> std::io::Result<()> {
        f.write_all_at(buf, at)
    }
}
#[cfg(windows)]
mod pos {
    use std::os::windows::fs::FileExt;
    pub fn read_exact_at(
        f: &std::fs::File,
        mut buf: &mut [u8],
        mut at: u64,
    ) -> std::io::Result<()> {
        while !buf.is_empty() {
            match f.seek_read(buf, at)? {
                0 => return Err(std::io::ErrorKind::UnexpectedEof.into()),
                n => {
                    buf = &mut buf[n..];
                    at += n as u64;
                }
            }
        }
        Ok(())
    }
    pub fn write_all_at(f: &std::fs::File, mut buf: &[u8], mut at: u64) -> std::io::Result<()> {
        while !buf.is_empty() {
            match f.seek_write(buf, at)? {
                0 => return Err(std::io::ErrorKind::WriteZero.into()),
                n => {
                    buf = &buf[n..];
                    at += n as u64;
                }
            }
        }
        Ok(())
    }
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

/// Writes `bytes` at `at` in `file` (named `path` in errors).
pub(crate) fn write_at(file: &File, path: &Path, bytes: &[u8], at: u64, what: &str) -> Result<()> {
    pos::write_all_at(file, bytes, at).map_err(|e| io_error(path, what, e))
}

impl RowStore {
    /// The layout of tables of `(rows, floats per record)`, and the file length it needs.
    pub(crate) fn layout(tables: &[(usize, usize)]) -> Result<(Vec<StoreTable>, u64)> {
        let mut offset = 0u64;
        let mut out = Vec::with_capacity(tables.len());
        for &(rows, record) in tables {
            out.push(StoreTable {
                offset,
                rows,
                record,
            });
            let bytes = (rows as u64)
                .checked_mul(record as u64 * 4)
                .and_then(|b| b.checked_add(offset))
                .ok_or_else(|| Error::invalid(OP, "the tables' size overflows 64 bits"))?;
            offset = bytes;
        }
        Ok((out, offset))
    }

    /// Creates (or replaces) `path` as an all-zero store for `tables` (`(rows, floats per
    /// record)`). The file is sparse: its blocks are allocated as rows are written back.
    pub(crate) fn create(path: &Path, tables: &[(usize, usize)]) -> Result<Self> {
        let (tables, len) = Self::layout(tables)?;
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(path)
            .map_err(|e| io_error(path, "creating the row store", e))?;
        file.set_len(len)
            .map_err(|e| io_error(path, &format!("sizing the row store to {len} bytes"), e))?;
        Ok(RowStore {
            file,
            path: path.to_path_buf(),
            tables,
            len,
        })
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
        let have = file
            .metadata()
            .map_err(|e| io_error(path, "reading the row store's size", e))?
            .len();
        if have != len {
            return Err(Error::invalid(
                OP,
                format!(
                    "{}: {have} bytes, but these tables need {len} (truncated or not this \
                     model's file)",
                    path.display()
                ),
            ));
        }
        Ok(RowStore {
            file,
            path: path.to_path_buf(),
            tables,
            len,
        })
    }

    /// The file's path.
    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    /// The file's length in bytes.
    pub(crate) fn len(&self) -> u64 {
        self.len
    }

    /// The layout of table `t`.
    pub(crate) fn table(&self, t: usize) -> &StoreTable {
        &self.tables[t]
    }

    fn at(&self, t: usize, row: usize) -> u64 {
        let s = &self.tables[t];
        s.offset + row as u64 * s.record as u64 * 4
    }

    /// Reads the records of rows `first..` of table `t` into `buf` (a whole number of records).
    pub(crate) fn read_rows(&self, t: usize, first: usize, buf: &mut [f32]) -> Result<()> {
        let at = self.at(t, first);
        pos::read_exact_at(&self.file, bytemuck::cast_slice_mut(buf), at).map_err(|e| {
            io_error(
                &self.path,
                &format!("reading table {t} from row {first}"),
                e,
            )
        })
    }

    /// Writes the records of rows `first..` of table `t` from `buf`.
    pub(crate) fn write_rows(&self, t: usize, first: usize, buf: &[f32]) -> Result<()> {
        let at = self.at(t, first);
        write_at(
            &self.file,
            &self.path,
            bytemuck::cast_slice(buf),
            at,
            &format!("writing table {t} from row {first}"),
        )
    }

    /// Flushes everything written to the disk (`fsync`).
    pub(crate) fn sync(&self) -> Result<()> {
        self.file
            .sync_all()
            .map_err(|e| io_error(&self.path, "syncing the row store", e))
    }

    /// Replaces the file with `source` (a complete store for these tables, on the same file
    /// system: it is renamed over the file) and reopens it.
    pub(crate) fn replace_with(&mut self, source: &Path) -> Result<()> {
        std::fs::rename(source, &self.path)
            .map_err(|e| io_error(&self.path, "replacing the row store", e))?;
        self.file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(&self.path)
            .map_err(|e| io_error(&self.path, "reopening the row store", e))?;
        Ok(())
    }
}

/// Copies `src` to a new file `dst` (flushed to disk) and returns the copy's checksum, a
/// 64-bit FNV-1a over the file's 8-byte words (a final partial word zero-padded).
pub(crate) fn copy_with_checksum(src: &Path, dst: &Path) -> Result<u64> {
    use std::io::{Read, Write};
    let mut input = File::open(src).map_err(|e| io_error(src, "opening to copy", e))?;
    let mut output = File::create(dst).map_err(|e| io_error(dst, "creating", e))?;
    let mut buf = vec![0u8; 8 << 20];
    let mut hash = 0xcbf2_9ce4_8422_2325u64;
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
        output
            .write_all(&buf[..n])
            .map_err(|e| io_error(dst, "writing a copy", e))?;
        if n < buf.len() {
            break;
        }
    }
    output
        .sync_all()
        .map_err(|e| io_error(dst, "syncing a copy", e))?;
    Ok(hash)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_disk_is_named_as_such() {
        // /dev/full answers every write with ENOSPC.
        let Ok(f) = OpenOptions::new().write(true).open("/dev/full") else {
            return;
        };
        let err = write_at(&f, Path::new("/dev/full"), &[0u8; 64], 0, "writing row 3")
            .unwrap_err()
            .to_string();
        assert!(err.contains("the disk is full"), "{err}");
        assert!(err.contains("/dev/full: writing row 3"), "{err}");
    }

    #[test]
    fn a_truncated_store_is_refused_at_open_and_at_read() {
        let dir = std::env::temp_dir().join(format!("embers-store-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("rows.bin");
        let store = RowStore::create(&path, &[(10, 4), (5, 3)]).unwrap();
        assert_eq!(store.len(), (10 * 4 + 5 * 3) * 4);
        store.write_rows(1, 2, &[1.0, 2.0, 3.0]).unwrap();
        let mut back = [0.0f32; 3];
        store.read_rows(1, 2, &mut back).unwrap();
        assert_eq!(back, [1.0, 2.0, 3.0]);
        // Cut the file while open: the next read past its end fails with words.
        std::fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .unwrap()
            .set_len(100)
            .unwrap();
        let err = store.read_rows(1, 4, &mut back).unwrap_err().to_string();
        assert!(err.contains("ends early"), "{err}");
        drop(store);
        let err = RowStore::open(&path, &[(10, 4), (5, 3)])
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("100 bytes") && err.contains("220"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
