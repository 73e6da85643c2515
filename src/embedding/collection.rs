//! TorchRec's module API over the TBE: [`EmbeddingBagCollection`] (KJT → pooled
//! [`KeyedTensor`]) and [`EmbeddingCollection`] (KJT → one [`JaggedTensor`] of rows per
//! feature).
//!
//! Both are autograd citizens: their outputs come from [`TableBatchedEmbedding::forward`], so a
//! `loss.backward()` downstream runs the fused optimizer on the embedding rows. Their tables are
//! *not* dense parameters (`named_parameters` is empty): a dense optimizer never sees them.
//!
//! Tables are grouped into one TBE per pooling mode (EBC) or per dim (EC); the features a
//! collection reads must be keys of the input KJT (extra keys are ignored) and every key must
//! have the same batch size.

use super::config::WeightType;
use super::config::{
    BoundsCheckMode, EmbeddingBagConfig, EmbeddingConfig, EmbeddingInit, PoolingMode, TableSpec,
};
use super::inference::QuantizedTableBatchedEmbedding;
use super::input::TbeInput;
use super::optimizer::{FusedOptimizer, WeightDecay};
use super::tbe::{Placement, TableBatchedEmbedding, TbeConfig};
use crate::nn::Module;
use crate::sparse::{JaggedTensor, KeyedJaggedTensor, KeyedTensor};
use crate::tensor::rng::Rng;
use crate::{DType, Device, Error, Result, Tensor};

/// One TBE of a collection and which features/tables it serves.
#[derive(Clone, Debug)]
struct Group {
    tbe: TableBatchedEmbedding,
    /// Features in the TBE's order.
    features: Vec<String>,
}

/// Where each collection table lives: (group, table index inside the group's TBE).
type TablePlace = (usize, usize);

/// The TBEs of a collection and where each of its tables lives: what EBC and EC share.
#[derive(Clone, Debug)]
struct TableGroups {
    op: &'static str,
    /// Table names in config order.
    names: Vec<String>,
    groups: Vec<Group>,
    places: Vec<TablePlace>,
}

/// One table of a collection, as the builder of [`TableGroups`] needs it.
struct TableDef<'a> {
    name: &'a str,
    rows: usize,
    dim: usize,
    features: &'a [String],
    init: EmbeddingInit,
}

impl TableGroups {
    /// One TBE per `(members, pooling)` partition entry (members index `tables`), each table
    /// initialised from `rng`.
    #[allow(clippy::too_many_arguments)]
    fn build(
        op: &'static str,
        tables: &[TableDef<'_>],
        partition: Vec<(Vec<usize>, PoolingMode)>,
        optimizer: FusedOptimizer,
        weight_decay: WeightDecay,
        bounds_check: BoundsCheckMode,
        placement: &Placement,
        device: Device,
        rng: &mut Rng,
    ) -> Result<Self> {
        let mut groups: Vec<Group> = Vec::new();
        let mut places = vec![(0, 0); tables.len()];
        let built = (|| {
            for (members, pooling) in partition {
                let mut specs = Vec::new();
                let mut ftm = Vec::new();
                let mut features = Vec::new();
                for (t, &i) in members.iter().enumerate() {
                    let c = &tables[i];
                    specs.push(TableSpec::new(c.name, c.rows, c.dim));
                    for f in c.features {
                        ftm.push(t);
                        features.push(f.clone());
                    }
                    places[i] = (groups.len(), t);
                }
                let mut cfg = TbeConfig::new(specs, ftm, pooling, optimizer);
                cfg.feature_names = Some(features.clone());
                cfg.weight_decay = weight_decay;
                cfg.bounds_check = bounds_check;
                let name = format!("{}-group{}.rows", op_short(op), groups.len());
                let tbe = placement.tbe(cfg, &name, device, device)?;
                groups.push(Group { tbe, features });
                let tbe = &groups[groups.len() - 1].tbe;
                for (t, &i) in members.iter().enumerate() {
                    tbe.init_table(t, tables[i].init, rng)?;
                }
            }
            Ok::<(), Error>(())
        })();
        if let Err(e) = built {
            // The groups made so far take their row files with them.
            for g in groups {
                g.tbe.discard();
            }
            return Err(e);
        }
        Ok(TableGroups {
            op,
            names: tables.iter().map(|t| t.name.to_string()).collect(),
            groups,
            places,
        })
    }

    fn tbes(&self) -> Vec<&TableBatchedEmbedding> {
        self.groups.iter().map(|g| &g.tbe).collect()
    }

    fn device(&self) -> crate::Device {
        self.groups
            .first()
            .map_or(crate::Device::Cpu, |g| g.tbe.device())
    }

    fn to_device(&self, device: crate::Device) -> Result<()> {
        let from = self.device();
        for (i, g) in self.groups.iter().enumerate() {
            if let Err(e) = g.tbe.to_device(device) {
                // Put the groups moved so far back, so the collection stays on one device.
                for moved in &self.groups[..i] {
                    moved.tbe.to_device(from)?;
                }
                return Err(e);
            }
        }
        Ok(())
    }

    fn place(&self, table: &str) -> Result<TablePlace> {
        let i = self
            .names
            .iter()
            .position(|n| n == table)
            .ok_or_else(|| Error::invalid(self.op, format!("no table named `{table}`")))?;
        Ok(self.places[i])
    }

    fn table_weights(&self, table: &str) -> Result<Vec<f32>> {
        let (g, t) = self.place(table)?;
        self.groups[g].tbe.table_weights(t)
    }

    fn set_table_weights(&self, table: &str, values: &[f32]) -> Result<()> {
        let (g, t) = self.place(table)?;
        self.groups[g].tbe.set_table_weights(t, values)
    }
}

/// The [`TableDef`]s of a list of EBC or EC configs (same field names in both).
macro_rules! table_defs {
    ($configs:expr) => {
        $configs
            .iter()
            .map(|c| TableDef {
                name: &c.name,
                rows: c.num_embeddings,
                dim: c.embedding_dim,
                features: &c.feature_names,
                init: c.init,
            })
            .collect::<Vec<TableDef<'_>>>()
    };
}

/// The table accessors and checkpoint methods EBC and EC share, delegating to their
/// [`TableGroups`].
macro_rules! table_access {
    () => {
        /// The underlying TBEs.
        pub fn tbes(&self) -> Vec<&TableBatchedEmbedding> {
            self.tables.tbes()
        }

        /// Where the tables live (all of a collection's tables on one device).
        pub fn device(&self) -> crate::Device {
            self.tables.device()
        }

        /// Moves every table and its optimizer state to `device` (clones of the collection
        /// follow): lookups then return tensors there and backward updates the tables there.
        /// On an error the tables stay where they were.
        pub fn to_device(&self, device: crate::Device) -> Result<()> {
            self.tables.to_device(device)
        }

        /// A copy of table `table`'s rows (`[rows, dim]` row-major).
        pub fn table_weights(&self, table: &str) -> Result<Vec<f32>> {
            self.tables.table_weights(table)
        }

        /// Overwrites table `table`'s rows.
        pub fn set_table_weights(&self, table: &str, values: &[f32]) -> Result<()> {
            self.tables.set_table_weights(table, values)
        }

        /// With [`FusedOptimizer::None`]: the row-sparse gradient of `table` summed over the
        /// backward calls since the last [`zero_sparse_gradients`](Self::zero_sparse_gradients),
        /// coalesced (sorted distinct rows; values on the tables' device); `None` before a
        /// backward reached it, or for tables with a fused optimizer. An unknown table is an
        /// error.
        pub fn sparse_gradient(&self, table: &str) -> Result<Option<crate::tensor::RowSparseGrad>> {
            let (g, t) = self.tables.place(table)?;
            (self.tables.groups[g].tbe.sparse_gradient(t))
                .map(|grad| grad.coalesce())
                .transpose()
        }

        /// Clears the gradients kept for [`sparse_gradient`](Self::sparse_gradient).
        pub fn zero_sparse_gradients(&self) {
            for g in &self.tables.groups {
                g.tbe.zero_sparse_gradients();
            }
        }

        /// Writes every table and its optimizer state to one safetensors file (atomically).
        pub fn save(&self, path: impl AsRef<std::path::Path>) -> Result<()> {
            super::checkpoint::save_many(path.as_ref(), &self.tbes())
        }

        /// Loads tables and optimizer state written by [`save`](Self::save); a bad file
        /// changes nothing.
        pub fn load(&self, path: impl AsRef<std::path::Path>) -> Result<()> {
            super::checkpoint::load_many(path.as_ref(), &self.tbes())
        }

        /// Adds every table and its optimizer state to a larger checkpoint, names prefixed by
        /// `prefix`. Tables cached in files go, as their row files, into the writer's parts
        /// directory when it has one ([`CheckpointWriter::parts_beside`](crate::checkpoint::CheckpointWriter::parts_beside));
        /// otherwise they are read into the file a chunk of rows at a time. The tables are
        /// read when the writer writes its file (so it borrows this collection): do not train
        /// them in between.
        pub fn checkpoint_into<'a>(
            &'a self,
            writer: &mut crate::checkpoint::CheckpointWriter<'a>,
            prefix: &str,
        ) -> Result<()> {
            super::checkpoint::add_tbes(writer, prefix, &self.tbes())
        }

        /// Restores what [`checkpoint_into`](Self::checkpoint_into) wrote; everything is
        /// checked before anything changes.
        pub fn restore_from(
            &self,
            reader: &crate::checkpoint::CheckpointReader,
            prefix: &str,
        ) -> Result<()> {
            self.stage_from(reader, prefix)?.apply(&self.tbes())
        }

        /// Reads and checks this collection's part of a checkpoint without applying it.
        pub(crate) fn stage_from(
            &self,
            reader: &crate::checkpoint::CheckpointReader,
            prefix: &str,
        ) -> Result<super::checkpoint::StagedTables> {
            super::checkpoint::stage_tbes(reader, prefix, &self.tbes())
        }
    };
}

/// Checks EBC configs (tables with unique names, features read by one table each, SUM or
/// MEAN pooling, FP32 rows): the output keys (features in config order) and their widths.
pub(crate) fn check_bag_configs(
    op: &'static str,
    configs: &[EmbeddingBagConfig],
) -> Result<(Vec<String>, Vec<usize>)> {
    if configs.is_empty() {
        return Err(Error::invalid(op, "at least one table config is needed"));
    }
    check_unique_names(op, configs.iter().map(|c| c.name.as_str()))?;
    let mut output_keys = Vec::new();
    let mut seen = std::collections::HashSet::new();
    let mut output_dims = Vec::new();
    for c in configs {
        if c.feature_names.is_empty() {
            return Err(Error::invalid(
                op,
                format!("table `{}` has no features", c.name),
            ));
        }
        if c.pooling == PoolingMode::None {
            return Err(Error::invalid(
                op,
                format!(
                    "table `{}`: an EmbeddingBagCollection pools (SUM or MEAN); use \
                         EmbeddingCollection for unpooled lookups",
                    c.name
                ),
            ));
        }
        if c.weight_type != super::WeightType::Fp32 {
            return Err(Error::invalid(
                op,
                format!(
                    "table `{}`: training tables are FP32; quantise for inference with \
                         QuantizedTableBatchedEmbedding::from_trained",
                    c.name
                ),
            ));
        }
        for f in &c.feature_names {
            if !seen.insert(f) {
                return Err(Error::invalid(
                    op,
                    format!("feature `{f}` is listed by more than one table"),
                ));
            }
            output_keys.push(f.clone());
            output_dims.push(c.embedding_dim);
        }
    }
    Ok((output_keys, output_dims))
}

fn check_unique_names<'a>(op: &'static str, names: impl Iterator<Item = &'a str>) -> Result<()> {
    let mut seen = std::collections::HashSet::new();
    for n in names {
        if !seen.insert(n) {
            return Err(Error::invalid(
                op,
                format!("table name `{n}` is used twice"),
            ));
        }
    }
    Ok(())
}

/// [`tbe_input_from_kjt`] copied to the host: ids and offsets as i64, weights as f32.
#[allow(clippy::type_complexity)]
fn host_tbe_input(
    op: &'static str,
    kjt: &KeyedJaggedTensor,
    features: &[String],
) -> Result<(Vec<i64>, Vec<i64>, Option<Vec<f32>>)> {
    let (ids, offsets, weights) = tbe_input_from_kjt(op, kjt, features)?;
    Ok((
        ids.cast_values(DType::I64)?.to_vec::<i64>()?,
        offsets.cast_values(DType::I64)?.to_vec::<i64>()?,
        weights.map(|w| w.to_vec::<f32>()).transpose()?,
    ))
}

/// Builds the TBE input of `features` from a KJT: zero-copy when the KJT holds exactly those
/// keys in that order, else one gather of their ids (and weights).
fn tbe_input_from_kjt(
    op: &'static str,
    kjt: &KeyedJaggedTensor,
    features: &[String],
) -> Result<(Tensor, Tensor, Option<Tensor>)> {
    if kjt.variable_stride_per_key() {
        return Err(Error::invalid(
            op,
            "variable-batch KJTs are not supported: every key needs the same batch size",
        ));
    }
    let keys = kjt.keys();
    let positions: Vec<usize> = features
        .iter()
        .map(|f| {
            keys.iter().position(|k| k == f).ok_or_else(|| {
                Error::invalid(
                    op,
                    format!("feature `{f}` is missing from the input KJT (its keys are {keys:?})"),
                )
            })
        })
        .collect::<Result<_>>()?;
    if positions.len() == keys.len() && positions.iter().enumerate().all(|(i, &p)| i == p) {
        return Ok((
            kjt.values().clone(),
            kjt.offsets().clone(),
            kjt.weights().cloned(),
        ));
    }
    let b = kjt.stride();
    let offs: Vec<i64> = match kjt.offsets().dtype() {
        DType::I32 => kjt
            .offsets()
            .to_vec::<i32>()?
            .into_iter()
            .map(i64::from)
            .collect(),
        _ => kjt.offsets().to_vec::<i64>()?,
    };
    let values: Vec<i64> = match kjt.values().dtype() {
        DType::I32 => kjt
            .values()
            .to_vec::<i32>()?
            .into_iter()
            .map(i64::from)
            .collect(),
        DType::I64 => kjt.values().to_vec::<i64>()?,
        other => {
            return Err(Error::UnsupportedDType {
                op,
                dtype: other,
                expected: "i32 or i64 ids in the KJT values",
            })
        }
    };
    let mut new_ids = Vec::new();
    // Where each picked value sits in the KJT: the weights are gathered with index_select,
    // so weights that require grad keep their gradient path.
    let mut picked = Vec::new();
    let mut new_offsets = vec![0i64];
    for &k in &positions {
        for s in 0..b {
            let (start, end) = (offs[k * b + s] as usize, offs[k * b + s + 1] as usize);
            new_ids.extend_from_slice(&values[start..end]);
            picked.extend(start as i64..end as i64);
            new_offsets.push(new_ids.len() as i64);
        }
    }
    let n = new_ids.len();
    let n_off = new_offsets.len();
    let weights = match kjt.weights() {
        Some(w) => Some(w.index_select(&Tensor::from_vec(picked, &[n])?)?),
        None => None,
    };
    Ok((
        Tensor::from_vec(new_ids, &[n])?,
        Tensor::from_vec(new_offsets, &[n_off])?,
        weights,
    ))
}

/// Puts each group's pooled output columns back in the collection's feature order.
fn assemble_pooled(
    output_keys: &[String],
    output_dims: &[usize],
    mut outputs: Vec<(&[String], Tensor)>,
) -> Result<KeyedTensor> {
    let values = if outputs.len() == 1 && outputs[0].0 == output_keys {
        outputs.pop().expect("one group").1
    } else {
        // Several pooling groups: put every feature's columns back in config order.
        let mut pieces = Vec::new();
        for key in output_keys {
            let (features, out) = outputs
                .iter()
                .find(|(fs, _)| fs.contains(key))
                .expect("every feature is in a group");
            let mut col = 0;
            let mut width = 0;
            for f in features.iter() {
                let d = output_dims[output_keys.iter().position(|k| k == f).unwrap()];
                if f == key {
                    width = d;
                    break;
                }
                col += d;
            }
            pieces.push(out.narrow(1, col, width)?);
        }
        let refs: Vec<&Tensor> = pieces.iter().collect();
        Tensor::cat(&refs, 1)?
    };
    KeyedTensor::new(output_keys.to_vec(), output_dims.to_vec(), values)
}

/// An inference-only [`EmbeddingBagCollection`] with quantized tables (see
/// [`EmbeddingBagCollection::quantize`]); outputs are f32 and take no part in autograd.
#[derive(Debug)]
pub struct QuantizedEmbeddingBagCollection {
    groups: Vec<(QuantizedTableBatchedEmbedding, Vec<String>)>,
    output_keys: Vec<String>,
    output_dims: Vec<usize>,
}

impl QuantizedEmbeddingBagCollection {
    /// Pooled embeddings of every feature, as [`EmbeddingBagCollection::forward`].
    pub fn forward(&self, kjt: &KeyedJaggedTensor) -> Result<KeyedTensor> {
        const OP: &str = "QuantizedEmbeddingBagCollection";
        let mut outputs: Vec<(&[String], Tensor)> = Vec::new();
        for (q, features) in &self.groups {
            let (ids, offsets, weights) = host_tbe_input(OP, kjt, features)?;
            let mut input = TbeInput::new(&ids[..], &offsets[..]);
            if let Some(w) = &weights {
                input = input.with_weights(w);
            }
            outputs.push((features, q.forward(input)?));
        }
        assemble_pooled(&self.output_keys, &self.output_dims, outputs)
    }

    /// Zeroes the cache counters of every cached table.
    pub fn reset_cache_stats(&self) {
        for (q, _) in &self.groups {
            q.reset_cache_stats();
        }
    }

    /// The cache counters of every table whose rows are cached
    /// ([`EmbeddingBagCollection::quantize_placed`]), group by group; empty when none is.
    pub fn cache_stats(&self) -> Vec<super::CacheStats> {
        (self.groups.iter())
            .filter_map(|(q, _)| q.cache_stats())
            .flatten()
            .collect()
    }

    /// Bytes held by the quantized tables.
    pub fn allocated_bytes(&self) -> usize {
        self.groups.iter().map(|(q, _)| q.allocated_bytes()).sum()
    }

    /// Makes the lookups run on `device` (the rows are copied there).
    pub fn to_device(&mut self, device: crate::Device) -> Result<()> {
        for (q, _) in &mut self.groups {
            q.to_device(device)?;
        }
        Ok(())
    }
}

/// Pooled embedding tables looked up by sparse features (TorchRec's `EmbeddingBagCollection`
/// with a fused optimizer).
#[derive(Clone, Debug)]
pub struct EmbeddingBagCollection {
    configs: Vec<EmbeddingBagConfig>,
    tables: TableGroups,
    /// Output keys (features in config order) and their widths.
    output_keys: Vec<String>,
    output_dims: Vec<usize>,
}

const EBC: &str = "EmbeddingBagCollection";
const EC: &str = "EmbeddingCollection";

impl EmbeddingBagCollection {
    /// Builds the tables (initialised from `rng` with each config's initialiser) with
    /// `optimizer` fused into backward.
    pub fn new(
        configs: Vec<EmbeddingBagConfig>,
        optimizer: FusedOptimizer,
        rng: &mut Rng,
    ) -> Result<Self> {
        Self::with_options(
            configs,
            optimizer,
            WeightDecay::None,
            BoundsCheckMode::Error,
            rng,
        )
    }

    /// [`new`](Self::new) with weight decay and a bounds-check mode.
    pub fn with_options(
        configs: Vec<EmbeddingBagConfig>,
        optimizer: FusedOptimizer,
        weight_decay: WeightDecay,
        bounds_check: BoundsCheckMode,
        rng: &mut Rng,
    ) -> Result<Self> {
        Self::build(
            configs,
            optimizer,
            weight_decay,
            bounds_check,
            (&Placement::Memory, Device::Cpu),
            rng,
        )
    }

    /// [`new`](Self::new) with the tables placed by `placement` (e.g. in files behind a DRAM
    /// cache, one per pooling group: `ebc-group<g>.rows`).
    pub fn with_placement(
        configs: Vec<EmbeddingBagConfig>,
        optimizer: FusedOptimizer,
        placement: &Placement,
        rng: &mut Rng,
    ) -> Result<Self> {
        Self::with_placement_on(configs, optimizer, placement, Device::Cpu, rng)
    }

    /// [`with_placement`](Self::with_placement) with the caches of cached tables in the
    /// memory of `device` (a GPU: rows in host memory, the hot ones in HBM); tables in memory
    /// are built on the host (move them with `to_device`).
    pub fn with_placement_on(
        configs: Vec<EmbeddingBagConfig>,
        optimizer: FusedOptimizer,
        placement: &Placement,
        device: Device,
        rng: &mut Rng,
    ) -> Result<Self> {
        Self::build(
            configs,
            optimizer,
            WeightDecay::None,
            BoundsCheckMode::Error,
            (placement, device),
            rng,
        )
    }

    fn build(
        configs: Vec<EmbeddingBagConfig>,
        optimizer: FusedOptimizer,
        weight_decay: WeightDecay,
        bounds_check: BoundsCheckMode,
        (placement, device): (&Placement, Device),
        rng: &mut Rng,
    ) -> Result<Self> {
        let (output_keys, output_dims) = check_bag_configs(EBC, &configs)?;
        let defs = table_defs!(configs);
        let partition = [PoolingMode::Sum, PoolingMode::Mean]
            .into_iter()
            .map(|pooling| {
                let members = (0..configs.len())
                    .filter(|&i| configs[i].pooling == pooling)
                    .collect::<Vec<_>>();
                (members, pooling)
            })
            .filter(|(members, _)| !members.is_empty())
            .collect();
        let tables = TableGroups::build(
            EBC,
            &defs,
            partition,
            optimizer,
            weight_decay,
            bounds_check,
            placement,
            device,
            rng,
        )?;
        Ok(EmbeddingBagCollection {
            configs,
            tables,
            output_keys,
            output_dims,
        })
    }

    /// The output keys (features in config order) and the pooled width of each.
    pub fn output_keys_and_dims(&self) -> (&[String], &[usize]) {
        (&self.output_keys, &self.output_dims)
    }

    /// The table configs.
    pub fn configs(&self) -> &[EmbeddingBagConfig] {
        &self.configs
    }

    table_access!();

    /// Pooled embeddings of every feature: keys in config order (each table's features in
    /// order), values `[B, Σ dims]`. Takes part in autograd; the backward runs the fused
    /// optimizer (and gives the KJT's weights their gradient if they require it).
    pub fn forward(&self, kjt: &KeyedJaggedTensor) -> Result<KeyedTensor> {
        let mut outputs: Vec<(&[String], Tensor)> = Vec::new();
        for g in &self.tables.groups {
            let (ids, offsets, weights) = tbe_input_from_kjt(EBC, kjt, &g.features)?;
            let out = g.tbe.forward(&ids, &offsets, weights.as_ref())?;
            outputs.push((&g.features, out));
        }
        assemble_pooled(&self.output_keys, &self.output_dims, outputs)
    }

    /// Prefetches the batch `kjt` into the caches of cached tables (see
    /// [`TableBatchedEmbedding::prefetch`]): its forward then finds its rows cached and its
    /// admission done. Nothing for tables in memory. Call it with batch `i + 1` while batch `i`
    /// trains.
    pub fn prefetch(&self, kjt: &KeyedJaggedTensor) -> Result<()> {
        for g in &self.tables.groups {
            if !g.tbe.is_cached() {
                continue;
            }
            let (ids, offsets, weights) = host_tbe_input(EBC, kjt, &g.features)?;
            let mut input = TbeInput::new(&ids[..], &offsets[..]);
            if let Some(w) = &weights {
                input = input.with_weights(w);
            }
            g.tbe.prefetch(input)?;
        }
        Ok(())
    }

    /// An inference copy with every table quantized to `weight_type` (FBGEMM's row formats),
    /// same features and pooling.
    pub fn quantize(&self, weight_type: WeightType) -> Result<QuantizedEmbeddingBagCollection> {
        self.quantize_placed(weight_type, &Placement::Memory)
    }

    /// [`quantize`](Self::quantize) into tables placed by `placement`: in memory
    /// ([`Placement::Memory`]), or each group's quantized rows in a row file under the
    /// placement's directory (`ebc-group<g>.<type>.rows`) behind a DRAM cache of its size and
    /// policy ([`Placement::Cached`]; [`Placement::Managed`]: the smallest cache) — inference
    /// tables bigger than memory (FBGEMM's `MANAGED_CACHING` for inference), quantized a chunk
    /// at a time ([`QuantizedTableBatchedEmbedding::from_trained_cached`]). Lookups give the
    /// same values whatever the placement, bit for bit. A row file of that name already there
    /// is replaced; one in use by another operator is refused.
    pub fn quantize_placed(
        &self,
        weight_type: WeightType,
        placement: &Placement,
    ) -> Result<QuantizedEmbeddingBagCollection> {
        let groups = (self.tables.groups.iter().enumerate())
            .map(|(k, g)| {
                let types = vec![weight_type; g.tbe.config().tables.len()];
                let name = format!(
                    "ebc-group{k}.{}.rows",
                    weight_type.fbgemm_name().to_lowercase()
                );
                let q = match placement.cache_for(&name)? {
                    None => QuantizedTableBatchedEmbedding::from_trained(&g.tbe, &types)?,
                    Some(cache) => {
                        QuantizedTableBatchedEmbedding::from_trained_cached(&g.tbe, &types, &cache)?
                    }
                };
                Ok((q, g.features.clone()))
            })
            .collect::<Result<_>>()?;
        Ok(QuantizedEmbeddingBagCollection {
            groups,
            output_keys: self.output_keys.clone(),
            output_dims: self.output_dims.clone(),
        })
    }
}

/// A short lower-case name of a collection kind for file names (`ebc`, `ec`).
fn op_short(op: &str) -> &'static str {
    if op == EBC {
        "ebc"
    } else {
        "ec"
    }
}

impl Module for EmbeddingBagCollection {
    /// Empty: the tables are updated by the fused optimizer, not by a dense optimizer.
    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        Vec::new()
    }
}

/// Checks an unpooled collection's configs (at least one; unique table names; each table
/// FP32 with features, no feature read by two tables): the features in config order.
pub(crate) fn check_configs(op: &'static str, configs: &[EmbeddingConfig]) -> Result<Vec<String>> {
    if configs.is_empty() {
        return Err(Error::invalid(op, "at least one table config is needed"));
    }
    check_unique_names(op, configs.iter().map(|c| c.name.as_str()))?;
    let mut feature_order = Vec::new();
    for c in configs {
        if c.feature_names.is_empty() {
            return Err(Error::invalid(
                op,
                format!("table `{}` has no features", c.name),
            ));
        }
        if c.weight_type != super::WeightType::Fp32 {
            return Err(Error::invalid(
                op,
                format!("table `{}`: training tables are FP32", c.name),
            ));
        }
        for f in &c.feature_names {
            if feature_order.contains(f) {
                return Err(Error::invalid(
                    op,
                    format!("feature `{f}` is listed by more than one table"),
                ));
            }
            feature_order.push(f.clone());
        }
    }
    Ok(feature_order)
}

/// Unpooled embedding tables (TorchRec's `EmbeddingCollection`): each id of each feature
/// gives its row, as sequence models (Bert4Rec) need.
#[derive(Clone, Debug)]
pub struct EmbeddingCollection {
    configs: Vec<EmbeddingConfig>,
    tables: TableGroups,
    feature_order: Vec<String>,
}

impl EmbeddingCollection {
    /// Builds the tables (initialised from `rng`) with `optimizer` fused into backward.
    pub fn new(
        configs: Vec<EmbeddingConfig>,
        optimizer: FusedOptimizer,
        rng: &mut Rng,
    ) -> Result<Self> {
        let feature_order = check_configs(EC, &configs)?;
        // One TBE per distinct dim: a TBE without pooling has one output width.
        let mut dims: Vec<usize> = configs.iter().map(|c| c.embedding_dim).collect();
        dims.sort_unstable();
        dims.dedup();
        let defs = table_defs!(configs);
        let partition = dims
            .into_iter()
            .map(|dim| {
                let members = (0..configs.len())
                    .filter(|&i| configs[i].embedding_dim == dim)
                    .collect();
                (members, PoolingMode::None)
            })
            .collect();
        let tables = TableGroups::build(
            EC,
            &defs,
            partition,
            optimizer,
            WeightDecay::None,
            BoundsCheckMode::Error,
            &Placement::Memory,
            Device::Cpu,
            rng,
        )?;
        Ok(EmbeddingCollection {
            configs,
            tables,
            feature_order,
        })
    }

    /// The table configs.
    pub fn configs(&self) -> &[EmbeddingConfig] {
        &self.configs
    }

    table_access!();

    /// One jagged tensor per feature (config order): values `[N_f, dim]` (the rows of the
    /// feature's ids, times their weights if the KJT has any), lengths as in the KJT. Takes
    /// part in autograd like [`EmbeddingBagCollection::forward`].
    pub fn forward(&self, kjt: &KeyedJaggedTensor) -> Result<Vec<(String, JaggedTensor)>> {
        let mut per_feature: Vec<(String, JaggedTensor)> = Vec::new();
        for g in &self.tables.groups {
            let (ids, offsets, weights) = tbe_input_from_kjt(EC, kjt, &g.features)?;
            let out = g.tbe.forward(&ids, &offsets, weights.as_ref())?;
            // (i32 when the KJT's offsets are: they are passed on as they are.)
            let offs = crate::sparse::ops::read_ints(EC, "offsets", &offsets)?;
            let b = kjt.stride();
            for (k, f) in g.features.iter().enumerate() {
                let (start, end) = (offs[k * b] as usize, offs[(k + 1) * b] as usize);
                let lengths: Vec<i64> = (0..b)
                    .map(|s| offs[k * b + s + 1] - offs[k * b + s])
                    .collect();
                let values = out.narrow(0, start, end - start)?;
                per_feature.push((
                    f.clone(),
                    JaggedTensor::new(values, Tensor::from_vec(lengths, &[b])?, None)?,
                ));
            }
        }
        let mut ordered = Vec::with_capacity(per_feature.len());
        for f in &self.feature_order {
            let i = per_feature
                .iter()
                .position(|(name, _)| name == f)
                .expect("every feature was looked up");
            ordered.push(per_feature.swap_remove(i));
        }
        Ok(ordered)
    }
}

impl Module for EmbeddingCollection {
    /// Empty: the tables are updated by the fused optimizer, not by a dense optimizer.
    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        Vec::new()
    }
}
