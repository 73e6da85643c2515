//! The quantized communication codecs: round-trip error on U[0, 1) within FBGEMM's bounds
//! (FP16/BF16/INT8 0.005, FP8 0.05), the bytes each takes, the E4M3 format against its
//! definition, loss scaling, and bad input.

use embers::distributed::codec::{fp8_e4m3, fp8_e4m3_to_f32, Codec, CommPrecision};
use embers::tensor::rng::seeded;
use rand::Rng as _;

const ROW: usize = 64;

fn uniform(n: usize) -> Vec<f32> {
    let mut rng = seeded(7);
    (0..n).map(|_| rng.random_range(0.0f32..1.0)).collect()
}

fn max_error(precision: CommPrecision, values: &[f32]) -> f32 {
    let codec = Codec::new(precision);
    let bytes = codec.encode(values, ROW).unwrap();
    assert_eq!(bytes.len(), precision.encoded_len(values.len(), ROW));
    let back = codec.decode(&bytes, values.len(), ROW).unwrap();
    (values.iter().zip(&back))
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f32::max)
}

#[test]
fn round_trips_on_uniform_values_are_within_fbgemms_bounds() {
    let values = uniform(ROW * 200);
    let n = values.len();
    assert_eq!(max_error(CommPrecision::Fp32, &values), 0.0);
    for (precision, bound, bytes) in [
        (CommPrecision::Fp16, 0.0005, 2 * n),
        (CommPrecision::Bf16, 0.002, 2 * n),
        (CommPrecision::Int8, 0.002, n + 8 * 200),
        (CommPrecision::Fp8, 0.032, n),
    ] {
        let e = max_error(precision, &values);
        assert!(
            e > 0.0 && e <= bound,
            "{precision:?}: max error {e}, bound {bound}"
        );
        assert_eq!(precision.encoded_len(n, ROW), bytes, "{precision:?}");
    }
}

#[test]
fn fp8_codes_follow_the_e4m3_definition() {
    // Every finite code decodes to a value that encodes back to it, in increasing order.
    let mut last = -1.0f32;
    for b in 0u8..=0x7E {
        let v = fp8_e4m3_to_f32(b);
        assert!(v > last, "code {b:#x}: {v} after {last}");
        last = v;
        assert_eq!(fp8_e4m3(v), b, "code {b:#x} ({v})");
        assert_eq!(fp8_e4m3(-v), b | 0x80, "code {:#x} ({})", b | 0x80, -v);
    }
    assert!(fp8_e4m3_to_f32(0x7F).is_nan() && fp8_e4m3_to_f32(0xFF).is_nan());
    // The format's landmarks: 2^-9 (smallest subnormal), 2^-6 (smallest normal), 1, 448.
    assert_eq!(fp8_e4m3_to_f32(0x01), 2f32.powi(-9));
    assert_eq!(fp8_e4m3_to_f32(0x08), 2f32.powi(-6));
    assert_eq!(fp8_e4m3_to_f32(0x38), 1.0);
    assert_eq!(fp8_e4m3_to_f32(0x7E), 448.0);
    // Saturation, and ties to even between 1 and 1.125.
    assert_eq!(fp8_e4m3(1000.0), 0x7E);
    assert_eq!(fp8_e4m3(-1000.0), 0xFE);
    assert_eq!(fp8_e4m3(1.0625), 0x38);
    assert_eq!(fp8_e4m3(1.0625f32.next_up()), 0x39);
    // Relative error on signed normal values: at most half a unit of the 3-bit mantissa.
    let mut rng = seeded(3);
    for _ in 0..10_000 {
        let v: f32 = rng.random_range(-300.0f32..300.0);
        if v.abs() < 2f32.powi(-6) {
            continue;
        }
        let back = fp8_e4m3_to_f32(fp8_e4m3(v));
        assert!((back - v).abs() <= v.abs() / 16.0, "{v} -> {back}");
    }
}

#[test]
fn loss_scaling_keeps_small_gradients_in_fp16() {
    let mut rng = seeded(11);
    let grads: Vec<f32> = (0..4096).map(|_| rng.random_range(1e-7f32..1e-6)).collect();
    let relative = |codec: Codec| {
        let bytes = codec.encode(&grads, ROW).unwrap();
        let back = codec.decode(&bytes, grads.len(), ROW).unwrap();
        (grads.iter().zip(&back))
            .map(|(a, b)| ((a - b) / a).abs())
            .fold(0.0f32, f32::max)
    };
    let plain = relative(Codec::new(CommPrecision::Fp16));
    let scaled = relative(
        Codec::new(CommPrecision::Fp16)
            .with_loss_scale(65536.0)
            .unwrap(),
    );
    assert!(
        plain > 0.01,
        "FP16 subnormals lose the small gradients: {plain}"
    );
    assert!(scaled < 0.001, "scaled by 2^16: {scaled}");
    assert!(Codec::new(CommPrecision::Bf16)
        .with_loss_scale(0.0)
        .is_err());
}

#[test]
fn bad_input_is_refused() {
    let codec = Codec::new(CommPrecision::Int8);
    let e = codec
        .encode(&[1.0, f32::NAN, 2.0, 3.0], 2)
        .unwrap_err()
        .to_string();
    assert!(e.contains("value 1 is NaN"), "{e}");
    let e = codec.encode(&[1.0, 2.0, 3.0], 2).unwrap_err().to_string();
    assert!(e.contains("not whole rows of 2"), "{e}");
    let bytes = codec.encode(&[1.0, 2.0, 3.0, 4.0], 2).unwrap();
    let e = codec
        .decode(&bytes[..bytes.len() - 1], 4, 2)
        .unwrap_err()
        .to_string();
    assert!(e.contains("expected 20"), "{e}");
    let e = Codec::new(CommPrecision::Fp8)
        .encode(&[f32::INFINITY], 1)
        .unwrap_err()
        .to_string();
    assert!(e.contains("value 0 is inf"), "{e}");
}
