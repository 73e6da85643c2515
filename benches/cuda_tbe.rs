//! TBE forward on the GPU at FBGEMM's benchmark defaults (T=32 tables, B=512, D=128,
//! E=100000 rows, L=20 ids per bag, uniform ids, sum pooling), plus E=10^7 rows: 32 features
//! again, over 8 tables of 10^7 rows (each shared by 4 features), since 32 such FP32 tables
//! (164 GB) do not fit in an 80 GB GPU and 8 (41 GB) do.
//! First the two numbers that frame the result: the bytes one forward must move (rows read,
//! ids and offsets read, output written) and this GPU's measured device-to-device copy
//! bandwidth; then the forward time (CUDA events, mean of 100 after 10 warm-up runs, cycling
//! through 8 batches of ids so that the rows come from memory, not the L2 cache) and the
//! fraction of copy bandwidth reached; the same for the fused backward (row-wise Adagrad) and,
//! at E=100000, for the inference forward of FP16/INT8/INT4/FP8 rows (FBGEMM's row layouts).
//! Without a GPU it says why and exits.
//! Side by side with `torch.nn.EmbeddingBag`: `benches/peers/cuda_tbe.sh`.

use embers::cuda;
use embers::embedding::WeightType;
use embers::embedding::{FusedOptimizer, PoolingMode, TableSpec, TbeInput};
use embers::embedding::{QuantizedTableBatchedEmbedding, TableBatchedEmbedding, TbeConfig};
use embers::{Device, Tensor};
use rand::Rng;

/// Distinct batches of ids the timed loops take in turn.
const BATCHES: usize = 8;

fn main() {
    if let Err(reason) = cuda::device_count().and_then(|n| {
        if n == 0 {
            Err(embers::Error::invalid("cuda_tbe bench", "no GPU"))
        } else {
            Ok(())
        }
    }) {
        println!("skipped: {reason}");
        return;
    }
    let device = cuda::device(0).expect("device 0");
    println!("device: {} ({})", device.name(), device.arch());
    let time_ms = |iters: usize, f: &mut dyn FnMut()| -> f64 {
        for _ in 0..10 {
            f();
        }
        let start = device.record_event().unwrap();
        for _ in 0..iters {
            f();
        }
        let end = device.record_event().unwrap();
        start.elapsed_ms(&end).unwrap() / iters as f64
    };
    // Copy bandwidth: 1 GiB device to device (read + write counted).
    let n = 1 << 28;
    let src = device.zeros::<f32>(n).unwrap();
    let mut dst = device.zeros::<f32>(n).unwrap();
    let copy_ms = time_ms(20, &mut || dst.copy_from(&src).unwrap());
    let copy_gbs = 2.0 * (n * 4) as f64 / (copy_ms * 1e-3) / 1e9;
    println!("device copy bandwidth: {copy_gbs:.0} GB/s (1 GiB device to device, read + write)");
    drop((src, dst));
    device.empty_cache();

    // (features T, tables, rows per table E)
    for (t, n_tables, e) in [(32usize, 32usize, 100_000usize), (32, 8, 10_000_000)] {
        let (b, d, l) = (512usize, 128usize, 20usize);
        let tables: Vec<TableSpec> = (0..n_tables)
            .map(|i| TableSpec::new(format!("t{i}"), e, d))
            .collect();
        let ftm: Vec<usize> = (0..t).map(|i| i % n_tables).collect();
        let optimizer = FusedOptimizer::RowWiseAdagrad {
            lr: 0.01,
            eps: 1e-8,
        };
        let config = TbeConfig::new(tables.clone(), ftm.clone(), PoolingMode::Sum, optimizer);
        let tbe = TableBatchedEmbedding::new_on(config, Device::Cuda(0)).unwrap();
        // BATCHES batches of ids, taken in turn, as FBGEMM's benchmark cycles through its
        // requests: timing one batch over and over would read its rows from the L2 cache.
        // Each is checked and copied to the device once (`prepare`), outside the timed loops.
        let mut rng = embers::tensor::rng::seeded(0);
        let offsets: Vec<i64> = (0..=t * b).map(|i| (i * l) as i64).collect();
        let id_batches: Vec<Vec<i64>> = (0..BATCHES)
            .map(|_| {
                (0..t * b * l)
                    .map(|_| rng.random_range(0..e as i64))
                    .collect()
            })
            .collect();
        let batches: Vec<_> = (id_batches.iter())
            .map(|ids| tbe.prepare(TbeInput::new(&ids[..], &offsets[..])).unwrap())
            .collect();
        // Both FP32 lookup kernels: 16-byte loads (the default here) and one float per lane.
        for vectorized in [true, false] {
            tbe.set_vectorized(vectorized);
            let mut i = 0;
            let ms = time_ms(100, &mut || {
                i = (i + 1) % BATCHES;
                tbe.lookup_batch(&batches[i]).unwrap();
            });
            let bytes =
                (t * b * l * d * 4 + t * b * l * 8 + (t * b + 1) * 8 + b * t * d * 4) as f64;
            let gbs = bytes / (ms * 1e-3) / 1e9;
            let kernel = if vectorized { "float4" } else { "scalar" };
            println!(
                "embers TBE fp32 fwd ({kernel}) T={t} B={b} D={d} E={e} L={l} ({n_tables} tables): {ms:.4} ms, {:.1} MB moved, {gbs:.0} GB/s = {:.1}% of copy bandwidth",
                bytes / 1e6,
                100.0 * gbs / copy_gbs
            );
        }
        tbe.set_vectorized(true);
        // Fused backward (row-wise Adagrad), counted as FBGEMM's benchmark counts it: every
        // lookup reads and writes its row, plus the output gradient read once.
        let grad: Vec<f32> = (0..b * tbe.output_dim())
            .map(|_| rng.random_range(-1.0..1.0))
            .collect();
        let grad = Tensor::from_vec(grad, &[b, tbe.output_dim()])
            .unwrap()
            .to_device(Device::Cuda(0))
            .unwrap();
        let mut i = 0;
        let ms = time_ms(40, &mut || {
            i = (i + 1) % BATCHES;
            tbe.backward_batch(&batches[i], &grad).unwrap();
        });
        let bytes = (2 * t * b * l * d * 4 + b * t * d * 4 + t * b * l * 8) as f64;
        let gbs = bytes / (ms * 1e-3) / 1e9;
        println!(
            "embers TBE fp32 fused backward (row-wise Adagrad) T={t} B={b} D={d} E={e} L={l} ({n_tables} tables): {ms:.4} ms, {:.1} MB counted, {gbs:.0} GB/s = {:.1}% of copy bandwidth",
            bytes / 1e6,
            100.0 * gbs / copy_gbs
        );
        drop((tbe, grad));
        device.empty_cache();
        // Inference forward of quantized rows (FBGEMM's row layouts, f32 output), E=1e5 only.
        if e == 100_000 {
            for ty in [
                WeightType::Fp16,
                WeightType::Int8,
                WeightType::Int4,
                WeightType::Fp8,
            ] {
                let mut q = QuantizedTableBatchedEmbedding::new(
                    tables.clone(),
                    vec![ty; n_tables],
                    ftm.clone(),
                    PoolingMode::Sum,
                )
                .unwrap();
                q.to_device(Device::Cuda(0)).unwrap();
                let q_batches: Vec<_> = (id_batches.iter())
                    .map(|ids| q.prepare(TbeInput::new(&ids[..], &offsets[..])).unwrap())
                    .collect();
                let mut i = 0;
                let ms = time_ms(100, &mut || {
                    i = (i + 1) % BATCHES;
                    q.lookup_batch(&q_batches[i]).unwrap();
                });
                let bytes =
                    (t * b * l * ty.row_bytes(d) + t * b * l * 8 + (t * b + 1) * 8 + b * t * d * 4)
                        as f64;
                let gbs = bytes / (ms * 1e-3) / 1e9;
                println!(
                    "embers TBE inference fwd [{}] T={t} B={b} D={d} E={e} L={l} ({n_tables} tables): {ms:.4} ms, {:.1} MB moved, {gbs:.0} GB/s = {:.1}% of copy bandwidth",
                    ty.fbgemm_name(),
                    bytes / 1e6,
                    100.0 * gbs / copy_gbs
                );
                drop((q_batches, q));
                device.empty_cache();
            }
        }
        // Give the memory back before the next, larger set.
        drop(batches);
        device.empty_cache();
    }
}
