//! Serving: answering requests with a trained model. [`DynamicBatcher`] is its core: requests
//! from many clients queue, close into a batch at `max_batch_rows` rows or `max_delay` after the
//! first, run on a blocking thread (so the async runtime never waits on compute), and each
//! client gets its own rows' outputs back. The queue is bounded in rows: past it a request is
//! refused at once with a retry hint (back-pressure instead of unbounded memory), and a request
//! whose rows are invalid fails alone, before it can join a batch shared with others.
//! [`Server`] (feature `server`, on by default) puts a trained DLRM behind HTTP with hot
//! reload, health and Prometheus metrics, and optionally a TwoTower retriever with its IVF-PQ
//! index beside it ([`RetrievalServable`]: the two stages of a recommender in one server); the
//! `embers-serve` binary runs it.

mod batcher;
mod dlrm;
mod histogram;
#[cfg(feature = "server")]
mod http;
mod retrieval;
#[cfg(feature = "server")]
mod stall;

pub use batcher::{BatchModel, BatchStats, BatcherConfig, DynamicBatcher, ServeError, MAX_DELAY};
pub use dlrm::{DlrmRow, DlrmServable};
pub use histogram::Histogram;
#[cfg(feature = "server")]
pub use http::{
    ReloadToken, RetrievalConfig, Server, ServerConfig, ARROW_STREAM, BODY_RATE_GRACE,
    MAX_RETRIEVE_RESULTS,
};
pub use retrieval::{RetrievalAnswer, RetrievalRow, RetrievalServable, MAX_RETRIEVAL_K};

/// Checks row `row`'s ids against the served features: one id list per key (`keys`; `what`
/// names the model, e.g. "the model"), each id inside its table (`rows`). The message names the
/// row, the feature and the id, for [`BatchModel::validate`].
fn check_ids(
    row: usize,
    ids: &[Vec<i64>],
    keys: &[String],
    rows: &[usize],
    what: &str,
) -> Result<(), String> {
    if ids.len() != keys.len() {
        return Err(format!(
            "row {row}: ids for {} features, {what} has {} ({keys:?})",
            ids.len(),
            keys.len(),
        ));
    }
    for ((ids, key), &n) in ids.iter().zip(keys).zip(rows) {
        if let Some(&id) = ids.iter().find(|&&id| id < 0 || id as usize >= n) {
            return Err(format!(
                "row {row}: feature `{key}` id {id} is outside 0..{n}"
            ));
        }
    }
    Ok(())
}

/// Rows' sparse ids key-major, as a KJT lays them out: every row's ids of feature 0, then of
/// feature 1, …; returns the ids and one length per (feature, row). `ids(row)` gives a row's id
/// lists, one per feature (`features` of them, already checked by [`check_ids`]).
fn key_major<R>(
    rows: &[R],
    features: usize,
    ids: impl Fn(&R) -> &[Vec<i64>],
) -> (Vec<i64>, Vec<i32>) {
    let mut values = Vec::new();
    let mut lengths = Vec::with_capacity(rows.len() * features);
    for f in 0..features {
        for row in rows {
            values.extend_from_slice(&ids(row)[f]);
            lengths.push(ids(row)[f].len() as i32);
        }
    }
    (values, lengths)
}
