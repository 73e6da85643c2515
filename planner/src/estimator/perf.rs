//! TorchRec 1.9.2's wall-time model of one shard, reproduced term by term.
//!
//! Every cost is bytes moved divided by a bandwidth (bytes/ms). Forward compute reads the
//! indices, gathers the rows and writes the outputs through the kernel's memory bandwidth;
//! backward compute is a multiple of forward; communications divide the output bytes by the
//! link bandwidth of the collective each sharding type uses. The floating-point operations are
//! done in TorchRec's order so results agree to the last bits.

use crate::config::Table;
use crate::estimator::cache_stats::expected_miss_rate;
use crate::topology::{Collective, Topology};
use crate::types::{ComputeDevice, ComputeKernel, Perf, ShardingType};

/// Bytes per input index (TBE widens indices to int64).
pub const INDEX_BYTES: f64 = 8.0;
/// Default HBM share of a cached table's bandwidth mix when no load factor is given.
pub const DEFAULT_CACHE_LOAD_FACTOR: f64 = 0.2;
const BATCHED_COPY_PERF_FACTOR: f64 = 2.455;
const FULL_BLOCK_EMB_DIM: u64 = 128;
const HALF_BLOCK_PENALTY: f64 = 1.15;
const QUARTER_BLOCK_PENALTY: f64 = 1.75;
const WEIGHTED_KERNEL_MULTIPLIER: f64 = 1.1;
const DP_ELEMENTWISE_KERNELS_PERF_FACTOR: f64 = 9.22;

/// Memory bandwidth a kernel sees on a device, or `None` if the kernel cannot run there.
pub fn kernel_bandwidth(
    topology: &Topology,
    kernel: ComputeKernel,
    cache_load_factor: Option<f64>,
) -> Option<f64> {
    let r = cache_load_factor.unwrap_or(DEFAULT_CACHE_LOAD_FACTOR);
    let t = topology;
    match (t.compute_device, kernel) {
        (ComputeDevice::Cpu, ComputeKernel::Dense) => Some(0.5 * t.ddr_mem_bw),
        (ComputeDevice::Cpu, ComputeKernel::Fused | ComputeKernel::Quant) => Some(t.ddr_mem_bw),
        (ComputeDevice::Cpu, _) => None,
        (ComputeDevice::Cuda, ComputeKernel::Dense) => Some(0.5 * t.hbm_mem_bw),
        (ComputeDevice::Cuda, ComputeKernel::Fused | ComputeKernel::Quant) => Some(t.hbm_mem_bw),
        (ComputeDevice::Cuda, ComputeKernel::FusedUvm) => Some(t.hbm_to_ddr_mem_bw / 10.0),
        (ComputeDevice::Cuda, ComputeKernel::FusedUvmCaching) => {
            Some((r * t.hbm_mem_bw + (1.0 - r) * t.hbm_to_ddr_mem_bw) / 10.0)
        }
    }
}

fn block_penalty(dim: u64) -> f64 {
    if dim >= FULL_BLOCK_EMB_DIM {
        1.0
    } else if dim >= 64 {
        HALF_BLOCK_PENALTY
    } else {
        QUARTER_BLOCK_PENALTY
    }
}

/// Sum over features of ids per batch (pooling factor x poolings x batch size).
pub fn batch_inputs(table: &Table) -> f64 {
    let mut s = 0.0;
    for ((il, np), bs) in table
        .input_lengths
        .iter()
        .zip(&table.num_poolings)
        .zip(&table.batch_sizes)
    {
        s += il * np * *bs as f64;
    }
    s
}

/// Sum over features of output rows per batch; a pooled feature with fewer than one id per
/// sample produces that fraction of a row.
pub fn batch_outputs(table: &Table) -> f64 {
    if !table.pooled {
        return batch_inputs(table);
    }
    let mut s = 0.0;
    for ((il, np), bs) in table
        .input_lengths
        .iter()
        .zip(&table.num_poolings)
        .zip(&table.batch_sizes)
    {
        s += il.min(1.0) * np * *bs as f64;
    }
    s
}

/// Per-option quantities shared by all of its shards.
struct Ctx<'a> {
    topo: &'a Topology,
    st: ShardingType,
    bi: f64,
    bo: f64,
    w: f64,
    weighted: bool,
    pooled: bool,
    elem: f64,
    device_bw: f64,
    cache_fetches: Option<f64>,
}

impl Ctx<'_> {
    fn divisor(&self) -> f64 {
        match self.st {
            ShardingType::RowWise => self.w,
            ShardingType::TableRowWise | ShardingType::GridShard => {
                self.topo.local_world_size as f64
            }
            _ => 1.0,
        }
    }

    fn input_read(&self) -> f64 {
        let size = match self.st {
            ShardingType::DataParallel => (self.bi * INDEX_BYTES).ceil(),
            ShardingType::TableWise | ShardingType::ColumnWise | ShardingType::TableColumnWise => {
                (self.bi * self.w * INDEX_BYTES).ceil()
            }
            _ => (self.bi / self.divisor() * self.w * INDEX_BYTES).ceil(),
        };
        if self.weighted {
            size * 2.0
        } else {
            size
        }
    }

    fn lookup(&self, dim: u64) -> f64 {
        match self.st {
            ShardingType::DataParallel => self.bi * dim as f64 * self.elem,
            ShardingType::TableWise | ShardingType::ColumnWise | ShardingType::TableColumnWise => {
                self.bi * self.w * dim.max(32) as f64 * self.elem
            }
            _ => self.bi / self.divisor() * self.w * dim as f64 * self.elem,
        }
    }

    fn output_write(&self, dim: u64) -> f64 {
        let d = dim as f64;
        match self.st {
            ShardingType::DataParallel => self.bo * d * self.elem,
            ShardingType::TableWise | ShardingType::ColumnWise | ShardingType::TableColumnWise => {
                self.bo * self.w * d * self.elem
            }
            _ if self.pooled => self.bo * self.w * d * self.elem,
            _ => self.bo / self.divisor() * self.w * d * self.elem,
        }
    }

    fn bw(&self, world: usize, local: usize, c: Collective) -> f64 {
        self.topo.comms_bw(world, local, c)
    }

    fn shard(&self, rows: u64, dim: u64) -> Perf {
        let t = self.topo;
        let (ws, ls) = (t.world_size, t.local_world_size);
        let tw_family = matches!(
            self.st,
            ShardingType::TableWise | ShardingType::ColumnWise | ShardingType::TableColumnWise
        );
        let penalty = if tw_family { block_penalty(dim) } else { 1.0 };
        let out = self.output_write(dim);
        let size = 1.0 * self.input_read() + 1.0 * self.lookup(dim) + 1.0 * out + 0.0 * rows as f64;
        let fwd_compute = size * penalty / self.device_bw;

        let mut bwd_compute = fwd_compute * t.bwd_compute_multiplier;
        let grad_weights = if self.weighted {
            fwd_compute * WEIGHTED_KERNEL_MULTIPLIER
        } else {
            0.0
        };
        if self.weighted {
            bwd_compute *= t.weighted_feature_bwd_compute_multiplier;
        }
        let bwd_compute = bwd_compute + grad_weights;

        let (fwd_comms, bwd_comms) = match self.st {
            ShardingType::DataParallel => {
                let table_bytes = (rows * dim) as f64 * self.elem;
                let nodes = (ws as f64 / ls as f64).min(2.0);
                let mut all_reduce = table_bytes * (2.0 * nodes - 1.0)
                    / nodes
                    / self.bw(ws, ls, Collective::AllReduce);
                if ws > 2 * ls {
                    all_reduce *= 2.0;
                }
                let optimizer = table_bytes * DP_ELEMENTWISE_KERNELS_PERF_FACTOR / self.device_bw;
                (0.0, all_reduce + optimizer)
            }
            ShardingType::TableWise | ShardingType::ColumnWise | ShardingType::TableColumnWise => {
                let bw = self.bw(ws, ls, Collective::AllToAll);
                (out / bw, out / bw)
            }
            ShardingType::RowWise => {
                let fwd = out / self.bw(ws, ls, Collective::ReduceScatter);
                let bwd = out / self.bw(ws, ls, Collective::AllGather);
                let copy = out * BATCHED_COPY_PERF_FACTOR / self.device_bw;
                (fwd, bwd + copy)
            }
            ShardingType::TableRowWise | ShardingType::GridShard => {
                let group = ls;
                let groups = (ws / group).max(1);
                let intra_local = group.min(ls);
                let cross = if groups > 1 {
                    self.bo * groups as f64 * dim as f64 * self.elem
                        / self.bw(groups, 1, Collective::AllToAll)
                } else {
                    0.0
                };
                let fwd = out / self.bw(group, intra_local, Collective::ReduceScatter) + cross;
                let intra_bwd = out / self.bw(group, intra_local, Collective::AllGather);
                let copy = out * BATCHED_COPY_PERF_FACTOR / self.device_bw;
                (fwd, cross + intra_bwd + copy)
            }
        };

        let prefetch_compute = match (self.st, self.cache_fetches) {
            (ShardingType::DataParallel, _) | (_, None) => 0.0,
            (_, Some(fetches)) => {
                let per_shard = fetches / self.divisor();
                per_shard * dim as f64 * self.elem / t.hbm_to_ddr_mem_bw
            }
        };

        let input_dist_comms = if self.st == ShardingType::DataParallel {
            0.0
        } else {
            (self.bi * self.w * INDEX_BYTES).ceil() / self.bw(ws, ls, Collective::AllToAll)
        };

        Perf {
            fwd_compute,
            fwd_comms,
            bwd_compute,
            bwd_comms,
            prefetch_compute,
            input_dist_comms,
        }
    }
}

/// Perf of each shard (`[rows, cols]` sizes) of `table` under a sharding type and kernel, as
/// TorchRec's `EmbeddingPerfEstimator` computes it. `None` if the kernel has no bandwidth on
/// the topology's device.
pub fn shard_perfs(
    topology: &Topology,
    table: &Table,
    sharding_type: ShardingType,
    kernel: ComputeKernel,
    sizes: &[[u64; 2]],
) -> Option<Vec<Perf>> {
    let clf = table.constraints.cache_load_factor;
    let device_bw = kernel_bandwidth(topology, kernel, clf)?;
    let cache_fetches = match (&table.constraints.cache_stats, clf, kernel) {
        (Some(stats), Some(clf), ComputeKernel::FusedUvmCaching) => {
            Some(expected_miss_rate(stats, clf) * stats.expected_lookups)
        }
        _ => None,
    };
    let ctx = Ctx {
        topo: topology,
        st: sharding_type,
        bi: batch_inputs(table),
        bo: batch_outputs(table),
        w: topology.world_size as f64,
        weighted: table.weighted,
        pooled: table.pooled,
        elem: table.data_type.element_size() as f64,
        device_bw,
        cache_fetches,
    };
    Some(sizes.iter().map(|&[r, c]| ctx.shard(r, c)).collect())
}
