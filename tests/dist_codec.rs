//! The quantized communication codecs: round-trip error on U[0, 1) within FBGEMM's bounds
//! (FP16/BF16/INT8 0.005, FP8 0.05), the bytes each takes, the E4M3 format against its
//! definition, loss scaling, and bad input.

use embers::distributed::codec::{fp8_e4m3, fp8_e4m3_to_f32, Codec, CommPrecision};
use embers::tensor::rng::seeded;
use rand::Rng as _;

const ROW: usize = 64;

fn uniform(n: usize) -> Vec<f32> {
    let mut rng = seeded(7);
    (0..n).map(|_| rng.random_range(0.0f32..1.0)).collect()
}

fn max_error(precision: CommPrecision, values: &[f32]) -> f32 {
    let codec = Codec::new(precision);
    let bytes = codec.encode(values, ROW).unwrap();
    assert_eq!(bytes.len(), precision.encoded_len(values.len(), ROW));
    let back = codec.decode(&bytes, values.len(), ROW).unwrap();
    (values.iter().zip(&back))
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f32::max)
}

#[test]
fn round_trips_on_uniform_values_are_within_fbgemms_bounds() {
    let values = uniform(ROW * 200);
    let n = values.len();
    assert_eq!(max_error(CommPrecision::Fp32, &values), 0.0);
    for (precision, bound, bytes) in [
        (CommPrecision::Fp16, 0.0005, 2 * n),
        (CommPrecision::Bf16, 0.002, 2 * n),
        (CommPrecision::Int8, 0.002, n + 8 * 200),
        (CommPrecision::Fp8, 0.032, n),
    ] {
        let e = max_error(precision, &values);
        assert!(
            e > 0.0 && e <= bound,
            "{precision:?}: max error {e}, bound {bound}"
        );
        assert_eq!(precision.encoded_len(n, ROW), bytes, "{precision:?}");
    }
}

#[test]
fn fp8_codes_follow_the_e4m3_definition() {
    // Every finite code decodes to a value that encodes back to it, in increasing order.
    let mut last = -1.0f32;
    for b in 0u8..=0x7E {
        let v = fp8_e4m3_to_f32(b);
        assert!(v > last, "code {b:#x}: {v} after {last}");
        last = v;
        assert_eq!(fp8_e4m3(v), b, "code {b:#x} ({v})");
        assert_eq!(fp8_e4m3(-v), b | 0x80, "code {:#x} ({})", b | 0x80, -v);
    }
    assert!(fp8_e4m3_to_f32(0x7F).is_nan() && fp8_e4m3_to_f32(0xFF).is_nan());
    // The format's landmarks: 2^-9 (smallest subnormal), 2^-6 (smallest normal), 1, 448.
    assert_eq!(fp8_e4m3_to_f32(0x01), 2f32.powi(-9));
    assert_eq!(fp8_e4m3_to_f32(0x08), 2f32.powi(-6));
    assert_eq!(fp8_e4m3_to_f32(0x38), 1.0);
    assert_eq!(fp8_e4m3_to_f32(0x7E), 448.0);
    // Saturation, and ties to even between 1 and 1.125.
    assert_eq!(fp8_e4m3(1000.0), 0x7E);
    assert_eq!(fp8_e4m3(-1000.0), 0xFE);
    assert_eq!(fp8_e4m3(1.0625), 0x38);
    assert_eq!(fp8_e4m3(1.0625f32.next_up()), 0x39);
    // Relative error on signed normal values: at most half a unit of the 3-bit mantissa.
    let mut rng = seeded(3);
    for _ in 0..10_000 {
        let v: f32 = rng.random_range(-300.0f32..300.0);
        if v.abs() < 2f32.powi(-6) {
            continue;
        }
        let back = fp8_e4m3_to_f32(fp8_e4m3(v));
        assert!((back - v).abs() <= v.abs() / 16.0, "{v} -> {back}");
    }
}

#[test]
fn loss_scaling_keeps_small_gradients_in_fp16() {
    let mut rng = seeded(11);
    let grads: Vec<f32> = (0..4096).map(|_| rng.random_range(1e-7f32..1e-6)).collect();
    let relative = |codec: Codec| {
        let bytes = codec.encode(&grads, ROW).unwrap();
        let back = codec.decode(&bytes, grads.len(), ROW).unwrap();
        (grads.iter().zip(&back))
            .map(|(a, b)| ((a - b) / a).abs())
            .fold(0.0f32, f32::max)
    };
    let plain = relative(Codec::new(CommPrecision::Fp16));
    let scaled = relative(
        Codec::new(CommPrecision::Fp16)
            .with_loss_scale(65536.0)
            .unwrap(),
    );
    assert!(
        plain > 0.01,
        "FP16 subnormals lose the small gradients: {plain}"
    );
    assert!(scaled < 0.001, "scaled by 2^16: {scaled}");
    assert!(Codec::new(CommPrecision::Bf16)
        .with_loss_scale(0.0)
        .is_err());
}

#[test]
fn bad_input_is_refused() {
    let codec = Codec::new(CommPrecision::Int8);
    let e = codec
        .encode(&[1.0, f32::NAN, 2.0, 3.0], 2)
        .unwrap_err()
        .to_string();
    assert!(e.contains("value 1 is NaN"), "{e}");
    let e = codec.encode(&[1.0, 2.0, 3.0], 2).unwrap_err().to_string();
    assert!(e.contains("not whole rows of 2"), "{e}");
    let bytes = codec.encode(&[1.0, 2.0, 3.0, 4.0], 2).unwrap();
    let e = codec
        .decode(&bytes[..bytes.len() - 1], 4, 2)
        .unwrap_err()
        .to_string();
    assert!(e.contains("expected 20"), "{e}");
    let e = Codec::new(CommPrecision::Fp8)
        .encode(&[f32::INFINITY], 1)
        .unwrap_err()
        .to_string();
    assert!(e.contains("value 0 is inf"), "{e}");
}

// ---- The codecs in the collectives, and in the sharded collection ----

#[path = "support/dist_scenarios.rs"]
mod dist_scenarios;

use std::collections::BTreeMap;
use std::time::Duration;

use dist_scenarios::{case, on_ranks, rank_batch, sharded_of, tables};
use embers::distributed::{Comm, QCommsConfig};
use embers::Tensor;

const QUANTIZED: [CommPrecision; 4] = [
    CommPrecision::Fp16,
    CommPrecision::Bf16,
    CommPrecision::Fp8,
    CommPrecision::Int8,
];

/// Bytes sent per op since the last reset.
fn sent(comm: &Comm) -> BTreeMap<&'static str, u64> {
    comm.bytes()
        .into_iter()
        .map(|(op, b)| (op, b.sent))
        .collect()
}

#[test]
fn collectives_deliver_what_the_codec_round_trip_gives_and_count_its_bytes() {
    // 3 ranks; rank s sends rank d a block of (d + 1) rows of width s + 2 (rank 1 sends
    // nothing to rank 2), and a NaN to rank 1 in row 1 of rank 2's block.
    let block = |s: usize, d: usize| -> Vec<f32> {
        let rows = if (s, d) == (1, 2) { 0 } else { d + 1 };
        let mut v: Vec<f32> = (0..rows * (s + 2))
            .map(|i| ((s * 31 + d * 7 + i) as f32 * 0.37).sin() * 3.0)
            .collect();
        if (s, d) == (2, 1) {
            v[s + 2] = f32::NAN;
        }
        v
    };
    for precision in [CommPrecision::Fp32].into_iter().chain(QUANTIZED) {
        let codec = Codec::new(precision);
        let results = on_ranks(3, Duration::from_secs(10), |comm| {
            let rank = comm.rank();
            let send: Vec<Vec<f32>> = (0..3).map(|d| block(rank, d)).collect();
            let dims = vec![rank + 2; 3];
            let recv: Vec<(usize, usize)> = (0..3).map(|s| (block(s, rank).len(), s + 2)).collect();
            let got = codec.all_to_all(&comm, "a2a", send, &dims, &recv).unwrap();
            // Reduce-scatter: every rank's part for rank d is d + 1 rows of width 4.
            let parts: Vec<Vec<f32>> = (0..3)
                .map(|d| {
                    (0..(d + 1) * 4)
                        .map(|i| (rank * 5 + i) as f32 * 0.25)
                        .collect()
                })
                .collect();
            let sum = codec.reduce_scatter(&comm, "rs", parts, 4).unwrap();
            let counts = [4, 0, 8];
            let mine: Vec<f32> = (0..counts[rank])
                .map(|i| i as f32 - 2.5 * rank as f32)
                .collect();
            let gathered = codec.all_gather(&comm, "ag", &mine, 4, &counts).unwrap();
            (rank, got, sum, gathered, sent(&comm))
        });
        for (rank, got, sum, gathered, bytes) in results {
            for (s, block_from) in got.iter().enumerate() {
                let (want, dim) = (block(s, rank), s + 2);
                assert_eq!(block_from.len(), want.len());
                // Every encoding is row by row: each finite row arrives as its own round trip.
                for (r, (row, sent_row)) in block_from.chunks(dim).zip(want.chunks(dim)).enumerate()
                {
                    if sent_row.iter().all(|v| v.is_finite()) {
                        let round = codec
                            .decode(&codec.encode(sent_row, dim).unwrap(), dim, dim)
                            .unwrap();
                        assert_eq!(
                            row,
                            &round[..],
                            "{precision:?}: rank {rank} from {s} row {r}"
                        );
                    } else {
                        // The NaN arrives as NaN: in its own value, or its whole INT8 row.
                        assert!(row[0].is_nan(), "{precision:?}: {row:?}");
                        let nans = row.iter().filter(|v| v.is_nan()).count();
                        let want_nans = if precision == CommPrecision::Int8 {
                            dim
                        } else {
                            1
                        };
                        assert_eq!(nans, want_nans, "{precision:?}: {row:?}");
                    }
                }
            }
            let want_sum: Vec<f32> = (0..(rank + 1) * 4)
                .map(|i| {
                    (0..3)
                        .map(|r| {
                            let part: Vec<f32> = (0..(rank + 1) * 4)
                                .map(|j| (r * 5 + j) as f32 * 0.25)
                                .collect();
                            codec
                                .decode(&codec.encode(&part, 4).unwrap(), part.len(), 4)
                                .unwrap()[i]
                        })
                        .fold(0.0f32, |a, b| a + b)
                })
                .collect();
            assert_eq!(
                sum, want_sum,
                "{precision:?}: reduce-scatter on rank {rank}"
            );
            for (r, g) in gathered.iter().enumerate() {
                let n = [4, 0, 8][r];
                let v: Vec<f32> = (0..n).map(|i| i as f32 - 2.5 * r as f32).collect();
                let want = codec.decode(&codec.encode(&v, 4).unwrap(), n, 4).unwrap();
                assert_eq!(g, &want, "{precision:?}: all-gather from {r} on {rank}");
            }
            // Bytes: what left this rank for the others, in the codec's encoding.
            let a2a: usize = (0..3)
                .filter(|&d| d != rank)
                .map(|d| precision.encoded_len(block(rank, d).len(), rank + 2))
                .sum();
            let rs: usize = (0..3)
                .filter(|&d| d != rank)
                .map(|d| precision.encoded_len((d + 1) * 4, 4))
                .sum();
            let ag = 2 * precision.encoded_len([4, 0, 8][rank], 4);
            assert_eq!(bytes["a2a"], a2a as u64, "{precision:?} rank {rank}");
            assert_eq!(bytes["rs"], rs as u64, "{precision:?} rank {rank}");
            assert_eq!(bytes["ag"], ag as u64, "{precision:?} rank {rank}");
        }
    }
}

/// One forward and backward of the `mixed` case (table-wise, row-wise, table-row-wise,
/// table-column-wise and data-parallel tables) on 4 ranks as 2 hosts: each rank's pooled
/// output, every table's update and the bytes each collective sent.
type Run = (Vec<f32>, Vec<Vec<f32>>, BTreeMap<&'static str, u64>);

fn one_step(q: QCommsConfig) -> Vec<Run> {
    let c = case(4, "mixed").unwrap();
    on_ranks(4, Duration::from_secs(20), |comm| {
        let rank = comm.rank();
        let sharded = sharded_of(comm, &c).unwrap();
        sharded.set_qcomms(q).unwrap();
        let before: Vec<Vec<f32>> = (tables().iter())
            .map(|t| sharded.table_weights(&t.name).unwrap())
            .collect();
        let batch = rank_batch(rank, 0, c.batches[rank]);
        let kjt = dist_scenarios::kjt_of(&[&batch], false);
        sharded.comm().reset_bytes();
        let out = sharded.forward(&kjt).unwrap();
        let values = out.values().clone();
        let n = values.numel();
        // A loss whose gradient is a fixed pattern of ±1s and smaller values.
        let pattern: Vec<f32> = (0..n).map(|i| ((i * 7 + rank) as f32).cos()).collect();
        let loss = values
            .mul(&Tensor::from_vec(pattern, values.shape()).unwrap())
            .unwrap()
            .sum_all()
            .unwrap();
        loss.backward().unwrap();
        let bytes = sent(sharded.comm());
        let after: Vec<Vec<f32>> = (tables().iter())
            .map(|t| sharded.table_weights(&t.name).unwrap())
            .collect();
        let updates = (before.iter().zip(&after))
            .map(|(b, a)| a.iter().zip(b).map(|(a, b)| a - b).collect())
            .collect();
        (values.to_vec::<f32>().unwrap(), updates, bytes)
    })
}

fn max_abs(v: &[f32]) -> f32 {
    v.iter().fold(0.0f32, |m, x| m.max(x.abs()))
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .fold(0.0f32, |m, (x, y)| m.max((x - y).abs()))
}

#[test]
fn the_sharded_collection_sends_its_rows_and_gradients_encoded() {
    let exact = one_step(QCommsConfig::default());
    // Relative bound on the error of a value (a sum of at most 2 encoded partial sums).
    for (precision, bound) in [
        (CommPrecision::Fp16, 2e-3),
        (CommPrecision::Bf16, 1.6e-2),
        (CommPrecision::Fp8, 0.13),
        (CommPrecision::Int8, 1.6e-2),
    ] {
        let runs = one_step(QCommsConfig::new(precision, precision));
        let mut touched_forward = false;
        for (rank, ((out, updates, bytes), (out32, updates32, bytes32))) in
            runs.iter().zip(&exact).enumerate()
        {
            let e = max_diff(out, out32);
            assert!(
                e <= bound * max_abs(out32),
                "{precision:?} rank {rank}: pooled rows off by {e} (max {})",
                max_abs(out32)
            );
            touched_forward |= e > 0.0;
            for (t, (u, u32_)) in updates.iter().zip(updates32).enumerate() {
                let e = max_diff(u, u32_);
                assert!(
                    e <= 2.0 * bound * max_abs(u32_),
                    "{precision:?} rank {rank} table t{t}: update off by {e} (max {})",
                    max_abs(u32_)
                );
            }
            // The pooled rows and their gradients shrink by the codec's ratio; ids, lengths
            // and the data-parallel table's gradients travel as they did.
            for (op, &b32) in bytes32 {
                let b = bytes[op];
                let coded = op.starts_with("output_dist")
                    || (op.starts_with("backward.") && !op.starts_with("backward.replicated"));
                match (coded, precision) {
                    (false, _) => assert_eq!(b, b32, "{precision:?} rank {rank} {op}"),
                    (true, CommPrecision::Fp16 | CommPrecision::Bf16) => {
                        assert_eq!(2 * b, b32, "{precision:?} rank {rank} {op}")
                    }
                    (true, CommPrecision::Fp8) => {
                        assert_eq!(4 * b, b32, "{precision:?} rank {rank} {op}")
                    }
                    (true, _) => {
                        // One byte a value and a scale and offset (8 bytes) a row.
                        assert!(
                            b >= b32 / 4 && (b - b32 / 4) % 8 == 0 && (b32 == 0) == (b == b32 / 4),
                            "INT8 rank {rank} {op}: {b} bytes, FP32 {b32}"
                        )
                    }
                }
            }
            assert!(
                bytes32.keys().any(|op| op.starts_with("output_dist.twrw")),
                "the case has table-row-wise tables"
            );
        }
        assert!(touched_forward, "{precision:?}: no value changed");
    }
}

#[test]
fn ranks_that_disagree_on_the_codecs_change_nothing() {
    let c = case(2, "mixed").unwrap();
    let results = on_ranks(2, Duration::from_secs(10), |comm| {
        let rank = comm.rank();
        let sharded = sharded_of(comm, &c).unwrap();
        let mine = if rank == 0 {
            QCommsConfig::new(CommPrecision::Fp16, CommPrecision::Bf16)
        } else {
            QCommsConfig::new(CommPrecision::Fp16, CommPrecision::Fp16)
        };
        let e = sharded.set_qcomms(mine).unwrap_err().to_string();
        (e, sharded.qcomms())
    });
    for (rank, (e, q)) in results.into_iter().enumerate() {
        assert!(
            e.contains("quantized-comms config differs") && e.contains("[1]"),
            "rank {rank}: {e}"
        );
        assert_eq!(q, QCommsConfig::default());
    }
}

// ---- A sharded DLRM trained with compressed comms ----

use embers::distributed::{
    all_reduce_mean_gradients, Placement, ShardedEmbeddingBagCollection, ShardingPlan, TableShape,
};
use embers::embedding::{EmbeddingBagConfig, FusedOptimizer};
use embers::models::DlrmDense;
use embers::nn::Module;
use embers::optim::{Adagrad, Optimizer};
use embers::tensor::Reduction;
use embers::DType;
use embers_datasets::{tie_corrected_auc, RawBatch, Split, SyntheticCriteo, SyntheticCriteoConfig};

const TABLES: usize = 8;
const DIM: usize = 8;
const BATCH: usize = 128;

/// Trains a DLRM whose tables are sharded over 2 ranks (table-wise, row-wise, column-wise
/// and data-parallel) with `q`, each rank on its own half of every global batch of the
/// synthetic data; then both evaluate their halves of the test split: the global AUC.
fn dlrm_auc(q: QCommsConfig, steps: usize) -> f64 {
    let g = SyntheticCriteo::new(SyntheticCriteoConfig {
        seed: 7,
        table_sizes: vec![200; TABLES],
        ids_per_feature: vec![1; TABLES],
        num_train: 1_000_000,
        num_validation: 0,
        num_test: 8_192,
        ..Default::default()
    })
    .unwrap();
    let keys = g.schema().sparse_keys.clone();
    let configs: Vec<EmbeddingBagConfig> = (0..TABLES)
        .map(|i| EmbeddingBagConfig::new(format!("t{i}"), 200, DIM, &[keys[i].as_str()]))
        .collect();
    let shapes: Vec<TableShape> = (0..TABLES)
        .map(|i| TableShape::new(format!("t{i}"), 200, DIM))
        .collect();
    let names: Vec<String> = (0..TABLES).map(|i| format!("t{i}")).collect();
    let placement = |i: usize| match i {
        0..=3 => Placement::TableWise { rank: i % 2 },
        4 | 5 => Placement::RowWise,
        6 => Placement::ColumnWise { ranks: vec![1, 0] },
        _ => Placement::DataParallel,
    };
    let placements: Vec<(&str, Placement)> = (0..TABLES)
        .map(|i| (names[i].as_str(), placement(i)))
        .collect();
    let plan = ShardingPlan::construct(&shapes, &placements, 2, 2).unwrap();
    let batch_of = |range: std::ops::Range<u64>| {
        let examples: Vec<_> = range.map(|i| g.example(i)).collect();
        RawBatch::from_examples(g.schema(), &examples)
            .unwrap()
            .into_batch()
            .unwrap()
    };
    let results = on_ranks(2, Duration::from_secs(60), |comm| {
        let rank = comm.rank() as u64;
        let optimizer = FusedOptimizer::RowWiseAdagrad {
            lr: 0.05,
            eps: 1e-8,
        };
        let sharded =
            ShardedEmbeddingBagCollection::new(configs.clone(), &plan, optimizer, comm, 3).unwrap();
        sharded.set_qcomms(q).unwrap();
        let comm = sharded.comm();
        let dense = DlrmDense::dot(
            g.schema().num_dense(),
            &[32, DIM],
            TABLES,
            &[32, 1],
            DType::F32,
            &mut seeded(3),
        )
        .unwrap();
        let params = dense.parameters();
        let mut opt = Adagrad::new(params.clone(), 0.05, 0.0).unwrap();
        let b = BATCH as u64;
        for step in 0..steps as u64 {
            let start = (2 * step + rank) * b;
            let batch = batch_of(start..start + b);
            let pooled = sharded.forward(&batch.sparse).unwrap();
            let embedded = pooled.values().reshape(&[BATCH, TABLES, DIM]).unwrap();
            let logits = dense.forward(&batch.dense, &embedded).unwrap();
            let labels = batch.labels.reshape(&[BATCH, 1]).unwrap();
            let loss = logits
                .bce_with_logits(&labels, None, Reduction::Mean)
                .unwrap();
            loss.backward().unwrap();
            all_reduce_mean_gradients(comm, &params).unwrap();
            opt.step().unwrap();
            opt.zero_grad();
        }
        // Evaluation: each rank its half of the test split, in batches of 1024.
        let test = g.split_range(Split::Test);
        let half = (test.end - test.start) / 2;
        let mine = test.start + rank * half..test.start + (rank + 1) * half;
        let (mut scores, mut labels) = (Vec::new(), Vec::new());
        for start in mine.clone().step_by(1024) {
            let batch = batch_of(start..(start + 1024).min(mine.end));
            let n = batch.batch_size();
            let logits = embers::tensor::no_grad(|| {
                let pooled = sharded.forward(&batch.sparse)?;
                let embedded = pooled.values().reshape(&[n, TABLES, DIM])?;
                dense.forward(&batch.dense, &embedded)
            })
            .unwrap();
            scores.extend(logits.to_vec::<f32>().unwrap());
            labels.extend(batch.labels.to_vec::<f32>().unwrap());
        }
        let all_scores = comm.all_gather_v("eval", &scores, None).unwrap().concat();
        let all_labels = comm.all_gather_v("eval", &labels, None).unwrap().concat();
        tie_corrected_auc(&all_scores, &all_labels).unwrap()
    });
    assert_eq!(results[0], results[1], "both ranks see the same AUC");
    results[0]
}

#[test]
fn a_dlrm_trained_with_fp16_forward_and_bf16_backward_comms_keeps_its_auc() {
    let steps = 400;
    let exact = dlrm_auc(QCommsConfig::default(), steps);
    let coded = dlrm_auc(
        QCommsConfig::new(CommPrecision::Fp16, CommPrecision::Bf16),
        steps,
    );
    println!("test AUC: FP32 comms {exact:.5}, FP16 forward / BF16 backward {coded:.5}");
    // The model learned the planted signal (chance is 0.5), and the codecs cost < 0.001.
    assert!(exact > 0.7, "FP32-comms AUC {exact}");
    assert!((coded - exact).abs() < 0.001, "{coded} vs {exact}");
}
