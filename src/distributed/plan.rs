//! Sharding plans: which rank holds which rectangle of each table, read from `embers-plan`'s
//! JSON or written by hand ([`ShardingPlan::construct`], TorchRec's
//! `construct_module_sharding_plan`), and checked against the tables before anything runs.

use std::path::{Path, PathBuf};

pub use embers_planner::types::{ComputeKernel, ShardingType};

use crate::embedding::CachePolicy;

use crate::error::{Error, Result};

const OP: &str = "ShardingPlan";

/// One rectangle of a table and the rank that holds it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Shard {
    /// The rank holding it.
    pub rank: usize,
    /// First row.
    pub row_offset: usize,
    /// Rows (may be 0 for a row-wise shard past the table's end).
    pub rows: usize,
    /// First column.
    pub col_offset: usize,
    /// Columns.
    pub cols: usize,
}

/// How one table is sharded.
#[derive(Clone, Debug, PartialEq)]
pub struct TableSharding {
    /// Table name.
    pub name: String,
    /// Sharding type.
    pub sharding_type: ShardingType,
    /// The compute kernel, which says where each rank keeps its shards of the table: in
    /// memory (`dense` for data-parallel replicas, `fused`), or behind a cache over rows in
    /// files or host memory (`fused_uvm`: the smallest cache; `fused_uvm_caching`: a cache of
    /// `cache_load_factor` × the shard's rows; see [`ShardCaches`]).
    pub compute_kernel: ComputeKernel,
    /// The cached fraction of a `fused_uvm_caching` table's rows (`None`: FBGEMM's 0.2).
    pub cache_load_factor: Option<f64>,
    /// The shards, in the plan's order.
    pub shards: Vec<Shard>,
}

/// Where a rank keeps the rows of the tables its plan gives a cached kernel (`fused_uvm`,
/// `fused_uvm_caching`): in files under `dir`, one per group of the rank's shards (named by
/// collection kind, rank and group, so ranks may share the directory, but two collections of
/// one kind need a directory each: the second is refused, its files being in use), or in
/// anonymous host memory
/// when `dir` is empty (the default; FBGEMM's `MANAGED_CACHING` rows). Each file sits behind
/// a DRAM cache of the plan's size with `policy`. Training is the same, bit for bit, wherever
/// the rows live.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ShardCaches {
    /// The row files' directory (created if needed); empty: host memory.
    pub dir: PathBuf,
    /// The caches' replacement policy.
    pub policy: CachePolicy,
    /// The device the collection will run on. On a GPU, shards the plan gives `fused_uvm`
    /// keep their tables in managed memory once the collection moves there (FBGEMM's
    /// `MANAGED`; built on the host in memory); on the host (the default), in a file behind the
    /// smallest cache.
    pub device: crate::Device,
}

/// Where every table of a collection lives across `world_size` ranks, `local_world_size` per
/// host (ranks `h·L .. h·L+L-1` are host `h`).
#[derive(Clone, Debug, PartialEq)]
pub struct ShardingPlan {
    /// Ranks in the job.
    pub world_size: usize,
    /// Ranks per host.
    pub local_world_size: usize,
    /// One entry per table.
    pub tables: Vec<TableSharding>,
}

/// A hand-written placement of one table ([`ShardingPlan::construct`]), TorchRec's
/// `table_wise(rank=…)`, `row_wise()`, … helpers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Placement {
    /// A full replica on every rank.
    DataParallel,
    /// The whole table on `rank`.
    TableWise {
        /// The rank holding it.
        rank: usize,
    },
    /// Equal column blocks, block `i` on `ranks[i]` (a rank may repeat).
    ColumnWise {
        /// One rank per block.
        ranks: Vec<usize>,
    },
    /// Column blocks as [`ColumnWise`](Self::ColumnWise), every rank on one host.
    TableColumnWise {
        /// One rank per block.
        ranks: Vec<usize>,
    },
    /// Row blocks of `ceil(rows / W)` over every rank (the last ones may be short or empty).
    RowWise,
    /// Row blocks of `ceil(rows / L)` over the `L` ranks of host `host`.
    TableRowWise {
        /// The host.
        host: usize,
    },
}

/// A table's name and shape, as a plan is checked against it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TableShape {
    /// Name.
    pub name: String,
    /// Rows.
    pub rows: usize,
    /// Columns (embedding dim).
    pub dim: usize,
}

impl TableShape {
    /// A shape.
    pub fn new(name: impl Into<String>, rows: usize, dim: usize) -> TableShape {
        TableShape {
            name: name.into(),
            rows,
            dim,
        }
    }
}

/// Row blocks of `ceil(rows / n)` (TorchRec's: 10 rows over 4 → 3, 3, 3, 1).
fn row_blocks(rows: usize, n: usize) -> Vec<(usize, usize)> {
    let block = rows.div_ceil(n.max(1));
    let mut offset = 0;
    (0..n)
        .map(|_| {
            let size = block.min(rows - offset);
            offset += size;
            (offset - size, size)
        })
        .collect()
}

impl ShardingPlan {
    /// A plan written by hand: one [`Placement`] per table (every table of `tables` needs
    /// one), kept in memory (kernel `dense` for data-parallel tables, `fused` for the others,
    /// as TorchRec's `construct_module_sharding_plan`; [`with_kernel`](Self::with_kernel)
    /// changes it). The result is [`check`](Self::check)ed.
    pub fn construct(
        tables: &[TableShape],
        placements: &[(&str, Placement)],
        world_size: usize,
        local_world_size: usize,
    ) -> Result<ShardingPlan> {
        check_world(world_size, local_world_size)?;
        let mut out = Vec::with_capacity(tables.len());
        for table in tables {
            let placement = (placements.iter())
                .find(|(name, _)| *name == table.name)
                .map(|(_, p)| p)
                .ok_or_else(|| {
                    Error::invalid(OP, format!("table `{}` has no placement", table.name))
                })?;
            let full = |rank| Shard {
                rank,
                row_offset: 0,
                rows: table.rows,
                col_offset: 0,
                cols: table.dim,
            };
            let row_shards = |ranks: Vec<usize>| {
                (row_blocks(table.rows, ranks.len()).into_iter().zip(ranks))
                    .map(|((row_offset, rows), rank)| Shard {
                        rank,
                        row_offset,
                        rows,
                        col_offset: 0,
                        cols: table.dim,
                    })
                    .collect::<Vec<_>>()
            };
            let col_shards = |ranks: &[usize]| -> Result<Vec<Shard>> {
                let n = ranks.len();
                if n == 0 || table.dim % n != 0 {
                    return Err(Error::invalid(
                        OP,
                        format!(
                            "table `{}`: {} columns do not split into {n} equal blocks",
                            table.name, table.dim
                        ),
                    ));
                }
                let cols = table.dim / n;
                Ok((ranks.iter().enumerate())
                    .map(|(i, &rank)| Shard {
                        rank,
                        row_offset: 0,
                        rows: table.rows,
                        col_offset: i * cols,
                        cols,
                    })
                    .collect())
            };
            let (sharding_type, shards) = match placement {
                Placement::DataParallel => (
                    ShardingType::DataParallel,
                    (0..world_size).map(full).collect(),
                ),
                Placement::TableWise { rank } => (ShardingType::TableWise, vec![full(*rank)]),
                Placement::ColumnWise { ranks } => (ShardingType::ColumnWise, col_shards(ranks)?),
                Placement::TableColumnWise { ranks } => {
                    (ShardingType::TableColumnWise, col_shards(ranks)?)
                }
                Placement::RowWise => {
                    (ShardingType::RowWise, row_shards((0..world_size).collect()))
                }
                Placement::TableRowWise { host } => {
                    let first = (host.checked_mul(local_world_size))
                        .filter(|&f| f < world_size)
                        .ok_or_else(|| {
                            Error::invalid(
                                OP,
                                format!(
                                    "table `{}`: host {host} is not one of the {} hosts",
                                    table.name,
                                    world_size / local_world_size.max(1)
                                ),
                            )
                        })?;
                    (
                        ShardingType::TableRowWise,
                        row_shards((first..first + local_world_size).collect()),
                    )
                }
            };
            out.push(TableSharding {
                name: table.name.clone(),
                sharding_type,
                compute_kernel: if sharding_type == ShardingType::DataParallel {
                    ComputeKernel::Dense
                } else {
                    ComputeKernel::Fused
                },
                cache_load_factor: None,
                shards,
            });
        }
        if let Some((name, _)) =
            (placements.iter()).find(|(n, _)| !tables.iter().any(|t| t.name == *n))
        {
            return Err(Error::invalid(
                OP,
                format!("a placement names `{name}`, which is not a table"),
            ));
        }
        let plan = ShardingPlan {
            world_size,
            local_world_size,
            tables: out,
        };
        plan.check(tables)?;
        Ok(plan)
    }

    /// The plan `embers-plan` found.
    pub fn from_planner(plan: &embers_planner::Plan) -> Result<ShardingPlan> {
        check_world(plan.world_size, plan.local_world_size)?;
        let usize_of = |table: &str, v: u64| {
            usize::try_from(v).map_err(|_| {
                Error::invalid(
                    OP,
                    format!("table `{table}`: {v} does not fit this machine"),
                )
            })
        };
        let tables = (plan.tables.iter())
            .map(|t| {
                // Two lists of the same ranks: one edited without the other is refused (the
                // shards' ranks placed the table, `ranks` was ignored).
                if !t.ranks.iter().eq(t.shards.iter().map(|s| &s.rank)) {
                    return Err(Error::invalid(
                        OP,
                        format!(
                            "table `{}`: its ranks {:?} are not its shards' ranks {:?}",
                            t.name,
                            t.ranks,
                            t.shards.iter().map(|s| s.rank).collect::<Vec<_>>()
                        ),
                    ));
                }
                let shards = (t.shards.iter())
                    .map(|s| {
                        Ok(Shard {
                            rank: s.rank,
                            row_offset: usize_of(&t.name, s.offset[0])?,
                            rows: usize_of(&t.name, s.size[0])?,
                            col_offset: usize_of(&t.name, s.offset[1])?,
                            cols: usize_of(&t.name, s.size[1])?,
                        })
                    })
                    .collect::<Result<_>>()?;
                Ok(TableSharding {
                    name: t.name.clone(),
                    sharding_type: t.sharding_type,
                    compute_kernel: t.compute_kernel,
                    cache_load_factor: t.cache_load_factor,
                    shards,
                })
            })
            .collect::<Result<_>>()?;
        Ok(ShardingPlan {
            world_size: plan.world_size,
            local_world_size: plan.local_world_size,
            tables,
        })
    }

    /// A plan from `embers-plan plan --output`'s JSON.
    pub fn from_json(json: &str) -> Result<ShardingPlan> {
        let plan = embers_planner::Plan::from_json(json)
            .map_err(|e| Error::invalid(OP, format!("not an embers-plan plan: {e}")))?;
        ShardingPlan::from_planner(&plan)
    }

    /// Reads a plan file written by `embers-plan plan --output`.
    pub fn load(path: impl AsRef<Path>) -> Result<ShardingPlan> {
        let path = path.as_ref();
        let json = std::fs::read_to_string(path).map_err(|source| Error::Io {
            path: path.display().to_string(),
            source,
        })?;
        ShardingPlan::from_json(&json)
            .map_err(|e| Error::invalid(OP, format!("{}: {e}", path.display())))
    }

    /// The same plan with table `name` on compute kernel `kernel` (and, for
    /// `fused_uvm_caching`, `cache_load_factor`), e.g. a hand-written plan whose large tables
    /// live in files behind a cache. Errors: no such table.
    pub fn with_kernel(
        mut self,
        name: &str,
        kernel: ComputeKernel,
        cache_load_factor: Option<f64>,
    ) -> Result<ShardingPlan> {
        let t = (self.tables.iter_mut())
            .find(|t| t.name == name)
            .ok_or_else(|| Error::invalid(OP, format!("the plan has no table `{name}`")))?;
        t.compute_kernel = kernel;
        t.cache_load_factor = cache_load_factor;
        Ok(self)
    }

    /// The sharding of table `name`.
    pub fn table(&self, name: &str) -> Option<&TableSharding> {
        self.tables.iter().find(|t| t.name == name)
    }

    /// Every table's sharding by name (the last of a repeated name): for lookups of many
    /// tables, which [`table`](Self::table) does one scan at a time.
    pub fn by_name(&self) -> std::collections::HashMap<&str, &TableSharding> {
        (self.tables.iter()).map(|t| (t.name.as_str(), t)).collect()
    }

    /// The host of `rank`.
    pub fn host_of(&self, rank: usize) -> usize {
        rank / self.local_world_size
    }

    /// Checks the plan against the tables it shards: every table placed once (and no other),
    /// shapes tiled exactly by the shards of a supported sharding type, ranks inside the
    /// world, host-bound types inside one host. Errors name the table and shard.
    pub fn check(&self, tables: &[TableShape]) -> Result<()> {
        check_world(self.world_size, self.local_world_size)?;
        // By name, through maps: a plan file of many tables is checked in linear time.
        let here: std::collections::HashSet<&str> =
            tables.iter().map(|s| s.name.as_str()).collect();
        let placed = self.by_name();
        if placed.len() < self.tables.len() {
            let mut seen = std::collections::HashSet::new();
            if let Some(t) = self.tables.iter().find(|t| !seen.insert(t.name.as_str())) {
                return Err(Error::invalid(
                    OP,
                    format!("the plan lists table `{}` twice", t.name),
                ));
            }
        }
        if let Some(t) = self.tables.iter().find(|t| !here.contains(t.name.as_str())) {
            return Err(Error::invalid(
                OP,
                format!("the plan shards `{}`, which is not a table here", t.name),
            ));
        }
        for shape in tables {
            let t = placed.get(shape.name.as_str()).ok_or_else(|| {
                Error::invalid(
                    OP,
                    format!("the plan does not place table `{}`", shape.name),
                )
            })?;
            self.check_table(t, shape)?;
        }
        Ok(())
    }

    fn check_table(&self, t: &TableSharding, shape: &TableShape) -> Result<()> {
        let fail = |what: String| {
            Err(Error::invalid(
                OP,
                format!(
                    "table `{}` ({} × {}, {}): {what}",
                    t.name, shape.rows, shape.dim, t.sharding_type
                ),
            ))
        };
        if t.shards.is_empty() {
            return fail("no shards".into());
        }
        for (i, s) in t.shards.iter().enumerate() {
            if s.rank >= self.world_size {
                return fail(format!(
                    "shard {i} is on rank {}, but the world has {} ranks",
                    s.rank, self.world_size
                ));
            }
        }
        let kernel = t.compute_kernel;
        match (t.sharding_type, kernel) {
            (_, ComputeKernel::Quant) => {
                return fail(
                    "kernel `quant` is for inference; a sharded training collection runs \
                     dense, fused, fused_uvm or fused_uvm_caching"
                        .into(),
                )
            }
            (ShardingType::DataParallel, ComputeKernel::Dense | ComputeKernel::Fused) => {}
            (ShardingType::DataParallel, _) => {
                return fail(format!(
                    "data-parallel replicas live in memory (dense or fused), not `{}`",
                    kernel.as_str()
                ))
            }
            (_, ComputeKernel::Dense) => {
                return fail("kernel `dense` is for data-parallel tables".into())
            }
            _ => {}
        }
        if let Some(f) = t.cache_load_factor {
            if !(f > 0.0 && f <= 1.0) {
                return fail(format!("cache load factor {f} is not in (0, 1]"));
            }
        }
        let full = |s: &Shard| {
            s.row_offset == 0 && s.rows == shape.rows && s.col_offset == 0 && s.cols == shape.dim
        };
        let one_host = |t: &TableSharding| {
            let host = self.host_of(t.shards[0].rank);
            t.shards.iter().all(|s| self.host_of(s.rank) == host)
        };
        let distinct_ranks = |t: &TableSharding| {
            let mut ranks: Vec<usize> = t.shards.iter().map(|s| s.rank).collect();
            ranks.sort_unstable();
            ranks.windows(2).all(|w| w[0] != w[1])
        };
        match t.sharding_type {
            ShardingType::GridShard => {
                return fail("grid sharding is not supported; plan without it".into())
            }
            ShardingType::DataParallel | ShardingType::TableWise => {
                if let Some(i) = t.shards.iter().position(|s| !full(s)) {
                    return fail(format!("shard {i} is not the whole table"));
                }
                if t.sharding_type == ShardingType::TableWise && t.shards.len() != 1 {
                    return fail(format!("{} shards, table-wise needs one", t.shards.len()));
                }
                if t.sharding_type == ShardingType::DataParallel
                    && (t.shards.len() != self.world_size || !distinct_ranks(t))
                {
                    return fail(format!(
                        "data-parallel needs one shard on each of the {} ranks, got ranks {:?}",
                        self.world_size,
                        t.shards.iter().map(|s| s.rank).collect::<Vec<_>>()
                    ));
                }
            }
            ShardingType::ColumnWise | ShardingType::TableColumnWise => {
                let mut by_col: Vec<&Shard> = t.shards.iter().collect();
                by_col.sort_by_key(|s| s.col_offset);
                let mut at = 0;
                for s in by_col {
                    if s.row_offset != 0 || s.rows != shape.rows || s.cols == 0 {
                        return fail(format!(
                            "the shard at column {} is not a block of whole columns",
                            s.col_offset
                        ));
                    }
                    if s.col_offset != at {
                        return fail(format!(
                            "columns {at}.. are covered {} (next shard starts at {})",
                            if s.col_offset < at {
                                "twice"
                            } else {
                                "by no shard"
                            },
                            s.col_offset
                        ));
                    }
                    at = match at.checked_add(s.cols).filter(|&a| a <= shape.dim) {
                        Some(a) => a,
                        None => {
                            return fail(format!(
                                "the shard at column {} runs past the table's {} columns",
                                s.col_offset, shape.dim
                            ))
                        }
                    };
                }
                if at != shape.dim {
                    return fail(format!("the shards cover {at} of {} columns", shape.dim));
                }
                if t.sharding_type == ShardingType::TableColumnWise && !one_host(t) {
                    return fail("the shards span several hosts".into());
                }
            }
            ShardingType::RowWise | ShardingType::TableRowWise => {
                let mut at = 0;
                for (i, s) in t.shards.iter().enumerate() {
                    if s.col_offset != 0 || s.cols != shape.dim {
                        return fail(format!("shard {i} is not a block of whole rows"));
                    }
                    // An empty block too sits where the blocks before it end (as TorchRec
                    // places them), never at some row outside the table.
                    if s.row_offset != at {
                        return fail(format!(
                            "shard {i} starts at row {}, expected {at} (row blocks in shard \
                             order, no gaps or overlaps)",
                            s.row_offset
                        ));
                    }
                    at = match at.checked_add(s.rows).filter(|&a| a <= shape.rows) {
                        Some(a) => a,
                        None => {
                            return fail(format!(
                                "shard {i} runs past the table's {} rows",
                                shape.rows
                            ))
                        }
                    };
                }
                if at != shape.rows {
                    return fail(format!("the shards cover {at} of {} rows", shape.rows));
                }
                if !distinct_ranks(t) {
                    return fail("two row blocks on one rank".into());
                }
                if t.sharding_type == ShardingType::TableRowWise && !one_host(t) {
                    return fail("the shards span several hosts".into());
                }
            }
        }
        Ok(())
    }

    /// A digest of the plan and the tables' shapes, features and pooling (`extra`): ranks
    /// compare it before they build anything.
    pub fn digest(&self, extra: &str) -> u64 {
        let mut text = format!("{} {} {extra}", self.world_size, self.local_world_size);
        for t in &self.tables {
            text.push_str(&format!(
                "|{} {} {} {:?}",
                t.name,
                t.sharding_type,
                t.compute_kernel.as_str(),
                t.cache_load_factor.map(f64::to_bits)
            ));
            for s in &t.shards {
                text.push_str(&format!(
                    " {}:{}+{}:{}+{}",
                    s.rank, s.row_offset, s.rows, s.col_offset, s.cols
                ));
            }
        }
        fnv1a(text.as_bytes())
    }
}

/// FNV-1a, 64 bits: a stable hash (the same on every machine and build).
pub(crate) fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

fn check_world(world_size: usize, local_world_size: usize) -> Result<()> {
    if world_size == 0 || local_world_size == 0 || world_size % local_world_size != 0 {
        return Err(Error::invalid(
            OP,
            format!(
                "a world of {world_size} ranks does not split into hosts of \
                 {local_world_size}"
            ),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shapes() -> Vec<TableShape> {
        vec![TableShape::new("t0", 10, 8), TableShape::new("t1", 7, 16)]
    }

    #[test]
    fn row_blocks_follow_torchrec() {
        assert_eq!(row_blocks(10, 4), vec![(0, 3), (3, 3), (6, 3), (9, 1)]);
        assert_eq!(row_blocks(2, 4), vec![(0, 1), (1, 1), (2, 0), (2, 0)]);
    }

    #[test]
    fn constructed_plans_pass_their_check_and_bad_ones_name_the_table() {
        let plan = ShardingPlan::construct(
            &shapes(),
            &[
                ("t0", Placement::RowWise),
                ("t1", Placement::ColumnWise { ranks: vec![1, 0] }),
            ],
            2,
            2,
        )
        .unwrap();
        assert_eq!(plan.tables[1].shards[0].rank, 1);
        assert_eq!(plan.tables[1].shards[1].col_offset, 8);
        let mut bad = plan.clone();
        bad.tables[0].shards[1].rows = 4;
        let e = bad.check(&shapes()).unwrap_err().to_string();
        assert!(
            e.contains("`t0`") && e.contains("cover 9 of 10 rows"),
            "{e}"
        );
        let mut bad = plan.clone();
        bad.tables[1].shards[0].rank = 2;
        let e = bad.check(&shapes()).unwrap_err().to_string();
        assert!(e.contains("`t1`") && e.contains("rank 2"), "{e}");
        let e = ShardingPlan::construct(&shapes(), &[("t0", Placement::RowWise)], 2, 2)
            .unwrap_err()
            .to_string();
        assert!(e.contains("`t1` has no placement"), "{e}");
        let e = ShardingPlan::construct(
            &shapes(),
            &[
                ("t0", Placement::TableRowWise { host: 0 }),
                ("t1", Placement::TableColumnWise { ranks: vec![0, 2] }),
            ],
            4,
            2,
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("`t1`") && e.contains("several hosts"), "{e}");
        assert!(ShardingPlan::construct(&shapes(), &[], 3, 2).is_err());
        // Sizes that wrap a running total back to the table's size (an edited plan file).
        let mut bad = plan.clone();
        bad.tables[0].shards[0].rows = usize::MAX;
        bad.tables[0].shards[1].row_offset = usize::MAX;
        bad.tables[0].shards[1].rows = 11;
        let e = bad.check(&shapes()).unwrap_err().to_string();
        assert!(
            e.contains("`t0`") && e.contains("runs past the table's 10 rows"),
            "{e}"
        );
        let mut bad = plan.clone();
        bad.tables[1].shards[0].cols = usize::MAX;
        bad.tables[1].shards[1].col_offset = usize::MAX;
        bad.tables[1].shards[1].cols = 17;
        let e = bad.check(&shapes()).unwrap_err().to_string();
        assert!(
            e.contains("`t1`") && e.contains("runs past the table's 16 columns"),
            "{e}"
        );
        let e = ShardingPlan::construct(
            &shapes(),
            &[
                (
                    "t0",
                    Placement::TableRowWise {
                        host: usize::MAX / 2 + 1,
                    },
                ),
                ("t1", Placement::RowWise),
            ],
            4,
            2,
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("`t0`") && e.contains("not one of the 2 hosts"),
            "{e}"
        );
        // Tables placed twice, placed but not here, here but not placed: each named.
        let plan = ShardingPlan::construct(
            &shapes(),
            &[("t0", Placement::RowWise), ("t1", Placement::RowWise)],
            2,
            2,
        )
        .unwrap();
        let mut bad = plan.clone();
        bad.tables.push(bad.tables[0].clone());
        let e = bad.check(&shapes()).unwrap_err().to_string();
        assert!(e.contains("lists table `t0` twice"), "{e}");
        let e = plan.check(&shapes()[..1]).unwrap_err().to_string();
        assert!(e.contains("shards `t1`, which is not a table here"), "{e}");
        let mut bad = plan.clone();
        bad.tables.pop();
        let e = bad.check(&shapes()).unwrap_err().to_string();
        assert!(e.contains("does not place table `t1`"), "{e}");
        // An empty row block sits where the blocks before it end, not outside the table.
        let small = vec![TableShape::new("s", 2, 4)];
        let plan = ShardingPlan::construct(&small, &[("s", Placement::RowWise)], 4, 2).unwrap();
        assert_eq!(plan.tables[0].shards[3].rows, 0);
        let mut bad = plan.clone();
        bad.tables[0].shards[3].row_offset = 99_999_999;
        let e = bad.check(&small).unwrap_err().to_string();
        assert!(
            e.contains("`s`") && e.contains("shard 3 starts at row 99999999, expected 2"),
            "{e}"
        );
    }

    #[test]
    fn plans_from_the_planner_round_trip_through_json() {
        let config = r#"
            batch_size = 512
            [topology]
            world_size = 4
            local_world_size = 2
            compute_device = "cpu"
            [[tables]]
            name = "a"
            rows = 1000
            dim = 64
            [[tables]]
            name = "b"
            rows = 100000
            dim = 128
        "#;
        let problem = embers_planner::Config::from_toml(config)
            .and_then(|c| c.resolve())
            .unwrap();
        let plan =
            embers_planner::plan_problem(&problem, embers_planner::CostModel::default()).unwrap();
        let sharding = ShardingPlan::from_json(&plan.to_json()).unwrap();
        assert_eq!(sharding.world_size, 4);
        let shapes = vec![
            TableShape::new("a", 1000, 64),
            TableShape::new("b", 100000, 128),
        ];
        sharding.check(&shapes).unwrap();
        assert_eq!(sharding, ShardingPlan::from_planner(&plan).unwrap());
        assert!(ShardingPlan::from_json("{\"tables\": 3}").is_err());

        // A table's `ranks` edited without its shards' (it was ignored).
        let mut edited = plan.clone();
        let t = &mut edited.tables[0];
        t.ranks[0] = (t.ranks[0] + 1) % 4;
        let e = ShardingPlan::from_planner(&edited).unwrap_err().to_string();
        assert!(e.contains("are not its shards' ranks"), "{e}");
        // A data-parallel table on some ranks only, or twice on one (it was replicated on
        // every rank all the same).
        let dp = ShardingPlan::construct(&shapes[..1], &[("a", Placement::DataParallel)], 4, 2);
        let dp = dp.unwrap();
        for ranks in [vec![0], vec![0, 1, 2, 2]] {
            let mut bad = dp.clone();
            let whole = bad.tables[0].shards[0].clone();
            bad.tables[0].shards = (ranks.iter())
                .map(|&rank| Shard {
                    rank,
                    ..whole.clone()
                })
                .collect();
            let e = bad.check(&shapes[..1]).unwrap_err().to_string();
            assert!(
                e.contains("one shard on each of the 4 ranks"),
                "{ranks:?}: {e}"
            );
        }
        dp.check(&shapes[..1]).unwrap();
    }

    #[test]
    fn the_planners_kernels_reach_the_plan_and_bad_ones_are_refused() {
        let config = r#"
            batch_size = 512
            [topology]
            world_size = 2
            local_world_size = 2
            compute_device = "cuda"
            [[tables]]
            name = "a"
            rows = 1000
            dim = 64
            [tables.constraints]
            sharding_types = ["table_wise"]
            compute_kernels = ["fused_uvm_caching"]
            cache_load_factor = 0.3
            [[tables]]
            name = "b"
            rows = 100
            dim = 16
            [tables.constraints]
            sharding_types = ["row_wise"]
            compute_kernels = ["fused_uvm"]
        "#;
        let problem = embers_planner::Config::from_toml(config)
            .and_then(|c| c.resolve())
            .unwrap();
        let plan =
            embers_planner::plan_problem(&problem, embers_planner::CostModel::default()).unwrap();
        let sharding = ShardingPlan::from_json(&plan.to_json()).unwrap();
        let a = sharding.table("a").unwrap();
        assert_eq!(a.compute_kernel, ComputeKernel::FusedUvmCaching);
        assert_eq!(a.cache_load_factor, Some(0.3));
        assert_eq!(
            sharding.table("b").unwrap().compute_kernel,
            ComputeKernel::FusedUvm
        );
        let planned = [
            TableShape::new("a", 1000, 64),
            TableShape::new("b", 100, 16),
        ];
        sharding.check(&planned).unwrap();

        // Hand-written plans: dense replicas, fused shards, then any kernel by name.
        let plan = ShardingPlan::construct(
            &shapes(),
            &[
                ("t0", Placement::DataParallel),
                ("t1", Placement::TableWise { rank: 1 }),
            ],
            2,
            2,
        )
        .unwrap();
        assert_eq!(plan.tables[0].compute_kernel, ComputeKernel::Dense);
        assert_eq!(plan.tables[1].compute_kernel, ComputeKernel::Fused);
        let cached = (plan.clone())
            .with_kernel("t1", ComputeKernel::FusedUvmCaching, Some(0.5))
            .unwrap();
        cached.check(&shapes()).unwrap();
        assert_ne!(
            cached.digest(""),
            plan.digest(""),
            "ranks must agree on kernels"
        );
        let e = plan.clone().with_kernel("t9", ComputeKernel::Fused, None);
        assert!(e.unwrap_err().to_string().contains("no table `t9`"));
        for (table, kernel, load, words) in [
            ("t1", ComputeKernel::Quant, None, "`quant` is for inference"),
            (
                "t0",
                ComputeKernel::FusedUvmCaching,
                None,
                "data-parallel replicas live in memory",
            ),
            (
                "t1",
                ComputeKernel::Dense,
                None,
                "`dense` is for data-parallel tables",
            ),
            (
                "t1",
                ComputeKernel::FusedUvmCaching,
                Some(0.0),
                "cache load factor 0 is not in",
            ),
            (
                "t1",
                ComputeKernel::FusedUvmCaching,
                Some(f64::NAN),
                "is not in (0, 1]",
            ),
        ] {
            let bad = plan.clone().with_kernel(table, kernel, load).unwrap();
            let e = bad.check(&shapes()).unwrap_err().to_string();
            assert!(
                e.contains(words) && e.contains(&format!("`{table}`")),
                "{e}"
            );
        }
    }
}
