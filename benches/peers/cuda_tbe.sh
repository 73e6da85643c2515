#!/usr/bin/env bash
# Side by side on a GPU machine, in one run: torch.nn.EmbeddingBag (benches/peers/cuda_tbe.py,
# the PyTorch installed there), embers' GPU TBE forward (benches/cuda_tbe.rs), PyTorch again,
# then the ratios. Usage: benches/peers/cuda_tbe.sh   Env: PYTHON (default python3);
# EMBERS_CUDA_TBE_BENCH, a prebuilt bench binary (on a GPU machine without cargo, see
# .ci/gpu-check), instead of `cargo bench`.
PEERS_PYTHON=${PYTHON:-$(command -v python3)}
if [[ -n "${EMBERS_CUDA_TBE_BENCH:-}" ]]; then
  set -euo pipefail
  cd "$(dirname "$0")/../.."
  PY=$PEERS_PYTHON
  OUT=$(mktemp -d)
  trap 'rm -rf "$OUT"' EXIT
  bench() { "$EMBERS_CUDA_TBE_BENCH"; }
else
  source "$(dirname "$0")/common.sh" cuda_tbe
  bench() { cargo bench --bench cuda_tbe; }
fi
echo "== torch.nn.EmbeddingBag (CUDA)"
"$PY" benches/peers/cuda_tbe.py | tee "$OUT/torch.txt"
echo "== embers"
bench 2>&1 | grep -E "skipped|bandwidth|embers" | tee "$OUT/embers.txt"
echo "== torch.nn.EmbeddingBag again (drift check)"
"$PY" benches/peers/cuda_tbe.py | tee "$OUT/torch2.txt"
echo "== ratios (torch ms / embers ms; torch = mean of its two runs; target >= 2x)"
"$PY" - "$OUT" <<'PYEOF'
import re, sys, pathlib
out = pathlib.Path(sys.argv[1])
def times(name):
    """Forward lines only: (kernel label or "", T, E) -> ms."""
    t = {}
    for line in (out / name).read_text().splitlines():
        m = re.search(r"fwd (?:\((\w+)\) )?T=(\d+) .*E=(\d+) .*: ([0-9.]+) ms", line)
        if m:
            t[(m.group(1) or "", m.group(2), m.group(3))] = float(m.group(4))
    return t
a, b, e = times("torch.txt"), times("torch2.txt"), times("embers.txt")
for (kernel, T, E), ms in e.items():
    key = ("", T, E)
    if key in a:
        ref = (a[key] + b.get(key, a[key])) / 2
        print(f"T={T} E={E}: torch {ref:.4f} ms, embers ({kernel}) {ms:.4f} ms, {ref / ms:.2f}x")
PYEOF
