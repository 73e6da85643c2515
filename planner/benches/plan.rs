//! Planning time for random table sets generated exactly as `benches/peers/plan.py manyN`
//! does (Python's Mersenne Twister, `random.Random(1)`), on 16 and 128 ranks of 8-GPU hosts
//! with 80 GiB HBM. Compare with `$PY benches/peers/plan.py manyN 16` (see README.md).

use criterion::{criterion_group, criterion_main, Criterion};
use embers_planner::config::{ByteSize, Config, TableConfig, TopologyConfig};
use embers_planner::{plan_problem, CostModel};
use std::hint::black_box;
use std::time::Duration;

/// CPython's `random.Random` (MT19937 with `init_by_array`), enough for `uniform` and `choice`.
struct PyRandom {
    mt: [u32; 624],
    index: usize,
}

impl PyRandom {
    fn new(seed: u32) -> Self {
        let mut mt = [0u32; 624];
        mt[0] = 19_650_218;
        for i in 1..624 {
            mt[i] = 1_812_433_253u32
                .wrapping_mul(mt[i - 1] ^ (mt[i - 1] >> 30))
                .wrapping_add(i as u32);
        }
        let key = [seed];
        let (mut i, mut j) = (1usize, 0usize);
        for _ in 0..624.max(key.len()) {
            mt[i] = (mt[i] ^ (mt[i - 1] ^ (mt[i - 1] >> 30)).wrapping_mul(1_664_525))
                .wrapping_add(key[j])
                .wrapping_add(j as u32);
            i += 1;
            j += 1;
            if i >= 624 {
                mt[0] = mt[623];
                i = 1;
            }
            if j >= key.len() {
                j = 0;
            }
        }
        for _ in 0..623 {
            mt[i] = (mt[i] ^ (mt[i - 1] ^ (mt[i - 1] >> 30)).wrapping_mul(1_566_083_941))
                .wrapping_sub(i as u32);
            i += 1;
            if i >= 624 {
                mt[0] = mt[623];
                i = 1;
            }
        }
        mt[0] = 0x8000_0000;
        PyRandom { mt, index: 624 }
    }

    fn next_u32(&mut self) -> u32 {
        if self.index >= 624 {
            for k in 0..624 {
                let y = (self.mt[k] & 0x8000_0000) | (self.mt[(k + 1) % 624] & 0x7fff_ffff);
                let mut v = self.mt[(k + 397) % 624] ^ (y >> 1);
                if y & 1 != 0 {
                    v ^= 0x9908_b0df;
                }
                self.mt[k] = v;
            }
            self.index = 0;
        }
        let mut y = self.mt[self.index];
        self.index += 1;
        y ^= y >> 11;
        y ^= (y << 7) & 0x9d2c_5680;
        y ^= (y << 15) & 0xefc6_0000;
        y ^ (y >> 18)
    }

    fn random(&mut self) -> f64 {
        let a = (self.next_u32() >> 5) as f64;
        let b = (self.next_u32() >> 6) as f64;
        (a * 67_108_864.0 + b) / 9_007_199_254_740_992.0
    }

    fn uniform(&mut self, a: f64, b: f64) -> f64 {
        a + (b - a) * self.random()
    }

    fn choice<T: Copy>(&mut self, items: &[T]) -> T {
        let n = items.len() as u32;
        let k = 32 - n.leading_zeros();
        loop {
            let r = self.next_u32() >> (32 - k);
            if r < n {
                return items[r as usize];
            }
        }
    }
}

/// The `manyN` table set of plan.py with its topology.
fn many(n: usize, world: usize) -> Config {
    let mut r = PyRandom::new(1);
    let rows: Vec<u64> = (0..n)
        .map(|_| 10f64.powf(r.uniform(2.0, 7.5)) as u64)
        .collect();
    let dims: Vec<u64> = (0..n).map(|_| r.choice(&[32, 64, 128, 256])).collect();
    let pf: Vec<f64> = (0..n).map(|_| r.choice(&[1.0, 5.0, 20.0, 50.0])).collect();
    Config {
        batch_size: 8192,
        topology: TopologyConfig {
            world_size: Some(world),
            local_world_size: Some(8.min(world)),
            hbm_cap: Some(ByteSize(80 << 30)),
            ..Default::default()
        },
        optimizer: Default::default(),
        // 5000 tables' KJT buffers alone exceed 80 GiB under TorchRec's heuristic (20 batches
        // of indices), so the largest set plans without that reservation.
        storage_reservation: embers_planner::config::ReservationConfig {
            kjt: n < 5000,
            ..Default::default()
        },
        tables: (0..n)
            .map(|i| TableConfig {
                name: format!("t{i}"),
                rows: rows[i],
                dim: dims[i],
                data_type: embers_planner::types::DataType::Fp32,
                features: Vec::new(),
                pooling_factors: Some(vec![pf[i]]),
                weighted: false,
                pooled: true,
                constraints: Default::default(),
            })
            .collect(),
    }
}

fn bench(c: &mut Criterion) {
    let mut g = c.benchmark_group("plan");
    g.sample_size(10).measurement_time(Duration::from_secs(5));
    for &world in &[16usize, 128] {
        for &n in &[26usize, 500, 5000] {
            let problem = many(n, world).resolve().expect("valid");
            let plan = match plan_problem(&problem, CostModel::Torchrec) {
                Ok(plan) => plan,
                Err(e) => {
                    println!("many{n} on {world} ranks: no plan ({e}); skipped");
                    continue;
                }
            };
            println!(
                "many{n} on {world} ranks: max_rank_perf {:.3} ms, lower bound {:.3} ms",
                plan.max_rank_perf, plan.lower_bound
            );
            g.bench_function(format!("many{n}_world{world}"), |b| {
                b.iter(|| plan_problem(black_box(&problem), CostModel::Torchrec).is_ok())
            });
        }
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
