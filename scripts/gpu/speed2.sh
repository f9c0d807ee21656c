#!/usr/bin/env bash
# Engine speed on the GPU machine (called through call.sh): decode vs llama-batched-bench with
# unified and split KV, the GIL's cost beside a busy Python thread, then the study's N=48
# workload over the GPU cap sweep beside llama-server (-np 8, its best) and our own server.
set -uo pipefail
M=synthetic:qwen2.5-0.5b:${QUANT:-q8_0}
T0=$SECONDS
stamp() { echo "== $1 ($((SECONDS - T0)) s)"; }
P=$(python3 -c "import sys; sys.path.insert(0,'.'); import engine; from engine.model import resolve_model; print(resolve_model('$M'))")
for kv in unified split; do
  stamp "GPU decode vs batched-bench, $kv KV"
  python3 -m app bench overhead --model "$M" --device gpu --threads 8 --batches 1,4,8,16,32 --kv $kv \
    --batched-bench "$LCBIN/llama-batched-bench" --no-llama --repeats 3 2>&1 | tail -5 | tee "$OUT/overhead_gpu_$kv.txt"
done
for si in 5 1; do
  stamp "GIL: beside a busy Python thread, switch interval $si ms"
  python3 -m app bench overhead --model "$M" --device gpu --threads 8 --batches 1,16 --busy-thread \
    --switch-interval-ms $si --no-llama --repeats 2 2>&1 | tail -1 | tee -a "$OUT/gil_gpu.txt"
done
stamp "CPU: 8 threads vs batched-bench; 15 threads without OpenBLAS's thread pool"
python3 -m app bench overhead --model "$M" --device cpu --threads 8 --batches 1 \
  --batched-bench "$LCBIN/llama-batched-bench" --no-llama --repeats 1 2>&1 | tail -1 | tee -a "$OUT/cpu_variants.txt"
OPENBLAS_NUM_THREADS=1 python3 -m app bench overhead --model "$M" --device cpu --threads 15 --batches 1 --no-llama \
  --repeats 1 2>&1 | tail -1 | sed 's/^/OPENBLAS_NUM_THREADS=1: /' | tee -a "$OUT/cpu_variants.txt"
nproc; lscpu | grep -E "^(Thread|Core|Socket|Model name)" | tee -a "$OUT/cpu_variants.txt"
stamp "our server (GPU cap 16) for the served-path comparison"
python3 -m app serve --model "$M" --backend gpu:cap=16,ctx=16384,threads=8 --port 8095 > /tmp/tandem-serve.log 2>&1 &
SERVE=$!
$LCBIN/llama-server -m "$P" -ngl 99 -np 8 -c 16384 -kvu --port 8092 --host 127.0.0.1 -fa auto > /tmp/llama-server-np8.log 2>&1 &
LS=$!
trap 'kill $SERVE $LS 2>/dev/null' EXIT
for port in 8095 8092; do
  for i in $(seq 300); do curl -sf "http://127.0.0.1:$port/health" >/dev/null && break; sleep 0.2; done
done
stamp "N=48 over the GPU cap sweep"
python3 -X faulthandler -m app bench grid --model "$M" --backend gpu:cap=4,ctx=16384,threads=8 --backend cpu:cap=4,threads=15 \
  --requests 48 --runs ${RUNS:-2} --shared 96 --outputs fixed --arrivals interval --caps ${CAPS:-1,2,4,8,16,32,64} \
  --sweep-policies gpu-only,predicted-finish --policies gpu-only \
  --target llama-server-np8=http://127.0.0.1:8092 --target tandem-serve-cap16=http://127.0.0.1:8095 --target-warm 4 \
  --no-plots --out "$OUT/sweep" 2>&1 | grep -v "it/s\]" | tail -40
tail -5 /tmp/tandem-serve.log
stamp done
