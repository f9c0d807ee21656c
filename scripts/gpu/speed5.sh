#!/usr/bin/env bash
# GPU decode over 5 rounds; N=48 at GPU caps 8/16/32 beside llama-server -np 8 and our own
# HTTP server at cap 16 (text handed to the server's loop once per step).
source scripts/gpu/lib.sh
gpu_info
decode overhead_gpu.txt 5 1,4,8,16,32
tandem_server 16 8095; llama_server 8 8092; wait_ready 8095 8092
n48 16,32 5 --target llama-server-np8=http://127.0.0.1:8092 --target tandem-serve-cap16=http://127.0.0.1:8095
