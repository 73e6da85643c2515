//! Invalid constructions and arguments are errors that say what and where — never a panic or
//! a silent clamp.

use embers::sparse::ops::*;
use embers::sparse::{JaggedTensor, KeyedJaggedTensor, KeyedTensor};
use embers::{Error, Tensor};

fn f32s(v: &[f32]) -> Tensor {
    Tensor::from_vec(v.to_vec(), &[v.len()]).unwrap()
}

fn i64s(v: &[i64]) -> Tensor {
    Tensor::from_vec(v.to_vec(), &[v.len()]).unwrap()
}

fn keys(k: &[&str]) -> Vec<String> {
    k.iter().map(|s| s.to_string()).collect()
}

fn message<T: std::fmt::Debug>(r: Result<T, Error>) -> String {
    r.expect_err("expected an error").to_string()
}

#[test]
fn kjt_negative_length_names_key_and_sample() {
    let m = message(KeyedJaggedTensor::from_lengths(
        keys(&["a", "b"]),
        f32s(&[1.0, 2.0]),
        i64s(&[1, 0, 2, -1]),
        None,
        None,
    ));
    assert!(m.contains("key `b`, sample 1") && m.contains("-1"), "{m}");
}

/// Where a key's values would end before they start (a negative length, offsets that go
/// down across a key boundary), lengths summing past an `i64` (wrapping to the values'
/// count), or strides past a `usize`: named errors, not overflow panics.
#[test]
fn kjt_lengths_that_overflow_or_cross_keys_are_named() {
    let m = message(KeyedJaggedTensor::from_lengths(
        keys(&["a", "b"]),
        f32s(&[1.0]),
        i64s(&[1, -1]),
        None,
        None,
    ));
    assert!(m.contains("key `b`, sample 0") && m.contains("-1"), "{m}");
    let m = message(KeyedJaggedTensor::from_offsets(
        keys(&["a", "b"]),
        f32s(&[1.0, 2.0]),
        i64s(&[0, 2, 1]),
        None,
        None,
    ));
    assert!(
        m.contains("key `b`, sample 0") && m.contains("decrease"),
        "{m}"
    );
    let m = message(KeyedJaggedTensor::from_lengths(
        keys(&["a", "z"]),
        f32s(&[]),
        i64s(&[i64::MAX, i64::MAX, 2, 0, 0, 0]),
        None,
        None,
    ));
    assert!(
        m.contains("key `a`, sample 1") && m.contains("disagree"),
        "{m}"
    );
    let m = message(KeyedJaggedTensor::from_lengths(
        keys(&["a", "b"]),
        f32s(&[1.0]),
        i64s(&[1, 0]),
        None,
        Some(usize::MAX),
    ));
    assert!(m.contains("2 lengths are inconsistent with 2 keys"), "{m}");
}

#[test]
fn kjt_lengths_must_sum_to_values() {
    let m = message(KeyedJaggedTensor::from_lengths(
        keys(&["a"]),
        f32s(&[1.0, 2.0, 3.0]),
        i64s(&[1, 1]),
        None,
        None,
    ));
    assert!(m.contains("add up to 2") && m.contains("3 rows"), "{m}");
}

#[test]
fn kjt_offsets_must_be_monotone_and_start_at_zero() {
    let m = message(KeyedJaggedTensor::from_offsets(
        keys(&["a", "b"]),
        f32s(&[1.0, 2.0, 3.0]),
        i64s(&[0, 2, 1, 3, 3]),
        None,
        None,
    ));
    assert!(
        m.contains("key `a`, sample 1") && m.contains("decrease"),
        "{m}"
    );
    let m = message(KeyedJaggedTensor::from_offsets(
        keys(&["a"]),
        f32s(&[1.0]),
        i64s(&[1, 1]),
        None,
        None,
    ));
    assert!(m.contains("start at 0"), "{m}");
}

#[test]
fn kjt_weights_must_match_values() {
    let m = message(KeyedJaggedTensor::from_lengths(
        keys(&["a"]),
        f32s(&[1.0, 2.0]),
        i64s(&[2]),
        Some(f32s(&[1.0])),
        None,
    ));
    assert!(m.contains("weights") && m.contains("([2])"), "{m}");
}

#[test]
fn kjt_stride_must_be_consistent() {
    let m = message(KeyedJaggedTensor::from_lengths(
        keys(&["a", "b"]),
        f32s(&[1.0]),
        i64s(&[1, 0, 0]),
        None,
        None,
    ));
    assert!(m.contains("inconsistent"), "{m}");
    let m = message(KeyedJaggedTensor::from_lengths(
        keys(&["a", "b"]),
        f32s(&[1.0]),
        i64s(&[1, 0, 0, 0]),
        None,
        Some(3),
    ));
    assert!(m.contains("stride 3"), "{m}");
    let m = message(KeyedJaggedTensor::from_lengths_variable_batch(
        keys(&["a", "b"]),
        f32s(&[1.0]),
        i64s(&[1, 0, 0]),
        None,
        vec![vec![1], vec![1]],
    ));
    assert!(m.contains("add up to 2 samples"), "{m}");
}

#[test]
fn kjt_out_of_range_permute_and_unknown_key() {
    let kjt =
        KeyedJaggedTensor::from_lengths(keys(&["a", "b"]), f32s(&[1.0]), i64s(&[1, 0]), None, None)
            .unwrap();
    match kjt.permute(&[1, 2]) {
        Err(Error::IndexOutOfRange {
            index: 2,
            position: 1,
            size: 2,
            ..
        }) => {}
        other => panic!("{other:?}"),
    }
    let m = message(kjt.get("c"));
    assert!(m.contains("unknown key `c`"), "{m}");
    let m = message(kjt.split(&[1, 2]));
    assert!(m.contains("add up to 3"), "{m}");
    // Segments whose sum wraps a usize to the key count (a panic in debug builds, an index
    // past the keys in release).
    let m = message(kjt.split(&[usize::MAX, 3]));
    assert!(m.contains("add up to more than a usize holds"), "{m}");
}

#[test]
fn unchecked_constructor_skips_validation() {
    // Lengths that don't sum to the values are accepted by the unchecked constructor (the
    // caller vouches for them) and rejected by the checked one.
    let unchecked = KeyedJaggedTensor::from_lengths_unchecked(
        keys(&["a"]),
        f32s(&[1.0, 2.0]),
        i64s(&[1, 1]),
        None,
        None,
        2,
        None,
    );
    assert_eq!(unchecked.unwrap().length_per_key(), &[2]);
    assert!(KeyedJaggedTensor::from_lengths(
        keys(&["a"]),
        f32s(&[1.0, 2.0, 3.0]),
        i64s(&[1, 1]),
        None,
        None
    )
    .is_err());
}

#[test]
fn jagged_tensor_validation() {
    let m = message(JaggedTensor::new(f32s(&[1.0, 2.0]), i64s(&[3, -1]), None));
    assert!(m.contains("sample 1") && m.contains("negative"), "{m}");
    let m = message(JaggedTensor::new(f32s(&[1.0, 2.0]), i64s(&[1, 0]), None));
    assert!(m.contains("add up to 1"), "{m}");
    let m = message(JaggedTensor::from_offsets(
        f32s(&[1.0, 2.0]),
        i64s(&[0, 2, 1]),
        None,
    ));
    assert!(m.contains("decrease at position 2"), "{m}");
    let m = message(JaggedTensor::from_offsets(
        f32s(&[1.0, 2.0]),
        i64s(&[1, 2]),
        None,
    ));
    assert!(m.contains("start at 0"), "{m}");
    let m = message(JaggedTensor::new(
        f32s(&[1.0, 2.0]),
        i64s(&[2]),
        Some(f32s(&[1.0, 2.0, 3.0])),
    ));
    assert!(m.contains("one weight per value"), "{m}");
    let dense = Tensor::zeros(&[2, 3], embers::DType::F32, embers::Device::Cpu);
    let m = message(JaggedTensor::from_dense_lengths(
        &dense,
        &i64s(&[1, 4]),
        None,
    ));
    assert!(m.contains("sample 1") && m.contains("exceeds"), "{m}");
}

/// Arguments whose sizes overflow or that are missing: errors, not panics (overflow,
/// "capacity overflow", an index into an empty list).
#[test]
fn sizes_past_memory_and_missing_arguments_are_errors() {
    let values = f32s(&[1.0, 2.0, 3.0]);
    let offsets = i64s(&[0, 2, 3]);
    let m = message(jagged_to_padded_dense(&values, &[], &[], 0.0));
    assert!(m.contains("no offsets"), "{m}");
    let m = message(jagged_to_padded_dense(
        &values,
        &[&offsets],
        &[usize::MAX],
        0.0,
    ));
    assert!(m.contains("past any memory"), "{m}");
    let dense = Tensor::zeros(&[2, 2], embers::DType::F32, embers::Device::Cpu);
    let m = message(dense_to_jagged(&dense, &[], None));
    assert!(m.contains("no offsets"), "{m}");
    let m = message(dense_to_jagged(&dense, &[&offsets], Some(usize::MAX)));
    assert!(m.contains("past any memory"), "{m}");
    let m = message(permute_2d_sparse_data(
        &i64s(&[0]),
        &i64s(&[0]),
        &Tensor::scalar(1f32),
        None,
        None,
    ));
    assert!(m.contains("at least one dimension"), "{m}");
    let m = message(segment_sum_csr(usize::MAX, &i64s(&[0, 2]), &values));
    assert!(m.contains("the last segment ends at 2"), "{m}");
    let m = message(Tensor::from_vec(Vec::<f32>::new(), &[usize::MAX, 2]));
    assert!(m.contains("past a usize"), "{m}");
    let m = message(values.reshape(&[usize::MAX, 2]));
    assert!(m.contains("more than a usize holds"), "{m}");
    let m = message(Tensor::try_zeros(
        &[1 << 62],
        embers::DType::F32,
        embers::Device::Cpu,
    ));
    assert!(m.contains("past any memory"), "{m}");
    let bucketize = |block: i64, my_size: usize| {
        message(block_bucketize_sparse_features(
            &i64s(&[1]),
            &i64s(&[3]),
            &i64s(&[block]),
            my_size,
            &BlockBucketizeOptions::default(),
        ))
    };
    let m = bucketize(i64::MAX, 4);
    assert!(m.contains("pass a u64"), "{m}");
    let m = bucketize(4, 1 << 61);
    assert!(m.contains("past any memory"), "{m}");
    // A slice "to the end" (usize::MAX) is the rest of each bag.
    let (sliced, lengths) =
        jagged_slice(&values, &i64s(&[2, 1]), &i64s(&[1, 0]), usize::MAX).unwrap();
    assert_eq!(sliced.to_vec::<f32>().unwrap(), vec![2.0, 3.0]);
    assert_eq!(lengths.to_vec::<i64>().unwrap(), vec![1, 1]);
}

#[test]
fn op_argument_errors() {
    let values = f32s(&[1.0, 2.0, 3.0]);
    let m = message(jagged_to_padded_dense(
        &values,
        &[&i64s(&[0, 2, 1])],
        &[2],
        0.0,
    ));
    assert!(m.contains("decrease"), "{m}");
    let m = message(jagged_to_padded_dense(
        &values,
        &[&i64s(&[0, 2, 5])],
        &[2],
        0.0,
    ));
    assert!(m.contains("end at 5"), "{m}");
    match jagged_index_select(&values, &i64s(&[1, 2]), &i64s(&[0, 2])) {
        Err(Error::IndexOutOfRange {
            index: 2,
            position: 1,
            size: 2,
            ..
        }) => {}
        other => panic!("{other:?}"),
    }
    let lengths = Tensor::from_vec(vec![1i64, 2], &[2, 1]).unwrap();
    match permute_2d_sparse_data(&i64s(&[0, 5]), &lengths, &values, None, None) {
        Err(Error::IndexOutOfRange {
            index: 5,
            position: 1,
            ..
        }) => {}
        other => panic!("{other:?}"),
    }
    let m = message(permute_2d_sparse_data(
        &i64s(&[1, 0]),
        &lengths,
        &values,
        Some(&f32s(&[1.0])),
        None,
    ));
    assert!(m.contains("weights"), "{m}");
    let m = message(block_bucketize_sparse_features(
        &i64s(&[1, 2]),
        &i64s(&[1, 2, -3]),
        &i64s(&[4]),
        2,
        &BlockBucketizeOptions::default(),
    ));
    assert!(m.contains("feature 0, sample 1") && m.contains("-3"), "{m}");
    let m = message(block_bucketize_sparse_features(
        &i64s(&[1, 2]),
        &i64s(&[1, 2]),
        &i64s(&[4]),
        2,
        &BlockBucketizeOptions::default(),
    ));
    assert!(m.contains("add up to 3"), "{m}");
    let kt = KeyedTensor::from_tensor_list(
        keys(&["a"]),
        &[Tensor::zeros(
            &[2, 3],
            embers::DType::F32,
            embers::Device::Cpu,
        )],
    )
    .unwrap();
    let m = message(KeyedTensor::regroup(&[kt], &[vec!["a".into(), "z".into()]]));
    assert!(
        m.contains("group 0, position 1") && m.contains("`z`"),
        "{m}"
    );
    // Widths (and a tensor's split sizes) whose sum wraps a usize to the real width: an
    // overflow panic in debug builds, where now an error names them.
    let values = Tensor::zeros(&[2, 3], embers::DType::F32, embers::Device::Cpu);
    let m = message(KeyedTensor::new(
        keys(&["a", "b"]),
        vec![usize::MAX, 4],
        values.clone(),
    ));
    assert!(m.contains("sum past a usize"), "{m}");
    let m = message(values.split(&[usize::MAX, 4], 1));
    assert!(m.contains("sum to more than a usize holds"), "{m}");
}

/// Lengths or batch sizes whose sum overflows are named errors (an overflow panic in debug
/// builds; in release the sum wrapped to the row count and a later slice panicked).
#[test]
fn lengths_and_batch_sizes_that_sum_past_an_integer_are_named() {
    let huge = [i64::MAX, i64::MAX, 2];
    let e = message(JaggedTensor::new(f32s(&[]), i64s(&huge), None));
    assert!(e.contains("sum past an i64"), "{e}");
    let lengths = Tensor::from_vec(huge.to_vec(), &[3, 1]).unwrap();
    let e = message(permute_2d_sparse_data(
        &i64s(&[0, 1, 2]),
        &lengths,
        &f32s(&[]),
        None,
        None,
    ));
    assert!(e.contains("sum past"), "{e}");
    let options = BlockBucketizeOptions {
        batch_size_per_feature: Some(&i64s(&huge)),
        ..Default::default()
    };
    let e = message(block_bucketize_sparse_features(
        &i64s(&[]),
        &i64s(&[]),
        &i64s(&[1, 1, 1]),
        1,
        &options,
    ));
    assert!(
        e.contains("batch sizes per feature sum past a usize"),
        "{e}"
    );
}

/// Cumulative sums past an i64, and outputs whose size a shape or the offsets claim past any
/// memory: named errors, with every claimed segment checked before the output is allocated
/// (an overflow panic, a capacity-overflow panic, or an allocation of the claimed size).
#[test]
fn cumsums_and_jagged_permutes_check_before_they_allocate() {
    for m in [
        message(complete_cumsum(&i64s(&[i64::MAX, 1]))),
        message(inclusive_cumsum(&i64s(&[1, i64::MAX]))),
        message(exclusive_cumsum(&i64s(&[i64::MAX, 1, 0]))),
    ] {
        assert!(m.contains("overflows i64"), "{m}");
    }
    let claimed = Tensor::from_vec(Vec::<i64>::new(), &[usize::MAX / 4, 0]).unwrap();
    let m = message(complete_cumsum(&claimed));
    assert!(m.contains("out of memory"), "{m}");
    // Segments that disagree are named before the 2^61 claimed outputs are allocated.
    let huge = 1i64 << 61;
    let m = message(expand_into_jagged_permute(
        &i64s(&[0]),
        &i64s(&[0, 5]),
        &i64s(&[0, huge]),
        huge as usize,
    ));
    assert!(
        m.contains("has length 2305843009213693952") && m.contains("has 5"),
        "{m}"
    );
    let m = message(expand_into_jagged_permute(
        &i64s(&[0]),
        &i64s(&[0, huge]),
        &i64s(&[0, huge]),
        huge as usize,
    ));
    assert!(m.contains("out of memory"), "{m}");
    // Lengths or offsets of more than one dimension (read flat, their shape kept).
    let two_d = Tensor::from_vec(vec![1i64, 1], &[1, 2]).unwrap();
    let m = message(JaggedTensor::new(f32s(&[1.0, 2.0]), two_d, None));
    assert!(
        m.contains("lengths must be 1-D") && m.contains("[1, 2]"),
        "{m}"
    );
    let two_d = Tensor::from_vec(vec![0i64, 2], &[2, 1]).unwrap();
    let m = message(JaggedTensor::from_offsets(f32s(&[1.0, 2.0]), two_d, None));
    assert!(m.contains("offsets must be 1-D"), "{m}");
}

/// Batched products with a zero dimension give the zero product, forward and backward
/// (chunks of zero columns panicked).
#[test]
fn jagged_bmm_with_a_zero_dimension_gives_zeros() {
    let x = Tensor::from_vec(vec![1.0f32; 6], &[2, 3])
        .unwrap()
        .with_requires_grad(true);
    let y = Tensor::from_vec(Vec::<f32>::new(), &[1, 3, 0])
        .unwrap()
        .with_requires_grad(true);
    let out = jagged_dense_bmm(&x, &i64s(&[0, 2]), &y, 2).unwrap();
    assert_eq!(out.shape(), &[2, 0]);
    out.sum_all().unwrap().backward().unwrap();
    assert_eq!(x.grad().unwrap().to_vec::<f32>().unwrap(), vec![0.0; 6]);
    let a = Tensor::from_vec(vec![1.0f32; 4], &[2, 2])
        .unwrap()
        .with_requires_grad(true);
    let b = Tensor::from_vec(Vec::<f32>::new(), &[2, 0])
        .unwrap()
        .with_requires_grad(true);
    let out = jagged_jagged_bmm(&a, &b, &i64s(&[0, 2]), 2).unwrap();
    assert_eq!(out.shape(), &[1, 2, 0]);
    out.sum_all().unwrap().backward().unwrap();
    assert_eq!(a.grad().unwrap().to_vec::<f32>().unwrap(), vec![0.0; 4]);
}

/// i32 lengths whose offsets pass i32::MAX are an error, not wrapped offsets (they read
/// negative and a later op failed on offsets the caller never gave).
#[test]
fn i32_offsets_past_i32_max_are_an_error() {
    let values = Tensor::zeros(&[3_000_000_000, 0], embers::DType::F32, embers::Device::Cpu);
    let lengths = Tensor::from_vec(vec![2_000_000_000i32, 1_000_000_000], &[2]).unwrap();
    let e = message(JaggedTensor::new(values, lengths, None));
    assert!(e.contains("past i32::MAX"), "{e}");
}

/// `from_lengths_unchecked` still checks the counts safe methods slice by (keys × stride
/// against the lengths, per-rank strides per key, offsets within the values, one weight per
/// value): `get` on such a KJT panicked.
#[test]
fn unchecked_kjts_still_check_their_counts() {
    let build = |lengths: &[i64], offsets: Option<&[i64]>, weights: Option<Tensor>, per_rank| {
        message(KeyedJaggedTensor::from_lengths_unchecked(
            keys(&["a", "b"]),
            f32s(&[1.0, 2.0, 3.0]),
            i64s(lengths),
            offsets.map(i64s),
            weights,
            2,
            per_rank,
        ))
    };
    let e = build(&[1, 1, 1], None, None, None);
    assert!(
        e.contains("3 lengths are inconsistent with 2 keys × stride 2"),
        "{e}"
    );
    let e = build(&[1, 1, 1, 0], None, None, Some(vec![vec![2, 2]]));
    assert!(
        e.contains("stride_per_key_per_rank has 1 entries for 2 keys"),
        "{e}"
    );
    let e = build(&[1, 1, 1, 0], Some(&[0, 1, 2, 3, 9]), None, None);
    assert!(e.contains("the offsets end at 9, past the 3 values"), "{e}");
    let e = build(
        &[1, 1, 1, 0],
        None,
        Some(Tensor::from_vec(vec![1.0f32], &[]).unwrap()),
        None,
    );
    assert!(e.contains("one weight per value"), "{e}");
}

/// A repeated key reads as its last occurrence through `get`, as through `to_dict` and as
/// TorchRec's dict of key indices (`get` took the first, `to_dict` the last).
#[test]
fn a_repeated_key_reads_as_its_last_occurrence() {
    let kjt = KeyedJaggedTensor::from_lengths(
        keys(&["a", "a"]),
        f32s(&[1.0, 2.0, 3.0]),
        i64s(&[1, 2]),
        None,
        Some(1),
    )
    .unwrap();
    let got = kjt.get("a").unwrap().values().to_vec::<f32>().unwrap();
    let dict = kjt.to_dict().unwrap();
    assert_eq!(dict.len(), 1);
    assert_eq!(dict[0].1.values().to_vec::<f32>().unwrap(), got);
    assert_eq!(got, vec![2.0, 3.0]);
    let kt = KeyedTensor::new(
        keys(&["x", "x"]),
        vec![1, 1],
        Tensor::from_vec(vec![5.0f32, 6.0], &[1, 2]).unwrap(),
    )
    .unwrap();
    assert_eq!(kt.get("x").unwrap().to_vec::<f32>().unwrap(), vec![6.0]);
}

/// Offsets given to a KJT that decrease past i64 (their length wrapped) or, as i32, give a
/// length past i32: named as decreasing offsets, not an overflow panic or a length mismatch.
#[test]
fn kjt_offsets_that_decrease_past_the_integer_are_named() {
    let m = message(KeyedJaggedTensor::from_offsets(
        keys(&["a", "b"]),
        f32s(&[1.0; 5]),
        i64s(&[0, 5, i64::MIN]),
        None,
        None,
    ));
    assert!(
        m.contains("offsets decrease") && m.contains("key `b`"),
        "{m}"
    );
    let offsets = Tensor::from_vec(vec![0i32, 2_000_000_000, -2_000_000_000], &[3]).unwrap();
    let m = message(KeyedJaggedTensor::from_offsets(
        keys(&["a", "b"]),
        f32s(&[1.0; 5]),
        offsets,
        None,
        None,
    ));
    assert!(m.contains("offsets decrease"), "{m}");
}

/// A KJT built unchecked whose per-key offsets lie past its values: permuting it is an
/// error (it panicked on a slice, or on a wrapped length).
#[test]
fn permuting_an_unchecked_kjt_past_its_values_is_an_error() {
    let kjt = KeyedJaggedTensor::from_lengths_unchecked(
        keys(&["a", "b"]),
        f32s(&[1.0, 2.0, 3.0]),
        i64s(&[1, 2]),
        Some(i64s(&[0, 5, 3])),
        None,
        1,
        None,
    )
    .unwrap();
    for order in [[0usize], [1]] {
        let m = message(kjt.permute(&order));
        assert!(m.contains("past the tensor's 3 rows"), "{order:?}: {m}");
    }
}

/// Weights of another shape than the values' `[B, N]` are refused (narrower ones padded the
/// rows past them with zero weights).
#[test]
fn dense_lengths_weights_must_be_the_values_batch_and_length() {
    let values = Tensor::from_vec(vec![1.0f32; 2 * 3 * 2], &[2, 3, 2]).unwrap();
    let weights = Tensor::from_vec(vec![1.0f32; 4], &[2, 2]).unwrap();
    let m = message(JaggedTensor::from_dense_lengths(
        &values,
        &i64s(&[3, 1]),
        Some(&weights),
    ));
    assert!(
        m.contains("weights have shape [2, 2]") && m.contains("[2, 3]"),
        "{m}"
    );
}

/// Dense operands of jagged elementwise ops whose trailing dimensions are not the jagged
/// values' (they broadcast across columns: a wrong result, silently).
#[test]
fn jagged_elementwise_trailing_dimensions_must_match() {
    let x = Tensor::from_vec(vec![1.0f32; 9], &[3, 3]).unwrap();
    let offsets = i64s(&[0, 1, 3]);
    let y = Tensor::from_vec(vec![1.0f32; 4], &[2, 2]).unwrap();
    let m = message(jagged_dense_elementwise_mul(&x, &offsets, &y));
    assert!(m.contains("dense has shape [2, 2]"), "{m}");
    let y = Tensor::from_vec(vec![1.0f32; 2 * 2 * 4], &[2, 2, 4]).unwrap();
    let m = message(jagged_dense_elementwise_add(&x, &offsets, &y));
    assert!(m.contains("[3, 3]"), "{m}");
    let y = Tensor::from_vec(vec![1.0f32; 2 * 2 * 3], &[2, 2, 3]).unwrap();
    assert_eq!(
        jagged_dense_elementwise_mul(&x, &offsets, &y)
            .unwrap()
            .shape(),
        &[3, 3]
    );
}

/// `expand_into_jagged_permute` checks its input offsets (a decrease gave negative positions,
/// or overflowed).
#[test]
fn expand_into_jagged_permute_checks_its_input_offsets() {
    let m = message(expand_into_jagged_permute(
        &i64s(&[0]),
        &i64s(&[-4, -2]),
        &i64s(&[0, 2]),
        2,
    ));
    assert!(m.contains("offsets must start at 0"), "{m}");
    let m = message(expand_into_jagged_permute(
        &i64s(&[0, 1]),
        &i64s(&[0, 4, 2]),
        &i64s(&[0, 4, 2]),
        2,
    ));
    assert!(m.contains("input segment"), "{m}");
}

/// Several jagged dimensions padded to lengths past memory, of no element: an error, where
/// the slot map's allocation aborted the process.
#[test]
fn a_slot_map_past_memory_is_an_error() {
    let values = Tensor::from_vec(Vec::<f32>::new(), &[1, 0]).unwrap();
    let m = message(jagged_to_padded_dense(
        &values,
        &[&i64s(&[0, 1]), &i64s(&[0, 1])],
        &[1 << 40, 1],
        0.0,
    ));
    assert!(
        m.contains("out of memory") || m.contains("past a usize"),
        "{m}"
    );
}

/// `segment_sum_csr`'s gradient has its values' shape (a `[4, 2]` input got a `[8]` one,
/// which autograd refused).
#[test]
fn segment_sum_gradients_have_the_values_shape() {
    let values = Tensor::from_vec(vec![1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0], &[4, 2])
        .unwrap()
        .with_requires_grad(true);
    let out = segment_sum_csr(2, &i64s(&[0, 1, 4]), &values).unwrap();
    assert_eq!(out.to_vec::<f32>().unwrap(), vec![3.0, 33.0]);
    out.sum(&[0], false).unwrap().backward().unwrap();
    let g = values.grad().unwrap();
    assert_eq!(g.shape(), &[4, 2]);
    assert_eq!(g.to_vec::<f32>().unwrap(), vec![1.0; 8]);
}

/// A key repeated across keyed tensors, or within one, regroups as its last occurrence, as
/// TorchRec's regroup (a dict filled in order); `to_dict` lists it once, with those columns.
#[test]
fn regroup_takes_a_repeated_keys_last_occurrence() {
    let kt = |k: &[&str], v: Vec<f32>| {
        let n = v.len();
        KeyedTensor::new(keys(k), vec![1; n], Tensor::from_vec(v, &[1, n]).unwrap()).unwrap()
    };
    let first = kt(&["a", "b"], vec![1.0, 2.0]);
    let second = kt(&["a", "a"], vec![3.0, 4.0]);
    let out =
        KeyedTensor::regroup(&[first, second.clone()], &[vec!["a".into(), "b".into()]]).unwrap();
    assert_eq!(out[0].to_vec::<f32>().unwrap(), vec![4.0, 2.0]);
    let dict = second.to_dict().unwrap();
    assert_eq!(dict.len(), 1);
    assert_eq!(dict[0].1.to_vec::<f32>().unwrap(), vec![4.0]);
}

/// KJT weights are one per value, 1-D: `[N, 2]` weights are refused (they were taken, and
/// `get` handed out a jagged tensor with 2-D weights, which its own constructor refuses).
#[test]
fn kjt_weights_are_one_dimensional() {
    let m = message(KeyedJaggedTensor::from_lengths(
        keys(&["a"]),
        f32s(&[1.0, 2.0]),
        i64s(&[2]),
        Some(Tensor::from_vec(vec![1.0f32; 4], &[2, 2]).unwrap()),
        None,
    ));
    assert!(m.contains("weights have shape [2, 2]"), "{m}");
}

/// An empty batch is FBGEMM's `[0, D]`, not an error, and its gradients are empty.
#[test]
fn batched_dense_vec_jagged_2d_mul_of_no_bag_is_empty() {
    let v = Tensor::from_vec(Vec::<f32>::new(), &[0, 3])
        .unwrap()
        .with_requires_grad(true);
    let a = Tensor::from_vec(Vec::<f32>::new(), &[0, 4])
        .unwrap()
        .with_requires_grad(true);
    let out = batched_dense_vec_jagged_2d_mul(&v, &a, &i64s(&[0])).unwrap();
    assert_eq!(out.shape(), &[0, 4]);
    out.sum_all().unwrap().backward().unwrap();
    assert_eq!(v.grad().unwrap().shape(), &[0, 3]);
    assert_eq!(a.grad().unwrap().shape(), &[0, 4]);
    // Rows of v without a bag are still refused.
    let v = Tensor::from_vec(vec![1.0f32; 3], &[1, 3]).unwrap();
    assert!(batched_dense_vec_jagged_2d_mul(&v, &a, &i64s(&[0])).is_err());
}
