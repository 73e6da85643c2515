#!/usr/bin/env bash
# embers' exact and IVF-PQ search beside FAISS (faiss-cpu) on the same vectors, in one run:
# FAISS, embers, FAISS again (drift check). Usage: benches/peers/ann.sh
source "$(dirname "$0")/common.sh" ann
EMBERS_ANN_DUMP="$OUT" cargo bench --bench ann 2>/dev/null
"$PY" benches/peers/ann.py "$OUT"
cargo bench --bench ann 2>/dev/null
"$PY" benches/peers/ann.py "$OUT"
