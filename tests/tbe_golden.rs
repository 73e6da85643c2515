//! The training and inference TBEs against FBGEMM's golden vectors (`tests/golden/tbe.json`).
//!
//! Where FBGEMM's CPU build is mathematically wrong (MEAN + per-sample weights dropping 1/L in
//! backward, a shared table stepped once per feature, weight decay ignored) embers does the
//! right thing: those values are checked against a float64 reference of the right rule, and the
//! same reference run with FBGEMM's quirks is checked against the golden file, so the oracle is
//! itself validated by FBGEMM's numbers.

#[path = "support/tbe_reference.rs"]
mod tbe_reference;

use embers::embedding::{
    FusedOptimizer, OutputDType, PoolingMode, QuantizedTableBatchedEmbedding,
    TableBatchedEmbedding, TableSpec, TbeConfig, TbeInput, WeightDecay, WeightType,
};
use embers::{DType, Tensor};
use serde_json::Value;
use tbe_reference::{assert_close, RefDecay, RefOptimizer, RefPooling, RefTbe};

const GOLDEN: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/golden/tbe.json");

fn golden() -> Value {
    serde_json::from_str(&std::fs::read_to_string(GOLDEN).expect("read tbe.json")).unwrap()
}

fn f64s(v: &Value) -> Vec<f64> {
    match v {
        Value::Array(a) => a.iter().flat_map(f64s).collect(),
        Value::Number(n) => vec![n.as_f64().unwrap()],
        Value::String(s) => vec![s.parse::<f64>().unwrap()],
        other => panic!("not a number: {other}"),
    }
}

fn i64s(v: &Value) -> Vec<i64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_i64().unwrap())
        .collect()
}

fn f32s(v: &Value) -> Vec<f32> {
    f64s(v).into_iter().map(|x| x as f32).collect()
}

fn widen(v: &[f32]) -> Vec<f64> {
    v.iter().map(|&x| x as f64).collect()
}

struct CaseSetup {
    tbe: TableBatchedEmbedding,
    reference: RefTbe,
    quirk_reference: RefTbe,
    deviates: bool,
}

fn setup(case: &Value) -> CaseSetup {
    let tables: Vec<(usize, usize)> = case["tables"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| {
            (
                t["rows"].as_u64().unwrap() as usize,
                t["dim"].as_u64().unwrap() as usize,
            )
        })
        .collect();
    let ftm: Vec<usize> = i64s(&case["feature_table_map"])
        .iter()
        .map(|&x| x as usize)
        .collect();
    let pooling = PoolingMode::from_fbgemm_name(case["pooling_mode"].as_str().unwrap()).unwrap();
    let args = &case["optimizer_args"];
    let lr = args["learning_rate"].as_f64().unwrap();
    let eps = args["eps"].as_f64().unwrap();
    let (opt, ref_opt) = match case["optimizer"].as_str().unwrap() {
        "EXACT_SGD" => (
            FusedOptimizer::Sgd { lr: lr as f32 },
            RefOptimizer::Sgd { lr },
        ),
        "EXACT_ADAGRAD" => (
            FusedOptimizer::Adagrad {
                lr: lr as f32,
                eps: eps as f32,
            },
            RefOptimizer::Adagrad { lr, eps },
        ),
        "EXACT_ROWWISE_ADAGRAD" => (
            FusedOptimizer::RowWiseAdagrad {
                lr: lr as f32,
                eps: eps as f32,
            },
            RefOptimizer::RowWiseAdagrad { lr, eps },
        ),
        other => panic!("unexpected optimizer {other}"),
    };
    let (decay, ref_decay) = match (args.get("weight_decay"), args.get("weight_decay_mode")) {
        (Some(wd), Some(mode)) => {
            let wd = wd.as_f64().unwrap();
            match mode.as_str().unwrap() {
                "L2" => (WeightDecay::L2(wd as f32), RefDecay::L2(wd)),
                "DECOUPLE" => (WeightDecay::Decoupled(wd as f32), RefDecay::Decoupled(wd)),
                m => panic!("unexpected decay mode {m}"),
            }
        }
        _ => (WeightDecay::None, RefDecay::None),
    };
    let specs = tables
        .iter()
        .enumerate()
        .map(|(t, &(r, d))| TableSpec::new(format!("t{t}"), r, d))
        .collect();
    let mut config = TbeConfig::new(specs, ftm.clone(), pooling, opt);
    config.weight_decay = decay;
    let tbe = TableBatchedEmbedding::new(config).unwrap();
    let initial: Vec<Vec<f64>> = case["initial_weights"]
        .as_array()
        .unwrap()
        .iter()
        .map(f64s)
        .collect();
    for (t, w) in initial.iter().enumerate() {
        tbe.set_table_weights(t, &w.iter().map(|&x| x as f32).collect::<Vec<_>>())
            .unwrap();
    }
    assert_eq!(
        tbe.d_offsets(),
        i64s(&case["D_offsets"])
            .iter()
            .map(|&x| x as usize)
            .collect::<Vec<_>>()
    );
    assert_eq!(
        tbe.weights_offsets(),
        i64s(&case["weights_offsets_elements"])
            .iter()
            .map(|&x| x as usize)
            .collect::<Vec<_>>()
    );
    let ref_pool = match pooling {
        PoolingMode::Sum => RefPooling::Sum,
        PoolingMode::Mean => RefPooling::Mean,
        PoolingMode::None => RefPooling::None,
    };
    // The reference works on the f32 initial weights widened, like FBGEMM's inputs.
    let reference = RefTbe::new(
        tables.clone(),
        ftm.clone(),
        ref_pool,
        ref_opt,
        ref_decay,
        initial.clone(),
    );
    let mut quirk_reference =
        RefTbe::new(tables, ftm.clone(), ref_pool, ref_opt, ref_decay, initial);
    quirk_reference.fbgemm_cpu_quirks = true;
    let weighted = case["weighted"].as_bool().unwrap();
    let shared = {
        let mut s = ftm.clone();
        s.sort();
        s.dedup();
        s.len() != ftm.len()
    };
    let deviates = (pooling == PoolingMode::Mean && weighted)
        || decay != WeightDecay::None
        || (shared && !matches!(opt, FusedOptimizer::Sgd { .. }));
    CaseSetup {
        tbe,
        reference,
        quirk_reference,
        deviates,
    }
}

fn state_of(tbe: &TableBatchedEmbedding) -> Vec<f64> {
    let mut v = Vec::new();
    for t in 0..tbe.num_tables() {
        if !tbe.optimizer_state_names().is_empty() {
            v.extend(widen(&tbe.optimizer_state(0, t).unwrap()));
        }
    }
    v
}

fn weights_of(tbe: &TableBatchedEmbedding) -> Vec<f64> {
    (0..tbe.num_tables())
        .flat_map(|t| widen(&tbe.table_weights(t).unwrap()))
        .collect()
}

fn ref_state(r: &RefTbe) -> Vec<f64> {
    r.m1.iter().flatten().copied().collect()
}

fn ref_weights(r: &RefTbe) -> Vec<f64> {
    r.weights.iter().flatten().copied().collect()
}

#[test]
fn training_cases_match_fbgemm_or_the_corrected_reference() {
    let g = golden();
    let mut checked = 0;
    let mut deviating = Vec::new();
    for case in g["cases"].as_array().unwrap() {
        if case["kind"] != "training" {
            continue;
        }
        let name = case["name"].as_str().unwrap();
        let CaseSetup {
            tbe,
            mut reference,
            mut quirk_reference,
            deviates,
        } = setup(case);
        if deviates {
            deviating.push(name.to_string());
        }
        for (s, step) in case["steps"].as_array().unwrap().iter().enumerate() {
            let what = |x: &str| format!("{name} step {} {x}", s + 1);
            let indices = i64s(&step["indices"]);
            let offsets = i64s(&step["offsets"]);
            let psw: Option<Vec<f32>> = step["per_sample_weights"]
                .as_array()
                .map(|_| f32s(&step["per_sample_weights"]));
            let psw64 = psw.as_ref().map(|w| widen(w));
            let idx_t = Tensor::from_vec(indices.clone(), &[indices.len()]).unwrap();
            let off_t = Tensor::from_vec(offsets.clone(), &[offsets.len()]).unwrap();
            let psw_t = psw.as_ref().map(|w| {
                Tensor::from_vec(w.clone(), &[w.len()])
                    .unwrap()
                    .with_requires_grad(true)
            });
            let out = tbe.forward(&idx_t, &off_t, psw_t.as_ref()).unwrap();
            let out_v = widen(&out.to_vec::<f32>().unwrap());
            let grad_out = f32s(&step["grad_output"]);
            let grad_t = Tensor::from_vec(grad_out.clone(), out.shape()).unwrap();
            let grad64 = widen(&grad_out);

            // The quirk reference must reproduce FBGEMM exactly where FBGEMM is the oracle.
            let q_out = quirk_reference.forward(&indices, &offsets, psw64.as_deref());
            let q_psw = quirk_reference.backward(&indices, &offsets, psw64.as_deref(), &grad64);
            assert_close(
                &q_out,
                &f64s(&step["output"]),
                1e-6,
                1e-6,
                &what("quirk-reference output"),
            );
            assert_close(
                &ref_weights(&quirk_reference),
                &f64s(&step["weights_after"]),
                1e-5,
                1e-6,
                &what("quirk-reference weights"),
            );
            assert_close(
                &ref_state(&quirk_reference),
                &f64s(&step["optimizer_states_after"]),
                1e-5,
                1e-6,
                &what("quirk-reference state"),
            );
            if let Some(q) = q_psw {
                assert_close(
                    &q,
                    &f64s(&step["per_sample_weights_grad"]),
                    1e-5,
                    1e-6,
                    &what("quirk-reference psw grad"),
                );
            }

            let r_out = reference.forward(&indices, &offsets, psw64.as_deref());
            let r_psw = reference.backward(&indices, &offsets, psw64.as_deref(), &grad64);
            out.backward_with(&grad_t, false).unwrap();
            let psw_grad = psw_t
                .as_ref()
                .map(|w| widen(&w.grad().unwrap().to_vec::<f32>().unwrap()));

            if !deviates || s == 0 {
                // Forward of the first step only depends on the initial weights.
                assert_close(&out_v, &f64s(&step["output"]), 1e-6, 1e-6, &what("output"));
            }
            assert_close(&out_v, &r_out, 1e-6, 1e-6, &what("output vs f64 reference"));
            if deviates {
                assert_close(
                    &weights_of(&tbe),
                    &ref_weights(&reference),
                    1e-5,
                    1e-6,
                    &what("weights vs corrected reference"),
                );
                assert_close(
                    &state_of(&tbe),
                    &ref_state(&reference),
                    1e-5,
                    1e-6,
                    &what("state vs corrected reference"),
                );
                if let (Some(a), Some(e)) = (&psw_grad, &r_psw) {
                    assert_close(a, e, 1e-5, 1e-6, &what("psw grad vs corrected reference"));
                }
            } else {
                assert_close(
                    &weights_of(&tbe),
                    &f64s(&step["weights_after"]),
                    1e-5,
                    1e-6,
                    &what("weights_after"),
                );
                assert_close(
                    &state_of(&tbe),
                    &f64s(&step["optimizer_states_after"]),
                    1e-5,
                    1e-6,
                    &what("optimizer_states_after"),
                );
                if let Some(a) = &psw_grad {
                    assert_close(
                        a,
                        &f64s(&step["per_sample_weights_grad"]),
                        1e-5,
                        1e-6,
                        &what("per_sample_weights_grad"),
                    );
                }
            }
            checked += 1;
        }
    }
    assert_eq!(checked, 40, "20 training cases × 2 steps");
    // The deviations are exactly the documented FBGEMM CPU quirks.
    assert_eq!(deviating.len(), 10, "{deviating:?}");
}

#[test]
fn deviating_cases_really_differ_from_fbgemm_cpu() {
    // Guard against the corrected rule silently equalling FBGEMM's: for each quirk at least one
    // value after the first step must differ from the golden file.
    let g = golden();
    for case in g["cases"].as_array().unwrap() {
        if case["kind"] != "training" {
            continue;
        }
        let CaseSetup { tbe, deviates, .. } = setup(case);
        if !deviates {
            continue;
        }
        let step = &case["steps"][0];
        let indices = i64s(&step["indices"]);
        let offsets = i64s(&step["offsets"]);
        let psw = step["per_sample_weights"]
            .as_array()
            .map(|_| f32s(&step["per_sample_weights"]));
        let mut input = TbeInput::new(&indices[..], &offsets[..]);
        if let Some(w) = &psw {
            input = input.with_weights(w);
        }
        tbe.backward_fused(input, &f32s(&step["grad_output"]))
            .unwrap();
        let ours = weights_of(&tbe);
        let theirs = f64s(&step["weights_after"]);
        let max_diff = ours
            .iter()
            .zip(&theirs)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f64::max);
        assert!(
            max_diff > 1e-4,
            "{}: expected a deliberate deviation, max diff {max_diff}",
            case["name"]
        );
    }
}

fn weight_type(name: &str) -> WeightType {
    WeightType::from_fbgemm_name(name).unwrap()
}

#[test]
fn inference_cases_match_fbgemm() {
    let g = golden();
    let mut runs_checked = 0;
    for case in g["cases"].as_array().unwrap() {
        if case["kind"] != "inference" {
            continue;
        }
        let name = case["name"].as_str().unwrap();
        let tables = case["tables"].as_array().unwrap();
        let specs: Vec<TableSpec> = tables
            .iter()
            .map(|t| {
                TableSpec::new(
                    t["name"].as_str().unwrap(),
                    t["rows"].as_u64().unwrap() as usize,
                    t["dim"].as_u64().unwrap() as usize,
                )
            })
            .collect();
        let types: Vec<WeightType> = tables
            .iter()
            .map(|t| weight_type(t["weight_type"].as_str().unwrap()))
            .collect();
        let ftm: Vec<usize> = (0..specs.len()).collect();
        for run in case["runs"].as_array().unwrap() {
            let pooling =
                PoolingMode::from_fbgemm_name(run["pooling_mode"].as_str().unwrap()).unwrap();
            let mut q = QuantizedTableBatchedEmbedding::new(
                specs.clone(),
                types.clone(),
                ftm.clone(),
                pooling,
            )
            .unwrap();
            assert_eq!(
                q.table_byte_offsets().to_vec(),
                i64s(&case["weights_physical_offsets_bytes"])
                    .iter()
                    .map(|&x| x as usize)
                    .collect::<Vec<_>>(),
                "{name}: 128-byte aligned table starts"
            );
            for (t, table) in tables.iter().enumerate() {
                let ty = types[t];
                assert_eq!(
                    ty.row_bytes(specs[t].dim),
                    table["row_bytes"].as_u64().unwrap() as usize
                );
                let stored: Vec<u8> = table["stored_rows"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .flat_map(|r| i64s(r).into_iter().map(|b| b as u8))
                    .collect();
                if table["float_source"].is_array() {
                    // Quantising FBGEMM's float source must give FBGEMM's bytes exactly.
                    q.quantize_table_from(t, &f32s(&table["float_source"]))
                        .unwrap();
                    assert_eq!(
                        q.table_bytes(t).unwrap(),
                        &stored[..],
                        "{name} table {t} ({ty:?}) quantised bytes"
                    );
                } else {
                    q.set_table_bytes(t, &stored).unwrap();
                }
                assert_close(
                    &widen(&q.dequantize_table(t).unwrap()),
                    &widen(&f32s(&table["dequantized_rows_via_tbe"])),
                    0.0,
                    0.0,
                    &format!("{name} table {t} ({ty:?}) dequantised"),
                );
            }
            let out_dtype = match run["output_dtype"].as_str().unwrap() {
                "FP32" => OutputDType::F32,
                "FP16" => OutputDType::F16,
                other => panic!("unexpected output dtype {other}"),
            };
            let q = q.with_output_dtype(out_dtype);
            let indices: Vec<i32> = i64s(&run["indices"]).iter().map(|&x| x as i32).collect();
            let offsets: Vec<i32> = i64s(&run["offsets"]).iter().map(|&x| x as i32).collect();
            let psw = run["per_sample_weights"]
                .as_array()
                .map(|_| f32s(&run["per_sample_weights"]));
            let mut input = TbeInput::new(&indices[..], &offsets[..]);
            if let Some(w) = &psw {
                input = input.with_weights(w);
            }
            let out = q.forward(input).unwrap();
            let expected = f64s(&run["output"]);
            match out_dtype {
                OutputDType::F32 => {
                    assert_eq!(out.dtype(), DType::F32);
                    assert_close(
                        &out.to_vec_f64().unwrap(),
                        &expected,
                        1e-6,
                        1e-6,
                        &format!("{name} {:?}", run["pooling_mode"]),
                    );
                }
                _ => {
                    assert_eq!(out.dtype(), DType::F16);
                    // One fp16 rounding of an f32 sum whose order may differ: 1 ulp of fp16.
                    assert_close(
                        &out.to_vec_f64().unwrap(),
                        &expected,
                        1e-3,
                        1e-6,
                        &format!("{name} fp16 output"),
                    );
                }
            }
            runs_checked += 1;
        }
    }
    assert_eq!(runs_checked, 10);
}
