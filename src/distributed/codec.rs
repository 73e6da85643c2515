//! Quantized communication codecs (TorchRec's `QCommsConfig` precisions): the encodings an
//! embedding collective can send its `f32` rows in, and back.
//!
//! * [`CommPrecision::Fp32`] — as is (4 bytes a value);
//! * [`CommPrecision::Fp16`], [`CommPrecision::Bf16`] — IEEE half and bfloat16, round to
//!   nearest even (2 bytes);
//! * [`CommPrecision::Fp8`] — E4M3 (4 exponent bits, bias 7, 3 mantissa bits, no infinities;
//!   finite range ±448), round to nearest even; like FBGEMM's FP8 comms it **saturates**
//!   values beyond ±448 (1 byte);
//! * [`CommPrecision::Int8`] — FBGEMM's fused 8-bit row-wise format: per row of `row_dim`
//!   values, `round((x − min) / scale)` with `scale = (max − min) / 255`, then the row's
//!   `scale` and `min` as `f32` (1 byte a value + 8 a row).
//!
//! A [`Codec`] may carry a loss scale (for FP16/BF16 gradients): values are multiplied by it
//! before encoding and divided after decoding, so small gradients keep their precision.
//! [`Codec::encode`] refuses a non-finite value, naming its position. The collectives
//! ([`Codec::all_to_all`], [`Codec::reduce_scatter`], [`Codec::all_gather`]) cannot stop on one
//! rank alone (the others would wait for it), so there a non-finite value arrives non-finite,
//! as it would in FP32: NaN and ±∞ as they are in FP16/BF16, NaN in FP8, and a NaN row in
//! INT8 — the loss shows it on every rank that uses it.
//!
//! [`QCommsConfig`] names the codec of a sharded collection's forward output distribution and
//! of its backward (TorchRec's `forward_precision` / `backward_precision`).
//!
//! Round-trip error on U[0, 1): below 0.0005 (FP16), 0.002 (BF16, INT8), 0.032 (FP8) — within
//! FBGEMM's test bounds (0.005, and 0.05 for FP8); `tests/dist_codec.rs` checks them.

use half::{bf16, f16};

use super::comm::{sum_in_rank_order, Comm};
use super::plan::fnv1a;
use crate::error::{Error, Result};

const OP: &str = "comm codec";

/// The precision a collective sends its values in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CommPrecision {
    /// 32-bit float (no compression).
    Fp32,
    /// IEEE 754 half.
    Fp16,
    /// bfloat16.
    Bf16,
    /// 8-bit float E4M3 (saturating).
    Fp8,
    /// 8-bit integers with a scale and an offset per row.
    Int8,
}

impl CommPrecision {
    /// Bytes of `n` values in rows of `row_dim` (`n` a multiple of it for INT8).
    pub fn encoded_len(self, n: usize, row_dim: usize) -> usize {
        match self {
            CommPrecision::Fp32 => 4 * n,
            CommPrecision::Fp16 | CommPrecision::Bf16 => 2 * n,
            CommPrecision::Fp8 => n,
            CommPrecision::Int8 => n + 8 * n.checked_div(row_dim).unwrap_or(0),
        }
    }
}

/// A precision and an optional loss scale.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Codec {
    /// What goes on the wire.
    pub precision: CommPrecision,
    /// Multiplies the values before encoding (divides them after decoding); `None` for 1.
    pub loss_scale: Option<f32>,
}

impl Codec {
    /// `precision` without loss scaling.
    pub const fn new(precision: CommPrecision) -> Codec {
        Codec {
            precision,
            loss_scale: None,
        }
    }

    /// With loss scale `scale` (finite and positive).
    pub fn with_loss_scale(self, scale: f32) -> Result<Codec> {
        if !(scale.is_finite() && scale > 0.0) {
            return Err(Error::invalid(
                OP,
                format!("a loss scale must be finite and positive, got {scale}"),
            ));
        }
        Ok(Codec {
            loss_scale: Some(scale),
            ..self
        })
    }

    /// Whether encoding changes nothing (FP32 without a loss scale).
    pub fn is_identity(&self) -> bool {
        self.precision == CommPrecision::Fp32 && self.loss_scale.is_none()
    }

    /// Encodes `values` (rows of `row_dim`; INT8 needs whole rows). A non-finite value is an
    /// error naming its position.
    pub fn encode(&self, values: &[f32], row_dim: usize) -> Result<Vec<u8>> {
        if let Some(i) = values.iter().position(|x| !x.is_finite()) {
            return Err(Error::invalid(
                OP,
                format!(
                    "value {i} is {} (not finite): refusing to send it",
                    values[i]
                ),
            ));
        }
        self.encode_any(values, row_dim)
    }

    /// [`encode`](Self::encode) letting non-finite values through (see the module docs).
    fn encode_any(&self, values: &[f32], row_dim: usize) -> Result<Vec<u8>> {
        if values.is_empty() {
            return Ok(Vec::new());
        }
        let scale = self.loss_scale.unwrap_or(1.0);
        let x = |v: f32| v * scale;
        let mut out = Vec::with_capacity(self.precision.encoded_len(values.len(), row_dim));
        match self.precision {
            CommPrecision::Fp32 => values
                .iter()
                .for_each(|&v| out.extend_from_slice(&x(v).to_le_bytes())),
            CommPrecision::Fp16 => values
                .iter()
                .for_each(|&v| out.extend_from_slice(&f16::from_f32(x(v)).to_le_bytes())),
            CommPrecision::Bf16 => values
                .iter()
                .for_each(|&v| out.extend_from_slice(&bf16::from_f32(x(v)).to_le_bytes())),
            CommPrecision::Fp8 => out.extend(values.iter().map(|&v| {
                let v = x(v);
                if v.is_finite() {
                    fp8_e4m3(v)
                } else {
                    FP8_E4M3_NAN
                }
            })),
            CommPrecision::Int8 => {
                if row_dim == 0 || values.len() % row_dim != 0 {
                    return Err(Error::invalid(
                        OP,
                        format!(
                            "INT8 rows: {} values are not whole rows of {row_dim}",
                            values.len()
                        ),
                    ));
                }
                for row in values.chunks_exact(row_dim) {
                    let (lo, hi) = row
                        .iter()
                        .fold((f32::INFINITY, f32::NEG_INFINITY), |(l, h), &v| {
                            (l.min(x(v)), h.max(x(v)))
                        });
                    // A non-finite value (or a range past f32's) makes the row NaN.
                    let finite = row.iter().all(|&v| x(v).is_finite());
                    let (step, lo) = match (hi - lo) / 255.0 {
                        step if finite && step.is_finite() => (step, lo),
                        _ => (f32::NAN, f32::NAN),
                    };
                    let inv = if step > 0.0 { 1.0 / step } else { 0.0 };
                    out.extend(
                        row.iter()
                            .map(|&v| ((x(v) - lo) * inv).round().clamp(0.0, 255.0) as u8),
                    );
                    out.extend_from_slice(&step.to_le_bytes());
                    out.extend_from_slice(&lo.to_le_bytes());
                }
            }
        }
        Ok(out)
    }

    /// Decodes `n` values (rows of `row_dim`) from `bytes`; a buffer of the wrong size is an
    /// error.
    pub fn decode(&self, bytes: &[u8], n: usize, row_dim: usize) -> Result<Vec<f32>> {
        let want = self.precision.encoded_len(n, row_dim);
        if bytes.len() != want || (self.precision == CommPrecision::Int8 && row_dim == 0 && n > 0) {
            return Err(Error::invalid(
                OP,
                format!(
                    "{} bytes for {n} {:?} values in rows of {row_dim}, expected {want}",
                    bytes.len(),
                    self.precision
                ),
            ));
        }
        let unscale = 1.0 / self.loss_scale.unwrap_or(1.0);
        let mut out = Vec::with_capacity(n);
        match self.precision {
            CommPrecision::Fp32 => out.extend(
                bytes
                    .chunks_exact(4)
                    .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
            ),
            CommPrecision::Fp16 => out.extend(
                bytes
                    .chunks_exact(2)
                    .map(|b| f16::from_le_bytes([b[0], b[1]]).to_f32()),
            ),
            CommPrecision::Bf16 => out.extend(
                bytes
                    .chunks_exact(2)
                    .map(|b| bf16::from_le_bytes([b[0], b[1]]).to_f32()),
            ),
            CommPrecision::Fp8 => out.extend(bytes.iter().map(|&b| fp8_e4m3_to_f32(b))),
            CommPrecision::Int8 => {
                for row in bytes.chunks_exact(row_dim + 8) {
                    let (q, tail) = row.split_at(row_dim);
                    let step = f32::from_le_bytes([tail[0], tail[1], tail[2], tail[3]]);
                    let lo = f32::from_le_bytes([tail[4], tail[5], tail[6], tail[7]]);
                    out.extend(q.iter().map(|&v| f32::from(v) * step + lo));
                }
            }
        }
        if unscale != 1.0 {
            out.iter_mut().for_each(|v| *v *= unscale);
        }
        Ok(out)
    }
}

/// The largest finite E4M3 value.
pub const FP8_E4M3_MAX: f32 = 448.0;

/// E4M3's (positive) NaN code.
pub const FP8_E4M3_NAN: u8 = 0x7F;

/// `v` as E4M3, rounded to nearest even, saturated to ±448 (`v` finite).
pub fn fp8_e4m3(v: f32) -> u8 {
    let bits = v.to_bits();
    let sign = ((bits >> 24) & 0x80) as u8;
    let magnitude = bits & 0x7fff_ffff;
    let a = f32::from_bits(magnitude);
    if a >= FP8_E4M3_MAX {
        return sign | 0x7E;
    }
    const MIN_NORMAL: f32 = 1.0 / 64.0; // 2^-6
    if a < MIN_NORMAL {
        // Subnormal: multiples of 2^-9 (8 of them make the smallest normal, code 0x08).
        let m = (a * 512.0).round_ties_even() as u8;
        return sign | m;
    }
    // Round the 23-bit mantissa to 3 bits, to nearest even (a carry moves into the
    // exponent, as it should); below 448 the result stays finite.
    let rounded = magnitude + 0x7_FFFF + ((magnitude >> 20) & 1);
    let e = (rounded >> 23) as i32 - 127;
    let m = ((rounded >> 20) & 7) as u8;
    sign | (((e + 7) as u8) << 3) | m
}

/// The value of E4M3 code `b` (`0x7F`/`0xFF` are NaN).
pub fn fp8_e4m3_to_f32(b: u8) -> f32 {
    let sign = u32::from(b & 0x80) << 24;
    let e = u32::from((b >> 3) & 0x0f);
    let m = u32::from(b & 0x07);
    if e == 0x0f && m == 0x07 {
        return f32::NAN;
    }
    if e == 0 {
        let v = m as f32 / 512.0;
        return if sign != 0 { -v } else { v };
    }
    f32::from_bits(sign | ((e + 120) << 23) | (m << 20))
}

/// Collectives that send their `f32` values encoded (the receiver decodes them); with
/// [`Codec::is_identity`] they are the plain [`Comm`] ones. Every rank calls them with the
/// same codec (see [`QCommsConfig`]). Bytes are counted as sent, under `op`.
impl Codec {
    /// [`Comm::all_to_all_v`] of rows: `send[d]` (rows of `send_dims[d]`) goes to rank `d`;
    /// `recv[s]` is `(values, row_dim)` of the block from rank `s`.
    pub fn all_to_all(
        &self,
        comm: &Comm,
        op: &'static str,
        send: Vec<Vec<f32>>,
        send_dims: &[usize],
        recv: &[(usize, usize)],
    ) -> Result<Vec<Vec<f32>>> {
        if self.is_identity() {
            let counts: Vec<usize> = recv.iter().map(|&(n, _)| n).collect();
            return comm.all_to_all_v(op, send, Some(&counts));
        }
        if send_dims.len() != send.len() {
            return Err(Error::invalid(
                op,
                format!("{} blocks, {} row widths", send.len(), send_dims.len()),
            ));
        }
        let encoded = (send.iter().zip(send_dims))
            .map(|(block, &dim)| self.encode_any(block, dim))
            .collect::<Result<Vec<_>>>()?;
        let counts: Vec<usize> = (recv.iter())
            .map(|&(n, dim)| self.precision.encoded_len(n, dim))
            .collect();
        let got = comm.all_to_all_v(op, encoded, Some(&counts))?;
        (got.iter().zip(recv))
            .map(|(bytes, &(n, dim))| self.decode(bytes, n, dim))
            .collect()
    }

    /// [`Comm::reduce_scatter_v`] of rows of `row_dim`: every part is encoded, the sum taken
    /// in `f32` after decoding, in rank order (the same bits for every placement of the
    /// ranks).
    pub fn reduce_scatter(
        &self,
        comm: &Comm,
        op: &'static str,
        send: Vec<Vec<f32>>,
        row_dim: usize,
    ) -> Result<Vec<f32>> {
        if self.is_identity() {
            return comm.reduce_scatter_v(op, send);
        }
        let own = send.get(comm.rank()).map_or(0, Vec::len);
        let dims = vec![row_dim; send.len()];
        let parts = self.all_to_all(comm, op, send, &dims, &vec![(own, row_dim); comm.size()])?;
        Ok(sum_in_rank_order(&parts, own))
    }

    /// [`Comm::all_gather_v`] of rows of `row_dim`: `counts[r]` values from rank `r`.
    pub fn all_gather(
        &self,
        comm: &Comm,
        op: &'static str,
        send: &[f32],
        row_dim: usize,
        counts: &[usize],
    ) -> Result<Vec<Vec<f32>>> {
        if self.is_identity() {
            return comm.all_gather_v(op, send, Some(counts));
        }
        let bytes = self.encode_any(send, row_dim)?;
        let byte_counts: Vec<usize> = (counts.iter())
            .map(|&n| self.precision.encoded_len(n, row_dim))
            .collect();
        let got = comm.all_gather_v(op, &bytes, Some(&byte_counts))?;
        (got.iter().zip(counts))
            .map(|(b, &n)| self.decode(b, n, row_dim))
            .collect()
    }
}

/// The codecs of a sharded collection's communication (TorchRec's `QCommsConfig`): the
/// forward output distribution's and the backward's. Ids and lengths (the input
/// distribution) always travel exactly.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct QCommsConfig {
    /// The pooled rows' all-to-all and reduce-scatter.
    pub forward: Codec,
    /// Their gradients' all-to-all and all-gather.
    pub backward: Codec,
}

impl Default for QCommsConfig {
    /// FP32 both ways.
    fn default() -> Self {
        QCommsConfig {
            forward: Codec::new(CommPrecision::Fp32),
            backward: Codec::new(CommPrecision::Fp32),
        }
    }
}

impl QCommsConfig {
    /// `forward` and `backward` without loss scaling.
    pub const fn new(forward: CommPrecision, backward: CommPrecision) -> Self {
        QCommsConfig {
            forward: Codec::new(forward),
            backward: Codec::new(backward),
        }
    }

    /// A stable digest, for ranks to compare.
    pub(crate) fn digest(&self) -> u64 {
        let scale = |c: &Codec| c.loss_scale.map(f32::to_bits);
        fnv1a(
            format!(
                "{:?} {:?} {:?} {:?}",
                self.forward.precision,
                scale(&self.forward),
                self.backward.precision,
                scale(&self.backward)
            )
            .as_bytes(),
        )
    }
}
