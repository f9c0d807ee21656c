#!/usr/bin/env bash
# One call (through call.sh): GPU decode vs llama-batched-bench with the fused greedy argmax
# and, in the same call, without it (llama.cpp's per-sequence greedy + logit bias); split KV;
# the study's N=48 workload at GPU caps 16/24/32 beside llama-server -np 4 and -np 8; both
# backends at once (GPU + 15-thread CPU).
set -uo pipefail
M=synthetic:qwen2.5-0.5b:${QUANT:-q8_0}
T0=$SECONDS
stamp() { echo "== $1 ($((SECONDS - T0)) s)"; }
P=$(python3 -c "import sys; sys.path.insert(0,'.'); import engine; from engine.model import resolve_model; print(resolve_model('$M'))")
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,utilization.gpu --format=csv | tee "$OUT/gpu.txt"
stamp "GPU decode vs batched-bench: fused greedy (default)"
python3 -m app bench overhead --model "$M" --device gpu --threads 8 --batches 1,4,8,16,32 \
  --batched-bench "$LCBIN/llama-batched-bench" --no-llama --repeats 3 2>&1 | tail -5 | tee "$OUT/overhead_gpu.txt"
stamp "GPU decode vs batched-bench: llama.cpp's greedy per sequence (before)"
python3 -m app bench overhead --model "$M" --device gpu --threads 8 --batches 1,4,16,32 --no-fused-greedy \
  --batched-bench "$LCBIN/llama-batched-bench" --no-llama --repeats 2 2>&1 | tail -4 | tee "$OUT/overhead_gpu_unfused.txt"
stamp "GPU decode, split KV"
python3 -m app bench overhead --model "$M" --device gpu --threads 8 --batches 1,4,16,32 --kv split \
  --batched-bench "$LCBIN/llama-batched-bench" --no-llama --repeats 2 2>&1 | tail -4 | tee "$OUT/overhead_gpu_split.txt"
$LCBIN/llama-server -m "$P" -ngl 99 -np 8 -c 16384 -kvu --port 8092 --host 127.0.0.1 -fa auto > /tmp/llama-server-np8.log 2>&1 &
LS8=$!
$LCBIN/llama-server -m "$P" -ngl 99 -np 4 -c 16384 -kvu --port 8094 --host 127.0.0.1 -fa auto > /tmp/llama-server-np4.log 2>&1 &
LS4=$!
trap 'kill $LS8 $LS4 2>/dev/null' EXIT
for port in 8092 8094; do
  for i in $(seq 300); do curl -sf "http://127.0.0.1:$port/health" >/dev/null && break; sleep 0.2; done
done
stamp "N=48 at GPU caps 16/24/32, llama-server -np 4 and -np 8"
python3 -X faulthandler -m app bench grid --model "$M" --backend gpu:cap=8,ctx=32768,threads=8 --backend cpu:cap=4,threads=15 \
  --requests 48 --runs 3 --shared 96 --outputs fixed --arrivals interval --caps 16,24,32 \
  --sweep-policies gpu-only --policies gpu-only \
  --target llama-server-np8=http://127.0.0.1:8092 --target llama-server-np4=http://127.0.0.1:8094 --target-warm 4 \
  --no-plots --out "$OUT/n48" 2>&1 | grep -v "it/s\]" | tail -16
kill $LS8 $LS4 2>/dev/null
stamp "both backends at once"
python3 -m app bench together --model "$M" --gpu-batch 16 --cpu-batch 4 --gpu-threads 1 --cpu-threads 15 \
  --repeats 3 2>&1 | tail -5 | tee "$OUT/together.txt"
stamp done
