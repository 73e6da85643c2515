//! KeyedJaggedTensor, KeyedTensor and JaggedTensor against TorchRec 1.9.2
//! (`tests/golden/kjt.json`).

mod jagged_common;

use embers::sparse::{JaggedTensor, KeyedJaggedTensor, KeyedTensor};
use embers::Tensor;
use jagged_common::*;
use serde_json::Value;

fn golden() -> Value {
    load("kjt.json")
}

fn opt_f32(v: &Value) -> Option<Tensor> {
    (!v.is_null()).then(|| f32t(v))
}

/// Builds the KJT a constructor case describes.
fn build_kjt(c: &Value) -> KeyedJaggedTensor {
    let i = &c["inputs"];
    let keys = strings(&i["keys"]);
    let values = f32t(&i["values"]);
    let weights = opt_f32(&i["weights"]);
    let op = c["op"].as_str().unwrap();
    if !i["stride_per_key_per_rank"].is_null() {
        let spkpr = i["stride_per_key_per_rank"]
            .as_array()
            .unwrap()
            .iter()
            .map(usizes)
            .collect();
        return KeyedJaggedTensor::from_lengths_variable_batch(
            keys,
            values,
            i64t(&i["lengths"]),
            weights,
            spkpr,
        )
        .unwrap();
    }
    let stride = i["stride"].as_u64().map(|s| s as usize);
    if !i["offsets"].is_null() {
        return KeyedJaggedTensor::from_offsets(keys, values, i64t(&i["offsets"]), weights, stride)
            .unwrap();
    }
    let lengths = if i["lengths_dtype"].as_str() == Some("int32") {
        i32t(&i["lengths"])
    } else {
        i64t(&i["lengths"])
    };
    assert!(op.contains("KeyedJaggedTensor"));
    KeyedJaggedTensor::from_lengths(keys, values, lengths, weights, stride).unwrap()
}

fn kjt_named(g: &Value, name: &str) -> KeyedJaggedTensor {
    build_kjt(case(g, name))
}

fn assert_jt(what: &str, jt: &JaggedTensor, want: &Value) {
    assert_values(&format!("{what} values"), jt.values(), &want["values"]);
    assert_values(&format!("{what} lengths"), jt.lengths(), &want["lengths"]);
    assert_values(&format!("{what} offsets"), jt.offsets(), &want["offsets"]);
    match jt.weights() {
        Some(w) => assert_close(&format!("{what} weights"), w, &want["weights"], 0.0),
        None => assert!(want["weights"].is_null(), "{what}: weights missing"),
    }
}

fn assert_kjt(what: &str, kjt: &KeyedJaggedTensor, want: &Value) {
    assert_eq!(kjt.keys(), strings(&want["keys"]).as_slice(), "{what} keys");
    assert_values(&format!("{what} values"), kjt.values(), &want["values"]);
    match kjt.weights() {
        Some(w) => assert_close(&format!("{what} weights"), w, &want["weights"], 0.0),
        None => assert!(want["weights"].is_null(), "{what}: weights missing"),
    }
    assert_values(&format!("{what} lengths"), kjt.lengths(), &want["lengths"]);
    assert_values(&format!("{what} offsets"), kjt.offsets(), &want["offsets"]);
    assert_eq!(
        kjt.stride() as u64,
        want["stride"].as_u64().unwrap(),
        "{what} stride"
    );
    assert_eq!(
        kjt.stride_per_key(),
        usizes(&want["stride_per_key"]).as_slice(),
        "{what} stride_per_key"
    );
    assert_eq!(
        kjt.variable_stride_per_key(),
        want["variable_stride_per_key"].as_bool().unwrap(),
        "{what} vbe"
    );
    assert_eq!(
        kjt.length_per_key(),
        usizes(&want["length_per_key"]).as_slice(),
        "{what} length_per_key"
    );
    assert_eq!(
        kjt.offset_per_key(),
        usizes(&want["offset_per_key"]).as_slice(),
        "{what} offset_per_key"
    );
    if let Some(spkpr) = want["stride_per_key_per_rank"].as_array() {
        let expected: Vec<Vec<usize>> = spkpr.iter().map(usizes).collect();
        assert_eq!(
            kjt.stride_per_key_per_rank().unwrap(),
            expected.as_slice(),
            "{what} stride_per_key_per_rank"
        );
    }
    if let Some(dict) = want["to_dict"].as_object() {
        let ours = kjt.to_dict().unwrap();
        assert_eq!(ours.len(), dict.len(), "{what} to_dict size");
        // serde_json's map sorts keys, so compare by key rather than by order.
        for (key, jt) in &ours {
            let want_jt = dict
                .get(key)
                .unwrap_or_else(|| panic!("{what}: unexpected key {key}"));
            assert_jt(&format!("{what}[{key}]"), jt, want_jt);
        }
    }
}

const CONSTRUCTORS: &[&str] = &[
    "construct_lengths",
    "construct_offsets",
    "from_lengths_sync_unweighted",
    "from_offsets_sync_stride",
    "construct_int32_lengths_sparse",
    "permute_source",
    "vbe_construct",
    "vbe_permute_source",
    "vbe_zero_stride_key",
    "vbe_two_ranks",
    "all_empty",
];

#[test]
fn constructors() {
    let g = golden();
    for name in CONSTRUCTORS {
        let c = case(&g, name);
        assert_kjt(name, &build_kjt(c), &c["outputs"]);
    }
    let kjt = kjt_named(&g, "construct_int32_lengths_sparse");
    assert_eq!(kjt.lengths().dtype(), embers::DType::I32);
    assert_kjt(
        "empty_kjt",
        &KeyedJaggedTensor::empty(),
        &case(&g, "empty_kjt")["outputs"],
    );
}

#[test]
fn getitem() {
    let g = golden();
    for name in ["getitem", "vbe_getitem"] {
        let c = case(&g, name);
        let kjt = kjt_named(&g, c["inputs"]["kjt"].as_str().unwrap());
        for (key, want) in c["outputs"].as_object().unwrap() {
            assert_jt(&format!("{name}[{key}]"), &kjt.get(key).unwrap(), want);
        }
    }
}

#[test]
fn split_and_permute() {
    let g = golden();
    for c in g["cases"].as_array().unwrap() {
        let op = c["op"].as_str().unwrap();
        let name = c["name"].as_str().unwrap();
        if op.starts_with("KeyedJaggedTensor.split") {
            let kjt = kjt_named(&g, c["inputs"]["kjt"].as_str().unwrap());
            let parts = kjt.split(&usizes(&c["inputs"]["segments"])).unwrap();
            let want = c["outputs"].as_array().unwrap();
            assert_eq!(parts.len(), want.len(), "{name}");
            for (k, (part, w)) in parts.iter().zip(want).enumerate() {
                assert_kjt(&format!("{name} part {k}"), part, w);
            }
        } else if op.starts_with("KeyedJaggedTensor.permute") {
            let kjt = kjt_named(&g, c["inputs"]["kjt"].as_str().unwrap());
            let out = kjt.permute(&usizes(&c["inputs"]["indices"])).unwrap();
            assert_kjt(name, &out, &c["outputs"]);
        }
    }
}

fn kjt_from_description(d: &Value) -> KeyedJaggedTensor {
    KeyedJaggedTensor::from_lengths(
        strings(&d["keys"]),
        f32t(&d["values"]),
        i64t(&d["lengths"]),
        opt_f32(&d["weights"]),
        d["stride"].as_u64().map(|s| s as usize),
    )
    .unwrap()
}

#[test]
fn concat() {
    let g = golden();
    let c = case(&g, "concat");
    let a = kjt_from_description(&c["inputs"]["A"]);
    let b = kjt_from_description(&c["inputs"]["B"]);
    assert_kjt(
        "concat",
        &KeyedJaggedTensor::concat(&[a, b]).unwrap(),
        &c["outputs"],
    );
}

fn keyed_tensor(g: &Value, name: &str) -> KeyedTensor {
    let i = &case(g, name)["inputs"];
    let tensors: Vec<Tensor> = i["tensors"].as_array().unwrap().iter().map(f32t).collect();
    KeyedTensor::from_tensor_list(strings(&i["keys"]), &tensors).unwrap()
}

#[test]
fn keyed_tensor_cases() {
    let g = golden();
    for name in ["kt_from_tensor_list", "kt2_from_tensor_list"] {
        let want = &case(&g, name)["outputs"];
        let kt = keyed_tensor(&g, name);
        assert_eq!(kt.keys(), strings(&want["keys"]).as_slice());
        assert_close(name, kt.values(), &want["values"], 0.0);
        assert_eq!(
            kt.length_per_key(),
            usizes(&want["length_per_key"]).as_slice()
        );
        assert_eq!(
            kt.offset_per_key(),
            usizes(&want["offset_per_key"]).as_slice()
        );
        assert_eq!(kt.key_dim() as u64, want["key_dim"].as_u64().unwrap());
        let dict = kt.to_dict().unwrap();
        assert_eq!(
            dict.len(),
            want["to_dict"].as_object().unwrap().len(),
            "{name} to_dict size"
        );
        for (key, t) in dict {
            assert_close(&format!("{name}[{key}]"), &t, &want["to_dict"][&key], 0.0);
        }
    }
    let c = case(&g, "kt_getitem");
    assert_close(
        "kt_getitem",
        &keyed_tensor(&g, "kt_from_tensor_list").get("b").unwrap(),
        &c["outputs"],
        0.0,
    );

    let kts = [
        keyed_tensor(&g, "kt_from_tensor_list"),
        keyed_tensor(&g, "kt2_from_tensor_list"),
    ];
    for name in ["regroup_fast", "regroup_dup_keys", "regroup_subset"] {
        let c = case(&g, name);
        let groups: Vec<Vec<String>> = c["inputs"]["groups"]
            .as_array()
            .unwrap()
            .iter()
            .map(strings)
            .collect();
        let out = KeyedTensor::regroup(&kts, &groups).unwrap();
        assert_eq!(
            out.len(),
            c["outputs"].as_array().unwrap().len(),
            "{name} groups"
        );
        for (k, t) in out.iter().enumerate() {
            assert_close(&format!("{name} group {k}"), t, &c["outputs"][k], 0.0);
        }
    }
    let c = case(&g, "regroup_as_dict");
    let groups: Vec<Vec<String>> = c["inputs"]["groups"]
        .as_array()
        .unwrap()
        .iter()
        .map(strings)
        .collect();
    let out = KeyedTensor::regroup_as_dict(&kts, &groups, &strings(&c["inputs"]["keys"])).unwrap();
    assert_eq!(
        out.len(),
        c["outputs"].as_object().unwrap().len(),
        "regroup_as_dict keys"
    );
    for (name, t) in &out {
        assert_close(name, t, &c["outputs"][name], 0.0);
    }
}

fn jt_construct(g: &Value) -> JaggedTensor {
    let i = &case(g, "jt_construct")["inputs"];
    JaggedTensor::new(
        f32t(&i["values"]),
        i64t(&i["lengths"]),
        opt_f32(&i["weights"]),
    )
    .unwrap()
}

#[test]
fn jagged_tensor_cases() {
    let g = golden();
    let jt = jt_construct(&g);
    assert_jt("jt_construct", &jt, &case(&g, "jt_construct")["outputs"]);
    for name in [
        "jt_to_padded_dense_default",
        "jt_to_padded_dense_truncate",
        "jt_to_padded_dense_longer",
    ] {
        let c = case(&g, name);
        let i = &c["inputs"];
        let out = jt
            .to_padded_dense(
                i["desired_length"].as_u64().map(|l| l as usize),
                i["padding_value"].as_f64().unwrap_or(0.0),
            )
            .unwrap();
        assert_close(name, &out, &c["outputs"], 0.0);
    }
    let c = case(&g, "jt_to_padded_dense_weights");
    let out = jt.to_padded_dense_weights(Some(3), 0.0).unwrap().unwrap();
    assert_close("jt_to_padded_dense_weights", &out, &c["outputs"], 0.0);

    let c = case(&g, "jt_to_dense");
    let rows = jt.to_dense().unwrap();
    assert_eq!(
        rows.len(),
        c["outputs"].as_array().unwrap().len(),
        "jt_to_dense rows"
    );
    for (k, row) in rows.iter().enumerate() {
        assert_values("jt_to_dense", row, &c["outputs"][k]);
    }

    let c = case(&g, "jt_from_dense");
    let values: Vec<Tensor> = c["inputs"]["values"]
        .as_array()
        .unwrap()
        .iter()
        .map(f32t)
        .collect();
    let weights: Vec<Tensor> = c["inputs"]["weights"]
        .as_array()
        .unwrap()
        .iter()
        .map(f32t)
        .collect();
    assert_jt(
        "jt_from_dense",
        &JaggedTensor::from_dense(&values, Some(&weights)).unwrap(),
        &c["outputs"],
    );

    for name in ["jt_from_dense_lengths", "jt_from_dense_lengths_3d"] {
        let c = case(&g, name);
        let i = &c["inputs"];
        let w = opt_f32(&i["weights"]);
        let jt =
            JaggedTensor::from_dense_lengths(&f32t(&i["values"]), &i64t(&i["lengths"]), w.as_ref())
                .unwrap();
        assert_jt(name, &jt, &c["outputs"]);
    }
}

/// Every case of the golden file is exercised by one of the tests above.
#[test]
fn every_golden_case_is_covered() {
    let source = include_str!("kjt_golden.rs");
    let g = golden();
    let cases = g["cases"].as_array().unwrap();
    assert_eq!(cases.len(), 48);
    for c in cases {
        let name = c["name"].as_str().unwrap();
        let op = c["op"].as_str().unwrap();
        let covered = source.contains(&format!("\"{name}\""))
            || op.starts_with("KeyedJaggedTensor.split")
            || op.starts_with("KeyedJaggedTensor.permute");
        assert!(covered, "golden case {name} is not tested");
    }
}
