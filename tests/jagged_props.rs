//! Property tests: dense↔jagged round trips, permute∘inverse = identity, split∘concat =
//! identity, and block bucketization routes every id to exactly one bucket.

use embers::sparse::ops::*;
use embers::sparse::KeyedJaggedTensor;
use embers::Tensor;
use proptest::prelude::*;

fn offsets_of(lengths: &[i64]) -> Vec<i64> {
    std::iter::once(0)
        .chain(lengths.iter().scan(0, |a, &l| {
            *a += l;
            Some(*a)
        }))
        .collect()
}

fn i64t(v: Vec<i64>) -> Tensor {
    let n = v.len();
    Tensor::from_vec(v, &[n]).unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn dense_jagged_dense_round_trip(lengths in prop::collection::vec(0i64..6, 1..8), dim in 1usize..4) {
        let offsets = offsets_of(&lengths);
        let rows = *offsets.last().unwrap() as usize;
        let values: Vec<f32> = (0..rows * dim).map(|i| i as f32 * 0.5 - 3.0).collect();
        let values_t = Tensor::from_vec(values.clone(), &[rows, dim]).unwrap();
        let offsets_t = i64t(offsets.clone());
        let max = *lengths.iter().max().unwrap() as usize;
        let dense = jagged_to_padded_dense(&values_t, &[&offsets_t], &[max], -7.0).unwrap();
        let back = dense_to_jagged(&dense, &[&offsets_t], None).unwrap();
        prop_assert_eq!(back.to_vec::<f32>().unwrap(), values);
        // And dense → jagged → dense restores the dense tensor at jagged positions, padding elsewhere.
        let again = jagged_to_padded_dense(&back, &[&offsets_t], &[max], -7.0).unwrap();
        prop_assert_eq!(again.to_vec::<f32>().unwrap(), dense.to_vec::<f32>().unwrap());
        let padded = dense.to_vec::<f32>().unwrap();
        for (b, &len) in lengths.iter().enumerate() {
            for p in len as usize..max {
                prop_assert!(padded[(b * max + p) * dim..(b * max + p + 1) * dim].iter().all(|&x| x == -7.0));
            }
        }
    }

    #[test]
    fn permute_then_inverse_is_identity(
        (num_keys, stride, lengths, order) in (1usize..6, 1usize..5).prop_flat_map(|(k, s)| (
            Just(k), Just(s), prop::collection::vec(0i64..4, k * s), Just((0..k).collect::<Vec<_>>()).prop_shuffle()
        ))
    ) {
        let total: i64 = lengths.iter().sum();
        let keys: Vec<String> = (0..num_keys).map(|k| format!("f{k}")).collect();
        let values = i64t((0..total).collect());
        let weights = Tensor::from_vec((0..total).map(|x| x as f32 * 0.25).collect::<Vec<_>>(), &[total as usize]).unwrap();
        let kjt = KeyedJaggedTensor::from_lengths(keys, values, i64t(lengths), Some(weights), Some(stride)).unwrap();
        let mut inverse = vec![0; num_keys];
        for (i, &k) in order.iter().enumerate() {
            inverse[k] = i;
        }
        let back = kjt.permute(&order).unwrap().permute(&inverse).unwrap();
        prop_assert_eq!(back.keys(), kjt.keys());
        prop_assert_eq!(back.values().to_vec::<i64>().unwrap(), kjt.values().to_vec::<i64>().unwrap());
        prop_assert_eq!(back.lengths().to_vec::<i64>().unwrap(), kjt.lengths().to_vec::<i64>().unwrap());
        prop_assert_eq!(back.weights().unwrap().to_vec::<f32>().unwrap(), kjt.weights().unwrap().to_vec::<f32>().unwrap());
        prop_assert_eq!(back.offset_per_key(), kjt.offset_per_key());
    }

    #[test]
    fn split_then_concat_is_identity(
        (strides, lengths_seed, cuts) in (prop::collection::vec(0usize..4, 1..6), any::<u64>(), prop::collection::vec(any::<bool>(), 6))
    ) {
        // Variable batch per key (one rank); lengths from a seed.
        let num_keys = strides.len();
        let bags: usize = strides.iter().sum();
        let lengths: Vec<i64> = (0..bags as u64).map(|i| ((i ^ lengths_seed).wrapping_mul(0x9E37_79B9) >> 7) as i64 % 4).collect();
        let total: i64 = lengths.iter().sum();
        let keys: Vec<String> = (0..num_keys).map(|k| format!("f{k}")).collect();
        let per_rank = strides.iter().map(|&s| vec![s]).collect();
        let kjt = KeyedJaggedTensor::from_lengths_variable_batch(keys, i64t((0..total).collect()), i64t(lengths), None, per_rank).unwrap();
        // Segments: cut after key k where cuts[k] is set (empty segments allowed at the ends).
        let mut segments = vec![0];
        for &cut in cuts.iter().take(num_keys) {
            *segments.last_mut().unwrap() += 1;
            if cut {
                segments.push(0);
            }
        }
        let parts = kjt.split(&segments).unwrap();
        prop_assert_eq!(parts.len(), segments.len());
        let back = KeyedJaggedTensor::concat(&parts).unwrap();
        prop_assert_eq!(back.keys(), kjt.keys());
        prop_assert_eq!(back.values().to_vec::<i64>().unwrap(), kjt.values().to_vec::<i64>().unwrap());
        prop_assert_eq!(back.lengths().to_vec::<i64>().unwrap(), kjt.lengths().to_vec::<i64>().unwrap());
        prop_assert_eq!(back.stride_per_key(), kjt.stride_per_key());
    }

    #[test]
    fn bucketize_routes_every_id_exactly_once(
        (num_features, batch, my_size, lengths, ids, block) in (1usize..4, 1usize..5, 1usize..5).prop_flat_map(|(t, b, s)| (
            Just(t), Just(b), Just(s), prop::collection::vec(0i64..5, t * b), prop::collection::vec(0i64..60, 60), 1i64..8
        ))
    ) {
        let total = lengths.iter().sum::<i64>() as usize;
        let ids: Vec<i64> = ids.into_iter().cycle().take(total).collect();
        let options = BlockBucketizeOptions { sequence: true, bucketize_pos: true, ..Default::default() };
        let block_sizes = i64t(vec![block; num_features]);
        let out = block_bucketize_sparse_features(&i64t(lengths.clone()), &i64t(ids.clone()), &block_sizes, my_size, &options).unwrap();
        let new_lengths = out.lengths.to_vec::<i64>().unwrap();
        prop_assert_eq!(new_lengths.len(), my_size * num_features * batch);
        prop_assert_eq!(new_lengths.iter().sum::<i64>() as usize, total);
        // The permutation hits every output slot exactly once ...
        let perm = out.unbucketize_permute.unwrap().to_vec::<i64>().unwrap();
        let mut seen = vec![false; total];
        for &p in &perm {
            prop_assert!(!seen[p as usize]);
            seen[p as usize] = true;
        }
        // ... and each id sits in the bucket the block rule gives, rebased as the rule says.
        let new_ids = out.indices.to_vec::<i64>().unwrap();
        let offsets = offsets_of(&new_lengths);
        let bags = num_features * batch;
        let orig_offsets = offsets_of(&lengths);
        for bag in 0..bags {
            for i in orig_offsets[bag]..orig_offsets[bag + 1] {
                let id = ids[i as usize];
                let (bucket, rebased) = if id < block * my_size as i64 { (id / block, id % block) } else { (id % my_size as i64, id / my_size as i64) };
                let slot = perm[i as usize];
                let (start, end) = (offsets[bucket as usize * bags + bag], offsets[bucket as usize * bags + bag + 1]);
                prop_assert!(slot >= start && slot < end, "id {} of bag {} not in bucket {}", id, bag, bucket);
                prop_assert_eq!(new_ids[slot as usize], rebased);
            }
        }
    }
}
