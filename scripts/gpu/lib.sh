#!/usr/bin/env bash
# Shared steps of the GPU calls (sourced by scripts/gpu/speed*.sh, which call.sh runs).
# Results go under $OUT; M is the model spec, P its file.
set -uo pipefail
M=synthetic:qwen2.5-0.5b:${QUANT:-q8_0}
T0=$SECONDS
P=$(python3 -c "import sys; sys.path.insert(0,'.'); import engine; from engine.model import resolve_model; print(resolve_model('$M'))")
SERVERS=()
trap 'kill "${SERVERS[@]}" 2>/dev/null' EXIT

stamp() { echo "== $1 ($((SECONDS - T0)) s)"; }

gpu_info() {
  nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee "$OUT/gpu.txt"
}

# decode FILE REPEATS BATCHES [bench overhead options...]: our GPU decode vs llama-batched-bench
decode() {
  local file=$1 repeats=$2 batches=$3; shift 3
  stamp "GPU decode vs batched-bench $* ($file)"
  python3 -m app bench overhead --model "$M" --device gpu --threads 8 --batches "$batches" "$@" \
    --batched-bench "$LCBIN/llama-batched-bench" --no-llama --repeats "$repeats" 2>&1 \
    | tail -$((repeats + 2)) | tee "$OUT/$file"
}

# llama_server NP PORT / tandem_server CAP PORT: a peer for `bench grid --target`, in the background
llama_server() {
  "$LCBIN/llama-server" -m "$P" -ngl 99 -np "$1" -c 16384 -kvu --port "$2" --host 127.0.0.1 -fa auto \
    > "/tmp/llama-server-$2.log" 2>&1 &
  SERVERS+=($!)
}
tandem_server() {
  python3 -m app serve --model "$M" --backend "gpu:cap=$1,ctx=32768,threads=8" --port "$2" > "/tmp/tandem-serve-$2.log" 2>&1 &
  SERVERS+=($!)
}
wait_ready() {  # wait_ready PORT...
  for port in "$@"; do
    for _ in $(seq 300); do curl -sf "http://127.0.0.1:$port/health" >/dev/null && break; sleep 0.2; done
  done
}
stop_servers() {
  kill "${SERVERS[@]}" 2>/dev/null
  SERVERS=()
  sleep 2
}

# n48 CAPS RUNS [bench grid options, e.g. --target NAME=URL...]: the study's workload, GPU only,
# cap 8 from the backend spec plus the swept CAPS
n48() {
  local caps=$1 runs=$2; shift 2
  stamp "N=48, GPU caps 8,$caps, $runs runs $*"
  python3 -X faulthandler -m app bench grid --model "$M" --backend gpu:cap=8,ctx=32768,threads=8 \
    --backend cpu:cap=4,threads=15 --requests 48 --runs "$runs" --shared 96 --outputs fixed --arrivals interval \
    --caps "$caps" --sweep-policies gpu-only --policies gpu-only --target-warm 4 "$@" \
    --no-plots --out "$OUT/n48" 2>&1 | grep -v "it/s\]" | tail -18
}

together() {
  stamp "both backends at once"
  python3 -m app bench together --model "$M" --gpu-batch 16 --cpu-batch 4 --gpu-threads 1 --cpu-threads 15 \
    --repeats 3 2>&1 | tail -5 | tee "$OUT/together.txt"
}

cpu15() {
  stamp "CPU decode vs batched-bench, 15 threads"
  python3 -m app bench overhead --model "$M" --device cpu --threads 15 --batches 1,4 \
    --batched-bench "$LCBIN/llama-batched-bench" --no-llama --repeats 2 2>&1 | tail -1 | tee "$OUT/overhead_cpu15.txt"
}

gil() {
  for si in 5 1; do
    stamp "GIL: beside a busy Python thread, switch interval $si ms"
    python3 -m app bench overhead --model "$M" --device gpu --threads 8 --batches 1,16 --busy-thread \
      --switch-interval-ms "$si" --no-llama --repeats 2 2>&1 | tail -1 | tee -a "$OUT/gil_gpu.txt"
  done
}
