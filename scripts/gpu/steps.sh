# The steps of scripts/gpu/run.sh, one function each (names starting with _ are helpers).
# Sourced on the GPU machine after `source .gpukit/enter.sh` ($LCBIN: llama.cpp's tools).
# Knobs: MODEL (or QUANT: q8_0), GPU_DEVICE, RUNS, CAPS, KV, GPU_CAP; results under $OUT/<step>.
M=${MODEL:-${M:-synthetic:qwen2.5-0.5b:${QUANT:-q8_0}}}
G=${GPU_DEVICE:-gpu}  # GPU_DEVICE=cpu tries a step on a machine without a GPU (MODEL=synthetic:tiny)
SERVERS=()
SERVER_LOGS=()  # pid -> its log (_serve_bg)
ALT_PORT=8200  # $ALTS's servers: 8200, 8201, ... (clear of the default on 8100 and the tuned rows after it)

_setup() {
  T0=$SECONDS
  P=$(python3 -c "import sys; sys.path.insert(0,'.'); import engine; from engine.llama.model import resolve_model; print(resolve_model('$M'))")
  trap 'kill "${SERVERS[@]}" 2>/dev/null' EXIT
}
_stamp() { echo "== $1 ($((SECONDS - T0)) s)"; }

# ---- peers and servers, in the background ----

_llama_server() {  # _llama_server NP PORT
  "$LCBIN/llama-server" -m "$P" -ngl 99 -np "$1" -c 16384 -kvu --port "$2" --host 127.0.0.1 -fa auto \
    > "/tmp/llama-server-$2.log" 2>&1 &
  SERVERS+=($!)
}
_tandem_server() {  # _tandem_server CAP PORT
  python3 -m app serve --model "$M" --backend "gpu:cap=$1,ctx=32768,threads=8" --port "$2" > "/tmp/tandem-serve-$2.log" 2>&1 &
  SERVERS+=($!)
}
_wait_ready() {  # _wait_ready PORT...: until each answers /health (a minute at most); fails at once when a server
                # started here has exited (its log says why)
  local port
  for port in "$@"; do
    for _ in $(seq 300); do
      curl -sf "http://127.0.0.1:$port/health" >/dev/null && break
      _servers_alive || { _dead_servers; echo "a server exited before port $port was ready" >&2; return 1; }
      sleep 0.2
    done
  done
}
_servers_alive() { local p; for p in "${SERVERS[@]}"; do kill -0 "$p" 2>/dev/null || return 1; done; }
_dead_servers() {  # the end of each exited server's log (SERVER_LOGS, by pid), on stderr
  local p
  for p in "${SERVERS[@]}"; do
    kill -0 "$p" 2>/dev/null || { echo "server $p exited: ${SERVER_LOGS[$p]:-}" >&2; tail -n 15 "${SERVER_LOGS[$p]:-/dev/null}" >&2; }
  done
}
_stop_servers() { kill "${SERVERS[@]}" 2>/dev/null; SERVERS=(); sleep 2; }

_decode() {  # _decode FILE REPEATS BATCHES [bench overhead options...]
  local file=$1 repeats=$2 batches=$3; shift 3
  _stamp "GPU decode vs batched-bench $* ($file)"
  python3 -m app bench overhead --model "$M" --device gpu --threads 8 --batches "$batches" "$@" \
    --batched-bench "$LCBIN/llama-batched-bench" --no-llama --repeats "$repeats" 2>&1 \
    | tail -$((repeats + 2)) | tee "$OUT/$file"
}

# ---- steps ----

info() {
  nvidia-smi --query-gpu=index,name,clocks.sm,clocks.mem,memory.total --format=csv | tee "$OUT/gpu.txt"
}

calibrate() {  # rates for the router, stored in $TANDEM_CACHE_DIR/rates.json (packed with the results)
  _stamp calibrate
  python3 -m app calibrate --model "$M" --backend "gpu:cap=16,threads=8" --backend "cpu:cap=4,threads=15" 2>&1 \
    | tail -4 | tee "$OUT/calibrate.txt"
}

calibrate_gpus() {  # each GPU's rates under its own key (gpu0, gpu1), for the in-process fleet (two-GPU machine)
  _stamp calibrate_gpus
  python3 -m app calibrate --model "$M" --backend "gpu:device=0,cap=32,threads=8" \
    --backend "gpu:device=1,cap=32,threads=8" 2>&1 | tail -6 | tee "$OUT/calibrate_gpus.txt"
}

decode() {  # our GPU decode vs llama-batched-bench, fused greedy, then llama.cpp's per-sequence greedy
  _decode overhead_gpu.txt "${REPEATS:-5}" 1,4,8,16,32
  _decode overhead_gpu_unfused.txt 2 1,4,16,32 --no-fused-greedy
}

decode_grammar() {  # one sequence of each batch under a grammar (host sampling) beside fused-greedy ones
  _decode overhead_gpu_grammar.txt 2 1,4,16,32 --constrained 1
}

decode_split() { _decode overhead_gpu_split.txt 2 1,4,16,32 --kv split; }

sampling() {  # ~3 min: temperature 0.8 / top-p 0.95 (fused, and llama.cpp's per-sequence chains) against greedy,
              # and greedy against llama-batched-bench, B = 1..128, in one run
  _stamp "GPU decode: temperature sampling vs greedy, greedy vs batched-bench"
  python3 -m app bench overhead --model "$M" --device gpu --threads 8 --batches 1,4,16,32,64,128 --sampled \
    --batched-bench "$LCBIN/llama-batched-bench" --no-llama --repeats "${REPEATS:-3}" 2>&1 \
    | tail -$((${REPEATS:-3} + 3)) | tee "$OUT/overhead_gpu_sampling.txt"
}
sampling_extras() {  # what OpenAI's extras cost beside fused greedy (cost_MODE_bB = MODE tok/s / plain's)
  _stamp "GPU decode with logprobs / logit_bias / penalties beside plain greedy"
  python3 -m app bench overhead --model "$M" --device gpu --threads 8 --batches 1,8,32 --no-llama --repeats 2 \
    --sampling plain,logprobs,logit_bias,penalties 2>&1 | tail -6 | tee "$OUT/overhead_gpu_extras.txt"
}

sampling_parts() {  # ~4 min: the fused sampler's parts alone (temperature over the whole vocabulary, + top-k 40,
                   # + top-p 0.95, + min-p 0.05; topk1/full1: topk/full with one ggml_top_k per row instead of
                   # the top-k in stages) against greedy at B = 1-32, with each part's graph reuse; then
                   # the same with CUDA graphs off (GGML_CUDA_DISABLE_GRAPHS=1): if greedy slows and the parts do
                   # not, the fused graph was already running without CUDA graphs
  _stamp "GPU decode: fused sampler parts vs greedy"
  for graphs in on off; do
    ( [ "$graphs" = off ] && export GGML_CUDA_DISABLE_GRAPHS=1
      python3 -m app bench overhead --model "$M" --device gpu --threads 8 --batches 1,4,16,32 \
        --sampled-variants temp,topk,topp,full,topk1,full1 --no-llama --repeats "${REPEATS:-2}" 2>&1 \
        | tail -$((${REPEATS:-2} + 2)) | tee "$OUT/sampling_parts_graphs_$graphs.txt" )
  done
  # what a user gets: the engine's default, llama.cpp's chains below 8 temperature requests, fused from 8
  python3 -m app bench overhead --model "$M" --device gpu --threads 8 --batches 1,4,16,32 --sampled \
    --fused-dist-from 8 --no-llama --repeats "${REPEATS:-2}" 2>&1 | tail -$((${REPEATS:-2} + 3)) \
    | tee "$OUT/sampling_default_policy.txt"
}

topk_stages() {  # ~5 min: the top-k in stages (topk/full) vs one ggml_top_k per row (topk1/full1) against greedy,
                # then temperature 0.8 / top-p 0.95 vs greedy with the fused sampler from 1 and from 8 sequences
  _stamp "GPU decode: top-k in stages vs one sort per row"
  python3 -m app bench overhead --model "$M" --device gpu --threads 8 --batches 1,4,16,32 \
    --sampled-variants topk,topk1,full,full1 --no-llama --repeats "${REPEATS:-2}" 2>&1 \
    | tail -$((${REPEATS:-2} + 2)) | tee "$OUT/topk_stages.txt"
  for from in 1 8; do
    _stamp "GPU decode: temperature sampling vs greedy, fused from $from"
    python3 -m app bench overhead --model "$M" --device gpu --threads 8 --batches 1,4,16,32 --sampled \
      --fused-dist-from "$from" --no-llama --repeats "${REPEATS:-2}" 2>&1 | tail -$((${REPEATS:-2} + 3)) \
      | tee "$OUT/sampling_fused_from_$from.txt"
  done
}

threads() {  # host threads of the GPU context at small batches
  for t in 1 4 8; do _decode "threads_gpu_$t.txt" 3 1,4,16 --threads "$t"; done
}

cpu15() {
  _stamp "CPU decode vs batched-bench, 15 threads"
  python3 -m app bench overhead --model "$M" --device cpu --threads 15 --batches 1,4 \
    --batched-bench "$LCBIN/llama-batched-bench" --no-llama --repeats 2 2>&1 | tail -1 | tee "$OUT/overhead_cpu15.txt"
}

together() {
  _stamp "both backends at once"
  python3 -m app bench together --model "$M" --gpu-batch 16 --cpu-batch 4 --gpu-threads 1 --cpu-threads 15 \
    --repeats 3 2>&1 | tail -5 | tee "$OUT/together.txt"
}

gil() {
  for si in 5 1; do
    _stamp "GIL: beside a busy Python thread, switch interval $si ms"
    python3 -m app bench overhead --model "$M" --device gpu --threads 8 --batches 1,16 --busy-thread \
      --switch-interval-ms "$si" --no-llama --repeats 2 2>&1 | tail -1 | tee -a "$OUT/gil_gpu.txt"
  done
}

prefill() {  # n_batch / n_ubatch: a cold prompt alone, and arriving beside decoding sequences
  _stamp "prefill GPU"
  python3 -m app bench prefill --model "$M" --device gpu --threads 8 --prompt-tokens 2048 \
    --sizes 256/256,512/512,1024/512,2048/512,2048/1024,2048/2048 --decoders 16 --decode-tokens 1024 \
    --repeats 3 2>&1 | tail -1 | tee "$OUT/prefill_gpu.txt"
  _stamp "prefill CPU, 15 threads"
  python3 -m app bench prefill --model "$M" --device cpu --threads 15 --prompt-tokens 1024 \
    --sizes 256/256,512/512,1024/512,1024/1024 --decoders 4 --decode-tokens 512 \
    --repeats 2 2>&1 | tail -1 | tee "$OUT/prefill_cpu15.txt"
}

mixed_steps() {  # the simulator's step model: a 516-token prompt (the grid's) beside 1, 4, 8 and 16 decoders
  for dec in 1 4 8 16; do
    _stamp "prefill GPU beside $dec decoders, 516-token prompt"
    python3 -m app bench prefill --model "$M" --device gpu --threads 8 --prompt-tokens 516 \
      --sizes 512/512 --decoders "$dec" --decode-tokens 1024 --repeats 5 2>&1 | tail -1 | tee -a "$OUT/mixed_steps_gpu.txt"
  done
}

n48() {  # the study's N=48, GPU-only at caps 8 and CAPS, beside llama-server -np 8 and our server at cap 16
  _tandem_server 16 8095; _llama_server 8 8092; _wait_ready 8095 8092
  _stamp "N=48, GPU caps 8,${CAPS:-16,32}, ${RUNS:-5} runs"
  python3 -X faulthandler -m app bench grid --model "$M" --backend gpu:cap=8,ctx=32768,threads=8 \
    --backend cpu:cap=4,threads=15 --requests 48 --runs "${RUNS:-5}" --shared 96 --outputs fixed --arrivals interval \
    --caps "${CAPS:-16,32}" --sweep-policies gpu-only --policies gpu-only --target-warm 4 \
    --target llama-server-np8=http://127.0.0.1:8092 --target tandem-serve-cap16=http://127.0.0.1:8095 \
    --no-plots --out "$OUT/n48" 2>&1 | grep -v "it/s\]" | tail -18
  _stop_servers
}

grid() {  # the GPU's KV budget (room for KV whole sequences), then the unconstrained grid
  _stamp "KV budgets"
  python3 -X faulthandler -m app bench grid --model "$M" --backend gpu:cap=64,threads=8 --backend cpu:cap=4,threads=15 \
    --requests 48 --runs "${RUNS:-2}" --shared 0,96 --outputs fixed --arrivals interval --caps none \
    --policies gpu-only,seed-score,predicted-finish --kv-seqs "${KV:-4,8,16}" --no-plots --out "$OUT/grid-kv" 2>&1 \
    | grep -v "it/s\]" | tail -60
  _stamp "unconstrained, GPU cap ${GPU_CAP:-16}"
  python3 -X faulthandler -m app bench grid --model "$M" --backend "gpu:cap=${GPU_CAP:-16},ctx=16384,threads=8" \
    --backend cpu:cap=4,threads=15 --requests 48 --runs "${RUNS:-2}" --shared 0,50 --outputs fixed,uniform \
    --arrivals interval,poisson --caps none --policies gpu-only,seed-score,predicted-finish --no-plots \
    --out "$OUT/grid-open" 2>&1 | grep -v "it/s\]" | tail -60
}

boundary() {  # where hybrid routing starts to pay: KV for 4 sequences and a growing backlog
  for load in "96 20" "192 50"; do
    set -- $load
    _stamp "KV budget 4, shared 0 %, N=$1 every $2 ms"
    python3 -X faulthandler -m app bench grid --model "$M" --backend gpu:cap=64,threads=8 --backend cpu:cap=4,threads=15 \
      --requests "$1" --interval-ms "$2" --runs "${RUNS:-2}" --shared 0 --outputs fixed --arrivals interval --caps none \
      --policies gpu-only,seed-score,predicted-finish --kv-seqs 4 --warmup 0 --no-plots --out "$OUT/boundary-n$1-i$2" 2>&1 \
      | grep -v "it/s\]" | tail -16
  done
}

fleet() {  # one engine per GPU behind Tandem's router and sglang-router, the tenant workload (see fleet.sh)
  bash scripts/gpu/fleet.sh
}
share_prefill() {  # a running prompt shared (publication + deferral) on vs off, one GPU, K=8 tenants (~2 min)
  _stamp "share_prefill: computed prompt tokens, TTFT, makespan; sharing off vs on"
  BACKEND="gpu:cap=48,ctx=32768,threads=8" MODEL="$M" MIN_OUT=32 MAX_OUT=256 WARMUP=1 TENANTS=${TENANTS:-8} PREFIX=1500 REQUESTS=${REQUESTS:-300} \
    RATE=${RATE:-60} RUNS=${RUNS:-1} OUT="$OUT/share-prefill" bash scripts/share_prefill.sh 2>&1 \
    | tee "$OUT/share-prefill.txt"
}

devices() {  # one backend per GPU through llama.cpp's device list, each snapshot with its GPU's memory
  python3 scripts/gpu/devices.py 2>&1 | tail -30 | tee "$OUT/devices.txt"
}

# ---- adaptive cap and KV layout (each prints its ratios from one invocation) ----

_caps_grid() {  # _caps_grid OUTDIR [bench grid workload options...]: the adaptive cap beside fixed caps
  # The backend has no cap (adaptive); `gpu-only` runs it so, `gpu-only@cap=N` at a fixed cap N.
  local dir=$1; shift
  python3 -X faulthandler -m app bench grid --model "$M" --backend gpu:threads=8 --runs "${RUNS:-2}" \
    --caps "${CAPS:-4,8,16,32,48}" --sweep-policies gpu-only --policies gpu-only --no-plots --out "$OUT/$dir" "$@" 2>&1 \
    | grep -v "it/s\]" | tail -4
  python3 scripts/gpu/ratios.py caps "$OUT/$dir" | tee "$OUT/$dir.txt"
}

adaptive() {  # no cap given vs fixed caps: the study's N=48 and the long-prompt workload (~4 min)
  _stamp "adaptive cap vs fixed caps ${CAPS:-4,8,16,32,48}: the study's N=48"
  _caps_grid caps-n48 --requests 48 --shared 96 --outputs fixed --arrivals interval
  _stamp "adaptive cap vs fixed caps: 1,516-token prompts (1,000 shared), outputs 32-512, Poisson 20/s, N=64"
  _caps_grid caps-long --requests 64 --prompt-tokens 1516 --shared 66 --outputs uniform --min-output 32 \
    --max-output 512 --arrivals poisson --rate 20
}

adaptive_grid() {  # the same on the unconstrained grid's rows (shared 0/50 %, outputs, arrivals; ~5 min at RUNS=1)
  _stamp "adaptive cap vs fixed caps: the grid"
  RUNS=${RUNS:-1} _caps_grid caps-grid --requests 48 --shared 0,50 --outputs fixed,uniform --arrivals interval,poisson
}

kvlayout() {  # many tenants and the context size, per KV layout (~6 min)
  # Unified KV (one buffer: a step attends over every cell in use, other tenants' prefixes
  # included), the same with a small idle-cache budget, and split KV (a stream per sequence,
  # cached prefixes copied on the device). 1,500-token tenant prefixes, outputs 32-256, Poisson.
  _stamp "KV layout: 4, 16, 32 tenants, N=200, cap 32"
  python3 -X faulthandler -m app bench grid --model "$M" \
    --backend gpu:name=unified,cap=32,ctx=65536,threads=8 \
    --backend gpu:name=idle2k,cap=32,ctx=65536,idle_cache_cells=2048,threads=8 \
    --backend gpu:name=split,kv=split,cap=32,seq_ctx=2048,threads=8 \
    --requests 200 --runs 1 --tenants 4,16,32 --outputs uniform --min-output 32 --max-output 256 \
    --arrivals poisson --rate 30 --caps none --policies only:unified,only:idle2k,only:split --no-plots \
    --out "$OUT/kv-tenants" 2>&1 | grep -v "it/s\]" | tail -4
  python3 scripts/gpu/ratios.py tenants "$OUT/kv-tenants" | tee "$OUT/kv-tenants.txt"
  # Unified twice more with an idle budget of 2,048 cells: the default budget (n_ctx / B) grows
  # with the context, so it may be what makes the context size alone matter.
  _stamp "KV layout: the context size alone, 4 tenants (unified 12k vs 32k cells; split 2k vs 4k per stream)"
  python3 -X faulthandler -m app bench grid --model "$M" \
    --backend gpu:name=u12k,cap=32,ctx=12288,threads=8 --backend gpu:name=u32k,cap=32,ctx=32768,threads=8 \
    --backend gpu:name=u12k-idle2k,cap=32,ctx=12288,idle_cache_cells=2048,threads=8 \
    --backend gpu:name=u32k-idle2k,cap=32,ctx=32768,idle_cache_cells=2048,threads=8 \
    --backend gpu:name=s2k,kv=split,cap=32,seq_ctx=2048,threads=8 \
    --backend gpu:name=s4k,kv=split,cap=32,seq_ctx=4096,threads=8 \
    --requests 200 --runs "${RUNS:-2}" --tenants 4 --outputs uniform --min-output 32 --max-output 256 \
    --arrivals poisson --rate 30 --caps none --no-plots \
    --policies only:u12k,only:u32k,only:u12k-idle2k,only:u32k-idle2k,only:s2k,only:s4k \
    --out "$OUT/kv-ctx" 2>&1 | grep -v "it/s\]" | tail -4
  python3 scripts/gpu/ratios.py pairs "$OUT/kv-ctx" only:u32k/only:u12k only:u32k-idle2k/only:u12k-idle2k \
    only:s4k/only:s2k only:s2k/only:u12k | tee "$OUT/kv-ctx.txt"
}

tenants() {  # many tenants with the GPU's default context (65,536 cells), by sequence slots and idle budget (~4 min)
  # base: the defaults (cap 32 -> 40 sequence slots: running + cached prefixes, idle budget n_ctx / B);
  # slots: 104 slots, so 32 tenants' prefixes keep an id each beside 32 running; slots-keep: and
  # no idle budget; c32k: the pool clamped to the training context, as before.
  _stamp "tenants 4/16/32: slots and idle budget, N=200, cap 32, Poisson 30/s"
  python3 -X faulthandler -m app bench grid --model "$M" \
    --backend gpu:name=base,cap=32,threads=8 \
    --backend gpu:name=slots,cap=32,n_seq_max=104,threads=8 \
    --backend gpu:name=slots-keep,cap=32,n_seq_max=104,idle_cache_cells=1048576,threads=8 \
    --backend gpu:name=c32k,cap=32,ctx=32768,threads=8 \
    --requests 200 --runs "${RUNS:-1}" --tenants 4,16,32 --outputs uniform --min-output 32 --max-output 256 \
    --arrivals poisson --rate 30 --caps none --policies only:base,only:slots,only:slots-keep,only:c32k --no-plots \
    --out "$OUT/tenants" 2>&1 | grep -v "it/s\]" | tail -4
  python3 scripts/gpu/ratios.py tenants "$OUT/tenants" | tee "$OUT/tenants.txt"
  python3 scripts/gpu/ratios.py pairs "$OUT/tenants" only:slots/only:base only:slots-keep/only:base \
    only:base/only:c32k | tee -a "$OUT/tenants.txt"
}

tenant_groups() {  # one context at cap 32 vs two on the same GPU at cap 16 each, tenants kept whole by
                  # cache-aware routing (each context attends only over its own tenants' cells); ~4 min
  for layout in "one gpu:name=one,cap=32,threads=8 only:one" \
                "two gpu:name=ga,cap=16,threads=8;gpu:name=gb,cap=16,threads=8 cache-aware"; do
    set -- $layout
    _stamp "tenant groups: $1 (tenants 4/16/32, N=200, Poisson 30/s)"
    IFS=';' read -ra specs <<< "$2"; args=(); for b in "${specs[@]}"; do args+=(--backend "$b"); done
    python3 -X faulthandler -m app bench grid --model "$M" "${args[@]}" --requests 200 --runs "${RUNS:-1}" \
      --tenants 4,16,32 --outputs uniform --min-output 32 --max-output 256 --arrivals poisson --rate 30 \
      --caps none --policies "$3" --no-plots --out "$OUT/groups-$1" 2>&1 | grep -v "it/s\]" | tail -2
    python3 scripts/gpu/ratios.py tenants "$OUT/groups-$1" | tee -a "$OUT/groups.txt"
  done
}

layouts() {  # one GPU context vs two on the same GPU, default (adaptive) caps: the study's N=48 and the
            # long-prompt workload (~3 min); two contexts under cache-aware, seed-score, predicted-finish
  for layout in "one gpu:name=one,threads=8 only:one" \
                "two gpu:name=ga,threads=8;gpu:name=gb,threads=8 cache-aware,seed-score,predicted-finish"; do
    set -- $layout
    IFS=';' read -ra specs <<< "$2"; args=(); for b in "${specs[@]}"; do args+=(--backend "$b"); done
    _stamp "layout $1: the study's N=48"
    python3 -X faulthandler -m app bench grid --model "$M" "${args[@]}" --requests 48 --runs "${RUNS:-2}" \
      --shared 96 --outputs fixed --arrivals interval --caps none --policies "$3" --no-plots \
      --out "$OUT/layout-$1-n48" 2>&1 | grep -v "it/s\]" | grep "^| " | grep -v "^| policy\|^|---\|^| workload"
    _stamp "layout $1: 1,516-token prompts (1,000 shared), outputs 32-512, Poisson 20/s, N=64"
    python3 -X faulthandler -m app bench grid --model "$M" "${args[@]}" --requests 64 --runs "${RUNS:-2}" \
      --prompt-tokens 1516 --shared 66 --outputs uniform --min-output 32 --max-output 512 --arrivals poisson \
      --rate 20 --caps none --policies "$3" --no-plots --out "$OUT/layout-$1-long" 2>&1 | grep -v "it/s\]" \
      | grep "^| " | grep -v "^| policy\|^|---\|^| workload"
  done
}

_tenants_two_contexts() {  # _tenants_two_contexts OUTDIR RUNS: tenants 4/16/32 on gpu:contexts=2 (adaptive caps)
  python3 -X faulthandler -m app bench grid --model "$M" --backend gpu:contexts=2,threads=8 \
    --requests 200 --runs "$2" --tenants 4,16,32 --outputs uniform --min-output 32 --max-output 256 \
    --arrivals poisson --rate 30 --caps none --policies seed-score,cache-aware --no-plots \
    --out "$OUT/$1" 2>&1 | grep -v "it/s\]" | tail -1
  python3 scripts/gpu/ratios.py tenants "$OUT/$1" | tee "$OUT/$1.txt"
}

tenants_default() {  # the must-show on the one-GPU default layout (two contexts), tenants 4/16/32, N=200,
                    # Poisson 30/s; then the context size alone (12k vs 32k cells) at 4 tenants (~5 min)
  _stamp "tenants 4/16/32 on gpu:contexts=2"
  _tenants_two_contexts tenants-default "${RUNS:-2}"
  _stamp "the context size alone: 12k vs 32k cells, one context, 4 tenants"
  python3 -X faulthandler -m app bench grid --model "$M" --backend gpu:name=u12k,cap=32,ctx=12288,threads=8 \
    --backend gpu:name=u32k,cap=32,ctx=32768,threads=8 --requests 200 --runs "${RUNS:-2}" --tenants 4 \
    --outputs uniform --min-output 32 --max-output 256 --arrivals poisson --rate 30 --caps none --no-plots \
    --policies only:u12k,only:u32k --out "$OUT/ctx-alone" 2>&1 | grep -v "it/s\]" | tail -2
  python3 scripts/gpu/ratios.py pairs "$OUT/ctx-alone" only:u32k/only:u12k | tee "$OUT/ctx-alone.txt"
}

final_check() {  # ~4 min: the defaults after the GPU ceiling moved to 32 (16 per context of two): the tenants
                # must-show on the one-GPU default layout, and the adaptive cap on both workloads
  _stamp "tenants 4/16/32 on gpu:contexts=2 (ceilings 16 each)"
  _tenants_two_contexts tenants-default2 "${RUNS:-1}"
  _stamp "adaptive (ceiling 32) vs fixed caps: long prompts"
  RUNS=2 CAPS=16,32 _caps_grid caps-long2 --requests 64 --prompt-tokens 1516 --shared 66 --outputs uniform \
    --min-output 32 --max-output 512 --arrivals poisson --rate 20
  _stamp "adaptive (ceiling 32) vs fixed caps: the study's N=48"
  RUNS=2 CAPS=8,16,32 _caps_grid caps-n48-2 --requests 48 --shared 96 --outputs fixed --arrivals interval
}

slots() {  # what sequence slots cost a decode step: 40 (cap 32's default) vs 104, B = 1-64
  _decode overhead_gpu_slots40.txt 2 1,16,32 --n-seq-max 40
  _decode overhead_gpu_slots104.txt 2 1,16,32 --n-seq-max 104
}

decode_big() {  # greedy decode vs llama-batched-bench at B = 64 and 128 (target: >= 0.90x), one invocation
  _decode overhead_gpu_big.txt "${REPEATS:-3}" "${BIG_BATCHES:-64,128}"
}

sampling_sortfree() {  # ~2.5 min: temperature 0.8 + top-p 0.95 (p), + top-k 40 (pk) and the chat default (full, + min-p
                      # 0.05) with the sort-free fused sampler, beside the computation by sorts (NAME-staged), each
                      # against greedy at B = 1, 4, 16, 32 in one invocation (target: >= 0.95x)
  _stamp "GPU decode: sort-free temperature sampling vs greedy"
  python3 -m app bench overhead --model "$M" --device "$G" --threads 8 --batches "${SAMPLING_BATCHES:-1,4,16,32}" \
    --sampled-variants "${SAMPLING_VARIANTS:-p,pk,full,pk-staged,full-staged}" --no-llama --repeats "${REPEATS:-3}" \
    --fused-dist-from "${FUSED_FROM:-1}" 2>&1 | tail -$((${REPEATS:-3} + 2)) | tee "$OUT/sampling_sortfree${FUSED_FROM:+_from$FUSED_FROM}.txt"
}

decode_wide() {  # greedy decode vs llama-batched-bench at B = 1-128 alone (the must-show's batch sizes)
  _decode overhead_gpu_wide.txt "${REPEATS:-3}" 1,4,16,32,64,128
}

spin() {  # the engine's OpenMP spin count (GOMP_SPINCOUNT=2000, engine/llama/__init__.py) vs libgomp's
        # 300,000 on the GPU host: greedy decode vs batched-bench at B = 1-32 (its CPU runs the input rows)
  GOMP_SPINCOUNT=300000 _decode overhead_gpu_spin300k.txt 2 1,4,16,32
  _decode overhead_gpu_spin2k.txt 2 1,4,16,32
}

decode_long() {  # saturated decode at the long-prompt workload's context (1,516-token prompts, 256 generated)
  # vs llama-batched-bench at the same batch sizes and lengths (must-show: >= 0.85x)
  _decode overhead_gpu_long.txt 2 16,32,64 --prompt-tokens 1516 --gen-tokens 256
}

simulate() {  # the grid and the boundary on today's engine, each predicted by `tandem simulate --replay`
  grid
  boundary
  for d in "$OUT"/grid-kv "$OUT"/grid-open "$OUT"/boundary-n*; do
    _stamp "replay $d"
    python3 -m app simulate --replay "$d" --hardware h200 --out "$d/replay" 2>&1 | grep -v "it/s\]" | tail -40
  done
}

# ---- defaults that never lose (issue: the default policy, the adaptive cap, the layout) ----

W_TENANTS="--requests ${N_TENANTS:-200} --tenants ${TENANTS:-4,16,32} --tenant-prefix-tokens 1500 --tenant-suffix-tokens 50
  --outputs uniform --min-output 32 --max-output 256 --arrivals poisson --rate 40"
W_N48="--requests 48 --shared 96 --outputs fixed --arrivals interval"
W_LONG="--requests 64 --prompt-tokens 1516 --shared 66 --outputs uniform --min-output 32 --max-output 512
  --arrivals poisson --rate 20"

_layout_grid() {  # _layout_grid OUTDIR WORKLOAD-VAR [bench grid options...]
  local dir=$1 w=$2; shift 2
  _stamp "$dir"
  # shellcheck disable=SC2086
  python3 -X faulthandler -m app bench grid --model "$M" ${!w} --runs "${RUNS:-1}" --no-plots --out "$OUT/$dir" "$@" 2>&1 \
    | grep -v "it/s\]" | grep "^| " | grep -v "^|---" | tee -a "$OUT/$dir.txt"
}

baseline_defaults() {  # today's default layout and policy vs tuned GPU-only layouts, tenants first (~9 min)
  _stamp "calibrate the default layout, as serve does at load"
  python3 -m app calibrate --model "$M" 2>&1 | tail -3 | tee "$OUT/calibrate-default.txt"
  for w in W_TENANTS W_LONG W_N48; do
    local tag=${w#W_}; tag=${tag,,}
    _layout_grid "default-$tag" "$w" --caps none --policies predicted-finish
    _layout_grid "one-$tag" "$w" --backend $G:threads=8 --caps "${CAPS:-32,64,128}" --sweep-policies gpu-only \
      --policies gpu-only
    _layout_grid "two-$tag" "$w" --backend $G:name=ga,cap=32,threads=8 --backend $G:name=gb,cap=32,threads=8 \
      --caps none --policies cache-aware,predicted-finish
  done
}

chat() {  # ~8 min: issue 26's chat workload (CHAT_N=96 conversations x 8 turns, 6/s, think 1 s, a 600-word
          # system prompt, user turns 40-120 words, replies 32-192 tokens) in one `tandem bench chat` against
          # one `tandem serve --model M` (default), two on this GPU behind `tandem serve --backend remote:...
          # --policy cache-aware`, one with two contexts (`gpu:contexts=2 --policy cache-aware`: a cap ceiling
          # each now) and llama-server -np 32 -c 131072 (its best there); each run cut at CHAT_LIMIT s. All
          # servers stay up (idle while another target runs); the first one started calibrates alone, the
          # others reuse its stored rates. CHAT_TWO_CONTEXTS=0 leaves the two-context one out.
  local limit=${CHAT_LIMIT:-110} n=${CHAT_N:-96} dir=$OUT/chat logs=$OUT/chat-logs
  mkdir -p "$logs"
  local targets=(--target one=http://127.0.0.1:8301 --target two-cache-aware=http://127.0.0.1:8304) ports=(8301 8304)
  python3 -m app serve --model "$M" --port 8301 > "$logs/one.log" 2>&1 & SERVERS+=($!)
  _wait_ready 8301
  python3 -m app serve --model "$M" --port 8302 > "$logs/a.log" 2>&1 & SERVERS+=($!)
  python3 -m app serve --model "$M" --port 8303 > "$logs/b.log" 2>&1 & SERVERS+=($!)
  if [ "${CHAT_TWO_CONTEXTS:-1}" = 1 ]; then
    python3 -m app serve --model "$M" --backend gpu:contexts=2 --policy cache-aware --port 8306 \
      > "$logs/contexts2.log" 2>&1 & SERVERS+=($!)
    targets+=(--target contexts2-cache-aware=http://127.0.0.1:8306); ports+=(8306)
  fi
  if [ -x "${LCBIN:-/nonexistent}/llama-server" ]; then
    "$LCBIN/llama-server" -m "$P" -ngl 99 -np 32 -c 131072 --port 8305 --host 127.0.0.1 -fa auto \
      > "$logs/llama-server.log" 2>&1 & SERVERS+=($!)
    targets+=(--target llama-server-np32=http://127.0.0.1:8305); ports+=(8305)
  else
    echo "chat: no llama-server in \$LCBIN; running without it"
  fi
  _wait_ready 8302 8303
  python3 -m app serve --backend remote:url=http://127.0.0.1:8302,name=a \
    --backend remote:url=http://127.0.0.1:8303,name=b --policy cache-aware --port 8304 > "$logs/router.log" 2>&1 &
  SERVERS+=($!)
  _wait_ready "${ports[@]}"
  _stamp "chat: $n conversations x ${CHAT_TURNS:-8} turns, $((${#targets[@]} / 2)) targets, $limit s each at most"
  python3 -X faulthandler -m app bench chat --conversations "$n" --turns "${CHAT_TURNS:-8}" --rate 6 --think 1 \
    --system-words "${CHAT_SYSTEM_WORDS:-600}" --user-words "${CHAT_USER_WORDS:-40-120}" \
    --reply-tokens "${CHAT_REPLY_TOKENS:-32-192}" "${targets[@]}" --time-limit "$limit" --no-plots --out "$dir" 2>&1 \
    | grep -v "it/s\]" | tail -"${CHAT_TAIL:-60}"
  _stop_servers
}

_chat_bench() {  # _chat_bench LABEL PORT: issue 26's chat workload against one server, cut at CHAT_LIMIT s
  _stamp "chat: $1 (${CHAT_N:-96} conversations)"
  python3 -X faulthandler -m app bench chat --conversations "${CHAT_N:-96}" --turns "${CHAT_TURNS:-8}" --rate 6 --think 1 \
    --system-words 600 --user-words 40-120 --reply-tokens 32-192 --target "$1=http://127.0.0.1:$2" \
    --time-limit "${CHAT_LIMIT:-110}" --no-plots --out "$OUT/chat-$1" 2>&1 | grep -v "it/s\]" | grep "^| \|rror" \
    | grep -v "^|---" | tee -a "$OUT/chat-layouts.txt"
}

_serve_bg() {  # _serve_bg LOGFILE PORT [serve options...]: start one tandem serve in the background
  local log=$1 port=$2; shift 2
  python3 -m app serve --model "$M" --port "$port" "$@" > "$log" 2>&1 & SERVERS+=($!); SERVER_LOGS[$!]=$log
}
_serve_one() {  # _serve_one LOGNAME PORT [serve options...]: start one tandem serve, wait for it
  local name=$1 port=$2; shift 2
  _serve_bg "$OUT/logs/$name.log" "$port" "$@"
  _wait_ready "$port"
}

chat_layouts() {  # ~9 min: the chat workload on one process per layout (1, 2, 4 GPU contexts, cache-aware), against
                 # two processes on the GPU behind Tandem's router, today's default, and llama-server -np 32
  mkdir -p "$OUT/logs"
  _serve_one a 8302 --backend $G; _serve_one b 8303 --backend gpu
  python3 -m app serve --backend remote:url=http://127.0.0.1:8302,name=a --backend remote:url=http://127.0.0.1:8303,name=b \
    --policy cache-aware --port 8304 > "$OUT/logs/router.log" 2>&1 & SERVERS+=($!)
  _wait_ready 8304; _chat_bench two-processes 8304; _stop_servers
  for n in 2 4 1; do
    _serve_one "ctx$n" 8310 --backend "$G:contexts=$n" --policy cache-aware; _chat_bench "contexts-$n" 8310; _stop_servers
  done
  _serve_one default 8311; _chat_bench default 8311; _stop_servers
  [ -x "${LCBIN:-/none}/llama-server" ] || return 0
  "$LCBIN/llama-server" -m "$P" -ngl 99 -np 32 -c 131072 --port 8305 --host 127.0.0.1 -fa auto \
    > "$OUT/logs/llama-server.log" 2>&1 & SERVERS+=($!)
  _wait_ready 8305; CHAT_LIMIT=${LLAMA_LIMIT:-100} _chat_bench llama-server-np32 8305; _stop_servers
}

# ---- defaults that never lose (issue 25) ----

_defaults_grid() {  # _defaults_grid OUTDIR [bench grid workload options...]: the default beside tuned rows
  # The engine as a user gets it (no --backend: the default layout, adaptive caps) under `default`;
  # in the same invocation its first GPU context alone at fixed caps ($CAPS; `only:swept`: with
  # several default contexts the others stay idle) and, over HTTP, the GPU as two contexts under
  # cache-aware ($TUNED2, a `tandem serve` started by `defaults`) and the servers of $ALTS.
  local dir=$1; shift
  local alt=() alts a
  IFS=';' read -ra alts <<< "${ALTS:-}"
  _alt_targets alt
  python3 -X faulthandler -m app bench grid --model "$M" --runs "${RUNS:-1}" --warmup "${WARMUP:-1}" \
    --policies default --caps "${CAPS:-16,32,64}" --sweep-policies "${SWEEP:-only:swept}" \
    --target "two-contexts=http://127.0.0.1:${TUNED2_PORT:-8097}" "${alt[@]}" --target-warm 4 \
    --no-plots --out "$OUT/$dir" "$@" 2>&1 | grep -v "it/s\]" | tail -3
  python3 scripts/gpu/ratios.py defaults "$OUT/$dir" default tuned | tee -a "$OUT/defaults.txt"
  for a in "${alts[@]}"; do  # each candidate layout against the same tuned rows
    _alt_up "${a%%=*}" || continue
    python3 scripts/gpu/ratios.py defaults "$OUT/$dir" "target:${a%%=*}" tuned | tee -a "$OUT/defaults.txt"
  done
}

_alt_up() { [[ ${ALT_DOWN:- } != *" $1 "* ]]; }  # _alt_up LABEL: whether $ALTS's server LABEL started (_alt_servers)
_alt_targets() {  # _alt_targets ARRAY: append `--target LABEL=URL` for each server of $ALTS that started to ARRAY
  local -n into=$1
  local i=0 alts a
  IFS=';' read -ra alts <<< "${ALTS:-}"
  for a in "${alts[@]}"; do
    ! _alt_up "${a%%=*}" || into+=(--target "${a%%=*}=http://127.0.0.1:$((ALT_PORT + i))")
    i=$((i + 1))
  done
}
_alt_parse() {  # _alt_parse "label=spec+spec[@policy]": ALT_NAME and ALT_ARGS, its serve options (no spec: the
                # default layout)
  local rest=${1#*=} parts b
  ALT_NAME=${1%%=*}; ALT_ARGS=()
  [[ $rest == *@* ]] && { ALT_ARGS=(--policy "${rest##*@}"); rest=${rest%@*}; }
  IFS='+' read -ra parts <<< "$rest"; for b in "${parts[@]}"; do ALT_ARGS+=(--backend "$b"); done
}
_alt_servers() {  # one `tandem serve` per entry of $ALTS ("label=spec+spec[@policy];label2=@policy"), on ports ALT_PORT (8200), ...;
                 # one that exits before it is ready is left out (ALT_DOWN: their labels; its log's end on stderr)
  local i=0 alts a pids=() names=() j
  ALT_DOWN=" "
  IFS=';' read -ra alts <<< "${ALTS:-}"
  for a in "${alts[@]}"; do
    _alt_parse "$a"
    _serve_bg "$OUT/logs/serve-alt-$ALT_NAME.log" $((ALT_PORT + i)) "${ALT_ARGS[@]}"
    pids+=($!); names+=("$ALT_NAME")
    i=$((i + 1))
  done
  for ((j = 0; j < i; j++)); do
    for _ in $(seq 300); do
      curl -sf "http://127.0.0.1:$((ALT_PORT + j))/health" >/dev/null && break
      kill -0 "${pids[j]}" 2>/dev/null || break
      sleep 0.2
    done
    if ! kill -0 "${pids[j]}" 2>/dev/null; then
      echo "alt ${names[j]} exited before it was ready, left out:" >&2; tail -n 15 "${SERVER_LOGS[${pids[j]}]}" >&2
      ALT_DOWN+="${names[j]} "
      local left=() p
      for p in "${SERVERS[@]}"; do [ "$p" = "${pids[j]}" ] || left+=("$p"); done
      SERVERS=("${left[@]}")
    fi
  done
  return 0
}

defaults() {  # ~6 min at RUNS=1: the default (no --backend, policy default) against the best tuned single-GPU
             # configuration found in the same invocation (fixed caps 16/32/64; two contexts), on the study's
             # N=48, the long-prompt workload and 4/16/32 tenants; prints makespan and TTFT p50 ratios
             # (+ about a minute per server in $ALTS)
  local n48=${N48:-48} long=${LONG_N:-64} tn=${TENANT_N:-200}
  mkdir -p "$OUT/logs"
  python3 -m app serve --model "$M" --backend "${TUNED2:-$G:contexts=2,cap=32,threads=8}" --policy cache-aware \
    --port "${TUNED2_PORT:-8097}" > "/tmp/tandem-serve-${TUNED2_PORT:-8097}.log" 2>&1 &
  SERVERS+=($!)
  _alt_servers  # other layouts beside them, e.g. ALTS="serve-default=;contexts-4=gpu:contexts=4"
  _wait_ready "${TUNED2_PORT:-8097}"
  _stamp "defaults: the study's N=$n48"
  _defaults_grid defaults-n48 --requests "$n48" --shared 96 --outputs fixed --arrivals interval
  _stamp "defaults: 1,516-token prompts (1,000 shared), outputs 32-512, Poisson 20/s, N=$long"
  _defaults_grid defaults-long --requests "$long" --prompt-tokens "${LONG_PROMPT:-1516}" --shared 66 \
    --outputs uniform --min-output 32 --max-output "${LONG_MAX_OUT:-512}" --arrivals poisson --rate 20
  _stamp "defaults: ${TENANTS:-4,16,32} tenants (1,500-token prefixes, 50-token suffixes), outputs 32-256, Poisson 40/s, N=$tn"
  _defaults_grid defaults-tenants --requests "$tn" --tenants "${TENANTS:-4,16,32}" \
    --tenant-prefix-tokens "${TENANT_PREFIX:-1500}" --tenant-suffix-tokens 50 --outputs uniform --min-output 32 \
    --max-output "${TENANT_MAX_OUT:-256}" --arrivals poisson --rate 40
  _stop_servers
}

_two_processes() {  # _two_processes PORT: two tandem serve (GPU only) on this GPU behind Tandem's router (cache-aware)
  _serve_one a 8302 --backend "$G"; _serve_one b 8303 --backend "$G"
  python3 -m app serve --backend remote:url=http://127.0.0.1:8302,name=a --backend remote:url=http://127.0.0.1:8303,name=b \
    --policy cache-aware --port "$1" > "$OUT/logs/router.log" 2>&1 & SERVERS+=($!)
  _wait_ready "$1"
}

chat_llama_server() {  # ~8 min: llama-server at -np 16/32/64, with -kvu and without, on the chat workload (each
                      # cut at LLAMA_LIMIT s), beside the no-knob default in the same call
  [ -x "${LCBIN:-/none}/llama-server" ] || { echo "chat_llama_server: no llama-server in \$LCBIN"; return 1; }
  mkdir -p "$OUT/logs"
  _serve_one default 8311; _chat_bench default 8311; _stop_servers
  _chat_alts 8312
  local np kvu ctx
  for np in ${LLAMA_NPS:-32 16 64}; do
    ctx=$((np > 32 ? 262144 : 131072))
    for kvu in "" -kvu; do
      "$LCBIN/llama-server" -m "$P" -ngl 99 -np "$np" -c "$ctx" $kvu --port 8305 --host 127.0.0.1 -fa auto \
        > "$OUT/logs/llama-server-np$np$kvu.log" 2>&1 & SERVERS+=($!)
      _wait_ready 8305; CHAT_LIMIT=${LLAMA_LIMIT:-60} _chat_bench "llama-server-np$np$kvu" 8305; _stop_servers
    done
  done
}
chat_cache() {  # ~7 min: what the default layout's caches keep on the chat workload (96 conversations): the
               # idle budget (`idle_cache_cells`: while B run, a context keeps idle_cache_cells / B cached cells no
               # running sequence uses; default 65,536) and the pool (65,536 cells per context) against larger ones
  mkdir -p "$OUT/logs"
  _serve_one default 8311; _chat_bench default 8311; _stop_servers
  local idle ctx
  for idle in ${CHAT_IDLE:-262144 -1}; do
    _serve_one "idle$idle" 8312 --backend "$G:idle_cache_cells=$idle"; _chat_bench "idle-$idle" 8312; _stop_servers
  done
  for ctx in ${CHAT_CTX:-131072}; do
    _serve_one "ctx$ctx" 8313 --backend "$G:ctx=$ctx,idle_cache_cells=-1"; _chat_bench "ctx-$ctx-idle-all" 8313
    _stop_servers
  done
}
_chat_alts() {  # _chat_alts PORT: the chat workload on one `tandem serve` per $ALTS entry (as in defaults_http:
               # "label=spec+spec[@policy];..."), one at a time, labelled alt-LABEL$CHAT_SUFFIX
  local alts a
  IFS=';' read -ra alts <<< "${ALTS:-}"
  for a in "${alts[@]}"; do
    _alt_parse "$a"
    _serve_one "chat-alt-$ALT_NAME" "$1" "${ALT_ARGS[@]}"; _chat_bench "alt-$ALT_NAME${CHAT_SUFFIX:-}" "$1"; _stop_servers
  done
}

chat_contexts() {  # ~8.5 min: contexts per GPU on the chat workload at CHAT_NS conversations (96 192 24): the
                  # default (no --backend) against each layout of $ALTS (e.g. "contexts-8=gpu:contexts=8+cpu:threads=15")
                  # and two default processes behind Tandem's router
  mkdir -p "$OUT/logs"
  local n
  for n in ${CHAT_NS:-96 192 24}; do
    _serve_one "default-$n" 8311; CHAT_N=$n _chat_bench "default-n$n" 8311; _stop_servers
    CHAT_N=$n CHAT_SUFFIX=-n$n _chat_alts 8312
    _two_processes 8304; CHAT_N=$n _chat_bench "two-processes-n$n" 8304; _stop_servers
  done
}

# The tuned single-GPU configurations of issue 25, each a `tandem serve` (label=spec): one or two contexts at
# fixed caps 16 / 32 / 64, two contexts under cache-aware (which keeps a tenant on one).
TUNED=(one-ctx-cap16="$G:contexts=1,cap=16,adaptive=0,threads=8" one-ctx-cap32="$G:contexts=1,cap=32,adaptive=0,threads=8"
       one-ctx-cap64="$G:contexts=1,cap=64,adaptive=0,threads=8" two-ctx-cap16="$G:contexts=2,cap=16,adaptive=0,threads=8"
       two-ctx-cap32="$G:contexts=2,cap=32,adaptive=0,threads=8" two-ctx-cap64="$G:contexts=2,cap=64,adaptive=0,threads=8")
_tuned() {  # _tuned LABEL: whether the TUNED entry LABEL runs in this call (TUNED_ONLY: the labels that do; all)
  [ -z "${TUNED_ONLY:-}" ] || [[ " $TUNED_ONLY " == *" $1 "* ]]
}
_tuned_servers() {  # one `tandem serve` per TUNED entry on ports 8101..., the default (nothing else) on 8100;
                    # TUNED_PORTS: the ports started
  local i=1 t
  _serve_bg "$OUT/logs/serve-default.log" 8100
  TUNED_PORTS=(8100)
  for t in "${TUNED[@]}"; do
    if _tuned "${t%%=*}"; then
      local policy=(); [[ ${t#*=} == *contexts=2* ]] && policy=(--policy cache-aware)
      _serve_bg "$OUT/logs/serve-tuned-${t%%=*}.log" $((8100 + i)) --backend "${t#*=}" "${policy[@]}"
      TUNED_PORTS+=($((8100 + i)))
    fi
    i=$((i + 1))
  done
}
_backends() {  # _backends DIR --target LABEL=URL ...: each Tandem server's /v1/backends (its caches' hits, evictions
               # and lost tokens so far, per context) as DIR/backends.txt, a line per backend
  local dir=$1; shift
  python3 - "$dir" "$@" <<'PY'
import json, sys, urllib.request
out = open(f"{sys.argv[1]}/backends.txt", "w")
for arg in sys.argv[2:]:
    if arg == "--target":
        continue
    label, url = arg.split("=", 1)
    try:
        with urllib.request.urlopen(f"{url}/v1/backends", timeout=10) as r:
            doc = json.loads(r.read())
    except (OSError, ValueError) as e:
        print(f"{label}: {e}", file=out)
        continue
    for b in doc.get("backends", []):
        c = b.get("cache") or {}
        print(f"{label} | {b['name']} | cached {c.get('cached_tokens')} hit {c.get('hit_tokens')} of {c.get('query_tokens')} "
              f"| evictions {c.get('evictions')} lost {c.get('lost_tokens')} | steps {b.get('steps')}", file=out)
PY
}

_http_grid() {  # _http_grid OUTDIR SKIP [bench grid workload options...]: every server of defaults_http on one workload,
                # runs interleaved; SKIP: tuned labels left out of this workload
  local dir=$1 skip=" $2 " i=1 t a alts targets=(--target "default=http://127.0.0.1:8100")
  shift 2
  for t in "${TUNED[@]}"; do
    [[ $skip == *" ${t%%=*} "* ]] || ! _tuned "${t%%=*}" || targets+=(--target "tuned-${t%%=*}=http://127.0.0.1:$((8100 + i))")
    i=$((i + 1))
  done
  IFS=';' read -ra alts <<< "${ALTS:-}"
  _alt_targets targets
  python3 -X faulthandler -m app bench grid --model "$M" --runs "${RUNS:-3}" --warmup 1 --policies none --caps none \
    "${targets[@]}" --target-warm 4 --no-plots --out "$OUT/$dir" "$@" 2>&1 | grep -v "it/s\]" | tail -3
  python3 scripts/gpu/ratios.py runs "$OUT/$dir" > "$OUT/$dir/runs.txt"
  python3 scripts/gpu/ratios.py ttft "$OUT/$dir" > "$OUT/$dir/ttft.txt"
  _backends "$OUT/$dir" "${targets[@]}"
  python3 scripts/gpu/ratios.py defaults "$OUT/$dir" target:default tuned | tee -a "$OUT/defaults.txt"
  for a in "${alts[@]}"; do
    _alt_up "${a%%=*}" || continue
    python3 scripts/gpu/ratios.py defaults "$OUT/$dir" "target:${a%%=*}" tuned | tee -a "$OUT/defaults.txt"
  done
}

defaults_http() {  # issue 25's must-show, every row served over HTTP: `tandem serve --model M` with nothing else
                   # against each TUNED configuration, on HTTP_WORKLOADS (n48 long tenants), RUNS (3) interleaved runs,
                   # ratios to the best tuned row per workload (~4 min for tenants, ~3 for n48 + long; $ALTS beside,
                   # on ports 8200...; TENANT_SKIP: tuned rows left out of the tenant runs; TENANT_RUNS: their runs
                   # (RUNS); TUNED_ONLY: the tuned rows started at all)
  mkdir -p "$OUT/logs"
  _tuned_servers
  _alt_servers || { _stop_servers; return 1; }
  _wait_ready "${TUNED_PORTS[@]}" || { _stop_servers; return 1; }
  local w n48=${N48:-48} long=${LONG_N:-64} tn=${TENANT_N:-200}
  for w in ${HTTP_WORKLOADS:-n48 long tenants}; do
    case $w in
      n48) _stamp "defaults over HTTP: the study's N=$n48"
        _http_grid http-n48 "" --requests "$n48" --shared 96 --outputs fixed --arrivals interval ;;
      long) _stamp "defaults over HTTP: 1,516-token prompts (1,000 shared), outputs 32-512, Poisson 20/s, N=$long"
        _http_grid http-long "" --requests "$long" --prompt-tokens "${LONG_PROMPT:-1516}" --shared 66 \
          --outputs uniform --min-output 32 --max-output "${LONG_MAX_OUT:-512}" --arrivals poisson --rate 20 ;;
      tenants) _stamp "defaults over HTTP: ${TENANTS:-4,16,32} tenants, outputs 32-256, Poisson 40/s, N=$tn"
        RUNS=${TENANT_RUNS:-${RUNS:-3}} _http_grid http-tenants "${TENANT_SKIP:-}" --requests "$tn" --tenants "${TENANTS:-4,16,32}" \
          --tenant-prefix-tokens "${TENANT_PREFIX:-1500}" --tenant-suffix-tokens 50 --outputs uniform --min-output 32 \
          --max-output "${TENANT_MAX_OUT:-256}" --arrivals poisson --rate 40 ;;
    esac
  done
  _stop_servers
}

chat_tuned() {  # ~3.5 min: issue 26's chat workload (CHAT_N, 96, conversations) on `tandem serve --model M` against the
                # tuned CHAT_TUNED (two-ctx-cap32 two-ctx-cap64), each of $ALTS (as in defaults_http) and four
                # contexts under cache-aware (CHAT_CTX4=0: not), one server at a time
  mkdir -p "$OUT/logs"
  local t name
  _serve_one chat-default 8311; _chat_bench default 8311; _stop_servers
  _chat_alts 8311
  for name in ${CHAT_TUNED:-two-ctx-cap32 two-ctx-cap64}; do
    for t in "${TUNED[@]}"; do
      [ "${t%%=*}" = "$name" ] || continue
      _serve_one "chat-$name" 8311 --backend "${t#*=}" --policy cache-aware; _chat_bench "tuned-$name" 8311; _stop_servers
    done
  done
  if [ "${CHAT_CTX4:-1}" = 1 ]; then
    _serve_one chat-ctx4 8310 --backend "$G:contexts=4" --policy cache-aware; _chat_bench contexts-4-cache-aware 8310
    _stop_servers
  fi
}

final_defaults() {  # ~8 min, the points that decide first: the chat workload at CHAT_NS conversations (96 24 192)
                   # on `tandem serve --model M` (nothing else) against two processes behind Tandem's router,
                   # and at 96 against four contexts under cache-aware (CHAT_CTX4=0 leaves it out). The grid on
                   # the other workloads is `defaults` (its own call: ~6 min), llama-server's -np sweep
                   # `chat_llama_server`.
  mkdir -p "$OUT/logs"
  local n
  for n in ${CHAT_NS:-96 24 192}; do
    _serve_one "default-$n" 8311; CHAT_N=$n _chat_bench "default-n$n" 8311; _stop_servers
    _two_processes 8304; CHAT_N=$n _chat_bench "two-processes-n$n" 8304; _stop_servers
    if [ "$n" = 96 ] && [ "${CHAT_CTX4:-1}" = 1 ]; then
      _serve_one ctx4 8310 --backend "$G:contexts=4" --policy cache-aware; _chat_bench contexts-4-cache-aware 8310
      _stop_servers
    fi
  done
}

first_turns() {  # ~2 min: a fresh `tandem serve`'s first chat turns (24 conversations x 2 turns), with py-spy dumps of
                # the server and the GPU's utilisation while they run, as is and under FIRST_ENVS (space-separated
                # VAR=VALUE, one variant each: e.g. CUDA_MODULE_LOADING=EAGER GGML_CUDA_DISABLE_GRAPHS=1)
  mkdir -p "$OUT/logs"
  local v tag pid
  for v in plain ${FIRST_ENVS:-}; do
    tag=${v%%=*}; tag=${tag,,}
    if [ "$v" = plain ]; then _serve_one "first-$tag" 8311; else env "$v" bash -c ':' && export "$v"; _serve_one "first-$tag" 8311; unset "${v%%=*}"; fi
    pid=${SERVERS[-1]}
    ( for i in $(seq 10); do echo "--- $((i * 2)) s"; py-spy dump --pid "$pid" 2>&1 | grep -v "^ *$" | head -60; sleep 2; done ) \
      > "$OUT/logs/pyspy-$tag.txt" 2>&1 &
    ( for i in $(seq 50); do nvidia-smi --query-gpu=utilization.gpu,clocks.sm --format=csv,noheader 2>&1; sleep 0.5; done ) \
      > "$OUT/logs/gpu-$tag.txt" 2>&1 &
    CHAT_N=24 CHAT_TURNS=2 CHAT_LIMIT=60 _chat_bench "first-$tag" 8311; _stop_servers
  done
}

first_probe() {  # ~1.5 min: where a fresh server's first chat requests wait (scripts/gpu/first_probe.py: connect,
                # response head, first chunk; the accept queue and unread bytes), then `bench chat` 24 x 2 beside
                # the same sampling, on a second fresh server
  mkdir -p "$OUT/logs"
  local root=$PWD
  _serve_one probe 8311
  (cd "$OUT/logs" && python3 "$root/scripts/gpu/first_probe.py" 8311 24) 2>&1 | tee "$OUT/first-probe.txt"
  _stop_servers
  _serve_one probe2 8311
  (cd "$OUT/logs" && timeout 40 python3 -c "
import sys, threading, time; sys.path.insert(0, '$root/scripts/gpu'); import first_probe as p
stop = threading.Event(); t = time.perf_counter(); p.sample(8311, 'ss-bench.txt', stop, t)" &)
  CHAT_N=24 CHAT_TURNS=2 CHAT_LIMIT=60 _chat_bench probe-bench 8311; _stop_servers
}

_dump_both() {  # _dump_both TAG SERVER_PID: py-spy dumps of the server and of the running `bench chat` every 2 s
  local tag=$1 spid=$2 i cpid
  for i in $(seq 12); do
    sleep 2
    cpid=$(pgrep -f "app bench chat" | head -1)
    { echo "--- $((i * 2)) s"; py-spy dump --pid "$spid" 2>&1 | grep -v "^ *$\|threading.py" | head -40
      [ -n "$cpid" ] && { echo "- client $cpid"; py-spy dump --native --pid "$cpid" 2>&1 | grep -v "^ *$" | head -60; }
    } >> "$OUT/logs/dump-$tag.txt"
  done
}

client_probe() {  # ~2 min: is a fresh server's slow first chat turn the client's or the server's? `bench chat`
                 # 24 x 2 on a fresh server (py-spy of both), again on the same server from a new client, and on a
                 # fresh server after scripts/gpu/first_probe.py's requests
  mkdir -p "$OUT/logs"
  local root=$PWD
  _serve_one cp1 8311
  _dump_both fresh "${SERVERS[-1]}" & local dumper=$!
  CHAT_N=24 CHAT_TURNS=2 CHAT_LIMIT=60 _chat_bench fresh 8311
  wait "$dumper"
  CHAT_N=24 CHAT_TURNS=2 CHAT_LIMIT=60 _chat_bench same-server 8311; _stop_servers
  _serve_one cp2 8311
  (cd "$OUT/logs" && python3 "$root/scripts/gpu/first_probe.py" 8311 4) 2>&1 | tail -2
  CHAT_N=24 CHAT_TURNS=2 CHAT_LIMIT=60 _chat_bench after-probe 8311; _stop_servers
}

# ---- a default that stays fast after hours of work: workloads in sequence on the same servers ----

# The tuned layouts of the sequence (label=spec, each under cache-aware): two contexts at fixed caps.
SEQ_TUNED=(t32="$G:contexts=2,cap=32,adaptive=0,threads=${SEQ_THREADS:-8}" t16="$G:contexts=2,cap=16,adaptive=0,threads=${SEQ_THREADS:-8}")
_seq_spec() {  # _seq_spec LABEL: the SEQ_TUNED spec of LABEL
  local t
  for t in "${SEQ_TUNED[@]}"; do [ "${t%%=*}" = "$1" ] && { echo "${t#*=}"; return; }; done
  echo "unknown tuned layout $1" >&2; return 1
}
_seq_step() {  # _seq_step STEP TARGETS...: one workload of the sequence against TARGETS (--target L=URL ...)
  local step=$1 dir=$OUT/seq/$1; shift
  _stamp "seq: $step"
  local chat=(--conversations "${CHAT_N:-96}" --turns 8 --rate 6 --think 1 --system-words 600 --user-words 40-120
              --reply-tokens 32-192 --time-limit "${CHAT_LIMIT:-110}" --no-plots --out "$dir")
  local grid=(--model "$M" --runs 1 --warmup 0 --policies none --caps none --no-plots --out "$dir")
  local tenants=(--tenant-prefix-tokens 1500 --tenant-suffix-tokens 50 --outputs uniform --min-output 32
                 --max-output 256 --arrivals poisson --rate 40 --requests "${TENANT_N:-200}")
  case $step in
    chat) python3 -X faulthandler -m app bench chat "${chat[@]}" "$@" ;;
    chat_temp) python3 -X faulthandler -m app bench chat "${chat[@]}" --temperature 0.8 --top-p 0.95 "$@" ;;
    tenants*) python3 -X faulthandler -m app bench grid "${grid[@]}" --runs "${SEQ_TENANT_RUNS:-1}" \
                --tenants "${step#tenants}" "${tenants[@]}" "$@" ;;
    long) python3 -X faulthandler -m app bench grid "${grid[@]}" --requests 64 --prompt-tokens 1516 --shared 66 \
            --outputs uniform --min-output 32 --max-output 512 --arrivals poisson --rate 20 "$@" ;;
    n48) python3 -X faulthandler -m app bench grid "${grid[@]}" --requests 48 --shared 96 --outputs fixed \
           --arrivals interval "$@" ;;
    *) echo "unknown seq step $step"; return 1 ;;
  esac 2>&1 | grep -v "it/s\]" | tail -4
  _backends "$dir" "$@"
}

seq_history() {  # issue 43's must-show: the workloads of SEQ_STEPS (chat chat_temp tenants4 tenants16 tenants32 long
                 # n48) one after another on the same servers: `tandem serve --model M` (default, 8100), each tuned
                 # layout of SEQ_HIST (t32 t16; SEQ_TUNED) serving the same sequence (8101...), and per step a
                 # fresh tuned server that serves that step alone (SEQ_FRESH: step=label ...; 8110...); SEQ_OLD: a
                 # project tree whose default serves the sequence too (8099, row `old-default`). Prints per step
                 # each server's makespan / TTFT p50 and the default over the best tuned row, then each server's
                 # temperature chats over its greedy ones (ratios.py seq; ~7 min for the whole sequence)
  mkdir -p "$OUT/logs" "$OUT/seq"
  local steps=(${SEQ_STEPS:-chat chat_temp tenants4 tenants16 tenants32 long n48}) hist=(${SEQ_HIST:-t32 t16})
  local fresh=(${SEQ_FRESH-tenants4=t32 tenants16=t32 tenants32=t32 long=t16 n48=t16}) ports=(8100) i f l step
  local base=(--target default=http://127.0.0.1:8100)
  _serve_one seq-default 8100  # alone first: it measures the rates the others read
  for ((i = 0; i < ${#hist[@]}; i++)); do
    _serve_bg "$OUT/logs/seq-${hist[i]}.log" $((8101 + i)) --backend "$(_seq_spec "${hist[i]}")" --policy cache-aware
    base+=(--target "tuned-${hist[i]}-hist=http://127.0.0.1:$((8101 + i))"); ports+=($((8101 + i)))
  done
  for ((i = 0; i < ${#fresh[@]}; i++)); do
    f=${fresh[i]}
    _serve_bg "$OUT/logs/seq-fresh-${f%%=*}.log" $((8110 + i)) --backend "$(_seq_spec "${f#*=}")" --policy cache-aware
    ports+=($((8110 + i)))
  done
  if [ -n "${SEQ_OLD:-}" ]; then
    (cd "$SEQ_OLD" && PYTHONPATH=/tmp/site:$(pwd) exec python3 -m app serve --model "$M" --port 8099) \
      > "$OUT/logs/seq-old-default.log" 2>&1 & SERVERS+=($!); SERVER_LOGS[$!]=$OUT/logs/seq-old-default.log
    base+=(--target old-default=http://127.0.0.1:8099); ports+=(8099)
  fi
  _wait_ready "${ports[@]}" || { _stop_servers; return 1; }
  for step in "${steps[@]}"; do
    local targets=("${base[@]}")
    for ((i = 0; i < ${#fresh[@]}; i++)); do
      f=${fresh[i]}
      [ "${f%%=*}" = "$step" ] && targets+=(--target "tuned-${f#*=}-fresh=http://127.0.0.1:$((8110 + i))")
    done
    _seq_step "$step" "${targets[@]}"
    l=("${steps[@]/#/$OUT/seq/}")
    python3 scripts/gpu/ratios.py seq "${l[@]}" > "$OUT/seq.txt" 2>&1  # so far, rewritten after each step
  done
  cat "$OUT/seq.txt"
  _stop_servers
}

chats_n() {  # the chat workload at CHAT_NS conversations (24 192) on the default and the tuned SEQ_HIST layouts, each
            # count on servers of its own (seq_history's chat step; results under $OUT/nN)
  local n top=$OUT
  for n in ${CHAT_NS:-24 192}; do
    mkdir -p "$top/n$n"
    OUT=$top/n$n SEQ_STEPS=chat SEQ_FRESH="" CHAT_N=$n seq_history
  done
  OUT=$top
}
