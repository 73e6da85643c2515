#!/usr/bin/env bash
# Side by side, in one run: FBGEMM_GPU CPU's TBE (benches/peers/tbe.py) and embers' TBE bench
# (benches/tbe.rs) at FBGEMM's defaults T=32 B=512 D=128 E=100000 L=20, then the ratios.
# Usage: benches/peers/tbe.sh [--quick] [T B D E L]   (from anywhere; --quick skips criterion's own runs)
# Env: PEERS_PYTHON (default: the peers venv), CARGO_TARGET_DIR as usual.
source "$(dirname "$0")/common.sh" tbe
if [[ "${1:-}" == "--quick" ]]; then export EMBERS_TBE_QUICK=1; shift; fi
# Optional shape: T B D E L (both sides), e.g. `tbe.sh --quick 32 512 64 100000 20`.
SHAPE=("$@")
if ((${#SHAPE[@]})); then export EMBERS_TBE_SHAPE="${SHAPE[*]}"; fi
echo "== FBGEMM_GPU CPU and torch.nn.EmbeddingBag (2 threads)"
"$PY" benches/peers/tbe.py "${SHAPE[@]}" | tee "$OUT/fbgemm.txt"
echo "== embers"
cargo bench --bench tbe -- --noplot 2>&1 | tee "$OUT/embers.txt" | sed -n '/== summary/,$p'
echo "== FBGEMM_GPU CPU and torch.nn.EmbeddingBag again (drift check)"
"$PY" benches/peers/tbe.py "${SHAPE[@]}" | tee "$OUT/fbgemm2.txt"

echo "== ratios (peer ms / embers ms, uniform ids; the peer = mean of its two runs)"
"$PY" - "$OUT" <<'PYEOF'
import re, sys, pathlib
out = pathlib.Path(sys.argv[1])
def times(path):
    t = {}
    for line in (out / path).read_text().splitlines():
        m = re.match(r"\s*(.+?)\s+([0-9.]+) ms", line)
        if m:
            t[m.group(1).strip()] = float(m.group(2))
    return t
f1, f2, e = times("fbgemm.txt"), times("fbgemm2.txt"), times("embers.txt")
pairs = [
    # The peer a CPU user would pick: plain torch.nn.EmbeddingBag (FBGEMM's JIT kernels).
    ("fp32 fwd vs nn.EmbeddingBag", "torch EmbeddingBag x T fwd", "embers fp32 fwd uniform", 1.3),
    ("fp32 train vs nn.EmbeddingBag", "torch EmbeddingBag(sparse) x T fwd+bwd+Adagrad", "embers fp32 fwd+bwd(rwAdagrad) uniform", 5),
    ("fp32 fwd", "fbgemm fp32 fwd", "embers fp32 fwd uniform", 1.15),
    ("fp32 fwd+bwd rowwise Adagrad", "fbgemm fp32 fwd+bwd(rwAdagrad)", "embers fp32 fwd+bwd(rwAdagrad) uniform", 10),
    ("fp16 inference fwd", "fbgemm fp16 inference fwd", "embers fp16 inference fwd uniform", 10),
    ("int8 inference fwd", "fbgemm int8 inference fwd", "embers int8 inference fwd uniform", 10),
    ("int4 inference fwd", "fbgemm int4 inference fwd", "embers int4 inference fwd uniform", 10),
    ("fp8 inference fwd", "fbgemm fp8 inference fwd", "embers fp8 inference fwd uniform", 10),
]
for name, fk, ek, target in pairs:
    if fk not in f1 or ek not in e:
        print(f"{name:32s} missing measurement"); continue
    fb = (f1[fk] + f2.get(fk, f1[fk])) / 2
    r = fb / e[ek]
    print(f"{name:32s} peer {fb:9.2f} ms  embers {e[ek]:8.2f} ms  ratio {r:6.2f}x  target >= {target}x  {'OK' if r >= target else 'BELOW'}")
PYEOF
