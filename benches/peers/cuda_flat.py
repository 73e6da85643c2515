"""The peer of benches/cuda_flat.rs: exact inner-product top-k on the GPU in PyTorch, as a
PyTorch user writes it (queries copied to the GPU, `torch.topk(q @ b.T, k)` per block of 1024
queries, results copied back), on the same sizes: 4096 queries against 10^5 and 10^6 vectors
of 64 and 128 dimensions, k = 10 and 100. Median of 5 after a warm-up. FP32 products without
TF32 (PyTorch's default, and embers').
"""
import time

import torch

torch.backends.cuda.matmul.allow_tf32 = False
dev = torch.device("cuda")
print(f"device: {torch.cuda.get_device_name(0)}; torch {torch.__version__}")
nq = 4096
g = torch.Generator().manual_seed(1)
for nb, dim in [(100_000, 64), (1_000_000, 64), (1_000_000, 128)]:
    base = (torch.rand(nb, dim, generator=g) * 2 - 1).to(dev)
    queries = torch.rand(nq, dim, generator=g) * 2 - 1
    for k in [10, 100]:
        def search():
            out_s, out_i = [], []
            for q0 in range(0, nq, 1024):
                q = queries[q0:q0 + 1024].to(dev)
                s, i = torch.topk(q @ base.T, k, dim=1)
                out_s.append(s.cpu())
                out_i.append(i.cpu())
            return out_s, out_i
        search()
        times = []
        for _ in range(5):
            t = time.perf_counter()
            search()
            times.append((time.perf_counter() - t) * 1e3)
        ms = sorted(times)[2]
        print(f"torch flat nb={nb} d={dim} nq={nq} k={k}: {ms:.2f} ms, {nq / (ms * 1e-3):.0f} queries/s")
    del base
    torch.cuda.empty_cache()
