//! Rewrites a checkpoint file with one metadata entry edited, such as a trainer's model
//! configuration, or with tensors added (shared by the tests of checkpoints whose metadata does not fit them,
//! `#[path]`-included).
#![allow(dead_code)]

use std::path::Path;

/// `path` rewritten with its metadata `key` replaced by `edit` of it (everything else kept).
pub fn rewrite_metadata(path: &Path, key: &str, edit: impl Fn(&str) -> String) {
    rewrite_file(path, |k, v| if k == key { edit(&v) } else { v }, |_| {});
}

/// `path` rewritten with what `add` writes added (everything else kept).
pub fn add_to(path: &Path, add: impl FnOnce(&mut embers::checkpoint::CheckpointWriter)) {
    rewrite_file(path, |_, v| v, add);
}

/// `path` rewritten: each metadata value through `edit(key, value)`, every tensor kept, then
/// what `add` writes.
fn rewrite_file(
    path: &Path,
    edit: impl Fn(&str, String) -> String,
    add: impl FnOnce(&mut embers::checkpoint::CheckpointWriter),
) {
    let r = embers::checkpoint::CheckpointReader::open(path).unwrap();
    let mut w = embers::checkpoint::CheckpointWriter::new();
    for (k, v) in r.names_of_metadata() {
        let v = edit(&k, v);
        w.set_metadata(k, v);
    }
    let tensors: Vec<_> = (r.names().into_iter())
        .map(|n| (r.read_tensor(&n).unwrap(), n))
        .collect();
    for (t, n) in &tensors {
        w.add_tensor(n, t).unwrap();
    }
    add(&mut w);
    w.write(path).unwrap();
}

/// `path` rewritten with its `model.config` metadata (JSON) changed by `edit`.
pub fn rewrite(path: &Path, edit: impl Fn(&mut serde_json::Value)) {
    rewrite_metadata(path, "model.config", |v| {
        let mut json: serde_json::Value = serde_json::from_str(v).unwrap();
        edit(&mut json);
        json.to_string()
    });
}
