"""`tandem bench laptop`: first use on a CPU-only machine, against one all-core backend and
llama-cpp-python's own server, side by side in one invocation.

Each layout is a fresh `tandem serve` process (`python -m app serve`) whose rate cache is an
empty temporary directory (`TANDEM_CACHE_DIR`), i.e. a first start on this machine: it
measures its backends' rates at load (`Engine.load(calibrate=True)`) before it answers
`/health`. `ready s` is from spawning the process to the first healthy `/health` (model load
+ that calibration). Then the study's workload (`engine.sim.workload.seed_workload`, N requests
50 ms apart, a 496-token shared prefix warmed once through the server first) is sent as
text over HTTP by `bench.target` (streamed `/v1/completions`), and the server is stopped.

Layouts: `default` (no `--backend`: what `tandem serve` picks on this machine), `one` (one
backend with every core, `cpu:threads=CORES,cap=N`), any `--layout LABEL=SPEC;SPEC` given,
and `llama-cpp-python` (`python -m llama_cpp.server --n_threads CORES
--interrupt_requests False`, which serves one request at a time; needs the `[server]`
extra's packages: fastapi, uvicorn, sse-starlette, starlette-context, pydantic-settings).
With `--runs R` the layouts alternate R times. Prints one row per run, the medians, the
ratios the laptop target is judged by, and one JSON line (the last line of stdout).
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

from engine.core.errors import InvalidRequest
from engine.sim.benchmark import run_metrics
from engine.sim.workload import build_workload, seed_workload

HELP = "first use on a CPU-only machine: default `tandem serve` vs one all-core backend vs llama-cpp-python's server"
LLAMA_CPP = "llama-cpp-python"
# what llama-cpp-python's `[server]` extra adds (checked without importing llama_cpp here)
SERVER_MODULES = ("fastapi", "uvicorn", "sse_starlette", "starlette_context", "pydantic_settings")


@dataclass(frozen=True)
class Layout:
    label: str
    argv: tuple[str, ...]  # the server's command line after the interpreter
    engine: str  # "tandem" or "llama-cpp-python"


def add_arguments(p) -> None:
    p.add_argument("--model", default="default", help="default | PATH.gguf (default: %(default)s)")
    p.add_argument("--requests", type=int, default=8, help="the study's N (default: %(default)s)")
    p.add_argument("--runs", type=int, default=1, help="rounds of every layout, alternated (default: %(default)s)")
    p.add_argument("--cores", type=int, default=None, help="threads of the all-core layouts (default: every core)")
    p.add_argument("--one-cap", type=int, default=8, help="cap of the `one` layout (default: %(default)s)")
    p.add_argument("--layout", action="append", default=[], metavar="LABEL=SPEC[;SPEC...]",
                   help="another Tandem layout to run, e.g. 'split=cpu:threads=1,cap=4;cpu:threads=1,cap=4'")
    p.add_argument("--no-llama-cpp", action="store_true", help="leave llama-cpp-python's server out")
    p.add_argument("--ready-timeout", type=float, default=300.0,
                   help="seconds a server may take to load and calibrate (default: %(default)s)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take")


def layouts(args, model_path: str) -> list[Layout]:
    cores = args.cores or os.cpu_count() or 2
    serve = ("-m", "app", "serve", "--model", args.model)
    out = [Layout("default", serve, "tandem"),
           Layout("one", (*serve, "--backend", f"cpu:threads={cores},cap={args.one_cap}"), "tandem")]
    for text in args.layout:
        label, eq, specs = text.partition("=")
        parts = [s.strip() for s in specs.split(";") if s.strip()]
        if not eq or not label.strip() or not parts:
            raise InvalidRequest(f"--layout {text!r}: expected LABEL=SPEC[;SPEC...]")
        out.append(Layout(label.strip(), (*serve, *(a for s in parts for a in ("--backend", s))), "tandem"))
    if not args.no_llama_cpp:
        out.append(Layout(LLAMA_CPP, ("-m", "llama_cpp.server", "--model", model_path, "--n_threads", str(cores),
                                      "--n_threads_batch", str(cores), "--n_ctx", "2048",
                                      "--interrupt_requests", "False"), LLAMA_CPP))
    return out


def run_laptop(args) -> int:
    from engine.llama.model import resolve_model

    if args.requests < 1 or args.runs < 1:
        raise InvalidRequest("--requests and --runs must be >= 1")
    model_path = str(resolve_model(args.model))
    plan = layouts(args, model_path)
    missing = [] if args.no_llama_cpp else [m for m in SERVER_MODULES if importlib.util.find_spec(m) is None]
    if missing:
        raise InvalidRequest(f"llama-cpp-python's server needs {', '.join(missing)}: install the [server] extra's "
                             f"packages (pip install fastapi uvicorn sse-starlette starlette-context "
                             f"pydantic-settings) or pass --no-llama-cpp")
    spec = seed_workload(args.requests)
    rows: list[dict] = []
    for run in range(args.runs):
        for layout in plan:
            row = one_run(layout, spec, run, args)
            rows.append(row)
            print(_row_line(row), flush=True)
    summary = summarize(rows, [lay.label for lay in plan])
    print(format_summary(summary))
    print(json.dumps({"requests": args.requests, "runs": args.runs, "cores": args.cores or os.cpu_count(),
                      "rows": rows, "summary": summary}))
    return 0


def one_run(layout: Layout, spec, run: int, args) -> dict:
    """Start `layout`'s server on a fresh rate cache, send the workload, stop it: one row."""
    from .target import probe, run_target

    cache = tempfile.mkdtemp(prefix="tandem-laptop-cache-")
    port = _free_port()
    argv = [sys.executable, *layout.argv, "--port", str(port)]
    from engine.llama import child_env

    env = child_env(TANDEM_CACHE_DIR=cache)  # llama-cpp-python's server on its own OpenMP defaults
    # the server writes to it until it stops; it is read back, then closed, below
    log = tempfile.NamedTemporaryFile("w+", prefix=f"laptop-{layout.label}-", suffix=".log", delete=False)  # noqa: SIM115
    t0 = time.monotonic()
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_ready(proc, url, layout, args.ready_timeout, log.name)
        ready_s = time.monotonic() - t0
        target = asyncio.run(probe(url, api="openai", label=layout.label, prompt="text"))
        records = run_target(target, build_workload(spec, run=run), run=run, timeout=args.timeout)
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)
        log.close()
        shutil.rmtree(cache, ignore_errors=True)
    m = run_metrics(records)
    failed = [r.error for r in records if not r.success]
    if not failed:  # a failed run keeps its server's log for reading
        os.unlink(log.name)
    return {"layout": layout.label, "run": run, "ready_s": ready_s, "makespan_s": m.makespan_s,
            "ttft_p50_s": m.ttft_p50_s, "ttft_p95_s": m.ttft_p95_s, "output_tok_s": m.output_tok_s,
            "completed": m.completed, "failed": m.failed, "routed": m.routed, "errors": failed[:3],
            "server_log": log.name if failed else None}


def summarize(rows: list[dict], order: list[str]) -> dict:
    """Medians per layout, and the ratios of `default` to `one` and to llama-cpp-python."""
    med: dict[str, dict] = {}
    for label in order:
        mine = [r for r in rows if r["layout"] == label and not r["failed"]]
        if mine:
            med[label] = {k: statistics.median(r[k] for r in mine)
                          for k in ("ready_s", "makespan_s", "ttft_p50_s", "output_tok_s")}
    ratios: dict[str, float] = {}
    d = med.get("default")
    if d and "one" in med:
        ratios["makespan default / one"] = d["makespan_s"] / med["one"]["makespan_s"]
    if d and LLAMA_CPP in med:
        ratios[f"makespan default / {LLAMA_CPP}"] = d["makespan_s"] / med[LLAMA_CPP]["makespan_s"]
        ratios[f"TTFT p50 default / {LLAMA_CPP}"] = d["ttft_p50_s"] / med[LLAMA_CPP]["ttft_p50_s"]
    return {"medians": med, "ratios": ratios}


TARGETS = {"makespan default / one": 1.10, f"makespan default / {LLAMA_CPP}": 0.5,
           f"TTFT p50 default / {LLAMA_CPP}": 0.1}


def format_summary(summary: dict) -> str:
    lines = ["| layout | ready s | makespan s | TTFT p50 s | output tok/s |", "|---|---|---|---|---|"]
    for label, m in summary["medians"].items():
        lines.append(f"| {label} | {m['ready_s']:.1f} | {m['makespan_s']:.2f} | {m['ttft_p50_s']:.3f} | "
                     f"{m['output_tok_s']:.1f} |")
    for name, value in summary["ratios"].items():
        bar = TARGETS.get(name)
        verdict = "" if bar is None else f"  (target <= {bar:g}: {'met' if value <= bar else 'NOT met'})"
        lines.append(f"ratio {name}: {value:.3f}{verdict}")
    return "\n".join(lines)


def _row_line(row: dict) -> str:
    routed = ", ".join(f"{k} {v}" for k, v in sorted(row["routed"].items()))
    bad = f"  FAILED {row['failed']}: {row['errors']}" if row["failed"] else ""
    return (f"run {row['run'] + 1} {row['layout']}: ready {row['ready_s']:.1f} s, makespan {row['makespan_s']:.2f} s, "
            f"TTFT p50 {row['ttft_p50_s']:.3f} s, routed {routed}{bad}")


def _wait_ready(proc: subprocess.Popen, url: str, layout: Layout, timeout: float, log_path: str) -> None:
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout
    path = "/health" if layout.engine == "tandem" else "/v1/models"
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise InvalidRequest(f"{layout.label}: the server exited with {proc.returncode} (log: {log_path})")
        try:
            with urllib.request.urlopen(url + path, timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.2)
    raise InvalidRequest(f"{layout.label}: not ready after {timeout:.0f} s (log: {log_path})")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
