//! Finite-difference gradient checks (f64) of the differentiable jagged ops and of the keyed
//! tensor regroup.

use embers::sparse::ops::*;
use embers::sparse::KeyedTensor;
use embers::tensor::rng::seeded;
use embers::tensor::testing::check_gradients;
use embers::{DType, Tensor};

fn leaf(shape: &[usize], seed: u64) -> Tensor {
    Tensor::rand_uniform(shape, -1.0, 1.0, DType::F64, &mut seeded(seed)).with_requires_grad(true)
}

fn offsets() -> Tensor {
    // Bags of 2, 0, 3, 1 rows.
    Tensor::from_vec(vec![0i64, 2, 2, 5, 6], &[5]).unwrap()
}

fn check(f: impl Fn(&[Tensor]) -> embers::Result<Tensor>, inputs: &[Tensor]) {
    check_gradients(f, inputs, 1e-6, 1e-6).unwrap();
}

#[test]
fn padded_dense_conversions() {
    let o = offsets();
    check(
        |x| jagged_to_padded_dense(&x[0], &[&o], &[2], 0.5),
        &[leaf(&[6, 3], 1)],
    );
    check(
        |x| dense_to_jagged(&x[0], &[&o], None),
        &[leaf(&[4, 2, 3], 2)],
    );
    check(|x| jagged_2d_to_dense(&x[0], &o, 4), &[leaf(&[6, 2], 3)]);
}

#[test]
fn elementwise() {
    let o = offsets();
    check(
        |x| jagged_dense_elementwise_add(&x[0], &o, &x[1]),
        &[leaf(&[6, 2], 4), leaf(&[4, 2, 2], 5)],
    );
    check(
        |x| jagged_dense_elementwise_add_jagged_output(&x[0], &o, &x[1]),
        &[leaf(&[6, 2], 6), leaf(&[4, 3, 2], 7)],
    );
    check(
        |x| jagged_dense_dense_elementwise_add_jagged_output(&x[0], &o, &x[1], &x[2]),
        &[leaf(&[6, 2], 8), leaf(&[4, 3, 2], 9), leaf(&[4, 3, 2], 10)],
    );
    check(
        |x| jagged_dense_elementwise_mul(&x[0], &o, &x[1]),
        &[leaf(&[6, 2], 11), leaf(&[4, 2, 2], 12)],
    );
}

#[test]
fn products() {
    let o = offsets();
    for max_l in [3, 2] {
        check(
            |x| jagged_dense_bmm(&x[0], &o, &x[1], max_l),
            &[leaf(&[6, 3], 13), leaf(&[4, 3, 2], 14)],
        );
        check(
            |x| jagged_jagged_bmm(&x[0], &x[1], &o, max_l),
            &[leaf(&[6, 2], 15), leaf(&[6, 3], 16)],
        );
    }
    check(
        |x| batched_dense_vec_jagged_2d_mul(&x[0], &x[1], &o),
        &[leaf(&[8, 2], 17), leaf(&[6, 6], 18)],
    );
    check(
        |x| permute102_baddbmm_permute102(&x[0], &x[1], &x[2]),
        &[
            leaf(&[2, 3], 19),
            leaf(&[4, 2, 5], 20),
            leaf(&[2, 5, 3], 21),
        ],
    );
    check(
        |x| permute102_baddbmm_permute102(&x[0], &x[1], &x[2]),
        &[leaf(&[3], 22), leaf(&[4, 2, 5], 23), leaf(&[2, 5, 3], 24)],
    );
}

#[test]
fn softmax_and_segments() {
    let o = offsets();
    check(|x| jagged_softmax(&x[0], &o, 3), &[leaf(&[6, 2], 25)]);
    check(|x| jagged_softmax(&x[0], &o, 2), &[leaf(&[6, 2], 26)]);
    let seg = Tensor::from_vec(vec![0i64, 1, 3], &[3]).unwrap();
    check(|x| segment_sum_csr(2, &seg, &x[0]), &[leaf(&[6], 27)]);
}

#[test]
fn selections() {
    let lengths = Tensor::from_vec(vec![2i64, 0, 3, 1], &[4]).unwrap();
    let picks = Tensor::from_vec(vec![2i64, 0, 2, 3], &[4]).unwrap();
    check(
        |x| Ok(jagged_index_select(&x[0], &lengths, &picks)?.0),
        &[leaf(&[6, 2], 28)],
    );
    check(|x| index_select_dim0(&x[0], &picks), &[leaf(&[5, 3], 29)]);
    let starts = Tensor::from_vec(vec![1i64, 0, 1, 0], &[4]).unwrap();
    check(
        |x| Ok(jagged_slice(&x[0], &lengths, &starts, 2)?.0),
        &[leaf(&[6], 30)],
    );
    let offsets = offsets();
    let batch_picks = Tensor::from_vec(vec![1i64, 1, 0], &[3]).unwrap();
    let key_lengths = Tensor::from_vec(vec![2i64, 0, 3, 1], &[4]).unwrap();
    check(
        |x| {
            Ok(keyed_jagged_index_select_dim1(
                &x[0],
                &key_lengths,
                &offsets,
                &batch_picks,
                2,
                None,
            )?
            .values)
        },
        &[leaf(&[6], 31)],
    );
}

#[test]
fn keyed_tensor_regroup() {
    check(
        |x| {
            let a = KeyedTensor::from_tensor_list(
                vec!["a".into(), "b".into()],
                &[x[0].clone(), x[1].clone()],
            )?;
            let groups = vec![
                vec!["b".to_string(), "a".to_string()],
                vec!["a".to_string()],
            ];
            let out = KeyedTensor::regroup(&[a], &groups)?;
            Tensor::cat(&[&out[0], &out[1]], 1)
        },
        &[leaf(&[3, 2], 32), leaf(&[3, 4], 33)],
    );
}

/// A jagged product whose one operand alone needs a gradient computes that one, equal to
/// its value when both are wanted, and reads (and checks) only the other operand: a write
/// into the operand it does not read changes nothing, one into the operand it reads is
/// refused by name.
#[test]
fn products_compute_and_read_only_the_wanted_gradient() {
    let o = offsets();
    for (name, op) in [("jagged_dense_bmm", 0), ("jagged_jagged_bmm", 1)] {
        let (x0, y0) = match op {
            0 => (leaf(&[6, 3], 13), leaf(&[4, 3, 2], 14)),
            _ => (leaf(&[6, 2], 15), leaf(&[6, 3], 16)),
        };
        let run = |x: &Tensor, y: &Tensor| match op {
            0 => jagged_dense_bmm(x, &o, y, 3),
            _ => jagged_jagged_bmm(x, y, &o, 3),
        };
        let (x, y) = (
            x0.detach().with_requires_grad(true),
            y0.detach().with_requires_grad(true),
        );
        run(&x, &y).unwrap().sum_all().unwrap().backward().unwrap();
        let both = x.grad().unwrap().to_vec::<f64>().unwrap();
        // Only x wanted: its gradient reads y alone.
        let (x, y) = (
            x0.detach().contiguous().unwrap(),
            y0.detach().contiguous().unwrap(),
        );
        let x = x.with_requires_grad(true);
        let loss = run(&x, &y).unwrap().sum_all().unwrap();
        x.update_in_place(|v: &mut [f64]| v[0] += 1.0).unwrap();
        loss.backward().unwrap();
        assert_eq!(x.grad().unwrap().to_vec::<f64>().unwrap(), both, "{name}");
        let x = x.detach().with_requires_grad(true);
        let loss = run(&x, &y).unwrap().sum_all().unwrap();
        y.update_in_place(|v: &mut [f64]| v[0] += 1.0).unwrap();
        let e = loss.backward().unwrap_err().to_string();
        assert!(e.contains(name) && e.contains("modified in place"), "{e}");
    }
}
