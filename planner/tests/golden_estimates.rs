//! Every option TorchRec's enumerator lists, with every shard's perf and storage, reproduced
//! to a relative error of 1e-9 (storage exactly).

mod common;

use embers_planner::enumerator;
use serde_json::Value;

fn close(ours: f64, theirs: f64) -> bool {
    let scale = ours.abs().max(theirs.abs());
    scale == 0.0 || (ours - theirs).abs() <= 1e-9 * scale
}

#[test]
fn every_option_matches_torchrec() {
    let golden = common::load("planner_estimates.json");
    let mut failures = Vec::new();
    let mut report = Vec::new();
    for case in golden["cases"].as_array().unwrap() {
        let name = case["name"].as_str().unwrap();
        let problem = common::problem(&case["inputs"]);
        let ours: Vec<_> = enumerator::enumerate(&problem)
            .unwrap()
            .into_iter()
            .flatten()
            .collect();
        let theirs = case["options"].as_array().unwrap();
        assert_eq!(ours.len(), theirs.len(), "{name}: option count");
        let mut matched = 0;
        for (o, g) in ours.iter().zip(theirs) {
            let mut errs = Vec::new();
            if o.name != g["table"].as_str().unwrap()
                || o.sharding_type.as_str() != g["sharding_type"].as_str().unwrap()
                || o.compute_kernel.as_str() != g["compute_kernel"].as_str().unwrap()
            {
                errs.push(format!(
                    "identity {} {} {}",
                    o.name, o.sharding_type, o.compute_kernel
                ));
            }
            let gs = g["shards"].as_array().unwrap();
            if gs.len() != o.shards.len() {
                errs.push(format!("shard count {} vs {}", o.shards.len(), gs.len()));
            }
            for (i, (s, gsh)) in o.shards.iter().zip(gs).enumerate() {
                let size: [u64; 2] = serde_json::from_value(gsh["size"].clone()).unwrap();
                let offset: [u64; 2] = serde_json::from_value(gsh["offset"].clone()).unwrap();
                if size != s.size || offset != s.offset {
                    errs.push(format!(
                        "shard {i} rect {:?}@{:?} vs {size:?}@{offset:?}",
                        s.size, s.offset
                    ));
                }
                let p = &gsh["perf"];
                let f = |v: &Value| v.as_f64().unwrap();
                for (field, ours_v) in [
                    ("fwd_compute", s.perf.fwd_compute),
                    ("fwd_comms", s.perf.fwd_comms),
                    ("bwd_compute", s.perf.bwd_compute),
                    ("bwd_comms", s.perf.bwd_comms),
                    ("prefetch_compute", s.perf.prefetch_compute),
                    ("input_dist_comms", s.perf.input_dist_comms),
                    ("total", s.perf.total()),
                ] {
                    if !close(ours_v, f(&p[field])) {
                        errs.push(format!(
                            "shard {i} {field}: {ours_v:e} vs {:e}",
                            f(&p[field])
                        ));
                    }
                }
                let st = &gsh["storage"];
                if st["hbm"].as_u64() != Some(s.storage.hbm)
                    || st["ddr"].as_u64() != Some(s.storage.ddr)
                    || st["ssd"].as_u64() != Some(0)
                {
                    errs.push(format!("shard {i} storage {:?} vs {st}", s.storage));
                }
            }
            if errs.is_empty() {
                matched += 1;
            } else {
                failures.push(format!(
                    "{name}: {} {} {}: {}",
                    o.name,
                    o.sharding_type,
                    o.compute_kernel,
                    errs.join("; ")
                ));
            }
        }
        report.push(format!("{name}: {matched}/{}", theirs.len()));
    }
    println!("{}", report.join("\n"));
    assert!(
        failures.is_empty(),
        "{} mismatching options:\n{}",
        failures.len(),
        failures
            .iter()
            .take(40)
            .cloned()
            .collect::<Vec<_>>()
            .join("\n")
    );
}
