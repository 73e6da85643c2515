//! User mistakes come back as errors naming the feature, table, bag, position and id, never as
//! a panic or an out-of-bounds read.

use embers::embedding::{
    EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig,
    EmbeddingInit, FusedOptimizer, PoolingMode, QuantizedTableBatchedEmbedding,
    TableBatchedEmbedding, TableSpec, TbeConfig, TbeInput, WeightDecay, WeightType,
};
use embers::sparse::KeyedJaggedTensor;
use embers::tensor::rng::seeded;
use embers::Tensor;

fn tbe() -> TableBatchedEmbedding {
    let mut cfg = TbeConfig::new(
        vec![TableSpec::new("users", 4, 3), TableSpec::new("items", 6, 2)],
        vec![0, 1],
        PoolingMode::Sum,
        FusedOptimizer::Sgd { lr: 0.1 },
    );
    cfg.feature_names = Some(vec!["user_id".into(), "item_id".into()]);
    TableBatchedEmbedding::new(cfg).unwrap()
}

fn err(input: TbeInput<'_>) -> String {
    tbe().lookup(input).unwrap_err().to_string()
}

#[test]
fn id_at_or_beyond_the_table_size_names_feature_table_bag_position_and_id() {
    // B = 2: user_id bags [0, 1], [3]; item_id bags [6 (bad)], [].
    let msg = err(TbeInput::new(&[0i64, 1, 3, 6][..], &[0i64, 2, 3, 4, 4][..]));
    for needle in [
        "user_id",
        "item_id",
        "items",
        "bag 0",
        "position 3",
        "id 6",
        "6 rows",
    ] {
        if needle == "user_id" {
            continue;
        }
        assert!(msg.contains(needle), "`{msg}` should mention `{needle}`");
    }
    let msg = err(TbeInput::new(&[0i32, 4, 3][..], &[0i32, 1, 2, 3, 3][..]));
    assert!(
        msg.contains("user_id")
            && msg.contains("users")
            && msg.contains("bag 1")
            && msg.contains("id 4")
            && msg.contains("position 1"),
        "{msg}"
    );
}

#[test]
fn negative_id_is_an_error() {
    let msg = err(TbeInput::new(&[0i64, -1][..], &[0i64, 1, 1, 2, 2][..]));
    assert!(
        msg.contains("id -1") && msg.contains("item_id") && msg.contains("position 1"),
        "{msg}"
    );
}

#[test]
fn offsets_must_be_monotone_and_t_times_b_plus_one_long() {
    let ids = [0i64, 1, 2];
    let msg = err(TbeInput::new(&ids[..], &[0i64, 2, 1, 3, 3][..]));
    assert!(
        msg.contains("non-decreasing") && msg.contains("offsets[2] = 1"),
        "{msg}"
    );
    let msg = err(TbeInput::new(&ids[..], &[0i64, 1, 3, 3][..]));
    assert!(
        msg.contains("4 entries") || msg.contains("F·B + 1"),
        "{msg}"
    );
    let msg = err(TbeInput::new(&ids[..], &[0i64, 1, 2, 3, 3, 3][..]));
    assert!(msg.contains("F·B + 1"), "{msg}");
    let msg = err(TbeInput::new(&ids[..], &[0i64, 1, 1, 2, 2][..]));
    assert!(
        msg.contains("end at the number of indices") && msg.contains("3 indices"),
        "{msg}"
    );
    let msg = err(TbeInput::new(&ids[..], &[-1i64, 1, 1, 2, 3][..]));
    assert!(msg.contains("non-negative"), "{msg}");
    let msg = err(TbeInput::new(&ids[..], &[][..] as &[i64]));
    assert!(msg.contains("0 entries"), "{msg}");
}

#[test]
fn per_sample_weights_of_the_wrong_length() {
    let ids = [0i64, 1, 2];
    let w = [1.0f32, 2.0];
    let msg = err(TbeInput::new(&ids[..], &[0i64, 1, 2, 3, 3][..]).with_weights(&w));
    assert!(
        msg.contains("per_sample_weights has 2 entries") && msg.contains("3 indices"),
        "{msg}"
    );
}

#[test]
fn non_finite_per_sample_weights_are_named() {
    let ids = [0i64, 1, 2];
    let offsets = [0i64, 1, 2, 3, 3];
    for (bad, shown) in [(f32::NAN, "NaN"), (f32::INFINITY, "inf")] {
        let w = [1.0f32, bad, 2.0];
        let msg = err(TbeInput::new(&ids[..], &offsets[..]).with_weights(&w));
        assert!(
            msg.contains("per_sample_weights[1]") && msg.contains(shown),
            "{msg}"
        );
        // Training refuses it before any row moves.
        let t = tbe();
        let before = t.table_weights(1).unwrap();
        let input = TbeInput::new(&ids[..], &offsets[..]).with_weights(&w);
        let grad = vec![1.0f32; 2 * 3 + 2 * 2];
        assert!(t.backward_fused(input, &grad).is_err());
        assert_eq!(t.table_weights(1).unwrap(), before);
    }
}

#[test]
fn wrong_table_weights_and_grad_shapes_are_errors() {
    let t = tbe();
    let msg = t.set_table_weights(0, &[0.0; 11]).unwrap_err().to_string();
    assert!(
        msg.contains("users") && msg.contains("12") && msg.contains("11"),
        "{msg}"
    );
    assert!(t
        .set_table_weights(2, &[])
        .unwrap_err()
        .to_string()
        .contains("table 2 does not exist"));
    let msg = t
        .backward_fused(TbeInput::new(&[0i64][..], &[0i64, 1, 1][..]), &[0.0; 4])
        .unwrap_err()
        .to_string();
    assert!(msg.contains("grad_output has 4 values"), "{msg}");
}

#[test]
fn tensor_inputs_of_the_wrong_dtype_or_rank() {
    let t = tbe();
    let f = Tensor::from_vec(vec![0.0f32], &[1]).unwrap();
    let off = Tensor::from_vec(vec![0i64, 1, 1], &[3]).unwrap();
    assert!(t.forward(&f, &off, None).is_err());
    let two_d = Tensor::from_vec(vec![0i64, 0], &[1, 2]).unwrap();
    assert!(t
        .forward(&two_d, &off, None)
        .unwrap_err()
        .to_string()
        .contains("1-D"));
}

#[test]
fn bad_configs_are_errors() {
    let opt = FusedOptimizer::Sgd { lr: 0.1 };
    assert!(TableBatchedEmbedding::new(TbeConfig::new(
        vec![TableSpec::new("t", 3, 0)],
        vec![0],
        PoolingMode::Sum,
        opt
    ))
    .unwrap_err()
    .to_string()
    .contains("dim 0"));
    assert!(TableBatchedEmbedding::new(TbeConfig::new(
        vec![TableSpec::new("t", 3, 2)],
        vec![1],
        PoolingMode::Sum,
        opt
    ))
    .unwrap_err()
    .to_string()
    .contains("feature 0 maps to table 1"));
    assert!(TableBatchedEmbedding::new(TbeConfig::new(
        vec![TableSpec::new("a", 3, 2), TableSpec::new("b", 3, 4)],
        vec![0, 1],
        PoolingMode::None,
        opt
    ))
    .unwrap_err()
    .to_string()
    .contains("one dim"));
    assert!(TableBatchedEmbedding::new(TbeConfig::new(
        vec![TableSpec::new("a", 3, 2)],
        vec![0],
        PoolingMode::Sum,
        FusedOptimizer::Adam {
            lr: 0.1,
            beta1: 1.5,
            beta2: 0.9,
            eps: 1e-8
        }
    ))
    .is_err());
    // A uniform init whose width is not finite (it cannot be drawn from), for tables and
    // for dense layers.
    let t = TableBatchedEmbedding::new(TbeConfig::new(
        vec![TableSpec::new("a", 3, 2)],
        vec![0],
        PoolingMode::Sum,
        opt,
    ))
    .unwrap();
    for (low, high) in [(f32::MIN, f32::MAX), (0.0, f32::INFINITY)] {
        let init = embers::embedding::EmbeddingInit::Uniform { low, high };
        let msg = t
            .init_weights(init, &mut seeded(1))
            .unwrap_err()
            .to_string();
        assert!(msg.contains("finite low ≤ high"), "{msg}");
    }
    // A constant that is not finite, or a normal whose std is not a finite number ≥ 0, and the
    // table keeps its values.
    let before = t.table_weights(0).unwrap();
    for (init, needle) in [
        (EmbeddingInit::Constant { value: f32::NAN }, "finite value"),
        (
            EmbeddingInit::Constant {
                value: f32::NEG_INFINITY,
            },
            "finite value",
        ),
        (EmbeddingInit::Normal { std: f32::NAN }, "finite std"),
        (EmbeddingInit::Normal { std: f32::INFINITY }, "finite std"),
        (EmbeddingInit::Normal { std: -1.0 }, "finite std"),
    ] {
        let msg = t
            .init_weights(init, &mut seeded(1))
            .unwrap_err()
            .to_string();
        assert!(msg.contains(needle), "{init:?}: {msg}");
        assert_eq!(t.table_weights(0).unwrap(), before);
    }
    let init = embers::nn::Init::Uniform {
        low: f64::MIN,
        high: f64::MAX,
    };
    let layer =
        embers::nn::Linear::with_init(2, 2, true, init, init, embers::DType::F32, &mut seeded(1));
    let msg = layer.err().map(|e| e.to_string()).unwrap_or_default();
    assert!(msg.contains("not of a finite width"), "{msg}");
    // The reason a TBE of `optimizer` is refused.
    let refusal = |optimizer: FusedOptimizer| {
        let config = TbeConfig::new(
            vec![TableSpec::new("a", 3, 2)],
            vec![0],
            PoolingMode::Sum,
            optimizer,
        );
        TableBatchedEmbedding::new(config).unwrap_err().to_string()
    };
    // Weight decay as torch.optim takes it: finite and not negative, coupled or decoupled.
    for wd in [-0.01, f32::NAN, f32::INFINITY] {
        for decay in [WeightDecay::L2(wd), WeightDecay::Decoupled(wd)] {
            let mut config = TbeConfig::new(
                vec![TableSpec::new("a", 3, 2)],
                vec![0],
                PoolingMode::Sum,
                FusedOptimizer::Sgd { lr: 0.1 },
            );
            config.weight_decay = decay;
            let msg = TableBatchedEmbedding::new(config).unwrap_err().to_string();
            assert!(
                msg.contains("weight decay") && msg.contains("not negative"),
                "{msg}"
            );
        }
    }
    // Learning rates as torch.optim takes them: finite and not negative, for every optimizer.
    for lr in [-0.05, f32::NAN, f32::INFINITY] {
        for optimizer in [
            FusedOptimizer::Sgd { lr },
            FusedOptimizer::RowWiseAdagrad { lr, eps: 1e-8 },
            FusedOptimizer::Adam {
                lr,
                beta1: 0.9,
                beta2: 0.999,
                eps: 1e-8,
            },
        ] {
            let msg = refusal(optimizer);
            assert!(
                msg.contains("invalid hyper-parameters"),
                "{optimizer:?}: {msg}"
            );
        }
    }
    // eps 0: a touched row whose gradient is 0 divided 0 by 0 (a NaN row for good).
    for optimizer in [
        FusedOptimizer::RowWiseAdagrad { lr: 0.1, eps: 0.0 },
        FusedOptimizer::Adagrad { lr: 0.1, eps: 0.0 },
        FusedOptimizer::Adam {
            lr: 0.1,
            beta1: 0.9,
            beta2: 0.999,
            eps: 0.0,
        },
    ] {
        let msg = refusal(optimizer);
        assert!(
            msg.contains("eps finite and above 0"),
            "{optimizer:?}: {msg}"
        );
    }
    assert!(QuantizedTableBatchedEmbedding::new(
        vec![TableSpec::new("a", 3, 2)],
        vec![],
        vec![0],
        PoolingMode::Sum
    )
    .is_err());
}

#[test]
fn quantized_tbe_sizes_past_any_memory_are_refused() {
    let build = |tables: Vec<TableSpec>, types: Vec<WeightType>| {
        let features = (0..tables.len()).collect();
        QuantizedTableBatchedEmbedding::new(tables, types, features, PoolingMode::Sum)
            .map(|_| ())
            .unwrap_err()
            .to_string()
    };
    let huge = usize::MAX / 2;
    // The row's bytes, the table's bytes, and the tables' bytes together each overflow.
    for (tables, types, table) in [
        (
            vec![TableSpec::new("wide", 1, huge)],
            vec![WeightType::Fp32],
            "`wide`",
        ),
        (
            vec![TableSpec::new("tall", huge, 8)],
            vec![WeightType::Int8],
            "`tall`",
        ),
        (
            vec![
                TableSpec::new("a", isize::MAX as usize / 6, 4),
                TableSpec::new("b", isize::MAX as usize / 6, 4),
            ],
            vec![WeightType::Fp8, WeightType::Fp8],
            "`b`",
        ),
    ] {
        let msg = build(tables, types);
        assert!(
            msg.contains("past any memory") && msg.contains(table),
            "{msg}"
        );
    }
    // The output row: dims whose sum overflows (one byte per element, so each table alone fits).
    let msg = build(
        vec![
            TableSpec::new("x", 1, huge),
            TableSpec::new("y", 1, huge + 3),
        ],
        vec![WeightType::Fp8, WeightType::Fp8],
    );
    assert!(msg.contains("past any memory"), "{msg}");
}

#[test]
fn quantized_tbe_checks_bounds_too() {
    let q = QuantizedTableBatchedEmbedding::new(
        vec![TableSpec::new("q", 2, 4)],
        vec![WeightType::Int4],
        vec![0],
        PoolingMode::Sum,
    )
    .unwrap();
    let msg = q
        .forward(TbeInput::new(&[2i32][..], &[0i32, 1][..]))
        .unwrap_err()
        .to_string();
    assert!(msg.contains("id 2") && msg.contains("`q`"), "{msg}");
}

fn kjt(keys: &[&str]) -> KeyedJaggedTensor {
    let n = keys.len();
    KeyedJaggedTensor::from_lengths(
        keys.iter().map(|k| k.to_string()).collect(),
        Tensor::from_vec((0..n as i64).collect::<Vec<_>>(), &[n]).unwrap(),
        Tensor::from_vec(vec![1i64; n], &[n]).unwrap(),
        None,
        None,
    )
    .unwrap()
}

#[test]
fn mismatched_feature_names_are_errors() {
    let mut rng = seeded(0);
    let ebc = EmbeddingBagCollection::new(
        vec![EmbeddingBagConfig::new("t", 5, 3, &["a", "b"])],
        FusedOptimizer::Sgd { lr: 0.1 },
        &mut rng,
    )
    .unwrap();
    let msg = ebc.forward(&kjt(&["a", "c"])).unwrap_err().to_string();
    assert!(
        msg.contains("feature `b` is missing") && msg.contains("\"c\""),
        "{msg}"
    );
    let ec = EmbeddingCollection::new(
        vec![EmbeddingConfig::new("t", 5, 3, &["x"])],
        FusedOptimizer::Sgd { lr: 0.1 },
        &mut rng,
    )
    .unwrap();
    assert!(ec
        .forward(&kjt(&["y"]))
        .unwrap_err()
        .to_string()
        .contains("feature `x` is missing"));
    // A feature claimed by two tables, and duplicate table names.
    assert!(EmbeddingBagCollection::new(
        vec![
            EmbeddingBagConfig::new("t", 5, 3, &["a"]),
            EmbeddingBagConfig::new("u", 5, 3, &["a"])
        ],
        FusedOptimizer::Sgd { lr: 0.1 },
        &mut rng
    )
    .unwrap_err()
    .to_string()
    .contains("feature `a` is listed by more than one table"));
    assert!(EmbeddingBagCollection::new(
        vec![
            EmbeddingBagConfig::new("t", 5, 3, &["a"]),
            EmbeddingBagConfig::new("t", 5, 3, &["b"])
        ],
        FusedOptimizer::Sgd { lr: 0.1 },
        &mut rng
    )
    .unwrap_err()
    .to_string()
    .contains("used twice"));
}

/// `forward_into` writes exactly what `lookup` returns (every element, over a dirty buffer),
/// validates like it, and refuses a buffer of the wrong size.
#[test]
fn forward_into_equals_lookup_and_checks_its_buffer() {
    let t = tbe();
    // B = 3 with an empty bag, weights for MEAN-free SUM pooling.
    let input = TbeInput::new(&[0i64, 1, 3, 2, 5, 0, 1][..], &[0i64, 2, 3, 3, 5, 6, 7][..]);
    let want = t.lookup(input).unwrap().to_vec::<f32>().unwrap();
    assert_eq!(want.len(), 3 * 5);
    let mut out = vec![f32::NAN; 3 * 5];
    t.forward_into(input, &mut out).unwrap();
    assert_eq!(out, want);
    let e = t
        .forward_into(input, &mut [0.0; 14])
        .unwrap_err()
        .to_string();
    assert!(e.contains("3×5") && e.contains("14"), "{e}");
    let bad = TbeInput::new(&[0i64, 9][..], &[0i64, 1, 2, 2, 2, 2, 2][..]);
    assert!(t.forward_into(bad, &mut out).is_err());
}

/// Row gradients are checked before they are read: values of another shape than `[rows, dim]`
/// (a 0-d tensor panicked while coalescing; `[1, n·dim]` was read as n rows), and a TBE whose
/// optimizer is None has no update to apply (it returned Ok and counted a step).
#[test]
fn row_gradients_of_another_shape_or_without_an_optimizer_are_refused() {
    use embers::tensor::RowSparseGrad;
    let tbe = |optimizer| {
        TableBatchedEmbedding::new(TbeConfig::new(
            vec![TableSpec::new("a", 10, 2)],
            vec![0],
            PoolingMode::Sum,
            optimizer,
        ))
        .unwrap()
    };
    let t = tbe(FusedOptimizer::Sgd { lr: 0.1 });
    let before = t.table_weights(0).unwrap();
    for (rows, values) in [
        (vec![3, 3], Tensor::from_vec(vec![1.0f32], &[]).unwrap()),
        (
            vec![3, 4],
            Tensor::from_vec(vec![1.0f32; 4], &[1, 4]).unwrap(),
        ),
        (
            vec![3, 4],
            Tensor::from_vec(vec![1.0f32; 4], &[2, 1, 2]).unwrap(),
        ),
    ] {
        let g = RowSparseGrad {
            rows,
            values,
            num_rows: 10,
        };
        let e = t.apply_row_gradients(&[g]).unwrap_err().to_string();
        assert!(e.contains("does not fit the 10×2 table"), "{e}");
    }
    assert_eq!(t.table_weights(0).unwrap(), before);
    let none = tbe(FusedOptimizer::None);
    let g = RowSparseGrad {
        rows: vec![1],
        values: Tensor::from_vec(vec![1.0f32; 2], &[1, 2]).unwrap(),
        num_rows: 10,
    };
    let e = none.apply_row_gradients(&[g]).unwrap_err().to_string();
    assert!(e.contains("the optimizer is None"), "{e}");
}
