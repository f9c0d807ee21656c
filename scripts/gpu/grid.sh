#!/usr/bin/env bash
# The grid on the GPU machine (called through call.sh): first the GPU's KV budget (room for
# 4, 8, 16 whole sequences; GPU cap 64 so memory binds), then the unconstrained grid at the best
# GPU cap (shared prefix 0/50 %, fixed vs uniform outputs, interval vs Poisson arrivals).
set -uo pipefail
M=synthetic:qwen2.5-0.5b:${QUANT:-q8_0}
T0=$SECONDS
stamp() { echo "== $1 ($((SECONDS - T0)) s)"; }
python3 -m app calibrate --list 2>&1 | tail -3
stamp "KV budgets"
python3 -X faulthandler -m app bench grid --model "$M" --backend gpu:cap=64,threads=8 --backend cpu:cap=4,threads=15 \
  --requests 48 --runs ${RUNS:-2} --shared 0,96 --outputs fixed --arrivals interval --caps none \
  --policies gpu-only,seed-score,predicted-finish --kv-seqs ${KV:-4,8,16} --no-plots --out "$OUT/grid-kv" 2>&1 \
  | grep -v "it/s\]" | tail -60
stamp "unconstrained, GPU cap ${GPU_CAP:-16}"
python3 -X faulthandler -m app bench grid --model "$M" --backend gpu:cap=${GPU_CAP:-16},ctx=16384,threads=8 \
  --backend cpu:cap=4,threads=15 --requests 48 --runs ${RUNS:-2} --shared 0,50 --outputs fixed,uniform \
  --arrivals interval,poisson --caps none --policies gpu-only,seed-score,predicted-finish --no-plots \
  --out "$OUT/grid-open" 2>&1 | grep -v "it/s\]" | tail -60
stamp done
