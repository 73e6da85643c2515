//! Reading checkpoints back in tests: every tensor of safetensors files, by name.

use std::collections::BTreeMap;

/// Every tensor of the safetensors files in `dir` whose names start with `prefix`: by file
/// (without its save id) and tensor, its dtype, shape and bytes (metadata left out: its order
/// is not fixed).
pub fn tensors_of(dir: &std::path::Path, prefix: &str) -> BTreeMap<String, (String, Vec<u8>)> {
    let mut out = BTreeMap::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        let file = path.file_name().unwrap().to_str().unwrap().to_string();
        if !file.starts_with(prefix) || !file.ends_with(".safetensors") {
            continue;
        }
        let bytes = std::fs::read(&path).unwrap();
        let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
        let data = &bytes[8 + n..];
        let stem = file.split('.').next().unwrap().to_string();
        for (name, t) in header.as_object().unwrap() {
            if name == "__metadata__" {
                continue;
            }
            let at = &t["data_offsets"];
            let (lo, hi) = (
                at[0].as_u64().unwrap() as usize,
                at[1].as_u64().unwrap() as usize,
            );
            let kind = format!("{} {}", t["dtype"], t["shape"]);
            out.insert(format!("{stem}/{name}"), (kind, data[lo..hi].to_vec()));
        }
    }
    assert!(!out.is_empty(), "no `{prefix}` files in {}", dir.display());
    out
}
