//! What the sharded collections share whatever they do with the rows they look up: the checks
//! every rank makes at construction, the routing, this rank's TBEs and the rectangles they
//! hold, the tables gathered or overwritten whole, sharded checkpoints, the input
//! distribution of a batch and the data-parallel tables' gradient sum.
//!
//! [`ShardedEmbeddingBagCollection`](super::ShardedEmbeddingBagCollection) (pooled) and
//! [`ShardedEmbeddingCollection`](super::ShardedEmbeddingCollection) (unpooled) each hold one
//! [`Shards`] and add their output distribution and backward.

use rand::SeedableRng;

use super::checkpoint::{self, Held, LoadReport, Rect};
use super::comm::Comm;
use super::input_dist::{agree_on_batch, all_to_all_bags, Bags, Gathered, HostKjt};
use super::plan::{fnv1a, ComputeKernel, ShardCaches, ShardingPlan, TableShape};
use super::routing::{Route, Routing, Slot};
use crate::embedding::{
    fill_init, BoundsCheckMode, CacheStats, EmbeddingBagConfig, EmbeddingConfig, EmbeddingInit,
    FusedOptimizer, Placement, PoolingMode, TableBatchedEmbedding, TableSpec, TbeConfig,
    WeightDecay,
};
use crate::error::{Error, Result};
use crate::sparse::KeyedJaggedTensor;
use crate::tensor::rng::Rng;
use crate::tensor::RowSparseGrad;
use crate::{Device, Tensor};

/// A table config a sharded collection can be built from (and initialised like one):
/// [`EmbeddingBagConfig`] and [`EmbeddingConfig`].
pub trait ShardableTable {
    /// Table name.
    fn name(&self) -> &str;
    /// Rows.
    fn num_embeddings(&self) -> usize;
    /// Row width.
    fn embedding_dim(&self) -> usize;
    /// Features looked up in it.
    fn feature_names(&self) -> &[String];
    /// Its initialiser.
    fn init(&self) -> EmbeddingInit;
}

macro_rules! shardable {
    ($t:ty) => {
        impl ShardableTable for $t {
            fn name(&self) -> &str {
                &self.name
            }
            fn num_embeddings(&self) -> usize {
                self.num_embeddings
            }
            fn embedding_dim(&self) -> usize {
                self.embedding_dim
            }
            fn feature_names(&self) -> &[String] {
                &self.feature_names
            }
            fn init(&self) -> EmbeddingInit {
                self.init
            }
        }
    };
}
shardable!(EmbeddingBagConfig);
shardable!(EmbeddingConfig);

/// The accessors both sharded collections delegate to their [`Shards`] (`self.inner.shards`).
macro_rules! sharded_access {
    () => {
        /// The communicator.
        pub fn comm(&self) -> &Comm {
            &self.inner.shards.comm
        }

        /// The plan.
        pub fn plan(&self) -> &ShardingPlan {
            &self.inner.shards.plan
        }

        /// This rank's TBEs: those holding its shards (looked up for the global batch), then
        /// those holding the data-parallel replicas.
        pub fn tbes(&self) -> Vec<&TableBatchedEmbedding> {
            self.inner.shards.local_tbes().map(|l| &l.tbe).collect()
        }

        /// Where the local tables live.
        pub fn device(&self) -> Device {
            self.inner.shards.device()
        }

        /// Moves this rank's tables and their optimizer state to `device` (collectives stay
        /// host-staged). On an error the tables stay where they were.
        pub fn to_device(&self, device: Device) -> Result<()> {
            self.inner.shards.to_device(device)
        }

        /// The rectangles of table `table` this rank holds (a data-parallel replica is the
        /// whole table).
        pub fn local_shards(&self, table: &str) -> Result<Vec<ShardValues>> {
            self.inner.shards.local_shards(table)
        }

        /// The whole of table `table` (`[rows, dim]` row-major), gathered from its shards: a
        /// collective, every rank gets it.
        pub fn table_weights(&self, table: &str) -> Result<Vec<f32>> {
            self.inner.shards.table_weights(table)
        }

        /// Overwrites table `table` from its whole value (`[rows, dim]`, the same on every
        /// rank; each rank keeps its shards). Not a collective.
        pub fn set_table_weights(&self, table: &str, values: &[f32]) -> Result<()> {
            self.inner.shards.set_table_weights(table, values)
        }

        /// Writes a sharded checkpoint into directory `dir` (a collective): each rank its
        /// rectangles, then rank 0 the manifest; atomic as a whole (see
        /// [`checkpoint`](crate::distributed::checkpoint)). Load it with
        /// [`load`](Self::load) under any plan and world size, or into one unsharded
        /// collection with [`load_into_unsharded`](crate::distributed::load_into_unsharded).
        pub fn save(&self, dir: impl AsRef<std::path::Path>) -> Result<()> {
            self.inner.shards.save(dir.as_ref())
        }

        /// Loads a checkpoint written by [`save`](Self::save) under any plan and world size,
        /// or an unsharded collection's file: each rank reads the rectangles it holds (the
        /// files must be readable from every rank). A collective: if any rank cannot read its
        /// part, no rank changes anything.
        pub fn load(&self, path: impl AsRef<std::path::Path>) -> Result<LoadReport> {
            self.inner.shards.load(path.as_ref())
        }
    };
}
pub(crate) use sharded_access;

/// One table of a sharded collection.
#[derive(Clone, Debug)]
pub(crate) struct TableInfo {
    pub name: String,
    pub rows: usize,
    pub dim: usize,
    pub init: EmbeddingInit,
}

impl TableInfo {
    pub fn of(c: &impl ShardableTable) -> TableInfo {
        TableInfo {
            name: c.name().to_string(),
            rows: c.num_embeddings(),
            dim: c.embedding_dim(),
            init: c.init(),
        }
    }
}

/// The intra-host and cross-host groups of the table-row-wise collectives.
pub(crate) struct HostGroups {
    /// The ranks of this rank's host (local rank = rank in it).
    pub intra: Comm,
    /// The ranks with this rank's local index, one per host (host = rank in it).
    pub cross: Comm,
}

/// One TBE of a rank: which tables (and shards) it holds and what it looks up.
pub(crate) struct LocalTbe {
    pub tbe: TableBatchedEmbedding,
    /// Per TBE table, the rectangle of a config table it holds.
    pub tables: Vec<LocalTable>,
    /// Its TBE features in order: this rank's slot indices (remote TBEs) or feature indices
    /// (replicated TBEs).
    pub members: Vec<usize>,
}

/// A rectangle of a config table held by one TBE table.
#[derive(Clone, Debug)]
pub(crate) struct LocalTable {
    pub table: usize,
    pub row_offset: usize,
    pub rows: usize,
    pub col_offset: usize,
    pub cols: usize,
}

/// One rectangle of a table held by a rank, with its values.
#[derive(Clone, Debug, PartialEq)]
pub struct ShardValues {
    /// First row.
    pub row_offset: usize,
    /// First column.
    pub col_offset: usize,
    /// Rows.
    pub rows: usize,
    /// Columns.
    pub cols: usize,
    /// `[rows, cols]` row-major.
    pub values: Vec<f32>,
    /// The optimizer's state of these rows, by name: `[rows]` for per-row state (of these
    /// columns only), else `[rows, cols]`.
    pub states: Vec<(&'static str, Vec<f32>)>,
}

/// How to build a collection's [`Shards`].
pub(crate) struct Build<'a> {
    /// The collection's name, for errors.
    pub op: &'static str,
    pub tables: Vec<TableInfo>,
    /// Per table, its features (output keys in config order follow them).
    pub features: Vec<Vec<String>>,
    /// The collection's own verdict on its configs.
    pub checked: Result<()>,
    /// Per table, what every rank must agree on besides the plan (pooling, init, …).
    pub describe: Vec<String>,
    /// The pooling of the TBEs.
    pub pooling: PoolingMode,
    /// One TBE per distinct width (unpooled lookups have one output width per TBE), or one
    /// for every slot and one for every replicated feature.
    pub by_width: bool,
    /// Whether the table-row-wise output needs the host groups (pooled partial sums).
    pub host_groups: bool,
    pub optimizer: FusedOptimizer,
    pub weight_decay: WeightDecay,
    pub plan: &'a ShardingPlan,
    /// Where the shards of tables with a cached kernel keep their rows.
    pub caches: &'a ShardCaches,
    pub comm: Comm,
    pub seed: u64,
}

/// The shared state of a sharded collection (see the module docs).
pub(crate) struct Shards {
    pub op: &'static str,
    pub comm: Comm,
    pub hosts: Option<HostGroups>,
    pub tables: Vec<TableInfo>,
    pub plan: ShardingPlan,
    pub routing: Routing,
    /// The TBEs holding this rank's shards (looked up for the global batch).
    pub remote: Vec<LocalTbe>,
    /// The TBEs holding the data-parallel replicas (looked up for this rank's batch).
    pub replicated: Vec<LocalTbe>,
    /// Output keys: every table's features, in config order.
    pub keys: Vec<String>,
    pub optimizer: FusedOptimizer,
}

/// The digest every rank compares before building: plan, tables and this rank's verdict on
/// them (a rank whose checks failed never matches).
fn build_digests(
    describe: &[String],
    plan: &ShardingPlan,
    names: &[&str],
    local: &Result<()>,
    optimizer: &FusedOptimizer,
) -> Vec<u64> {
    let mut all = String::new();
    let mut per_table = Vec::with_capacity(describe.len());
    let by_name = plan.by_name();
    for (d, name) in describe.iter().zip(names) {
        let text = format!("{d} {:?}", by_name.get(name));
        per_table.push(fnv1a(text.as_bytes()));
        all.push_str(&text);
    }
    all.push_str(&format!("{optimizer:?}"));
    let head = match local {
        Ok(()) => plan.digest(&all),
        Err(e) => fnv1a(format!("rejected: {e}").as_bytes()),
    };
    let mut out = vec![head, describe.len() as u64];
    out.extend(per_table);
    out
}

/// Groups of `items` with equal `key`, in order of their smallest key (all in one group when
/// `split` is false).
fn groups_by<K: Ord + Copy>(
    items: Vec<usize>,
    key: impl Fn(usize) -> K,
    split: bool,
) -> Vec<Vec<usize>> {
    if items.is_empty() {
        return Vec::new();
    }
    if !split {
        return vec![items];
    }
    let mut keys: Vec<K> = items.iter().map(|&i| key(i)).collect();
    keys.sort_unstable();
    keys.dedup();
    keys.into_iter()
        .map(|k| items.iter().copied().filter(|&i| key(i) == k).collect())
        .collect()
}

impl Shards {
    /// The cache counters of the local TBEs behind caches (a plan's cached kernels).
    pub(crate) fn cache_stats(&self) -> Vec<CacheStats> {
        (self.remote.iter())
            .filter_map(|l| l.tbe.cache_stats())
            .flatten()
            .collect()
    }

    /// Builds this rank's shards (a collective: every rank calls it with the same arguments)
    /// and initialises them from the seed, row by row ([`init_table`]).
    pub fn build(b: Build<'_>) -> Result<Shards> {
        let (op, comm) = (b.op, b.comm);
        let (rank, w) = (comm.rank(), comm.size());
        let shapes: Vec<TableShape> = (b.tables.iter())
            .map(|t| TableShape::new(&t.name, t.rows, t.dim))
            .collect();
        let checked = b
            .checked
            .and_then(|()| b.plan.check(&shapes))
            .and_then(|()| b.optimizer.validate());
        let names: Vec<&str> = b.tables.iter().map(|t| t.name.as_str()).collect();
        let digests = build_digests(&b.describe, b.plan, &names, &checked, &b.optimizer);
        let all = comm.all_gather_v("check_plan", &digests, None)?;
        checked?;
        if let Some(other) = (0..w).find(|&r| all[r] != all[0]) {
            let table = (names.iter().enumerate())
                .find(|&(t, _)| all[other].get(2 + t) != all[0].get(2 + t))
                .map(|(_, n)| format!(" (first difference: table `{n}`)"))
                .unwrap_or_default();
            return Err(Error::Distributed(format!(
                "rank {rank}: rank {other} holds another plan or other tables than rank 0{table}, \
                 or rejected them"
            )));
        }
        let plan = b.plan;
        if plan.world_size != w {
            return Err(Error::Distributed(format!(
                "rank {rank}: the plan is for {} ranks, the communicator has {w}",
                plan.world_size
            )));
        }
        let routing = Routing::new(plan, &shapes, &b.features)?;
        let hosts = if b.host_groups && routing.has_twrw() {
            let local = plan.local_world_size;
            let intra = comm.split(rank / local)?;
            let cross = comm.split(rank % local)?;
            Some(HostGroups { intra, cross })
        } else {
            None
        };
        let keys: Vec<String> = b.features.concat();
        // Row files named by collection kind: the pooled one (EBC) or the unpooled one (EC).
        let short = if b.pooling == PoolingMode::None {
            "ec"
        } else {
            "ebc"
        };
        let mut files = 0;
        // A TBE of `tables` (features `names` reading tables `ftm`), its rows where `kernel`
        // keeps them.
        let mut tbe = |tables: &[LocalTable],
                       names: Vec<String>,
                       ftm: Vec<usize>,
                       kernel: (ComputeKernel, Option<f64>)| {
            let specs = (tables.iter().enumerate())
                .map(|(i, t)| {
                    TableSpec::new(format!("{}#{i}", names_of(&b.tables, t)), t.rows, t.cols)
                })
                .collect();
            let mut cfg = TbeConfig::new(specs, ftm, b.pooling, b.optimizer);
            cfg.feature_names = Some(names);
            cfg.weight_decay = b.weight_decay;
            cfg.bounds_check = BoundsCheckMode::Error;
            let placement =
                Placement::for_kernel(kernel.0.as_str(), kernel.1, &b.caches.dir, b.caches.policy)?;
            let name = format!("{short}-rank{rank}-group{files}.rows");
            // Built on the host (caches included); `to_device` moves them.
            let tbe = placement.tbe(cfg, &name, b.caches.device, crate::Device::Cpu)?;
            files += usize::from(tbe.is_cached());
            Ok::<_, Error>(tbe)
        };
        // The kernel a slot's shard runs: its table's, but an empty row block stays in memory.
        let by_name = plan.by_name();
        let kernel_of = |s: &Slot| {
            let t = by_name
                .get(b.tables[s.table].name.as_str())
                .expect("a checked plan places every table");
            if s.rows == 0 {
                (ComputeKernel::Fused, None)
            } else {
                (t.compute_kernel, t.cache_load_factor)
            }
        };
        // Built by each rank alone (row files made, their blocks allocated): a rank whose
        // build fails (a full disk, a directory it cannot write) tells the others, which
        // would otherwise wait for it at their first collective.
        let mut remote = Vec::new();
        let mut replicated = Vec::new();
        let built = (|| {
            // Remote TBEs: one table per distinct (table, shard, columns) of this rank's slots.
            let slots = &routing.slots[rank];
            // Grouped by width (unpooled) and by where the kernel keeps the rows.
            let group_key = |i: usize| {
                let (kernel, load) = kernel_of(&slots[i]);
                let width = if b.by_width { slots[i].cols } else { 0 };
                (width, kernel.as_str(), load.map(f64::to_bits))
            };
            for members in groups_by((0..slots.len()).collect(), group_key, true) {
                let mut tables: Vec<LocalTable> = Vec::new();
                let mut held: Vec<(usize, Option<usize>, usize)> = Vec::new();
                let mut ftm = Vec::with_capacity(members.len());
                for &i in &members {
                    let s = &slots[i];
                    let key = (s.table, s.shard, s.col_offset);
                    let at = held.iter().position(|k| *k == key).unwrap_or_else(|| {
                        held.push(key);
                        tables.push(LocalTable {
                            table: s.table,
                            row_offset: s.row_offset,
                            rows: s.rows,
                            col_offset: s.col_offset,
                            cols: s.cols,
                        });
                        tables.len() - 1
                    });
                    ftm.push(at);
                }
                let names = members
                    .iter()
                    .map(|&i| keys[slots[i].feature].clone())
                    .collect();
                remote.push(LocalTbe {
                    tbe: tbe(&tables, names, ftm, kernel_of(&slots[members[0]]))?,
                    tables,
                    members,
                });
            }
            // Replicated TBEs: the data-parallel tables whole.
            let features = &routing.features;
            for members in groups_by(routing.replicated.clone(), |f| features[f].dim, b.by_width) {
                let mut tables: Vec<LocalTable> = Vec::new();
                let mut ftm = Vec::new();
                for &f in &members {
                    let t = features[f].table;
                    let at = tables.iter().position(|l| l.table == t).unwrap_or_else(|| {
                        tables.push(LocalTable {
                            table: t,
                            row_offset: 0,
                            rows: b.tables[t].rows,
                            col_offset: 0,
                            cols: b.tables[t].dim,
                        });
                        tables.len() - 1
                    });
                    ftm.push(at);
                }
                let names = members.iter().map(|&f| keys[f].clone()).collect();
                // Replicas live in memory (the plan's `dense` or `fused`).
                replicated.push(LocalTbe {
                    tbe: tbe(&tables, names, ftm, (ComputeKernel::Fused, None))?,
                    tables,
                    members,
                });
            }
            Ok::<(), Error>(())
        })();
        // The TBEs made so far, on a failure here or on any rank, take their row files with
        // them.
        let discard = |tbes: Vec<LocalTbe>| tbes.into_iter().for_each(|l| l.tbe.discard());
        let built =
            checkpoint::all_ok_then(&comm, "build.tables", built, "no collection was built");
        if let Err(e) = built {
            discard(remote);
            discard(replicated);
            return Err(e);
        }
        let shards = Shards {
            op,
            comm,
            hosts,
            tables: b.tables,
            plan: plan.clone(),
            routing,
            remote,
            replicated,
            keys,
            optimizer: b.optimizer,
        };
        let initialised = shards.init_tables(b.seed);
        let initialised = checkpoint::all_ok_then(
            &shards.comm,
            "build.init",
            initialised,
            "no collection was built",
        );
        if let Err(e) = initialised {
            discard(shards.remote);
            discard(shards.replicated);
            return Err(e);
        }
        Ok(shards)
    }

    /// Fills every local table from `seed`, row by row ([`init_table`]).
    fn init_tables(&self, seed: u64) -> Result<()> {
        for local in self.local_tbes() {
            for (i, t) in local.tables.iter().enumerate() {
                let mut values = vec![0.0f32; t.rows * t.cols];
                init_rows(
                    &self.tables[t.table],
                    seed,
                    t.row_offset,
                    t.rows,
                    t.col_offset,
                    t.cols,
                    &mut values,
                )?;
                local.tbe.set_table_weights(i, &values)?;
            }
        }
        Ok(())
    }

    /// This rank's TBEs whose tables live in managed memory on a GPU.
    pub fn managed_tbes(&self) -> usize {
        self.local_tbes().filter(|l| l.tbe.is_managed()).count()
    }

    /// Every TBE of this rank, remote ones first.
    pub fn local_tbes(&self) -> impl Iterator<Item = &LocalTbe> {
        self.remote.iter().chain(self.replicated.iter())
    }

    /// Where the local tables live.
    pub fn device(&self) -> Device {
        self.local_tbes()
            .next()
            .map_or(Device::Cpu, |l| l.tbe.device())
    }

    /// Moves every local table and its optimizer state to `device`; on an error the tables
    /// stay where they were.
    pub fn to_device(&self, device: Device) -> Result<()> {
        let from = self.device();
        let tbes: Vec<&TableBatchedEmbedding> = self.local_tbes().map(|l| &l.tbe).collect();
        for (i, tbe) in tbes.iter().enumerate() {
            if let Err(e) = tbe.to_device(device) {
                for moved in &tbes[..i] {
                    moved.to_device(from)?;
                }
                return Err(e);
            }
        }
        Ok(())
    }

    pub fn table_index(&self, table: &str) -> Result<usize> {
        (self.tables.iter())
            .position(|c| c.name == table)
            .ok_or_else(|| Error::invalid(self.op, format!("no table named `{table}`")))
    }

    /// The rectangles of `table` this rank holds.
    pub fn local_shards(&self, table: &str) -> Result<Vec<ShardValues>> {
        let t = self.table_index(table)?;
        let mut out = Vec::new();
        for local in self.local_tbes() {
            for (i, l) in local.tables.iter().enumerate() {
                if l.table == t {
                    out.push(ShardValues {
                        row_offset: l.row_offset,
                        col_offset: l.col_offset,
                        rows: l.rows,
                        cols: l.cols,
                        values: local.tbe.table_weights(i)?,
                        states: (local.tbe.optimizer_state_names().into_iter().enumerate())
                            .map(|(k, (name, _))| Ok((name, local.tbe.optimizer_state(k, i)?)))
                            .collect::<Result<_>>()?,
                    });
                }
            }
        }
        Ok(out)
    }

    /// Whether `table` is data-parallel.
    fn replicated_table(&self, t: usize) -> bool {
        self.plan
            .table(&self.tables[t].name)
            .map(|p| p.sharding_type)
            == Some(super::ShardingType::DataParallel)
    }

    /// The whole of `table`, gathered from its shards (a collective).
    pub fn table_weights(&self, table: &str) -> Result<Vec<f32>> {
        let t = self.table_index(table)?;
        let (rows, dim) = (self.tables[t].rows, self.tables[t].dim);
        let mut header: Vec<u64> = Vec::new();
        let mut values: Vec<f32> = Vec::new();
        // A replica is the same everywhere: rank 0 sends it.
        if !self.replicated_table(t) || self.comm.rank() == 0 {
            for s in self.local_shards(table)? {
                header.extend([s.row_offset, s.col_offset, s.rows, s.cols].map(|x| x as u64));
                values.extend_from_slice(&s.values);
            }
        }
        let headers = self.comm.all_gather_v("gather_table", &header, None)?;
        let blocks = self.comm.all_gather_v("gather_table", &values, None)?;
        let mut full = vec![0.0f32; rows * dim];
        let (table_rows, table_dim) = (rows, dim);
        for (s, (header, block)) in headers.iter().zip(&blocks).enumerate() {
            let mut at = 0usize;
            if header.len() % 4 != 0 {
                return Err(Error::Distributed(format!(
                    "rank {}: gather_table: rank {s} sent a header of {} words for `{table}`, \
                     not whole rectangles of 4",
                    self.comm.rank(),
                    header.len()
                )));
            }
            for rect in header.chunks_exact(4) {
                let [r0, c0, rows, cols] = [rect[0], rect[1], rect[2], rect[3]].map(|x| x as usize);
                // A peer's rectangle inside the table, its values inside its block.
                let fits = (r0.checked_add(rows)).is_some_and(|e| e <= table_rows)
                    && (c0.checked_add(cols)).is_some_and(|e| e <= table_dim)
                    && (rows.checked_mul(cols))
                        .and_then(|n| n.checked_add(at))
                        .is_some_and(|e| e <= block.len());
                if !fits {
                    return Err(Error::Distributed(format!(
                        "rank {}: gather_table: rank {s} sent a rectangle {rect:?} of `{table}` \
                         outside its {table_rows}×{table_dim} values or its own block",
                        self.comm.rank()
                    )));
                }
                for r in 0..rows {
                    full[(r0 + r) * dim + c0..(r0 + r) * dim + c0 + cols]
                        .copy_from_slice(&block[at + r * cols..at + (r + 1) * cols]);
                }
                at += rows * cols;
            }
        }
        Ok(full)
    }

    /// Overwrites `table` from its whole value; each rank keeps its shards.
    pub fn set_table_weights(&self, table: &str, values: &[f32]) -> Result<()> {
        let t = self.table_index(table)?;
        let (rows, dim) = (self.tables[t].rows, self.tables[t].dim);
        if values.len() != rows * dim {
            return Err(Error::invalid(
                self.op,
                format!(
                    "table `{table}` has {rows}×{dim} values, got {}",
                    values.len()
                ),
            ));
        }
        for local in self.local_tbes() {
            for (i, l) in local.tables.iter().enumerate() {
                if l.table == t {
                    let mut shard = Vec::with_capacity(l.rows * l.cols);
                    for r in l.row_offset..l.row_offset + l.rows {
                        shard.extend_from_slice(&values[r * dim + l.col_offset..][..l.cols]);
                    }
                    local.tbe.set_table_weights(i, &shard)?;
                }
            }
        }
        Ok(())
    }

    /// This rank's rectangles for a checkpoint (`save`: a data-parallel replica only on rank
    /// 0).
    fn held(&self, save: bool) -> Vec<Held<'_>> {
        let mut out = Vec::new();
        for (locals, replicated) in [(&self.remote, false), (&self.replicated, true)] {
            if replicated && save && self.comm.rank() != 0 {
                continue;
            }
            for local in locals {
                for (index, t) in local.tables.iter().enumerate() {
                    out.push(Held {
                        table: &self.tables[t.table].name,
                        rect: Rect {
                            row_offset: t.row_offset,
                            col_offset: t.col_offset,
                            rows: t.rows,
                            cols: t.cols,
                        },
                        tbe: &local.tbe,
                        index,
                    });
                }
            }
        }
        out
    }

    /// Whether the plan gives any table a kernel that keeps rows in files (`fused_uvm`,
    /// `fused_uvm_caching`), whose lookups and updates can fail on one rank (I/O): the same
    /// answer on every rank, so all make the same agreements around them.
    pub fn has_cached_kernels(&self) -> bool {
        (self.plan.tables.iter()).any(|t| {
            matches!(
                t.compute_kernel,
                ComputeKernel::FusedUvm | ComputeKernel::FusedUvmCaching
            )
        })
    }

    /// This rank's remote lookups, `looked`, agreed on by every rank when rows are in files
    /// (they can fail to read on one rank: the others would wait in the output distribution
    /// until the deadline). A collective then: every rank with an input distribution calls it.
    pub(crate) fn agree_on_lookups<T>(&self, looked: Result<T>) -> Result<T> {
        if self.has_cached_kernels() {
            checkpoint::all_ok(&self.comm, "forward.lookups", looked)
        } else {
            looked
        }
    }

    /// This rank's update of its remote rows, `updated`, agreed on by every rank when rows are
    /// in files and a replicated step (a collective) is still to come: an update that failed
    /// on one rank stops every rank here.
    pub(crate) fn agree_on_update(&self, updated: Result<()>) -> Result<()> {
        if self.has_cached_kernels() && !self.replicated.is_empty() {
            checkpoint::all_ok(&self.comm, "backward.remote", updated)
        } else {
            updated
        }
    }

    /// Writes a sharded checkpoint into `dir` (a collective).
    pub fn save(&self, dir: &std::path::Path) -> Result<()> {
        let comm = &self.comm;
        let step = self.local_tbes().map(|l| l.tbe.step()).max().unwrap_or(0);
        let steps = comm.all_gather_v("checkpoint.step", &[step], Some(&vec![1; comm.size()]))?;
        let step = steps.iter().map(|s| s[0]).max().unwrap_or(0);
        checkpoint::save(comm, dir, &self.held(true), self.optimizer.name(), step)
    }

    /// Loads a sharded checkpoint or an unsharded collection's file (a collective: if any rank
    /// cannot read its part, no rank changes anything).
    pub fn load(&self, path: &std::path::Path) -> Result<LoadReport> {
        let held = self.held(false);
        let shapes: Vec<(&str, usize, usize)> = (self.tables.iter())
            .map(|t| (t.name.as_str(), t.rows, t.dim))
            .collect();
        let staged = checkpoint::Saved::open(path)
            .and_then(|mut saved| saved.stage(&held, self.optimizer.name(), &shapes));
        let staged = checkpoint::all_ok(&self.comm, "checkpoint.loaded", staged)?;
        // Each rank opened the checkpoint it found: a save committed while they did may have
        // given them different ones, which no rank applies.
        let which = staged.checkpoint.as_bytes();
        let all = self.comm.all_gather_v("checkpoint.which", which, None)?;
        if let Some(r) = all.iter().position(|w| w != which) {
            return Err(Error::Distributed(format!(
                "rank {}: {}: rank {r} read another checkpoint (a save replaced it during the \
                 load); nothing was loaded: load again",
                self.comm.rank(),
                path.display()
            )));
        }
        // Writing what every rank read can still fail on I/O (a staged row file's rename):
        // every rank then says so.
        let applied = staged.apply();
        checkpoint::all_ok_then(
            &self.comm,
            "checkpoint.applied",
            applied,
            "tables may now differ between ranks: load a checkpoint again",
        )
    }

    /// Reads and checks this rank's batch: every feature present, ids inside their tables.
    fn read_input(&self, kjt: &KeyedJaggedTensor) -> Result<LocalInput> {
        let op = self.op;
        if kjt.weights().is_some_and(Tensor::requires_grad) {
            return Err(Error::invalid(
                op,
                "per-sample weights that require grad: sharded tables give them no gradient",
            ));
        }
        let host = HostKjt::new(op, kjt)?;
        let key_of = (self.keys.iter())
            .map(|f| {
                host.keys.iter().position(|k| k == f).ok_or_else(|| {
                    Error::invalid(
                        op,
                        format!(
                            "feature `{f}` is missing from the input KJT (its keys are {:?})",
                            host.keys
                        ),
                    )
                })
            })
            .collect::<Result<Vec<_>>>()?;
        for (f, &k) in key_of.iter().enumerate() {
            let c = &self.tables[self.routing.features[f].table];
            let (ids, _, _) = host.key(k);
            if let Some(p) = ids.iter().position(|&i| i < 0 || i as usize >= c.rows) {
                return Err(Error::invalid(
                    op,
                    format!(
                        "feature `{}`: id {} at position {p} is outside table `{}` (0..{})",
                        self.keys[f], ids[p], c.name, c.rows
                    ),
                ));
            }
        }
        Ok(LocalInput { kjt: host, key_of })
    }

    /// The input distribution of this rank's batch (a collective): the batch read and checked,
    /// and, when any table has slots, the bags of this rank's slots from every rank
    /// (`weights`: whether the bags carry the KJT's weights), over `comm` (the collection's
    /// communicator, or a duplicate of it for a pipeline's communication thread). A batch that
    /// fails its checks is an error on this rank naming the feature, and an error naming this
    /// rank on the others.
    pub fn distribute_input(
        &self,
        kjt: &KeyedJaggedTensor,
        weights: bool,
        comm: &Comm,
    ) -> Result<(LocalInput, Option<Gathered>)> {
        if (comm.rank(), comm.size()) != (self.comm.rank(), self.comm.size()) {
            return Err(Error::invalid(
                self.op,
                format!(
                    "the input distribution's communicator is rank {} of {}, the collection's \
                     rank {} of {}: it must be the collection's or a duplicate of it",
                    comm.rank(),
                    comm.size(),
                    self.comm.rank(),
                    self.comm.size()
                ),
            ));
        }
        let batch = comm.next_batch();
        let input = self.read_input(kjt);
        if !self.routing.has_slots() {
            let rejected = (input.as_ref().err()).map(|e| Error::invalid(self.op, e.to_string()));
            agree_on_batch(comm, rejected, batch)?;
            return Ok((input?, None));
        }
        let (send, stride, rejected) = match &input {
            Ok(host) => (self.bags_for_slots(host, weights), host.kjt.stride, None),
            Err(e) => (Vec::new(), 0, Some(Error::invalid(self.op, e.to_string()))),
        };
        let slots = self.routing.slots[self.comm.rank()].len();
        let gathered = all_to_all_bags(comm, send, stride, slots, rejected, batch)?;
        Ok((input?, Some(gathered)))
    }

    /// This rank's bags for every rank's slots.
    fn bags_for_slots(&self, input: &LocalInput, weights: bool) -> Vec<Bags> {
        let weighted = weights && input.kjt.weights.is_some();
        (self.routing.slots.iter())
            .map(|slots| {
                let mut bags = Bags {
                    weights: weighted.then(Vec::new),
                    ..Bags::default()
                };
                for slot in slots {
                    input.push_slot(slot, &mut bags);
                }
                bags
            })
            .collect()
    }

    /// One step of the replicated TBEs, each with its row gradients for this rank's batch
    /// (`steps`, in the order of [`Shards::replicated`]): summed over the ranks in rank order,
    /// divided by the world size, applied once — every rank makes the same update. One
    /// all-gather of rows and one of values for all of them.
    pub fn step_replicated(&self, steps: Vec<Vec<RowSparseGrad>>) -> Result<()> {
        let comm = &self.comm;
        let w = comm.size();
        if w == 1 {
            for (rep, grads) in self.replicated.iter().zip(&steps) {
                rep.tbe.apply_row_gradients(grads)?;
            }
            return Ok(());
        }
        let tables: Vec<&LocalTable> = self.replicated.iter().flat_map(|r| &r.tables).collect();
        let mut rows: Vec<i64> = Vec::new();
        let mut values: Vec<f32> = Vec::new();
        for gt in steps.iter().flatten() {
            rows.push(gt.rows.len() as i64);
            rows.extend_from_slice(&gt.rows);
            values.extend(gt.values.to_device(Device::Cpu)?.to_vec::<f32>()?);
        }
        let all_rows = comm.all_gather_v("backward.replicated_rows", &rows, None)?;
        let value_counts: Vec<usize> = (all_rows.iter())
            .enumerate()
            .map(|(s, r)| {
                count_values(r, &tables).map_err(|why| {
                    Error::Distributed(format!(
                        "rank {}: backward.replicated_rows: rank {s} sent a block that {why}",
                        comm.rank()
                    ))
                })
            })
            .collect::<Result<_>>()?;
        let all_values =
            comm.all_gather_v("backward.replicated_values", &values, Some(&value_counts))?;
        let mut summed: Vec<std::collections::BTreeMap<i64, Vec<f32>>> =
            vec![Default::default(); tables.len()];
        for (r, v) in all_rows.iter().zip(&all_values) {
            let (mut at, mut vat) = (0, 0);
            for (t, table) in tables.iter().enumerate() {
                let n = r[at] as usize;
                for &row in &r[at + 1..at + 1 + n] {
                    let acc = summed[t]
                        .entry(row)
                        .or_insert_with(|| vec![0.0; table.cols]);
                    for (a, &x) in acc.iter_mut().zip(&v[vat..vat + table.cols]) {
                        *a += x;
                    }
                    vat += table.cols;
                }
                at += 1 + n;
            }
        }
        let world = w as f32;
        let mut grads = (summed.into_iter().zip(&tables))
            .map(|(rows, table)| {
                let n = rows.len();
                let mut values = Vec::with_capacity(n * table.cols);
                let rows: Vec<i64> = (rows.into_iter())
                    .map(|(r, v)| {
                        values.extend(v.into_iter().map(|x| x / world));
                        r
                    })
                    .collect();
                Ok(RowSparseGrad {
                    rows,
                    values: Tensor::from_vec(values, &[n, table.cols])?,
                    num_rows: table.rows,
                })
            })
            .collect::<Result<Vec<_>>>()?
            .into_iter();
        for rep in &self.replicated {
            let mine: Vec<RowSparseGrad> = grads.by_ref().take(rep.tables.len()).collect();
            rep.tbe.apply_row_gradients(&mine)?;
        }
        Ok(())
    }
}

fn names_of<'a>(tables: &'a [TableInfo], t: &LocalTable) -> &'a str {
    &tables[t.table].name
}

/// Values in a gathered replicated-gradient block whose row lists are `rows` (per table, its
/// row count and then its rows), or what is wrong with the block: a count past its end, a row
/// outside its table, words left over, a size past a `usize`.
fn count_values(rows: &[i64], tables: &[&LocalTable]) -> std::result::Result<usize, String> {
    let (mut at, mut n) = (0usize, 0usize);
    for t in tables {
        let k = (rows.get(at).copied())
            .and_then(|k| usize::try_from(k).ok())
            .filter(|&k| k < rows.len() - at)
            .ok_or_else(|| format!("is cut short at word {at}"))?;
        let listed = &rows[at + 1..at + 1 + k];
        if let Some(r) = listed.iter().find(|&&r| r < 0 || r as u64 >= t.rows as u64) {
            return Err(format!("lists row {r} of a table of {} rows", t.rows));
        }
        n = (k.checked_mul(t.cols))
            .and_then(|v| n.checked_add(v))
            .ok_or("holds more values than a usize counts")?;
        at += 1 + k;
    }
    if at != rows.len() {
        return Err(format!(
            "has {} words past its tables' rows",
            rows.len() - at
        ));
    }
    Ok(n)
}

/// This rank's batch on the host, with the KJT key of each output feature.
pub(crate) struct LocalInput {
    pub kjt: HostKjt,
    pub key_of: Vec<usize>,
}

impl LocalInput {
    /// Feature `f`'s ids, weights and per-sample lengths.
    pub fn feature(&self, f: usize) -> (&[i64], Option<&[f32]>, &[i64]) {
        self.kjt.key(self.key_of[f])
    }

    /// Appends this rank's bags for `slot` (its row block re-based to the shard for row
    /// blocks); weights only if `bags` carries them.
    fn push_slot(&self, slot: &Slot, bags: &mut Bags) {
        let (ids, weights, lengths) = self.feature(slot.feature);
        match slot.route {
            Route::Owned => {
                bags.lengths.extend(lengths.iter().map(|&l| l as i32));
                bags.values.extend_from_slice(ids);
                if let (Some(o), Some(w)) = (&mut bags.weights, weights) {
                    o.extend_from_slice(w);
                }
            }
            Route::RowWise | Route::TwRw { .. } => {
                let (lo, hi) = (slot.row_offset as i64, (slot.row_offset + slot.rows) as i64);
                let mut at = 0;
                for &l in lengths {
                    let before = bags.values.len();
                    for k in at..at + l as usize {
                        let id = ids[k];
                        if id >= lo && id < hi {
                            bags.values.push(id - lo);
                            if let (Some(o), Some(w)) = (&mut bags.weights, weights) {
                                o.push(w[k]);
                            }
                        }
                    }
                    bags.lengths.push((bags.values.len() - before) as i32);
                    at += l as usize;
                }
            }
        }
    }

    /// The bags of `features` (this rank's batch), for a replicated TBE: ids, offsets and
    /// the weights if `weights` and the KJT has them.
    pub fn bags_of(
        &self,
        features: &[usize],
        weights: bool,
    ) -> (Vec<i64>, Vec<i64>, Option<Vec<f32>>) {
        let mut ids = Vec::new();
        let mut offsets = vec![0i64];
        let mut out_weights = (weights && self.kjt.weights.is_some()).then(Vec::new);
        for &f in features {
            let (v, w, lengths) = self.feature(f);
            ids.extend_from_slice(v);
            if let (Some(o), Some(w)) = (&mut out_weights, w) {
                o.extend_from_slice(w);
            }
            for &l in lengths {
                let last = *offsets.last().expect("offsets start at 0");
                offsets.push(last + l);
            }
        }
        (ids, offsets, out_weights)
    }
}

/// Rows `[row_offset, row_offset + rows)`, columns `[col_offset, col_offset + cols)` of
/// `table` as initialised from `seed`: each row from its own ChaCha8 stream (seeded by `seed`
/// and the table name, stream = row), so the values do not depend on how the table is
/// sharded.
fn init_rows(
    table: &TableInfo,
    seed: u64,
    row_offset: usize,
    rows: usize,
    col_offset: usize,
    cols: usize,
    out: &mut [f32],
) -> Result<()> {
    let table_seed = seed ^ fnv1a(table.name.as_bytes());
    let mut row = vec![0.0f32; table.dim];
    for r in 0..rows {
        let mut rng = Rng::seed_from_u64(table_seed);
        rng.set_stream((row_offset + r) as u64);
        fill_init(&mut row, table.rows, table.init, &mut rng)?;
        out[r * cols..(r + 1) * cols].copy_from_slice(&row[col_offset..col_offset + cols]);
    }
    Ok(())
}

/// Table `config` as a sharded collection initialises it from `seed` (`[rows, dim]`): load it
/// into an unsharded collection to compare the two.
pub fn init_table(config: &impl ShardableTable, seed: u64) -> Result<Vec<f32>> {
    let table = TableInfo::of(config);
    let mut out = vec![0.0f32; table.rows * table.dim];
    init_rows(&table, seed, 0, table.rows, 0, table.dim, &mut out)?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::{count_values, LocalTable};

    /// A peer's replicated-gradient row lists are read only as far as they hold: a count past
    /// the block, a row outside its table or words left over are named (the block was indexed
    /// unchecked, and a short one panicked).
    #[test]
    fn a_peers_gradient_block_is_checked_before_it_is_read() {
        let table = |rows, cols| LocalTable {
            table: 0,
            row_offset: 0,
            rows,
            col_offset: 0,
            cols,
        };
        let (a, b) = (table(10, 4), table(5, 2));
        let tables = [&a, &b];
        // Table a: rows 3 and 7; table b: row 0.
        assert_eq!(count_values(&[2, 3, 7, 1, 0], &tables), Ok(2 * 4 + 2));
        for (block, why) in [
            (&[2, 3, 7, 2, 0][..], "cut short at word 3"),
            (&[2, 3][..], "cut short at word 0"),
            (&[-1][..], "cut short at word 0"),
            (&[1, 10, 0][..], "lists row 10 of a table of 10 rows"),
            (&[1, 3, 1, -2][..], "lists row -2"),
            (&[0, 0, 9][..], "has 1 words past"),
        ] {
            let e = count_values(block, &tables).unwrap_err();
            assert!(e.contains(why), "{block:?}: {e}");
        }
    }
}
