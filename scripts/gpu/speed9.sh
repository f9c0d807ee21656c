#!/usr/bin/env bash
# n_batch / n_ubatch by measurement (tandem bench prefill), GPU and the 15-thread CPU
# backend: a cold prompt alone, and arriving beside decoding sequences.
source scripts/gpu/lib.sh
stamp "GPU"
python3 -m app bench prefill --model "$M" --device gpu --threads 8 --prompt-tokens 2048 \
  --sizes 256/256,512/512,1024/512,2048/512,2048/1024,2048/2048 --decoders 16 --decode-tokens 1024 \
  --repeats 3 2>&1 | tail -1 | tee "$OUT/prefill_gpu.txt"
stamp "CPU, 15 threads"
python3 -m app bench prefill --model "$M" --device cpu --threads 15 --prompt-tokens 1024 \
  --sizes 256/256,512/512,1024/512,1024/1024 --decoders 4 --decode-tokens 512 \
  --repeats 2 2>&1 | tail -1 | tee "$OUT/prefill_cpu15.txt"
