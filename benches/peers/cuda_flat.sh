#!/usr/bin/env bash
# Side by side on a GPU machine, in one run: exact top-k search in PyTorch
# (benches/peers/cuda_flat.py, the PyTorch installed there), embers' GPU FlatIndex
# (benches/cuda_flat.rs), PyTorch again, then the ratios. Usage: benches/peers/cuda_flat.sh
# Env: PYTHON (default python3); EMBERS_CUDA_FLAT_BENCH, a prebuilt bench binary (on a GPU
# machine without cargo, see .ci/gpu-check), instead of `cargo bench`.
PEERS_PYTHON=${PYTHON:-$(command -v python3)}
if [[ -n "${EMBERS_CUDA_FLAT_BENCH:-}" ]]; then
  set -euo pipefail
  cd "$(dirname "$0")/../.."
  PY=$PEERS_PYTHON
  OUT=$(mktemp -d)
  trap 'rm -rf "$OUT"' EXIT
  bench() { "$EMBERS_CUDA_FLAT_BENCH"; }
else
  source "$(dirname "$0")/common.sh" cuda_flat
  bench() { cargo bench --bench cuda_flat; }
fi
echo "== PyTorch: torch.topk(q @ b.T)"
"$PY" benches/peers/cuda_flat.py | tee "$OUT/torch.txt"
echo "== embers FlatIndex on the GPU"
bench 2>&1 | tee "$OUT/embers.txt"
echo "== PyTorch again (drift check)"
"$PY" benches/peers/cuda_flat.py | tee "$OUT/torch2.txt"
echo "== ratios (torch ms / embers ms; torch = mean of its two runs)"
"$PY" - "$OUT" <<'PYEOF'
import re, sys, pathlib
out = pathlib.Path(sys.argv[1])
def times(name):
    t = {}
    for line in (out / name).read_text().splitlines():
        m = re.search(r"flat (nb=\d+ d=\d+ nq=\d+ k=\d+): ([0-9.]+) ms", line)
        if m:
            t[m.group(1)] = float(m.group(2))
    return t
a, b, e = times("torch.txt"), times("torch2.txt"), times("embers.txt")
for case, ms in e.items():
    if case in a:
        ref = (a[case] + b.get(case, a[case])) / 2
        print(f"{case}: torch {ref:.2f} ms, embers {ms:.2f} ms, {ref / ms:.2f}x")
PYEOF
