"""`tandem bench prefill`: what the batch sizes (`n_batch`, `n_ubatch`) buy and cost.

`n_batch` is a backend's prefill budget per step (prompt tokens it may decode at once) and
llama.cpp's logical batch; `n_ubatch` the physical batch one graph computes. For each
`--sizes` pair, one backend on the same model, measured in alternation (A B C A B C ...):

- **alone**: a cold `--prompt-tokens` prompt (cache flushed) on an idle backend: its time to
  first token, and prefill tok/s = prompt tokens / that time;
- **beside decoding**: `--decoders` sequences are decoding when the same prompt arrives: its
  time to first token, and the longest step that carried prompt tokens — the gap between two
  tokens that every running sequence sees while the prompt is prefilled.

A larger `n_batch` gives the new prompt its first token sooner and stalls the running
sequences longer per step. The last stdout line is one JSON object.
"""

from __future__ import annotations

import json
import statistics
import sys
import time

from engine.backends.config import BackendConfig
from engine.backends.local import Backend
from engine.core.events import EventBus, StepDone
from engine.core.request import FinishRecord, Request, SamplingParams
from engine.llama.model import Model, resolve_model

from .common import ctx_for, filler_prompt


def parse_sizes(text: str) -> list[tuple[int, int]]:
    """`512/512,2048/512` → [(512, 512), (2048, 512)] (n_batch / n_ubatch)."""
    sizes = []
    for item in filter(None, (p.strip() for p in text.split(","))):
        b, _, u = item.partition("/")
        try:
            n_batch, n_ubatch = int(b), int(u or b)
        except ValueError:
            raise SystemExit(f"--sizes: {item!r} is not N_BATCH/N_UBATCH") from None
        if not 1 <= n_ubatch <= n_batch:
            raise SystemExit(f"--sizes: {item!r} needs 1 <= n_ubatch <= n_batch")
        sizes.append((n_batch, n_ubatch))
    return sizes


HELP = "prefill speed and decode stalls for n_batch/n_ubatch pairs"


def add_arguments(p) -> None:
    p.add_argument("--model", default="default")
    p.add_argument("--device", default="cpu", choices=["cpu", "gpu"])
    p.add_argument("--threads", type=int, default=0, help="0: all cores")
    p.add_argument("--sizes", default="512/512,2048/512,2048/2048",
                   help="comma-separated N_BATCH/N_UBATCH pairs (default: %(default)s)")
    p.add_argument("--prompt-tokens", type=int, default=2048)
    p.add_argument("--decoders", type=int, default=8, help="sequences decoding when the prompt arrives")
    p.add_argument("--decode-tokens", type=int, default=1024, help="their length (they are cancelled after)")
    p.add_argument("--repeats", type=int, default=3)


def run_prefill(args) -> int:
    sizes = parse_sizes(args.sizes)
    path = resolve_model(args.model)
    model = Model(path, args.device)
    prompt = filler_prompt(model, args.prompt_tokens)
    n_ctx = ctx_for(len(prompt), args.decode_tokens + 4, args.decoders)  # decoders' prompts: 4 tokens
    steps: list[StepDone] = []
    bus = EventBus()
    bus.subscribe(steps.append, (StepDone,))
    backends = {}
    for n_batch, n_ubatch in sizes:
        name = f"{n_batch}/{n_ubatch}"
        config = BackendConfig(name=name, device=model.device, cap=args.decoders + 1, n_ctx=n_ctx,
                               n_batch=n_batch, n_ubatch=n_ubatch, threads=args.threads)
        backends[name] = Backend(config, model, bus=bus).start()
    print(f"model {path.name}, device {model.device}, prompt {len(prompt)} tokens, "
          f"{args.decoders} decoding beside it", file=sys.stderr)
    keys = ("alone_ttft_s", "beside_ttft_s", "beside_max_step_s")
    results: dict[str, dict[str, list[float]]] = {name: {k: [] for k in keys} for name in backends}
    try:
        for rnd in range(args.repeats + 1):  # round 0 warms up
            for name, b in backends.items():
                alone = _alone(b, prompt)
                beside, stall = _beside(b, prompt, args.decoders, args.decode_tokens, steps)
                if rnd:
                    for k, v in zip(keys, (alone, beside, stall)):
                        results[name][k].append(v)
                    print(f"round {rnd} {name:>9}: alone {alone * 1e3:7.1f} ms, beside decoding "
                          f"{beside * 1e3:7.1f} ms, longest step {stall * 1e3:6.1f} ms", file=sys.stderr)
    finally:
        for b in backends.values():
            b.stop()
        model.close()
    out = {}
    for name, r in results.items():
        med = {k: statistics.median(v) for k, v in r.items()}
        out[name] = {**{k: round(v, 4) for k, v in med.items()},
                     "prefill_tok_s": round(len(prompt) / med["alone_ttft_s"], 1),
                     "samples": {k: [round(x, 4) for x in v] for k, v in r.items()}}
    print(json.dumps({"sizes": out, "model": path.name, "device": model.device, "prompt_tokens": len(prompt),
                      "decoders": args.decoders, "threads": args.threads, "repeats": args.repeats}))
    return 0


def _alone(b: Backend, prompt: list[int]) -> float:
    b.flush().result(60)
    r = b.enqueue(Request(tuple(prompt), SamplingParams(temperature=0.0, max_tokens=1), source="bench")).result(600)
    return _ttft(b, r)


def _ttft(b: Backend, r: FinishRecord) -> float:
    if r.ttft_s is None:
        raise RuntimeError(f"{b.name}: the prompt produced no token ({r.error or r.status.name})")
    return r.ttft_s


def _beside(b: Backend, prompt: list[int], decoders: int, decode_tokens: int, steps: list) -> tuple[float, float]:
    """TTFT of `prompt` arriving while `decoders` sequences decode, and the longest step that
    carried prompt tokens while they ran."""
    b.flush().result(60)
    sp = SamplingParams(temperature=0.0, max_tokens=decode_tokens, ignore_eos=True)
    running = [b.enqueue(Request((5 + i, 7, 11, 13), sp, source="bench")) for i in range(decoders)]
    deadline = time.monotonic() + 60
    while len((snap := b.snapshot()).running) < decoders:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{b.name}: {len(snap.running)} of {decoders} decoding sequences started in "
                               f"{snap.n_ctx} KV cells (lower --decoders or --decode-tokens)")
        time.sleep(0.002)
    first = len(steps)
    r = b.enqueue(Request(tuple(prompt), SamplingParams(temperature=0.0, max_tokens=1), source="bench")).result(600)
    mixed = [e.seconds for e in steps[first:] if e.backend == b.name and e.n_prefill and e.n_decode]
    for h in running:
        h.cancel()
    for h in running:
        h.result(60)
    if not mixed:
        raise RuntimeError(f"{b.name}: the prompt was never prefilled beside decoding sequences "
                           "(raise --decode-tokens)")
    return _ttft(b, r), max(mixed)
