//! RecMetrics over every rank's data: each rank updates its own [`RecMetrics`] with its own
//! batches; [`global_metrics`] gathers their states so that every rank gets the values one
//! process that saw all the data would compute (TorchRec's metric reduction across ranks).
//!
//! Lifetime sums and the lifetime AUC/AUPRC histograms add up across ranks (an all-reduce, so
//! a rank sends about twice their size whatever the world size); the windows' batches and
//! samples are gathered and concatenated in rank order, and nothing of them is dropped. A
//! window is therefore the union of every rank's window: give each rank `window / W`
//! samples for a global window of `window` (as TorchRec does).

use std::collections::BTreeMap;

use super::comm::Comm;
use crate::error::{Error, Result};
use crate::metrics::RecMetrics;

const OP: &str = "global_metrics";

/// How an entry of the state combines across ranks.
fn concatenated(key: &str) -> Result<bool> {
    let suffix = key.rsplit('.').next().unwrap_or("");
    match suffix {
        "lifetime" | "window" | "positives" | "negatives" | "mixed_positives"
        | "mixed_negatives" => Ok(false),
        "batches" | "recent" => Ok(true),
        _ => Err(Error::invalid(
            OP,
            format!("the metric state `{key}` has no rule to combine across ranks"),
        )),
    }
}

/// The metrics of every rank's data as one process would compute them (a collective: every
/// rank passes its own metrics, configured the same way, and gets the same values). Ranks
/// whose metrics are configured differently fail, naming the rank and the entry.
pub fn global_metrics(comm: &Comm, metrics: &RecMetrics) -> Result<BTreeMap<String, f64>> {
    let state = metrics.state_dict();
    // The window's size and the keys (their names and sizes) first: every rank must hold the
    // same entries.
    let mut names = vec![format!("window size {}", metrics.window_size())];
    let mut lengths: Vec<u64> = Vec::with_capacity(state.len());
    // The entries gathered, and those summed, each back to back in key order.
    let (mut values, mut sums): (Vec<f64>, Vec<f64>) = (Vec::new(), Vec::new());
    // Whether each entry (in key order) is gathered.
    let mut concat: Vec<bool> = Vec::with_capacity(state.len());
    for (key, v) in &state {
        names.push(key.clone());
        lengths.push(v.len() as u64);
        let gathered = concatenated(key)?;
        concat.push(gathered);
        if gathered {
            values.extend_from_slice(v);
        } else {
            sums.extend_from_slice(v);
        }
    }
    let header: Vec<u8> = names.iter().flat_map(|k| k.bytes().chain([0])).collect();
    let headers = comm.all_gather_v("metrics.keys", &header, None)?;
    let rank = comm.rank();
    if let Some(other) = (0..comm.size()).find(|&r| headers[r] != header) {
        let theirs: Vec<String> = (headers[other].split(|&b| b == 0))
            .filter(|k| !k.is_empty())
            .map(|k| String::from_utf8_lossy(k).to_string())
            .collect();
        let differs = (names.iter().zip(&theirs))
            .find(|(a, b)| a != b)
            .map(|(a, b)| format!("{a}` here, `{b}"))
            .unwrap_or_else(|| format!("{} entries against {}", names.len(), theirs.len()));
        return Err(Error::Distributed(format!(
            "rank {rank}: rank {other}'s metrics are configured differently (first difference: \
             `{differs}`)"
        )));
    }
    let all_lengths = comm.all_gather_v(
        "metrics.lengths",
        &lengths,
        Some(&vec![state.len(); comm.size()]),
    )?;
    // Every rank sees every rank's lengths, so all of them stop here alike: the summed
    // entries must have one length on every rank.
    for (k, key) in state.keys().enumerate() {
        if let Some(r) = (!concat[k])
            .then(|| (1..comm.size()).find(|&r| all_lengths[r][k] != all_lengths[0][k]))
            .flatten()
        {
            return Err(Error::Distributed(format!(
                "rank {rank}: metric state `{key}` has {} values on rank {r}, {} on rank 0",
                all_lengths[r][k], all_lengths[0][k]
            )));
        }
    }
    // Counts from the peers, checked: a sum past a usize is a malformed message.
    let counts: Vec<usize> = (all_lengths.iter().enumerate())
        .map(|(r, l)| {
            (l.iter().zip(&concat))
                .filter(|(_, &c)| c)
                .try_fold(0usize, |n, (&k, _)| n.checked_add(usize::try_from(k).ok()?))
                .ok_or_else(|| {
                    Error::Distributed(format!(
                        "rank {rank}: metrics.lengths: rank {r} announced lengths past a usize"
                    ))
                })
        })
        .collect::<Result<_>>()?;
    let all_values = comm.all_gather_v("metrics.values", &values, Some(&counts))?;
    comm.all_reduce_sum_f64("metrics.sums", &mut sums)?;
    let mut merged: BTreeMap<String, Vec<f64>> = BTreeMap::new();
    let mut at = vec![0usize; comm.size()];
    let mut summed = 0;
    for (k, key) in state.keys().enumerate() {
        let mut out: Vec<f64> = Vec::new();
        if concat[k] {
            for r in 0..comm.size() {
                let n = all_lengths[r][k] as usize;
                out.extend_from_slice(&all_values[r][at[r]..at[r] + n]);
                at[r] += n;
            }
        } else {
            let n = all_lengths[rank][k] as usize;
            out.extend_from_slice(&sums[summed..summed + n]);
            summed += n;
        }
        merged.insert(key.clone(), out);
    }
    // Every rank's window whole: the union is up to W windows wide.
    let mut global = metrics.with_window_size(usize::MAX)?;
    global.load_state_dict(&merged)?;
    Ok(global.compute())
}
