//! The HTTP server over real sockets on 127.0.0.1: concurrent clients get exactly what
//! `DlrmTrainer::predict` gives their rows (bit-equal, FP32 and INT8 tables, JSON and Arrow),
//! a reload under load fails no request and a corrupt checkpoint is refused, a full queue
//! answers 503 at once, malformed bodies of every kind get a 4xx (never a crash), the
//! `embers-serve` binary starts, reloads on SIGHUP and drains on SIGTERM.

use std::net::SocketAddr;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use arrow_array::builder::{Float32Builder, Int64Builder, ListBuilder};
use arrow_array::{ArrayRef, RecordBatch};
use bytes::Bytes;
use embers::embedding::{QuantizedEmbeddingBagCollection, WeightType};
use embers::serve::{BatcherConfig, DlrmRow, ReloadToken, Server, ServerConfig, ARROW_STREAM};
use embers::train::{Batch, DlrmConfig, DlrmTrainer};
use embers_datasets::SyntheticCriteo;
use http_body_util::{BodyExt, Full};
use support::{config, rows, train};

#[path = "support/checksums.rs"]
mod checksums;
#[path = "support/serve_dlrm.rs"]
mod support;
use serde_json::{json, Value};

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

/// A fresh directory for one test.
fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("embers-serve-http-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn data() -> SyntheticCriteo {
    support::data(3_000, 300, 1)
}

/// `DlrmTrainer::predict` on `rows` as one batch (the reference every answer must equal).
fn predict(
    trainer: &DlrmTrainer,
    keys: &[String],
    rows: &[DlrmRow],
    q: Option<&QuantizedEmbeddingBagCollection>,
) -> Vec<f32> {
    let mut dense = Vec::new();
    rows.iter().for_each(|r| dense.extend_from_slice(&r.dense));
    let (mut ids, mut lengths) = (Vec::new(), Vec::new());
    for f in 0..keys.len() {
        for r in rows {
            ids.extend_from_slice(&r.ids[f]);
            lengths.push(r.ids[f].len() as i32);
        }
    }
    let n = rows[0].dense.len();
    let labels = vec![0.0; rows.len()];
    let batch = Batch::from_parts(dense, n, keys.to_vec(), ids, lengths, labels, 1).unwrap();
    trainer.predict(&batch, q).unwrap()
}

fn json_body(keys: &[String], rows: &[DlrmRow]) -> Vec<u8> {
    let instances: Vec<Value> = rows
        .iter()
        .map(|r| {
            let mut o = serde_json::Map::new();
            o.insert("dense".into(), json!(r.dense));
            for (k, ids) in keys.iter().zip(&r.ids) {
                o.insert(k.clone(), json!(ids));
            }
            Value::Object(o)
        })
        .collect();
    serde_json::to_vec(&json!({ "instances": instances })).unwrap()
}

fn arrow_body(keys: &[String], rows: &[DlrmRow]) -> Vec<u8> {
    let mut dense = ListBuilder::new(Float32Builder::new());
    for r in rows {
        dense.values().append_slice(&r.dense);
        dense.append(true);
    }
    let mut columns: Vec<(String, ArrayRef)> = vec![("dense".into(), Arc::new(dense.finish()))];
    for (f, k) in keys.iter().enumerate() {
        let mut ids = ListBuilder::new(Int64Builder::new());
        for r in rows {
            ids.values().append_slice(&r.ids[f]);
            ids.append(true);
        }
        columns.push((k.clone(), Arc::new(ids.finish())));
    }
    let batch = RecordBatch::try_from_iter(columns).unwrap();
    let mut out = Vec::new();
    let mut w = arrow_ipc::writer::StreamWriter::try_new(&mut out, &batch.schema()).unwrap();
    w.write(&batch).unwrap();
    w.finish().unwrap();
    drop(w);
    out
}

/// One HTTP/1.1 request on a new connection: status, headers, body.
async fn send(
    addr: SocketAddr,
    method: &str,
    path: &str,
    content_type: Option<&str>,
    body: Vec<u8>,
) -> (u16, hyper::HeaderMap, Bytes) {
    try_send(addr, method, path, content_type, body)
        .await
        .unwrap_or_else(|e| panic!("{method} {path}: {e}"))
}

/// [`send`], with a refused or cut connection as an error.
async fn try_send(
    addr: SocketAddr,
    method: &str,
    path: &str,
    content_type: Option<&str>,
    body: Vec<u8>,
) -> Result<(u16, hyper::HeaderMap, Bytes), String> {
    let headers: Vec<(&str, &str)> = content_type
        .map(|t| ("content-type", t))
        .into_iter()
        .collect();
    send_with(addr, method, path, &headers, body).await
}

/// One HTTP/1.1 request with `headers` on a new connection: status, headers, body, or what
/// failed.
async fn send_with(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Vec<u8>,
) -> Result<(u16, hyper::HeaderMap, Bytes), String> {
    let stream = tokio::net::TcpStream::connect(addr)
        .await
        .map_err(|e| e.to_string())?;
    let (mut sender, conn) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
            .await
            .map_err(|e| e.to_string())?;
    tokio::spawn(conn);
    let mut request = hyper::Request::builder()
        .method(method)
        .uri(path)
        .header("host", "127.0.0.1");
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let response = sender
        .send_request(request.body(Full::new(Bytes::from(body))).unwrap())
        .await
        .map_err(|e| e.to_string())?;
    let status = response.status().as_u16();
    let headers = response.headers().clone();
    let body = (response.into_body().collect().await)
        .map_err(|e| e.to_string())?
        .to_bytes();
    Ok((status, headers, body))
}

/// The probabilities of a JSON answer.
/// The server's `/metrics` text.
async fn metrics_text(addr: SocketAddr) -> String {
    let (_, _, metrics) = send(addr, "GET", "/metrics", None, vec![]).await;
    String::from_utf8(metrics.to_vec()).unwrap()
}

/// Polls `/metrics` until metric `name` reads `value` (10 s at most): how a test knows the
/// server has reached a state (a request queued, a place taken) rather than sleeping on it.
async fn wait_for_metric(addr: SocketAddr, name: &str, value: u64) {
    let waited = Instant::now();
    loop {
        let text = metrics_text(addr).await;
        if metric(&text, name) == value {
            return;
        }
        assert!(
            waited.elapsed() < Duration::from_secs(10),
            "{name} never read {value}:\n{text}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

fn json_predictions(body: &[u8]) -> Vec<f32> {
    let v: Value = serde_json::from_slice(body).unwrap();
    (v["predictions"].as_array().unwrap().iter())
        .map(|p| p.as_f64().unwrap() as f32)
        .collect()
}

/// The first column of an Arrow answer.
fn arrow_predictions(body: &[u8]) -> Vec<f32> {
    use arrow_array::cast::AsArray;
    let reader =
        arrow_ipc::reader::StreamReader::try_new(std::io::Cursor::new(body), None).unwrap();
    let mut out = Vec::new();
    for batch in reader {
        let batch = batch.unwrap();
        assert_eq!(batch.schema().field(0).name(), "click");
        let column = batch
            .column(0)
            .as_primitive::<arrow_array::types::Float32Type>();
        out.extend(column.values().iter().copied());
    }
    out
}

/// A running server: its address, and a sender that shuts it down.
struct Running {
    addr: SocketAddr,
    server: Server,
    stop: tokio::sync::oneshot::Sender<()>,
    done: tokio::task::JoinHandle<std::io::Result<()>>,
}

async fn start(config: ServerConfig) -> Running {
    let server = Server::start(config).await.unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let s = server.clone();
    let done = tokio::spawn(async move {
        s.serve(listener, async {
            let _ = stopped.await;
        })
        .await
    });
    Running {
        addr,
        server,
        stop,
        done,
    }
}

/// Sets to `value` the f32 values of the safetensors file at `path` that `pick` chooses: given
/// a tensor's name and shape, the range of its elements (the header and other dtypes stay).
fn fill_tensor_data(
    path: &Path,
    value: f32,
    pick: impl Fn(&str, &[usize]) -> Option<Range<usize>>,
) {
    let mut bytes = std::fs::read(path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    for (name, t) in header.as_object().unwrap() {
        if name == "__metadata__" || t["dtype"] != "F32" {
            continue;
        }
        let shape: Vec<usize> = (t["shape"].as_array().unwrap().iter())
            .map(|d| d.as_u64().unwrap() as usize)
            .collect();
        let Some(elements) = pick(name, &shape) else {
            continue;
        };
        let at = t["data_offsets"][0].as_u64().unwrap() as usize + 8 + n;
        for chunk in bytes[at + 4 * elements.start..at + 4 * elements.end].chunks_exact_mut(4) {
            chunk.copy_from_slice(&value.to_le_bytes());
        }
    }
    std::fs::write(path, &bytes).unwrap();
    checksums::restamp_checksums(path);
}

/// Every element of a tensor, for [`fill_tensor_data`].
fn every_element(_: &str, shape: &[usize]) -> Option<Range<usize>> {
    Some(0..shape.iter().product())
}

fn write_checkpoint(trainer: &DlrmTrainer, path: &Path) {
    trainer.save_checkpoint(path, &Default::default()).unwrap();
}

/// Concurrent clients over HTTP, JSON and Arrow, FP32 and INT8 tables: every answer equals
/// `DlrmTrainer::predict` on the same rows bit for bit, whatever batch the server put it in.
#[test]
fn concurrent_http_clients_get_exactly_what_predict_gives() {
    let g = data();
    let dir = scratch("concurrent");
    let path = dir.join("model.safetensors");
    let mut trainer = config(&g).build().unwrap();
    train(&mut trainer, &g, 1);
    write_checkpoint(&trainer, &path);
    let keys = g.schema().sparse_keys.clone();
    let rows = Arc::new(rows(&g));
    for quantize in [None, Some(WeightType::Int8)] {
        // The reference: the checkpoint loaded back, predicting each request's rows alone.
        let config_read = DlrmConfig::from_checkpoint(&path).unwrap();
        assert_eq!(config_read.tasks, trainer.tasks());
        let mut reference = config_read.build().unwrap();
        reference.load_checkpoint(&path).unwrap();
        let q = quantize.map(|w| reference.model().sparse_arch.quantize(w).unwrap());
        let reference = (reference, q);
        let (keys, rows, path) = (keys.clone(), rows.clone(), path.clone());
        runtime().block_on(async move {
            let mut cfg = ServerConfig::new("dlrm", &path);
            cfg.quantize = quantize;
            cfg.batcher = BatcherConfig {
                max_batch_rows: 64,
                max_delay: Duration::from_millis(5),
                max_queued_rows: 10_000,
            };
            let running = start(cfg).await;
            let addr = running.addr;
            let mut clients = Vec::new();
            let mut at = 0;
            for c in 0..48 {
                let n = 1 + c % 7;
                let mine = rows[at % 250..at % 250 + n].to_vec();
                at += n;
                let keys = keys.clone();
                clients.push(tokio::spawn(async move {
                    let arrow = c % 3 == 0;
                    let (status, _, body) = if arrow {
                        send(
                            addr,
                            "POST",
                            "/v1/models/dlrm:predict",
                            Some(ARROW_STREAM),
                            arrow_body(&keys, &mine),
                        )
                        .await
                    } else {
                        send(
                            addr,
                            "POST",
                            "/v1/models/dlrm:predict",
                            Some("application/json"),
                            json_body(&keys, &mine),
                        )
                        .await
                    };
                    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
                    let got = if arrow {
                        arrow_predictions(&body)
                    } else {
                        json_predictions(&body)
                    };
                    (c, arrow, mine, got)
                }));
            }
            for client in clients {
                let (c, arrow, mine, got) = client.await.unwrap();
                let want = predict(&reference.0, &keys, &mine, reference.1.as_ref());
                assert_eq!(got, want, "client {c} (arrow {arrow}, {quantize:?})");
            }
            // Requests really were batched together.
            let (status, _, metrics) = send(addr, "GET", "/metrics", None, vec![]).await;
            assert_eq!(status, 200);
            let metrics = String::from_utf8(metrics.to_vec()).unwrap();
            let batches: u64 = metric(&metrics, "embers_batches_total");
            assert!(
                batches < 48,
                "48 requests ran in {batches} batches: none were batched\n{metrics}"
            );
            assert_eq!(metric(&metrics, "embers_rows_total"), at as u64);
            assert!(
                metrics.contains("embers_responses_total{route=\"predict\",code=\"200\"} 48"),
                "{metrics}"
            );
            // Model info names the features and the table format.
            let (status, _, info) = send(addr, "GET", "/v1/models/dlrm", None, vec![]).await;
            assert_eq!(status, 200);
            let info: Value = serde_json::from_slice(&info).unwrap();
            assert_eq!(
                info["weights"],
                if quantize.is_some() { "int8" } else { "fp32" }
            );
            assert_eq!(info["features"].as_array().unwrap().len(), keys.len());
            assert_eq!(send(addr, "GET", "/healthz", None, vec![]).await.0, 200);
            assert_eq!(send(addr, "GET", "/readyz", None, vec![]).await.0, 200);
            running.stop.send(()).unwrap();
            running.done.await.unwrap().unwrap();
        });
    }
}

/// The value of an unlabelled metric line `name value`.
fn metric(text: &str, name: &str) -> u64 {
    text.lines()
        .find_map(|l| l.strip_prefix(&format!("{name} ")))
        .unwrap_or_else(|| panic!("no {name} in\n{text}"))
        .trim()
        .parse()
        .unwrap()
}

/// Clients keep sending while the checkpoint is replaced and reloaded: no request fails, each
/// answer is either the old model's or the new one's (never a mix within a request), and after
/// the reload only the new one's; a truncated and a NaN checkpoint are refused and the model
/// before them keeps serving.
#[test]
fn reload_under_load_fails_nothing_and_refuses_bad_checkpoints() {
    let g = data();
    let dir = scratch("reload");
    let path = dir.join("model.safetensors");
    let mut trainer = config(&g).build().unwrap();
    train(&mut trainer, &g, 1);
    write_checkpoint(&trainer, &path);
    let keys = g.schema().sparse_keys.clone();
    let rows = rows(&g);
    let probe = rows[..5].to_vec();
    let old = predict(&trainer, &keys, &probe, None);
    train(&mut trainer, &g, 1);
    let new = predict(&trainer, &keys, &probe, None);
    assert_ne!(old, new);
    runtime().block_on(async move {
        let mut cfg = ServerConfig::new("dlrm", &path);
        cfg.batcher.max_delay = Duration::from_millis(1);
        let running = start(cfg).await;
        let addr = running.addr;
        let body = json_body(&keys, &probe);
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let mut clients = Vec::new();
        for _ in 0..4 {
            let (body, stop, old, new) = (body.clone(), stop.clone(), old.clone(), new.clone());
            clients.push(tokio::spawn(async move {
                let (mut n_old, mut n_new) = (0, 0);
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let (status, _, answer) =
                        send(addr, "POST", "/v1/models/dlrm:predict", None, body.clone()).await;
                    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&answer));
                    let p = json_predictions(&answer);
                    if p == old {
                        n_old += 1;
                    } else {
                        assert_eq!(p, new, "an answer from neither model");
                        n_new += 1;
                    }
                }
                (n_old, n_new)
            }));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
        // Replace the file atomically, as the trainer does, and reload.
        write_checkpoint(&trainer, &path);
        let (status, _, answer) = send(addr, "POST", "/v1/models/dlrm:reload", None, vec![]).await;
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&answer));
        assert_eq!(running.server.version(), 2);
        tokio::time::sleep(Duration::from_millis(200)).await;
        // A truncated checkpoint: refused, version 2 keeps serving.
        let good = std::fs::read(&path).unwrap();
        std::fs::write(&path, &good[..good.len() / 2]).unwrap();
        let (status, _, answer) = send(addr, "POST", "/v1/models/dlrm:reload", None, vec![]).await;
        assert_eq!(status, 500, "{}", String::from_utf8_lossy(&answer));
        assert!(String::from_utf8_lossy(&answer).contains("old model keeps serving"));
        // Weights that hold NaN: refused as the checkpoint is read.
        write_checkpoint(&trainer, &path);
        fill_tensor_data(&path, f32::NAN, every_element);
        let (status, _, answer) = send(addr, "POST", "/v1/models/dlrm:reload", None, vec![]).await;
        assert_eq!(status, 500, "{}", String::from_utf8_lossy(&answer));
        assert_eq!(running.server.version(), 2);
        tokio::time::sleep(Duration::from_millis(100)).await;
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let (mut total_old, mut total_new) = (0, 0);
        for c in clients {
            let (o, n) = c.await.unwrap();
            total_old += o;
            total_new += n;
        }
        assert!(
            total_old > 0 && total_new > 0,
            "old {total_old}, new {total_new}"
        );
        let (_, _, answer) = send(addr, "POST", "/v1/models/dlrm:predict", None, body).await;
        assert_eq!(json_predictions(&answer), new);
        let metrics = metrics_text(addr).await;
        assert!(
            metrics.contains("embers_reloads_total{result=\"ok\"} 1"),
            "{metrics}"
        );
        assert!(
            metrics.contains("embers_reloads_total{result=\"failed\"} 2"),
            "{metrics}"
        );
        running.stop.send(()).unwrap();
        running.done.await.unwrap().unwrap();
        // Drained: a reload (a SIGHUP or a --watch tick late in the drain) loads nothing (a
        // load begun then held the process past its drain).
        write_checkpoint(&trainer, &path);
        let e = running.server.reload().await.unwrap_err().to_string();
        assert!(e.contains("draining"), "{e}");
    });
}

/// A queue bounded at 8 rows with batches waiting 2 s: requests past it get 503 with a
/// Retry-After header at once (long before the batch runs); the queue never holds more than
/// its bound; the admitted requests are answered. Requests in flight are bounded the same way.
#[test]
fn a_full_queue_answers_503_at_once() {
    let g = data();
    let dir = scratch("overload");
    let path = dir.join("model.safetensors");
    let trainer = config(&g).build().unwrap();
    write_checkpoint(&trainer, &path);
    let keys = g.schema().sparse_keys.clone();
    let rows = rows(&g);
    runtime().block_on(async move {
        let mut cfg = ServerConfig::new("dlrm", &path);
        cfg.batcher = BatcherConfig {
            max_batch_rows: 1000,
            max_delay: Duration::from_secs(2),
            max_queued_rows: 8,
        };
        let running = start(cfg).await;
        let addr = running.addr;
        let mut clients = Vec::new();
        let client = |c: usize| {
            let body = json_body(&keys, &rows[c..c + 2]);
            tokio::spawn(async move {
                let t = Instant::now();
                let (status, headers, answer) =
                    send(addr, "POST", "/v1/models/dlrm:predict", None, body).await;
                (status, headers, answer, t.elapsed())
            })
        };
        // Four requests fill the queue (8 rows); the sixteen sent once it is full wait for
        // nothing: their batch would run 2 s after the first arrived.
        clients.extend((0..4).map(client));
        wait_for_metric(addr, "embers_queue_rows", 8).await;
        clients.extend((4..20).map(client));
        let (mut ok, mut refused) = (0, 0);
        for c in clients {
            let (status, headers, answer, took) = c.await.unwrap();
            match status {
                200 => ok += 1,
                503 => {
                    refused += 1;
                    assert!(took < Duration::from_secs(1), "a 503 took {took:?}");
                    assert!(headers.contains_key("retry-after"));
                    let v: Value = serde_json::from_slice(&answer).unwrap();
                    assert_eq!(v["error"]["kind"], "overloaded");
                }
                s => panic!("status {s}: {}", String::from_utf8_lossy(&answer)),
            }
        }
        assert_eq!(ok, 4, "8 rows admitted, 2 per request");
        assert_eq!(refused, 16);
        running.stop.send(()).unwrap();
        running.done.await.unwrap().unwrap();
        // Requests in flight are bounded too (each may hold a body of max_body_bytes).
        let mut cfg = ServerConfig::new("dlrm", &path);
        cfg.batcher.max_delay = Duration::from_secs(2);
        cfg.max_inflight_requests = 3;
        let running = start(cfg).await;
        let addr = running.addr;
        let client = |c: usize| {
            let body = json_body(&keys, &rows[c..c + 1]);
            tokio::spawn(
                async move { send(addr, "POST", "/v1/models/dlrm:predict", None, body).await },
            )
        };
        let mut clients: Vec<_> = (0..3).map(client).collect();
        wait_for_metric(addr, "embers_requests_in_flight", 3).await;
        clients.extend((3..10).map(client));
        let mut statuses = Vec::new();
        for c in clients {
            let (status, _, answer) = c.await.unwrap();
            if status == 503 {
                assert!(String::from_utf8_lossy(&answer).contains("3 requests in flight"));
            }
            statuses.push(status);
        }
        assert_eq!(
            statuses.iter().filter(|&&s| s == 200).count(),
            3,
            "{statuses:?}"
        );
        assert_eq!(
            statuses.iter().filter(|&&s| s == 503).count(),
            7,
            "{statuses:?}"
        );
        running.stop.send(()).unwrap();
        running.done.await.unwrap().unwrap();
    });
}

/// A malformed request: method, path, content type, body, expected status, and what the
/// error message must say.
type Case<'a> = (&'a str, &'a str, Option<&'a str>, Vec<u8>, u16, &'a str);

/// Malformed requests of every kind at every endpoint, then thousands of seeded random
/// mutations of valid JSON and Arrow bodies: every answer is a 2xx or a 4xx with a JSON error
/// naming what is wrong (never a 5xx, a dropped connection or a crash), and the server still
/// answers correctly afterwards.
#[test]
fn malformed_requests_get_4xx_and_never_break_the_server() {
    use rand::{Rng, SeedableRng};
    let g = data();
    let dir = scratch("fuzz");
    let path = dir.join("model.safetensors");
    let trainer = config(&g).build().unwrap();
    write_checkpoint(&trainer, &path);
    let keys = g.schema().sparse_keys.clone();
    let rows = rows(&g);
    let want = predict(&trainer, &keys, &rows[..3], None);
    runtime().block_on(async move {
        let mut cfg = ServerConfig::new("dlrm", &path);
        cfg.max_body_bytes = 64 << 10;
        cfg.batcher.max_delay = Duration::from_micros(200);
        let running = start(cfg).await;
        let addr = running.addr;
        let k0 = keys[0].clone();
        let dense13 = json!(rows[0].dense);
        let one = |extra: Value| {
            let mut o = json!({"dense": dense13.clone()});
            for (k, v) in extra.as_object().unwrap() {
                o[k] = v.clone();
            }
            serde_json::to_vec(&json!({ "instances": [o] })).unwrap()
        };
        let json_t = Some("application/json");
        let cases: Vec<Case> = vec![
            (
                "POST",
                "/v1/models/dlrm:predict",
                json_t,
                b"{not json".to_vec(),
                400,
                "malformed JSON",
            ),
            (
                "POST",
                "/v1/models/dlrm:predict",
                json_t,
                b"".to_vec(),
                400,
                "malformed JSON",
            ),
            (
                "POST",
                "/v1/models/dlrm:predict",
                json_t,
                b"{}".to_vec(),
                400,
                "instances",
            ),
            (
                "POST",
                "/v1/models/dlrm:predict",
                json_t,
                br#"{"instances": 3}"#.to_vec(),
                400,
                "instances",
            ),
            (
                "POST",
                "/v1/models/dlrm:predict",
                json_t,
                br#"{"instances": []}"#.to_vec(),
                400,
                "no instances",
            ),
            (
                "POST",
                "/v1/models/dlrm:predict",
                json_t,
                br#"{"instances": [7]}"#.to_vec(),
                400,
                "instances[0] is not an object",
            ),
            (
                "POST",
                "/v1/models/dlrm:predict",
                json_t,
                one(json!({"nope": [1]})),
                400,
                "unknown feature `nope`",
            ),
            (
                "POST",
                "/v1/models/dlrm:predict",
                json_t,
                one(json!({ k0.clone(): ["a"] })),
                400,
                "expected an integer id",
            ),
            (
                "POST",
                "/v1/models/dlrm:predict",
                json_t,
                one(json!({ k0.clone(): [1.5] })),
                400,
                "expected an integer id",
            ),
            (
                "POST",
                "/v1/models/dlrm:predict",
                json_t,
                one(json!({ k0.clone(): [100] })),
                400,
                "id 100 is outside 0..100",
            ),
            (
                "POST",
                "/v1/models/dlrm:predict",
                json_t,
                one(json!({ k0.clone(): [-1] })),
                400,
                "id -1 is outside",
            ),
            (
                "POST",
                "/v1/models/dlrm:predict",
                json_t,
                one(json!({"dense": [1.0, 2.0]})),
                400,
                "2 values, the model takes 13",
            ),
            (
                "POST",
                "/v1/models/dlrm:predict",
                json_t,
                one(json!({"dense": "x"})),
                400,
                "expected a list of numbers",
            ),
            (
                "POST",
                "/v1/models/dlrm:predict",
                json_t,
                one(json!({"dense": vec![1e39f64; 13]})),
                400,
                "inf",
            ),
            (
                "POST",
                "/v1/models/dlrm:predict",
                json_t,
                br#"{"instances": [{"cat_0": [1]}]}"#.to_vec(),
                400,
                "missing `dense`",
            ),
            (
                "POST",
                "/v1/models/dlrm:predict",
                json_t,
                vec![b' '; 70 << 10],
                413,
                "exceeds",
            ),
            (
                "POST",
                "/v1/models/dlrm:predict",
                Some("text/csv"),
                b"1,2".to_vec(),
                415,
                "content-type",
            ),
            (
                "POST",
                "/v1/models/dlrm:predict",
                Some(ARROW_STREAM),
                b"\xff\xff\xff\xff garbage".to_vec(),
                400,
                "malformed Arrow",
            ),
            (
                "POST",
                "/v1/models/other:predict",
                json_t,
                one(json!({})),
                404,
                "no model `other`",
            ),
            (
                "POST",
                "/v1/models/dlrm:explode",
                json_t,
                one(json!({})),
                404,
                "expected `<model>:predict`",
            ),
            (
                "POST",
                "/v1/models/dlrm",
                json_t,
                one(json!({})),
                404,
                "expected `<model>:predict`",
            ),
            ("GET", "/v1/models/other", None, vec![], 404, "no model"),
            ("GET", "/nowhere", None, vec![], 404, "no such route"),
            (
                "POST",
                "/v1/models/other:reload",
                None,
                vec![],
                404,
                "no model",
            ),
        ];
        for (method, path, ctype, body, status, needle) in cases {
            let (got, _, answer) = send(addr, method, path, ctype, body).await;
            let text = String::from_utf8_lossy(&answer);
            assert_eq!(got, status, "{method} {path}: {text}");
            assert!(
                text.contains(needle),
                "{method} {path}: `{text}` does not say `{needle}`"
            );
        }
        // Arrow bodies with bad columns.
        let mut arrow_cases = Vec::new();
        {
            use arrow_array::{Float32Array, Int64Array, StringArray};
            let good = arrow_body(&keys, &rows[..2]);
            arrow_cases.push((good[..good.len() / 2].to_vec(), "malformed Arrow"));
            let nan_rows: Vec<DlrmRow> = vec![DlrmRow {
                dense: vec![f32::NAN; 13],
                ids: rows[0].ids.clone(),
            }];
            arrow_cases.push((arrow_body(&keys, &nan_rows), "NaN"));
            let batch = |columns: Vec<(&str, ArrayRef)>| {
                let b = RecordBatch::try_from_iter(columns).unwrap();
                let mut out = Vec::new();
                let mut w =
                    arrow_ipc::writer::StreamWriter::try_new(&mut out, &b.schema()).unwrap();
                w.write(&b).unwrap();
                w.finish().unwrap();
                drop(w);
                out
            };
            arrow_cases.push((
                batch(vec![(
                    "dense",
                    Arc::new(Float32Array::from(vec![1.0])) as ArrayRef,
                )]),
                "expected a list",
            ));
            arrow_cases.push((
                batch(vec![
                    (k0.as_str(), Arc::new(Int64Array::from(vec![3])) as ArrayRef),
                    (k0.as_str(), Arc::new(Int64Array::from(vec![4])) as ArrayRef),
                ]),
                "given twice",
            ));
            arrow_cases.push((
                batch(vec![(
                    "who",
                    Arc::new(StringArray::from(vec!["x"])) as ArrayRef,
                )]),
                "unknown column `who`",
            ));
            arrow_cases.push((
                batch(vec![(
                    k0.as_str(),
                    Arc::new(Int64Array::from(vec![3])) as ArrayRef,
                )]),
                "no `dense` column",
            ));
            arrow_cases.push((
                batch(vec![(
                    k0.as_str(),
                    Arc::new(StringArray::from(vec!["x"])) as ArrayRef,
                )]),
                "expected int64/int32",
            ));
        }
        for (body, needle) in arrow_cases {
            let (got, _, answer) = send(
                addr,
                "POST",
                "/v1/models/dlrm:predict",
                Some(ARROW_STREAM),
                body,
            )
            .await;
            let text = String::from_utf8_lossy(&answer);
            assert_eq!(got, 400, "{text}");
            assert!(text.contains(needle), "`{text}` does not say `{needle}`");
        }
        // A top-level field the request does not take (it was ignored).
        let mut extra = json!({ "instances": [{"dense": dense13.clone()}] });
        extra["instance"] = json!([]);
        let body = serde_json::to_vec(&extra).unwrap();
        let (got, _, answer) = send(addr, "POST", "/v1/models/dlrm:predict", json_t, body).await;
        let v: Value = serde_json::from_slice(&answer).unwrap();
        assert_eq!(
            (got, v["error"]["kind"].as_str()),
            (400, Some("unknown_field"))
        );
        // A field given twice (serde_json kept the last silently) and a repeated Arrow column.
        let dense_text = serde_json::to_string(&dense13).unwrap();
        for body in [
            format!(r#"{{"instances": [{{"dense": {dense_text}, "{k0}": [1], "{k0}": [5]}}]}}"#),
            format!(r#"{{"instances": [], "instances": [{{"dense": {dense_text}}}]}}"#),
        ] {
            let (got, _, answer) = send(
                addr,
                "POST",
                "/v1/models/dlrm:predict",
                json_t,
                body.into_bytes(),
            )
            .await;
            let text = String::from_utf8_lossy(&answer);
            assert_eq!(got, 400, "{text}");
            assert!(text.contains("given twice"), "{text}");
        }
        // A client's long value is not echoed back whole.
        let long = "x".repeat(20_000);
        let (got, _, answer) = send(
            addr,
            "POST",
            "/v1/models/dlrm:predict",
            json_t,
            one(json!({ long.clone(): [1] })),
        )
        .await;
        assert_eq!(got, 400);
        let text = String::from_utf8_lossy(&answer);
        assert!(
            text.len() < 1000 && text.contains("(20000 bytes)"),
            "{}",
            text.len()
        );
        // More instances than may ever queue: 413 before any row is built (the first
        // instance, not an object, would otherwise be the error).
        let many = vec![json!(7); 8193];
        let (got, _, answer) = send(
            addr,
            "POST",
            "/v1/models/dlrm:predict",
            json_t,
            serde_json::to_vec(&json!({ "instances": many })).unwrap(),
        )
        .await;
        let v: Value = serde_json::from_slice(&answer).unwrap();
        assert_eq!(
            (got, v["error"]["kind"].as_str()),
            (413, Some("too_many_rows")),
            "{v}"
        );
        // axum's own refusals answer as the API does: JSON, counted.
        for (method, path, status, kind) in [
            ("PUT", "/v1/models/dlrm", 405, "method_not_allowed"),
            ("POST", "/healthz", 405, "method_not_allowed"),
            ("GET", "/nowhere", 404, "not_found"),
            ("GET", "/v1/models/%FF", 400, "invalid"),
        ] {
            let (got, _, answer) = send(addr, method, path, None, vec![]).await;
            let v: Value = serde_json::from_slice(&answer).unwrap_or_else(|_| {
                panic!("{method} {path}: {}", String::from_utf8_lossy(&answer))
            });
            assert_eq!(
                (got, v["error"]["kind"].as_str()),
                (status, Some(kind)),
                "{method} {path}"
            );
        }
        let metrics = metrics_text(addr).await;
        assert!(
            metrics.contains("embers_errors_total{kind=\"method_not_allowed\"} 2"),
            "{metrics}"
        );
        // Random mutations: flipped, dropped and inserted bytes of valid bodies.
        let valid = [
            (json_t, json_body(&keys, &rows[..3])),
            (Some(ARROW_STREAM), arrow_body(&keys, &rows[..3])),
        ];
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
        let mut statuses = std::collections::BTreeMap::new();
        for i in 0..600 {
            let (ctype, body) = &valid[i % 2];
            let mut body = body.clone();
            for _ in 0..rng.random_range(1..4) {
                let at = rng.random_range(0..body.len());
                match rng.random_range(0..3) {
                    0 => body[at] = rng.random(),
                    1 => {
                        body.remove(at);
                    }
                    _ => body.insert(at, rng.random()),
                }
            }
            let (status, _, answer) =
                send(addr, "POST", "/v1/models/dlrm:predict", *ctype, body).await;
            assert!(
                status == 200 || (400..500).contains(&status),
                "mutation {i}: {status} {}",
                String::from_utf8_lossy(&answer)
            );
            if status != 200 {
                let v: Value = serde_json::from_slice(&answer).expect("errors are JSON");
                assert!(v["error"]["message"]
                    .as_str()
                    .is_some_and(|m| !m.is_empty()));
            }
            *statuses.entry(status).or_insert(0) += 1;
        }
        println!("mutated bodies: {statuses:?}");
        assert!(
            statuses.len() > 1,
            "the mutations hit more than one outcome: {statuses:?}"
        );
        // Still serving, correctly.
        let (status, _, answer) = send(
            addr,
            "POST",
            "/v1/models/dlrm:predict",
            json_t,
            json_body(&keys, &rows[..3]),
        )
        .await;
        assert_eq!(status, 200);
        assert_eq!(json_predictions(&answer), want);
        let metrics = metrics_text(addr).await;
        assert!(
            metrics.contains("embers_errors_total{kind=\"malformed_json\"}"),
            "{metrics}"
        );
        assert!(!metrics.contains("code=\"5"), "no 5xx: {metrics}");
        running.stop.send(()).unwrap();
        running.done.await.unwrap().unwrap();

        // A model whose table rows past the first are the largest f32 loads (its probe row
        // reads row 0); a request reading row 1, whose prediction overflows to a non-number,
        // gets 422 naming the row, not 200 with `null`.
        let nan_rows = dir.join("huge-rows.safetensors");
        std::fs::copy(&path, &nan_rows).unwrap();
        fill_tensor_data(&nan_rows, f32::MAX, |name, shape| {
            (name.starts_with("tables.") && name.ends_with(".weight"))
                .then(|| shape[1]..shape.iter().product())
        });
        let running = start(ServerConfig::new("dlrm", &nan_rows)).await;
        for (id, status) in [(0, 200), (1, 422)] {
            let mut o = json!({ "dense": dense13.clone() });
            o[&k0] = json!([id]);
            let body = serde_json::to_vec(&json!({ "instances": [o] })).unwrap();
            let (got, _, answer) = send(
                running.addr,
                "POST",
                "/v1/models/dlrm:predict",
                json_t,
                body,
            )
            .await;
            assert_eq!(got, status, "{}", String::from_utf8_lossy(&answer));
            if status == 422 {
                let v: Value = serde_json::from_slice(&answer).unwrap();
                assert_eq!(v["error"]["kind"], "non_finite", "{v}");
                assert!(v["error"]["message"]
                    .as_str()
                    .unwrap()
                    .contains("instances[0]"));
            }
        }
        running.stop.send(()).unwrap();
        running.done.await.unwrap().unwrap();
    });
}

/// Clients that would hold the server's places or memory cannot:
/// - a body that never arrives gets 408 after `body_timeout`, and its place among those in
///   flight comes free (with one place, the next request is answered);
/// - a connection that sends half a request head is closed after `header_timeout` (one past
///   a day is refused at start);
/// - an Arrow stream of a few hundred bytes that claims 2^31 rows (a `dense` column of nulls
///   takes no bytes) is refused before any row is made;
/// - a reload whose caller stops waiting still loads, swaps and counts the new model, and
///   abandoned reload calls join the one waiting to start instead of each queueing a load;
/// - reloads of a checkpoint that is gone each get the load's own I/O error;
/// - a batching delay past `MAX_DELAY` is refused at start.
#[test]
fn hostile_clients_hold_no_places_no_memory_and_cancel_no_reload() {
    use std::io::{Read, Write};
    let g = data();
    let dir = scratch("hostile");
    let path = dir.join("model.safetensors");
    let trainer = config(&g).build().unwrap();
    write_checkpoint(&trainer, &path);
    let keys = g.schema().sparse_keys.clone();
    let rows = rows(&g);
    let want = predict(&trainer, &keys, &rows[..2], None);
    runtime().block_on(async move {
        let mut too_slow = ServerConfig::new("dlrm", &path);
        too_slow.batcher.max_delay = embers::serve::MAX_DELAY + Duration::from_secs(1);
        let err = Server::start(too_slow).await.err().expect("refused");
        assert!(err.to_string().contains("max_delay"), "{err}");
        // A header timeout past a day (one of 2^63 s would overflow the timer's deadline).
        let mut forever = ServerConfig::new("dlrm", &path);
        forever.header_timeout = Duration::from_secs(u64::MAX);
        let err = Server::start(forever).await.err().expect("refused");
        assert!(err.to_string().contains("header_timeout is"), "{err}");
        // A model name that is not one URL segment (every route was unreachable).
        let err = Server::start(ServerConfig::new("ranking/v2", &path))
            .await
            .err()
            .expect("refused");
        assert!(
            err.to_string().contains("model name \"ranking/v2\""),
            "{err}"
        );
        // More requests in flight than tokio's semaphore counts (it panicked).
        let mut countless = ServerConfig::new("dlrm", &path);
        countless.max_inflight_requests = usize::MAX;
        let err = Server::start(countless).await.err().expect("refused");
        assert!(err.to_string().contains("max_inflight_requests"), "{err}");

        let mut cfg = ServerConfig::new("dlrm", &path);
        cfg.max_inflight_requests = 1;
        cfg.body_timeout = Duration::from_secs(2);
        cfg.header_timeout = Duration::from_millis(400);
        let running = start(cfg).await;
        let addr = running.addr;
        // Headers promising 100 bytes, then nothing.
        let mut stalled = std::net::TcpStream::connect(addr).unwrap();
        stalled
            .write_all(
                b"POST /v1/models/dlrm:predict HTTP/1.1\r\nhost: x\r\n\
                  content-type: application/json\r\ncontent-length: 100\r\n\r\n",
            )
            .unwrap();
        wait_for_metric(addr, "embers_requests_in_flight", 1).await;
        let body = json_body(&keys, &rows[..2]);
        let (status, _, _) =
            send(addr, "POST", "/v1/models/dlrm:predict", None, body.clone()).await;
        assert_eq!(status, 503, "the stalled request holds the one place");
        stalled
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        let (answer, n) = tokio::task::spawn_blocking(move || {
            let mut answer = vec![0u8; 4096];
            let n = stalled
                .read(&mut answer)
                .expect("answered within the timeout");
            (answer, n)
        })
        .await
        .unwrap();
        let head = String::from_utf8_lossy(&answer[..n]);
        assert!(head.starts_with("HTTP/1.1 408"), "{head}");
        assert!(head.contains("body_timeout"), "{head}");
        let (status, _, answer) = send(addr, "POST", "/v1/models/dlrm:predict", None, body).await;
        assert_eq!(status, 200);
        assert_eq!(json_predictions(&answer), want);

        // Half a request head, then nothing: the connection is closed once the header
        // timeout (400 ms here) has passed, not held.
        let opened = Instant::now();
        let mut trickled = std::net::TcpStream::connect(addr).unwrap();
        trickled
            .write_all(b"POST /v1/models/dlrm:predict HTTP/1.1\r\nhost: x\r\n")
            .unwrap();
        trickled
            .set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        let closed_after = tokio::task::spawn_blocking(move || {
            let mut rest = Vec::new();
            // A read timeout is an error here: the connection was held.
            trickled.read_to_end(&mut rest).map(|_| opened.elapsed())
        })
        .await
        .unwrap();
        let closed_after = closed_after.expect("closed within the header timeout");
        assert!(
            closed_after >= Duration::from_millis(300) && closed_after < Duration::from_secs(5),
            "closed after {closed_after:?}"
        );

        // 2^31 rows of nothing.
        let claimed = 1usize << 31;
        let nulls: ArrayRef = Arc::new(arrow_array::NullArray::new(claimed));
        let batch = RecordBatch::try_from_iter([("dense", nulls)]).unwrap();
        let mut huge = Vec::new();
        let mut w = arrow_ipc::writer::StreamWriter::try_new(&mut huge, &batch.schema()).unwrap();
        w.write(&batch).unwrap();
        w.finish().unwrap();
        drop(w);
        assert!(huge.len() < 1024, "{} bytes", huge.len());
        let (status, _, answer) = send(
            addr,
            "POST",
            "/v1/models/dlrm:predict",
            Some(ARROW_STREAM),
            huge,
        )
        .await;
        let text = String::from_utf8_lossy(&answer);
        assert_eq!(status, 400, "{text}");
        assert!(text.contains(&format!("claims {claimed} rows")), "{text}");

        // A reload polled once, then abandoned (a client that hung up). It is usually still
        // loading then (rarely, on a busy machine, already done: the check below holds either
        // way, and fails when an abandoned reload is thrown away).
        let _ = tokio::time::timeout(Duration::ZERO, running.server.reload()).await;
        let waited = Instant::now();
        while running.server.version() < 2 {
            assert!(
                waited.elapsed() < Duration::from_secs(20),
                "never swapped in"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        // Counted just after the swap.
        wait_for_metric(addr, "embers_reloads_total{result=\"ok\"}", 1).await;

        // Thirty abandoned reloads in a row, then one waited for: the calls made while a
        // reload waits to start join it, so a few loads run (8 at most even on a busy machine
        // where some end between the calls), not one per call (31 before). Reloads run in
        // order, so the waited one ends after all of them.
        for _ in 0..30 {
            let mut call = std::pin::pin!(running.server.reload());
            let mut polled = std::task::Context::from_waker(std::task::Waker::noop());
            let _ = std::future::Future::poll(call.as_mut(), &mut polled);
        }
        running.server.reload().await.unwrap();
        let metrics = metrics_text(addr).await;
        let loads = metric(&metrics, "embers_reloads_total{result=\"ok\"}") - 1;
        assert!(
            (1..=8).contains(&loads),
            "31 reload calls ran {loads} loads"
        );

        // Reloads of a checkpoint that is gone: every caller, joined or not, gets the load's
        // own error (an I/O error naming the file), and the old model keeps serving.
        std::fs::remove_file(&path).unwrap();
        let (a, b, c) = tokio::join!(
            running.server.reload(),
            running.server.reload(),
            running.server.reload()
        );
        for err in [a, b, c] {
            match err {
                Err(embers::Error::Io {
                    path: named,
                    source,
                }) => {
                    assert_eq!(source.kind(), std::io::ErrorKind::NotFound);
                    assert!(named.contains("model.safetensors"), "{named}");
                }
                other => panic!("not the load's I/O error: {other:?}"),
            }
        }
        let body = json_body(&keys, &rows[..2]);
        let (status, _, _) = send(addr, "POST", "/v1/models/dlrm:predict", None, body).await;
        assert_eq!(status, 200);
        running.stop.send(()).unwrap();
        running.done.await.unwrap().unwrap();
    });
}

/// Shutdown drains: a request waiting in a batch (2 s delay) when shutdown begins is still
/// answered, and `serve` returns only after it.
#[test]
fn shutdown_answers_in_flight_requests_first() {
    let g = data();
    let dir = scratch("drain");
    let path = dir.join("model.safetensors");
    let trainer = config(&g).build().unwrap();
    write_checkpoint(&trainer, &path);
    let keys = g.schema().sparse_keys.clone();
    let rows = rows(&g);
    let want = predict(&trainer, &keys, &rows[..2], None);
    runtime().block_on(async move {
        let mut cfg = ServerConfig::new("dlrm", &path);
        cfg.batcher.max_delay = Duration::from_secs(2);
        let running = start(cfg).await;
        let addr = running.addr;
        let body = json_body(&keys, &rows[..2]);
        let client =
            tokio::spawn(
                async move { send(addr, "POST", "/v1/models/dlrm:predict", None, body).await },
            );
        // Its two rows queued, their batch about 2 s away.
        wait_for_metric(addr, "embers_queue_rows", 2).await;
        let t = Instant::now();
        running.stop.send(()).unwrap();
        running.done.await.unwrap().unwrap();
        let (status, _, answer) = client.await.unwrap();
        assert_eq!(status, 200);
        assert_eq!(json_predictions(&answer), want);
        assert!(
            t.elapsed() >= Duration::from_secs(1),
            "serve returned before the batch ran"
        );
        assert!(
            tokio::net::TcpStream::connect(addr).await.is_err(),
            "still accepting after shutdown"
        );
    });
}

/// A connection to the server at `addr` on which a thread pipelines model-info requests
/// whose answers come to about 64 MiB, far more than the loopback's buffers hold (it sends
/// what the server takes, which stops reading while its writes wait, for up to 5 s), and how
/// many requests that is.
async fn flood(addr: SocketAddr) -> (std::net::TcpStream, usize) {
    use std::io::Write;
    let (status, _, one) = send(addr, "GET", "/v1/models/dlrm", None, Vec::new()).await;
    assert_eq!(status, 200);
    let n = (64usize << 20) / one.len() + 1;
    let requests = b"GET /v1/models/dlrm HTTP/1.1\r\nhost: x\r\n\r\n".repeat(n);
    let connection = std::net::TcpStream::connect(addr).unwrap();
    let mut sender = connection.try_clone().unwrap();
    sender
        .set_write_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    std::thread::spawn(move || {
        let _ = sender.write_all(&requests);
    });
    (connection, n)
}

/// A client that stops reading its answers cannot stall a drain: pipelined model-info
/// requests whose answers are far more than the loopback's buffers hold, never read, keep the
/// connection's write waiting (the server's count of answers stops growing); shutdown begins
/// while it waits, and `serve` returns once the write has waited `write_timeout` (2 s here),
/// the connection closed. (Without the limit the drain waits for the client forever.) A zero
/// limit is refused at start.
#[test]
fn a_client_that_stops_reading_cannot_stall_a_drain() {
    use std::io::Read;
    let g = data();
    let dir = scratch("unread");
    let path = dir.join("model.safetensors");
    let trainer = config(&g).build().unwrap();
    write_checkpoint(&trainer, &path);
    runtime().block_on(async move {
        let mut never = ServerConfig::new("dlrm", &path);
        never.write_timeout = Duration::ZERO;
        let err = Server::start(never).await.err().expect("refused");
        assert!(err.to_string().contains("write_timeout is"), "{err}");

        let mut cfg = ServerConfig::new("dlrm", &path);
        cfg.write_timeout = Duration::from_secs(2);
        let running = start(cfg).await;
        let addr = running.addr;
        // Model-info answers counted so far (each call's own answer is counted after it).
        let answered = || async move {
            let (_, _, text) = send(addr, "GET", "/metrics", None, Vec::new()).await;
            let text = String::from_utf8(text.to_vec()).unwrap();
            let key = "embers_responses_total{route=\"model\",code=\"200\"}";
            if text.contains(key) {
                metric(&text, key)
            } else {
                0
            }
        };
        // Nothing is read from it.
        let (mut unread, n) = flood(addr).await;
        // Until the answers stop coming: the write waits.
        let mut last = answered().await;
        loop {
            tokio::time::sleep(Duration::from_millis(150)).await;
            let now = answered().await;
            if now == last && now > 1 {
                break;
            }
            assert!(now < n as u64, "every one of {n} answers was taken");
            last = now;
        }
        let t = Instant::now();
        running.stop.send(()).unwrap();
        tokio::time::timeout(Duration::from_secs(30), running.done)
            .await
            .expect("the drain waited for a client that reads nothing")
            .unwrap()
            .unwrap();
        let drained = t.elapsed();
        assert!(
            drained < Duration::from_secs(20),
            "drained after {drained:?}"
        );
        // The connection was closed by the server, not left open: what it sent, then the end.
        unread
            .set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        let mut got = Vec::new();
        match unread.read_to_end(&mut got) {
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {}
            Err(e) => panic!("the connection was left open: {e}"),
        }
        let taken = String::from_utf8_lossy(&got)
            .matches("HTTP/1.1 200")
            .count();
        assert!(taken < n, "every one of {n} answers was taken");
    });
}

/// A slow reader of a large answer is not cut by the write timeout: pipelined model-info
/// requests whose answers are far more than the loopback's buffers hold, read 16 KiB every
/// 50 ms (about 320 KB/s) for 3 s with a `write_timeout` of 1.5 s: the connection keeps
/// delivering throughout (the server counts each time the socket takes bytes, not only when
/// half its send buffer has drained).
#[test]
fn a_slow_reader_is_not_cut_by_the_write_timeout() {
    use std::io::Read;
    let g = data();
    let dir = scratch("slow");
    let path = dir.join("model.safetensors");
    let trainer = config(&g).build().unwrap();
    write_checkpoint(&trainer, &path);
    runtime().block_on(async move {
        let mut cfg = ServerConfig::new("dlrm", &path);
        cfg.write_timeout = Duration::from_millis(1500);
        let running = start(cfg).await;
        let addr = running.addr;
        let (mut slow, _) = flood(addr).await;
        let read = tokio::task::spawn_blocking(move || {
            slow.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
            let (mut total, mut chunk) = (0usize, vec![0u8; 16 << 10]);
            let start = Instant::now();
            while start.elapsed() < Duration::from_secs(3) {
                std::thread::sleep(Duration::from_millis(50));
                let mut got = 0;
                while got < chunk.len() {
                    match slow.read(&mut chunk[got..]) {
                        Ok(0) => {
                            return Err(format!(
                                "closed after {:?}, {total} bytes",
                                start.elapsed()
                            ))
                        }
                        Ok(k) => got += k,
                        Err(e) => {
                            return Err(format!("{e} after {:?}, {total} bytes", start.elapsed()))
                        }
                    }
                }
                total += got;
            }
            Ok(total)
        })
        .await
        .unwrap();
        let total = read.expect("the slow reader was cut");
        assert!(total >= 40 * (16 << 10), "{total} bytes");
        running.stop.send(()).unwrap();
        tokio::time::timeout(Duration::from_secs(30), running.done)
            .await
            .expect("the drain ended")
            .unwrap()
            .unwrap();
    });
}

/// The binary refuses flags it would ignore or could not honour, naming them, before it
/// loads anything (the checkpoint here does not exist).
#[test]
fn the_embers_serve_binary_refuses_flags_it_cannot_honour() {
    let refused = |args: &[&str], names: &str| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_embers-serve"))
            .args(["--checkpoint", "absent.safetensors"])
            .args(args)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains(names), "{args:?}: {stderr}");
    };
    // Retrieval settings without a retrieval stage were ignored without a word.
    refused(&["--nprobe", "4"], "--retrieval-checkpoint");
    refused(&["--max-k", "10"], "--retrieval-checkpoint");
    // A watch period of 2^63 s panicked in the timer.
    refused(&["--watch", "9223372036854775807"], "--watch");
    refused(&["--cache-load-factor", "0.5"], "--cache-dir");
    // A reload token that cannot be read is refused before the model loads.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_embers-serve"))
        .args(["--checkpoint", "absent.safetensors"])
        .args(["--reload-token-file", "absent.token"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("absent.token") && !stderr.contains("absent.safetensors"),
        "{stderr}"
    );
}

/// `embers-serve` started with `args`, its stdout's reader, and the first line it printed
/// (where it serves).
#[cfg(unix)]
fn spawn_serve(
    args: &[&str],
) -> (
    std::process::Child,
    std::io::BufReader<std::process::ChildStdout>,
    String,
) {
    use std::io::BufRead;
    use std::process::{Command, Stdio};
    let mut child = Command::new(env!("CARGO_BIN_EXE_embers-serve"))
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = std::io::BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    out.read_line(&mut line).unwrap();
    (child, out, line)
}

/// The binary: starts on a free port, answers, reloads on SIGHUP, refuses a bad checkpoint
/// with the old model serving, and exits 0 after draining on SIGTERM.
#[cfg(unix)]
#[test]
fn the_embers_serve_binary_serves_reloads_and_drains() {
    use std::io::BufRead;
    use std::process::Command;
    let g = data();
    let dir = scratch("binary");
    let path = dir.join("model.safetensors");
    let mut trainer = config(&g).build().unwrap();
    write_checkpoint(&trainer, &path);
    let keys = g.schema().sparse_keys.clone();
    let rows = rows(&g);
    let (mut child, mut out, mut line) = spawn_serve(&[
        "--checkpoint",
        path.to_str().unwrap(),
        "--addr",
        "127.0.0.1:0",
        "--quantize",
        "int8",
        // The INT8 rows in files behind a cache of a tenth of them.
        "--cache-dir",
        dir.join("caches").to_str().unwrap(),
        "--cache-load-factor",
        "0.1",
    ]);
    let addr: SocketAddr = line
        .trim()
        .rsplit("http://")
        .next()
        .unwrap()
        .parse()
        .unwrap_or_else(|_| panic!("{line}"));
    let q = trainer
        .model()
        .sparse_arch
        .quantize(WeightType::Int8)
        .unwrap();
    let want = predict(&trainer, &keys, &rows[..4], Some(&q));
    let body = json_body(&keys, &rows[..4]);
    let rt = runtime();
    let (status, _, answer) = rt.block_on(send(
        addr,
        "POST",
        "/v1/models/dlrm:predict",
        None,
        body.clone(),
    ));
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&answer));
    assert_eq!(json_predictions(&answer), want);
    // Train on, replace the checkpoint, SIGHUP: the new model answers.
    train(&mut trainer, &g, 1);
    write_checkpoint(&trainer, &path);
    let signal = |sig: &str| {
        assert!(Command::new("kill")
            .args([sig, &child.id().to_string()])
            .status()
            .unwrap()
            .success());
    };
    signal("-HUP");
    line.clear();
    out.read_line(&mut line).unwrap();
    assert!(line.contains("now serving version 2"), "{line}");
    let q = trainer
        .model()
        .sparse_arch
        .quantize(WeightType::Int8)
        .unwrap();
    let (_, _, answer) = rt.block_on(send(
        addr,
        "POST",
        "/v1/models/dlrm:predict",
        None,
        body.clone(),
    ));
    assert_eq!(
        json_predictions(&answer),
        predict(&trainer, &keys, &rows[..4], Some(&q))
    );
    // The cache's counters, per table, of the model now served.
    let (_, _, metrics) = rt.block_on(send(addr, "GET", "/metrics", None, vec![]));
    let metrics = String::from_utf8(metrics.to_vec()).unwrap();
    for key in &keys {
        let table = format!("{{table=\"t_{key}\"}}");
        let requested = metric(
            &metrics,
            &format!("embers_cache_requested_ids_total{table}"),
        );
        let misses = metric(
            &metrics,
            &format!("embers_cache_unique_misses_total{table}"),
        );
        assert!(
            requested > 0 && misses > 0 && misses <= requested,
            "{metrics}"
        );
        assert_eq!(metric(&metrics, &format!("embers_cache_slots{table}")), 32);
    }
    signal("-TERM");
    let status = child.wait().unwrap();
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut out, &mut rest).unwrap();
    assert!(status.success(), "exit {status}: {rest}");
    assert!(rest.contains("drained"), "{rest}");
    // Every model's row files went with it.
    let left: Vec<_> = std::fs::read_dir(dir.join("caches")).unwrap().collect();
    assert!(left.is_empty(), "{left:?}");
}

/// The retrieval stage: a TwoTower checkpoint and an IVF-PQ index of its candidates served
/// beside the DLRM. Concurrent clients asking for different `k` each get exactly
/// `TwoTower::retrieve` on their own query (ids and score bits), whatever batch they shared;
/// bad requests get named 4xx; `GET` shows the stage; a server without one answers 404.
#[test]
fn the_retrieval_stage_answers_what_retrieve_gives() {
    use embers::embedding::FusedOptimizer;
    use embers::retrieval::{IvfPqConfig, IvfPqIndex, Metric};
    use embers::serve::RetrievalConfig;
    use embers::sparse::KeyedJaggedTensor;
    use embers::train::{DenseOptimizer, PairBatch, TwoTowerConfig, TwoTowerLoss};
    use rand::{Rng, SeedableRng};

    let dir = scratch("retrieval");
    let g = data();
    let dlrm_path = dir.join("dlrm.safetensors");
    let mut dlrm = config(&g).build().unwrap();
    train(&mut dlrm, &g, 1);
    write_checkpoint(&dlrm, &dlrm_path);

    let (users, items) = (60usize, 400usize);
    let tt = TwoTowerConfig {
        query_features: vec![("user".into(), users)],
        candidate_features: vec![("item".into(), items)],
        embedding_dim: 8,
        layers: vec![16, 8],
        normalize: true,
        temperature: 0.1,
        loss: TwoTowerLoss::Softmax {
            log_q: true,
            random_negatives: 0,
        },
        estimator_buckets: 1024,
        estimator_alpha: 0.05,
        sparse_optimizer: FusedOptimizer::RowWiseAdagrad {
            lr: 0.05,
            eps: 1e-8,
        },
        dense_optimizer: DenseOptimizer::Adam { lr: 1e-2 },
        seed: 3,
        device: embers::Device::Cpu,
    };
    let one_hot = |key: &str, ids: &[i64]| KeyedJaggedTensor::one_hot(key, ids).unwrap();
    let mut trainer = tt.build().unwrap();
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(4);
    for _ in 0..20 {
        let u: Vec<i64> = (0..64).map(|_| rng.random_range(0..users as i64)).collect();
        let i: Vec<i64> = u
            .iter()
            .map(|&u| (u * 7 + rng.random_range(0..3)) % items as i64)
            .collect();
        let batch = PairBatch {
            queries: one_hot("user", &u),
            candidates: one_hot("item", &i),
            labels: None,
            candidate_ids: i,
        };
        trainer.train_step(&batch).unwrap();
    }
    let tt_path = dir.join("two_tower.safetensors");
    trainer
        .save_checkpoint(&tt_path, &Default::default())
        .unwrap();
    let all: Vec<i64> = (0..items as i64).collect();
    let emb = trainer
        .model()
        .embed_candidates(&one_hot("item", &all))
        .unwrap()
        .to_vec::<f32>()
        .unwrap();
    let mut index =
        IvfPqIndex::train(IvfPqConfig::new(8, 4, Metric::InnerProduct), &emb, 8).unwrap();
    index.add(&all, &emb).unwrap();
    // Named after the model it was built from: the server's trainer, loaded from the
    // checkpoint, must be that one (its run id kept by the checkpoint).
    index.set_source(trainer.model_id());
    let index_path = dir.join("items.ivfpq");
    index.save(&index_path).unwrap();
    let nprobe = 3;
    // The reference: each query alone, row-invariant as the server runs it.
    let reference = |u: i64, k: usize| {
        embers::tensor::row_invariant(|| {
            trainer
                .model()
                .retrieve(&one_hot("user", &[u]), &index.with_nprobe(nprobe), k)
                .unwrap()
        })
    };
    let expected: Vec<Vec<(Vec<i64>, Vec<u32>)>> = (0..users as i64)
        .map(|u| {
            [1, 5, 17, 40]
                .iter()
                .map(|&k| {
                    let n = reference(u, k);
                    (
                        n.ids_of(0).to_vec(),
                        n.scores_of(0).iter().map(|s| s.to_bits()).collect(),
                    )
                })
                .collect()
        })
        .collect();
    let expected = Arc::new(expected);

    runtime().block_on(async move {
        let mut cfg = ServerConfig::new("recs", &dlrm_path);
        cfg.retrieval = Some(RetrievalConfig {
            checkpoint: tt_path.clone(),
            index: index_path.clone(),
            nprobe,
            max_k: 40,
        });
        cfg.max_body_bytes = 64 << 10;
        cfg.batcher = BatcherConfig {
            max_batch_rows: 32,
            max_delay: Duration::from_millis(5),
            max_queued_rows: 10_000,
        };
        let running = start(cfg).await;
        let addr = running.addr;
        let mut clients = Vec::new();
        for c in 0..40usize {
            let expected = expected.clone();
            clients.push(tokio::spawn(async move {
                let kk = c % 4;
                let k = [1, 5, 17, 40][kk];
                let mine: Vec<i64> = (0..1 + c % 5)
                    .map(|j| ((c * 13 + j * 7) % users) as i64)
                    .collect();
                let instances: Vec<Value> = mine.iter().map(|&u| json!({ "user": u })).collect();
                let body = serde_json::to_vec(&json!({ "instances": instances, "k": k })).unwrap();
                let (status, _, body) =
                    send(addr, "POST", "/v1/models/recs:retrieve", None, body).await;
                assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
                let v: Value = serde_json::from_slice(&body).unwrap();
                for (q, &u) in mine.iter().enumerate() {
                    let ids: Vec<i64> = (v["ids"][q].as_array().unwrap().iter())
                        .map(|x| x.as_i64().unwrap())
                        .collect();
                    let scores: Vec<u32> = (v["scores"][q].as_array().unwrap().iter())
                        .map(|x| (x.as_f64().unwrap() as f32).to_bits())
                        .collect();
                    let (want_ids, want_scores) = &expected[u as usize][kk];
                    assert_eq!(ids.len(), k);
                    assert_eq!(&ids, want_ids, "user {u} k {k}");
                    assert_eq!(&scores, want_scores, "user {u} k {k}");
                }
            }));
        }
        for c in clients {
            c.await.unwrap();
        }
        // Queries and their times are counted as retrieval's, not as predict's.
        let metrics = metrics_text(addr).await;
        let queries: usize = (0..40).map(|c| 1 + c % 5).sum();
        assert_eq!(
            metric(&metrics, "embers_retrieval_queries_total"),
            queries as u64
        );
        assert_eq!(metric(&metrics, "embers_rows_total"), 0);
        assert_eq!(
            metric(&metrics, "embers_retrieve_duration_seconds_count"),
            40
        );
        assert_eq!(metric(&metrics, "embers_request_duration_seconds_count"), 0);
        // Bad requests: named 4xx, and the server keeps answering.
        for (body, kind) in [
            (json!({"instances": [{"user": users}], "k": 5}), "invalid"),
            (json!({"instances": [{"user": -1}]}), "invalid"),
            (json!({"instances": [{"user": 1}], "k": 41}), "invalid"),
            (json!({"instances": [{"user": 1}], "k": 0}), "invalid"),
            (json!({"instances": [{"movie": 1}]}), "unknown_feature"),
            (json!({"instances": [{"user": "x"}]}), "wrong_type"),
            (json!({"instances": []}), "invalid"),
            (json!({"k": 3}), "invalid"),
            // A misspelt `k` was ignored, and 10 answered.
            (
                json!({"instances": [{"user": 1}], "top_k": 3}),
                "unknown_field",
            ),
        ] {
            let (status, _, answer) = send(
                addr,
                "POST",
                "/v1/models/recs:retrieve",
                None,
                serde_json::to_vec(&body).unwrap(),
            )
            .await;
            let v: Value = serde_json::from_slice(&answer).unwrap();
            assert_eq!(
                (status, v["error"]["kind"].as_str()),
                (400, Some(kind)),
                "{body}"
            );
        }
        // Over the body limit (64 KiB here; small enough that the client has written it all
        // before the server answers): 413, as for predict.
        let (status, _, _) = send(
            addr,
            "POST",
            "/v1/models/recs:retrieve",
            None,
            vec![b' '; 70 << 10],
        )
        .await;
        assert_eq!(status, 413);
        let (status, _, answer) = send(addr, "GET", "/v1/models/recs", None, vec![]).await;
        assert_eq!(status, 200);
        let v: Value = serde_json::from_slice(&answer).unwrap();
        assert_eq!(v["retrieval"]["candidates"], json!(items));
        assert_eq!(v["retrieval"]["features"], json!(["user"]));
        running.stop.send(()).unwrap();
        running.done.await.unwrap().unwrap();

        // More results than an answer holds (queries × k past 2^20): 413 before any search.
        let mut cfg = ServerConfig::new("recs", &dlrm_path);
        cfg.retrieval = Some(RetrievalConfig {
            checkpoint: tt_path.clone(),
            index: index_path.clone(),
            nprobe,
            max_k: 1000,
        });
        let wide = start(cfg).await;
        let many = vec![json!({}); (1 << 20) / 1000 + 1];
        let body = serde_json::to_vec(&json!({"instances": many, "k": 1000})).unwrap();
        let (status, _, answer) =
            send(wide.addr, "POST", "/v1/models/recs:retrieve", None, body).await;
        let v: Value = serde_json::from_slice(&answer).unwrap();
        assert_eq!(
            (status, v["error"]["kind"].as_str()),
            (413, Some("too_many_results"))
        );
        wide.stop.send(()).unwrap();
        wide.done.await.unwrap().unwrap();

        // Without a retrieval stage the route is a 404; a mismatched index refuses to load.
        let plain = start(ServerConfig::new("recs", &dlrm_path)).await;
        let body = serde_json::to_vec(&json!({"instances": [{"user": 1}]})).unwrap();
        let (status, _, _) = send(plain.addr, "POST", "/v1/models/recs:retrieve", None, body).await;
        assert_eq!(status, 404);
        plain.stop.send(()).unwrap();
        plain.done.await.unwrap().unwrap();
        let small: Vec<f32> = emb.chunks_exact(8).flat_map(|v| v[..4].to_vec()).collect();
        let mut wrong =
            IvfPqIndex::train(IvfPqConfig::new(4, 2, Metric::InnerProduct), &small, 4).unwrap();
        wrong.add(&all, &small).unwrap();
        let wrong_path = dir.join("wrong.ivfpq");
        wrong.save(&wrong_path).unwrap();
        let mut cfg = ServerConfig::new("recs", &dlrm_path);
        cfg.retrieval = Some(RetrievalConfig {
            checkpoint: tt_path.clone(),
            index: wrong_path,
            nprobe: 2,
            max_k: 10,
        });
        let err = Server::start(cfg)
            .await
            .err()
            .expect("a mismatched index is refused");
        assert!(err.to_string().contains("dimension 4"), "{err}");

        // Probe counts outside the index's lists, no candidates wanted, an index emptied of its
        // vectors: each refused at load, named.
        use embers::serve::RetrievalServable;
        let load_err = |index: &std::path::Path, nprobe: usize, max_k: usize| {
            RetrievalServable::from_files(&tt_path, index, nprobe, max_k)
                .err()
                .expect("refused")
                .to_string()
        };
        assert!(load_err(&index_path, 0, 10).contains("nprobe 0"));
        // An index of another model's candidates (an earlier checkpoint's, another run's).
        let mut stale = IvfPqIndex::load(&index_path).unwrap();
        let other = "0123456789abcdef.3";
        stale.set_source(other);
        let stale_path = dir.join("stale.ivfpq");
        stale.save(&stale_path).unwrap();
        assert_eq!(IvfPqIndex::load(&stale_path).unwrap().source(), Some(other));
        let e = load_err(&stale_path, 3, 10);
        assert!(
            e.contains(&format!("holds the candidates of model {other}"))
                && e.contains("two_tower.safetensors holds model"),
            "{e}"
        );
        assert!(load_err(&index_path, 9, 10).contains("nprobe 9 (1..=8)"));
        assert!(load_err(&index_path, 3, 0).contains("max_k 0"));
        assert!(load_err(&index_path, 3, 100_001).contains("max_k 100001 (1..=100000)"));
        // A query tower whose weights overflow every query to a non-number: refused at load
        // by its probe query (it loaded, and every query failed).
        let nan_tt = dir.join("huge-tt.safetensors");
        std::fs::copy(&tt_path, &nan_tt).unwrap();
        fill_tensor_data(&nan_tt, f32::MAX, every_element);
        let e = RetrievalServable::from_files(&nan_tt, &index_path, 3, 10)
            .err()
            .expect("refused")
            .to_string();
        assert!(e.contains("cannot answer a probe query"), "{e}");
        // Only the rows past the probe's id 0 overflow: it loads, and a query of user 1
        // gets 422 naming it, not 200 with `null` scores.
        let half_nan = dir.join("half-huge-tt.safetensors");
        std::fs::copy(&tt_path, &half_nan).unwrap();
        fill_tensor_data(&half_nan, f32::MAX, |name, shape| {
            (name.starts_with("query.tables.") && name.ends_with(".weight"))
                .then(|| shape[1]..shape.iter().product())
        });
        let mut cfg = ServerConfig::new("recs", &dlrm_path);
        cfg.retrieval = Some(RetrievalConfig {
            checkpoint: half_nan,
            index: index_path.clone(),
            nprobe,
            max_k: 10,
        });
        let overflowing = start(cfg).await;
        for (user, status) in [(0, 200), (1, 422)] {
            let body = serde_json::to_vec(&json!({"instances": [{"user": user}], "k": 3})).unwrap();
            let (got, _, answer) = send(
                overflowing.addr,
                "POST",
                "/v1/models/recs:retrieve",
                None,
                body,
            )
            .await;
            assert_eq!(got, status, "{}", String::from_utf8_lossy(&answer));
            if status == 422 {
                let v: Value = serde_json::from_slice(&answer).unwrap();
                assert_eq!(v["error"]["kind"], "non_finite", "{v}");
            }
        }
        overflowing.stop.send(()).unwrap();
        overflowing.done.await.unwrap().unwrap();
        let mut empty = IvfPqIndex::load(&index_path).unwrap();
        assert_eq!(empty.remove(&all), items);
        let empty_path = dir.join("empty.ivfpq");
        empty.save(&empty_path).unwrap();
        assert!(load_err(&empty_path, 3, 10).contains("holds no vector"));
    });
}

/// `--watch`: a checkpoint replaced by a truncated file is refused (the old model keeps
/// serving), and the complete file that follows is loaded (seen as version 2).
#[cfg(unix)]
#[test]
fn the_binary_watches_its_checkpoint() {
    use std::io::{BufRead, BufReader};
    let g = data();
    let dir = scratch("watch");
    let path = dir.join("model.safetensors");
    let mut trainer = config(&g).build().unwrap();
    write_checkpoint(&trainer, &path);
    let (mut child, mut out, mut line) = spawn_serve(&[
        "--checkpoint",
        path.to_str().unwrap(),
        "--addr",
        "127.0.0.1:0",
        "--watch",
        "1",
    ]);
    let mut err = BufReader::new(child.stderr.take().unwrap());
    assert!(line.contains("version 1"), "{line}");
    let good = std::fs::read(&path).unwrap();
    std::fs::write(&path, &good[..good.len() / 2]).unwrap();
    line.clear();
    err.read_line(&mut line).unwrap();
    assert!(
        line.contains("reload refused, the old model keeps serving"),
        "{line}"
    );
    train(&mut trainer, &g, 1);
    write_checkpoint(&trainer, &path);
    line.clear();
    out.read_line(&mut line).unwrap();
    assert!(line.contains("now serving version 2"), "{line}");
    child.kill().unwrap();
    let _ = child.wait();
    let _ = std::fs::remove_dir_all(&dir);
}

/// A body trickled below `min_body_rate` is cut after the grace (it held its place among
/// those in flight for the whole `body_timeout`), freeing its place; past `max_connections` a
/// new connection is closed at once; both answered as the API answers and counted.
#[test]
fn trickled_bodies_and_connections_past_the_bound_are_cut() {
    use std::io::{Read, Write};
    let g = data();
    let dir = scratch("trickle");
    let path = dir.join("model.safetensors");
    let trainer = config(&g).build().unwrap();
    write_checkpoint(&trainer, &path);
    runtime().block_on(async move {
        let mut cfg = ServerConfig::new("dlrm", &path);
        cfg.max_inflight_requests = 1;
        cfg.body_timeout = Duration::from_secs(60);
        cfg.min_body_rate = 1000;
        cfg.max_connections = 2;
        let running = start(cfg).await;
        let addr = running.addr;
        let started = Instant::now();
        let answer = tokio::task::spawn_blocking(move || {
            let mut slow = std::net::TcpStream::connect(addr).unwrap();
            slow.write_all(
                b"POST /v1/models/dlrm:predict HTTP/1.1\r\nhost: x\r\n\
                  content-type: application/json\r\ncontent-length: 100000\r\n\r\n",
            )
            .unwrap();
            // 10 bytes every 100 ms: 100 bytes a second, a tenth of the floor.
            slow.set_read_timeout(Some(Duration::from_millis(100)))
                .unwrap();
            let mut answer = Vec::new();
            for _ in 0..100 {
                if slow.write_all(b"          ").is_err() {
                    break;
                }
                let mut buf = [0u8; 4096];
                match slow.read(&mut buf) {
                    Ok(0) => break,
                    Ok(n) => {
                        answer.extend_from_slice(&buf[..n]);
                        break;
                    }
                    Err(_) => {}
                }
            }
            String::from_utf8_lossy(&answer).to_string()
        })
        .await
        .unwrap();
        let took = started.elapsed();
        assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
        assert!(answer.contains("body_too_slow"), "{answer}");
        assert!(
            took >= embers::serve::BODY_RATE_GRACE && took < Duration::from_secs(8),
            "cut after {took:?}"
        );
        // Two connections open (idle); a third is closed as soon as it is accepted.
        let a = std::net::TcpStream::connect(addr).unwrap();
        let b = std::net::TcpStream::connect(addr).unwrap();
        tokio::time::sleep(Duration::from_millis(200)).await;
        let third = tokio::task::spawn_blocking(move || {
            let mut c = std::net::TcpStream::connect(addr).unwrap();
            c.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
            let _ = c.write_all(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n");
            let mut buf = [0u8; 256];
            c.read(&mut buf).map(|n| n == 0).unwrap_or(true)
        })
        .await
        .unwrap();
        assert!(third, "the third connection was served");
        drop((a, b));
        // Their places come free once the server sees them closed.
        let waited = Instant::now();
        let status = loop {
            match try_send(addr, "GET", "/healthz", None, vec![]).await {
                Ok((status, _, _)) => break status,
                Err(e) => assert!(
                    waited.elapsed() < Duration::from_secs(10),
                    "no place came free: {e}"
                ),
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        assert_eq!(status, 200, "a place came free");
        let metrics = metrics_text(addr).await;
        assert!(
            metrics.contains("embers_errors_total{kind=\"body_too_slow\"} 1"),
            "{metrics}"
        );
        assert!(
            metrics.contains("embers_errors_total{kind=\"too_many_connections\"}"),
            "{metrics}"
        );
        running.stop.send(()).unwrap();
        running.done.await.unwrap().unwrap();
    });
}

/// Reloads over HTTP (each a whole model load) are not anyone's: with a token, only requests
/// carrying it (401 with a `WWW-Authenticate` challenge otherwise, from loopback too); without
/// one, only loopback clients, so a router served without `Server::serve` (which alone knows
/// the client's address) refuses them (403). Refusals are counted; the model keeps serving.
#[test]
fn reloads_over_http_need_the_token_or_a_loopback_client() {
    // Tokens that could be guessed or could not travel in a header are refused, and never
    // shown.
    for bad in [
        "short",
        "sixteen chars but spaces",
        "tab\tin-the-middle-of-it",
    ] {
        let err = ReloadToken::new(bad).unwrap_err().to_string();
        assert!(err.contains("at least 16 visible ASCII"), "{bad:?}: {err}");
    }
    let secret = "s3cr3t-reload-token-0123";
    let token = ReloadToken::new(secret).unwrap();
    assert!(!format!("{token:?}").contains("s3cr3t"), "{token:?}");
    let dir = scratch("reload-auth");
    let file = dir.join("token");
    std::fs::write(&file, format!("  {secret}  \nsecond line ignored\n")).unwrap();
    let read = ReloadToken::from_file(&file).unwrap();
    let missing = ReloadToken::from_file(&dir.join("absent"))
        .unwrap_err()
        .to_string();
    assert!(missing.contains("absent"), "{missing}");
    std::fs::write(dir.join("short"), "tooshort\n").unwrap();
    let short = ReloadToken::from_file(&dir.join("short"))
        .unwrap_err()
        .to_string();
    assert!(
        short.contains("short") && short.contains("at least 16"),
        "{short}"
    );

    let g = data();
    let path = dir.join("model.safetensors");
    let trainer = config(&g).build().unwrap();
    write_checkpoint(&trainer, &path);
    const RELOAD: &str = "/v1/models/dlrm:reload";
    runtime().block_on(async move {
        let mut cfg = ServerConfig::new("dlrm", &path);
        cfg.reload_token = Some(read);
        let running = start(cfg).await;
        let addr = running.addr;
        let kind = |answer: &Bytes| {
            let v: Value = serde_json::from_slice(answer).unwrap();
            v["error"]["kind"].as_str().unwrap().to_string()
        };
        // No token, a wrong one, another scheme: 401, challenged, nothing reloaded.
        let bearer_wrong = format!("Bearer {secret}x");
        let basic = format!("Basic {secret}");
        for headers in [
            vec![],
            vec![("authorization", bearer_wrong.as_str())],
            vec![("authorization", basic.as_str())],
        ] {
            let (status, answer_headers, answer) =
                send_with(addr, "POST", RELOAD, &headers, vec![])
                    .await
                    .unwrap();
            assert_eq!(status, 401, "{headers:?}");
            assert_eq!(kind(&answer), "unauthorized");
            assert_eq!(answer_headers["www-authenticate"], "Bearer");
        }
        assert_eq!(running.server.version(), 1);
        let bearer = format!("Bearer {secret}");
        let (status, _, answer) =
            send_with(addr, "POST", RELOAD, &[("authorization", &bearer)], vec![])
                .await
                .unwrap();
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&answer));
        assert_eq!(running.server.version(), 2);
        let metrics = metrics_text(addr).await;
        assert_eq!(
            metric(&metrics, "embers_errors_total{kind=\"unauthorized\"}"),
            3
        );
        running.stop.send(()).unwrap();
        running.done.await.unwrap().unwrap();

        // No token: the router served by axum alone does not know the client, so refuses.
        let server = Server::start(ServerConfig::new("dlrm", &path))
            .await
            .unwrap();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let router = server.router();
        let served = tokio::spawn(async move { axum::serve(listener, router).await });
        let (status, _, answer) = send(addr, "POST", RELOAD, None, vec![]).await;
        assert_eq!(status, 403);
        assert_eq!(kind(&answer), "reload_forbidden");
        assert!(String::from_utf8_lossy(&answer).contains("client address unknown"));
        assert_eq!(server.version(), 1);
        served.abort();
    });
    let _ = std::fs::remove_dir_all(&dir);
}
