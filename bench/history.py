"""`tandem bench history`: does a server that has served a chat workload serve the next one as
fast as a server that has not?

Two `tandem serve` processes with the same options (`--model`, `--backend`, `--policy`; one
calibration, stored in a temporary `TANDEM_CACHE_DIR` both read) start side by side. The one
labelled `history` first serves `bench chat`'s workload (`--conversations` x `--turns`, a
`--system-words` system prompt, streamed over HTTP, whatever its cache keeps afterwards stays);
then both serve the study's workload (`seed_workload`: `--requests` prompts of a 496-token
shared prefix and 20 own tokens, 50 ms apart, 128 tokens each, the prefix warmed first), the
two alternating run by run (`run_order`), one at a time. The ratio of the median makespans,
history over fresh, is the figure (target: at most `TARGET`), with the cells each server's cache
held after the chats (`/v1/backends`).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from engine.core.errors import InvalidRequest
from engine.sim.benchmark import run_metrics, run_order
from engine.sim.workload import build_workload, seed_workload

HELP = "a server after a chat workload vs a fresh one on the study's N: the makespan ratio"
TARGET = 1.10  # history / fresh makespan, at most
LABELS = ("history", "fresh")


@dataclass(frozen=True, slots=True)
class Server:
    label: str
    url: str
    proc: subprocess.Popen
    log: str


def add_arguments(p) -> None:
    p.add_argument("--model", default="default", help="default | PATH.gguf | synthetic:SHAPE[:QUANT]")
    p.add_argument("--backend", action="append", default=None, metavar="SPEC",
                   help="both servers' backends, as `tandem serve` takes them (default: the default layout)")
    p.add_argument("--policy", default=None, help="both servers' routing policy (default: serve's)")
    p.add_argument("--conversations", type=int, default=8, help="the chat workload's (default: %(default)s)")
    p.add_argument("--turns", type=int, default=4, help="(default: %(default)s)")
    p.add_argument("--system-words", type=int, default=600, help="(default: %(default)s)")
    p.add_argument("--user-words", default="40-120", help="N or LOW-HIGH (default: %(default)s)")
    p.add_argument("--reply-tokens", default="32-192", help="N or LOW-HIGH (default: %(default)s)")
    p.add_argument("--think", type=float, default=1.0, help="mean think time, s (default: %(default)s)")
    p.add_argument("--rate", type=float, default=6.0, help="conversations starting per second (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.0, help="the chats' (default: %(default)s)")
    p.add_argument("--requests", type=int, default=8, help="the study's N (default: %(default)s)")
    p.add_argument("--runs", type=int, default=2, help="runs of the study per server, alternated (default: %(default)s)")
    p.add_argument("--ready-timeout", type=float, default=300.0, help="seconds a server may take to load")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take")


def run_history(args) -> int:
    from .chat import ChatSpec, ChatTarget, build_chat, parse_range
    from .chat import run_workload as run_chat

    if args.requests < 1 or args.runs < 1:
        raise InvalidRequest("--requests and --runs must be >= 1")
    try:
        chat = ChatSpec(conversations=args.conversations, turns=args.turns, rate=args.rate, think_s=args.think,
                        system_words=args.system_words, user_words=parse_range(args.user_words, "--user-words"),
                        reply_tokens=parse_range(args.reply_tokens, "--reply-tokens")).validate()
    except ValueError as e:
        raise InvalidRequest(str(e)) from None
    with _servers(args) as servers:
        hist = servers["history"]
        print(f"chats on {hist.label}: {chat.name()}", flush=True)
        records = asyncio.run(run_chat(ChatTarget(hist.url, hist.label), build_chat(chat, 0), timeout=args.timeout,
                                       temperature=args.temperature))
        cm = run_metrics(records)
        print(f"chats: makespan {cm.makespan_s:.2f} s, {cm.completed} turns, {cm.failed} failed", flush=True)
        cached = {label: cached_cells(s.url) for label, s in servers.items()}
        print("cached cells after the chats: " + ", ".join(f"{k} {v:,}" for k, v in cached.items()), flush=True)
        rows = study_runs(servers, args)
    summary = summarize(rows)
    print(format_summary(summary, cached))
    print(json.dumps({"chat": chat.to_dict(), "chat_failed": cm.failed, "requests": args.requests,
                      "runs": args.runs, "cached_cells": cached, "rows": rows, "summary": summary}))
    return 0 if not cm.failed and all(not r["failed"] for r in rows) else 1


def study_runs(servers: dict[str, Server], args) -> list[dict]:
    """The study's workload on every server, alternating run by run: one row each."""
    from .target import probe, run_target

    spec = seed_workload(args.requests)
    rows = []
    for run in range(args.runs):
        for label in run_order(list(LABELS), run):
            s = servers[label]
            target = asyncio.run(probe(s.url, api="openai", label=label, prompt="text"))
            records = run_target(target, build_workload(spec, run=run), run=run, timeout=args.timeout)
            m = run_metrics(records)
            row = {"server": label, "run": run, "makespan_s": m.makespan_s, "ttft_p50_s": m.ttft_p50_s,
                   "output_tok_s": m.output_tok_s, "completed": m.completed, "failed": m.failed}
            rows.append(row)
            print(f"run {run + 1} {label}: makespan {m.makespan_s:.2f} s, TTFT p50 {m.ttft_p50_s:.3f} s, "
                  f"{m.completed} done, {m.failed} failed", flush=True)
    return rows


def summarize(rows: list[dict]) -> dict:
    """Medians per server and the ratio history / fresh."""
    med = {}
    for label in LABELS:
        mine = [r for r in rows if r["server"] == label and not r["failed"]]
        if mine:
            med[label] = {k: statistics.median(r[k] for r in mine) for k in ("makespan_s", "ttft_p50_s", "output_tok_s")}
    ratios = {}
    if len(med) == len(LABELS):
        ratios["makespan history / fresh"] = med["history"]["makespan_s"] / med["fresh"]["makespan_s"]
        ratios["TTFT p50 history / fresh"] = med["history"]["ttft_p50_s"] / med["fresh"]["ttft_p50_s"]
    return {"medians": med, "ratios": ratios}


def format_summary(summary: dict, cached: dict[str, int]) -> str:
    lines = ["| server | cached cells after the chats | makespan s | TTFT p50 s | output tok/s |", "|---|---|---|---|---|"]
    for label, m in summary["medians"].items():
        lines.append(f"| {label} | {cached.get(label, -1):,} | {m['makespan_s']:.2f} | {m['ttft_p50_s']:.3f} | "
                     f"{m['output_tok_s']:.1f} |")
    for name, value in summary["ratios"].items():
        verdict = f"  (target <= {TARGET:g}: {'met' if value <= TARGET else 'NOT met'})" if name.startswith("makespan") else ""
        lines.append(f"ratio {name}: {value:.3f}{verdict}")
    return "\n".join(lines)


def cached_cells(url: str) -> int:
    """The KV cells a Tandem server's backends hold (in use or cached), from `/v1/backends`."""
    with urllib.request.urlopen(f"{url}/v1/backends", timeout=10) as r:
        doc = json.loads(r.read())
    return sum(int(b.get("kv_cells_used") or 0) for b in doc.get("backends", []))


@contextmanager
def _servers(args) -> Iterator[dict[str, Server]]:
    """Both servers, ready; stopped (and their rate cache removed) on the way out."""
    from engine.llama import child_env

    from .laptop import Layout, _free_port, _wait_ready

    cache = tempfile.mkdtemp(prefix="tandem-history-cache-")
    argv = ["-m", "app", "serve", "--model", args.model]
    for spec in args.backend or []:
        argv += ["--backend", spec]
    if args.policy:
        argv += ["--policy", args.policy]
    out: dict[str, Server] = {}
    ok = False
    try:
        for label in LABELS:  # one after the other: the second reuses the first one's stored rates
            port = _free_port()
            log = tempfile.NamedTemporaryFile("w+", prefix=f"history-{label}-", suffix=".log", delete=False)  # noqa: SIM115
            proc = subprocess.Popen([sys.executable, *argv, "--port", str(port)], stdout=log,
                                    stderr=subprocess.STDOUT, env=child_env(TANDEM_CACHE_DIR=cache))
            log.close()
            out[label] = Server(label, f"http://127.0.0.1:{port}", proc, log.name)
            t0 = time.monotonic()
            _wait_ready(proc, out[label].url, Layout(label, tuple(argv), "tandem"), args.ready_timeout, log.name)
            print(f"{label}: ready in {time.monotonic() - t0:.1f} s at {out[label].url}", flush=True)
        yield out
        ok = True
    finally:
        for s in out.values():
            s.proc.terminate()
        for s in out.values():
            try:
                s.proc.wait(30)
            except subprocess.TimeoutExpired:
                s.proc.kill()
                s.proc.wait(30)
            if ok:  # a failed run keeps its servers' logs for reading
                os.unlink(s.log)
            else:
                print(f"{s.label}'s log: {s.log}", file=sys.stderr)
        shutil.rmtree(cache, ignore_errors=True)
