//! RecMetrics against TorchRec 1.9.2's values in `tests/golden/metrics.json`.

use embers::metrics::{auc, MetricKind, RecMetrics, Sample};
use serde_json::Value;

fn golden() -> Value {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/golden/metrics.json");
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{path}: {e}"));
    serde_json::from_str(&text).unwrap()
}

fn floats(v: &Value) -> Vec<f32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap() as f32)
        .collect()
}

fn assert_close(key: &str, ours: f64, theirs: f64, tol: f64) {
    assert!(
        (ours - theirs).abs() <= tol * (1.0 + theirs.abs()),
        "{key}: embers {ours} vs TorchRec {theirs}"
    );
}

/// Our name for a TorchRec key (identical except AUC, which TorchRec reports window-only).
fn compare_all(
    case: &str,
    ours: &std::collections::BTreeMap<String, f64>,
    theirs: &serde_json::Map<String, Value>,
    tol: f64,
) -> usize {
    let mut n = 0;
    for (key, v) in theirs {
        let got = *ours
            .get(key)
            .unwrap_or_else(|| panic!("{case}: embers has no `{key}`"));
        if v.as_str() == Some("nan") {
            assert!(got.is_nan(), "{case} {key}: embers {got}, TorchRec NaN");
            n += 1;
            continue;
        }
        let expected = v.as_f64().unwrap();
        assert_close(&format!("{case} {key}"), got, expected, tol);
        n += 1;
    }
    n
}

#[test]
fn single_batch_cases_match_torchrec() {
    let g = golden();
    let mut checked = 0;
    for case in g["cases"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| c.get("steps").is_none())
    {
        let name = case["name"].as_str().unwrap();
        let (p, y, w) = (
            floats(&case["predictions"]),
            floats(&case["labels"]),
            floats(&case["weights"]),
        );
        let n = p.len();
        let mut m = RecMetrics::new(&["t"], &MetricKind::all(), n).unwrap();
        m.update(&[&p], &[&y], Some(&[&w])).unwrap();
        let values = m.compute();
        let mut expected = case["module_values"].as_object().unwrap().clone();
        // TorchRec's AUC does not group ties: with ties its value depends on torch.argsort's
        // (unstable) order; those cases are checked below with the recorded order.
        let stable = case["auc_sorted_indices_is_stable_descending"]
            .as_bool()
            .unwrap();
        if !stable {
            expected.remove("auc-t|window_auc");
        }
        // We compute the states in f64; TorchRec sums some of them in f32.
        checked += compare_all(name, &values, &expected, 2e-6);
        // Against TorchRec's functional helpers on f64 inputs, tighter.
        for (metric, v) in case["functional_float64"].as_object().unwrap() {
            let key = match metric.as_str() {
                // All labels equal: TorchRec's f64 helper divides rounding noise by ~0 (it
                // reports 2e15 here) while its module reports 1; we follow the module, checked
                // above.
                "r_squared"
                    if case["module_values"]["mse-t|lifetime_r_squared"].as_f64() == Some(1.0) =>
                {
                    continue
                }
                "ne" | "logloss" => format!("ne-t|lifetime_{metric}"),
                "mse" | "rmse" | "r_squared" => format!("mse-t|lifetime_{metric}"),
                "auc" if !stable => continue,
                "auc" => "auc-t|window_auc".to_string(),
                "auprc" => "auprc-t|window_auprc".to_string(),
                other => format!("{other}-t|lifetime_{other}"),
            };
            match v.as_f64() {
                Some(expected) => {
                    assert_close(&format!("{name} f64 {key}"), values[&key], expected, 1e-6)
                }
                None => assert!(values[&key].is_nan(), "{name} f64 {key}: expected NaN"),
            }
        }
        // TorchRec-compatible AUC in TorchRec's own visiting order, and the tie-correct AUC
        // against scikit-learn's tie-aware value.
        let samples: Vec<Sample> = (0..n)
            .map(|i| Sample {
                prediction: p[i],
                label: y[i],
                weight: w[i],
            })
            .collect();
        let order: Vec<usize> = case["auc_sorted_indices"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as usize)
            .collect();
        assert_close(
            &format!("{name} auc in torch order"),
            auc::auc_in_order(&samples, &order),
            case["module_values"]["auc-t|window_auc"].as_f64().unwrap(),
            2e-6,
        );
        // (scikit-learn only defines it for 0/1 labels.)
        let binary = y.iter().all(|&l| l == 0.0 || l == 1.0);
        if let (Some(sk), true) = (case["sklearn_roc_auc_tie_aware"].as_f64(), binary) {
            assert_close(
                &format!("{name} tie-correct auc"),
                values["auc-t|window_auc_tie_correct"],
                sk,
                1e-9,
            );
        }
    }
    assert!(checked > 13 * 20, "only {checked} values compared");
}

#[test]
fn windowed_cases_match_torchrec_after_every_update() {
    let g = golden();
    let mut steps = 0;
    for case in g["cases"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| c.get("steps").is_some())
    {
        let name = case["name"].as_str().unwrap();
        let window = case["window_size"].as_u64().unwrap() as usize;
        let mut m = RecMetrics::new(&["t"], &MetricKind::all(), window).unwrap();
        for (i, step) in case["steps"].as_array().unwrap().iter().enumerate() {
            let (p, y, w) = (
                floats(&step["predictions"]),
                floats(&step["labels"]),
                floats(&step["weights"]),
            );
            m.update(&[&p], &[&y], Some(&[&w])).unwrap();
            compare_all(
                &format!("{name} step {i}"),
                &m.compute(),
                step["values_after"].as_object().unwrap(),
                2e-6,
            );
            steps += 1;
        }
    }
    assert_eq!(steps, 6 + 7 + 5);
}

#[test]
fn state_round_trip_continues_identically() {
    let g = golden();
    let case = g["cases"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == "window_b8_w20_variable")
        .unwrap();
    let steps = case["steps"].as_array().unwrap();
    let feed = |m: &mut RecMetrics, s: &Value| {
        let (p, y, w) = (
            floats(&s["predictions"]),
            floats(&s["labels"]),
            floats(&s["weights"]),
        );
        m.update(&[&p], &[&y], Some(&[&w])).unwrap();
    };
    let mut a = RecMetrics::new(&["t"], &MetricKind::all(), 20).unwrap();
    for s in &steps[..3] {
        feed(&mut a, s);
    }
    let mut b = RecMetrics::new(&["t"], &MetricKind::all(), 20).unwrap();
    b.load_state_dict(&a.state_dict()).unwrap();
    for s in &steps[3..] {
        feed(&mut a, s);
        feed(&mut b, s);
    }
    assert_eq!(a.compute(), b.compute());
    // A truncated state is refused with the entry named.
    let mut broken = a.state_dict();
    broken.get_mut("ne-t.lifetime").unwrap().pop();
    let err = b.load_state_dict(&broken).unwrap_err().to_string();
    assert!(err.contains("ne-t.lifetime"), "{err}");
    // A batch size that is not a count (the first value of each batch's record), or sizes
    // that sum past a usize, are refused with the entry named, and change nothing.
    let state = a.state_dict();
    let record = state["ne-t.lifetime"].len() + 1;
    for bad in [1e300, -1.0, 0.5, f64::NAN, f64::INFINITY] {
        let mut broken = state.clone();
        broken.get_mut("ne-t.batches").unwrap()[0] = bad;
        let err = b.load_state_dict(&broken).unwrap_err().to_string();
        // (A NaN or infinity is refused first as not finite.)
        assert!(
            err.contains("ne-t.batches")
                && (err.contains("not a count") || err.contains("must be finite")),
            "{bad}: {err}"
        );
    }
    let mut broken = state.clone();
    let mut batch = state["ne-t.batches"][..record].to_vec();
    batch[0] = 2f64.powi(53) - 1.0;
    *broken.get_mut("ne-t.batches").unwrap() = batch.repeat(4096);
    let err = b.load_state_dict(&broken).unwrap_err().to_string();
    assert!(
        err.contains("ne-t.batches") && err.contains("past a usize"),
        "{err}"
    );
    assert_eq!(b.state_dict(), a.state_dict());
}

#[test]
fn bad_inputs_are_errors() {
    let mut m = RecMetrics::new(&["click", "like"], &MetricKind::all(), 10).unwrap();
    let p = [0.5f32, 0.2];
    let y = [1.0f32, 0.0];
    // Wrong number of tasks.
    assert!(m.update(&[&p], &[&y], None).is_err());
    // Lengths that differ.
    let err = m
        .update(&[&p, &p], &[&y, &y[..1]], None)
        .unwrap_err()
        .to_string();
    assert!(err.contains("like") && err.contains("1 labels"), "{err}");
    // NaN prediction named with its task and position.
    let bad = [0.5f32, f32::NAN];
    let err = m
        .update(&[&p, &bad], &[&y, &y], None)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("like") && err.contains("predictions[1]"),
        "{err}"
    );
    // Out of range for probability metrics: a logit, a label of 2, a negative weight (they
    // were clamped into the histograms' end bins, or made NE negative).
    for (pred, label, weight, expected) in [
        (
            1.5f32,
            1.0f32,
            1.0f32,
            "predictions[1] is 1.5 (must be a probability)",
        ),
        (0.5, 2.0, 1.0, "labels[1] is 2 (must be within [0, 1])"),
        (0.5, 1.0, -1.0, "weights[1] is -1 (must be not negative)"),
    ] {
        let (bp, by, bw) = ([0.5f32, pred], [1.0f32, label], [1.0f32, weight]);
        let err = m
            .update(&[&p, &bp], &[&y, &by], Some(&[&[1.0, 1.0], &bw]))
            .unwrap_err()
            .to_string();
        assert!(err.contains("like") && err.contains(expected), "{err}");
    }
    // Nothing was recorded by the failed updates.
    m.update(&[&p, &p], &[&y, &y], None).unwrap();
    let v = m.compute();
    assert_eq!(v["ctr-click|lifetime_ctr"], 0.5);
    assert_eq!(v["ctr-like|window_ctr"], 0.5);
    // Regression metrics alone take any real predictions and labels.
    use embers::metrics::SumKind;
    let mut r = RecMetrics::new(
        &["t"],
        &[MetricKind::Sum(SumKind::Mse), MetricKind::Sum(SumKind::Mae)],
        10,
    )
    .unwrap();
    r.update(&[&[3.5, -2.0]], &[&[4.0, -1.0]], None).unwrap();
    assert_eq!(r.compute()["mae-t|lifetime_mae"], 0.75);
}

/// R² of labels that differ by 1 in 1e6 is computed, not taken for constant labels' 1 (a
/// tolerance of 1e-12 of the squares' sum took it for constant labels).
#[test]
fn r_squared_of_large_labels() {
    use embers::metrics::SumKind;
    let mut m = RecMetrics::new(&["t"], &[MetricKind::Sum(SumKind::Mse)], 10).unwrap();
    m.update(&[&[0.0, 0.0]], &[&[1e6, 1e6 + 1.0]], None)
        .unwrap();
    let r2 = m.compute()["mse-t|lifetime_r_squared"];
    // Σ(y−ȳ)² = 0.5, Σ(p−y)² ≈ 2e12.
    let want = 1.0 - (1e12 + (1e6f64 + 1.0).powi(2)) / 0.5;
    assert!((r2 - want).abs() <= 1e-9 * want.abs(), "{r2} vs {want}");
}

#[test]
fn lifetime_auc_histogram_tracks_exact_auc() {
    use rand::{Rng, SeedableRng};
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(5);
    let samples: Vec<Sample> = (0..20000)
        .map(|_| {
            let label = if rng.random::<f32>() < 0.3 { 1.0 } else { 0.0 };
            let prediction = (rng.random::<f32>() * 0.6 + label * 0.3).min(1.0);
            Sample {
                prediction,
                label,
                weight: rng.random::<f32>() + 0.5,
            }
        })
        .collect();
    let mut m = RecMetrics::new(&["t"], &[MetricKind::Auc], samples.len()).unwrap();
    let p: Vec<f32> = samples.iter().map(|s| s.prediction).collect();
    let y: Vec<f32> = samples.iter().map(|s| s.label).collect();
    let w: Vec<f32> = samples.iter().map(|s| s.weight).collect();
    m.update(&[&p], &[&y], Some(&[&w])).unwrap();
    let v = m.compute();
    let exact = auc::auc_tie_correct(&samples);
    assert!(exact > 0.7 && exact < 0.95, "{exact}");
    assert!(
        (v["auc-t|lifetime_auc"] - exact).abs() < 1e-4,
        "{} vs {exact}",
        v["auc-t|lifetime_auc"]
    );
    // A few f32 predictions tie among 20000, which only the tie-correct variant groups.
    assert!((v["auc-t|window_auc"] - exact).abs() < 1e-6);
}

#[test]
fn throughput_excludes_warmup_and_windows_recent_steps() {
    use embers::metrics::Throughput;
    use std::time::{Duration, Instant};
    let t0 = Instant::now();
    let mut t = Throughput::new(2, 2).unwrap();
    assert!(Throughput::new(2, 0).is_err());
    // Two slow warm-up steps are ignored; then 100 examples every 10 ms, then every 20 ms.
    t.step_at(100, t0 + Duration::from_millis(500));
    t.step_at(100, t0 + Duration::from_millis(1000));
    for i in 1..=4 {
        t.step_at(100, t0 + Duration::from_millis(1000 + 10 * i));
    }
    assert!((t.lifetime() - 10_000.0).abs() < 1e-6, "{}", t.lifetime());
    for i in 1..=2 {
        t.step_at(100, t0 + Duration::from_millis(1040 + 20 * i));
    }
    assert!((t.window() - 5_000.0).abs() < 1e-6, "{}", t.window());
    assert!(
        (t.lifetime() - 600.0 / 0.080).abs() < 1e-6,
        "{}",
        t.lifetime()
    );
    // A validation of 5 s between two steps, excluded: the rates are the steps' alone.
    t.exclude(Duration::from_secs(5));
    t.step_at(100, t0 + Duration::from_millis(5000 + 1080 + 20));
    assert!((t.window() - 5_000.0).abs() < 1e-6, "{}", t.window());
    assert!(
        (t.lifetime() - 700.0 / 0.100).abs() < 1e-6,
        "{}",
        t.lifetime()
    );
}

/// A state saved with a wider window, loaded into metrics of a narrower one, reports over the
/// narrower window at once, as metrics that saw the same batches with it (it reported over
/// the saved width until the next update); a non-finite value in a state is refused.
#[test]
fn a_state_of_a_wider_window_loads_into_a_narrower_one() {
    let kinds = MetricKind::all();
    let (mut wide, mut narrow) = (
        RecMetrics::new(&["t"], &kinds, 1000).unwrap(),
        RecMetrics::new(&["t"], &kinds, 8).unwrap(),
    );
    for b in 0..5 {
        let p: Vec<f32> = (0..4)
            .map(|i| ((b * 4 + i) as f32 * 0.13).fract())
            .collect();
        let y: Vec<f32> = (0..4).map(|i| ((b + i) % 2) as f32).collect();
        wide.update(&[&p], &[&y], None).unwrap();
        narrow.update(&[&p], &[&y], None).unwrap();
    }
    let mut loaded = RecMetrics::new(&["t"], &kinds, 8).unwrap();
    loaded.load_state_dict(&wide.state_dict()).unwrap();
    let (got, want) = (loaded.compute(), narrow.compute());
    assert_eq!(got.len(), want.len());
    for (k, v) in &want {
        let g = got[k];
        assert!(
            (g - v).abs() <= 1e-12 * v.abs().max(1.0) || (g.is_nan() && v.is_nan()),
            "{k}: {g} vs {v}"
        );
    }
    let mut state = wide.state_dict();
    let key = state.keys().next().unwrap().clone();
    state.get_mut(&key).unwrap()[0] = f64::NAN;
    let e = loaded.load_state_dict(&state).unwrap_err().to_string();
    assert!(e.contains(&format!("entry `{key}` value 0 is NaN")), "{e}");
}

/// A window's sums are its batches' sums, not what is left of a running sum after the
/// batches that left were subtracted: three positive batches whose weights' sum rounds, then
/// one negative batch alone in the window, reads as that batch alone (the running sum kept
/// -2e-16 of positive weight, and calibration over it read -2.4e15).
#[test]
fn a_window_reads_as_its_batches_alone() {
    let kinds = MetricKind::all();
    let mut m = RecMetrics::new(&["t"], &kinds, 1).unwrap();
    for w in [7.609_624_4e-6_f32, 6.515_93, 7.887_233e-12] {
        m.update(&[&[0.5]], &[&[1.0]], Some(&[&[w]])).unwrap();
    }
    let last = ([0.5f32], [0.0f32], [1.0f32]);
    m.update(&[&last.0], &[&last.1], Some(&[&last.2])).unwrap();
    let mut alone = RecMetrics::new(&["t"], &kinds, 1).unwrap();
    alone
        .update(&[&last.0], &[&last.1], Some(&[&last.2]))
        .unwrap();
    let (got, want) = (m.compute(), alone.compute());
    let windowed: Vec<_> = want.keys().filter(|k| k.contains("|window_")).collect();
    assert!(windowed.len() > 10, "{windowed:?}");
    for key in windowed {
        assert_eq!(
            got[key].to_bits(),
            want[key].to_bits(),
            "{key}: {} in the window, {} alone",
            got[key],
            want[key]
        );
    }
}

/// Tasks of one name overwrote each other's values; a name holding the separator of a
/// value's name, a metric asked for twice, or none, are refused too.
#[test]
fn metrics_of_colliding_names_are_refused() {
    let all = MetricKind::all();
    for (tasks, kinds, says) in [
        (&["ctr", "ctr"][..], &all[..], "named twice"),
        (&["a|b"], &all, "without `|`"),
        (&[""], &all, "non-empty"),
        (
            &["ctr"],
            &[MetricKind::Auc, MetricKind::Auc],
            "asked for twice",
        ),
        (&["ctr"], &[], "one metric"),
    ] {
        let err = RecMetrics::new(tasks, kinds, 10).unwrap_err().to_string();
        assert!(err.contains(says), "{tasks:?} {kinds:?}: {err}");
    }
    // Names a trainer takes (letters, digits, `_`, `.`) stay usable.
    RecMetrics::new(&["click.v2", "like_rate", "a-b"], &all, 10).unwrap();
}

/// Predictions of a rare event (1e-6 .. 1e-3, positives scored higher): the lifetime AUC
/// follows the exact one (equal bins of 1/65536 put most of them in the first few bins,
/// ties that read an AUC near 0.5); a state saved with equal bins carries on.
#[test]
fn lifetime_auc_of_rare_event_predictions_tracks_exact_auc() {
    use rand::{Rng, SeedableRng};
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(6);
    let samples: Vec<Sample> = (0..20000)
        .map(|_| {
            let label = if rng.random::<f32>() < 0.01 { 1.0 } else { 0.0 };
            let exponent = -6.0 + 3.0 * rng.random::<f32>() + 0.8 * label;
            Sample {
                prediction: 10f32.powf(exponent.min(-3.0)),
                label,
                weight: 1.0,
            }
        })
        .collect();
    let mut m = RecMetrics::new(&["t"], &[MetricKind::Auc], 10).unwrap();
    let p: Vec<f32> = samples.iter().map(|s| s.prediction).collect();
    let y: Vec<f32> = samples.iter().map(|s| s.label).collect();
    m.update(&[&p], &[&y], None).unwrap();
    let exact = auc::auc_tie_correct(&samples);
    assert!(exact > 0.6 && exact < 0.9, "{exact}");
    let lifetime = m.compute()["auc-t|lifetime_auc"];
    assert!((lifetime - exact).abs() < 1e-3, "{lifetime} vs {exact}");
    // Equal bins on the same samples: far off (what the lifetime AUC was).
    let mut equal = auc::ScoreHistogram::new(embers::metrics::LIFETIME_AUC_BINS);
    equal.add(samples.iter().copied());
    assert!(
        (equal.auc() - exact).abs() > 0.01,
        "{} vs {exact}",
        equal.auc()
    );
    // A state of equal bins (as saved before) loads, its counts carried to the new bins.
    let mut state = m.state_dict();
    let pos = state.remove("auc-t.mixed_positives").unwrap();
    let neg = state.remove("auc-t.mixed_negatives").unwrap();
    assert_eq!(pos.len(), equal.positives.len());
    let _ = neg;
    state.insert("auc-t.positives".into(), equal.positives.clone());
    state.insert("auc-t.negatives".into(), equal.negatives.clone());
    let mut old = RecMetrics::new(&["t"], &[MetricKind::Auc], 10).unwrap();
    old.load_state_dict(&state).unwrap();
    let carried = old.compute()["auc-t|lifetime_auc"];
    assert!(
        (carried - equal.auc()).abs() < 1e-9,
        "{carried} vs {}",
        equal.auc()
    );
}

/// A sum metric's window holds at most 1000 batches, as TorchRec's (`MAX_BUFFER_COUNT`):
/// 1500 batches of one sample in a window of 10000 read as their last 1000 (all 1500 were
/// kept, the memory of a window of tiny batches unbounded). AUC's window keeps samples.
#[test]
fn sum_windows_hold_at_most_a_thousand_batches() {
    use embers::metrics::{SumKind, MAX_WINDOW_BATCHES};
    assert_eq!(MAX_WINDOW_BATCHES, 1000);
    let kinds = [MetricKind::Sum(SumKind::Ctr), MetricKind::Auc];
    let mut m = RecMetrics::new(&["t"], &kinds, 10_000).unwrap();
    let mut last = RecMetrics::new(&["t"], &kinds, 10_000).unwrap();
    for i in 0..1500u32 {
        let (p, y) = ([0.5f32], [f32::from(i % 3 == 0 || i >= 1000)]);
        m.update(&[&p], &[&y], None).unwrap();
        if i >= 500 {
            last.update(&[&p], &[&y], None).unwrap();
        }
    }
    let (got, want) = (m.compute(), last.compute());
    assert_eq!(got["ctr-t|window_ctr"], want["ctr-t|window_ctr"]);
    // Batches 500..1500: 167 multiples of 3 below 1000, then 500 positives.
    assert!((got["ctr-t|window_ctr"] - 0.667).abs() < 1e-12, "{got:?}");
    // 334 + 500 of all 1500.
    assert!(
        (got["ctr-t|lifetime_ctr"] - 834.0 / 1500.0).abs() < 1e-12,
        "{got:?}"
    );
}
