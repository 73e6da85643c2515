# Sourced by the side-by-side scripts in benches/peers: moves to the repository root, finds the
# peers' python (PEERS_PYTHON, else the peers venv, else benches/peers/setup.sh installs it),
# makes a scratch directory $OUT removed on exit, and builds bench $1 before anything is timed.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
PY=${PEERS_PYTHON:-$HOME/.cache/embers-peers/venv/bin/python}
if [[ ! -x "$PY" ]]; then PY=$(benches/peers/setup.sh); fi
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT
cargo bench --bench $1 --no-run >/dev/null 2>&1 || cargo bench --bench $1 --no-run
