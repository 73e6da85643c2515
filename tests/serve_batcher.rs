//! The dynamic batcher under concurrent clients: every client gets exactly its own rows'
//! outputs (equal to the model run on them alone), batches close at `max_batch_rows` or
//! `max_delay`, a full queue refuses at once with a retry hint, an invalid request fails alone,
//! a failing batch fails only its own requests, and dropping the batcher drains the queue.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use embers::serve::{BatchModel, BatcherConfig, DynamicBatcher, ServeError};

#[path = "support/checksums.rs"]
mod checksums;
#[path = "support/serve_dlrm.rs"]
mod support;

/// Row `(id, x)` → `2x + id`, a function of the row alone; records every batch's size and
/// when it ran, and can be slowed down or made to fail on a marked row.
#[derive(Default)]
struct Toy {
    batches: Arc<Mutex<Vec<usize>>>,
    /// When each batch began and ended.
    spans: Arc<Mutex<Vec<(Instant, Instant)>>>,
    delay: Duration,
    fail_on: Option<u32>,
    running: Arc<AtomicBool>,
}

impl BatchModel for Toy {
    type Row = (u32, f32);
    type Output = f32;

    fn validate(&self, rows: &[(u32, f32)]) -> Result<(), String> {
        match rows.iter().position(|r| !r.1.is_finite()) {
            Some(i) => Err(format!("row {i}: x is {}", rows[i].1)),
            None => Ok(()),
        }
    }

    fn run(&self, rows: Vec<(u32, f32)>) -> embers::Result<Vec<f32>> {
        // One batch at a time: a second concurrent run would be a bug.
        assert!(
            !self.running.swap(true, Ordering::SeqCst),
            "two batches ran at once"
        );
        self.batches.lock().unwrap().push(rows.len());
        let began = Instant::now();
        std::thread::sleep(self.delay);
        self.spans.lock().unwrap().push((began, Instant::now()));
        self.running.store(false, Ordering::SeqCst);
        if let Some(bad) = self.fail_on {
            if rows.iter().any(|r| r.0 == bad) {
                return Err(embers::Error::invalid("Toy", format!("row {bad} fails")));
            }
        }
        Ok(rows.iter().map(|&(id, x)| 2.0 * x + id as f32).collect())
    }
}

fn expected(rows: &[(u32, f32)]) -> Vec<f32> {
    rows.iter().map(|&(id, x)| 2.0 * x + id as f32).collect()
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

#[test]
fn concurrent_clients_get_their_own_rows_in_batches_of_at_most_max_rows() {
    runtime().block_on(async {
        let model = Toy::default();
        let batches = model.batches.clone();
        let config = BatcherConfig {
            max_batch_rows: 64,
            max_delay: Duration::from_millis(5),
            max_queued_rows: 100_000,
        };
        let batcher = DynamicBatcher::new(model, config).unwrap();
        let mut clients = Vec::new();
        for c in 0..300u32 {
            let batcher = batcher.clone();
            clients.push(tokio::spawn(async move {
                let n = 1 + (c as usize * 7) % 20;
                let rows: Vec<(u32, f32)> = (0..n)
                    .map(|i| (c * 100 + i as u32, c as f32 * 0.5 - i as f32))
                    .collect();
                let out = batcher.submit(rows.clone()).await.unwrap();
                assert_eq!(out, expected(&rows), "client {c}");
                n
            }));
        }
        let mut total = 0;
        for client in clients {
            total += client.await.unwrap();
        }
        let sizes = batches.lock().unwrap().clone();
        assert_eq!(sizes.iter().sum::<usize>(), total);
        assert!(sizes.iter().all(|&s| s <= 64), "{sizes:?}");
        // 300 concurrent clients must have shared batches, not run one by one.
        assert!(
            sizes.len() < 200,
            "{} batches for 300 requests",
            sizes.len()
        );
        let stats = batcher.stats();
        assert_eq!(stats.requests.load(Ordering::Relaxed), 300);
        assert_eq!(stats.batches.load(Ordering::Relaxed), sizes.len() as u64);
        assert_eq!(batcher.queued_rows(), 0);
    });
}

#[test]
fn a_lone_request_waits_at_most_about_max_delay_and_a_large_one_runs_alone_up_to_the_queue() {
    runtime().block_on(async {
        let model = Toy::default();
        let batches = model.batches.clone();
        let config = BatcherConfig {
            max_batch_rows: 8,
            max_delay: Duration::from_millis(20),
            max_queued_rows: 1000,
        };
        let batcher = DynamicBatcher::new(model, config).unwrap();
        let start = Instant::now();
        let out = batcher.submit(vec![(1, 1.0)]).await.unwrap();
        let waited = start.elapsed();
        assert_eq!(out, vec![3.0]);
        assert!(
            waited >= Duration::from_millis(15),
            "closed early: {waited:?}"
        );
        assert!(waited < Duration::from_millis(500), "waited {waited:?}");
        // Larger than a batch: runs as one batch of its own, outputs in order.
        let rows: Vec<(u32, f32)> = (0..20).map(|i| (i, i as f32)).collect();
        assert_eq!(batcher.submit(rows.clone()).await.unwrap(), expected(&rows));
        assert_eq!(*batches.lock().unwrap(), vec![1, 20]);
        // One larger than the queue may hold is refused at once, and runs nothing.
        let rows: Vec<(u32, f32)> = (0..1001).map(|i| (i, 0.0)).collect();
        let refused = batcher.submit(rows).await.unwrap_err();
        assert!(
            matches!(
                refused,
                ServeError::TooLarge {
                    rows: 1001,
                    limit: 1000
                }
            ),
            "{refused}"
        );
        assert_eq!(*batches.lock().unwrap(), vec![1, 20]);
        // An empty request is answered without a batch.
        assert_eq!(batcher.submit(vec![]).await.unwrap(), Vec::<f32>::new());
    });
}

#[test]
fn a_full_queue_refuses_at_once_with_a_retry_hint() {
    runtime().block_on(async {
        let model = Toy {
            delay: Duration::from_millis(100),
            ..Toy::default()
        };
        let config = BatcherConfig {
            max_batch_rows: 4,
            max_delay: Duration::from_millis(1),
            max_queued_rows: 10,
        };
        let batcher = DynamicBatcher::new(model, config).unwrap();
        let mut clients = Vec::new();
        for c in 0..12u32 {
            let batcher = batcher.clone();
            clients.push(tokio::spawn(async move {
                let start = Instant::now();
                let result = batcher.submit(vec![(c, 1.0), (c, 2.0)]).await;
                (result, start.elapsed())
            }));
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        let (mut ok, mut refused) = (0, 0);
        for client in clients {
            match client.await.unwrap() {
                (Ok(out), _) => {
                    ok += 1;
                    assert_eq!(out.len(), 2);
                }
                (
                    Err(ServeError::Overloaded {
                        limit, retry_after, ..
                    }),
                    waited,
                ) => {
                    refused += 1;
                    assert_eq!(limit, 10);
                    assert!(retry_after > Duration::ZERO);
                    assert!(
                        waited < Duration::from_millis(50),
                        "refused after {waited:?}"
                    );
                }
                (Err(e), _) => panic!("unexpected {e}"),
            }
        }
        // 12 requests of 2 rows against a limit of 10 rows while each batch takes 100 ms.
        assert!(ok >= 5 && refused >= 1, "{ok} answered, {refused} refused");
        assert_eq!(
            batcher.stats().overloaded.load(Ordering::Relaxed),
            refused as u64
        );
    });
}

#[test]
fn an_invalid_request_or_a_failing_batch_fails_only_its_own_requests() {
    runtime().block_on(async {
        let model = Toy {
            fail_on: Some(666),
            ..Toy::default()
        };
        let config = BatcherConfig {
            max_batch_rows: 1000,
            max_delay: Duration::from_millis(30),
            max_queued_rows: 10_000,
        };
        let batcher = DynamicBatcher::new(model, config).unwrap();
        let good = {
            let b = batcher.clone();
            tokio::spawn(async move { b.submit(vec![(1, 1.0), (2, 2.0)]).await })
        };
        let bad = {
            let b = batcher.clone();
            tokio::spawn(async move { b.submit(vec![(3, 1.0), (4, f32::NAN)]).await })
        };
        let bad = bad.await.unwrap().unwrap_err();
        assert!(
            matches!(&bad, ServeError::Invalid(m) if m.contains("row 1")),
            "{bad}"
        );
        assert_eq!(good.await.unwrap().unwrap(), vec![3.0, 6.0]);
        // A row the model fails on fails its batch, and the next batch runs normally.
        let failing = batcher.submit(vec![(666, 1.0)]).await.unwrap_err();
        assert!(
            matches!(&failing, ServeError::Model(m) if m.contains("666")),
            "{failing}"
        );
        assert_eq!(batcher.submit(vec![(5, 0.5)]).await.unwrap(), vec![6.0]);
        assert_eq!(batcher.stats().invalid.load(Ordering::Relaxed), 1);
        assert_eq!(batcher.stats().model_errors.load(Ordering::Relaxed), 1);
    });
}

#[test]
fn dropping_the_batcher_still_answers_every_queued_request() {
    runtime().block_on(async {
        let model = Toy {
            delay: Duration::from_millis(20),
            ..Toy::default()
        };
        let config = BatcherConfig {
            max_batch_rows: 2,
            max_delay: Duration::from_millis(1),
            max_queued_rows: 1000,
        };
        let batcher = DynamicBatcher::new(model, config).unwrap();
        let mut clients = Vec::new();
        for c in 0..10u32 {
            let b = batcher.clone();
            clients.push(tokio::spawn(async move { b.submit(vec![(c, 1.0)]).await }));
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
        drop(batcher);
        for (c, client) in clients.into_iter().enumerate() {
            assert_eq!(client.await.unwrap().unwrap(), vec![2.0 + c as f32]);
        }
    });
}

#[test]
fn a_batcher_that_could_never_run_is_refused() {
    runtime().block_on(async {
        for config in [
            BatcherConfig {
                max_batch_rows: 0,
                ..BatcherConfig::default()
            },
            BatcherConfig {
                max_queued_rows: 0,
                ..BatcherConfig::default()
            },
        ] {
            let error = DynamicBatcher::new(Toy::default(), config).err().unwrap();
            assert!(error.to_string().contains("at least 1"), "{error}");
        }
    });
}

/// A trained DLRM behind the batcher: 40 concurrent clients of 1–8 rows each get the
/// bit-identical probabilities the model gives their rows alone (an identical copy of the model
/// runs them: predictions are row-invariant), for FP32 and INT8 tables; rows with a bad id or dense width
/// fail alone, naming the row and feature.
#[test]
fn a_trained_dlrm_answers_concurrent_clients_as_it_answers_each_alone() {
    use embers::embedding::WeightType;
    use embers::serve::{DlrmRow, DlrmServable};

    let g = support::data(5_000, 400, 2);
    let (config, _, dir, path) = support::trained_checkpoint(&g, 1, "serve");
    let copy = || {
        let mut t = config.build().unwrap();
        t.load_checkpoint(&path).unwrap();
        t
    };
    let rows: Vec<DlrmRow> = support::rows(&g);
    for quantized in [false, true] {
        let tables = |t: &embers::train::DlrmTrainer| {
            quantized.then(|| t.model().sparse_arch.quantize(WeightType::Int8).unwrap())
        };
        let served = copy();
        let q = tables(&served);
        let reference = {
            let t = copy();
            let q = tables(&t);
            DlrmServable::new(t, q)
        };
        let servable = DlrmServable::new(served, q);
        assert_eq!(servable.keys(), &g.schema().sparse_keys[..]);
        let rows = rows.clone();
        runtime().block_on(async move {
            let batcher = DynamicBatcher::new(
                servable,
                BatcherConfig {
                    max_batch_rows: 64,
                    max_delay: Duration::from_millis(5),
                    max_queued_rows: 10_000,
                },
            )
            .unwrap();
            let mut clients = Vec::new();
            let mut at = 0;
            for c in 0..40 {
                let n = 1 + c % 8;
                let mine: Vec<DlrmRow> = rows[at..at + n].to_vec();
                at += n;
                let b = batcher.clone();
                clients.push(tokio::spawn(async move {
                    let out = b.submit(mine.clone()).await.unwrap();
                    (mine, out)
                }));
            }
            for client in clients {
                let (mine, out) = client.await.unwrap();
                // Predictions are row-invariant: batched with strangers or alone, the same bits.
                let alone = reference.run(mine).unwrap();
                assert_eq!(out.len(), alone.len());
                for (a, b) in out.iter().zip(&alone) {
                    assert_eq!(a.len(), 2, "one probability per task");
                    assert_eq!(a, b, "quantized {quantized}: batched and alone differ");
                }
            }
            assert!(batcher.stats().max_batch_rows.load(Ordering::Relaxed) > 8);
            // Bad rows fail their own request, naming row and feature.
            let mut bad = rows[0].clone();
            bad.ids[2][0] = 100;
            let e = batcher
                .submit(vec![rows[1].clone(), bad])
                .await
                .unwrap_err();
            assert!(
                e.to_string().contains("row 1: feature `cat_2` id 100"),
                "{e}"
            );
            let mut short = rows[0].clone();
            short.dense.pop();
            let e = batcher.submit(vec![short]).await.unwrap_err();
            assert!(e.to_string().contains("dense values"), "{e}");
        });
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A DLRM served from row files behind small DRAM caches (a tenth of each table; FP32, INT8
/// and INT4 rows; LRU and LFU) predicts exactly what the same checkpoint served from memory
/// predicts, bit for bit, with misses and evictions counted; two such servables of one
/// checkpoint (a reload's overlap) keep their files apart, and each removes its own when
/// dropped. What a dead server left there is removed; a load factor of 0 is refused by name.
#[test]
#[cfg(unix)] // the test holds a lock with flock
fn a_dlrm_served_from_cached_tables_predicts_as_from_memory() {
    use embers::embedding::{CachePolicy, CacheSize, Placement, WeightType};
    use embers::serve::DlrmServable;

    let g = support::data(3_000, 300, 1);
    let (_, _, dir, path) = support::trained_checkpoint(&g, 1, "serve-cached");
    let root = dir.join("caches");
    // Left by a server that died: its lock file held by no one...
    let dead = root.join("embers-serve-4000000000-0-1a2b");
    std::fs::create_dir_all(&dead).unwrap();
    std::fs::write(dead.join(".lock"), b"").unwrap();
    std::fs::write(dead.join("ebc-group0.rows"), b"stale").unwrap();
    // ... one whose lock a live server holds (from another process or PID namespace: its
    // pid means nothing here) ...
    let alive = root.join("embers-serve-4000000001-0-3c4d");
    std::fs::create_dir_all(&alive).unwrap();
    let holder = std::fs::File::create(alive.join(".lock")).unwrap();
    {
        use std::os::unix::io::AsRawFd;
        // SAFETY: flock on an open descriptor.
        assert_eq!(unsafe { libc::flock(holder.as_raw_fd(), libc::LOCK_EX) }, 0);
    }
    // ... and one with no lock file yet (its server between making and locking it): kept.
    let unlocked = root.join("embers-serve-4000000002-0-5e6f");
    std::fs::create_dir_all(&unlocked).unwrap();
    let entries = || -> Vec<String> {
        let mut names: Vec<String> = (std::fs::read_dir(&root).unwrap())
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    };
    let rows = support::rows(&g);
    let cases = [
        (None, CachePolicy::Lru),
        (Some(WeightType::Int8), CachePolicy::Lfu),
        (Some(WeightType::Int4), CachePolicy::Lru),
    ];
    for (quantize, policy) in cases {
        let memory = DlrmServable::from_checkpoint(&path, quantize).unwrap();
        let placement = Placement::Cached {
            dir: root.clone(),
            size: CacheSize::LoadFactor(0.1),
            policy,
        };
        let cached = DlrmServable::from_checkpoint_placed(&path, quantize, &placement).unwrap();
        assert!(!dead.exists(), "a dead server's files were kept");
        let again = DlrmServable::from_checkpoint_placed(&path, quantize, &placement).unwrap();
        assert!(alive.exists(), "a live server's files were removed");
        assert!(unlocked.exists(), "a directory being made was removed");
        let ours: Vec<String> = (entries().into_iter())
            .filter(|n| !alive.ends_with(n) && !unlocked.ends_with(n))
            .collect();
        assert_eq!(ours.len(), 2, "{ours:?}");
        let pid = format!("embers-serve-{}-", std::process::id());
        assert!(ours.iter().all(|n| n.starts_with(&pid)), "{ours:?}");
        for chunk in rows.chunks(37) {
            let want = memory.run(chunk.to_vec()).unwrap();
            assert_eq!(cached.run(chunk.to_vec()).unwrap(), want, "{quantize:?}");
            assert_eq!(again.run(chunk.to_vec()).unwrap(), want, "{quantize:?}");
        }
        assert!(memory.cache_stats().is_empty());
        let stats = cached.cache_stats();
        assert_eq!(stats.len(), 4, "one series per table");
        for s in &stats {
            // 100 rows, one set of 32 slots: the tables do not fit.
            assert_eq!(s.slots, 32, "{s:?}");
            assert!(s.unique_misses > 32 && s.evictions > 0, "{s:?}");
            assert!(s.unique_misses < s.unique_ids, "{s:?}");
            assert_eq!(s.rows_read, s.unique_misses, "{s:?}");
        }
        drop(cached);
        assert_eq!(entries().len(), 3);
        drop(again);
        assert_eq!(entries().len(), 2, "only the others' directories are left");
    }
    drop(holder);
    let _ = std::fs::remove_dir_all(&alive);
    let _ = std::fs::remove_dir_all(&unlocked);
    let zero = Placement::Cached {
        dir: root.clone(),
        size: CacheSize::LoadFactor(0.0),
        policy: CachePolicy::Lru,
    };
    let err = DlrmServable::from_checkpoint_placed(&path, None, &zero)
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("cache load factor 0"), "{err}");
    assert_eq!(entries(), Vec::<String>::new());
    // A checkpoint that fails after its directory is made (weights that load but score the
    // probe row to NaN: every f32 tensor NaN; the metrics' f64 state kept, which would be
    // refused as it loads): refused, and the directory goes with it.
    let nan = dir.join("nan.safetensors");
    let mut bytes = std::fs::read(&path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    for info in header.as_object().unwrap().values() {
        if info["dtype"] != "F32" {
            continue;
        }
        let at = |i: usize| 8 + n + info["data_offsets"][i].as_u64().unwrap() as usize;
        for chunk in bytes[at(0)..at(1)].chunks_exact_mut(4) {
            chunk.copy_from_slice(&f32::NAN.to_le_bytes());
        }
    }
    std::fs::write(&nan, &bytes).unwrap();
    checksums::restamp_checksums(&nan);
    let placement = Placement::Cached {
        dir: root.clone(),
        size: CacheSize::LoadFactor(0.1),
        policy: CachePolicy::Lru,
    };
    for quantize in [None, Some(WeightType::Int8)] {
        let err = DlrmServable::from_checkpoint_placed(&nan, quantize, &placement)
            .err()
            .unwrap()
            .to_string();
        // Refused as the checkpoint is read (values read back are finite), before any
        // cached table's files are made.
        assert!(
            err.contains("is NaN: a checkpoint's values are finite"),
            "{err}"
        );
        assert_eq!(entries(), Vec::<String>::new());
    }
    // A cache directory that is a file: named.
    let file = dir.join("a-file");
    std::fs::write(&file, b"x").unwrap();
    let in_file = Placement::Cached {
        dir: file.clone(),
        size: CacheSize::LoadFactor(0.1),
        policy: CachePolicy::Lru,
    };
    let err = DlrmServable::from_checkpoint_placed(&path, None, &in_file)
        .err()
        .unwrap()
        .to_string();
    assert!(
        err.contains("a-file") && err.contains("not a directory"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// A request queued while a batch runs waits at most `max_delay` from its arrival: when the
/// batch before ends past that, its batch runs at once (it waited a further `max_delay`).
#[test]
fn the_batching_delay_counts_from_a_requests_arrival() {
    runtime().block_on(async {
        let model = Toy {
            delay: Duration::from_millis(800),
            ..Toy::default()
        };
        let spans = model.spans.clone();
        let config = BatcherConfig {
            max_batch_rows: 64,
            max_delay: Duration::from_millis(400),
            max_queued_rows: 1000,
        };
        let batcher = DynamicBatcher::new(model, config).unwrap();
        let first = {
            let batcher = batcher.clone();
            tokio::spawn(async move { batcher.submit(vec![(1, 1.0)]).await })
        };
        // Queued while the first batch gathers (0.4 s) and runs (0.8 s): its own 0.4 s have
        // passed when that batch ends, at ~1.2 s.
        tokio::time::sleep(Duration::from_millis(450)).await;
        let second = batcher.submit(vec![(2, 2.0)]).await.unwrap();
        assert_eq!(second, expected(&[(2, 2.0)]));
        first.await.unwrap().unwrap();
        // So it runs at once; counted from when the worker took it, it waited 0.4 s more.
        let spans = spans.lock().unwrap().clone();
        assert_eq!(spans.len(), 2);
        let gap = spans[1].0 - spans[0].1;
        assert!(
            gap < Duration::from_millis(250),
            "the second batch began {gap:?} after the first ended"
        );
    });
}

/// A request whose client went away before its batch ran is dropped unrun: the model sees
/// only the rows still wanted, and the queue frees its place.
#[test]
fn requests_whose_clients_left_are_not_run() {
    runtime().block_on(async {
        let model = Toy::default();
        let batches = model.batches.clone();
        let config = BatcherConfig {
            max_batch_rows: 64,
            max_delay: Duration::from_millis(300),
            max_queued_rows: 1000,
        };
        let batcher = DynamicBatcher::new(model, config).unwrap();
        let gone = {
            let batcher = batcher.clone();
            tokio::spawn(async move { batcher.submit(vec![(1, 1.0); 5]).await })
        };
        // Queued (not merely spawned) before its client goes away.
        let waited = Instant::now();
        while batcher.queued_rows() < 5 {
            assert!(waited.elapsed() < Duration::from_secs(10), "never queued");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        gone.abort();
        let kept = batcher.submit(vec![(2, 2.0); 3]).await.unwrap();
        assert_eq!(kept, expected(&[(2, 2.0); 3]));
        assert_eq!(*batches.lock().unwrap(), vec![3], "only the kept rows ran");
        assert_eq!(batcher.stats().abandoned.load(Ordering::Relaxed), 1);
        assert_eq!(batcher.queued_rows(), 0);
    });
}
