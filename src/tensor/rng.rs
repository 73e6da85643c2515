//! Seeded random number generation. Every random initialisation in embers takes an explicit
//! generator so runs are reproducible across machines.

use rand::SeedableRng;

/// The generator embers uses: ChaCha8, portable and reproducible for a given seed.
pub type Rng = rand_chacha::ChaCha8Rng;

/// A generator seeded with `seed`.
pub fn seeded(seed: u64) -> Rng {
    Rng::seed_from_u64(seed)
}
