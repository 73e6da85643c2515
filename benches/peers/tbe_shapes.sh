#!/usr/bin/env bash
# embers' FP32 TBE forward vs torch.nn.EmbeddingBag, side by side, on shapes beyond FBGEMM's
# default (tbe.sh covers that one with every op): D=64 and D=256, E=1e7, each with uniform and
# Zipf(1.15) ids. Each shape runs ROUNDS rounds (default 4) of the peer then embers, alternating,
# each process a median of 20 calls; the ratio is of the medians over rounds, and every round's
# figure is printed too: on a shared 2-core VM one process can run 2x slower than the next.
# Beside each ratio: the gather roofline of the same id trace (the time just to read its rows,
# measured by the embers bench) and each side's fraction of it, so a ratio that no kernel could
# reach shows as such.
# Usage: ROUNDS=n benches/peers/tbe_shapes.sh ["T B D E L" ...]   (default: the shapes below)
source "$(dirname "$0")/common.sh" tbe
ROUNDS=${ROUNDS:-4}
if (($#)); then SHAPES=("$@"); else
  SHAPES=("32 512 64 100000 20" "32 512 256 100000 20" "2 4096 128 10000000 20")
fi
for shape in "${SHAPES[@]}"; do
  tag=${shape// /_}
  echo "== T B D E L = $shape ($ROUNDS rounds: peer, embers)"
  for r in $(seq "$ROUNDS"); do
    "$PY" benches/peers/tbe_forward.py $shape > "$OUT/peer${r}_$tag.txt"
    EMBERS_TBE_QUICK=1 EMBERS_TBE_FORWARD_ONLY=1 EMBERS_TBE_SHAPE="$shape" \
      cargo bench --bench tbe -- --noplot > "$OUT/embers${r}_$tag.txt" 2>&1
  done
  grep -E "^memory limit" "$OUT/embers1_$tag.txt" || true
  "$PY" - "$OUT" "$tag" "$ROUNDS" <<'PYEOF'
import re, sys, pathlib, statistics
out, tag, rounds = pathlib.Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
def times(path):
    t = {}
    for line in (out / path).read_text().splitlines():
        m = re.match(r"\s*(.+?)\s+([0-9.]+) ms", line)
        if m:
            t[m.group(1).strip()] = float(m.group(2))
    return t
runs = [(times(f"peer{r}_{tag}.txt"), times(f"embers{r}_{tag}.txt")) for r in range(1, rounds + 1)]
def roof(path, dist):
    m = re.search(rf"gather roofline, fp32 rows, {re.escape(dist)} ids: ([0-9.]+) ms", (out / path).read_text())
    return float(m.group(1)) if m else None
for dist in ["uniform", "zipf1.15"]:
    pk, ek = f"torch EmbeddingBag x T fwd {dist}", f"embers fp32 fwd {dist}"
    peer = [p[pk] for p, _ in runs if pk in p]
    emb = [e[ek] for _, e in runs if ek in e]
    if len(peer) < rounds or len(emb) < rounds:
        print(f"  {dist}: missing measurement"); continue
    pm, em = statistics.median(peer), statistics.median(emb)
    r = pm / em
    fmt = lambda xs: "/".join(f"{x:.2f}" for x in xs)
    print(f"  fp32 fwd {dist:9s} nn.EmbeddingBag {pm:7.2f} ms ({fmt(peer)})  embers {em:7.2f} ms "
          f"({fmt(emb)})  ratio {r:5.2f}x  target >= 1.3x  {'OK' if r >= 1.3 else 'BELOW'}")
    # The gather roofline of the same trace (benches/tbe.rs, measured in each embers process):
    # the fastest any kernel could read these rows. Each side's median over it is the fraction
    # of the memory system it uses; the best ratio still possible is the roofline over the peer.
    roofs = [x for x in (roof(f"embers{r}_{tag}.txt", dist) for r in range(1, rounds + 1)) if x]
    if len(roofs) == rounds:
        rm = statistics.median(roofs)
        print(f"    gather roofline {rm:7.2f} ms ({fmt(roofs)}): nn.EmbeddingBag at {100 * rm / pm:3.0f}%, "
              f"embers at {100 * rm / em:3.0f}%; the roofline leaves room for at most {pm / rm:4.2f}x over the peer")
PYEOF
  grep -E "transparent huge" "$OUT/embers1_$tag.txt" || true
done
