#!/usr/bin/env bash
# Sharing a running request's prompt (engine/sched/scheduler.py: publication at prefill end, deferral
# behind a running prefill of the same prefix) on and off, on one backend, the same workload:
# a Poisson burst of TENANTS tenants' requests (TENANTS=1: one tenant's burst). Three sides:
# off (share_prefill=0), nodefer (publication only, defer_shared=0), on (both). Prints each
# side's computed prompt tokens (prompt - cached: the prefix cache's misses), TTFT p50 and
# makespan, and each side's ratio to off.
#   CPU (default): bash scripts/share_prefill.sh
#   GPU: BACKEND=gpu:cap=48,ctx=32768,threads=8 MODEL=synthetic:qwen2.5-0.5b:q8_0 PREFIX=1500 \
#        TENANTS=8 REQUESTS=300 RATE=60 bash scripts/share_prefill.sh
# Knobs: MODEL (synthetic:tiny), BACKEND (cpu:cap=8,ctx=16384,threads=2,adaptive=0), TENANTS (1),
# PREFIX (tenant prefix words, 300), REQUESTS (16), RATE (60), RUNS (1), MIN_OUT, MAX_OUT (outputs
# uniform in 16-64), WARMUP (unrecorded runs first, 0), OUT (/tmp/share-prefill).
set -uo pipefail
MODEL=${MODEL:-synthetic:tiny}
BACKEND=${BACKEND:-cpu:cap=8,ctx=16384,threads=2,adaptive=0}
OUT=${OUT:-/tmp/share-prefill}
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
declare -A FLAGS=([off]=",share_prefill=0,defer_shared=0" [nodefer]=",defer_shared=0" [on]="")
for side in off nodefer on; do
  flags=${FLAGS[$side]}
  echo "== sharing $side: $BACKEND$flags"
  "$PY" -m app bench grid --model "$MODEL" --backend "$BACKEND$flags" --policies "${BACKEND%%:*}-only" \
    --caps none --tenants "${TENANTS:-1}" --tenant-prefix-tokens "${PREFIX:-300}" --requests "${REQUESTS:-16}" \
    --runs "${RUNS:-1}" --warmup "${WARMUP:-0}" --outputs uniform --min-output "${MIN_OUT:-16}" --max-output "${MAX_OUT:-64}" --arrivals poisson \
    --rate "${RATE:-60}" --no-plots --out "$OUT/$side" 2>&1 | grep -A2 "^| policy"
done
"$PY" - "$OUT" <<'PY'
import json, sys
sides = ("off", "nodefer", "on")
rows = {side: json.load(open(f"{sys.argv[1]}/{side}/summary.json"))["results"][0] for side in sides}
for key, label in (("computed_prompt_tokens", "computed prompt tokens"), ("ttft_p50_s", "TTFT p50 s"),
                   ("makespan_s", "makespan s")):
    v = {s: rows[s][key]["mean"] for s in sides}
    print(f"{label}: " + "  ".join(f"{s} {v[s]:,.3f}" + (f" ({v[s] / v['off']:.3f}x off)" if s != "off" and v["off"] else "")
                                   for s in sides))
PY
