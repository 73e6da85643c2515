#!/usr/bin/env bash
# embers-serve under load (benches/serve_load.rs, INT8 and FP32 tables) beside the same model in
# TorchRec/PyTorch eager called per request and per 256-row batch (serve_torch.py), in one run:
# peer, embers, peer again (drift check). Usage: benches/peers/serve.sh [seconds per phase]
source "$(dirname "$0")/common.sh" serve_load
SECS=${1:-3}
"$PY" benches/peers/serve_torch.py "$SECS"
for q in int8 fp32; do
  EMBERS_SERVE_QUANTIZE=$q EMBERS_SERVE_SECS=$SECS cargo bench --bench serve_load 2>/dev/null
done
"$PY" benches/peers/serve_torch.py "$SECS"
