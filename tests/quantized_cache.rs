//! Inference tables in a row file behind a DRAM cache of the same byte form
//! (`QuantizedTableBatchedEmbedding::new_cached`): lookups equal, bit for bit, those of the
//! same rows in memory for every weight type, pooling, cache size and policy (conflict misses
//! included); hit and miss counts equal an independent simulation of the policy; rows written
//! while cached are seen at once; a truncated row file and misuse are named errors. On a GPU
//! (the emulation in CI): the cache in the GPU's memory gives the lookups of the same rows all
//! in the GPU's memory, bit for bit, and makes the host cache's decisions.

#[path = "support/cache_trace.rs"]
mod cache_trace;
#[path = "support/cuda_device.rs"]
mod cuda_device;

use cache_trace::{assert_counts_match, batches, simulate_step, simulations, temp_dir, Step};
use embers::embedding::{
    CacheConfig, CachePolicy, CacheSize, FusedOptimizer, PoolingMode,
    QuantizedTableBatchedEmbedding, TableSpec, TbeConfig, WeightType,
};
use embers::tensor::rng::seeded;
use embers::{Device, Result};
use rand::Rng as _;

/// Bags per feature in every batch.
const BAGS: usize = 24;

/// Three tables (one read by two features) of mixed types, in memory and behind a cache.
struct Pair {
    tables: Vec<TableSpec>,
    map: Vec<usize>,
    memory: QuantizedTableBatchedEmbedding,
    cached: QuantizedTableBatchedEmbedding,
}

fn pair(
    types: [WeightType; 3],
    dims: [usize; 3],
    pooling: PoolingMode,
    cache: &CacheConfig,
) -> Result<Pair> {
    let tables = vec![
        TableSpec::new("a", 700, dims[0]),
        TableSpec::new("b", 300, dims[1]),
        TableSpec::new("c", 90, dims[2]),
    ];
    let map = vec![0, 1, 0, 2];
    let mut memory =
        QuantizedTableBatchedEmbedding::new(tables.clone(), types.to_vec(), map.clone(), pooling)?;
    let mut cached = QuantizedTableBatchedEmbedding::new_cached(
        tables.clone(),
        types.to_vec(),
        map.clone(),
        pooling,
        cache,
    )?;
    let mut rng = seeded(7);
    for (t, spec) in tables.iter().enumerate() {
        let values: Vec<f32> = (0..spec.rows * spec.dim)
            .map(|_| rng.random_range(-1.0f32..1.0))
            .collect();
        memory.quantize_table_from(t, &values)?;
        // The cached operator is filled in chunks of 64 rows, as a table bigger than memory is.
        for (k, chunk) in values.chunks(64 * spec.dim).enumerate() {
            cached.quantize_rows_from(t, k * 64, chunk)?;
        }
        assert_eq!(memory.table_bytes(t)?, cached.table_bytes(t)?);
    }
    Ok(Pair {
        tables,
        map,
        memory,
        cached,
    })
}

/// Batches over `pair`'s features (a training config is only the trace generator's shape).
fn trace(pair: &Pair, n: usize, s: f64, weighted: bool, seed: u64) -> Vec<Step> {
    let cfg = TbeConfig::new(
        pair.tables.clone(),
        pair.map.clone(),
        PoolingMode::Sum,
        FusedOptimizer::Sgd { lr: 0.1 },
    );
    batches(&cfg, n, BAGS, 30, s, weighted, seed)
}

/// Case `i`'s weight types for the three tables: each type first in one case, mixed with
/// two others.
fn types_of_case(i: usize) -> [WeightType; 3] {
    let all = WeightType::ALL;
    [all[i], all[(i + 3) % 8], all[(i + 5) % 8]]
}

fn bits(values: &[f32]) -> Vec<u32> {
    values.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn cached_lookups_equal_lookups_in_memory_for_every_type_pooling_size_and_policy() -> Result<()> {
    let dir = temp_dir("quantized");
    let sizes = [
        CacheSize::LoadFactor(1e-9), // one set per table: conflict misses in most batches
        CacheSize::LoadFactor(0.1),
        CacheSize::LoadFactor(0.5),
        CacheSize::LoadFactor(1.0),
        CacheSize::Bytes(40_000),
    ];
    let mut conflicts = 0;
    let mut hits = 0;
    for i in 0..WeightType::ALL.len() {
        let types = types_of_case(i);
        for (j, pooling) in [PoolingMode::Sum, PoolingMode::Mean, PoolingMode::None]
            .into_iter()
            .enumerate()
        {
            let dims = if pooling == PoolingMode::None {
                [8, 8, 8]
            } else {
                [8, 5, 16]
            };
            let size = sizes[(i + j) % sizes.len()];
            let policy = [CachePolicy::Lru, CachePolicy::Lfu][(i + j) % 2];
            let cache =
                CacheConfig::new(dir.join(format!("rows-{i}-{j}.bin")), size).with_policy(policy);
            let p = pair(types, dims, pooling, &cache)?;
            let what = format!("{types:?} {pooling:?} {size:?} {policy:?}");
            // Zipf or uniform ids, alternating with the case; weighted bags with SUM.
            let s = [1.1, 0.0][(i + j) % 2];
            for (k, step) in trace(&p, 6, s, j == 0, i as u64).iter().enumerate() {
                let a = p.memory.forward(step.input())?.to_vec::<f32>()?;
                let b = p.cached.forward(step.input())?.to_vec::<f32>()?;
                assert_eq!(bits(&a), bits(&b), "{what}, batch {k}");
                if pooling != PoolingMode::None {
                    let mut into = vec![f32::NAN; a.len()];
                    p.cached.forward_into(step.input(), &mut into)?;
                    assert_eq!(bits(&a), bits(&into), "{what}, batch {k}, forward_into");
                }
            }
            let stats = p.cached.cache_stats().expect("a cached operator");
            assert!(p.memory.cache_stats().is_none());
            for st in &stats {
                assert_eq!(
                    st.rows_written, 0,
                    "{what}: a read-only cache writes nothing"
                );
                assert_eq!(
                    st.rows_read, st.unique_misses,
                    "{what}: every miss is read once"
                );
                conflicts += st.conflict_misses;
                hits += st.unique_ids - st.unique_misses;
            }
        }
    }
    // The sizes above must have exercised both sides of the cache.
    assert!(conflicts > 0, "no conflict miss was served by direct reads");
    assert!(hits > 0, "no lookup hit the cache");
    std::fs::remove_dir_all(&dir).unwrap();
    Ok(())
}

#[test]
fn hit_and_miss_counts_match_a_plain_simulation_on_zipf_and_uniform_ids() -> Result<()> {
    let dir = temp_dir("quantized-counts");
    for (s, policy) in [
        (1.1, CachePolicy::Lru),
        (0.0, CachePolicy::Lru),
        (1.1, CachePolicy::Lfu),
        (0.0, CachePolicy::Lfu),
    ] {
        let cache =
            CacheConfig::new(dir.join("rows.bin"), CacheSize::LoadFactor(0.1)).with_policy(policy);
        let types = [WeightType::Int4, WeightType::Fp16, WeightType::Int8];
        let p = pair(types, [8, 8, 8], PoolingMode::Sum, &cache)?;
        let steps = trace(&p, 30, s, false, 5);
        let mut sims = simulations(&p.cached.cache_stats().unwrap(), policy == CachePolicy::Lfu);
        for (i, step) in steps.iter().enumerate() {
            p.cached.forward(step.input())?;
            simulate_step(&mut sims, step, &p.map, BAGS, i);
        }
        let stats = p.cached.cache_stats().unwrap();
        assert_counts_match(&stats, &sims, steps.len(), &format!("zipf {s}, {policy:?}"));
        p.cached.reset_cache_stats();
        let zeroed = p.cached.cache_stats().unwrap();
        assert!(zeroed.iter().all(|st| st.calls == 0 && st.slots > 0));
    }
    std::fs::remove_dir_all(&dir).unwrap();
    Ok(())
}

#[test]
fn rows_written_while_cached_are_seen_at_once() -> Result<()> {
    let dir = temp_dir("quantized-writes");
    let cache = CacheConfig::new(dir.join("rows.bin"), CacheSize::LoadFactor(0.5));
    let types = [WeightType::Int8, WeightType::Fp16, WeightType::Fp32];
    let mut p = pair(types, [8, 8, 8], PoolingMode::Sum, &cache)?;
    let steps = trace(&p, 4, 1.1, false, 3);
    for step in &steps {
        p.cached.forward(step.input())?;
    }
    // Overwrite part of table 0 (rows 100..228, most of them cached by now) in both operators.
    let mut rng = seeded(9);
    let values: Vec<f32> = (0..128 * 8)
        .map(|_| rng.random_range(-3.0f32..3.0))
        .collect();
    p.memory.quantize_rows_from(0, 100, &values)?;
    p.cached.quantize_rows_from(0, 100, &values)?;
    assert_eq!(p.memory.table_bytes(0)?, p.cached.table_bytes(0)?);
    for step in &steps {
        let a = p.memory.forward(step.input())?.to_vec::<f32>()?;
        let b = p.cached.forward(step.input())?.to_vec::<f32>()?;
        assert_eq!(bits(&a), bits(&b));
    }
    // A few rows (each looked up in its set rather than the directory scanned): rows 0..3,
    // the hottest, cached for sure.
    let few: Vec<f32> = values[..3 * 8].iter().map(|v| -v).collect();
    p.memory.quantize_rows_from(0, 0, &few)?;
    p.cached.quantize_rows_from(0, 0, &few)?;
    for step in &steps {
        let a = p.memory.forward(step.input())?.to_vec::<f32>()?;
        let b = p.cached.forward(step.input())?.to_vec::<f32>()?;
        assert_eq!(bits(&a), bits(&b));
    }
    let whole = p.memory.table_bytes(2)?.to_vec();
    p.cached.set_table_bytes(2, &whole)?;
    p.cached.sync_rows()?;
    // A checkpoint of the tables in memory loads into the cached operator a chunk of rows at
    // a time (it was read whole, every table at once), and its lookups follow at once.
    let mut other = seeded(11);
    let fresh: Vec<f32> = (0..700 * 8)
        .map(|_| other.random_range(-2.0f32..2.0))
        .collect();
    p.memory.quantize_table_from(0, &fresh)?;
    let saved = dir.join("memory.safetensors");
    p.memory.save(&saved)?;
    p.cached.load(&saved)?;
    for t in 0..3 {
        assert_eq!(p.memory.table_bytes(t)?, p.cached.table_bytes(t)?);
    }
    for step in &steps {
        let a = p.memory.forward(step.input())?.to_vec::<f32>()?;
        let b = p.cached.forward(step.input())?.to_vec::<f32>()?;
        assert_eq!(bits(&a), bits(&b));
    }
    // A checkpoint whose row 5 of table 0 has a NaN scale (its every lookup NaN) is refused,
    // naming the table and the row, before any row changes: into the cached operator (read
    // a chunk at a time) and into one in memory.
    let rb = p.memory.table_bytes(0)?.len() / p.tables[0].rows;
    let mut row = p.memory.table_bytes(0)?[5 * rb..6 * rb].to_vec();
    row[..2].copy_from_slice(&half::f16::NAN.to_le_bytes());
    p.memory.set_rows_bytes(0, 5, &row)?;
    let bad = dir.join("nan-scale.safetensors");
    p.memory.save(&bad)?;
    let before = (0..3).map(|t| p.cached.table_bytes(t).map(|b| b.to_vec()));
    let before: Vec<Vec<u8>> = before.collect::<Result<_>>()?;
    let (name, ty) = (&p.tables[0].name, p.memory.weight_types()[0].fbgemm_name());
    let says = format!("table `{name}` row 5 decodes to NaN ({ty})");
    let files = || {
        let mut names: Vec<String> = (std::fs::read_dir(&dir).unwrap())
            .map(|e| e.unwrap().file_name().to_string_lossy().to_string())
            .collect();
        names.sort();
        names
    };
    let files_before = files();
    let err = p.cached.load(&bad).unwrap_err().to_string();
    assert!(err.contains(&says), "{err}");
    for (t, b) in before.iter().enumerate() {
        assert_eq!(p.cached.table_bytes(t)?, &b[..], "table {t} changed");
    }
    assert_eq!(files(), files_before, "the staged rows stay behind");
    let err = p.memory.load(&bad).unwrap_err().to_string();
    assert!(err.contains(&says), "{err}");
    // A flipped bit in the last table's rows (its checksum no longer matches): the rows read
    // before it were staged, not loaded; nothing changes and nothing stays behind.
    let flipped = dir.join("flipped.safetensors");
    let mut bytes = std::fs::read(&saved).unwrap();
    let last = bytes.len() - 3;
    bytes[last] ^= 1;
    std::fs::write(&flipped, &bytes).unwrap();
    let files_before = files();
    let err = p.cached.load(&flipped).unwrap_err().to_string();
    assert!(err.contains("do not match their checksum"), "{err}");
    for (t, b) in before.iter().enumerate() {
        assert_eq!(p.cached.table_bytes(t)?, &b[..], "table {t} changed");
    }
    assert_eq!(files(), files_before, "the staged rows stay behind");
    std::fs::remove_dir_all(&dir).unwrap();
    Ok(())
}

#[test]
fn a_cached_operator_names_bad_files_writes_and_devices() -> Result<()> {
    let dir = temp_dir("quantized-errors");
    let path = dir.join("rows.bin");
    let cache = CacheConfig::new(&path, CacheSize::LoadFactor(0.2));
    let types = [WeightType::Int4, WeightType::Int8, WeightType::Fp16];
    let mut p = pair(types, [8, 8, 8], PoolingMode::Sum, &cache)?;
    let step = &trace(&p, 1, 1.1, false, 1)[0];
    let before = p.cached.forward(step.input())?.to_vec::<f32>()?;

    // A second operator on the same row file is refused (it would zero the first one's rows).
    let err = QuantizedTableBatchedEmbedding::new_cached(
        p.tables.clone(),
        types.to_vec(),
        p.map.clone(),
        PoolingMode::Sum,
        &cache,
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("already uses this row file"), "{err}");

    // Truncated under the running operator: the next lookup names the file; restored, it runs.
    let len = std::fs::metadata(&path).unwrap().len();
    let file = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    file.set_len(len / 2).unwrap();
    let err = p.cached.forward(step.input()).unwrap_err().to_string();
    assert!(
        err.contains("rows.bin") && err.contains("truncated"),
        "{err}"
    );
    file.set_len(len).unwrap();
    let whole: Vec<Vec<u8>> = (0..3)
        .map(|t| p.memory.table_bytes(t).map(<[u8]>::to_vec))
        .collect::<Result<_>>()?;
    for (t, bytes) in whole.iter().enumerate() {
        p.cached.set_table_bytes(t, bytes)?;
    }
    assert_eq!(
        bits(&before),
        bits(&p.cached.forward(step.input())?.to_vec::<f32>()?)
    );

    // Rows that do not fit the table, or are not whole rows.
    let row = WeightType::Int4.row_bytes(8);
    let err = p
        .cached
        .set_rows_bytes(0, 699, &vec![0u8; 2 * row])
        .unwrap_err()
        .to_string();
    assert!(err.contains("700 rows") && err.contains("row 699"), "{err}");
    let err = p
        .cached
        .set_rows_bytes(0, 0, &vec![0u8; row + 1])
        .unwrap_err()
        .to_string();
    assert!(err.contains("whole rows"), "{err}");
    let err = p
        .cached
        .quantize_rows_from(1, 0, &[0.5; 7])
        .unwrap_err()
        .to_string();
    assert!(err.contains("not whole rows"), "{err}");

    // Out-of-range ids are named before anything is admitted.
    let bad = Step {
        ids: vec![0, 700],
        offsets: (0..=4 * BAGS as i64).map(|i| i.min(2)).collect(),
        weights: None,
    };
    let err = p.cached.forward(bad.input()).unwrap_err().to_string();
    assert!(err.contains("700"), "{err}");

    // A GPU that does not exist is named; the cache stays on the host.
    let err = p
        .cached
        .to_device(Device::Cuda(99))
        .unwrap_err()
        .to_string();
    assert!(err.contains("99"), "{err}");
    assert_eq!(p.cached.device(), Device::Cpu);
    drop(p);
    std::fs::remove_dir_all(&dir).unwrap();
    Ok(())
}

#[test]
fn gpu_cached_lookups_equal_lookups_in_gpu_memory_and_make_the_host_caches_decisions() -> Result<()>
{
    let Some(device) = cuda_device::device() else {
        return Ok(());
    };
    let dir = temp_dir("quantized-gpu");
    let sizes = [
        CacheSize::LoadFactor(1e-9), // one set per table: conflict misses in most batches
        CacheSize::LoadFactor(0.1),
        CacheSize::LoadFactor(0.5),
        CacheSize::Bytes(40_000),
    ];
    let (mut conflicts, mut hits, mut evictions) = (0, 0, 0);
    for i in 0..WeightType::ALL.len() {
        let types = types_of_case(i);
        let pooling = [PoolingMode::Sum, PoolingMode::Mean, PoolingMode::None][i % 3];
        let dims = if pooling == PoolingMode::None {
            [8, 8, 8]
        } else {
            [8, 5, 16]
        };
        let size = sizes[i % sizes.len()];
        // Rows in a file (moves staged through the host) or in host memory the GPU reads in
        // place, each with either policy and Zipf or uniform ids: every combination.
        let in_memory = i % 2 == 0;
        let policy = [CachePolicy::Lru, CachePolicy::Lfu][(i / 2) % 2];
        let s = [1.1, 0.0][(i / 4) % 2];
        let what = format!("{types:?} {pooling:?} {size:?} {policy:?} in memory {in_memory}");
        let cache = CacheConfig::new(dir.join(format!("host-{i}.bin")), size).with_policy(policy);
        let mut p = pair(types, dims, pooling, &cache)?;
        let gpu_cache = if in_memory {
            CacheConfig::in_host_memory(size)
        } else {
            CacheConfig::new(dir.join(format!("gpu-{i}.bin")), size)
        }
        .with_policy(policy);
        let mut gpu = QuantizedTableBatchedEmbedding::new_cached(
            p.tables.clone(),
            types.to_vec(),
            p.map.clone(),
            pooling,
            &gpu_cache,
        )?;
        for t in 0..3 {
            gpu.set_table_bytes(t, p.memory.table_bytes(t)?)?;
        }
        let mut on_gpu = QuantizedTableBatchedEmbedding::new(
            p.tables.clone(),
            types.to_vec(),
            p.map.clone(),
            pooling,
        )?;
        for t in 0..3 {
            on_gpu.set_table_bytes(t, p.memory.table_bytes(t)?)?;
        }
        on_gpu.to_device(device)?;
        gpu.to_device(device)?;
        assert_eq!(gpu.device(), device);
        let steps = trace(&p, 8, s, pooling == PoolingMode::Sum, i as u64);
        // The same decisions as the host cache, batch by batch: the same counters.
        let same_counters = |p: &Pair, gpu: &QuantizedTableBatchedEmbedding, k: usize| {
            let (host, device_stats) = (p.cached.cache_stats(), gpu.cache_stats());
            assert_eq!(host, device_stats, "{what}, after batch {k}");
        };
        for (k, step) in steps.iter().enumerate() {
            if k == 4 {
                // Rows rewritten while cached, in all three; then the cache goes to the host
                // and back, keeping its rows.
                let mut rng = seeded(k as u64);
                let values: Vec<f32> = (0..40 * dims[0])
                    .map(|_| rng.random_range(-2.0f32..2.0))
                    .collect();
                for op in [&mut p.memory, &mut p.cached, &mut gpu, &mut on_gpu] {
                    op.quantize_rows_from(0, 10, &values)?;
                }
                gpu.to_device(Device::Cpu)?;
                assert_eq!(gpu.device(), Device::Cpu);
                let a = p.cached.forward(step.input())?.to_vec::<f32>()?;
                let b = gpu.forward(step.input())?.to_vec::<f32>()?;
                assert_eq!(bits(&a), bits(&b), "{what}, batch {k} on the host");
                same_counters(&p, &gpu, k);
                gpu.to_device(device)?;
                continue;
            }
            p.cached.forward(step.input())?;
            let a = on_gpu.forward(step.input())?;
            let b = gpu.forward(step.input())?;
            assert_eq!(b.device(), device);
            let (a, b) = (a.to_vec::<f32>()?, b.to_vec::<f32>()?);
            assert_eq!(bits(&a), bits(&b), "{what}, batch {k}");
            same_counters(&p, &gpu, k);
            if pooling != PoolingMode::None {
                let mut into = vec![f32::NAN; a.len()];
                gpu.forward_into(step.input(), &mut into)?;
                p.cached.forward(step.input())?;
                assert_eq!(bits(&a), bits(&into), "{what}, batch {k}, forward_into");
                same_counters(&p, &gpu, k);
            }
        }
        for st in &gpu.cache_stats().unwrap() {
            assert_eq!(st.rows_written, 0, "{what}");
            assert_eq!(
                st.rows_read, st.unique_misses,
                "{what}: every miss read once"
            );
            conflicts += st.conflict_misses;
            hits += st.unique_ids - st.unique_misses;
            evictions += st.evictions;
        }
    }
    assert!(conflicts > 0, "no conflict miss was served by direct reads");
    assert!(
        hits > 0 && evictions > 0,
        "hits {hits}, evictions {evictions}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
    Ok(())
}
