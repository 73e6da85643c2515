//! EmbeddingBagCollection / EmbeddingCollection: KJT in, KeyedTensor / JaggedTensors out, and
//! `backward()` through ordinary tensor ops reaching the fused TBE update, checked against the
//! float64 reference (including a table shared by two features, stepped once per row).

#[path = "support/tbe_reference.rs"]
mod tbe_reference;

use embers::embedding::{
    EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig,
    EmbeddingInit, FusedOptimizer, PoolingMode,
};
use embers::sparse::KeyedJaggedTensor;
use embers::tensor::rng::seeded;
use embers::Tensor;
use rand::Rng as _;
use tbe_reference::{assert_close, RefDecay, RefOptimizer, RefPooling, RefTbe};

/// keys → per-sample id lists (B samples each), optional weights.
fn make_kjt(keys: &[&str], bags: &[Vec<Vec<i64>>], weights: bool) -> (KeyedJaggedTensor, Vec<f32>) {
    let mut values = Vec::new();
    let mut lengths = Vec::new();
    for key_bags in bags {
        for bag in key_bags {
            values.extend_from_slice(bag);
            lengths.push(bag.len() as i64);
        }
    }
    let n = values.len();
    let w: Vec<f32> = (0..n).map(|i| 0.5 + (i % 4) as f32 * 0.25).collect();
    let kjt = KeyedJaggedTensor::from_lengths(
        keys.iter().map(|k| k.to_string()).collect(),
        Tensor::from_vec(values, &[n]).unwrap(),
        Tensor::from_vec(lengths.clone(), &[lengths.len()]).unwrap(),
        weights.then(|| Tensor::from_vec(w.clone(), &[n]).unwrap()),
        None,
    )
    .unwrap();
    (kjt, w)
}

fn random_bags(rng: &mut embers::tensor::rng::Rng, rows: usize, b: usize) -> Vec<Vec<i64>> {
    (0..b)
        .map(|_| {
            (0..rng.random_range(0..4))
                .map(|_| rng.random_range(0..rows as i64))
                .collect()
        })
        .collect()
}

/// Indices/offsets/weights of `features` (positions in the KJT key list) in TBE layout.
fn tbe_layout(
    bags: &[Vec<Vec<i64>>],
    weights: &[f32],
    features: &[usize],
) -> (Vec<i64>, Vec<i64>, Vec<f64>) {
    // Flat positions of each (key, sample) in the KJT.
    let mut starts = Vec::new();
    let mut pos = 0;
    for key_bags in bags {
        let mut s = Vec::new();
        for bag in key_bags {
            s.push(pos);
            pos += bag.len();
        }
        starts.push(s);
    }
    let (mut ids, mut offs, mut w) = (Vec::new(), vec![0i64], Vec::new());
    for &k in features {
        for (s, bag) in bags[k].iter().enumerate() {
            ids.extend_from_slice(bag);
            w.extend((0..bag.len()).map(|j| weights[starts[k][s] + j] as f64));
            offs.push(ids.len() as i64);
        }
    }
    (ids, offs, w)
}

#[test]
fn ebc_pools_shared_and_mixed_tables_and_backward_runs_the_fused_optimizer() {
    let mut rng = seeded(11);
    let configs = vec![
        EmbeddingBagConfig::new("t0", 10, 3, &["a", "b"]).with_init(EmbeddingInit::Uniform {
            low: -1.0,
            high: 1.0,
        }),
        EmbeddingBagConfig::new("t1", 6, 5, &["c"]).with_pooling(PoolingMode::Mean),
        EmbeddingBagConfig::new("t2", 4, 4, &["d"]),
    ];
    let opt = FusedOptimizer::RowWiseAdagrad { lr: 0.1, eps: 1e-3 };
    let ebc = EmbeddingBagCollection::new(configs, opt, &mut rng).unwrap();
    let b = 4;
    // KJT keys in another order, plus a key no table reads.
    let keys = ["d", "extra", "c", "b", "a"];
    let rows = [4usize, 3, 6, 10, 10];
    for weighted in [false, true] {
        let bags: Vec<Vec<Vec<i64>>> = rows.iter().map(|&r| random_bags(&mut rng, r, b)).collect();
        let (kjt, w) = make_kjt(&keys, &bags, weighted);
        // References: the SUM group (t0 read by a and b, t2 by d) and the MEAN group (t1 by c).
        let w0: Vec<f64> = ebc
            .table_weights("t0")
            .unwrap()
            .iter()
            .map(|&x| x as f64)
            .collect();
        let w1: Vec<f64> = ebc
            .table_weights("t1")
            .unwrap()
            .iter()
            .map(|&x| x as f64)
            .collect();
        let w2: Vec<f64> = ebc
            .table_weights("t2")
            .unwrap()
            .iter()
            .map(|&x| x as f64)
            .collect();
        let ref_opt = RefOptimizer::RowWiseAdagrad { lr: 0.1, eps: 1e-3 };
        let mut sum_ref = RefTbe::new(
            vec![(10, 3), (4, 4)],
            vec![0, 0, 1],
            RefPooling::Sum,
            ref_opt,
            RefDecay::None,
            vec![w0, w2],
        );
        let mut mean_ref = RefTbe::new(
            vec![(6, 5)],
            vec![0],
            RefPooling::Mean,
            ref_opt,
            RefDecay::None,
            vec![w1],
        );
        // Carry the Adagrad state across the two loop iterations.
        if weighted {
            sum_ref.m1 = vec![
                ebc.tbes()[0]
                    .optimizer_state(0, 0)
                    .unwrap()
                    .iter()
                    .map(|&x| x as f64)
                    .collect(),
                ebc.tbes()[0]
                    .optimizer_state(0, 1)
                    .unwrap()
                    .iter()
                    .map(|&x| x as f64)
                    .collect(),
            ];
            mean_ref.m1 = vec![ebc.tbes()[1]
                .optimizer_state(0, 0)
                .unwrap()
                .iter()
                .map(|&x| x as f64)
                .collect()];
        }
        let (sid, soff, sw) = tbe_layout(&bags, &w, &[4, 3, 0]);
        let (mid, moff, mw) = tbe_layout(&bags, &w, &[2]);
        let sum_out = sum_ref.forward(&sid, &soff, weighted.then_some(&sw[..]));
        let mean_out = mean_ref.forward(&mid, &moff, weighted.then_some(&mw[..]));

        let kt = ebc.forward(&kjt).unwrap();
        assert_eq!(kt.keys(), &["a", "b", "c", "d"]);
        assert_eq!(kt.length_per_key(), &[3, 3, 5, 4]);
        let out = kt.values().to_vec_f64().unwrap();
        // Expected [B, a|b|c|d] from the two group outputs (sum group is a|b|d, 10 wide).
        let mut expected = Vec::new();
        for s in 0..b {
            expected.extend_from_slice(&sum_out[s * 10..s * 10 + 6]);
            expected.extend_from_slice(&mean_out[s * 5..s * 5 + 5]);
            expected.extend_from_slice(&sum_out[s * 10 + 6..s * 10 + 10]);
        }
        assert_close(
            &out,
            &expected,
            1e-5,
            1e-6,
            &format!("EBC output weighted={weighted}"),
        );

        // loss = Σ r ⊙ values through tensor ops; backward reaches the TBEs.
        let r: Vec<f32> = (0..b * 15)
            .map(|_| rng.random_range(-1.0f32..1.0))
            .collect();
        let loss = kt
            .values()
            .mul(&Tensor::from_vec(r.clone(), &[b, 15]).unwrap())
            .unwrap()
            .sum_all()
            .unwrap();
        loss.backward().unwrap();
        let mut g_sum = Vec::new();
        let mut g_mean = Vec::new();
        for s in 0..b {
            let row = &r[s * 15..(s + 1) * 15];
            g_sum.extend(row[..6].iter().chain(&row[11..]).map(|&x| x as f64));
            g_mean.extend(row[6..11].iter().map(|&x| x as f64));
        }
        sum_ref.backward(&sid, &soff, weighted.then_some(&sw[..]), &g_sum);
        mean_ref.backward(&mid, &moff, weighted.then_some(&mw[..]), &g_mean);
        let got = |t: &str| {
            ebc.table_weights(t)
                .unwrap()
                .iter()
                .map(|&x| x as f64)
                .collect::<Vec<_>>()
        };
        assert_close(
            &got("t0"),
            &sum_ref.weights[0],
            1e-5,
            1e-6,
            "shared table t0 after one fused step",
        );
        assert_close(&got("t2"), &sum_ref.weights[1], 1e-5, 1e-6, "t2");
        assert_close(
            &got("t1"),
            &mean_ref.weights[0],
            1e-5,
            1e-6,
            "mean table t1",
        );
    }
}

/// A KJT with i32 lengths (`one_hot` makes them) whose keys are exactly a table's features
/// (its offsets then go to the table as they are): each id's row, lengths 1.
#[test]
fn ec_takes_i32_lengths() {
    let mut rng = seeded(4);
    let configs = vec![EmbeddingConfig::new("items", 6, 3, &["item"])];
    let ec = EmbeddingCollection::new(configs, FusedOptimizer::Sgd { lr: 0.5 }, &mut rng).unwrap();
    let kjt = KeyedJaggedTensor::one_hot("item", &[4, 0, 4]).unwrap();
    let out = ec.forward(&kjt).unwrap();
    let table = ec.table_weights("items").unwrap();
    let (name, jt) = &out[0];
    assert_eq!(name, "item");
    assert_eq!(jt.lengths_vec().unwrap(), vec![1, 1, 1]);
    let rows: Vec<f32> = [4usize, 0, 4]
        .iter()
        .flat_map(|&i| table[i * 3..i * 3 + 3].to_vec())
        .collect();
    assert_eq!(jt.values().to_vec::<f32>().unwrap(), rows);
}

#[test]
fn ec_returns_per_feature_rows_and_trains_through_them() {
    let mut rng = seeded(3);
    let configs = vec![
        EmbeddingConfig::new("items", 8, 4, &["seq", "target"])
            .with_init(EmbeddingInit::Normal { std: 0.5 }),
        EmbeddingConfig::new("cats", 5, 4, &["cat"]),
        EmbeddingConfig::new("wide", 3, 7, &["w"]),
    ];
    let ec = EmbeddingCollection::new(configs, FusedOptimizer::Sgd { lr: 0.5 }, &mut rng).unwrap();
    let b = 3;
    let keys = ["cat", "target", "seq", "w"];
    let rows = [5usize, 8, 8, 3];
    let bags: Vec<Vec<Vec<i64>>> = rows.iter().map(|&r| random_bags(&mut rng, r, b)).collect();
    let (kjt, _) = make_kjt(&keys, &bags, false);
    let before: Vec<Vec<f32>> = ["items", "cats", "wide"]
        .iter()
        .map(|t| ec.table_weights(t).unwrap())
        .collect();
    let out = ec.forward(&kjt).unwrap();
    let names: Vec<&str> = out.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, vec!["seq", "target", "cat", "w"]);
    let table_of = |f: &str| match f {
        "seq" | "target" => (0usize, 4usize),
        "cat" => (1, 4),
        _ => (2, 7),
    };
    let mut loss_terms = Vec::new();
    let mut expected_grad: Vec<Vec<f32>> = before.iter().map(|w| vec![0.0; w.len()]).collect();
    for (name, jt) in &out {
        let k = keys.iter().position(|k| k == name).unwrap();
        let ids: Vec<i64> = bags[k].iter().flatten().copied().collect();
        let (t, d) = table_of(name);
        assert_eq!(jt.values().shape(), &[ids.len(), d]);
        assert_eq!(
            jt.lengths_vec().unwrap(),
            bags[k].iter().map(|x| x.len() as i64).collect::<Vec<_>>()
        );
        let values = jt.values().to_vec::<f32>().unwrap();
        for (i, &id) in ids.iter().enumerate() {
            assert_eq!(
                &values[i * d..(i + 1) * d],
                &before[t][id as usize * d..(id as usize + 1) * d],
                "{name} row {i}"
            );
            // loss = Σ values² / 2 → d/drow = row (summed over occurrences and features).
            for j in 0..d {
                expected_grad[t][id as usize * d + j] += values[i * d + j];
            }
        }
        loss_terms.push(jt.values().mul(jt.values()).unwrap().sum_all().unwrap());
    }
    let mut loss = loss_terms[0].clone();
    for term in &loss_terms[1..] {
        loss = loss.add(term).unwrap();
    }
    loss.mul(&Tensor::scalar(0.5f32))
        .unwrap()
        .backward()
        .unwrap();
    for (t, name) in ["items", "cats", "wide"].iter().enumerate() {
        let after = ec.table_weights(name).unwrap();
        let expected: Vec<f64> = before[t]
            .iter()
            .zip(&expected_grad[t])
            .map(|(&w, &g)| w as f64 - 0.5 * g as f64)
            .collect();
        assert_close(
            &after.iter().map(|&x| x as f64).collect::<Vec<_>>(),
            &expected,
            1e-5,
            1e-6,
            name,
        );
    }
}

#[test]
fn ebc_weighted_kjt_weights_receive_gradients() {
    let mut rng = seeded(4);
    let ebc = EmbeddingBagCollection::new(
        vec![EmbeddingBagConfig::new("t", 4, 2, &["f"])
            .with_init(EmbeddingInit::Constant { value: 0.5 })],
        FusedOptimizer::Sgd { lr: 0.0 },
        &mut rng,
    )
    .unwrap();
    ebc.set_table_weights("t", &[1., 2., 3., 4., 5., 6., 7., 8.])
        .unwrap();
    let w = Tensor::from_vec(vec![2.0f32, 3.0, 1.0], &[3])
        .unwrap()
        .with_requires_grad(true);
    let kjt = KeyedJaggedTensor::from_lengths(
        vec!["f".into()],
        Tensor::from_vec(vec![0i64, 3, 1], &[3]).unwrap(),
        Tensor::from_vec(vec![2i64, 1], &[2]).unwrap(),
        Some(w.clone()),
        None,
    )
    .unwrap();
    let kt = ebc.forward(&kjt).unwrap();
    assert_eq!(
        kt.values().to_vec::<f32>().unwrap(),
        vec![2. + 21., 4. + 24., 3., 4.]
    );
    kt.values().sum_all().unwrap().backward().unwrap();
    // d/dw_k = Σ row_k.
    assert_eq!(
        w.grad().unwrap().to_vec::<f32>().unwrap(),
        vec![3., 15., 7.]
    );
}

#[test]
fn weights_keep_their_gradients_when_the_kjt_keys_are_in_another_order() {
    // Two tables; the KJT lists the features in the other order, so the collection gathers
    // each group's values: the weights' gradient must still reach the caller's tensor.
    let ebc = EmbeddingBagCollection::new(
        vec![
            EmbeddingBagConfig::new("a", 3, 2, &["f"]),
            EmbeddingBagConfig::new("b", 3, 2, &["g"]),
        ],
        FusedOptimizer::Sgd { lr: 0.0 },
        &mut seeded(5),
    )
    .unwrap();
    let (ta, tb) = ([1., 2., 3., 4., 5., 6.], [10., 20., 30., 40., 50., 60.]);
    ebc.set_table_weights("a", &ta).unwrap();
    ebc.set_table_weights("b", &tb).unwrap();
    // Keys (g, f), batch 1: g = [2, 0], f = [1].
    let w = Tensor::from_vec(vec![0.5f32, 2.0, 3.0], &[3])
        .unwrap()
        .with_requires_grad(true);
    let kjt = KeyedJaggedTensor::from_lengths(
        vec!["g".into(), "f".into()],
        Tensor::from_vec(vec![2i64, 0, 1], &[3]).unwrap(),
        Tensor::from_vec(vec![2i64, 1], &[2]).unwrap(),
        Some(w.clone()),
        Some(1),
    )
    .unwrap();
    let kt = ebc.forward(&kjt).unwrap();
    kt.values().sum_all().unwrap().backward().unwrap();
    // d/dw_k = Σ of the row it scales: g's rows 2 and 0 of b, f's row 1 of a.
    let row_sum = |t: &[f32; 6], r: usize| t[2 * r] + t[2 * r + 1];
    assert_eq!(
        w.grad()
            .expect("the weights got a gradient")
            .to_vec::<f32>()
            .unwrap(),
        vec![row_sum(&tb, 2), row_sum(&tb, 0), row_sum(&ta, 1)]
    );
}
