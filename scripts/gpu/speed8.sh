#!/usr/bin/env bash
# One short call: host threads of the GPU context (1, 4, 8) at small batches, our engine and
# llama-batched-bench with the same thread count, alternating.
set -uo pipefail
M=synthetic:qwen2.5-0.5b:${QUANT:-q8_0}
for t in 1 4 8; do
  echo "== GPU context with $t host threads"
  python3 -m app bench overhead --model "$M" --device gpu --threads $t --batches 1,4,16 \
    --batched-bench "$LCBIN/llama-batched-bench" --no-llama --repeats 3 2>&1 | tail -1 | tee -a "$OUT/threads_gpu.txt"
done
