//! Load generator for the inference server, aimed only at 127.0.0.1 and bounded in requests
//! and time. It starts the server in this process (its own tokio runtime; the model computes on
//! rayon's pool) on the DLRM example's model — the checkpoint in `EMBERS_SERVE_CHECKPOINT`
//! (e.g. `dlrm-out/checkpoint.safetensors` after `cargo run --release --example dlrm`), or by
//! default the example's default architecture untrained (same shapes, so the same cost) — with
//! tables in `EMBERS_SERVE_QUANTIZE` (default `int8`; `fp32`, `fp16`, `int4`, `fp8`), and sends
//! JSON requests of synthetic Criteo rows over HTTP/1.1 keep-alive connections:
//!
//! 1. idle: one client, sequential 1-row requests (the latency floor);
//! 2. closed loop: N clients, each sending its next request when the last is answered, for
//!    1-row and 32-row requests: throughput and latency percentiles;
//! 3. open loop: 1-row requests at fixed rates (`EMBERS_SERVE_QPS`, comma-separated requests/s;
//!    by default 50% and 90% of the closed loop's maximum), latency measured from each
//!    request's scheduled time (no coordinated omission);
//! 4. the closed loop again with batching off (`max_batch_rows` 1): what batching buys;
//! 5. the retrieval stage (`:retrieve`): a TwoTower at the TwoTower example's MovieLens-100K
//!    shape (943 users, 1682 items, 64-dim tables, MLP 128 → 64, untrained: same cost) with an
//!    IVF-PQ index of its items (nlist 16, m 16, nprobe 4), k = 100: the stage alone per batch,
//!    one query at a time, and 16 clients in a closed loop.
//!
//! `EMBERS_SERVE_CACHE` (a load factor) serves the tables from row files behind DRAM caches of
//! that fraction of their rows; the model alone is timed that way too (load factor 0.2 by
//! default), beside the tables in memory.
//!
//! `EMBERS_SERVE_SECS` (default 4) is each phase's length; `EMBERS_SERVE_DELAY_US` (default
//! 0: each batch is what queued while the last one ran) the batcher's `max_delay`. Client and server share the
//! machine's cores. Run: `cargo bench --bench serve_load`.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use embers::embedding::{CachePolicy, CacheSize, FusedOptimizer, Placement, WeightType};
use embers::serve::{BatcherConfig, Server, ServerConfig};
use embers::train::{DenseOptimizer, DlrmConfig};
use embers_datasets::{Split, SyntheticCriteo, SyntheticCriteoConfig};
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1::SendRequest;
use serde_json::{json, Value};

/// No phase sends more than this many requests.
const MAX_REQUESTS: usize = 2_000_000;

type Conn = SendRequest<Full<Bytes>>;

async fn connect(addr: SocketAddr) -> Conn {
    let stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
    stream.set_nodelay(true).expect("nodelay");
    let (sender, conn) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
            .await
            .expect("handshake");
    tokio::spawn(conn);
    sender
}

/// The DLRM's route.
const PREDICT: &str = "/v1/models/dlrm:predict";
/// The retrieval stage's route (phase 5).
const RETRIEVE: &str = "/v1/models/dlrm:retrieve";

/// Sends one request to `path`; its status (anything but 200 or 503 panics).
async fn post(conn: &mut Conn, path: &str, body: &Bytes) -> u16 {
    conn.ready().await.expect("connection ready");
    // Arrow IPC streams start with the continuation marker 0xFFFFFFFF; JSON with `{`.
    let content_type = if body.first() == Some(&0xff) {
        embers::serve::ARROW_STREAM
    } else {
        "application/json"
    };
    let req = hyper::Request::post(path)
        .header("host", "127.0.0.1")
        .header("content-type", content_type)
        .body(Full::new(body.clone()))
        .expect("request");
    let response = conn.send_request(req).await.expect("response");
    let status = response.status();
    let body = response
        .into_body()
        .collect()
        .await
        .expect("body")
        .to_bytes();
    assert!(
        status == 200 || status == 503,
        "{status}: {}",
        String::from_utf8_lossy(&body)
    );
    status.as_u16()
}

/// Latency percentiles of `samples` in milliseconds.
fn summary(samples: &mut [Duration]) -> String {
    samples.sort();
    let at = |q: f64| {
        let i = ((samples.len() as f64 * q).ceil() as usize).clamp(1, samples.len()) - 1;
        samples[i].as_secs_f64() * 1e3
    };
    format!(
        "p50 {:.3} ms  p99 {:.3} ms  p99.9 {:.3} ms  ({} requests)",
        at(0.5),
        at(0.99),
        at(0.999),
        samples.len()
    )
}

/// JSON bodies of `rows` rows each, cycling over the synthetic test rows.
fn bodies(g: &SyntheticCriteo, rows: usize, count: usize) -> Vec<Bytes> {
    let keys = &g.schema().sparse_keys;
    let examples: Vec<Value> = g
        .examples(g.split_range(Split::Test))
        .map(|e| {
            let e = e.expect("example");
            let mut o = serde_json::Map::new();
            o.insert("dense".into(), json!(e.dense));
            let mut at = 0;
            for (k, &l) in keys.iter().zip(&e.lengths) {
                o.insert(k.clone(), json!(e.ids[at..at + l as usize]));
                at += l as usize;
            }
            Value::Object(o)
        })
        .collect();
    (0..count)
        .map(|i| {
            let instances: Vec<&Value> = (0..rows)
                .map(|r| &examples[(i * rows + r) % examples.len()])
                .collect();
            Bytes::from(serde_json::to_vec(&json!({ "instances": instances })).expect("json"))
        })
        .collect()
}

/// Arrow IPC bodies of `rows` rows each (the same rows as [`bodies`]).
fn arrow_bodies(g: &SyntheticCriteo, rows: usize, count: usize) -> Vec<Bytes> {
    use arrow_array::builder::{Float32Builder, Int64Builder, ListBuilder};
    use arrow_array::{ArrayRef, RecordBatch};
    let keys = &g.schema().sparse_keys;
    let examples: Vec<_> = g
        .examples(g.split_range(Split::Test))
        .map(|e| e.expect("example"))
        .collect();
    (0..count)
        .map(|i| {
            let mine: Vec<_> = (0..rows)
                .map(|r| &examples[(i * rows + r) % examples.len()])
                .collect();
            let mut dense = ListBuilder::new(Float32Builder::new());
            let mut ids: Vec<_> = keys
                .iter()
                .map(|_| ListBuilder::new(Int64Builder::new()))
                .collect();
            for e in &mine {
                dense.values().append_slice(&e.dense);
                dense.append(true);
                let mut at = 0;
                for (b, &l) in ids.iter_mut().zip(&e.lengths) {
                    b.values().append_slice(&e.ids[at..at + l as usize]);
                    b.append(true);
                    at += l as usize;
                }
            }
            let mut columns: Vec<(String, ArrayRef)> =
                vec![("dense".into(), Arc::new(dense.finish()))];
            for (k, mut b) in keys.iter().zip(ids) {
                columns.push((k.clone(), Arc::new(b.finish())));
            }
            let batch = RecordBatch::try_from_iter(columns).expect("batch");
            let mut out = Vec::new();
            let mut w = arrow_ipc::writer::StreamWriter::try_new(&mut out, &batch.schema())
                .expect("writer");
            w.write(&batch).expect("write");
            w.finish().expect("finish");
            drop(w);
            Bytes::from(out)
        })
        .collect()
}

/// `clients` clients posting to `path` in a closed loop for `secs`: (requests/s, latencies).
async fn closed_loop(
    addr: SocketAddr,
    path: &'static str,
    bodies: Arc<Vec<Bytes>>,
    clients: usize,
    secs: f64,
) -> (f64, Vec<Duration>) {
    let start = Instant::now();
    let end = start + Duration::from_secs_f64(secs);
    let mut tasks = Vec::new();
    for c in 0..clients {
        let bodies = bodies.clone();
        tasks.push(tokio::spawn(async move {
            let mut conn = connect(addr).await;
            let mut latencies = Vec::new();
            let mut i = c;
            while Instant::now() < end && latencies.len() < MAX_REQUESTS / clients {
                let t = Instant::now();
                let status = post(&mut conn, path, &bodies[i % bodies.len()]).await;
                assert_eq!(status, 200, "a closed loop never overloads the queue");
                latencies.push(t.elapsed());
                i += clients;
            }
            latencies
        }));
    }
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await.expect("client"));
    }
    (all.len() as f64 / start.elapsed().as_secs_f64(), all)
}

/// Requests at `rate` per second for `secs` over a pool of 512 connections opened before the
/// clock starts (a request waits for a free one); latency from each request's scheduled time,
/// so waiting for a connection counts. Returns the answered requests' latencies and how many
/// were refused (503).
async fn open_loop(
    addr: SocketAddr,
    bodies: Arc<Vec<Bytes>>,
    rate: f64,
    secs: f64,
) -> (Vec<Duration>, usize) {
    let (give, take) = tokio::sync::mpsc::unbounded_channel::<Conn>();
    for _ in 0..512 {
        give.send(connect(addr).await).expect("pool");
    }
    let take = Arc::new(tokio::sync::Mutex::new(take));
    let start = Instant::now();
    let n = ((rate * secs) as usize).min(MAX_REQUESTS);
    let mut tasks = Vec::with_capacity(n);
    for i in 0..n {
        let due = start + Duration::from_secs_f64(i as f64 / rate);
        tokio::time::sleep_until(due.into()).await;
        let (give, take, bodies) = (give.clone(), take.clone(), bodies.clone());
        tasks.push(tokio::spawn(async move {
            let mut conn = take.lock().await.recv().await.expect("pool");
            let status = post(&mut conn, PREDICT, &bodies[i % bodies.len()]).await;
            let latency = due.elapsed();
            give.send(conn).expect("pool");
            (status, latency)
        }));
    }
    let (mut all, mut refused) = (Vec::with_capacity(n), 0);
    for t in tasks {
        match t.await.expect("request") {
            (200, latency) => all.push(latency),
            _ => refused += 1,
        }
    }
    (all, refused)
}

/// One client posting `bodies` to `path` one at a time for `secs` (at most 20,000): latencies.
async fn one_at_a_time(addr: SocketAddr, path: &str, bodies: &[Bytes], secs: f64) -> Vec<Duration> {
    let mut conn = connect(addr).await;
    let mut latencies = Vec::new();
    let end = Instant::now() + Duration::from_secs_f64(secs);
    for i in 0..20_000 {
        if Instant::now() >= end {
            break;
        }
        let t = Instant::now();
        assert_eq!(post(&mut conn, path, &bodies[i % bodies.len()]).await, 200);
        latencies.push(t.elapsed());
    }
    latencies
}

/// A running server: its address, the sender that stops it, and its task.
type Running = (
    SocketAddr,
    tokio::sync::oneshot::Sender<()>,
    tokio::task::JoinHandle<std::io::Result<()>>,
);

/// Starts a server for `config` on `rt`, on a free port of 127.0.0.1.
fn start(rt: &tokio::runtime::Runtime, config: ServerConfig) -> Running {
    rt.block_on(async {
        let server = Server::start(config).await.expect("server");
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let done = tokio::spawn(async move {
            server
                .serve(listener, async {
                    let _ = stopped.await;
                })
                .await
        });
        (addr, stop, done)
    })
}

/// `label` followed by what `run(n)` costs for batches of 1, 16, 64 and 256 `unit`s (2000
/// units per size).
/// The median of `v` (sorted in place).
fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn per_batch(label: &str, unit: &str, mut run: impl FnMut(usize)) -> String {
    let mut line = label.to_string();
    for n in [1, 16, 64, 256] {
        let reps = 2000 / n;
        let t = Instant::now();
        for _ in 0..reps {
            run(n);
        }
        let each = t.elapsed().as_secs_f64() / reps as f64;
        line += &format!(
            "  {n} {unit} {:.0} us ({:.0} {unit}/s)",
            each * 1e6,
            n as f64 / each
        );
    }
    line
}

fn main() {
    let secs: f64 = std::env::var("EMBERS_SERVE_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(4.0);
    let quantize = match std::env::var("EMBERS_SERVE_QUANTIZE")
        .as_deref()
        .unwrap_or("int8")
    {
        "fp32" => None,
        "fp16" => Some(WeightType::Fp16),
        "int8" => Some(WeightType::Int8),
        "int4" => Some(WeightType::Int4),
        "fp8" => Some(WeightType::Fp8),
        other => panic!("EMBERS_SERVE_QUANTIZE={other}: expected fp32, fp16, int8, int4 or fp8"),
    };
    // EMBERS_SERVE_CACHE: serve the HTTP phases from tables in row files behind DRAM caches of
    // this load factor (default: in memory); the model-alone comparison uses it, or 0.2.
    let serve_cached: Option<f64> = std::env::var("EMBERS_SERVE_CACHE")
        .ok()
        .map(|s| s.parse().expect("EMBERS_SERVE_CACHE: a load factor"));
    let cache_load_factor = serve_cached.unwrap_or(0.2);
    // The DLRM example's default data and model (tables capped at 100k rows, D = 16,
    // bottom 64-32-16, top 64-32-1).
    let defaults = SyntheticCriteoConfig::default();
    let data = SyntheticCriteoConfig {
        table_sizes: defaults
            .table_sizes
            .iter()
            .map(|&s| s.min(100_000))
            .collect(),
        num_train: 0,
        num_validation: 0,
        // 4096 rows for the requests; all of them for the cached model's stream.
        num_test: 1 << 16,
        ..defaults
    };
    let g = SyntheticCriteo::new(data.clone()).expect("synthetic data");
    let dir = std::env::temp_dir().join(format!("embers-serve-load-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let checkpoint = match std::env::var("EMBERS_SERVE_CHECKPOINT") {
        Ok(path) => path.into(),
        Err(_) => {
            let config = DlrmConfig {
                num_dense: g.schema().num_dense(),
                sparse_features: (g.schema().sparse_keys.iter().cloned())
                    .zip(data.table_sizes.iter().map(|&s| s as usize))
                    .collect(),
                embedding_dim: 16,
                dense_arch: vec![64, 32],
                over_arch: vec![64, 32],
                tasks: vec!["click".into()],
                dcn: None,
                dense_optimizer: DenseOptimizer::Adagrad { lr: 0.05 },
                sparse_optimizer: FusedOptimizer::RowWiseAdagrad {
                    lr: 0.05,
                    eps: 1e-8,
                },
                seed: 0,
                metrics_window: 1000,
                device: embers::Device::Cpu,
            };
            let path = dir.join("model.safetensors");
            let trainer = config.build().expect("model");
            trainer
                .save_checkpoint(&path, &Default::default())
                .expect("checkpoint");
            path
        }
    };
    let delay_us: u64 = std::env::var("EMBERS_SERVE_DELAY_US")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let server_rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("server runtime");
    let client_rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("client runtime");
    let start_server = |batch: usize| {
        let mut config = ServerConfig::new("dlrm", &checkpoint);
        config.quantize = quantize;
        if let Some(f) = serve_cached {
            config.tables = Placement::Cached {
                dir: dir.join("caches"),
                size: CacheSize::LoadFactor(f),
                policy: CachePolicy::Lru,
            };
        }
        config.batcher = BatcherConfig {
            max_batch_rows: batch,
            max_delay: Duration::from_micros(delay_us),
            max_queued_rows: 1 << 16,
        };
        start(&server_rt, config)
    };
    println!(
        "embers-serve load: {} tables, {} dense, tables {:?}{}, max_delay {delay_us} us, {} cores, {secs} s per phase, checkpoint {}",
        g.schema().sparse_keys.len(),
        g.schema().num_dense(),
        quantize.map_or("fp32".to_string(), |w| format!("{w:?}")),
        serve_cached.map_or(String::new(), |f| format!(
            " in row files behind caches of {f} of their rows"
        )),
        std::thread::available_parallelism().map_or(1, |n| n.get()),
        checkpoint.display()
    );
    {
        // The model alone (no HTTP, no batcher): what a batch of each size costs.
        use embers::serve::{BatchModel, DlrmRow, DlrmServable};
        let servable = DlrmServable::from_checkpoint(&checkpoint, quantize).expect("model");
        let row_of = |e: embers_datasets::Example| {
            let mut at = 0;
            let ids = (e.lengths.iter())
                .map(|&l| {
                    at += l as usize;
                    e.ids[at - l as usize..at].to_vec()
                })
                .collect();
            DlrmRow {
                dense: e.dense,
                ids,
            }
        };
        let stream: Vec<DlrmRow> = (g.examples(g.split_range(Split::Test)))
            .map(|e| row_of(e.expect("example")))
            .collect();
        let rows = &stream[..256];
        let line = per_batch("the model alone, per batch:", "rows", |n| {
            servable.run(rows[..n].to_vec()).expect("run");
        });
        println!("{line}");
        // The same tables in row files behind DRAM caches of `load_factor` of their rows,
        // beside those in memory: rounds alternate, each a median of its batches.
        let placement = Placement::Cached {
            dir: dir.join("caches"),
            size: CacheSize::LoadFactor(cache_load_factor),
            policy: CachePolicy::Lru,
        };
        let cached = DlrmServable::from_checkpoint_placed(&checkpoint, quantize, &placement)
            .expect("cached model");
        // Warm: the caches fill with the first quarter of the stream's ids; the rest is
        // timed, batch by batch, alternating the two models.
        let (warm, timed) = stream.split_at(stream.len() / 4);
        for chunk in warm.chunks(256) {
            cached.run(chunk.to_vec()).expect("run");
        }
        cached.reset_cache_stats();
        for n in [16, 256] {
            let (mut in_memory, mut in_cache) = (Vec::new(), Vec::new());
            for batch in timed.chunks_exact(n).take(4000 / n * 4) {
                for (model, times) in [(&servable, &mut in_memory), (&cached, &mut in_cache)] {
                    let t = Instant::now();
                    model.run(batch.to_vec()).expect("run");
                    times.push(t.elapsed().as_secs_f64());
                }
            }
            let (m, c) = (median(&mut in_memory), median(&mut in_cache));
            let stats = cached.cache_stats();
            cached.reset_cache_stats();
            let (unique, misses) = stats
                .iter()
                .fold((0, 0), |a, s| (a.0 + s.unique_ids, a.1 + s.unique_misses));
            println!(
                "the model alone, {n}-row batches, tables in memory {:.0} us, in row files \
                 behind caches of {cache_load_factor} of their rows {:.0} us: cached / in \
                 memory throughput {:.2} (miss rate {:.3} of distinct ids)",
                m * 1e6,
                c * 1e6,
                m / c,
                misses as f64 / unique.max(1) as f64
            );
        }
    }
    let one = Arc::new(bodies(&g, 1, 4096));
    let many = Arc::new(bodies(&g, 32, 256));
    let many_arrow = Arc::new(arrow_bodies(&g, 32, 256));
    let (addr, stop, done) = start_server(256);
    let max_rate = client_rt.block_on(async {
        // Warm-up.
        closed_loop(addr, PREDICT, one.clone(), 8, secs.min(1.0)).await;
        let mut idle = one_at_a_time(addr, PREDICT, &one, secs).await;
        println!("idle, 1-row requests one at a time: {}", summary(&mut idle));
        let mut max_rate = 0.0;
        for clients in [16, 64] {
            let (rate, mut lat) = closed_loop(addr, PREDICT, one.clone(), clients, secs).await;
            println!(
                "closed loop, {clients} clients x 1-row requests: {rate:.0} rows/s  {}",
                summary(&mut lat)
            );
            max_rate = f64::max(max_rate, rate);
        }
        for (format, bodies) in [("JSON", many.clone()), ("Arrow", many_arrow.clone())] {
            let (rate, mut lat) = closed_loop(addr, PREDICT, bodies, 16, secs).await;
            println!(
                "closed loop, 16 clients x 32-row {format} requests: {:.0} rows/s  {}",
                rate * 32.0,
                summary(&mut lat)
            );
        }
        // Open-loop rates: EMBERS_SERVE_QPS (comma-separated requests/s), else 50% and 90% of
        // the closed-loop maximum.
        let rates: Vec<f64> = match std::env::var("EMBERS_SERVE_QPS") {
            Ok(list) => list
                .split(',')
                .map(|r| r.trim().parse().expect("EMBERS_SERVE_QPS: requests/s, comma-separated"))
                .filter(|&r: &f64| r > 0.0)
                .collect(),
            Err(_) => vec![max_rate * 0.5, max_rate * 0.9],
        };
        for rate in rates {
            let (mut lat, refused) = open_loop(addr, one.clone(), rate, secs).await;
            println!(
                "open loop, 1-row requests at {rate:.0}/s ({:.0}% of the closed-loop max): {}, {refused} refused (503)",
                100.0 * rate / max_rate,
                summary(&mut lat)
            );
        }
        max_rate
    });
    stop.send(()).expect("stop");
    server_rt.block_on(done).expect("join").expect("serve");
    let (addr, stop, done) = start_server(1);
    client_rt.block_on(async {
        let (rate, mut lat) = closed_loop(addr, PREDICT, one.clone(), 64, secs).await;
        println!(
            "batching off (max_batch_rows 1), 64 clients x 1-row requests: {rate:.0} rows/s  {}  \
             (batching buys {:.1}x)",
            summary(&mut lat),
            max_rate / rate
        );
    });
    stop.send(()).expect("stop");
    server_rt.block_on(done).expect("join").expect("serve");
    retrieval_phase(&dir, &checkpoint, &server_rt, &client_rt, secs);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Phase 5: the retrieval stage beside the DLRM (see the file's doc).
fn retrieval_phase(
    dir: &std::path::Path,
    dlrm: &std::path::Path,
    server_rt: &tokio::runtime::Runtime,
    client_rt: &tokio::runtime::Runtime,
    secs: f64,
) {
    use embers::retrieval::{IvfPqConfig, IvfPqIndex, Metric};
    use embers::serve::{BatchModel, RetrievalConfig, RetrievalRow, RetrievalServable};
    use embers::sparse::KeyedJaggedTensor;
    use embers::train::{TwoTowerConfig, TwoTowerLoss};
    let (users, items, k, nprobe) = (943usize, 1682usize, 100usize, 4usize);
    let config = TwoTowerConfig {
        query_features: vec![("user".into(), users)],
        candidate_features: vec![("item".into(), items)],
        embedding_dim: 64,
        layers: vec![128, 64],
        normalize: true,
        temperature: 0.05,
        loss: TwoTowerLoss::Softmax {
            log_q: true,
            random_negatives: 0,
        },
        estimator_buckets: 4096,
        estimator_alpha: 0.05,
        sparse_optimizer: FusedOptimizer::RowWiseAdagrad {
            lr: 0.05,
            eps: 1e-8,
        },
        dense_optimizer: DenseOptimizer::Adam { lr: 1e-3 },
        seed: 0,
        device: embers::Device::Cpu,
    };
    let trainer = config.build().expect("two tower");
    let tt = dir.join("two_tower.safetensors");
    trainer
        .save_checkpoint(&tt, &Default::default())
        .expect("checkpoint");
    let all: Vec<i64> = (0..items as i64).collect();
    let emb = trainer
        .model()
        .embed_catalogue(&KeyedJaggedTensor::one_hot("item", &all).expect("kjt"))
        .expect("catalogue");
    let mut index =
        IvfPqIndex::train(IvfPqConfig::new(16, 16, Metric::InnerProduct), &emb, 64).expect("index");
    index.add(&all, &emb).expect("add");
    let index_path = dir.join("items.ivfpq");
    index.save(&index_path).expect("save");
    let stage = RetrievalServable::from_files(&tt, &index_path, nprobe, 1000).expect("stage");
    let queries: Vec<RetrievalRow> = (0..256)
        .map(|u| RetrievalRow {
            ids: vec![vec![(u * 37 % users) as i64]],
            k,
        })
        .collect();
    let line = per_batch(
        &format!("retrieval stage alone (k {k}, nprobe {nprobe}), per batch:"),
        "queries",
        |n| {
            stage.run(queries[..n].to_vec()).expect("run");
        },
    );
    println!("{line}");
    let mut server = ServerConfig::new("dlrm", dlrm);
    server.retrieval = Some(RetrievalConfig {
        checkpoint: tt,
        index: index_path,
        nprobe,
        max_k: 1000,
    });
    server.batcher = BatcherConfig {
        max_batch_rows: 256,
        max_delay: Duration::ZERO,
        max_queued_rows: 1 << 16,
    };
    let (addr, stop, done) = start(server_rt, server);
    let bodies: Arc<Vec<Bytes>> = Arc::new(
        (0..users)
            .map(|u| {
                Bytes::from(
                    serde_json::to_vec(&json!({"instances": [{"user": u}], "k": k})).expect("json"),
                )
            })
            .collect(),
    );
    client_rt.block_on(async {
        let mut idle = one_at_a_time(addr, RETRIEVE, &bodies, secs).await;
        println!(
            "retrieve, 1-query requests one at a time: {}",
            summary(&mut idle)
        );
        let (rate, mut all) = closed_loop(addr, RETRIEVE, bodies.clone(), 16, secs).await;
        println!(
            "retrieve, closed loop, 16 clients x 1-query requests: {rate:.0} queries/s  {}",
            summary(&mut all)
        );
    });
    stop.send(()).expect("stop");
    server_rt.block_on(done).expect("join").expect("serve");
}
