"""Plain PyTorch DLRM training on the GPU, in the configuration of benches/dlrm.rs (and of
benches/peers/dlrm.py): B=512, D=64, 26 tables x 100k rows (one nn.EmbeddingBag each, sum
pooling, one id per feature), bottom MLP 13-512-256-64, dot interaction (upper triangle of the
27 x 27 products, diagonal excluded), top MLP 415-512-512-256-1, BCE with logits, Adagrad
(lr 0.01) on the dense half and on the tables (sparse gradients; embers uses its fused row-wise
Adagrad there, which keeps one state value per row instead of one per weight). 8 pre-built
batches on the device, cycled. Prints samples/s from CUDA events over `steps` steps after 10
warm-up steps. Usage: python3 benches/peers/cuda_dlrm.py [steps]"""
import sys

import torch

assert torch.cuda.is_available(), "no GPU visible to PyTorch"
B, D, E, F = 512, 64, 100_000, 26
steps = int(sys.argv[1]) if len(sys.argv) > 1 else 200
dev = torch.device("cuda")
torch.manual_seed(0)


def mlp(sizes, relu_last):
    layers = []
    for i in range(len(sizes) - 1):
        layers.append(torch.nn.Linear(sizes[i], sizes[i + 1]))
        if i < len(sizes) - 2 or relu_last:
            layers.append(torch.nn.ReLU())
    return torch.nn.Sequential(*layers)


class Dlrm(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.tables = torch.nn.ModuleList(
            [torch.nn.EmbeddingBag(E, D, mode="sum", sparse=True) for _ in range(F)]
        )
        self.bottom = mlp([13, 512, 256, D], True)
        n = F + 1
        self.top = mlp([D + n * (n - 1) // 2, 512, 512, 256, 1], False)
        li, lj = torch.triu_indices(n, n, offset=1)
        self.register_buffer("li", li)
        self.register_buffer("lj", lj)

    def forward(self, dense, ids, offsets):
        x = self.bottom(dense)
        pooled = [t(ids[f], offsets) for f, t in enumerate(self.tables)]
        rows = torch.stack([x] + pooled, dim=1)  # [B, F + 1, D]
        dots = torch.bmm(rows, rows.transpose(1, 2))[:, self.li, self.lj]
        return self.top(torch.cat([x, dots], dim=1)).squeeze(1)


model = Dlrm().to(dev)
sparse = [p for t in model.tables for p in t.parameters()]
dense = [p for n, p in model.named_parameters() if not n.startswith("tables.")]
# Sparse gradients take the single-tensor Adagrad (foreach=False).
opts = [torch.optim.Adagrad(sparse, lr=0.01, foreach=False), torch.optim.Adagrad(dense, lr=0.01)]
loss_fn = torch.nn.BCEWithLogitsLoss()
g = torch.Generator(device=dev).manual_seed(0)
offsets = torch.arange(B, device=dev)
data = [
    (
        torch.randn(B, 13, device=dev, generator=g),
        torch.randint(0, E, (F, B), device=dev, generator=g),
        torch.randint(0, 2, (B,), device=dev, generator=g).float(),
    )
    for _ in range(8)
]


def step(i):
    x, ids, y = data[i % len(data)]
    for o in opts:
        o.zero_grad(set_to_none=True)
    loss = loss_fn(model(x, ids, offsets), y)
    loss.backward()
    for o in opts:
        o.step()


for i in range(10):
    step(i)
start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
start.record()
for i in range(steps):
    step(i)
end.record()
torch.cuda.synchronize()
ms = start.elapsed_time(end) / steps
print(
    f"pytorch DLRM cuda B={B} D={D} E={E} tables={F}: {B / ms * 1e3:,.0f} samples/s "
    f"({ms:.2f} ms/step, {torch.cuda.get_device_name()})"
)
