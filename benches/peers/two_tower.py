"""The peer of benches/two_tower.rs: TorchRec's TwoTower on the CPU, as its retrieval example
builds it (an EmbeddingBagCollection holding a user table and an item table, an MLP per tower
over the pooled embeddings, scores by inner product), at the same shape: 943 x 64 and
1682 x 64 tables, MLPs 64 -> 128 -> 64, batch 256 of uniform (user, item) pairs. Losses:
pointwise BCE (TorchRec's example), in-batch softmax with log-Q (a constant log-Q tensor here:
the frequency estimate is cheap host work), and the same with 256 random negatives. Tables and
MLPs train with Adagrad (TorchRec's example's optimizer; on the CPU the EBC's weights get dense
gradients), 2 threads. Pairs/s: median of 5 timings of 50 steps after 20 warm-up steps.
"""
import time

import torch
import torch.nn.functional as F
import torchrec
from torchrec.modules.mlp import MLP
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

torch.set_num_threads(2)
torch.manual_seed(0)
USERS, ITEMS, BATCH, D = 943, 1682, 256, 64


class TwoTower(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.ebc = torchrec.EmbeddingBagCollection(
            tables=[
                torchrec.EmbeddingBagConfig(name="t_user", embedding_dim=D, num_embeddings=USERS, feature_names=["user"]),
                torchrec.EmbeddingBagConfig(name="t_item", embedding_dim=D, num_embeddings=ITEMS, feature_names=["item"]),
            ],
            device=torch.device("cpu"),
        )
        self.query_proj = MLP(in_size=D, layer_sizes=[128, 64])
        self.candidate_proj = MLP(in_size=D, layer_sizes=[128, 64])

    def forward(self, kjt):
        pooled = self.ebc(kjt)
        return self.query_proj(pooled["user"]), self.candidate_proj(pooled["item"])


def kjt(users, items):
    n = len(users)
    return KeyedJaggedTensor.from_lengths_sync(
        keys=["user", "item"],
        values=torch.cat([users, items]),
        lengths=torch.ones(2 * n, dtype=torch.int32),
    )


def run(name):
    model = TwoTower()
    opt = torch.optim.Adagrad(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(2)
    batches = []
    for _ in range(16):
        u = torch.randint(0, USERS, (BATCH,), generator=g)
        i = torch.randint(0, ITEMS, (BATCH,), generator=g)
        y = torch.randint(0, 2, (BATCH,), generator=g).float()
        batches.append((kjt(u, i), y))
    log_q = torch.full((BATCH + 256,), -3.0)

    def step(b):
        features, y = b
        q, c = model(features)
        if name == "pointwise":
            loss = F.binary_cross_entropy_with_logits((q * c).sum(dim=1), y)
        else:
            q, c = F.normalize(q, dim=1), F.normalize(c, dim=1)
            if name == "softmax+256neg":
                # The EBC reads every feature: the negatives' batch has empty user bags.
                neg = torch.randint(0, ITEMS, (256,))
                lengths = torch.cat([torch.zeros(256, dtype=torch.int32), torch.ones(256, dtype=torch.int32)])
                nk = KeyedJaggedTensor.from_lengths_sync(keys=["user", "item"], values=neg, lengths=lengths)
                cn = F.normalize(model.candidate_proj(model.ebc(nk)["item"]), dim=1)
                c = torch.cat([c, cn])
            logits = q @ c.T / 0.05 - log_q[: c.shape[0]]
            loss = F.cross_entropy(logits, torch.arange(q.shape[0]))
        opt.zero_grad()
        loss.backward()
        opt.step()

    for k in range(20):
        step(batches[k % 16])
    rates = []
    for _ in range(5):
        t = time.perf_counter()
        for k in range(50):
            step(batches[k % 16])
        rates.append(50 * BATCH / (time.perf_counter() - t))
    print(f"torchrec two_tower {name}: {sorted(rates)[2]:.0f} pairs/s")


print(f"TorchRec TwoTower training, CPU, torch {torch.__version__}, torchrec {torchrec.__version__}, 2 threads, batch {BATCH}")
for name in ["pointwise", "softmax", "softmax+256neg"]:
    run(name)
