#!/usr/bin/env bash
# Side-by-side: embers' jagged bench and FBGEMM_GPU CPU (benches/peers/jagged.py), same inputs,
# same machine, one run. Usage: benches/peers/jagged.sh   (from the repository root)
#
# Both sides run twice: with glibc's default allocator settings, where every output buffer of
# more than 32 MiB is a fresh mmap whose page faults dominate (and vary with the allocator's
# history), and with MALLOC_MMAP_THRESHOLD_/MALLOC_TRIM_THRESHOLD_ raised so freed buffers are
# reused and the kernels themselves are compared.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PEERS_PYTHON:-$HOME/.cache/embers-peers/venv/bin/python}
cargo bench --bench jagged --no-run >/dev/null 2>&1
run_both() {
    echo "== FBGEMM_GPU CPU (2 threads)"
    "$PY" benches/peers/jagged.py
    echo "== embers"
    cargo bench --bench jagged -- --noplot 2>&1 | grep -E "^[a-zA-Z_].*|time:" | grep -B1 "time:"
}
echo "#### default allocator settings"
run_both
echo "#### buffers reused (MALLOC_MMAP_THRESHOLD_=4294967296 MALLOC_TRIM_THRESHOLD_=8589934592)"
MALLOC_MMAP_THRESHOLD_=4294967296 MALLOC_TRIM_THRESHOLD_=8589934592 run_both
