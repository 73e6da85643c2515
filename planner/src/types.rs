//! The planner's vocabulary: data types, sharding types, compute kernels, and the per-shard
//! cost records (`Perf`, `Storage`). Names and string forms follow TorchRec so plans can be read
//! by anyone who knows its planner.

use serde::{Deserialize, Serialize};
use std::fmt;

/// Element type of an embedding table's rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "UPPERCASE")]
pub enum DataType {
    /// 32-bit float.
    #[serde(alias = "fp32", alias = "float32")]
    Fp32,
    /// 16-bit IEEE half.
    #[serde(alias = "fp16", alias = "float16")]
    Fp16,
    /// bfloat16.
    #[serde(alias = "bf16", alias = "bfloat16")]
    Bf16,
    /// 8-bit float.
    #[serde(alias = "fp8")]
    Fp8,
    /// 8-bit integer (row-wise quantized).
    #[serde(alias = "int8")]
    Int8,
    /// 4-bit integer (row-wise quantized).
    #[serde(alias = "int4")]
    Int4,
}

impl DataType {
    /// Bits per element.
    pub fn bits(self) -> u32 {
        match self {
            DataType::Fp32 => 32,
            DataType::Fp16 | DataType::Bf16 => 16,
            DataType::Fp8 | DataType::Int8 => 8,
            DataType::Int4 => 4,
        }
    }

    /// Bytes per element as a float (INT4 is half a byte).
    pub fn bytes(self) -> f64 {
        self.bits() as f64 / 8.0
    }

    /// Bytes per element of the parameter tensor as TorchRec's `tensor.element_size()`
    /// reports it; sub-byte types are stored in a byte container.
    pub fn element_size(self) -> u64 {
        (self.bits() as u64).div_ceil(8)
    }

    /// The torch dtype name of the parameter tensor.
    pub fn torch_name(self) -> &'static str {
        match self {
            DataType::Fp32 => "float32",
            DataType::Fp16 => "float16",
            DataType::Bf16 => "bfloat16",
            DataType::Fp8 => "float8",
            DataType::Int8 => "int8",
            DataType::Int4 => "uint8",
        }
    }
}

/// How a table is split across ranks (TorchRec's `ShardingType`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ShardingType {
    /// Every rank holds a full replica; gradients are all-reduced.
    DataParallel,
    /// The whole table lives on one rank.
    TableWise,
    /// Column blocks, each placed on any rank.
    ColumnWise,
    /// Column blocks placed within one host.
    TableColumnWise,
    /// Row blocks over all ranks of the world.
    RowWise,
    /// Row blocks over the ranks of one host.
    TableRowWise,
    /// Column blocks, each row-sharded over the ranks of one host.
    GridShard,
}

impl ShardingType {
    /// Every sharding type, in the order TorchRec's embedding-bag sharder lists them.
    pub const ALL: [ShardingType; 7] = [
        ShardingType::DataParallel,
        ShardingType::TableWise,
        ShardingType::ColumnWise,
        ShardingType::TableColumnWise,
        ShardingType::RowWise,
        ShardingType::TableRowWise,
        ShardingType::GridShard,
    ];

    /// TorchRec's string for this sharding type.
    pub fn as_str(self) -> &'static str {
        match self {
            ShardingType::DataParallel => "data_parallel",
            ShardingType::TableWise => "table_wise",
            ShardingType::ColumnWise => "column_wise",
            ShardingType::TableColumnWise => "table_column_wise",
            ShardingType::RowWise => "row_wise",
            ShardingType::TableRowWise => "table_row_wise",
            ShardingType::GridShard => "grid_shard",
        }
    }

    /// How the partitioner may place this type's shards.
    pub fn partition_by(self) -> PartitionBy {
        match self {
            ShardingType::TableWise | ShardingType::ColumnWise => PartitionBy::Device,
            ShardingType::TableRowWise | ShardingType::TableColumnWise => PartitionBy::Host,
            ShardingType::RowWise | ShardingType::DataParallel => PartitionBy::Uniform,
            ShardingType::GridShard => PartitionBy::MultiHost,
        }
    }
}

impl fmt::Display for ShardingType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The embedding kernel that serves a shard (TorchRec's `EmbeddingComputeKernel`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ComputeKernel {
    /// Plain dense parameter (data parallel only).
    Dense,
    /// Table-batched kernel with the optimizer fused into backward; weights in HBM.
    Fused,
    /// Fused kernel with weights in host memory reached through unified memory.
    FusedUvm,
    /// Fused kernel with weights in host memory and an HBM cache in front.
    FusedUvmCaching,
    /// Quantized inference kernel.
    Quant,
}

impl ComputeKernel {
    /// TorchRec's string for this kernel.
    pub fn as_str(self) -> &'static str {
        match self {
            ComputeKernel::Dense => "dense",
            ComputeKernel::Fused => "fused",
            ComputeKernel::FusedUvm => "fused_uvm",
            ComputeKernel::FusedUvmCaching => "fused_uvm_caching",
            ComputeKernel::Quant => "quant",
        }
    }

    /// Whether the table lives in DDR with an HBM cache in front of it.
    pub fn is_cached(self) -> bool {
        matches!(self, ComputeKernel::FusedUvmCaching)
    }
}

impl fmt::Display for ComputeKernel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Where the partitioner may put the shards of one option.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PartitionBy {
    /// Shard `i` goes to rank `i` (row-wise, data parallel).
    Uniform,
    /// Each shard goes to any rank.
    Device,
    /// All shards go to the ranks of one host.
    Host,
    /// Each column block goes to one host, its row shards to that host's ranks in order.
    MultiHost,
}

impl PartitionBy {
    /// TorchRec's string.
    pub fn as_str(self) -> &'static str {
        match self {
            PartitionBy::Uniform => "uniform",
            PartitionBy::Device => "device",
            PartitionBy::Host => "host",
            PartitionBy::MultiHost => "multi_host",
        }
    }
}

/// Where a job's embeddings are computed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum ComputeDevice {
    /// GPUs with HBM.
    #[default]
    Cuda,
    /// CPUs; tables live in DDR.
    Cpu,
}

impl ComputeDevice {
    /// TorchRec's string.
    pub fn as_str(self) -> &'static str {
        match self {
            ComputeDevice::Cuda => "cuda",
            ComputeDevice::Cpu => "cpu",
        }
    }
}

/// Estimated wall time of one shard in milliseconds, split the way TorchRec splits it.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct Perf {
    /// Forward lookup time.
    pub fwd_compute: f64,
    /// Forward output communication.
    pub fwd_comms: f64,
    /// Backward compute, fused optimizer included.
    pub bwd_compute: f64,
    /// Backward communication (gradient all-to-all / all-gather / all-reduce).
    pub bwd_comms: f64,
    /// Cache prefetch from DDR (cached kernels with cache statistics only).
    pub prefetch_compute: f64,
    /// Input (index) distribution; reported but not part of `total`, as in TorchRec 1.9.2.
    pub input_dist_comms: f64,
}

impl Perf {
    /// The total TorchRec ranks plans by: everything except input distribution.
    pub fn total(&self) -> f64 {
        self.fwd_compute
            + self.fwd_comms
            + self.bwd_compute
            + self.bwd_comms
            + self.prefetch_compute
    }

    /// Component-wise sum.
    pub fn add(&mut self, other: &Perf) {
        self.fwd_compute += other.fwd_compute;
        self.fwd_comms += other.fwd_comms;
        self.bwd_compute += other.bwd_compute;
        self.bwd_comms += other.bwd_comms;
        self.prefetch_compute += other.prefetch_compute;
        self.input_dist_comms += other.input_dist_comms;
    }

    /// Component-wise difference (undoes [`Perf::add`]).
    pub fn sub(&mut self, other: &Perf) {
        self.fwd_compute -= other.fwd_compute;
        self.fwd_comms -= other.fwd_comms;
        self.bwd_compute -= other.bwd_compute;
        self.bwd_comms -= other.bwd_comms;
        self.prefetch_compute -= other.prefetch_compute;
        self.input_dist_comms -= other.input_dist_comms;
    }
}

/// Bytes one shard occupies on its rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Storage {
    /// Device (GPU) memory.
    pub hbm: u64,
    /// Host memory.
    pub ddr: u64,
}

impl Storage {
    /// Whether this fits in `capacity` on both tiers. Sizes saturate ([`Storage::plus`]), so
    /// `u64::MAX` stands for a size past u64, which fits nowhere, not even in a capacity of
    /// `u64::MAX`.
    pub fn fits_in(&self, capacity: &Storage) -> bool {
        self.hbm <= capacity.hbm
            && self.ddr <= capacity.ddr
            && self.hbm != u64::MAX
            && self.ddr != u64::MAX
    }

    /// Component-wise sum (saturating: sizes near `u64::MAX` mean "cannot fit").
    pub fn plus(&self, other: &Storage) -> Storage {
        Storage {
            hbm: self.hbm.saturating_add(other.hbm),
            ddr: self.ddr.saturating_add(other.ddr),
        }
    }
}

/// One shard of a sharding option: a rectangle of the table and its estimated cost.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Shard {
    /// `[rows, cols]`.
    pub size: [u64; 2],
    /// `[row, col]` of the shard's top-left corner in the table.
    pub offset: [u64; 2],
    /// Estimated wall time.
    pub perf: Perf,
    /// Estimated memory.
    pub storage: Storage,
}

/// One way to shard one table: a sharding type, a kernel, and the resulting shards with costs.
#[derive(Debug, Clone, PartialEq)]
pub struct ShardingOption {
    /// Index of the table in the config.
    pub table: usize,
    /// Table name.
    pub name: String,
    /// The sharding type.
    pub sharding_type: ShardingType,
    /// The compute kernel.
    pub compute_kernel: ComputeKernel,
    /// The cache load factor given in the constraints (`None` if not given).
    pub cache_load_factor: Option<f64>,
    /// The shards with their estimates.
    pub shards: Vec<Shard>,
}

impl ShardingOption {
    /// Where the partitioner may place this option's shards.
    pub fn partition_by(&self) -> PartitionBy {
        self.sharding_type.partition_by()
    }

    /// Sum of the shards' perf totals.
    pub fn total_perf(&self) -> f64 {
        self.shards.iter().map(|s| s.perf.total()).sum()
    }

    /// Sum of the shards' storage.
    pub fn total_storage(&self) -> Storage {
        self.shards
            .iter()
            .fold(Storage::default(), |acc, s| acc.plus(&s.storage))
    }
}
