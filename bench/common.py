"""What the benchmarks share: a fixed filler prompt, context sizes, and decoding a batch on one
backend with its decode rate (`overhead`, `together`, `prefill`, `cache` and `ui` use them).

`engine_decode` records, per batch size, the share of wall time spent outside `llama_decode`
(`HOST_SHARE`), the host time between consecutive steps (`HOST_GAP`) and the share of steps
that reused llama.cpp's graph (`GRAPH_REUSE`); only `tandem bench overhead` reads them. Called from the bench's own (main) thread.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import replace

from engine.backends.local import Backend
from engine.core.request import Request, SamplingParams
from engine.llama.model import Model


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
# µs between one step's device sync and the next step's llama_decode, median over a run's steps:
# the host work on the critical path of every step, without what a request costs once
# (admission, its prefix's KV copy, retirement), which HOST_US spreads over the steps.
HOST_GAP: dict[int, list[float]] = {}
GRAPH_REUSE: dict[int, list[float]] = {}


# A grammar that never completes and lets every token but NUL through: each constrained step
# checks the whole vocabulary against it (a JSON string's content costs the same), and the
# sequence runs to `max_tokens` like the `ignore_eos` ones beside it.
UNENDING_GRAMMAR = "root ::= [^\\x00] root"


def engine_decode(backend: Backend, prompt: list[int], n_gen: int, batch: int, record: bool = True,
                  sampling: SamplingParams | None = None, constrained: int = 0) -> float:
    """Decode tok/s of `batch` requests of `prompt` run together for `n_gen` tokens each
    (`ignore_eos`), greedy unless `sampling` says otherwise; the first `constrained` of them
    run under `UNENDING_GRAMMAR` (host sampling: the per-sequence fallback)."""
    backend.set_cap(batch)  # B at a time, and no more idle sampler chains than that
    backend.flush().result(60)
    backend.warm(prompt[:-1]).result(120)
    d0, t0, s0, g0 = backend.decode_s, time.perf_counter(), backend.steps, backend.stats().graphs_reused
    sp = replace(sampling or SamplingParams(temperature=0.0), max_tokens=n_gen, ignore_eos=True)
    cp = SamplingParams(temperature=0.0, max_tokens=n_gen, grammar=UNENDING_GRAMMAR)
    handles = [backend.enqueue(Request(tuple(prompt), cp if i < constrained else sp, source="bench"))
               for i in range(batch)]
    records = [h.result(600) for h in handles]
    for r in records:
        if r.error:
            raise RuntimeError(r.error)
    if not record:
        return decode_rate(records)
    wall = time.perf_counter() - t0
    HOST_SHARE.setdefault(batch, []).append(1 - (backend.decode_s - d0) / wall)
    HOST_US.setdefault(batch, []).append(1e6 * (wall - (backend.decode_s - d0)) / max(backend.steps - s0, 1))
    GRAPH_REUSE.setdefault(batch, []).append((backend.stats().graphs_reused - g0) / max(backend.steps - s0, 1))
    steps = backend.steps - s0
    gaps = list(backend.step_gaps)[-steps:][1:] if steps > 1 else []  # the first: idle before the run
    if gaps:
        HOST_GAP.setdefault(batch, []).append(1e6 * statistics.median(gaps))
    return decode_rate(records)


def decode_rate(records) -> float:
    """Decode tok/s of requests that ran together: tokens after each one's first, summed,
    over the time from the last first token to the last token."""
    start = max(r.ttft_s for r in records)
    end = max(r.e2e_s for r in records)
    return sum(r.output_tokens - 1 for r in records) / (end - start)
