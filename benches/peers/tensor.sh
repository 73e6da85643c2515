#!/usr/bin/env bash
# Side-by-side: embers' tensor-core bench and PyTorch CPU (benches/peers/matmul.py) in one run.
# Usage: benches/peers/tensor.sh   (from the repository root; installs the peers venv if needed)
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=$(benches/peers/setup.sh)
echo "== PyTorch CPU (2 threads)"
"$PY" benches/peers/matmul.py
echo "== embers"
cargo bench --bench tensor -- --noplot 2>&1 | grep -E "^[a-zA-Z].*|time:" | grep -B1 "time:"
echo "== PyTorch CPU again (drift check)"
"$PY" benches/peers/matmul.py
