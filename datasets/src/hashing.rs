//! Small, fixed hash functions. They are spelled out here (rather than taken from a crate) so
//! that generated data, splits and shuffles stay bit-identical across dependency upgrades.

/// SplitMix64 finaliser: a bijective, well-mixed 64-bit hash.
pub(crate) fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Hashes a short sequence of words; order matters.
pub(crate) fn hash_words(words: &[u64]) -> u64 {
    let mut h = 0x243F_6A88_85A3_08D3u64;
    for &w in words {
        h = splitmix64(h ^ w);
    }
    h
}

/// Maps a hash to a uniform double in the open interval (0, 1), so `ln` never sees 0.
pub(crate) fn unit_open(h: u64) -> f64 {
    ((h >> 11) as f64 + 0.5) * (1.0 / (1u64 << 53) as f64)
}

/// A standard normal deviate derived from one hash (Box–Muller on two derived uniforms).
pub(crate) fn standard_normal(h: u64) -> f64 {
    let u1 = unit_open(h);
    let u2 = unit_open(splitmix64(h ^ 0x5851_F42D_4C95_7F2D));
    (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
}

/// 64-bit FNV-1a, used to turn non-numeric tokens into ids.
pub(crate) fn fnv1a64(bytes: &[u8]) -> u64 {
    let mut h = 0xCBF2_9CE4_8422_2325u64;
    for &b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01B3);
    }
    h
}

/// A tiny seeded generator for shuffling (SplitMix64 stream).
#[derive(Debug, Clone)]
pub(crate) struct SplitMix64 {
    state: u64,
}

impl SplitMix64 {
    pub(crate) fn new(seed: u64) -> Self {
        Self { state: seed }
    }

    pub(crate) fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        splitmix64(self.state)
    }

    /// Uniform integer in `0..n` (`n > 0`), by widening multiply (bias below 2^-64·n).
    pub(crate) fn below(&mut self, n: usize) -> usize {
        ((u128::from(self.next_u64()) * n as u128) >> 64) as usize
    }
}
