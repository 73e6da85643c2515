//! Floats kept in checkpoint metadata exactly, as their bits: the examples' running loss sums,
//! which a resumed run goes on adding to.

/// `x`'s bits as 16 hex digits ([`f64_of_bits`] reads them back).
pub fn bits_of_f64(x: f64) -> String {
    format!("{:016x}", x.to_bits())
}

/// The finite f64 whose bits `text` holds as [`bits_of_f64`] writes them.
pub fn f64_of_bits(text: &str) -> Option<f64> {
    let bits = (text.len() == 16).then(|| u64::from_str_radix(text, 16).ok())??;
    Some(f64::from_bits(bits)).filter(|x| x.is_finite())
}
