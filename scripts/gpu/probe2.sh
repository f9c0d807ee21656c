#!/usr/bin/env bash
# GPU decode variants (n_seq_max, flash attention) and the CPU backend's buffer types.
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export TANDEM_CACHE_DIR=${TANDEM_CACHE_DIR:-/tmp/tandem-cache}
M=${MODEL:-synthetic:qwen2.5-0.5b:q8_0}
P=$(python3 -c "import sys; sys.path.insert(0,'.'); import engine; from engine.model import resolve_model; print(resolve_model('$M'))")
for v in "--n-seq-max 33" "--flash-attn on" "--flash-attn off" "--threads 2"; do
echo "== GPU $v"
python3 -m app bench overhead --model "$M" --device gpu --threads 8 --batches 1,4,16,32 --no-llama --repeats 1 $v 2>&1 | tail -1 | tee -a "$OUT/probe2_gpu.txt"
done
echo "== CPU buffers: batched-bench, then ours"
$LCBIN/llama-batched-bench -m "$P" -c 2048 -npp 516 -ntg 128 -npl 1 -pps -kvu -t 15 -tb 15 -ngl 0 2>&1 | grep -i -E "buffer|amx|repack|extra|CPU :|system_info" | head -20 | tee -a "$OUT/probe2_cpu.txt"
TANDEM_LLAMA_LOG=1 python3 -m app -v bench overhead --model "$M" --device cpu --threads 15 --batches 1 --no-llama --repeats 1 2>&1 | grep -i -E "buffer|amx|repack|extra|CPU :|system_info|^\{" | head -20 | tee -a "$OUT/probe2_cpu.txt"
python3 -c "import engine.llama as l; print(l.system_info())" | tee -a "$OUT/probe2_cpu.txt"
