//! The hardware the plan is for: ranks, hosts, memory capacities and bandwidths.
//!
//! Bandwidths are in bytes per millisecond, TorchRec's unit, so a cost in bytes divided by a
//! bandwidth is a time in milliseconds. Defaults are TorchRec 1.9.2's.

use crate::error::PlannerError;
use crate::types::{ComputeDevice, Storage};
use serde::{Deserialize, Serialize};

const GIB: f64 = 1024.0 * 1024.0 * 1024.0;

/// Largest world size accepted (every rank has per-rank state in the search).
pub const MAX_WORLD_SIZE: usize = 1 << 16;

/// Largest multiplier of a cost or of the weights' bytes accepted (backward compute, a custom
/// optimizer's state): beyond it no hardware or optimizer is described, and costs leave f64's
/// useful range.
pub const MAX_MULTIPLIER: f64 = 1e3;
/// The largest `hbm_cap` or `ddr_cap` accepted: 2^60 bytes (1 EiB), far past any device, so
/// that no capacity reaches the u64::MAX of sizes past u64.
pub const MAX_CAP: u64 = 1 << 60;

/// TorchRec's default HBM capacity per rank (32 GiB).
pub const DEFAULT_HBM_CAP: u64 = 32 << 30;
/// TorchRec's default DDR capacity per rank (128 GiB).
pub const DEFAULT_DDR_CAP: u64 = 128 << 30;
/// TorchRec's default HBM bandwidth: 897 GiB/s in bytes/ms.
pub const DEFAULT_HBM_MEM_BW: f64 = 897.0 * GIB / 1000.0;
/// TorchRec's default DDR bandwidth: 51 GiB/s in bytes/ms.
pub const DEFAULT_DDR_MEM_BW: f64 = 51.0 * GIB / 1000.0;
/// TorchRec's default HBM-to-DDR bandwidth: 32 GiB/s in bytes/ms.
pub const DEFAULT_HBM_TO_DDR_MEM_BW: f64 = 32.0 * GIB / 1000.0;
/// TorchRec's default intra-host link bandwidth: 600 GiB/s in bytes/ms.
pub const DEFAULT_INTRA_HOST_BW: f64 = 600.0 * GIB / 1000.0;
/// TorchRec's default inter-host link bandwidth: 12.5 GiB/s in bytes/ms.
pub const DEFAULT_INTER_HOST_BW: f64 = 12.5 * GIB / 1000.0;

/// The collective a communication cost refers to; it selects the link bandwidth.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Collective {
    /// All-reduce (data-parallel gradients).
    AllReduce,
    /// All-to-all (table-wise outputs, inputs).
    AllToAll,
    /// Reduce-scatter (row-wise pooled outputs).
    ReduceScatter,
    /// All-gather (row-wise gradients).
    AllGather,
}

/// A resolved topology.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Topology {
    /// Number of ranks.
    pub world_size: usize,
    /// Ranks per host.
    pub local_world_size: usize,
    /// GPU or CPU.
    pub compute_device: ComputeDevice,
    /// HBM bytes per rank (0 on CPU).
    pub hbm_cap: u64,
    /// DDR bytes per rank.
    pub ddr_cap: u64,
    /// HBM bandwidth (bytes/ms).
    pub hbm_mem_bw: f64,
    /// DDR bandwidth (bytes/ms).
    pub ddr_mem_bw: f64,
    /// HBM-to-DDR (UVM) bandwidth (bytes/ms).
    pub hbm_to_ddr_mem_bw: f64,
    /// Link bandwidth between ranks of a host (bytes/ms).
    pub intra_host_bw: f64,
    /// Link bandwidth between hosts, per NIC (bytes/ms).
    pub inter_host_bw: f64,
    /// Backward compute as a multiple of forward compute.
    pub bwd_compute_multiplier: f64,
    /// Extra backward multiplier for weighted features.
    pub weighted_feature_bwd_compute_multiplier: f64,
}

impl Topology {
    /// A topology with TorchRec's defaults for everything but the world.
    pub fn torchrec_default(world_size: usize, compute_device: ComputeDevice) -> Topology {
        Topology {
            world_size,
            local_world_size: world_size,
            compute_device,
            hbm_cap: match compute_device {
                ComputeDevice::Cuda => DEFAULT_HBM_CAP,
                ComputeDevice::Cpu => 0,
            },
            ddr_cap: DEFAULT_DDR_CAP,
            hbm_mem_bw: DEFAULT_HBM_MEM_BW,
            ddr_mem_bw: DEFAULT_DDR_MEM_BW,
            hbm_to_ddr_mem_bw: DEFAULT_HBM_TO_DDR_MEM_BW,
            intra_host_bw: DEFAULT_INTRA_HOST_BW,
            inter_host_bw: DEFAULT_INTER_HOST_BW,
            bwd_compute_multiplier: 2.0,
            weighted_feature_bwd_compute_multiplier: 1.0,
        }
    }

    /// A named hardware preset: `8xA100-40G`, `8xA100-80G`, `8xH100-80G`, `8xH200-141G`,
    /// or `torchrec-default` (TorchRec's defaults, one 8-GPU host). A preset describes one
    /// host; `world_size` in the config may ask for several.
    pub fn preset(name: &str) -> Option<Topology> {
        let mut t = Topology::torchrec_default(8, ComputeDevice::Cuda);
        // Vendor figures in decimal GB/s converted to bytes/ms.
        let gbs = |x: f64| x * 1e9 / 1000.0;
        match name.to_ascii_lowercase().as_str() {
            "torchrec-default" => {}
            "8xa100-40g" | "8xa100-80g" => {
                t.hbm_cap = if name.contains("80") {
                    80 << 30
                } else {
                    40 << 30
                };
                t.hbm_mem_bw = gbs(if name.contains("80") { 2039.0 } else { 1555.0 });
                t.hbm_to_ddr_mem_bw = gbs(32.0); // PCIe 4 x16
                t.intra_host_bw = gbs(300.0); // NVLink 3, one direction
                t.inter_host_bw = gbs(25.0); // 200 Gb/s NIC per GPU
                t.ddr_cap = 128 << 30;
            }
            "8xh100-80g" => {
                // What the driver reports (nvidia-smi: 81559 MiB), not the marketed 80 GiB.
                t.hbm_cap = 81559 << 20;
                t.hbm_mem_bw = gbs(3350.0);
                t.hbm_to_ddr_mem_bw = gbs(64.0); // PCIe 5 x16
                t.intra_host_bw = gbs(450.0); // NVLink 4, one direction
                t.inter_host_bw = gbs(50.0); // 400 Gb/s NIC per GPU
                t.ddr_cap = 256 << 30;
            }
            "8xh200-141g" => {
                // What the driver reports (nvidia-smi: 143771 MiB), not 141 GiB.
                t.hbm_cap = 143771 << 20;
                t.hbm_mem_bw = gbs(4800.0);
                t.hbm_to_ddr_mem_bw = gbs(64.0);
                t.intra_host_bw = gbs(450.0);
                t.inter_host_bw = gbs(50.0);
                t.ddr_cap = 256 << 30;
            }
            _ => return None,
        }
        Some(t)
    }

    /// Names accepted by [`Topology::preset`].
    pub const PRESETS: [&'static str; 5] = [
        "torchrec-default",
        "8xA100-40G",
        "8xA100-80G",
        "8xH100-80G",
        "8xH200-141G",
    ];

    /// Checks the invariants the planner relies on.
    pub fn validate(&self) -> Result<(), PlannerError> {
        let bad = |field: &str, why: String| PlannerError::Config {
            field: format!("topology.{field}"),
            message: why,
        };
        if self.world_size == 0 || self.world_size > MAX_WORLD_SIZE {
            return Err(bad(
                "world_size",
                format!(
                    "must be within 1..={MAX_WORLD_SIZE}, got {}",
                    self.world_size
                ),
            ));
        }
        if self.local_world_size == 0 || self.world_size % self.local_world_size != 0 {
            return Err(bad(
                "local_world_size",
                format!(
                    "{} must be >= 1 and divide world_size {}",
                    self.local_world_size, self.world_size
                ),
            ));
        }
        // Sizes past u64 saturate to u64::MAX, which then means "fits nowhere": a capacity
        // of u64::MAX held them (a 16 EiB shard planned as fitting).
        for (name, v) in [("hbm_cap", self.hbm_cap), ("ddr_cap", self.ddr_cap)] {
            if v > MAX_CAP {
                return Err(bad(
                    name,
                    format!("must be at most 2^60 bytes (1 EiB), got {v}"),
                ));
            }
        }
        for (name, v) in [
            ("hbm_mem_bw", self.hbm_mem_bw),
            ("ddr_mem_bw", self.ddr_mem_bw),
            ("hbm_to_ddr_mem_bw", self.hbm_to_ddr_mem_bw),
            ("intra_host_bw", self.intra_host_bw),
            ("inter_host_bw", self.inter_host_bw),
        ] {
            // At least a byte per millisecond: a subnormal one priced every shard at infinity
            // and wrote a plan whose imbalance was NaN (`null`, unreadable).
            if !(v.is_finite() && v >= 1.0) {
                return Err(bad(name, format!("must be at least 1 byte/ms, got {v}")));
            }
        }
        for (name, v) in [
            ("bwd_compute_multiplier", self.bwd_compute_multiplier),
            (
                "weighted_feature_bwd_compute_multiplier",
                self.weighted_feature_bwd_compute_multiplier,
            ),
        ] {
            if !(v.is_finite() && (0.0..=MAX_MULTIPLIER).contains(&v)) {
                return Err(bad(
                    name,
                    format!("must be a number within [0, {MAX_MULTIPLIER}], got {v}"),
                ));
            }
        }
        Ok(())
    }

    /// Number of hosts.
    pub fn num_hosts(&self) -> usize {
        self.world_size / self.local_world_size
    }

    /// Memory of one rank.
    pub fn capacity(&self) -> Storage {
        Storage {
            hbm: self.hbm_cap,
            ddr: self.ddr_cap,
        }
    }

    /// Link bandwidth a collective over `world_size` ranks (of which `local_world_size`
    /// share a host) runs at, as TorchRec's basic comms model has it: all-reduce uses one NIC
    /// per GPU, everything else the intra-host link if the group fits in a host.
    pub fn comms_bw(&self, world_size: usize, local_world_size: usize, c: Collective) -> f64 {
        if c == Collective::AllReduce {
            return self.inter_host_bw * local_world_size as f64;
        }
        if world_size <= local_world_size {
            self.intra_host_bw
        } else {
            self.inter_host_bw
        }
    }
}
