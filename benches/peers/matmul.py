"""Reference numbers from PyTorch (CPU) for dense kernels the tensor core must match.
Run: benches/peers/venv/bin/python benches/peers/matmul.py   (after benches/peers/setup.sh)"""
import time, torch
torch.set_num_threads(2)
def bench(fn, iters=50):
    for _ in range(5): fn()
    ts = []
    for _ in range(iters):
        t = time.perf_counter(); fn(); ts.append(time.perf_counter() - t)
    ts.sort(); return ts[len(ts) // 2]
for (m, k, n) in [(512, 512, 512), (512, 415, 512), (512, 13, 512), (2048, 1024, 1024), (512, 512, 1)]:
    a = torch.randn(m, k); b = torch.randn(k, n)
    s = bench(lambda: a @ b)
    print(f"matmul f32 {m}x{k}x{n}: {s*1e6:9.1f} us  {2*m*k*n/s/1e9:7.1f} GFLOP/s")
# DLRM-style MLP forward+backward (bottom 13-512-256-64, top 415-512-512-256-1), batch 512
B = 512
bot = torch.nn.Sequential(torch.nn.Linear(13, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64), torch.nn.ReLU())
top = torch.nn.Sequential(torch.nn.Linear(415, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))
xd = torch.randn(B, 13); xt = torch.randn(B, 415)
def step():
    loss = bot(xd).sum() + top(xt).sum(); loss.backward()
print(f"DLRM MLPs fwd+bwd B=512: {bench(step, 30)*1e3:.2f} ms")
# batched pairwise dot interaction (B x 27 x 64)
z = torch.randn(B, 27, 64, requires_grad=True)
def inter():
    zz = torch.bmm(z, z.transpose(1, 2)); li, lj = torch.triu_indices(27, 27, 1); zz[:, li, lj].sum().backward()
print(f"dot interaction fwd+bwd B=512 F=27 D=64: {bench(inter, 30)*1e3:.2f} ms")
