#!/usr/bin/env bash
# Fetches MovieLens-100K (RecBole's atomic files, shipped inside the PyPI package recbole==1.2.1)
# into a cache directory and prints that directory. The data's licence forbids redistribution:
# never commit it.
# Usage: dir=$(datasets/scripts/movielens-100k.sh)
#        cargo run --release --example dlrm -- --data movielens \
#            --path "$dir/ml-100k.inter" --items-path "$dir/ml-100k.item" --table-cap 2000
set -euo pipefail
CACHE=${EMBERS_DATA_CACHE:-$HOME/.cache/embers-data}
DIR="$CACHE/ml-100k"
if [[ ! -s "$DIR/ml-100k.inter" || ! -s "$DIR/ml-100k.item" ]]; then
  mkdir -p "$CACHE/wheel" "$DIR"
  python3 -m pip download --quiet --no-deps recbole==1.2.1 -d "$CACHE/wheel" >&2
  python3 - "$CACHE/wheel" "$DIR" <<'PY'
import glob, sys, zipfile
wheel = glob.glob(sys.argv[1] + "/recbole-1.2.1-*.whl")[0]
with zipfile.ZipFile(wheel) as z:
    for name in ("ml-100k.inter", "ml-100k.item"):
        data = z.read("recbole/dataset_example/ml-100k/" + name)
        with open(f"{sys.argv[2]}/{name}", "wb") as f:
            f.write(data)
PY
fi
echo "$DIR"
