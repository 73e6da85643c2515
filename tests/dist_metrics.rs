//! RecMetrics across ranks (`global_metrics`): each rank updates its metrics with its own
//! batches; every rank must get what one process that saw every rank's batches computes —
//! every metric of every kind, lifetime and window — and ranks configured differently fail.

#[path = "support/dist_scenarios.rs"]
mod dist_scenarios;

use std::collections::BTreeMap;
use std::time::Duration;

use dist_scenarios::on_ranks;
use embers::distributed::global_metrics;
use embers::metrics::{MetricKind, RecMetrics};
use embers::tensor::rng::seeded;
use rand::Rng as _;

/// Rank `rank`'s batches: two tasks, batches of 5–40 samples, distinct predictions.
fn batches(rank: usize) -> Vec<[Vec<f32>; 4]> {
    let mut rng = seeded(500 + rank as u64);
    (0..4 + rank)
        .map(|_| {
            let n = rng.random_range(5..40usize);
            let p: Vec<f32> = (0..n).map(|_| rng.random_range(0.001f32..0.999)).collect();
            let y: Vec<f32> = p
                .iter()
                .map(|&p| f32::from(rng.random_range(0.0f32..1.0) < p))
                .collect();
            let p2: Vec<f32> = (0..n).map(|_| rng.random_range(0.001f32..0.999)).collect();
            let w: Vec<f32> = (0..n).map(|_| rng.random_range(0.5f32..2.0)).collect();
            [p, y, p2, w]
        })
        .collect()
}

fn update(m: &mut RecMetrics, b: &[Vec<f32>; 4]) {
    let [p, y, p2, w] = b;
    m.update(&[p, p2], &[y, y], Some(&[w, w])).unwrap();
}

const WINDOW: usize = 10_000;

fn metrics() -> RecMetrics {
    RecMetrics::new(&["ctr", "other"], &MetricKind::all(), WINDOW).unwrap()
}

#[test]
fn global_metrics_equal_one_process_on_all_the_data() {
    let world = 3;
    let got: Vec<BTreeMap<String, f64>> = on_ranks(world, Duration::from_secs(10), |comm| {
        let mut m = metrics();
        for b in batches(comm.rank()) {
            update(&mut m, &b);
        }
        global_metrics(&comm, &m).unwrap()
    });
    let mut single = metrics();
    for r in 0..world {
        for b in batches(r) {
            update(&mut single, &b);
        }
    }
    let want = single.compute();
    assert!(want.len() > 40, "{want:?}");
    for (r, values) in got.iter().enumerate() {
        assert_eq!(
            values.keys().collect::<Vec<_>>(),
            want.keys().collect::<Vec<_>>()
        );
        for (key, &w) in &want {
            let g = values[key];
            assert!(
                (g - w).abs() <= 1e-9 * w.abs().max(1.0),
                "rank {r} {key}: {g}, one process: {w}"
            );
        }
        // A rank's own metrics differ from the global ones (the check above can fail).
        if r == 0 {
            let mut own = metrics();
            for b in batches(0) {
                update(&mut own, &b);
            }
            let own = own.compute();
            let key = "auc-ctr|lifetime_auc";
            assert!(
                (own[key] - want[key]).abs() > 1e-6,
                "{} vs {}",
                own[key],
                want[key]
            );
        }
    }
}

#[test]
fn ranks_with_other_metrics_fail_naming_the_rank() {
    let errors: Vec<String> = on_ranks(2, Duration::from_secs(5), |comm| {
        let kinds = if comm.rank() == 0 {
            MetricKind::all()
        } else {
            vec![MetricKind::Auc]
        };
        let m = RecMetrics::new(&["ctr"], &kinds, WINDOW).unwrap();
        global_metrics(&comm, &m).unwrap_err().to_string()
    });
    assert!(
        errors[0].contains("rank 0: rank 1's metrics are configured differently"),
        "{}",
        errors[0]
    );
    assert!(
        errors[1].contains("rank 1: rank 0's metrics are configured differently"),
        "{}",
        errors[1]
    );
}
