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

/// A rank's window past its bound (batches and samples dropped) joins the others' whole:
/// the global window is the union of every rank's window, not the last rank's (the merged
/// state was trimmed back to one rank's width, dropping every rank but the last). Sum
/// metrics over every rank's retained batches; AUC and AUPRC over every rank's last samples.
#[test]
fn global_windows_are_the_union_of_every_ranks_window() {
    const SMALL: usize = 50;
    let world = 3;
    let small = || RecMetrics::new(&["ctr", "other"], &MetricKind::all(), SMALL).unwrap();
    let got: Vec<BTreeMap<String, f64>> = on_ranks(world, Duration::from_secs(10), |comm| {
        let mut m = small();
        for b in batches(comm.rank()) {
            update(&mut m, &b);
        }
        global_metrics(&comm, &m).unwrap()
    });
    // What each rank keeps: whole batches from the newest back while they fit in SMALL
    // samples (at least one) for the sums; its last SMALL samples for AUC and AUPRC.
    let wide = usize::MAX;
    let (mut sums, mut samples) = (
        RecMetrics::new(&["ctr", "other"], &MetricKind::all(), wide).unwrap(),
        RecMetrics::new(&["ctr", "other"], &MetricKind::all(), wide).unwrap(),
    );
    let mut dropped = 0;
    for r in 0..world {
        let all = batches(r);
        let mut kept = 0;
        let mut held = 0;
        for b in all.iter().rev() {
            if kept > 0 && held + b[0].len() > SMALL {
                break;
            }
            held += b[0].len();
            kept += 1;
        }
        dropped += all.len() - kept;
        for b in &all[all.len() - kept..] {
            update(&mut sums, b);
        }
        let flat = |i: usize| -> Vec<f32> { all.iter().flat_map(|b| b[i].clone()).collect() };
        let (p, y, p2, w) = (flat(0), flat(1), flat(2), flat(3));
        let from = p.len().saturating_sub(SMALL);
        update(
            &mut samples,
            &[
                p[from..].to_vec(),
                y[from..].to_vec(),
                p2[from..].to_vec(),
                w[from..].to_vec(),
            ],
        );
    }
    assert!(
        dropped > 0,
        "no rank's window dropped a batch: the test tests nothing"
    );
    let (sums, samples) = (sums.compute(), samples.compute());
    for (r, values) in got.iter().enumerate() {
        let mut compared = 0;
        for (key, &g) in values.iter().filter(|(k, _)| k.contains("|window_")) {
            let w = if key.starts_with("auc-") || key.starts_with("auprc-") {
                samples[key]
            } else {
                sums[key]
            };
            assert!(
                (g - w).abs() <= 1e-9 * w.abs().max(1.0),
                "rank {r} {key}: {g}, the union of the windows: {w}"
            );
            compared += 1;
        }
        assert!(compared > 20, "{compared} window values");
    }
}

#[test]
fn ranks_with_other_windows_fail_naming_them() {
    let errors: Vec<String> = on_ranks(2, Duration::from_secs(5), |comm| {
        let window = if comm.rank() == 0 { 100 } else { 200 };
        let m = RecMetrics::new(&["ctr"], &MetricKind::all(), window).unwrap();
        global_metrics(&comm, &m).unwrap_err().to_string()
    });
    assert!(
        errors[0].contains("`window size 100` here, `window size 200`"),
        "{}",
        errors[0]
    );
}

/// The summed state (lifetime sums, the AUC/AUPRC histograms: most of the bytes) is
/// all-reduced, not gathered: on 4 ranks each sends 2·(W−1)/W of its size (a gather sent it
/// W−1 times), and only the windows' batches and samples are gathered.
#[test]
fn the_summed_state_is_all_reduced() {
    let world = 4;
    let counts = on_ranks(world, Duration::from_secs(10), |comm| {
        let mut m = metrics();
        for b in batches(comm.rank()) {
            update(&mut m, &b);
        }
        let (mut summed, mut gathered) = (0u64, 0u64);
        for (key, v) in m.state_dict() {
            let bytes = 8 * v.len() as u64;
            if key.ends_with(".batches") || key.ends_with(".recent") {
                gathered += bytes;
            } else {
                summed += bytes;
            }
        }
        comm.reset_bytes();
        global_metrics(&comm, &m).unwrap();
        let bytes = comm.bytes();
        (
            summed,
            gathered,
            bytes["metrics.sums"].sent,
            bytes["metrics.values"].sent,
        )
    });
    for (r, &(summed, gathered, sums_sent, values_sent)) in counts.iter().enumerate() {
        assert!(summed > 1 << 20, "rank {r}: {summed} bytes summed");
        // Chunks of ⌈n/W⌉ values: each rank sends its W−1 others' chunks, then its own W−1
        // times.
        let chunk = (summed / 8).div_ceil(world as u64) * 8;
        assert!(
            sums_sent <= 2 * (world as u64 - 1) * chunk && sums_sent >= summed,
            "rank {r}: {sums_sent} bytes sent to sum {summed}"
        );
        assert_eq!(values_sent, gathered * (world as u64 - 1), "rank {r}");
    }
}
