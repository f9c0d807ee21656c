"""`tandem bench overhead`: our backend's decode speed against llama-cpp-python's `Llama`.

Both decode `--gen-tokens` tokens after the same `--prompt-tokens`-token prompt, on the same
model, threads and device. The two are measured in alternation (A B A B ...) so that drift
of a noisy machine hits both alike, and the ratios are of the medians.

Engine side: one backend; for batch B the prompt (all but its last token) is warmed into
the prefix cache, then B requests with that prompt run together (each decodes its own
continuation; ignore_eos so all run to the end). Decode tok/s = tokens generated after the
first one, summed over the B sequences, divided by the time from the last first-token to the
last token. Baseline: `Llama.generate()` on one sequence, timed the same way (first token →
last token). The last line of stdout is one JSON object.
"""

from __future__ import annotations

import json
import statistics
import sys
import threading
import time
from dataclasses import replace

from engine.backend import Backend, BackendConfig
from engine.llama.model import Model, resolve_model

from .common import GRAPH_REUSE, HOST_SHARE, HOST_US, ctx_for, engine_decode, filler_prompt


HELP = "engine decode tok/s vs llama-cpp-python's Llama, same run"


def add_arguments(p) -> None:
    p.add_argument("--model", default="default")
    p.add_argument("--threads", type=int, default=0, help="0: all cores")
    p.add_argument("--device", default="cpu", choices=["cpu", "gpu"])
    p.add_argument("--batches", default="1,4", help="parallel sequences to measure (default: %(default)s)")
    p.add_argument("--prompt-tokens", type=int, default=516)
    p.add_argument("--gen-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-llama", action="store_true", help="skip the high-level Llama baseline")
    p.add_argument("--batched-bench", metavar="BIN", default=None,
                   help="also run llama.cpp's llama-batched-bench (path) with the same shape")
    p.add_argument("--host-sampling", action="store_true", help="sample on the host, not in the graph")
    p.add_argument("--constrained", type=int, default=0, metavar="N",
                   help="also measure each batch with N of its sequences under a grammar (they sample on "
                        "the host): the cost of the per-sequence fallback (constrained_bB, constrained_ratio_bB)")
    p.add_argument("--no-fused-greedy", action="store_true",
                   help="llama.cpp's greedy sampler per sequence (and its logit bias for ignore_eos) "
                        "instead of one argmax for all sequences of a step")
    p.add_argument("--flash-attn", default="auto", choices=["auto", "on", "off"])
    p.add_argument("--n-seq-max", type=int, default=0, help="context sequence slots (0: cap + 8, at least 32)")
    p.add_argument("--busy-thread", action="store_true",
                   help="also decode beside a pure-Python thread that wants the GIL all the time "
                        "(the worst a UI or HTTP thread could do): reports busy_bB and gil_ratio_bB")
    p.add_argument("--switch-interval-ms", type=float, default=None,
                   help="sys.setswitchinterval for the run (Python's default: 5 ms)")
    p.add_argument("--kv", default="unified", choices=["unified", "split"],
                   help="KV layout: one buffer with the prompt aliased, or one stream per sequence "
                        "with the prompt copied (llama-batched-bench then runs without -kvu)")


def run_overhead(args) -> int:
    path = resolve_model(args.model)
    batches = [int(b) for b in args.batches.split(",")]
    threads = args.threads or None
    model = Model(path, args.device)
    # A fixed pseudo-text prompt: token ids drawn from the vocabulary's ordinary range.
    prompt = filler_prompt(model, args.prompt_tokens)
    unified = args.kv == "unified"
    n_ctx = ctx_for(args.prompt_tokens, args.gen_tokens, max(batches))
    config = BackendConfig(name="bench", device=model.device, cap=max(batches), n_ctx=n_ctx,
                           threads=threads or 0, backend_sampling=not args.host_sampling,
                           flash_attn=args.flash_attn, n_seq_max=args.n_seq_max, kv_unified=unified,
                           fused_greedy=not args.no_fused_greedy)
    if not unified:  # every stream holds the prompt and one sequence's tokens
        config = replace(config, n_ctx=config.resolved().n_seq_max * ctx_for(args.prompt_tokens, args.gen_tokens, 1))
    backend = Backend(config, model).start()
    llama = None if args.no_llama else _baseline(path, args.device, threads or backend.config.threads, n_ctx,
                                                 flash=args.flash_attn != "off")
    print(f"model {model.info.name} ({path.name}), device {model.device}, threads "
          f"{backend.config.threads}, prompt {len(prompt)} tokens, generate {args.gen_tokens}", file=sys.stderr)
    if args.switch_interval_ms is not None:
        sys.setswitchinterval(args.switch_interval_ms / 1000)
    results: dict[str, list[float]] = {f"engine_b{b}": [] for b in batches}
    if args.busy_thread:
        results.update({f"busy_b{b}": [] for b in batches})
    if args.constrained:
        results.update({f"constrained_b{b}": [] for b in batches})
    if llama is not None:
        results["llama_b1"] = []
    if args.batched_bench:
        results.update({f"batched_b{b}": [] for b in batches})
    try:
        # One unmeasured round warms caches, threads and the allocator on all sides.
        for rnd in range(args.repeats + 1):
            for b in batches:
                v = engine_decode(backend, prompt, args.gen_tokens, b)
                if rnd:
                    results[f"engine_b{b}"].append(v)
                if args.busy_thread:
                    with _BusyThread():
                        v = engine_decode(backend, prompt, args.gen_tokens, b, record=False)
                    if rnd:
                        results[f"busy_b{b}"].append(v)
                if args.constrained:
                    v = engine_decode(backend, prompt, args.gen_tokens, b, record=False,
                                      constrained=min(args.constrained, b))
                    if rnd:
                        results[f"constrained_b{b}"].append(v)
            if llama is not None:
                v = _llama_decode(llama, prompt, args.gen_tokens)
                if rnd:
                    results["llama_b1"].append(v)
            if args.batched_bench and rnd:
                bb = _batched_bench(args.batched_bench, path, model.device, backend.config.threads,
                                    n_ctx if unified else len(prompt) * max(batches) + n_ctx,
                                    len(prompt), args.gen_tokens, batches, unified)
                for b in batches:
                    results[f"batched_b{b}"].append(bb[b])
            if rnd:
                row = "  ".join(f"{k} {v[-1]:7.1f}" for k, v in results.items())
                print(f"round {rnd}/{args.repeats}: {row} tok/s", file=sys.stderr)
    finally:
        backend.stop()
        model.close()
    out = {f"{k}_tok_s": round(statistics.median(v), 2) for k, v in results.items()}
    out["samples"] = {k: [round(x, 2) for x in v] for k, v in results.items()}
    # Share of the engine's wall time spent outside llama_decode (scheduling, sampling, events).
    out["host_share"] = {f"b{b}": round(statistics.median(v), 3) for b, v in HOST_SHARE.items()}
    # The same per step, in µs: the host's cost of a step, whatever the device's speed.
    out["host_us_per_step"] = {f"b{b}": round(statistics.median(v), 1) for b, v in HOST_US.items()}
    # Share of steps that reused the previous step's graph (no rebuild, no scheduler reset).
    out["graph_reuse"] = {f"b{b}": round(statistics.median(v), 3) for b, v in GRAPH_REUSE.items()}
    for b in batches:
        if llama is not None:
            out[f"ratio_b{b}"] = round(out[f"engine_b{b}_tok_s"] / out["llama_b1_tok_s"], 3)
        if args.busy_thread:
            out[f"gil_ratio_b{b}"] = round(out[f"busy_b{b}_tok_s"] / out[f"engine_b{b}_tok_s"], 3)
        if args.constrained:
            out[f"constrained_ratio_b{b}"] = round(out[f"constrained_b{b}_tok_s"] / out[f"engine_b{b}_tok_s"], 3)
        if args.batched_bench:
            out[f"ratio_batched_b{b}"] = round(out[f"engine_b{b}_tok_s"] / out[f"batched_b{b}_tok_s"], 3)
    out["eog_redos"] = backend.eog_redos  # end tokens taken back (ignore_eos with a guarding chain)
    out.update(model=path.name, device=model.device, kv=args.kv, fused_greedy=backend.config.fused_greedy,
               threads=backend.config.threads,
               switch_interval_ms=round(sys.getswitchinterval() * 1000, 3),
               prompt_tokens=len(prompt), gen_tokens=args.gen_tokens, repeats=args.repeats)
    print(json.dumps(out))
    return 0


class _BusyThread:
    """A thread running pure-Python work until stopped: it holds the GIL whenever it can,
    so the backend's worker must win it back (Python's switch interval) after every
    `llama_decode`."""

    def __enter__(self):
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._spin, name="busy", daemon=True)
        self._thread.start()
        return self

    def _spin(self) -> None:
        x = 0
        while not self._stop.is_set():
            for i in range(1000):
                x += i * i

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def _batched_bench(binary: str, path, device: str, threads: int, n_ctx: int, n_prompt: int,
                   n_gen: int, batches: list[int], unified: bool = True) -> dict[int, float]:
    """Run llama.cpp's `llama-batched-bench` with the same shape (a shared prompt, in one
    unified KV buffer or copied into each sequence's stream, as our engine with a warm
    prefix) and return decode tok/s (S_TG) per batch size."""
    import subprocess

    cmd = [binary, "-m", str(path), "-c", str(n_ctx), "-b", "2048", "-ub", "512",
           "-npp", str(n_prompt), "-ntg", str(n_gen), "-npl", ",".join(map(str, batches)),
           "-pps", *(["-kvu"] if unified else []), "-t", str(threads), "-tb", str(threads),
           "-ngl", "99" if device == "gpu" else "0"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    speeds = {}
    for line in (out.stdout + out.stderr).splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 10 and cells[0].isdigit():
            speeds[int(cells[2])] = float(cells[7])
    missing = [b for b in batches if b not in speeds]
    if missing:
        raise RuntimeError(f"llama-batched-bench printed no result for B={missing}: {out.stderr[-2000:]}")
    return speeds


def _baseline(path, device: str, threads: int, n_ctx: int, flash: bool):
    from llama_cpp import Llama

    return Llama(str(path), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, flash_attn=flash,
                 n_gpu_layers=-1 if device == "gpu" else 0, verbose=False)


def _llama_decode(llama, prompt: list[int], n_gen: int) -> float:
    llama.reset()
    t_first = t_last = 0.0
    n = 0
    for _tok in llama.generate(prompt, temp=0.0, reset=True):
        n += 1
        t_last = time.perf_counter()
        if n == 1:
            t_first = t_last
        if n == n_gen:
            break
    return (n - 1) / (t_last - t_first)
