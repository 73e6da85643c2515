#!/usr/bin/env bash
# TwoTower training throughput beside TorchRec's TwoTower (CPU), in one run: TorchRec, embers,
# TorchRec again (drift check), then the ratios. Usage: benches/peers/two_tower.sh
source "$(dirname "$0")/common.sh" two_tower
"$PY" benches/peers/two_tower.py | tee "$OUT/torch.txt"
cargo bench --bench two_tower 2>/dev/null | tee "$OUT/embers.txt"
"$PY" benches/peers/two_tower.py | tee "$OUT/torch2.txt"
"$PY" - "$OUT" <<'PYEOF'
import re, sys, pathlib
out = pathlib.Path(sys.argv[1])
def rates(name):
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"two_tower (\S+): (\d+) pairs/s", (out / name).read_text())}
a, b, e = rates("torch.txt"), rates("torch2.txt"), rates("embers.txt")
for k, v in e.items():
    if k in a:
        ref = (a[k] + b.get(k, a[k])) / 2
        print(f"{k}: TorchRec {ref:,.0f} pairs/s, embers {v:,.0f} pairs/s, {v / ref:.2f}x")
PYEOF
