//! The jagged op set against FBGEMM_GPU 1.9.0 CPU golden vectors (`tests/golden/jagged.json`):
//! forward values and, for differentiable ops, the gradients FBGEMM's backward produced for the
//! recorded upstream gradient. Cases FBGEMM could not run on CPU are checked against a naïve
//! reference on the same inputs.

mod jagged_common;

use embers::sparse::ops::*;
use embers::{DType, Tensor};
use jagged_common::*;
use serde_json::Value;

const TOL: f64 = 1e-6;

fn golden() -> Value {
    load("jagged.json")
}

/// Feeds the case's upstream gradient to `out` and compares each named input's gradient.
fn check_grads(c: &Value, out: &Tensor, inputs: &[(&str, &Tensor)]) {
    if c["upstream_grad"].is_null() {
        return;
    }
    let upstream = f32t(&c["upstream_grad"]).to_dtype(out.dtype()).unwrap();
    out.backward_with(&upstream, false).unwrap();
    for (name, t) in inputs {
        let want = &c["grads"][*name];
        assert!(!want.is_null(), "{}: no golden grad for {name}", c["name"]);
        let grad = t
            .grad()
            .unwrap_or_else(|| panic!("{}: {name} got no gradient", c["name"]));
        assert_close(&format!("{} grad {name}", c["name"]), &grad, want, TOL);
    }
}

fn offsets_list(v: &Value) -> Vec<Tensor> {
    v.as_array().unwrap().iter().map(i64t).collect()
}

#[test]
fn jagged_to_padded_dense_cases() {
    let g = golden();
    for name in [
        "j2pd_basic",
        "j2pd_truncate_pad",
        "j2pd_1d_values",
        "j2pd_two_jagged_dims",
    ] {
        let c = case(&g, name);
        let i = &c["inputs"];
        let values = leaf(&i["values"]);
        let offsets = offsets_list(&i["offsets"]);
        let refs: Vec<&Tensor> = offsets.iter().collect();
        let out = jagged_to_padded_dense(
            &values,
            &refs,
            &usizes(&i["max_lengths"]),
            i["padding_value"].as_f64().unwrap(),
        )
        .unwrap();
        assert_close(name, &out, &c["outputs"], TOL);
        check_grads(c, &out, &[("values", &values)]);
    }
}

#[test]
fn jagged_1d_and_2d_to_dense_cases() {
    let g = golden();
    let c = case(&g, "j1d_to_dense");
    let i = &c["inputs"];
    let out = jagged_1d_to_dense(&i64t(&i["values"]), &i64t(&i["offsets"]), 2, -1.0).unwrap();
    assert_eq!(out.dtype(), DType::I64);
    assert_close("j1d_to_dense", &out, &c["outputs"], 0.0);

    let c = case(&g, "j2d_to_dense");
    let i = &c["inputs"];
    let values = leaf(&i["values"]);
    let out = jagged_2d_to_dense(
        &values,
        &i64t(&i["offsets"]),
        i["max_sequence_length"].as_u64().unwrap() as usize,
    )
    .unwrap();
    assert_close("j2d_to_dense", &out, &c["outputs"], TOL);
    check_grads(c, &out, &[("values", &values)]);
}

#[test]
fn dense_to_jagged_cases() {
    let g = golden();
    for name in ["d2j_basic", "d2j_total_L"] {
        let c = case(&g, name);
        let i = &c["inputs"];
        let dense = leaf(&i["dense"]);
        let offsets = offsets_list(&i["x_offsets"]);
        let refs: Vec<&Tensor> = offsets.iter().collect();
        let total = i["total_L"].as_u64().map(|t| t as usize);
        let out = dense_to_jagged(&dense, &refs, total).unwrap();
        assert_close(name, &out, &c["outputs"][0], TOL);
        // FBGEMM also returns its input offsets, unchanged; embers returns the values only, so
        // what its output must agree with is their total: one row per jagged element.
        let golden_offsets = c["outputs"][1][0].as_array().unwrap();
        let total = golden_offsets.last().unwrap().as_u64().unwrap() as usize;
        assert_eq!(
            out.shape()[0],
            total,
            "{name}: rows vs the golden offsets' total"
        );
        check_grads(c, &out, &[("dense", &dense)]);
    }
}

#[test]
fn jagged_dense_elementwise_cases() {
    let g = golden();
    for name in ["jd_add", "jd_add_y_shorter"] {
        let c = case(&g, name);
        let i = &c["inputs"];
        let (x, y) = (leaf(&i["x_values"]), leaf(&i["y"]));
        let out = jagged_dense_elementwise_add(&x, &i64t(&i["x_offsets"][0]), &y).unwrap();
        assert_close(name, &out, &c["outputs"], TOL);
        check_grads(c, &out, &[("x_values", &x), ("y", &y)]);
    }
    let c = case(&g, "jd_add_jout");
    let i = &c["inputs"];
    let (x, y) = (leaf(&i["x_values"]), leaf(&i["y"]));
    let out =
        jagged_dense_elementwise_add_jagged_output(&x, &i64t(&i["x_offsets"][0]), &y).unwrap();
    assert_close("jd_add_jout", &out, &c["outputs"][0], TOL);
    check_grads(c, &out, &[("x_values", &x), ("y", &y)]);

    let c = case(&g, "jdd_add_jout");
    let i = &c["inputs"];
    let (x, y0, y1) = (leaf(&i["x_values"]), leaf(&i["y_0"]), leaf(&i["y_1"]));
    let out =
        jagged_dense_dense_elementwise_add_jagged_output(&x, &i64t(&i["x_offsets"][0]), &y0, &y1)
            .unwrap();
    assert_close("jdd_add_jout", &out, &c["outputs"][0], TOL);
    check_grads(c, &out, &[("x_values", &x), ("y_0", &y0), ("y_1", &y1)]);

    let c = case(&g, "jd_mul");
    let i = &c["inputs"];
    let (x, y) = (leaf(&i["x_values"]), leaf(&i["y"]));
    let out = jagged_dense_elementwise_mul(&x, &i64t(&i["x_offsets"][0]), &y).unwrap();
    assert_close("jd_mul", &out, &c["outputs"][0], TOL);
    check_grads(c, &out, &[("x_values", &x), ("y", &y)]);
}

#[test]
fn bmm_cases() {
    let g = golden();
    for name in ["jd_bmm", "jd_bmm_truncated"] {
        let c = case(&g, name);
        let i = &c["inputs"];
        let (x, y) = (leaf(&i["x_values"]), leaf(&i["y"]));
        let out = jagged_dense_bmm(
            &x,
            &i64t(&i["x_offsets"]),
            &y,
            i["max_L"].as_u64().unwrap() as usize,
        )
        .unwrap();
        assert_close(name, &out, &c["outputs"][0], TOL);
        check_grads(c, &out, &[("x_values", &x), ("y", &y)]);
    }
    for name in ["jj_bmm", "jj_bmm_truncated"] {
        let c = case(&g, name);
        let i = &c["inputs"];
        let (x, y) = (leaf(&i["x_values"]), leaf(&i["y_values"]));
        let out = jagged_jagged_bmm(
            &x,
            &y,
            &i64t(&i["x_offsets"]),
            i["max_L"].as_u64().unwrap() as usize,
        )
        .unwrap();
        assert_close(name, &out, &c["outputs"], TOL);
        check_grads(c, &out, &[("x_values", &x), ("y_values", &y)]);
    }
    let c = case(&g, "bdvj_mul");
    let i = &c["inputs"];
    let (v, a) = (leaf(&i["v"]), leaf(&i["a_values"]));
    let out = batched_dense_vec_jagged_2d_mul(&v, &a, &i64t(&i["a_offsets"])).unwrap();
    assert_close("bdvj_mul", &out, &c["outputs"], TOL);
    check_grads(c, &out, &[("v", &v), ("a_values", &a)]);
}

#[test]
fn softmax_cases() {
    let g = golden();
    for name in ["j_softmax", "j_softmax_truncated"] {
        let c = case(&g, name);
        let i = &c["inputs"];
        let values = leaf(&i["values"]);
        let out = jagged_softmax(
            &values,
            &i64t(&i["x_offsets"]),
            i["max_L"].as_u64().unwrap() as usize,
        )
        .unwrap();
        // Rows FBGEMM leaves uninitialised are null in the golden file (skipped); ours are 0.
        assert_close(name, &out, &c["outputs"][0], 1e-6);
        check_grads(c, &out, &[("values", &values)]);
        if name == "j_softmax_truncated" {
            assert_eq!(
                out.narrow(0, 4, 1).unwrap().to_vec::<f32>().unwrap(),
                vec![0.0, 0.0]
            );
        }
    }
}

#[test]
fn index_select_cases() {
    let g = golden();
    let c = case(&g, "j_index_select");
    let i = &c["inputs"];
    let values = leaf(&i["values"]);
    let (out, lengths) =
        jagged_index_select(&values, &i64t(&i["lengths"]), &i64t(&i["indices"])).unwrap();
    assert_close("j_index_select", &out, &c["outputs"][0], TOL);
    assert_values("j_index_select lengths", &lengths, &c["outputs"][1]);
    check_grads(c, &out, &[("values", &values)]);

    // FBGEMM's CPU kernel refuses 1-D values; embers supports them: naïve reference.
    let c = case(&g, "j_index_select_1d");
    let i = &c["inputs"];
    let (out, lengths) = jagged_index_select(
        &f32t(&i["values"]),
        &i64t(&i["lengths"]),
        &i64t(&i["indices"]),
    )
    .unwrap();
    let (vals, _) = flat(&i["values"]);
    let lens = usizes(&i["lengths"]);
    let mut expected = Vec::new();
    let mut expected_lengths = Vec::new();
    for &k in &usizes(&i["indices"]) {
        let start: usize = lens[..k].iter().sum();
        expected.extend_from_slice(&vals[start..start + lens[k]]);
        expected_lengths.push(lens[k] as f64);
    }
    assert_eq!(out.to_vec_f64().unwrap(), expected);
    assert_eq!(lengths.to_vec_f64().unwrap(), expected_lengths);

    for name in ["index_select_dim0", "index_select_dim0_int32"] {
        let c = case(&g, name);
        let i = &c["inputs"];
        let input = leaf(&i["input"]);
        let idx = if name.ends_with("int32") {
            i32t(&i["indices"])
        } else {
            i64t(&i["indices"])
        };
        let out = index_select_dim0(&input, &idx).unwrap();
        assert_close(name, &out, &c["outputs"], TOL);
        check_grads(c, &out, &[("input", &input)]);
    }
}

/// FBGEMM has no CPU kernel for keyed_jagged_index_select_dim1: compare with a naïve
/// per-key, per-sample reference on the golden inputs.
#[test]
fn keyed_jagged_index_select_dim1_matches_naive_reference() {
    let g = golden();
    for name in ["kj_index_select_dim1", "kj_index_select_dim1_weighted"] {
        let c = case(&g, name);
        let i = &c["inputs"];
        let batch = i["batch_size"].as_u64().unwrap() as usize;
        let values = if name.ends_with("weighted") {
            i64t(&i["values"])
        } else {
            leaf(&i["values"])
        };
        let weights = (!i["weights"].is_null()).then(|| leaf(&i["weights"]));
        let out = keyed_jagged_index_select_dim1(
            &values,
            &i64t(&i["lengths"]),
            &i64t(&i["offsets"]),
            &i64t(&i["indices"]),
            batch,
            weights.as_ref(),
        )
        .unwrap();
        let (vals, _) = flat(&i["values"]);
        let lens = usizes(&i["lengths"]);
        let picks = usizes(&i["indices"]);
        let mut expected = Vec::new();
        let mut expected_rows = Vec::new();
        let mut expected_lengths = Vec::new();
        for key in 0..lens.len() / batch {
            for &b in &picks {
                let bag = key * batch + b;
                let start: usize = lens[..bag].iter().sum();
                expected.extend_from_slice(&vals[start..start + lens[bag]]);
                expected_rows.extend(start..start + lens[bag]);
                expected_lengths.push(lens[bag] as f64);
            }
        }
        assert_eq!(out.values.to_vec_f64().unwrap(), expected, "{name}");
        assert_eq!(
            out.lengths.to_vec_f64().unwrap(),
            expected_lengths,
            "{name}"
        );
        if let Some(w) = &weights {
            let (wv, _) = flat(&i["weights"]);
            let want: Vec<f64> = expected_rows.iter().map(|&r| wv[r] as f32 as f64).collect();
            assert_eq!(out.weights.as_ref().unwrap().to_vec_f64().unwrap(), want);
            // Gradient of the weights: each selected occurrence adds its upstream gradient.
            let ones = Tensor::ones(&[want.len()], DType::F32, embers::Device::Cpu);
            out.weights.unwrap().backward_with(&ones, false).unwrap();
            let mut counts = vec![0.0; wv.len()];
            for &r in &expected_rows {
                counts[r] += 1.0;
            }
            assert_eq!(w.grad().unwrap().to_vec_f64().unwrap(), counts);
        }
    }
}

#[test]
fn permute_2d_sparse_data_cases() {
    let g = golden();
    for name in [
        "permute2d",
        "permute2d_dup_subset",
        "permute2d_int32_float_values",
    ] {
        let c = case(&g, name);
        let i = &c["inputs"];
        let int32 = name.contains("int32");
        let lengths = if int32 {
            i32t(&i["lengths"])
        } else {
            i64t(&i["lengths"])
        };
        let values = if int32 {
            f32t(&i["values"])
        } else {
            i64t(&i["values"])
        };
        let weights = (!i["weights"].is_null()).then(|| f32t(&i["weights"]));
        let sum = i["permuted_lengths_sum"].as_u64().map(|s| s as usize);
        let out = permute_2d_sparse_data(
            &i32t(&i["permute"]),
            &lengths,
            &values,
            weights.as_ref(),
            sum,
        )
        .unwrap();
        assert_eq!(out.lengths.dtype(), lengths.dtype());
        assert_close(name, &out.lengths, &c["outputs"][0], 0.0);
        assert_close(name, &out.values, &c["outputs"][1], 0.0);
        match &out.weights {
            Some(w) => assert_close(name, w, &c["outputs"][2], 0.0),
            None => assert!(c["outputs"][2].is_null()),
        }
    }
    // FBGEMM's CPU kernel rejects an i64 permute ("expected scalar type Int"); embers accepts it
    // and must give exactly the i32 result.
    let c = case(&g, "permute2d_int64_permute_error");
    let i = &c["inputs"];
    let with_i64 = permute_2d_sparse_data(
        &i64t(&i["permute"]),
        &i64t(&i["lengths"]),
        &i64t(&i["values"]),
        None,
        None,
    )
    .unwrap();
    let with_i32 = permute_2d_sparse_data(
        &i32t(&i["permute"]),
        &i64t(&i["lengths"]),
        &i64t(&i["values"]),
        None,
        None,
    )
    .unwrap();
    assert_eq!(
        with_i64.values.to_vec::<i64>().unwrap(),
        with_i32.values.to_vec::<i64>().unwrap()
    );
    assert_eq!(
        with_i64.lengths.to_vec::<i64>().unwrap(),
        vec![2, 2, 0, 1, 0, 2, 0, 3, 1]
    );
}

#[test]
fn block_bucketize_cases() {
    let g = golden();
    for name in [
        "bb_basic",
        "bb_weights_pos",
        "bb_sequence",
        "bb_keep_orig_idx",
        "bb_block_bucketize_pos",
        "bb_total_num_blocks",
        "bb_variable_batch",
    ] {
        let c = case(&g, name);
        let i = &c["inputs"];
        let weights = (!i["weights"].is_null()).then(|| f32t(&i["weights"]));
        let batch_sizes =
            (!i["batch_size_per_feature"].is_null()).then(|| i64t(&i["batch_size_per_feature"]));
        let total_blocks = (!i["total_num_blocks"].is_null()).then(|| i64t(&i["total_num_blocks"]));
        let positions: Option<Vec<Tensor>> =
            (!i["block_bucketize_pos"].is_null()).then(|| offsets_list(&i["block_bucketize_pos"]));
        let options = BlockBucketizeOptions {
            bucketize_pos: i["bucketize_pos"].as_bool().unwrap_or(false),
            sequence: i["sequence"].as_bool().unwrap_or(false),
            weights: weights.as_ref(),
            batch_size_per_feature: batch_sizes.as_ref(),
            max_batch_size: i["max_B"].as_u64().map(|m| m as usize),
            block_bucketize_pos: positions.as_deref(),
            keep_orig_idx: i["keep_orig_idx"].as_bool().unwrap_or(false),
            total_num_blocks: total_blocks.as_ref(),
        };
        let out = block_bucketize_sparse_features(
            &i64t(&i["lengths"]),
            &i64t(&i["indices"]),
            &i64t(&i["block_sizes"]),
            i["my_size"].as_u64().unwrap() as usize,
            &options,
        )
        .unwrap();
        let o = &c["outputs"];
        assert_values(&format!("{name} lengths"), &out.lengths, &o[0]);
        assert_values(&format!("{name} indices"), &out.indices, &o[1]);
        for (what, got, want) in [
            ("weights", &out.weights, &o[2]),
            ("positions", &out.positions, &o[3]),
            ("unbucketize_permute", &out.unbucketize_permute, &o[4]),
        ] {
            match got {
                Some(t) => assert_values(&format!("{name} {what}"), t, want),
                None => assert!(want.is_null(), "{name}: {what} missing"),
            }
        }
    }
}

#[test]
fn cumsum_cases() {
    let g = golden();
    for c in g["cases"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| c["op"].as_str().unwrap().ends_with("_cumsum"))
    {
        let name = c["name"].as_str().unwrap();
        let input = if name.contains("int32") {
            i32t(&c["inputs"]["t_in"])
        } else {
            i64t(&c["inputs"]["t_in"])
        };
        let out = match c["op"].as_str().unwrap() {
            "asynchronous_complete_cumsum" => complete_cumsum(&input),
            "asynchronous_exclusive_cumsum" => exclusive_cumsum(&input),
            "asynchronous_inclusive_cumsum" => inclusive_cumsum(&input),
            op => panic!("{op}"),
        }
        .unwrap();
        assert_eq!(out.dtype(), input.dtype(), "{name}");
        assert_close(name, &out, &c["outputs"], 0.0);
    }
}

#[test]
fn permute102_baddbmm_cases() {
    let g = golden();
    let c = case(&g, "p102_baddbmm");
    let i = &c["inputs"];
    let (bias, a, b) = (leaf(&i["bias"]), leaf(&i["A"]), leaf(&i["B"]));
    let out = permute102_baddbmm_permute102(&bias, &a, &b).unwrap();
    assert_close("p102_baddbmm", &out, &c["outputs"], TOL);
    check_grads(c, &out, &[("bias", &bias), ("A", &a), ("B", &b)]);

    // f16: the same inputs (exact in f16) give the f32 result rounded to f16, and the
    // gradients in f16.
    let (bias, a, b) = [&i["bias"], &i["A"], &i["B"]]
        .map(|v| {
            f32t(v)
                .to_dtype(DType::F16)
                .unwrap()
                .with_requires_grad(true)
        })
        .into();
    let out = permute102_baddbmm_permute102(&bias, &a, &b).unwrap();
    assert_eq!(out.dtype(), DType::F16);
    assert_close("p102_baddbmm f16", &out, &c["outputs"], 1e-3);
    check_grads_f16(c, &out, &[("bias", &bias), ("A", &a), ("B", &b)]);
}

fn check_grads_f16(c: &Value, out: &Tensor, inputs: &[(&str, &Tensor)]) {
    let upstream = f32t(&c["upstream_grad"]).to_dtype(DType::F16).unwrap();
    out.backward_with(&upstream, false).unwrap();
    for (name, t) in inputs {
        let grad = t.grad().unwrap();
        assert_eq!(grad.dtype(), DType::F16);
        assert_close(&format!("f16 grad {name}"), &grad, &c["grads"][*name], 2e-3);
    }
}

#[test]
fn small_jagged_op_cases() {
    let g = golden();
    let c = case(&g, "j_slice");
    let i = &c["inputs"];
    let (values, lengths) = jagged_slice(
        &f32t(&i["x_values"]),
        &i64t(&i["x_lengths"]),
        &i64t(&i["start"]),
        i["slice_length"].as_u64().unwrap() as usize,
    )
    .unwrap();
    assert_close("j_slice", &values, &c["outputs"][0], 0.0);
    assert_values("j_slice lengths", &lengths, &c["outputs"][1]);

    let c = case(&g, "j1d_truncated");
    let i = &c["inputs"];
    let out = jagged_1d_to_truncated_values(
        &f32t(&i["values"]),
        &i64t(&i["lengths"]),
        i["max_truncated_length"].as_u64().unwrap() as usize,
    )
    .unwrap();
    assert_close("j1d_truncated", &out, &c["outputs"], 0.0);

    let c = case(&g, "masked_select_j1d");
    let i = &c["inputs"];
    let mask = Tensor::from_vec(
        flat(&i["mask"])
            .0
            .into_iter()
            .map(|m| m as u8)
            .collect::<Vec<_>>(),
        &[6],
    )
    .unwrap();
    let (values, lengths) =
        masked_select_jagged_1d(&i64t(&i["values"]), &i64t(&i["lengths"]), &mask).unwrap();
    assert_values("masked_select values", &values, &c["outputs"][0]);
    assert_values("masked_select lengths", &lengths, &c["outputs"][1]);

    let c = case(&g, "segment_sum_csr");
    let i = &c["inputs"];
    let out = segment_sum_csr(2, &i64t(&i["csr_seg"]), &f32t(&i["values"])).unwrap();
    assert_close("segment_sum_csr", &out, &c["outputs"], TOL);

    let c = case(&g, "stacked_j1d");
    let i = &c["inputs"];
    let outs = stacked_jagged_1d_to_dense(
        &i64t(&i["values"]),
        &i64t(&i["lengths"]),
        &usizes(&i["offset_per_key"]),
        &usizes(&i["max_lengths_per_key"]),
        -1.0,
    )
    .unwrap();
    assert_eq!(outs.len(), 2);
    for (k, out) in outs.iter().enumerate() {
        assert_close("stacked_j1d", out, &c["outputs"][k], 0.0);
    }

    let c = case(&g, "expand_into_jagged_permute");
    let i = &c["inputs"];
    let out = expand_into_jagged_permute(
        &i64t(&i["permute"]),
        &i64t(&i["input_offset"]),
        &i64t(&i["output_offset"]),
        6,
    )
    .unwrap();
    assert_values("expand_into_jagged_permute", &out, &c["outputs"]);
}

/// Every case of the golden file is exercised by one of the tests above.
#[test]
fn every_golden_case_is_covered() {
    let source = include_str!("jagged_golden.rs");
    let g = golden();
    let cases = g["cases"].as_array().unwrap();
    assert_eq!(cases.len(), 54);
    for c in cases {
        let name = c["name"].as_str().unwrap();
        let covered = source.contains(&format!("\"{name}\""))
            || c["op"].as_str().unwrap().ends_with("_cumsum");
        assert!(covered, "golden case {name} is not tested");
    }
}
