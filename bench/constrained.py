"""`tandem bench constrained`: what a grammar- or schema-constrained request costs the plain
chat beside it on the same backend, against the same chat alone, in one invocation.

A constrained sequence samples on the host: each of its tokens may take a pass of its grammar
over the whole vocabulary (llama.cpp's grammar sampler), and that work sits between two steps
of every sequence of its backend. Here a neighbour (a greedy chat of `--tokens` tokens, end
tokens ignored) runs alone, then beside a hog that is still decoding when it arrives, in
alternation (alone, beside, alone, ...), for each hog and sampling mode:

- `grammar`: the costliest raw grammar the limits still accept: `MAX_ALTERNATIVES` literal
  alternatives, repeated without end (no end token is ever allowed), behind a one-character start (the start is what
  `check` times against `MAX_PASS_MS`);
- `schema`: a JSON array of `MAX_REPEAT` items or more, each one of an enum of `MAX_ENUM` values;
- `json`: a JSON object whose string holds `MAX_REPEAT` characters or more (inside a string
  every token passes: what `json_object` replies spend most tokens on).

Each is measured beside a control too, in the same alternation (alone, beside the control,
beside the hog, ...): the same long request without a grammar, which is what any second
sequence costs the step (on a two-core CPU, most of it). Modes: `greedy` (temperature 0) and `sampled` (temperature 1, top-k 40: the chat defaults).
Each row prints the neighbour's TTFT and decode tok/s (medians) alone, beside the control and
beside the hog, the hog's ratios over alone and over the control, the hog's own tok/s, and the
host time between two steps while both ran (p50 and max: the grammar's work lands there). The last line of stdout is one JSON object (`--out DIR` also
writes it, with the command, date and commit, to `constrained.json`).
"""

from __future__ import annotations

import os
import statistics
import sys
import threading
import time
from typing import Any

from engine.backends.config import default_specs, parse_backend_specs
from engine.backends.local import Backend
from engine.core.request import Request, SamplingParams
from engine.engine import Engine

from . import report as bench_report

HELP = ("a plain chat's TTFT and tok/s beside the costliest grammar, schema and json_object requests "
        "the limits accept, against the same chat alone")
HOGS = ("grammar", "schema", "json")
MODES = ("greedy", "sampled")
START_S = 120  # the hog's first token comes within this
NEIGHBOUR = [{"role": "user", "content": "Tell me about the history of computing."}]
HOG_PROMPT = [{"role": "user", "content": "Write a long list of words."}]


def add_arguments(p) -> None:
    p.add_argument("--model", default="default", help="(default: %(default)s)")
    p.add_argument("--backend", action="append", default=None, metavar="SPEC",
                   help="backend spec (default: one CPU backend, as `tandem serve` has)")
    p.add_argument("--hogs", default=",".join(HOGS), help="which constrained requests (default: all)")
    p.add_argument("--modes", default=",".join(MODES), help="greedy, sampled (default: both)")
    p.add_argument("--tokens", type=int, default=32, help="the neighbour's output tokens (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=3, help="alone/beside pairs per row (default: %(default)s)")
    p.add_argument("--out", default=None, metavar="DIR", help="write constrained.json there")


def hog_grammar(engine: Engine, hog: str) -> tuple[str, str]:
    """The hog's grammar, and what it is; the largest the engine's limits accept."""
    from engine.llama import grammar as g

    model = engine.model
    if model is None:
        raise ValueError("tandem bench constrained needs a local model")
    schema: dict[str, Any] = {}
    what = ""
    if hog == "json":  # inside a string every token passes
        schema = {"type": "object", "properties": {"text": {"type": "string", "minLength": g.MAX_REPEAT}},
                  "required": ["text"]}
        what = f"an object's string of {g.MAX_REPEAT}+ characters"
    elif hog == "schema":
        schema = {"type": "array", "items": {"enum": [f"value{i}" for i in range(g.MAX_ENUM)]},
                  "minItems": g.MAX_REPEAT}
        what = f"an array of {g.MAX_REPEAT}+ items of an enum of {g.MAX_ENUM} values"
    if hog in ("json", "schema"):
        text = engine.json_grammar(schema)
        model.check_grammar(text, "response_format")
        return text, what
    # Alternatives that share their first letters, so that many stacks match a token deeply.
    n = g.MAX_ALTERNATIVES
    words = " | ".join(f'"w{i:03d}x"' for i in range(n))
    text = f'root ::= "[" items\nitems ::= item items\nitem ::= ({words}) " "'
    model.check_grammar(text)
    return text, f"{n} alternatives, repeated"


def run_constrained(args) -> int:
    hogs = [h for h in args.hogs.split(",") if h]
    modes = [m for m in args.modes.split(",") if m]
    bad = [h for h in hogs if h not in HOGS] + [m for m in modes if m not in MODES]
    if bad:
        print(f"tandem: unknown hog or mode {', '.join(bad)}", file=sys.stderr)
        return 2
    engine = Engine.load(args.model, parse_backend_specs(args.backend or default_specs(gpu=False)))
    rows = []
    try:
        name = engine.backend_names[0]
        prompt = engine.chat_tokens(NEIGHBOUR)
        hog_prompt = engine.chat_tokens(HOG_PROMPT)
        near = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
        _neighbour(engine, name, prompt, near)  # warm-up, not measured
        print(f"{'hog':<7} {'mode':<7} {'TTFT ms: alone':>14} {'plain':>6} {'hog':>6} {'x':>5} {'x plain':>7}  "
              f"{'tok/s: alone':>12} {'plain':>6} {'hog':>6} {'x':>5} {'x plain':>7}  {'hog tok/s':>9} "
              f"{'gap ms p50':>10} {'max':>5}  grammar", flush=True)
        for hog in hogs:
            text, what = hog_grammar(engine, hog)
            for mode in modes:
                t = 0.0 if mode == "greedy" else 1.0
                hp = SamplingParams(temperature=t, max_tokens=4096, seed=1, grammar=text)
                control = SamplingParams(temperature=t, max_tokens=4096, seed=1, ignore_eos=True)
                runs: dict[str, list] = {"alone": [], "plain": [], "hog": [], "hog_tok_s": [], "gaps": [],
                                         "plain_gaps": []}
                deferrals = _local(engine, name).stats().grammar_deferrals
                for _ in range(args.repeats):  # alone, beside the control, beside the hog, ...
                    runs["alone"].append(_neighbour(engine, name, prompt, near))
                    one, _, gaps = _beside(engine, name, prompt, near, hog_prompt, control)
                    runs["plain"].append(one)
                    runs["plain_gaps"] += gaps
                    one, rate, gaps = _beside(engine, name, prompt, near, hog_prompt, hp)
                    runs["hog"].append(one)
                    runs["hog_tok_s"].append(rate)
                    runs["gaps"] += gaps
                rows.append(_row(hog, mode, what, len(text), runs))
                rows[-1]["grammar_deferrals"] = _local(engine, name).stats().grammar_deferrals - deferrals
                _print(rows[-1])
    finally:
        engine.close()
    bench_report.write_result(args.out, "constrained.json",
                              {"model": args.model, "load_average": os.getloadavg(), "rows": rows})
    return 0


def _local(engine: Engine, name: str) -> Backend:
    """Backend `name`, which must be a local (llama.cpp) one: its step counters are read."""
    backend = engine.backend(name)
    if not isinstance(backend, Backend):
        raise ValueError(f"backend {name} is not a local one")
    return backend


def _neighbour(engine: Engine, name: str, prompt: list[int], sp: SamplingParams) -> tuple[float, float]:
    """(TTFT s, decode tok/s) of one neighbour request."""
    record = engine.submit(Request(tuple(prompt), sp, source="bench", backend=name)).result(600)
    if record.error:
        raise RuntimeError(record.error)
    return record.ttft_s or 0.0, record.decode_tok_s or 0.0


def _beside(engine: Engine, name: str, prompt, near, hog_prompt, hp):
    """The neighbour's (TTFT, tok/s) while the hog decodes, the hog's tok/s meanwhile, and the
    host seconds between the steps they ran together."""
    hog = engine.submit(Request(tuple(hog_prompt), hp, source="bench", backend=name))
    first = threading.Event()
    counted = [0]

    def drain() -> None:
        for _ in hog:
            counted[0] += 1
            first.set()
        first.set()

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    if not first.wait(START_S) or hog.done:
        hog.cancel()
        record = hog.result(60)
        raise RuntimeError(f"the hog did not start decoding: {record.error or record.finish_reason}")
    backend = _local(engine, name)
    t0, n0, s0 = time.perf_counter(), _generated(engine, name, hog.id), backend.steps
    result = _neighbour(engine, name, prompt, near)
    dt, n, s1 = time.perf_counter() - t0, _generated(engine, name, hog.id) - n0, backend.steps
    hog.cancel()
    record = hog.result(600)
    reader.join(60)
    gaps = list(backend.step_gaps)  # the worker is idle now
    end = backend.steps
    step_gaps = gaps[max(len(gaps) - (end - s0) + 1, 0):len(gaps) - (end - s1)]
    if record.error and record.finish_reason not in ("cancelled", None):
        raise RuntimeError(f"the hog failed: {record.error}")
    if record.finish_reason != "cancelled":
        raise RuntimeError(f"the hog ended ({record.finish_reason}) before its neighbour: make it longer")
    return result, n / dt if dt > 0 else 0.0, step_gaps


def _generated(engine: Engine, name: str, request_id: str) -> int:
    """Tokens request `request_id` has generated so far on backend `name`."""
    return next((i.generated for i in engine.backend_snapshot(name).items if i.request_id == request_id), 0)


def _row(hog, mode, what, size, runs) -> dict:
    med = statistics.median
    ttft = {k: med(x[0] for x in runs[k]) for k in ("alone", "plain", "hog")}
    rate = {k: med(x[1] for x in runs[k]) for k in ("alone", "plain", "hog")}
    gaps = runs["gaps"]
    return {"hog": hog, "mode": mode, "grammar": what, "grammar_bytes": size,
            **{f"ttft_{k}_ms": round(1e3 * v, 1) for k, v in ttft.items()},
            **{f"tok_s_{k}": round(v, 1) for k, v in rate.items()},
            # the neighbour's TTFT and its slowdown beside the hog: over alone, and over beside the control
            "ttft_ratio": round(ttft["hog"] / ttft["alone"], 2), "ttft_ratio_plain": round(ttft["hog"] / ttft["plain"], 2),
            "slowdown": round(rate["alone"] / rate["hog"], 2), "slowdown_plain": round(rate["plain"] / rate["hog"], 2),
            "hog_tok_s": round(med(runs["hog_tok_s"]), 1),
            "gap_p50_ms": round(1e3 * med(gaps), 2) if gaps else None,
            "gap_max_ms": round(1e3 * max(gaps), 1) if gaps else None,
            "plain_gap_p50_ms": round(1e3 * med(runs["plain_gaps"]), 2) if runs["plain_gaps"] else None,
            "samples": {k: runs[k] for k in ("alone", "plain", "hog")}}


def _print(r: dict) -> None:
    print(f"{r['hog']:<7} {r['mode']:<7} {r['ttft_alone_ms']:>14.0f} {r['ttft_plain_ms']:>6.0f} {r['ttft_hog_ms']:>6.0f} "
          f"{r['ttft_ratio']:>5.2f} {r['ttft_ratio_plain']:>7.2f}  {r['tok_s_alone']:>12.1f} {r['tok_s_plain']:>6.1f} "
          f"{r['tok_s_hog']:>6.1f} {r['slowdown']:>5.2f} {r['slowdown_plain']:>7.2f}  {r['hog_tok_s']:>9.1f} "
          f"{r['gap_p50_ms'] or 0:>10.1f} {r['gap_max_ms'] or 0:>5.0f}  {r['grammar']} ({r['grammar_bytes']} B)",
          flush=True)


