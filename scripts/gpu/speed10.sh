#!/usr/bin/env bash
# One short call, text made while the next step runs (overlap_text): GPU decode vs
# llama-batched-bench over 5 rounds; N=48 at caps 8 and 16 beside llama-server -np 8 and our
# HTTP server at cap 16, 3 runs each.
set -uo pipefail
M=synthetic:qwen2.5-0.5b:${QUANT:-q8_0}
T0=$SECONDS
stamp() { echo "== $1 ($((SECONDS - T0)) s)"; }
P=$(python3 -c "import sys; sys.path.insert(0,'.'); import engine; from engine.model import resolve_model; print(resolve_model('$M'))")
stamp "GPU decode vs batched-bench, 5 rounds"
python3 -m app bench overhead --model "$M" --device gpu --threads 8 --batches 1,4,8,16,32 \
  --batched-bench "$LCBIN/llama-batched-bench" --no-llama --repeats 5 2>&1 | tail -7 | tee "$OUT/overhead_gpu.txt"
python3 -m app serve --model "$M" --backend gpu:cap=16,ctx=32768,threads=8 --port 8095 > /tmp/tandem-serve.log 2>&1 &
SERVE=$!
$LCBIN/llama-server -m "$P" -ngl 99 -np 8 -c 16384 -kvu --port 8092 --host 127.0.0.1 -fa auto > /tmp/llama-server-np8.log 2>&1 &
LS8=$!
trap 'kill $SERVE $LS8 2>/dev/null' EXIT
for port in 8095 8092; do
  for i in $(seq 300); do curl -sf "http://127.0.0.1:$port/health" >/dev/null && break; sleep 0.2; done
done
stamp "N=48 at GPU caps 8/16, llama-server -np 8, tandem serve cap 16"
python3 -X faulthandler -m app bench grid --model "$M" --backend gpu:cap=8,ctx=32768,threads=8 --backend cpu:cap=4,threads=15 \
  --requests 48 --runs 3 --shared 96 --outputs fixed --arrivals interval --caps 16 \
  --sweep-policies gpu-only --policies gpu-only \
  --target llama-server-np8=http://127.0.0.1:8092 --target tandem-serve-cap16=http://127.0.0.1:8095 --target-warm 4 \
  --no-plots --out "$OUT/n48" 2>&1 | grep -v "it/s\]" | tail -14
stamp done
