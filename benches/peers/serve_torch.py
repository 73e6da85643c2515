"""Reference numbers for benches/serve_load.rs: the DLRM example's default model (26 tables x 1000
rows, D=16, bottom MLP 13-64-32-16, top MLP 64-32-1, dot interaction) as TorchRec's DLRM in
PyTorch eager on the CPU (inference_mode, 2 threads, FP32 tables), called the way a simple Python
server would: once per request (1 row, and 32 rows), and on a simple batch of 256 rows. Each call
builds its KeyedJaggedTensor, as a server must. Ids: Zipf(1.1) over each table, one per feature,
as the synthetic data. Usage: serve_torch.py [seconds per phase]"""
import sys, time, torch, numpy as np
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.models.dlrm import DLRM
torch.set_num_threads(2)
secs = float(sys.argv[1]) if len(sys.argv) > 1 else 3.0
F, E, D = 26, 1000, 16
tables = [EmbeddingBagConfig(name=f"t_cat_{i}", embedding_dim=D, num_embeddings=E, feature_names=[f"cat_{i}"]) for i in range(F)]
model = DLRM(embedding_bag_collection=EmbeddingBagCollection(tables=tables), dense_in_features=13,
             dense_arch_layer_sizes=[64, 32, D], over_arch_layer_sizes=[64, 32, 1]).eval()
rng = np.random.default_rng(0)
ranks = np.arange(1, E + 1, dtype=np.float64); p = ranks ** -1.1; p /= p.sum()
keys = [f"cat_{i}" for i in range(F)]
def request(rows):
    dense = torch.from_numpy(rng.random((rows, 13), dtype=np.float32))
    ids = torch.from_numpy(rng.choice(E, size=F * rows, p=p).astype(np.int64))
    return dense, ids
def call(dense, ids, rows):
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=keys, values=ids, lengths=torch.ones(F * rows, dtype=torch.int32))
    return torch.sigmoid(model(dense, kjt)).squeeze(-1)
with torch.inference_mode():
    for rows in (1, 32, 256):
        inputs = [request(rows) for _ in range(64)]
        for i in range(20):
            call(*inputs[i % 64], rows)
        lat, end, i = [], time.perf_counter() + secs, 0
        while time.perf_counter() < end:
            t = time.perf_counter(); call(*inputs[i % 64], rows); lat.append(time.perf_counter() - t); i += 1
        lat.sort(); q = lambda x: lat[min(len(lat) - 1, int(len(lat) * x))] * 1e3
        print(f"torchrec DLRM eager, {rows}-row calls one at a time: {rows * len(lat) / sum(lat):.0f} rows/s  "
              f"p50 {q(0.5):.3f} ms  p99 {q(0.99):.3f} ms  ({len(lat)} calls)")
