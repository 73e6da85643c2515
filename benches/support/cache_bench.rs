//! What the cache benches (`tbe_cache`, `quantized_cache`) share: their Zipf id batches, a
//! numeric setting from the environment, the device they run on, a median.

use embers::tensor::rng::seeded;
use rand_distr::{Distribution, Zipf};

/// `n` batches of `t` features × `b` bags × `l` ids in FBGEMM's layout (ids, offsets), each id
/// drawn from Zipf(`s`) over `e` rows, its rank scattered over the table by a multiplicative
/// hash so that hot rows are not neighbours; seeded.
pub fn zipf_batches(
    n: usize,
    [t, b, l]: [usize; 3],
    e: usize,
    s: f64,
    seed: u64,
) -> Vec<(Vec<i64>, Vec<i64>)> {
    let mut rng = seeded(seed);
    let zipf = Zipf::new(e as f64, s).unwrap();
    (0..n)
        .map(|_| {
            let ids: Vec<i64> = (0..t * b * l)
                .map(|_| {
                    let rank = zipf.sample(&mut rng) as u64 - 1;
                    (rank.wrapping_mul(2_654_435_761) % e as u64) as i64
                })
                .collect();
            let offsets = (0..=t * b).map(|i| (i * l) as i64).collect();
            (ids, offsets)
        })
        .collect()
}

/// The number in environment variable `name`, else `default`.
pub fn env_f64(name: &str, default: f64) -> f64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// The median of `v`.
pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

/// The device `EMBERS_CACHE_DEVICE` names (`cuda`: GPU 0; otherwise the host), and the GPU to
/// synchronize with when it is one.
pub fn device_from_env() -> (
    embers::Device,
    Option<std::sync::Arc<embers::cuda::CudaDevice>>,
) {
    let device = match std::env::var("EMBERS_CACHE_DEVICE").as_deref() {
        Ok("cuda") => embers::Device::cuda(0).expect("EMBERS_CACHE_DEVICE=cuda needs GPU 0"),
        _ => embers::Device::Cpu,
    };
    let gpu = match device {
        embers::Device::Cuda(i) => Some(embers::cuda::device(i).unwrap()),
        embers::Device::Cpu => None,
    };
    (device, gpu)
}
