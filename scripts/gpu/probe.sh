#!/usr/bin/env bash
# On the GPU machine after `source .gpukit/enter.sh`: where do the engine's steps go?
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export TANDEM_CACHE_DIR=${TANDEM_CACHE_DIR:-/tmp/tandem-cache}
M=${MODEL:-synthetic:qwen2.5-0.5b:q8_0}
P=$(python3 -c "import sys; sys.path.insert(0,'.'); import engine; from engine.model import resolve_model; print(resolve_model('$M'))")
echo "== env"; env | grep -i -E "omp|mkl|openblas|cuda_visible" ; nproc
echo "== libraries in a python process"
python3 -c "import llama_cpp, numpy; print('numpy', numpy.__version__); print('\n'.join(sorted({l.split()[-1] for l in open('/proc/self/maps') if any(k in l for k in ('omp','blas','mkl'))})))"
echo "== GPU: backend vs host sampling"
for hs in "" "--host-sampling"; do
python3 -m app bench overhead --model "$M" --device gpu --threads 8 --batches 1,4,16,32 --no-llama $hs --repeats 1 2>&1 | tail -1 | tee -a "$OUT/probe_gpu.txt"
done
echo "== CPU: batched-bench without the GPU, and ours"
CUDA_VISIBLE_DEVICES= $LCBIN/llama-batched-bench -m "$P" -c 2048 -b 2048 -ub 512 -npp 516 -ntg 128 -npl 1,4 -pps -kvu -t 15 -tb 15 -ngl 0 2>&1 | grep -E "^\|" | tee -a "$OUT/probe_cpu.txt"
$LCBIN/llama-batched-bench -m "$P" -c 2048 -b 2048 -ub 512 -npp 516 -ntg 128 -npl 1,4 -pps -kvu -t 15 -tb 15 -ngl 0 2>&1 | grep -E "^\||buffer" | tee -a "$OUT/probe_cpu.txt"
for t in 15 16; do
TANDEM_LLAMA_LOG=1 python3 -m app -v bench overhead --model "$M" --device cpu --threads $t --batches 1,4 --no-llama --repeats 1 2>&1 | grep -E "buffer size|repack|AMX|^\{" | sort -u | tail -12 | tee -a "$OUT/probe_cpu.txt"
done
CUDA_VISIBLE_DEVICES= python3 -m app bench overhead --model "$M" --device cpu --threads 15 --batches 1,4 --no-llama --repeats 1 2>&1 | tail -1 | tee -a "$OUT/probe_cpu.txt"
