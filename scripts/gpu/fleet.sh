#!/usr/bin/env bash
# The router benchmark on the two-GPU machine, the `fleet` step of the GPU driver
# (`source .gpukit/enter.sh && bash scripts/gpu/run.sh fleet`; run.sh sets OUT and packs it):
# `tandem bench fleet` once per tenant count, with the reference tenant workload (K = 8 then 32 tenants x 1,500-token prefixes, Zipf popularity, ~50 tokens of
# each request's own, outputs uniform 32-256, N = 300, Poisson 60/s) through Tandem's router and
# sglang-router (cache-aware, round-robin) in front of one engine per GPU, one engine alone, and
# the in-process engine over both GPUs. The deciding points (K = 8: Tandem cache-aware vs sglang
# cache_aware vs round-robin) run first; every run's results are written as soon as it ends.
#
# sglang-router is not on that machine: carry its wheel (sglang_router-0.3.2-*.whl, abi3; 31 MB)
# or a tarball of its package directory (sglang_router-*.tar.xz, e.g. with the .so stripped:
# 17 MB, which fits beside the kit in a 64 MiB carry) in .gpukit/; it is unpacked onto
# PYTHONPATH here and started without its Python launcher (no fastapi/uvicorn there). .whl/
# (git-ignored) is searched too: the kit and the project already take most of a carry, so the
# router can come in a second call to the same warm machine.
#   ENGINES=llama-server|tandem (default llama-server)  TENANTS="8 32"  REQUESTS=300  RATE=60  RUNS=1
#   VARIANTS=...  (default: the deciding ones first, then single, then in-process; every variant
#                 is checked before anything starts: a policy or backend kind this build lacks is
#                 refused by name, so drop it from VARIANTS rather than lose the step)
#   KILL_AT=S     (also a run with one engine killed S seconds in, K = 8, sglang/Tandem cache-aware)
#   BUDGET=540    seconds for the whole step (run.sh allows 560): an invocation still running at
#                 the end gets SIGTERM, stops its engines and keeps every finished run's results
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
M=synthetic:qwen2.5-0.5b:${QUANT:-q8_0}
T0=$SECONDS
stamp() { echo "== $1 ($((SECONDS - T0)) s)"; }

if ! python3 -c "import sglang_router" 2>/dev/null; then
  whl=$(ls .gpukit/sglang_router-*.whl .whl/sglang_router-*.whl 2>/dev/null | head -1)
  tarball=$(ls .gpukit/sglang_router-*.tar.* .whl/sglang_router-*.tar.* 2>/dev/null | head -1)
  mkdir -p /tmp/sgr
  if [ -n "$whl" ]; then
    python3 -m zipfile -e "$whl" /tmp/sgr
  elif [ -n "$tarball" ]; then
    tar xf "$tarball" -C /tmp/sgr
  else
    echo "fleet: no sglang_router wheel or tarball in .gpukit/ or .whl/: the sglang variants will be refused" >&2
  fi
  export PYTHONPATH=/tmp/sgr:$PYTHONPATH
fi
nvidia-smi --query-gpu=index,name,memory.used --format=csv | tee "$OUT/gpus.txt"

ENGINES=${ENGINES:-llama-server}
DEFAULT_VARIANTS=tandem:cache-aware,sglang:cache_aware,tandem:round-robin,sglang:round_robin,single
DEFAULT_VARIANTS+=,in-process:cache-aware,in-process:round-robin
GPU_SPEC=gpu:cap=32,ctx=65536,threads=8
fleet() {  # fleet NAME K [extra options...]
  local name=$1 k=$2; shift 2
  stamp "fleet $name: $ENGINES engines, K=$k"
  local left=$(( ${BUDGET:-540} - (SECONDS - T0) ))
  [ "$left" -gt 30 ] || { echo "fleet: no time left for $name" >&2; return 1; }
  timeout "$left" python3 -X faulthandler -m app bench fleet --model "$M" --engines "$ENGINES" \
    --gpus 0,1 --engine-backend "$GPU_SPEC" --llama-flags "-ngl 99 -kvu -c 65536 -np 32 --threads-http 32 -fa auto" \
    --inprocess-backend "gpu:device=0,cap=32,ctx=65536,threads=8" \
    --inprocess-backend "gpu:device=1,cap=32,ctx=65536,threads=8" \
    --tenants "$k" --tenant-prefix-tokens 1500 --tenant-suffix-tokens 50 --tenant-skew zipf \
    --requests "${REQUESTS:-300}" --rate "${RATE:-60}" --min-output 32 --max-output 256 --runs "${RUNS:-1}" \
    --start-timeout 120 --timeout 120 --no-plots --out "$OUT/fleet-$name" "$@" 2>&1 \
    | grep -v "it/s\]" | tail -40
}
for k in ${TENANTS:-8 32}; do
  fleet "$ENGINES-k$k" "$k" --variants "${VARIANTS:-$DEFAULT_VARIANTS}"
done
if [ -n "${KILL_AT:-}" ]; then
  fleet "$ENGINES-k8-kill" 8 --variants tandem:cache-aware,sglang:cache_aware --kill-one-at "$KILL_AT"
fi
stamp done
