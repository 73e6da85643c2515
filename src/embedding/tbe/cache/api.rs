//! What a [`TableBatchedEmbedding`] with cached tables offers beyond the uncached one:
//! statistics, `flush`, `prefetch`, and checkpoints that are the row file itself plus a small
//! manifest.
//!
//! A checkpoint directory holds `manifest.json` and the row file it names
//! (`rows-<step>-<nonce>.bin`). Saving flushes the cache, copies the live row file under a
//! temporary name, syncs it, renames it, then replaces the manifest atomically (temporary file,
//! fsync, rename) and only then removes the previous row file: killed at any moment, the
//! directory still holds a manifest and the complete file it names. Loading checks the
//! manifest against the operator (tables, optimizer), the file's length and its checksum before
//! touching anything.

use std::path::Path;

use serde_json::json;

use super::store::{io_error, Previous};
use super::{CacheStats, CacheTimes};
use crate::embedding::input::TbeInput;
use crate::embedding::optimizer::FusedOptimizer;
use crate::embedding::tbe::TbeConfig;
use crate::embedding::tbe::{moved_error, TableBatchedEmbedding, Tables};
use crate::{Error, Result};

const OP: &str = "cached TBE checkpoint";
const FORMAT: &str = "embers.cached-tbe.v1";
const MANIFEST: &str = "manifest.json";

impl TableBatchedEmbedding {
    /// Whether the tables live in a file behind a DRAM cache
    /// ([`new_cached`](Self::new_cached)).
    pub fn is_cached(&self) -> bool {
        matches!(self.inner.state.read().tables, Tables::Cached(_))
    }

    /// Each table's cache counters since the operator was built (or the counters reset); `None`
    /// unless the tables are cached.
    pub fn cache_stats(&self) -> Option<Vec<CacheStats>> {
        match &self.inner.state.read().tables {
            Tables::Cached(c) => Some(c.stats()),
            _ => None,
        }
    }

    /// Where the cache's admissions spent their time since the operator was built or the
    /// counters reset (`None` unless the tables are cached): in all, moving rows to and from
    /// the file, and (a GPU cache) copying them to and from the GPU.
    pub fn cache_times(&self) -> Option<CacheTimes> {
        match &self.inner.state.read().tables {
            Tables::Cached(c) => Some(c.times()),
            _ => None,
        }
    }

    /// Drops an operator built for a collection that could not be built, its row file (if
    /// cached) removed with it: nothing else knows that file, and a table bigger than memory
    /// takes a disk's worth. Shared handles keep the operator, and the file, until they go.
    pub(crate) fn discard(self) {
        if let Tables::Cached(c) = &mut self.inner.state.write().tables {
            c.discard_on_drop();
        }
    }

    /// Zeroes the cache counters and times (nothing without a cache).
    pub fn reset_cache_stats(&self) {
        if let Tables::Cached(c) = &mut self.inner.state.write().tables {
            c.reset_stats();
        }
    }

    /// Per table, the cache slots that batches still alive (prepared, or recorded for a
    /// backward) hold locked; empty without a cache.
    pub fn locked_cache_slots(&self) -> Result<Vec<usize>> {
        match &mut self.inner.state.write().tables {
            Tables::Cached(c) => {
                c.drain_released()?;
                c.locked_slots()
            }
            _ => Ok(Vec::new()),
        }
    }

    /// Writes every cached row that changed back to the file and syncs it to disk (nothing
    /// without a cache).
    pub fn flush(&self) -> Result<()> {
        match &mut self.inner.state.write().tables {
            Tables::Cached(c) => c.flush(),
            _ => Ok(()),
        }
    }

    /// Admits the batch `input` to the cache now — its rows read in and locked — and keeps
    /// the admission for the batch's own `prepare` or `forward`, which then takes it instead of
    /// admitting the batch again (FBGEMM's prefetch): call it with batch `i + 1` while batch
    /// `i` trains, from another thread if you like (calls are serialised with forward and
    /// backward). At most two prefetched batches wait; an older one is dropped (its rows
    /// unlocked). A row a backward in flight will still update is kept coherent: the backward
    /// writes where the row lives when it runs. Without a cache it does nothing.
    ///
    /// On a GPU the admission runs on a prefetch stream (one per device, shared by its
    /// caches), so that called once batch `i`'s backward is queued, it runs beside that
    /// backward instead of after it: it waits only for the batches released before (their
    /// slots are the ones it may take), not for the dirty marks and updates of the batch in
    /// flight, whose rows stay locked. The batch's own lookup waits for the prefetch stream.
    pub fn prefetch(&self, input: TbeInput<'_>) -> Result<()> {
        if !self.is_cached() {
            return Ok(());
        }
        let batch = self.validate_input(input)?;
        let Tables::Cached(c) = &mut self.inner.state.write().tables else {
            return Err(moved_error());
        };
        c.prefetch(&self.inner.config, &batch)
    }

    /// A GPU cache that prefetches on its device's prefetch stream: timed events recorded on
    /// that stream at the start and the end of the last [`prefetch`](Self::prefetch)'s
    /// admission, each span given once. Placed against events of the caller's own stream
    /// ([`CudaDevice::record_event`](crate::cuda::CudaDevice::record_event),
    /// [`DeviceEvent::elapsed_ms`](crate::cuda::DeviceEvent::elapsed_ms)) they show how much
    /// of the admission ran beside the backward before it; the span starts once the
    /// admission's waits for other streams are met. `None` without a cache, on the host,
    /// when prefetching on the caller's stream, when the last prefetch was admitted by the
    /// host (a batch too big for the device directory's keys), or when the last span was
    /// taken.
    pub fn take_prefetch_span(&self) -> Option<[crate::cuda::DeviceEvent; 2]> {
        match &mut self.inner.state.write().tables {
            Tables::Cached(c) => c.take_prefetch_span(),
            _ => None,
        }
    }

    /// Saves the tables, optimizer state and step count to the directory `dir` (created if
    /// needed): a copy of the row file, synced and renamed into place, then `manifest.json`
    /// (its name, length, checksum, the tables, optimizer and step) replaced atomically, then
    /// the previous row file removed — killed at any moment, `dir` holds a loadable checkpoint.
    pub fn save_cached_checkpoint(&self, dir: impl AsRef<Path>) -> Result<()> {
        let dir = dir.as_ref();
        let cfg = &self.inner.config;
        let mut state = self.inner.state.write();
        let step = state.step;
        let Tables::Cached(c) = &mut state.tables else {
            return Err(Error::invalid(OP, "the tables are not cached in a file"));
        };
        let ours = tables_of(cfg);
        if let Ok(text) = read_manifest(&dir.join(MANIFEST)) {
            let theirs = (text.len() as u64 <= MANIFEST_LIMIT)
                .then(|| serde_json::from_str::<serde_json::Value>(&text).ok())
                .flatten()
                .and_then(|m| manifest_tables(&m));
            let held = match &theirs {
                Some(theirs) if *theirs == ours => None,
                Some(theirs) => Some(format!("the checkpoint of other tables ({theirs:?})")),
                None => Some(format!("a {MANIFEST} that is no checkpoint manifest")),
            };
            if let Some(held) = held {
                return Err(Error::invalid(
                    OP,
                    format!(
                        "{} holds {held}; give each operator its own directory (nothing \
                         there was changed)",
                        dir.display()
                    ),
                ));
            }
        }
        c.flush()?;
        std::fs::create_dir_all(dir).map_err(|e| io_error(dir, "creating", e))?;
        let nonce = crate::checkpoint::clock_nanos();
        let name = format!("rows-{step}-{nonce:x}.bin");
        let tmp = dir.join(format!(".{name}.tmp"));
        // Rows that went non-finite are refused: the previous checkpoint stays, loadable.
        let checksum = match c.store().copy_to(&tmp, true) {
            Ok(h) => h,
            Err(e) => {
                let _ = std::fs::remove_file(&tmp);
                return Err(e);
            }
        };
        let target = dir.join(&name);
        if let Err(e) = std::fs::rename(&tmp, &target) {
            let _ = std::fs::remove_file(&tmp);
            return Err(io_error(&target, "renaming", e));
        }
        let manifest = json!({
            "format": FORMAT,
            "rows_file": name,
            "bytes": c.store().len(),
            "checksum": format!("{checksum:016x}"),
            "step": step,
            "optimizer": cfg.optimizer.name(),
            "cache_policy": c.policy().name(),
            "tables": cfg.tables.iter().map(|s| json!({
                "name": s.name, "rows": s.rows, "dim": s.dim,
            })).collect::<Vec<_>>(),
        });
        let written = serde_json::to_string_pretty(&manifest)
            .map_err(|e| Error::invalid(OP, format!("writing the manifest: {e}")))
            .and_then(|text| {
                crate::checkpoint::write_atomically_or(&dir.join(MANIFEST), text.as_bytes())
                    .map_err(|f| {
                        // Renamed, the manifest names the new copy: it stays, and so do the
                        // old ones (a crash may yet bring back the old manifest).
                        if !f.renamed {
                            let _ = std::fs::remove_file(&target);
                        }
                        f.error
                    })
            });
        written?;
        // Only now may the previous checkpoint's file go.
        if let Ok(entries) = std::fs::read_dir(dir) {
            for e in entries.flatten() {
                let n = e.file_name().to_string_lossy().into_owned();
                let stale = (n.starts_with("rows-") && n.ends_with(".bin") && n != name)
                    || (n.starts_with(".rows-") && n.ends_with(".tmp"));
                if stale {
                    let _ = std::fs::remove_file(e.path());
                }
            }
        }
        Ok(())
    }

    /// Loads a checkpoint written by [`save_cached_checkpoint`](Self::save_cached_checkpoint)
    /// into this operator (whose tables and optimizer must match): the row file is checked
    /// (length, checksum) and copied over the live one, the cache emptied. Any error leaves the
    /// operator as it was.
    pub fn load_cached_checkpoint(&self, dir: impl AsRef<Path>) -> Result<()> {
        let staged = self.stage_cached_checkpoint(dir.as_ref())?;
        self.commit_cached_checkpoint(staged)
    }

    /// The first half of [`load_cached_checkpoint`](Self::load_cached_checkpoint): every
    /// check, and the rows copied beside the live ones; nothing changes yet.
    pub(crate) fn stage_cached_checkpoint(&self, dir: &Path) -> Result<StagedRows> {
        let m = Manifest::read(dir, &self.inner.config)?;
        let mut state = self.inner.state.write();
        let Tables::Cached(c) = &mut state.tables else {
            return Err(Error::invalid(OP, "the tables are not cached in a file"));
        };
        // Refused now rather than at the commit: a commit should not fail on a check.
        c.check_idle()?;
        if m.bytes != c.store().len() {
            return Err(m.bad(format!(
                "says {} bytes of rows, these tables need {}",
                m.bytes,
                c.store().len()
            )));
        }
        // Read (and checked) beside the live rows first; an unaccepted copy goes with `staged`.
        let staged = c.store().stage(&m.rows_file, true)?;
        let h = staged.checksum();
        if format!("{h:016x}") != m.checksum {
            return Err(m.corrupt(h));
        }
        let step = m.step;
        Ok(StagedRows { staged, step })
    }

    /// The second half of [`load_cached_checkpoint`](Self::load_cached_checkpoint): the staged
    /// rows become the live ones, the cache emptied.
    pub(crate) fn commit_cached_checkpoint(&self, staged: StagedRows) -> Result<()> {
        let cfg = &self.inner.config;
        let mut state = self.inner.state.write();
        let Tables::Cached(c) = &mut state.tables else {
            return Err(Error::invalid(OP, "the tables are not cached in a file"));
        };
        c.check_idle()?;
        c.commit_store(staged.staged)?;
        // The old file's rows (dirty ones included) are gone with it: forget them. A cache
        // that cannot is unusable: its directory names the old file's rows.
        if let Err(e) = c.invalidate(cfg) {
            c.poison(format!(
                "after a checkpoint load that could not empty it ({e})"
            ));
            return Err(e);
        }
        state.step = staged.step;
        Ok(())
    }

    /// [`commit_cached_checkpoint`](Self::commit_cached_checkpoint), keeping what it replaces
    /// for [`undo_commit`](Self::undo_commit): the dirty cached rows are written back first, so
    /// that the rows kept are every row, and an error doing so refuses the load (nothing is
    /// lost). A cache whose rows are lost already — unusable after a failed admission, or its
    /// file truncated — loads without writing them back and keeps nothing (that is how it
    /// recovers; a truncated file could not even be read through its mapping), and
    /// [`Kept::rows`] says why, for an undo to leave it unusable again.
    fn commit_keeping(&self, staged: StagedRows) -> Result<Kept> {
        let cfg = &self.inner.config;
        let mut state = self.inner.state.write();
        let Tables::Cached(c) = &mut state.tables else {
            return Err(Error::invalid(OP, "the tables are not cached in a file"));
        };
        c.check_idle()?;
        let lost = match c.poisoned() {
            Some(why) => Some(why.to_string()),
            // Truncated under it: its rows are gone already (an I/O error refuses the load).
            None => match c.store().file_len()? {
                have if have != c.store().len() => Some(format!(
                    "after its row file changed length under it ({})",
                    c.store().wrong_length(have)
                )),
                _ => {
                    c.flush()?;
                    None
                }
            },
        };
        let rows = match lost {
            Some(why) => {
                c.commit_store(staged.staged)?;
                Err(why)
            }
            None => Ok(c.commit_store_keeping(staged.staged)?),
        };
        if let Err(e) = c.invalidate(cfg) {
            // Not committed after all.
            match rows {
                Ok(previous) => c.restore_store(previous)?,
                Err(why) => c.poison(why),
            }
            return Err(e);
        }
        let step = std::mem::replace(&mut state.step, staged.step);
        Ok(Kept { rows, step })
    }

    /// Puts back the rows and step count a [`commit_keeping`](Self::commit_keeping) replaced
    /// (the cache emptied again), or for a cache whose rows were lost, the step count, and
    /// makes it unusable again. On an error the kept rows stay where the error says.
    fn undo_commit(&self, kept: Kept) -> Result<()> {
        let cfg = &self.inner.config;
        let mut guard = self.inner.state.write();
        let state = &mut *guard;
        let abandon = |rows: std::result::Result<Previous, String>, e: Error| match rows {
            Ok(previous) => previous.abandon(e),
            Err(_) => e,
        };
        let Tables::Cached(c) = &mut state.tables else {
            let e = Error::invalid(OP, "the tables are not cached in a file");
            return Err(abandon(kept.rows, e));
        };
        let lost = kept.rows.as_ref().err().cloned();
        let undone = match c.check_idle() {
            Err(e) => Err(abandon(kept.rows, e)),
            Ok(()) => match kept.rows {
                Ok(previous) => c.restore_store(previous),
                Err(_) => Ok(()),
            }
            .and_then(|()| {
                state.step = kept.step;
                c.invalidate(cfg)
            }),
        };
        // Unusable again whatever else failed: its own rows are gone.
        if let Some(why) = lost {
            c.poison(why);
        }
        undone
    }
}

/// What a [`TableBatchedEmbedding::commit_keeping`] replaced: the rows, or why the cache's
/// own rows were lost already (none were kept), and the step count.
struct Kept {
    rows: std::result::Result<Previous, String>,
    step: u64,
}

/// Commits the staged checkpoint loads of several cached TBEs as one: the rows each commit
/// replaces are kept (dirty cached rows written back first) until every commit is done, and if
/// one fails — an I/O error when its file is renamed into place — the TBEs committed before it
/// get their rows, cache and step count back, and the error says so. A single load is a plain
/// commit (nothing to keep). This covers errors, not a crash of the process midway: after one,
/// load the checkpoint again.
pub(crate) fn commit_cached_checkpoints(
    loads: Vec<(&TableBatchedEmbedding, StagedRows)>,
) -> Result<()> {
    if loads.len() == 1 {
        let (tbe, staged) = loads.into_iter().next().expect("one load");
        return tbe.commit_cached_checkpoint(staged);
    }
    let mut done = Vec::with_capacity(loads.len());
    for (tbe, staged) in loads {
        match tbe.commit_keeping(staged) {
            Ok(kept) => done.push((tbe, kept)),
            Err(e) => {
                let n = done.len();
                let failed: Vec<Error> = (done.into_iter().rev())
                    .filter_map(|(tbe, kept)| tbe.undo_commit(kept).err())
                    .collect();
                return Err(Error::invalid(
                    OP,
                    match failed.first() {
                        None => format!(
                            "{e}; nothing was loaded (the {n} groups of cached tables loaded \
                             before it were put back as they were)"
                        ),
                        Some(u) => format!(
                            "{e}; putting back the {n} groups of cached tables loaded before it \
                             failed too ({u}): some tables may hold the checkpoint's rows and \
                             others not"
                        ),
                    },
                ));
            }
        }
    }
    Ok(())
}

impl TableBatchedEmbedding {
    /// Stages new values for every row of these cached tables beside the live ones (as
    /// [`stage_cached_checkpoint`](Self::stage_cached_checkpoint) stages a checkpoint's copy),
    /// asking `rows_of(t, rows)` for the weights (`[rows, dim]`) and each optimizer state
    /// buffer's values (`[rows]` per-row, else `[rows, dim]`) of `chunk_rows(t)` rows of table
    /// `t` at a time: a table bigger than memory is never held whole. Nothing changes until
    /// [`commit_cached_checkpoint`](Self::commit_cached_checkpoint).
    pub(crate) fn stage_cached_rows(
        &self,
        chunk_rows: impl Fn(usize) -> usize,
        mut rows_of: impl FnMut(usize, std::ops::Range<usize>) -> Result<(Vec<f32>, Vec<Vec<f32>>)>,
    ) -> Result<StagedRows> {
        let cfg = &self.inner.config;
        let mut state = self.inner.state.write();
        let step = state.step;
        let Tables::Cached(c) = &mut state.tables else {
            return Err(Error::invalid(OP, "the tables are not cached in a file"));
        };
        c.check_idle()?;
        let parts = super::parts_of(cfg);
        let staged = c.store().stage_new(|bytes, layout| {
            for (t, (spec, p)) in cfg.tables.iter().zip(&parts).enumerate() {
                let record = layout[t].record_bytes;
                let chunk = chunk_rows(t).max(1);
                for first in (0..spec.rows).step_by(chunk) {
                    let rows = first..(first + chunk).min(spec.rows);
                    let (w, states) = rows_of(t, rows.clone())?;
                    let n = rows.len();
                    let sizes = [p.dim, p.state[0], p.state[1]];
                    let short = (w.len() != n * p.dim)
                        || (0..2).any(|i| states.get(i).map_or(0, Vec::len) != n * sizes[i + 1]);
                    if short {
                        return Err(Error::invalid(
                            OP,
                            format!("table {t} rows {rows:?}: values of the wrong length"),
                        ));
                    }
                    let at = layout[t].offset as usize + first * record;
                    let out = &mut bytes[at..at + n * record];
                    for (r, rec) in out.chunks_exact_mut(record).enumerate() {
                        let values = [
                            &w[..],
                            states.first().map_or(&[][..], |s| &s[..]),
                            states.get(1).map_or(&[][..], |s| &s[..]),
                        ];
                        for (q, v) in values.iter().enumerate() {
                            let range = p.range(q);
                            let src = &v[r * sizes[q]..(r + 1) * sizes[q]];
                            let dst = &mut rec[range.start * 4..range.end * 4];
                            for (b, x) in dst.chunks_exact_mut(4).zip(src) {
                                b.copy_from_slice(&x.to_le_bytes());
                            }
                        }
                    }
                }
            }
            Ok(())
        })?;
        Ok(StagedRows { staged, step })
    }
}

/// A cached checkpoint's rows, checked and copied beside the live ones, and its step.
pub(crate) struct StagedRows {
    staged: super::store::Staged,
    step: u64,
}

/// The `(name, rows, dim)` of every table of `cfg`, as a manifest lists them.
fn tables_of(cfg: &TbeConfig) -> Vec<(String, u64, u64)> {
    (cfg.tables.iter())
        .map(|s| (s.name.clone(), s.rows as u64, s.dim as u64))
        .collect()
}

/// The `(name, rows, dim)` of every table a manifest lists, if it lists them.
fn manifest_tables(m: &serde_json::Value) -> Option<Vec<(String, u64, u64)>> {
    (m.get("tables")?.as_array()?.iter())
        .map(|t| {
            Some((
                t["name"].as_str()?.to_string(),
                t["rows"].as_u64()?,
                t["dim"].as_u64()?,
            ))
        })
        .collect()
}

/// A cached checkpoint's manifest.
struct Manifest {
    path: std::path::PathBuf,
    rows_file: std::path::PathBuf,
    bytes: u64,
    checksum: String,
    step: u64,
    optimizer: String,
    /// Each table's `(name, rows, dim)`.
    tables: Vec<(String, u64, u64)>,
}

/// A manifest lists tables, a few KiB each: a file past this is none.
const MANIFEST_LIMIT: u64 = 16 << 20;

/// The text of the manifest at `path`, read no further than one byte past
/// [`MANIFEST_LIMIT`] (a longer result is none).
fn read_manifest(path: &Path) -> std::io::Result<String> {
    use std::io::Read;
    let mut text = String::new();
    std::fs::File::open(path)?
        .take(MANIFEST_LIMIT + 1)
        .read_to_string(&mut text)?;
    Ok(text)
}

impl Manifest {
    /// Reads `dir`'s manifest and checks it against `cfg` (format, optimizer, tables) and the
    /// row file it names against its length.
    fn read(dir: &Path, cfg: &TbeConfig) -> Result<Self> {
        let m = Self::open(dir)?;
        if m.optimizer != cfg.optimizer.name() {
            return Err(m.bad(format!(
                "saved with optimizer `{}`, this operator uses `{}`",
                m.optimizer,
                cfg.optimizer.name()
            )));
        }
        let ours = tables_of(cfg);
        if ours != m.tables {
            return Err(m.bad(format!(
                "tables (name, rows, dim) {:?} differ from this operator's {ours:?}",
                m.tables
            )));
        }
        Ok(m)
    }

    /// Reads `dir`'s manifest (format, fields) and checks the row file it names against its
    /// length, for whatever tables it lists.
    fn open(dir: &Path) -> Result<Self> {
        let path = dir.join(MANIFEST);
        let bad = |why: String| Error::invalid(OP, format!("{}: {why}", path.display()));
        let text = read_manifest(&path).map_err(|e| io_error(&path, "reading", e))?;
        if text.len() as u64 > MANIFEST_LIMIT {
            return Err(bad(format!("over {MANIFEST_LIMIT} bytes: not a manifest")));
        }
        let m: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| bad(format!("not JSON: {e}")))?;
        let field = |k: &str| m.get(k).ok_or_else(|| bad(format!("no `{k}`")));
        if field("format")?.as_str() != Some(FORMAT) {
            return Err(bad(format!("not a `{FORMAT}` manifest")));
        }
        let optimizer = field("optimizer")?.as_str().unwrap_or("?").to_string();
        let tables =
            manifest_tables(&m).ok_or_else(|| bad("`tables` is not a list of tables".into()))?;
        // Sizes no table has (their products would overflow) are malformed.
        if let Some((name, rows, dim)) =
            (tables.iter()).find(|(_, rows, dim)| *rows > 1 << 48 || *dim == 0 || *dim > 1 << 24)
        {
            return Err(bad(format!(
                "table `{name}` of {rows} rows of {dim}: impossible sizes"
            )));
        }
        let step = (field("step")?.as_u64())
            .and_then(crate::checkpoint::as_count)
            .ok_or_else(|| bad("`step` is not a count below 2^63".into()))?;
        let bytes = field("bytes")?
            .as_u64()
            .ok_or_else(|| bad("`bytes` is not a number".into()))?;
        let checksum = field("checksum")?.as_str().unwrap_or("").to_string();
        let name = field("rows_file")?
            .as_str()
            .filter(|n| !n.contains('/') && !n.contains('\\') && !n.starts_with('.'))
            .ok_or_else(|| bad("`rows_file` is not a file name".into()))?;
        let rows_file = dir.join(name);
        let have = std::fs::metadata(&rows_file)
            .map_err(|e| io_error(&rows_file, "reading its size", e))?
            .len();
        if have != bytes {
            return Err(Error::invalid(
                OP,
                format!(
                    "{}: {have} bytes, the manifest says {bytes} (truncated?)",
                    rows_file.display()
                ),
            ));
        }
        Ok(Manifest {
            path,
            rows_file,
            bytes,
            checksum,
            step,
            optimizer,
            tables,
        })
    }

    /// An error about the manifest.
    fn bad(&self, why: String) -> Error {
        Error::invalid(OP, format!("{}: {why}", self.path.display()))
    }

    /// An error about the row file's checksum.
    fn corrupt(&self, h: u64) -> Error {
        Error::invalid(
            OP,
            format!(
                "{}: checksum {h:016x}, the manifest says {} (corrupt)",
                self.rows_file.display(),
                self.checksum
            ),
        )
    }
}

/// A cached checkpoint's tables read whole, for tables kept in memory.
pub(crate) struct PlainTables {
    /// Per table, its weights (`[rows, dim]`).
    pub weights: Vec<Vec<f32>>,
    /// Per optimizer state buffer, per table, its values.
    pub states: Vec<Vec<Vec<f32>>>,
}

/// Reads the checkpoint of cached tables `cfg` written by
/// [`TableBatchedEmbedding::save_cached_checkpoint`] in `dir` whole into memory (every check
/// made, the checksum included), for an operator whose tables are in memory.
pub(crate) fn read_cached_checkpoint(dir: &Path, cfg: &TbeConfig) -> Result<PlainTables> {
    let m = Manifest::read(dir, cfg)?;
    let parts = super::parts_of(cfg);
    let (layout, len) = super::store::RowStore::layout(&super::records_of(cfg, &parts))?;
    if len != m.bytes {
        return Err(m.bad(format!(
            "says {} bytes of rows, these tables need {len}",
            m.bytes
        )));
    }
    let (bytes, h) = super::store::read_with_checksum(&m.rows_file, len)?;
    if format!("{h:016x}") != m.checksum {
        return Err(m.corrupt(h));
    }
    super::store::refuse_non_finite_rows(&m.rows_file, &bytes, 0)?;
    let buffers = cfg.optimizer.state_buffers().len();
    let mut weights = Vec::with_capacity(cfg.tables.len());
    let mut states = vec![Vec::with_capacity(cfg.tables.len()); buffers];
    for ((spec, p), table) in cfg.tables.iter().zip(&parts).zip(&layout) {
        let start = table.offset as usize;
        let [w, s0, s1] = split_records(&bytes[start..start + spec.rows * table.record_bytes], p);
        weights.push(w);
        for (i, s) in [s0, s1].into_iter().enumerate().take(buffers) {
            states[i].push(s);
        }
    }
    Ok(PlainTables { weights, states })
}

/// Records laid out as `p` (little-endian FP32 bytes, back to back) split into their parts:
/// the weights, then each state buffer's values.
fn split_records(bytes: &[u8], p: &super::Parts) -> [Vec<f32>; 3] {
    let mut split = [Vec::new(), Vec::new(), Vec::new()];
    for record in bytes.chunks_exact((p.record() * 4).max(1)) {
        for (q, part) in split.iter_mut().enumerate() {
            let r = p.range(q);
            part.extend(
                (record[r.start * 4..r.end * 4].chunks_exact(4))
                    .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
            );
        }
    }
    split
}

/// A cached checkpoint ([`TableBatchedEmbedding::save_cached_checkpoint`]) opened to read
/// some rows of its tables, without an operator of the same tables: what a sharded
/// checkpoint's reader uses to cut rectangles out of a shard's rows under another plan. Only
/// the rows asked for are read.
pub(crate) struct SavedRows {
    m: Manifest,
    /// The row file, open from the start (what is verified is what is read).
    file: std::fs::File,
}

impl SavedRows {
    /// Opens the checkpoint in `dir`: its manifest read and the row file's length checked (not
    /// yet its checksum: [`verify`](Self::verify)).
    pub(crate) fn open(dir: &Path) -> Result<Self> {
        let m = Manifest::open(dir)?;
        let file = std::fs::File::open(&m.rows_file)
            .map_err(|e| io_error(&m.rows_file, "opening to read", e))?;
        Ok(SavedRows { m, file })
    }

    /// The directory it was opened from.
    pub(crate) fn dir(&self) -> &Path {
        self.m.path.parent().unwrap_or(Path::new("."))
    }

    /// Each table's `(name, rows, dim)`.
    pub(crate) fn tables(&self) -> &[(String, u64, u64)] {
        &self.m.tables
    }

    /// Whether these are the tables of `cfg` (names, rows, widths, optimizer): a checkpoint
    /// such an operator loads whole.
    pub(crate) fn is_for(&self, cfg: &TbeConfig) -> bool {
        self.m.optimizer == cfg.optimizer.name() && self.m.tables == tables_of(cfg)
    }

    /// Reads the whole row file once and compares its checksum with the manifest's.
    pub(crate) fn verify(&self) -> Result<()> {
        let h = super::store::checksum_of(&self.file, &self.m.rows_file)?;
        if format!("{h:016x}") != self.m.checksum {
            return Err(self.m.corrupt(h));
        }
        Ok(())
    }

    /// Rows `rows` of table `t`, trained by `optimizer` (which must be the one saved): their
    /// weights (`[rows, dim]`) and each optimizer state buffer's values for them (`[rows]`
    /// per-row, else `[rows, dim]`).
    pub(crate) fn read_rows(
        &self,
        optimizer: &FusedOptimizer,
        t: usize,
        rows: std::ops::Range<usize>,
    ) -> Result<(Vec<f32>, Vec<Vec<f32>>)> {
        use std::os::unix::fs::FileExt;
        if self.m.optimizer != optimizer.name() {
            return Err(self.m.bad(format!(
                "saved with optimizer `{}`, read for `{}`",
                self.m.optimizer,
                optimizer.name()
            )));
        }
        let Some(&(_, n, _)) = self.m.tables.get(t) else {
            return Err(self
                .m
                .bad(format!("no table {t}: it lists {}", self.m.tables.len())));
        };
        if rows.start > rows.end || rows.end as u64 > n {
            return Err(self
                .m
                .bad(format!("rows {rows:?} of table {t}, which has {n}")));
        }
        let parts = super::parts_for(optimizer, self.m.tables.iter().map(|x| x.2 as usize));
        let counts = self.m.tables.iter().map(|x| x.1 as usize);
        let (layout, len) = super::store::RowStore::layout(&super::records_for(counts, &parts))?;
        if len != self.m.bytes {
            return Err(self.m.bad(format!(
                "says {} bytes of rows, its tables need {len}",
                self.m.bytes
            )));
        }
        let (table, p) = (&layout[t], &parts[t]);
        let mut bytes = vec![0u8; rows.len() * table.record_bytes];
        let at = table.offset + (rows.start * table.record_bytes) as u64;
        self.file
            .read_exact_at(&mut bytes, at)
            .map_err(|e| io_error(&self.m.rows_file, "reading rows", e))?;
        super::store::refuse_non_finite_rows(&self.m.rows_file, &bytes, at)?;
        let buffers = optimizer.state_buffers().len();
        let [w, s0, s1] = split_records(&bytes, p);
        Ok((w, [s0, s1].into_iter().take(buffers).collect()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::embedding::{CacheConfig, CacheSize, PoolingMode, TableSpec};

    /// The value `rows_of` gives row `r` of table `t`, part `q` (0 weights, 1.. state), at `i`.
    fn value(t: usize, r: usize, q: usize, i: usize) -> f32 {
        (t * 100_000 + r * 10 + q) as f32 + i as f32 / 64.0
    }

    /// An empty directory `embers-<name>-<process>` under the temp dir.
    fn fresh_dir(name: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("embers-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    /// One table `a` of `rows` rows of 4, trained by `optimizer`.
    fn one_table(rows: usize, optimizer: FusedOptimizer) -> TbeConfig {
        TbeConfig::new(
            vec![TableSpec::new("a", rows, 4)],
            vec![0],
            PoolingMode::Sum,
            optimizer,
        )
    }

    /// Sets every TBE's table 0 to `saved` and writes its checkpoint `dir/ckpt<k>`.
    fn save_all(tbes: &[TableBatchedEmbedding], saved: &[f32], dir: &Path) {
        for (k, tbe) in tbes.iter().enumerate() {
            tbe.set_table_weights(0, saved).unwrap();
            tbe.save_cached_checkpoint(dir.join(format!("ckpt{k}")))
                .unwrap();
        }
    }

    /// Each TBE's checkpoint `dir/ckpt<k>` staged for it (by [`save_all`]).
    fn stage_all<'a>(
        tbes: &'a [TableBatchedEmbedding],
        dir: &Path,
    ) -> Vec<(&'a TableBatchedEmbedding, StagedRows)> {
        (tbes.iter().enumerate())
            .map(|(k, t)| {
                let dir = dir.join(format!("ckpt{k}"));
                (t, t.stage_cached_checkpoint(&dir).unwrap())
            })
            .collect()
    }

    /// Commits `loads` with the last one's staged file removed first (its rename fails): the
    /// error.
    fn commit_with_the_last_broken(loads: Vec<(&TableBatchedEmbedding, StagedRows)>) -> String {
        let super::super::store::Staged::File(last, _) = &loads[loads.len() - 1].1.staged else {
            panic!("a file store stages a file");
        };
        std::fs::remove_file(last).unwrap();
        commit_cached_checkpoints(loads).unwrap_err().to_string()
    }

    /// Loads into several cached TBEs commit as one: when the last one's commit fails (its
    /// staged file gone before the rename), the ones committed before it get back their rows —
    /// dirty cached rows included —, step count and an empty cache, and no kept or staged file
    /// is left behind; committed again, all of them load.
    #[test]
    fn loads_into_several_cached_tbes_commit_all_or_nothing() {
        let dir = fresh_dir("commit-all");
        let cfg = one_table(64, FusedOptimizer::Adagrad { lr: 0.5, eps: 1e-3 });
        let size = CacheSize::LoadFactor(0.5);
        // One with its rows in host memory, two in files.
        let tbes: Vec<TableBatchedEmbedding> = [None, Some("b.rows"), Some("c.rows")]
            .into_iter()
            .map(|file| {
                let cache = match file {
                    None => CacheConfig::in_host_memory(size),
                    Some(f) => CacheConfig::new(dir.join(f), size),
                };
                TableBatchedEmbedding::new_cached(cfg.clone(), cache).unwrap()
            })
            .collect();
        let saved: Vec<f32> = (0..64 * 4).map(|i| i as f32 / 8.0).collect();
        save_all(&tbes, &saved, &dir);
        // Since the checkpoints: one step trained through every cache (dirty cached rows).
        let ids: Vec<i64> = (0..40).collect();
        let offsets: Vec<i64> = (0..=40).collect();
        for tbe in &tbes {
            let batch = tbe.prepare(TbeInput::new(&ids[..], &offsets[..])).unwrap();
            let out = tbe.lookup_batch(&batch).unwrap();
            let grad = crate::Tensor::from_vec(vec![1.0f32; 40 * 4], out.shape()).unwrap();
            tbe.backward_batch(&batch, &grad).unwrap();
        }
        let now: Vec<Vec<f32>> = tbes.iter().map(|t| t.table_weights(0).unwrap()).collect();
        assert!(now.iter().all(|w| *w != saved), "training changed nothing");
        let leftovers = || -> Vec<String> {
            (std::fs::read_dir(&dir).unwrap())
                .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .filter(|n| n.ends_with(".tmp"))
                .collect()
        };
        let stage = || stage_all(&tbes, &dir);
        let err = commit_with_the_last_broken(stage());
        assert!(
            err.contains("opening the new row store") && err.contains("nothing was loaded"),
            "{err}"
        );
        for (k, tbe) in tbes.iter().enumerate() {
            assert!(tbe.table_weights(0).unwrap() == now[k], "table {k} changed");
            assert_eq!(tbe.step(), 1, "table {k}'s step changed");
            assert_eq!(tbe.locked_cache_slots().unwrap(), vec![0]);
        }
        assert_eq!(leftovers(), Vec::<String>::new());
        commit_cached_checkpoints(stage()).unwrap();
        for (k, tbe) in tbes.iter().enumerate() {
            assert!(
                tbe.table_weights(0).unwrap() == saved,
                "table {k} not loaded"
            );
            assert_eq!(tbe.step(), 0);
        }
        assert_eq!(leftovers(), Vec::<String>::new());
        drop(tbes);
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A save whose manifest is renamed into place but whose directory cannot be synced
    /// fails, and keeps both row files (the new manifest names the new one; a crash may bring
    /// back the old manifest, which names the old one); the checkpoint loads as saved, and
    /// the next clean save removes the stale file.
    #[test]
    fn a_save_whose_directory_cannot_be_synced_keeps_both_row_files() {
        use crate::checkpoint::FAIL_DIR_SYNC;
        let dir = fresh_dir("save-sync");
        let cfg = one_table(64, FusedOptimizer::Sgd { lr: 0.5 });
        let cache = CacheConfig::new(dir.join("a.rows"), CacheSize::LoadFactor(0.5));
        let tbe = TableBatchedEmbedding::new_cached(cfg, cache).unwrap();
        let ckpt = dir.join("ckpt");
        let rows_files = || {
            (std::fs::read_dir(&ckpt).unwrap().flatten())
                .filter(|e| e.file_name().to_string_lossy().starts_with("rows-"))
                .count()
        };
        tbe.save_cached_checkpoint(&ckpt).unwrap();
        let values: Vec<f32> = (0..64 * 4).map(|i| i as f32).collect();
        tbe.set_table_weights(0, &values).unwrap();
        FAIL_DIR_SYNC.with(|f| f.set(Some(0)));
        let err = tbe.save_cached_checkpoint(&ckpt);
        FAIL_DIR_SYNC.with(|f| f.set(None));
        let err = err.unwrap_err().to_string();
        assert!(err.contains("renamed into place"), "{err}");
        assert_eq!(rows_files(), 2);
        tbe.set_table_weights(0, &vec![0.0; 64 * 4]).unwrap();
        tbe.load_cached_checkpoint(&ckpt).unwrap();
        assert!(tbe.table_weights(0).unwrap() == values);
        tbe.save_cached_checkpoint(&ckpt).unwrap();
        assert_eq!(rows_files(), 1);
        drop(tbe);
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A batch whose rows are all direct reads holds no lock, so a checkpoint load finds the
    /// cache idle beside it; the load makes the cache anew, and the batch is refused after
    /// it (before, its lookup and backward ran on the new cache's rows). A batch of a cache
    /// made unusable is refused too.
    #[test]
    fn batches_of_an_emptied_or_unusable_cache_are_refused() {
        let dir = fresh_dir("stale");
        // 200 rows behind one set of 32 slots.
        let cfg = one_table(200, FusedOptimizer::Sgd { lr: 0.5 });
        let cache = CacheConfig::new(dir.join("a.rows"), CacheSize::LoadFactor(0.01));
        let tbe = TableBatchedEmbedding::new_cached(cfg, cache).unwrap();
        tbe.save_cached_checkpoint(dir.join("ckpt")).unwrap();
        let prepare = |ids: &[i64]| {
            let offsets: Vec<i64> = (0..=ids.len() as i64).collect();
            tbe.prepare(TbeInput::new(ids, &offsets[..])).unwrap()
        };
        let every_way: Vec<i64> = (0..32).collect();
        let x = prepare(&every_way);
        let y = prepare(&[100]);
        assert_eq!(tbe.cache_stats().unwrap()[0].conflict_misses, 1);
        drop(x);
        let refused = |batch: &crate::embedding::TbeBatch, bags: usize, says: &str| {
            let grad = crate::Tensor::from_vec(vec![1.0f32; bags * 4], &[bags, 4]).unwrap();
            for err in [
                tbe.lookup_batch(batch).unwrap_err(),
                tbe.backward_batch(batch, &grad).unwrap_err(),
            ] {
                assert!(err.to_string().contains(says), "{err}");
            }
        };
        tbe.lookup_batch(&y).unwrap();
        tbe.load_cached_checkpoint(dir.join("ckpt")).unwrap();
        refused(
            &y,
            1,
            "admitted before the cache was moved, emptied or reloaded",
        );
        drop(y);
        let z = prepare(&[100, 7]);
        if let Tables::Cached(c) = &mut tbe.inner.state.write().tables {
            c.poison("after a failed admission (test)".to_string());
        }
        refused(&z, 2, "unusable after a failed admission (test)");
        drop(z);
        drop(tbe);
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A write-back after a backward that fails (updated rows not marked dirty, scratch rows
    /// not written back), or a release of finished batches' slots that fails (slots left
    /// locked), makes the cache unusable, saying which, instead of losing updates or slots
    /// silently; a checkpoint load makes it usable again.
    #[test]
    fn a_failed_write_back_or_release_makes_the_cache_unusable() {
        use super::super::{FAIL_RELEASE, FAIL_WRITE_BACK};
        let dir = fresh_dir("write-back");
        let cfg = one_table(200, FusedOptimizer::Sgd { lr: 0.5 });
        let cache = CacheConfig::new(dir.join("a.rows"), CacheSize::LoadFactor(0.2));
        let tbe = TableBatchedEmbedding::new_cached(cfg, cache).unwrap();
        tbe.save_cached_checkpoint(dir.join("ckpt")).unwrap();
        let ids = [3i64, 50, 199];
        let offsets: Vec<i64> = (0..=ids.len() as i64).collect();
        let prepare = || tbe.prepare(TbeInput::new(&ids[..], &offsets[..]));
        let grad = crate::Tensor::from_vec(vec![1.0f32; 3 * 4], &[3, 4]).unwrap();
        let unusable = |says: &str| {
            let err = prepare().unwrap_err().to_string();
            assert!(err.contains("unusable") && err.contains(says), "{err}");
        };
        let batch = prepare().unwrap();
        FAIL_WRITE_BACK.with(|f| f.set(true));
        let err = tbe.backward_batch(&batch, &grad).unwrap_err().to_string();
        assert!(err.contains("a failure made by a test"), "{err}");
        drop(batch);
        unusable("after a failed write-back of a backward");
        tbe.load_cached_checkpoint(dir.join("ckpt")).unwrap();
        let batch = prepare().unwrap();
        tbe.backward_batch(&batch, &grad).unwrap();
        drop(batch);
        FAIL_RELEASE.with(|f| f.set(true));
        let err = prepare().unwrap_err().to_string();
        assert!(err.contains("a failure made by a test"), "{err}");
        unusable("after a failed release of finished batches");
        tbe.load_cached_checkpoint(dir.join("ckpt")).unwrap();
        prepare().unwrap();
        drop(tbe);
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A cache left unusable by a failed admission, or whose row file was truncated under
    /// it, recovers by a load into several TBEs at once (its dirty rows cannot be written
    /// back first, and need not be); when that load is undone — another TBE's commit
    /// failing — it is unusable again, not silently missing its lost rows.
    #[test]
    fn an_unusable_cache_recovers_by_a_load_of_several_and_stays_unusable_when_undone() {
        let dir = fresh_dir("poisoned");
        // 2000 rows of 20 bytes (10 pages of file) behind one set of 32 slots.
        let cfg = one_table(2000, FusedOptimizer::Sgd { lr: 0.5 });
        let size = CacheSize::LoadFactor(0.01);
        let tbes: Vec<TableBatchedEmbedding> = ["a.rows", "b.rows"]
            .into_iter()
            .map(|f| {
                let cache = CacheConfig::new(dir.join(f), size);
                TableBatchedEmbedding::new_cached(cfg.clone(), cache).unwrap()
            })
            .collect();
        let saved: Vec<f32> = (0..2000 * 4).map(|i| i as f32 / 4.0).collect();
        save_all(&tbes, &saved, &dir);
        let step_on = |tbe: &TableBatchedEmbedding, ids: &[i64]| -> Result<()> {
            let offsets: Vec<i64> = (0..=ids.len() as i64).collect();
            let batch = tbe.prepare(TbeInput::new(ids, &offsets[..]))?;
            let out = tbe.lookup_batch(&batch)?;
            let grad = crate::Tensor::from_vec(vec![1.0f32; ids.len() * 4], out.shape())?;
            tbe.backward_batch(&batch, &grad).map(drop)
        };
        let ids: Vec<i64> = (0..10).collect();
        let step = |tbe: &TableBatchedEmbedding| step_on(tbe, &ids);
        for tbe in &tbes {
            step(tbe).unwrap();
        }
        if let Tables::Cached(c) = &mut tbes[0].inner.state.write().tables {
            c.poison("after a failed admission (test)".to_string());
        }
        let unusable = |tbe: &TableBatchedEmbedding| {
            let err = step(tbe).unwrap_err().to_string();
            assert!(err.contains("unusable") && err.contains("(test)"), "{err}");
        };
        unusable(&tbes[0]);
        let stage = || stage_all(&tbes, &dir);
        // Undone: the poisoned one refuses again, with its step count back.
        let err = commit_with_the_last_broken(stage());
        assert!(err.contains("nothing was loaded"), "{err}");
        unusable(&tbes[0]);
        assert_eq!(tbes[0].step(), 1);
        assert_eq!(tbes[1].step(), 1);
        // Loaded: usable again, with the checkpoint's rows.
        commit_cached_checkpoints(stage()).unwrap();
        for tbe in &tbes {
            assert!(tbe.table_weights(0).unwrap() == saved);
            assert_eq!(tbe.step(), 0);
        }
        step(&tbes[0]).unwrap();
        assert!(
            tbes[0].table_weights(0).unwrap() != saved,
            "the step changed nothing"
        );
        // A row file truncated under its cache (its rows gone already), rows of it in its
        // write log, loads too, without writing its cached rows back into it or folding the
        // log into it (which would read the mapped file past its end); undone, it is
        // unusable again, saying why.
        let far: Vec<i64> = (1000..1060).collect();
        step_on(&tbes[0], &far).unwrap();
        let logged = |tbe: &TableBatchedEmbedding| match &tbe.inner.state.read().tables {
            Tables::Cached(c) => c.store().log_holds_records(),
            _ => unreachable!("cached tables"),
        };
        assert!(logged(&tbes[0]), "no write-back reached the log");
        (std::fs::OpenOptions::new().write(true))
            .open(dir.join("a.rows"))
            .unwrap()
            .set_len(100)
            .unwrap();
        let truncated = |tbe: &TableBatchedEmbedding, unusable: bool| {
            let err = step(tbe).unwrap_err().to_string();
            assert!(
                err.contains("a.rows: 100 bytes") && err.contains("truncated"),
                "{err}"
            );
            assert_eq!(err.contains("unusable"), unusable, "{err}");
        };
        truncated(&tbes[0], false);
        let before = tbes[0].step();
        assert_ne!(before, 0, "the checkpoint's step");
        let err = commit_with_the_last_broken(stage());
        assert!(err.contains("nothing was loaded"), "{err}");
        truncated(&tbes[0], true);
        assert_eq!(tbes[0].step(), before);
        commit_cached_checkpoints(stage()).unwrap();
        for tbe in &tbes {
            assert!(tbe.table_weights(0).unwrap() == saved);
            assert!(!logged(tbe));
            step(tbe).unwrap();
        }
        drop(tbes);
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// Ranges of a cached table's rows read back as the same rows of the whole table (cached
    /// dirty rows included), out-of-range ones refused by name; quantized from such a table
    /// a chunk at a time into a cached inference operator (the table several chunks long),
    /// lookups equal those of the operator quantized from the whole table in memory.
    #[test]
    fn cached_rows_read_by_range_and_quantized_by_chunk_equal_the_whole_tables() {
        use crate::embedding::{QuantizedTableBatchedEmbedding, WeightType};
        let cfg = TbeConfig::new(
            vec![TableSpec::new("a", 2500, 1024), TableSpec::new("b", 40, 3)],
            vec![0, 1],
            PoolingMode::Sum,
            FusedOptimizer::Sgd { lr: 0.5 },
        );
        let cache = CacheConfig::in_host_memory(CacheSize::LoadFactor(0.05));
        let tbe = TableBatchedEmbedding::new_cached(cfg.clone(), cache).unwrap();
        // The same tables in memory, trained alike: the reference.
        let plain = TableBatchedEmbedding::new(cfg).unwrap();
        let values: Vec<f32> = (0..2500 * 1024).map(|i| (i % 977) as f32 / 97.0).collect();
        // One step: dirty rows in the cache, newer than the file's.
        let ids: Vec<i64> = vec![3, 2400, 1500, 7, 11, 39];
        let offsets: Vec<i64> = vec![0, 2, 3, 4, 6];
        for t in [&tbe, &plain] {
            t.set_table_weights(0, &values).unwrap();
            let batch = t.prepare(TbeInput::new(&ids[..], &offsets[..])).unwrap();
            let out = t.lookup_batch(&batch).unwrap();
            let grad = crate::Tensor::from_vec(vec![1.0f32; 2 * (1024 + 3)], out.shape()).unwrap();
            t.backward_batch(&batch, &grad).unwrap();
        }
        let whole = plain.table_weights(0).unwrap();
        assert!(
            whole[3 * 1024] != values[3 * 1024],
            "the step changed nothing"
        );
        for rows in [0..2500, 3..4, 1000..2401, 2499..2500, 5..5] {
            let part = tbe.table_weight_rows(0, rows.clone()).unwrap();
            assert!(
                part == whole[rows.start * 1024..rows.end * 1024],
                "{rows:?}"
            );
        }
        // By chunks (one not dividing the rows), every row once, in order.
        let mut chunks = Vec::new();
        tbe.for_each_weight_chunk(0, 700, |first, rows| {
            assert_eq!(first, chunks.len() / 1024);
            chunks.extend_from_slice(rows);
            Ok(())
        })
        .unwrap();
        assert!(chunks == whole, "chunked reads differ");
        #[allow(clippy::reversed_empty_ranges)] // a bad range on purpose
        let backwards = 7..3;
        for bad in [2400..2501, backwards] {
            let err = tbe.table_weight_rows(0, bad).unwrap_err().to_string();
            assert!(err.contains("of table 0 `a`, which has 2500"), "{err}");
        }
        let types = [WeightType::Int8, WeightType::Fp16];
        let memory = QuantizedTableBatchedEmbedding::from_trained(&tbe, &types).unwrap();
        let cache = CacheConfig::in_host_memory(CacheSize::LoadFactor(0.02));
        let cached =
            QuantizedTableBatchedEmbedding::from_trained_cached(&tbe, &types, &cache).unwrap();
        for t in 0..2 {
            assert_eq!(
                cached.table_bytes(t).unwrap(),
                memory.table_bytes(t).unwrap()
            );
        }
        let ids: Vec<i64> = (0..300).map(|i| (i * 37) % 2500).chain(0..40).collect();
        let offsets: Vec<i64> = vec![0, 100, 300, 320, 340];
        let input = || TbeInput::new(&ids[..], &offsets[..]);
        let want = memory.forward(input()).unwrap().to_vec::<f32>().unwrap();
        let got = cached.forward(input()).unwrap().to_vec::<f32>().unwrap();
        assert!(got == want, "cached lookups differ");
        assert!(cached.cache_stats().unwrap()[0].unique_misses > 0);
    }

    /// A manifest listing a table of impossible size (its products would overflow) is refused
    /// by name when opened, before any row is read.
    #[test]
    fn a_manifest_of_impossible_table_sizes_is_refused() {
        let dir = std::env::temp_dir().join(format!("embers-impossible-{}", std::process::id()));
        let cfg = TbeConfig::new(
            vec![TableSpec::new("a", 20, 4)],
            vec![0],
            PoolingMode::Sum,
            FusedOptimizer::Sgd { lr: 0.1 },
        );
        let cache = CacheConfig::in_host_memory(CacheSize::LoadFactor(0.5));
        let tbe = TableBatchedEmbedding::new_cached(cfg, cache).unwrap();
        tbe.save_cached_checkpoint(&dir).unwrap();
        assert!(SavedRows::open(&dir).is_ok());
        let path = dir.join(MANIFEST);
        let mut m: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        m["tables"][0]["dim"] = json!(1u64 << 62);
        std::fs::write(&path, m.to_string()).unwrap();
        let err = SavedRows::open(&dir).err().expect("refused").to_string();
        assert!(
            err.contains("table `a`") && err.contains("impossible sizes"),
            "{err}"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// Rows staged a few at a time (chunks much smaller than a table, and not a whole number
    /// of them) land in the right records: every weight and state value read back through the
    /// operator equals what was given, for per-row and per-element state, rows in a file or in
    /// host memory; values of the wrong length are refused and change nothing.
    #[test]
    fn rows_staged_in_chunks_become_the_tables_rows() {
        let dir = std::env::temp_dir().join(format!("embers-stage-rows-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let optimizers = crate::embedding::optimizer::optimizers_of_both_state_shapes();
        for (k, optimizer) in optimizers.into_iter().enumerate() {
            for in_file in [false, true] {
                let tables = vec![TableSpec::new("a", 257, 5), TableSpec::new("b", 40, 3)];
                let cfg = TbeConfig::new(tables, vec![0, 1], PoolingMode::Sum, optimizer);
                let size = CacheSize::LoadFactor(0.2);
                let cache = if in_file {
                    CacheConfig::new(dir.join(format!("rows-{k}.bin")), size)
                } else {
                    CacheConfig::in_host_memory(size)
                };
                let tbe = TableBatchedEmbedding::new_cached(cfg.clone(), cache).unwrap();
                let sizes = |t: usize| {
                    let dim = cfg.tables[t].dim;
                    [
                        dim,
                        optimizer.state_len(0, 1, dim),
                        optimizer.state_len(1, 1, dim),
                    ]
                };
                let make = |t: usize, rows: std::ops::Range<usize>, q: usize| -> Vec<f32> {
                    rows.flat_map(|r| (0..sizes(t)[q]).map(move |i| value(t, r, q, i)))
                        .collect()
                };
                let before = tbe.table_weights(0).unwrap();
                let short = tbe.stage_cached_rows(
                    |t| [7, 3][t],
                    |t, rows| {
                        let mut w = make(t, rows.clone(), 0);
                        w.pop();
                        Ok((w, vec![make(t, rows.clone(), 1), make(t, rows, 2)]))
                    },
                );
                assert!(short.is_err());
                assert_eq!(tbe.table_weights(0).unwrap(), before);
                // Nothing staged is left behind.
                let left: Vec<_> = (std::fs::read_dir(&dir).unwrap())
                    .map(|e| e.unwrap().file_name().to_string_lossy().to_string())
                    .filter(|n| n.contains("restore"))
                    .collect();
                assert!(left.is_empty(), "{left:?}");
                let mut calls = 0;
                let staged = tbe
                    .stage_cached_rows(
                        |t| [7, 3][t],
                        |t, rows| {
                            calls += 1;
                            let states = (1..3)
                                .map(|q| make(t, rows.clone(), q))
                                .filter(|s| !s.is_empty())
                                .collect();
                            Ok((make(t, rows, 0), states))
                        },
                    )
                    .unwrap();
                assert!(calls > 10, "{calls} chunks");
                tbe.commit_cached_checkpoint(staged).unwrap();
                for t in 0..2 {
                    let rows = cfg.tables[t].rows;
                    assert_eq!(tbe.table_weights(t).unwrap(), make(t, 0..rows, 0));
                    for i in 0..optimizer.state_buffers().len() {
                        let got = tbe.optimizer_state(i, t).unwrap();
                        assert_eq!(got, make(t, 0..rows, i + 1), "{optimizer:?} state {i}");
                    }
                }
            }
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}
