//! [`ShardedEmbeddingBagCollection`]: an [`EmbeddingBagCollection`](crate::embedding::EmbeddingBagCollection)
//! whose tables are spread over the ranks of a [`Comm`] by a [`ShardingPlan`] — TorchRec's
//! `ShardedEmbeddingBagCollection`, for every sharding type but grid.
//!
//! Each rank keeps two TBEs, both SUM-pooled with the optimizer fused into backward:
//! * *remote* — its slots (the `routing` module): the shards it holds, looked up for
//!   every rank's batch (the global batch);
//! * *replicated* — the data-parallel tables, looked up for its own batch.
//!
//! Forward: the input distribution (the `input_dist` module) brings every rank the
//! bags of its slots; the remote lookup runs; the output distribution brings each rank the rows
//! of its samples — all-to-all for owned shards, reduce-scatter for row-wise partial sums,
//! reduce-scatter inside the host then all-to-all across hosts for table-row-wise ones; the
//! replicated lookup fills the data-parallel columns. MEAN pooling divides by the bag length
//! at the end, on the sample's own rank (the shards pool with SUM), as TorchRec does for
//! row-wise shards. The output is in the unsharded key order.
//!
//! Backward reverses each collective (all-to-all back, all-gather for the reduce-scatters)
//! and divides the gradients by the world size (TorchRec's gradient division): one sharded
//! step on the ranks' local batches is one unsharded step on their concatenation (each rank's
//! loss being the mean over its own batch). Data-parallel tables sum their row gradients over
//! the ranks (an all-gather of the row-sparse gradients), divide by the world size and take
//! one fused step.

use std::sync::Arc;

use rand::SeedableRng;

use super::checkpoint::{self, Held, LoadReport, Rect};
use super::comm::Comm;
use super::input_dist::{all_to_all_bags, Bags, HostKjt};
use super::plan::{fnv1a, ShardingPlan, ShardingType, TableShape};
use super::routing::{width, Route, Routing, Slot};
use crate::embedding::{
    check_bag_configs, fill_init, BoundsCheckMode, EmbeddingBagConfig, FusedOptimizer, PoolingMode,
    TableBatchedEmbedding, TableSpec, TbeBatch, TbeConfig, TbeInput, WeightDecay,
};
use crate::error::{Error, Result};
use crate::sparse::{KeyedJaggedTensor, KeyedTensor};
use crate::tensor::rng::Rng;
use crate::tensor::{record_op_with_state, BackwardOp, Gradient, RowSparseGrad};
use crate::{Device, Tensor};

const OP: &str = "ShardedEmbeddingBagCollection";

/// The intra-host and cross-host groups of the table-row-wise collectives.
struct HostGroups {
    /// The ranks of this rank's host (local rank = rank in it).
    intra: Comm,
    /// The ranks with this rank's local index, one per host (host = rank in it).
    cross: Comm,
}

/// One TBE of a rank and, per TBE table, which table (and shard) it holds.
struct LocalTbe {
    tbe: TableBatchedEmbedding,
    /// Per TBE table: (config table, plan shard), the rectangle it holds.
    tables: Vec<LocalTable>,
}

/// A rectangle of a config table held by one TBE table.
#[derive(Clone, Debug)]
struct LocalTable {
    table: usize,
    row_offset: usize,
    rows: usize,
    col_offset: usize,
    cols: usize,
}

struct Inner {
    comm: Comm,
    hosts: Option<HostGroups>,
    configs: Vec<EmbeddingBagConfig>,
    plan: ShardingPlan,
    routing: Routing,
    remote: Option<LocalTbe>,
    replicated: Option<LocalTbe>,
    output_keys: Vec<String>,
    output_dims: Vec<usize>,
    optimizer: FusedOptimizer,
    /// Forward calls so far: the batch number every rank must agree on.
    batches: std::sync::atomic::AtomicU64,
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

/// An embedding-bag collection sharded over the ranks of a communicator (see the module
/// docs). Every rank builds it with the same configs and plan, and every rank calls
/// [`forward`](Self::forward) (and backward) for each batch; batch sizes may differ between
/// ranks.
#[derive(Clone)]
pub struct ShardedEmbeddingBagCollection {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for ShardedEmbeddingBagCollection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShardedEmbeddingBagCollection")
            .field("rank", &self.inner.comm.rank())
            .field("world", &self.inner.comm.size())
            .field("tables", &self.inner.configs.len())
            .finish()
    }
}

/// The digest every rank compares before building: plan, tables, features, pooling and this
/// rank's verdict on them (a rank whose checks failed never matches).
fn build_digests(
    configs: &[EmbeddingBagConfig],
    plan: &ShardingPlan,
    local: &Result<()>,
    optimizer: &FusedOptimizer,
) -> Vec<u64> {
    let describe = |c: &EmbeddingBagConfig| {
        format!(
            "{} {}x{} {:?} {:?} {:?}",
            c.name, c.num_embeddings, c.embedding_dim, c.feature_names, c.pooling, c.init
        )
    };
    let mut all = String::new();
    let mut per_table = Vec::with_capacity(configs.len());
    for c in configs {
        let t = plan.table(&c.name);
        let text = format!("{} {t:?}", describe(c));
        per_table.push(fnv1a(text.as_bytes()));
        all.push_str(&text);
    }
    all.push_str(&format!("{optimizer:?}"));
    let head = match local {
        Ok(()) => plan.digest(&all),
        Err(e) => fnv1a(format!("rejected: {e}").as_bytes()),
    };
    let mut out = vec![head, configs.len() as u64];
    out.extend(per_table);
    out
}

impl ShardedEmbeddingBagCollection {
    /// Builds this rank's shards of `configs` under `plan` (a collective: every rank of `comm`
    /// calls it with the same arguments). Tables are initialised from `seed` row by row, so
    /// every plan (and an unsharded run using [`init_table`]) gives the same tables.
    ///
    /// Errors, on every rank alike: a plan that does not fit the tables (naming the table), a
    /// world size other than the plan's, or ranks that disagree on the plan or the tables
    /// (naming the rank and table).
    pub fn new(
        configs: Vec<EmbeddingBagConfig>,
        plan: &ShardingPlan,
        optimizer: FusedOptimizer,
        comm: Comm,
        seed: u64,
    ) -> Result<Self> {
        Self::with_options(configs, plan, optimizer, WeightDecay::None, comm, seed)
    }

    /// [`new`](Self::new) with weight decay.
    pub fn with_options(
        configs: Vec<EmbeddingBagConfig>,
        plan: &ShardingPlan,
        optimizer: FusedOptimizer,
        weight_decay: WeightDecay,
        comm: Comm,
        seed: u64,
    ) -> Result<Self> {
        let (rank, w) = (comm.rank(), comm.size());
        let shapes: Vec<TableShape> = (configs.iter())
            .map(|c| TableShape::new(&c.name, c.num_embeddings, c.embedding_dim))
            .collect();
        let checked = check_bag_configs(OP, &configs)
            .and_then(|keys| plan.check(&shapes).map(|()| keys))
            .and_then(|keys| optimizer.validate().map(|()| keys));
        let verdict = checked
            .as_ref()
            .map(|_| ())
            .map_err(|e| Error::invalid(OP, e.to_string()));
        let digests = build_digests(&configs, plan, &verdict, &optimizer);
        let all = comm.all_gather_v("check_plan", &digests, None)?;
        let (output_keys, output_dims) = checked?;
        if let Some(other) = (0..w).find(|&r| all[r] != all[0]) {
            let table = (configs.iter().enumerate())
                .find(|&(t, _)| all[other].get(2 + t) != all[0].get(2 + t))
                .map(|(_, c)| format!(" (first difference: table `{}`)", c.name))
                .unwrap_or_default();
            return Err(Error::Distributed(format!(
                "rank {rank}: rank {other} holds another plan or other tables than rank 0{table}, \
                 or rejected them"
            )));
        }
        if plan.world_size != w {
            return Err(Error::Distributed(format!(
                "rank {rank}: the plan is for {} ranks, the communicator has {w}",
                plan.world_size
            )));
        }
        let features: Vec<Vec<String>> = configs.iter().map(|c| c.feature_names.clone()).collect();
        let routing = Routing::new(plan, &shapes, &features)?;
        let hosts = if routing.has_twrw() {
            let local = plan.local_world_size;
            let intra = comm.split(rank / local)?;
            let cross = comm.split(rank % local)?;
            Some(HostGroups { intra, cross })
        } else {
            None
        };
        let tbe_config = |tables: &[LocalTable], names: Vec<String>, ftm: Vec<usize>| {
            let specs = (tables.iter().enumerate())
                .map(|(i, t)| {
                    TableSpec::new(format!("{}#{i}", configs[t.table].name), t.rows, t.cols)
                })
                .collect();
            let mut cfg = TbeConfig::new(specs, ftm, PoolingMode::Sum, optimizer);
            cfg.feature_names = Some(names);
            cfg.weight_decay = weight_decay;
            cfg.bounds_check = BoundsCheckMode::Error;
            cfg
        };
        // The remote TBE: one table per distinct (table, shard) of this rank's slots.
        let slots = &routing.slots[rank];
        let remote = if slots.is_empty() {
            None
        } else {
            let mut tables: Vec<LocalTable> = Vec::new();
            let mut keys: Vec<(usize, Option<usize>, usize)> = Vec::new();
            let mut ftm = Vec::with_capacity(slots.len());
            let mut names = Vec::with_capacity(slots.len());
            for s in slots {
                let key = (s.table, s.shard, s.col_offset);
                let i = match keys.iter().position(|k| *k == key) {
                    Some(i) => i,
                    None => {
                        keys.push(key);
                        tables.push(LocalTable {
                            table: s.table,
                            row_offset: s.row_offset,
                            rows: s.rows,
                            col_offset: s.col_offset,
                            cols: s.cols,
                        });
                        tables.len() - 1
                    }
                };
                ftm.push(i);
                names.push(output_keys[s.feature].clone());
            }
            let tbe = TableBatchedEmbedding::new(tbe_config(&tables, names, ftm))?;
            Some(LocalTbe { tbe, tables })
        };
        let replicated = if routing.replicated.is_empty() {
            None
        } else {
            let mut tables: Vec<LocalTable> = Vec::new();
            let mut ftm = Vec::new();
            let mut names = Vec::new();
            for &f in &routing.replicated {
                let t = routing.features[f].table;
                let i = match tables.iter().position(|l| l.table == t) {
                    Some(i) => i,
                    None => {
                        tables.push(LocalTable {
                            table: t,
                            row_offset: 0,
                            rows: configs[t].num_embeddings,
                            col_offset: 0,
                            cols: configs[t].embedding_dim,
                        });
                        tables.len() - 1
                    }
                };
                ftm.push(i);
                names.push(output_keys[f].clone());
            }
            let tbe = TableBatchedEmbedding::new(tbe_config(&tables, names, ftm))?;
            Some(LocalTbe { tbe, tables })
        };
        let sharded = ShardedEmbeddingBagCollection {
            inner: Arc::new(Inner {
                comm,
                hosts,
                configs,
                plan: plan.clone(),
                routing,
                remote,
                replicated,
                output_keys,
                output_dims,
                optimizer,
                batches: Default::default(),
            }),
        };
        sharded.init_tables(seed)?;
        Ok(sharded)
    }

    /// Fills every local table from `seed`, row by row ([`init_table`]).
    fn init_tables(&self, seed: u64) -> Result<()> {
        for local in self.local_tbes() {
            for (i, t) in local.tables.iter().enumerate() {
                let c = &self.inner.configs[t.table];
                let mut values = vec![0.0f32; t.rows * t.cols];
                init_rows(
                    c,
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

    fn local_tbes(&self) -> impl Iterator<Item = &LocalTbe> {
        self.inner.remote.iter().chain(self.inner.replicated.iter())
    }

    /// The communicator.
    pub fn comm(&self) -> &Comm {
        &self.inner.comm
    }

    /// The plan.
    pub fn plan(&self) -> &ShardingPlan {
        &self.inner.plan
    }

    /// The table configs (unsharded).
    pub fn configs(&self) -> &[EmbeddingBagConfig] {
        &self.inner.configs
    }

    /// The output keys (features in config order) and the pooled width of each, as the
    /// unsharded collection's.
    pub fn output_keys_and_dims(&self) -> (&[String], &[usize]) {
        (&self.inner.output_keys, &self.inner.output_dims)
    }

    /// This rank's TBEs: the one holding its shards (looked up for the global batch) and the
    /// one holding the data-parallel replicas, when it has them.
    pub fn tbes(&self) -> Vec<&TableBatchedEmbedding> {
        self.local_tbes().map(|l| &l.tbe).collect()
    }

    /// Where the local tables live.
    pub fn device(&self) -> Device {
        self.local_tbes()
            .next()
            .map_or(Device::Cpu, |l| l.tbe.device())
    }

    /// Moves this rank's tables and their optimizer state to `device` (collectives stay
    /// host-staged). On an error the tables stay where they were.
    pub fn to_device(&self, device: Device) -> Result<()> {
        let from = self.device();
        let tbes = self.tbes();
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

    /// The rectangles of table `table` this rank holds (a data-parallel replica is the whole
    /// table).
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

    fn table_index(&self, table: &str) -> Result<usize> {
        (self.inner.configs.iter())
            .position(|c| c.name == table)
            .ok_or_else(|| Error::invalid(OP, format!("no table named `{table}`")))
    }

    /// The whole of table `table` (`[rows, dim]` row-major), gathered from its shards: a
    /// collective, every rank gets it.
    pub fn table_weights(&self, table: &str) -> Result<Vec<f32>> {
        let t = self.table_index(table)?;
        let c = &self.inner.configs[t];
        let dim = c.embedding_dim;
        let replicated = self.inner.plan.table(&c.name).map(|p| p.sharding_type)
            == Some(ShardingType::DataParallel);
        let mut header: Vec<u64> = Vec::new();
        let mut values: Vec<f32> = Vec::new();
        // A replica is the same everywhere: rank 0 sends it.
        if !replicated || self.inner.comm.rank() == 0 {
            for s in self.local_shards(table)? {
                header.extend([s.row_offset, s.col_offset, s.rows, s.cols].map(|x| x as u64));
                values.extend_from_slice(&s.values);
            }
        }
        let comm = &self.inner.comm;
        let headers = comm.all_gather_v("gather_table", &header, None)?;
        let blocks = comm.all_gather_v("gather_table", &values, None)?;
        let mut full = vec![0.0f32; c.num_embeddings * dim];
        for (header, block) in headers.iter().zip(&blocks) {
            let mut at = 0;
            for rect in header.chunks_exact(4) {
                let [r0, c0, rows, cols] = [rect[0], rect[1], rect[2], rect[3]].map(|x| x as usize);
                for r in 0..rows {
                    full[(r0 + r) * dim + c0..(r0 + r) * dim + c0 + cols]
                        .copy_from_slice(&block[at + r * cols..at + (r + 1) * cols]);
                }
                at += rows * cols;
            }
        }
        Ok(full)
    }

    /// Overwrites table `table` from its whole value (`[rows, dim]`, the same on every rank;
    /// each rank keeps its shards). Not a collective.
    pub fn set_table_weights(&self, table: &str, values: &[f32]) -> Result<()> {
        let t = self.table_index(table)?;
        let c = &self.inner.configs[t];
        let dim = c.embedding_dim;
        if values.len() != c.num_embeddings * dim {
            return Err(Error::invalid(
                OP,
                format!(
                    "table `{table}` has {}×{dim} values, got {}",
                    c.num_embeddings,
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
        let inner = &self.inner;
        let mut out = Vec::new();
        for (local, replicated) in [(&inner.remote, false), (&inner.replicated, true)] {
            let Some(local) = local else { continue };
            if replicated && save && inner.comm.rank() != 0 {
                continue;
            }
            for (index, t) in local.tables.iter().enumerate() {
                let c = &inner.configs[t.table];
                out.push(Held {
                    table: &c.name,
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
        out
    }

    /// Writes a sharded checkpoint into directory `dir` (a collective): each rank its
    /// rectangles, then rank 0 the manifest; atomic as a whole (see
    /// [`super::checkpoint`]). Load it with [`load`](Self::load) under any plan
    /// and world size, or into one unsharded collection with
    /// [`load_into_unsharded`](super::checkpoint::load_into_unsharded).
    pub fn save(&self, dir: impl AsRef<std::path::Path>) -> Result<()> {
        let comm = &self.inner.comm;
        let step = self.local_tbes().map(|l| l.tbe.step()).max().unwrap_or(0);
        let steps = comm.all_gather_v("checkpoint.step", &[step], Some(&vec![1; comm.size()]))?;
        let step = steps.iter().map(|s| s[0]).max().unwrap_or(0);
        checkpoint::save(
            comm,
            dir.as_ref(),
            &self.held(true),
            self.inner.optimizer.name(),
            step,
        )
    }

    /// Loads a checkpoint written by [`save`](Self::save) under any plan and world size, or
    /// an unsharded collection's file ([`EmbeddingBagCollection::save`](crate::embedding::EmbeddingBagCollection::save)):
    /// each rank reads the rectangles it holds (the files must be readable from every rank). A
    /// collective: if any rank cannot read its part, no rank changes anything.
    pub fn load(&self, path: impl AsRef<std::path::Path>) -> Result<LoadReport> {
        let held = self.held(false);
        let staged = checkpoint::Saved::open(path.as_ref())
            .and_then(|mut saved| saved.stage(&held, self.inner.optimizer.name()));
        let staged = checkpoint::all_ok(&self.inner.comm, "checkpoint.loaded", staged)?;
        staged.apply()
    }

    /// Pooled embeddings of this rank's batch: keys in the unsharded order, values `[B, Σ
    /// dims]` on the tables' device. A collective: every rank calls it for its own batch (the
    /// sizes may differ). Takes part in autograd: its backward (again on every rank) runs the
    /// sharded backward and the fused optimizer. Per-sample weights are used but get no
    /// gradient.
    ///
    /// A batch that fails its checks here (missing features, ids out of range, …) is an
    /// error on this rank naming the feature, and an error naming this rank on the others:
    /// every rank skips the batch.
    pub fn forward(&self, kjt: &KeyedJaggedTensor) -> Result<KeyedTensor> {
        let inner = &self.inner;
        let routing = &inner.routing;
        let rank = inner.comm.rank();
        let batch_number = (inner.batches).fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let input = self.read_input(kjt);
        let (stride, gathered, rejected_here) = if routing.has_slots() {
            let (send, stride, rejected) = match &input {
                Ok(host) => (self.bags_for_slots(host), host.kjt.stride, None),
                Err(e) => (Vec::new(), 0, Some(Error::invalid(OP, e.to_string()))),
            };
            let slots = routing.slots[rank].len();
            let gathered =
                all_to_all_bags(&inner.comm, send, stride, slots, rejected, batch_number)?;
            (stride, Some(gathered), false)
        } else {
            (
                input.as_ref().map_or(0, |h| h.kjt.stride),
                None,
                input.is_err(),
            )
        };
        if rejected_here {
            return Err(input.err().expect("rejected"));
        }
        let host = input?;
        let strides = match &gathered {
            Some(g) => g.strides.clone(),
            None => vec![stride; inner.comm.size()],
        };
        let mut out = vec![0.0f32; stride * routing.width];
        // Remote lookups and the output distribution.
        let remote_batch = match (&inner.remote, &gathered) {
            (Some(remote), Some(g)) => {
                let offsets = g.offsets();
                let mut input = TbeInput::new(&g.values[..], &offsets[..]);
                if let Some(w) = &g.weights {
                    input = input.with_weights(w);
                }
                let batch = remote.tbe.prepare(input)?;
                let looked = remote.tbe.lookup_batch(&batch)?.to_vec::<f32>()?;
                Some((batch, looked))
            }
            _ => None,
        };
        if gathered.is_some() {
            let looked = remote_batch.as_ref().map_or(&[][..], |(_, l)| &l[..]);
            self.distribute_output(looked, &strides, &mut out)?;
        }
        // Replicated lookups.
        let replicated_batch = match &inner.replicated {
            Some(rep) => {
                let (ids, offsets, weights) = host.replicated_input(routing);
                let mut input = TbeInput::new(&ids[..], &offsets[..]);
                if let Some(w) = &weights {
                    input = input.with_weights(w);
                }
                let batch = rep.tbe.prepare(input)?;
                let looked = rep.tbe.lookup_batch(&batch)?.to_vec::<f32>()?;
                let width = rep.tbe.output_dim();
                let mut col = 0;
                for &f in &routing.replicated {
                    let feature = &routing.features[f];
                    for b in 0..stride {
                        out[b * routing.width + feature.col..][..feature.dim]
                            .copy_from_slice(&looked[b * width + col..][..feature.dim]);
                    }
                    col += feature.dim;
                }
                Some(batch)
            }
            None => None,
        };
        // MEAN: divide each bag by its length on the sample's own rank.
        let scales = host.mean_scales(&inner.configs, routing);
        apply_scales(&mut out, routing.width, &scales);
        let device = self.device();
        let values = Tensor::from_vec(out, &[stride, routing.width])?.to_device(device)?;
        let values = if crate::tensor::is_grad_enabled() {
            record_op_with_state(
                values,
                &[],
                ShardedBackward {
                    sharded: self.clone(),
                    strides,
                    remote: remote_batch.map(|(b, _)| b),
                    replicated: replicated_batch,
                    scales,
                },
            )
        } else {
            values
        };
        KeyedTensor::new(inner.output_keys.clone(), inner.output_dims.clone(), values)
    }

    /// Reads and checks this rank's batch.
    fn read_input(&self, kjt: &KeyedJaggedTensor) -> Result<LocalInput> {
        let inner = &self.inner;
        if kjt.weights().is_some_and(Tensor::requires_grad) {
            return Err(Error::invalid(
                OP,
                "per-sample weights that require grad: sharded tables give them no gradient",
            ));
        }
        let host = HostKjt::new(OP, kjt)?;
        let key_of = (inner.output_keys.iter())
            .map(|f| {
                host.keys.iter().position(|k| k == f).ok_or_else(|| {
                    Error::invalid(
                        OP,
                        format!(
                            "feature `{f}` is missing from the input KJT (its keys are {:?})",
                            host.keys
                        ),
                    )
                })
            })
            .collect::<Result<Vec<_>>>()?;
        for (f, &k) in key_of.iter().enumerate() {
            let c = &inner.configs[inner.routing.features[f].table];
            let (ids, _, _) = host.key(k);
            if let Some(p) = ids
                .iter()
                .position(|&i| i < 0 || i as usize >= c.num_embeddings)
            {
                return Err(Error::invalid(
                    OP,
                    format!(
                        "feature `{}`: id {} at position {p} is outside table `{}` (0..{})",
                        inner.output_keys[f], ids[p], c.name, c.num_embeddings
                    ),
                ));
            }
        }
        Ok(LocalInput { kjt: host, key_of })
    }

    /// This rank's bags for every rank's slots.
    fn bags_for_slots(&self, input: &LocalInput) -> Vec<Bags> {
        let routing = &self.inner.routing;
        let weighted = input.kjt.weights.is_some();
        (routing.slots.iter())
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

    /// The output distribution: this rank's remote lookup `looked` (`[Σ B, slot widths]`) to
    /// the pooled rows of its own samples in `out`.
    fn distribute_output(&self, looked: &[f32], strides: &[usize], out: &mut [f32]) -> Result<()> {
        let inner = &self.inner;
        let (routing, comm) = (&inner.routing, &inner.comm);
        let (rank, w) = (comm.rank(), comm.size());
        let starts = starts(strides);
        let b = strides[rank];
        let local_width = width(&routing.slots[rank]);
        let owned_width = width(routing.owned_slots(rank));
        let rows_of = |r: usize| starts[r]..starts[r] + strides[r];
        // Owned shards: all-to-all of final rows.
        if routing.owned.iter().any(|&n| n > 0) {
            let send = (0..w)
                .map(|d| block(looked, local_width, rows_of(d), 0..owned_width))
                .collect();
            let counts: Vec<usize> = (0..w).map(|s| b * width(routing.owned_slots(s))).collect();
            let got = comm.all_to_all_v("output_dist.owned", send, Some(&counts))?;
            for (s, block) in got.iter().enumerate() {
                place(out, routing.width, block, routing.owned_slots(s));
            }
        }
        // Row-wise: reduce-scatter of partial sums.
        if routing.row_wise > 0 {
            let cols = owned_width..owned_width + width(routing.row_wise_slots(rank));
            let send = (0..w)
                .map(|d| block(looked, local_width, rows_of(d), cols.clone()))
                .collect();
            let sum = comm.reduce_scatter_v("output_dist.row_wise", send)?;
            place(out, routing.width, &sum, routing.row_wise_slots(rank));
        }
        // Table-row-wise: reduce-scatter inside the host, then all-to-all across hosts.
        if let Some(groups) = &inner.hosts {
            let (local, hosts) = (routing.local, routing.hosts());
            let l = rank % local;
            let start = owned_width + width(routing.row_wise_slots(rank));
            let cols = start..start + width(routing.twrw_slots(rank));
            let send = (0..local)
                .map(|to| {
                    (0..hosts)
                        .flat_map(|g| {
                            block(looked, local_width, rows_of(g * local + to), cols.clone())
                        })
                        .collect::<Vec<f32>>()
                })
                .collect();
            let summed = groups
                .intra
                .reduce_scatter_v("output_dist.twrw_intra", send)?;
            let t = cols.len();
            let mut at = 0;
            let send = (0..hosts)
                .map(|g| {
                    let n = strides[g * local + l] * t;
                    at += n;
                    summed[at - n..at].to_vec()
                })
                .collect();
            let counts: Vec<usize> = (0..hosts)
                .map(|g| b * width(routing.host_twrw_slots(g)))
                .collect();
            let got = groups
                .cross
                .all_to_all_v("output_dist.twrw_cross", send, Some(&counts))?;
            for (g, block) in got.iter().enumerate() {
                place(out, routing.width, block, routing.host_twrw_slots(g));
            }
        }
        Ok(())
    }

    /// The backward of the output distribution: `grad` (`[B, width]` of this rank's samples,
    /// MEAN already applied) to the gradient of this rank's remote lookup (`[Σ B, slot
    /// widths]`), divided by the world size.
    fn gather_gradients(&self, grad: &[f32], strides: &[usize]) -> Result<Vec<f32>> {
        let inner = &self.inner;
        let (routing, comm) = (&inner.routing, &inner.comm);
        let (rank, w) = (comm.rank(), comm.size());
        let starts = starts(strides);
        let total: usize = strides.iter().sum();
        let b = strides[rank];
        let local_width = width(&routing.slots[rank]);
        let owned_width = width(routing.owned_slots(rank));
        let mut out = vec![0.0f32; total * local_width];
        if routing.owned.iter().any(|&n| n > 0) {
            let send = (0..w)
                .map(|s| take(grad, routing.width, b, routing.owned_slots(s)))
                .collect();
            let counts: Vec<usize> = strides.iter().map(|&n| n * owned_width).collect();
            let got = comm.all_to_all_v("backward.owned", send, Some(&counts))?;
            for (d, block) in got.iter().enumerate() {
                put(&mut out, local_width, starts[d], 0, block, owned_width);
            }
        }
        if routing.row_wise > 0 {
            let slots = routing.row_wise_slots(rank);
            let rw = width(slots);
            let mine = take(grad, routing.width, b, slots);
            let counts: Vec<usize> = strides.iter().map(|&n| n * rw).collect();
            let got = comm.all_gather_v("backward.row_wise", &mine, Some(&counts))?;
            for (d, block) in got.iter().enumerate() {
                put(&mut out, local_width, starts[d], owned_width, block, rw);
            }
        }
        if let Some(groups) = &inner.hosts {
            let (local, hosts) = (routing.local, routing.hosts());
            let l = rank % local;
            let start = owned_width + width(routing.row_wise_slots(rank));
            let t = width(routing.twrw_slots(rank));
            let send = (0..hosts)
                .map(|g| take(grad, routing.width, b, routing.host_twrw_slots(g)))
                .collect();
            let counts: Vec<usize> = (0..hosts).map(|g| strides[g * local + l] * t).collect();
            let got = groups
                .cross
                .all_to_all_v("backward.twrw_cross", send, Some(&counts))?;
            let mine: Vec<f32> = got.concat();
            let counts: Vec<usize> = (0..local)
                .map(|to| (0..hosts).map(|g| strides[g * local + to] * t).sum())
                .collect();
            let all = groups
                .intra
                .all_gather_v("backward.twrw_intra", &mine, Some(&counts))?;
            for (to, block) in all.iter().enumerate() {
                let mut at = 0;
                for g in 0..hosts {
                    let source = g * local + to;
                    let n = strides[source] * t;
                    put(
                        &mut out,
                        local_width,
                        starts[source],
                        start,
                        &block[at..at + n],
                        t,
                    );
                    at += n;
                }
            }
        }
        // TorchRec's gradient division: each rank's loss is a mean over its own batch.
        let world = w as f32;
        out.iter_mut().for_each(|g| *g /= world);
        Ok(out)
    }

    /// The data-parallel tables' step: row gradients of this rank's batch, summed over the
    /// ranks (rank order), divided by the world size, applied once.
    fn step_replicated(&self, batch: &TbeBatch, grad: &[f32], b: usize) -> Result<()> {
        let inner = &self.inner;
        let (routing, comm) = (&inner.routing, &inner.comm);
        let rep = inner.replicated.as_ref().expect("replicated tables");
        let mut g = Vec::with_capacity(b * rep.tbe.output_dim());
        for s in 0..b {
            for &f in &routing.replicated {
                let feature = &routing.features[f];
                g.extend_from_slice(&grad[s * routing.width + feature.col..][..feature.dim]);
            }
        }
        let g = Tensor::from_vec(g, &[b, rep.tbe.output_dim()])?;
        let grads = rep.tbe.row_gradients_batch(batch, &g)?;
        let w = comm.size();
        if w == 1 {
            return rep.tbe.apply_row_gradients(&grads);
        }
        let mut rows: Vec<i64> = Vec::new();
        let mut values: Vec<f32> = Vec::new();
        for gt in &grads {
            rows.push(gt.rows.len() as i64);
            rows.extend_from_slice(&gt.rows);
            values.extend(gt.values.to_device(Device::Cpu)?.to_vec::<f32>()?);
        }
        let all_rows = comm.all_gather_v("backward.replicated_rows", &rows, None)?;
        let value_counts: Vec<usize> = (all_rows.iter())
            .map(|r| count_values(r, &rep.tables))
            .collect::<Result<_>>()?;
        let all_values =
            comm.all_gather_v("backward.replicated_values", &values, Some(&value_counts))?;
        let mut summed: Vec<std::collections::BTreeMap<i64, Vec<f32>>> =
            vec![Default::default(); rep.tables.len()];
        for (r, v) in all_rows.iter().zip(&all_values) {
            let (mut at, mut vat) = (0, 0);
            for (t, table) in rep.tables.iter().enumerate() {
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
        let grads = (summed.into_iter().zip(&rep.tables))
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
            .collect::<Result<Vec<_>>>()?;
        rep.tbe.apply_row_gradients(&grads)
    }
}

/// Values in a gathered replicated-gradient block whose row lists are `rows`.
fn count_values(rows: &[i64], tables: &[LocalTable]) -> Result<usize> {
    let (mut at, mut n) = (0usize, 0usize);
    for t in tables {
        let k = rows.get(at).copied().filter(|&k| k >= 0).ok_or_else(|| {
            Error::Distributed("a data-parallel gradient block is cut short".into())
        })? as usize;
        n += k * t.cols;
        at += 1 + k;
    }
    Ok(n)
}

/// Prefix sums of the batch sizes: where each rank's samples start in the global batch.
fn starts(strides: &[usize]) -> Vec<usize> {
    let mut at = 0;
    strides
        .iter()
        .map(|&b| {
            at += b;
            at - b
        })
        .collect()
}

/// Rows `rows`, columns `cols` of a row-major matrix of `stride` columns.
fn block(
    m: &[f32],
    stride: usize,
    rows: std::ops::Range<usize>,
    cols: std::ops::Range<usize>,
) -> Vec<f32> {
    let mut out = Vec::with_capacity(rows.len() * cols.len());
    for r in rows {
        out.extend_from_slice(&m[r * stride + cols.start..r * stride + cols.end]);
    }
    out
}

/// Writes `block` (rows of `cols` columns) into `m` (`stride` columns) from row `row`,
/// column `col`.
fn put(m: &mut [f32], stride: usize, row: usize, col: usize, block: &[f32], cols: usize) {
    if cols == 0 {
        return;
    }
    for (i, r) in block.chunks_exact(cols).enumerate() {
        m[(row + i) * stride + col..][..cols].copy_from_slice(r);
    }
}

/// Scatters `block` (`[B, width(slots)]`, slots side by side) into the output columns of
/// `slots`.
fn place(out: &mut [f32], out_width: usize, block: &[f32], slots: &[Slot]) {
    let w = width(slots);
    if w == 0 {
        return;
    }
    for (b, row) in block.chunks_exact(w).enumerate() {
        let mut col = 0;
        for s in slots {
            out[b * out_width + s.out_col..][..s.cols].copy_from_slice(&row[col..col + s.cols]);
            col += s.cols;
        }
    }
}

/// The output columns of `slots` for the first `b` rows of `m`, side by side (the reverse of
/// [`place`]).
fn take(m: &[f32], m_width: usize, b: usize, slots: &[Slot]) -> Vec<f32> {
    let mut out = Vec::with_capacity(b * width(slots));
    for r in 0..b {
        for s in slots {
            out.extend_from_slice(&m[r * m_width + s.out_col..][..s.cols]);
        }
    }
    out
}

/// Per MEAN feature: its output columns and `1/len` per sample (0 for an empty bag).
type Scales = Vec<(usize, usize, Vec<f32>)>;

fn apply_scales(m: &mut [f32], m_width: usize, scales: &Scales) {
    for (col, dim, per_sample) in scales {
        for (b, &s) in per_sample.iter().enumerate() {
            m[b * m_width + col..][..*dim]
                .iter_mut()
                .for_each(|x| *x *= s);
        }
    }
}

/// This rank's batch on the host, with the KJT key of each output feature.
struct LocalInput {
    kjt: HostKjt,
    key_of: Vec<usize>,
}

impl LocalInput {
    /// Appends this rank's bags for `slot` (its row block re-based to the shard for row
    /// blocks).
    fn push_slot(&self, slot: &Slot, bags: &mut Bags) {
        let (ids, weights, lengths) = self.kjt.key(self.key_of[slot.feature]);
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

    /// The replicated TBE's input: the data-parallel features' bags.
    fn replicated_input(&self, routing: &Routing) -> (Vec<i64>, Vec<i64>, Option<Vec<f32>>) {
        let mut ids = Vec::new();
        let mut offsets = vec![0i64];
        let mut weights = self.kjt.weights.as_ref().map(|_| Vec::new());
        for &f in &routing.replicated {
            let (v, w, lengths) = self.kjt.key(self.key_of[f]);
            ids.extend_from_slice(v);
            if let (Some(o), Some(w)) = (&mut weights, w) {
                o.extend_from_slice(w);
            }
            for &l in lengths {
                let last = *offsets.last().expect("offsets start at 0");
                offsets.push(last + l);
            }
        }
        (ids, offsets, weights)
    }

    /// `1/len` per sample of every MEAN feature.
    fn mean_scales(&self, configs: &[EmbeddingBagConfig], routing: &Routing) -> Scales {
        (routing.features.iter().enumerate())
            .filter(|(_, f)| configs[f.table].pooling == PoolingMode::Mean)
            .map(|(i, f)| {
                let (_, _, lengths) = self.kjt.key(self.key_of[i]);
                let scales = (lengths.iter())
                    .map(|&l| if l > 0 { 1.0 / l as f32 } else { 0.0 })
                    .collect();
                (f.col, f.dim, scales)
            })
            .collect()
    }
}

/// Autograd node of [`ShardedEmbeddingBagCollection::forward`]: the sharded backward and the
/// fused updates.
struct ShardedBackward {
    sharded: ShardedEmbeddingBagCollection,
    strides: Vec<usize>,
    remote: Option<TbeBatch>,
    replicated: Option<TbeBatch>,
    scales: Scales,
}

impl BackwardOp for ShardedBackward {
    fn name(&self) -> &'static str {
        "sharded_embedding_bag_collection"
    }

    fn backward(&self, grad_output: &Tensor) -> Result<Vec<Option<Gradient>>> {
        let sharded = &self.sharded;
        let inner = &sharded.inner;
        let rank = inner.comm.rank();
        let b = self.strides[rank];
        let mut grad = grad_output
            .to_device(Device::Cpu)?
            .contiguous()?
            .to_vec::<f32>()?;
        if grad.len() != b * inner.routing.width {
            return Err(Error::Backward(format!(
                "{OP}: the gradient has {} values, expected {b}×{}",
                grad.len(),
                inner.routing.width
            )));
        }
        apply_scales(&mut grad, inner.routing.width, &self.scales);
        if inner.routing.has_slots() {
            let g = sharded.gather_gradients(&grad, &self.strides)?;
            if let (Some(remote), Some(batch)) = (&inner.remote, &self.remote) {
                let total: usize = self.strides.iter().sum();
                let g = Tensor::from_vec(g, &[total, remote.tbe.output_dim()])?;
                remote.tbe.backward_batch(batch, &g)?;
            }
        }
        if let Some(batch) = &self.replicated {
            sharded.step_replicated(batch, &grad, b)?;
        }
        Ok(Vec::new())
    }
}

/// Rows `[row_offset, row_offset + rows)`, columns `[col_offset, col_offset + cols)` of table
/// `config` as initialised from `seed`: each row from its own ChaCha8 stream (seeded by `seed`
/// and the table name, stream = row), so the values do not depend on how the table is
/// sharded.
fn init_rows(
    config: &EmbeddingBagConfig,
    seed: u64,
    row_offset: usize,
    rows: usize,
    col_offset: usize,
    cols: usize,
    out: &mut [f32],
) -> Result<()> {
    let table_seed = seed ^ fnv1a(config.name.as_bytes());
    let dim = config.embedding_dim;
    let mut row = vec![0.0f32; dim];
    for r in 0..rows {
        let mut rng = Rng::seed_from_u64(table_seed);
        rng.set_stream((row_offset + r) as u64);
        fill_init(&mut row, config.num_embeddings, config.init, &mut rng)?;
        out[r * cols..(r + 1) * cols].copy_from_slice(&row[col_offset..col_offset + cols]);
    }
    Ok(())
}

/// Table `config` as [`ShardedEmbeddingBagCollection::new`] initialises it from `seed`
/// (`[rows, dim]`): load it into an unsharded collection to compare the two.
pub fn init_table(config: &EmbeddingBagConfig, seed: u64) -> Result<Vec<f32>> {
    let mut out = vec![0.0f32; config.num_embeddings * config.embedding_dim];
    init_rows(
        config,
        seed,
        0,
        config.num_embeddings,
        0,
        config.embedding_dim,
        &mut out,
    )?;
    Ok(out)
}
