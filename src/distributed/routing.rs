//! Who looks up what: the plan turned into each rank's lookup slots and the column layouts of
//! the output collectives. Every rank computes the same routing from the same plan, so the
//! sizes of every exchange are known on both ends without sending them.
//!
//! A *slot* is one (feature, shard) pair that a rank looks up for the whole global batch
//! (every rank's samples, in rank order). A rank's slots come in three sections, always in
//! this order, and its remote lookup's output columns follow them:
//! 1. *owned* — table-wise, column-wise and table-column-wise shards it holds (one slot per
//!    shard and feature), sent back whole by an all-to-all;
//! 2. *row-wise* — one slot per feature of every row-wise table (its row block, possibly
//!    empty), partial sums added up by a reduce-scatter;
//! 3. *table-row-wise* — one slot per feature of each table-row-wise table of its host, summed
//!    inside the host and then sent across hosts.
//!
//! Data-parallel tables take no slot: every rank looks them up on its own batch.

use super::plan::{ShardingPlan, ShardingType, TableShape};
use crate::error::{Error, Result};

/// How a slot's partial results reach the output.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Route {
    /// The holder's rows are final: all-to-all back to each sample's rank.
    Owned,
    /// Partial sums over a row block, reduced over every rank.
    RowWise,
    /// Partial sums over a row block, reduced inside host `host`, then sent across hosts.
    TwRw { host: usize },
}

/// One output feature of the unsharded collection (keys in config order).
#[derive(Clone, Debug)]
pub(crate) struct Feature {
    /// Index of its table in the configs.
    pub table: usize,
    /// Pooled width.
    pub dim: usize,
    /// First column in the unsharded output.
    pub col: usize,
}

/// One (feature, shard) lookup a rank makes for the global batch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Slot {
    /// Index into [`Routing::features`].
    pub feature: usize,
    /// Index of the table in the configs.
    pub table: usize,
    /// Index of the shard in the plan's table entry (`None`: an empty row block of a rank
    /// the plan gave no shard of a row-wise table).
    pub shard: Option<usize>,
    pub route: Route,
    /// Rows `[row_offset, row_offset + rows)` of the table.
    pub row_offset: usize,
    pub rows: usize,
    /// Columns `[col_offset, col_offset + cols)` of the table.
    pub col_offset: usize,
    pub cols: usize,
    /// Its first column in the unsharded output.
    pub out_col: usize,
}

/// The whole routing of a plan.
#[derive(Clone, Debug)]
pub(crate) struct Routing {
    pub world: usize,
    pub local: usize,
    pub features: Vec<Feature>,
    /// Per rank, its slots: owned, then row-wise, then table-row-wise.
    pub slots: Vec<Vec<Slot>>,
    /// Per rank, how many of its slots are owned.
    pub owned: Vec<usize>,
    /// Row-wise slots per rank (the same features on every rank).
    pub row_wise: usize,
    /// Per host, its table-row-wise slots (the same on every rank of the host).
    pub twrw: Vec<usize>,
    /// Data-parallel features (indices into `features`).
    pub replicated: Vec<usize>,
    /// Total pooled width of the output.
    pub width: usize,
}

impl Routing {
    /// The routing of `plan` for tables `shapes` with features `features[t]` (per table, its
    /// feature names in order). The plan must already have been checked against `shapes`.
    pub fn new(
        plan: &ShardingPlan,
        shapes: &[TableShape],
        features: &[Vec<String>],
    ) -> Result<Routing> {
        let (world, local) = (plan.world_size, plan.local_world_size);
        let hosts = world / local;
        let mut feats = Vec::new();
        let mut per_table_features = Vec::with_capacity(shapes.len());
        let mut col = 0;
        for (t, shape) in shapes.iter().enumerate() {
            let mut mine = Vec::new();
            for _ in &features[t] {
                mine.push(feats.len());
                feats.push(Feature {
                    table: t,
                    dim: shape.dim,
                    col,
                });
                col += shape.dim;
            }
            per_table_features.push(mine);
        }
        let by_name = plan.by_name();
        let sharding: Vec<_> = (shapes.iter())
            .map(|s| {
                by_name.get(s.name.as_str()).copied().ok_or_else(|| {
                    Error::invalid("ShardingPlan", format!("no plan for table `{}`", s.name))
                })
            })
            .collect::<Result<_>>()?;
        let mut slots = vec![Vec::new(); world];
        let mut replicated = Vec::new();
        // 1. Owned shards, per rank in table, shard, feature order.
        for (t, ts) in sharding.iter().enumerate() {
            match ts.sharding_type {
                ShardingType::TableWise
                | ShardingType::ColumnWise
                | ShardingType::TableColumnWise => {
                    for (k, shard) in ts.shards.iter().enumerate() {
                        for &f in &per_table_features[t] {
                            slots[shard.rank].push(Slot {
                                feature: f,
                                table: t,
                                shard: Some(k),
                                route: Route::Owned,
                                row_offset: 0,
                                rows: shard.rows,
                                col_offset: shard.col_offset,
                                cols: shard.cols,
                                out_col: feats[f].col + shard.col_offset,
                            });
                        }
                    }
                }
                ShardingType::DataParallel => replicated.extend(&per_table_features[t]),
                _ => {}
            }
        }
        let owned = slots.iter().map(Vec::len).collect();
        // 2. and 3. Row blocks: every rank of the table's group gets a slot per feature.
        let mut row_wise = 0;
        let mut twrw = vec![0; hosts];
        let row_slot = |t: usize, f: usize, rank: usize, route: Route| -> Slot {
            let ts = sharding[t];
            let shard = ts.shards.iter().position(|s| s.rank == rank);
            let (row_offset, rows) = match shard {
                Some(k) => (ts.shards[k].row_offset, ts.shards[k].rows),
                None => (shapes[t].rows, 0),
            };
            Slot {
                feature: f,
                table: t,
                shard,
                route,
                row_offset,
                rows,
                col_offset: 0,
                cols: shapes[t].dim,
                out_col: feats[f].col,
            }
        };
        for (t, ts) in sharding.iter().enumerate() {
            if ts.sharding_type == ShardingType::RowWise {
                for &f in &per_table_features[t] {
                    row_wise += 1;
                    for (rank, rank_slots) in slots.iter_mut().enumerate() {
                        rank_slots.push(row_slot(t, f, rank, Route::RowWise));
                    }
                }
            }
        }
        for (t, ts) in sharding.iter().enumerate() {
            if ts.sharding_type == ShardingType::TableRowWise {
                let host = plan.host_of(ts.shards[0].rank);
                for &f in &per_table_features[t] {
                    twrw[host] += 1;
                    let members = slots.iter_mut().enumerate().skip(host * local).take(local);
                    for (rank, rank_slots) in members {
                        rank_slots.push(row_slot(t, f, rank, Route::TwRw { host }));
                    }
                }
            }
        }
        Ok(Routing {
            world,
            local,
            features: feats,
            slots,
            owned,
            row_wise,
            twrw,
            replicated,
            width: col,
        })
    }

    /// Whether any table has a slot (an input distribution runs).
    pub fn has_slots(&self) -> bool {
        self.slots.iter().any(|s| !s.is_empty())
    }

    /// Whether any table is table-row-wise (the host groups exist).
    pub fn has_twrw(&self) -> bool {
        self.twrw.iter().any(|&n| n > 0)
    }

    /// Hosts in the world.
    pub fn hosts(&self) -> usize {
        self.world / self.local
    }

    /// Rank `rank`'s owned slots.
    pub fn owned_slots(&self, rank: usize) -> &[Slot] {
        &self.slots[rank][..self.owned[rank]]
    }

    /// Rank `rank`'s row-wise slots (the same features on every rank).
    pub fn row_wise_slots(&self, rank: usize) -> &[Slot] {
        let at = self.owned[rank];
        &self.slots[rank][at..at + self.row_wise]
    }

    /// Rank `rank`'s table-row-wise slots (those of its host).
    pub fn twrw_slots(&self, rank: usize) -> &[Slot] {
        &self.slots[rank][self.owned[rank] + self.row_wise..]
    }

    /// The table-row-wise slots of host `host` (as any of its ranks holds them).
    pub fn host_twrw_slots(&self, host: usize) -> &[Slot] {
        self.twrw_slots(host * self.local)
    }
}

/// Total width of `slots`.
pub(crate) fn width(slots: &[Slot]) -> usize {
    slots.iter().map(|s| s.cols).sum()
}
