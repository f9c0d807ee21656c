#!/usr/bin/env bash
# The one GPU driver. On the GPU machine, from the project root, after carrying .gpukit:
#
#   source .gpukit/enter.sh && bash scripts/gpu/run.sh STEP [STEP ...]
#
# Each STEP is a function of scripts/gpu/steps.sh (list them: `bash scripts/gpu/run.sh`); knobs
# are environment variables named there (QUANT, RUNS, CAPS, ...). Results go to a work folder
# that is packed into $OUT/results.tgz at the end, whatever happens (a device call returns at
# most 8 files), with the calibration store and a manifest (command, date, commit).
set -uo pipefail
source scripts/gpu/steps.sh
if [ $# -eq 0 ]; then
  echo "steps:"; declare -F | awk '{print $3}' | grep -v '^_' | sed 's/^/  /'; exit 2
fi
for step in "$@"; do
  declare -F "$step" >/dev/null || { echo "unknown step: $step (run without arguments for the list)"; exit 2; }
done
# Every step runs `app`: a package the device lacks (the kit's wheels: docs/NOTES.md, "GPU runs") fails here, at once.
python3 -c "import app.cli, app.server" || { echo "run.sh: app does not import here: carry the missing wheels in .gpukit"; exit 3; }
DEST=${OUT:?set OUT to where results should go}; mkdir -p "$DEST"
export OUT=/tmp/results; rm -rf "$OUT"; mkdir -p "$OUT"  # this call's results only
export TANDEM_CACHE_DIR=${TANDEM_CACHE_DIR:-/tmp/tandem-cache}; mkdir -p "$TANDEM_CACHE_DIR"
# Reuse the committed calibration when the model file is the same (the store keys by fingerprint).
[ -f docs/results/gpu/rates.json ] && [ ! -f "$TANDEM_CACHE_DIR/rates.json" ] && cp docs/results/gpu/rates.json "$TANDEM_CACHE_DIR/"
{ echo "command: scripts/gpu/run.sh $*"; echo "date: $(date -u +%FT%TZ)"
  echo "commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown) (the device copy's git HEAD: may predate uncommitted or later work)"
  env | grep -E '^(QUANT|RUNS|CAPS|KV|GPU_CAP|TENANTS|REQUESTS|RATE|CHAT_[A-Z0-9_]+|ALTS|HTTP_WORKLOADS|TENANT_SKIP|TUNED_ONLY|TIMEOUT|LLAMA_[A-Z_]+|N48|LONG_N|TENANT_N|TENANT_RUNS|SEQ_[A-Z_]+|SAMPLING_[A-Z_]+|FUSED_FROM|BIG_BATCHES|REPEATS)=' ; } > "$OUT/manifest.txt"
trap 'cp "$TANDEM_CACHE_DIR/rates.json" "$OUT/" 2>/dev/null; tar czf "$DEST/results.tgz" -C "$OUT" .' EXIT
# One deadline for all steps, under the device's 10 minutes, so the results are always packed.
timeout "${TIMEOUT:-560}" bash -c 'source scripts/gpu/steps.sh; _setup; for s in "$@"; do "$s"; done' run "$@"
