//! Row formats against FBGEMM's quantisation ops (`tests/golden/quantization.json`): bytes
//! exactly, dequantised values exactly. Where FBGEMM's CPU ops refuse a shape (4-bit and 2-bit
//! rows with an odd packed byte count) embers still quantises, checked against a float64
//! reference of the documented rule.

use embers::embedding::quantize::{
    dequantize_row, e4m3fn_to_f32, f32_to_e4m3fn, f32_to_hfp8, fused8bit_dequantize_row,
    fused8bit_quantize_row, fused8bit_row_bytes, fused_nbit_dequantize_row,
    fused_nbit_quantize_row, fused_nbit_row_bytes, hfp8_to_f32, quantize_row, Hfp8Config,
};
use embers::embedding::WeightType;
use half::{bf16, f16};
use serde_json::Value;

const GOLDEN: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/golden/quantization.json"
);

fn golden() -> Value {
    serde_json::from_str(&std::fs::read_to_string(GOLDEN).expect("read quantization.json")).unwrap()
}

fn num(v: &Value) -> f64 {
    match v {
        Value::Number(n) => n.as_f64().unwrap(),
        Value::String(s) => s.parse::<f64>().unwrap(),
        other => panic!("not a number: {other}"),
    }
}

fn rows_f32(v: &Value) -> Vec<Vec<f32>> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|r| {
            r.as_array()
                .unwrap()
                .iter()
                .map(|x| num(x) as f32)
                .collect()
        })
        .collect()
}

fn rows_u8(v: &Value) -> Vec<Vec<u8>> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|r| {
            r.as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_u64().unwrap() as u8)
                .collect()
        })
        .collect()
}

fn rows_u16(v: &Value) -> Vec<Vec<u16>> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|r| {
            r.as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_u64().unwrap() as u16)
                .collect()
        })
        .collect()
}

/// Bit-exact equality of f32s (NaN equal to NaN).
fn assert_same_f32(a: &[f32], e: &[f32], what: &str) {
    assert_eq!(a.len(), e.len(), "{what}: length");
    for (i, (x, y)) in a.iter().zip(e).enumerate() {
        assert!(
            x.to_bits() == y.to_bits() || (x.is_nan() && y.is_nan()) || (*x == 0.0 && *y == 0.0),
            "{what}[{i}]: got {x}, expected {y}"
        );
    }
}

#[test]
fn fused_8bit_rows_match_fbgemm() {
    let g = golden();
    let mut rows_checked = 0;
    for case in g["cases"].as_array().unwrap() {
        let dim = case["dim"].as_u64().unwrap() as usize;
        let input = rows_f32(&case["input"]);
        let q = &case["fused8bit"];
        assert_eq!(
            q["out_cols"].as_u64().unwrap() as usize,
            fused8bit_row_bytes(dim)
        );
        for (r, row) in input.iter().enumerate() {
            let what = format!("dim {dim} row {r} ({})", case["row_names"][r]);
            let mut bytes = vec![0u8; fused8bit_row_bytes(dim)];
            fused8bit_quantize_row(row, &mut bytes).unwrap();
            assert_eq!(bytes, rows_u8(&q["bytes"])[r], "{what}: bytes");
            let mut deq = vec![0.0f32; dim];
            fused8bit_dequantize_row(&bytes, &mut deq).unwrap();
            assert_same_f32(
                &deq,
                &rows_f32(&q["dequantized"])[r],
                &format!("{what}: dequantized"),
            );
            let half: Vec<f32> = deq.iter().map(|&x| f16::from_f32(x).to_f32()).collect();
            assert_same_f32(
                &half,
                &rows_f32(&q["dequantized_half"])[r],
                &format!("{what}: to half"),
            );
            let b16: Vec<f32> = deq.iter().map(|&x| bf16::from_f32(x).to_f32()).collect();
            assert_same_f32(
                &b16,
                &rows_f32(&q["dequantized_bf16"])[r],
                &format!("{what}: to bf16"),
            );

            let h = &case["fused8bit_from_half"];
            let half_in = &rows_f32(&h["half_input"])[r];
            fused8bit_quantize_row(half_in, &mut bytes).unwrap();
            assert_eq!(
                bytes,
                rows_u8(&h["bytes"])[r],
                "{what}: bytes from half input"
            );
            fused8bit_dequantize_row(&bytes, &mut deq).unwrap();
            assert_same_f32(
                &deq,
                &rows_f32(&h["dequantized"])[r],
                &format!("{what}: dequantized from half"),
            );
            rows_checked += 1;
        }
    }
    assert_eq!(rows_checked, 12 * 9);
}

#[test]
fn fused_nbit_rows_match_fbgemm_where_it_accepts_the_dim() {
    let g = golden();
    let (mut checked, mut refused) = (0, 0);
    for case in g["cases"].as_array().unwrap() {
        let dim = case["dim"].as_u64().unwrap() as usize;
        let input = rows_f32(&case["input"]);
        for bits in [4u32, 2] {
            let key = format!("nbit{bits}");
            let q = &case[&key];
            if q.get("error").is_some() {
                refused += 1;
                continue;
            }
            assert_eq!(
                q["out_cols"].as_u64().unwrap() as usize,
                fused_nbit_row_bytes(dim, bits)
            );
            for (r, row) in input.iter().enumerate() {
                let what = format!("{key} dim {dim} row {r} ({})", case["row_names"][r]);
                let mut bytes = vec![0u8; fused_nbit_row_bytes(dim, bits)];
                fused_nbit_quantize_row(row, bits, &mut bytes).unwrap();
                assert_eq!(bytes, rows_u8(&q["bytes"])[r], "{what}: bytes");
                let mut deq = vec![0.0f32; dim];
                fused_nbit_dequantize_row(&bytes, bits, &mut deq).unwrap();
                assert_same_f32(
                    &deq,
                    &rows_f32(&q["dequantized"])[r],
                    &format!("{what}: dequantized"),
                );
                let half: Vec<f32> = deq.iter().map(|&x| f16::from_f32(x).to_f32()).collect();
                assert_same_f32(
                    &half,
                    &rows_f32(&q["dequantized_half"])[r],
                    &format!("{what}: to half"),
                );

                let h = &case[&format!("{key}_from_half")];
                let half_in: Vec<f32> = row.iter().map(|&x| f16::from_f32(x).to_f32()).collect();
                fused_nbit_quantize_row(&half_in, bits, &mut bytes).unwrap();
                assert_eq!(
                    bytes,
                    rows_u8(&h["bytes"])[r],
                    "{what}: bytes from half input"
                );
                fused_nbit_dequantize_row(&bytes, bits, &mut deq).unwrap();
                assert_same_f32(
                    &deq,
                    &rows_f32(&h["dequantized"])[r],
                    &format!("{what}: dequantized from half"),
                );

                // The TBE row layout holds the same codes with the header moved in front.
                let ty = if bits == 4 {
                    WeightType::Int4
                } else {
                    WeightType::Int2
                };
                let mut tbe_row = vec![0u8; ty.row_bytes(dim)];
                quantize_row(ty, row, &mut tbe_row).unwrap();
                let n = bytes.len() - 4;
                fused_nbit_quantize_row(row, bits, &mut bytes).unwrap();
                assert_eq!(&tbe_row[4..], &bytes[..n], "{what}: TBE row codes");
                assert_eq!(&tbe_row[..4], &bytes[n..], "{what}: TBE row header");
                checked += 1;
            }
        }
    }
    assert_eq!(
        checked,
        9 * (7 + 5),
        "9 rows × (7 dims for 4-bit + 5 for 2-bit)"
    );
    assert_eq!(refused, 5 + 7);
}

/// The documented 4/2-bit rule evaluated in f64 from the fp16 header: every code is the nearest
/// level (ties either way), and dequantised values are within half a step of the input.
fn check_nbit_against_f64_reference(row: &[f32], bits: u32, ty: WeightType, what: &str) {
    let dim = row.len();
    let mut bytes = vec![0u8; ty.row_bytes(dim)];
    quantize_row(ty, row, &mut bytes).unwrap();
    let scale = f16::from_le_bytes([bytes[0], bytes[1]]).to_f64();
    let bias = f16::from_le_bytes([bytes[2], bytes[3]]).to_f64();
    let min = row.iter().fold(f64::INFINITY, |a, &x| a.min(x as f64));
    let max = row.iter().fold(f64::NEG_INFINITY, |a, &x| a.max(x as f64));
    let levels = ((1u32 << bits) - 1) as f64;
    assert_eq!(
        bias,
        f16::from_f64(min).to_f64(),
        "{what}: bias = fp16(min)"
    );
    let raw_scale = (max - bias) / levels;
    if raw_scale > 1e-4 {
        assert!(
            (scale - raw_scale).abs() <= raw_scale * 1e-3,
            "{what}: scale {scale} vs {raw_scale}"
        );
    }
    let mut deq = vec![0.0f32; dim];
    dequantize_row(ty, &bytes, &mut deq).unwrap();
    for (j, (&x, &y)) in row.iter().zip(&deq).enumerate() {
        let per_byte = 8 / bits as usize;
        let code = (bytes[4 + j / per_byte] >> ((j % per_byte) as u32 * bits)) & ((1 << bits) - 1);
        let exact = ((x as f64 - bias) / scale).clamp(0.0, levels);
        assert!(
            (code as f64 - exact).abs() <= 0.5 + 1e-3,
            "{what}[{j}]: code {code} for {exact}"
        );
        assert!(
            (y as f64 - (code as f64 * scale + bias)).abs() <= 1e-6 * (1.0 + y.abs() as f64),
            "{what}[{j}]: value"
        );
        if raw_scale > 1e-4 && raw_scale < 1e3 {
            assert!(
                (y as f64 - x as f64).abs() <= scale * 0.5 + 1e-3 * scale + f64::EPSILON,
                "{what}[{j}]: {y} vs {x}"
            );
        }
    }
    // Unused bits of the last byte stay zero.
    let used = dim * bits as usize;
    let total = (bytes.len() - 4) * 8;
    if used < total {
        assert_eq!(
            bytes[bytes.len() - 1] >> (8 - (total - used)),
            0,
            "{what}: padding bits"
        );
    }
}

#[test]
fn nbit_rows_of_dims_fbgemm_refuses_follow_the_f64_reference() {
    let g = golden();
    let mut checked = 0;
    for case in g["cases"].as_array().unwrap() {
        let dim = case["dim"].as_u64().unwrap() as usize;
        for bits in [4u32, 2] {
            if case[&format!("nbit{bits}")].get("error").is_none() {
                continue;
            }
            let ty = if bits == 4 {
                WeightType::Int4
            } else {
                WeightType::Int2
            };
            for (r, row) in rows_f32(&case["input"]).iter().enumerate() {
                if row.iter().any(|x| x.abs() > 65504.0) {
                    continue; // beyond fp16: the header itself cannot represent the range
                }
                check_nbit_against_f64_reference(
                    row,
                    bits,
                    ty,
                    &format!("{ty:?} dim {dim} row {r}"),
                );
                checked += 1;
            }
        }
    }
    assert_eq!(
        checked,
        12 * 7,
        "7 of the 9 rows fit fp16 (the 7e4 and 123456.78 rows do not)"
    );
}

#[test]
fn hfp8_matches_fbgemm_for_every_config() {
    let g = golden();
    for case in g["cases"].as_array().unwrap() {
        let input = rows_f32(&case["input"]);
        for cfg_v in case["hfp8"].as_array().unwrap() {
            let cfg = Hfp8Config::new(
                cfg_v["ebits"].as_u64().unwrap() as u32,
                cfg_v["exponent_bias"].as_i64().unwrap() as i32,
                num(&cfg_v["max_pos"]) as f32,
            )
            .unwrap();
            let bytes = rows_u8(&cfg_v["bytes"]);
            let deq = rows_f32(&cfg_v["dequantized"]);
            for (r, row) in input.iter().enumerate() {
                let ours: Vec<u8> = row.iter().map(|&x| f32_to_hfp8(x, cfg)).collect();
                assert_eq!(
                    ours, bytes[r],
                    "{} dim {} row {r}",
                    cfg_v["name"], case["dim"]
                );
                let back: Vec<f32> = ours.iter().map(|&b| hfp8_to_f32(b, cfg)).collect();
                assert_same_f32(&back, &deq[r], &format!("{} decode", cfg_v["name"]));
            }
        }
    }
    let special = &g["hfp8_special"];
    let input = rows_f32(&special["input"]);
    for cfg_v in special["configs"].as_array().unwrap() {
        let cfg = Hfp8Config::new(
            cfg_v["ebits"].as_u64().unwrap() as u32,
            cfg_v["exponent_bias"].as_i64().unwrap() as i32,
            num(&cfg_v["max_pos"]) as f32,
        )
        .unwrap();
        let ours: Vec<u8> = input[0].iter().map(|&x| f32_to_hfp8(x, cfg)).collect();
        assert_eq!(
            ours,
            rows_u8(&cfg_v["bytes"])[0],
            "{} special values",
            cfg_v["name"]
        );
        let back: Vec<f32> = ours.iter().map(|&b| hfp8_to_f32(b, cfg)).collect();
        assert_same_f32(&back, &rows_f32(&cfg_v["dequantized"])[0], "special decode");
    }
    for table in special["decode_tables"].as_array().unwrap() {
        let (ebits, bias) = (
            table["ebits"].as_u64().unwrap() as u32,
            table["exponent_bias"].as_i64().unwrap() as i32,
        );
        let bytes: Vec<u8> = table["byte"]
            .as_array()
            .unwrap()
            .iter()
            .map(|b| b.as_u64().unwrap() as u8)
            .collect();
        let values: Vec<f32> = table["value"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| num(v) as f32)
            .collect();
        assert_eq!(bytes.len(), 256);
        let format =
            Hfp8Config::new(ebits, bias, Hfp8Config::largest(ebits, bias).unwrap()).unwrap();
        let ours: Vec<f32> = bytes.iter().map(|&b| hfp8_to_f32(b, format)).collect();
        // Every code decodes finite, the largest to the format's largest value.
        assert_eq!(
            ours.iter().cloned().fold(f32::MIN, f32::max),
            format.max_pos(),
            "{}",
            table["name"]
        );
        assert_same_f32(&ours, &values, &format!("decode table {}", table["name"]));
    }
}

#[test]
fn hfp8_formats_the_bit_arithmetic_cannot_hold_are_refused() {
    for (ebits, bias) in [(0, 7), (8, 7), (4, -1), (4, 128), (u32::MAX, 0)] {
        let msg = Hfp8Config::largest(ebits, bias).unwrap_err().to_string();
        assert!(msg.contains("1 to 7 exponent bits"), "{msg}");
        assert!(Hfp8Config::new(ebits, bias, 1.0).is_err());
    }
    // e4 bias 7 tops out at 480; 240 (the TBE format) and 480 fit, 481 does not.
    assert_eq!(Hfp8Config::largest(4, 7).unwrap(), 480.0);
    assert_eq!(Hfp8Config::new(4, 7, 240.0).unwrap(), Hfp8Config::TBE);
    assert!(Hfp8Config::new(4, 7, 480.0).is_ok());
    for max_pos in [481.0, 0.0, -1.0, f32::NAN, f32::INFINITY] {
        let msg = Hfp8Config::new(4, 7, max_pos).unwrap_err().to_string();
        assert!(msg.contains("max_pos"), "{msg}");
    }
    // Every format the constructor takes round-trips its largest value and saturates past it.
    for ebits in 1..=7 {
        for bias in [0, 1, 7, 15, 31, 63, 127] {
            let largest = Hfp8Config::largest(ebits, bias).unwrap();
            let cfg = Hfp8Config::new(ebits, bias, largest).unwrap();
            for x in [largest, -largest] {
                assert_eq!(hfp8_to_f32(f32_to_hfp8(x, cfg), cfg), x, "e{ebits} b{bias}");
            }
            assert_eq!(
                hfp8_to_f32(f32_to_hfp8(f32::INFINITY, cfg), cfg),
                largest,
                "e{ebits} b{bias}"
            );
        }
    }
}

#[test]
fn fp16_and_bf16_rows_match_torch_rounding() {
    let g = golden();
    for case in g["cases"].as_array().unwrap() {
        let dim = case["dim"].as_u64().unwrap() as usize;
        for (r, row) in rows_f32(&case["input"]).iter().enumerate() {
            for (key, ty) in [
                ("fp16", WeightType::Fp16),
                ("bf16", WeightType::Bf16),
                ("fbgemm_bf16", WeightType::Bf16),
            ] {
                let mut bytes = vec![0u8; ty.row_bytes(dim)];
                quantize_row(ty, row, &mut bytes).unwrap();
                let bits: Vec<u16> = bytes
                    .chunks_exact(2)
                    .map(|b| u16::from_le_bytes([b[0], b[1]]))
                    .collect();
                assert_eq!(
                    bits,
                    rows_u16(&case[key]["bits"])[r],
                    "{key} dim {dim} row {r}"
                );
                let mut deq = vec![0.0f32; dim];
                dequantize_row(ty, &bytes, &mut deq).unwrap();
                assert_same_f32(
                    &deq,
                    &rows_f32(&case[key]["value"])[r],
                    &format!("{key} dim {dim} row {r} value"),
                );
            }
        }
    }
}

#[test]
fn int8_tbe_rows_are_fbgemm_fused_rows_with_an_fp16_header_in_front() {
    let g = golden();
    for case in g["cases"].as_array().unwrap() {
        let dim = case["dim"].as_u64().unwrap() as usize;
        for row in rows_f32(&case["input"]) {
            let mut fused = vec![0u8; fused8bit_row_bytes(dim)];
            fused8bit_quantize_row(&row, &mut fused).unwrap();
            let mut tbe = vec![0u8; WeightType::Int8.row_bytes(dim)];
            quantize_row(WeightType::Int8, &row, &mut tbe).unwrap();
            assert_eq!(&tbe[4..], &fused[..dim]);
            let scale = f32::from_le_bytes(fused[dim..dim + 4].try_into().unwrap());
            let bias = f32::from_le_bytes(fused[dim + 4..].try_into().unwrap());
            assert_eq!(&tbe[..2], &f16::from_f32(scale).to_le_bytes());
            assert_eq!(&tbe[2..4], &f16::from_f32(bias).to_le_bytes());
        }
    }
}

#[test]
fn ocp_e4m3fn_encodes_and_decodes_every_code() {
    // Known values of the OCP spec.
    assert_eq!(f32_to_e4m3fn(448.0), 0x7e);
    assert_eq!(f32_to_e4m3fn(-448.0), 0xfe);
    assert_eq!(f32_to_e4m3fn(1.0), 0x38);
    assert_eq!(f32_to_e4m3fn(2f32.powi(-9)), 0x01, "smallest sub-normal");
    assert_eq!(f32_to_e4m3fn(2f32.powi(-6)), 0x08, "smallest normal");
    assert_eq!(f32_to_e4m3fn(1000.0), 0x7e, "saturates");
    assert_eq!(f32_to_e4m3fn(f32::INFINITY), 0x7e, "saturates");
    assert_eq!(f32_to_e4m3fn(f32::NAN) & 0x7f, 0x7f);
    assert_eq!(f32_to_e4m3fn(1.0625), 0x38, "tie to even (down)");
    assert_eq!(f32_to_e4m3fn(1.1875), 0x3a, "tie to even (up)");
    assert!(e4m3fn_to_f32(0x7f).is_nan() && e4m3fn_to_f32(0xff).is_nan());
    // f64 reference decode: sign · 2^(e−7) · (1 + m/8), sub-normals 2^−6 · m/8.
    for b in 0u8..=255 {
        if b & 0x7f == 0x7f {
            continue;
        }
        let (s, e, m) = ((b >> 7) as i32, ((b >> 3) & 15) as i32, (b & 7) as f64);
        let mag = if e == 0 {
            2f64.powi(-6) * m / 8.0
        } else {
            2f64.powi(e - 7) * (1.0 + m / 8.0)
        };
        let expected = if s == 1 { -mag } else { mag };
        assert_eq!(e4m3fn_to_f32(b) as f64, expected, "decode {b:#04x}");
        // Every finite code round-trips.
        assert_eq!(f32_to_e4m3fn(e4m3fn_to_f32(b)), b, "round trip {b:#04x}");
    }
    // Rounding lands on the nearest code, checked against the f64 grid.
    let mut rng = 0x2545F4914F6CDD1Du64;
    for _ in 0..10_000 {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        let x = ((rng >> 11) as f64 / (1u64 << 53) as f64 - 0.5) * 900.0;
        let x = x as f32;
        let y = e4m3fn_to_f32(f32_to_e4m3fn(x)) as f64;
        let best = (0u8..=255)
            .filter(|b| b & 0x7f != 0x7f)
            .map(|b| (e4m3fn_to_f32(b) as f64 - x as f64).abs())
            .fold(f64::INFINITY, f64::min);
        assert!(
            (y - x as f64).abs() <= best + 1e-12 || x.abs() > 448.0,
            "{x} → {y}, best error {best}"
        );
    }
}

#[test]
fn every_weight_type_round_trips_within_its_precision_for_any_dim() {
    for dim in [1usize, 2, 3, 5, 7, 9, 13, 31, 33, 130] {
        let row: Vec<f32> = (0..dim)
            .map(|j| ((j * 37 % 17) as f32 - 8.0) / 5.0)
            .collect();
        let (min, max) = row
            .iter()
            .fold((f32::INFINITY, f32::NEG_INFINITY), |(a, b), &x| {
                (a.min(x), b.max(x))
            });
        for ty in WeightType::ALL {
            let mut bytes = vec![0u8; ty.row_bytes(dim)];
            quantize_row(ty, &row, &mut bytes).unwrap();
            let mut back = vec![0.0f32; dim];
            dequantize_row(ty, &bytes, &mut back).unwrap();
            let range = (max - min).max(1e-3);
            let tol = match ty {
                WeightType::Fp32 => 0.0,
                WeightType::Fp16 => 1e-3,
                WeightType::Bf16 => 1e-2,
                WeightType::Fp8 | WeightType::Fp8E4m3fn => 0.07,
                // Half a step, plus the fp16 rounding of the scale/bias header.
                WeightType::Int8 => range / 255.0 + 1e-3,
                WeightType::Int4 => range / 15.0 + 1e-3,
                WeightType::Int2 => range / 3.0 + 1e-3,
            };
            for (j, (&a, &b)) in row.iter().zip(&back).enumerate() {
                assert!(
                    (a - b).abs() <= tol * a.abs().max(1.0),
                    "{ty:?} dim {dim}[{j}]: {a} → {b}"
                );
            }
        }
    }
}

/// An operator refuses rows it cannot store, naming the table, the row and the value or the
/// range: a NaN (coded as the row's minimum), infinity (a NaN row), a range whose FP16 scale
/// or bias overflows (a NaN or infinite row), a value past FP16. (`quantize_row` itself
/// stores what FBGEMM stores, checked against the golden values above.) FP8 saturates, as
/// FBGEMM's.
#[test]
fn rows_that_cannot_be_stored_are_refused() {
    use embers::embedding::{PoolingMode, QuantizedTableBatchedEmbedding, TableSpec};
    for (ty, row, says) in [
        (WeightType::Int8, [f32::NAN, 1.0], "value 0 is NaN"),
        (WeightType::Int4, [1.0, f32::INFINITY], "value 1 is inf"),
        (WeightType::Int8, [0.0, 1e8], "span [0, 100000000]"),
        (WeightType::Int4, [0.0, 1e6], "span [0, 1000000]"),
        (WeightType::Int2, [-1e5, 0.0], "span [-100000, 0]"),
        (WeightType::Fp16, [0.0, 1e6], "span [0, 1000000]"),
    ] {
        let mut q = QuantizedTableBatchedEmbedding::new(
            vec![TableSpec::new("users", 3, 2)],
            vec![ty],
            vec![0],
            PoolingMode::Sum,
        )
        .unwrap();
        let before = q.table_bytes(0).unwrap().to_vec();
        let values = [[0.5, 1.5], [2.0, 3.0], row].concat();
        let e = q.quantize_table_from(0, &values).unwrap_err().to_string();
        assert!(
            e.contains("table 0 `users` row 2") && e.contains(says),
            "{ty:?}: {e}"
        );
        assert_eq!(q.table_bytes(0).unwrap(), &before[..]);
    }
    let mut q = QuantizedTableBatchedEmbedding::new(
        vec![TableSpec::new("users", 1, 2)],
        vec![WeightType::Fp8],
        vec![0],
        PoolingMode::Sum,
    )
    .unwrap();
    q.quantize_table_from(0, &[0.0, 1e6]).unwrap();
}
