"""torch.nn.EmbeddingBag on the GPU at the shapes of benches/cuda_tbe.rs: T features over tables of E rows,
D=128, B=512, L=20 uniform ids per bag, sum pooling; one EmbeddingBag per table, as FBGEMM's
benchmark compares against. Prints ms per forward of all T tables (CUDA events, mean of 100
after 10 warm-up runs, cycling through 8 batches of ids). Usage: python3 benches/peers/cuda_tbe.py"""
import torch

assert torch.cuda.is_available(), "no GPU visible to PyTorch"
dev = torch.device("cuda")
g = torch.Generator(device=dev).manual_seed(0)
# (features T, tables, rows E): 32 features over 8 tables of 10^7 rows (32 would not fit).
for T, NT, E in [(32, 32, 100_000), (32, 8, 10_000_000)]:
    B, D, L = 512, 128, 20
    tables = [torch.nn.EmbeddingBag(E, D, mode="sum", device=dev) for _ in range(NT)]
    bags = [tables[i % NT] for i in range(T)]
    # 8 batches taken in turn, as benches/cuda_tbe.rs does (rows from memory, not the L2).
    batches = [[torch.randint(0, E, (B * L,), device=dev, generator=g) for _ in range(T)]
               for _ in range(8)]
    offsets = torch.arange(0, B * L, L, device=dev)

    def forward(k):
        with torch.no_grad():
            return [bag(i, offsets) for bag, i in zip(bags, batches[k % 8])]

    for k in range(10):
        forward(k)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for k in range(100):
        forward(k)
    end.record()
    torch.cuda.synchronize()
    ms = start.elapsed_time(end) / 100
    moved = T * B * L * D * 4 + T * B * L * 8 + T * B * 8 + B * T * D * 4
    print(f"torch EmbeddingBag fp32 fwd T={T} B={B} D={D} E={E} L={L} ({NT} tables): {ms:.4f} ms, "
          f"{moved / ms / 1e6:.0f} GB/s")
    del tables, bags, batches
    torch.cuda.empty_cache()
