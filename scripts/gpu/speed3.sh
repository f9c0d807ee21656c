#!/usr/bin/env bash
# GPU decode vs llama-batched-bench with the fused greedy argmax and, in the same call,
# without it (llama.cpp's per-sequence greedy + logit bias); split KV; N=48 at GPU caps
# 16/24/32 beside llama-server -np 4 and -np 8; both backends at once.
source scripts/gpu/lib.sh
gpu_info
decode overhead_gpu.txt 3 1,4,8,16,32
decode overhead_gpu_unfused.txt 2 1,4,16,32 --no-fused-greedy
decode overhead_gpu_split.txt 2 1,4,16,32 --kv split
llama_server 8 8092; llama_server 4 8094; wait_ready 8092 8094
n48 16,24,32 3 --target llama-server-np8=http://127.0.0.1:8092 --target llama-server-np4=http://127.0.0.1:8094
stop_servers
together
