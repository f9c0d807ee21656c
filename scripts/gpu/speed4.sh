#!/usr/bin/env bash
# After cached sequences stopped taking the chained sequence ids: GPU decode; N=48 at GPU caps
# 16/32/48 beside llama-server -np 4 / -np 8 and our own server; both backends at once; the
# CPU backend (15 threads) vs batched-bench.
source scripts/gpu/lib.sh
gpu_info
decode overhead_gpu.txt 3 1,4,8,16,32
tandem_server 32 8095; llama_server 8 8092; llama_server 4 8094; wait_ready 8095 8092 8094
n48 16,32,48 5 --target llama-server-np8=http://127.0.0.1:8092 --target llama-server-np4=http://127.0.0.1:8094 \
  --target tandem-serve-cap32=http://127.0.0.1:8095
stop_servers
together
cpu15
