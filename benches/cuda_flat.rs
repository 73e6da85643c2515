//! Exact nearest-neighbour search on the GPU (`FlatIndex` on a CUDA device, inner product):
//! 4096 queries against 10^5 and 10^6 random vectors of 64 and 128 dimensions, k = 10 and 100.
//! Per case: the search's wall time (queries uploaded, results copied back, as a caller sees
//! it; median of 5 after a warm-up that also uploads the vectors), queries per second, and
//! beside it the matrix products alone (cuBLAS, the same blocks, CUDA events) — the floor a
//! products-then-select search cannot go under — with their FLOP rate. The rest is the
//! selection (`kernels/topk.cu`) and the transfers.
//! Without a GPU it says why and exits.
//! Side by side with PyTorch (`torch.topk(q @ b.T)`): `benches/peers/cuda_flat.py`, run by
//! `.ci/gpu-check`.

use std::time::Instant;

use embers::retrieval::{FlatIndex, GpuBlocks, Metric};
use embers::{cuda, no_grad, Device, Tensor};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

fn main() {
    if let Err(reason) = cuda::device_count().and_then(|n| {
        if n == 0 {
            Err(embers::Error::invalid("cuda_flat bench", "no GPU"))
        } else {
            Ok(())
        }
    }) {
        println!("skipped: {reason}");
        return;
    }
    let device = cuda::device(0).expect("device 0");
    println!("device: {} ({})", device.name(), device.arch());
    let dev = Device::Cuda(0);
    let nq = 4096;
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    for (nb, dim) in [(100_000usize, 64usize), (1_000_000, 64), (1_000_000, 128)] {
        // Uniform in [-1, 1): the distribution matters little to the timing.
        let base: Vec<f32> = (0..nb * dim).map(|_| rng.random_range(-1.0..1.0)).collect();
        let queries: Vec<f32> = (0..nq * dim).map(|_| rng.random_range(-1.0..1.0)).collect();
        let ids: Vec<i64> = (0..nb as i64).collect();
        let mut index = FlatIndex::new(dim, Metric::InnerProduct).unwrap();
        index.add(&ids, &base).unwrap();
        let index = index.to_device(dev).unwrap();
        // The products alone, block by block as the search multiplies them.
        let blocks = GpuBlocks::default();
        let base_t = Tensor::from_slice(&base, &[nb, dim])
            .unwrap()
            .to_device(dev)
            .unwrap();
        let q_t = Tensor::from_slice(&queries, &[nq, dim])
            .unwrap()
            .to_device(dev)
            .unwrap();
        let products = || {
            no_grad(|| {
                for q0 in (0..nq).step_by(blocks.queries) {
                    let q = q_t.narrow(0, q0, blocks.queries.min(nq - q0)).unwrap();
                    for b0 in (0..nb).step_by(blocks.chunk) {
                        let b = base_t.narrow(0, b0, blocks.chunk.min(nb - b0)).unwrap();
                        drop(q.linear(&b, None).unwrap());
                    }
                }
            })
        };
        products();
        let start = device.record_event().unwrap();
        for _ in 0..5 {
            products();
        }
        let end = device.record_event().unwrap();
        let gemm_ms = start.elapsed_ms(&end).unwrap() / 5.0;
        let tflops = 2.0 * (nq * nb * dim) as f64 / (gemm_ms * 1e-3) / 1e12;
        println!("products nb={nb} d={dim} nq={nq}: {gemm_ms:.2} ms ({tflops:.1} TFLOP/s FP32)");
        drop((base_t, q_t));
        for k in [10usize, 100] {
            index.search(&queries, k).unwrap();
            let mut times: Vec<f64> = (0..5)
                .map(|_| {
                    let t = Instant::now();
                    index.search(&queries, k).unwrap();
                    t.elapsed().as_secs_f64() * 1e3
                })
                .collect();
            times.sort_by(f64::total_cmp);
            let ms = times[2];
            println!(
                "embers flat nb={nb} d={dim} nq={nq} k={k}: {ms:.2} ms, {:.0} queries/s \
                 (products {:.0}% of it)",
                nq as f64 / (ms * 1e-3),
                100.0 * gemm_ms / ms
            );
        }
        if nb == 1_000_000 && dim == 64 {
            // How the product blocks' size moves the time (the default is the first).
            for (queries_per, chunk) in [(1024, 16_384), (2048, 32_768), (512, 65_536)] {
                let mut tuned = index.clone();
                tuned
                    .set_gpu_blocks(GpuBlocks {
                        queries: queries_per,
                        chunk,
                    })
                    .unwrap();
                for k in [10usize, 100] {
                    tuned.search(&queries, k).unwrap();
                    let t = Instant::now();
                    for _ in 0..3 {
                        tuned.search(&queries, k).unwrap();
                    }
                    let ms = t.elapsed().as_secs_f64() * 1e3 / 3.0;
                    println!(
                        "  blocks {queries_per} queries x {chunk} vectors, k={k}: {ms:.2} ms \
                         (product block {} MiB)",
                        (queries_per * chunk * 4) >> 20
                    );
                }
            }
        }
        drop(index);
        device.empty_cache();
    }
}
