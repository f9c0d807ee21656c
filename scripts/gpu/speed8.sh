#!/usr/bin/env bash
# Host threads of the GPU context (1, 4, 8) at small batches, our engine and
# llama-batched-bench with the same thread count.
source scripts/gpu/lib.sh
for t in 1 4 8; do
  decode "threads_gpu_$t.txt" 3 1,4,16 --threads "$t"
done
cat "$OUT"/threads_gpu_*.txt | grep '^{' > "$OUT/threads_gpu.txt"
