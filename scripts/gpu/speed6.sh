#!/usr/bin/env bash
# After cache holders stopped taking chained ids and idle cached cells became bounded by the
# batch: N=48 at GPU caps 8/16/32 beside llama-server -np 8 and our HTTP server at caps 16 and
# 32; then GPU decode once more.
source scripts/gpu/lib.sh
gpu_info
tandem_server 16 8095; tandem_server 32 8096; llama_server 8 8092; wait_ready 8095 8096 8092
n48 16,32 5 --target llama-server-np8=http://127.0.0.1:8092 --target tandem-serve-cap16=http://127.0.0.1:8095 \
  --target tandem-serve-cap32=http://127.0.0.1:8096
stop_servers
decode overhead_gpu.txt 3 1,4,8,16,32
