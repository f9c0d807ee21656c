#!/usr/bin/env bash
# Text made while the next step runs (overlap_text): GPU decode over 5 rounds; N=48 at caps
# 8 and 16 beside llama-server -np 8 and our HTTP server at cap 16, 3 runs each.
source scripts/gpu/lib.sh
decode overhead_gpu.txt 5 1,4,8,16,32
tandem_server 16 8095; llama_server 8 8092; wait_ready 8095 8092
n48 16 3 --target llama-server-np8=http://127.0.0.1:8092 --target tandem-serve-cap16=http://127.0.0.1:8095
