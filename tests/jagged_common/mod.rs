//! Shared helpers of the jagged test files: reading golden JSON into tensors and comparing.
#![allow(dead_code)]

use embers::{DType, Tensor};
use serde_json::Value;

/// Loads `tests/golden/<file>`.
pub fn load(file: &str) -> Value {
    let path = format!("{}/tests/golden/{file}", env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    serde_json::from_str(&text).unwrap()
}

/// The case called `name`.
pub fn case<'a>(golden: &'a Value, name: &str) -> &'a Value {
    golden["cases"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == name)
        .unwrap_or_else(|| panic!("no case {name}"))
}

fn scalar(v: &Value) -> f64 {
    match v {
        Value::Number(n) => n.as_f64().unwrap(),
        Value::Bool(b) => f64::from(u8::from(*b)),
        Value::String(s) if s == "nan" => f64::NAN,
        Value::String(s) if s == "inf" => f64::INFINITY,
        Value::String(s) if s == "-inf" => f64::NEG_INFINITY,
        Value::Null => f64::NAN,
        other => panic!("not a number: {other}"),
    }
}

/// Flattens nested lists into (row-major values, shape). `null` rows become NaN markers.
pub fn flat(v: &Value) -> (Vec<f64>, Vec<usize>) {
    match v {
        Value::Array(items) => {
            if items.is_empty() {
                return (Vec::new(), vec![0]);
            }
            let inner_shape = items
                .iter()
                .find(|x| !x.is_null())
                .map(|x| flat(x).1)
                .unwrap_or_default();
            let inner_n: usize = inner_shape.iter().product();
            let mut out = Vec::new();
            for item in items {
                if item.is_null() {
                    out.extend(std::iter::repeat_n(f64::NAN, inner_n));
                } else {
                    out.extend(flat(item).0);
                }
            }
            let mut shape = vec![items.len()];
            shape.extend(inner_shape);
            (out, shape)
        }
        s => (vec![scalar(s)], vec![]),
    }
}

pub fn f32t(v: &Value) -> Tensor {
    let (d, s) = flat(v);
    Tensor::from_vec(d.into_iter().map(|x| x as f32).collect::<Vec<_>>(), &s).unwrap()
}

pub fn f64t(v: &Value) -> Tensor {
    let (d, s) = flat(v);
    Tensor::from_vec(d, &s).unwrap()
}

pub fn i64t(v: &Value) -> Tensor {
    let (d, s) = flat(v);
    Tensor::from_vec(d.into_iter().map(|x| x as i64).collect::<Vec<_>>(), &s).unwrap()
}

pub fn i32t(v: &Value) -> Tensor {
    let (d, s) = flat(v);
    Tensor::from_vec(d.into_iter().map(|x| x as i32).collect::<Vec<_>>(), &s).unwrap()
}

/// An f32 leaf that requires grad.
pub fn leaf(v: &Value) -> Tensor {
    f32t(v).with_requires_grad(true)
}

pub fn usizes(v: &Value) -> Vec<usize> {
    flat(v).0.into_iter().map(|x| x as usize).collect()
}

pub fn strings(v: &Value) -> Vec<String> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|s| s.as_str().unwrap().to_string())
        .collect()
}

/// Asserts `t` has the expected values (and shape, unless `expected` is an empty list);
/// NaN markers (golden `null`) are skipped.
pub fn assert_close(what: &str, t: &Tensor, expected: &Value, tol: f64) {
    let (want, shape) = flat(expected);
    let got = t.to_vec_f64().unwrap();
    if !(want.is_empty() && got.is_empty()) {
        assert_eq!(t.shape(), shape.as_slice(), "{what}: shape");
    }
    assert_eq!(got.len(), want.len(), "{what}: element count");
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        if w.is_nan() {
            continue;
        }
        assert!(
            (g - w).abs() <= tol * (1.0 + w.abs()),
            "{what}: element {i}: got {g}, want {w}\n got {got:?}\nwant {want:?}"
        );
    }
}

/// Same as [`assert_close`] ignoring shape (for 1-D integer comparisons).
pub fn assert_values(what: &str, t: &Tensor, expected: &Value) {
    let (want, _) = flat(expected);
    let got = t.to_vec_f64().unwrap();
    assert_eq!(got, want, "{what}");
}

pub fn dtype_of(v: &Value) -> DType {
    if v.as_str() == Some("int32") {
        DType::I32
    } else {
        DType::I64
    }
}
