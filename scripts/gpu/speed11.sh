#!/usr/bin/env bash
# The final engine once more on the study's workload: N=48 at GPU caps 8 and 16 beside
# llama-server -np 8 and our HTTP server at cap 16, 5 runs each.
source scripts/gpu/lib.sh
tandem_server 16 8095; llama_server 8 8092; wait_ready 8095 8092
n48 16 5 --target llama-server-np8=http://127.0.0.1:8092 --target tandem-serve-cap16=http://127.0.0.1:8095
