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

/// Every table of the sharded checkpoint in `dir` (whatever its plan, tables cached in files
/// included), loaded into one unsharded collection: by table, its weights and each optimizer
/// state buffer.
#[allow(dead_code)] // not every test that includes this file reads sharded checkpoints
pub fn tables_of_sharded(dir: &std::path::Path) -> BTreeMap<String, (Vec<f32>, Vec<Vec<f32>>)> {
    use embers::embedding::{EmbeddingBagCollection, EmbeddingBagConfig, FusedOptimizer};
    let manifest = embers::checkpoint::CheckpointReader::open(dir.join("manifest.safetensors"))
        .expect("a sharded checkpoint's manifest");
    // Each table's extent: the union of its saved rectangles.
    let mut extent: BTreeMap<String, (usize, usize)> = BTreeMap::new();
    let files = manifest
        .required_metadata("files")
        .unwrap()
        .split(',')
        .count();
    for f in 0..files {
        let rects = manifest.required_metadata(&format!("rects.{f}")).unwrap();
        let rects: Vec<serde_json::Value> = serde_json::from_str(rects).unwrap();
        for r in rects {
            let n = |i: usize| r[i].as_u64().unwrap() as usize;
            let e = extent
                .entry(r[0].as_str().unwrap().to_string())
                .or_default();
            *e = (e.0.max(n(1) + n(3)), e.1.max(n(2) + n(4)));
        }
    }
    // Only the kind of optimizer matters to a load (the state it keeps).
    let (lr, eps, beta1, beta2) = (0.1, 1e-8, 0.9, 0.999);
    let optimizer = match manifest.required_metadata("optimizer").unwrap() {
        "sgd" => FusedOptimizer::Sgd { lr },
        "adagrad" => FusedOptimizer::Adagrad { lr, eps },
        "rowwise_adagrad" => FusedOptimizer::RowWiseAdagrad { lr, eps },
        "adam" => FusedOptimizer::Adam {
            lr,
            beta1,
            beta2,
            eps,
        },
        other => panic!("no test optimizer for `{other}`"),
    };
    let configs: Vec<EmbeddingBagConfig> = (extent.iter())
        .map(|(name, &(rows, dim))| {
            EmbeddingBagConfig::new(name, rows, dim, &[&format!("{name}.feature")])
        })
        .collect();
    let mut rng = embers::tensor::rng::seeded(1);
    let whole = EmbeddingBagCollection::new(configs, optimizer, &mut rng).unwrap();
    embers::distributed::load_into_unsharded(&whole, dir).unwrap();
    let mut out = BTreeMap::new();
    for tbe in whole.tbes() {
        for (t, spec) in tbe.config().tables.iter().enumerate() {
            let states = (0..tbe.optimizer_state_names().len())
                .map(|i| tbe.optimizer_state(i, t).unwrap())
                .collect();
            out.insert(spec.name.clone(), (tbe.table_weights(t).unwrap(), states));
        }
    }
    out
}
