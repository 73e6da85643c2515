//! Finite-difference gradient checks (f64) for every differentiable op of the tensor core,
//! including broadcast and view cases.

// Inputs are passed as owned clones on purpose: each check gets fresh leaves.
#![allow(clippy::cloned_ref_to_slice_refs)]

use embers::tensor::rng::seeded;
use embers::tensor::testing::check_gradients;
use embers::tensor::Reduction;
use embers::{DType, Result, Tensor};

const EPS: f64 = 1e-6;
const TOL: f64 = 1e-6;

/// A random f64 leaf requiring grad, values in [lo, hi).
fn leaf(shape: &[usize], lo: f64, hi: f64, seed: u64) -> Tensor {
    Tensor::rand_uniform(shape, lo, hi, DType::F64, &mut seeded(seed)).with_requires_grad(true)
}

fn check(f: impl Fn(&[Tensor]) -> Result<Tensor>, inputs: &[Tensor]) {
    check_gradients(f, inputs, EPS, TOL).unwrap();
}

#[test]
fn binary_ops_with_broadcasting() {
    let a = leaf(&[2, 3], -1.0, 1.0, 1);
    let row = leaf(&[3], 0.5, 1.5, 2);
    let col = leaf(&[2, 1], 0.5, 1.5, 3);
    let other = leaf(&[1, 3], 0.5, 1.5, 4);
    check(|x| x[0].add(&x[1]), &[a.clone(), row.clone()]);
    check(|x| x[0].sub(&x[1]), &[col.clone(), other.clone()]);
    check(|x| x[0].mul(&x[1]), &[a.clone(), col.clone()]);
    check(|x| x[0].div(&x[1]), &[a.clone(), row.clone()]);
    check(|x| x[0].div(&x[1]), &[col.clone(), other.clone()]);
    // maximum/minimum away from ties: a in [-1,1), row in [0.5,1.5) overlap but never equal.
    check(|x| x[0].maximum(&x[1]), &[a.clone(), row.clone()]);
    check(|x| x[0].minimum(&x[1]), &[a.clone(), row.clone()]);
    // Same tensor on both sides (x * x) accumulates two contributions.
    check(|x| x[0].mul(&x[0]), &[a.clone()]);
    // Scalars.
    check(|x| x[0].affine(2.5, -1.0), &[a.clone()]);
    check(|x| x[0].add_scalar(3.0)?.div_scalar(2.0), &[a.clone()]);
}

#[test]
fn unary_ops() {
    let x = leaf(&[3, 4], -2.0, 2.0, 5);
    let pos = leaf(&[3, 4], 0.2, 3.0, 6);
    check(|x| x[0].neg(), &[x.clone()]);
    check(|x| x[0].exp(), &[x.clone()]);
    check(|x| x[0].log(), &[pos.clone()]);
    check(|x| x[0].sqrt(), &[pos.clone()]);
    check(|x| x[0].pow_scalar(2.5), &[pos.clone()]);
    check(|x| x[0].sigmoid(), &[x.clone()]);
    check(|x| x[0].tanh(), &[x.clone()]);
    check(|x| x[0].gelu(), &[x.clone()]);
    check(|x| x[0].gelu_tanh(), &[x.clone()]);
    check(|x| x[0].square(), &[x.clone()]);
    // Kinks: inputs kept away from 0 / the clamp bounds.
    let away = Tensor::from_vec(vec![-1.5, -0.7, -0.2, 0.3, 0.9, 1.7], &[2, 3])
        .unwrap()
        .with_requires_grad(true);
    check(|x| x[0].relu(), &[away.clone()]);
    check(|x| x[0].abs(), &[away.clone()]);
    check(|x| x[0].clamp(-1.0, 1.0), &[away.clone()]);
}

#[test]
fn reductions() {
    let x = leaf(&[2, 3, 4], -1.0, 1.0, 7);
    check(|x| x[0].sum_all(), &[x.clone()]);
    check(|x| x[0].sum(&[1], false), &[x.clone()]);
    check(|x| x[0].sum(&[0, 2], true), &[x.clone()]);
    check(|x| x[0].mean(&[-1], false), &[x.clone()]);
    check(|x| x[0].mean_all(), &[x.clone()]);
    // Random values: ties have probability zero.
    check(|x| Ok(x[0].max_dim(1, false)?.0), &[x.clone()]);
    check(|x| Ok(x[0].max_dim(2, true)?.0), &[x.clone()]);
    check(|x| x[0].max_all(), &[x.clone()]);
    check(|x| x[0].sum_to_shape(&[1, 3, 1]), &[x.clone()]);
}

#[test]
fn matmul_variants() {
    let a = leaf(&[3, 4], -1.0, 1.0, 8);
    let b = leaf(&[4, 5], -1.0, 1.0, 9);
    check(|x| x[0].matmul(&x[1]), &[a.clone(), b.clone()]);
    // Transposed operands are strided views.
    let bt = leaf(&[5, 4], -1.0, 1.0, 10);
    check(|x| x[0].matmul(&x[1].t()?), &[a.clone(), bt.clone()]);
    check(
        |x| x[0].t()?.matmul(&x[1].t()?),
        &[leaf(&[4, 3], -1.0, 1.0, 11), leaf(&[5, 4], -1.0, 1.0, 12)],
    );
    // Batched, with a broadcast 2-D right operand and a broadcast batch dimension.
    let batched = leaf(&[2, 3, 4], -1.0, 1.0, 13);
    check(|x| x[0].matmul(&x[1]), &[batched.clone(), b.clone()]);
    check(
        |x| x[0].matmul(&x[1]),
        &[
            leaf(&[2, 1, 3, 4], -1.0, 1.0, 14),
            leaf(&[3, 4, 2], -1.0, 1.0, 15),
        ],
    );
    // The DLRM interaction pattern: z · zᵀ.
    let z = leaf(&[2, 4, 3], -1.0, 1.0, 16);
    check(|x| x[0].matmul(&x[0].transpose(1, 2)?), &[z]);
    // linear: x·Wᵀ + b, with and without bias, and with leading dims.
    let w = leaf(&[5, 4], -1.0, 1.0, 17);
    let bias = leaf(&[5], -1.0, 1.0, 18);
    check(
        |x| x[0].linear(&x[1], Some(&x[2])),
        &[a.clone(), w.clone(), bias.clone()],
    );
    check(|x| x[0].linear(&x[1], None), &[batched.clone(), w.clone()]);
}

#[test]
fn views() {
    let x = leaf(&[2, 3, 4], -1.0, 1.0, 19);
    check(|x| x[0].reshape(&[6, 4]), &[x.clone()]);
    check(|x| x[0].permute(&[2, 0, 1])?.contiguous(), &[x.clone()]);
    check(|x| x[0].transpose(0, 2)?.reshape(&[4, 6]), &[x.clone()]);
    check(|x| x[0].narrow(1, 1, 2), &[x.clone()]);
    check(|x| x[0].narrow(2, 0, 3)?.narrow(0, 1, 1), &[x.clone()]);
    check(|x| x[0].unsqueeze(1)?.squeeze(1), &[x.clone()]);
    check(|x| x[0].flatten(0, 1), &[x.clone()]);
    let small = leaf(&[3, 1], -1.0, 1.0, 20);
    check(|x| x[0].expand(&[2, 3, 4]), &[small.clone()]);
    // Ops on views: a non-contiguous operand into an elementwise op and a reduction.
    check(
        |x| x[0].transpose(0, 1)?.mul(&x[1])?.sum(&[0], false),
        &[leaf(&[4, 3], -1.0, 1.0, 21), leaf(&[3, 4], -1.0, 1.0, 22)],
    );
}

#[test]
fn concat_split_stack_chunk() {
    let a = leaf(&[2, 3], -1.0, 1.0, 23);
    let b = leaf(&[2, 2], -1.0, 1.0, 24);
    check(|x| Tensor::cat(&[&x[0], &x[1]], 1), &[a.clone(), b.clone()]);
    check(|x| Tensor::cat(&[&x[0], &x[0]], 0), &[a.clone()]);
    check(
        |x| Tensor::stack(&[&x[0], &x[1]], 1),
        &[a.clone(), leaf(&[2, 3], -1.0, 1.0, 25)],
    );
    check(
        |x| {
            let p = x[0].split(&[1, 2], 1)?;
            p[1].mul(&p[1])?.add(&p[0])
        },
        &[a.clone()],
    );
    check(
        |x| {
            let p = x[0].chunk(2, 1)?;
            Tensor::cat(&[&p[1], &p[0]], 1)
        },
        &[leaf(&[2, 4], -1.0, 1.0, 26)],
    );
}

#[test]
fn indexing() {
    let table = leaf(&[5, 3], -1.0, 1.0, 27);
    let idx = Tensor::from_vec(vec![4i64, 0, 4, 2], &[4]).unwrap();
    check(|x| x[0].index_select(&x[1]), &[table.clone(), idx.clone()]);
    let idx2 = Tensor::from_vec(vec![1i32, 3, 1, 0, 0, 2], &[2, 3]).unwrap();
    check(|x| x[0].index_select(&x[1]), &[table.clone(), idx2]);
    let gidx = Tensor::from_vec(vec![0i64, 4, 2, 1, 1, 3], &[2, 3]).unwrap();
    check(|x| x[0].gather(&x[1]), &[table.clone(), gidx]);
    let mask = Tensor::from_vec(vec![1u8, 0, 0, 1, 1, 0], &[2, 3]).unwrap();
    let m = leaf(&[2, 3], -1.0, 1.0, 28);
    check(|x| x[0].masked_fill(&mask, 7.0), &[m.clone()]);
    check(
        |x| Tensor::where_cond(&mask, &x[0], &x[1]),
        &[m.clone(), leaf(&[3], -1.0, 1.0, 29)],
    );
    // The dot-interaction pattern: pick the strict upper triangle of z·zᵀ.
    let (rows, cols) = Tensor::triu_indices(4, 1).unwrap();
    let flat: Vec<i64> = rows
        .to_vec::<i64>()
        .unwrap()
        .iter()
        .zip(cols.to_vec::<i64>().unwrap())
        .map(|(r, c)| r * 4 + c)
        .collect();
    let n = flat.len();
    let flat = Tensor::from_vec(flat, &[n]).unwrap();
    check(
        |x| {
            let zz = x[0].matmul(&x[0].transpose(1, 2)?)?; // [2, 4, 4]
            zz.reshape(&[2, 16])?.t()?.index_select(&flat)?.t()
        },
        &[leaf(&[2, 4, 3], -1.0, 1.0, 30)],
    );
}

#[test]
fn softmax_family() {
    let x = leaf(&[3, 5], -2.0, 2.0, 31);
    check(|x| x[0].softmax(-1), &[x.clone()]);
    check(|x| x[0].softmax(0), &[x.clone()]);
    check(|x| x[0].log_softmax(1), &[x.clone()]);
}

/// The CPU's one-pass f32 backward along the last dimension (large enough to run in
/// parallel) against the gradient composed of f64 tensor ops.
#[test]
fn softmax_family_f32_last_dim_matches_f64() {
    let (rows, n) = (300, 200);
    let x64 = Tensor::rand_uniform(&[rows, n], -3.0, 3.0, DType::F64, &mut seeded(35));
    let g64 = Tensor::rand_uniform(&[rows, n], -1.0, 1.0, DType::F64, &mut seeded(36));
    for log in [false, true] {
        let grad = |dtype: DType| {
            let x = x64.to_dtype(dtype).unwrap().with_requires_grad(true);
            let y = if log {
                x.log_softmax(-1)
            } else {
                x.softmax(-1)
            }
            .unwrap();
            let g = g64.to_dtype(dtype).unwrap();
            y.mul(&g).unwrap().sum_all().unwrap().backward().unwrap();
            x.grad().unwrap().to_vec_f64().unwrap()
        };
        let (fast, reference) = (grad(DType::F32), grad(DType::F64));
        for (i, (a, b)) in fast.iter().zip(&reference).enumerate() {
            assert!(
                (a - b).abs() <= 1e-5 * b.abs().max(1.0),
                "log {log}, element {i}: f32 {a} vs f64 {b}"
            );
        }
    }
}

#[test]
fn losses() {
    let logits = leaf(&[4, 3], -2.0, 2.0, 32);
    let soft = Tensor::rand_uniform(&[4, 3], 0.0, 1.0, DType::F64, &mut seeded(33));
    let w = Tensor::rand_uniform(&[3], 0.5, 2.0, DType::F64, &mut seeded(34));
    check(
        |x| x[0].bce_with_logits(&soft, None, Reduction::Mean),
        &[logits.clone()],
    );
    check(
        |x| x[0].bce_with_logits(&soft, Some(&w), Reduction::Sum),
        &[logits.clone()],
    );
    check(
        |x| x[0].bce_with_logits(&soft, None, Reduction::None),
        &[logits.clone()],
    );
    check(
        |x| x[0].mse_loss(&x[1], Reduction::Mean),
        &[logits.clone(), leaf(&[4, 3], -1.0, 1.0, 35)],
    );
    let target = Tensor::from_vec(vec![2i64, 0, 1, 2], &[4]).unwrap();
    check(
        |x| x[0].cross_entropy(&target, Reduction::Mean),
        &[logits.clone()],
    );
    check(
        |x| x[0].cross_entropy(&target, Reduction::None),
        &[logits.clone()],
    );
}

#[test]
fn layer_norm_with_affine() {
    let x = leaf(&[3, 6], -2.0, 2.0, 36);
    let w = leaf(&[6], 0.5, 1.5, 37);
    let b = leaf(&[6], -0.5, 0.5, 38);
    check(
        |x| x[0].layer_norm(&[6], Some(&x[1]), Some(&x[2]), 1e-5),
        &[x.clone(), w, b],
    );
    check(
        |x| x[0].layer_norm(&[2, 3], None, None, 1e-5),
        &[leaf(&[2, 2, 3], -2.0, 2.0, 39)],
    );
}

#[test]
fn composed_mlp_graph() {
    // A small MLP with shared use of a tensor and a non-trivial graph.
    let x = leaf(&[4, 3], -1.0, 1.0, 40);
    let w1 = leaf(&[5, 3], -1.0, 1.0, 41);
    let w2 = leaf(&[1, 5], -1.0, 1.0, 42);
    check(
        |p| {
            let h = p[0].linear(&p[1], None)?.tanh()?;
            let skip = h.mean(&[1], true)?;
            h.linear(&p[2], None)?.add(&skip)?.sigmoid()
        },
        &[x, w1, w2],
    );
}
