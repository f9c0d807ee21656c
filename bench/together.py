"""`tandem bench together`: does each backend keep its speed when both run at once?

A GPU backend and a CPU backend (own models, one process) decode after the same warm
prompt, first each alone, then both at the same time, in alternation over `--repeats`
rounds. The ratios (together / alone, of medians) say what running both costs each one —
through shared cores, memory bandwidth and Python's GIL. The last stdout line is JSON.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import threading
from typing import Any

from engine.backends.config import BackendConfig
from engine.backends.local import Backend
from engine.llama.model import Model, resolve_model

from .common import ctx_for, engine_decode, filler_prompt

HELP = "GPU and CPU backends decoding at once vs each alone"


def add_arguments(p) -> None:
    p.add_argument("--model", default="default")
    p.add_argument("--gpu-batch", type=int, default=16)
    p.add_argument("--cpu-batch", type=int, default=4)
    p.add_argument("--gpu-threads", type=int, default=1, help="host threads of the GPU context")
    p.add_argument("--gpu-device", default="gpu", choices=["gpu", "cpu"],
                   help="device of the first backend (cpu: a smoke run on a machine without a GPU)")
    p.add_argument("--cpu-threads", type=int, default=0, help="0: all cores but one")
    p.add_argument("--prompt-tokens", type=int, default=516)
    p.add_argument("--gen-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)


def run_together(args) -> int:
    if not args.cpu_threads:
        args.cpu_threads = max((os.cpu_count() or 2) - 1, 1)
    path = resolve_model(args.model)
    gpu_model, cpu_model = Model(path, args.gpu_device), Model(path, "cpu")
    prompt = filler_prompt(cpu_model, args.prompt_tokens)
    batches = {"gpu": args.gpu_batch, "cpu": args.cpu_batch}
    backends = {
        "gpu": Backend(BackendConfig(name="gpu", device=gpu_model.device, cap=args.gpu_batch, threads=args.gpu_threads,
                                     n_ctx=ctx_for(len(prompt), args.gen_tokens, args.gpu_batch)), gpu_model).start(),
        "cpu": Backend(BackendConfig(name="cpu", device="cpu", cap=args.cpu_batch, threads=args.cpu_threads,
                                     n_ctx=ctx_for(len(prompt), args.gen_tokens, args.cpu_batch)), cpu_model).start(),
    }
    print(f"model {path.name}; gpu batch {args.gpu_batch} ({args.gpu_threads} host threads), "
          f"cpu batch {args.cpu_batch} ({args.cpu_threads} threads)", file=sys.stderr)
    alone: dict[str, list[float]] = {k: [] for k in backends}
    together: dict[str, list[float]] = {k: [] for k in backends}

    def measure(name, into):
        into[name].append(engine_decode(backends[name], prompt, args.gen_tokens, batches[name]))

    try:
        for rnd in range(args.repeats + 1):
            a: dict[str, list[float]] = {k: [] for k in backends}
            t: dict[str, list[float]] = {k: [] for k in backends}
            for name in backends:
                measure(name, a)
            threads = [threading.Thread(target=measure, args=(n, t)) for n in backends]
            for th in threads:
                th.start()
            for th in threads:
                th.join()
            if rnd:  # round 0 warms up
                for k in backends:
                    alone[k] += a[k]
                    together[k] += t[k]
                print(f"round {rnd}: " + "  ".join(
                    f"{k} alone {a[k][0]:7.1f} together {t[k][0]:7.1f}" for k in backends) + " tok/s", file=sys.stderr)
    finally:
        for b in backends.values():
            b.stop()
        gpu_model.close()
        cpu_model.close()
    out: dict[str, Any] = {}
    for k in backends:
        out[f"{k}_alone_tok_s"] = round(statistics.median(alone[k]), 2)
        out[f"{k}_together_tok_s"] = round(statistics.median(together[k]), 2)
        out[f"{k}_keep"] = round(out[f"{k}_together_tok_s"] / out[f"{k}_alone_tok_s"], 3)
    out.update(model=path.name, gpu_batch=args.gpu_batch, cpu_batch=args.cpu_batch,
               gpu_threads=args.gpu_threads, cpu_threads=args.cpu_threads, repeats=args.repeats)
    print(json.dumps(out))
    return 0
