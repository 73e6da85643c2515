#!/usr/bin/env bash
# Side by side, in one run: TorchRec's DistributedModelParallel (torchrun, gloo, table-wise) on 1
# and 2 CPU processes (benches/peers/dist_dlrm.py) and embers' sharded DLRM under mpiexec
# (benches/dist_dlrm.rs) on the same model, one thread per rank; TorchRec again (drift check).
# Usage: benches/peers/dist_dlrm.sh   Env: PEERS_PYTHON, EMBERS_DIST_BENCH_WORLDS (default 1,2).
source "$(dirname "$0")/common.sh" "dist_dlrm --features mpi"
TORCHRUN="$(dirname "$PY")/torchrun"
torchrec() {
  for w in 1 2; do
    OMP_NUM_THREADS=1 "$TORCHRUN" --nproc_per_node "$w" --master_port $((29600 + w)) \
      benches/peers/dist_dlrm.py 512 20 100000 2>&1 | grep "^torchrec DMP"
  done
}
echo "== TorchRec DMP"
torchrec | tee "$OUT/torchrec.txt"
echo "== embers"
EMBERS_DIST_BENCH_WORLDS=${EMBERS_DIST_BENCH_WORLDS:-1,2} cargo bench --features mpi --bench dist_dlrm 2>&1 \
  | sed -n '/== embers/,$p' | tee "$OUT/embers.txt"
echo "== TorchRec DMP again (drift check)"
torchrec | tee "$OUT/torchrec2.txt"
