//! The byte-form cache on a GPU: the cache rows in HBM, the directory on the GPU (the training
//! cache's [`DeviceDirectory`] and admission kernels), the rows in the store — FBGEMM's
//! `MANAGED_CACHING` for inference. A lookup uploads the batch, admits it on the GPU (its ids
//! become cache rows in place), has the GPU read the new rows from the store (in place when the
//! store is host memory registered with the GPU, else staged through one upload), fills the
//! conflict misses' scratch rows, runs the quantized lookup kernels on the cache rows and
//! unlocks. Cached rows never differ from the store's, so an eviction moves nothing back.
//!
//! The host directories and cache rows are the cache's between [`ByteCache::move_to`] calls:
//! moving to the GPU copies them up, moving back copies them down.

use std::sync::Arc;

use super::super::device_directory::{scatter_bytes, DeviceDirectory, MovesInPlace};
use super::super::directory::Directory;
use super::super::store::RowStore;
use super::super::{add_device_counts, CachePolicy, TablePositions};
use super::{grown_scratch, slots_of, starts_for, ByteCache, CacheState};
use crate::cuda::{CudaDevice, DeviceBuffer, MappedHost};
use crate::embedding::config::{PoolingMode, WeightType};
use crate::embedding::input::Batch;
use crate::embedding::storage::RowBuffer;
use crate::embedding::tbe::cuda::{DeviceBatch, DeviceTables, FeatureLayout};
use crate::{Device, Error, Result, Tensor};

/// Byte alignment of each table's cache rows on the device (as the resident tables').
const ALIGN: usize = crate::embedding::inference::TABLE_ALIGNMENT;

/// What the lookup kernels need of the operator: per table its dim and weight type, per
/// feature its table, and the pooling.
pub(crate) struct GpuShape {
    pub dims: Vec<usize>,
    pub types: Vec<WeightType>,
    pub feature_table_map: Vec<usize>,
    pub pooling: PoolingMode,
}

/// The cache on a GPU.
pub(super) struct GpuRows {
    /// The store's rows registered with the GPU, when they are host memory (declared first:
    /// unregistered before the rest goes; the store outlives the cache state).
    mapped: Option<MappedHost>,
    dir: DeviceDirectory,
    /// The cache rows (table `t`: its slots, then its scratch rows) as quantized tables.
    tables: DeviceTables,
    shape: GpuShape,
    /// Byte offset of each table's cache rows in `tables`, and the end.
    starts: Vec<usize>,
    /// Scratch rows per table.
    scratch: Vec<usize>,
    /// An admission failed part-way (its locks and installed rows unaccounted for): the
    /// directory is emptied before the next lookup. Nothing is lost: no cached row is dirty.
    stale: bool,
}

impl GpuRows {
    /// The quantized tables over `bytes` laid out as `starts` (`slots + scratch` rows each).
    fn tables_over(
        device: &Arc<CudaDevice>,
        shape: &GpuShape,
        slots: &[usize],
        scratch: &[usize],
        starts: &[usize],
        bytes: DeviceBuffer<u8>,
    ) -> Result<DeviceTables> {
        let rows: Vec<usize> = slots.iter().zip(scratch).map(|(a, b)| a + b).collect();
        let ftm = &shape.feature_table_map;
        let layout = FeatureLayout::of_tables(ftm, starts, &rows, &shape.dims, shape.pooling);
        let types: Vec<WeightType> = ftm.iter().map(|&t| shape.types[t]).collect();
        DeviceTables::quantized_in(device.clone(), layout, bytes, &types)
    }

    fn bytes(&self) -> &DeviceBuffer<u8> {
        self.tables
            .quantized_bytes()
            .expect("a byte cache's tables are quantized")
    }

    /// Gives each table `t` room for `need[t]` scratch rows at least (keeping every cached row).
    fn grow_scratch(&mut self, slots: &[usize], need: &[usize], row_bytes: &[usize]) -> Result<()> {
        let scratch = grown_scratch(&self.scratch, need);
        let starts = starts_for(slots, &scratch, row_bytes, ALIGN)?;
        let d = self.dir.device().clone();
        // The whole device settles before and after the copies: the old rows may be in use
        // on another stream, and are freed (to their stream's pool) once replaced.
        d.synchronize()?;
        let bytes = d.zeros::<u8>(starts[slots.len()].max(1))?;
        for (t, &n) in slots.iter().enumerate() {
            d.copy_bytes(
                &bytes,
                starts[t],
                self.bytes(),
                self.starts[t],
                n * row_bytes[t],
            )?;
        }
        let tables = Self::tables_over(&d, &self.shape, slots, &scratch, &starts, bytes)?;
        d.synchronize()?;
        self.tables = tables;
        (self.scratch, self.starts) = (scratch, starts);
        Ok(())
    }

    /// Copies rows of the store into the cache: `(table, row, cache row of the table)`,
    /// gathered on the host and scattered on the GPU.
    fn fill(
        &self,
        store: &RowStore,
        row_bytes: &[usize],
        rows: impl Iterator<Item = (usize, u64, usize)>,
    ) -> Result<()> {
        let mut staged = Vec::new();
        let mut at = Vec::new();
        for (t, row, pos) in rows {
            let rb = row_bytes[t];
            let from = row as usize * rb;
            at.push((staged.len(), self.starts[t] + pos * rb, rb));
            staged.extend_from_slice(&store.table_bytes(t)[from..from + rb]);
        }
        if at.is_empty() {
            return Ok(());
        }
        let src = self.dir.device().htod(&staged)?;
        scatter_bytes(&src, self.bytes(), &at)
    }
}

impl ByteCache {
    /// Where the cache rows live (and lookups run).
    pub(crate) fn device(&self) -> Device {
        match &self.state.lock().gpu {
            Some(g) => Device::Cuda(g.dir.device().ordinal()),
            None => Device::Cpu,
        }
    }

    /// Whether the cache rows are on a GPU.
    pub(crate) fn on_gpu(&self) -> bool {
        self.state.lock().gpu.is_some()
    }

    /// Empty directories of the sizes of `dirs`.
    fn empty_dirs(
        store: &RowStore,
        policy: CachePolicy,
        dirs: &[Directory],
    ) -> Result<Vec<Directory>> {
        (dirs.iter().enumerate())
            .map(|(t, d)| Directory::new(d.sets, store.table(t).rows, policy))
            .collect()
    }

    /// Moves the cache rows and directories to `device` (`None`: the host), for lookups of
    /// tables shaped as `shape`. The cached rows stay cached. On an error the cache stays
    /// where it was (a move from one GPU to another that fails on the second one leaves it
    /// on the host).
    pub(crate) fn move_to(
        &mut self,
        device: Option<Arc<CudaDevice>>,
        shape: GpuShape,
    ) -> Result<()> {
        let st = self.state.get_mut();
        if let Some(gpu) = st.gpu.as_mut() {
            if device
                .as_ref()
                .is_some_and(|d| Arc::ptr_eq(d, gpu.dir.device()))
            {
                return Ok(());
            }
            // The host copy is made aside first: a failure leaves the cache on its GPU.
            let mut dirs = Self::empty_dirs(&self.store, self.policy, &st.dirs)?;
            if !gpu.stale {
                gpu.dir.pull(&mut dirs)?;
            }
            let starts = starts_for(&slots_of(&dirs), &st.scratch, &self.row_bytes, 1)?;
            let mut rows = RowBuffer::zeros(starts[dirs.len()])?;
            if !gpu.stale {
                let d = gpu.dir.device().clone();
                for (t, dir) in dirs.iter().enumerate() {
                    let len = dir.slots() * self.row_bytes[t];
                    let to = &mut rows[starts[t]..starts[t] + len];
                    d.read_bytes(gpu.bytes(), gpu.starts[t], to)?;
                }
            }
            (st.dirs, st.rows, st.starts) = (dirs, rows, starts);
            st.gpu = None;
        }
        let Some(device) = device else {
            return Ok(());
        };
        let st = self.state.get_mut();
        let slots = slots_of(&st.dirs);
        let rows: Vec<usize> = (0..slots.len()).map(|t| self.store.table(t).rows).collect();
        let mut dir = DeviceDirectory::new(
            &device,
            &st.dirs,
            &rows,
            &shape.feature_table_map,
            self.policy,
        )?;
        dir.push(&st.dirs)?;
        let scratch = vec![0; slots.len()];
        let starts = starts_for(&slots, &scratch, &self.row_bytes, ALIGN)?;
        let mut up = vec![0u8; starts[slots.len()].max(1)];
        for (t, &n) in slots.iter().enumerate() {
            let len = n * self.row_bytes[t];
            up[starts[t]..starts[t] + len]
                .copy_from_slice(&st.rows[st.starts[t]..st.starts[t] + len]);
        }
        let bytes = device.htod(&up)?;
        let tables = GpuRows::tables_over(&device, &shape, &slots, &scratch, &starts, bytes)?;
        // The host copy of the cache rows goes; the directories stay for the way back.
        (st.rows, st.scratch) = (RowBuffer::zeros(0)?, vec![0; slots.len()]);
        st.starts = starts_for(&vec![0; slots.len()], &st.scratch, &self.row_bytes, 1)?;
        let in_memory = self.store.in_memory();
        let bytes = self.store.bytes_mut();
        let mapped = if in_memory && !bytes.is_empty() {
            // SAFETY: the store's memory outlives the registration (the cache state, which
            // holds it, is dropped before the store, and the store's memory is never replaced
            // under a byte cache); the host writes it only in `write_rows`, between lookups,
            // and every lookup waits for its moves.
            unsafe { MappedHost::register(&device, bytes.as_mut_ptr(), bytes.len()) }.ok()
        } else {
            None
        };
        self.state.get_mut().gpu = Some(GpuRows {
            mapped,
            dir,
            tables,
            shape,
            starts,
            scratch,
            stale: false,
        });
        Ok(())
    }

    /// The lookup of a validated batch on the GPU cache: `[B, ΣD]` (or `[N, D]` unpooled) FP32
    /// values on the GPU.
    pub(crate) fn forward_on_device(&self, batch: &Batch<'_>) -> Result<Tensor> {
        self.store.check_len()?;
        let mut guard = self.state.lock();
        let st = &mut *guard;
        let empty = match st.gpu.as_ref() {
            None => return Err(Error::invalid(super::super::OP, "the cache is on the host")),
            Some(g) if g.stale => Some(Self::empty_dirs(&self.store, self.policy, &st.dirs)?),
            Some(_) => None,
        };
        let gpu = st.gpu.as_mut().expect("checked above");
        if let Some(empty) = empty {
            gpu.dir.push(&empty)?;
            gpu.stale = false;
        }
        if !gpu.dir.fits(batch.ids.len()) {
            return Err(Error::invalid(
                super::super::OP,
                format!(
                    "a batch of {} ids is too large for the GPU directory's keys: split it",
                    batch.ids.len()
                ),
            ));
        }
        st.tick += 1;
        let tables = self.row_bytes.len();
        let ranges = TablePositions::new(&gpu.shape.feature_table_map, tables, batch);
        let device = gpu.dir.device().clone();
        let mut on_device = DeviceBatch::upload(&device, batch)?;
        let looked_up = (|| {
            let cache =
                (gpu.tables.quantized_bytes()).expect("a byte cache's tables are quantized");
            let in_place = gpu.mapped.as_ref().map(|host| MovesInPlace::Bytes {
                cache,
                host,
                host_first: (0..tables)
                    .map(|t| self.store.table(t).offset as i64)
                    .collect(),
                cache_first: gpu.starts[..tables].iter().map(|&s| s as i64).collect(),
                row_bytes: self.row_bytes.iter().map(|&b| b as i64).collect(),
            });
            let a = gpu.dir.admit(&mut on_device, st.tick, in_place.as_ref())?;
            drop(in_place);
            add_device_counts(&mut st.stats, &a.counts, &ranges);
            for (stats, &[_, installed, direct, _, _]) in st.stats.iter_mut().zip(&a.counts) {
                stats.rows_read += installed + direct;
            }
            if gpu.mapped.is_none() {
                let moves = a.moves(tables)?;
                let rows = (moves.iter().enumerate())
                    .flat_map(|(t, m)| m.iter().map(move |&(slot, _, row)| (t, row, slot)));
                gpu.fill(&self.store, &self.row_bytes, rows)?;
            }
            let mut need = vec![0; tables];
            for &(t, _, _) in &a.direct {
                need[t] += 1;
            }
            if need.iter().zip(&gpu.scratch).any(|(n, s)| n > s) {
                gpu.grow_scratch(&slots_of(&st.dirs), &need, &self.row_bytes)?;
            }
            gpu.fill(&self.store, &self.row_bytes, a.direct.iter().copied())?;
            let out = gpu.tables.forward(&on_device)?;
            gpu.dir.unlock(&a.locked, a.locked_len)?;
            Ok(out)
        })();
        if looked_up.is_err() {
            gpu.stale = true;
        }
        looked_up
    }

    /// Rewrites the GPU cache's copies of rows `first..first + n` of table `t` from the store
    /// (`false`: the cache is on the host).
    pub(super) fn refresh_on_gpu(&mut self, t: usize, first: usize, n: usize) -> Result<bool> {
        let Some(gpu) = self.state.get_mut().gpu.as_mut() else {
            return Ok(false);
        };
        if gpu.stale {
            // The next lookup empties the directory anyway.
            return Ok(true);
        }
        // Only the written rows are looked up on the GPU (not the table's whole directory).
        let rows: Vec<(usize, u64)> = (first as u64..(first + n) as u64).map(|r| (t, r)).collect();
        let refreshed = gpu.dir.find(&rows).and_then(|slots| {
            let cached =
                (rows.iter().zip(slots)).filter_map(|(&(t, row), slot)| Some((t, row, slot?)));
            gpu.fill(&self.store, &self.row_bytes, cached)
        });
        if refreshed.is_err() {
            // Some cached copies may be old: the next lookup empties the directory.
            gpu.stale = true;
        }
        refreshed.map(|()| true)
    }

    /// Where the cache is on a GPU: marks every cached copy old (the next lookup empties the
    /// directory) and says so.
    pub(super) fn forget_on_gpu(&mut self) -> bool {
        match self.state.get_mut().gpu.as_mut() {
            Some(gpu) => {
                gpu.stale = true;
                true
            }
            None => false,
        }
    }

    /// Device bytes of the GPU cache (rows and directory), if on a GPU.
    pub(super) fn gpu_bytes(st: &CacheState) -> usize {
        (st.gpu.as_ref()).map_or(0, |g| g.tables.allocated_bytes() + g.dir.bytes())
    }
}
