#!/usr/bin/env bash
# TorchRec's planner vs embers-plan on the same random table sets (see plan_compare.py).
# Usage: benches/peers/plan_compare.sh [SIZES] [WORLDS] [SEEDS]   default: 100 16,128 1,2,3
# TorchRec's planner takes ~20 s for 100 tables on 16 ranks, ~2 min for 200, over 10 for 500.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
PY=${PEERS_PYTHON:-$HOME/.cache/embers-peers/venv/bin/python}
if [[ ! -x "$PY" ]]; then PY=$(benches/peers/setup.sh); fi
cargo build --release -p embers-planner --bin embers-plan
"$PY" benches/peers/plan_compare.py target/release/embers-plan "${1:-100}" "${2:-16,128}" "${3:-1,2,3}" 2> >(grep -v -e FutureWarning -e 'HeuristicalStorageReservation(' >&2)
