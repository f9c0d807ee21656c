#!/usr/bin/env bash
# On the GPU machine after `source .gpukit/enter.sh`: the study re-created (hybrid vs GPU-only,
# N = 4, 8, 48, 3 runs) with llama-server beside it, then the GPU cap sweep with every policy.
#   STAGE=study|sweep|grid|together  QUANT=q8_0|q4_k_m
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export TANDEM_CACHE_DIR=${TANDEM_CACHE_DIR:-/tmp/tandem-cache}
Q=${QUANT:-q8_0}
M=synthetic:qwen2.5-0.5b:$Q
P=$(python3 -c "import sys; sys.path.insert(0,'.'); import engine; from engine.model import resolve_model; print(resolve_model('$M'))")
servers=()
serve() {  # serve NP PORT: llama-server with NP slots, unified KV, the same model
  $LCBIN/llama-server -m "$P" -ngl 99 -np "$1" -c $(( $1 * 1024 > 16384 ? $1 * 1024 : 16384 )) -kvu \
    --port "$2" --host 127.0.0.1 -fa auto > "/tmp/llama-server-np$1.log" 2>&1 &
  servers+=($!)
}
wait_up() { for i in $(seq 100); do curl -sf "http://127.0.0.1:$1/health" >/dev/null && return 0; sleep 0.2; done; return 1; }
trap 'kill ${servers[@]} 2>/dev/null' EXIT
GPU="gpu:cap=${GPU_CAP:-4},ctx=16384,threads=8"
CPU="cpu:cap=4,threads=15"
case ${STAGE:-study} in
study)
  serve 4 8091; wait_up 8091
  python3 -X faulthandler -m app bench seed --model "$M" --backend "$GPU" --backend "$CPU" --requests 4,8,48 --runs 3 \
    --policies seed-score,predicted-finish,gpu-only --target llama-server-np4=http://127.0.0.1:8091 \
    --target-warm 4 --no-plots --out "$OUT/study-$Q" 2>&1 | grep -v "^\s*$" | tail -40 ;;
sweep)  # TARGETS=1 adds llama-server at each -np of NP (default 4 16 64)
  targets=()
  if [ -n "${TARGETS:-}" ]; then
    port=8091
    for np in ${NP:-4 16 64}; do
      serve "$np" $port; wait_up $port; targets+=(--target llama-server-np$np=http://127.0.0.1:$port); port=$((port + 1))
    done
    targets+=(--target-warm 4)
  fi
  python3 -X faulthandler -m app bench grid --model "$M" --backend "$GPU" --backend "$CPU" --requests ${N:-48} --runs ${RUNS:-3} \
    --shared 96 --outputs fixed --arrivals interval --caps ${CAPS:-1,4,8,16,32,64} \
    --sweep-policies ${SWEEP_POLICIES:-gpu-only,seed-score,predicted-finish} --policies ${POLICIES:-gpu-only} \
    "${targets[@]}" --no-plots --out "$OUT/sweep${TAG:-}-$Q" 2>&1 | grep -v "^\s*$" | tail -40 ;;
grid)
  python3 -X faulthandler -m app bench grid --model "$M" --backend "$GPU" --backend "$CPU" --requests ${N:-48} --runs ${RUNS:-2} \
    --shared ${SHARED:-0,50,96} --outputs ${OUTPUTS:-fixed,uniform} --arrivals ${ARRIVALS:-interval,poisson} \
    --caps none --policies gpu-only,seed-score,predicted-finish ${KV:+--kv-seqs $KV} \
    --no-plots --out "$OUT/grid-$Q" 2>&1 | grep -v "^\s*$" | tail -40 ;;
together)
  python3 -m app bench together --model "$M" --gpu-batch 16 --cpu-batch 4 --gpu-threads 1 --cpu-threads 15 \
    --repeats 3 2>&1 | tail -6 | tee "$OUT/together-$Q.txt" ;;
esac
