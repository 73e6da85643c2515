//! `embers-serve`: a trainer checkpoint behind HTTP (routes and body formats:
//! [`embers::serve::Server`]). SIGHUP (or `POST /v1/models/{name}:reload`) reloads the
//! checkpoint file; `--watch` reloads it whenever it changes; SIGINT/SIGTERM drain in-flight
//! requests and exit.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::{Duration, SystemTime};

use clap::{Parser, ValueEnum};
use embers::embedding::{CachePolicy, CacheSize, Placement, WeightType};
use embers::serve::{BatcherConfig, ReloadToken, RetrievalConfig, Server, ServerConfig};

/// Serve a trained DLRM checkpoint over HTTP with dynamic batching.
#[derive(Parser, Debug)]
#[command(name = "embers-serve", version)]
struct Args {
    /// The trainer checkpoint (e.g. `dlrm-out/checkpoint.safetensors` of the DLRM example).
    #[arg(long)]
    checkpoint: PathBuf,
    /// The model's name in the URL: `/v1/models/<name>:predict`.
    #[arg(long, default_value = "dlrm")]
    name: String,
    /// Address to listen on (port 0: any free port; the chosen one is printed).
    #[arg(long, default_value = "127.0.0.1:8080")]
    addr: SocketAddr,
    /// Serve the DLRM's tables in this format (quantized at load) instead of FP32 (the
    /// retrieval stage's query tower stays FP32 in memory).
    #[arg(long, value_enum)]
    quantize: Option<Quantize>,
    /// Serve the DLRM's tables from row files in this directory behind a DRAM cache (tables
    /// bigger than memory; FBGEMM's MANAGED_CACHING): each load's files go in a directory of
    /// its own there, removed when that model is dropped.
    #[arg(long)]
    cache_dir: Option<PathBuf>,
    /// With --cache-dir: the cache holds this fraction of each table group's rows, in (0, 1].
    #[arg(long, default_value_t = 0.2, requires = "cache_dir")]
    cache_load_factor: f64,
    /// With --cache-dir: the cache's replacement policy.
    #[arg(long, value_enum, default_value_t = Policy::Lru, requires = "cache_dir")]
    cache_policy: Policy,
    /// A batch closes at this many rows …
    #[arg(long, default_value_t = 256)]
    max_batch: usize,
    /// … or this many microseconds after its first request (at most 60 s).
    #[arg(long, default_value_t = 2000)]
    max_delay_us: u64,
    /// Rows queued or running at most; past it requests get 503 with Retry-After.
    #[arg(long, default_value_t = 8192)]
    max_queued_rows: usize,
    /// Largest request body, in bytes (413 above it).
    #[arg(long, default_value_t = 8 << 20)]
    max_body_bytes: usize,
    /// Predict requests in flight at most (each holds up to max-body-bytes); past it, 503.
    #[arg(long, default_value_t = 1024)]
    max_inflight: usize,
    /// Seconds a request's body may take to arrive (408 past it).
    #[arg(long, default_value_t = 30)]
    body_timeout_s: u64,
    /// The slowest a request's body may arrive, in bytes a second on average after its first
    /// 2 s (408 below it; 0: no floor).
    #[arg(long, default_value_t = 16 << 10)]
    min_body_rate: u64,
    /// Connections open at once (a new one past it is closed at once).
    #[arg(long, default_value_t = 4096)]
    max_connections: usize,
    /// Seconds a connection may take to send a request's headers (closed past it; so also
    /// how long an idle keep-alive connection is kept).
    #[arg(long, default_value_t = 60)]
    header_timeout_s: u64,
    /// Seconds a write of an answer may wait without progress (a client that stops reading
    /// is disconnected past it).
    #[arg(long, default_value_t = 30)]
    write_timeout_s: u64,
    /// Check the modification times of the DLRM checkpoint and of the retrieval stage's files
    /// every this many seconds and reload them all when one changes (0: never; at most a day,
    /// 86400; SIGHUP always reloads).
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u64).range(0..=86_400))]
    watch: u64,
    /// Compute threads (rayon) for the model (0: one per core).
    #[arg(long, default_value_t = 0)]
    threads: usize,
    /// A TwoTower trainer checkpoint to serve as the retrieval stage
    /// (`/v1/models/<name>:retrieve`; needs --retrieval-index).
    #[arg(long, requires = "retrieval_index")]
    retrieval_checkpoint: Option<PathBuf>,
    /// The IVF-PQ index of its candidates (`examples/two_tower --index-out`).
    #[arg(long, requires = "retrieval_checkpoint")]
    retrieval_index: Option<PathBuf>,
    /// With --retrieval-checkpoint: index lists probed per retrieval query.
    #[arg(long, default_value_t = 8, requires = "retrieval_checkpoint")]
    nprobe: usize,
    /// With --retrieval-checkpoint: the most candidates one retrieval query may ask for (at
    /// most 100000; an answer holds at most 2^20 results, queries × k).
    #[arg(long, default_value_t = 1000, requires = "retrieval_checkpoint")]
    max_k: usize,
    /// A file whose first line is the token `POST …:reload` must carry
    /// (`Authorization: Bearer <token>`; at least 16 characters), from any client. Without
    /// it, only clients on this host's loopback interface may reload over HTTP.
    #[arg(long)]
    reload_token_file: Option<PathBuf>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Quantize {
    Fp16,
    Bf16,
    Fp8,
    Int8,
    Int4,
    Int2,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Policy {
    Lru,
    Lfu,
}

impl Quantize {
    fn weight_type(self) -> WeightType {
        match self {
            Quantize::Fp16 => WeightType::Fp16,
            Quantize::Bf16 => WeightType::Bf16,
            Quantize::Fp8 => WeightType::Fp8,
            Quantize::Int8 => WeightType::Int8,
            Quantize::Int4 => WeightType::Int4,
            Quantize::Int2 => WeightType::Int2,
        }
    }
}

fn main() {
    let args = Args::parse();
    if let Err(e) = run(args) {
        eprintln!("embers-serve: {e}");
        std::process::exit(1);
    }
}

fn run(args: Args) -> Result<(), Box<dyn std::error::Error>> {
    if args.threads > 0 {
        rayon::ThreadPoolBuilder::new()
            .num_threads(args.threads)
            .build_global()?;
    }
    let config = ServerConfig {
        model_name: args.name.clone(),
        checkpoint: args.checkpoint.clone(),
        quantize: args.quantize.map(Quantize::weight_type),
        tables: match &args.cache_dir {
            None => Placement::Memory,
            Some(dir) => Placement::Cached {
                dir: dir.clone(),
                size: CacheSize::LoadFactor(args.cache_load_factor),
                policy: match args.cache_policy {
                    Policy::Lru => CachePolicy::Lru,
                    Policy::Lfu => CachePolicy::Lfu,
                },
            },
        },
        batcher: BatcherConfig {
            max_batch_rows: args.max_batch,
            max_delay: Duration::from_micros(args.max_delay_us),
            max_queued_rows: args.max_queued_rows,
        },
        max_body_bytes: args.max_body_bytes,
        max_inflight_requests: args.max_inflight,
        body_timeout: Duration::from_secs(args.body_timeout_s),
        min_body_rate: args.min_body_rate,
        max_connections: args.max_connections,
        header_timeout: Duration::from_secs(args.header_timeout_s),
        write_timeout: Duration::from_secs(args.write_timeout_s),
        retrieval: args
            .retrieval_checkpoint
            .clone()
            .zip(args.retrieval_index.clone())
            .map(|(checkpoint, index)| RetrievalConfig {
                checkpoint,
                index,
                nprobe: args.nprobe,
                max_k: args.max_k,
            }),
        reload_token: (args.reload_token_file.as_deref())
            .map(ReloadToken::from_file)
            .transpose()?,
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let served = runtime.block_on(async move {
        // Taken before the first load, which can be long: a SIGHUP meanwhile reloads once it
        // has loaded, instead of ending the process (the signal's default action).
        let hangups = hangups();
        // The watched files' stamps before the first load: a file replaced while it runs is
        // then reloaded at the first tick (stamps taken after it were taken as loaded).
        let watched: Vec<PathBuf> = [Some(&args.checkpoint), args.retrieval_checkpoint.as_ref()]
            .into_iter()
            .chain([args.retrieval_index.as_ref()])
            .flatten()
            .cloned()
            .collect();
        let baseline = stamps(&watched);
        let server = Server::start(config).await?;
        let listener = tokio::net::TcpListener::bind(args.addr).await?;
        println!(
            "embers-serve: serving `{}` (version {}) from {} on http://{}",
            args.name,
            server.version(),
            args.checkpoint.display(),
            listener.local_addr()?
        );
        tokio::spawn(reload_on_sighup(server.clone(), hangups));
        if args.watch > 0 {
            tokio::spawn(watch(server.clone(), watched, baseline, args.watch));
        }
        server.serve(listener, shutdown_signal()).await?;
        println!("embers-serve: drained, exiting");
        Ok(())
    });
    // A load still running on the blocking pool (a reload begun before the drain) is not
    // waited for without end: dropping the runtime would.
    runtime.shutdown_timeout(Duration::from_secs(10));
    served
}

/// Completes on SIGINT or SIGTERM.
async fn shutdown_signal() {
    let interrupt = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = interrupt => {}
                    _ = term.recv() => {}
                }
            }
            Err(_) => {
                let _ = interrupt.await;
            }
        }
    }
    #[cfg(not(unix))]
    let _ = interrupt.await;
    println!("embers-serve: shutting down, draining in-flight requests");
}

/// SIGHUPs from now on (`None` where there are none, or they cannot be caught).
#[cfg(unix)]
fn hangups() -> Option<tokio::signal::unix::Signal> {
    use tokio::signal::unix::{signal, SignalKind};
    signal(SignalKind::hangup()).ok()
}

#[cfg(not(unix))]
fn hangups() -> Option<()> {
    None
}

/// Reloads the checkpoint on every SIGHUP.
#[cfg(unix)]
async fn reload_on_sighup(server: Server, hangups: Option<tokio::signal::unix::Signal>) {
    let Some(mut hup) = hangups else {
        return;
    };
    while hup.recv().await.is_some() {
        report(server.reload().await);
    }
}

#[cfg(not(unix))]
async fn reload_on_sighup(_server: Server, _hangups: Option<()>) {}

/// Each watched file's modification time and length (`None` if one cannot be read).
type Stamps = Option<Vec<(SystemTime, u64)>>;

/// Each file's modification time and length (`None` if one cannot be read).
fn stamps(paths: &[PathBuf]) -> Stamps {
    (paths.iter())
        .map(|p| {
            let m = std::fs::metadata(p).ok()?;
            Some((m.modified().ok()?, m.len()))
        })
        .collect()
}

/// The most ticks a watch waits before trying files that failed to load again, unchanged.
const MAX_RETRY_TICKS: u32 = 64;

/// Reloads the served files whenever one's modification time or length changes from `last`
/// (those of the files the server loaded first; a file caught half written and completed
/// within the clock's tick changes length); the retrieval stage's checkpoint and index are
/// watched with the DLRM's (a retrained tower or index alone was never picked up). Files that
/// fail to load are tried again once they change, or unchanged after a wait that doubles from
/// one tick to [`MAX_RETRY_TICKS`] (a full disk clears; a bad file is not loaded back to back
/// for ever).
async fn watch(server: Server, paths: Vec<PathBuf>, mut last: Stamps, every: u64) {
    let mut tick = tokio::time::interval(Duration::from_secs(every));
    // A long load must not be followed by the ticks it missed, at once.
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // The stamps that failed, the ticks to wait before trying them again, and the ticks left.
    let mut failed: Option<(Stamps, u32, u32)> = None;
    loop {
        tick.tick().await;
        let now = stamps(&paths);
        if now.is_none() || now == last {
            continue;
        }
        if let Some((stamp, _, left)) = failed.as_mut() {
            if *stamp == now && *left > 0 {
                *left -= 1;
                continue;
            }
        }
        if report(server.reload().await) {
            last = now;
            failed = None;
        } else {
            let wait = match &failed {
                Some((stamp, wait, _)) if *stamp == now => (wait * 2).min(MAX_RETRY_TICKS),
                _ => 1,
            };
            failed = Some((now, wait, wait));
        }
    }
}

/// Prints a reload's outcome; whether it loaded.
fn report(result: embers::Result<u64>) -> bool {
    match &result {
        Ok(v) => println!("embers-serve: reloaded, now serving version {v}"),
        Err(e) => eprintln!("embers-serve: reload refused, the old model keeps serving: {e}"),
    }
    result.is_ok()
}
