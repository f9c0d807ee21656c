#!/usr/bin/env bash
# The router benchmark on the two-GPU machine, the `fleet` step of the GPU driver
# (`source .gpukit/enter.sh && bash scripts/gpu/run.sh fleet`; run.sh sets OUT and packs it).
# The whole must-show in ONE call of ~8.5 minutes: the reference tenant workload (K tenants x
# 1,500-token prefixes, Zipf popularity, 50 tokens of each request's own, outputs uniform
# 32-256, N = 300, Poisson 60/s) at K = 8 and 32, through Tandem's `cache-aware`, Tandem's
# `round-robin` and sglang-router's `cache_aware` in front of
#   (b) two `tandem serve` engines, one per GPU,
#   (c) two `llama-server` engines, one per GPU,
# and (a) the in-process engine over `gpu:device=0` + `gpu:device=1` (cache-aware and
# round-robin: sglang-router needs HTTP engines; priced at calibrated rates only where the
# store holds gpu0/gpu1 entries: `run.sh calibrate_gpus` once, its rates.json merged into
# docs/results/gpu/rates.json, which run.sh seeds the store with), plus one Tandem engine alone (the one-GPU
# baseline, K = 8) and a run with one engine killed KILL_AT seconds in. Parts, in this order
# (the points that decide the targets first; every run's results are written as it ends):
#   tandem-k8      (b) K=8: tandem:cache-aware, sglang:cache_aware, tandem:round-robin, single  ~70 s
#   tandem-k32     (b) K=32: the three routers                                                   ~45 s
#   kill           (b) K=8, e1 SIGKILLed KILL_AT s in: tandem:cache-aware, sglang:cache_aware    ~45 s
#   in-process     (a) K=8 and 32: in-process:cache-aware, in-process:round-robin                ~65 s
#   llama-k8       (c) K=8: the three routers (llama-server runs ~40 s each)                    ~130 s
#   llama-k32      (c) K=32: the three routers                                                  ~130 s
# (estimates from earlier fleet runs: a Tandem-engine run ~14 s with the engines' restart, one
# engine alone ~23 s, a llama-server run ~40-44 s). At the end the ratios against the targets are
# printed (and written to fleet-ratios.txt): cache-aware makespan <= 0.75x round-robin, TTFT p50
# <= 0.25x, no worse than sglang-router's cache_aware on either, >= 1.8x one GPU's throughput.
#
# sglang-router is not on that machine: carry its wheel (sglang_router-0.3.2-*.whl, abi3; 31 MB)
# or a tarball of its package directory (sglang_router-*.tar.xz, e.g. with the .so stripped:
# 17 MB, which fits beside the kit in a 64 MiB carry) in .gpukit/; it is unpacked onto
# PYTHONPATH here and started without its Python launcher (no fastapi/uvicorn there). .whl/
# (git-ignored) is searched too.
#   PARTS="tandem-k8 tandem-k32 kill in-process llama-k8 llama-k32"  (a subset, e.g. for more runs)
#   RUNS=1  REQUESTS=300  RATE=60  KILL_AT=3
#   GPUS=0,1    the engines' GPUs (GPUS=0,0: two engines on one GPU, where only one is lent)
#   ROUTERS=tandem:cache-aware,sglang:cache_aware,tandem:round-robin  (the routers of every part)
#   BUDGET=540    seconds for the whole step (run.sh allows 560): a part still running at the end
#                 gets SIGTERM, stops its engines and keeps every finished run's results; parts
#                 with no time left are skipped, said so in the log and in fleet-ratios.txt
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
M=synthetic:qwen2.5-0.5b:${QUANT:-q8_0}
T0=$SECONDS
BUDGET=${BUDGET:-540}
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
  export PYTHONPATH=/tmp/sgr:${PYTHONPATH:-}
fi
nvidia-smi --query-gpu=index,name,memory.used --format=csv | tee "$OUT/gpus.txt"

ROUTERS=${ROUTERS:-tandem:cache-aware,sglang:cache_aware,tandem:round-robin}
GPU_SPEC=gpu:cap=32,ctx=65536,threads=8
LLAMA_FLAGS="-ngl 99 -kvu -c 65536 -np 32 --threads-http 32 -fa auto"
SKIPPED=()
fleet() {  # fleet NAME ENGINES TENANTS VARIANTS [extra options...]
  local name=$1 engines=$2 k=$3 variants=$4; shift 4
  local left=$(( BUDGET - (SECONDS - T0) ))
  if [ "$left" -le 30 ]; then
    echo "fleet: no time left for $name ($left s of $BUDGET)" >&2; SKIPPED+=("$name"); return 1
  fi
  stamp "fleet $name: $engines engines, K=$k, $variants"
  timeout "$left" python3 -X faulthandler -m app bench fleet --model "$M" --engines "$engines" \
    --gpus "${GPUS:-0,1}" --engine-backend "$GPU_SPEC" --llama-flags "$LLAMA_FLAGS" \
    --inprocess-backend "gpu:device=0,cap=32,ctx=65536,threads=8" \
    --inprocess-backend "gpu:device=1,cap=32,ctx=65536,threads=8" \
    --tenants "$k" --tenant-prefix-tokens 1500 --tenant-suffix-tokens 50 --tenant-skew zipf \
    --requests "${REQUESTS:-300}" --rate "${RATE:-60}" --min-output 32 --max-output 256 --runs "${RUNS:-1}" \
    --start-timeout 120 --timeout 120 --no-plots --variants "$variants" --out "$OUT/fleet-$name" "$@" 2>&1 \
    | grep -v "it/s\]" | tail -40
}
for part in ${PARTS:-tandem-k8 tandem-k32 kill in-process llama-k8 llama-k32}; do
  case $part in
    tandem-k8)  fleet tandem-k8 tandem 8 "$ROUTERS,single" ;;
    tandem-k32) fleet tandem-k32 tandem 32 "$ROUTERS" ;;
    kill)       fleet tandem-k8-kill tandem 8 tandem:cache-aware,sglang:cache_aware --kill-one-at "${KILL_AT:-3}" ;;
    in-process) fleet in-process tandem 8,32 in-process:cache-aware,in-process:round-robin ;;
    llama-k8)   fleet llama-server-k8 llama-server 8 "$ROUTERS" ;;
    llama-k32)  fleet llama-server-k32 llama-server 32 "$ROUTERS" ;;
    *) echo "fleet: unknown part $part" >&2 ;;
  esac
done
stamp "runs done"

# The ratios against the targets, every part in one table.
python3 - "$OUT" "${SKIPPED[*]:-}" <<'EOF' | tee "$OUT/fleet-ratios.txt"
import json, sys
from pathlib import Path

out, skipped = Path(sys.argv[1]), sys.argv[2].split()
TARGETS = {("round-robin", "makespan_s"): ("<=", 0.75), ("round-robin", "ttft_p50_s"): ("<=", 0.25),
           ("sglang:cache_aware", "makespan_s"): ("<=", 1.0), ("sglang:cache_aware", "ttft_p50_s"): ("<=", 1.0),
           ("single", "output_tok_s"): (">=", 1.8)}
print("part | workload | a / b | metric | ratio | target | met")
for summary in sorted(out.glob("fleet-*/summary.json")):
    s = json.loads(summary.read_text())
    part = summary.parent.name.removeprefix("fleet-")
    killed = s.get("kill_one_at_s") is not None
    for r in [] if killed else s.get("ratios", []):
        b = r["b"].split(":", 1)[1] if r["b"].endswith("round-robin") else r["b"]
        if not r["a"].endswith("cache-aware") or (b, r["metric"]) not in TARGETS:
            continue
        op, t = TARGETS[(b, r["metric"])]
        met = r["value"] <= t if op == "<=" else r["value"] >= t
        failed = sum(r["failed"].values())
        print(f"{part} | {r['workload'].split(',')[0]} | {r['a']} / {r['b']} | {r['metric']} | {r['value']:.3f} | "
              f"{op} {t:g} | {'yes' if met and not failed else 'NO'}{f' ({failed} failed)' if failed else ''}")
    # Tandem's router: streams that went on from their text on the other engine (decisions
    # with `continued` > 0, engine/backends/remote/backend.py's module doc); other routers' moves are not seen.
    moved: dict[str, int] = {}
    decisions = summary.parent / "decisions.jsonl"
    for line in decisions.read_text().splitlines() if killed and decisions.exists() else []:
        d = json.loads(line)
        if d.get("continued"):
            moved[d.get("variant", "")] = moved.get(d.get("variant", ""), 0) + 1
    for row in s.get("results", []) if killed else []:
        print(f"{part} | {row['policy']}: e1 killed at {s['kill_one_at_s']:g} s: {row['failed']} of "
              f"{row['requests'] * row.get('runs', 1)} requests failed over {row.get('runs', 1)} run(s), "
              f"makespan {row['makespan_s']['mean']:.2f} s"
              + (f", {moved[row['policy']]} streams continued on the other engine" if row['policy'] in moved else ""))
for name in skipped:
    print(f"{name} | skipped: no time left in BUDGET")
EOF
stamp done
