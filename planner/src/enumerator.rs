//! Lists every way each table may be sharded, with each shard's cost, in TorchRec's order
//! (sharding types as the embedding-bag sharder lists them, then kernels).

use crate::config::{Problem, Table};
use crate::error::PlannerError;
use crate::estimator::{perf, storage};
use crate::shard_sizes::{shard_count, shard_rects};
use crate::types::{ComputeDevice, ComputeKernel, Shard, ShardingOption, ShardingType};

/// Sharding types the embedding-bag sharder supports on a device.
pub fn supported_sharding_types(device: ComputeDevice) -> Vec<ShardingType> {
    match device {
        ComputeDevice::Cuda => ShardingType::ALL.to_vec(),
        ComputeDevice::Cpu => vec![
            ShardingType::DataParallel,
            ShardingType::TableWise,
            ShardingType::ColumnWise,
            ShardingType::TableColumnWise,
        ],
    }
}

/// The most shards [`enumerate`] makes over all tables' sharding options.
pub const MAX_SHARD_OPTIONS: u64 = 1 << 25;

/// Kernels the sharder supports for a sharding type on a device. `quant` is offered only when
/// a constraint names it (it is an inference kernel).
pub fn supported_kernels(device: ComputeDevice, st: ShardingType) -> Vec<ComputeKernel> {
    match (device, st) {
        (_, ShardingType::DataParallel) => vec![ComputeKernel::Dense],
        (ComputeDevice::Cuda, _) => vec![
            ComputeKernel::Fused,
            ComputeKernel::FusedUvm,
            ComputeKernel::FusedUvmCaching,
            ComputeKernel::Quant,
        ],
        (ComputeDevice::Cpu, _) => vec![ComputeKernel::Fused, ComputeKernel::Quant],
    }
}

fn allowed_types(device: ComputeDevice, table: &Table) -> Vec<ShardingType> {
    let supported = supported_sharding_types(device);
    match &table.constraints.sharding_types {
        None => supported
            .into_iter()
            .filter(|t| *t != ShardingType::GridShard)
            .collect(),
        Some(wanted) => supported
            .into_iter()
            .filter(|t| wanted.contains(t))
            .collect(),
    }
}

fn allowed_kernels(device: ComputeDevice, table: &Table, st: ShardingType) -> Vec<ComputeKernel> {
    let supported = supported_kernels(device, st);
    let mut out: Vec<ComputeKernel> = match &table.constraints.compute_kernels {
        None => supported
            .into_iter()
            .filter(|k| *k != ComputeKernel::Quant)
            .collect(),
        Some(wanted) => supported
            .into_iter()
            .filter(|k| wanted.contains(k))
            .collect(),
    };
    if out.contains(&ComputeKernel::Dense) && out.contains(&ComputeKernel::Fused) {
        out.retain(|k| *k != ComputeKernel::Dense);
    }
    out
}

/// All options of one table.
pub fn enumerate_table(
    problem: &Problem,
    index: usize,
) -> Result<Vec<ShardingOption>, PlannerError> {
    let topo = &problem.topology;
    let table = &problem.tables[index];
    let mut options = Vec::new();
    let types = allowed_types(topo.compute_device, table);
    for &st in &types {
        let rects = shard_rects(
            table.rows,
            table.dim,
            st,
            topo.world_size,
            topo.local_world_size,
            table.constraints.min_partition,
        );
        let sizes: Vec<[u64; 2]> = rects.iter().map(|r| r.0).collect();
        for kernel in allowed_kernels(topo.compute_device, table, st) {
            let Some(perfs) = perf::shard_perfs(topo, table, st, kernel, &sizes) else {
                continue;
            };
            let storages = storage::shard_storages(
                topo.compute_device,
                topo.world_size,
                topo.local_world_size,
                table,
                st,
                kernel,
                &sizes,
            );
            let shards = rects
                .iter()
                .zip(perfs.into_iter().zip(storages))
                .map(|(&(size, offset), (perf, storage))| Shard {
                    size,
                    offset,
                    perf,
                    storage,
                })
                .collect();
            options.push(ShardingOption {
                table: index,
                name: table.name.clone(),
                sharding_type: st,
                compute_kernel: kernel,
                cache_load_factor: table.constraints.cache_load_factor,
                shards,
            });
        }
    }
    if options.is_empty() {
        let reason = if types.is_empty() {
            format!(
                "constraint sharding_types {:?} allows none of the types the {} sharder supports ({:?})",
                table.constraints.sharding_types.as_deref().unwrap_or(&[]),
                topo.compute_device.as_str(),
                supported_sharding_types(topo.compute_device)
            )
        } else {
            format!(
                "constraint compute_kernels {:?} allows no kernel for sharding types {:?} on {}",
                table.constraints.compute_kernels.as_deref().unwrap_or(&[]),
                types,
                topo.compute_device.as_str()
            )
        };
        return Err(PlannerError::NoOptions {
            table: table.name.clone(),
            reason,
        });
    }
    Ok(options)
}

/// All options of all tables, table by table.
pub fn enumerate(problem: &Problem) -> Result<Vec<Vec<ShardingOption>>, PlannerError> {
    // Counted before any is made: tables × options × shards can be past any memory (a
    // thousand tables on 65536 ranks, or grid shards of a wide table, aborted the process).
    let topo = &problem.topology;
    let mut shards = 0u64;
    for table in &problem.tables {
        for st in allowed_types(topo.compute_device, table) {
            let kernels = allowed_kernels(topo.compute_device, table, st).len() as u64;
            let count = shard_count(
                table.dim,
                st,
                topo.world_size,
                topo.local_world_size,
                table.constraints.min_partition,
            );
            shards = shards.saturating_add(count.saturating_mul(kernels));
        }
    }
    if shards > MAX_SHARD_OPTIONS {
        return Err(PlannerError::Config {
            field: "tables".into(),
            message: format!(
                "the search would weigh {shards} shards over the tables' sharding options (at \
                 most {MAX_SHARD_OPTIONS}, about 100 bytes each): constrain sharding_types, \
                 raise min_partition, or plan fewer tables or ranks at once"
            ),
        });
    }
    (0..problem.tables.len())
        .map(|i| enumerate_table(problem, i))
        .collect()
}
