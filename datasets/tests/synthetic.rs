//! The synthetic generator: determinism, splits, Zipf skew, and the planted signal.

use embers_datasets::{
    tie_corrected_auc, BatchConfig, Batcher, RawBatch, Split, SplitRule, SyntheticCriteo,
    SyntheticCriteoConfig, ZipfSampler,
};

fn small(seed: u64) -> SyntheticCriteo {
    SyntheticCriteo::new(SyntheticCriteoConfig {
        seed,
        num_train: 4000,
        num_validation: 1000,
        num_test: 1000,
        ..SyntheticCriteoConfig::default()
    })
    .unwrap()
}

fn batches(generator: &SyntheticCriteo, split: Split) -> Vec<RawBatch> {
    let config = BatchConfig {
        batch_size: 256,
        ..BatchConfig::default()
    };
    Batcher::new(generator.split(split), config)
        .unwrap()
        .map(Result::unwrap)
        .collect()
}

#[test]
fn same_seed_same_batches_different_seed_differs() {
    let a = batches(&small(7), Split::Train);
    let b = batches(&small(7), Split::Train);
    let c = batches(&small(8), Split::Train);
    assert_eq!(a, b);
    assert_eq!(a.len(), 16);
    assert_ne!(a[0].values, c[0].values);
    assert_ne!(a[0].dense, c[0].dense);
    // Counter-based: example i alone equals example i inside the stream.
    let generator = small(7);
    assert_eq!(
        generator.example(300),
        generator.examples(290..310).nth(10).unwrap().unwrap()
    );
    // Examples are generated in parallel chunks of 1024: across chunk boundaries the stream is
    // still example(i) for every i, in order, and its length is the range's.
    let mut stream = generator.examples(1000..3100);
    assert_eq!(stream.size_hint(), (2100, Some(2100)));
    let mut count = 0;
    for i in 1000..3100u64 {
        assert_eq!(
            stream.next().unwrap().unwrap(),
            generator.example(i),
            "example {i}"
        );
        count += 1;
        if i == 1500 {
            assert_eq!(stream.size_hint(), (1599, Some(1599)));
        }
    }
    assert!(stream.next().is_none());
    assert_eq!(count, 2100);
    let batch = &a[1];
    assert_eq!(batch.keys.len(), 26);
    assert_eq!(batch.lengths.len(), 26 * 256);
    assert_eq!(
        batch.ids(3, 5).unwrap(),
        &generator.example(256 + 5).ids[3..4]
    );
    assert!(batch
        .true_probability
        .as_ref()
        .unwrap()
        .iter()
        .all(|p| (0.0..=1.0).contains(p)));
}

#[test]
fn splits_are_disjoint_consecutive_ranges() {
    let generator = small(1);
    assert_eq!(generator.split_range(Split::Train), 0..4000);
    assert_eq!(generator.split_range(Split::Validation), 4000..5000);
    assert_eq!(generator.split_range(Split::Test), 5000..6000);
    let mut seen = std::collections::HashSet::new();
    for split in [Split::Train, Split::Validation, Split::Test] {
        for batch in batches(&generator, split) {
            for index in batch.example_indices {
                assert!(seen.insert(index), "index {index} in two splits");
            }
        }
    }
    assert_eq!(seen.len(), 6000);
}

#[test]
fn zipf_sampler_matches_exact_probabilities() {
    let sampler = ZipfSampler::new(1000, 1.1).unwrap();
    let draws = 200_000u64;
    let mut counts = vec![0u64; 1001];
    let mut state = 12345u64;
    for _ in 0..draws {
        let k = sampler.sample(|| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((state >> 11) as f64 + 0.5) / (1u64 << 53) as f64
        });
        assert!((1..=1000).contains(&k));
        counts[k as usize] += 1;
    }
    for k in [1u64, 2, 10] {
        let expected = sampler.probability(k);
        let observed = counts[k as usize] as f64 / draws as f64;
        let sigma = (expected * (1.0 - expected) / draws as f64).sqrt();
        assert!(
            (observed - expected).abs() < 5.0 * sigma,
            "rank {k}: {observed} vs {expected}"
        );
    }
    assert!(ZipfSampler::new(0, 1.0).is_err());
    assert!(ZipfSampler::new(10, 0.0).is_err());
    // s = 1 exactly goes through the series expansions.
    let harmonic = ZipfSampler::new(3, 1.0).unwrap();
    assert!((harmonic.probability(1) - 6.0 / 11.0).abs() < 1e-12);
    assert!((1..=3).contains(&harmonic.sample(|| 0.5)));
}

#[test]
fn generated_ids_are_zipf_skewed() {
    let generator = small(3);
    let mut counts = vec![0u64; 1000];
    let n = 20_000u64;
    for i in 0..n {
        let example = generator.example(i);
        counts[example.ids[0] as usize] += 1;
    }
    let sampler = ZipfSampler::new(1000, 1.1).unwrap();
    let top = counts[0] as f64 / n as f64;
    assert!(
        (top - sampler.probability(1)).abs() < 0.02,
        "top id share {top}"
    );
    let top10: u64 = counts[..10].iter().sum();
    let bottom500: u64 = counts[500..].iter().sum();
    let expected_top10: f64 = (1..=10).map(|k| sampler.probability(k)).sum();
    assert!((top10 as f64 / n as f64 - expected_top10).abs() < 0.02);
    assert!(
        top10 > 3 * bottom500,
        "top 10 ids ({top10}) dominate the bottom 500 ({bottom500})"
    );
    assert!(counts[0] > counts[1] && counts[1] > counts[9]);
}

#[test]
fn planted_signal_best_auc_is_sane() {
    let generator = SyntheticCriteo::new(SyntheticCriteoConfig {
        num_train: 40_000,
        num_validation: 0,
        num_test: 20_000,
        ..SyntheticCriteoConfig::default()
    })
    .unwrap();
    let best = generator.best_auc(Split::Test, None).unwrap();
    assert!((0.72..0.85).contains(&best), "best AUC {best}");

    // Click rate near 0.3 for the default bias.
    let test = generator.split_range(Split::Test);
    let ctr = test
        .clone()
        .map(|i| generator.example(i).labels[0] as f64)
        .sum::<f64>()
        / (test.end - test.start) as f64;
    assert!((0.2..0.4).contains(&ctr), "ctr {ctr}");

    // A logistic model on the dense features only, trained by full-batch gradient descent,
    // must find some signal but cannot beat the true probability.
    let train: Vec<_> = generator.split(Split::Train).map(Result::unwrap).collect();
    let mut weights = vec![0.0f64; 14];
    for _ in 0..200 {
        let mut gradient = vec![0.0f64; 14];
        for e in &train {
            let z = weights[13]
                + e.dense
                    .iter()
                    .zip(&weights)
                    .map(|(x, w)| *x as f64 * w)
                    .sum::<f64>();
            let error = 1.0 / (1.0 + (-z).exp()) - e.labels[0] as f64;
            for (g, x) in gradient.iter_mut().zip(&e.dense) {
                *g += error * *x as f64;
            }
            gradient[13] += error;
        }
        for (w, g) in weights.iter_mut().zip(&gradient) {
            *w -= 0.5 * g / train.len() as f64;
        }
    }
    let (scores, labels): (Vec<f32>, Vec<f32>) = generator
        .split(Split::Test)
        .map(Result::unwrap)
        .map(|e| {
            let z = weights[13]
                + e.dense
                    .iter()
                    .zip(&weights)
                    .map(|(x, w)| *x as f64 * w)
                    .sum::<f64>();
            (z as f32, e.labels[0])
        })
        .unzip();
    let model = tie_corrected_auc(&scores, &labels).unwrap();
    eprintln!("best AUC {best:.4}, dense-only logistic AUC {model:.4}, ctr {ctr:.3}");
    assert!(model > 0.55, "dense-only model AUC {model}");
    assert!(
        model < best,
        "model {model} must not beat the planted best {best}"
    );
}

#[test]
fn multi_hot_features_and_config_errors() {
    let generator = SyntheticCriteo::new(SyntheticCriteoConfig {
        table_sizes: vec![50, 60],
        ids_per_feature: vec![3, 1],
        num_dense: 2,
        ..SyntheticCriteoConfig::default()
    })
    .unwrap();
    let example = generator.example(9);
    assert_eq!(example.lengths, vec![3, 1]);
    assert_eq!(example.ids.len(), 4);
    assert!(example.ids[..3].iter().all(|&id| (0..50).contains(&id)));
    assert_eq!(example.dense.len(), 2);
    assert!(SyntheticCriteo::new(SyntheticCriteoConfig {
        ids_per_feature: vec![0; 26],
        ..SyntheticCriteoConfig::default()
    })
    .is_err());
    assert!(SyntheticCriteo::new(SyntheticCriteoConfig {
        table_sizes: vec![],
        ids_per_feature: vec![],
        ..SyntheticCriteoConfig::default()
    })
    .is_err());
    // Sizes whose examples could not be held (each reserved ~445 GB), and dense means whose
    // law rounds away, are refused naming the field.
    let refusal =
        |config: SyntheticCriteoConfig| SyntheticCriteo::new(config).err().unwrap().to_string();
    let msg = refusal(SyntheticCriteoConfig {
        ids_per_feature: vec![i32::MAX as u32; 26],
        ..SyntheticCriteoConfig::default()
    });
    assert!(msg.contains("ids_per_feature sums to"), "{msg}");
    let msg = refusal(SyntheticCriteoConfig {
        table_sizes: vec![10],
        ids_per_feature: vec![3_000_000_000],
        ..SyntheticCriteoConfig::default()
    });
    assert!(msg.contains("3000000000 ids per example"), "{msg}");
    let msg = refusal(SyntheticCriteoConfig {
        num_dense: usize::MAX,
        ..SyntheticCriteoConfig::default()
    });
    assert!(msg.contains("num_dense"), "{msg}");
    let msg = refusal(SyntheticCriteoConfig {
        dense_count_mean_range: (1.0, 1e16),
        ..SyntheticCriteoConfig::default()
    });
    assert!(msg.contains("dense_count_mean_range"), "{msg}");
}

#[test]
fn several_tasks_keep_the_first_and_add_related_ones() {
    let config = SyntheticCriteoConfig {
        num_train: 0,
        num_validation: 0,
        num_test: 20_000,
        ..SyntheticCriteoConfig::default()
    };
    let one = SyntheticCriteo::new(config.clone()).unwrap();
    let three = SyntheticCriteo::new(SyntheticCriteoConfig {
        num_tasks: 3,
        ..config.clone()
    })
    .unwrap();
    assert_eq!(one.schema().tasks, ["click"]);
    assert_eq!(three.schema().tasks, ["click", "task1", "task2"]);
    let test = three.split_range(Split::Test);
    let mut labels = vec![Vec::new(); 3];
    let mut probabilities = vec![Vec::new(); 3];
    for i in test.clone() {
        let single = one.example(i);
        let (e, p) = three.example_with_probabilities(i);
        // Task 0 is the single-task data, bit for bit; the features do not depend on tasks.
        assert_eq!(e.labels[0], single.labels[0]);
        assert_eq!(e.true_probability, single.true_probability);
        assert_eq!((&e.dense, &e.ids), (&single.dense, &single.ids));
        assert_eq!(e.labels.len(), 3);
        for t in 0..3 {
            labels[t].push(e.labels[t]);
            probabilities[t].push(p[t]);
        }
    }
    // Each task's label follows its own probability (the mean label is the mean probability
    // within 4 standard errors), its best AUC is a real signal, and the tasks are related but
    // not copies: probabilities correlate clearly below 1.
    let n = labels[0].len() as f64;
    for t in 0..3 {
        let mean_label = labels[t].iter().map(|&y| f64::from(y)).sum::<f64>() / n;
        let mean_p = probabilities[t].iter().sum::<f64>() / n;
        let se = (mean_p * (1.0 - mean_p) / n).sqrt();
        assert!(
            (mean_label - mean_p).abs() < 4.0 * se,
            "task {t}: {mean_label} vs {mean_p}"
        );
        let best = three.best_task_auc(Split::Test, t, None).unwrap();
        assert!((0.68..0.9).contains(&best), "task {t}: best AUC {best}");
    }
    let correlation = |a: &[f64], b: &[f64]| {
        let (ma, mb) = (a.iter().sum::<f64>() / n, b.iter().sum::<f64>() / n);
        let cov: f64 = a.iter().zip(b).map(|(x, y)| (x - ma) * (y - mb)).sum();
        let va: f64 = a.iter().map(|x| (x - ma) * (x - ma)).sum();
        let vb: f64 = b.iter().map(|y| (y - mb) * (y - mb)).sum();
        cov / (va * vb).sqrt()
    };
    for (a, b) in [(0, 1), (0, 2), (1, 2)] {
        let r = correlation(&probabilities[a], &probabilities[b]);
        assert!((0.2..0.8).contains(&r), "tasks {a}, {b}: correlation {r}");
    }
    assert_eq!(one.best_task_auc(Split::Test, 1, None), None);
    assert_eq!(
        one.best_auc(Split::Test, None),
        three.best_task_auc(Split::Test, 0, None)
    );
    // Batches carry one label column per task, row-major.
    let batch = &batches(&three, Split::Test)[0];
    assert_eq!(batch.num_tasks, 3);
    assert_eq!(
        &batch.labels[3..6],
        &three.example(test.start + 1).labels[..]
    );
    for bad in [0, 5000] {
        let error = SyntheticCriteo::new(SyntheticCriteoConfig {
            num_tasks: bad,
            ..config.clone()
        })
        .unwrap_err();
        assert!(error.to_string().contains("num_tasks"), "{error}");
    }
}

#[test]
fn a_split_of_an_endless_ascending_source_ends_after_its_last_index() {
    let generator = small(3);
    let config = |split, split_rule| BatchConfig {
        batch_size: 256,
        split,
        split_rule,
        ..BatchConfig::default()
    };
    // Validation is 0..1000 of an endless stream: 1000 examples, then the end (it scanned
    // the stream for ever before).
    let rule = SplitRule::IndexRanges {
        train: 2000..u64::MAX,
        validation: 0..1000,
        test: 1000..2000,
    };
    let rows: usize = Batcher::new(
        generator.examples(0..u64::MAX),
        config(Split::Validation, rule.clone()),
    )
    .unwrap()
    .map(|b| b.unwrap().batch_size)
    .sum();
    assert_eq!(rows, 1000);
    // A split with no share reads nothing at all.
    let rule = SplitRule::Fractions {
        validation: 0.0,
        test: 0.5,
        seed: 1,
    };
    let mut none = Batcher::new(
        generator.examples(0..u64::MAX),
        config(Split::Validation, rule),
    )
    .unwrap();
    assert!(none.next().is_none());
    let rule = SplitRule::Assigned(std::sync::Arc::new(vec![
        Some(Split::Test),
        None,
        Some(Split::Test),
        Some(Split::Train),
    ]));
    let rows: usize = Batcher::new(generator.examples(0..u64::MAX), config(Split::Test, rule))
        .unwrap()
        .map(|b| b.unwrap().batch_size)
        .sum();
    assert_eq!(rows, 2);
    // Dropping a prefetcher whose batcher is inside a long scan returns (it waited for the
    // scan's end before): a train split that starts far into the stream.
    let rule = SplitRule::IndexRanges {
        train: u64::MAX - 1..u64::MAX,
        validation: 0..0,
        test: 0..0,
    };
    let prefetcher = Batcher::new(generator.examples(0..u64::MAX), config(Split::Train, rule))
        .unwrap()
        .prefetch(2)
        .unwrap();
    std::thread::sleep(std::time::Duration::from_millis(50));
    let started = std::time::Instant::now();
    drop(prefetcher);
    // The scan stops at the drop: the thread is joined well within the wait.
    assert!(
        started.elapsed() < embers_datasets::PREFETCH_DROP_WAIT / 2,
        "drop took {:?}",
        started.elapsed()
    );
}

#[test]
fn split_ranges_that_run_backwards_are_refused() {
    let config = BatchConfig {
        split_rule: SplitRule::IndexRanges {
            train: 0..100,
            validation: std::ops::Range {
                start: 200,
                end: 50,
            },
            test: 0..0,
        },
        ..BatchConfig::default()
    };
    let msg = Batcher::new(small(1).examples(0..10), config)
        .err()
        .unwrap()
        .to_string();
    assert!(
        msg.contains("validation") && msg.contains("backwards"),
        "{msg}"
    );
}
