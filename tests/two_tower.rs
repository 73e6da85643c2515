//! TwoTower: the losses against f64 references, gradients through towers, normalisation and
//! losses by finite differences, the streaming frequency estimator, and training on planted
//! user/item factors recovering them (recall@10 near what the planted model itself achieves),
//! retrieved through the exact index.

use embers::embedding::{EmbeddingBagCollection, EmbeddingBagConfig, FusedOptimizer};
#[path = "support/config_edit.rs"]
mod config_edit;

use embers::models::two_tower::{
    in_batch_softmax, l2_normalize, pointwise_bce, FrequencyEstimator, Tower, TwoTower,
};
use embers::nn::{Activation, Forward, Mlp};
use embers::optim::{Adam, AdamConfig, Optimizer};
use embers::retrieval::{FlatIndex, IvfPqConfig, IvfPqIndex, Metric};
use embers::sparse::KeyedJaggedTensor;
use embers::tensor::rng::seeded;
use embers::tensor::testing::check_gradients;
use embers::{DType, Tensor};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rand_distr::StandardNormal;

fn randn(shape: &[usize], seed: u64) -> Vec<f64> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..shape.iter().product::<usize>())
        .map(|_| rng.sample(StandardNormal))
        .collect()
}

#[test]
fn losses_match_f64_references() {
    let (b, d, tau) = (6, 4, 0.7);
    let q = randn(&[b, d], 1);
    let c = randn(&[b, d], 2);
    let lq: Vec<f64> = randn(&[b], 3).iter().map(|x| -x.abs() - 0.1).collect();
    let qt = Tensor::from_vec(q.clone(), &[b, d]).unwrap();
    let ct = Tensor::from_vec(c.clone(), &[b, d]).unwrap();
    let lt = Tensor::from_vec(lq.clone(), &[b]).unwrap();
    let dot = |i: usize, j: usize| (0..d).map(|k| q[i * d + k] * c[j * d + k]).sum::<f64>();
    for with_q in [false, true] {
        let got = in_batch_softmax(&qt, &ct, with_q.then_some(&lt), tau)
            .unwrap()
            .to_vec::<f64>()
            .unwrap()[0];
        let mut want = 0.0;
        for i in 0..b {
            let logits: Vec<f64> = (0..b)
                .map(|j| dot(i, j) / tau - if with_q { lq[j] } else { 0.0 })
                .collect();
            let max = logits.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let lse = max + logits.iter().map(|l| (l - max).exp()).sum::<f64>().ln();
            want += (lse - logits[i]) / b as f64;
        }
        assert!(
            (got - want).abs() < 1e-12,
            "log-Q {with_q}: {got} vs {want}"
        );
    }
    let labels = Tensor::from_vec(vec![1.0, 0.0, 1.0, 1.0, 0.0, 0.0], &[b]).unwrap();
    let got = pointwise_bce(&qt, &ct, &labels, tau)
        .unwrap()
        .to_vec::<f64>()
        .unwrap()[0];
    let y = [1.0, 0.0, 1.0, 1.0, 0.0, 0.0];
    let want: f64 = (0..b)
        .map(|i| {
            let x = dot(i, i) / tau;
            let p = 1.0 / (1.0 + (-x).exp());
            -(y[i] * p.ln() + (1.0 - y[i]) * (1.0 - p).ln())
        })
        .sum::<f64>()
        / b as f64;
    assert!((got - want).abs() < 1e-12, "{got} vs {want}");
    // Normalisation.
    let n = l2_normalize(&qt).unwrap().to_vec::<f64>().unwrap();
    for i in 0..b {
        let norm: f64 = (0..d).map(|k| q[i * d + k].powi(2)).sum::<f64>().sqrt();
        for k in 0..d {
            assert!((n[i * d + k] - q[i * d + k] / norm).abs() < 1e-14);
        }
    }
    // Shape errors name the op.
    let e = in_batch_softmax(&qt, &ct.narrow(0, 0, 3).unwrap(), None, tau).unwrap_err();
    assert!(e.to_string().contains("in_batch_softmax"), "{e}");
}

/// Gradients of both losses through f64 MLP towers and L2 normalisation, against central
/// finite differences.
#[test]
fn gradients_through_towers_match_finite_differences() {
    let mut rng = seeded(4);
    let (b, width, d) = (5, 6, 4);
    let qm = Mlp::with_dtype(width, &[8, d], Activation::Tanh, DType::F64, &mut rng).unwrap();
    let cm = Mlp::with_dtype(width, &[8, d], Activation::Tanh, DType::F64, &mut rng).unwrap();
    let xq = Tensor::from_vec(randn(&[b, width], 5), &[b, width])
        .unwrap()
        .with_requires_grad(true);
    let xc = Tensor::from_vec(randn(&[b, width], 6), &[b, width])
        .unwrap()
        .with_requires_grad(true);
    let lq = Tensor::from_vec(vec![-1.0, -2.0, -0.5, -3.0, -1.5], &[b]).unwrap();
    let labels = Tensor::from_vec(vec![1.0, 0.0, 0.0, 1.0, 1.0], &[b]).unwrap();
    for normalize in [false, true] {
        let towers = |x: &[Tensor]| {
            let q = qm.forward(&x[0])?;
            let c = cm.forward(&x[1])?;
            if normalize {
                Ok::<_, embers::Error>((l2_normalize(&q)?, l2_normalize(&c)?))
            } else {
                Ok((q, c))
            }
        };
        check_gradients(
            |x| {
                let (q, c) = towers(x)?;
                in_batch_softmax(&q, &c, Some(&lq), 0.5)
            },
            &[xq.clone(), xc.clone()],
            1e-6,
            1e-6,
        )
        .unwrap();
        check_gradients(
            |x| {
                let (q, c) = towers(x)?;
                pointwise_bce(&q, &c, &labels, 0.5)
            },
            &[xq.clone(), xc.clone()],
            1e-6,
            1e-6,
        )
        .unwrap();
    }
}

#[test]
fn the_frequency_estimator_tracks_each_items_rate() {
    let mut f = FrequencyEstimator::new(1 << 12, 0.05).unwrap();
    // Item 1 in every batch, item 2 in every 4th, item 3 in every 10th, item 4 never.
    for step in 1..=2000 {
        let mut ids = vec![1];
        if step % 4 == 0 {
            ids.push(2);
        }
        if step % 10 == 0 {
            ids.extend([3, 3]);
        }
        f.update(&ids);
    }
    for (id, rate) in [(1, 1.0), (2, 0.25), (3, 0.1)] {
        let p = f.probability(id);
        assert!((p - rate).abs() < 0.1 * rate, "item {id}: {p} vs {rate}");
    }
    assert_eq!(f.probability(4), 1.0, "an unseen item gets no correction");
    let lq = f.log_q(&[1, 2]).unwrap().to_vec::<f32>().unwrap();
    assert!((lq[1] - 0.25f32.ln()).abs() < 0.1);
    assert!(FrequencyEstimator::new(0, 0.1).is_err());
    assert!(FrequencyEstimator::new(8, 0.0).is_err());
}

/// Users and items with planted 8-dimensional factors and item popularity; interactions drawn
/// from the planted softmax. A TwoTower trained with in-batch softmax and log-Q correction
/// retrieves (through `TwoTower::retrieve` over an exact and an IVF-PQ index of the item
/// embeddings) held-out interactions with recall@10 close to the planted model's own.
#[test]
fn training_on_planted_factors_recovers_them() {
    let (users, items, k) = (200usize, 1000usize, 8usize);
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    let uf: Vec<f32> = (0..users * k)
        .map(|_| rng.sample::<f32, _>(StandardNormal) * 0.6)
        .collect();
    let itf: Vec<f32> = (0..items * k)
        .map(|_| rng.sample::<f32, _>(StandardNormal) * 0.6)
        .collect();
    let pop: Vec<f32> = (0..items)
        .map(|_| rng.sample::<f32, _>(StandardNormal))
        .collect();
    let planted = |u: usize, i: usize| -> f32 {
        (0..k).map(|j| uf[u * k + j] * itf[i * k + j]).sum::<f32>() + pop[i]
    };
    let sample = |rng: &mut ChaCha8Rng, u: usize| -> usize {
        let w: Vec<f64> = (0..items).map(|i| f64::from(planted(u, i)).exp()).collect();
        let mut t = rng.random::<f64>() * w.iter().sum::<f64>();
        for (i, x) in w.iter().enumerate() {
            t -= x;
            if t < 0.0 {
                return i;
            }
        }
        items - 1
    };
    let train: Vec<(usize, usize)> = (0..30_000)
        .map(|n| (n % users, 0))
        .map(|(u, _)| (u, sample(&mut rng, u)))
        .collect();
    let test: Vec<(usize, usize)> = (0..4_000)
        .map(|n| (n % users, 0))
        .map(|(u, _)| (u, sample(&mut rng, u)))
        .collect();
    let mut init = seeded(8);
    let d = 16;
    let tower = |name: &str, rows: usize, init: &mut embers::tensor::rng::Rng| {
        let tables = EmbeddingBagCollection::new(
            vec![EmbeddingBagConfig::new(
                format!("t_{name}"),
                rows,
                d,
                &[name],
            )],
            FusedOptimizer::RowWiseAdagrad { lr: 0.1, eps: 1e-8 },
            init,
        )
        .unwrap();
        let mlp = Mlp::new(d, &[d], Activation::Identity, init).unwrap();
        Tower::new(tables, mlp).unwrap()
    };
    let q = tower("user", users, &mut init);
    let c = tower("item", items, &mut init);
    let model = TwoTower::new(q, c, false, 1.0).unwrap();
    let mut opt = Adam::new(
        model.dense_parameters(),
        AdamConfig {
            lr: 0.01,
            ..Default::default()
        },
    )
    .unwrap();
    let mut freq = FrequencyEstimator::new(4096, 0.01).unwrap();
    let kjt = |key: &str, ids: Vec<i64>| one_hot(key, &ids);
    let batch = 128;
    let mut order: Vec<usize> = (0..train.len()).collect();
    for epoch in 0..8 {
        use rand::seq::SliceRandom;
        order.shuffle(&mut rng);
        let mut total = 0.0;
        for chunk in order.chunks(batch) {
            let u: Vec<i64> = chunk.iter().map(|&n| train[n].0 as i64).collect();
            let i: Vec<i64> = chunk.iter().map(|&n| train[n].1 as i64).collect();
            freq.update(&i);
            let qe = model.embed_queries(&kjt("user", u)).unwrap();
            let ce = model.embed_candidates(&kjt("item", i.clone())).unwrap();
            let loss = model
                .in_batch_loss(&qe, &ce, Some(&freq.log_q(&i).unwrap()))
                .unwrap();
            total += f64::from(loss.to_vec::<f32>().unwrap()[0]);
            loss.backward().unwrap();
            opt.step().unwrap();
            opt.zero_grad();
        }
        println!(
            "epoch {epoch}: mean loss {:.4}",
            total / (train.len() / batch) as f64
        );
    }
    // Retrieval: the catalogue embedded into an exact index and an IVF-PQ index, every user's
    // top-10 through the model's retrieval call.
    let item_ids: Vec<i64> = (0..items as i64).collect();
    let item_emb = model
        .embed_catalogue(&kjt("item", item_ids.clone()))
        .unwrap();
    let mut index = FlatIndex::new(d, Metric::InnerProduct).unwrap();
    index.add(&item_ids, &item_emb).unwrap();
    let all_users = kjt("user", (0..users as i64).collect());
    let top = model.retrieve(&all_users, &index, 10).unwrap();
    let config = IvfPqConfig {
        coarse_iters: 10,
        pq_iters: 10,
        ..IvfPqConfig::new(16, 4, Metric::InnerProduct)
    };
    let mut ivf = IvfPqIndex::train(config, &item_emb, d).unwrap();
    ivf.add(&item_ids, &item_emb).unwrap();
    let approx = model.retrieve(&all_users, &ivf.with_nprobe(8), 10).unwrap();
    let bad = FlatIndex::new(d + 1, Metric::InnerProduct).unwrap();
    assert!(model
        .retrieve(&all_users, &bad, 10)
        .unwrap_err()
        .to_string()
        .contains("dimension 17"));
    let planted_top: Vec<Vec<usize>> = (0..users)
        .map(|u| {
            let mut s: Vec<usize> = (0..items).collect();
            s.sort_by(|&a, &b| planted(u, b).total_cmp(&planted(u, a)));
            s[..10].to_vec()
        })
        .collect();
    let recall = |hit: &dyn Fn(usize, usize) -> bool| {
        test.iter().filter(|&&(u, i)| hit(u, i)).count() as f64 / test.len() as f64
    };
    let model_recall = recall(&|u, i| top.ids_of(u).contains(&(i as i64)));
    let ivf_recall = recall(&|u, i| approx.ids_of(u).contains(&(i as i64)));
    let ceiling = recall(&|u, i| planted_top[u].contains(&i));
    let mut popular: Vec<usize> = (0..items).collect();
    popular.sort_by(|&a, &b| pop[b].total_cmp(&pop[a]));
    let popularity = recall(&|_, i| popular[..10].contains(&i));
    println!("recall@10: model {model_recall:.3} (through IVF-PQ {ivf_recall:.3}), planted ceiling {ceiling:.3}, popularity {popularity:.3}");
    assert!(
        ivf_recall >= 0.8 * model_recall,
        "IVF-PQ {ivf_recall} vs exact {model_recall}"
    );
    assert!(
        model_recall >= 0.85 * ceiling,
        "model {model_recall} vs planted {ceiling}"
    );
    assert!(
        model_recall > popularity + 0.02,
        "model {model_recall} vs popularity {popularity}"
    );
}

/// The sampled softmax over the batch plus extra candidates, with log-Q and an additive mask,
/// against an f64 reference; its gradient by finite differences.
#[test]
fn sampled_softmax_with_extra_candidates_and_mask_matches_f64() {
    use embers::models::two_tower::sampled_softmax;
    let (b, n, d, tau) = (4, 7, 3, 0.8);
    let q = randn(&[b, d], 31);
    let c = randn(&[n, d], 32);
    let lq: Vec<f64> = randn(&[n], 33).iter().map(|x| -x.abs() - 0.2).collect();
    let mut m = vec![0.0; b * n];
    m[1] = -1e9; // row 0 ignores candidate 1
    m[2 * n + 5] = -1e9; // row 2 ignores candidate 5
    let qt = Tensor::from_vec(q.clone(), &[b, d]).unwrap();
    let ct = Tensor::from_vec(c.clone(), &[n, d]).unwrap();
    let lt = Tensor::from_vec(lq.clone(), &[n]).unwrap();
    let mt = Tensor::from_vec(m.clone(), &[b, n]).unwrap();
    let got = sampled_softmax(&qt, &ct, Some(&lt), Some(&mt), tau)
        .unwrap()
        .to_vec::<f64>()
        .unwrap()[0];
    let mut want = 0.0;
    for i in 0..b {
        let logits: Vec<f64> = (0..n)
            .map(|j| {
                (0..d).map(|k| q[i * d + k] * c[j * d + k]).sum::<f64>() / tau - lq[j]
                    + m[i * n + j]
            })
            .collect();
        let max = logits.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let lse = max + logits.iter().map(|l| (l - max).exp()).sum::<f64>().ln();
        want += (lse - logits[i]) / b as f64;
    }
    assert!((got - want).abs() < 1e-12, "{got} vs {want}");
    check_gradients(
        |x| sampled_softmax(&x[0], &x[1], Some(&lt), Some(&mt), tau),
        &[
            qt.clone().with_requires_grad(true),
            ct.clone().with_requires_grad(true),
        ],
        1e-6,
        1e-6,
    )
    .unwrap();
    // Fewer candidates than queries, and masks or log-Q of the wrong shape, are named errors.
    for e in [
        sampled_softmax(&qt, &ct.narrow(0, 0, 3).unwrap(), None, None, tau).unwrap_err(),
        sampled_softmax(&qt, &ct, Some(&lt.narrow(0, 0, 3).unwrap()), None, tau).unwrap_err(),
        sampled_softmax(&qt, &ct, None, Some(&mt.narrow(1, 0, 3).unwrap()), tau).unwrap_err(),
    ] {
        assert!(e.to_string().contains("sampled_softmax"), "{e}");
    }
}

#[test]
fn towers_that_do_not_fit_are_named_errors() {
    let mut init = seeded(40);
    let tables = |d: usize, init: &mut embers::tensor::rng::Rng| {
        EmbeddingBagCollection::new(
            vec![EmbeddingBagConfig::new("t", 10, d, &["f"])],
            FusedOptimizer::Sgd { lr: 0.1 },
            init,
        )
        .unwrap()
    };
    let t8 = tables(8, &mut init);
    let mlp = Mlp::new(4, &[4], Activation::Relu, &mut init).unwrap();
    let e = Tower::new(t8.clone(), mlp).unwrap_err().to_string();
    assert!(
        e.contains("Tower::new") && e.contains("4 inputs") && e.contains("8"),
        "{e}"
    );
    let q = Tower::new(
        t8.clone(),
        Mlp::new(8, &[4], Activation::Relu, &mut init).unwrap(),
    )
    .unwrap();
    let c = Tower::new(t8, Mlp::new(8, &[5], Activation::Relu, &mut init).unwrap()).unwrap();
    let e = TwoTower::new(q.clone(), c, false, 1.0)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("TwoTower::new") && e.contains('4') && e.contains('5'),
        "{e}"
    );
    for t in [0.0, -1.0, f64::NAN, f64::INFINITY] {
        let e = TwoTower::new(q.clone(), q.clone(), false, t)
            .unwrap_err()
            .to_string();
        assert!(e.contains("temperature"), "{t}: {e}");
    }
}

/// One-hot features of one key.
fn one_hot(key: &str, ids: &[i64]) -> KeyedJaggedTensor {
    KeyedJaggedTensor::one_hot(key, ids).unwrap()
}

fn trainer_config(loss: embers::train::TwoTowerLoss) -> embers::train::TwoTowerConfig {
    use embers::train::{DenseOptimizer, TwoTowerConfig};
    TwoTowerConfig {
        query_features: vec![("user".into(), 40)],
        candidate_features: vec![("item".into(), 60)],
        embedding_dim: 8,
        layers: vec![16, 8],
        normalize: true,
        temperature: 0.2,
        loss,
        estimator_buckets: 256,
        estimator_alpha: 0.05,
        sparse_optimizer: FusedOptimizer::RowWiseAdagrad {
            lr: 0.05,
            eps: 1e-8,
        },
        dense_optimizer: DenseOptimizer::Adam { lr: 0.01 },
        seed: 41,
        device: embers::Device::Cpu,
    }
}

fn pair_batch(step: u64, labels: bool) -> embers::train::PairBatch {
    let mut rng = ChaCha8Rng::seed_from_u64(100 + step);
    let users: Vec<i64> = (0..16).map(|_| rng.random_range(0..40)).collect();
    // Items correlated with users (so there is something to learn), with repeats in a batch.
    let items: Vec<i64> = users
        .iter()
        .map(|u| (u * 3 + rng.random_range(0..3)) % 60)
        .collect();
    embers::train::PairBatch {
        queries: one_hot("user", &users),
        candidates: one_hot("item", &items),
        candidate_ids: items,
        labels: labels.then(|| {
            let y: Vec<f32> = (0..16).map(|i| (i % 2) as f32).collect();
            Tensor::from_vec(y, &[16]).unwrap()
        }),
    }
}

fn sampler() -> embers::train::NegativeSampler {
    Box::new(|ids: &[i64]| Ok(one_hot("item", ids)))
}

/// Training through the trainer with mixed negatives lowers the loss; a checkpoint taken
/// midway and loaded into a fresh trainer continues bit-identically (tables with their
/// optimizer state, MLPs with Adam's, the frequency estimator, the negatives' draws).
#[test]
fn the_trainer_resumes_from_a_checkpoint_exactly() {
    use embers::train::TwoTowerLoss;
    let loss = TwoTowerLoss::Softmax {
        log_q: true,
        random_negatives: 8,
    };
    let dir = std::env::temp_dir().join(format!("embers-two-tower-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("tt.ckpt");
    let mut a = trainer_config(loss)
        .build()
        .unwrap()
        .with_negative_sampler(60, sampler())
        .unwrap();
    let first: Vec<f64> = (0..30)
        .map(|s| a.train_step(&pair_batch(s, false)).unwrap())
        .collect();
    let early: f64 = first[..5].iter().sum::<f64>() / 5.0;
    let late: f64 = first[25..].iter().sum::<f64>() / 5.0;
    assert!(late < early - 0.1, "loss {early} -> {late}");
    let user = std::collections::BTreeMap::from([("epoch".to_string(), "3".to_string())]);
    a.save_checkpoint(&path, &user).unwrap();
    let config = embers::train::TwoTowerConfig::from_checkpoint(&path).unwrap();
    assert_eq!(config, trainer_config(loss));
    let mut b = config
        .build()
        .unwrap()
        .with_negative_sampler(60, sampler())
        .unwrap();
    assert_eq!(b.load_checkpoint(&path).unwrap(), user);
    assert_eq!((b.step(), b.examples_seen()), (30, 30 * 16));
    for s in 30..40 {
        let la = a.train_step(&pair_batch(s, false)).unwrap();
        let lb = b.train_step(&pair_batch(s, false)).unwrap();
        assert_eq!(la.to_bits(), lb.to_bits(), "step {s}: {la} vs {lb}");
    }
    for (t, (x, y)) in [
        ("t_user", (&a.model().query.tables, &b.model().query.tables)),
        (
            "t_item",
            (&a.model().candidate.tables, &b.model().candidate.tables),
        ),
    ] {
        assert_eq!(
            x.table_weights(t).unwrap(),
            y.table_weights(t).unwrap(),
            "{t}"
        );
    }
    // Bad checkpoints change nothing: another configuration, a truncated file, not a file of
    // this kind.
    let mut other = trainer_config(TwoTowerLoss::Pointwise).build().unwrap();
    let e = other.load_checkpoint(&path).unwrap_err().to_string();
    assert!(e.contains("another configuration"), "{e}");
    let bytes = std::fs::read(&path).unwrap();
    let cut = dir.join("cut.ckpt");
    std::fs::write(&cut, &bytes[..bytes.len() / 2]).unwrap();
    let before = b.model().query.tables.table_weights("t_user").unwrap();
    let e = b.load_checkpoint(&cut).unwrap_err().to_string();
    assert!(e.contains("cut.ckpt"), "{e}");
    assert_eq!(
        b.model().query.tables.table_weights("t_user").unwrap(),
        before
    );
    assert_eq!(b.step(), 40);
    std::fs::remove_dir_all(&dir).ok();
}

/// A checkpoint whose configuration names a model larger than the file (more estimator
/// buckets, wider towers, larger tables) is refused before anything is built, naming the
/// file; a configuration built directly with such sizes is an error, not a panic.
#[test]
fn a_configuration_larger_than_its_checkpoint_is_refused_before_building() {
    use embers::train::{TwoTowerConfig, TwoTowerLoss};
    let dir = std::env::temp_dir().join(format!("embers-two-tower-big-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("tt.ckpt");
    let config = trainer_config(TwoTowerLoss::Pointwise);
    config
        .build()
        .unwrap()
        .save_checkpoint(&path, &Default::default())
        .unwrap();
    let saved = std::fs::read(&path).unwrap();
    type Edit = fn(&mut serde_json::Value);
    let edits: [(&str, Edit); 3] = [
        ("buckets", |j| j["estimator_buckets"] = (1u64 << 61).into()),
        ("layers", |j| j["layers"] = serde_json::json!([1u64 << 40])),
        ("rows", |j| {
            j["candidate_features"][0][1] = (1u64 << 50).into()
        }),
    ];
    for (what, edit) in edits {
        std::fs::write(&path, &saved).unwrap();
        config_edit::rewrite(&path, edit);
        let msg = TwoTowerConfig::from_checkpoint(&path)
            .unwrap_err()
            .to_string();
        assert!(
            msg.contains("tt.ckpt") && msg.contains("describes weights"),
            "{what}: {msg}"
        );
    }
    let refusal = |c: &TwoTowerConfig| c.build().err().map(|e| e.to_string()).unwrap_or_default();
    let mut buckets = config.clone();
    buckets.estimator_buckets = 1 << 61;
    assert!(refusal(&buckets).contains("past any memory"));
    let mut wide = config.clone();
    wide.embedding_dim = usize::MAX / 2;
    let msg = refusal(&wide);
    assert!(msg.contains("`t_user` is too large"), "{msg}");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn trainer_misuse_is_a_named_error() {
    use embers::train::TwoTowerLoss;
    // Random negatives without a sampler.
    let mut t = trainer_config(TwoTowerLoss::Softmax {
        log_q: false,
        random_negatives: 4,
    })
    .build()
    .unwrap();
    let e = t.train_step(&pair_batch(0, false)).unwrap_err().to_string();
    assert!(e.contains("with_negative_sampler"), "{e}");
    // Pointwise without labels; then with labels it trains.
    let mut t = trainer_config(TwoTowerLoss::Pointwise).build().unwrap();
    let e = t.train_step(&pair_batch(0, false)).unwrap_err().to_string();
    assert!(e.contains("labels"), "{e}");
    assert!(t.train_step(&pair_batch(0, true)).unwrap().is_finite());
    // Candidate ids that do not match the rows.
    let mut batch = pair_batch(1, true);
    batch.candidate_ids.pop();
    let e = t.train_step(&batch).unwrap_err().to_string();
    assert!(e.contains("15 candidate ids"), "{e}");
    // A configuration without features.
    let mut c = trainer_config(TwoTowerLoss::Pointwise);
    c.query_features.clear();
    assert!(c.build().is_err());
    // Labels outside [0, 1] (NaN included) are refused before anything changes: the next
    // steps are those of a trainer that never saw them (a NaN label trained NaN into the
    // tables, then reported the loss).
    let build = || trainer_config(TwoTowerLoss::Pointwise).build().unwrap();
    let (mut bad, mut good) = (build(), build());
    for y in [f32::NAN, 2.0, -0.5] {
        let mut batch = pair_batch(2, true);
        let mut labels = vec![1.0f32; 16];
        labels[5] = y;
        batch.labels = Some(Tensor::from_vec(labels, &[16]).unwrap());
        let e = bad.train_step(&batch).unwrap_err().to_string();
        assert!(e.contains("label 5 is") && e.contains("[0, 1]"), "{e}");
    }
    for s in 3..6 {
        let batch = pair_batch(s, true);
        assert_eq!(
            bad.train_step(&batch).unwrap(),
            good.train_step(&batch).unwrap()
        );
    }
    // An empty batch: nothing to train on (its mean loss was 0/0).
    let empty = embers::train::PairBatch {
        queries: one_hot("user", &[]),
        candidates: one_hot("item", &[]),
        candidate_ids: Vec::new(),
        labels: Some(Tensor::from_vec(Vec::<f32>::new(), &[0]).unwrap()),
    };
    let e = bad.train_step(&empty).unwrap_err().to_string();
    assert!(e.contains("an empty batch"), "{e}");
    // No catalogue to draw negatives from, or one past the ids.
    for catalogue in [0, usize::MAX] {
        let e = build()
            .with_negative_sampler(catalogue, sampler())
            .err()
            .expect("refused")
            .to_string();
        assert!(
            e.contains(&format!("a catalogue of {catalogue} items")),
            "{e}"
        );
    }
    // The public losses refuse a temperature the logits cannot be divided by.
    let q = Tensor::from_vec(vec![1.0f32; 8], &[2, 4]).unwrap();
    let y = Tensor::from_vec(vec![1.0f32, 0.0], &[2]).unwrap();
    // Nor one whose f32 or inverse is not a normal number (1e-40: infinite logits, then
    // NaN; 1e300: all logits 0, a loss without gradient).
    for t in [0.0, -1.0, f64::NAN, f64::INFINITY, 1e-40, 1e300] {
        for e in [
            in_batch_softmax(&q, &q, None, t).unwrap_err().to_string(),
            pointwise_bce(&q, &q, &y, t).unwrap_err().to_string(),
        ] {
            assert!(e.contains("must be positive"), "{t}: {e}");
        }
    }
}

/// Batches the softmax cannot learn from, and constants that are not numbers, are refused
/// (they trained with loss 0 and no gradient, or a NaN loss); a failed step leaves the
/// trainer, its frequency estimator included, as it was; on the host a diverging step is not
/// taken.
#[test]
fn softmax_batches_without_negatives_and_failed_steps_change_nothing() {
    use embers::models::two_tower::sampled_softmax;
    use embers::train::TwoTowerLoss;
    let q = Tensor::from_vec(vec![0.5f32; 12], &[3, 4]).unwrap();
    let one = Tensor::from_vec(vec![0.5f32; 4], &[1, 4]).unwrap();
    let e = in_batch_softmax(&one, &one, None, 0.2)
        .unwrap_err()
        .to_string();
    assert!(e.contains("row 0 has no negative"), "{e}");
    let empty = Tensor::from_vec(Vec::<f32>::new(), &[0, 4]).unwrap();
    let e = in_batch_softmax(&empty, &empty, None, 0.2)
        .unwrap_err()
        .to_string();
    assert!(e.contains("an empty batch"), "{e}");
    let lq = Tensor::from_vec(vec![0.0f32, f32::NAN, 0.0], &[3]).unwrap();
    let e = in_batch_softmax(&q, &q, Some(&lq), 0.2)
        .unwrap_err()
        .to_string();
    assert!(e.contains("log_q[1] is NaN"), "{e}");
    let mask = |m: [f32; 9]| Tensor::from_vec(m.to_vec(), &[3, 3]).unwrap();
    let ninf = f32::NEG_INFINITY;
    for (m, says) in [
        (
            [0.0, f32::NAN, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0],
            "mask[0][1] is NaN",
        ),
        (
            [0.0, 0.0, 0.0, 0.0, ninf, 0.0, 0.0, 0.0, 0.0],
            "removes row 1's own positive",
        ),
        (
            [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, ninf, ninf, 0.0],
            "row 2 has no negative",
        ),
    ] {
        let e = sampled_softmax(&q, &q, None, Some(&mask(m)), 0.2)
            .unwrap_err()
            .to_string();
        assert!(e.contains(says), "{e}");
    }
    // −∞ removes a column exactly: the loss is that of the other columns alone.
    let removed = sampled_softmax(
        &q,
        &q,
        None,
        Some(&mask([0.0, ninf, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0])),
        0.2,
    )
    .unwrap()
    .item()
    .unwrap();
    assert!(removed.is_finite());

    // The trainer: labels under the softmax, a batch of one row without negatives, a sampler
    // giving the wrong rows; each refused, and the trainer then steps as one that never saw
    // them (the estimator had recorded the failed batch).
    let softmax = |random_negatives| TwoTowerLoss::Softmax {
        log_q: true,
        random_negatives,
    };
    let wrong_sampler: embers::train::NegativeSampler =
        Box::new(|ids: &[i64]| Ok(one_hot("item", &ids[1..])));
    let mut bad = trainer_config(softmax(3))
        .build()
        .unwrap()
        .with_negative_sampler(60, wrong_sampler)
        .unwrap();
    let e = bad
        .train_step(&pair_batch(0, true))
        .unwrap_err()
        .to_string();
    assert!(e.contains("does not read"), "{e}");
    let e = bad
        .train_step(&pair_batch(0, false))
        .unwrap_err()
        .to_string();
    assert!(e.contains("gave 2 candidate rows for 3 sampled ids"), "{e}");
    let mut lone = trainer_config(softmax(0)).build().unwrap();
    let single = embers::train::PairBatch {
        queries: one_hot("user", &[3]),
        candidates: one_hot("item", &[9]),
        candidate_ids: vec![9],
        labels: None,
    };
    let e = lone.train_step(&single).unwrap_err().to_string();
    assert!(e.contains("row 0 has no negative"), "{e}");
    let mut fresh = trainer_config(softmax(0)).build().unwrap();
    for s in 1..4 {
        let batch = pair_batch(s, false);
        assert_eq!(
            lone.train_step(&batch).unwrap().to_bits(),
            fresh.train_step(&batch).unwrap().to_bits(),
            "step {s}"
        );
    }
    // Divergence: a dense learning rate of 1e25 moves the weights by about 1e25 a step, still
    // finite, but the next forward's activations overflow; the step whose loss is not finite
    // is not taken (its checkpoint is the one before it). (Weights past f32 themselves are
    // refused by the save: a checkpoint's values are finite.)
    let mut config = trainer_config(softmax(0));
    config.sparse_optimizer = FusedOptimizer::Sgd { lr: 0.1 };
    config.dense_optimizer = embers::train::DenseOptimizer::Adam { lr: 1e25 };
    let mut t = config.build().unwrap();
    let dir = std::env::temp_dir().join(format!("embers-tt-diverge-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (before, after) = (
        dir.join("before.safetensors"),
        dir.join("after.safetensors"),
    );
    let mut diverged = None;
    for s in 0..20 {
        t.save_checkpoint(&before, &Default::default()).unwrap();
        if let Err(e) = t.train_step(&pair_batch(s, false)) {
            diverged = Some(e.to_string());
            break;
        }
    }
    let e = diverged.expect("a non-finite loss within 20 steps");
    assert!(e.contains("diverged") && e.contains("not taken"), "{e}");
    t.save_checkpoint(&after, &Default::default()).unwrap();
    // Equal headers (as JSON: the metadata's order is a map's) and equal tensor bytes.
    let parts = |path: &std::path::Path| {
        let bytes = std::fs::read(path).unwrap();
        let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
        (header, bytes[8 + n..].to_vec())
    };
    assert!(
        parts(&before) == parts(&after),
        "the diverging step changed the trainer"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
