"""torch.nn.EmbeddingBag on the GPU at the shapes of benches/cuda_tbe.rs: T tables of E rows,
D=128, B=512, L=20 uniform ids per bag, sum pooling; one EmbeddingBag per table as FBGEMM's
benchmark compares against. Prints ms per forward of all T tables (CUDA events, mean of 100
after 10 warm-up runs). Usage: python3 benches/peers/cuda_tbe.py"""
import torch

assert torch.cuda.is_available(), "no GPU visible to PyTorch"
dev = torch.device("cuda")
g = torch.Generator(device=dev).manual_seed(0)
for T, E in [(32, 100_000), (4, 10_000_000)]:
    B, D, L = 512, 128, 20
    bags = [torch.nn.EmbeddingBag(E, D, mode="sum").to(dev) for _ in range(T)]
    ids = [torch.randint(0, E, (B * L,), device=dev, generator=g) for _ in range(T)]
    offsets = torch.arange(0, B * L, L, device=dev)

    def forward():
        with torch.no_grad():
            return [bag(i, offsets) for bag, i in zip(bags, ids)]

    for _ in range(10):
        forward()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(100):
        forward()
    end.record()
    torch.cuda.synchronize()
    ms = start.elapsed_time(end) / 100
    moved = T * B * L * D * 4 + T * B * L * 8 + T * B * 8 + B * T * D * 4
    print(f"torch EmbeddingBag fp32 fwd T={T} B={B} D={D} E={E} L={L}: {ms:.4f} ms, "
          f"{moved / ms / 1e6:.0f} GB/s")
    del bags, ids
    torch.cuda.empty_cache()
