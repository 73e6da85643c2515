#!/usr/bin/env bash
# Side by side, in one run: TorchRec's DLRM training on CPU (benches/peers/dlrm.py:
# DistributedModelParallel, fused row-wise Adagrad on the tables, Adagrad on the dense half) and
# embers' (benches/dlrm.rs) in the same configuration, TorchRec again, then the ratio.
# Usage: benches/peers/dlrm.sh [--quick]   (--quick skips criterion's own runs)
# Env: PEERS_PYTHON (default: the peers venv), CARGO_TARGET_DIR as usual.
source "$(dirname "$0")/common.sh" dlrm
if [[ "${1:-}" == "--quick" ]]; then export EMBERS_DLRM_QUICK=1; fi
peak() { /usr/bin/time -f "peak RSS %M KiB" "$@"; }
echo "== TorchRec (2 threads)"
peak "$PY" benches/peers/dlrm.py 2>&1 | grep -v "^ *[│|]\|^$\|plan" | tee "$OUT/torchrec.txt"
echo "== embers"
cargo bench --bench dlrm -- --noplot 2>&1 | tee "$OUT/embers.txt" | sed -n '/== summary/,$p'
echo "== TorchRec again (drift check)"
peak "$PY" benches/peers/dlrm.py 2>&1 | grep -v "^ *[│|]\|^$\|plan" | tee "$OUT/torchrec2.txt"

echo "== ratio (samples/s embers / TorchRec, TorchRec = mean of its two runs; target >= 20x)"
"$PY" - "$OUT" <<'PYEOF'
import re, sys, pathlib
out = pathlib.Path(sys.argv[1])
def rate(name):
    m = re.search(r"([0-9,]+) samples/s", (out / name).read_text())
    return float(m.group(1).replace(",", ""))
t = (rate("torchrec.txt") + rate("torchrec2.txt")) / 2
e = rate("embers.txt")
print(f"TorchRec {t:,.0f} samples/s, embers {e:,.0f} samples/s: {e / t:.1f}x")
PYEOF
