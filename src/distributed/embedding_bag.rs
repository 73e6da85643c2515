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

use super::checkpoint::LoadReport;
use super::codec::{Codec, QCommsConfig};
use super::comm::Comm;
use super::input_dist::Gathered;
use super::plan::{ShardCaches, ShardingPlan};
use super::routing::{width, Slot};
use super::shards::{sharded_access, Build, LocalInput, ShardValues, Shards, TableInfo};
use crate::embedding::{
    check_bag_configs, CacheStats, EmbeddingBagConfig, FusedOptimizer, PoolingMode,
    TableBatchedEmbedding, TbeBatch, TbeInput, WeightDecay,
};
use crate::error::{Error, Result};
use crate::sparse::{KeyedJaggedTensor, KeyedTensor};
use crate::tensor::{record_op_with_state, BackwardOp, Gradient};
use crate::{Device, Tensor};

const OP: &str = "ShardedEmbeddingBagCollection";

struct Inner {
    shards: Shards,
    configs: Vec<EmbeddingBagConfig>,
    output_dims: Vec<usize>,
    qcomms: parking_lot::Mutex<QCommsConfig>,
}

/// A batch after its input distribution: this rank's batch, checked, and the bags of this
/// rank's shards from every rank ([`ShardedEmbeddingBagCollection::distribute_input`]).
pub struct DistributedInput {
    host: LocalInput,
    gathered: Option<Gathered>,
    /// The gathered batch's bags grouped per remote TBE, once a prefetch or the lookups
    /// needed them (with several remote TBEs).
    bags: std::sync::OnceLock<Vec<GroupBags>>,
}

/// One remote TBE's bags of a gathered batch: ids, offsets and per-sample weights.
type GroupBags = (Vec<i64>, Vec<i64>, Option<Vec<f32>>);

impl std::fmt::Debug for DistributedInput {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DistributedInput")
            .field("batch_size", &self.host.kjt.stride)
            .field(
                "global_batch_size",
                &self.gathered.as_ref().map(|g| g.batch()),
            )
            .finish()
    }
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
            .field("rank", &self.inner.shards.comm.rank())
            .field("world", &self.inner.shards.comm.size())
            .field("tables", &self.inner.configs.len())
            .finish()
    }
}

impl ShardedEmbeddingBagCollection {
    /// Builds this rank's shards of `configs` under `plan` (a collective: every rank of `comm`
    /// calls it with the same arguments). Tables are initialised from `seed` row by row, so
    /// every plan (and an unsharded run using [`init_table`](super::init_table)) gives the
    /// same tables.
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

    /// The cache counters of this rank's shards that the plan's cached kernels put behind a
    /// cache (one entry per local table, named `<table>#<i>`; empty without cached kernels).
    pub fn cache_stats(&self) -> Vec<CacheStats> {
        self.inner.shards.cache_stats()
    }

    /// How many of this rank's TBEs keep their tables in managed memory on a GPU (the plan's
    /// `fused_uvm` shards with [`ShardCaches::device`](crate::distributed::ShardCaches) a GPU).
    pub fn managed_tbes(&self) -> usize {
        self.inner.shards.managed_tbes()
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
        let caches = ShardCaches::default();
        Self::with_caches(configs, plan, optimizer, weight_decay, &caches, comm, seed)
    }

    /// [`with_options`](Self::with_options) with the rows of tables the plan gives a cached
    /// kernel (`fused_uvm`, `fused_uvm_caching`) kept where `caches` says (by default in host
    /// memory): each rank's shards of those tables train through a DRAM cache of the plan's
    /// size, bit for bit as in memory.
    pub fn with_caches(
        configs: Vec<EmbeddingBagConfig>,
        plan: &ShardingPlan,
        optimizer: FusedOptimizer,
        weight_decay: WeightDecay,
        caches: &ShardCaches,
        comm: Comm,
        seed: u64,
    ) -> Result<Self> {
        let checked = check_bag_configs(OP, &configs);
        let output_dims = checked.as_ref().map(|(_, d)| d.clone()).unwrap_or_default();
        let shards = Shards::build(Build {
            op: OP,
            tables: configs.iter().map(TableInfo::of).collect(),
            features: configs.iter().map(|c| c.feature_names.clone()).collect(),
            checked: checked.map(|_| ()),
            describe: (configs.iter())
                .map(|c| {
                    format!(
                        "{} {}x{} {:?} {:?} {:?}",
                        c.name,
                        c.num_embeddings,
                        c.embedding_dim,
                        c.feature_names,
                        c.pooling,
                        c.init
                    )
                })
                .collect(),
            pooling: PoolingMode::Sum,
            by_width: false,
            host_groups: true,
            optimizer,
            weight_decay,
            plan,
            caches,
            comm,
            seed,
        })?;
        Ok(ShardedEmbeddingBagCollection {
            inner: Arc::new(Inner {
                shards,
                configs,
                output_dims,
                qcomms: parking_lot::Mutex::new(QCommsConfig::default()),
            }),
        })
    }

    sharded_access!();

    /// The codecs of the output distribution and of its backward (FP32 both ways unless
    /// [`set_qcomms`](Self::set_qcomms) chose others).
    pub fn qcomms(&self) -> QCommsConfig {
        *self.inner.qcomms.lock()
    }

    /// Chooses the codecs of the output distribution (`q.forward`: the pooled rows'
    /// all-to-all and reduce-scatters) and of its backward (`q.backward`: their gradients'
    /// all-to-all and all-gathers) for the batches that follow. A collective: ranks compare
    /// their configs, and a difference is an error on every rank (naming the ranks) that
    /// changes nothing.
    pub fn set_qcomms(&self, q: QCommsConfig) -> Result<()> {
        self.comm()
            .check_same("the quantized-comms config", q.digest())?;
        *self.inner.qcomms.lock() = q;
        Ok(())
    }

    /// The table configs (unsharded).
    pub fn configs(&self) -> &[EmbeddingBagConfig] {
        &self.inner.configs
    }

    /// The output keys (features in config order) and the pooled width of each, as the
    /// unsharded collection's.
    pub fn output_keys_and_dims(&self) -> (&[String], &[usize]) {
        (&self.inner.shards.keys, &self.inner.output_dims)
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
        let input = self.distribute_input(kjt, self.comm())?;
        self.forward_distributed(input)
    }

    /// The first half of [`forward`](Self::forward): the input distribution of this rank's
    /// batch over `comm` — this collection's communicator or a duplicate of it
    /// ([`Comm::split`]), so that a pipeline can run it on its own thread while the previous
    /// batch trains. A collective on `comm`; it reads no table, so it may run before earlier
    /// batches' backward. Errors as [`forward`](Self::forward)'s.
    pub fn distribute_input(
        &self,
        kjt: &KeyedJaggedTensor,
        comm: &Comm,
    ) -> Result<DistributedInput> {
        let (host, gathered) = self.inner.shards.distribute_input(kjt, true, comm)?;
        Ok(DistributedInput {
            host,
            gathered,
            bags: std::sync::OnceLock::new(),
        })
    }

    /// The second half of [`forward`](Self::forward): the lookups and the output
    /// distribution of a batch from [`distribute_input`](Self::distribute_input), in the
    /// order the batches were distributed.
    pub fn forward_distributed(&self, input: DistributedInput) -> Result<KeyedTensor> {
        let inner = &*self.inner;
        let shards = &inner.shards;
        let routing = &shards.routing;
        let DistributedInput {
            host,
            gathered,
            bags,
        } = input;
        let stride = host.kjt.stride;
        let qcomms = self.qcomms();
        let strides = match &gathered {
            Some(g) => g.strides.clone(),
            None => vec![stride; shards.comm.size()],
        };
        let mut out = vec![0.0f32; stride * routing.width];
        // Remote lookups and the output distribution.
        let remote_batch = match &gathered {
            Some(g) if !shards.remote.is_empty() => Some(self.remote_lookups(g, &bags)),
            _ => None,
        }
        .transpose();
        let remote_batch = if gathered.is_some() {
            shards.agree_on_lookups(remote_batch)?
        } else {
            remote_batch?
        };
        if gathered.is_some() {
            let looked = remote_batch.as_ref().map_or(&[][..], |(_, l)| &l[..]);
            self.distribute_output(&qcomms.forward, looked, &strides, &mut out)?;
        }
        // Replicated lookups.
        let replicated_batch = match shards.replicated.first() {
            Some(rep) => {
                let (ids, offsets, weights) = host.bags_of(&rep.members, true);
                let mut input = TbeInput::new(&ids[..], &offsets[..]);
                if let Some(w) = &weights {
                    input = input.with_weights(w);
                }
                let batch = rep.tbe.prepare(input)?;
                let looked = rep.tbe.lookup_batch(&batch)?.to_vec::<f32>()?;
                let width = rep.tbe.output_dim();
                let mut col = 0;
                for &f in &rep.members {
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
        let scales = mean_scales(&host, &inner.configs, routing);
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
                    remote: remote_batch.map_or_else(Vec::new, |(b, _)| b),
                    replicated: replicated_batch,
                    scales,
                    codec: qcomms.backward,
                },
            )
        } else {
            values
        };
        KeyedTensor::new(shards.keys.clone(), inner.output_dims.clone(), values)
    }

    /// This rank's remote lookups of the gathered global batch: one prepared batch per remote
    /// TBE (the plan's kernels may put its shards in several: in memory, behind caches) and
    /// the pooled rows of every slot, `[Σ B, slot widths]` in slot order.
    fn remote_lookups(
        &self,
        g: &Gathered,
        bags: &std::sync::OnceLock<Vec<GroupBags>>,
    ) -> Result<(Vec<TbeBatch>, Vec<f32>)> {
        let shards = &self.inner.shards;
        let slots = &shards.routing.slots[shards.comm.rank()];
        let total = g.batch();
        fn lookup(
            tbe: &TableBatchedEmbedding,
            input: TbeInput<'_>,
        ) -> Result<(TbeBatch, Vec<f32>)> {
            let batch = tbe.prepare(input)?;
            let looked = tbe.lookup_batch(&batch)?.to_vec::<f32>()?;
            Ok((batch, looked))
        }
        if let [remote] = &shards.remote[..] {
            // One TBE holds every slot, in slot order: the gathered batch as it is.
            let offsets = g.offsets();
            let (batch, looked) = lookup(&remote.tbe, group_input(g, &offsets))?;
            return Ok((vec![batch], looked));
        }
        let all = width(slots);
        let columns = slot_columns(slots);
        let mut looked = vec![0.0f32; total * all];
        let mut batches = Vec::with_capacity(shards.remote.len());
        let grouped = bags.get_or_init(|| self.group_bags(g));
        for (remote, (ids, offsets, weights)) in shards.remote.iter().zip(grouped) {
            let input = tbe_input(ids, offsets, weights.as_deref());
            let (batch, out) = lookup(&remote.tbe, input)?;
            let group_width = remote.tbe.output_dim();
            let mut col = 0;
            for &i in &remote.members {
                let cols = slots[i].cols;
                for b in 0..total {
                    looked[b * all + columns[i]..][..cols]
                        .copy_from_slice(&out[b * group_width + col..][..cols]);
                }
                col += cols;
            }
            batches.push(batch);
        }
        Ok((batches, looked))
    }

    /// Per remote TBE (several of them), its slots' bags of the gathered batch `g`: ids,
    /// offsets and weights (each slot's bags are consecutive).
    fn group_bags(&self, g: &Gathered) -> Vec<GroupBags> {
        let offsets = g.offsets();
        let total = g.batch();
        (self.inner.shards.remote.iter())
            .map(|remote| {
                let mut ids = Vec::new();
                let mut group_offsets = vec![0i64];
                let mut weights = g.weights.as_ref().map(|_| Vec::new());
                for &i in &remote.members {
                    let (s, e) = (
                        offsets[i * total] as usize,
                        offsets[(i + 1) * total] as usize,
                    );
                    ids.extend_from_slice(&g.values[s..e]);
                    if let (Some(w), Some(all_w)) = (&mut weights, &g.weights) {
                        w.extend_from_slice(&all_w[s..e]);
                    }
                    let base = *group_offsets.last().expect("starts at 0") - s as i64;
                    let bags = &offsets[i * total + 1..=(i + 1) * total];
                    group_offsets.extend(bags.iter().map(|&o| o + base));
                }
                (ids, group_offsets, weights)
            })
            .collect()
    }

    /// Brings the rows a distributed batch will look up on this rank into the caches of the
    /// shards behind caches (the plan's cached kernels) and locks them there, as
    /// [`TableBatchedEmbedding::prefetch`] does: the batch's own lookups then take those
    /// admissions. Called on the batch after [`distribute_input`](Self::distribute_input) and
    /// before [`forward_distributed`](Self::forward_distributed), e.g. while the previous batch
    /// trains ([`TrainPipeline::with_cache_prefetch`](super::TrainPipeline::with_cache_prefetch)).
    /// Nothing to do without cached shards. Not a collective.
    pub fn prefetch_distributed(&self, input: &DistributedInput) -> Result<()> {
        let shards = &self.inner.shards;
        let Some(g) = &input.gathered else {
            return Ok(());
        };
        if !shards.remote.iter().any(|r| r.tbe.is_cached()) {
            return Ok(());
        }
        if let [remote] = &shards.remote[..] {
            let offsets = g.offsets();
            return remote.tbe.prefetch(group_input(g, &offsets));
        }
        // Grouped once: the batch's lookups take the same groups.
        let grouped = input.bags.get_or_init(|| self.group_bags(g));
        for (remote, (ids, offsets, weights)) in shards.remote.iter().zip(grouped) {
            if remote.tbe.is_cached() {
                remote
                    .tbe
                    .prefetch(tbe_input(ids, offsets, weights.as_deref()))?;
            }
        }
        Ok(())
    }

    /// The output distribution: this rank's remote lookup `looked` (`[Σ B, slot widths]`) to
    /// the pooled rows of its own samples in `out`.
    fn distribute_output(
        &self,
        codec: &Codec,
        looked: &[f32],
        strides: &[usize],
        out: &mut [f32],
    ) -> Result<()> {
        let inner = &*self.inner;
        let (routing, comm) = (&inner.shards.routing, &inner.shards.comm);
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
            let recv: Vec<(usize, usize)> = (0..w)
                .map(|s| {
                    let t = width(routing.owned_slots(s));
                    (b * t, t)
                })
                .collect();
            let dims = vec![owned_width; w];
            let got = codec.all_to_all(comm, "output_dist.owned", send, &dims, &recv)?;
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
            let sum = codec.reduce_scatter(comm, "output_dist.row_wise", send, cols.len())?;
            place(out, routing.width, &sum, routing.row_wise_slots(rank));
        }
        // Table-row-wise: reduce-scatter inside the host, then all-to-all across hosts.
        if let Some(groups) = &inner.shards.hosts {
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
            let t = cols.len();
            let summed = codec.reduce_scatter(&groups.intra, "output_dist.twrw_intra", send, t)?;
            let mut at = 0;
            let send = (0..hosts)
                .map(|g| {
                    let n = strides[g * local + l] * t;
                    at += n;
                    summed[at - n..at].to_vec()
                })
                .collect();
            let recv: Vec<(usize, usize)> = (0..hosts)
                .map(|g| {
                    let tg = width(routing.host_twrw_slots(g));
                    (b * tg, tg)
                })
                .collect();
            let dims = vec![t; hosts];
            let got =
                codec.all_to_all(&groups.cross, "output_dist.twrw_cross", send, &dims, &recv)?;
            for (g, block) in got.iter().enumerate() {
                place(out, routing.width, block, routing.host_twrw_slots(g));
            }
        }
        Ok(())
    }

    /// The backward of the output distribution: `grad` (`[B, width]` of this rank's samples,
    /// MEAN already applied) to the gradient of this rank's remote lookup (`[Σ B, slot
    /// widths]`), divided by the world size.
    fn gather_gradients(&self, codec: &Codec, grad: &[f32], strides: &[usize]) -> Result<Vec<f32>> {
        let inner = &*self.inner;
        let (routing, comm) = (&inner.shards.routing, &inner.shards.comm);
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
            let dims: Vec<usize> = (0..w).map(|s| width(routing.owned_slots(s))).collect();
            let recv: Vec<(usize, usize)> = strides
                .iter()
                .map(|&n| (n * owned_width, owned_width))
                .collect();
            let got = codec.all_to_all(comm, "backward.owned", send, &dims, &recv)?;
            for (d, block) in got.iter().enumerate() {
                put(&mut out, local_width, starts[d], 0, block, owned_width);
            }
        }
        if routing.row_wise > 0 {
            let slots = routing.row_wise_slots(rank);
            let rw = width(slots);
            let mine = take(grad, routing.width, b, slots);
            let counts: Vec<usize> = strides.iter().map(|&n| n * rw).collect();
            let got = codec.all_gather(comm, "backward.row_wise", &mine, rw, &counts)?;
            for (d, block) in got.iter().enumerate() {
                put(&mut out, local_width, starts[d], owned_width, block, rw);
            }
        }
        if let Some(groups) = &inner.shards.hosts {
            let (local, hosts) = (routing.local, routing.hosts());
            let l = rank % local;
            let start = owned_width + width(routing.row_wise_slots(rank));
            let t = width(routing.twrw_slots(rank));
            let send = (0..hosts)
                .map(|g| take(grad, routing.width, b, routing.host_twrw_slots(g)))
                .collect();
            let dims: Vec<usize> = (0..hosts)
                .map(|g| width(routing.host_twrw_slots(g)))
                .collect();
            let recv: Vec<(usize, usize)> = (0..hosts)
                .map(|g| (strides[g * local + l] * t, t))
                .collect();
            let got = codec.all_to_all(&groups.cross, "backward.twrw_cross", send, &dims, &recv)?;
            let mine: Vec<f32> = got.concat();
            let counts: Vec<usize> = (0..local)
                .map(|to| (0..hosts).map(|g| strides[g * local + to] * t).sum())
                .collect();
            let all = codec.all_gather(&groups.intra, "backward.twrw_intra", &mine, t, &counts)?;
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
}

/// Prefix sums of the batch sizes: where each rank's samples start in the global batch.
pub(super) fn starts(strides: &[usize]) -> Vec<usize> {
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

/// `1/len` per sample of every MEAN feature of this rank's batch.
fn mean_scales(
    input: &super::shards::LocalInput,
    configs: &[EmbeddingBagConfig],
    routing: &super::routing::Routing,
) -> Scales {
    (routing.features.iter().enumerate())
        .filter(|(_, f)| configs[f.table].pooling == PoolingMode::Mean)
        .map(|(i, f)| {
            let (_, _, lengths) = input.feature(i);
            let scales = (lengths.iter())
                .map(|&l| if l > 0 { 1.0 / l as f32 } else { 0.0 })
                .collect();
            (f.col, f.dim, scales)
        })
        .collect()
}

/// Autograd node of [`ShardedEmbeddingBagCollection::forward`]: the sharded backward and the
/// fused updates.
struct ShardedBackward {
    sharded: ShardedEmbeddingBagCollection,
    strides: Vec<usize>,
    /// One batch per remote TBE (none when this rank looked nothing up).
    remote: Vec<TbeBatch>,
    replicated: Option<TbeBatch>,
    scales: Scales,
    codec: Codec,
}

impl BackwardOp for ShardedBackward {
    fn name(&self) -> &'static str {
        "sharded_embedding_bag_collection"
    }

    fn backward(&self, grad_output: &Tensor) -> Result<Vec<Option<Gradient>>> {
        let sharded = &self.sharded;
        let shards = &sharded.inner.shards;
        let rank = shards.comm.rank();
        let b = self.strides[rank];
        let mut grad = grad_output
            .to_device(Device::Cpu)?
            .contiguous()?
            .to_vec::<f32>()?;
        if grad.len() != b * shards.routing.width {
            return Err(Error::Backward(format!(
                "{OP}: the gradient has {} values, expected {b}×{}",
                grad.len(),
                shards.routing.width
            )));
        }
        apply_scales(&mut grad, shards.routing.width, &self.scales);
        if shards.routing.has_slots() {
            let g = sharded.gather_gradients(&self.codec, &grad, &self.strides)?;
            let total: usize = self.strides.iter().sum();
            let updated = (|| {
                if let ([remote], [batch]) = (&shards.remote[..], &self.remote[..]) {
                    // One TBE holds every slot, in slot order: the gradient as it is.
                    let g = Tensor::from_vec(g, &[total, remote.tbe.output_dim()])?;
                    remote.tbe.backward_batch(batch, &g)?;
                } else {
                    let slots = &shards.routing.slots[rank];
                    for (remote, batch) in shards.remote.iter().zip(&self.remote) {
                        let g = group_columns(&g, slots, total, &remote.members);
                        let g = Tensor::from_vec(g, &[total, remote.tbe.output_dim()])?;
                        remote.tbe.backward_batch(batch, &g)?;
                    }
                }
                Ok(())
            })();
            shards.agree_on_update(updated)?;
        }
        if let (Some(rep), Some(batch)) = (shards.replicated.first(), &self.replicated) {
            let routing = &shards.routing;
            let mut g = Vec::with_capacity(b * rep.tbe.output_dim());
            for s in 0..b {
                for &f in &routing.replicated {
                    let feature = &routing.features[f];
                    g.extend_from_slice(&grad[s * routing.width + feature.col..][..feature.dim]);
                }
            }
            let g = Tensor::from_vec(g, &[b, rep.tbe.output_dim()])?;
            let grads = rep.tbe.row_gradients_batch(batch, &g)?;
            shards.step_replicated(vec![grads])?;
        }
        Ok(Vec::new())
    }
}

/// The first column of each slot in a rank's remote lookup (`[Σ B, slot widths]`).
fn slot_columns(slots: &[Slot]) -> Vec<usize> {
    starts(&slots.iter().map(|s| s.cols).collect::<Vec<_>>())
}

/// The columns of slots `members` (in that order) of `g` (`[total, slot widths]`): the
/// gradient of one of several remote TBEs' lookups.
fn group_columns(g: &[f32], slots: &[Slot], total: usize, members: &[usize]) -> Vec<f32> {
    let all = width(slots);
    let columns = slot_columns(slots);
    let mut out = Vec::with_capacity(total * members.iter().map(|&i| slots[i].cols).sum::<usize>());
    for b in 0..total {
        for &i in members {
            out.extend_from_slice(&g[b * all + columns[i]..][..slots[i].cols]);
        }
    }
    out
}

/// The gathered batch `g` as one TBE's input (`offsets`: its offsets).
fn group_input<'a>(g: &'a Gathered, offsets: &'a [i64]) -> TbeInput<'a> {
    tbe_input(&g.values, offsets, g.weights.as_deref())
}

/// Bags (`ids`, `offsets`, optional per-sample `weights`) as a TBE's input.
fn tbe_input<'a>(ids: &'a [i64], offsets: &'a [i64], weights: Option<&'a [f32]>) -> TbeInput<'a> {
    let input = TbeInput::new(ids, offsets);
    match weights {
        Some(w) => input.with_weights(w),
        None => input,
    }
}
