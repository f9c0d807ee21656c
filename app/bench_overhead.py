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
from engine.model import Model, resolve_model
from engine.request import Request, SamplingParams


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
        if args.batched_bench:
            out[f"ratio_batched_b{b}"] = round(out[f"engine_b{b}_tok_s"] / out[f"batched_b{b}_tok_s"], 3)
    out["eog_redos"] = backend.eog_redos  # end tokens taken back (ignore_eos with a guarding chain)
    out.update(model=path.name, device=model.device, kv=args.kv, fused_greedy=backend.config.fused_greedy,
               threads=backend.config.threads,
               switch_interval_ms=round(sys.getswitchinterval() * 1000, 3),
               prompt_tokens=len(prompt), gen_tokens=args.gen_tokens, repeats=args.repeats)
    print(json.dumps(out))
    return 0


def filler_prompt(model: Model, n: int) -> list[int]:
    """A fixed pseudo-text prompt of `n` tokens (the same every run)."""
    text = ("The history of computing is a story of people who wanted machines to do their "
            "arithmetic, then their bookkeeping, then their thinking. ") * (n // 8 + 1)
    tokens = model.tokenize(text, add_special=False)
    return tokens[:n]


def ctx_for(n_prompt: int, n_gen: int, batch: int) -> int:
    need = n_prompt + batch * (n_gen + 1) + 64
    return 1 << (need - 1).bit_length()


HOST_SHARE: dict[int, list[float]] = {}
HOST_US: dict[int, list[float]] = {}  # µs of the worker's wall time outside llama_decode, per step
GRAPH_REUSE: dict[int, list[float]] = {}


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


def engine_decode(backend: Backend, prompt: list[int], n_gen: int, batch: int, record: bool = True) -> float:
    backend.set_cap(batch)  # B at a time, and no more idle sampler chains than that
    backend.flush().result(60)
    backend.warm(prompt[:-1]).result(120)
    d0, t0, s0, g0 = backend.decode_s, time.perf_counter(), backend.steps, backend.graphs_reused
    sp = SamplingParams(temperature=0.0, max_tokens=n_gen, ignore_eos=True)
    handles = [backend.enqueue(Request(tuple(prompt), sp, source="bench")) for _ in range(batch)]
    records = [h.result(600) for h in handles]
    for r in records:
        if r.error:
            raise RuntimeError(r.error)
    if not record:
        return decode_rate(records)
    wall = time.perf_counter() - t0
    HOST_SHARE.setdefault(batch, []).append(1 - (backend.decode_s - d0) / wall)
    HOST_US.setdefault(batch, []).append(1e6 * (wall - (backend.decode_s - d0)) / max(backend.steps - s0, 1))
    GRAPH_REUSE.setdefault(batch, []).append((backend.graphs_reused - g0) / max(backend.steps - s0, 1))
    return decode_rate(records)


def decode_rate(records) -> float:
    """Decode tok/s of requests that ran together: tokens after each one's first, summed,
    over the time from the last first token to the last token."""
    start = max(r.ttft_s for r in records)
    end = max(r.e2e_s for r in records)
    return sum(r.output_tokens - 1 for r in records) / (end - start)


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
