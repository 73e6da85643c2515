//! Row formats: quantising FP32 rows into every [`WeightType`] and back, byte for byte as FBGEMM
//! lays them out.
//!
//! Two families of layouts exist in FBGEMM and both are provided:
//!
//! * **TBE rows** (what an inference TBE stores, [`quantize_row`] / [`dequantize_row`]): the
//!   integer types put a 4-byte header `[fp16 scale][fp16 bias]` *before* the codes. INT8 codes
//!   are computed with fp32 scale/bias (which are then narrowed to fp16 for the header); INT4/INT2
//!   codes use the fp16 scale/bias themselves.
//! * **Stand-alone fused rows** (FBGEMM's `FloatToFused8BitRowwiseQuantized` and
//!   `FloatToFusedNBitRowwiseQuantizedSBHalf`): the scale and bias come *after* the codes, fp32
//!   for 8-bit and fp16 for 4/2-bit. See [`fused8bit_quantize_row`] and
//!   [`fused_nbit_quantize_row`].
//!
//! Dequantisation is `code · scale + bias` evaluated in f32 (a multiply, then an add).
//!
//! Unlike FBGEMM's CPU quantiser, every dim ≥ 1 is accepted: a 4-bit or 2-bit row whose last
//! byte is only partly used pads it with zero bits.

use half::{bf16, f16};

use super::config::WeightType;
use crate::{Error, Result};

/// Exponent bits, exponent bias and largest magnitude of an 8-bit float format without
/// inf/NaN (FBGEMM's "HFP8"). Built checked ([`Hfp8Config::new`]), so the encoder and decoder
/// never see a format their bit arithmetic cannot hold.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Hfp8Config {
    ebits: u32,
    exponent_bias: i32,
    max_pos: f32,
}

impl Hfp8Config {
    /// The TBE FP8 weight format: 4 exponent bits, bias 7, saturating at ±240.
    pub const TBE: Hfp8Config = Hfp8Config {
        ebits: 4,
        exponent_bias: 7,
        max_pos: 240.0,
    };

    /// A format of `ebits` exponent bits (1..=7; the mantissa has `7 − ebits`) and
    /// `exponent_bias` (0..=127), saturating at ± `max_pos`, which must be above 0 and no more
    /// than the format's largest value ([`Hfp8Config::largest`]).
    pub fn new(ebits: u32, exponent_bias: i32, max_pos: f32) -> Result<Self> {
        let largest = Self::largest(ebits, exponent_bias)?;
        if !(max_pos > 0.0 && max_pos <= largest) {
            return Err(Error::invalid(
                "Hfp8Config",
                format!(
                    "max_pos {max_pos} must be above 0 and at most {largest}, the largest value \
                     of {ebits} exponent bits with bias {exponent_bias}"
                ),
            ));
        }
        Ok(Hfp8Config {
            ebits,
            exponent_bias,
            max_pos,
        })
    }

    /// The largest value of `ebits` exponent bits (1..=7) with `exponent_bias` (0..=127):
    /// `2^(2^ebits − 1 − bias) · (2 − 2^−(7 − ebits))`, every exponent code being finite.
    pub fn largest(ebits: u32, exponent_bias: i32) -> Result<f32> {
        if !(1..=7).contains(&ebits) || !(0..=127).contains(&exponent_bias) {
            return Err(Error::invalid(
                "Hfp8Config",
                format!(
                    "{ebits} exponent bits with bias {exponent_bias}: HFP8 takes 1 to 7 exponent \
                     bits and a bias from 0 to 127"
                ),
            ));
        }
        let top = (1i32 << ebits) - 1 - exponent_bias;
        let mantissa = 7 - ebits as i32;
        Ok((2f64.powi(top) * (2.0 - 2f64.powi(-mantissa))) as f32)
    }

    /// Exponent bits.
    pub fn ebits(&self) -> u32 {
        self.ebits
    }

    /// Exponent bias.
    pub fn exponent_bias(&self) -> i32 {
        self.exponent_bias
    }

    /// Values saturate at ± this.
    pub fn max_pos(&self) -> f32 {
        self.max_pos
    }
}

/// Encodes `x` as an HFP8 byte (round to nearest even, saturating at `max_pos`).
pub fn f32_to_hfp8(x: f32, cfg: Hfp8Config) -> u8 {
    let mantissa_bits = 7 - cfg.ebits;
    let bits = x.to_bits();
    let sign = bits & 0x8000_0000;
    let mut magnitude = f32::from_bits(bits & 0x7fff_ffff);
    if magnitude.is_nan() || magnitude > cfg.max_pos {
        // The format has no NaN; a NaN saturates like an overflow rather than aliasing a value.
        magnitude = cfg.max_pos;
    }
    let smallest_normal = f32::from_bits(((127 - cfg.exponent_bias + 1) as u32) << 23);
    if magnitude >= smallest_normal {
        // Adding 2^(e + 23 − mantissa_bits) pushes every mantissa bit below the kept ones out of
        // the f32 significand, so the FPU itself rounds to nearest even; subtracting it back
        // leaves the rounded value, still encoded as an f32.
        let bouncer =
            f32::from_bits((magnitude.to_bits() & 0xff80_0000) + ((23 - mantissa_bits) << 23));
        let rounded = (bouncer + magnitude) - bouncer;
        let rebased =
            (rounded.to_bits() - (((127 - cfg.exponent_bias) as u32) << 23)) << (8 - cfg.ebits);
        ((rebased | sign) >> 24) as u8
    } else {
        // Sub-normal range: a fixed-point grid whose step is 2^(1 − bias − mantissa_bits).
        // Adding a bouncer whose last significand bit is that step rounds onto the grid and
        // leaves the code in the low byte.
        let exponent = 127 + 23 + 1 - cfg.exponent_bias - mantissa_bits as i32;
        let bouncer = f32::from_bits((exponent as u32) << 23);
        let low = (bouncer + magnitude).to_bits() as u8;
        low | (sign >> 24) as u8
    }
}

/// Decodes an HFP8 byte of format `cfg` (its `max_pos` plays no part).
pub fn hfp8_to_f32(byte: u8, cfg: Hfp8Config) -> f32 {
    let (ebits, exponent_bias) = (cfg.ebits, cfg.exponent_bias);
    let sign = ((byte & 0x80) as u32) << 24;
    // Put the exponent and mantissa bits where an f32 keeps them; the f32 then holds
    // value · 2^(bias − 127), sub-normals included, and one exact multiply rebases it.
    let shifted = f32::from_bits(((byte & 0x7f) as u32) << (16 + ebits));
    let rebase = f32::from_bits(((127 + (127 - exponent_bias)) as u32) << 23);
    f32::from_bits((shifted * rebase).to_bits() | sign)
}

/// Largest finite OCP E4M3FN value.
pub const E4M3FN_MAX: f32 = 448.0;

/// Encodes `x` as OCP FP8 E4M3FN: round to nearest even; magnitudes above 448 (and ±inf)
/// saturate to ±448, NaN stays NaN (`0x7f` with the sign).
pub fn f32_to_e4m3fn(x: f32) -> u8 {
    if x.is_nan() {
        return 0x7f | ((x.to_bits() >> 24) as u8 & 0x80);
    }
    f32_to_hfp8(
        x,
        Hfp8Config {
            ebits: 4,
            exponent_bias: 7,
            max_pos: E4M3FN_MAX,
        },
    )
}

/// Decodes an OCP FP8 E4M3FN byte.
pub fn e4m3fn_to_f32(byte: u8) -> f32 {
    if byte & 0x7f == 0x7f {
        return f32::NAN;
    }
    hfp8_to_f32(byte, Hfp8Config::TBE)
}

/// FBGEMM's 8-bit code: `round_half_even((x − min) · 255 / (range + 1e-8))` in f32. The 1e-8
/// keeps a constant row at code 0 and matters for rows with a tiny range.
fn int8_codes(row: &[f32], min: f32, max: f32, codes: &mut [u8]) {
    let inverse_scale = 255.0f32 / (max - min + 1e-8f32);
    for (c, &x) in codes.iter_mut().zip(row) {
        *c = ((x - min) * inverse_scale)
            .round_ties_even()
            .clamp(0.0, 255.0) as u8;
    }
}

/// The smallest and largest of `row` (∞ and −∞ when empty).
pub(crate) fn row_min_max(row: &[f32]) -> (f32, f32) {
    row.iter()
        .fold((f32::INFINITY, f32::NEG_INFINITY), |(lo, hi), &x| {
            (lo.min(x), hi.max(x))
        })
}

/// The fp16 scale and bias FBGEMM's 4/2-bit quantiser picks for a row, and the codes.
fn nbit_codes(row: &[f32], bits: u32, packed: &mut [u8]) -> (f16, f16) {
    let (min, max) = if row.is_empty() {
        (0.0, 0.0)
    } else {
        row_min_max(row)
    };
    let levels = ((1u32 << bits) - 1) as f32;
    let bias = f16::from_f32(min);
    let mut scale = f16::from_f32((max - bias.to_f32()) / levels);
    // A zero scale (constant row) or one whose reciprocal overflows would poison the codes.
    if scale.to_f32() == 0.0 || (1.0f32 / scale.to_f32()).is_infinite() {
        scale = f16::from_f32(1.0);
    }
    let inverse = 1.0f32 / scale.to_f32();
    packed.fill(0);
    let per_byte = 8 / bits as usize;
    for (j, &x) in row.iter().enumerate() {
        let code = ((x - bias.to_f32()) * inverse)
            .round_ties_even()
            .clamp(0.0, levels) as u8;
        packed[j / per_byte] |= code << ((j % per_byte) as u32 * bits);
    }
    (scale, bias)
}

fn nbit_code(packed: &[u8], j: usize, bits: u32) -> u8 {
    let per_byte = 8 / bits as usize;
    (packed[j / per_byte] >> ((j % per_byte) as u32 * bits)) & ((1u8 << bits) - 1)
}

fn check_row(op: &'static str, ty: WeightType, dim: usize, bytes: usize) -> Result<()> {
    if bytes != ty.row_bytes(dim) {
        return Err(Error::invalid(
            op,
            format!(
                "a {} row of dim {dim} takes {} bytes, {bytes} given",
                ty.fbgemm_name(),
                ty.row_bytes(dim)
            ),
        ));
    }
    Ok(())
}

/// Quantises one FP32 row into the TBE row layout of `ty`; `out` must be
/// `ty.row_bytes(row.len())` bytes.
pub fn quantize_row(ty: WeightType, row: &[f32], out: &mut [u8]) -> Result<()> {
    check_row("quantize_row", ty, row.len(), out.len())?;
    match ty {
        WeightType::Fp32 => {
            for (o, x) in out.chunks_exact_mut(4).zip(row) {
                o.copy_from_slice(&x.to_le_bytes());
            }
        }
        WeightType::Fp16 => {
            for (o, x) in out.chunks_exact_mut(2).zip(row) {
                o.copy_from_slice(&f16::from_f32(*x).to_le_bytes());
            }
        }
        WeightType::Bf16 => {
            for (o, x) in out.chunks_exact_mut(2).zip(row) {
                o.copy_from_slice(&bf16::from_f32(*x).to_le_bytes());
            }
        }
        WeightType::Fp8 => {
            for (o, &x) in out.iter_mut().zip(row) {
                *o = f32_to_hfp8(x, Hfp8Config::TBE);
            }
        }
        WeightType::Fp8E4m3fn => {
            for (o, &x) in out.iter_mut().zip(row) {
                *o = f32_to_e4m3fn(x);
            }
        }
        WeightType::Int8 => {
            let (min, max) = if row.is_empty() {
                (0.0, 0.0)
            } else {
                row_min_max(row)
            };
            let (header, codes) = out.split_at_mut(4);
            int8_codes(row, min, max, codes);
            let scale = (max - min) / 255.0;
            header[..2].copy_from_slice(&f16::from_f32(scale).to_le_bytes());
            header[2..].copy_from_slice(&f16::from_f32(min).to_le_bytes());
        }
        WeightType::Int4 | WeightType::Int2 => {
            let bits = if ty == WeightType::Int4 { 4 } else { 2 };
            let (header, packed) = out.split_at_mut(4);
            let (scale, bias) = nbit_codes(row, bits, packed);
            header[..2].copy_from_slice(&scale.to_le_bytes());
            header[2..].copy_from_slice(&bias.to_le_bytes());
        }
    }
    Ok(())
}

/// Reads the fp16 scale and bias header of an INT8/INT4/INT2 TBE row, as f32.
pub fn row_scale_bias(row: &[u8]) -> (f32, f32) {
    (
        f16::from_le_bytes([row[0], row[1]]).to_f32(),
        f16::from_le_bytes([row[2], row[3]]).to_f32(),
    )
}

/// Dequantises one TBE row of `ty` into `out` (`out.len()` is the dim).
pub fn dequantize_row(ty: WeightType, row: &[u8], out: &mut [f32]) -> Result<()> {
    check_row("dequantize_row", ty, out.len(), row.len())?;
    match ty {
        WeightType::Fp32 => {
            for (o, b) in out.iter_mut().zip(row.chunks_exact(4)) {
                *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        WeightType::Fp16 => {
            for (o, b) in out.iter_mut().zip(row.chunks_exact(2)) {
                *o = f16::from_le_bytes([b[0], b[1]]).to_f32();
            }
        }
        WeightType::Bf16 => {
            for (o, b) in out.iter_mut().zip(row.chunks_exact(2)) {
                *o = bf16::from_le_bytes([b[0], b[1]]).to_f32();
            }
        }
        WeightType::Fp8 => {
            for (o, &b) in out.iter_mut().zip(row) {
                *o = hfp8_to_f32(b, Hfp8Config::TBE);
            }
        }
        WeightType::Fp8E4m3fn => {
            for (o, &b) in out.iter_mut().zip(row) {
                *o = e4m3fn_to_f32(b);
            }
        }
        WeightType::Int8 => {
            let (scale, bias) = row_scale_bias(row);
            for (o, &c) in out.iter_mut().zip(&row[4..]) {
                *o = c as f32 * scale + bias;
            }
        }
        WeightType::Int4 | WeightType::Int2 => {
            let bits = if ty == WeightType::Int4 { 4 } else { 2 };
            let (scale, bias) = row_scale_bias(row);
            for (j, o) in out.iter_mut().enumerate() {
                *o = nbit_code(&row[4..], j, bits) as f32 * scale + bias;
            }
        }
    }
    Ok(())
}

/// Quantises a whole `[rows, dim]` FP32 table (row-major) into TBE rows of `ty`, back to back.
pub fn quantize_table(ty: WeightType, table: &[f32], dim: usize) -> Result<Vec<u8>> {
    if dim == 0 || table.len() % dim != 0 {
        return Err(Error::invalid(
            "quantize_table",
            format!(
                "{} values do not form rows of dim {dim} (dim must be ≥ 1)",
                table.len()
            ),
        ));
    }
    let row_bytes = ty.row_bytes(dim);
    let mut out = vec![0u8; table.len() / dim * row_bytes];
    for (src, dst) in table.chunks_exact(dim).zip(out.chunks_exact_mut(row_bytes)) {
        quantize_row(ty, src, dst)?;
    }
    Ok(out)
}

// ----- FBGEMM's stand-alone fused row formats (scale and bias after the codes) ----------------

/// Bytes of a `FloatToFused8BitRowwiseQuantized` row of `dim` elements (`dim + 8`).
pub fn fused8bit_row_bytes(dim: usize) -> usize {
    dim + 8
}

/// FBGEMM's `FloatToFused8BitRowwiseQuantized` for one row: `[dim × u8][f32 scale][f32 bias]`,
/// little-endian, scale = (max − min)/255, bias = min.
pub fn fused8bit_quantize_row(row: &[f32], out: &mut [u8]) -> Result<()> {
    if out.len() != fused8bit_row_bytes(row.len()) {
        return Err(Error::invalid(
            "fused8bit_quantize_row",
            format!(
                "a row of dim {} takes {} bytes, {} given",
                row.len(),
                fused8bit_row_bytes(row.len()),
                out.len()
            ),
        ));
    }
    let (min, max) = if row.is_empty() {
        (0.0, 0.0)
    } else {
        row_min_max(row)
    };
    let (codes, tail) = out.split_at_mut(row.len());
    int8_codes(row, min, max, codes);
    tail[..4].copy_from_slice(&((max - min) / 255.0).to_le_bytes());
    tail[4..].copy_from_slice(&min.to_le_bytes());
    Ok(())
}

/// FBGEMM's `Fused8BitRowwiseQuantizedToFloat` for one row.
pub fn fused8bit_dequantize_row(row: &[u8], out: &mut [f32]) -> Result<()> {
    let dim = out.len();
    if row.len() != fused8bit_row_bytes(dim) {
        return Err(Error::invalid(
            "fused8bit_dequantize_row",
            format!(
                "a row of dim {dim} takes {} bytes, {} given",
                fused8bit_row_bytes(dim),
                row.len()
            ),
        ));
    }
    let tail = &row[dim..];
    let scale = f32::from_le_bytes([tail[0], tail[1], tail[2], tail[3]]);
    let bias = f32::from_le_bytes([tail[4], tail[5], tail[6], tail[7]]);
    // FBGEMM's stand-alone op rounds once (fused multiply-add); its golden bytes say so.
    for (o, &c) in out.iter_mut().zip(row) {
        *o = (c as f32).mul_add(scale, bias);
    }
    Ok(())
}

/// Bytes of a `FloatToFusedNBitRowwiseQuantizedSBHalf` row: `⌈dim·bits/8⌉ + 4`.
pub fn fused_nbit_row_bytes(dim: usize, bits: u32) -> usize {
    (dim * bits as usize).div_ceil(8) + 4
}

fn check_bits(op: &'static str, bits: u32) -> Result<()> {
    if !matches!(bits, 2 | 4) {
        return Err(Error::invalid(
            op,
            format!("bit rate {bits} is not supported (expected 2 or 4)"),
        ));
    }
    Ok(())
}

/// FBGEMM's `FloatToFusedNBitRowwiseQuantizedSBHalf` for one row: `[packed codes][fp16 scale]
/// [fp16 bias]`. Any dim is accepted (FBGEMM's CPU op needs an even packed byte count).
pub fn fused_nbit_quantize_row(row: &[f32], bits: u32, out: &mut [u8]) -> Result<()> {
    check_bits("fused_nbit_quantize_row", bits)?;
    if out.len() != fused_nbit_row_bytes(row.len(), bits) {
        return Err(Error::invalid(
            "fused_nbit_quantize_row",
            format!(
                "a {bits}-bit row of dim {} takes {} bytes, {} given",
                row.len(),
                fused_nbit_row_bytes(row.len(), bits),
                out.len()
            ),
        ));
    }
    let split = out.len() - 4;
    let (packed, tail) = out.split_at_mut(split);
    let (scale, bias) = nbit_codes(row, bits, packed);
    tail[..2].copy_from_slice(&scale.to_le_bytes());
    tail[2..].copy_from_slice(&bias.to_le_bytes());
    Ok(())
}

/// FBGEMM's `FusedNBitRowwiseQuantizedSBHalfToFloat` for one row.
pub fn fused_nbit_dequantize_row(row: &[u8], bits: u32, out: &mut [f32]) -> Result<()> {
    check_bits("fused_nbit_dequantize_row", bits)?;
    let dim = out.len();
    if row.len() != fused_nbit_row_bytes(dim, bits) {
        return Err(Error::invalid(
            "fused_nbit_dequantize_row",
            format!(
                "a {bits}-bit row of dim {dim} takes {} bytes, {} given",
                fused_nbit_row_bytes(dim, bits),
                row.len()
            ),
        ));
    }
    let split = row.len() - 4;
    let (packed, tail) = row.split_at(split);
    let (scale, bias) = row_scale_bias(tail);
    for (j, o) in out.iter_mut().enumerate() {
        *o = nbit_code(packed, j, bits) as f32 * scale + bias;
    }
    Ok(())
}
