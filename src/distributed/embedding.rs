//! [`ShardedEmbeddingCollection`]: an [`EmbeddingCollection`](crate::embedding::EmbeddingCollection)
//! (unpooled lookups: one row per id) whose tables are spread over the ranks of a [`Comm`] by
//! a [`ShardingPlan`] — TorchRec's `ShardedEmbeddingCollection` (its "sequence" shardings).
//!
//! The input distribution and the tables a rank holds are those of the pooled collection
//! (the `shards` module): a rank's *slots* are the (feature, shard) pairs it looks up for every
//! rank's batch; a table-wise or column-wise shard receives every id of its features, a row
//! block (row-wise, table-row-wise) only the ids inside it, re-based. The lookup is unpooled
//! (one TBE per slot width), so nothing is summed across ranks:
//!
//! * forward: one all-to-all (`output_dist.sequence`) sends each rank the rows of the ids it
//!   sent, slot by slot; the rank puts each row back at its id's position in its batch (a row
//!   block's ids at the positions they came from) and in its columns (column blocks side by
//!   side), then multiplies by the per-sample weight when the KJT has weights (the weights
//!   never travel);
//! * backward: the reverse all-to-all (`backward.sequence`) sends each holder the gradient of
//!   the rows it looked up, divided by the world size (TorchRec's gradient division), and the
//!   holder's fused optimizer takes one step with every rank's rows;
//! * data-parallel tables are looked up locally; their row gradients are summed over the ranks
//!   as the pooled collection's are.
//!
//! TorchRec shards an `EmbeddingCollection` data-parallel, table-wise, column-wise and
//! row-wise; the table-column-wise and table-row-wise plans also run here (a column block or
//! a row block placed inside one host, the same exchanges).

use std::sync::Arc;

use super::checkpoint::LoadReport;
use super::comm::Comm;
use super::embedding_bag::starts;
use super::input_dist::Gathered;
use super::plan::{ShardCaches, ShardingPlan};
use super::routing::{Route, Slot};
use super::shards::{sharded_access, Build, LocalInput, ShardValues, Shards, TableInfo};
use crate::embedding::{
    check_configs, CacheStats, EmbeddingConfig, FusedOptimizer, PoolingMode, TableBatchedEmbedding,
    TbeBatch, TbeInput, WeightDecay,
};
use crate::error::{Error, Result};
use crate::sparse::{JaggedTensor, KeyedJaggedTensor};
use crate::tensor::{record_op_with_state, BackwardOp, Gradient};
use crate::{Device, Tensor};

const OP: &str = "ShardedEmbeddingCollection";

struct Inner {
    shards: Shards,
    configs: Vec<EmbeddingConfig>,
}

/// An embedding collection (unpooled lookups) sharded over the ranks of a communicator (see
/// the module docs). Every rank builds it with the same configs and plan, and every rank calls
/// [`forward`](Self::forward) (and backward) for each batch; batch sizes may differ between
/// ranks.
#[derive(Clone)]
pub struct ShardedEmbeddingCollection {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for ShardedEmbeddingCollection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShardedEmbeddingCollection")
            .field("rank", &self.inner.shards.comm.rank())
            .field("world", &self.inner.shards.comm.size())
            .field("tables", &self.inner.configs.len())
            .finish()
    }
}

/// Where this rank's remote lookups put each slot's rows: per slot, its TBE and the first row
/// of its ids in that TBE's output; and per slot and source rank, where the source's ids start
/// inside the slot and how many there are.
struct SlotRows {
    tbe: Vec<usize>,
    first: Vec<usize>,
    /// `[slot][source]`: (start inside the slot, count).
    from: Vec<Vec<(usize, usize)>>,
}

impl SlotRows {
    fn new(shards: &Shards, g: &Gathered) -> SlotRows {
        let rank = shards.comm.rank();
        let slots = shards.routing.slots[rank].len();
        let batch = g.batch();
        let starts = starts(&g.strides);
        let mut from = Vec::with_capacity(slots);
        for slot in 0..slots {
            let lengths = &g.lengths[slot * batch..(slot + 1) * batch];
            let mut at = 0;
            let per_source: Vec<(usize, usize)> = (g.strides.iter().zip(&starts))
                .map(|(&b, &s)| {
                    let n: usize = lengths[s..s + b].iter().map(|&l| l as usize).sum();
                    at += n;
                    (at - n, n)
                })
                .collect();
            from.push(per_source);
        }
        let mut tbe = vec![0; slots];
        let mut first = vec![0; slots];
        for (r, local) in shards.remote.iter().enumerate() {
            let mut at = 0;
            for &slot in &local.members {
                tbe[slot] = r;
                first[slot] = at;
                at += from[slot].iter().map(|&(_, n)| n).sum::<usize>();
            }
        }
        SlotRows { tbe, first, from }
    }

    /// Ids of slot `slot` in total.
    fn ids(&self, slot: usize) -> usize {
        self.from[slot].iter().map(|&(_, n)| n).sum()
    }
}

/// The positions (in this rank's ids of the slot's feature) of the ids `slot` looks up.
fn positions(input: &LocalInput, slot: &Slot) -> Vec<usize> {
    let (ids, _, _) = input.feature(slot.feature);
    match slot.route {
        Route::Owned => (0..ids.len()).collect(),
        Route::RowWise | Route::TwRw { .. } => {
            let (lo, hi) = (slot.row_offset as i64, (slot.row_offset + slot.rows) as i64);
            (ids.iter().enumerate())
                .filter(|&(_, &id)| id >= lo && id < hi)
                .map(|(k, _)| k)
                .collect()
        }
    }
}

/// This rank's output layout: per feature, where its rows start in the flat output and its
/// width; and per rank, per slot of that rank, the positions of this rank's ids it looks up.
struct Layout {
    start: Vec<usize>,
    dim: Vec<usize>,
    count: Vec<usize>,
    positions: Vec<Vec<Vec<usize>>>,
    /// Per feature, the weight of each of its ids (when the KJT has weights).
    weights: Option<Vec<f32>>,
}

impl Layout {
    fn new(shards: &Shards, input: &LocalInput) -> Layout {
        let features = &shards.routing.features;
        let (mut start, mut dim, mut count) = (Vec::new(), Vec::new(), Vec::new());
        let mut at = 0;
        let mut weights = input.kjt.weights.as_ref().map(|_| Vec::new());
        for (f, feature) in features.iter().enumerate() {
            let (ids, w, _) = input.feature(f);
            start.push(at);
            dim.push(feature.dim);
            count.push(ids.len());
            at += ids.len() * feature.dim;
            if let (Some(o), Some(w)) = (&mut weights, w) {
                o.extend_from_slice(w);
            }
        }
        start.push(at);
        let positions = (shards.routing.slots.iter())
            .map(|slots| slots.iter().map(|s| positions(input, s)).collect())
            .collect();
        Layout {
            start,
            dim,
            count,
            positions,
            weights,
        }
    }

    fn len(&self) -> usize {
        *self.start.last().expect("a start per feature and the end")
    }

    /// Multiplies every row by its id's weight (forward, and the gradient in backward).
    fn scale(&self, flat: &mut [f32]) {
        let Some(weights) = &self.weights else { return };
        let mut k = 0;
        for f in 0..self.dim.len() {
            let d = self.dim[f];
            for row in flat[self.start[f]..self.start[f + 1]].chunks_exact_mut(d) {
                row.iter_mut().for_each(|x| *x *= weights[k]);
                k += 1;
            }
        }
    }

    /// The span of columns `slot` covers in the row at `position` of its feature.
    fn span(&self, slot: &Slot, position: usize) -> std::ops::Range<usize> {
        let f = slot.feature;
        let at = self.start[f] + position * self.dim[f] + slot.col_offset;
        at..at + slot.cols
    }
}

impl ShardedEmbeddingCollection {
    /// Builds this rank's shards of `configs` under `plan` (a collective: every rank of `comm`
    /// calls it with the same arguments), initialised from `seed` row by row as
    /// [`init_table`](super::init_table) gives them.
    ///
    /// Errors, on every rank alike: configs an unsharded collection refuses, a plan that does
    /// not fit the tables (naming the table), a world size other than the plan's, or ranks that
    /// disagree on the plan or the tables (naming the rank and table).
    pub fn new(
        configs: Vec<EmbeddingConfig>,
        plan: &ShardingPlan,
        optimizer: FusedOptimizer,
        comm: Comm,
        seed: u64,
    ) -> Result<Self> {
        Self::with_caches(
            configs,
            plan,
            optimizer,
            &ShardCaches::default(),
            comm,
            seed,
        )
    }

    /// [`new`](Self::new) with the rows of tables the plan gives a cached kernel
    /// (`fused_uvm`, `fused_uvm_caching`) kept where `caches` says (by default in host
    /// memory; a directory: one row file per rank and group of its shards, `ec-rank<r>-…`):
    /// each rank's shards of those tables train through a DRAM cache of the plan's size, bit
    /// for bit as in memory.
    pub fn with_caches(
        configs: Vec<EmbeddingConfig>,
        plan: &ShardingPlan,
        optimizer: FusedOptimizer,
        caches: &ShardCaches,
        comm: Comm,
        seed: u64,
    ) -> Result<Self> {
        let checked = check_configs(OP, &configs).map(|_| ());
        let shards = Shards::build(Build {
            op: OP,
            tables: configs.iter().map(TableInfo::of).collect(),
            features: configs.iter().map(|c| c.feature_names.clone()).collect(),
            checked,
            describe: (configs.iter())
                .map(|c| {
                    format!(
                        "{} {}x{} {:?} unpooled {:?}",
                        c.name, c.num_embeddings, c.embedding_dim, c.feature_names, c.init
                    )
                })
                .collect(),
            pooling: PoolingMode::None,
            by_width: true,
            host_groups: false,
            optimizer,
            weight_decay: WeightDecay::None,
            plan,
            caches,
            comm,
            seed,
        })?;
        Ok(ShardedEmbeddingCollection {
            inner: Arc::new(Inner { shards, configs }),
        })
    }

    sharded_access!();

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

    /// The table configs (unsharded).
    pub fn configs(&self) -> &[EmbeddingConfig] {
        &self.inner.configs
    }

    /// The rows of this rank's batch: one jagged tensor per feature (config order), values
    /// `[N_f, dim]` (the row of each id, times its weight if the KJT has weights) on the
    /// tables' device, lengths as in the KJT — what the unsharded collection returns. A
    /// collective, every rank with its own batch; its backward (on every rank) runs the
    /// sharded backward and the fused optimizer. Weights get no gradient.
    ///
    /// A batch that fails its checks is an error on this rank naming the feature, and an
    /// error naming this rank on the others: every rank skips the batch.
    pub fn forward(&self, kjt: &KeyedJaggedTensor) -> Result<Vec<(String, JaggedTensor)>> {
        let shards = &self.inner.shards;
        let (input, gathered) = shards.distribute_input(kjt, false, &shards.comm)?;
        let layout = Layout::new(shards, &input);
        let mut flat = vec![0.0f32; layout.len()];
        // Remote lookups and the output distribution.
        let mut remote_batches = Vec::new();
        let mut rows = None;
        if let Some(g) = &gathered {
            let slot_rows = SlotRows::new(shards, g);
            let mut looked = Vec::with_capacity(shards.remote.len());
            let lookups = (|| {
                for local in &shards.remote {
                    let (ids, offsets) = slot_bags(
                        g,
                        &local.members,
                        shards.routing.slots[shards.comm.rank()].len(),
                    );
                    let batch = local.tbe.prepare(TbeInput::new(&ids[..], &offsets[..]))?;
                    looked.push(local.tbe.lookup_batch(&batch)?.to_vec::<f32>()?);
                    remote_batches.push(batch);
                }
                Ok(())
            })();
            shards.agree_on_lookups(lookups)?;
            self.distribute_output(&slot_rows, &looked, &layout, &mut flat)?;
            rows = Some(slot_rows);
        }
        // Replicated lookups.
        let mut replicated_batches = Vec::new();
        for rep in &shards.replicated {
            let (ids, offsets, _) = input.bags_of(&rep.members, false);
            let batch = rep.tbe.prepare(TbeInput::new(&ids[..], &offsets[..]))?;
            let looked = rep.tbe.lookup_batch(&batch)?.to_vec::<f32>()?;
            let mut at = 0;
            for &f in &rep.members {
                let n = layout.start[f + 1] - layout.start[f];
                flat[layout.start[f]..layout.start[f + 1]].copy_from_slice(&looked[at..at + n]);
                at += n;
            }
            replicated_batches.push(batch);
        }
        layout.scale(&mut flat);
        let (start, dim, count) = (
            layout.start.clone(),
            layout.dim.clone(),
            layout.count.clone(),
        );
        let n = flat.len();
        let values = Tensor::from_vec(flat, &[n])?.to_device(self.device())?;
        let values = if crate::tensor::is_grad_enabled() {
            record_op_with_state(
                values,
                &[],
                SequenceBackward {
                    sharded: self.clone(),
                    rows,
                    remote: remote_batches,
                    replicated: replicated_batches,
                    layout,
                    stride: input.kjt.stride,
                },
            )
        } else {
            values
        };
        let b = input.kjt.stride;
        (shards.keys.iter().enumerate())
            .map(|(f, key)| {
                let rows = values
                    .narrow(0, start[f], count[f] * dim[f])?
                    .reshape(&[count[f], dim[f]])?;
                let (_, _, lengths) = input.feature(f);
                let lengths = Tensor::from_vec(lengths.to_vec(), &[b])?;
                Ok((key.clone(), JaggedTensor::new(rows, lengths, None)?))
            })
            .collect()
    }

    /// The output distribution: every remote lookup's rows (`looked[tbe]`) back to the ranks
    /// whose ids they are, placed in `flat` at their ids' positions and columns.
    fn distribute_output(
        &self,
        rows: &SlotRows,
        looked: &[Vec<f32>],
        layout: &Layout,
        flat: &mut [f32],
    ) -> Result<()> {
        let shards = &self.inner.shards;
        let (comm, routing) = (&shards.comm, &shards.routing);
        let (rank, w) = (comm.rank(), comm.size());
        let mine = &routing.slots[rank];
        let send: Vec<Vec<f32>> = (0..w)
            .map(|d| {
                let mut out = Vec::new();
                for (i, slot) in mine.iter().enumerate() {
                    let (start, n) = rows.from[i][d];
                    let first = (rows.first[i] + start) * slot.cols;
                    out.extend_from_slice(&looked[rows.tbe[i]][first..first + n * slot.cols]);
                }
                out
            })
            .collect();
        let counts: Vec<usize> = (0..w)
            .map(|s| {
                (routing.slots[s].iter().zip(&layout.positions[s]))
                    .map(|(slot, p)| p.len() * slot.cols)
                    .sum()
            })
            .collect();
        let got = comm.all_to_all_v("output_dist.sequence", send, Some(&counts))?;
        for (s, block) in got.iter().enumerate() {
            let mut at = 0;
            for (slot, positions) in routing.slots[s].iter().zip(&layout.positions[s]) {
                for &p in positions {
                    flat[layout.span(slot, p)].copy_from_slice(&block[at..at + slot.cols]);
                    at += slot.cols;
                }
            }
        }
        Ok(())
    }

    /// The backward of the output distribution: the gradient of this rank's rows (`grad`,
    /// weights applied) to the gradient of each remote lookup (`[ids, cols]` per TBE), divided
    /// by the world size.
    fn gather_gradients(
        &self,
        rows: &SlotRows,
        layout: &Layout,
        grad: &[f32],
    ) -> Result<Vec<Vec<f32>>> {
        let shards = &self.inner.shards;
        let (comm, routing) = (&shards.comm, &shards.routing);
        let (rank, w) = (comm.rank(), comm.size());
        let send: Vec<Vec<f32>> = (0..w)
            .map(|d| {
                let mut out = Vec::new();
                for (slot, positions) in routing.slots[d].iter().zip(&layout.positions[d]) {
                    for &p in positions {
                        out.extend_from_slice(&grad[layout.span(slot, p)]);
                    }
                }
                out
            })
            .collect();
        let mine = &routing.slots[rank];
        let counts: Vec<usize> = (0..w)
            .map(|s| {
                (mine.iter().enumerate())
                    .map(|(i, slot)| rows.from[i][s].1 * slot.cols)
                    .sum()
            })
            .collect();
        let got = comm.all_to_all_v("backward.sequence", send, Some(&counts))?;
        let mut out: Vec<Vec<f32>> = (shards.remote.iter())
            .map(|local| {
                let n: usize = local.members.iter().map(|&i| rows.ids(i)).sum();
                vec![0.0f32; n * local.tbe.output_dim()]
            })
            .collect();
        let world = w as f32;
        for (s, block) in got.iter().enumerate() {
            let mut at = 0;
            for (i, slot) in mine.iter().enumerate() {
                let (start, n) = rows.from[i][s];
                let first = (rows.first[i] + start) * slot.cols;
                let len = n * slot.cols;
                for (o, &g) in out[rows.tbe[i]][first..first + len]
                    .iter_mut()
                    .zip(&block[at..at + len])
                {
                    *o = g / world;
                }
                at += len;
            }
        }
        Ok(out)
    }
}

/// The bags of `members` (slot indices) of a gathered input with `slots` slots: ids and
/// offsets, slot after slot.
fn slot_bags(g: &Gathered, members: &[usize], slots: usize) -> (Vec<i64>, Vec<i64>) {
    let batch = g.batch();
    let mut value_start = Vec::with_capacity(slots + 1);
    let mut at = 0usize;
    for slot in 0..slots {
        value_start.push(at);
        at += g.lengths[slot * batch..(slot + 1) * batch]
            .iter()
            .map(|&l| l as usize)
            .sum::<usize>();
    }
    value_start.push(at);
    let mut ids = Vec::new();
    let mut offsets = vec![0i64];
    for &slot in members {
        ids.extend_from_slice(&g.values[value_start[slot]..value_start[slot + 1]]);
        for &l in &g.lengths[slot * batch..(slot + 1) * batch] {
            let last = *offsets.last().expect("offsets start at 0");
            offsets.push(last + i64::from(l));
        }
    }
    (ids, offsets)
}

/// Autograd node of [`ShardedEmbeddingCollection::forward`].
struct SequenceBackward {
    sharded: ShardedEmbeddingCollection,
    rows: Option<SlotRows>,
    remote: Vec<TbeBatch>,
    replicated: Vec<TbeBatch>,
    layout: Layout,
    stride: usize,
}

impl BackwardOp for SequenceBackward {
    fn name(&self) -> &'static str {
        "sharded_embedding_collection"
    }

    fn backward(&self, grad_output: &Tensor) -> Result<Vec<Option<Gradient>>> {
        let sharded = &self.sharded;
        let shards = &sharded.inner.shards;
        let layout = &self.layout;
        let mut grad = grad_output
            .to_device(Device::Cpu)?
            .contiguous()?
            .to_vec::<f32>()?;
        if grad.len() != layout.len() {
            return Err(Error::Backward(format!(
                "{OP}: the gradient has {} values, expected {} (a batch of {})",
                grad.len(),
                layout.len(),
                self.stride
            )));
        }
        layout.scale(&mut grad);
        if let Some(rows) = &self.rows {
            let grads = sharded.gather_gradients(rows, layout, &grad)?;
            let updated = (|| {
                for ((local, batch), g) in shards.remote.iter().zip(&self.remote).zip(grads) {
                    let n = g.len() / local.tbe.output_dim();
                    let g = Tensor::from_vec(g, &[n, local.tbe.output_dim()])?;
                    local.tbe.backward_batch(batch, &g)?;
                }
                Ok(())
            })();
            shards.agree_on_update(updated)?;
        }
        let mut steps = Vec::with_capacity(self.replicated.len());
        for (rep, batch) in shards.replicated.iter().zip(&self.replicated) {
            let mut g = Vec::new();
            for &f in &rep.members {
                g.extend_from_slice(&grad[layout.start[f]..layout.start[f + 1]]);
            }
            let n = g.len() / rep.tbe.output_dim();
            let g = Tensor::from_vec(g, &[n, rep.tbe.output_dim()])?;
            steps.push(rep.tbe.row_gradients_batch(batch, &g)?);
        }
        if !steps.is_empty() {
            shards.step_replicated(steps)?;
        }
        Ok(Vec::new())
    }
}
