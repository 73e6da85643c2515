//! Checkpoints as safetensors files, written atomically.
//!
//! [`CheckpointWriter`] collects named tensors and string metadata and writes them in one
//! safetensors file under a temporary name in the destination's directory, flushes it to disk
//! (fsync), renames it over the destination and syncs the directory: a crash at any moment
//! leaves either the previous file or the new one, never a mix. [`CheckpointReader`] opens such
//! a file, validates its header, and hands out tensors with their dtype and shape checked, so
//! callers can read and check everything before changing any state.

use std::borrow::Cow;
use std::collections::{HashMap, HashSet};
use std::io::Write;
use std::path::{Path, PathBuf};

use safetensors::tensor::{Dtype, Metadata, SafeTensors, View};

use crate::{DType, Error, Result, Tensor};

struct Entry {
    dtype: Dtype,
    shape: Vec<usize>,
    data: Vec<u8>,
}

impl View for &Entry {
    fn dtype(&self) -> Dtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Borrowed(&self.data)
    }
    fn data_len(&self) -> usize {
        self.data.len()
    }
}

/// Element types a checkpoint stores, with their safetensors dtype and little-endian bytes.
pub trait CheckpointElem: Copy {
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

fn safetensors_dtype(dtype: DType) -> Dtype {
    crate::tensor::ops::with_any_dtype!(dtype, T => <T as CheckpointElem>::DTYPE)
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

/// Metadata key naming a checkpoint's directory of parts (see
/// [`CheckpointWriter::parts_beside`]).
const PARTS_KEY: &str = "parts_dir";

/// The prefix of the parts directories of checkpoints written to a file named `file_name`.
fn parts_prefix(file_name: &str) -> String {
    format!("{file_name}.parts-")
}

/// Collects tensors and metadata for one atomically written safetensors file.
#[derive(Default)]
pub struct CheckpointWriter {
    entries: Vec<(String, Entry)>,
    names: HashSet<String>,
    metadata: HashMap<String, String>,
    /// The file this checkpoint will be written to, when it may have a parts directory, and
    /// that directory once made.
    parts: Option<(PathBuf, Option<PathBuf>)>,
}

impl CheckpointWriter {
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
        if !self.names.insert(name.clone()) {
            return Err(Error::invalid(
                "checkpoint",
                format!("`{name}` is written twice; names must be unique"),
            ));
        }
        let mut data = Vec::with_capacity(values.len() * T::SIZE);
        values.iter().for_each(|v| v.put(&mut data));
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
        let nonce = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let name = format!(
            "{}{nonce:x}-{}",
            parts_prefix(&file_name),
            std::process::id()
        );
        let dir = parent_dir(target).join(&name);
        std::fs::create_dir_all(&dir).map_err(|e| io_err(&dir, e))?;
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
                sync_dir(dir);
            }
        }
        let metadata = std::mem::take(&mut self.metadata);
        let entries = std::mem::take(&mut self.entries);
        let written = replace_atomically(path, |tmp| {
            safetensors::serialize_to_file(
                entries.iter().map(|(n, e)| (n.as_str(), e)),
                Some(metadata),
                tmp,
            )
            .map_err(|e| invalid(path, e))
        });
        if written.is_ok() {
            if let Some((_, made)) = self.parts.take() {
                remove_stale_parts(path, made.as_deref());
            }
        }
        written
    }
}

impl Drop for CheckpointWriter {
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

/// Flushes directory `dir`'s entries to disk (best effort where directories cannot be opened).
fn sync_dir(dir: &Path) {
    if let Ok(d) = std::fs::File::open(dir) {
        let _ = d.sync_all();
    }
}

/// The directory holding `path` (`.` for a bare file name).
fn parent_dir(path: &Path) -> &Path {
    path.parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."))
}

/// Removes the parts directories of the checkpoints written to `path` other than `keep`.
fn remove_stale_parts(path: &Path, keep: Option<&Path>) {
    let Some(file_name) = path.file_name() else {
        return;
    };
    let prefix = parts_prefix(&file_name.to_string_lossy());
    let keep = keep.and_then(Path::file_name);
    let Ok(entries) = std::fs::read_dir(parent_dir(path)) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name();
        if name.to_string_lossy().starts_with(&prefix)
            && Some(name.as_os_str()) != keep
            && e.file_type().is_ok_and(|t| t.is_dir())
        {
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
}

/// Writes `bytes` to `path` through a temporary file in the same directory, fsync and rename,
/// so readers (and a crash) see the old file or the new one, never part of one.
pub fn write_atomically(path: &Path, bytes: &[u8]) -> Result<()> {
    replace_atomically(path, |tmp| {
        let mut f = std::fs::File::create(tmp).map_err(|e| io_err(tmp, e))?;
        f.write_all(bytes).map_err(|e| io_err(tmp, e))
    })
}

/// Lets `fill` write the new contents to a temporary file next to `path`, then flushes that
/// file to disk, renames it over `path` and syncs the directory.
fn replace_atomically(path: &Path, fill: impl FnOnce(&Path) -> Result<()>) -> Result<()> {
    let dir = parent_dir(path);
    let file_name = path
        .file_name()
        .ok_or_else(|| invalid(path, "not a file path"))?;
    let tmp = dir.join(format!(
        ".{}.tmp.{}",
        file_name.to_string_lossy(),
        std::process::id()
    ));
    let result = (|| {
        fill(&tmp)?;
        std::fs::File::open(&tmp)
            .and_then(|f| f.sync_all())
            .map_err(|e| io_err(&tmp, e))?;
        std::fs::rename(&tmp, path).map_err(|e| io_err(path, e))?;
        // Persist the rename itself (the directory entry).
        sync_dir(dir);
        Ok(())
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

/// A checkpoint file read into memory with its header validated.
pub struct CheckpointReader {
    path: PathBuf,
    bytes: Vec<u8>,
    data_start: usize,
    header: Metadata,
}

impl CheckpointReader {
    /// Reads and validates `path` (a truncated or corrupt file is an error naming it).
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref().to_path_buf();
        let bytes = std::fs::read(&path).map_err(|e| io_err(&path, e))?;
        SafeTensors::deserialize(&bytes).map_err(|e| invalid(&path, e))?;
        let (n, header) = SafeTensors::read_metadata(&bytes).map_err(|e| invalid(&path, e))?;
        Ok(CheckpointReader {
            path,
            bytes,
            data_start: 8 + n,
            header,
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

    /// Every metadata entry, sorted by key.
    pub fn names_of_metadata(&self) -> Vec<(String, String)> {
        let mut all: Vec<(String, String)> = self
            .header
            .metadata()
            .as_ref()
            .map(|m| m.iter().map(|(k, v)| (k.clone(), v.clone())).collect())
            .unwrap_or_default();
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

    fn raw(&self, name: &str, dtype: Dtype, shape: &[usize]) -> Result<&[u8]> {
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
        Ok(&self.bytes[self.data_start + a..self.data_start + b])
    }

    /// The values of `name`, which must have element type `T` and shape `shape`.
    pub fn read<T: CheckpointElem>(&self, name: &str, shape: &[usize]) -> Result<Vec<T>> {
        Ok(self
            .raw(name, T::DTYPE, shape)?
            .chunks_exact(T::SIZE)
            .map(T::get)
            .collect())
    }

    /// Elements `elems` (in row-major order) of `name`, which must have element type `T` and
    /// shape `shape`: only those are decoded.
    pub fn read_range<T: CheckpointElem>(
        &self,
        name: &str,
        shape: &[usize],
        elems: std::ops::Range<usize>,
    ) -> Result<Vec<T>> {
        let raw = self.raw(name, T::DTYPE, shape)?;
        let bytes = raw
            .get(elems.start * T::SIZE..elems.end * T::SIZE)
            .ok_or_else(|| {
                invalid(
                    &self.path,
                    format!("elements {elems:?} of `{name}` {shape:?}: past its end"),
                )
            })?;
        Ok(bytes.chunks_exact(T::SIZE).map(T::get).collect())
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
        let dtype = safetensors_dtype(like.dtype());
        let _ = self.raw(name, dtype, like.shape())?;
        crate::tensor::ops::with_any_dtype!(like.dtype(), T => {
            Tensor::from_vec(self.read::<T>(name, like.shape())?, like.shape())
        })
    }
}
