#!/usr/bin/env bash
# embers' FP32 TBE forward vs torch.nn.EmbeddingBag, side by side in one run, on shapes beyond
# FBGEMM's default (tbe.sh covers that one with every op): D=64 and D=256, E=1e7, each with
# uniform and Zipf(1.15) ids. Each shape: the peer, embers, the peer again (drift check).
# Usage: benches/peers/tbe_shapes.sh ["T B D E L" ...]   (default: the shapes below)
source "$(dirname "$0")/common.sh" tbe
if (($#)); then SHAPES=("$@"); else
  SHAPES=("32 512 64 100000 20" "32 512 256 100000 20" "2 4096 128 10000000 20")
fi
for shape in "${SHAPES[@]}"; do
  tag=${shape// /_}
  echo "== T B D E L = $shape"
  "$PY" benches/peers/tbe_forward.py $shape > "$OUT/peer1_$tag.txt"
  EMBERS_TBE_QUICK=1 EMBERS_TBE_FORWARD_ONLY=1 EMBERS_TBE_SHAPE="$shape" \
    cargo bench --bench tbe -- --noplot > "$OUT/embers_$tag.txt" 2>&1
  "$PY" benches/peers/tbe_forward.py $shape > "$OUT/peer2_$tag.txt"
  sed -n '/memory limit/,/^fraction/p' "$OUT/embers_$tag.txt" | head -3
  "$PY" - "$OUT" "$tag" <<'PYEOF'
import re, sys, pathlib
out, tag = pathlib.Path(sys.argv[1]), sys.argv[2]
def times(path):
    t = {}
    for line in (out / path).read_text().splitlines():
        m = re.match(r"\s*(.+?)\s+([0-9.]+) ms", line)
        if m:
            t[m.group(1).strip()] = float(m.group(2))
    return t
p1, p2, e = times(f"peer1_{tag}.txt"), times(f"peer2_{tag}.txt"), times(f"embers_{tag}.txt")
for dist in ["uniform", "zipf1.15"]:
    pk, ek = f"torch EmbeddingBag x T fwd {dist}", f"embers fp32 fwd {dist}"
    if pk not in p1 or ek not in e:
        print(f"  {dist}: missing measurement"); continue
    peer = (p1[pk] + p2.get(pk, p1[pk])) / 2
    r = peer / e[ek]
    print(f"  fp32 fwd {dist:9s} nn.EmbeddingBag {peer:8.2f} ms ({p1[pk]:.2f}/{p2.get(pk, float('nan')):.2f})  "
          f"embers {e[ek]:8.2f} ms  ratio {r:5.2f}x  target >= 1.3x  {'OK' if r >= 1.3 else 'BELOW'}")
PYEOF
  grep -E "embers fp32 fwd (uniform|zipf)|transparent huge" "$OUT/embers_$tag.txt" | grep -E "% of the limit|huge" || true
done
