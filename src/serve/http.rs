//! The HTTP server: a trained DLRM behind [`DynamicBatcher`], routed by axum over its own
//! hyper accept loop (see [`Server`]).

use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::io::Cursor;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use arrow_array::cast::AsArray;
use arrow_array::types::{Float32Type, Float64Type, Int32Type, Int64Type};
use arrow_array::{Array, ArrayRef, Float32Array, RecordBatch};
use arrow_schema::{DataType, Field, Schema};
use axum::body::{Body, HttpBody};
use axum::extract::rejection::PathRejection;
use axum::extract::{Path, State};
use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use serde_json::{json, Value};

use super::{
    BatchModel, BatcherConfig, DlrmRow, DlrmServable, DynamicBatcher, Histogram, RetrievalRow,
    RetrievalServable, ServeError,
};
use crate::embedding::{CacheStats, Placement, WeightType};
use crate::{Error, Result};

/// The Arrow IPC stream media type.
pub const ARROW_STREAM: &str = "application/vnd.apache.arrow.stream";

/// What to serve and how.
#[derive(Clone, Debug)]
pub struct ServerConfig {
    /// The model's name in the URL (`/v1/models/{name}:predict`).
    pub model_name: String,
    /// The trainer checkpoint (loaded at start and again on every reload).
    pub checkpoint: PathBuf,
    /// Serve a quantized copy of the tables (FP16, INT8, INT4, FP8, …) instead of FP32.
    pub quantize: Option<WeightType>,
    /// Where the served tables live: in memory, or in row files behind a DRAM cache for
    /// tables bigger than memory ([`DlrmServable::from_checkpoint_placed`]).
    pub tables: Placement,
    /// Batching and queue bounds.
    pub batcher: BatcherConfig,
    /// Largest request body accepted (413 above it).
    pub max_body_bytes: usize,
    /// Predict requests being read, parsed or waiting at once; past it, 503 at once. With
    /// `max_body_bytes` it bounds the bodies requests hold; a body being parsed takes up to
    /// about 20 times its size more while it is parsed (one per runtime thread at a time), and
    /// the batcher's queue bounds the rows parsed.
    pub max_inflight_requests: usize,
    /// The longest a request's body may take to arrive (408 past it): a client that stops
    /// sending holds its place among those in flight no longer than this, and cannot keep
    /// a draining server from exiting.
    pub body_timeout: Duration,
    /// The slowest a request's body may arrive, in bytes a second on average after the first
    /// [`BODY_RATE_GRACE`] (408 `body_too_slow` below it; 0: no floor): a client trickling
    /// bodies holds a place among those in flight only as long as it sends at this rate.
    pub min_body_rate: u64,
    /// Connections open at once; past it a new connection is closed as soon as it is
    /// accepted (each holds a task and a socket; without a bound, slow clients could take
    /// every file descriptor).
    pub max_connections: usize,
    /// The longest a connection may take to send a request's headers, counted from when the
    /// server starts waiting for them (it is closed past it): a client that opens connections
    /// and trickles or withholds headers holds each no longer, and an idle keep-alive
    /// connection is closed after it.
    pub header_timeout: Duration,
    /// The longest a write of an answer may wait without progress (the connection is closed
    /// past it): a client that stops reading its answer holds the connection, the answer's
    /// memory and a draining server no longer. A slow reader that keeps reading is not cut
    /// (on Linux the socket holds at most 128 KiB unsent, so each bit the reader takes is
    /// progress; elsewhere it must take about half the socket's send buffer within the limit).
    pub write_timeout: Duration,
    /// A TwoTower retriever served beside the DLRM under the same name
    /// (`/v1/models/{name}:retrieve`), loaded and reloaded with it.
    pub retrieval: Option<RetrievalConfig>,
    /// Who may reload over HTTP (`:reload`, each a whole model load). With a token, requests
    /// carrying `Authorization: Bearer <token>`, from anywhere (401 otherwise); without one,
    /// only clients on this host's loopback interface (403 from elsewhere, and from a router
    /// served without [`Server::serve`], which alone knows the client's address). SIGHUP and
    /// `--watch` reload regardless.
    pub reload_token: Option<ReloadToken>,
}

/// The secret a `:reload` request must carry when the server has one
/// ([`ServerConfig::reload_token`]). Its `Debug` shows no part of it.
#[derive(Clone)]
pub struct ReloadToken(String);

impl ReloadToken {
    /// The shortest token accepted: guessing it must be out of reach.
    pub const MIN_LEN: usize = 16;

    /// `token` as a reload token: at least [`MIN_LEN`](Self::MIN_LEN) visible ASCII
    /// characters, no spaces (it travels in a header).
    pub fn new(token: impl Into<String>) -> Result<ReloadToken> {
        let token = token.into();
        if token.len() < Self::MIN_LEN || !token.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(Error::invalid(
                "ReloadToken",
                format!(
                    "a reload token is at least {} visible ASCII characters without spaces \
                     (got {} bytes{})",
                    Self::MIN_LEN,
                    token.len(),
                    if token.bytes().all(|b| b.is_ascii_graphic()) {
                        ""
                    } else {
                        ", some not visible ASCII"
                    }
                ),
            ));
        }
        Ok(ReloadToken(token))
    }

    /// The token in the file at `path` (its first line; surrounding whitespace and the line
    /// end are not part of it).
    pub fn from_file(path: &std::path::Path) -> Result<ReloadToken> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::Io {
            path: path.display().to_string(),
            source: e,
        })?;
        let first = text.lines().next().unwrap_or("").trim();
        ReloadToken::new(first).map_err(|e| {
            Error::invalid("ReloadToken::from_file", format!("{}: {e}", path.display()))
        })
    }

    /// Whether `given` is the token, in time that does not depend on where they differ.
    fn matches(&self, given: &[u8]) -> bool {
        let want = self.0.as_bytes();
        let differ = (want.iter().zip(given)).fold(0u8, |acc, (a, b)| acc | (a ^ b));
        want.len() == given.len() && differ == 0
    }
}

impl std::fmt::Debug for ReloadToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ReloadToken(<redacted>)")
    }
}

/// The address of the client of a connection [`Server::serve`] accepted, put into each of
/// its requests' extensions.
#[derive(Clone, Copy, Debug)]
struct Peer(std::net::SocketAddr);

/// The retrieval stage: a TwoTower trainer checkpoint and an IVF-PQ index of its candidates.
#[derive(Clone, Debug)]
pub struct RetrievalConfig {
    /// The TwoTower trainer checkpoint (its query tower embeds the requests).
    pub checkpoint: PathBuf,
    /// The IVF-PQ index of the candidate tower's embeddings (`IvfPqIndex::save`).
    pub index: PathBuf,
    /// Lists probed per query.
    pub nprobe: usize,
    /// The most candidates one query may ask for.
    pub max_k: usize,
}

impl ServerConfig {
    /// Serves `checkpoint` as `model_name` with FP32 tables, default batching, an 8 MiB body
    /// limit, 1024 requests in flight, 30 s for a body to arrive (at 16 KiB/s at least after
    /// the first 2 s), 60 s for headers, 30 s for a stalled write of an answer, and 4096
    /// connections.
    pub fn new(model_name: impl Into<String>, checkpoint: impl Into<PathBuf>) -> Self {
        ServerConfig {
            model_name: model_name.into(),
            checkpoint: checkpoint.into(),
            quantize: None,
            tables: Placement::Memory,
            batcher: BatcherConfig::default(),
            max_body_bytes: 8 << 20,
            max_inflight_requests: 1024,
            body_timeout: Duration::from_secs(30),
            min_body_rate: 16 << 10,
            max_connections: 4096,
            header_timeout: Duration::from_secs(60),
            write_timeout: Duration::from_secs(30),
            retrieval: None,
            reload_token: None,
        }
    }
}

/// One loaded model version.
struct Loaded {
    batcher: DynamicBatcher<DlrmServable>,
    version: u64,
    keys: Vec<String>,
    key_index: HashMap<String, usize>,
    table_rows: Vec<usize>,
    num_dense: usize,
    tasks: Vec<String>,
    retrieval: Option<LoadedRetrieval>,
}

/// The loaded retrieval stage of a [`Loaded`] version.
struct LoadedRetrieval {
    batcher: DynamicBatcher<RetrievalServable>,
    keys: Vec<String>,
    key_index: HashMap<String, usize>,
    max_k: usize,
    candidates: usize,
    nprobe: usize,
}

/// Server-wide counters.
struct Metrics {
    /// Responses by (route, status code).
    responses: Mutex<BTreeMap<(&'static str, u16), u64>>,
    /// Error responses by kind.
    errors: Mutex<BTreeMap<&'static str, u64>>,
    /// Seconds from a predict request's arrival to its answer (an error included).
    latency: Histogram,
    /// … and a retrieve request's.
    retrieve_latency: Histogram,
    /// Rows scored.
    rows: AtomicU64,
    /// Retrieval queries answered.
    queries: AtomicU64,
    reloads_ok: AtomicU64,
    reloads_failed: AtomicU64,
}

/// A finished reload: the version it swapped in, or its error (every joined caller gets a
/// [`duplicate`](Error::duplicate)).
type ReloadResult = std::result::Result<u64, Arc<Error>>;

struct Shared {
    config: ServerConfig,
    model: RwLock<Option<Arc<Loaded>>>,
    reloading: tokio::sync::Mutex<()>,
    /// The reload waiting for `reloading` (none started yet): callers meanwhile join it
    /// rather than queue one full load each. It is the sender's result once sent.
    queued_reload: Mutex<Option<tokio::sync::watch::Receiver<Option<ReloadResult>>>>,
    versions: AtomicU64,
    draining: AtomicBool,
    inflight: tokio::sync::Semaphore,
    metrics: Metrics,
}

/// The inference server: a loaded model, its batcher and the HTTP routes over them. Cheap to
/// clone (clones share everything).
///
/// | route | what |
/// |---|---|
/// | `POST /v1/models/{name}:predict` | scores rows: JSON (`application/json`) or Arrow IPC (`application/vnd.apache.arrow.stream`) in, the same format out |
/// | `POST /v1/models/{name}:retrieve` | with a retrieval stage ([`ServerConfig::retrieval`]): `{"instances": [{"<query feature>": ids, …}], "k": 10}` → `{"ids": [[…]], "scores": [[…]]}`, each instance's `k` nearest candidates (TwoTower query tower → IVF-PQ), best first |
/// | `POST /v1/models/{name}:reload` | loads the checkpoint file(s) again, checks them, swaps them in (loopback clients, or the [`ServerConfig::reload_token`]) |
/// | `GET /v1/models/{name}` | the model's features, tasks, version and table format |
/// | `GET /healthz` | 200 while the process runs |
/// | `GET /readyz` | 200 while a model is loaded and the server is not draining, else 503 |
/// | `GET /metrics` | Prometheus text: responses by route and code, errors by kind, latency and batch-size histograms, queue depth, model version, reloads |
///
/// **JSON** (`application/json`, or no type, or curl's default form type)
/// `{"instances": [{"dense": [0.1, …], "cat_0": [12, 7], "cat_1": 3}, …]}`: each
/// instance has its dense values under `dense` and, under each sparse feature's name, its ids
/// (a list, or one integer); a feature left out is an empty bag. The answer:
/// `{"model", "version", "predictions": [p, …], "outputs": {"<task>": [p, …], …}}`, one
/// probability per instance in request order (`predictions` is the first task's).
///
/// **Arrow IPC** (one stream, any number of record batches): a `dense` column (list or
/// fixed-size list of float32/float64) and one column per sparse feature (list of int64/int32,
/// or int64/int32 for one id per row). The answer is a stream with one float32 column per task.
///
/// Every bad request gets a 4xx naming the field (`{"error": {"kind", "message"}}`); a full
/// queue gets 503 with `Retry-After`. A reload loads and checks the new checkpoint on the
/// blocking pool while the old model serves; the swap is one pointer store, and requests already
/// holding the old model finish on it; a checkpoint that fails to load leaves the old model.
#[derive(Clone)]
pub struct Server {
    shared: Arc<Shared>,
}

/// A request's failure, as the client sees it.
#[derive(Debug)]
struct ApiError {
    status: StatusCode,
    kind: &'static str,
    message: String,
    retry_after: Option<Duration>,
    /// A 401 that names the scheme the request must authenticate with (`WWW-Authenticate`).
    challenge: bool,
}

impl ApiError {
    fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            status,
            kind,
            message: message.into(),
            retry_after: None,
            challenge: false,
        }
    }
    fn bad(kind: &'static str, message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, kind, message)
    }
}

impl From<ServeError> for ApiError {
    fn from(e: ServeError) -> Self {
        match e {
            ServeError::Invalid(m) => ApiError::bad("invalid", m),
            ServeError::Overloaded { retry_after, .. } => ApiError {
                retry_after: Some(retry_after),
                ..ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "overloaded", e.to_string())
            },
            ServeError::TooLarge { .. } => ApiError::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                "too_many_rows",
                format!("{e} (--max-queued-rows)"),
            ),
            ServeError::Model(m) => ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "model", m),
            ServeError::ShuttingDown => ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "shutting_down",
                "the model is shutting down",
            ),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut error = json!({"kind": self.kind, "message": self.message});
        if let Some(r) = self.retry_after {
            error["retry_after_ms"] = json!(r.as_millis() as u64);
        }
        let mut response = (self.status, axum::Json(json!({ "error": error }))).into_response();
        if let Some(r) = self.retry_after {
            // Retry-After is whole seconds; round the hint up so it is never zero.
            let secs = r.as_secs() + u64::from(r.subsec_nanos() > 0);
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(secs.max(1)));
        }
        if self.challenge {
            (response.headers_mut())
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        response
    }
}

impl Server {
    /// Loads the model of `config` (on the blocking pool) and starts its batcher. Must run
    /// inside a tokio runtime.
    pub async fn start(config: ServerConfig) -> Result<Server> {
        if config.max_body_bytes == 0 {
            return Err(Error::invalid(
                "ServerConfig",
                "max_body_bytes must be at least 1",
            ));
        }
        let name = &config.model_name;
        if name.is_empty()
            || !(name.bytes()).all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
        {
            return Err(Error::invalid(
                "ServerConfig",
                format!(
                    "model name {name:?}: letters, digits, `.`, `_` and `-` only (it is a \
                     segment of every URL: `/` made every route unreachable)"
                ),
            ));
        }
        // Each is a semaphore's places (past its most, tokio panicked).
        let most = tokio::sync::Semaphore::MAX_PERMITS;
        for (name, places) in [
            ("max_connections", config.max_connections),
            ("max_inflight_requests", config.max_inflight_requests),
        ] {
            if !(1..=most).contains(&places) {
                return Err(Error::invalid(
                    "ServerConfig",
                    format!("{name} {places} must be within 1..={most}"),
                ));
            }
        }
        let day = Duration::from_secs(24 * 3600);
        for (name, t) in [
            ("body_timeout", config.body_timeout),
            ("header_timeout", config.header_timeout),
            ("write_timeout", config.write_timeout),
        ] {
            if t.is_zero() || t > day {
                return Err(Error::invalid(
                    "ServerConfig",
                    format!("{name} is {t:?}: it must be longer than zero and at most a day"),
                ));
            }
        }
        let shared = Arc::new(Shared {
            inflight: tokio::sync::Semaphore::new(config.max_inflight_requests),
            config,
            model: RwLock::new(None),
            reloading: tokio::sync::Mutex::new(()),
            queued_reload: Mutex::new(None),
            versions: AtomicU64::new(0),
            draining: AtomicBool::new(false),
            metrics: Metrics {
                responses: Mutex::new(BTreeMap::new()),
                errors: Mutex::new(BTreeMap::new()),
                latency: Histogram::exponential(1e-4, 2.0, 18),
                retrieve_latency: Histogram::exponential(1e-4, 2.0, 18),
                rows: AtomicU64::new(0),
                queries: AtomicU64::new(0),
                reloads_ok: AtomicU64::new(0),
                reloads_failed: AtomicU64::new(0),
            },
        });
        let server = Server { shared };
        // No reload can run yet: the server is not shared.
        server.load().await?;
        Ok(server)
    }

    /// The model version being served (1 after start, +1 per successful reload).
    pub fn version(&self) -> u64 {
        self.current().map_or(0, |m| m.version)
    }

    /// Loads the checkpoint file again and swaps it in once it has loaded and scored a probe
    /// row; returns the new version. On error the old model keeps serving. The reload runs
    /// to its end even when the caller stops waiting (a client that hangs up on `:reload`):
    /// the model it loaded is swapped in and counted, not thrown away. Reloads run one at a
    /// time; calls made while one waits to start join it (each would read the same files),
    /// so abandoned calls never pile up full loads. A draining server reloads nothing (a load
    /// begun then held the process past its drain).
    pub async fn reload(&self) -> Result<u64> {
        self.refuse_reload_if_draining()?;
        let mut result = {
            let mut queued = (self.shared.queued_reload.lock()).unwrap_or_else(|p| p.into_inner());
            match &*queued {
                // One whose task ended without starting (its runtime shut down) is replaced.
                Some(waiting) if waiting.has_changed().is_ok() => waiting.clone(),
                _ => {
                    let (tx, rx) = tokio::sync::watch::channel(None);
                    *queued = Some(rx.clone());
                    let server = self.clone();
                    tokio::spawn(async move {
                        let _one_at_a_time = server.shared.reloading.lock().await;
                        // Started: a later call reloads again (the files may change meanwhile).
                        *(server.shared.queued_reload.lock()).unwrap_or_else(|p| p.into_inner()) =
                            None;
                        // A drain begun while this waited for the one before: no load (it
                        // would hold the process past its drain).
                        let result = match server.refuse_reload_if_draining() {
                            Ok(()) => server.load().await,
                            Err(e) => Err(e),
                        };
                        let counter = match result {
                            Ok(_) => &server.shared.metrics.reloads_ok,
                            Err(_) => &server.shared.metrics.reloads_failed,
                        };
                        counter.fetch_add(1, Ordering::Relaxed);
                        let _ = tx.send(Some(result.map_err(Arc::new)));
                    });
                    rx
                }
            }
        };
        let done = result.wait_for(Option::is_some).await;
        match done.as_deref() {
            Ok(Some(Ok(version))) => Ok(*version),
            Ok(Some(Err(e))) => Err(e.duplicate()),
            _ => Err(Error::invalid(
                "reload",
                "the reload task ended without a result",
            )),
        }
    }

    /// A draining server reloads nothing (a load begun then held the process past its drain).
    fn refuse_reload_if_draining(&self) -> Result<()> {
        if self.shared.draining.load(Ordering::Acquire) {
            return Err(Error::invalid(
                "reload",
                "the server is draining to exit: nothing is reloaded",
            ));
        }
        Ok(())
    }

    /// Loads the checkpoint and swaps it in: at start, and in [`Server::reload`]'s task (which
    /// holds `reloading`).
    async fn load(&self) -> Result<u64> {
        let (path, quantize, tables) = (
            self.shared.config.checkpoint.clone(),
            self.shared.config.quantize,
            self.shared.config.tables.clone(),
        );
        let retrieval = self.shared.config.retrieval.clone();
        let (servable, retriever) = tokio::task::spawn_blocking(move || -> Result<_> {
            let servable = DlrmServable::from_checkpoint_placed(&path, quantize, &tables)?;
            let retriever = retrieval
                .map(|r| RetrievalServable::from_files(&r.checkpoint, &r.index, r.nprobe, r.max_k))
                .transpose()?;
            Ok((servable, retriever))
        })
        .await
        .map_err(|e| Error::invalid("checkpoint", format!("loading panicked: {e}")))??;
        let retrieval = match retriever {
            Some(r) => Some(LoadedRetrieval {
                keys: r.keys().to_vec(),
                key_index: (r.keys().iter().enumerate())
                    .map(|(i, k)| (k.clone(), i))
                    .collect(),
                max_k: r.max_k(),
                candidates: r.candidates(),
                nprobe: r.nprobe(),
                batcher: DynamicBatcher::new(r, self.shared.config.batcher)?,
            }),
            None => None,
        };
        let keys = servable.keys().to_vec();
        let loaded = Loaded {
            key_index: keys
                .iter()
                .enumerate()
                .map(|(i, k)| (k.clone(), i))
                .collect(),
            table_rows: servable.table_rows().to_vec(),
            num_dense: servable.num_dense(),
            tasks: servable.tasks().to_vec(),
            keys,
            retrieval,
            version: self.shared.versions.fetch_add(1, Ordering::AcqRel) + 1,
            batcher: DynamicBatcher::new(servable, self.shared.config.batcher)?,
        };
        let version = loaded.version;
        // The swap: requests that already hold the old model finish on it; its batcher drains
        // and stops when the last of them lets go.
        *self.shared.model.write().unwrap_or_else(|p| p.into_inner()) = Some(Arc::new(loaded));
        Ok(version)
    }

    fn current(&self) -> Option<Arc<Loaded>> {
        self.shared
            .model
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// The routes (see [`Server`]).
    pub fn router(&self) -> Router {
        Router::new()
            .route("/healthz", get(|| async { "ok\n" }))
            .route("/readyz", get(readyz))
            .route("/metrics", get(metrics))
            .route("/v1/models/{target}", get(model_info).post(model_post))
            // axum's own answers (plain text, uncounted) are made the API's: JSON errors,
            // counted in the metrics under the route `other`.
            .fallback(|State(server): State<Server>| async move {
                server.refuse(ApiError::new(
                    StatusCode::NOT_FOUND,
                    "not_found",
                    "no such route",
                ))
            })
            .method_not_allowed_fallback(
                |State(server): State<Server>, method: Method| async move {
                    server.refuse(ApiError::new(
                        StatusCode::METHOD_NOT_ALLOWED,
                        "method_not_allowed",
                        format!("{method} is not served on this route"),
                    ))
                },
            )
            .with_state(self.clone())
    }

    /// Serves HTTP/1.1 on `listener` until `shutdown` completes, then stops accepting,
    /// reports not ready, and returns once every in-flight request has been answered. Each
    /// connection must send a request's headers within the configured `header_timeout`, and
    /// is closed when a write of its answer waits longer than `write_timeout`.
    pub async fn serve(
        &self,
        listener: tokio::net::TcpListener,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> std::io::Result<()> {
        use hyper_util::rt::{TokioIo, TokioTimer};
        let router = self.router();
        let header_timeout = self.shared.config.header_timeout;
        let write_timeout = self.shared.config.write_timeout;
        // Connections hold a receiver of `open`, and watch `stop` to finish their last
        // request and close: the drain waits until every receiver is gone.
        let (open, open_rx) = tokio::sync::watch::channel(());
        let (stop, stop_rx) = tokio::sync::watch::channel(false);
        let connections = Arc::new(tokio::sync::Semaphore::new(
            self.shared.config.max_connections,
        ));
        let mut shutdown = std::pin::pin!(shutdown);
        loop {
            let accepted = tokio::select! {
                accepted = listener.accept() => accepted,
                () = &mut shutdown => break,
            };
            let (stream, peer) = match accepted {
                Ok(accepted) => accepted,
                // A connection that failed before it was accepted: the next one may not.
                Err(e) if is_connection_error(&e) => continue,
                // Out of descriptors or memory: wait for connections to close, not spin.
                Err(_) => {
                    tokio::select! {
                        () = tokio::time::sleep(Duration::from_millis(100)) => continue,
                        () = &mut shutdown => break,
                    }
                }
            };
            // Past the bound the connection is closed at once (dropped), counted.
            let Ok(place) = connections.clone().try_acquire_owned() else {
                self.count(
                    "other",
                    StatusCode::SERVICE_UNAVAILABLE,
                    Some("too_many_connections"),
                );
                drop(stream);
                continue;
            };
            // Answers are small and whole: sent at once, not held back for more (Nagle).
            let _ = stream.set_nodelay(true);
            super::stall::limit_unsent(&stream);
            let stream = super::stall::WriteStallLimit::new(stream, write_timeout);
            let service = hyper_util::service::TowerToHyperService::new(
                router.clone().layer(axum::Extension(Peer(peer))),
            );
            let (open_rx, mut stop_rx) = (open_rx.clone(), stop_rx.clone());
            tokio::spawn(async move {
                let mut http = hyper::server::conn::http1::Builder::new();
                http.timer(TokioTimer::new())
                    .header_read_timeout(header_timeout);
                let mut conn = std::pin::pin!(http.serve_connection(TokioIo::new(stream), service));
                let mut stopping = false;
                loop {
                    tokio::select! {
                        // A connection's failure (a reset, a header or write timeout) is its
                        // own.
                        _ = conn.as_mut() => break,
                        changed = stop_rx.changed(), if !stopping => {
                            stopping = true;
                            if changed.is_ok() {
                                conn.as_mut().graceful_shutdown();
                            }
                        }
                    }
                }
                drop(open_rx);
                drop(place);
            });
        }
        self.shared.draining.store(true, Ordering::Release);
        drop(listener);
        drop(open_rx);
        let _ = stop.send(true);
        open.closed().await;
        Ok(())
    }

    /// `error` as the answer to a request no route took, counted under `other`.
    fn refuse(&self, error: ApiError) -> Response {
        let kind = error.kind;
        let response = error.into_response();
        self.count("other", response.status(), Some(kind));
        response
    }

    fn count(&self, route: &'static str, status: StatusCode, kind: Option<&'static str>) {
        let m = &self.shared.metrics;
        *m.responses
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry((route, status.as_u16()))
            .or_default() += 1;
        if let Some(kind) = kind {
            *m.errors
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .entry(kind)
                .or_default() += 1;
        }
    }

    /// The model named `name`, or 404 / 503.
    fn model(&self, name: &str) -> std::result::Result<Arc<Loaded>, ApiError> {
        if name != self.shared.config.model_name {
            return Err(ApiError::new(
                StatusCode::NOT_FOUND,
                "not_found",
                format!(
                    "no model `{name}` (this server serves `{}`)",
                    self.shared.config.model_name
                ),
            ));
        }
        self.current().ok_or_else(|| {
            ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "not_ready",
                "no model loaded",
            )
        })
    }
}

async fn readyz(State(server): State<Server>) -> Response {
    if server.shared.draining.load(Ordering::Acquire) {
        (StatusCode::SERVICE_UNAVAILABLE, "draining\n").into_response()
    } else if server.current().is_some() {
        (StatusCode::OK, "ready\n").into_response()
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "no model loaded\n").into_response()
    }
}

/// The model path's segment, or the API's 400 (counted) for one that is not UTF-8 once
/// decoded.
fn target_of(
    server: &Server,
    target: std::result::Result<Path<String>, PathRejection>,
) -> std::result::Result<String, Box<Response>> {
    target.map(|Path(t)| t).map_err(|e| {
        Box::new(server.refuse(ApiError::bad(
            "invalid",
            format!("the model path: {}", e.body_text()),
        )))
    })
}

async fn model_info(
    State(server): State<Server>,
    target: std::result::Result<Path<String>, PathRejection>,
) -> Response {
    let name = match target_of(&server, target) {
        Ok(name) => name,
        Err(refused) => return *refused,
    };
    let response = match server.model(&name) {
        Ok(m) => {
            let features: Vec<Value> = (m.keys.iter().zip(&m.table_rows))
                .map(|(k, r)| json!({"name": k, "rows": r}))
                .collect();
            let weights = server
                .shared
                .config
                .quantize
                .map_or("fp32".to_string(), |w| format!("{w:?}").to_lowercase());
            axum::Json(json!({
                "name": name,
                "version": m.version,
                "dense": m.num_dense,
                "features": features,
                "tasks": m.tasks,
                "weights": weights,
                "checkpoint": server.shared.config.checkpoint.display().to_string(),
                "retrieval": m.retrieval.as_ref().map(|r| {
                    let config = server.shared.config.retrieval.as_ref();
                    json!({
                        "features": r.keys,
                        "candidates": r.candidates,
                        "nprobe": r.nprobe,
                        "max_k": r.max_k,
                        "checkpoint": config.map(|c| c.checkpoint.display().to_string()),
                        "index": config.map(|c| c.index.display().to_string()),
                    })
                }),
            }))
            .into_response()
        }
        Err(e) => e.into_response(),
    };
    server.count("model", response.status(), None);
    response
}

/// `POST /v1/models/{name}:{verb}`.
async fn model_post(
    State(server): State<Server>,
    target: std::result::Result<Path<String>, PathRejection>,
    peer: Option<axum::Extension<Peer>>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let target = match target_of(&server, target) {
        Ok(target) => target,
        Err(refused) => return *refused,
    };
    let started = Instant::now();
    let (route, result) = match target.rsplit_once(':') {
        Some((name, "predict")) => ("predict", predict(&server, name, &headers, body).await),
        Some((name, "retrieve")) => ("retrieve", retrieve(&server, name, &headers, body).await),
        Some((name, "reload")) => {
            let peer = peer.map(|p| p.0 .0);
            ("reload", reload(&server, name, &headers, peer).await)
        }
        _ => (
            "unknown",
            Err(ApiError::new(
                StatusCode::NOT_FOUND,
                "not_found",
                format!(
                    "`{target}`: expected `<model>:predict`, `<model>:retrieve` or \
                     `<model>:reload`"
                ),
            )),
        ),
    };
    let (response, kind) = match result {
        Ok(r) => (r, None),
        Err(e) => {
            let kind = e.kind;
            (e.into_response(), Some(kind))
        }
    };
    let m = &server.shared.metrics;
    match route {
        "predict" => m.latency.observe(started.elapsed().as_secs_f64()),
        "retrieve" => m.retrieve_latency.observe(started.elapsed().as_secs_f64()),
        _ => {}
    }
    server.count(route, response.status(), kind);
    response
}

async fn reload(
    server: &Server,
    name: &str,
    headers: &HeaderMap,
    peer: Option<std::net::SocketAddr>,
) -> std::result::Result<Response, ApiError> {
    authorize_reload(server.shared.config.reload_token.as_ref(), headers, peer)?;
    server.model(name)?;
    match server.reload().await {
        Ok(version) => Ok(axum::Json(json!({ "version": version })).into_response()),
        // The request was fine: a draining server (503) or files on the server that do not
        // load (500) are the server's side.
        Err(e) if server.shared.draining.load(Ordering::Acquire) => Err(ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "draining",
            format!("the old model keeps serving until the drain ends: {e}"),
        )),
        Err(e) => Err(ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "reload_failed",
            format!("the old model keeps serving: {e}"),
        )),
    }
}

/// Whether a `:reload` request may reload ([`ServerConfig::reload_token`]).
fn authorize_reload(
    token: Option<&ReloadToken>,
    headers: &HeaderMap,
    peer: Option<std::net::SocketAddr>,
) -> std::result::Result<(), ApiError> {
    let Some(token) = token else {
        // IPv4 clients of an IPv6 socket come as ::ffff:a.b.c.d.
        return match peer {
            Some(p) if p.ip().to_canonical().is_loopback() => Ok(()),
            _ => Err(ApiError::new(
                StatusCode::FORBIDDEN,
                "reload_forbidden",
                format!(
                    "reloads over HTTP come only from this host ({}) unless the server has \
                     a reload token (--reload-token-file); SIGHUP and --watch reload too",
                    peer.map_or("client address unknown".to_string(), |p| format!(
                        "this client is {}",
                        p.ip()
                    ))
                ),
            )),
        };
    };
    // The scheme's name is case-insensitive (RFC 9110).
    let given = (headers.get(header::AUTHORIZATION))
        .and_then(|v| v.to_str().ok())
        .and_then(|v| {
            let (scheme, token) = v.split_once(' ')?;
            scheme.eq_ignore_ascii_case("bearer").then_some(token)
        });
    let refused = |message: &str| ApiError {
        challenge: true,
        ..ApiError::new(StatusCode::UNAUTHORIZED, "unauthorized", message)
    };
    match given {
        Some(g) if token.matches(g.trim().as_bytes()) => Ok(()),
        Some(_) => Err(refused("the reload token does not match")),
        None => Err(refused(
            "a reload needs `Authorization: Bearer <token>`, the server's reload token",
        )),
    }
}

/// Whether an `accept` error is the failed connection's own (the listener is fine).
fn is_connection_error(e: &std::io::Error) -> bool {
    use std::io::ErrorKind::*;
    matches!(
        e.kind(),
        ConnectionRefused | ConnectionAborted | ConnectionReset | Interrupted
    )
}

/// A request's place among those in flight, or 503 when the limit is reached.
fn admit(server: &Server) -> std::result::Result<tokio::sync::SemaphorePermit<'_>, ApiError> {
    server.shared.inflight.try_acquire().map_err(|_| ApiError {
        retry_after: Some(server.shared.config.batcher.max_delay),
        ..ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "overloaded",
            format!(
                "{} requests in flight (limit)",
                server.shared.config.max_inflight_requests
            ),
        )
    })
}

/// The request body, at most `max_body_bytes` (413 above it).
async fn read_body(
    server: &Server,
    headers: &HeaderMap,
    body: Body,
) -> std::result::Result<axum::body::Bytes, ApiError> {
    let limit = server.shared.config.max_body_bytes;
    let too_large = || {
        ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "body_too_large",
            format!("the body exceeds {limit} bytes"),
        )
    };
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit as u64) {
        return Err(too_large());
    }
    let timeout = server.shared.config.body_timeout;
    let rate = server.shared.config.min_body_rate;
    let started = tokio::time::Instant::now();
    let end = started + timeout;
    let timed_out = || {
        ApiError::new(
            StatusCode::REQUEST_TIMEOUT,
            "body_timeout",
            format!("the body did not arrive within {timeout:?}"),
        )
    };
    // Frame by frame: the whole body within `body_timeout`, and, past the first
    // BODY_RATE_GRACE, at least `min_body_rate` bytes a second on average (a client trickling
    // its body held a place among those in flight for the whole timeout: a few thousand such
    // connections refused every other request).
    let mut body = std::pin::pin!(body);
    let mut bytes: Vec<u8> = Vec::new();
    loop {
        let due = if rate == 0 {
            end
        } else {
            let secs = (bytes.len() as f64 + 1.0) / rate as f64;
            let slow = started + BODY_RATE_GRACE + Duration::from_secs_f64(secs.min(86_400.0));
            slow.min(end)
        };
        let next = std::future::poll_fn(|cx| body.as_mut().poll_frame(cx));
        let frame = match tokio::time::timeout_at(due, next).await {
            Err(_) if due < end => {
                return Err(ApiError::new(
                    StatusCode::REQUEST_TIMEOUT,
                    "body_too_slow",
                    format!(
                        "the body arrived slower than {rate} bytes a second ({} bytes in {:?})",
                        bytes.len(),
                        started.elapsed()
                    ),
                ))
            }
            Err(_) => return Err(timed_out()),
            Ok(None) => break,
            Ok(Some(frame)) => frame
                .map_err(|e| ApiError::bad("body", format!("the body could not be read: {e}")))?,
        };
        if let Ok(data) = frame.into_data() {
            if bytes.len() + data.len() > limit {
                return Err(too_large());
            }
            bytes.extend_from_slice(&data);
        }
    }
    Ok(axum::body::Bytes::from(bytes))
}

/// How long a request body may arrive at any pace before [`ServerConfig::min_body_rate`]
/// applies.
pub const BODY_RATE_GRACE: Duration = Duration::from_secs(2);

/// A request's rows through `batcher` (none is a 400), counted in `answered` (a metric).
async fn run_rows<M: BatchModel>(
    batcher: &DynamicBatcher<M>,
    rows: Vec<M::Row>,
    answered: &AtomicU64,
) -> std::result::Result<Vec<M::Output>, ApiError> {
    if rows.is_empty() {
        return Err(ApiError::bad("invalid", "no instances"));
    }
    let n = rows.len();
    let outputs = batcher.submit(rows).await?;
    answered.fetch_add(n as u64, Ordering::Relaxed);
    Ok(outputs)
}

/// `POST /v1/models/{name}:retrieve`: `{"instances": [{"<query feature>": ids, …}, …],
/// "k": 10}` → each instance's `k` nearest candidates, best first.
async fn retrieve(
    server: &Server,
    name: &str,
    headers: &HeaderMap,
    body: Body,
) -> std::result::Result<Response, ApiError> {
    // As predict: the stage is checked at once and taken once the body is in.
    let no_stage = || {
        ApiError::new(
            StatusCode::NOT_FOUND,
            "not_found",
            format!("model `{name}` has no retrieval stage (start the server with one)"),
        )
    };
    if server.model(name)?.retrieval.is_none() {
        return Err(no_stage());
    }
    let _permit = admit(server)?;
    let bytes = read_body(server, headers, body).await?;
    let model = server.model(name)?;
    let stage = model.retrieval.as_ref().ok_or_else(no_stage)?;
    let value = parse_json(&bytes)?;
    only_fields(&value, &["instances", "k"])?;
    let k = match value.get("k") {
        None => 10.min(stage.max_k),
        Some(v) => v
            .as_u64()
            .filter(|&k| k >= 1 && k as usize <= stage.max_k)
            .ok_or_else(|| {
                ApiError::bad(
                    "invalid",
                    format!(
                        "`k` = {}: expected an integer in 1..={}",
                        shown(v),
                        stage.max_k
                    ),
                )
            })? as usize,
    };
    let instances = instances(&value)?;
    stage.batcher.check_size(instances.len())?;
    if instances.len().saturating_mul(k) > MAX_RETRIEVE_RESULTS {
        return Err(ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "too_many_results",
            format!(
                "{} queries × k = {k} ask for more than {MAX_RETRIEVE_RESULTS} results in one \
                 answer: send fewer queries a request, or a smaller k",
                instances.len()
            ),
        ));
    }
    let mut rows = Vec::with_capacity(instances.len());
    for (i, instance) in instances.iter().enumerate() {
        let object = object_at(i, instance)?;
        let mut row = RetrievalRow {
            ids: vec![Vec::new(); stage.keys.len()],
            k,
        };
        for (key, value) in object {
            let f = *stage.key_index.get(key).ok_or_else(|| {
                ApiError::bad(
                    "unknown_feature",
                    format!(
                        "instances[{i}]: unknown feature `{}` (the query tower takes {:?})",
                        shown_str(key),
                        stage.keys
                    ),
                )
            })?;
            row.ids[f] = ids_of(value, &format!("instances[{i}].{key}"))?;
        }
        rows.push(row);
    }
    let answers = run_rows(&stage.batcher, rows, &server.shared.metrics.queries).await?;
    // A query with no answer, or a score that is not a number, is no answer (JSON wrote it as
    // `null`, with 200).
    let non_finite = |i: usize, what: String| {
        ApiError::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            "non_finite",
            format!("instances[{i}]: {what} (inputs past what the query tower computes in f32?)"),
        )
    };
    let mut found = Vec::with_capacity(answers.len());
    for (i, answer) in answers.into_iter().enumerate() {
        let r = answer.map_err(|m| non_finite(i, m))?;
        if let Some(&(id, score)) = r.iter().find(|p| !p.1.is_finite()) {
            return Err(non_finite(i, format!("candidate {id} scores {score}")));
        }
        found.push(r);
    }
    let ids: Vec<Vec<i64>> = found
        .iter()
        .map(|r| r.iter().map(|p| p.0).collect())
        .collect();
    let scores: Vec<Vec<f32>> = found
        .iter()
        .map(|r| r.iter().map(|p| p.1).collect())
        .collect();
    Ok(axum::Json(json!({
        "model": name,
        "version": model.version,
        "k": k,
        "ids": ids,
        "scores": scores,
    }))
    .into_response())
}

/// A JSON request body (400 `malformed_json` if it is not JSON, or if an object repeats a
/// key: serde_json keeps the last one silently, dropping what the client sent first).
fn parse_json(bytes: &[u8]) -> std::result::Result<Value, ApiError> {
    use serde::de::DeserializeSeed;
    let malformed =
        |e: serde_json::Error| ApiError::bad("malformed_json", format!("malformed JSON: {e}"));
    let mut de = serde_json::Deserializer::from_slice(bytes);
    let value = StrictJson.deserialize(&mut de).map_err(malformed)?;
    de.end().map_err(malformed)?;
    Ok(value)
}

/// Deserializes a [`Value`] as serde_json does, but refuses an object with a repeated key.
struct StrictJson;

impl<'de> serde::de::DeserializeSeed<'de> for StrictJson {
    type Value = Value;

    fn deserialize<D: serde::Deserializer<'de>>(
        self,
        d: D,
    ) -> std::result::Result<Value, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> serde::de::Visitor<'de> for StrictJson {
    type Value = Value;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_bool<E>(self, v: bool) -> std::result::Result<Value, E> {
        Ok(Value::Bool(v))
    }

    fn visit_i64<E>(self, v: i64) -> std::result::Result<Value, E> {
        Ok(Value::from(v))
    }

    fn visit_u64<E>(self, v: u64) -> std::result::Result<Value, E> {
        Ok(Value::from(v))
    }

    fn visit_f64<E>(self, v: f64) -> std::result::Result<Value, E> {
        Ok(serde_json::Number::from_f64(v).map_or(Value::Null, Value::Number))
    }

    fn visit_str<E>(self, v: &str) -> std::result::Result<Value, E> {
        Ok(Value::String(v.to_string()))
    }

    fn visit_string<E>(self, v: String) -> std::result::Result<Value, E> {
        Ok(Value::String(v))
    }

    fn visit_unit<E>(self) -> std::result::Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_none<E>(self) -> std::result::Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_some<D: serde::Deserializer<'de>>(self, d: D) -> std::result::Result<Value, D::Error> {
        d.deserialize_any(self)
    }

    fn visit_seq<A: serde::de::SeqAccess<'de>>(
        self,
        mut seq: A,
    ) -> std::result::Result<Value, A::Error> {
        let mut list = Vec::new();
        while let Some(v) = seq.next_element_seed(StrictJson)? {
            list.push(v);
        }
        Ok(Value::Array(list))
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(
        self,
        mut map: A,
    ) -> std::result::Result<Value, A::Error> {
        let mut object = serde_json::Map::new();
        while let Some(key) = map.next_key::<String>()? {
            if object.contains_key(&key) {
                return Err(serde::de::Error::custom(format!(
                    "the field `{}` is given twice",
                    shown_str(&key)
                )));
            }
            let value = map.next_value_seed(StrictJson)?;
            object.insert(key, value);
        }
        Ok(Value::Object(object))
    }
}

/// The most characters of a client's value an error message repeats.
const SHOWN_CHARS: usize = 64;

/// A client's JSON value as an error message shows it: cut to [`SHOWN_CHARS`] characters
/// (a message must not echo a whole request back).
fn shown(v: &Value) -> String {
    shown_str(&v.to_string())
}

/// A client's text cut to [`SHOWN_CHARS`] characters.
fn shown_str(text: &str) -> String {
    match text.char_indices().nth(SHOWN_CHARS) {
        None => text.to_string(),
        Some((at, _)) => format!("{}… ({} bytes)", &text[..at], text.len()),
    }
}

/// The most `(id, score)` results one retrieve answer holds (queries × k): past it, 413.
pub const MAX_RETRIEVE_RESULTS: usize = 1 << 20;

/// 400 `unknown_field` for a top-level field of a JSON request other than `known` (a
/// misspelt `top_k` was ignored, and the default answered).
fn only_fields(value: &Value, known: &[&str]) -> std::result::Result<(), ApiError> {
    let Some(object) = value.as_object() else {
        return Ok(());
    };
    match object.keys().find(|key| !known.contains(&key.as_str())) {
        None => Ok(()),
        Some(key) => Err(ApiError::bad(
            "unknown_field",
            format!(
                "unknown field `{}` (the request takes {known:?})",
                shown_str(key)
            ),
        )),
    }
}

/// `instances[i]` as an object (400 `invalid` otherwise).
fn object_at(
    i: usize,
    instance: &Value,
) -> std::result::Result<&serde_json::Map<String, Value>, ApiError> {
    instance
        .as_object()
        .ok_or_else(|| ApiError::bad("invalid", format!("instances[{i}] is not an object")))
}

/// The `instances` list of a JSON request.
fn instances(value: &Value) -> std::result::Result<&Vec<Value>, ApiError> {
    value
        .get("instances")
        .ok_or_else(|| ApiError::bad("invalid", "missing `instances` (a list of objects)"))?
        .as_array()
        .ok_or_else(|| ApiError::bad("invalid", "`instances` must be a list of objects"))
}

/// A feature's ids in JSON: a list of integers, or one integer.
fn ids_of(value: &Value, at: &str) -> std::result::Result<Vec<i64>, ApiError> {
    let id = |v: &Value, where_: String| {
        v.as_i64().ok_or_else(|| {
            ApiError::bad(
                "wrong_type",
                format!("{where_}: expected an integer id, got {}", shown(v)),
            )
        })
    };
    match value {
        Value::Array(list) => (list.iter().enumerate())
            .map(|(j, v)| id(v, format!("{at}[{j}]")))
            .collect(),
        v => Ok(vec![id(v, at.to_string())?]),
    }
}

/// The request's body format.
#[derive(Clone, Copy, PartialEq)]
enum Format {
    Json,
    Arrow,
}

async fn predict(
    server: &Server,
    name: &str,
    headers: &HeaderMap,
    body: Body,
) -> std::result::Result<Response, ApiError> {
    // The name is checked at once; the model is taken once the body is in, so a slow body
    // never holds a model a reload has replaced.
    server.model(name)?;
    let _permit = admit(server)?;
    let format = match headers.get(header::CONTENT_TYPE).map(|v| v.to_str()) {
        None => Format::Json,
        Some(Ok(t)) if t.starts_with("application/json") => Format::Json,
        // What `curl -d` sends when no type is given: the body is still read as JSON.
        Some(Ok(t)) if t.starts_with("application/x-www-form-urlencoded") => Format::Json,
        Some(Ok(t)) if t.starts_with(ARROW_STREAM) => Format::Arrow,
        Some(t) => {
            return Err(ApiError::new(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                "unsupported_media_type",
                format!(
                    "content-type {:?}: expected application/json or {ARROW_STREAM}",
                    t.unwrap_or("(not text)")
                ),
            ))
        }
    };
    let bytes = read_body(server, headers, body).await?;
    let model = server.model(name)?;
    let rows = match format {
        Format::Json => rows_from_json(&model, &bytes)?,
        Format::Arrow => {
            // The IPC decoder trusts some offsets in the stream and can panic on a corrupt
            // one (seen under fuzzing): a panic there is a malformed body, not a crash.
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                rows_from_arrow(&model, &bytes)
            }))
            .unwrap_or_else(|_| {
                Err(ApiError::bad(
                    "malformed_arrow",
                    "malformed Arrow IPC stream (the decoder rejected its buffers)",
                ))
            })?
        }
    };
    let outputs = run_rows(&model.batcher, rows, &server.shared.metrics.rows).await?;
    let tasks = &model.tasks;
    // A prediction that is not a number is no answer (JSON wrote it as `null`, with 200).
    for (i, out) in outputs.iter().enumerate() {
        if let Some((t, p)) = out.iter().enumerate().find(|(_, p)| !p.is_finite()) {
            return Err(ApiError::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                "non_finite",
                format!(
                    "instances[{i}]: the model predicts {p} for task `{}` (inputs past what \
                     it computes in f32?)",
                    tasks[t]
                ),
            ));
        }
    }
    let column = |t: usize| outputs.iter().map(|o| o[t]).collect::<Vec<f32>>();
    Ok(match format {
        Format::Json => {
            let per_task: serde_json::Map<String, Value> = (tasks.iter().enumerate())
                .map(|(t, name)| (name.clone(), json!(column(t))))
                .collect();
            axum::Json(json!({
                "model": name,
                "version": model.version,
                "predictions": column(0),
                "outputs": per_task,
            }))
            .into_response()
        }
        Format::Arrow => {
            let fields: Vec<Field> = tasks
                .iter()
                .map(|t| Field::new(t, DataType::Float32, false))
                .collect();
            let columns: Vec<ArrayRef> = (0..tasks.len())
                .map(|t| Arc::new(Float32Array::from(column(t))) as ArrayRef)
                .collect();
            let encode = || -> std::result::Result<Vec<u8>, arrow_schema::ArrowError> {
                let schema = Arc::new(Schema::new(fields));
                let batch = RecordBatch::try_new(schema.clone(), columns)?;
                let mut out = Vec::new();
                let mut writer = arrow_ipc::writer::StreamWriter::try_new(&mut out, &schema)?;
                writer.write(&batch)?;
                writer.finish()?;
                drop(writer);
                Ok(out)
            };
            let bytes = encode().map_err(|e| {
                ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "encode", e.to_string())
            })?;
            ([(header::CONTENT_TYPE, ARROW_STREAM)], bytes).into_response()
        }
    })
}

/// `{"instances": [...]}` → rows (see [`Server`]).
fn rows_from_json(model: &Loaded, bytes: &[u8]) -> std::result::Result<Vec<DlrmRow>, ApiError> {
    let value = parse_json(bytes)?;
    only_fields(&value, &["instances"])?;
    let instances = instances(&value)?;
    // Refused before any row is built (a row costs more than its JSON: a list per feature).
    model.batcher.check_size(instances.len())?;
    let mut rows = Vec::with_capacity(instances.len());
    for (i, instance) in instances.iter().enumerate() {
        let at = |field: &str| format!("instances[{i}].{field}");
        let object = object_at(i, instance)?;
        let mut row = DlrmRow {
            dense: Vec::new(),
            ids: vec![Vec::new(); model.keys.len()],
        };
        let mut has_dense = false;
        for (key, value) in object {
            if key == "dense" {
                has_dense = true;
                let list = value.as_array().ok_or_else(|| {
                    ApiError::bad(
                        "wrong_type",
                        format!("{}: expected a list of numbers", at(key)),
                    )
                })?;
                for (j, x) in list.iter().enumerate() {
                    let x = x.as_f64().ok_or_else(|| {
                        ApiError::bad(
                            "wrong_type",
                            format!("{}[{j}]: expected a number, got {}", at(key), shown(x)),
                        )
                    })?;
                    row.dense.push(x as f32);
                }
                if row.dense.len() != model.num_dense {
                    return Err(ApiError::bad(
                        "invalid",
                        format!(
                            "{}: {} values, the model takes {}",
                            at(key),
                            row.dense.len(),
                            model.num_dense
                        ),
                    ));
                }
            } else if let Some(&f) = model.key_index.get(key) {
                row.ids[f] = ids_of(value, &at(key))?;
            } else {
                return Err(ApiError::bad(
                    "unknown_feature",
                    format!(
                        "instances[{i}]: unknown feature `{}` (the model takes `dense` and {:?})",
                        shown_str(key),
                        model.keys
                    ),
                ));
            }
        }
        if !has_dense {
            return Err(ApiError::bad(
                "invalid",
                format!(
                    "instances[{i}]: missing `dense` ({} values)",
                    model.num_dense
                ),
            ));
        }
        rows.push(row);
    }
    Ok(rows)
}

/// An Arrow IPC stream → rows (see [`Server`]).
fn rows_from_arrow(model: &Loaded, bytes: &[u8]) -> std::result::Result<Vec<DlrmRow>, ApiError> {
    let malformed = |e: arrow_schema::ArrowError| {
        ApiError::bad(
            "malformed_arrow",
            format!("malformed Arrow IPC stream: {e}"),
        )
    };
    let reader =
        arrow_ipc::reader::StreamReader::try_new(Cursor::new(bytes), None).map_err(malformed)?;
    let mut rows = Vec::new();
    for batch in reader {
        let batch = batch.map_err(malformed)?;
        // Offsets, lengths and null counts checked before any value is read.
        for column in batch.columns() {
            column.to_data().validate_full().map_err(malformed)?;
        }
        // The rows a stream claims cost no bytes until a column is read (a `dense` column of
        // nulls, no columns at all): checked against what its bytes can hold — every row's
        // dense values, 4 bytes each at least — before they are made.
        let per_row = (4 * model.num_dense).max(1);
        let claimed = rows.len().saturating_add(batch.num_rows());
        if claimed.saturating_mul(per_row) > bytes.len() {
            return Err(ApiError::bad(
                "invalid",
                format!(
                    "the stream claims {claimed} rows; its {} bytes hold at most {} rows of {} \
                     dense values",
                    bytes.len(),
                    bytes.len() / per_row,
                    model.num_dense
                ),
            ));
        }
        model.batcher.check_size(claimed)?;
        let first = rows.len();
        rows.extend((0..batch.num_rows()).map(|_| DlrmRow {
            dense: Vec::new(),
            ids: vec![Vec::new(); model.keys.len()],
        }));
        let mut has_dense = false;
        let mut seen = std::collections::HashSet::new();
        for (field, column) in batch.schema().fields().iter().zip(batch.columns()) {
            let name = field.name();
            if !seen.insert(name.as_str()) {
                return Err(ApiError::bad(
                    "invalid",
                    format!("the column `{}` is given twice", shown_str(name)),
                ));
            }
            if name == "dense" {
                has_dense = true;
                for r in 0..batch.num_rows() {
                    let values = arrow_floats(column, r).map_err(|m| {
                        ApiError::bad(
                            "wrong_type",
                            format!("column `dense` row {}: {m}", first + r),
                        )
                    })?;
                    if values.len() != model.num_dense {
                        return Err(ApiError::bad(
                            "invalid",
                            format!(
                                "column `dense` row {}: {} values, the model takes {}",
                                first + r,
                                values.len(),
                                model.num_dense
                            ),
                        ));
                    }
                    rows[first + r].dense = values;
                }
            } else if let Some(&f) = model.key_index.get(name.as_str()) {
                for r in 0..batch.num_rows() {
                    rows[first + r].ids[f] = arrow_ids(column, r).map_err(|m| {
                        ApiError::bad(
                            "wrong_type",
                            format!("column `{name}` row {}: {m}", first + r),
                        )
                    })?;
                }
            } else {
                return Err(ApiError::bad(
                    "unknown_feature",
                    format!(
                        "unknown column `{}` (the model takes `dense` and {:?})",
                        shown_str(name),
                        model.keys
                    ),
                ));
            }
        }
        if !has_dense && batch.num_rows() > 0 {
            return Err(ApiError::bad(
                "invalid",
                format!("no `dense` column ({} values per row)", model.num_dense),
            ));
        }
    }
    Ok(rows)
}

/// The list at row `r` of `column`, when it is a list-like column.
fn arrow_list(column: &ArrayRef, r: usize) -> Option<ArrayRef> {
    if let Some(l) = column.as_list_opt::<i32>() {
        Some(l.value(r))
    } else if let Some(l) = column.as_list_opt::<i64>() {
        Some(l.value(r))
    } else {
        column.as_fixed_size_list_opt().map(|l| l.value(r))
    }
}

/// Row `r` of a list-of-floats column.
fn arrow_floats(column: &ArrayRef, r: usize) -> std::result::Result<Vec<f32>, String> {
    if column.is_null(r) {
        return Err("null".into());
    }
    let values = arrow_list(column, r).ok_or_else(|| {
        format!(
            "expected a list of float32/float64, got {}",
            column.data_type()
        )
    })?;
    if values.null_count() > 0 {
        return Err("a null value".into());
    }
    if let Some(v) = values.as_primitive_opt::<Float32Type>() {
        Ok(v.values().to_vec())
    } else if let Some(v) = values.as_primitive_opt::<Float64Type>() {
        Ok(v.values().iter().map(|&x| x as f32).collect())
    } else {
        Err(format!(
            "expected float32/float64 values, got {}",
            values.data_type()
        ))
    }
}

/// Row `r` of an ids column (a list of int64/int32, or one int64/int32 per row).
fn arrow_ids(column: &ArrayRef, r: usize) -> std::result::Result<Vec<i64>, String> {
    if column.is_null(r) {
        return Err("null".into());
    }
    if let Some(v) = column.as_primitive_opt::<Int64Type>() {
        return Ok(vec![v.value(r)]);
    }
    if let Some(v) = column.as_primitive_opt::<Int32Type>() {
        return Ok(vec![i64::from(v.value(r))]);
    }
    let values = arrow_list(column, r).ok_or_else(|| {
        format!(
            "expected int64/int32 or a list of them, got {}",
            column.data_type()
        )
    })?;
    if values.null_count() > 0 {
        return Err("a null id".into());
    }
    if let Some(v) = values.as_primitive_opt::<Int64Type>() {
        Ok(v.values().to_vec())
    } else if let Some(v) = values.as_primitive_opt::<Int32Type>() {
        Ok(v.values().iter().map(|&x| i64::from(x)).collect())
    } else {
        Err(format!(
            "expected int64/int32 ids, got {}",
            values.data_type()
        ))
    }
}

/// The counters of the tables served from a cache (FBGEMM's cache statistics, one series per
/// table, for the current model version), in Prometheus text.
fn write_cache_stats(out: &mut String, caches: &[CacheStats]) {
    use std::fmt::Write as _;
    if caches.is_empty() {
        return;
    }
    // (name, type, help, value)
    type Series = (
        &'static str,
        &'static str,
        &'static str,
        fn(&CacheStats) -> u64,
    );
    let series: [Series; 7] = [
        (
            "embers_cache_requested_ids_total",
            "counter",
            "Ids looked up in a table's cache.",
            |s| s.requested_ids,
        ),
        (
            "embers_cache_unique_ids_total",
            "counter",
            "Distinct ids per lookup, summed.",
            |s| s.unique_ids,
        ),
        (
            "embers_cache_unique_misses_total",
            "counter",
            "Distinct ids not cached when looked up, summed.",
            |s| s.unique_misses,
        ),
        (
            "embers_cache_conflict_misses_total",
            "counter",
            "Misses served by a direct read (every way of their set locked).",
            |s| s.conflict_misses,
        ),
        (
            "embers_cache_evictions_total",
            "counter",
            "Cached rows evicted.",
            |s| s.evictions,
        ),
        (
            "embers_cache_rows_read_total",
            "counter",
            "Rows read from the row file.",
            |s| s.rows_read,
        ),
        (
            "embers_cache_slots",
            "gauge",
            "Rows a table's cache holds.",
            |s| s.slots as u64,
        ),
    ];
    // A label value with its backslashes, quotes and newlines escaped.
    let label = |s: &CacheStats| {
        (s.table.replace('\\', "\\\\"))
            .replace('"', "\\\"")
            .replace('\n', "\\n")
    };
    for (name, kind, help, value) in series {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
        for s in caches {
            let _ = writeln!(out, "{name}{{table=\"{}\"}} {}", label(s), value(s));
        }
    }
}

/// `GET /metrics`.
async fn metrics(State(server): State<Server>) -> Response {
    use std::fmt::Write as _;
    let m = &server.shared.metrics;
    let mut out = String::new();
    let counter = |out: &mut String, name: &str, help: &str| {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter");
    };
    counter(
        &mut out,
        "embers_responses_total",
        "HTTP responses by route and status code.",
    );
    for ((route, code), n) in m.responses.lock().unwrap_or_else(|p| p.into_inner()).iter() {
        let _ = writeln!(
            out,
            "embers_responses_total{{route=\"{route}\",code=\"{code}\"}} {n}"
        );
    }
    counter(&mut out, "embers_errors_total", "Error responses by kind.");
    for (kind, n) in m.errors.lock().unwrap_or_else(|p| p.into_inner()).iter() {
        let _ = writeln!(out, "embers_errors_total{{kind=\"{kind}\"}} {n}");
    }
    // A counter without labels.
    let single = |out: &mut String, name: &str, help: &str, value: &AtomicU64| {
        counter(out, name, help);
        let _ = writeln!(out, "{name} {}", value.load(Ordering::Relaxed));
    };
    single(
        &mut out,
        "embers_rows_total",
        "Rows scored (predict).",
        &m.rows,
    );
    single(
        &mut out,
        "embers_retrieval_queries_total",
        "Retrieval queries answered.",
        &m.queries,
    );
    counter(&mut out, "embers_reloads_total", "Model reloads by result.");
    let _ = writeln!(
        out,
        "embers_reloads_total{{result=\"ok\"}} {}",
        m.reloads_ok.load(Ordering::Relaxed)
    );
    let _ = writeln!(
        out,
        "embers_reloads_total{{result=\"failed\"}} {}",
        m.reloads_failed.load(Ordering::Relaxed)
    );
    let config = &server.shared.config;
    let _ = writeln!(
        out,
        "# HELP embers_requests_in_flight Predict and retrieve requests holding one of the \
         max_inflight_requests places now.\n# TYPE embers_requests_in_flight gauge\n\
         embers_requests_in_flight {}",
        (config.max_inflight_requests).saturating_sub(server.shared.inflight.available_permits())
    );
    m.latency.write(
        &mut out,
        "embers_request_duration_seconds",
        "Predict requests (errors included), arrival to answer.",
    );
    m.retrieve_latency.write(
        &mut out,
        "embers_retrieve_duration_seconds",
        "Retrieve requests (errors included), arrival to answer.",
    );
    if let Some(model) = server.current() {
        let stats = model.batcher.stats();
        let _ = writeln!(
            out,
            "# HELP embers_model_version The model version served.\n# TYPE embers_model_version gauge\nembers_model_version {}",
            model.version
        );
        let _ = writeln!(
            out,
            "# HELP embers_queue_rows Rows queued or running now.\n# TYPE embers_queue_rows gauge\nembers_queue_rows {}",
            model.batcher.queued_rows()
        );
        single(
            &mut out,
            "embers_batches_total",
            "Batches run by the current model version.",
            &stats.batches,
        );
        stats.batch_rows.write(
            &mut out,
            "embers_batch_rows",
            "Rows per batch run by the current model version.",
        );
        // Off the async threads: FP32 cached tables are read under the model's lock, which a
        // running batch holds.
        let servable = model.batcher.model().clone();
        let caches = tokio::task::spawn_blocking(move || servable.cache_stats())
            .await
            .unwrap_or_default();
        write_cache_stats(&mut out, &caches);
    }
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], out).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Without a token only loopback clients reload, IPv4 ones on an IPv6 socket included;
    /// with one, where the request comes from does not matter.
    #[test]
    fn reloads_without_a_token_come_from_loopback_only() {
        let none = HeaderMap::new();
        let at = |a: &str| Some(a.parse::<std::net::SocketAddr>().unwrap());
        for ok in ["127.0.0.1:5000", "[::1]:5000", "[::ffff:127.0.0.1]:5000"] {
            assert!(authorize_reload(None, &none, at(ok)).is_ok(), "{ok}");
        }
        for far in [
            "10.1.2.3:5000",
            "[2001:db8::1]:5000",
            "[::ffff:10.1.2.3]:5000",
        ] {
            let e = authorize_reload(None, &none, at(far)).unwrap_err();
            assert_eq!(
                (e.status, e.kind),
                (StatusCode::FORBIDDEN, "reload_forbidden")
            );
            assert!(
                e.message
                    .contains(far.rsplit_once(':').unwrap().0.trim_matches(['[', ']'])),
                "{}",
                e.message
            );
        }
        let token = ReloadToken::new("0123456789abcdef").unwrap();
        let mut carried = HeaderMap::new();
        carried.insert(
            header::AUTHORIZATION,
            HeaderValue::from_static("Bearer 0123456789abcdef"),
        );
        assert!(authorize_reload(Some(&token), &carried, at("10.1.2.3:5000")).is_ok());
        assert!(authorize_reload(Some(&token), &carried, None).is_ok());
        // The scheme in any case.
        let mut lower = HeaderMap::new();
        lower.insert(
            header::AUTHORIZATION,
            HeaderValue::from_static("bearer 0123456789abcdef"),
        );
        assert!(authorize_reload(Some(&token), &lower, None).is_ok());
        let e = authorize_reload(Some(&token), &none, at("127.0.0.1:1")).unwrap_err();
        assert_eq!((e.status, e.challenge), (StatusCode::UNAUTHORIZED, true));
        // A prefix of the token, or the token and more, is not the token.
        for near in ["Bearer 0123456789abcde", "Bearer 0123456789abcdef0"] {
            let mut h = HeaderMap::new();
            h.insert(header::AUTHORIZATION, HeaderValue::from_static(near));
            assert!(authorize_reload(Some(&token), &h, None).is_err(), "{near}");
        }
    }
}
