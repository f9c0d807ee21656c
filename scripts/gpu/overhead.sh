#!/usr/bin/env bash
# On the GPU machine, from the project root, after `source .gpukit/enter.sh`:
# engine decode speed vs llama-batched-bench and llama-cpp-python's Llama, GPU and CPU.
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export TANDEM_CACHE_DIR=${TANDEM_CACHE_DIR:-/tmp/tandem-cache}
M=${MODEL:-synthetic:qwen2.5-0.5b:q8_0}
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv | tee "$OUT/gpu.txt"
python3 -m app generate --model "$M" --backend gpu:cap=1 --prompt "hello" --max-tokens 8 --stats 2>&1 | tail -3
python3 -m app bench overhead --model "$M" --device gpu --threads ${GPU_THREADS:-8} --batches ${BATCHES:-1,4,16,32} \
  --batched-bench "$LCBIN/llama-batched-bench" --repeats ${REPEATS:-3} 2>&1 | tee "$OUT/overhead_gpu.txt"
if [ -n "${CPU:-1}" ]; then
python3 -m app bench overhead --model "$M" --device cpu --threads 15 --batches 1,4 \
  --batched-bench "$LCBIN/llama-batched-bench" --repeats ${REPEATS:-3} 2>&1 | tee "$OUT/overhead_cpu15.txt"
fi
