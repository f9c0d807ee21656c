#!/usr/bin/env bash
# On the GPU machine after `source .gpukit/enter.sh`: the engine-speed checks in one call —
# decode vs llama-batched-bench (GPU and 15-thread CPU, with OpenMP variants for the CPU),
# calibration, and the study's N=48 workload around the best GPU cap beside llama-server.
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export TANDEM_CACHE_DIR=${TANDEM_CACHE_DIR:-/tmp/tandem-cache}
M=${MODEL:-synthetic:qwen2.5-0.5b:q8_0}
T0=$SECONDS
stamp() { echo "== $1 ($((SECONDS - T0)) s)"; }
stamp "GPU decode vs batched-bench"
python3 -m app bench overhead --model "$M" --device gpu --threads 8 --batches ${BATCHES:-1,4,8,16,32} \
  --batched-bench "$LCBIN/llama-batched-bench" --no-llama --repeats ${REPEATS:-3} 2>&1 | tail -5 | tee "$OUT/overhead_gpu.txt"
stamp "CPU decode vs batched-bench, 15 threads"
python3 -m app bench overhead --model "$M" --device cpu --threads 15 --batches 1,4 \
  --batched-bench "$LCBIN/llama-batched-bench" --repeats 2 2>&1 | tail -4 | tee "$OUT/overhead_cpu15.txt"
for v in "OMP_WAIT_POLICY=ACTIVE" "OMP_PROC_BIND=close OMP_PLACES=cores" "GOMP_SPINCOUNT=0"; do
  stamp "CPU B=1 with $v"
  env $v python3 -m app bench overhead --model "$M" --device cpu --threads 15 --batches 1 --no-llama --repeats 1 2>&1 \
    | tail -1 | sed "s/^/$v: /" | tee -a "$OUT/overhead_cpu15_env.txt"
done
grep -E "^Cpus_allowed_list|^Threads" /proc/self/status | tee -a "$OUT/overhead_cpu15_env.txt"
stamp "calibrate"
python3 -m app calibrate --model "$M" --backend "gpu:cap=16,threads=8" --backend "cpu:cap=4,threads=15" 2>&1 \
  | tail -4 | tee "$OUT/calibrate.txt"
cp "$TANDEM_CACHE_DIR/rates.json" "$OUT/rates.json" 2>/dev/null
stamp "N=48 around the best cap, llama-server beside"
STAGE=sweep TAG=${TAG:-2} CAPS=${CAPS:-6,8,10,12,16} SWEEP_POLICIES=gpu-only POLICIES=gpu-only TARGETS=1 NP="${NP:-4 8 16}" \
  bash scripts/gpu/study.sh
stamp "done"
