//! Rewrites a trainer checkpoint with its model configuration edited (shared by the tests of
//! checkpoints whose configuration does not fit them, `#[path]`-included).

use std::path::Path;

/// `path` rewritten with its `model.config` metadata changed by `edit` (everything else kept).
pub fn rewrite(path: &Path, edit: impl Fn(&mut serde_json::Value)) {
    let r = embers::checkpoint::CheckpointReader::open(path).unwrap();
    let mut w = embers::checkpoint::CheckpointWriter::new();
    for (k, v) in r.names_of_metadata() {
        if k == "model.config" {
            let mut json: serde_json::Value = serde_json::from_str(&v).unwrap();
            edit(&mut json);
            w.set_metadata(k, json.to_string());
        } else {
            w.set_metadata(k, v);
        }
    }
    let tensors: Vec<_> = (r.names().into_iter())
        .map(|n| (r.read_tensor(&n).unwrap(), n))
        .collect();
    for (t, n) in &tensors {
        w.add_tensor(n, t).unwrap();
    }
    w.write(path).unwrap();
}
