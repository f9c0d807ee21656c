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

`--sampled` also decodes at temperature 0.8 / top-p 0.95 (top-k 40 and min-p 0.05 as a chat
request gets them by default) in the same rounds: with the fused sampler (one computation for
all sequences of a step, engine/llama/fused_dist.py) and, on a second backend without fused
sampling, with llama.cpp's chains per sequence; each is printed as a ratio to the greedy decode.

`--sampled-variants temp,topk,topp,full` isolates the fused sampler's parts in the same rounds:
each variant decodes with the fused sampler on the greedy backend (temp: temperature alone over
the whole vocabulary; topk: + top-k 40; topp: + top-p 0.95; full: + min-p 0.05, the chat
default; topk1 and full1: topk and full with the top-k in one `ggml_top_k` per row instead of
stages of small sorts, `fused_dist.top_k_stages(0)` while they run; the CPU backend takes no
stages anyway), printed as a ratio to greedy per batch size, with the share of its steps that
reused the previous step's graph (a rebuild runs the sampler's Python callbacks and, on CUDA, captures
a new CUDA graph), its ms per step inside `llama_decode` (graph build and device) and its µs
per step outside it (host: scheduling, the uniforms' upload), beside greedy's `host_us_per_step`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from engine.backends.config import BackendConfig
from engine.backends.local import Backend
from engine.core.request import SamplingParams
from engine.llama import fused_dist
from engine.llama.model import Model, resolve_model

from .common import GRAPH_REUSE, HOST_GAP, HOST_SHARE, HOST_US, ctx_for, engine_decode, filler_prompt

# `--sampling` modes: the sampling fields each adds to the plain greedy request.
SAMPLING_MODES = {
    "plain": SamplingParams(temperature=0.0),
    "logprobs": SamplingParams(temperature=0.0, logprobs=5),  # host chain; the row's logits log-softmaxed
    "logit_bias": SamplingParams(temperature=0.0, logit_bias=((1, -5.0), (2, 5.0))),  # per-sequence, on the device
    "penalties": SamplingParams(temperature=0.0, frequency_penalty=0.5, presence_penalty=0.5),  # llama.cpp's: host
}


HELP = "engine decode tok/s vs llama-cpp-python's Llama, same run"


# The fused sampler's parts (`--sampled-variants`), each at temperature 0.8. A name ending in
# STAGED runs the computation by sorts (`fused_dist.fused_path("staged")`) instead of the sort-free one.
VARIANTS = {
    "temp": SamplingParams(temperature=0.8, top_k=0, top_p=1.0, min_p=0.0),  # whole vocabulary
    "topk": SamplingParams(temperature=0.8, top_k=40, top_p=1.0, min_p=0.0),
    "topp": SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.0),
    "full": SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05),
    "topk1": SamplingParams(temperature=0.8, top_k=40, top_p=1.0, min_p=0.0),
    "full1": SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05),
    "p": SamplingParams(temperature=0.8, top_k=0, top_p=0.95, min_p=0.0),  # temperature + top-p
    "pk": SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.0),  # + top-k 40
}
ONE_STAGE = {"topk1", "full1"}  # variants whose top-k runs as one ggml_top_k per row (no stages)
STAGED = "-staged"


def _variant(name: str) -> tuple[SamplingParams, str, int]:
    """A `--sampled-variants` name's request, fused path and top-k chunk."""
    base = name.removesuffix(STAGED)
    path = "staged" if name.endswith(STAGED) else "sortfree"
    return VARIANTS[base], path, 0 if base in ONE_STAGE else fused_dist.TOP_K_CHUNK


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
    p.add_argument("--sampled", action="store_true",
                   help="also decode at temperature 0.8 / top-p 0.95 with the fused sampler and with llama.cpp's "
                        "per-sequence chains (a second backend), each as a ratio to greedy")
    p.add_argument("--sampling", default="plain", metavar="MODES",
                   help=f"comma-separated sampling modes, each measured beside plain greedy "
                        f"({', '.join(SAMPLING_MODES)}; default: %(default)s)")
    p.add_argument("--fused-dist-from", type=int, default=1, metavar="N",
                   help="temperature requests take the fused sampler once N run (the engine's default is 8; "
                        "1 here, so that --sampled and --sampled-variants measure the fused sampler at every B)")
    p.add_argument("--sampled-variants", default="", metavar="LIST",
                   help="also decode with the fused sampler's parts alone, each as a ratio to greedy: "
                        f"comma-separated among {','.join(VARIANTS)} (p: temperature + top-p; pk: + top-k 40); "
                        f"NAME{STAGED}: by the computation by sorts")
    p.add_argument("--flash-attn", default="auto", choices=["auto", "on", "off"])
    p.add_argument("--n-seq-max", type=int, default=0, help="context sequence slots (0: the backend default, engine/sched/scheduler.py default_seq_slots)")
    p.add_argument("--busy-thread", action="store_true",
                   help="also decode beside a pure-Python thread that wants the GIL all the time "
                        "(the worst a UI or HTTP thread could do): reports busy_bB and gil_ratio_bB")
    p.add_argument("--switch-interval-ms", type=float, default=None,
                   help="sys.setswitchinterval for the run (Python's default: 5 ms)")
    p.add_argument("--kv", default="unified", choices=["unified", "split"],
                   help="KV layout: one buffer with the prompt aliased, or one stream per sequence "
                        "with the prompt copied (llama-batched-bench then runs without -kvu)")


def _names(listed: str, known: dict, flag: str, suffix: str = "") -> list[str]:
    """The comma-separated names of `listed`, each one of `known` (or one with `suffix`;
    ValueError naming the rest)."""
    names = [n for n in listed.split(",") if n]
    unknown = [n for n in names if n not in known and not (suffix and n.removesuffix(suffix) in known)]
    if unknown:
        raise ValueError(f"unknown {flag} value(s) {', '.join(unknown)}: use {', '.join(known)}")
    return names


def run_overhead(args: argparse.Namespace) -> int:
    try:
        plan = _Plan.of(args)
    except ValueError as e:
        print(f"tandem: {e}", file=sys.stderr)
        return 2
    rig = _Rig.open(args, plan)
    samples = _Samples(args, plan, rig)
    try:
        # One unmeasured round warms caches, threads and the allocator on all sides.
        for rnd in range(args.repeats + 1):
            _round(args, plan, rig, samples, measured=rnd > 0)
            if rnd:
                row = "  ".join(f"{k} {v[-1]:7.1f}" for k, v in samples.results.items())
                print(f"round {rnd}/{args.repeats}: {row} tok/s", file=sys.stderr)
    finally:
        rig.close()
    out = _medians(samples)
    _add_ratios(out, args, plan, rig)
    _add_variants(out, plan, samples)
    _add_sampler_builds(out, plan, rig, samples)
    out["eog_redos"] = rig.backend.eog_redos  # end tokens taken back (ignore_eos with a guarding chain)
    if plan.modes:
        for b in plan.batches:
            row = "  ".join(f"{m} {out[f'cost_{m}_b{b}']:.3f}" for m in plan.modes)
            print(f"B={b}: tok/s over plain greedy: {row}", file=sys.stderr)
    out.update(model=rig.path.name, device=rig.model.device, kv=args.kv, fused_greedy=rig.backend.config.fused_greedy,
               threads=rig.backend.config.threads,
               switch_interval_ms=round(sys.getswitchinterval() * 1000, 3),
               prompt_tokens=len(rig.prompt), gen_tokens=args.gen_tokens, repeats=args.repeats)
    print(json.dumps(out))
    return 0


@dataclass(frozen=True)
class _Plan:
    """What the command line asks to measure: batch sizes, sampling modes, sampler parts."""

    batches: list[int]
    modes: list[str]  # `--sampling` beyond plain greedy
    variants: list[str]  # `--sampled-variants`

    @classmethod
    def of(cls, args: argparse.Namespace) -> _Plan:
        """ValueError for a mode or variant that does not exist."""
        return cls([int(b) for b in args.batches.split(",")],
                   [m for m in _names(args.sampling, SAMPLING_MODES, "--sampling") if m != "plain"],
                   _names(args.sampled_variants, VARIANTS, "--sampled-variants", STAGED))


@dataclass
class _Rig:
    """The model, the prompt and what decodes it: our backend, the per-sequence chains'
    backend (`--sampled`) and llama-cpp-python's `Llama` (unless `--no-llama`)."""

    path: Path
    model: Model
    prompt: list[int]
    n_ctx: int
    unified: bool
    backend: Backend
    chains: Backend | None
    llama: Any  # llama_cpp.Llama, or None

    @classmethod
    def open(cls, args: argparse.Namespace, plan: _Plan) -> _Rig:
        path = resolve_model(args.model)
        threads = args.threads or None
        model = Model(path, args.device)
        # A fixed pseudo-text prompt: token ids drawn from the vocabulary's ordinary range.
        prompt = filler_prompt(model, args.prompt_tokens)
        unified = args.kv == "unified"
        n_ctx = ctx_for(args.prompt_tokens, args.gen_tokens, max(plan.batches))
        config = BackendConfig(name="bench", device=model.device, cap=max(plan.batches), n_ctx=n_ctx,
                               threads=threads or 0, backend_sampling=not args.host_sampling,
                               flash_attn=args.flash_attn, n_seq_max=args.n_seq_max, kv_unified=unified,
                               fused_greedy=not args.no_fused_greedy, fused_dist_from=args.fused_dist_from)
        if not unified:  # every stream holds the prompt and one sequence's tokens
            config = replace(config, n_ctx=config.resolved().n_seq_max * ctx_for(args.prompt_tokens, args.gen_tokens, 1))
        backend = Backend(config, model).start()
        chains = (Backend(replace(config, name="bench-chains", fused_greedy=False), model).start()
                  if args.sampled else None)
        llama = None if args.no_llama else _baseline(path, args.device, threads or backend.config.threads, n_ctx,
                                                     flash=backend.config.flash_attn != "off")  # as our backend runs
        print(f"model {model.info.name} ({path.name}), device {model.device}, threads "
              f"{backend.config.threads}, prompt {len(prompt)} tokens, generate {args.gen_tokens}", file=sys.stderr)
        if args.switch_interval_ms is not None:
            sys.setswitchinterval(args.switch_interval_ms / 1000)
        return cls(path, model, prompt, n_ctx, unified, backend, chains, llama)

    def close(self) -> None:
        self.backend.stop()
        if self.chains is not None:
            self.chains.stop()
        self.model.close()


class _Samples:
    """Every measured round's tok/s per series (`results`, in the order they print) and the
    sampler parts' per-step figures."""

    def __init__(self, args: argparse.Namespace, plan: _Plan, rig: _Rig) -> None:
        batches, variants = plan.batches, plan.variants
        results: dict[str, list[float]] = {f"engine_b{b}": [] for b in batches}
        if args.busy_thread:
            results.update({f"busy_b{b}": [] for b in batches})
        if rig.chains is not None:
            results.update({f"{k}_b{b}": [] for b in batches for k in ("fused_temp", "chain_temp")})
        for m in plan.modes:
            results.update({f"{m}_b{b}": [] for b in batches})
        results.update({f"part_{v}_b{b}": [] for b in batches for v in variants})
        if args.constrained:
            results.update({f"constrained_b{b}": [] for b in batches})
        if rig.llama is not None:
            results["llama_b1"] = []
        if args.batched_bench:
            results.update({f"batched_b{b}": [] for b in batches})
        self.results = results
        self.builds0 = fused_dist.BUILDS.copy()
        self.variant_reuse: dict[str, list[float]] = {f"{v}_b{b}": [] for b in batches for v in variants}
        self.variant_step: dict[str, list[float]] = {k: [] for k in self.variant_reuse}  # ms per step inside llama_decode (+ its sync)
        self.variant_host: dict[str, list[float]] = {k: [] for k in self.variant_reuse}  # µs per step outside it (the uniforms' upload is there)

    def add(self, key: str, value: float, measured: bool) -> None:
        if measured:
            self.results[key].append(value)


def _round(args: argparse.Namespace, plan: _Plan, rig: _Rig, samples: _Samples, measured: bool) -> None:
    """One round: each batch size on every side asked for, then the baselines."""
    backend, prompt, n_gen = rig.backend, rig.prompt, args.gen_tokens
    chat = SamplingParams(temperature=0.8, top_p=0.95)  # top-k 40, min-p 0.05: the defaults
    for b in plan.batches:
        samples.add(f"engine_b{b}", engine_decode(backend, prompt, n_gen, b), measured)
        if args.busy_thread:
            with _BusyThread():
                v = engine_decode(backend, prompt, n_gen, b, record=False)
            samples.add(f"busy_b{b}", v, measured)
        if rig.chains is not None:
            for key, bk in (("fused_temp", backend), ("chain_temp", rig.chains)):
                samples.add(f"{key}_b{b}", engine_decode(bk, prompt, n_gen, b, record=False, sampling=chat), measured)
        for m in plan.modes:
            v = engine_decode(backend, prompt, n_gen, b, record=False, sampling=SAMPLING_MODES[m])
            samples.add(f"{m}_b{b}", v, measured)
        for name in plan.variants:
            _variant_decode(rig, samples, name, b, n_gen, measured)
        if args.constrained:
            v = engine_decode(backend, prompt, n_gen, b, record=False, constrained=min(args.constrained, b))
            samples.add(f"constrained_b{b}", v, measured)
    if rig.llama is not None:
        samples.add("llama_b1", _llama_decode(rig.llama, prompt, n_gen), measured)
    if args.batched_bench and measured:
        batches = plan.batches
        bb = _batched_bench(args.batched_bench, rig.path, rig.model.device, backend.config.threads,
                            rig.n_ctx if rig.unified else len(prompt) * max(batches) + rig.n_ctx,
                            len(prompt), n_gen, batches, rig.unified, backend.config.flash_attn)
        for b in batches:
            samples.add(f"batched_b{b}", bb[b], measured)


def _variant_decode(rig: _Rig, samples: _Samples, name: str, b: int, n_gen: int, measured: bool) -> None:
    """One sampler part at batch `b` on the greedy backend, with its graph reuse and its time
    per step inside and outside `llama_decode`."""
    backend = rig.backend
    steps0, reused0, dec0 = backend.steps, backend.graphs_reused, backend.decode_s
    t0 = time.perf_counter()
    params, fpath, chunk = _variant(name)
    with fused_dist.top_k_stages(chunk), fused_dist.fused_path(fpath):
        v = engine_decode(backend, rig.prompt, n_gen, b, record=False, sampling=params)
    if measured:
        steps, dec = max(backend.steps - steps0, 1), backend.decode_s - dec0
        key = f"{name}_b{b}"
        samples.results[f"part_{key}"].append(v)
        samples.variant_reuse[key].append((backend.graphs_reused - reused0) / steps)
        samples.variant_step[key].append(1e3 * dec / steps)
        samples.variant_host[key].append(1e6 * (time.perf_counter() - t0 - dec) / steps)


def _medians(samples: _Samples) -> dict[str, Any]:
    """Each series' median and samples, and the backend's host figures per batch size."""
    results = samples.results
    out: dict[str, Any] = {f"{k}_tok_s": round(statistics.median(v), 2) for k, v in results.items()}
    out["samples"] = {k: [round(x, 2) for x in v] for k, v in results.items()}
    # Share of the engine's wall time spent outside llama_decode (scheduling, sampling, events).
    out["host_share"] = {f"b{b}": round(statistics.median(v), 3) for b, v in HOST_SHARE.items()}
    # The same per step, in µs: the host's cost of a step, whatever the device's speed.
    out["host_us_per_step"] = {f"b{b}": round(statistics.median(v), 1) for b, v in HOST_US.items()}
    # Only the host work between consecutive steps (median step): what every step waits for,
    # without the once-per-request costs (admission, prefix KV copies, retirement) above.
    out["host_gap_us"] = {f"b{b}": round(statistics.median(v), 1) for b, v in HOST_GAP.items()}
    # Share of steps that reused the previous step's graph (no rebuild, no scheduler reset).
    out["graph_reuse"] = {f"b{b}": round(statistics.median(v), 3) for b, v in GRAPH_REUSE.items()}
    return out


def _add_ratios(out: dict[str, Any], args: argparse.Namespace, plan: _Plan, rig: _Rig) -> None:
    """Each side's tok/s over the greedy engine's (or the baselines' under it), per batch size."""

    def ratio(a: str, b: str) -> float:
        return round(out[f"{a}_tok_s"] / out[f"{b}_tok_s"], 3)

    for b in plan.batches:
        engine = f"engine_b{b}"
        if rig.llama is not None:
            out[f"ratio_b{b}"] = ratio(engine, "llama_b1")
        if args.busy_thread:
            out[f"gil_ratio_b{b}"] = ratio(f"busy_b{b}", engine)
        for m in plan.modes:  # what leaving plain greedy costs: MODE's decode speed over plain's
            out[f"cost_{m}_b{b}"] = ratio(f"{m}_b{b}", engine)
        if args.constrained:
            out[f"constrained_ratio_b{b}"] = ratio(f"constrained_b{b}", engine)
        if args.batched_bench:
            out[f"ratio_batched_b{b}"] = ratio(engine, f"batched_b{b}")
        if rig.chains is not None:  # temperature decode against greedy, fused and per-sequence chains
            for key in ("fused_temp", "chain_temp"):
                out[f"ratio_{key}_greedy_b{b}"] = ratio(f"{key}_b{b}", engine)


def _add_variants(out: dict[str, Any], plan: _Plan, samples: _Samples) -> None:
    """`--sampled-variants`: each part over greedy, its graph reuse and its time per step."""
    if not plan.variants:
        return
    batches, variants = plan.batches, plan.variants
    for b in batches:
        for name in variants:
            out[f"ratio_part_{name}_greedy_b{b}"] = round(out[f"part_{name}_b{b}_tok_s"] / out[f"engine_b{b}_tok_s"], 3)
    out["variant_graph_reuse"] = {k: round(statistics.median(v), 3) for k, v in samples.variant_reuse.items()}
    out["variant_decode_ms_per_step"] = {k: round(statistics.median(v), 3) for k, v in samples.variant_step.items()}
    out["variant_host_us_per_step"] = {k: round(statistics.median(v), 1) for k, v in samples.variant_host.items()}
    print("fused sampler parts vs greedy (graph reuse): " + "  ".join(
        f"B={b} " + " ".join(f"{name} {out[f'ratio_part_{name}_greedy_b{b}']:.3f} "
                             f"({out['variant_graph_reuse'][f'{name}_b{b}']:.2f})" for name in variants)
        for b in batches), file=sys.stderr)


def _add_sampler_builds(out: dict[str, Any], plan: _Plan, rig: _Rig, samples: _Samples) -> None:
    """With the fused sampler measured: how its builds went and where its tables live; with
    `--sampled`, temperature decode over greedy printed."""
    if rig.chains is not None or plan.variants:
        # how the fused sampler's builds went: "shared"/"row" on the device, "host" if it lacked an
        # op, "idle" where only idle fused chains were in a graph (greedy steps)
        out["fused_dist_builds"] = dict(fused_dist.BUILDS - samples.builds0)
        out["fused_dist_placement"] = dict(fused_dist.PLACEMENT)  # its tables' buffer: host memory costs copies
        out["top_k_chunk"] = fused_dist.TOP_K_CHUNK  # the top-k's stages (0: one ggml_top_k per row)
    if rig.chains is not None:
        print("temperature 0.8 / top-p 0.95 vs greedy: " + "  ".join(
            f"B={b} fused {out[f'ratio_fused_temp_greedy_b{b}']:.3f} chains {out[f'ratio_chain_temp_greedy_b{b}']:.3f}"
            for b in plan.batches), file=sys.stderr)


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
                   n_gen: int, batches: list[int], unified: bool = True, flash: str = "auto") -> dict[int, float]:
    """Run llama.cpp's `llama-batched-bench` with the same shape (a shared prompt, in one
    unified KV buffer or copied into each sequence's stream, as our engine with a warm
    prefix) and return decode tok/s (S_TG) per batch size. `flash`: our backend's resolved
    flash attention, passed on unless it is llama.cpp's own `auto`."""
    import subprocess

    from engine.llama import child_env

    cmd = [binary, "-m", str(path), "-c", str(n_ctx), "-b", "2048", "-ub", "512",
           "-npp", str(n_prompt), "-ntg", str(n_gen), "-npl", ",".join(map(str, batches)),
           "-pps", *(["-kvu"] if unified else []), "-t", str(threads), "-tb", str(threads),
           "-ngl", "99" if device == "gpu" else "0", *(["-fa", flash] if flash != "auto" else [])]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=child_env())  # its OpenMP defaults
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
