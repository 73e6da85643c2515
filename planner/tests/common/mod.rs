//! Builds planner problems from the golden files' TorchRec inputs.
#![allow(dead_code)]

use embers_planner::config::{CacheStats, Constraints, Problem, ReservationSettings, Table};
use embers_planner::topology::Topology;
use embers_planner::types::{ComputeDevice, ComputeKernel, DataType, ShardingType};
use serde_json::Value;

pub const GOLDEN: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/golden/");

pub fn load(name: &str) -> Value {
    let path = format!("{GOLDEN}{name}");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("read {path}: {e}"));
    serde_json::from_str(&text).expect("golden json")
}

fn from<T: serde::de::DeserializeOwned>(v: &Value) -> T {
    serde_json::from_value(v.clone()).expect("golden field")
}

pub fn problem(inputs: &Value) -> Problem {
    let t = &inputs["topology"];
    let device = match t["compute_device"].as_str() {
        Some("cpu") => ComputeDevice::Cpu,
        _ => ComputeDevice::Cuda,
    };
    let topology = Topology {
        world_size: t["world_size"].as_u64().unwrap() as usize,
        local_world_size: t["local_world_size"].as_u64().unwrap() as usize,
        compute_device: device,
        hbm_cap: t["hbm_cap_per_rank"][0].as_u64().unwrap(),
        ddr_cap: t["ddr_cap_per_rank"][0].as_u64().unwrap(),
        hbm_mem_bw: t["hbm_mem_bw"].as_f64().unwrap(),
        ddr_mem_bw: t["ddr_mem_bw"].as_f64().unwrap(),
        hbm_to_ddr_mem_bw: t["hbm_to_ddr_mem_bw"].as_f64().unwrap(),
        intra_host_bw: t["intra_host_bw"].as_f64().unwrap(),
        inter_host_bw: t["inter_host_bw"].as_f64().unwrap(),
        bwd_compute_multiplier: t["bwd_compute_multiplier"].as_f64().unwrap(),
        weighted_feature_bwd_compute_multiplier: t["weighted_feature_bwd_compute_multiplier"]
            .as_f64()
            .unwrap(),
    };
    let batch = inputs["batch_size"].as_u64().unwrap();
    let weighted_module = inputs["module"]
        .as_str()
        .is_some_and(|m| m.contains("is_weighted=True"));
    let optimizer = inputs["optimizer"]["class"].as_str().unwrap_or("");
    let tables = inputs["tables"]
        .as_array()
        .unwrap()
        .iter()
        .map(|tv| {
            let name = tv["name"].as_str().unwrap().to_string();
            let dim = tv["embedding_dim"].as_u64().unwrap();
            let c = &inputs["constraints"][&name];
            let input_lengths: Vec<f64> = if c["pooling_factors"].is_array() {
                from(&c["pooling_factors"])
            } else {
                vec![1.0]
            };
            let n = input_lengths.len();
            let num_poolings: Vec<f64> = if c["num_poolings"].is_array() {
                from(&c["num_poolings"])
            } else {
                vec![1.0; n]
            };
            let batch_sizes: Vec<u64> = if c["batch_sizes"].is_array() {
                from(&c["batch_sizes"])
            } else {
                vec![batch; n]
            };
            let cache = &c["cache_params"];
            let stats = &cache["stats"];
            let constraints = Constraints {
                sharding_types: c["sharding_types"]
                    .is_array()
                    .then(|| from::<Vec<ShardingType>>(&c["sharding_types"])),
                compute_kernels: c["compute_kernels"]
                    .is_array()
                    .then(|| from::<Vec<ComputeKernel>>(&c["compute_kernels"])),
                min_partition: c["min_partition"].as_u64(),
                cache_load_factor: cache["load_factor"].as_f64(),
                cache_stats: stats.is_object().then(|| CacheStats {
                    expected_lookups: stats["expected_lookups"].as_f64().unwrap(),
                    mrc_hist_counts: from(&stats["mrc_hist_counts"]),
                    height: stats["height"].as_u64().unwrap(),
                    cacheability: stats["cacheability"].as_f64(),
                }),
                output_dtype: c["output_dtype"]
                    .is_string()
                    .then(|| from::<DataType>(&c["output_dtype"])),
            };
            let optimizer_multiplier = if optimizer.contains("RowWiseAdagrad") {
                1.0 / dim as f64
            } else if optimizer.contains("Adam") {
                2.0
            } else if optimizer.is_empty() || optimizer.contains("SGD") {
                0.0
            } else {
                1.0
            };
            Table {
                name,
                rows: tv["num_embeddings"].as_u64().unwrap(),
                dim,
                data_type: from(&tv["data_type"]),
                input_lengths,
                num_poolings,
                batch_sizes,
                weighted: weighted_module || c["is_weighted"].as_bool().unwrap_or(false),
                pooled: tv["pooling"].as_str() != Some("NONE"),
                optimizer_multiplier,
                constraints,
            }
        })
        .collect();
    Problem {
        topology,
        batch_size: batch,
        tables,
        reservation: ReservationSettings {
            percentage: 0.15,
            dense_bytes: 0,
            kjt: true,
        },
    }
}
