//! Tables in a file behind a DRAM cache (`TableBatchedEmbedding::new_cached`): training through
//! the cache is bit-identical to the uncached TBE for every fused optimizer, cache size and
//! prefetch setting; hit and miss counts equal an independent simulation of the policy; rows
//! locked by in-flight batches are never evicted and overflow is served by direct reads; the
//! stale-copy race of a prefetch pipeline is handled; checkpoints survive kill -9.

#[path = "support/cache_trace.rs"]
mod cache_trace;
#[path = "support/cuda_device.rs"]
mod cuda_device;
#[path = "support/kill.rs"]
mod kill;

use cache_trace::{assert_counts_match, batches, simulate_step, simulations, temp_dir, Step};

use std::path::{Path, PathBuf};

use embers::embedding::{
    CacheConfig, CachePolicy, CacheSize, EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingInit,
    FusedOptimizer, Placement, PoolingMode, TableBatchedEmbedding, TableSpec, TbeConfig, TbeInput,
    WeightDecay,
};
use embers::tensor::rng::seeded;
use embers::{Device, Result, Tensor};

fn optimizers() -> Vec<FusedOptimizer> {
    let (lr, eps, beta1, beta2) = (0.05, 1e-3, 0.9, 0.99);
    vec![
        FusedOptimizer::None,
        FusedOptimizer::Sgd { lr },
        FusedOptimizer::Adagrad { lr, eps },
        FusedOptimizer::RowWiseAdagrad { lr, eps },
        FusedOptimizer::Adam {
            lr,
            beta1,
            beta2,
            eps,
        },
        FusedOptimizer::PartialRowWiseAdam {
            lr,
            beta1,
            beta2,
            eps,
        },
        FusedOptimizer::Lamb {
            lr,
            beta1,
            beta2,
            eps,
        },
        FusedOptimizer::PartialRowWiseLamb {
            lr,
            beta1,
            beta2,
            eps,
        },
    ]
}

/// Three tables (one read by two features), dims that are and are not multiples of 4.
fn config(optimizer: FusedOptimizer, pooling: PoolingMode, decay: WeightDecay) -> TbeConfig {
    let tables = vec![
        TableSpec::new("big", 700, 8),
        TableSpec::new("odd", 150, 3),
        TableSpec::new("small", 20, 16),
    ];
    let mut cfg = TbeConfig::new(tables, vec![0, 1, 1, 2], pooling, optimizer);
    cfg.weight_decay = decay;
    cfg
}

/// Every table's weights and optimizer state, as bits, and the step count.
fn state_bits(tbe: &TableBatchedEmbedding) -> Result<(Vec<u32>, u64)> {
    let mut bits = Vec::new();
    for t in 0..tbe.num_tables() {
        bits.extend(tbe.table_weights(t)?.iter().map(|x| x.to_bits()));
        for i in 0..tbe.optimizer_state_names().len() {
            bits.extend(tbe.optimizer_state(i, t)?.iter().map(|x| x.to_bits()));
        }
    }
    Ok((bits, tbe.step()))
}

/// Trains on `steps` (prepare, lookup, optionally prefetch the next batch, backward) and
/// returns the bits of every output and every sparse gradient.
fn train(tbe: &TableBatchedEmbedding, steps: &[Step], prefetch: bool) -> Result<Vec<u32>> {
    let when = match prefetch {
        true => Prefetch::AfterLookup,
        false => Prefetch::Never,
    };
    train_prefetching(tbe, steps, when)
}

/// When [`train_prefetching`] prefetches batch `i + 1`.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Prefetch {
    Never,
    /// After batch `i`'s lookup, before its backward.
    AfterLookup,
    /// After batch `i`'s backward is queued, while the batch is alive (a GPU cache's
    /// prefetch stream then admits beside the backward).
    AfterBackward,
    /// After batch `i`'s backward is queued and the batch dropped (as a training step drops
    /// its graph before `Trainer::train_step_then`'s closure prefetches).
    AfterDroppingTheBatch,
}

/// Trains `tbe` on `steps`, prefetching each batch's successor as `when` says; the outputs,
/// per-sample weight gradients and sparse gradients seen, as bits.
fn train_prefetching(
    tbe: &TableBatchedEmbedding,
    steps: &[Step],
    when: Prefetch,
) -> Result<Vec<u32>> {
    let mut seen = Vec::new();
    // The next batch's rows, brought in and locked until that batch has been admitted.
    let prefetch = |i: usize| -> Result<()> {
        match steps.get(i + 1) {
            Some(next) => tbe.prefetch(next.input()),
            None => Ok(()),
        }
    };
    for (i, step) in steps.iter().enumerate() {
        let batch = tbe.prepare(step.input())?;
        let out = tbe.lookup_batch(&batch)?;
        if when == Prefetch::AfterLookup {
            prefetch(i)?;
        }
        let values = out.to_vec::<f32>()?;
        seen.extend(values.iter().map(|x| x.to_bits()));
        let grad: Vec<f32> = (values.iter().enumerate())
            .map(|(k, &x)| 0.5 * x + 0.01 * (k % 7) as f32 - 0.02)
            .collect();
        let grad = Tensor::from_vec(grad, out.shape())?;
        let grads = tbe.backward_batch(&batch, &grad)?;
        match when {
            Prefetch::AfterBackward => prefetch(i)?,
            Prefetch::AfterDroppingTheBatch => {
                drop(batch);
                prefetch(i)?;
            }
            Prefetch::Never | Prefetch::AfterLookup => {}
        }
        if let Some(g) = grads.per_sample_weights {
            seen.extend(g.to_vec::<f32>()?.iter().map(|x| x.to_bits()));
        }
        for g in grads.sparse.unwrap_or_default() {
            seen.extend(g.rows.iter().map(|&r| r as u32));
            seen.extend(g.values.to_vec::<f32>()?.iter().map(|x| x.to_bits()));
        }
    }
    Ok(seen)
}

fn cached(cfg: &TbeConfig, dir: &Path, name: &str, size: CacheSize) -> TableBatchedEmbedding {
    cached_on(cfg, dir, name, size, Device::Cpu)
}

/// A TBE whose rows live in `dir/name` behind a cache of `size` in the memory of `device`.
fn cached_on(
    cfg: &TbeConfig,
    dir: &Path,
    name: &str,
    size: CacheSize,
    device: Device,
) -> TableBatchedEmbedding {
    let cache = CacheConfig::new(dir.join(name), size);
    TableBatchedEmbedding::new_cached_on(cfg.clone(), cache, device).unwrap()
}

#[test]
fn training_through_the_cache_is_bit_identical_for_every_optimizer_size_and_prefetch() -> Result<()>
{
    // 1 set per table, a tenth, half, and every row.
    training_is_bit_identical(Device::Cpu, &[1e-9, 0.1, 0.5, 1.0], "identical", true)
}

#[test]
fn gpu_training_through_an_hbm_cache_is_bit_identical_for_every_optimizer_size_and_prefetch(
) -> Result<()> {
    let Some(device) = cuda_device::device() else {
        return Ok(());
    };
    // Compared with the same tables all in the GPU's memory. On the host emulation (slow: the
    // CPU test above covers the cache logic for every combination) the optimizers take the
    // size and prefetch combinations in turn, each combination at least once.
    let every = embers::cuda::emulated_devices() == 0;
    training_is_bit_identical(device, &[1e-9, 0.1, 1.0], "gpu-identical", every)
}

/// Training through caches of `sizes` (load factors) in `device`'s memory, with and without
/// prefetching, against the uncached TBE on `device`, for every fused optimizer: each
/// optimizer with every size and prefetch (`every`), or with one combination each in turn.
fn training_is_bit_identical(device: Device, sizes: &[f64], name: &str, every: bool) -> Result<()> {
    let dir = temp_dir(name);
    let combinations: Vec<(CacheSize, Prefetch)> = [
        Prefetch::Never,
        Prefetch::AfterLookup,
        Prefetch::AfterBackward,
        Prefetch::AfterDroppingTheBatch,
    ]
    .into_iter()
    .flat_map(|prefetch| {
        sizes
            .iter()
            .map(move |&s| (CacheSize::LoadFactor(s), prefetch))
    })
    .collect();
    let optimizers = optimizers();
    let n = optimizers.len();
    for (k, optimizer) in optimizers.into_iter().enumerate() {
        let (pooling, decay, weighted) = match k % 3 {
            0 => (PoolingMode::Sum, WeightDecay::None, true),
            1 => (PoolingMode::Mean, WeightDecay::L2(0.01), false),
            _ => (PoolingMode::Sum, WeightDecay::Decoupled(0.02), false),
        };
        let cfg = config(optimizer, pooling, decay);
        let steps = batches(&cfg, 5, 12, 6, 1.1, weighted, 7 + k as u64);
        let reference = TableBatchedEmbedding::new(cfg.clone())?;
        reference.init_weights(EmbeddingInit::Normal { std: 0.3 }, &mut seeded(3))?;
        reference.to_device(device)?;
        let seen = train(&reference, &steps, false)?;
        let expected = state_bits(&reference)?;
        // In turn: optimizer k takes combinations k, k + n, … (every one is taken).
        let these: Vec<(CacheSize, Prefetch)> = match every {
            true => combinations.clone(),
            false => combinations.iter().copied().skip(k).step_by(n).collect(),
        };
        for (size, prefetch) in these {
            // Every other optimizer keeps its rows in host memory instead of a file (on a GPU:
            // the rows its kernels move in place).
            let tbe = match k % 2 {
                0 => cached_on(&cfg, &dir, "rows.bin", size, device),
                _ => {
                    let cache = CacheConfig::in_host_memory(size);
                    TableBatchedEmbedding::new_cached_on(cfg.clone(), cache, device)?
                }
            };
            assert_eq!(tbe.device(), device);
            tbe.init_weights(EmbeddingInit::Normal { std: 0.3 }, &mut seeded(3))?;
            let what = format!(
                "{} with {size:?}, prefetch {prefetch:?}, rows in {}",
                optimizer.name(),
                ["a file", "host memory"][k % 2]
            );
            assert!(
                train_prefetching(&tbe, &steps, prefetch)? == seen,
                "{what}: outputs differ"
            );
            assert!(state_bits(&tbe)? == expected, "{what}: tables differ");
            let stats = tbe.cache_stats().unwrap();
            if size == CacheSize::LoadFactor(1e-9) {
                assert!(stats.iter().all(|s| s.slots == 32), "{stats:?}");
                assert!(stats[0].evictions > 0, "{what}: {stats:?}");
            }
            // The same after everything is written back.
            tbe.flush()?;
            assert!(
                state_bits(&tbe)? == expected,
                "{what}: tables differ after flush"
            );
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
    Ok(())
}

/// The pipeline a training loop runs on a GPU, at a size where the prefetch stream's admission
/// really runs beside the backward (thousands of rows moved a batch, each way): batch `i + 1`
/// prefetched once batch `i`'s backward is queued, batch `i` dropped first or still alive, rows
/// in host memory (moved by the GPU in place) or in a file (staged moves), LRU and LFU. Every
/// output, and the tables and state after flushing, equal the same tables all in the GPU's
/// memory, bit for bit. On the emulation, which runs every launch to completion (the
/// bookkeeping, not the overlap), a small shape.
#[test]
fn gpu_a_prefetch_beside_the_backward_trains_bit_identically_at_size() -> Result<()> {
    let Some(device) = cuda_device::device() else {
        return Ok(());
    };
    let on_gpu = embers::cuda::emulated_devices() == 0;
    let (rows, dim, b, len, n) = match on_gpu {
        true => (200_000, 64, 2048, 20, 40),
        false => (3000, 8, 24, 6, 6),
    };
    let dir = temp_dir("gpu-prefetch-at-size");
    let tables = (0..3)
        .map(|i| TableSpec::new(format!("t{i}"), rows, dim))
        .collect();
    let optimizer = FusedOptimizer::RowWiseAdagrad {
        lr: 0.05,
        eps: 1e-3,
    };
    let cfg = TbeConfig::new(tables, vec![0, 1, 2, 2], PoolingMode::Sum, optimizer);
    let steps = batches(&cfg, n, b, len, 1.1, false, 5);
    let init = EmbeddingInit::Normal { std: 0.3 };
    let reference = TableBatchedEmbedding::new(cfg.clone())?;
    reference.init_weights(init, &mut seeded(3))?;
    reference.to_device(device)?;
    let seen = train_prefetching(&reference, &steps, Prefetch::Never)?;
    let expected = state_bits(&reference)?;
    let runs = [
        (CachePolicy::Lru, false, Prefetch::AfterDroppingTheBatch),
        (CachePolicy::Lfu, true, Prefetch::AfterDroppingTheBatch),
        (CachePolicy::Lru, true, Prefetch::AfterBackward),
    ];
    for (k, (policy, in_file, when)) in runs.into_iter().enumerate() {
        let size = CacheSize::LoadFactor(0.05);
        let cache = match in_file {
            true => CacheConfig::new(dir.join(format!("rows{k}.bin")), size),
            false => CacheConfig::in_host_memory(size),
        };
        let tbe =
            TableBatchedEmbedding::new_cached_on(cfg.clone(), cache.with_policy(policy), device)?;
        tbe.init_weights(init, &mut seeded(3))?;
        let what = format!("{policy:?}, rows in a file {in_file}, {when:?}");
        assert!(
            train_prefetching(&tbe, &steps, when)? == seen,
            "{what}: outputs differ"
        );
        let stats = tbe.cache_stats().unwrap();
        let prefetched: u64 = stats.iter().map(|s| s.prefetched).sum();
        let evictions: u64 = stats.iter().map(|s| s.evictions).sum();
        assert!(prefetched > 0 && evictions > 0, "{what}: {stats:?}");
        tbe.flush()?;
        assert!(state_bits(&tbe)? == expected, "{what}: tables differ");
    }
    std::fs::remove_dir_all(&dir).unwrap();
    Ok(())
}

#[test]
fn hit_and_miss_counts_match_a_plain_simulation_on_zipf_and_uniform_ids() -> Result<()> {
    let dir = temp_dir("counts");
    for (s, policy) in [
        (1.1, CachePolicy::Lru),
        (0.0, CachePolicy::Lru),
        (1.1, CachePolicy::Lfu),
        (0.0, CachePolicy::Lfu),
    ] {
        let tables = vec![TableSpec::new("t", 3000, 4), TableSpec::new("u", 500, 2)];
        let cfg = TbeConfig::new(
            tables,
            vec![0, 1, 0],
            PoolingMode::Sum,
            FusedOptimizer::Sgd { lr: 0.1 },
        );
        let steps = batches(&cfg, 40, 32, 8, s, false, 11);
        let cache =
            CacheConfig::new(dir.join("rows.bin"), CacheSize::LoadFactor(0.08)).with_policy(policy);
        let tbe = TableBatchedEmbedding::new_cached(cfg.clone(), cache)?;
        let mut sims = simulations(&tbe.cache_stats().unwrap(), policy == CachePolicy::Lfu);
        for (i, step) in steps.iter().enumerate() {
            drop(tbe.prepare(step.input())?);
            simulate_step(&mut sims, step, &cfg.feature_table_map, 32, i);
        }
        let stats = tbe.cache_stats().unwrap();
        assert_counts_match(&stats, &sims, steps.len(), &format!("zipf {s}, {policy:?}"));
        if s > 0.0 && policy == CachePolicy::Lru {
            // A skewed trace is what a cache is for: most distinct ids hit.
            assert!(stats[0].miss_rate() < 0.6, "{stats:?}");
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
    Ok(())
}

/// One batch of single-id bags over one feature.
fn bags(ids: std::ops::Range<i64>) -> Step {
    let ids: Vec<i64> = ids.collect();
    Step {
        offsets: (0..=ids.len() as i64).collect(),
        ids,
        weights: None,
    }
}

#[test]
fn locked_rows_survive_pressure_overflow_reads_directly_and_the_prefetch_race_is_handled(
) -> Result<()> {
    pressure_and_race(Device::Cpu, "race")
}

#[test]
fn gpu_locked_rows_survive_pressure_overflow_reads_directly_and_the_prefetch_race_is_handled(
) -> Result<()> {
    let Some(device) = cuda_device::device() else {
        return Ok(());
    };
    pressure_and_race(device, "gpu-race")
}

/// Rows locked by in-flight batches under pressure, direct reads, and the stale-copy race of
/// a prefetch, with the cache in `device`'s memory, against the uncached TBE there.
fn pressure_and_race(device: Device, name: &str) -> Result<()> {
    let dir = temp_dir(name);
    for optimizer in optimizers().into_iter().skip(1) {
        let cfg = TbeConfig::new(
            vec![TableSpec::new("t", 200, 4)],
            vec![0],
            PoolingMode::Sum,
            optimizer,
        );
        let reference = TableBatchedEmbedding::new(cfg.clone())?;
        let tbe = cached_on(&cfg, &dir, "rows.bin", CacheSize::LoadFactor(1e-9), device);
        for t in [&reference, &tbe] {
            t.init_weights(EmbeddingInit::Normal { std: 0.5 }, &mut seeded(5))?;
        }
        reference.to_device(device)?;
        let what = optimizer.name();
        let (a, b, c) = (bags(0..32), bags(16..64), bags(32..48));
        let grad = |n: usize| {
            (Tensor::from_vec(vec![0.25f32; n * 4], &[n, 4]).unwrap())
                .to_device(device)
                .unwrap()
        };
        // A fills and locks the single 32-way set; B finds 16 of its rows there and 32 more
        // that cannot be cached while A is in flight: direct reads.
        let run = |t: &TableBatchedEmbedding| -> Result<Vec<u32>> {
            let mut seen = Vec::new();
            let pa = t.prepare(a.input())?;
            let pb = t.prepare(b.input())?;
            if t.is_cached() {
                assert_eq!(t.locked_cache_slots().unwrap(), vec![32], "{what}");
                let st = &t.cache_stats().unwrap()[0];
                assert_eq!((st.unique_misses, st.conflict_misses), (64, 32), "{what}");
            }
            for p in [&pa, &pb] {
                seen.extend(
                    t.lookup_batch(p)?
                        .to_vec::<f32>()?
                        .iter()
                        .map(|x| x.to_bits()),
                );
            }
            t.backward_batch(&pa, &grad(32))?;
            drop(pa);
            // Prefetching C (B's overflow rows 32..48) while B's backward is still to come
            // caches rows whose newest values B's backward is about to write: B must write
            // them to the cache, or C reads stale rows.
            t.prefetch(c.input())?;
            if t.is_cached() {
                // B's 16 hits, and C's 16 rows (locked until C is admitted).
                assert_eq!(t.locked_cache_slots().unwrap(), vec![32], "{what}");
            }
            t.backward_batch(&pb, &grad(48))?;
            drop(pb);
            let pc = t.prepare(c.input())?;
            seen.extend(
                t.lookup_batch(&pc)?
                    .to_vec::<f32>()?
                    .iter()
                    .map(|x| x.to_bits()),
            );
            t.backward_batch(&pc, &grad(16))?;
            Ok(seen)
        };
        assert!(run(&reference)? == run(&tbe)?, "{what}: outputs differ");
        assert!(
            state_bits(&reference)? == state_bits(&tbe)?,
            "{what}: tables differ"
        );
        let st = &tbe.cache_stats().unwrap()[0];
        // C's prepare took its prefetched admission: A, B, C admitted once each.
        assert_eq!(st.calls, 3, "{what}");
        assert_eq!(st.unique_misses, 64 + 16, "{what}: {st:?}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
    Ok(())
}

#[test]
fn the_cache_reports_bad_files_and_sizes_in_words() -> Result<()> {
    let dir = temp_dir("errors");
    let cfg = config(
        FusedOptimizer::Sgd { lr: 0.1 },
        PoolingMode::Sum,
        WeightDecay::None,
    );
    // Impossible sizes: load factors outside (0, 1] (none clamped), a budget below a set.
    for (size, says) in [
        (CacheSize::LoadFactor(0.0), "load factor 0 is not in (0, 1]"),
        (
            CacheSize::LoadFactor(-0.5),
            "load factor -0.5 is not in (0, 1]",
        ),
        (
            CacheSize::LoadFactor(1.5),
            "load factor 1.5 is not in (0, 1]",
        ),
        (
            CacheSize::LoadFactor(f64::NAN),
            "load factor NaN is not in (0, 1]",
        ),
        (
            CacheSize::LoadFactor(f64::INFINITY),
            "load factor inf is not",
        ),
        (CacheSize::Bytes(100), "budget of 100 bytes"),
    ] {
        let cache = CacheConfig::new(dir.join("rows.bin"), size);
        let err = TableBatchedEmbedding::new_cached(cfg.clone(), cache).unwrap_err();
        assert!(err.to_string().contains(says), "{err}");
    }
    // Every row cached (load factor 1) is a size.
    let cache = CacheConfig::new(dir.join("rows.bin"), CacheSize::LoadFactor(1.0));
    drop(TableBatchedEmbedding::new_cached(cfg.clone(), cache)?);
    // A file that cannot be created.
    let cache = CacheConfig::new(dir.join("no/such/dir/rows.bin"), CacheSize::LoadFactor(0.5));
    let err = TableBatchedEmbedding::new_cached(cfg.clone(), cache)
        .unwrap_err()
        .to_string();
    assert!(err.contains("no/such/dir/rows.bin"), "{err}");
    // The file truncated under a running operator: the next batch fails with the file's
    // name, nothing crashes; put back, the operator answers again.
    let tbe = cached(&cfg, &dir, "rows.bin", CacheSize::LoadFactor(0.1));
    let file = std::fs::OpenOptions::new()
        .write(true)
        .open(dir.join("rows.bin"))
        .unwrap();
    let len = file.metadata().unwrap().len();
    file.set_len(64).unwrap();
    let step = bags(600..610);
    let input = TbeInput::new(&step.ids[..], &[0i64, 10, 10, 10, 10][..]);
    let err = tbe.lookup(input).unwrap_err().to_string();
    assert!(
        err.contains("rows.bin") && err.contains("truncated"),
        "{err}"
    );
    assert!(tbe.flush().is_err() && tbe.table_weights(0).is_err());
    file.set_len(len).unwrap();
    let input = TbeInput::new(&step.ids[..], &[0i64, 10, 10, 10, 10][..]);
    assert!(tbe.lookup(input).is_ok());
    // A second operator given the same row file is refused, not handed the first one's rows.
    let cache = CacheConfig::new(dir.join("rows.bin"), CacheSize::LoadFactor(0.1));
    let err = TableBatchedEmbedding::new_cached(cfg.clone(), cache)
        .unwrap_err()
        .to_string();
    assert!(err.contains("already uses this row file"), "{err}");
    // Another operator's checkpoint directory is not overwritten.
    tbe.save_cached_checkpoint(dir.join("ckpt"))?;
    let other_cfg = TbeConfig::new(
        vec![TableSpec::new("other", 10, 2)],
        vec![0],
        PoolingMode::Sum,
        FusedOptimizer::Sgd { lr: 0.1 },
    );
    let other = cached(&other_cfg, &dir, "other.bin", CacheSize::LoadFactor(1.0));
    let err = other
        .save_cached_checkpoint(dir.join("ckpt"))
        .unwrap_err()
        .to_string();
    assert!(err.contains("other tables"), "{err}");
    // Nor is a directory whose manifest is damaged: named as such, left as it was.
    let damaged = dir.join("damaged");
    std::fs::create_dir_all(&damaged).unwrap();
    std::fs::write(damaged.join("manifest.json"), b"{\"format\": \"embers-ro").unwrap();
    let err = other
        .save_cached_checkpoint(&damaged)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("damaged holds a manifest.json that is no checkpoint manifest"),
        "{err}"
    );
    assert_eq!(std::fs::read_dir(&damaged).unwrap().count(), 1);
    // Out-of-range ids are refused before the cache sees them.
    let input = TbeInput::new(&[700i64][..], &[0i64, 1, 1, 1, 1][..]);
    let err = tbe.lookup(input).unwrap_err().to_string();
    assert!(err.contains("700"), "{err}");
    // A GPU that does not exist is named; the cache stays where it was.
    let err = tbe
        .to_device(embers::Device::Cuda(99))
        .unwrap_err()
        .to_string();
    assert!(err.contains("99"), "{err}");
    assert_eq!(tbe.device(), embers::Device::Cpu);
    std::fs::remove_dir_all(&dir).unwrap();
    Ok(())
}

#[test]
fn a_table_four_times_the_cache_trains_checkpoints_and_resumes_bit_identically() -> Result<()> {
    checkpoint_round_trip("ckpt", false, Device::Cpu)
}

#[test]
fn rows_in_host_memory_train_checkpoint_and_resume_bit_identically() -> Result<()> {
    checkpoint_round_trip("ckpt-mem", true, Device::Cpu)
}

#[test]
fn gpu_rows_in_host_memory_behind_an_hbm_cache_checkpoint_and_resume_bit_identically() -> Result<()>
{
    let Some(device) = cuda_device::device() else {
        return Ok(());
    };
    checkpoint_round_trip("gpu-ckpt-mem", true, device)
}

/// A table four times its cache (in `device`'s memory; rows in a file, or in host memory)
/// trains, checkpoints and resumes bit-identically to the uncached TBE on `device`, and a bad
/// checkpoint changes nothing.
fn checkpoint_round_trip(name: &str, host_memory: bool, device: Device) -> Result<()> {
    let dir = temp_dir(name);
    let optimizer = FusedOptimizer::RowWiseAdagrad {
        lr: 0.05,
        eps: 1e-3,
    };
    let cfg = TbeConfig::new(
        vec![TableSpec::new("t", 20_000, 16)],
        vec![0, 0],
        PoolingMode::Sum,
        optimizer,
    );
    // Records are 17 floats: a budget of a quarter of the file.
    let budget = 20_000 * 17 * 4 / 4;
    let make = |name: &str| {
        let cache = match host_memory {
            true => CacheConfig::in_host_memory(CacheSize::Bytes(budget)),
            false => CacheConfig::new(dir.join(name), CacheSize::Bytes(budget)),
        };
        TableBatchedEmbedding::new_cached_on(cfg.clone(), cache, device).unwrap()
    };
    let steps = batches(&cfg, 12, 64, 10, 1.05, false, 3);
    let reference = TableBatchedEmbedding::new(cfg.clone())?;
    let tbe = make("live.bin");
    for t in [&reference, &tbe] {
        t.init_weights(
            EmbeddingInit::Uniform {
                low: -0.1,
                high: 0.1,
            },
            &mut seeded(9),
        )?;
    }
    assert!(
        tbe.allocated_bytes() as u64 <= budget,
        "{}",
        tbe.allocated_bytes()
    );
    assert!(tbe.allocated_bytes() < reference.allocated_bytes() / 3);
    reference.to_device(device)?;
    train(&reference, &steps[..6], false)?;
    train(&tbe, &steps[..6], true)?;
    tbe.save_cached_checkpoint(dir.join("ckpt"))?;
    let at_checkpoint = state_bits(&reference)?;
    train(&reference, &steps[6..], false)?;
    train(&tbe, &steps[6..], true)?;
    assert!(state_bits(&tbe)? == state_bits(&reference)?);
    // A new operator (its own file) resumes from the checkpoint.
    let resumed = make("other.bin");
    resumed.load_cached_checkpoint(dir.join("ckpt"))?;
    assert!(state_bits(&resumed)? == at_checkpoint);
    train(&resumed, &steps[6..], false)?;
    assert!(state_bits(&resumed)? == state_bits(&reference)?);
    if host_memory {
        // The checkpoint of rows in host memory is an ordinary row file: an operator whose
        // rows live in a file loads it too.
        let cache = CacheConfig::new(dir.join("filed.bin"), CacheSize::Bytes(budget));
        let filed = TableBatchedEmbedding::new_cached_on(cfg.clone(), cache, device)?;
        filed.load_cached_checkpoint(dir.join("ckpt"))?;
        assert!(state_bits(&filed)? == at_checkpoint);
    }
    // A corrupt or truncated checkpoint is refused and changes nothing.
    let manifest: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("ckpt/manifest.json")).unwrap())
            .unwrap();
    // A step that cannot go on counting.
    let mut stepped = manifest.clone();
    stepped["step"] = u64::MAX.into();
    let manifest_path = dir.join("ckpt/manifest.json");
    let text = std::fs::read_to_string(&manifest_path).unwrap();
    std::fs::write(&manifest_path, stepped.to_string()).unwrap();
    let err = (resumed
        .load_cached_checkpoint(dir.join("ckpt"))
        .unwrap_err())
    .to_string();
    assert!(err.contains("not a count below 2^63"), "{err}");
    // A manifest past 16 MiB (here valid JSON, padded) is not read whole.
    std::fs::write(&manifest_path, format!("{text}{}", " ".repeat(17 << 20))).unwrap();
    let err = (resumed
        .load_cached_checkpoint(dir.join("ckpt"))
        .unwrap_err())
    .to_string();
    assert!(err.contains("not a manifest"), "{err}");
    std::fs::write(&manifest_path, &text).unwrap();
    let rows = dir
        .join("ckpt")
        .join(manifest["rows_file"].as_str().unwrap());
    let mut bytes = std::fs::read(&rows).unwrap();
    bytes[1000] ^= 0x40;
    std::fs::write(&rows, &bytes).unwrap();
    let before = state_bits(&resumed)?;
    let err = resumed
        .load_cached_checkpoint(dir.join("ckpt"))
        .unwrap_err()
        .to_string();
    assert!(err.contains("checksum"), "{err}");
    // A NaN under a checksum that matches (a run that went non-finite, saved by a version
    // that did not refuse it) is refused, naming the file and the byte.
    bytes[1000] ^= 0x40;
    bytes[1000..1004].copy_from_slice(&f32::NAN.to_le_bytes());
    std::fs::write(&rows, &bytes).unwrap();
    let mut fixed = manifest.clone();
    fixed["checksum"] = format!("{:016x}", fnv_words(&bytes)).into();
    std::fs::write(&manifest_path, fixed.to_string()).unwrap();
    let err = resumed
        .load_cached_checkpoint(dir.join("ckpt"))
        .unwrap_err()
        .to_string();
    assert!(err.contains("the f32 at byte 1000 is NaN"), "{err}");
    std::fs::write(&manifest_path, &text).unwrap();
    std::fs::write(&rows, &bytes[..bytes.len() - 8]).unwrap();
    let err = resumed
        .load_cached_checkpoint(dir.join("ckpt"))
        .unwrap_err()
        .to_string();
    assert!(err.contains("truncated"), "{err}");
    assert!(state_bits(&resumed)? == before);
    std::fs::remove_dir_all(&dir).unwrap();
    Ok(())
}

/// A cached checkpoint's checksum: 64-bit FNV-1a over 8-byte little-endian words, a final
/// partial word zero-padded (as the manifest states it).
fn fnv_words(bytes: &[u8]) -> u64 {
    let mut hash = 0xcbf2_9ce4_8422_2325u64;
    for word in bytes.chunks(8) {
        let mut w = [0u8; 8];
        w[..word.len()].copy_from_slice(word);
        hash = (hash ^ u64::from_le_bytes(w)).wrapping_mul(0x0000_0100_0000_01b3);
    }
    hash
}

const CHILD_ENV: &str = "EMBERS_CACHED_CHECKPOINT_CHILD";

fn kill_config() -> TbeConfig {
    TbeConfig::new(
        vec![TableSpec::new("t", 200_000, 32)],
        vec![0],
        PoolingMode::Sum,
        FusedOptimizer::Adagrad {
            lr: 0.05,
            eps: 1e-3,
        },
    )
}

fn kill_steps(cfg: &TbeConfig) -> Vec<Step> {
    batches(cfg, 400, 64, 8, 1.05, false, 21)
}

fn kill_tbe(dir: &Path, name: &str) -> TableBatchedEmbedding {
    let cache = CacheConfig::new(dir.join(name), CacheSize::LoadFactor(0.05));
    let tbe = TableBatchedEmbedding::new_cached(kill_config(), cache).unwrap();
    tbe.init_weights(EmbeddingInit::Constant { value: 0.01 }, &mut seeded(0))
        .unwrap();
    tbe
}

/// Not a test on its own: the body of the child process of
/// `a_kill_during_a_cached_checkpoint_leaves_the_previous_one_loadable`. It trains and writes
/// a checkpoint after every step until it is killed.
#[test]
fn cached_checkpoint_writer_child() -> Result<()> {
    let Ok(dir) = std::env::var(CHILD_ENV) else {
        return Ok(());
    };
    let dir = PathBuf::from(dir);
    let tbe = kill_tbe(&dir, &format!("live-{}.bin", std::process::id()));
    let steps = kill_steps(&kill_config());
    for step in &steps {
        train(&tbe, std::slice::from_ref(step), false)?;
        tbe.save_cached_checkpoint(dir.join("ckpt"))?;
    }
    Ok(())
}

#[test]
fn a_kill_during_a_cached_checkpoint_leaves_the_previous_one_loadable() -> Result<()> {
    let dir = temp_dir("kill");
    let ckpt = dir.join("ckpt");
    let manifest = ckpt.join("manifest.json");
    // Checkpoint contents a reference reaches step by step.
    let steps = kill_steps(&kill_config());
    let writing = |_pid: u32| {
        std::fs::read_dir(&ckpt).is_ok_and(|entries| {
            entries
                .flatten()
                .any(|e| e.file_name().to_string_lossy().ends_with(".tmp"))
        })
    };
    let loaded = kill::kill_rounds(
        "cached_checkpoint_writer_child",
        (CHILD_ENV, &dir),
        &manifest,
        30,
        writing,
        |pid, _| -> Result<usize> {
            std::fs::remove_file(dir.join(format!("live-{pid}.bin"))).unwrap();
            let tbe = kill_tbe(&dir, "check.bin");
            tbe.load_cached_checkpoint(&ckpt)?;
            let step = tbe.step() as usize;
            // The checkpoint holds exactly the tables after its step.
            let reference = TableBatchedEmbedding::new(kill_config())?;
            reference.init_weights(EmbeddingInit::Constant { value: 0.01 }, &mut seeded(0))?;
            train(&reference, &steps[..step], false)?;
            assert!(state_bits(&reference)? == state_bits(&tbe)?, "step {step}");
            Ok(step)
        },
    )?;
    println!("cached checkpoints loaded after kills: {loaded:?}");
    std::fs::remove_dir_all(&dir).unwrap();
    Ok(())
}

#[test]
fn the_planners_cache_statistics_from_a_trace_predict_an_lru_cache() -> Result<()> {
    // With one bin per row the miss-ratio curve is exact: the planner's expected miss rate of
    // a k-row cache is the miss rate of a fully associative LRU cache of k rows over the
    // accesses that reuse an id (a plain move-to-front simulation here).
    let rows = 400usize;
    let cfg = TbeConfig::new(
        vec![TableSpec::new("t", rows, 4)],
        vec![0],
        PoolingMode::Sum,
        FusedOptimizer::Sgd { lr: 0.1 },
    );
    for s in [1.1, 0.0] {
        let steps = batches(&cfg, 30, 16, 6, s, false, 5);
        let stats = embers::embedding::planner_cache_stats(
            rows as u64,
            steps.iter().map(|b| b.ids.clone()),
            rows,
        )?;
        let mut stack: Vec<i64> = Vec::new();
        let mut distances = Vec::new();
        let mut unique = 0;
        for b in &steps {
            let mut ids = b.ids.clone();
            ids.sort();
            ids.dedup();
            unique += ids.len();
            for id in ids {
                if let Some(p) = stack.iter().position(|&x| x == id) {
                    distances.push(p);
                    stack.remove(p);
                }
                stack.insert(0, id);
            }
        }
        assert_eq!(stats.expected_lookups, unique as f64 / steps.len() as f64);
        for k in [1, 10, 40, 100, 250, 400] {
            let simulated =
                distances.iter().filter(|&&d| d >= k).count() as f64 / distances.len() as f64;
            let planned = embers_planner::estimator::cache_stats::expected_miss_rate(
                &stats,
                k as f64 / rows as f64,
            );
            assert!(
                (planned - simulated).abs() < 1e-6,
                "zipf {s}, {k} rows: planner {planned}, simulation {simulated}"
            );
        }
        let c = stats.cacheability.unwrap();
        assert!(c > 0.0 && c < 1.0, "{c}");
    }
    // Bad traces are refused with words.
    let err = embers::embedding::planner_cache_stats(10, [vec![3i64, 10]], 4).unwrap_err();
    assert!(err.to_string().contains("id 10"), "{err}");
    let max = embers::embedding::MAX_CACHE_STATS_BINS;
    for (rows, bins, says) in [
        (0, 4, "one row (0)"),
        (10, 0, "bins (0)"),
        (10, max + 1, "1 to 1048576 bins (1048577)"),
        (10, usize::MAX, "bins (18446744073709551615)"),
    ] {
        let err = embers::embedding::planner_cache_stats(rows, [vec![3i64]], bins).unwrap_err();
        assert!(err.to_string().contains(says), "{err}");
    }
    Ok(())
}

#[test]
fn a_collection_prefetches_its_cached_tables_rows_for_the_next_batch() -> Result<()> {
    use embers::embedding::{EmbeddingBagCollection, EmbeddingBagConfig, Placement};
    use embers::sparse::KeyedJaggedTensor;
    let dir = temp_dir("ebc-prefetch");
    let configs = vec![
        EmbeddingBagConfig::new("users", 5000, 8, &["user"]),
        EmbeddingBagConfig::new("items", 3000, 4, &["item"]),
    ];
    let placement = Placement::Cached {
        dir: dir.clone(),
        size: CacheSize::LoadFactor(0.05),
        policy: CachePolicy::Lru,
    };
    let sgd = FusedOptimizer::Sgd { lr: 0.1 };
    let ebc = EmbeddingBagCollection::with_placement(configs, sgd, &placement, &mut seeded(1))?;
    // Four samples, one user and two items each.
    let kjt = KeyedJaggedTensor::from_lengths(
        vec!["user".into(), "item".into()],
        Tensor::from_vec(vec![7i64, 4999, 12, 7, 1, 2, 3, 4, 5, 6, 2999, 2998], &[12])?,
        Tensor::from_vec(vec![1i64, 1, 1, 1, 2, 2, 2, 2], &[8])?,
        None,
        None,
    )?;
    let tbe = &ebc.tbes()[0];
    ebc.prefetch(&kjt)?;
    let misses = |t: &TableBatchedEmbedding| -> Vec<u64> {
        t.cache_stats()
            .unwrap()
            .iter()
            .map(|s| s.unique_misses)
            .collect()
    };
    assert_eq!(misses(tbe), vec![3, 8]);
    assert_eq!(tbe.locked_cache_slots().unwrap(), vec![3, 8]);
    let pooled = ebc.forward(&kjt)?;
    // The forward took the prefetched admission: no second one.
    assert_eq!(misses(tbe), vec![3, 8]);
    assert!(tbe.cache_stats().unwrap().iter().all(|s| s.calls == 1));
    assert_eq!(pooled.values().shape(), &[4, 12]);
    std::fs::remove_dir_all(&dir).unwrap();
    Ok(())
}

/// A collection whose second group's row file cannot be made (a directory stands at its
/// path) fails naming that file, and the first group's row file, already made, goes with it.
#[test]
fn a_collection_that_cannot_be_built_leaves_no_row_file() -> Result<()> {
    use embers::embedding::{EmbeddingBagCollection, EmbeddingBagConfig, Placement};
    let dir = temp_dir("ebc-unbuilt");
    let blocker = dir.join("ebc-group1.rows");
    std::fs::create_dir_all(blocker.join("in-the-way")).unwrap();
    let configs = vec![
        EmbeddingBagConfig::new("users", 5000, 8, &["user"]),
        EmbeddingBagConfig::new("items", 3000, 4, &["item"]).with_pooling(PoolingMode::Mean),
    ];
    let placement = Placement::Cached {
        dir: dir.clone(),
        size: CacheSize::LoadFactor(0.05),
        policy: CachePolicy::Lru,
    };
    let sgd = FusedOptimizer::Sgd { lr: 0.1 };
    let err = EmbeddingBagCollection::with_placement(configs, sgd, &placement, &mut seeded(1))
        .expect_err("the second group has no row file");
    assert!(err.to_string().contains("ebc-group1.rows"), "{err}");
    let mut left: Vec<_> = (std::fs::read_dir(&dir).unwrap())
        .map(|e| e.unwrap().file_name())
        .collect();
    left.sort();
    assert_eq!(left, vec![std::ffi::OsString::from("ebc-group1.rows")]);
    std::fs::remove_dir_all(&dir).unwrap();
    Ok(())
}

#[test]
fn every_entry_point_of_a_cached_tbe_matches_the_uncached_one() -> Result<()> {
    // forward (autograd), forward_into, backward_fused, row gradients and apply_row_gradients,
    // clone_to: the same values through the cache (one set: conflicts and evictions) as in
    // memory.
    let dir = temp_dir("entry-points");
    let cfg = config(
        FusedOptimizer::Adagrad { lr: 0.1, eps: 1e-3 },
        PoolingMode::Mean,
        WeightDecay::None,
    );
    let steps = batches(&cfg, 4, 12, 6, 1.1, true, 31);
    let plain = TableBatchedEmbedding::new(cfg.clone())?;
    let tbe = cached(&cfg, &dir, "rows.bin", CacheSize::LoadFactor(1e-9));
    for t in [&plain, &tbe] {
        t.init_weights(EmbeddingInit::Normal { std: 0.2 }, &mut seeded(8))?;
    }
    let width = plain.output_dim();
    for step in &steps {
        let n = step.offsets.len() - 1;
        let b = n / cfg.feature_table_map.len();
        let mut outs = Vec::new();
        for t in [&plain, &tbe] {
            // forward_into, then backward_fused with a gradient of the output.
            let mut out = vec![0.0f32; b * width];
            t.forward_into(step.input(), &mut out)?;
            let grad: Vec<f32> = out.iter().map(|x| x * 0.3 + 0.01).collect();
            let back = t.backward_fused(step.input(), &grad)?;
            // forward through autograd, backward into the tables.
            let ids = Tensor::from_vec(step.ids.clone(), &[step.ids.len()])?;
            let offsets = Tensor::from_vec(step.offsets.clone(), &[step.offsets.len()])?;
            let y = t.forward(&ids, &offsets, None)?;
            y.sum_all()?.backward()?;
            // Row gradients summed over two looks, applied once.
            let batch = t.prepare(step.input())?;
            let g = Tensor::from_vec(vec![0.05f32; b * width], &[b, width])?;
            let rows = t.row_gradients_batch(&batch, &g)?;
            drop(batch);
            t.apply_row_gradients(&rows)?;
            outs.push((
                out.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                back.per_sample_weights_grad
                    .map(|g| g.iter().map(|x| x.to_bits()).collect::<Vec<_>>()),
                y.to_vec::<f32>()?
                    .iter()
                    .map(|x| x.to_bits())
                    .collect::<Vec<_>>(),
                rows.iter().map(|r| r.rows.clone()).collect::<Vec<_>>(),
            ));
        }
        assert!(outs[0] == outs[1]);
        assert!(state_bits(&plain)? == state_bits(&tbe)?);
    }
    let copy = tbe.clone_to(embers::Device::Cpu)?;
    assert!(!copy.is_cached());
    assert!(state_bits(&copy)? == state_bits(&plain)?);
    std::fs::remove_dir_all(&dir).unwrap();
    Ok(())
}

/// A batch prefetched with per-sample weights and then looked up without them (or the other
/// way round) is looked up with its own weights, on the host and on a GPU.
#[test]
fn a_prefetched_batch_is_looked_up_with_its_own_weights() -> Result<()> {
    let mut devices = vec![Device::Cpu];
    devices.extend(cuda_device::device());
    for device in devices {
        let dir = temp_dir(&format!("weights-{device:?}"));
        let cfg = config(
            FusedOptimizer::Sgd { lr: 0.1 },
            PoolingMode::Sum,
            WeightDecay::None,
        );
        let step = &batches(&cfg, 1, 8, 4, 1.1, true, 5)[0];
        let reference = TableBatchedEmbedding::new(cfg.clone())?;
        let tbe = cached_on(&cfg, &dir, "rows.bin", CacheSize::LoadFactor(0.5), device);
        for t in [&reference, &tbe] {
            t.init_weights(EmbeddingInit::Normal { std: 0.3 }, &mut seeded(2))?;
        }
        reference.to_device(device)?;
        let bare = TbeInput::new(&step.ids[..], &step.offsets[..]);
        let bits = |t: Tensor| -> Result<Vec<u32>> {
            Ok(t.to_vec::<f32>()?.iter().map(|x| x.to_bits()).collect())
        };
        for (prefetched, looked_up) in [(step.input(), bare), (bare, step.input())] {
            tbe.prefetch(prefetched)?;
            assert!(
                bits(tbe.lookup(looked_up)?)? == bits(reference.lookup(looked_up)?)?,
                "{device:?}"
            );
        }
        assert_eq!(
            tbe.cache_stats().unwrap()[0].calls,
            2,
            "both prefetches taken"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
    Ok(())
}

#[test]
fn a_byte_budget_pays_for_lfus_access_counts_too() -> Result<()> {
    let dir = temp_dir("budget-lfu");
    let cfg = TbeConfig::new(
        vec![TableSpec::new("t", 20_000, 16)],
        vec![0],
        PoolingMode::Sum,
        FusedOptimizer::RowWiseAdagrad {
            lr: 0.05,
            eps: 1e-3,
        },
    );
    // A quarter of the 17-float records; LFU also counts every row's accesses (80 kB here).
    let budget = 20_000 * 17 * 4 / 4;
    let mut slots = Vec::new();
    for policy in [CachePolicy::Lru, CachePolicy::Lfu] {
        let cache = CacheConfig::new(
            dir.join(format!("{policy:?}.bin")),
            CacheSize::Bytes(budget),
        )
        .with_policy(policy);
        let tbe = TableBatchedEmbedding::new_cached(cfg.clone(), cache)?;
        let bytes = tbe.allocated_bytes() as u64;
        assert!(bytes <= budget, "{policy:?}: {bytes} bytes > {budget}");
        assert!(bytes > budget * 9 / 10, "{policy:?}: {bytes} bytes");
        slots.push(tbe.cache_stats().unwrap()[0].slots);
    }
    assert!(
        slots[1] < slots[0],
        "LFU's counts take room from its slots: {slots:?}"
    );
    // A budget the counts alone exceed is refused in words.
    let cache = CacheConfig::new(dir.join("small.bin"), CacheSize::Bytes(60_000))
        .with_policy(CachePolicy::Lfu);
    let err = TableBatchedEmbedding::new_cached(cfg.clone(), cache)
        .unwrap_err()
        .to_string();
    assert!(err.contains("access counts"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
    Ok(())
}

/// Two tables (3000×8 and 500×12, three features) trained by Adam.
fn two_tables_adam() -> TbeConfig {
    TbeConfig::new(
        vec![TableSpec::new("a", 3000, 8), TableSpec::new("b", 500, 12)],
        vec![0, 1, 0],
        PoolingMode::Sum,
        FusedOptimizer::Adam {
            lr: 0.01,
            beta1: 0.9,
            beta2: 0.99,
            eps: 1e-6,
        },
    )
}

/// The same uniform weights in every TBE of `tbes`.
fn init_alike(tbes: &[&TableBatchedEmbedding]) -> Result<()> {
    for t in tbes {
        let init = EmbeddingInit::Uniform {
            low: -0.1,
            high: 0.1,
        };
        t.init_weights(init, &mut seeded(2))?;
    }
    Ok(())
}

/// The planner's `fused_uvm` on a GPU (FBGEMM's `MANAGED`): tables and optimizer state in
/// managed memory, which the caching allocator does not hand out, trained by the same kernels
/// as tables in the GPU's memory — bit for bit, moved host → GPU → host → GPU, or made on the
/// GPU; a collection placed `Managed` puts them there on a GPU and in files behind the
/// smallest cache on the host.
#[test]
fn gpu_tables_in_managed_memory_train_like_tables_in_gpu_memory() -> Result<()> {
    let Some(device) = cuda_device::device() else {
        return Ok(());
    };
    let gpu = embers::cuda::open(device)?;
    let cfg = two_tables_adam();
    // Weights and Adam's two per-element moments.
    let table_bytes = 3 * 4 * (3000 * 8 + 500 * 12);
    let steps = batches(&cfg, 12, 16, 8, 1.05, true, 4);
    let reference = TableBatchedEmbedding::new(cfg.clone())?;
    let managed = TableBatchedEmbedding::new_managed(cfg.clone(), Device::Cpu)?;
    assert!(managed.is_managed() && !reference.is_managed());
    init_alike(&[&reference, &managed])?;
    let allocated = || gpu.memory_stats().allocated;
    let before = allocated();
    managed.to_device(device)?;
    let with_managed = allocated();
    reference.to_device(device)?;
    let with_both = allocated();
    assert!(
        with_managed - before < table_bytes / 2,
        "managed tables took {} allocator bytes",
        with_managed - before
    );
    assert!(
        with_both - with_managed >= table_bytes,
        "{with_both} {with_managed}"
    );
    for (k, at) in [device, Device::Cpu, device].into_iter().enumerate() {
        reference.to_device(at)?;
        managed.to_device(at)?;
        assert_eq!(managed.device(), at);
        let part = &steps[4 * k..4 * k + 4];
        let (a, b) = (
            train(&reference, part, false)?,
            train(&managed, part, false)?,
        );
        assert!(a == b, "outputs differ on {at:?}");
        assert!(
            state_bits(&managed)? == state_bits(&reference)?,
            "state differs on {at:?}"
        );
    }
    // Made on the GPU: zeros there, in managed memory.
    let before = allocated();
    let made = TableBatchedEmbedding::new_managed(cfg.clone(), device)?;
    assert!(allocated() - before < table_bytes / 2);
    assert_eq!(made.device(), device);
    assert!(made.table_weights(0)?.iter().all(|&x| x == 0.0));

    // A collection placed `Managed` (the planner's `fused_uvm`).
    let dir = temp_dir("gpu-managed");
    let placement = Placement::for_kernel("fused_uvm", None, &dir, CachePolicy::Lru)?;
    assert!(
        matches!(placement, Placement::Managed { .. }),
        "{placement:?}"
    );
    let configs = vec![EmbeddingBagConfig::new("t", 400, 8, &["f"])];
    let on_gpu = EmbeddingBagCollection::with_placement_on(
        configs.clone(),
        FusedOptimizer::Sgd { lr: 0.1 },
        &placement,
        device,
        &mut seeded(3),
    )?;
    on_gpu.to_device(device)?;
    let tbe = on_gpu.tbes()[0];
    assert!(tbe.is_managed() && !tbe.is_cached() && tbe.device() == device);
    let on_host = EmbeddingBagCollection::with_placement(
        configs,
        FusedOptimizer::Sgd { lr: 0.1 },
        &placement,
        &mut seeded(3),
    )?;
    let tbe = on_host.tbes()[0];
    assert!(tbe.is_cached() && tbe.cache_stats().unwrap()[0].slots == 32);
    std::fs::remove_dir_all(&dir).unwrap();
    Ok(())
}

#[test]
fn gpu_a_cached_tbe_moves_between_the_host_and_the_gpu_training_bit_identically() -> Result<()> {
    let Some(device) = cuda_device::device() else {
        return Ok(());
    };
    let dir = temp_dir("gpu-move");
    let cfg = two_tables_adam();
    let steps = batches(&cfg, 12, 16, 8, 1.05, true, 4);
    for in_memory in [false, true] {
        let size = CacheSize::LoadFactor(0.1);
        let cache = match in_memory {
            true => CacheConfig::in_host_memory(size),
            false => CacheConfig::new(dir.join("rows.bin"), size),
        };
        let reference = TableBatchedEmbedding::new(cfg.clone())?;
        let tbe = TableBatchedEmbedding::new_cached(cfg.clone(), cache)?;
        init_alike(&[&reference, &tbe])?;
        // Host, then the GPU, then the host again: the uncached TBE follows (host and GPU
        // kernels may round differently, the cache's place must not matter).
        for (k, at) in [Device::Cpu, device, Device::Cpu].into_iter().enumerate() {
            reference.to_device(at)?;
            tbe.to_device(at)?;
            assert_eq!(tbe.device(), at);
            let part = &steps[4 * k..4 * k + 4];
            let (a, b) = (train(&reference, part, false)?, train(&tbe, part, k == 1)?);
            assert!(a == b, "in memory {in_memory}: outputs differ on {at:?}");
            assert!(
                state_bits(&tbe)? == state_bits(&reference)?,
                "in memory {in_memory}: state differs on {at:?}"
            );
        }
        let stats = tbe.cache_stats().unwrap();
        assert!(stats.iter().all(|s| s.calls == 12), "{stats:?}");
        assert!(stats.iter().any(|s| s.evictions > 0), "{stats:?}");
        // A batch still alive keeps the cache where it is.
        let batch = tbe.prepare(steps[0].input())?;
        let err = tbe.to_device(device).unwrap_err().to_string();
        assert!(err.contains("still alive"), "{err}");
        assert_eq!(tbe.device(), Device::Cpu);
        drop(batch);
        tbe.to_device(device)?;
        assert_eq!(tbe.device(), device);
    }
    std::fs::remove_dir_all(&dir).unwrap();
    Ok(())
}
