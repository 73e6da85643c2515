"""torch.nn.EmbeddingBag forward only (the CPU peer of embers' FP32 TBE forward), uniform and
Zipf(1.15) ids, for shapes whose FBGEMM training or quantized copies would not fit beside the
tables (tbe.py measures those at the default shape).
Ids follow benches/tbe.rs: uniform over 0..E, or Zipf ranks 1..E (P(k) ∝ k^-1.15) scattered over
the rows by the same multiplicative hash, so hot rows are not neighbours.
Usage: python tbe_forward.py T B D E L [threads]"""
import sys, time, torch, numpy as np

T, B, D, E, L = [int(x) for x in sys.argv[1:6]]
threads = int(sys.argv[6]) if len(sys.argv) > 6 else 2
torch.set_num_threads(threads)
rng = np.random.default_rng(0)
n = T * B * L

def bench(fn, iters=20):
    fn(); fn()
    ts = []
    for _ in range(iters):
        t = time.perf_counter(); fn(); ts.append(time.perf_counter() - t)
    return float(np.median(ts))

def report(name, sec):
    read = T * B * L * D * 4
    out = T * B * D * 4
    print(f"{name:28s} {sec*1e3:9.2f} ms  {(read+out)/sec/1e9:7.2f} GB/s  {T*B*L/sec/1e6:8.1f} Mlookups/s")

uniform = rng.integers(0, E, n, dtype=np.int64)
weights = np.arange(1, E + 1, dtype=np.float64) ** -1.15
cdf = np.cumsum(weights); cdf /= cdf[-1]
ranks = np.minimum(np.searchsorted(cdf, rng.random(n)), E - 1).astype(np.uint64)  # rank - 1
with np.errstate(over="ignore"):
    zipf = ((ranks * np.uint64(0x9E3779B97F4A7C15)) % np.uint64(E)).astype(np.int64)
del weights, cdf, ranks

bags = []
for _ in range(T):
    bag = torch.nn.EmbeddingBag(E, D, mode="sum")
    bags.append(bag)
off = torch.arange(0, B * L, L)
with torch.no_grad():
    for name, ids in [("uniform", uniform), ("zipf1.15", zipf)]:
        idx = torch.from_numpy(ids).view(T, B * L)
        report(f"torch EmbeddingBag x T fwd {name}", bench(lambda: [bags[t](idx[t], off) for t in range(T)]))
