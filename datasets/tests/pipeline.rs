//! Batch assembly, splits, shuffling and the background prefetcher.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use embers_datasets::{
    BatchConfig, Batcher, DatasetError, Example, ExampleSource, FeatureSchema, Prefetcher,
    RawBatch, ShuffleConfig, Split, SplitRule,
};

/// A source of `n` examples with 2 keys of varying lengths: key `a` has `i % 3` ids
/// (`100·i + j`), key `b` has one id (`-i`); dense = [i]; label = i % 2.
struct Counting {
    schema: FeatureSchema,
    next: u64,
    n: u64,
}

fn counting(n: u64) -> Counting {
    Counting {
        schema: FeatureSchema {
            dense_names: vec!["x".into()],
            sparse_keys: vec!["a".into(), "b".into()],
            tasks: vec!["click".to_string()],
        },
        next: 0,
        n,
    }
}

fn example(i: u64) -> Example {
    let a_len = (i % 3) as i64;
    let mut ids: Vec<i64> = (0..a_len).map(|j| 100 * i as i64 + j).collect();
    ids.push(-(i as i64));
    Example {
        index: i,
        dense: vec![i as f32],
        ids,
        lengths: vec![a_len as i32, 1],
        labels: vec![(i % 2) as f32],
        true_probability: None,
    }
}

impl Iterator for Counting {
    type Item = embers_datasets::Result<Example>;
    fn next(&mut self) -> Option<Self::Item> {
        (self.next < self.n).then(|| {
            self.next += 1;
            Ok(example(self.next - 1))
        })
    }
}

impl ExampleSource for Counting {
    fn schema(&self) -> &FeatureSchema {
        &self.schema
    }
}

fn run(n: u64, config: BatchConfig) -> Vec<RawBatch> {
    Batcher::new(counting(n), config)
        .unwrap()
        .map(Result::unwrap)
        .collect()
}

#[test]
fn batches_are_key_major() {
    let batches = run(
        4,
        BatchConfig {
            batch_size: 4,
            ..BatchConfig::default()
        },
    );
    assert_eq!(batches.len(), 1);
    let b = &batches[0];
    assert_eq!(b.batch_size, 4);
    assert_eq!(b.dense, vec![0.0, 1.0, 2.0, 3.0]);
    assert_eq!(b.labels, vec![0.0, 1.0, 0.0, 1.0]);
    // key a: lengths 0,1,2,0 ; key b: 1,1,1,1
    assert_eq!(b.lengths, vec![0, 1, 2, 0, 1, 1, 1, 1]);
    assert_eq!(b.values, vec![100, 200, 201, 0, -1, -2, -3]);
    assert_eq!(b.offsets(), vec![0, 0, 1, 3, 3, 4, 5, 6, 7]);
    assert_eq!(b.length_per_key(), vec![3, 4]);
    assert_eq!(b.ids(0, 2).unwrap(), &[200, 201]);
    assert_eq!(b.ids(1, 3).unwrap(), &[-3]);
    assert_eq!(b.ids(2, 0), None);
    assert_eq!(b.true_probability, None);
}

#[test]
fn last_batch_kept_or_dropped() {
    let kept = run(
        10,
        BatchConfig {
            batch_size: 4,
            ..BatchConfig::default()
        },
    );
    assert_eq!(
        kept.iter().map(|b| b.batch_size).collect::<Vec<_>>(),
        vec![4, 4, 2]
    );
    let dropped = run(
        10,
        BatchConfig {
            batch_size: 4,
            drop_last: true,
            ..BatchConfig::default()
        },
    );
    assert_eq!(dropped.len(), 2);
}

fn indices(batches: &[RawBatch]) -> Vec<u64> {
    batches
        .iter()
        .flat_map(|b| b.example_indices.clone())
        .collect()
}

#[test]
fn shuffle_is_seeded_local_and_a_permutation() {
    let config = |seed| BatchConfig {
        batch_size: 16,
        shuffle: Some(ShuffleConfig {
            buffer_size: 32,
            seed,
        }),
        ..BatchConfig::default()
    };
    let a = indices(&run(200, config(1)));
    let b = indices(&run(200, config(1)));
    let c = indices(&run(200, config(2)));
    assert_eq!(a, b);
    assert_ne!(a, c);
    assert_ne!(a, (0..200).collect::<Vec<_>>());
    let mut sorted = a.clone();
    sorted.sort_unstable();
    assert_eq!(sorted, (0..200).collect::<Vec<_>>());
    // Local: output position p can only hold an index the buffer has seen, i.e. < p + 32.
    assert!(a.iter().enumerate().all(|(p, &i)| (i as usize) < p + 32));
    // The batch content still matches its indices after shuffling.
    let batches = run(50, config(5));
    for batch in &batches {
        for (s, &i) in batch.example_indices.iter().enumerate() {
            assert_eq!(batch.dense[s], i as f32);
            assert_eq!(batch.ids(1, s).unwrap(), &[-(i as i64)]);
        }
    }
}

/// A batch or shuffle buffer far bigger than the data holds the data: nothing is reserved
/// for examples that never come (room for `usize::MAX` examples aborted the process).
#[test]
fn batches_and_buffers_bigger_than_the_data_hold_the_data() {
    for shuffle in [
        None,
        Some(ShuffleConfig {
            buffer_size: usize::MAX,
            seed: 3,
        }),
    ] {
        let batches = run(
            100,
            BatchConfig {
                batch_size: usize::MAX,
                shuffle,
                ..BatchConfig::default()
            },
        );
        assert_eq!(batches.len(), 1);
        let mut got = indices(&batches);
        if shuffle.is_some() {
            assert_ne!(got, (0..100).collect::<Vec<_>>(), "shuffled");
        }
        got.sort_unstable();
        assert_eq!(got, (0..100).collect::<Vec<_>>());
    }
}

#[test]
fn split_rules_partition_indices() {
    let rule = SplitRule::Fractions {
        validation: 0.1,
        test: 0.2,
        seed: 9,
    };
    let mut all = Vec::new();
    let mut sizes = Vec::new();
    for split in [Split::Train, Split::Validation, Split::Test] {
        let got = indices(&run(
            5000,
            BatchConfig {
                batch_size: 64,
                split_rule: rule.clone(),
                split,
                ..BatchConfig::default()
            },
        ));
        sizes.push(got.len());
        all.extend(got);
    }
    all.sort_unstable();
    assert_eq!(
        all,
        (0..5000).collect::<Vec<_>>(),
        "every index in exactly one split"
    );
    assert!((sizes[1] as f64 / 5000.0 - 0.1).abs() < 0.02, "{sizes:?}");
    assert!((sizes[2] as f64 / 5000.0 - 0.2).abs() < 0.02, "{sizes:?}");

    let ranges = SplitRule::IndexRanges {
        train: 0..10,
        validation: 10..15,
        test: 15..20,
    };
    let test = indices(&run(
        30,
        BatchConfig {
            batch_size: 8,
            split_rule: ranges,
            split: Split::Test,
            ..BatchConfig::default()
        },
    ));
    assert_eq!(test, (15..20).collect::<Vec<_>>());

    let overlapping = SplitRule::IndexRanges {
        train: 0..10,
        validation: 5..15,
        test: 15..20,
    };
    assert!(Batcher::new(
        counting(1),
        BatchConfig {
            split_rule: overlapping,
            ..BatchConfig::default()
        }
    )
    .is_err());
    let bad = SplitRule::Fractions {
        validation: 0.7,
        test: 0.7,
        seed: 0,
    };
    assert!(Batcher::new(
        counting(1),
        BatchConfig {
            split_rule: bad,
            ..BatchConfig::default()
        }
    )
    .is_err());
    assert!(Batcher::new(
        counting(1),
        BatchConfig {
            batch_size: 0,
            ..BatchConfig::default()
        }
    )
    .is_err());
}

#[test]
fn inconsistent_example_is_an_error() {
    let schema = counting(0).schema;
    let mut bad = example(4);
    bad.lengths = vec![5, 1];
    let error = RawBatch::from_examples(&schema, &[example(1), bad]).unwrap_err();
    assert!(
        matches!(error, DatasetError::InconsistentExample { index: 4, .. }),
        "{error}"
    );
}

/// An endless iterator that counts how many items it produced and notes when it is dropped.
struct Endless {
    produced: Arc<AtomicUsize>,
    dropped: Arc<AtomicBool>,
}

impl Iterator for Endless {
    type Item = embers_datasets::Result<usize>;
    fn next(&mut self) -> Option<Self::Item> {
        Some(Ok(self.produced.fetch_add(1, Ordering::SeqCst)))
    }
}

impl Drop for Endless {
    fn drop(&mut self) {
        self.dropped.store(true, Ordering::SeqCst);
    }
}

#[test]
fn prefetcher_preserves_order_and_is_bounded_and_stops_on_drop() {
    let produced = Arc::new(AtomicUsize::new(0));
    let dropped = Arc::new(AtomicBool::new(false));
    let mut prefetcher = Prefetcher::spawn(
        Endless {
            produced: produced.clone(),
            dropped: dropped.clone(),
        },
        3,
    )
    .unwrap();
    let first: Vec<usize> = prefetcher.by_ref().take(5).map(Result::unwrap).collect();
    assert_eq!(first, vec![0, 1, 2, 3, 4]);
    // It runs ahead: 5 consumed + 3 queued (waited for, not slept on: a busy machine may
    // not schedule the producer for a while)...
    let waited = std::time::Instant::now();
    while produced.load(Ordering::SeqCst) < 5 + 3 {
        assert!(
            waited.elapsed() < Duration::from_secs(10),
            "produced {}, not running ahead",
            produced.load(Ordering::SeqCst)
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    // ...and no further than 1 more, blocked in send, however long it is given.
    std::thread::sleep(Duration::from_millis(100));
    let ahead = produced.load(Ordering::SeqCst);
    assert!(ahead <= 5 + 3 + 1, "produced {ahead}, queue not bounded");
    drop(prefetcher);
    assert!(
        dropped.load(Ordering::SeqCst),
        "dropping the prefetcher ends the thread"
    );
}

#[test]
fn dropping_a_prefetcher_inside_a_long_item_waits_a_bounded_time() {
    // An item that takes 5 s to produce: the drop waits PREFETCH_DROP_WAIT, then leaves the
    // thread to end by itself (it joined, for the whole item, before).
    let slow = (0..2).map(|i| {
        std::thread::sleep(Duration::from_secs(5));
        Ok::<_, DatasetError>(i)
    });
    let prefetcher = Prefetcher::spawn(slow, 1).unwrap();
    std::thread::sleep(Duration::from_millis(20));
    let started = std::time::Instant::now();
    drop(prefetcher);
    let took = started.elapsed();
    assert!(
        took >= embers_datasets::PREFETCH_DROP_WAIT && took < Duration::from_secs(4),
        "drop took {took:?}"
    );
}

#[test]
fn prefetcher_propagates_errors_then_ends() {
    let items: Vec<embers_datasets::Result<u32>> = vec![
        Ok(1),
        Ok(2),
        Err(DatasetError::InvalidConfig("boom".into())),
        Ok(3),
    ];
    let out: Vec<_> = Prefetcher::spawn(items.into_iter(), 1).unwrap().collect();
    assert_eq!(out.len(), 3);
    assert_eq!(*out[1].as_ref().unwrap(), 2);
    assert!(out[2].as_ref().unwrap_err().to_string().contains("boom"));

    let panicking = (0..3).map(|i| {
        if i == 2 {
            panic!("reader bug");
        }
        Ok(i)
    });
    let out: Vec<_> = Prefetcher::spawn(panicking, 2).unwrap().collect();
    assert_eq!(out.len(), 3);
    match &out[2] {
        Err(DatasetError::WorkerPanicked(message)) => assert!(message.contains("reader bug")),
        other => panic!("unexpected {other:?}"),
    }
    assert!(Prefetcher::spawn(std::iter::empty::<embers_datasets::Result<u8>>(), 0).is_err());
}

#[test]
fn batcher_prefetch_matches_direct() {
    let config = BatchConfig {
        batch_size: 7,
        shuffle: Some(ShuffleConfig {
            buffer_size: 10,
            seed: 3,
        }),
        ..BatchConfig::default()
    };
    let direct = run(100, config.clone());
    let prefetched: Vec<RawBatch> = Batcher::new(counting(100), config)
        .unwrap()
        .prefetch(2)
        .unwrap()
        .map(Result::unwrap)
        .collect();
    assert_eq!(direct, prefetched);
}
