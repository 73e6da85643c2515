//! Checkpoints as safetensors files, written atomically.
//!
//! [`CheckpointWriter`] collects named tensors and string metadata and writes them in one
//! safetensors file under a temporary name in the destination's directory, flushes it to disk
//! (fsync), renames it over the destination and syncs the directory: a crash at any moment
//! leaves either the previous file or the new one, never a mix. The header keeps a CRC-32 of
//! each MiB of the data. [`CheckpointReader`] opens such a file, validates its header, and
//! hands out tensors with their dtype and shape checked and the blocks they lie in checked
//! against their checksums (a flipped bit is an error naming the tensor, not a value loaded),
//! so callers can read and check everything before changing any state.

use std::collections::{HashMap, HashSet};
use std::io::{Seek, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use safetensors::tensor::{Dtype, Metadata, TensorInfo};

use crate::{DType, Error, Result, Tensor};

/// Reads rows `range` of a tensor as little-endian bytes, while the file is written.
type ReadRows<'a> = Box<dyn FnMut(std::ops::Range<usize>) -> Result<Vec<u8>> + Send + 'a>;

/// Where a tensor's bytes come from.
enum Data<'a> {
    /// Held by the writer.
    Bytes(Vec<u8>),
    /// Read a chunk of rows at a time while the file is written: `rows` rows of `row_bytes`.
    Rows {
        rows: usize,
        row_bytes: usize,
        read: ReadRows<'a>,
    },
}

struct Entry<'a> {
    dtype: Dtype,
    shape: Vec<usize>,
    data: Data<'a>,
}

impl Entry<'_> {
    /// Its bytes (`None`: more than a `usize` counts).
    fn len(&self) -> Option<usize> {
        match &self.data {
            Data::Bytes(b) => Some(b.len()),
            Data::Rows {
                rows, row_bytes, ..
            } => rows.checked_mul(*row_bytes),
        }
    }
}

/// Element types a checkpoint stores, with their safetensors dtype and little-endian bytes.
pub trait CheckpointElem: bytemuck::Pod {
    /// The safetensors dtype.
    const DTYPE: Dtype;
    /// Bytes per element.
    const SIZE: usize;
    /// Appends the element's little-endian bytes.
    fn put(self, out: &mut Vec<u8>);
    /// Reads an element from `SIZE` little-endian bytes.
    fn get(bytes: &[u8]) -> Self;
}

macro_rules! checkpoint_elem {
    ($($t:ty => $d:ident),*) => {$(
        impl CheckpointElem for $t {
            const DTYPE: Dtype = Dtype::$d;
            const SIZE: usize = std::mem::size_of::<$t>();
            fn put(self, out: &mut Vec<u8>) {
                out.extend_from_slice(&self.to_le_bytes());
            }
            fn get(bytes: &[u8]) -> Self {
                <$t>::from_le_bytes(bytes.try_into().expect("SIZE bytes"))
            }
        }
    )*};
}
checkpoint_elem!(f32 => F32, f64 => F64, half::f16 => F16, half::bf16 => BF16, i64 => I64,
    i32 => I32, u8 => U8);

/// A counter read from a file (a step, examples seen): `n` if below 2^63, so that what reads
/// it can go on counting (and store it as an `i64`) without overflowing.
pub(crate) fn as_count(n: u64) -> Option<u64> {
    (n <= i64::MAX as u64).then_some(n)
}

/// A counter read from a file as decimal text ([`as_count`]).
pub(crate) fn parse_count(text: &str) -> Option<u64> {
    text.parse::<u64>().ok().and_then(as_count)
}

/// `values` as little-endian bytes (their memory, on a little-endian machine).
fn le_bytes<T: CheckpointElem>(values: &[T]) -> Vec<u8> {
    if cfg!(target_endian = "little") {
        return bytemuck::cast_slice(values).to_vec();
    }
    let mut out = Vec::with_capacity(values.len() * T::SIZE);
    values.iter().for_each(|v| v.put(&mut out));
    out
}

fn io_err(path: &Path, source: std::io::Error) -> Error {
    Error::Io {
        path: path.display().to_string(),
        source,
    }
}

fn invalid(path: &Path, msg: impl std::fmt::Display) -> Error {
    Error::invalid("checkpoint", format!("{}: {msg}", path.display()))
}

/// Metadata key of the data's checksums: the CRC-32 of each [`CHECKSUM_BLOCK_KEY`]-byte block
/// of the bytes after the header (the last block may be shorter), as 8 lowercase hex digits
/// each, back to back. A reader checks every block a read touches, once, so a flipped bit in
/// a tensor (one that still decodes as a finite number) is an error naming the tensor rather
/// than a value loaded.
const CHECKSUM_KEY: &str = "checksums.crc32";

/// Metadata key of the checksums' block size in bytes (decimal).
const CHECKSUM_BLOCK_KEY: &str = "checksums.block_bytes";

/// The block size a writer checksums: 1 MiB, so a header holds 8 bytes of checksums per MiB
/// of tensors (a terabyte's fit the header's limit) and a read reads at most a block more
/// than it asked for.
const CHECKSUM_BLOCK: usize = 1 << 20;

/// Metadata key naming a checkpoint's directory of parts (see
/// [`CheckpointWriter::parts_beside`]).
const PARTS_KEY: &str = "parts_dir";

/// The file in a parts directory that its writer (exclusively, until its write is done) and
/// its readers (shared, while they may read the parts) lock: a writer's removal of stale
/// parts directories skips a locked one.
pub(crate) const PARTS_LOCK: &str = ".in-use";

/// Takes a lock on the [`PARTS_LOCK`] file of parts directory `dir` (created if missing):
/// exclusive for a writer, shared for a reader. `None` where it cannot be taken (the parts
/// are then only not protected from another writer's cleanup).
fn lock_parts(dir: &Path, exclusive: bool) -> Option<std::fs::File> {
    let file = (std::fs::OpenOptions::new())
        .create(true)
        .truncate(false)
        .write(true)
        .open(dir.join(PARTS_LOCK))
        .ok()?;
    #[cfg(unix)]
    {
        use std::os::unix::io::AsRawFd;
        let how = if exclusive {
            libc::LOCK_EX
        } else {
            libc::LOCK_SH
        };
        // A reader's shared lock is refused while a writer's cleanup probes the directory
        // (an exclusive lock held for an instant): tried again for a while, or the reader
        // would hold no lock for its whole life. A writer's lock is on a directory it made.
        let tries = if exclusive { 1 } else { 200 };
        for attempt in 1..=tries {
            // SAFETY: flock reads no user memory; the descriptor is open.
            if unsafe { libc::flock(file.as_raw_fd(), how | libc::LOCK_NB) } == 0 {
                break;
            }
            if attempt == tries {
                return None;
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    }
    Some(file)
}

/// The prefix of the parts directories of checkpoints written to a file named `file_name`.
fn parts_prefix(file_name: &str) -> String {
    format!("{file_name}.parts-")
}

/// Collects tensors and metadata for one atomically written safetensors file. Tensors are
/// given as values (copied) or as a way to read them a chunk of rows at a time
/// ([`add_rows`](Self::add_rows)) while the file is written, so that writing a checkpoint of
/// big tables never holds a second copy of them; the writer then borrows what it reads from
/// (`'a`).
#[derive(Default)]
pub struct CheckpointWriter<'a> {
    entries: Vec<(String, Entry<'a>)>,
    names: HashSet<String>,
    metadata: HashMap<String, String>,
    /// The file this checkpoint will be written to, when it may have a parts directory, and
    /// that directory once made.
    parts: Option<(PathBuf, Option<PathBuf>)>,
    /// The exclusive lock on that directory, held until the write is done: another writer's
    /// cleanup leaves it alone.
    parts_lock: Option<std::fs::File>,
}

impl<'a> CheckpointWriter<'a> {
    /// An empty checkpoint.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds `values` (row-major, `shape`) under `name`; names must be unique.
    pub fn add<T: CheckpointElem>(
        &mut self,
        name: impl Into<String>,
        shape: &[usize],
        values: &[T],
    ) -> Result<()> {
        let name = name.into();
        if shape.iter().product::<usize>() != values.len() {
            return Err(Error::invalid(
                "checkpoint",
                format!(
                    "`{name}`: shape {shape:?} does not hold {} values",
                    values.len()
                ),
            ));
        }
        self.push::<T>(name, shape, Data::Bytes(le_bytes(values)))
    }

    /// Adds a tensor of element type `T` and shape `shape` under `name` (names must be unique)
    /// whose values are read when the file is written: `read(rows)` returns rows `rows` of it
    /// (the first dimension; `rows.len()` times the product of the other dimensions values), and is
    /// called for consecutive ranges of about 4 MiB covering every row once, in order. An
    /// error from it, or values of the wrong length, fails the write. The values are those at
    /// [`write`](Self::write) time: what they are read from must not change in between (a
    /// table trained meanwhile would be saved partly before and partly after a step).
    pub fn add_rows<T: CheckpointElem>(
        &mut self,
        name: impl Into<String>,
        shape: &[usize],
        mut read: impl FnMut(std::ops::Range<usize>) -> Result<Vec<T>> + Send + 'a,
    ) -> Result<()> {
        let name = name.into();
        let rows = shape.first().copied().unwrap_or(1);
        let per_row = (shape.iter().skip(1))
            .try_fold(1usize, |n, &d| n.checked_mul(d))
            .filter(|n| {
                n.checked_mul(T::SIZE)
                    .and_then(|b| b.checked_mul(rows))
                    .is_some()
            })
            .ok_or_else(|| {
                Error::invalid(
                    "checkpoint",
                    format!("`{name}`: shape {shape:?} holds more bytes than a usize counts"),
                )
            })?;
        let tensor = name.clone();
        let data = Data::Rows {
            rows,
            row_bytes: per_row * T::SIZE,
            read: Box::new(move |range: std::ops::Range<usize>| {
                let n = range.len();
                let values = read(range.clone())?;
                if values.len() != n * per_row {
                    return Err(Error::invalid(
                        "checkpoint",
                        format!(
                            "`{tensor}` rows {range:?}: {} values read, {} expected",
                            values.len(),
                            n * per_row
                        ),
                    ));
                }
                Ok(le_bytes(&values))
            }),
        };
        self.push::<T>(name, shape, data)
    }

    fn push<T: CheckpointElem>(
        &mut self,
        name: String,
        shape: &[usize],
        data: Data<'a>,
    ) -> Result<()> {
        if !self.names.insert(name.clone()) {
            return Err(Error::invalid(
                "checkpoint",
                format!("`{name}` is written twice; names must be unique"),
            ));
        }
        self.entries.push((
            name,
            Entry {
                dtype: T::DTYPE,
                shape: shape.to_vec(),
                data,
            },
        ));
        Ok(())
    }

    /// Adds a tensor's values with its dtype and shape.
    pub fn add_tensor(&mut self, name: impl Into<String>, tensor: &Tensor) -> Result<()> {
        crate::tensor::ops::with_any_dtype!(tensor.dtype(), T => {
            let values = tensor.to_vec::<T>()?;
            self.add(name, tensor.shape(), &values)
        })
    }

    /// Sets a metadata string.
    pub fn set_metadata(&mut self, key: impl Into<String>, value: impl Into<String>) {
        self.metadata.insert(key.into(), value.into());
    }

    /// Says that this checkpoint will be written to `path` and may keep parts that do not
    /// belong in one file (the row files of tables cached in files, copied whole) in a
    /// directory beside it, `<file name>.parts-<nonce>/`, made on first use (when the first
    /// cached table is written) and named in the metadata. Each checkpoint gets a new
    /// directory, and [`write`](Self::write) removes those of earlier checkpoints at `path`
    /// only after the new file is in place: a crash leaves the previous checkpoint whole. A
    /// copy of the file under another name still names this directory: copy the directory
    /// with it (the next checkpoint written to `path` removes it).
    pub fn parts_beside(&mut self, path: impl AsRef<Path>) {
        self.parts = Some((path.as_ref().to_path_buf(), None));
    }

    /// The parts directory (made now if needed), when [`parts_beside`](Self::parts_beside)
    /// allowed one.
    pub(crate) fn parts_dir(&mut self) -> Result<Option<PathBuf>> {
        let Some((target, made)) = &mut self.parts else {
            return Ok(None);
        };
        if let Some(dir) = made {
            return Ok(Some(dir.clone()));
        }
        let file_name = target
            .file_name()
            .ok_or_else(|| invalid(target, "not a file path"))?
            .to_string_lossy()
            .into_owned();
        let nonce = clock_nanos();
        let parent = parent_dir(target);
        std::fs::create_dir_all(parent).map_err(|e| io_err(parent, e))?;
        // A new directory, never one that exists (a live checkpoint's, were the clock to
        // repeat): the count tells apart those made in one process.
        static MADE: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let (name, dir) = loop {
            let n = MADE.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let name = format!(
                "{}{nonce:x}-{}-{n}",
                parts_prefix(&file_name),
                std::process::id()
            );
            let dir = parent.join(&name);
            match std::fs::create_dir(&dir) {
                Ok(()) => break (name, dir),
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
                Err(e) => return Err(io_err(&dir, e)),
            }
        };
        self.parts_lock = lock_parts(&dir, true);
        // The directory's own entry is on disk before any file that names it is (POSIX asks
        // for the parent's sync; only some journals order it by themselves).
        sync_dir(parent).map_err(|e| io_err(parent, e))?;
        self.metadata.insert(PARTS_KEY.into(), name);
        *made = Some(dir.clone());
        Ok(Some(dir))
    }

    /// Serialises everything to `path` atomically (temporary file, fsync, rename, directory
    /// fsync), streaming the tensors to the file rather than building the whole file in
    /// memory. On error the temporary file is removed and `path` is untouched. With
    /// [`parts_beside`](Self::parts_beside), then, the parts directories of earlier
    /// checkpoints at `path` are removed (on error: this one's).
    pub fn write(mut self, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        if let Some((target, made)) = &self.parts {
            // (On an early return, `drop` removes a parts directory made for this write.)
            if !same_path(target, path) {
                return Err(invalid(
                    path,
                    format!(
                        "this checkpoint's parts were made for {}, not this path",
                        target.display()
                    ),
                ));
            }
            if let Some(dir) = made {
                // The parts' directory entries on disk before the file naming them.
                sync_dir(dir).map_err(|e| io_err(dir, e))?;
            }
        }
        if let Some(key) = [CHECKSUM_KEY, CHECKSUM_BLOCK_KEY]
            .into_iter()
            .find(|k| self.metadata.contains_key(*k))
        {
            return Err(invalid(
                path,
                format!("metadata key `{key}` is the writer's own (the data's checksums)"),
            ));
        }
        let metadata = std::mem::take(&mut self.metadata);
        let entries = std::mem::take(&mut self.entries);
        match replace_atomically_or(path, |tmp| write_safetensors(path, tmp, entries, metadata)) {
            Ok(()) => {
                if let Some((_, made)) = self.parts.take() {
                    remove_stale_parts(path, made.as_deref());
                }
                Ok(())
            }
            Err(f) => {
                if f.renamed {
                    // The new file is in place, naming its parts; the old parts stay too (a
                    // crash may yet bring back the old file).
                    self.parts = None;
                }
                Err(f.error)
            }
        }
    }
}

/// Writes `entries` and `metadata` to a new file `tmp` in the safetensors format (header
/// length, JSON header padded to 8 bytes, the tensors' bytes back to back in safetensors' own
/// order: by dtype, widest first, then by name, so every tensor starts aligned to its element
/// size), reading the tensors given as rows a chunk at a time. The header's
/// [`CHECKSUM_KEY`] holds the data's checksums: written as zeros first (its length is known),
/// then over-written once the data is out. Errors name `path`, the file being written, and
/// the tensor.
fn write_safetensors(
    path: &Path,
    tmp: &Path,
    mut entries: Vec<(String, Entry<'_>)>,
    mut metadata: HashMap<String, String>,
) -> Result<()> {
    entries.sort_by(|(a, x), (b, y)| y.dtype.cmp(&x.dtype).then_with(|| a.cmp(b)));
    let mut infos = Vec::with_capacity(entries.len());
    let mut end = 0usize;
    for (name, e) in &entries {
        let start = end;
        end = (e.len().and_then(|n| end.checked_add(n))).ok_or_else(|| {
            invalid(
                path,
                format!("`{name}` and the tensors before it overflow the file's size"),
            )
        })?;
        let info = TensorInfo {
            dtype: e.dtype,
            shape: e.shape.clone(),
            data_offsets: (start, end),
        };
        infos.push((name.clone(), info));
    }
    let blocks = end.div_ceil(CHECKSUM_BLOCK);
    metadata.insert(CHECKSUM_BLOCK_KEY.into(), CHECKSUM_BLOCK.to_string());
    metadata.insert(CHECKSUM_KEY.into(), "0".repeat(8 * blocks));
    let header = Metadata::new(Some(metadata), infos).map_err(|e| invalid(path, e))?;
    let mut header = serde_json::to_vec(&header).map_err(|e| invalid(path, e))?;
    // Where the checksums' digits go: the key's own string, opening after a `{` or a `,`
    // (inside a JSON string every quote is escaped, so a key ending in `\"checksums.crc32`
    // has a backslash there).
    let pattern = format!("\"{CHECKSUM_KEY}\":\"");
    let sums_at = (header.windows(pattern.len()).enumerate())
        .find(|&(p, w)| w == pattern.as_bytes() && p > 0 && matches!(header[p - 1], b'{' | b','))
        .map(|(p, _)| p + pattern.len())
        .ok_or_else(|| invalid(path, "the header's checksums were not written"))?;
    header.resize(header.len().next_multiple_of(8), b' ');
    if header.len() as u64 > MAX_HEADER_BYTES {
        return Err(invalid(
            path,
            format!(
                "its header (names, shapes and metadata) would take {} bytes, more than the \
                 {MAX_HEADER_BYTES} a reader accepts",
                header.len()
            ),
        ));
    }
    let file = std::fs::File::create(tmp).map_err(|e| io_err(path, e))?;
    let mut out = std::io::BufWriter::with_capacity(1 << 20, file);
    let io = |e| io_err(path, e);
    out.write_all(&(header.len() as u64).to_le_bytes())
        .map_err(io)?;
    out.write_all(&header).map_err(io)?;
    let mut sums = BlockSums::new(CHECKSUM_BLOCK);
    for (name, e) in entries {
        let dtype = e.dtype;
        match e.data {
            Data::Bytes(b) => {
                refuse_non_finite(path, &name, dtype, &b, 0)?;
                sums.update(&b);
                out.write_all(&b).map_err(io)?
            }
            Data::Rows {
                rows,
                row_bytes,
                mut read,
            } => {
                let chunk = (READ_CHUNK_BYTES / row_bytes.max(1)).max(1);
                let mut at = 0;
                for first in (0..rows).step_by(chunk) {
                    let bytes = read(first..(first + chunk).min(rows))
                        .map_err(|e| invalid(path, format!("reading `{name}`: {e}")))?;
                    refuse_non_finite(path, &name, dtype, &bytes, at)?;
                    at += bytes.len();
                    sums.update(&bytes);
                    out.write_all(&bytes).map_err(io)?;
                }
            }
        }
    }
    let sums = sums.finish();
    if sums.len() != blocks {
        return Err(invalid(
            path,
            format!("{} checksum blocks written, {blocks} counted", sums.len()),
        ));
    }
    let digits: String = sums.iter().map(|c| format!("{c:08x}")).collect();
    out.seek(std::io::SeekFrom::Start(8 + sums_at as u64))
        .map_err(io)?;
    out.write_all(digits.as_bytes()).map_err(io)?;
    out.flush().map_err(io)
}

/// The CRC-32 of each `block`-byte block of a stream of bytes.
struct BlockSums {
    block: usize,
    /// Bytes of the current block seen.
    filled: usize,
    hasher: crc32fast::Hasher,
    sums: Vec<u32>,
}

impl BlockSums {
    fn new(block: usize) -> Self {
        BlockSums {
            block,
            filled: 0,
            hasher: crc32fast::Hasher::new(),
            sums: Vec::new(),
        }
    }

    /// Goes on with `bytes`.
    fn update(&mut self, mut bytes: &[u8]) {
        while !bytes.is_empty() {
            let n = bytes.len().min(self.block - self.filled);
            self.hasher.update(&bytes[..n]);
            self.filled += n;
            bytes = &bytes[n..];
            if self.filled == self.block {
                let done = std::mem::replace(&mut self.hasher, crc32fast::Hasher::new());
                self.sums.push(done.finalize());
                self.filled = 0;
            }
        }
    }

    /// Every block's checksum, the last one's if shorter too.
    fn finish(mut self) -> Vec<u32> {
        if self.filled > 0 {
            self.sums.push(self.hasher.finalize());
        }
        self.sums
    }
}

/// The first NaN or infinity among little-endian f32 words, with its index.
pub(crate) fn first_non_finite_f32(bytes: &[u8]) -> Option<(usize, f32)> {
    (bytes.chunks_exact(4))
        .map(|b| f32::from_le_bytes(b.try_into().expect("4 bytes")))
        .enumerate()
        .find(|(_, v)| !v.is_finite())
}

/// Refuses float values a reader refuses (NaN, ±inf in F32 and F64 tensors; `bytes` are
/// little-endian, from byte `at` of tensor `name`): a checkpoint of them would replace the
/// last good one with a file no load takes (a training run whose optimizer state overflowed
/// saved one). The temporary file is removed and the old checkpoint stays.
fn refuse_non_finite(path: &Path, name: &str, dtype: Dtype, bytes: &[u8], at: usize) -> Result<()> {
    let found = match dtype {
        Dtype::F32 => first_non_finite_f32(bytes).map(|(i, v)| (at / 4 + i, f64::from(v))),
        Dtype::F64 => (bytes.chunks_exact(8))
            .map(|b| f64::from_le_bytes(b.try_into().expect("8 bytes")))
            .enumerate()
            .find(|(_, v)| !v.is_finite())
            .map(|(i, v)| (at / 8 + i, v)),
        _ => None,
    };
    match found {
        Some((i, v)) => Err(invalid(
            path,
            format!(
                "`{name}` element {i} is {v}: a checkpoint's values are finite (no load would \
                 take this one); nothing was replaced"
            ),
        )),
        None => Ok(()),
    }
}

impl Drop for CheckpointWriter<'_> {
    /// A parts directory made for a checkpoint never written (an error while adding to it or
    /// writing it) goes with the writer.
    fn drop(&mut self) {
        if let Some((_, Some(dir))) = &self.parts {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

/// Whether `a` and `b` name the same path as written, `.` components aside.
fn same_path(a: &Path, b: &Path) -> bool {
    fn parts(p: &Path) -> impl Iterator<Item = std::path::Component<'_>> {
        p.components()
            .filter(|c| !matches!(c, std::path::Component::CurDir))
    }
    parts(a).eq(parts(b))
}

/// Flushes directory `dir`'s entries to disk: an I/O error is returned (one opening it too:
/// out of descriptors, say, is no proof of durability); where directories cannot be opened
/// or synced at all (some platforms and file systems), nothing is done.
fn sync_dir(dir: &Path) -> std::io::Result<()> {
    #[cfg(test)]
    if let Some(k) = FAIL_DIR_SYNC.with(|f| f.get()) {
        FAIL_DIR_SYNC.with(|f| f.set(k.checked_sub(1)));
        if k == 0 {
            return Err(std::io::Error::other("a failing directory sync (test)"));
        }
    }
    let unsupported = |e: &std::io::Error| {
        matches!(
            e.kind(),
            std::io::ErrorKind::InvalidInput | std::io::ErrorKind::Unsupported
        )
    };
    let d = match std::fs::File::open(dir) {
        Ok(d) => d,
        Err(e) if unsupported(&e) => return Ok(()),
        Err(e) => return Err(e),
    };
    match d.sync_all() {
        Err(e) if unsupported(&e) => Ok(()),
        r => r,
    }
}

#[cfg(test)]
thread_local! {
    /// Files synced to disk and then renamed into place on this thread (tests: a write
    /// without its file's sync would survive a kill, not a power loss, and no kill test sees
    /// it).
    pub(crate) static SYNCED_BEFORE_RENAME: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
}

#[cfg(test)]
thread_local! {
    /// `Some(k)`: the directory sync on this thread after the next `k` fails (tests).
    pub(crate) static FAIL_DIR_SYNC: std::cell::Cell<Option<u32>> =
        const { std::cell::Cell::new(None) };
}

/// A [`replace_atomically_or`] that failed: before the rename (`path` untouched, the
/// temporary file removed), or after it (`renamed`: the new file is in place, but its
/// directory entry may not be on disk yet, so a crash may bring back the old file).
pub(crate) struct ReplaceFailed {
    /// What failed.
    pub error: Error,
    /// Whether the new file took `path`'s place.
    pub renamed: bool,
}

/// Nanoseconds since the Unix epoch (0 for a clock before it): what makes a name unique
/// across processes that may share a pid (other PID namespaces, restarts).
pub(crate) fn clock_nanos() -> u64 {
    (std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH))
        .map_or(0, |d| d.as_nanos() as u64)
}

/// A nonzero id no other process or moment gives: the clock's nanoseconds and the process
/// id (a sharded checkpoint's, a training run's).
pub(crate) fn unique_id() -> u64 {
    (clock_nanos() ^ u64::from(std::process::id())).max(1)
}

/// `flock(LOCK_EX | LOCK_NB)` on `file`: the lock goes with its open file description. Off
/// Unix, nothing (and success).
pub(crate) fn try_lock(file: &std::fs::File) -> std::io::Result<()> {
    #[cfg(unix)]
    {
        use std::os::unix::io::AsRawFd;
        // SAFETY: flock reads no user memory; the descriptor is open.
        if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    #[cfg(not(unix))]
    let _ = file;
    Ok(())
}

/// Whether the file at `path` may be in use: some open file description (of any process)
/// holds a lock on it, as every live row store and serving directory holds one. Only a missing
/// file, or a lock this call could take itself, reads as not in use: any other error (a file
/// system without locks, no permission) reads as in use, so nothing live is taken for dead.
/// Off Unix every existing file reads as in use.
pub(crate) fn in_use(path: &Path) -> bool {
    let file = match std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
    {
        Ok(file) => file,
        Err(e) => return e.kind() != std::io::ErrorKind::NotFound,
    };
    // A lock taken here goes when `file` is closed, at the return.
    !cfg!(unix) || try_lock(&file).is_err()
}

/// The directory holding `path` (`.` for a bare file name).
fn parent_dir(path: &Path) -> &Path {
    path.parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."))
}

/// Removes the parts directories of the checkpoints written to `path` other than `keep`, the
/// one the file now at `path` names (another writer's, which may have replaced this one's
/// since), and those a writer or a reader holds ([`PARTS_LOCK`]).
fn remove_stale_parts(path: &Path, keep: Option<&Path>) {
    let Some(file_name) = path.file_name() else {
        return;
    };
    let prefix = parts_prefix(&file_name.to_string_lossy());
    let keep = keep.and_then(Path::file_name);
    let current: Option<String> =
        (CheckpointReader::open(path).ok()).and_then(|r| r.metadata(PARTS_KEY).map(str::to_string));
    let Ok(entries) = std::fs::read_dir(parent_dir(path)) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name();
        if name.to_string_lossy().starts_with(&prefix)
            && Some(name.as_os_str()) != keep
            && current.as_deref() != name.to_str()
            && !in_use(&e.path().join(PARTS_LOCK))
            && e.file_type().is_ok_and(|t| t.is_dir())
        {
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
}

/// Writes `bytes` to `path` through a temporary file in the same directory, fsync and rename,
/// so readers (and a crash) see the old file or the new one, never part of one.
pub fn write_atomically(path: &Path, bytes: &[u8]) -> Result<()> {
    write_atomically_or(path, bytes).map_err(|f| f.error)
}

/// [`write_atomically`], saying whether a failure came after the rename.
pub(crate) fn write_atomically_or(
    path: &Path,
    bytes: &[u8],
) -> std::result::Result<(), ReplaceFailed> {
    replace_atomically_or(path, |tmp| {
        let mut f = std::fs::File::create(tmp).map_err(|e| io_err(tmp, e))?;
        f.write_all(bytes).map_err(|e| io_err(tmp, e))
    })
}

/// Lets `fill` write the new contents to a temporary file next to `path`, then flushes that
/// file to disk, renames it over `path` and syncs the directory.
fn replace_atomically_or(
    path: &Path,
    fill: impl FnOnce(&Path) -> Result<()>,
) -> std::result::Result<(), ReplaceFailed> {
    let before = |error| ReplaceFailed {
        error,
        renamed: false,
    };
    let dir = parent_dir(path);
    let file_name = (path.file_name()).ok_or_else(|| before(invalid(path, "not a file path")))?;
    // Unique to this write (two threads may write one path), and locked until the rename:
    // a later writer of `path` removes the temporaries no writer holds, those a killed one
    // left ([`remove_dead_temporaries`]). The lock is taken under a staging name no remover
    // looks at, before the file takes its findable one, so no live write is ever seen
    // unlocked (a writer killed in between leaves an empty staging file). Where the lock
    // cannot be taken the write goes on (the file is then only not told from a dead writer's).
    // The clock tells apart writers that share a process id (other PID namespaces on one
    // volume), and the staging file must be new: a collision is an error, not a shared file.
    static WRITES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let write = WRITES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let name = format!(
        "{}{}-{write}-{}",
        temporary_prefix(file_name),
        std::process::id(),
        clock_nanos()
    );
    let (staging, tmp) = (dir.join(format!("{name}.new")), dir.join(name));
    let held = (std::fs::OpenOptions::new().write(true).create_new(true))
        .open(&staging)
        .map_err(|e| before(io_err(&staging, e)))?;
    let _ = try_lock(&held);
    if let Err(e) = std::fs::rename(&staging, &tmp) {
        let _ = std::fs::remove_file(&staging);
        return Err(before(io_err(&tmp, e)));
    }
    let result = (|| {
        fill(&tmp)?;
        std::fs::File::open(&tmp)
            .and_then(|f| f.sync_all())
            .map_err(|e| io_err(&tmp, e))?;
        #[cfg(test)]
        SYNCED_BEFORE_RENAME.with(|n| n.set(n.get() + 1));
        std::fs::rename(&tmp, path).map_err(|e| io_err(path, e))
    })();
    if let Err(e) = result {
        let _ = std::fs::remove_file(&tmp);
        return Err(before(e));
    }
    drop(held);
    remove_dead_temporaries(dir, file_name);
    // Persist the rename itself (the directory entry).
    sync_dir(dir).map_err(|e| ReplaceFailed {
        error: invalid(
            path,
            format!(
                "written and renamed into place, but syncing {} failed ({e}): a crash may \
                 still bring back the file it replaced",
                dir.display()
            ),
        ),
        renamed: true,
    })
}

/// The name of a temporary file of `file_name`'s writers, less the writer's process id,
/// write number and clock (`<pid>-<n>-<nanoseconds>`).
fn temporary_prefix(file_name: &std::ffi::OsStr) -> String {
    format!(".{}.tmp.", file_name.to_string_lossy())
}

/// Removes the temporary files of `file_name` in `dir` that no writer holds: those of
/// writers killed before their rename, which no one else would remove (a full model's worth
/// each). A live writer's is locked ([`in_use`]).
fn remove_dead_temporaries(dir: &Path, file_name: &std::ffi::OsStr) {
    let prefix = temporary_prefix(file_name);
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name();
        let Some(writer) = name.to_str().and_then(|n| n.strip_prefix(&prefix)) else {
            continue;
        };
        // `<pid>-<n>-<clock>`, or `<pid>-<n>` and `<pid>` as earlier versions named them.
        let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
        let parts: Vec<&str> = writer.split('-').collect();
        let ours = parts.len() <= 3 && parts.iter().all(|p| digits(p));
        let dead = ours && e.file_type().is_ok_and(|t| t.is_file()) && !in_use(&e.path());
        if dead {
            let _ = std::fs::remove_file(e.path());
        }
    }
}

/// Values decoded per read: a tensor is read from the file this many bytes at a time, so
/// reading one never holds more than it and its decoded values.
const READ_CHUNK_BYTES: usize = 4 << 20;

/// The largest header accepted (safetensors' own limit).
const MAX_HEADER_BYTES: u64 = 100_000_000;

/// Reads `buf.len()` bytes of `file` at `offset`.
fn read_at(file: &std::fs::File, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
    #[cfg(unix)]
    {
        std::os::unix::fs::FileExt::read_exact_at(file, buf, offset)
    }
    #[cfg(windows)]
    {
        use std::os::windows::fs::FileExt;
        let mut done = 0;
        while done < buf.len() {
            match file.seek_read(&mut buf[done..], offset + done as u64) {
                Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
                Ok(n) => done += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }
    #[cfg(not(any(unix, windows)))]
    {
        // No positioned reads: one reader must not be read from two threads at once here.
        use std::io::{Read, Seek};
        let mut f = file;
        f.seek(std::io::SeekFrom::Start(offset))?;
        f.read_exact(buf)
    }
}

/// A file's data checksums ([`CHECKSUM_KEY`]) and which of their blocks a read has checked.
struct Checksums {
    block: u64,
    sums: Vec<u32>,
    /// A bit a block: checked.
    checked: Vec<AtomicU64>,
}

impl Checksums {
    /// The checksums `header` holds for `data_len` bytes of data (`None`: it holds none), or
    /// an error naming `path` when they are malformed.
    fn parse(path: &Path, header: &Metadata, data_len: u64) -> Result<Option<Self>> {
        let meta = header.metadata().as_ref();
        let get = |key| meta.and_then(|m| m.get(key)).map(String::as_str);
        let (digits, block) = match (get(CHECKSUM_KEY), get(CHECKSUM_BLOCK_KEY)) {
            (None, None) => return Ok(None),
            (Some(d), Some(b)) => (d, b),
            (d, _) => {
                let (has, lacks) = if d.is_some() {
                    (CHECKSUM_KEY, CHECKSUM_BLOCK_KEY)
                } else {
                    (CHECKSUM_BLOCK_KEY, CHECKSUM_KEY)
                };
                return Err(invalid(
                    path,
                    format!("metadata `{has}` without `{lacks}` (corrupt header)"),
                ));
            }
        };
        let block = (block.parse::<u64>().ok())
            .filter(|b| (1..=1 << 30).contains(b))
            .ok_or_else(|| {
                invalid(
                    path,
                    format!("`{CHECKSUM_BLOCK_KEY}` is `{block}`, not a size in 1..=2^30 bytes"),
                )
            })?;
        let blocks = data_len.div_ceil(block);
        if digits.len() as u64 != 8 * blocks || !digits.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(invalid(
                path,
                format!(
                    "`{CHECKSUM_KEY}` is not {blocks} checksums of 8 hex digits (one for each \
                     {block} bytes of its {data_len} bytes of data): corrupt header"
                ),
            ));
        }
        let sums = (digits.as_bytes().chunks(8))
            .map(|d| u32::from_str_radix(std::str::from_utf8(d).expect("hex digits"), 16))
            .collect::<std::result::Result<Vec<u32>, _>>()
            .map_err(|e| invalid(path, format!("`{CHECKSUM_KEY}`: {e}")))?;
        let checked = (0..blocks.div_ceil(64))
            .map(|_| AtomicU64::new(0))
            .collect();
        Ok(Some(Checksums {
            block,
            sums,
            checked,
        }))
    }

    fn is_checked(&self, k: u64) -> bool {
        self.checked[(k / 64) as usize].load(Ordering::Relaxed) & (1 << (k % 64)) != 0
    }

    fn mark(&self, k: u64) {
        self.checked[(k / 64) as usize].fetch_or(1 << (k % 64), Ordering::Relaxed);
    }
}

/// An open checkpoint file with its header read and validated. Tensors are read from the file
/// when asked for, a few megabytes at a time (never the whole file at once), so a checkpoint
/// bigger than memory can be read tensor by tensor or range by range. The file stays open:
/// one replaced (renamed over) meanwhile is still read whole and consistent; one truncated
/// meanwhile gives an error naming it, not a crash. Each checksum block a read touches is read
/// whole and checked the first time (files without checksums, from other writers or older
/// embers, are read unchecked; [`verify`](Self::verify) checks a whole file).
pub struct CheckpointReader {
    path: PathBuf,
    file: std::fs::File,
    data_start: u64,
    /// Bytes after the header.
    data_len: u64,
    header: Metadata,
    /// The data's checksums, where the file has them (files written before embers kept them,
    /// or by other safetensors writers, have none and are read unchecked).
    checksums: Option<Checksums>,
    /// A shared lock on the parts directory, taken by [`parts_dir`](Self::parts_dir) and held
    /// while this reader lives: a writer replacing the checkpoint meanwhile leaves the parts
    /// this one reads.
    parts_lock: std::sync::OnceLock<Option<std::fs::File>>,
}

impl CheckpointReader {
    /// Opens `path` and validates its header against the file's length (a truncated or
    /// corrupt file is an error naming it).
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref().to_path_buf();
        let file = std::fs::File::open(&path).map_err(|e| io_err(&path, e))?;
        let len = file.metadata().map_err(|e| io_err(&path, e))?.len();
        let mut n = [0u8; 8];
        if len < 8 {
            return Err(invalid(
                &path,
                format!("{len} bytes, too short for a safetensors header"),
            ));
        }
        read_at(&file, &mut n, 0).map_err(|e| io_err(&path, e))?;
        let n = u64::from_le_bytes(n);
        if n > MAX_HEADER_BYTES || 8 + n > len {
            return Err(invalid(
                &path,
                format!(
                    "its header length {n} does not fit in its {len} bytes (truncated, or not \
                     a safetensors file)"
                ),
            ));
        }
        let mut text = vec![0u8; n as usize];
        read_at(&file, &mut text, 8).map_err(|e| io_err(&path, e))?;
        let text = std::str::from_utf8(&text)
            .map_err(|e| invalid(&path, format!("its header is not UTF-8 ({e})")))?;
        let header: Metadata = serde_json::from_str(text)
            .map_err(|e| invalid(&path, format!("its header is corrupt ({e})")))?;
        let want = (8 + n).checked_add(header.data_len() as u64);
        if want != Some(len) {
            let want = want.map_or("more than 2^64".into(), |w| w.to_string());
            return Err(invalid(
                &path,
                format!(
                    "holds {len} bytes where its header describes {want} (truncated or \
                     corrupt)"
                ),
            ));
        }
        let data_len = len - (8 + n);
        let checksums = Checksums::parse(&path, &header, data_len)?;
        Ok(CheckpointReader {
            path,
            file,
            data_start: 8 + n,
            data_len,
            header,
            checksums,
            parts_lock: std::sync::OnceLock::new(),
        })
    }

    /// The file this was read from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The checkpoint's parts directory (see [`CheckpointWriter::parts_beside`]), if it has
    /// one; an error when the metadata names something else than a parts directory beside
    /// the file, or when it is missing.
    pub fn parts_dir(&self) -> Result<Option<PathBuf>> {
        let Some(name) = self.metadata(PARTS_KEY) else {
            return Ok(None);
        };
        // A checkpoint copied under another name keeps its parts directory's name, so only
        // the form is checked.
        if name.contains(['/', '\\']) || !name.contains(".parts-") || name.starts_with('.') {
            return Err(invalid(
                &self.path,
                format!("`{PARTS_KEY}` is `{name}`, not a parts directory name"),
            ));
        }
        let dir = parent_dir(&self.path).join(name);
        if !dir.is_dir() {
            return Err(invalid(
                &self.path,
                format!(
                    "its parts directory {} is missing (the checkpoint's cached tables are \
                     there)",
                    dir.display()
                ),
            ));
        }
        self.parts_lock.get_or_init(|| lock_parts(&dir, false));
        Ok(Some(dir))
    }

    /// A metadata string, if present.
    pub fn metadata(&self, key: &str) -> Option<&str> {
        self.header
            .metadata()
            .as_ref()
            .and_then(|m| m.get(key))
            .map(String::as_str)
    }

    /// Every metadata entry, sorted by key, but the file's checksums (which describe this
    /// file's bytes, not what it holds: a writer of a copy makes its own).
    pub fn names_of_metadata(&self) -> Vec<(String, String)> {
        let mut all: Vec<(String, String)> = (self.header.metadata().iter())
            .flat_map(|m| m.iter())
            .filter(|(k, _)| ![CHECKSUM_KEY, CHECKSUM_BLOCK_KEY].contains(&k.as_str()))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        all.sort();
        all
    }

    /// A metadata string that must be present.
    pub fn required_metadata(&self, key: &str) -> Result<&str> {
        self.metadata(key)
            .ok_or_else(|| invalid(&self.path, format!("metadata `{key}` is missing")))
    }

    /// Whether a tensor named `name` is stored.
    pub fn contains(&self, name: &str) -> bool {
        self.header.info(name).is_some()
    }

    /// Names of all stored tensors (unordered).
    pub fn names(&self) -> Vec<String> {
        self.header.tensors().into_keys().collect()
    }

    /// Where `name`'s bytes lie in the file (checked to have `dtype` and `shape`).
    fn locate(&self, name: &str, dtype: Dtype, shape: &[usize]) -> Result<std::ops::Range<u64>> {
        let info = self
            .header
            .info(name)
            .ok_or_else(|| invalid(&self.path, format!("tensor `{name}` is missing")))?;
        if info.dtype != dtype || info.shape != shape {
            return Err(invalid(
                &self.path,
                format!(
                    "`{name}` is {:?} {:?}, expected {dtype:?} {shape:?}",
                    info.dtype, info.shape
                ),
            ));
        }
        let (a, b) = info.data_offsets;
        Ok(self.data_start + a as u64..self.data_start + b as u64)
    }

    /// The values of `name`, which must have element type `T` and shape `shape`.
    pub fn read<T: CheckpointElem>(&self, name: &str, shape: &[usize]) -> Result<Vec<T>> {
        // The count from the checked header, not from `shape` (which may come from a file).
        let at = self.locate(name, T::DTYPE, shape)?;
        self.read_range(name, shape, 0..(at.end - at.start) as usize / T::SIZE)
    }

    /// Elements `elems` (in row-major order) of `name`, which must have element type `T` and
    /// shape `shape`: only those are read from the file, but for the checksum blocks they
    /// touch that no read has checked yet (read whole, once).
    pub fn read_range<T: CheckpointElem>(
        &self,
        name: &str,
        shape: &[usize],
        elems: std::ops::Range<usize>,
    ) -> Result<Vec<T>> {
        let at = self.locate(name, T::DTYPE, shape)?;
        let len = (at.end - at.start) as usize;
        let bytes = (elems.start.checked_mul(T::SIZE))
            .zip(elems.end.checked_mul(T::SIZE))
            .filter(|(a, b)| a <= b && *b <= len)
            .ok_or_else(|| {
                invalid(
                    &self.path,
                    format!("elements {elems:?} of `{name}` {shape:?}: past its end"),
                )
            })?;
        // Read straight into the values' memory.
        let mut out = vec![T::zeroed(); elems.len()];
        let bytes_out: &mut [u8] = bytemuck::cast_slice_mut(&mut out);
        let start = at.start - self.data_start + bytes.0 as u64;
        self.read_data(&format!("`{name}`"), start, bytes_out)?;
        if cfg!(target_endian = "big") {
            for v in &mut out {
                *v = T::get(bytemuck::bytes_of(v));
            }
        }
        // Tables, optimizer state and dense weights are finite: a NaN or infinity read back
        // would spread through every later step before anything noticed.
        let non_finite = match T::DTYPE {
            Dtype::F32 => (bytemuck::cast_slice::<T, f32>(&out).iter())
                .position(|v| !v.is_finite())
                .map(|i| (i, f64::from(bytemuck::cast_slice::<T, f32>(&out)[i]))),
            Dtype::F64 => (bytemuck::cast_slice::<T, f64>(&out).iter())
                .position(|v| !v.is_finite())
                .map(|i| (i, bytemuck::cast_slice::<T, f64>(&out)[i])),
            _ => None,
        };
        if let Some((i, v)) = non_finite {
            return Err(invalid(
                &self.path,
                format!(
                    "`{name}` element {} is {v}: a checkpoint's values are finite",
                    elems.start + i
                ),
            ));
        }
        Ok(out)
    }

    /// Reads `out.len()` bytes of the data from byte `start` (counted from the data's
    /// start), a few megabytes at a time, and checks each checksum block they touch that no
    /// read has checked yet (reading it whole). `what` names what is read in errors.
    fn read_data(&self, what: &str, start: u64, out: &mut [u8]) -> Result<()> {
        let read = |buf: &mut [u8], at: u64| {
            read_at(&self.file, buf, self.data_start + at).map_err(|e| {
                if e.kind() == std::io::ErrorKind::UnexpectedEof {
                    invalid(
                        &self.path,
                        format!("{what} ends early: the file was truncated after it was opened"),
                    )
                } else {
                    io_err(&self.path, e)
                }
            })
        };
        let Some(c) = &self.checksums else {
            for (k, chunk) in out.chunks_mut(READ_CHUNK_BYTES).enumerate() {
                read(chunk, start + (k * READ_CHUNK_BYTES) as u64)?;
            }
            return Ok(());
        };
        let end = start + out.len() as u64;
        let span = (READ_CHUNK_BYTES as u64 / c.block).max(1);
        let mut pos = start;
        while pos < end {
            // Blocks `first..last`, of which bytes `pos..upto` are wanted.
            let first = pos / c.block;
            let last = (first + span).min(end.div_ceil(c.block));
            let upto = (last * c.block).min(end);
            let dst = &mut out[(pos - start) as usize..(upto - start) as usize];
            if (first..last).all(|k| c.is_checked(k)) {
                read(dst, pos)?;
            } else {
                let from = first * c.block;
                let mut buf = vec![0u8; ((last * c.block).min(self.data_len) - from) as usize];
                read(&mut buf, from)?;
                for (i, block) in buf.chunks(c.block as usize).enumerate() {
                    let k = first + i as u64;
                    if crc32fast::hash(block) != c.sums[k as usize] {
                        let at = k * c.block;
                        return Err(self.corrupt(what, at..at + block.len() as u64));
                    }
                    c.mark(k);
                }
                dst.copy_from_slice(&buf[(pos - from) as usize..(upto - from) as usize]);
            }
            pos = upto;
        }
        Ok(())
    }

    /// The error for data bytes `bytes` not matching their checksum, read for `what`: names
    /// the tensors those bytes hold.
    fn corrupt(&self, what: &str, bytes: std::ops::Range<u64>) -> Error {
        let mut held: Vec<(usize, String)> = (self.header.tensors().into_iter())
            .filter(|(_, i)| {
                let (a, b) = i.data_offsets;
                (a as u64) < bytes.end && bytes.start < b as u64
            })
            .map(|(n, i)| (i.data_offsets.0, format!("`{n}`")))
            .collect();
        held.sort();
        let more = held.len().saturating_sub(4);
        let mut names: Vec<String> = held.into_iter().take(4).map(|(_, n)| n).collect();
        if more > 0 {
            names.push(format!("{more} more"));
        }
        invalid(
            &self.path,
            format!(
                "reading {what}: data bytes {bytes:?} (holding {}) do not match their checksum: \
                 the file is corrupt (a bad disk, memory or copy); load a good copy",
                names.join(", ")
            ),
        )
    }

    /// Checks every byte of the data against its checksum (what reads check, block by block,
    /// as they read). `Ok(false)` when the file has no checksums to check.
    pub fn verify(&self) -> Result<bool> {
        if self.checksums.is_none() {
            return Ok(false);
        }
        let mut buf = vec![0u8; (READ_CHUNK_BYTES as u64).min(self.data_len) as usize];
        let mut pos = 0;
        while pos < self.data_len {
            let n = (buf.len() as u64).min(self.data_len - pos);
            self.read_data("its data", pos, &mut buf[..n as usize])?;
            pos += n;
        }
        Ok(true)
    }

    /// The stored shape of `name`.
    pub fn shape(&self, name: &str) -> Option<Vec<usize>> {
        self.header.info(name).map(|i| i.shape.clone())
    }

    /// A new tensor holding `name`, with its stored dtype and shape.
    pub fn read_tensor(&self, name: &str) -> Result<Tensor> {
        let info = self
            .header
            .info(name)
            .ok_or_else(|| invalid(&self.path, format!("tensor `{name}` is missing")))?;
        let shape = info.shape.clone();
        let dtype = match info.dtype {
            Dtype::F32 => DType::F32,
            Dtype::F64 => DType::F64,
            Dtype::F16 => DType::F16,
            Dtype::BF16 => DType::BF16,
            Dtype::I64 => DType::I64,
            Dtype::I32 => DType::I32,
            Dtype::U8 => DType::U8,
            other => {
                return Err(invalid(
                    &self.path,
                    format!("`{name}` has dtype {other:?}, which embers does not store"),
                ))
            }
        };
        crate::tensor::ops::with_any_dtype!(dtype, T => {
            Tensor::from_vec(self.read::<T>(name, &shape)?, &shape)
        })
    }

    /// A new tensor holding `name`, which must have `like`'s dtype and shape.
    pub fn read_like(&self, name: &str, like: &Tensor) -> Result<Tensor> {
        crate::tensor::ops::with_any_dtype!(like.dtype(), T => {
            Tensor::from_vec(self.read::<T>(name, like.shape())?, like.shape())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The parts directories of `ckpt.safetensors` in `dir`, sorted.
    fn parts_in(dir: &Path) -> Vec<String> {
        let mut names: Vec<String> = (std::fs::read_dir(dir).unwrap().flatten())
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with("ckpt.safetensors.parts-"))
            .collect();
        names.sort();
        names
    }

    fn temp(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("embers-reader-{}-{name}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    /// A writer killed before its rename leaves its temporary file; the next write of the same
    /// file removes it, but not a live writer's (locked), another file's, or a name that is no
    /// writer's.
    #[cfg(unix)]
    #[test]
    fn a_killed_writers_temporary_goes_with_the_next_write() {
        let dir = temp("dead-temporaries");
        let path = dir.join("m.safetensors");
        let named = |n: &str| dir.join(n);
        let dead = named(".m.safetensors.tmp.4194999-3-1764000000000000000");
        let dead_before = named(".m.safetensors.tmp.4194995-3");
        let dead_earlier = named(".m.safetensors.tmp.4194997");
        let live = named(".m.safetensors.tmp.4194998-0");
        let others = [
            named(".n.safetensors.tmp.5-0"),
            named(".m.safetensors.tmp.x1"),
            named(".m.safetensors.tmp.5-"),
            named(".m.safetensors.tmp.5-1-2-3"),
            // A writer's staging name: locked before it takes its findable one.
            named(".m.safetensors.tmp.4194996-0.new"),
        ];
        for p in [&dead, &dead_before, &dead_earlier, &live]
            .into_iter()
            .chain(&others)
        {
            std::fs::write(p, b"a partial checkpoint").unwrap();
        }
        let writer = std::fs::File::open(&live).unwrap();
        try_lock(&writer).unwrap();
        write_atomically(&path, b"new").unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"new");
        assert!(!dead.exists() && !dead_before.exists() && !dead_earlier.exists());
        assert!(live.exists() && others.iter().all(|p| p.exists()));
        drop(writer);
        write_atomically(&path, b"newer").unwrap();
        assert!(!live.exists() && others.iter().all(|p| p.exists()));
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// Two writers of one path and a reader: a writer's cleanup leaves the parts of a writer
    /// still writing (whose file then names them: they were removed, and the checkpoint named
    /// a missing directory), keeps the parts of the file now at the path, and leaves those a
    /// reader holds until it is done; the next write removes what is stale.
    #[test]
    fn cleanups_leave_the_parts_of_other_writers_and_of_readers() {
        let dir = temp("parts-race");
        let path = dir.join("ckpt.safetensors");
        let parts = || parts_in(&dir);
        let write = |w: CheckpointWriter<'_>, v: f32| {
            let mut w = w;
            w.add("x", &[1], &[v]).unwrap();
            w.write(&path).unwrap();
        };
        let start = |v: f32| {
            let mut w = CheckpointWriter::new();
            w.parts_beside(&path);
            let made = w.parts_dir().unwrap().unwrap();
            std::fs::write(made.join("rows.bin"), [v as u8]).unwrap();
            w
        };
        let named = |v: f32| {
            let r = CheckpointReader::open(&path).unwrap();
            assert_eq!(r.read::<f32>("x", &[1]).unwrap(), vec![v]);
            let at = r.parts_dir().unwrap().expect("named parts");
            assert_eq!(std::fs::read(at.join("rows.bin")).unwrap(), vec![v as u8]);
        };
        // A begins, B writes whole: B's cleanup leaves A's parts.
        let a = start(1.0);
        write(start(2.0), 2.0);
        assert_eq!(parts().len(), 2);
        // A finishes: its file names its parts, which are there; B's are stale and go.
        write(a, 1.0);
        named(1.0);
        assert_eq!(parts().len(), 1);
        // A reader of the checkpoint keeps its parts through a new write; they go after it.
        let reader = CheckpointReader::open(&path).unwrap();
        let held = reader.parts_dir().unwrap().unwrap();
        write(start(3.0), 3.0);
        assert!(
            held.join("rows.bin").exists(),
            "a reader's parts were removed"
        );
        named(3.0);
        drop(reader);
        write(start(4.0), 4.0);
        assert!(!held.exists());
        named(4.0);
        assert_eq!(parts().len(), 1);
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// Every atomic write syncs its file to disk before renaming it into place: checkpoints
    /// and plain replacements alike.
    #[test]
    fn every_replacement_syncs_its_file_before_the_rename() {
        let dir = temp("synced");
        let before = SYNCED_BEFORE_RENAME.with(|n| n.get());
        let mut w = CheckpointWriter::new();
        w.add("x", &[1], &[1.0f32]).unwrap();
        w.write(dir.join("a.safetensors")).unwrap();
        write_atomically(&dir.join("b.json"), b"{}").unwrap();
        assert_eq!(SYNCED_BEFORE_RENAME.with(|n| n.get()), before + 2);
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A NaN or infinity in an F32 or F64 tensor (given whole or as rows, in any chunk) is
    /// refused at the write, naming the tensor and the element: the last good checkpoint
    /// stays, and no temporary file is left (it was replaced by a file every load refuses).
    #[test]
    fn non_finite_values_are_refused_before_they_replace_a_checkpoint() {
        let dir = temp("non-finite");
        let path = dir.join("ckpt.safetensors");
        let mut w = CheckpointWriter::new();
        w.add("w", &[2], &[1.0f32, 2.0]).unwrap();
        w.write(&path).unwrap();
        let before = std::fs::read(&path).unwrap();
        let rows = 3 * READ_CHUNK_BYTES / 8 + 5;
        for (what, at, bad) in [
            ("f32 whole", 1usize, f64::NAN),
            ("f64 rows", rows - 1, f64::INFINITY),
            ("f64 rows", 0, f64::NEG_INFINITY),
        ] {
            let mut w = CheckpointWriter::new();
            w.add("ok", &[1], &[0.5f64]).unwrap();
            if what == "f32 whole" {
                w.add("w", &[2], &[1.0f32, bad as f32]).unwrap();
            } else {
                w.add_rows::<f64>("sums", &[rows, 1], move |r| {
                    Ok(r.map(|i| if i == at { bad } else { i as f64 }).collect())
                })
                .unwrap();
            }
            let err = w.write(&path).unwrap_err().to_string();
            let name = if what == "f32 whole" { "`w`" } else { "`sums`" };
            assert!(
                err.contains(&format!("{name} element {at} is"))
                    && err.contains("nothing was replaced"),
                "{what}: {err}"
            );
            assert_eq!(std::fs::read(&path).unwrap(), before, "{what}");
            let left: Vec<_> = (std::fs::read_dir(&dir).unwrap().flatten())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.contains(".tmp."))
                .collect();
            assert!(left.is_empty(), "{what}: {left:?}");
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A tensor several read chunks long (not a whole number of them) and small ones of other
    /// dtypes read back whole and by range, a range crossing a chunk boundary included; ranges
    /// past the end and wrong dtypes or shapes are refused by name.
    /// A directory sync that fails never removes parts a checkpoint on disk may name: the
    /// parts' own sync failing (before the file is replaced) leaves the old file and parts
    /// and removes the new parts; the file's directory failing after the rename leaves the
    /// new file in place with its parts and the old parts too; a clean write then removes
    /// the stale ones.
    #[test]
    fn a_failed_directory_sync_never_removes_parts_a_checkpoint_may_name() {
        let dir = temp("dir-sync");
        let path = dir.join("ckpt.safetensors");
        let write = |fail_after: Option<u32>, v: f32| -> Result<()> {
            let mut w = CheckpointWriter::new();
            w.parts_beside(&path);
            let parts = w.parts_dir()?.expect("a parts directory");
            std::fs::write(parts.join("rows.bin"), [v as u8]).unwrap();
            w.add("x", &[1], &[v])?;
            FAIL_DIR_SYNC.with(|f| f.set(fail_after));
            let written = w.write(&path);
            FAIL_DIR_SYNC.with(|f| f.set(None));
            written
        };
        let parts = || parts_in(&dir);
        let saved = |v: f32| {
            let r = CheckpointReader::open(&path).unwrap();
            assert_eq!(r.read::<f32>("x", &[1]).unwrap(), vec![v]);
            let named = r.parts_dir().unwrap().expect("named parts");
            assert_eq!(
                std::fs::read(named.join("rows.bin")).unwrap(),
                vec![v as u8]
            );
        };
        write(None, 1.0).unwrap();
        let first = parts();
        assert_eq!(first.len(), 1);
        let err = write(Some(0), 2.0).unwrap_err().to_string();
        assert!(err.contains("a failing directory sync (test)"), "{err}");
        assert_eq!(parts(), first);
        saved(1.0);
        let err = write(Some(1), 3.0).unwrap_err().to_string();
        assert!(
            err.contains("renamed into place") && err.contains("(test)"),
            "{err}"
        );
        assert_eq!(parts().len(), 2);
        assert!(parts().contains(&first[0]));
        saved(3.0);
        write(None, 4.0).unwrap();
        assert_eq!(parts().len(), 1);
        saved(4.0);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn tensors_read_back_whole_and_by_range_across_read_chunks() {
        let dir = temp("ranges");
        let path = dir.join("c.safetensors");
        let n = 2 * READ_CHUNK_BYTES / 4 + 1001;
        let big: Vec<f32> = (0..n).map(|i| i as f32 * 0.5 - 3.0).collect();
        let small: Vec<i64> = vec![-5, 7, 1 << 40];
        let bytes: Vec<u8> = (0..=255).collect();
        let mut w = CheckpointWriter::new();
        w.add("big", &[n], &big).unwrap();
        w.add("small", &[3], &small).unwrap();
        w.add("bytes", &[16, 16], &bytes).unwrap();
        w.set_metadata("k", "v");
        w.write(&path).unwrap();
        let r = CheckpointReader::open(&path).unwrap();
        assert_eq!(r.metadata("k"), Some("v"));
        assert!(r.read::<f32>("big", &[n]).unwrap() == big);
        assert_eq!(r.read::<i64>("small", &[3]).unwrap(), small);
        assert_eq!(r.read::<u8>("bytes", &[16, 16]).unwrap(), bytes);
        let edge = READ_CHUNK_BYTES / 4;
        for range in [0..0, 3..10, edge - 5..edge + 5, n - 7..n, 0..n] {
            let got = r.read_range::<f32>("big", &[n], range.clone()).unwrap();
            assert!(got == big[range.clone()], "{range:?}");
        }
        let err = (r.read_range::<f32>("big", &[n], n - 1..n + 1).unwrap_err()).to_string();
        assert!(
            err.contains("past its end") && err.contains("`big`"),
            "{err}"
        );
        let err = r.read::<f64>("small", &[3]).unwrap_err().to_string();
        assert!(err.contains("`small` is I64"), "{err}");
        let err = r.read::<i64>("small", &[4]).unwrap_err().to_string();
        assert!(err.contains("expected I64 [4]"), "{err}");
        // A shape whose product overflows (as one read from a file's metadata may): an error.
        let err = r.read::<f32>("big", &[1 << 40, 1 << 40]).unwrap_err();
        assert!(err.to_string().contains("expected F32"), "{err}");
        let err = r.read::<i64>("absent", &[3]).unwrap_err().to_string();
        assert!(err.contains("`absent` is missing"), "{err}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// Tensors given as rows are read a chunk at a time (several chunks, not a whole number
    /// of them) into a file that safetensors' own parser reads back value for value, beside
    /// tensors given whole; a read error or a read of the wrong length fails the write by
    /// name, and leaves the previous file as it was and no temporary file.
    #[test]
    fn tensors_read_by_rows_while_writing_make_a_standard_file() {
        let dir = temp("rows");
        let path = dir.join("c.safetensors");
        let (rows, cols) = (3 * READ_CHUNK_BYTES / (4 * 37) + 5, 37);
        let value = |r: usize, c: usize| (r * cols + c) as f32 * 0.25;
        let mut calls = Vec::new();
        let mut w = CheckpointWriter::new();
        w.add("first", &[2], &[1.5f64, -2.0]).unwrap();
        w.add_rows("big", &[rows, cols], |range: std::ops::Range<usize>| {
            calls.push(range.clone());
            Ok(range
                .flat_map(|r| (0..cols).map(move |c| value(r, c)))
                .collect::<Vec<f32>>())
        })
        .unwrap();
        let err = w.add_rows("first", &[1], |_| Ok(vec![0u8])).unwrap_err();
        assert!(
            err.to_string().contains("`first` is written twice"),
            "{err}"
        );
        w.add_rows("bytes", &[3, 2], |r| {
            Ok((r.start as u8 * 2..r.end as u8 * 2).collect())
        })
        .unwrap();
        w.set_metadata("k", "v");
        w.write(&path).unwrap();
        assert!(calls.len() > 3, "{calls:?}");
        let file = std::fs::read(&path).unwrap();
        let st = safetensors::SafeTensors::deserialize(&file).unwrap();
        let big: Vec<f32> = (st.tensor("big").unwrap().data().chunks_exact(4))
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
            .collect();
        assert_eq!(big.len(), rows * cols);
        assert!((0..rows * cols).all(|i| big[i] == value(i / cols, i % cols)));
        assert_eq!(st.tensor("bytes").unwrap().data(), &[0, 1, 2, 3, 4, 5]);
        assert_eq!(st.tensor("first").unwrap().shape(), &[2]);
        let r = CheckpointReader::open(&path).unwrap();
        assert_eq!(r.read::<f64>("first", &[2]).unwrap(), vec![1.5, -2.0]);
        assert_eq!(r.metadata("k"), Some("v"));

        let failing = |read: Box<dyn FnMut(std::ops::Range<usize>) -> Result<Vec<f32>> + Send>| {
            let mut w = CheckpointWriter::new();
            w.add_rows("t", &[10, 3], read).unwrap();
            let err = w.write(&path).unwrap_err().to_string();
            assert_eq!(std::fs::read(&path).unwrap(), file);
            let left: Vec<_> = (std::fs::read_dir(&dir).unwrap())
                .map(|e| e.unwrap().file_name().to_string_lossy().to_string())
                .filter(|n| n.contains(".tmp"))
                .collect();
            assert!(left.is_empty(), "{left:?}");
            err
        };
        let err = failing(Box::new(|_| {
            Err(Error::invalid("test", "the disk is gone"))
        }));
        assert!(
            err.contains("c.safetensors")
                && err.contains("reading `t`: ")
                && err.contains("the disk is gone"),
            "{err}"
        );
        let err = failing(Box::new(|r| Ok(vec![0.0; r.len() * 3 - 1])));
        assert!(
            err.contains("`t` rows 0..10: 29 values read, 30 expected"),
            "{err}"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// Tensors given whole make the very file safetensors' own writer makes of them (its
    /// order: widest dtype first, then by name, so each starts aligned to its element size;
    /// its padding), given as rows too; a header bigger than a reader accepts and a shape of
    /// more bytes than a usize counts are refused by name, the previous file kept.
    #[test]
    fn files_are_byte_for_byte_safetensors_own_and_impossible_ones_are_refused() {
        use safetensors::tensor::TensorView;
        let dir = temp("same");
        let path = dir.join("c.safetensors");
        let f64s: Vec<f64> = vec![0.5, -1.25, 3.0];
        let f32s: Vec<f32> = (0..7).map(|i| i as f32 / 3.0).collect();
        let u8s: Vec<u8> = vec![1, 2, 3, 4, 5];
        let halfs: Vec<half::f16> = (0..3).map(|i| half::f16::from_f32(i as f32)).collect();
        let i64s: Vec<i64> = vec![-1, 1 << 50];
        let views = [
            ("b.bytes", Dtype::U8, vec![5], u8s.clone()),
            ("a.half", Dtype::F16, vec![3], le_bytes(&halfs)),
            ("z.f32", Dtype::F32, vec![7, 1], le_bytes(&f32s)),
            ("m.f64", Dtype::F64, vec![3], le_bytes(&f64s)),
            ("c.i64", Dtype::I64, vec![2], le_bytes(&i64s)),
        ];
        let serialize = |meta: HashMap<String, String>| {
            safetensors::serialize(
                (views.iter()).map(|(n, d, s, b)| (*n, TensorView::new(*d, s.clone(), b).unwrap())),
                Some(meta),
            )
            .unwrap()
        };
        let mut meta = HashMap::from([("format".to_string(), "test".to_string())]);
        // The data's checksum, computed from safetensors' own file (one block).
        let plain = serialize(meta.clone());
        let n = u64::from_le_bytes(plain[..8].try_into().unwrap()) as usize;
        let crc = crc32fast::hash(&plain[8 + n..]);
        meta.insert(CHECKSUM_KEY.into(), format!("{crc:08x}"));
        meta.insert(CHECKSUM_BLOCK_KEY.into(), (1 << 20).to_string());
        let theirs = serialize(meta);
        for rows in [false, true] {
            let mut w = CheckpointWriter::new();
            w.add("b.bytes", &[5], &u8s).unwrap();
            w.add("a.half", &[3], &halfs).unwrap();
            if rows {
                let v = f32s.clone();
                w.add_rows("z.f32", &[7, 1], move |r| Ok(v[r].to_vec()))
                    .unwrap();
            } else {
                w.add("z.f32", &[7, 1], &f32s).unwrap();
            }
            w.add("m.f64", &[3], &f64s).unwrap();
            w.add("c.i64", &[2], &i64s).unwrap();
            w.set_metadata("format", "test");
            w.write(&path).unwrap();
            // Metadata is a hash map, which each writes in its own order: the headers are
            // compared as JSON, the rest byte for byte.
            let ours = std::fs::read(&path).unwrap();
            let parts = |f: &[u8]| {
                let n = u64::from_le_bytes(f[..8].try_into().unwrap()) as usize;
                let json: serde_json::Value = serde_json::from_slice(&f[8..8 + n]).unwrap();
                (n, json, f[8 + n..].to_vec())
            };
            assert!(parts(&ours) == parts(&theirs), "rows {rows}");
        }
        let kept = std::fs::read(&path).unwrap();
        let mut w = CheckpointWriter::new();
        w.set_metadata("huge", "x".repeat(MAX_HEADER_BYTES as usize));
        let err = w.write(&path).unwrap_err().to_string();
        assert!(
            err.contains("c.safetensors") && err.contains("header"),
            "{err}"
        );
        let mut w = CheckpointWriter::new();
        let err = (w.add_rows::<f32>("x", &[usize::MAX / 2, 3], |_| Ok(Vec::new())))
            .unwrap_err()
            .to_string();
        assert!(err.contains("`x`") && err.contains("more bytes"), "{err}");
        assert!(std::fs::read(&path).unwrap() == kept);
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A flipped bit anywhere in the data (one that still reads as a finite number) is an
    /// error naming the tensors of its block, for whole reads, range reads and `verify`;
    /// reads of other blocks go on; malformed checksums are refused at open; files without
    /// them (other writers') load; the writer's own keys are refused and not copied.
    #[test]
    fn checksums_catch_flipped_bits_block_by_block() {
        use safetensors::tensor::TensorView;
        let dir = temp("checksums");
        let path = dir.join("c.safetensors");
        // `b` (i64, first: widest dtype) then `a`, 9.5 MiB of f32: blocks 0..10.
        let a: Vec<f32> = (0..(19 << 17)).map(|i| (i % 1000) as f32 * 0.25).collect();
        let b: Vec<i64> = vec![7, -3, 1 << 40];
        let write = || {
            let mut w = CheckpointWriter::new();
            w.add("a", &[a.len()], &a).unwrap();
            w.add("b", &[3], &b).unwrap();
            w.set_metadata("run", "x");
            w.write(&path).unwrap();
        };
        write();
        let r = CheckpointReader::open(&path).unwrap();
        assert!(r.verify().unwrap());
        // Range reads spanning blocks unaligned, then whole reads.
        let mid = (1 << 18) + 3..(5 << 18) + 11;
        assert_eq!(
            r.read_range::<f32>("a", &[a.len()], mid.clone()).unwrap(),
            a[mid]
        );
        assert_eq!(r.read::<f32>("a", &[a.len()]).unwrap(), a);
        assert_eq!(r.read::<i64>("b", &[3]).unwrap(), b);
        assert_eq!(r.names_of_metadata(), vec![("run".into(), "x".into())]);
        drop(r);
        let header = 8 + u64::from_le_bytes(std::fs::read(&path).unwrap()[..8].try_into().unwrap());
        let flip = |at: u64, bit: u8| {
            use std::os::unix::fs::FileExt;
            let f = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open(&path)
                .unwrap();
            let mut x = [0u8];
            f.read_exact_at(&mut x, header + at).unwrap();
            f.write_all_at(&[x[0] ^ bit], header + at).unwrap();
        };
        // A low mantissa bit of `a`'s element 2^20 (data byte 24 + 4 * 2^20: block 4).
        flip(24 + (4 << 20), 1);
        let r = CheckpointReader::open(&path).unwrap();
        assert_eq!(r.read::<i64>("b", &[3]).unwrap(), b);
        let n = a.len();
        assert_eq!(r.read_range::<f32>("a", &[n], 0..1000).unwrap(), a[..1000]);
        assert_eq!(
            r.read_range::<f32>("a", &[n], (5 << 18)..n).unwrap(),
            a[5 << 18..]
        );
        for err in [
            r.read::<f32>("a", &[n]).unwrap_err(),
            r.read_range::<f32>("a", &[n], (1 << 20) + 5..(1 << 20) + 6)
                .unwrap_err(),
            r.verify().unwrap_err(),
        ] {
            let err = err.to_string();
            assert!(
                err.contains("c.safetensors")
                    && err.contains("data bytes 4194304..5242880 (holding `a`)")
                    && err.contains("do not match their checksum"),
                "{err}"
            );
        }
        drop(r);
        // In block 0, which holds both.
        write();
        flip(3, 0x10);
        let r = CheckpointReader::open(&path).unwrap();
        let err = r.read::<i64>("b", &[3]).unwrap_err().to_string();
        assert!(
            err.contains("(holding `b`, `a`)") && err.contains("reading `b`"),
            "{err}"
        );
        drop(r);
        // Malformed checksums, or one key without the other, are refused at open.
        fn view(bytes: &[u8]) -> TensorView<'_> {
            TensorView::new(Dtype::U8, vec![bytes.len()], bytes).unwrap()
        }
        let data = vec![1u8; 10];
        for (meta, says) in [
            (
                vec![(CHECKSUM_KEY, "0000000g"), (CHECKSUM_BLOCK_KEY, "4")],
                "not 3 checksums",
            ),
            (
                vec![(CHECKSUM_KEY, "00000000"), (CHECKSUM_BLOCK_KEY, "4")],
                "not 3 checksums",
            ),
            (vec![(CHECKSUM_KEY, "")], "without `checksums.block_bytes`"),
            (vec![(CHECKSUM_BLOCK_KEY, "4")], "without `checksums.crc32`"),
            (
                vec![(CHECKSUM_KEY, ""), (CHECKSUM_BLOCK_KEY, "0")],
                "not a size",
            ),
            (
                vec![(CHECKSUM_KEY, "+0000000"), (CHECKSUM_BLOCK_KEY, "10")],
                "not 1 checksums",
            ),
        ] {
            let meta = meta
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect();
            let bytes = safetensors::serialize([("d", view(&data))], Some(meta)).unwrap();
            std::fs::write(&path, bytes).unwrap();
            let err = CheckpointReader::open(&path).err().expect(says).to_string();
            assert!(
                err.contains(says) && err.contains("c.safetensors"),
                "{says}: {err}"
            );
        }
        // Another writer's file has none: read unchecked.
        let bytes = safetensors::serialize([("d", view(&data))], None).unwrap();
        std::fs::write(&path, bytes).unwrap();
        let r = CheckpointReader::open(&path).unwrap();
        assert!(!r.verify().unwrap());
        assert_eq!(r.read::<u8>("d", &[10]).unwrap(), data);
        drop(r);
        // An empty checkpoint has no blocks.
        CheckpointWriter::new().write(&path).unwrap();
        assert!(CheckpointReader::open(&path).unwrap().verify().unwrap());
        // A key ending in the checksums' key (its quote escaped) is not where they go,
        // whichever the header lists first.
        for n in 0..8 {
            let mut w = CheckpointWriter::new();
            w.add("x", &[2], &[1.5f32, 2.5]).unwrap();
            for k in 0..n {
                w.set_metadata(format!("u{k}\"{CHECKSUM_KEY}"), "v");
            }
            w.write(&path).unwrap();
            let r = CheckpointReader::open(&path).unwrap();
            assert!(r.verify().unwrap());
            assert_eq!(r.names_of_metadata().len(), n);
            assert!(r.names_of_metadata().iter().all(|(_, v)| v == "v"));
        }
        for key in [CHECKSUM_KEY, CHECKSUM_BLOCK_KEY] {
            let mut w = CheckpointWriter::new();
            w.set_metadata(key, "1");
            let err = w.write(&path).unwrap_err().to_string();
            assert!(err.contains(key) && err.contains("writer's own"), "{err}");
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// Short, truncated, padded and corrupt files are refused at open with their path; a file
    /// truncated after it was opened gives an error on read (no crash), and one replaced by a
    /// rename after it was opened is still read as it was.
    #[test]
    fn bad_files_are_refused_and_files_changed_under_a_reader_are_caught() {
        let dir = temp("bad");
        let path = dir.join("c.safetensors");
        let values: Vec<f32> = (0..1000).map(|i| i as f32).collect();
        let mut w = CheckpointWriter::new();
        w.add("v", &[1000], &values).unwrap();
        w.write(&path).unwrap();
        let good = std::fs::read(&path).unwrap();
        let refused = |bytes: &[u8], what: &str| {
            let bad = dir.join("bad.safetensors");
            std::fs::write(&bad, bytes).unwrap();
            let err = CheckpointReader::open(&bad)
                .err()
                .expect("refused")
                .to_string();
            assert!(
                err.contains("bad.safetensors") && err.contains(what),
                "{err}"
            );
        };
        refused(&good[..5], "too short");
        refused(&good[..good.len() - 4], "truncated");
        refused(&[&good[..], &[0u8; 4]].concat(), "truncated or corrupt");
        let mut huge = good.clone();
        huge[..8].copy_from_slice(&u64::MAX.to_le_bytes());
        refused(&huge, "header length");
        let mut corrupt = good.clone();
        corrupt[8] = b'[';
        refused(&corrupt, "header is corrupt");
        // A header describing more bytes than 64 bits count (eight tensors of 2^61 - 1).
        let size = (1u64 << 61) - 1;
        let tensors: Vec<String> = (0..8u64)
            .map(|i| {
                format!(
                    "\"t{i}\":{{\"dtype\":\"U8\",\"shape\":[{size}],\"data_offsets\":[{},{}]}}",
                    i * size,
                    (i + 1) * size
                )
            })
            .collect();
        let header = format!("{{{}}}", tensors.join(","));
        let huge = [&(header.len() as u64).to_le_bytes()[..], header.as_bytes()].concat();
        refused(&huge, "more than 2^64");
        let missing = CheckpointReader::open(dir.join("absent.safetensors")).err();
        assert!(missing.unwrap().to_string().contains("absent.safetensors"));

        // Replaced after opening: the open file is still the old one.
        let r = CheckpointReader::open(&path).unwrap();
        let mut w = CheckpointWriter::new();
        w.add("v", &[1000], &vec![9.0f32; 1000]).unwrap();
        w.write(&path).unwrap();
        assert!(r.read::<f32>("v", &[1000]).unwrap() == values);
        // Truncated after opening: an error naming the file and the tensor.
        let r = CheckpointReader::open(&path).unwrap();
        let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        f.set_len(good.len() as u64 / 2).unwrap();
        let err = r.read::<f32>("v", &[1000]).unwrap_err().to_string();
        assert!(
            err.contains("c.safetensors") && err.contains("`v` ends early"),
            "{err}"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}
