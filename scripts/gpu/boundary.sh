#!/usr/bin/env bash
# Where hybrid routing starts to pay (called through call.sh): the GPU's KV budget holds 4
# sequences and the backlog grows past what the CPU needs for one request (~3 s here) — more
# requests, or faster arrivals, than the N=48 grid.
set -uo pipefail
M=synthetic:qwen2.5-0.5b:${QUANT:-q8_0}
T0=$SECONDS
stamp() { echo "== $1 ($((SECONDS - T0)) s)"; }
for load in "96 20" "192 50"; do
  set -- $load
  stamp "KV budget 4, shared 0 %, N=$1 every $2 ms"
  python3 -X faulthandler -m app bench grid --model "$M" --backend gpu:cap=64,threads=8 --backend cpu:cap=4,threads=15 \
    --requests $1 --interval-ms $2 --runs ${RUNS:-2} --shared 0 --outputs fixed --arrivals interval --caps none \
    --policies gpu-only,seed-score,predicted-finish --kv-seqs 4 --warmup 0 --no-plots --out "$OUT/boundary-n$1-i$2" 2>&1 \
    | grep -v "it/s\]" | tail -16
done
stamp done
