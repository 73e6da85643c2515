//! TwoTower training throughput on the CPU at MovieLens-100K's shape: a user tower (943 × 64
//! table) and an item tower (1682 × 64 table), each followed by an MLP 64 → 128 → 64, batch 256
//! of uniformly drawn (user, item) pairs. Three losses: pointwise BCE with labels (TorchRec's
//! retrieval example), the in-batch softmax with log-Q, and the same with 256 random negatives
//! mixed in. Tables train through row-wise Adagrad fused into the backward, the MLPs through
//! Adam. Reports pairs/s (median of 5 timings of 50 steps, after 20 warm-up steps).
//! Side by side with TorchRec's TwoTower (EmbeddingBagCollection + MLP towers, PyTorch CPU):
//! `benches/peers/two_tower.sh`.

use std::time::Instant;

use embers::embedding::FusedOptimizer;
use embers::sparse::KeyedJaggedTensor;
use embers::train::{DenseOptimizer, PairBatch, TwoTowerConfig, TwoTowerLoss};
use embers::{Device, Tensor};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

const USERS: usize = 943;
const ITEMS: usize = 1682;
const BATCH: usize = 256;

fn one_hot(key: &str, ids: &[i64]) -> KeyedJaggedTensor {
    KeyedJaggedTensor::one_hot(key, ids).unwrap()
}

fn batch(rng: &mut ChaCha8Rng, labels: bool) -> PairBatch {
    let users: Vec<i64> = (0..BATCH)
        .map(|_| rng.random_range(0..USERS as i64))
        .collect();
    let items: Vec<i64> = (0..BATCH)
        .map(|_| rng.random_range(0..ITEMS as i64))
        .collect();
    PairBatch {
        queries: one_hot("user", &users),
        candidates: one_hot("item", &items),
        labels: labels.then(|| {
            let y: Vec<f32> = (0..BATCH).map(|_| rng.random_range(0..2) as f32).collect();
            Tensor::from_vec(y, &[BATCH]).unwrap()
        }),
        candidate_ids: items,
    }
}

fn main() {
    let threads = rayon::current_num_threads();
    println!("embers TwoTower training, CPU, {threads} threads, batch {BATCH}");
    for (name, loss) in [
        ("pointwise", TwoTowerLoss::Pointwise),
        (
            "softmax",
            TwoTowerLoss::Softmax {
                log_q: true,
                random_negatives: 0,
            },
        ),
        (
            "softmax+256neg",
            TwoTowerLoss::Softmax {
                log_q: true,
                random_negatives: 256,
            },
        ),
    ] {
        let config = TwoTowerConfig {
            query_features: vec![("user".into(), USERS)],
            candidate_features: vec![("item".into(), ITEMS)],
            embedding_dim: 64,
            layers: vec![128, 64],
            normalize: loss != TwoTowerLoss::Pointwise,
            temperature: if loss == TwoTowerLoss::Pointwise {
                1.0
            } else {
                0.05
            },
            loss,
            estimator_buckets: 8192,
            estimator_alpha: 0.05,
            sparse_optimizer: FusedOptimizer::RowWiseAdagrad {
                lr: 0.01,
                eps: 1e-8,
            },
            dense_optimizer: DenseOptimizer::Adam { lr: 1e-3 },
            seed: 1,
            device: Device::Cpu,
        };
        let mut trainer = config
            .build()
            .unwrap()
            .with_negative_sampler(ITEMS, Box::new(|ids| Ok(one_hot("item", ids))))
            .unwrap();
        let mut rng = ChaCha8Rng::seed_from_u64(2);
        let labels = loss == TwoTowerLoss::Pointwise;
        let batches: Vec<PairBatch> = (0..16).map(|_| batch(&mut rng, labels)).collect();
        for b in batches.iter().cycle().take(20) {
            trainer.train_step(b).unwrap();
        }
        let mut rates: Vec<f64> = (0..5)
            .map(|_| {
                let t = Instant::now();
                for b in batches.iter().cycle().take(50) {
                    trainer.train_step(b).unwrap();
                }
                (50 * BATCH) as f64 / t.elapsed().as_secs_f64()
            })
            .collect();
        rates.sort_by(f64::total_cmp);
        println!("embers two_tower {name}: {:.0} pairs/s", rates[2]);
    }
}
