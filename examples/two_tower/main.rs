//! Trains a TwoTower retrieval model and measures retrieval as the field does.
//!
//! `cargo run --release --example two_tower` trains on MovieLens-100K (fetch it once with
//! `datasets/scripts/movielens-100k.sh`; `--data synthetic` uses planted user/item factors
//! instead) with a time-based split — every user's earliest 80% of interactions train, the
//! rest are held out — then embeds the whole catalogue, searches it exactly and through an
//! IVF-PQ index, and reports Recall@10/50/100 and NDCG@10 over the full item set (each user's
//! training items excluded), next to a popularity baseline. With `--rerank` a DLRM trained on
//! the same interactions re-ranks the top 100 (the two-stage pipeline). Writes to `--out`
//! (default `two-tower-out/`): `checkpoint.safetensors` (atomic, every epoch), the catalogue's
//! IVF-PQ index `items.ivfpq` (the two serve as `embers-serve`'s retrieval stage),
//! `metrics.json` and `curves.png`. `--resume <checkpoint>` continues a run after its last
//! epoch, as if it had not stopped. `--help` lists the flags.

// Loss sums kept in checkpoints as their bits.
#[path = "../shared/bits.rs"]
mod bits;
mod plot;

use bits::{bits_of_f64, f64_of_bits};

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use clap::{Parser, ValueEnum};
use embers::embedding::FusedOptimizer;
use embers::retrieval::{FlatIndex, IvfPqConfig, IvfPqIndex, Metric, Search};
use embers::sparse::KeyedJaggedTensor;
use embers::train::{
    Batch, DenseOptimizer, DlrmConfig, PairBatch, TwoTowerConfig, TwoTowerLoss, TwoTowerTrainer,
};
use embers::{Device, Error, Result, Tensor};
use embers_datasets::{ExampleSource, MovieLensConfig, MovieLensFormat, MovieLensReader};
use indicatif::{ProgressBar, ProgressStyle};
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rand_distr::StandardNormal;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum DataKind {
    /// MovieLens-100K (RecBole's atomic files, from datasets/scripts/movielens-100k.sh).
    Movielens,
    /// Planted user and item factors (no files needed).
    Synthetic,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum LossKind {
    /// In-batch sampled softmax (+ random negatives), log-Q corrected.
    Softmax,
    /// Pointwise BCE with one random negative per positive (TorchRec's example).
    Pointwise,
}

/// Train a TwoTower retrieval model and evaluate exact and IVF-PQ retrieval.
#[derive(Parser, Debug)]
#[command(version)]
struct Args {
    /// The data.
    #[arg(long, value_enum, default_value_t = DataKind::Movielens)]
    data: DataKind,
    /// Folder with ml-100k.inter and ml-100k.item (default: $EMBERS_DATA_CACHE/ml-100k, else
    /// ~/.cache/embers-data/ml-100k, where datasets/scripts/movielens-100k.sh puts them).
    #[arg(long)]
    path: Option<PathBuf>,
    /// Passes over the training interactions.
    #[arg(long, default_value_t = 15)]
    epochs: usize,
    /// Positive pairs per batch (the in-batch negatives).
    #[arg(long, default_value_t = 256)]
    batch_size: usize,
    /// Embedding dimension of the tables.
    #[arg(long, default_value_t = 64)]
    embedding_dim: usize,
    /// MLP widths of each tower (the last is the retrieval embedding's width).
    #[arg(long, value_delimiter = ',', default_value = "128,64")]
    layers: Vec<usize>,
    /// Softmax temperature (the towers' outputs are L2-normalised).
    #[arg(long, default_value_t = 0.05)]
    temperature: f64,
    /// The loss.
    #[arg(long, value_enum, default_value_t = LossKind::Softmax)]
    loss: LossKind,
    /// Uniform random negatives per batch mixed into the softmax.
    #[arg(long, default_value_t = DEFAULT_RANDOM_NEGATIVES)]
    random_negatives: usize,
    /// Train without the log-Q correction.
    #[arg(long)]
    no_log_q: bool,
    /// Learning rate of the tables (row-wise Adagrad, fused).
    #[arg(long, default_value_t = 0.05)]
    sparse_lr: f64,
    /// Learning rate of the MLPs (Adam).
    #[arg(long, default_value_t = 0.001)]
    dense_lr: f64,
    /// Share of each user's interactions (the latest) held out.
    #[arg(long, default_value_t = 0.2)]
    test_fraction: f64,
    /// IVF-PQ inverted lists.
    #[arg(long, default_value_t = 16)]
    nlist: usize,
    /// IVF-PQ sub-quantizers (bytes per item).
    #[arg(long, default_value_t = 16)]
    pq_m: usize,
    /// IVF-PQ lists scanned per query.
    #[arg(long, default_value_t = 4)]
    nprobe: usize,
    /// Re-rank the top 100 with a DLRM trained on the same interactions (two-stage).
    #[arg(long)]
    rerank: bool,
    /// With --rerank: passes of the re-ranking DLRM over its training pairs.
    #[arg(long, default_value_t = 3, requires = "rerank")]
    rerank_epochs: usize,
    /// With --rerank: of the re-ranker's 4 negatives per training interaction, how many are
    /// drawn from the user's retrieved top 100 (hard negatives: items the retriever ranks high
    /// that the user did not interact with in the training period) instead of uniformly from
    /// unseen items (3: the best of 0–4 on MovieLens-100K's held-out set; there is no separate
    /// validation split to choose it on).
    #[arg(long, default_value_t = 3, requires = "rerank")]
    rerank_hard_negatives: usize,
    /// cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu")]
    device: Device,
    /// Seed of everything random.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Output folder.
    #[arg(long, default_value = "two-tower-out")]
    out: PathBuf,
    /// No progress bar.
    #[arg(long)]
    no_progress: bool,
    /// Continue the run that wrote this checkpoint (this example's `checkpoint.safetensors`)
    /// after its last epoch, up to --epochs, with the flags it ran with (the model's and the
    /// data's are checked): the tables, history and outputs equal an uninterrupted run's.
    #[arg(long)]
    resume: Option<PathBuf>,
}

/// Where a run stands after an epoch, kept in its checkpoint's user metadata.
struct Progress {
    epoch: usize,
    /// Each epoch's `metrics.json` history entry.
    history: Vec<serde_json::Value>,
    /// The loss curve's points, and the losses summed since its last one.
    loss_points: Vec<(f64, f64)>,
    loss_sum: f64,
    loss_n: usize,
    train_seconds: f64,
}

/// The flags that choose the data and its batches, recorded in every checkpoint (`run.*`)
/// and checked on `--resume` (the model's flags are in its configuration, which the load
/// checks).
fn run_flags(args: &Args, data: &Data) -> Vec<(&'static str, String)> {
    vec![
        ("--data", data.name.clone()),
        ("interactions", data.interactions.len().to_string()),
        ("--test-fraction", args.test_fraction.to_string()),
        ("--batch-size", args.batch_size.to_string()),
    ]
}

impl Progress {
    /// The checkpoint metadata of this progress (and the run's flags).
    fn to_meta(&self, flags: &[(&'static str, String)]) -> BTreeMap<String, String> {
        let mut meta = BTreeMap::from([
            ("epoch".to_string(), self.epoch.to_string()),
            (
                "history".to_string(),
                serde_json::to_string(&self.history).expect("JSON of JSON values"),
            ),
            (
                "loss_points".to_string(),
                serde_json::json!(self.loss_points).to_string(),
            ),
            ("loss_sum".to_string(), bits_of_f64(self.loss_sum)),
            ("loss_n".to_string(), self.loss_n.to_string()),
            ("train_seconds".to_string(), self.train_seconds.to_string()),
        ]);
        for (flag, value) in flags {
            meta.insert(format!("run.{flag}"), value.clone());
        }
        meta
    }

    /// Read back from a checkpoint's metadata, checked against this run's flags.
    fn from_meta(
        meta: &BTreeMap<String, String>,
        flags: &[(&'static str, String)],
        path: &Path,
    ) -> Result<Progress> {
        let bad = |what: String| {
            Error::invalid("two_tower", format!("--resume {}: {what}", path.display()))
        };
        for (flag, mine) in flags {
            let theirs = meta.get(&format!("run.{flag}")).ok_or_else(|| {
                bad(format!(
                    "no `run.{flag}` metadata (not a checkpoint of this example)"
                ))
            })?;
            if theirs != mine {
                return Err(bad(format!(
                    "its run had {flag} {theirs}, this run has {mine}: resume with the data \
                     and flags of the run it continues"
                )));
            }
        }
        let get = |key: &str| {
            meta.get(key).ok_or_else(|| {
                bad(format!(
                    "no `{key}` metadata (not a checkpoint of this example)"
                ))
            })
        };
        let parsed = |key: &str| -> Result<serde_json::Value> {
            serde_json::from_str(get(key)?).map_err(|e| bad(format!("`{key}` metadata: {e}")))
        };
        let history = match parsed("history")? {
            serde_json::Value::Array(h) => h,
            _ => return Err(bad("`history` metadata is not a list".into())),
        };
        let loss_points: Vec<(f64, f64)> = serde_json::from_value(parsed("loss_points")?)
            .map_err(|e| bad(format!("`loss_points` metadata: {e}")))?;
        let number = |key: &str| -> Result<usize> {
            get(key)?
                .parse()
                .map_err(|_| bad(format!("`{key}` metadata is not a count")))
        };
        let loss_sum = f64_of_bits(get("loss_sum")?)
            .ok_or_else(|| bad("`loss_sum` metadata is not a finite f64's bits".into()))?;
        let train_seconds = (get("train_seconds")?.parse::<f64>().ok())
            .filter(|v| v.is_finite() && *v >= 0.0)
            .ok_or_else(|| bad("`train_seconds` metadata is not a duration".into()))?;
        let epoch = number("epoch")?;
        if history.len() != epoch {
            return Err(bad(format!(
                "its history holds {} epochs, its `epoch` says {epoch}",
                history.len()
            )));
        }
        Ok(Progress {
            epoch,
            history,
            loss_points,
            loss_sum,
            loss_n: number("loss_n")?,
            train_seconds,
        })
    }

    /// Recall@10/50/100 by epoch, from the history.
    fn recall(&self) -> Result<[Vec<(f64, f64)>; 3]> {
        let mut recall: [Vec<(f64, f64)>; 3] = Default::default();
        for (e, h) in self.history.iter().enumerate() {
            for (c, k) in recall
                .iter_mut()
                .zip(["recall_at_10", "recall_at_50", "recall_at_100"])
            {
                let v = h["exact"][k].as_f64().ok_or_else(|| {
                    Error::invalid(
                        "two_tower",
                        format!("--resume: epoch {} of its history has no {k}", e + 1),
                    )
                })?;
                c.push(((e + 1) as f64, v));
            }
        }
        Ok(recall)
    }
}

/// `--random-negatives`' default.
const DEFAULT_RANDOM_NEGATIVES: usize = 256;

/// Interactions in time order per user, and the items' genres.
struct Data {
    name: String,
    users: usize,
    items: usize,
    /// Genre ids of each item (0-based item ids).
    genres: Arc<Vec<Vec<i64>>>,
    genre_count: usize,
    /// (user, item, time), 0-based ids.
    interactions: Vec<(usize, usize, f64)>,
}

fn movielens(args: &Args) -> Result<Data> {
    let dir = match &args.path {
        Some(p) => p.clone(),
        None => std::env::var_os("EMBERS_DATA_CACHE")
            .map(PathBuf::from)
            .or_else(|| {
                std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/embers-data"))
            })
            .unwrap_or_default()
            .join("ml-100k"),
    };
    let inter = dir.join("ml-100k.inter");
    if !inter.is_file() {
        return Err(Error::invalid(
            "two_tower",
            format!(
                "no MovieLens-100K at {} (fetch it with datasets/scripts/movielens-100k.sh, give \
                 --path, or run --data synthetic)",
                inter.display()
            ),
        ));
    }
    let mut config = MovieLensConfig::new(MovieLensFormat::RecBoleInter, &inter);
    config.items_path = Some(dir.join("ml-100k.item"));
    let mut reader = MovieLensReader::open(config)?;
    let keys = reader.schema().sparse_keys.clone();
    let pos = |k: &str| keys.iter().position(|x| x == k);
    let (Some(u), Some(i), Some(g)) = (pos("user_id"), pos("item_id"), pos("genres")) else {
        return Err(Error::invalid(
            "two_tower",
            format!("unexpected MovieLens features {keys:?}"),
        ));
    };
    let mut raw = Vec::new();
    let mut item_genres: HashMap<i64, Vec<i64>> = HashMap::new();
    while let Some(example) = reader.next() {
        let example = example?;
        let t = reader.last_timestamp().unwrap_or(example.index as f64);
        let mut at = 0usize;
        let mut feature = Vec::new();
        for &len in &example.lengths {
            feature.push(example.ids[at..at + len as usize].to_vec());
            at += len as usize;
        }
        let (user, item) = (feature[u][0], feature[i][0]);
        item_genres
            .entry(item)
            .or_insert_with(|| feature[g].clone());
        raw.push((user, item, t));
    }
    // Dense 0-based ids in order of first appearance of the sorted raw ids.
    let mut user_ids: Vec<i64> = raw.iter().map(|r| r.0).collect();
    let mut item_ids: Vec<i64> = raw.iter().map(|r| r.1).collect();
    for v in [&mut user_ids, &mut item_ids] {
        v.sort_unstable();
        v.dedup();
    }
    let user_of: HashMap<i64, usize> = user_ids.iter().enumerate().map(|(i, &u)| (u, i)).collect();
    let item_of: HashMap<i64, usize> = item_ids.iter().enumerate().map(|(i, &u)| (u, i)).collect();
    let genres: Vec<Vec<i64>> = item_ids.iter().map(|id| item_genres[id].clone()).collect();
    Ok(Data {
        name: format!("MovieLens-100K ({})", dir.display()),
        users: user_ids.len(),
        items: item_ids.len(),
        genre_count: embers_datasets::MOVIELENS_GENRES.len(),
        genres: Arc::new(genres),
        interactions: raw
            .into_iter()
            .map(|(u, i, t)| (user_of[&u], item_of[&i], t))
            .collect(),
    })
}

/// Users pick items from a softmax over planted factors and popularities; 4 genres per item
/// derived from its factors; time is the order of the draws.
fn synthetic(seed: u64) -> Data {
    let (users, items, k, per_user, genre_count) = (300usize, 1000usize, 8usize, 80usize, 16usize);
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut gauss = |n: usize, s: f32| -> Vec<f32> {
        (0..n)
            .map(|_| rng.sample::<f32, _>(StandardNormal) * s)
            .collect()
    };
    let (uf, itf, pop) = (
        gauss(users * k, 1.0),
        gauss(items * k, 1.0),
        gauss(items, 0.5),
    );
    let genres: Vec<Vec<i64>> = (0..items)
        .map(|i| {
            let f = &itf[i * k..(i + 1) * k];
            let mut g: Vec<i64> = (0..k as i64)
                .map(|j| if f[j as usize] > 0.0 { j } else { j + k as i64 })
                .take(4)
                .collect();
            g.sort_unstable();
            g
        })
        .collect();
    let mut interactions = Vec::with_capacity(users * per_user);
    let mut t = 0.0;
    for _ in 0..per_user {
        for u in 0..users {
            let w: Vec<f64> = (0..items)
                .map(|i| {
                    let s: f32 = (0..k).map(|j| uf[u * k + j] * itf[i * k + j]).sum();
                    f64::from(s + pop[i]).exp()
                })
                .collect();
            let mut x = rng.random::<f64>() * w.iter().sum::<f64>();
            let item = w.iter().position(|&wi| {
                x -= wi;
                x < 0.0
            });
            interactions.push((u, item.unwrap_or(items - 1), t));
            t += 1.0;
        }
    }
    Data {
        name: "synthetic planted factors".into(),
        users,
        items,
        genres: Arc::new(genres),
        genre_count,
        interactions,
    }
}

/// The time split: each user's interactions in time order, the latest `fraction` held out.
struct Split {
    train: Vec<(usize, usize)>,
    /// Held-out items per user (users without any are absent).
    test: BTreeMap<usize, Vec<usize>>,
    /// Training items per user (excluded from that user's retrieval).
    seen: Vec<HashSet<usize>>,
}

fn split(data: &Data, fraction: f64) -> Split {
    let mut per_user: Vec<Vec<(f64, usize)>> = vec![Vec::new(); data.users];
    for &(u, i, t) in &data.interactions {
        per_user[u].push((t, i));
    }
    let mut train = Vec::new();
    let mut test = BTreeMap::new();
    let mut seen = vec![HashSet::new(); data.users];
    for (u, mut list) in per_user.into_iter().enumerate() {
        list.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
        let held =
            ((list.len() as f64 * fraction).round() as usize).min(list.len().saturating_sub(1));
        let cut = list.len() - held;
        for &(_, i) in &list[..cut] {
            train.push((u, i));
            seen[u].insert(i);
        }
        // Items seen in training are not targets (they are excluded from the ranking).
        let later: Vec<usize> = {
            let mut v: Vec<usize> = list[cut..]
                .iter()
                .map(|&(_, i)| i)
                .filter(|i| !seen[u].contains(i))
                .collect();
            v.sort_unstable();
            v.dedup();
            v
        };
        if !later.is_empty() {
            test.insert(u, later);
        }
    }
    Split { train, test, seen }
}

/// The candidate tower's features of `items`: `item` (one-hot) and `genre` (multi-hot).
fn item_features(items: &[i64], genres: &[Vec<i64>]) -> Result<KeyedJaggedTensor> {
    let mut values: Vec<i64> = items.to_vec();
    let mut lengths: Vec<i32> = vec![1; items.len()];
    for &i in items {
        let g = genres.get(i as usize).ok_or_else(|| {
            Error::invalid("two_tower", format!("item {i} is not in the catalogue"))
        })?;
        values.extend_from_slice(g);
        lengths.push(g.len() as i32);
    }
    let (nv, nl) = (values.len(), lengths.len());
    KeyedJaggedTensor::from_lengths(
        vec!["item".into(), "genre".into()],
        Tensor::from_vec(values, &[nv])?,
        Tensor::from_vec(lengths, &[nl])?,
        None,
        Some(items.len()),
    )
}

/// Retrieval quality over the held-out users.
#[derive(Clone, Copy, Debug, Default, serde::Serialize)]
struct Quality {
    recall_at_10: f64,
    recall_at_50: f64,
    recall_at_100: f64,
    ndcg_at_10: f64,
}

impl std::fmt::Display for Quality {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Recall@10 {:.4}  Recall@50 {:.4}  Recall@100 {:.4}  NDCG@10 {:.4}",
            self.recall_at_10, self.recall_at_50, self.recall_at_100, self.ndcg_at_10
        )
    }
}

/// Quality of per-user rankings (`ranked[u]`: item ids best first, seen items already out).
fn quality(split: &Split, ranked: &HashMap<usize, Vec<usize>>) -> Quality {
    let mut q = Quality::default();
    for (u, truth) in &split.test {
        let list = &ranked[u];
        let truth: HashSet<usize> = truth.iter().copied().collect();
        let hits = |k: usize| list.iter().take(k).filter(|i| truth.contains(i)).count() as f64;
        q.recall_at_10 += hits(10) / truth.len() as f64;
        q.recall_at_50 += hits(50) / truth.len() as f64;
        q.recall_at_100 += hits(100) / truth.len() as f64;
        let dcg: f64 = (list.iter().take(10).enumerate())
            .filter(|(_, i)| truth.contains(i))
            .map(|(r, _)| 1.0 / (r as f64 + 2.0).log2())
            .sum();
        let ideal: f64 = (0..truth.len().min(10))
            .map(|r| 1.0 / (r as f64 + 2.0).log2())
            .sum();
        q.ndcg_at_10 += dcg / ideal;
    }
    let n = split.test.len().max(1) as f64;
    q.recall_at_10 /= n;
    q.recall_at_50 /= n;
    q.recall_at_100 /= n;
    q.ndcg_at_10 /= n;
    q
}

/// Every test user's top 100 unseen items through `index`.
fn retrieve(
    trainer: &TwoTowerTrainer,
    split: &Split,
    index: &impl Search,
    items: usize,
) -> Result<HashMap<usize, Vec<usize>>> {
    let users: Vec<usize> = split.test.keys().copied().collect();
    let max_seen = users
        .iter()
        .map(|&u| split.seen[u].len())
        .max()
        .unwrap_or(0);
    let k = (100 + max_seen).min(items);
    let ids: Vec<i64> = users.iter().map(|&u| u as i64).collect();
    let found = trainer
        .model()
        .retrieve(&KeyedJaggedTensor::one_hot("user", &ids)?, index, k)?;
    Ok(users
        .iter()
        .enumerate()
        .map(|(row, &u)| {
            let list: Vec<usize> = (found.ids_of(row).iter())
                .filter(|&&id| id >= 0 && !split.seen[u].contains(&(id as usize)))
                .map(|&id| id as usize)
                .take(100)
                .collect();
            (u, list)
        })
        .collect())
}

/// The catalogue's embeddings `[items × D]`.
fn catalogue(trainer: &TwoTowerTrainer, data: &Data) -> Result<Vec<f32>> {
    let ids: Vec<i64> = (0..data.items as i64).collect();
    trainer
        .model()
        .embed_catalogue(&item_features(&ids, &data.genres)?)
}

/// The model now: the catalogue's embeddings, every test user's top 100 through exact search,
/// their quality and the search's time in seconds.
struct Evaluation {
    catalogue: Vec<f32>,
    lists: HashMap<usize, Vec<usize>>,
    quality: Quality,
    search_seconds: f64,
}

fn evaluate(
    trainer: &TwoTowerTrainer,
    data: &Data,
    split: &Split,
    device: Device,
) -> Result<Evaluation> {
    let catalogue = catalogue(trainer, data)?;
    let dim = catalogue.len() / data.items;
    let mut index = FlatIndex::new(dim, Metric::InnerProduct)?;
    index.add(&(0..data.items as i64).collect::<Vec<_>>(), &catalogue)?;
    let index = index.to_device(device)?;
    let t = Instant::now();
    let lists = retrieve(trainer, split, &index, data.items)?;
    let search_seconds = t.elapsed().as_secs_f64();
    Ok(Evaluation {
        quality: quality(split, &lists),
        catalogue,
        lists,
        search_seconds,
    })
}

/// Ranks by training popularity, seen items excluded.
fn popularity(split: &Split, items: usize) -> HashMap<usize, Vec<usize>> {
    let mut count = vec![0usize; items];
    for &(_, i) in &split.train {
        count[i] += 1;
    }
    let mut order: Vec<usize> = (0..items).collect();
    order.sort_by(|&a, &b| count[b].cmp(&count[a]).then(a.cmp(&b)));
    (split.test.keys())
        .map(|&u| {
            let list = (order.iter())
                .filter(|i| !split.seen[u].contains(i))
                .take(100)
                .copied()
                .collect();
            (u, list)
        })
        .collect()
}

/// The retriever's score of a (user, item) pair, ⟨query, candidate⟩: the re-ranker's one dense
/// feature, so it starts from what retrieval knows and learns what to add.
struct Scores<'a> {
    users: Vec<f32>,
    items: &'a [f32],
    dim: usize,
}

impl<'a> Scores<'a> {
    fn new(trainer: &TwoTowerTrainer, users: usize, catalogue: &'a [f32]) -> Result<Self> {
        let ids: Vec<i64> = (0..users as i64).collect();
        let q = trainer
            .model()
            .embed_queries(&KeyedJaggedTensor::one_hot("user", &ids)?)?
            .to_vec::<f32>()?;
        Ok(Scores {
            dim: q.len() / users,
            users: q,
            items: catalogue,
        })
    }

    fn of(&self, u: usize, i: usize) -> f32 {
        let d = self.dim;
        (self.users[u * d..(u + 1) * d].iter())
            .zip(&self.items[i * d..(i + 1) * d])
            .map(|(a, b)| a * b)
            .sum()
    }
}

/// The DLRM batch of (user, item) pairs with labels; the dense feature is the retriever's score.
fn dlrm_batch(
    pairs: &[(usize, usize, f32)],
    genres: &[Vec<i64>],
    scores: &Scores<'_>,
) -> Result<Batch> {
    let b = pairs.len();
    let users: Vec<i64> = pairs.iter().map(|p| p.0 as i64).collect();
    let items: Vec<i64> = pairs.iter().map(|p| p.1 as i64).collect();
    let features = item_features(&items, genres)?;
    // Keys user, item, genre: prepend the users' one-hot block.
    let mut values = users.clone();
    values.extend(features.values().to_vec::<i64>()?);
    let mut lengths = vec![1i32; b];
    lengths.extend(features.lengths().to_vec::<i32>()?);
    let (nv, nl) = (values.len(), lengths.len());
    let sparse = KeyedJaggedTensor::from_lengths(
        vec!["user".into(), "item".into(), "genre".into()],
        Tensor::from_vec(values, &[nv])?,
        Tensor::from_vec(lengths, &[nl])?,
        None,
        Some(b),
    )?;
    let labels: Vec<f32> = pairs.iter().map(|p| p.2).collect();
    let dense: Vec<f32> = pairs.iter().map(|p| scores.of(p.0, p.1)).collect();
    Batch::new(
        Tensor::from_vec(dense, &[b, 1])?,
        sparse,
        Tensor::from_vec(labels, &[b, 1])?,
    )
}

/// Trains a DLRM on the training interactions (label 1) and 4 unseen items per interaction
/// (label 0: `--rerank-hard-negatives` of them from the user's retrieved 100, the rest uniform),
/// then re-orders each user's retrieved 100 by its click probability.
fn rerank(
    args: &Args,
    data: &Data,
    split: &Split,
    retrieved: &HashMap<usize, Vec<usize>>,
    scores: &Scores<'_>,
) -> Result<(HashMap<usize, Vec<usize>>, f64)> {
    let config = DlrmConfig {
        num_dense: 1,
        sparse_features: vec![
            ("user".into(), data.users),
            ("item".into(), data.items),
            ("genre".into(), data.genre_count),
        ],
        embedding_dim: 16,
        dense_arch: vec![16],
        over_arch: vec![64, 32],
        tasks: vec!["click".into()],
        dcn: None,
        dense_optimizer: DenseOptimizer::Adam { lr: 1e-3 },
        sparse_optimizer: FusedOptimizer::RowWiseAdagrad {
            lr: 0.05,
            eps: 1e-8,
        },
        seed: args.seed,
        metrics_window: 10_000,
        device: args.device,
    };
    let mut trainer = config.build()?;
    let mut rng = ChaCha8Rng::seed_from_u64(args.seed ^ 0xD1);
    let started = Instant::now();
    let mut auc = 0.0;
    // Users who have seen every item have no negative to draw (the draw looped for ever).
    let (mut no_negatives, mut pair_count) = (0usize, 0usize);
    for _ in 0..args.rerank_epochs {
        let mut pairs: Vec<(usize, usize, f32)> = Vec::with_capacity(split.train.len() * 5);
        for &(u, i) in &split.train {
            pairs.push((u, i, 1.0));
            if split.seen[u].len() >= data.items {
                no_negatives += 1;
                continue;
            }
            // The retrieved lists exclude each user's training items already.
            let hard = retrieved.get(&u).filter(|l| !l.is_empty());
            for n in 0..4 {
                let neg = match hard {
                    Some(list) if n < args.rerank_hard_negatives => {
                        list[rng.random_range(0..list.len())]
                    }
                    _ => loop {
                        let j = rng.random_range(0..data.items);
                        if !split.seen[u].contains(&j) {
                            break j;
                        }
                    },
                };
                pairs.push((u, neg, 0.0));
            }
        }
        pairs.shuffle(&mut rng);
        pair_count = pairs.len();
        for chunk in pairs.chunks(512) {
            trainer.train_step(&dlrm_batch(chunk, &data.genres, scores)?)?;
        }
        auc = trainer
            .train_metrics()
            .get("auc")
            .copied()
            .unwrap_or(f64::NAN);
    }
    println!(
        "re-ranking DLRM: {} epochs over {} pairs in {:.1} s, training AUC {auc:.4}{}",
        args.rerank_epochs,
        pair_count,
        started.elapsed().as_secs_f64(),
        match no_negatives / args.rerank_epochs.max(1) {
            0 => String::new(),
            n => format!(" ({n} interactions of users who have seen every item: no negatives)"),
        }
    );
    let mut out = HashMap::new();
    for (&u, list) in retrieved {
        let pairs: Vec<(usize, usize, f32)> = list.iter().map(|&i| (u, i, 0.0)).collect();
        let probs = trainer.predict(&dlrm_batch(&pairs, &data.genres, scores)?, None)?;
        let mut order: Vec<usize> = (0..list.len()).collect();
        order.sort_by(|&a, &b| probs[b].total_cmp(&probs[a]).then(a.cmp(&b)));
        out.insert(u, order.into_iter().map(|r| list[r]).collect());
    }
    Ok((out, auc))
}

fn run(args: Args) -> Result<()> {
    // Flags the chosen data or loss would ignore, refused rather than ignored.
    if args.path.is_some() && args.data == DataKind::Synthetic {
        return Err(Error::invalid(
            "two_tower",
            "--path names MovieLens files, and --data synthetic reads none",
        ));
    }
    if args.loss == LossKind::Pointwise
        && (args.no_log_q || args.random_negatives != DEFAULT_RANDOM_NEGATIVES)
    {
        return Err(Error::invalid(
            "two_tower",
            "--no-log-q and --random-negatives shape the softmax loss; --loss pointwise \
             draws one random negative per positive and has no log-Q correction",
        ));
    }
    let data = match args.data {
        DataKind::Movielens => movielens(&args)?,
        DataKind::Synthetic => synthetic(args.seed),
    };
    if !(0.0..1.0).contains(&args.test_fraction) || args.batch_size < 2 {
        return Err(Error::invalid(
            "two_tower",
            "--test-fraction must be in [0, 1) and --batch-size at least 2",
        ));
    }
    // No pass trains nothing, writes no checkpoint and reports 0/0 pairs a second.
    if args.epochs == 0 || (args.rerank && args.rerank_epochs == 0) {
        return Err(Error::invalid(
            "two_tower",
            "--epochs (and, with --rerank, --rerank-epochs) must be at least 1",
        ));
    }
    if args.rerank_hard_negatives > 4 {
        return Err(Error::invalid(
            "two_tower",
            format!(
                "--rerank-hard-negatives {}: at most 4 (the re-ranker's negatives per interaction)",
                args.rerank_hard_negatives
            ),
        ));
    }
    // The index's flags, checked before the training whose model they index.
    let ivf_config = IvfPqConfig {
        seed: args.seed,
        ..IvfPqConfig::new(args.nlist, args.pq_m, Metric::InnerProduct)
    };
    let width = args.layers.last().copied().unwrap_or(0);
    (ivf_config.check(width, data.items)).map_err(|e| {
        Error::invalid(
            "two_tower",
            format!("--nlist {} --pq-m {}: {e}", args.nlist, args.pq_m),
        )
    })?;
    if args.nprobe == 0 || args.nprobe > args.nlist {
        return Err(Error::invalid(
            "two_tower",
            format!(
                "--nprobe {}: must be 1..={} (--nlist)",
                args.nprobe, args.nlist
            ),
        ));
    }
    let split = split(&data, args.test_fraction);
    // The evaluation asks each user for 100 items past those it has seen: on a GPU, at most
    // MAX_GPU_K in all (it failed after the first epoch).
    let max_seen = split
        .test
        .keys()
        .map(|&u| split.seen[u].len())
        .max()
        .unwrap_or(0);
    let k = (100 + max_seen).min(data.items);
    if args.device != Device::Cpu && k > embers::retrieval::MAX_GPU_K {
        return Err(Error::invalid(
            "two_tower",
            format!(
                "a held-out user has seen {max_seen} items: the evaluation's search for 100 \
                 more asks for {k}, past the GPU's {} (use --device cpu)",
                embers::retrieval::MAX_GPU_K
            ),
        ));
    }
    println!(
        "{}: {} users, {} items, {} interactions; time split: {} train, {} held-out items over {} users",
        data.name,
        data.users,
        data.items,
        data.interactions.len(),
        split.train.len(),
        split.test.values().map(Vec::len).sum::<usize>(),
        split.test.len()
    );
    std::fs::create_dir_all(&args.out).map_err(|source| Error::Io {
        path: args.out.display().to_string(),
        source,
    })?;
    let loss = match args.loss {
        LossKind::Softmax => TwoTowerLoss::Softmax {
            log_q: !args.no_log_q,
            random_negatives: args.random_negatives,
        },
        LossKind::Pointwise => TwoTowerLoss::Pointwise,
    };
    let config = TwoTowerConfig {
        query_features: vec![("user".into(), data.users)],
        candidate_features: vec![
            ("item".into(), data.items),
            ("genre".into(), data.genre_count),
        ],
        embedding_dim: args.embedding_dim,
        layers: args.layers.clone(),
        normalize: true,
        temperature: args.temperature,
        loss,
        estimator_buckets: (4 * data.items).next_power_of_two(),
        estimator_alpha: 0.05,
        sparse_optimizer: FusedOptimizer::RowWiseAdagrad {
            lr: args.sparse_lr as f32,
            eps: 1e-8,
        },
        dense_optimizer: DenseOptimizer::Adam { lr: args.dense_lr },
        seed: args.seed,
        device: args.device,
    };
    let genres = data.genres.clone();
    let mut trainer = config
        .build()?
        .with_negative_sampler(data.items, Box::new(move |ids| item_features(ids, &genres)))?;
    let flags = run_flags(&args, &data);
    let mut progress = Progress {
        epoch: 0,
        history: Vec::new(),
        loss_points: Vec::new(),
        loss_sum: 0.0,
        loss_n: 0,
        train_seconds: 0.0,
    };
    if let Some(path) = &args.resume {
        let meta = trainer.load_checkpoint(path)?;
        progress = Progress::from_meta(&meta, &flags, path)?;
        if progress.epoch >= args.epochs {
            return Err(Error::invalid(
                "two_tower",
                format!(
                    "--resume {}: its run trained {} epochs, and --epochs {} asks for no more",
                    path.display(),
                    progress.epoch,
                    args.epochs
                ),
            ));
        }
        println!(
            "resumed from {} after epoch {} (step {})",
            path.display(),
            progress.epoch,
            trainer.step()
        );
    }
    let steps_per_epoch = split.train.len().div_ceil(args.batch_size);
    let bar = if args.no_progress {
        ProgressBar::hidden()
    } else {
        let epochs = args.epochs - progress.epoch;
        let bar = ProgressBar::new(steps_per_epoch.saturating_mul(epochs) as u64);
        bar.set_style(
            ProgressStyle::with_template("{elapsed_precise} [{bar:30}] {pos}/{len} steps {msg}")
                .expect("valid template")
                .progress_chars("=> "),
        );
        bar
    };
    let mut rng = ChaCha8Rng::seed_from_u64(args.seed);
    let mut order = split.train.clone();
    let mut recall = progress.recall()?;
    let checkpoint = args.out.join("checkpoint.safetensors");
    let mut last = None;
    for epoch in 1..=args.epochs {
        order.shuffle(&mut rng);
        // TorchRec's pointwise example: every positive next to a random item labelled 0.
        // Drawn for the epochs a resumed run skips too, so that its later draws are the
        // uninterrupted run's.
        let mut negatives: Vec<Vec<i64>> = Vec::new();
        if loss == TwoTowerLoss::Pointwise {
            negatives = (order.chunks(args.batch_size))
                .map(|c| {
                    (0..c.len())
                        .map(|_| rng.random_range(0..data.items as i64))
                        .collect()
                })
                .collect();
        }
        if epoch <= progress.epoch {
            continue;
        }
        let started = Instant::now();
        for (b, chunk) in order.chunks(args.batch_size).enumerate() {
            let users: Vec<i64> = chunk.iter().map(|p| p.0 as i64).collect();
            let mut items: Vec<i64> = chunk.iter().map(|p| p.1 as i64).collect();
            let mut labels = None;
            if let Some(negatives) = negatives.get(b) {
                let mut y = vec![1f32; items.len()];
                y.extend(vec![0f32; negatives.len()]);
                items.extend(negatives);
                labels = Some(Tensor::from_vec(y, &[items.len()])?);
            }
            let users = if labels.is_some() {
                [users.clone(), users].concat()
            } else {
                users
            };
            let batch = PairBatch {
                queries: KeyedJaggedTensor::one_hot("user", &users)?,
                candidates: item_features(&items, &data.genres)?,
                candidate_ids: items,
                labels,
            };
            let p = &mut progress;
            p.loss_sum += trainer.train_step(&batch)?;
            p.loss_n += 1;
            bar.inc(1);
            if trainer.step() % 20 == 0 {
                let mean = p.loss_sum / p.loss_n as f64;
                p.loss_points.push((trainer.step() as f64, mean));
                bar.set_message(format!("epoch {epoch}, loss {mean:.4}"));
                (p.loss_sum, p.loss_n) = (0.0, 0);
            }
        }
        progress.train_seconds += started.elapsed().as_secs_f64();
        let evaluation = evaluate(&trainer, &data, &split, args.device)?;
        let q = evaluation.quality;
        last = Some(evaluation);
        let line = format!("epoch {epoch}: {q}");
        if args.no_progress {
            println!("{line}");
        } else {
            bar.println(line);
        }
        for (c, v) in recall
            .iter_mut()
            .zip([q.recall_at_10, q.recall_at_50, q.recall_at_100])
        {
            c.push((epoch as f64, v));
        }
        (progress.history)
            .push(serde_json::json!({ "epoch": epoch, "step": trainer.step(), "exact": q }));
        progress.epoch = epoch;
        trainer.save_checkpoint(&checkpoint, &progress.to_meta(&flags))?;
    }
    bar.finish_and_clear();
    let pairs_per_s = split.train.len() as f64 * args.epochs as f64 / progress.train_seconds;

    // The final model (the last epoch's evaluation): exact search, IVF-PQ, popularity, and
    // optionally the re-ranked top 100.
    let Evaluation {
        catalogue: emb,
        lists: exact_lists,
        quality: exact,
        search_seconds: exact_s,
    } = match last {
        Some(evaluation) => evaluation,
        None => evaluate(&trainer, &data, &split, args.device)?,
    };
    let dim = emb.len() / data.items;
    let t = Instant::now();
    let mut ivf = IvfPqIndex::train(ivf_config, &emb, dim)?;
    ivf.add(&(0..data.items as i64).collect::<Vec<_>>(), &emb)?;
    let build_s = t.elapsed().as_secs_f64();
    // What `embers-serve --retrieval-checkpoint … --retrieval-index …` serves: the index
    // names the model it was built from (the last checkpoint's), which the server checks.
    ivf.set_source(trainer.model_id());
    ivf.save(args.out.join("items.ivfpq"))?;
    let approx = quality(
        &split,
        &retrieve(&trainer, &split, &ivf.with_nprobe(args.nprobe), data.items)?,
    );
    let popular = quality(&split, &popularity(&split, data.items));
    println!(
        "\nheld-out interactions of {} users, full catalogue of {} items:",
        split.test.len(),
        data.items
    );
    println!("  exact search      {exact}");
    println!(
        "  IVF-PQ            {approx}   (nlist {}, m {}, nprobe {}; built in {build_s:.2} s)",
        args.nlist, args.pq_m, args.nprobe
    );
    println!("  popularity        {popular}");
    let mut report = serde_json::json!({
        "data": data.name,
        "users": data.users,
        "items": data.items,
        "train_interactions": split.train.len(),
        "test_users": split.test.len(),
        "config": trainer.config(),
        "training_pairs_per_second": pairs_per_s,
        "exact": exact,
        "exact_search_seconds": exact_s,
        "ivf_pq": { "nlist": args.nlist, "m": args.pq_m, "nprobe": args.nprobe, "build_seconds": build_s, "quality": approx },
        "popularity": popular,
        "history": progress.history,
    });
    if args.rerank {
        let scores = Scores::new(&trainer, data.users, &emb)?;
        let (reranked, auc) = rerank(&args, &data, &split, &exact_lists, &scores)?;
        let q = quality(&split, &reranked);
        println!("  exact + DLRM      {q}   (top 100 re-ranked)");
        report["rerank"] = serde_json::json!({ "quality": q, "dlrm_train_auc": auc });
    }
    println!(
        "\ntraining: {pairs_per_s:.0} pairs/s over {} epochs; outputs in {}",
        args.epochs,
        args.out.display()
    );
    let json = serde_json::to_string_pretty(&report)
        .map_err(|e| Error::invalid("two_tower", format!("metrics.json: {e}")))?;
    embers::checkpoint::write_atomically(&args.out.join("metrics.json"), json.as_bytes())?;
    plot::curves(
        &args.out.join("curves.png"),
        &plot::Series {
            loss: progress.loss_points,
            recall,
            popularity_at_100: popular.recall_at_100,
        },
    )?;
    Ok(())
}

fn main() {
    if let Err(e) = run(Args::parse()) {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}
