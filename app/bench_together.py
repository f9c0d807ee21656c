"""`tandem bench together`: does each backend keep its speed when both run at once?

A GPU backend and a CPU backend (own models, one process) decode after the same warm
prompt, first each alone, then both at the same time, in alternation over `--repeats`
rounds. The ratios (together / alone, of medians) say what running both costs each one —
through shared cores, memory bandwidth and Python's GIL. The last stdout line is JSON.
"""

from __future__ import annotations

import json
import statistics
import sys
import threading

from engine.backend import Backend, BackendConfig
from engine.model import Model, resolve_model

from .bench_overhead import ctx_for, engine_decode, filler_prompt


def run_together(args) -> int:
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
    alone = {k: [] for k in backends}
    together = {k: [] for k in backends}

    def measure(name, into):
        into[name].append(engine_decode(backends[name], prompt, args.gen_tokens, batches[name]))

    try:
        for rnd in range(args.repeats + 1):
            a = {k: [] for k in backends}
            t = {k: [] for k in backends}
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
    out = {}
    for k in backends:
        out[f"{k}_alone_tok_s"] = round(statistics.median(alone[k]), 2)
        out[f"{k}_together_tok_s"] = round(statistics.median(together[k]), 2)
        out[f"{k}_keep"] = round(out[f"{k}_together_tok_s"] / out[f"{k}_alone_tok_s"], 3)
    out.update(model=path.name, gpu_batch=args.gpu_batch, cpu_batch=args.cpu_batch,
               gpu_threads=args.gpu_threads, cpu_threads=args.cpu_threads, repeats=args.repeats)
    print(json.dumps(out))
    return 0
