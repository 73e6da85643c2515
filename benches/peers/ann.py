"""Reference numbers for benches/ann.rs: FAISS (faiss-cpu) on the same vectors: IndexFlatL2 and
IndexFlatIP exact search, IndexIVFPQ(nlist=256, m=16, nbits=8) trained with FAISS's defaults (k-means: 10 rounds coarse, 25 per
sub-quantizer),
searched at nprobe 1/4/16/64, 2 threads. Recall@10 against FAISS's own exact search.
Usage: ann.py <dir with base.f32 and queries.f32> [dim]"""
import sys, time, numpy as np, faiss
faiss.omp_set_num_threads(2)
d = int(sys.argv[2]) if len(sys.argv) > 2 else 64
base = np.fromfile(f"{sys.argv[1]}/base.f32", dtype="<f4").reshape(-1, d)
queries = np.fromfile(f"{sys.argv[1]}/queries.f32", dtype="<f4").reshape(-1, d)
n, nq, k = len(base), len(queries), 10
t = time.perf_counter(); flat = faiss.IndexFlatL2(d); flat.add(base); build = time.perf_counter() - t
t = time.perf_counter(); _, truth = flat.search(queries, k); secs = time.perf_counter() - t
print(f"faiss exact (IndexFlatL2)  build {build:.3f} s  {nq / secs:.0f} queries/s  ({2 * n * d * nq / secs / 1e9:.1f} GFLOP/s)")
flat_ip = faiss.IndexFlatIP(d); flat_ip.add(base)
t = time.perf_counter(); flat_ip.search(queries, k); secs = time.perf_counter() - t
print(f"faiss exact inner product (IndexFlatIP)  {nq / secs:.0f} queries/s  ({2 * n * d * nq / secs / 1e9:.1f} GFLOP/s)")
index = faiss.IndexIVFPQ(faiss.IndexFlatL2(d), d, 256, 16, 8)
t = time.perf_counter(); index.train(base); train = time.perf_counter() - t
t = time.perf_counter(); index.add(base); add = time.perf_counter() - t
print(f"faiss ivfpq nlist=256 m=16 nbits=8  train {train:.2f} s  add {add:.2f} s")
for nprobe in (1, 4, 16, 64):
    index.nprobe = nprobe
    t = time.perf_counter(); _, found = index.search(queries, k); secs = time.perf_counter() - t
    recall = np.mean([len(set(found[i]) & set(truth[i])) / k for i in range(nq)])
    print(f"faiss ivfpq nprobe={nprobe:<3} {nq / secs:>9.0f} queries/s  recall@10 {recall:.4f}")
