//! TorchRec's `KJTAllToAll` docstring example on 2 ranks: keys A, B, C with 3 samples per
//! rank; splits `[2, 1]` send A and B to rank 0 and C to rank 1, each with both ranks' samples
//! (6). Shared by `tests/dist_comm.rs` (threads) and the MPI worker.
#![allow(dead_code)]

use embers::distributed::{kjt_all_to_all, Comm};
use embers::sparse::KeyedJaggedTensor;
use embers::Tensor;

/// The splits of the example.
pub const SPLITS: [usize; 2] = [2, 1];

/// A KJT from per key, per sample values.
fn kjt(keys: &[&str], per_key: &[Vec<Vec<i64>>]) -> embers::Result<KeyedJaggedTensor> {
    let values: Vec<i64> = per_key.iter().flatten().flatten().copied().collect();
    let lengths: Vec<i64> = per_key.iter().flatten().map(|v| v.len() as i64).collect();
    let (n, l) = (values.len(), lengths.len());
    KeyedJaggedTensor::from_lengths(
        keys.iter().map(|k| k.to_string()).collect(),
        Tensor::from_vec(values, &[n])?,
        Tensor::from_vec(lengths, &[l])?,
        None,
        None,
    )
}

/// Rank `rank`'s input: keys A, B, C (values A.V*, B.V* and C.V* numbered from 0, 10, 20).
pub fn input(rank: usize) -> embers::Result<KeyedJaggedTensor> {
    let per_rank: [[Vec<Vec<i64>>; 3]; 2] = [
        [
            vec![vec![0], vec![], vec![1, 2]],
            vec![vec![], vec![10], vec![11]],
            vec![vec![20], vec![21], vec![]],
        ],
        [
            vec![vec![3], vec![4], vec![]],
            vec![vec![], vec![12], vec![13, 14]],
            vec![vec![22], vec![23], vec![]],
        ],
    ];
    kjt(&["A", "B", "C"], &per_rank[rank])
}

/// What rank `rank` must receive, as the docstring writes it.
pub fn expected(rank: usize) -> embers::Result<KeyedJaggedTensor> {
    if rank == 0 {
        // 'A': [A.V0] None [A.V1, A.V2] [A.V3] [A.V4] None
        // 'B': None [B.V0] [B.V1] None [B.V2] [B.V3, B.V4]
        kjt(
            &["A", "B"],
            &[
                vec![vec![0], vec![], vec![1, 2], vec![3], vec![4], vec![]],
                vec![vec![], vec![10], vec![11], vec![], vec![12], vec![13, 14]],
            ],
        )
    } else {
        // 'C': [C.V0] [C.V1] None [C.V2] [C.V3] None
        kjt(
            &["C"],
            &[vec![vec![20], vec![21], vec![], vec![22], vec![23], vec![]]],
        )
    }
}

/// Runs the example on this rank of a 2-rank `comm`: an error saying what differs.
pub fn check(comm: &Comm) -> Result<(), String> {
    let e = |e: embers::Error| e.to_string();
    let rank = comm.rank();
    let got = kjt_all_to_all(comm, &input(rank).map_err(e)?, &SPLITS).map_err(e)?;
    let want = expected(rank).map_err(e)?;
    let same = got.keys() == want.keys()
        && got.stride() == 6
        && got.lengths().to_vec::<i64>().map_err(e)?
            == want.lengths().to_vec::<i64>().map_err(e)?
        && got.values().to_vec::<i64>().map_err(e)? == want.values().to_vec::<i64>().map_err(e)?;
    if same {
        Ok(())
    } else {
        Err(format!("rank {rank}: got {got:?}, expected {want:?}"))
    }
}
