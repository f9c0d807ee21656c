#!/usr/bin/env bash
# Device-call wrapper: runs `scripts/gpu/$1.sh` with results in a work folder and packs that
# folder into $OUT/results.tgz at the end, whatever happens (the device returns at most 8
# files). Usage, from the project root: source .gpukit/enter.sh && bash scripts/gpu/call.sh grid
set -uo pipefail
DEST=${OUT:?}
export OUT=/tmp/results; mkdir -p "$OUT"
export TANDEM_CACHE_DIR=${TANDEM_CACHE_DIR:-/tmp/tandem-cache}; mkdir -p "$TANDEM_CACHE_DIR"
# Reuse the committed calibration when the model file is the same (the store keys by fingerprint).
[ -f docs/results/gpu/rates.json ] && [ ! -f "$TANDEM_CACHE_DIR/rates.json" ] && cp docs/results/gpu/rates.json "$TANDEM_CACHE_DIR/"
trap 'cp "$TANDEM_CACHE_DIR/rates.json" "$OUT/" 2>/dev/null; tar czf "$DEST/results.tgz" -C "$OUT" .' EXIT
timeout "${TIMEOUT:-560}" bash "scripts/gpu/$1.sh"
