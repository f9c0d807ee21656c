"""`tandem bench cache`: time to first token of a prompt whose prefix is cached vs cold.

The study's case: a 516-token prompt whose first 496 tokens are warm in the prefix cache
(so 20 are prefilled) against the same prompt with the cache flushed (516 prefilled). Cold
and warm alternate for `--repeats` rounds on one backend; the ratio is of the medians. The
last stdout line is one JSON object with the hit rate the cache reported.
"""

from __future__ import annotations

import json
import statistics
import sys

from engine.backends.config import BackendConfig
from engine.backends.local import Backend
from engine.core.request import Request, SamplingParams
from engine.llama.model import Model, resolve_model

from .common import filler_prompt

HELP = "TTFT with a warm cached prefix vs cold"


def add_arguments(p) -> None:
    p.add_argument("--model", default="default")
    p.add_argument("--device", default="cpu", choices=["cpu", "gpu"])
    p.add_argument("--threads", type=int, default=0, help="0: all cores")
    p.add_argument("--prefix-tokens", type=int, default=496)
    p.add_argument("--suffix-tokens", type=int, default=20)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--flash-attn", default="auto", choices=["auto", "on", "off"],
                   help="auto: on for a GPU, off for the CPU (engine/backends/config.py AUTO_FLASH_ATTN)")


def run_cache(args) -> int:
    path = resolve_model(args.model)
    model = Model(path, args.device)
    prompt = filler_prompt(model, args.prefix_tokens + args.suffix_tokens)
    prefix = prompt[:args.prefix_tokens]
    backend = Backend(BackendConfig(name="bench", device=model.device, cap=1, n_ctx=2048,
                                    threads=args.threads, flash_attn=args.flash_attn), model).start()
    sp = SamplingParams(temperature=0.0, max_tokens=1)
    ttft: dict[str, list[float]] = {"cold": [], "warm": []}
    cached = []
    try:
        for rnd in range(args.repeats + 1):  # round 0 warms up
            for kind in ("cold", "warm"):
                backend.flush().result(60)
                if kind == "warm":
                    backend.warm(prefix).result(120)
                r = backend.enqueue(Request(tuple(prompt), sp, source="bench")).result(120)
                if rnd:
                    if r.ttft_s is None:
                        raise RuntimeError(f"the {kind} request produced no token ({r.error or r.status.name})")
                    ttft[kind].append(r.ttft_s)
                    if kind == "warm":
                        cached.append(r.cached_tokens)
            if rnd:
                print(f"round {rnd}: cold {ttft['cold'][-1] * 1e3:7.1f} ms  warm {ttft['warm'][-1] * 1e3:7.1f} ms "
                      f"(cached {cached[-1]})", file=sys.stderr)
        stats = backend.cache.stats()
    finally:
        backend.stop()
        model.close()
    cold, warm = statistics.median(ttft["cold"]), statistics.median(ttft["warm"])
    print(json.dumps({
        "ttft_cold_s": round(cold, 4), "ttft_warm_s": round(warm, 4), "speedup": round(cold / warm, 2),
        "cached_tokens": statistics.median(cached), "prompt_tokens": len(prompt),
        "warm_hit_rate": round(statistics.median(cached) / len(prompt), 3),
        "cache_hit_rate_all": round(stats.hit_rate, 3),  # every admission: cold runs and warm-ups too
        "samples": {k: [round(x, 4) for x in v] for k, v in ttft.items()},
        "model": path.name, "threads": backend.config.threads, "flash_attn": backend.config.flash_attn,
        "repeats": args.repeats,
    }))
    return 0
