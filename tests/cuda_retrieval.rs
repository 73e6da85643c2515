//! Exact search on a CUDA device against the CPU's: the same ids (ties to the smaller id) and
//! scores, across several query blocks and base chunks (the chunk merge), both metrics, massive
//! ties, `k` from 1 to the whole index, refreshes after add/remove, and the GPU's `k` limit.
//! Runs on GPU 0 when the machine has one, else on the host emulation (CI).

use embers::retrieval::{FlatIndex, GpuBlocks, Metric, MAX_GPU_K};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rand_distr::StandardNormal;

#[path = "support/cuda_device.rs"]
mod cuda_device;
use cuda_device::device;

fn gaussian(n: usize, dim: usize, seed: u64) -> Vec<f32> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..n * dim)
        .map(|_| rng.sample::<f32, _>(StandardNormal))
        .collect()
}

/// Small integers (-2..=2): every product is exact on any device, and scores tie massively.
fn small_integers(n: usize, dim: usize, seed: u64) -> Vec<f32> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..n * dim)
        .map(|_| rng.random_range(-2i32..=2) as f32)
        .collect()
}

/// GPU and CPU answers agree: ids exactly, scores within `tol` relative (products are summed in
/// another order on the GPU).
fn assert_same(
    gpu: &embers::retrieval::Neighbors,
    cpu: &embers::retrieval::Neighbors,
    tol: f32,
    what: &str,
) {
    assert_eq!(gpu.k, cpu.k, "{what}: k");
    assert_eq!(gpu.num_queries(), cpu.num_queries(), "{what}: queries");
    for q in 0..cpu.num_queries() {
        assert_eq!(gpu.ids_of(q), cpu.ids_of(q), "{what}: query {q}'s ids");
        for (g, c) in gpu.scores_of(q).iter().zip(cpu.scores_of(q)) {
            assert!(
                (g - c).abs() <= tol * c.abs().max(1.0),
                "{what}: query {q}: GPU score {g} vs CPU {c}"
            );
        }
    }
}

/// Blocks small enough that the test crosses query blocks and base chunks.
const SMALL: GpuBlocks = GpuBlocks {
    queries: 16,
    chunk: 256,
};

#[test]
fn gpu_exact_search_equals_the_cpu() {
    let Some(dev) = device() else { return };
    let (dim, nb, nq) = (8, 700, 24);
    let base = gaussian(nb, dim, 1);
    let queries = gaussian(nq, dim, 2);
    let ids: Vec<i64> = (0..nb as i64).map(|i| i * 3 + 1).collect();
    for metric in [Metric::InnerProduct, Metric::L2] {
        let mut cpu = FlatIndex::new(dim, metric).unwrap();
        cpu.add(&ids, &base).unwrap();
        let mut gpu = cpu.clone().to_device(dev).unwrap();
        assert_eq!(gpu.device(), dev);
        gpu.set_gpu_blocks(SMALL).unwrap();
        for k in [1, 100] {
            let what = format!("{metric:?} k {k}");
            assert_same(
                &gpu.search(&queries, k).unwrap(),
                &cpu.search(&queries, k).unwrap(),
                1e-5,
                &what,
            );
        }
        // Chunks of 700 columns: the kernel's sampled bound (its first 256 columns) is taken.
        gpu.set_gpu_blocks(GpuBlocks {
            queries: 16,
            chunk: 700,
        })
        .unwrap();
        assert_same(
            &gpu.search(&queries, 10).unwrap(),
            &cpu.search(&queries, 10).unwrap(),
            1e-5,
            &format!("{metric:?} sampled bound, k 10"),
        );
        // One chunk holding everything (k = the whole index) and the default blocks.
        let all = gpu.search(&queries[..2 * dim], nb).unwrap();
        assert_same(
            &all,
            &cpu.search(&queries[..2 * dim], nb).unwrap(),
            1e-5,
            "whole index",
        );
        gpu.set_gpu_blocks(GpuBlocks::default()).unwrap();
        assert_same(
            &gpu.search(&queries, 10).unwrap(),
            &cpu.search(&queries, 10).unwrap(),
            1e-5,
            "default blocks",
        );
    }
}

#[test]
fn gpu_ties_keep_the_smaller_ids_as_the_cpu_does() {
    let Some(dev) = device() else { return };
    let (dim, nb, nq) = (4, 600, 12);
    let base = small_integers(nb, dim, 3);
    let queries = small_integers(nq, dim, 4);
    // Ids out of order so that "smaller id" is not "earlier row".
    let ids: Vec<i64> = (0..nb as i64).map(|i| (i * 389) % 1201).collect();
    for metric in [Metric::InnerProduct, Metric::L2] {
        let mut cpu = FlatIndex::new(dim, metric).unwrap();
        cpu.add(&ids, &base).unwrap();
        let mut gpu = cpu.clone().to_device(dev).unwrap();
        gpu.set_gpu_blocks(SMALL).unwrap();
        for k in [1, 7, 50, 300] {
            let got = gpu.search(&queries, k).unwrap();
            let want = cpu.search(&queries, k).unwrap();
            // Exact products: scores equal too.
            assert_same(&got, &want, 0.0, &format!("{metric:?} ties k {k}"));
        }
    }
}

#[test]
fn gpu_search_follows_add_and_remove() {
    let Some(dev) = device() else { return };
    let (dim, nb) = (8, 400);
    let base = gaussian(nb, dim, 5);
    let queries = gaussian(6, dim, 6);
    let ids: Vec<i64> = (0..nb as i64).collect();
    let mut gpu = FlatIndex::new(dim, Metric::L2)
        .unwrap()
        .to_device(dev)
        .unwrap();
    gpu.set_gpu_blocks(SMALL).unwrap();
    let mut cpu = FlatIndex::new(dim, Metric::L2).unwrap();
    let empty = gpu.search(&queries, 1).unwrap_err().to_string();
    assert!(empty.contains("empty"), "{empty}");
    for index in [&mut gpu, &mut cpu] {
        index.add(&ids[..200], &base[..200 * dim]).unwrap();
    }
    assert_same(
        &gpu.search(&queries, 5).unwrap(),
        &cpu.search(&queries, 5).unwrap(),
        1e-5,
        "first half",
    );
    for index in [&mut gpu, &mut cpu] {
        index.add(&ids[200..], &base[200 * dim..]).unwrap();
    }
    let before = gpu.search(&queries, 5).unwrap();
    assert_same(
        &before,
        &cpu.search(&queries, 5).unwrap(),
        1e-5,
        "after add",
    );
    let found = before.ids.clone();
    assert_eq!(gpu.remove(&found), cpu.remove(&found));
    let after = gpu.search(&queries, 5).unwrap();
    assert!(
        after.ids.iter().all(|id| !found.contains(id)),
        "removed ids found"
    );
    assert_same(
        &after,
        &cpu.search(&queries, 5).unwrap(),
        1e-5,
        "after remove",
    );
}

#[test]
fn gpu_k_limit_is_a_named_error() {
    let Some(dev) = device() else { return };
    let dim = 2;
    let nb = MAX_GPU_K + 1;
    let mut gpu = FlatIndex::new(dim, Metric::InnerProduct)
        .unwrap()
        .to_device(dev)
        .unwrap();
    let ids: Vec<i64> = (0..nb as i64).collect();
    gpu.add(&ids, &gaussian(nb, dim, 7)).unwrap();
    let err = gpu
        .search(&[1.0, 0.0], MAX_GPU_K + 1)
        .unwrap_err()
        .to_string();
    assert!(err.contains("k = 1025") && err.contains("1024"), "{err}");
}

/// A small TwoTower (one table and a 2-layer MLP per tower), normalised, temperature 0.5.
fn two_tower() -> embers::models::two_tower::TwoTower {
    use embers::embedding::{EmbeddingBagCollection, EmbeddingBagConfig, FusedOptimizer};
    use embers::models::two_tower::{Tower, TwoTower};
    use embers::nn::{Activation, Mlp};
    let mut init = embers::tensor::rng::seeded(21);
    let mut tower = |name: &str, rows: usize| {
        let tables = EmbeddingBagCollection::new(
            vec![EmbeddingBagConfig::new(
                format!("t_{name}"),
                rows,
                8,
                &[name],
            )],
            FusedOptimizer::RowWiseAdagrad { lr: 0.1, eps: 1e-8 },
            &mut init,
        )
        .unwrap();
        let mlp = Mlp::new(8, &[16, 8], Activation::Relu, &mut init).unwrap();
        Tower::new(tables, mlp).unwrap()
    };
    let (q, c) = (tower("user", 30), tower("item", 60));
    TwoTower::new(q, c, true, 0.5).unwrap()
}

fn one_hot(key: &str, ids: Vec<i64>) -> embers::sparse::KeyedJaggedTensor {
    embers::sparse::KeyedJaggedTensor::one_hot(key, &ids).unwrap()
}

#[test]
fn two_tower_trains_and_retrieves_on_the_gpu_as_on_the_cpu() {
    use embers::models::two_tower::FrequencyEstimator;
    use embers::optim::{Adam, AdamConfig, Optimizer};
    let Some(dev) = device() else { return };
    let (cpu, gpu) = (two_tower(), two_tower());
    gpu.to_device(dev).unwrap();
    let adam = |m: &embers::models::two_tower::TwoTower| {
        let config = AdamConfig {
            lr: 0.01,
            ..Default::default()
        };
        Adam::new(m.dense_parameters(), config).unwrap()
    };
    let (mut opt_cpu, mut opt_gpu) = (adam(&cpu), adam(&gpu));
    let mut freq = FrequencyEstimator::new(256, 0.05).unwrap();
    let mut rng = ChaCha8Rng::seed_from_u64(22);
    for step in 0..4 {
        let users: Vec<i64> = (0..24).map(|_| rng.random_range(0..30)).collect();
        let items: Vec<i64> = (0..24).map(|_| rng.random_range(0..60)).collect();
        freq.update(&items);
        let log_q = freq.log_q(&items).unwrap();
        let mut losses = Vec::new();
        for (model, opt, on) in [
            (&cpu, &mut opt_cpu, embers::Device::Cpu),
            (&gpu, &mut opt_gpu, dev),
        ] {
            let qe = model
                .embed_queries(&one_hot("user", users.clone()))
                .unwrap();
            let ce = model
                .embed_candidates(&one_hot("item", items.clone()))
                .unwrap();
            assert_eq!(qe.device(), on);
            let loss = model.in_batch_loss(&qe, &ce, Some(&log_q)).unwrap();
            losses.push(loss.to_vec::<f32>().unwrap()[0]);
            loss.backward().unwrap();
            opt.step().unwrap();
            opt.zero_grad();
        }
        assert!(
            (losses[0] - losses[1]).abs() <= 1e-5 * losses[0].abs().max(1.0),
            "step {step}: CPU loss {} vs GPU {}",
            losses[0],
            losses[1]
        );
    }
    for (t, (c, g)) in ["t_user", "t_item"].iter().zip([
        (&cpu.query.tables, &gpu.query.tables),
        (&cpu.candidate.tables, &gpu.candidate.tables),
    ]) {
        let (c, g) = (c.table_weights(t).unwrap(), g.table_weights(t).unwrap());
        for (i, (a, b)) in g.iter().zip(&c).enumerate() {
            assert!((a - b).abs() <= 1e-5, "{t}[{i}]: GPU {a} vs CPU {b}");
        }
    }
    // Retrieval through the model's call: the GPU index over the GPU model's catalogue gives
    // the CPU's answer (scores are cosines here, so a tolerance of 1e-4 covers both paths).
    let catalogue = one_hot("item", (0..60).collect());
    let ids: Vec<i64> = (0..60).collect();
    let mut cpu_index = FlatIndex::new(8, Metric::InnerProduct).unwrap();
    cpu_index
        .add(&ids, &cpu.embed_catalogue(&catalogue).unwrap())
        .unwrap();
    let mut gpu_index = FlatIndex::new(8, Metric::InnerProduct).unwrap();
    gpu_index
        .add(&ids, &gpu.embed_catalogue(&catalogue).unwrap())
        .unwrap();
    let gpu_index = gpu_index.to_device(dev).unwrap();
    let users = one_hot("user", (0..30).collect());
    let want = cpu.retrieve(&users, &cpu_index, 5).unwrap();
    let got = gpu.retrieve(&users, &gpu_index, 5).unwrap();
    for q in 0..30 {
        for (g, c) in got.scores_of(q).iter().zip(want.scores_of(q)) {
            assert!((g - c).abs() <= 1e-4, "user {q}: GPU {g} vs CPU {c}");
        }
    }
    let agree = (0..30 * 5).filter(|&i| got.ids[i] == want.ids[i]).count();
    assert!(
        agree >= 30 * 5 - 3,
        "only {agree} of 150 retrieved ids agree"
    );
}

#[test]
fn gpu_selection_falls_back_to_the_row_when_the_kth_bin_overflows_shared_memory() {
    // 4000 vectors of 0s and 1s in 2 dimensions, 81% of them (1, 1): for every query the most
    // common score is shared by ~3240 vectors (all 4000 for the zero query), more than the
    // kernel's shared candidate buffer holds (3072), and k = 5 and k = 1000 both fall in it:
    // the sampled bound and the top bin both overflow, and the selection reads the row.
    let Some(dev) = device() else { return };
    let (dim, nb) = (2, 4000);
    let mut rng = ChaCha8Rng::seed_from_u64(8);
    let base: Vec<f32> = (0..nb * dim)
        .map(|_| f32::from(u8::from(rng.random::<f32>() < 0.9)))
        .collect();
    let queries = [1.0, 1.0, 2.0, 3.0, 0.0, 0.0];
    let ids: Vec<i64> = (0..nb as i64).map(|i| (i * 1009) % 4001).collect();
    for metric in [Metric::InnerProduct, Metric::L2] {
        let mut cpu = FlatIndex::new(dim, metric).unwrap();
        cpu.add(&ids, &base).unwrap();
        let mut gpu = cpu.clone().to_device(dev).unwrap();
        gpu.set_gpu_blocks(GpuBlocks {
            queries: 2,
            chunk: 4096,
        })
        .unwrap();
        for k in [5, 1000] {
            assert_same(
                &gpu.search(&queries, k).unwrap(),
                &cpu.search(&queries, k).unwrap(),
                0.0,
                &format!("{metric:?} overflowing bin, k {k}"),
            );
        }
    }
}
