#!/usr/bin/env bash
# The engine at the end of the engine-speed work: GPU decode over 5 rounds, llama.cpp's
# per-sequence greedy in the same call; N=48 (caps 8/16/32, llama-server -np 8, our HTTP
# server at caps 16 and 32); the GIL beside a busy Python thread.
source scripts/gpu/lib.sh
gpu_info
decode overhead_gpu.txt 5 1,4,8,16,32
decode overhead_gpu_unfused.txt 2 1,4,16,32 --no-fused-greedy
tandem_server 16 8095; tandem_server 32 8096; llama_server 8 8092; wait_ready 8095 8096 8092
n48 16,32 5 --target llama-server-np8=http://127.0.0.1:8092 --target tandem-serve-cap16=http://127.0.0.1:8095 \
  --target tandem-serve-cap32=http://127.0.0.1:8096
stop_servers
gil
