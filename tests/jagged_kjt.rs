//! KeyedJaggedTensor behaviours beyond the golden file: building from per-key jagged tensors,
//! concatenating variable-batch KJTs, and the metadata staying consistent through views.

use embers::sparse::{JaggedTensor, KeyedJaggedTensor};
use embers::Tensor;

fn i64s(v: &[i64]) -> Tensor {
    Tensor::from_vec(v.to_vec(), &[v.len()]).unwrap()
}

fn f32s(v: &[f32]) -> Tensor {
    Tensor::from_vec(v.to_vec(), &[v.len()]).unwrap()
}

fn keys(k: &[&str]) -> Vec<String> {
    k.iter().map(|s| s.to_string()).collect()
}

#[test]
fn from_jagged_tensors_inverts_to_dict() {
    let kjt = KeyedJaggedTensor::from_lengths(
        keys(&["a", "b", "c"]),
        i64s(&[10, 11, 20, 30, 31, 32]),
        i64s(&[2, 0, 1, 0, 0, 3]),
        Some(f32s(&[0.5, 1.0, 1.5, 2.0, 2.5, 3.0])),
        None,
    )
    .unwrap();
    let (names, tensors): (Vec<String>, Vec<JaggedTensor>) =
        kjt.to_dict().unwrap().into_iter().unzip();
    let back = KeyedJaggedTensor::from_jagged_tensors(names, &tensors).unwrap();
    assert_eq!(back.keys(), kjt.keys());
    assert_eq!(
        back.values().to_vec::<i64>().unwrap(),
        vec![10, 11, 20, 30, 31, 32]
    );
    assert_eq!(
        back.lengths().to_vec::<i64>().unwrap(),
        vec![2, 0, 1, 0, 0, 3]
    );
    assert_eq!(
        back.weights().unwrap().to_vec::<f32>().unwrap(),
        vec![0.5, 1.0, 1.5, 2.0, 2.5, 3.0]
    );
    assert_eq!(back.stride(), 2);
    assert!(!back.variable_stride_per_key());
}

#[test]
fn from_jagged_tensors_with_different_batches_is_variable_batch() {
    let a = JaggedTensor::new(f32s(&[1.0, 2.0]), i64s(&[2]), None).unwrap();
    let b = JaggedTensor::new(f32s(&[3.0, 4.0, 5.0]), i64s(&[1, 0, 2]), None).unwrap();
    let kjt = KeyedJaggedTensor::from_jagged_tensors(keys(&["a", "b"]), &[a, b]).unwrap();
    assert!(kjt.variable_stride_per_key());
    assert_eq!(kjt.stride_per_key(), &[1, 3]);
    assert_eq!(kjt.stride(), 3);
    assert_eq!(kjt.stride_per_key_per_rank().unwrap(), &[vec![1], vec![3]]);
    assert_eq!(
        kjt.get("b").unwrap().values().to_vec::<f32>().unwrap(),
        vec![3.0, 4.0, 5.0]
    );
    assert_eq!(
        kjt.get("b").unwrap().offsets().to_vec::<i64>().unwrap(),
        vec![0, 1, 1, 3]
    );
}

#[test]
fn concat_of_different_strides_is_variable_batch_and_splits_back() {
    let a = KeyedJaggedTensor::from_lengths(keys(&["a"]), i64s(&[1, 2]), i64s(&[1, 1]), None, None)
        .unwrap();
    let b = KeyedJaggedTensor::from_lengths(
        keys(&["b"]),
        i64s(&[3, 4, 5]),
        i64s(&[0, 2, 0, 1]),
        None,
        None,
    )
    .unwrap();
    let both = KeyedJaggedTensor::concat(&[a, b]).unwrap();
    assert!(both.variable_stride_per_key());
    assert_eq!(both.stride_per_key(), &[2, 4]);
    assert_eq!(both.length_per_key(), &[2, 3]);
    let parts = both.split(&[1, 1]).unwrap();
    assert_eq!(parts[1].values().to_vec::<i64>().unwrap(), vec![3, 4, 5]);
    assert_eq!(
        parts[1].offsets().to_vec::<i64>().unwrap(),
        vec![0, 0, 2, 2, 3]
    );
    // The split parts are views of the concatenated buffer, not copies.
    assert!(parts[1].values().shares_storage_with(both.values()));
}

/// A KJT of no keys (`KeyedJaggedTensor::empty`, stride 0) adds nothing: the concat keeps the
/// others' uniform stride (it became variable-batch), and their weighting (an unweighted empty
/// one was "weighted differently").
#[test]
fn concat_with_a_keyless_kjt_keeps_the_uniform_batch() {
    let a = KeyedJaggedTensor::from_lengths(keys(&["a"]), i64s(&[1, 2]), i64s(&[1, 1]), None, None)
        .unwrap();
    let b = KeyedJaggedTensor::from_lengths(keys(&["b"]), i64s(&[3]), i64s(&[0, 1]), None, None)
        .unwrap();
    let empty = KeyedJaggedTensor::empty();
    for parts in [
        vec![a.clone(), empty.clone(), b.clone()],
        vec![empty.clone(), a.clone(), b.clone()],
    ] {
        let both = KeyedJaggedTensor::concat(&parts).unwrap();
        assert!(!both.variable_stride_per_key());
        assert_eq!(both.stride(), 2);
        assert_eq!(both.keys(), keys(&["a", "b"]).as_slice());
        assert_eq!(both.values().to_vec::<i64>().unwrap(), vec![1, 2, 3]);
    }
    let weighted = KeyedJaggedTensor::from_lengths(
        keys(&["w"]),
        f32s(&[1.0]),
        i64s(&[1, 0]),
        Some(f32s(&[0.5])),
        None,
    )
    .unwrap();
    let both = KeyedJaggedTensor::concat(&[empty.clone(), weighted.clone(), weighted]).unwrap();
    assert_eq!(
        both.weights().unwrap().to_vec::<f32>().unwrap(),
        vec![0.5, 0.5]
    );
    // Only keyless KJTs: an empty one.
    let none = KeyedJaggedTensor::concat(&[empty.clone(), empty]).unwrap();
    assert!(none.keys().is_empty());
}

#[test]
fn permute_of_variable_batch_keeps_per_key_strides() {
    let kjt = KeyedJaggedTensor::from_lengths_variable_batch(
        keys(&["x", "y"]),
        i64s(&[1, 2, 3]),
        i64s(&[1, 0, 2]),
        None,
        vec![vec![1], vec![2]],
    )
    .unwrap();
    let p = kjt.permute(&[1, 0, 1]).unwrap();
    assert_eq!(p.keys(), keys(&["y", "x", "y"]).as_slice());
    assert_eq!(p.stride_per_key(), &[2, 1, 2]);
    assert_eq!(p.values().to_vec::<i64>().unwrap(), vec![2, 3, 1, 2, 3]);
    assert_eq!(p.lengths().to_vec::<i64>().unwrap(), vec![0, 2, 1, 0, 2]);
}
