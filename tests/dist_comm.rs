//! The communicator's collectives against hand-worked examples, each rank a thread over a
//! `LocalGroup` (the MPI transport runs the same calls in `dist_mpi.rs`): uneven and empty
//! blocks, byte counts, sub-groups, TorchRec's `KJTAllToAll` docstring example, and the errors
//! — counts that do not match, a rank that never joins.

#[path = "support/dist_scenarios.rs"]
mod dist_scenarios;
#[path = "support/kjt_docstring.rs"]
mod kjt_docstring;

use std::time::{Duration, Instant};

use embers::distributed::Comm;

fn on_ranks<T: Send>(world: usize, timeout_ms: u64, f: impl Fn(Comm) -> T + Sync) -> Vec<T> {
    dist_scenarios::on_ranks(world, Duration::from_millis(timeout_ms), f)
}

#[test]
fn all_to_all_v_with_uneven_and_empty_blocks() {
    // Rank r sends to rank d the values 100·r + 10·d + k for k < (r + d) % 3.
    let block = |r: usize, d: usize| -> Vec<i64> {
        (0..(r + d) % 3)
            .map(|k| (100 * r + 10 * d + k) as i64)
            .collect()
    };
    let got = on_ranks(3, 2000, |comm| {
        let r = comm.rank();
        let send = (0..3).map(|d| block(r, d)).collect();
        let out = comm.all_to_all_v("test.a2a", send, None).unwrap();
        (out, comm.bytes()["test.a2a"], comm.bytes()["sizes"])
    });
    for (d, (out, bytes, sizes)) in got.iter().enumerate() {
        for (r, b) in out.iter().enumerate() {
            assert_eq!(b, &block(r, d), "rank {d} from rank {r}");
        }
        // 8-byte values to the other ranks; the sizes exchange is one u64 per other rank.
        let sent: usize = (0..3)
            .filter(|&x| x != d)
            .map(|x| block(d, x).len() * 8)
            .sum();
        let received: usize = (0..3)
            .filter(|&x| x != d)
            .map(|x| block(x, d).len() * 8)
            .sum();
        assert_eq!((bytes.sent, bytes.received), (sent as u64, received as u64));
        assert_eq!((sizes.sent, sizes.calls), (16, 1));
    }
}

#[test]
fn all_gather_reduce_scatter_and_all_reduce() {
    let got = on_ranks(4, 2000, |comm| {
        let r = comm.rank();
        let mine: Vec<f32> = (0..r).map(|k| (10 * r + k) as f32).collect();
        let gathered = comm.all_gather_v("test.gather", &mine, None).unwrap();
        // Segment d has d + 1 values; rank r contributes r + 1 to each.
        let send = (0..4).map(|d| vec![(r + 1) as f32; d + 1]).collect();
        let summed = comm.reduce_scatter_v("test.rs", send).unwrap();
        // 0.1 added in rank order everywhere gives the same bits on every rank.
        let mut values: Vec<f32> = (0..7).map(|i| 0.1 * (i + r) as f32).collect();
        comm.all_reduce_sum("test.ar", &mut values).unwrap();
        (gathered, summed, values)
    });
    for (r, (gathered, summed, values)) in got.iter().enumerate() {
        for (s, g) in gathered.iter().enumerate() {
            let want: Vec<f32> = (0..s).map(|k| (10 * s + k) as f32).collect();
            assert_eq!(g, &want, "rank {r} gathered from {s}");
        }
        assert_eq!(summed, &vec![10.0f32; r + 1], "rank {r}: 1 + 2 + 3 + 4");
        let want: Vec<f32> = (0..7)
            .map(|i| (0..4).fold(0.0f32, |acc, q| acc + 0.1 * (i + q) as f32))
            .collect();
        assert_eq!(values, &want, "rank {r}");
        assert_eq!(values, &got[0].2, "rank {r}: the same bits as rank 0");
    }
}

#[test]
fn split_makes_host_groups() {
    let got = on_ranks(4, 2000, |comm| {
        let r = comm.rank();
        let intra = comm.split(r / 2).unwrap();
        let cross = comm.split(r % 2).unwrap();
        let hosts = cross.all_gather_v("test.cross", &[r as u32], None).unwrap();
        (intra.rank(), intra.size(), cross.rank(), hosts.concat())
    });
    assert_eq!(got[0], (0, 2, 0, vec![0, 2]));
    assert_eq!(got[1], (1, 2, 0, vec![1, 3]));
    assert_eq!(got[2], (0, 2, 1, vec![0, 2]));
    assert_eq!(got[3], (1, 2, 1, vec![1, 3]));
}

#[test]
fn counts_that_do_not_match_are_errors() {
    // One rank: the block to itself must have the announced length.
    let one = on_ranks(1, 2000, |comm| {
        comm.all_to_all_v("test.one", vec![vec![1u32, 2]], Some(&[3]))
            .unwrap_err()
            .to_string()
    });
    assert!(
        one[0].contains("test.one") && one[0].contains("2 values to itself, 3 expected"),
        "{}",
        one[0]
    );
    // Wrong number of blocks, and an all-gather whose own count is wrong.
    let two = on_ranks(2, 2000, |comm| {
        let blocks = comm
            .all_to_all_v("test.blocks", vec![vec![1u32]], None)
            .unwrap_err()
            .to_string();
        let own = comm
            .all_gather_v("test.own", &[1u32, 2], Some(&[1, 1]))
            .unwrap_err()
            .to_string();
        (blocks, own)
    });
    for (blocks, own) in two {
        assert!(blocks.contains("needs 2 blocks and counts"), "{blocks}");
        assert!(own.contains("needs 2 counts, this rank's its own"), "{own}");
    }
    // Counts that disagree between ranks: the receiver expected more than was sent.
    let disagree = on_ranks(2, 1000, |comm| {
        let r = comm.rank();
        let send = vec![vec![r as u32; 1], vec![r as u32; 1]];
        let counts = if r == 0 { vec![1, 2] } else { vec![1, 1] };
        comm.all_to_all_v("test.disagree", send, Some(&counts))
            .map_err(|e| e.to_string())
    });
    let e = disagree[0].as_ref().unwrap_err();
    assert!(e.contains("test.disagree #1"), "{e}");
    // Counts past any memory are an error on the rank given them (an overflow or an abort).
    let huge = on_ranks(2, 1000, |comm| {
        let a2a = comm
            .all_to_all_v(
                "test.huge",
                vec![vec![1u32], vec![1u32]],
                Some(&[1, usize::MAX]),
            )
            .unwrap_err()
            .to_string();
        let gather = comm
            .all_gather_v("test.huge", &[1u32], Some(&[1, 1 << 62]))
            .map_err(|e| e.to_string());
        (a2a, gather)
    });
    for (r, (a2a, gather)) in huge.into_iter().enumerate() {
        assert!(
            a2a.contains("test.huge") && a2a.contains("past any memory"),
            "{a2a}"
        );
        // Rank 1's own count is 1, not 2^62: refused as not its own; rank 0 is refused the
        // 2^62 values of 4 bytes.
        let e = gather.unwrap_err();
        let says = ["past any memory", "this rank's its own"][r];
        assert!(e.contains(says), "rank {r}: {e}");
    }
}

#[test]
fn a_rank_that_never_joins_ends_the_others_at_the_deadline() {
    let got = on_ranks(3, 500, |comm| {
        let start = Instant::now();
        if comm.rank() == 2 {
            // Stalls, holding its communicator, past the others' deadline.
            std::thread::sleep(Duration::from_millis(1500));
            return (Ok(()), start.elapsed());
        }
        let out = comm
            .all_gather_v("test.missing", &[1u8], Some(&[1, 1, 1]))
            .map(|_| ())
            .map_err(|e| e.to_string());
        (out, start.elapsed())
    });
    for (r, (out, took)) in got.iter().enumerate().take(2) {
        let e = out.as_ref().unwrap_err();
        assert!(
            e.contains(&format!(
                "rank {r}: test.missing #1 exceeded 0.5 s waiting for rank(s) ["
            )),
            "{e}"
        );
        // The stalled rank is named (a rank that gave up first has withdrawn: named too).
        assert!(e.contains("2]"), "names the missing rank: {e}");
        assert!(*took < Duration::from_millis(500 + 2000), "{took:?}");
    }
}

#[test]
fn kjt_all_to_all_matches_torchrecs_docstring_example() {
    for result in on_ranks(2, 2000, |comm| kjt_docstring::check(&comm)) {
        result.unwrap();
    }
}

/// Splits whose sum wraps a usize to the key count are refused on every rank (they indexed
/// past the keys).
#[test]
fn kjt_all_to_all_refuses_splits_past_a_usize() {
    let errors = on_ranks(2, 2000, |comm| {
        let kjt = embers::sparse::KeyedJaggedTensor::from_lengths(
            vec!["a".into()],
            embers::Tensor::from_vec(vec![1i64, 2], &[2]).unwrap(),
            embers::Tensor::from_vec(vec![1i64, 1], &[2]).unwrap(),
            None,
            None,
        )
        .unwrap();
        embers::distributed::kjt_all_to_all(&comm, &kjt, &[usize::MAX, 2])
            .unwrap_err()
            .to_string()
    });
    for e in errors {
        assert!(e.contains("must give each of the 2 ranks its keys"), "{e}");
    }
}

/// Ranks passing their keys in another order, or other splits, are refused on every rank (key
/// names never travel: rank 0 received rank 1's `b` ids as its `a`); a KJT whose lengths and
/// offsets disagree (built unchecked) is refused on its rank and named on the others (the
/// receivers' checks failed on some ranks only).
#[test]
fn kjt_all_to_all_refuses_ranks_that_disagree() {
    use embers::sparse::KeyedJaggedTensor;
    use embers::Tensor;
    let kjt = |keys: [&str; 2]| {
        KeyedJaggedTensor::from_lengths(
            keys.iter().map(|k| k.to_string()).collect(),
            Tensor::from_vec(vec![1i64, 2], &[2]).unwrap(),
            Tensor::from_vec(vec![1i64, 1], &[2]).unwrap(),
            None,
            None,
        )
        .unwrap()
    };
    for splits_of_1 in [[1usize, 1], [2, 0]] {
        let errors = on_ranks(2, 2000, |comm| {
            let (keys, splits) = if comm.rank() == 0 {
                (["a", "b"], [1, 1])
            } else if splits_of_1 == [1, 1] {
                (["b", "a"], splits_of_1)
            } else {
                (["a", "b"], splits_of_1)
            };
            embers::distributed::kjt_all_to_all(&comm, &kjt(keys), &splits)
                .unwrap_err()
                .to_string()
        });
        for e in errors {
            assert!(e.contains("rank(s) [1] pass other keys or splits"), "{e}");
        }
    }
    let errors = on_ranks(2, 2000, |comm| {
        let k = if comm.rank() == 1 {
            KeyedJaggedTensor::from_lengths_unchecked(
                vec!["a".into(), "b".into()],
                Tensor::from_vec(vec![1i64, 2], &[2]).unwrap(),
                Tensor::from_vec(vec![1i64, 1], &[2]).unwrap(),
                Some(Tensor::from_vec(vec![0i64, 5, 2], &[3]).unwrap()),
                None,
                1,
                None,
            )
            .unwrap()
        } else {
            kjt(["a", "b"])
        };
        embers::distributed::kjt_all_to_all(&comm, &k, &[1, 1])
            .unwrap_err()
            .to_string()
    });
    assert!(errors[0].contains("rank(s) [1] rejected"), "{}", errors[0]);
    assert!(errors[1].contains("lengths, 3 offsets"), "{}", errors[1]);
}

/// Ranks summing different numbers of values (dense halves of different shapes) all stop at
/// the op's first call, naming the lengths (the ranks' messages mismatched: MPI aborted on a
/// truncated message, or a tail stayed unsummed); a length one rank changes later is an error
/// there.
#[test]
fn all_reduce_sum_refuses_ranks_with_other_lengths() {
    let errors = on_ranks(2, 2000, |comm| {
        let mut v = vec![1.0f32; 5 + comm.rank()];
        comm.all_reduce_sum("test.sum", &mut v)
            .unwrap_err()
            .to_string()
    });
    for e in errors {
        assert!(e.contains("different numbers of values [5, 6]"), "{e}");
    }
    let results = on_ranks(2, 2000, |comm| {
        let mut v = vec![1.0f32; 4];
        comm.all_reduce_sum("test.sum", &mut v).unwrap();
        assert_eq!(v, vec![2.0; 4]);
        comm.all_reduce_sum("test.sum", &mut v).unwrap();
        assert_eq!(v, vec![4.0; 4]);
        let mut w = vec![1.0f32; 3];
        comm.all_reduce_sum("test.sum", &mut w)
            .unwrap_err()
            .to_string()
    });
    for e in results {
        assert!(
            e.contains("3 values to sum, where every rank agreed on 4"),
            "{e}"
        );
    }
}
