//! The training TBE against the float64 reference where FBGEMM's CPU build cannot produce
//! values: Adam, dims that are not multiples of 4, pooling NONE, optimizer none (row-sparse
//! gradients), weight decay, shared tables; over several random steps with duplicates and
//! empty bags, i32 and i64 ids.
#![allow(clippy::needless_range_loop)]

#[path = "support/tbe_reference.rs"]
mod tbe_reference;

use embers::embedding::{
    BoundsCheckMode, EmbeddingInit, FusedOptimizer, PoolingMode, TableBatchedEmbedding, TableSpec,
    TbeConfig, TbeInput, WeightDecay,
};
use embers::tensor::rng::seeded;
use embers::{DType, Gradient, Tensor};
use rand::Rng as _;
use tbe_reference::{assert_close, RefDecay, RefOptimizer, RefPooling, RefTbe};

struct Batch {
    indices: Vec<i64>,
    offsets: Vec<i64>,
    weights: Option<Vec<f32>>,
}

fn random_batch(
    rng: &mut embers::tensor::rng::Rng,
    rows_per_feature: &[usize],
    b: usize,
    weighted: bool,
) -> Batch {
    let mut indices = Vec::new();
    let mut offsets = vec![0i64];
    for &rows in rows_per_feature {
        for _ in 0..b {
            // Lengths 0..=5 (empty bags included); few rows, so duplicates are common.
            let len = rng.random_range(0..=5);
            for _ in 0..len {
                indices.push(rng.random_range(0..rows as i64));
            }
            offsets.push(indices.len() as i64);
        }
    }
    let weights = weighted.then(|| {
        (0..indices.len())
            .map(|_| rng.random_range(0.25f32..1.75))
            .collect()
    });
    Batch {
        indices,
        offsets,
        weights,
    }
}

fn to_ref_opt(o: FusedOptimizer) -> RefOptimizer {
    match o {
        FusedOptimizer::None => RefOptimizer::None,
        FusedOptimizer::Sgd { lr } => RefOptimizer::Sgd { lr: lr as f64 },
        FusedOptimizer::Adagrad { lr, eps } => RefOptimizer::Adagrad {
            lr: lr as f64,
            eps: eps as f64,
        },
        FusedOptimizer::RowWiseAdagrad { lr, eps } => RefOptimizer::RowWiseAdagrad {
            lr: lr as f64,
            eps: eps as f64,
        },
        FusedOptimizer::Adam {
            lr,
            beta1,
            beta2,
            eps,
        } => RefOptimizer::Adam {
            lr: lr as f64,
            beta1: beta1 as f64,
            beta2: beta2 as f64,
            eps: eps as f64,
        },
        FusedOptimizer::PartialRowWiseAdam {
            lr,
            beta1,
            beta2,
            eps,
        } => RefOptimizer::PartialRowWiseAdam {
            lr: lr as f64,
            beta1: beta1 as f64,
            beta2: beta2 as f64,
            eps: eps as f64,
        },
        FusedOptimizer::Lamb {
            lr,
            beta1,
            beta2,
            eps,
        } => RefOptimizer::Lamb {
            lr: lr as f64,
            beta1: beta1 as f64,
            beta2: beta2 as f64,
            eps: eps as f64,
        },
        FusedOptimizer::PartialRowWiseLamb {
            lr,
            beta1,
            beta2,
            eps,
        } => RefOptimizer::PartialRowWiseLamb {
            lr: lr as f64,
            beta1: beta1 as f64,
            beta2: beta2 as f64,
            eps: eps as f64,
        },
    }
}

fn to_ref_decay(d: WeightDecay) -> RefDecay {
    match d {
        WeightDecay::None => RefDecay::None,
        WeightDecay::L2(l) => RefDecay::L2(l as f64),
        WeightDecay::Decoupled(l) => RefDecay::Decoupled(l as f64),
    }
}

#[allow(clippy::too_many_arguments)]
/// Runs `steps` random forward/backward steps through autograd and compares everything with
/// the reference after each.
fn run_against_reference(
    tables: &[(usize, usize)],
    ftm: &[usize],
    pooling: PoolingMode,
    optimizer: FusedOptimizer,
    decay: WeightDecay,
    weighted: bool,
    use_i32: bool,
    seed: u64,
) {
    let label = format!("{tables:?} ftm {ftm:?} {pooling:?} {optimizer:?} {decay:?} weighted={weighted} i32={use_i32}");
    let specs: Vec<TableSpec> = tables
        .iter()
        .enumerate()
        .map(|(t, &(r, d))| TableSpec::new(format!("t{t}"), r, d))
        .collect();
    let mut cfg = TbeConfig::new(specs, ftm.to_vec(), pooling, optimizer);
    cfg.weight_decay = decay;
    let tbe = TableBatchedEmbedding::new(cfg).unwrap();
    let mut rng = seeded(seed);
    tbe.init_weights(
        EmbeddingInit::Uniform {
            low: -0.5,
            high: 0.5,
        },
        &mut rng,
    )
    .unwrap();
    let initial: Vec<Vec<f64>> = (0..tables.len())
        .map(|t| {
            tbe.table_weights(t)
                .unwrap()
                .iter()
                .map(|&x| x as f64)
                .collect()
        })
        .collect();
    let ref_pool = match pooling {
        PoolingMode::Sum => RefPooling::Sum,
        PoolingMode::Mean => RefPooling::Mean,
        PoolingMode::None => RefPooling::None,
    };
    let mut reference = RefTbe::new(
        tables.to_vec(),
        ftm.to_vec(),
        ref_pool,
        to_ref_opt(optimizer),
        to_ref_decay(decay),
        initial,
    );
    let rows_per_feature: Vec<usize> = ftm.iter().map(|&t| tables[t].0).collect();
    for step in 0..3 {
        let what = |x: &str| format!("{label} step {step} {x}");
        let batch = random_batch(&mut rng, &rows_per_feature, 3, weighted);
        let idx_t = if use_i32 {
            Tensor::from_vec(
                batch.indices.iter().map(|&x| x as i32).collect::<Vec<_>>(),
                &[batch.indices.len()],
            )
            .unwrap()
        } else {
            Tensor::from_vec(batch.indices.clone(), &[batch.indices.len()]).unwrap()
        };
        let off_t = Tensor::from_vec(batch.offsets.clone(), &[batch.offsets.len()]).unwrap();
        let psw_t = batch.weights.as_ref().map(|w| {
            Tensor::from_vec(w.clone(), &[w.len()])
                .unwrap()
                .with_requires_grad(true)
        });
        let out = tbe.forward(&idx_t, &off_t, psw_t.as_ref()).unwrap();
        let psw64: Option<Vec<f64>> = batch
            .weights
            .as_ref()
            .map(|w| w.iter().map(|&x| x as f64).collect());
        let r_out = reference.forward(&batch.indices, &batch.offsets, psw64.as_deref());
        assert_close(
            &out.to_vec_f64().unwrap(),
            &r_out,
            1e-5,
            1e-6,
            &what("output"),
        );
        let grad: Vec<f32> = (0..out.numel())
            .map(|_| rng.random_range(-1.0f32..1.0))
            .collect();
        let grad64: Vec<f64> = grad.iter().map(|&x| x as f64).collect();
        let r_psw = reference.backward(&batch.indices, &batch.offsets, psw64.as_deref(), &grad64);
        tbe.zero_sparse_gradients();
        out.backward_with(&Tensor::from_vec(grad, out.shape()).unwrap(), false)
            .unwrap();
        if let (Some(w), Some(r)) = (&psw_t, &r_psw) {
            assert_close(
                &w.grad().unwrap().to_vec_f64().unwrap(),
                r,
                1e-5,
                1e-6,
                &what("per-sample-weight grad"),
            );
        }
        for t in 0..tables.len() {
            let w: Vec<f64> = tbe
                .table_weights(t)
                .unwrap()
                .iter()
                .map(|&x| x as f64)
                .collect();
            assert_close(
                &w,
                &reference.weights[t],
                1e-5,
                1e-6,
                &what(&format!("table {t} weights")),
            );
            if !reference.m1[t].is_empty() {
                let m: Vec<f64> = tbe
                    .optimizer_state(0, t)
                    .unwrap()
                    .iter()
                    .map(|&x| x as f64)
                    .collect();
                assert_close(
                    &m,
                    &reference.m1[t],
                    1e-5,
                    1e-6,
                    &what(&format!("table {t} momentum1")),
                );
            }
            if !reference.m2[t].is_empty() {
                let m: Vec<f64> = tbe
                    .optimizer_state(1, t)
                    .unwrap()
                    .iter()
                    .map(|&x| x as f64)
                    .collect();
                assert_close(
                    &m,
                    &reference.m2[t],
                    1e-5,
                    1e-6,
                    &what(&format!("table {t} momentum2")),
                );
            }
            if optimizer == FusedOptimizer::None {
                let expected = &reference.last_sparse[t];
                match tbe.sparse_gradient(t) {
                    Some(g) => {
                        assert_eq!(g.num_rows, tables[t].0);
                        let rows: Vec<usize> = g.rows.iter().map(|&r| r as usize).collect();
                        assert_eq!(
                            rows,
                            expected.keys().copied().collect::<Vec<_>>(),
                            "{}",
                            what("sparse rows")
                        );
                        let flat: Vec<f64> = expected.values().flatten().copied().collect();
                        assert_close(
                            &g.values.to_vec_f64().unwrap(),
                            &flat,
                            1e-5,
                            1e-6,
                            &what("sparse values"),
                        );
                    }
                    None => assert!(expected.is_empty(), "{}", what("missing sparse gradient")),
                }
            }
        }
    }
}

const ODD_TABLES: [(usize, usize); 3] = [(7, 3), (5, 1), (9, 13)];

#[test]
fn every_optimizer_and_pooling_with_odd_dims_follows_the_f64_reference() {
    let optimizers = [
        FusedOptimizer::None,
        FusedOptimizer::Sgd { lr: 0.1 },
        FusedOptimizer::Adagrad { lr: 0.1, eps: 1e-3 },
        FusedOptimizer::RowWiseAdagrad { lr: 0.1, eps: 1e-3 },
        FusedOptimizer::Adam {
            lr: 0.01,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
        },
        FusedOptimizer::PartialRowWiseAdam {
            lr: 0.01,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
        },
        FusedOptimizer::Lamb {
            lr: 0.01,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-6,
        },
        FusedOptimizer::PartialRowWiseLamb {
            lr: 0.01,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-6,
        },
    ];
    let mut seed = 0;
    for opt in optimizers {
        for pooling in [PoolingMode::Sum, PoolingMode::Mean] {
            for weighted in [false, true] {
                seed += 1;
                // Tables 0 and 2 are each read by two features (shared tables).
                run_against_reference(
                    &ODD_TABLES,
                    &[0, 1, 2, 0, 2],
                    pooling,
                    opt,
                    WeightDecay::None,
                    weighted,
                    seed % 2 == 0,
                    seed,
                );
            }
        }
        // Pooling NONE needs one dim across features.
        seed += 1;
        run_against_reference(
            &[(6, 5), (4, 5)],
            &[0, 1, 0],
            PoolingMode::None,
            opt,
            WeightDecay::None,
            seed % 2 == 0,
            false,
            seed,
        );
    }
}

#[test]
fn weight_decay_is_applied_to_the_touched_rows() {
    let mut seed = 100;
    for opt in [
        FusedOptimizer::Sgd { lr: 0.1 },
        FusedOptimizer::Adagrad { lr: 0.1, eps: 1e-3 },
        FusedOptimizer::RowWiseAdagrad { lr: 0.1, eps: 1e-3 },
        FusedOptimizer::Adam {
            lr: 0.01,
            beta1: 0.9,
            beta2: 0.99,
            eps: 1e-6,
        },
        FusedOptimizer::PartialRowWiseAdam {
            lr: 0.01,
            beta1: 0.9,
            beta2: 0.99,
            eps: 1e-6,
        },
        FusedOptimizer::Lamb {
            lr: 0.01,
            beta1: 0.9,
            beta2: 0.99,
            eps: 1e-6,
        },
        FusedOptimizer::PartialRowWiseLamb {
            lr: 0.01,
            beta1: 0.9,
            beta2: 0.99,
            eps: 1e-6,
        },
    ] {
        for decay in [WeightDecay::L2(0.1), WeightDecay::Decoupled(0.1)] {
            seed += 1;
            run_against_reference(
                &ODD_TABLES,
                &[0, 1, 2],
                PoolingMode::Sum,
                opt,
                decay,
                false,
                false,
                seed,
            );
        }
    }
}

#[test]
fn duplicate_ids_are_summed_deterministically_whatever_the_thread_count() {
    // Many duplicates of few rows across bags and features: run on 1 and 2 threads, the updated
    // tables must be bit-identical.
    let tables = [(3usize, 17usize), (2, 9)];
    let run = |threads: usize| {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        pool.install(|| {
            let specs = tables
                .iter()
                .enumerate()
                .map(|(t, &(r, d))| TableSpec::new(format!("t{t}"), r, d))
                .collect();
            let tbe = TableBatchedEmbedding::new(TbeConfig::new(
                specs,
                vec![0, 1, 0],
                PoolingMode::Mean,
                FusedOptimizer::RowWiseAdagrad { lr: 0.3, eps: 1e-6 },
            ))
            .unwrap();
            let mut rng = seeded(5);
            tbe.init_weights(EmbeddingInit::Normal { std: 1.0 }, &mut rng)
                .unwrap();
            let b = 64;
            let batch = random_batch(&mut rng, &[3, 2, 3], b, true);
            let input = TbeInput::new(&batch.indices[..], &batch.offsets[..])
                .with_weights(batch.weights.as_ref().unwrap());
            let grad: Vec<f32> = (0..b * (17 + 9 + 17))
                .map(|i| ((i * 7919) % 1000) as f32 / 997.0 - 0.5)
                .collect();
            let out = tbe.backward_fused(input, &grad).unwrap();
            (
                (0..2)
                    .map(|t| tbe.table_weights(t).unwrap())
                    .collect::<Vec<_>>(),
                out.per_sample_weights_grad.unwrap(),
            )
        })
    };
    let (w1, g1) = run(1);
    let (w2, g2) = run(2);
    for (a, b) in w1.iter().zip(&w2) {
        assert_eq!(
            a.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            b.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
        );
    }
    assert_eq!(
        g1.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
        g2.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
    );
}

#[test]
fn per_sample_weight_gradient_matches_finite_differences() {
    // d(Σ r ⊙ out)/dw_k by central differences of the lookup (SGD with lr 0 keeps the tables).
    let tables = [(5usize, 3usize), (4, 6)];
    for pooling in [PoolingMode::Sum, PoolingMode::Mean] {
        let specs = tables
            .iter()
            .enumerate()
            .map(|(t, &(r, d))| TableSpec::new(format!("t{t}"), r, d))
            .collect();
        let tbe = TableBatchedEmbedding::new(TbeConfig::one_feature_per_table(
            specs,
            pooling,
            FusedOptimizer::Sgd { lr: 0.0 },
        ))
        .unwrap();
        let mut rng = seeded(9);
        tbe.init_weights(
            EmbeddingInit::Uniform {
                low: -1.0,
                high: 1.0,
            },
            &mut rng,
        )
        .unwrap();
        let batch = random_batch(&mut rng, &[5, 4], 4, true);
        let w = batch.weights.clone().unwrap();
        let r: Vec<f32> = (0..4 * 9).map(|_| rng.random_range(0.5f32..1.5)).collect();
        let project = |w: &[f32]| -> f64 {
            let out = tbe
                .lookup(TbeInput::new(&batch.indices[..], &batch.offsets[..]).with_weights(w))
                .unwrap();
            out.to_vec::<f32>()
                .unwrap()
                .iter()
                .zip(&r)
                .map(|(&a, &b)| a as f64 * b as f64)
                .sum()
        };
        let analytic = tbe
            .backward_fused(
                TbeInput::new(&batch.indices[..], &batch.offsets[..]).with_weights(&w),
                &r,
            )
            .unwrap()
            .per_sample_weights_grad
            .unwrap();
        for k in 0..w.len() {
            let eps = 1e-2f32;
            let (mut plus, mut minus) = (w.clone(), w.clone());
            plus[k] += eps;
            minus[k] -= eps;
            let numeric = (project(&plus) - project(&minus)) / (2.0 * eps as f64);
            assert!(
                (analytic[k] as f64 - numeric).abs() <= 1e-3 * (1.0 + numeric.abs()),
                "{pooling:?} weight {k}: {} vs {numeric}",
                analytic[k]
            );
        }
    }
}

#[test]
fn warn_and_skip_drops_bad_ids_and_counts_them() {
    let specs = vec![TableSpec::new("a", 4, 2), TableSpec::new("b", 3, 2)];
    let mut cfg =
        TbeConfig::one_feature_per_table(specs, PoolingMode::Mean, FusedOptimizer::Sgd { lr: 1.0 });
    cfg.bounds_check = BoundsCheckMode::WarnAndSkip;
    let tbe = TableBatchedEmbedding::new(cfg).unwrap();
    tbe.set_table_weights(0, &[0., 0., 1., 1., 2., 2., 3., 3.])
        .unwrap();
    tbe.set_table_weights(1, &[10., 10., 20., 20., 30., 30.])
        .unwrap();
    // B = 2; feature a: [1, 9(bad)], [3]; feature b: [-1(bad), 2], [].
    let indices = [1i64, 9, 3, -1, 2];
    let offsets = [0i64, 2, 3, 5, 5];
    let weights = [1.0f32, 5.0, 1.0, 7.0, 2.0];
    let out = tbe
        .lookup(TbeInput::new(&indices[..], &offsets[..]).with_weights(&weights))
        .unwrap();
    // Skipped ids do not count in MEAN's L.
    assert_eq!(
        out.to_vec::<f32>().unwrap(),
        vec![1., 1., 60., 60., 3., 3., 0., 0.]
    );
    assert_eq!(tbe.bounds_check_warnings(), 2);
    // Backward through autograd: the skipped positions get zero weight gradient.
    let psw = Tensor::from_vec(weights.to_vec(), &[5])
        .unwrap()
        .with_requires_grad(true);
    let out = tbe
        .forward(
            &Tensor::from_vec(indices.to_vec(), &[5]).unwrap(),
            &Tensor::from_vec(offsets.to_vec(), &[5]).unwrap(),
            Some(&psw),
        )
        .unwrap();
    assert_eq!(tbe.bounds_check_warnings(), 4);
    out.backward_with(
        &Tensor::ones(&[2, 4], DType::F32, embers::Device::Cpu),
        false,
    )
    .unwrap();
    let g = psw.grad().unwrap().to_vec::<f32>().unwrap();
    assert_eq!(g, vec![2.0, 0.0, 6.0, 0.0, 60.0]);
    // Row 1 of table a got lr · w · 1/L · 1 = 1 per element; row 9 does not exist.
    assert_eq!(
        tbe.table_weights(0).unwrap(),
        vec![0., 0., 0., 0., 2., 2., 2., 2.]
    );
    assert_eq!(
        tbe.table_weights(1).unwrap(),
        vec![10., 10., 20., 20., 28., 28.]
    );
    // With pooling NONE each id has its own output row: an id out of range is an error, not
    // skipped (the output lost a row and every row after it shifted).
    let mut cfg = TbeConfig::one_feature_per_table(
        vec![TableSpec::new("a", 10, 2)],
        PoolingMode::None,
        FusedOptimizer::Sgd { lr: 1.0 },
    );
    cfg.bounds_check = BoundsCheckMode::WarnAndSkip;
    let tbe = TableBatchedEmbedding::new(cfg).unwrap();
    let e = tbe
        .lookup(TbeInput::new(&[1i64, 99, 2][..], &[0i64, 3][..]))
        .unwrap_err()
        .to_string();
    assert!(e.contains("id 99") && e.contains("pooling NONE"), "{e}");
}

#[test]
fn sparse_gradients_flow_to_autograd_with_optimizer_none() {
    let tbe = TableBatchedEmbedding::new(TbeConfig::one_feature_per_table(
        vec![TableSpec::new("t", 10, 2)],
        PoolingMode::Sum,
        FusedOptimizer::None,
    ))
    .unwrap();
    tbe.set_table_weights(0, &(0..20).map(|x| x as f32).collect::<Vec<_>>())
        .unwrap();
    let out = tbe
        .forward(
            &Tensor::from_vec(vec![3i64, 3, 7], &[3]).unwrap(),
            &Tensor::from_vec(vec![0i64, 2, 3], &[3]).unwrap(),
            None,
        )
        .unwrap();
    assert_eq!(out.to_vec::<f32>().unwrap(), vec![12., 14., 14., 15.]);
    out.backward_with(
        &Tensor::from_vec(vec![1.0f32, 2.0, 3.0, 4.0], &[2, 2]).unwrap(),
        false,
    )
    .unwrap();
    let g = tbe.sparse_gradient(0).expect("row-sparse gradient");
    assert_eq!(g.rows, vec![3, 7]);
    assert_eq!(g.values.to_vec::<f32>().unwrap(), vec![2., 4., 3., 4.]);
    // The tables did not move.
    assert_eq!(tbe.table_weights(0).unwrap()[6], 6.0);
    match tbe.sparse_gradient(0).map(Gradient::RowSparse) {
        Some(Gradient::RowSparse(s)) => assert_eq!(s.num_rows, 10),
        _ => unreachable!(),
    }
}

/// A few bags of one table of `rows` rows for the every-dimension tests: lengths 0, 1, 7, 13
/// and 30, random ids and per-sample weights.
fn every_dim_input(
    rng: &mut embers::tensor::rng::Rng,
    rows: usize,
) -> (Vec<i64>, Vec<i64>, Vec<f32>) {
    let mut offsets = vec![0i64];
    let mut ids = Vec::new();
    for l in [0usize, 1, 7, 13, 30] {
        ids.extend((0..l).map(|_| rng.random_range(0..rows as i64)));
        offsets.push(ids.len() as i64);
    }
    let weights = ids.iter().map(|_| rng.random_range(-2.0..2.0)).collect();
    (ids, offsets, weights)
}

/// Checks pooled `out` (`[bags, dim]`) against the f64 sum (or mean) of rows `values` (`[rows,
/// dim]`) within f32 rounding.
fn check_pooled(
    out: &[f32],
    values: &[f32],
    dim: usize,
    (ids, offsets, weights): (&[i64], &[i64], Option<&[f32]>),
    mean: bool,
    what: &str,
) {
    assert_eq!(out.len(), (offsets.len() - 1) * dim, "{what}");
    for bag in 0..offsets.len() - 1 {
        let (s, e) = (offsets[bag] as usize, offsets[bag + 1] as usize);
        for c in 0..dim {
            let (mut sum, mut scale) = (0.0f64, 0.0f64);
            for p in s..e {
                let w = weights.map_or(1.0, |w| f64::from(w[p]));
                let x = f64::from(values[ids[p] as usize * dim + c]);
                sum += w * x;
                scale += (w * x).abs();
            }
            if mean && e > s {
                sum /= (e - s) as f64;
                scale /= (e - s) as f64;
            }
            let got = f64::from(out[bag * dim + c]);
            assert!(
                (got - sum).abs() <= 8e-6 * scale + 1e-7,
                "{what}: dim {dim} bag {bag} col {c}: {got} vs {sum}"
            );
        }
    }
}

/// The FP32 forward pools a bag by column blocks of 64, 32, 16 and 8 columns and a last
/// narrower one; every dimension from 1 to 200 (all block combinations), sum and mean,
/// weighted and not, equals the f64 sum of the rows within f32 rounding.
#[test]
fn forward_of_every_dimension_matches_the_f64_sum() {
    let mut rng = seeded(11);
    let rows = 50;
    for dim in 1..=200usize {
        let values: Vec<f32> = (0..rows * dim)
            .map(|_| rng.random_range(-1.0..1.0))
            .collect();
        let (ids, offsets, weights) = every_dim_input(&mut rng, rows);
        for mean in [false, true] {
            let tbe = TableBatchedEmbedding::new(TbeConfig::one_feature_per_table(
                vec![TableSpec::new("t", rows, dim)],
                if mean {
                    PoolingMode::Mean
                } else {
                    PoolingMode::Sum
                },
                FusedOptimizer::None,
            ))
            .unwrap();
            tbe.set_table_weights(0, &values).unwrap();
            for weighted in [false, true] {
                let mut input = TbeInput::new(&ids[..], &offsets[..]);
                if weighted {
                    input = input.with_weights(&weights);
                }
                let out = tbe.lookup(input).unwrap().to_vec::<f32>().unwrap();
                let w = weighted.then_some(&weights[..]);
                let what = format!("fp32 weighted {weighted} mean {mean}");
                check_pooled(&out, &values, dim, (&ids, &offsets, w), mean, &what);
            }
        }
    }
}

/// The quantized inference forward (FP32, FP16, INT8 and INT4 rows, row at a time): every
/// dimension from 1 to 200, weighted or not, equals the f64 sum of the rows as
/// `dequantize_table` decodes them.
#[test]
fn quantized_forward_of_every_dimension_matches_the_f64_sum_of_its_rows() {
    use embers::embedding::{QuantizedTableBatchedEmbedding, WeightType};
    let mut rng = seeded(12);
    let rows = 50;
    for dim in 1..=200usize {
        let source: Vec<f32> = (0..rows * dim)
            .map(|_| rng.random_range(-1.0..1.0))
            .collect();
        let (ids, offsets, weights) = every_dim_input(&mut rng, rows);
        let ids32: Vec<i32> = ids.iter().map(|&i| i as i32).collect();
        let off32: Vec<i32> = offsets.iter().map(|&o| o as i32).collect();
        for ty in [
            WeightType::Fp32,
            WeightType::Fp16,
            WeightType::Int8,
            WeightType::Int4,
        ] {
            let mut q = QuantizedTableBatchedEmbedding::new(
                vec![TableSpec::new("t", rows, dim)],
                vec![ty],
                vec![0],
                PoolingMode::Sum,
            )
            .unwrap();
            q.quantize_table_from(0, &source).unwrap();
            let values = q.dequantize_table(0).unwrap();
            for weighted in [false, true] {
                let mut input = TbeInput::new(&ids32[..], &off32[..]);
                if weighted {
                    input = input.with_weights(&weights);
                }
                let out = q.forward(input).unwrap().to_vec::<f32>().unwrap();
                let w = weighted.then_some(&weights[..]);
                let what = format!("{ty:?} weighted {weighted}");
                check_pooled(&out, &values, dim, (&ids, &offsets, w), false, &what);
            }
        }
    }
}
