#!/usr/bin/env bash
# One call (through call.sh), the engine as it stands at the end of the engine-speed work:
# GPU decode vs llama-batched-bench over 5 rounds, then llama.cpp's per-sequence greedy in
# the same call; the study's N=48 workload (caps 8/16/32, llama-server -np 8, our HTTP server
# at caps 16 and 32, 5 runs each); the GIL beside a busy Python thread.
set -uo pipefail
M=synthetic:qwen2.5-0.5b:${QUANT:-q8_0}
T0=$SECONDS
stamp() { echo "== $1 ($((SECONDS - T0)) s)"; }
P=$(python3 -c "import sys; sys.path.insert(0,'.'); import engine; from engine.model import resolve_model; print(resolve_model('$M'))")
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee "$OUT/gpu.txt"
stamp "GPU decode vs batched-bench, 5 rounds"
python3 -m app bench overhead --model "$M" --device gpu --threads 8 --batches 1,4,8,16,32 \
  --batched-bench "$LCBIN/llama-batched-bench" --no-llama --repeats 5 2>&1 | tail -7 | tee "$OUT/overhead_gpu.txt"
stamp "GPU decode, llama.cpp's greedy per sequence (before)"
python3 -m app bench overhead --model "$M" --device gpu --threads 8 --batches 1,4,16,32 --no-fused-greedy \
  --batched-bench "$LCBIN/llama-batched-bench" --no-llama --repeats 2 2>&1 | tail -4 | tee "$OUT/overhead_gpu_unfused.txt"
python3 -m app serve --model "$M" --backend gpu:cap=16,ctx=32768,threads=8 --port 8095 > /tmp/tandem-serve.log 2>&1 &
SERVE=$!
python3 -m app serve --model "$M" --backend gpu:cap=32,ctx=32768,threads=8 --port 8096 > /tmp/tandem-serve32.log 2>&1 &
SERVE32=$!
$LCBIN/llama-server -m "$P" -ngl 99 -np 8 -c 16384 -kvu --port 8092 --host 127.0.0.1 -fa auto > /tmp/llama-server-np8.log 2>&1 &
LS8=$!
trap 'kill $SERVE $SERVE32 $LS8 2>/dev/null' EXIT
for port in 8095 8096 8092; do
  for i in $(seq 300); do curl -sf "http://127.0.0.1:$port/health" >/dev/null && break; sleep 0.2; done
done
stamp "N=48 at GPU caps 8 (the spec)/16/32, llama-server -np 8, tandem serve caps 16 and 32"
python3 -X faulthandler -m app bench grid --model "$M" --backend gpu:cap=8,ctx=32768,threads=8 --backend cpu:cap=4,threads=15 \
  --requests 48 --runs 5 --shared 96 --outputs fixed --arrivals interval --caps 16,32 \
  --sweep-policies gpu-only --policies gpu-only \
  --target llama-server-np8=http://127.0.0.1:8092 --target tandem-serve-cap16=http://127.0.0.1:8095 \
  --target tandem-serve-cap32=http://127.0.0.1:8096 --target-warm 4 \
  --no-plots --out "$OUT/n48" 2>&1 | grep -v "it/s\]" | tail -16
kill $SERVE $SERVE32 $LS8 2>/dev/null
sleep 2
for si in 5 1; do
  stamp "GIL: beside a busy Python thread, switch interval $si ms"
  python3 -m app bench overhead --model "$M" --device gpu --threads 8 --batches 1,16 --busy-thread \
    --switch-interval-ms $si --no-llama --repeats 2 2>&1 | tail -1 | tee -a "$OUT/gil_gpu.txt"
done
stamp done
