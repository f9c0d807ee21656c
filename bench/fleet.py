"""`tandem bench fleet`: a fleet of engines behind routers, the tenant workload through each, in
one invocation.

What one invocation does:

1. Launches the engines as subprocesses, one command line each, from a preset:
   `--engines tandem` (`python -m app serve` per GPU of `--gpus` with `CUDA_VISIBLE_DEVICES=i`,
   or `--count N` CPU engines, e.g. `--model synthetic:tiny`), `--engines llama-server` (the
   binary on PATH or `--llama-server`, per GPU, `--metrics` plus `--llama-flags`), or
   `--engine-cmd 'CMD ... {port}'` (repeatable, any OpenAI-compatible server). It waits for each
   one's `GET /health`; an engine that exits or stays unhealthy is an `EngineStartError`
   naming its command and the last lines of its log (the invocation stops: nothing could run).
   A router or in-process run that fails the same way only loses its own rows: the error is
   printed, kept in the report's notes, and the next variant runs.
2. For each tenant count K (`--tenants 8,32`) and run, runs the workload through each variant
   of `--variants`, in the order given (put the deciding ones first: results are written after
   every run):
   - `tandem:POLICY` — Tandem's router, `python -m app serve --backend remote:url=…,name=eI`
     for every engine, `--policy POLICY`, no local model (needs `engine.backends.remote`);
   - `sglang:POLICY` — sglang-router (`cache_aware`, `round_robin`, ...), started without its
     Python launcher (that wants fastapi/uvicorn/orjson/setproctitle, absent on the GPU
     machine): a child process builds `RouterArgs` and calls `Router.from_args(args).start()`;
     one at a time;
   - `single` — engine e0 alone, no router (the one-engine baseline);
   - `in-process:POLICY` — the in-process engine over `--inprocess-backend` specs (e.g.
     `gpu:device=0`, `gpu:device=1`), run as a child `tandem bench grid` with the fleet's
     engines stopped meanwhile (they would share the GPUs), its records merged here.
   Routers and engines get text prompts (`--target-prompt text` in `bench grid` terms):
   sglang-router matches only text and refuses token ids with a 422.
3. Cold and alike: before every run the engines are restarted (`--fresh restart`, the
   default; llama-server's cache cannot be flushed otherwise; Tandem engines restart just as
   fast) and the router is started anew, so no run inherits a cache or a router's tree.
4. `--kill-one-at S` kills the last engine (SIGKILL) S seconds into every router run: the
   report then shows whether the rest finished, failures counted; every request is bounded
   by `--timeout`, so nothing hangs.

Requests per engine come from each engine's own Prometheus `/metrics` counters, read before
and after each run (deltas) (the in-process rows: from the engine's finish records): Tandem engines count finished requests
(`tandem:request_success_total`), generated tokens and computed (uncached) prompt tokens;
llama-server (started with `--metrics`) counts generated tokens (`llamacpp:tokens_predicted_total`)
and computed prompt tokens (`llamacpp:prompt_tokens_total`) but not requests, so for it the
split is in tokens. Responses also carry the serving backend where a router says it (Tandem's
`X-Tandem-Backend`; the fleet names each Tandem engine's backend `eI`, so that header names the
engine even through sglang-router): that is `requests.csv`'s `backend` column.

Output (`--out`): summary.json, requests.csv, decisions.jsonl (Tandem's router's decisions
with their reasons, read from its /v1/routing after each run), results.md (makespan, output tok/s, TTFT p50/p95,
E2E p50, failures, requests and computed prompt tokens per engine, and the ratios: Tandem
cache-aware vs round-robin, vs sglang-router, throughput vs one engine), plots drawn in a child
process (`bench.report`), and each engine's and router's log under logs/.

Threads: everything runs on the calling thread, except the `--kill-one-at` timer, which only
kills a process.
"""

from __future__ import annotations

import importlib.util
import json
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path
from typing import BinaryIO

from engine.core.errors import EngineError, InvalidRequest
from engine.sim.benchmark import RequestRecord, oracle
from engine.sim.workload import OUTPUT_MODES, WorkloadSpec, build_workload

from . import report as bench_report
from .progress import Progress

DEFAULT_VARIANTS = "tandem:cache-aware,sglang:cache_aware,tandem:round-robin,sglang:round_robin,single"
LLAMA_FLAGS = "-ngl 99 -kvu -c 65536 -np 32 --threads-http 32 -fa auto"
SGLANG_POLICIES = ("random", "round_robin", "cache_aware", "power_of_two")
# A child that builds sglang-router's RouterArgs from JSON and runs the Rust router in the foreground.
SGLANG_CHILD = ("import json, sys\n"
                "from sglang_router.router_args import RouterArgs\n"
                "from sglang_router.router import Router\n"
                "Router.from_args(RouterArgs(**json.loads(sys.argv[1]))).start()\n")
LOG_TAIL_LINES = 15


class EngineStartError(EngineError):
    """An engine or router of the fleet exited or never became healthy."""


class RouterStartError(EngineStartError):
    """A router (or the in-process run) did not come up: its variant is skipped, with a note."""


# ---- arguments ----


HELP = "engines behind routers (Tandem, sglang-router), tenant workload"


def add_arguments(p) -> None:
    from .study import add_tenant_arguments

    p.add_argument("--model", default="synthetic:qwen2.5-0.5b:q8_0",
                   help="model every engine serves (default: %(default)s)")
    p.add_argument("--engines", default="tandem", choices=["tandem", "llama-server"],
                   help="engine preset (default: %(default)s); --engine-cmd replaces it")
    p.add_argument("--gpus", default=None, help="GPU indices, one engine each with CUDA_VISIBLE_DEVICES=i (e.g. 0,1)")
    p.add_argument("--count", type=int, default=2, help="engines without --gpus (CPU engines) (default: %(default)s)")
    p.add_argument("--engine-backend", default=None,
                   help="the tandem preset's --backend spec, without name= (default: gpu with --gpus, "
                        "else cpu:threads=1,cap=4)")
    p.add_argument("--llama-server", default="llama-server", help="llama-server binary (default: on PATH)")
    p.add_argument("--llama-flags", default=LLAMA_FLAGS, help="llama-server flags (default: %(default)s)")
    p.add_argument("--engine-cmd", action="append", default=[], metavar="CMD",
                   help="a custom engine command line with {port} (repeatable; replaces the preset)")
    p.add_argument("--variants", default=DEFAULT_VARIANTS,
                   help="comma-separated, run in this order: tandem:POLICY, sglang:POLICY, single, "
                        "in-process:POLICY (default: %(default)s)")
    p.add_argument("--inprocess-backend", action="append", default=[], metavar="SPEC",
                   help="backend specs of the in-process engine for in-process:POLICY variants (repeatable)")
    add_tenant_arguments(p, tenants="8")
    p.add_argument("--requests", type=int, default=300, help="requests per run (default: %(default)s)")
    p.add_argument("--rate", type=float, default=60.0, help="Poisson arrivals per second (default: %(default)s)")
    p.add_argument("--min-output", type=int, default=32)
    p.add_argument("--max-output", type=int, default=256)
    p.add_argument("--output", default="uniform", choices=OUTPUT_MODES, help="output lengths (default: %(default)s)")
    p.add_argument("--runs", type=int, default=1, help="runs per variant and K (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fresh", default="restart", choices=["restart", "none"],
                   help="restart the engines before every run (default) or keep them (warm caches)")
    p.add_argument("--kill-one-at", type=float, default=None, metavar="S",
                   help="kill the last engine S seconds into every router run")
    p.add_argument("--base-port", type=int, default=0,
                   help="engines get BASE+i, routers BASE+100+j (default: free ports the system picks)")
    p.add_argument("--start-timeout", type=float, default=300.0, help="seconds an engine or router may take to get healthy")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds one request may take")
    p.add_argument("--out", default=None, help="output directory (default: out/bench-fleet-TIME)")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")


# ---- processes ----


@dataclass
class Proc:
    """One child server: its command line, environment additions, port and log."""

    name: str
    cmd: list[str]
    port: int
    log: Path
    env: dict = field(default_factory=dict)
    popen: subprocess.Popen | None = None
    _log_file: BinaryIO | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        self._log_file = self.log.open("ab")
        self._log_file.write(f"\n==== {datetime.now():%H:%M:%S} {shlex.join(self.cmd)}\n".encode())
        self._log_file.flush()
        from engine.llama import child_env  # llama-server and sglang-router on their own OpenMP defaults

        try:
            self.popen = subprocess.Popen(self.cmd, stdout=self._log_file, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, env=child_env(**self.env),
                                          start_new_session=True)
        except OSError as e:
            self._close_log()
            raise EngineStartError(f"{self.name}: cannot run {shlex.join(self.cmd)}: {e}") from None

    def wait_healthy(self, timeout: float) -> None:
        """Poll GET /health until 200; raise EngineStartError (command and log tail) otherwise."""
        deadline = time.monotonic() + timeout
        last = "no answer"
        while time.monotonic() < deadline:
            if self.popen is None or self.popen.poll() is not None:
                code = None if self.popen is None else self.popen.returncode
                raise EngineStartError(self._failure(f"exited with code {code}"))
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                    if r.status == 200:
                        return
                    last = f"HTTP {r.status}"
            except urllib.error.HTTPError as e:
                last = f"HTTP {e.code}"
            except (urllib.error.URLError, OSError) as e:
                last = str(e)
            time.sleep(0.2)
        self.stop()
        raise EngineStartError(self._failure(f"not healthy after {timeout:g} s ({last})"))

    def kill(self) -> None:
        """SIGKILL, as a crash would."""
        if self.popen is not None and self.popen.poll() is None:
            self.popen.kill()

    def stop(self, grace: float = 10.0) -> None:
        if self.popen is not None and self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(grace)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(grace)
        self.popen = None
        self._close_log()

    def _close_log(self) -> None:
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def _failure(self, what: str) -> str:
        if self._log_file is not None:
            self._log_file.flush()
        try:
            tail = self.log.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:]
        except OSError:
            tail = []
        return (f"{self.name} {what}: {shlex.join(self.cmd)}\n  log {self.log}, last lines:\n"
                + "\n".join(f"    {line}" for line in tail))


def engine_procs(args, log_dir: Path) -> list[Proc]:
    """The engines' command lines from the preset (or --engine-cmd)."""
    py = sys.executable
    out = []
    if args.engine_cmd:
        for i, text in enumerate(args.engine_cmd):
            port = args.base_port + i if args.base_port else free_port()
            if "{port}" not in text:
                raise InvalidRequest(f"--engine-cmd {text!r} must contain {{port}}")
            out.append(Proc(f"e{i}", shlex.split(text.replace("{port}", str(port))), port, log_dir / f"e{i}.log"))
        return out
    gpus = [g.strip() for g in args.gpus.split(",") if g.strip()] if args.gpus else []
    n = len(gpus) or args.count
    if n < 1:
        raise InvalidRequest("the fleet needs at least one engine (--gpus or --count)")
    for i in range(n):
        port = args.base_port + i if args.base_port else free_port()
        env = {"CUDA_VISIBLE_DEVICES": gpus[i]} if gpus else {}
        if args.engines == "llama-server":
            from engine.llama.model import resolve_model

            binary = shutil.which(args.llama_server) or args.llama_server
            cmd = [binary, "-m", str(resolve_model(args.model)), "--host", "127.0.0.1", "--port", str(port),
                   "--metrics", *shlex.split(args.llama_flags)]
        else:
            spec = args.engine_backend or ("gpu" if gpus else "cpu:threads=1,cap=4")
            spec += ("," if ":" in spec else ":") + f"name=e{i}"
            cmd = [py, "-m", "app", "serve", "--model", args.model, "--backend", spec, "--port", str(port)]
        out.append(Proc(f"e{i}", cmd, port, log_dir / f"e{i}.log", env))
    return out


def router_proc(variant: str, engines: list[Proc], port: int, log_dir: Path, timeout: float) -> Proc:
    kind, _, policy = variant.partition(":")
    name = variant.replace(":", "-")
    if kind == "tandem":
        cmd = [sys.executable, "-m", "app", "serve", "--policy", policy, "--port", str(port)]
        for e in engines:
            cmd += ["--backend", f"remote:url={e.url},name={e.name}"]
        return Proc(name, cmd, port, log_dir / f"{name}.log")
    router_args = {"worker_urls": [e.url for e in engines], "host": "127.0.0.1", "port": port, "policy": policy,
                   "log_level": "warn", "request_timeout_secs": int(timeout),
                   "worker_startup_timeout_secs": 60, "worker_startup_check_interval": 1}
    return Proc(name, [sys.executable, "-c", SGLANG_CHILD, json.dumps(router_args)], port, log_dir / f"{name}.log")


def free_port() -> int:
    """A TCP port on the loopback that nothing listens on now (the child binds it moments later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- engine counters ----


def scrape(url: str) -> dict | None:
    """An engine's request and token counters from its /metrics (None if it does not answer)."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        with urllib.request.urlopen(f"{url}/metrics", timeout=5) as r:
            text = r.read().decode("utf-8", errors="replace")
    except (urllib.error.URLError, OSError):
        return None
    sums: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            sums[s.name] = sums.get(s.name, 0.0) + s.value
    if "tandem:generation_tokens_total" in sums:
        return {"requests": sums.get("tandem:request_success_total", 0.0),
                "output_tokens": sums["tandem:generation_tokens_total"],
                "prompt_tokens_computed": sums.get("tandem:prompt_tokens_total", 0.0)
                - sums.get("tandem:prompt_tokens_cached_total", 0.0)}
    if "llamacpp:tokens_predicted_total" in sums:
        return {"requests": None, "output_tokens": sums["llamacpp:tokens_predicted_total"],
                "prompt_tokens_computed": sums.get("llamacpp:prompt_tokens_total", 0.0)}
    return {"requests": None, "output_tokens": None, "prompt_tokens_computed": None}


def counter_deltas(before: dict, after: dict) -> dict:
    """Per engine: after - before of each counter; None where either side is unknown (a killed
    engine answers nothing after)."""
    out = {}
    for name in before:
        b, a = before[name], after.get(name)
        out[name] = {k: (None if b is None or a is None or b.get(k) is None or a.get(k) is None else a[k] - b[k])
                     for k in ("requests", "output_tokens", "prompt_tokens_computed")}
    return out


# ---- the fleet ----


class Fleet:
    def __init__(self, args, out_dir: Path):
        self.args = args
        self.out_dir = out_dir
        self.log_dir = out_dir / "logs"
        self.engines = engine_procs(args, self.log_dir)
        self.variants = parse_variants(args.variants, args)
        self.tenants = _ints(args.tenants, "--tenants")
        self.records: list[RequestRecord] = []
        self.decisions: list[dict] = []  # Tandem's router's, from its /v1/routing after each run
        self.meta: dict[tuple[str, str], dict] = {}
        self.notes: list[str] = []
        self.model_id: str | None = None
        self.router_port = args.base_port + 100

    def specs(self) -> list[WorkloadSpec]:
        a = self.args
        try:
            return [WorkloadSpec(n_requests=a.requests, prompt_tokens=a.tenant_prefix_tokens + a.tenant_suffix_tokens,
                                 shared_tokens=a.tenant_prefix_tokens, output=a.output, gen_tokens=a.max_output,
                                 min_output=a.min_output, max_output=a.max_output, arrival="poisson", rate=a.rate,
                                 tenants=k, tenant_skew=a.tenant_skew, seed=a.seed).validate() for k in self.tenants]
        except ValueError as e:
            raise InvalidRequest(str(e)) from None

    # ---- engines ----

    def start_engines(self) -> None:
        for e in self.engines:
            e.start()
        for e in self.engines:
            e.wait_healthy(self.args.start_timeout)
        if self.model_id is None:
            self.model_id = _model_id(self.engines[0].url)

    def stop_engines(self) -> None:
        for e in self.engines:
            e.stop()

    def fresh_engines(self) -> None:
        if self.args.fresh == "restart" or any(e.popen is None or e.popen.poll() is not None for e in self.engines):
            self.stop_engines()
            self.start_engines()

    # ---- runs ----

    def run(self, bar: Progress, checkpoint) -> None:
        specs = self.specs()
        steps = [(spec, run, v) for spec in specs for run in range(self.args.runs) for v in self.variants]
        bar.add_total(len(steps) * self.args.requests)
        inprocess_done: set[str] = set()
        try:
            for i, (spec, run, variant) in enumerate(steps, 1):
                head = f"fleet [{i}/{len(steps)}] K={spec.tenants} run {run + 1}/{self.args.runs} {variant}"
                print(head, file=sys.stderr, flush=True)
                if variant.startswith("in-process:"):
                    if spec.name() in inprocess_done:  # one child grid did every in-process variant and run
                        continue
                    inprocess_done.add(spec.name())
                    try:
                        got = self._inprocess(spec)
                    except RouterStartError as e:
                        self._skip(variant, spec, e)
                        continue
                    bar.update(len(got))  # as many as all in-process steps of this workload
                else:
                    try:
                        got = self._through(spec, run, variant, bar)
                    except (RouterStartError, ConnectionError) as e:
                        # A router that does not come up costs its own rows, not the invocation's
                        # (an engine that does not is an EngineStartError: nothing else could run).
                        self._skip(variant, spec, e)
                        continue
                self.records.extend(got)
                failed = sum(not r.success for r in got)
                print(f"{head}: {len(got) - failed} ok, {failed} failed", file=sys.stderr, flush=True)
                checkpoint()
        finally:
            self.stop_engines()

    def _skip(self, variant: str, spec: WorkloadSpec, error: Exception) -> None:
        line = f"{variant} skipped for {spec.name()}: {error}"
        print(f"fleet: {line}", file=sys.stderr, flush=True)
        self.notes.append(line)

    def _through(self, spec: WorkloadSpec, run: int, variant: str, bar: Progress) -> list[RequestRecord]:
        """One run of the workload through a router (or engine e0 alone)."""
        import asyncio

        from .target import Target, probe, routing_decisions, run_target

        self.fresh_engines()
        router = None
        if variant == "single":
            url = self.engines[0].url
        else:
            port = self.router_port if self.args.base_port else free_port()
            self.router_port += 1  # a fresh port per router: no TIME_WAIT clash with the last one
            router = router_proc(variant, self.engines, port, self.log_dir, self.args.timeout)
            try:
                router.start()
                router.wait_healthy(self.args.start_timeout)
            except EngineStartError as e:
                router.stop()
                raise RouterStartError(str(e)) from None
            url = router.url
        killer = None
        try:
            # sglang-router passes the body's model on and lists "unknown" in /v1/models when it has
            # no tokenizer: send the engines' own model id; Tandem's router says what it serves.
            probed = asyncio.run(probe(url, "openai", variant, prompt="text"))
            model = (probed.model or self.model_id) if variant.startswith("tandem:") else self.model_id
            target = Target(url=url, label=variant, api="openai", model=model, prompt="text")
            wl = build_workload(spec, run)
            before = {e.name: scrape(e.url) for e in self.engines}
            victim = self.engines[-1]
            if self.args.kill_one_at is not None and router is not None:
                killer = threading.Timer(self.args.kill_one_at, victim.kill)
                killer.daemon = True
                killer.start()
            records = run_target(target, wl, run=run, timeout=self.args.timeout, on_done=lambda _r: bar.update(1),
                                 warm_tenants=self.args.warm_tenants)
            after = {e.name: scrape(e.url) for e in self.engines}
            if variant.startswith("tandem:"):
                self.decisions += [{"workload": spec.name(), "variant": variant, "run": run, **d}
                                   for d in routing_decisions(url, len(wl.requests))]
        finally:
            if killer is not None:
                killer.cancel()
            if router is not None:
                router.stop()
        m = self.meta.setdefault((spec.name(), variant), {"kind": variant.partition(":")[0], "engines_per_run": []})
        m["engines_per_run"].append(counter_deltas(before, after))
        if killer is not None:
            m["killed"] = {"engine": victim.name, "at_s": self.args.kill_one_at}
        return records

    def _inprocess(self, spec: WorkloadSpec) -> list[RequestRecord]:
        """The in-process engine's variants, in a child `bench grid`, with the fleet stopped."""
        a = self.args
        policies = [v.partition(":")[2] for v in self.variants if v.startswith("in-process:")]
        self.stop_engines()
        out = self.out_dir / "in-process" / f"k{spec.tenants}"
        cmd = [sys.executable, "-m", "app", "bench", "grid", "--model", a.model,
               *[x for b in a.inprocess_backend for x in ("--backend", b)],
               "--policies", ",".join(policies), "--requests", str(a.requests), "--runs", str(a.runs),
               "--tenants", str(spec.tenants), "--tenant-prefix-tokens", str(a.tenant_prefix_tokens),
               "--tenant-suffix-tokens", str(a.tenant_suffix_tokens), "--tenant-skew", a.tenant_skew,
               "--outputs", a.output, "--min-output", str(a.min_output), "--max-output", str(a.max_output),
               "--gen-tokens", str(a.max_output), "--arrivals", "poisson", "--rate", str(a.rate),
               "--seed", str(a.seed), "--caps", "none", "--warmup", "0", "--timeout", str(a.timeout),
               "--no-plots", "--out", str(out), *(["--warm-tenants"] if a.warm_tenants else [])]
        log = self.log_dir / f"in-process-k{spec.tenants}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("ab") as f:
            proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        csv_path = out / "requests.csv"
        if not csv_path.exists():
            tail = log.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:]
            raise RouterStartError(f"in-process bench exited with code {proc.returncode} and no results: "
                                   f"{shlex.join(cmd)}\n" + "\n".join(f"    {line}" for line in tail))
        records = []
        for r in bench_report.read_records(csv_path):
            label = f"in-process:{r.policy}"
            records.append(replace(r, policy=label))
            self.meta.setdefault((r.workload, label), {"kind": "in-process", "engines_per_run": []})
        return records

    # ---- results ----

    def summary(self) -> dict:
        from .study import summarize

        rows = summarize(self.records, self.meta)
        for row in rows:
            per_run = row.pop("engines_per_run", None) or []
            if not per_run:  # in-process: its backends are the engines; the records say what each did
                per_run = _record_counters([r for r in self.records
                                            if (r.workload, r.policy) == (row["workload"], row["policy"])])
            row["engines"] = _mean_counters(per_run)
            row["engines_per_run"] = per_run
        return {
            "tool": "tandem bench fleet",
            "argv": list(sys.argv),
            "created": datetime.now().astimezone().isoformat(timespec="seconds"),
            "model": {"spec": self.args.model, "served_as": self.model_id},
            "engines": [{"name": e.name, "url": e.url, "cmd": shlex.join(e.cmd), "env": e.env} for e in self.engines],
            "variants": self.variants,
            "workloads": [s.to_dict() for s in self.specs()],
            "requests": [self.args.requests],
            "runs": self.args.runs,
            "policies": list(dict.fromkeys(r["policy"] for r in rows)),
            "engine_state": ("engines restarted before every run (cold caches), each router started anew"
                             if self.args.fresh == "restart" else "engines kept running across runs (warm caches)"),
            "engines_counted_from": "each engine's /metrics counters, before and after each run (deltas)",
            "kill_one_at_s": self.args.kill_one_at,
            "notes": self.notes,
            "results": rows,
            "oracle": oracle(rows, group=("workload", "requests"), single={"single"}),
            "ratios": ratios(rows),
        }


def parse_variants(text: str, args) -> list[str]:
    """Check every variant now, with the reason, instead of failing mid-invocation."""
    from engine.routing import make_policy

    out = []
    for v in (x.strip() for x in text.split(",")):
        if not v:
            continue
        kind, _colon, policy = v.partition(":")
        if v == "single":
            pass
        elif kind == "tandem" and policy:
            if not remote_backend_available():
                raise InvalidRequest(f"variant {v}: Tandem's router needs the remote: backend (engine/backends/remote/), "
                                     f"which this build lacks")
            _policy(make_policy, policy, v)
        elif kind == "sglang" and policy:
            if importlib.util.find_spec("sglang_router") is None:
                raise InvalidRequest(f"variant {v}: sglang-router is not installed (pip install sglang-router==0.3.2, "
                                     f"or its unpacked wheel on PYTHONPATH)")
            if policy not in SGLANG_POLICIES:
                raise InvalidRequest(f"variant {v}: sglang-router policy must be one of {', '.join(SGLANG_POLICIES)}")
        elif kind == "in-process" and policy:
            if not args.inprocess_backend:
                raise InvalidRequest(f"variant {v} needs --inprocess-backend specs (e.g. gpu:device=0)")
            _policy(make_policy, policy, v)
        else:
            raise InvalidRequest(f"variant {v!r}: expected tandem:POLICY, sglang:POLICY, single or in-process:POLICY")
        out.append(v)
    if not out:
        raise InvalidRequest("--variants names nothing to run")
    if len(set(out)) != len(out):
        raise InvalidRequest(f"--variants repeats a variant: {text}")
    return out


def remote_backend_available() -> bool:
    """Whether this tree's engine has the remote: backend (engine/backends/remote/ under
    engine/__init__.py's folder; an editable install of another checkout can make
    `engine.backends.remote` importable from there)."""
    import engine

    try:
        spec = importlib.util.find_spec("engine.backends.remote")
    except ModuleNotFoundError:
        return False
    return spec is not None and spec.origin is not None and \
        Path(spec.origin).parent.parent.parent == Path(engine.__file__).parent


def ratios(rows: list[dict]) -> list[dict]:
    """The comparisons the router work is judged by, per workload, where both rows exist:
    `value` = a / b of the metric's means (lower is better for times, higher for throughput)."""
    pairs = [("tandem:cache-aware", "tandem:round-robin", "makespan_s"),
             ("tandem:cache-aware", "tandem:round-robin", "ttft_p50_s"),
             ("tandem:cache-aware", "sglang:cache_aware", "makespan_s"),
             ("tandem:cache-aware", "sglang:cache_aware", "ttft_p50_s"),
             ("sglang:cache_aware", "sglang:round_robin", "makespan_s"),
             ("sglang:cache_aware", "sglang:round_robin", "ttft_p50_s"),
             ("in-process:cache-aware", "in-process:round-robin", "makespan_s"),
             ("in-process:cache-aware", "in-process:round-robin", "ttft_p50_s")]
    out = []
    by_workload: dict[str, dict[str, dict]] = {}
    for r in rows:
        by_workload.setdefault(r["workload"], {})[r["policy"]] = r
    for workload, rs in by_workload.items():
        for a, b, metric in pairs:
            out += _ratio(workload, rs, a, b, metric)
        if "single" in rs:
            for name in rs:
                if name != "single":
                    out += _ratio(workload, rs, name, "single", "output_tok_s")
    return out


def _ratio(workload, rs, a, b, metric) -> list[dict]:
    if a not in rs or b not in rs:
        return []
    va, vb = rs[a][metric]["mean"], rs[b][metric]["mean"]
    value = va / vb if va is not None and vb else None
    return [{"workload": workload, "a": a, "b": b, "metric": metric, "value": value,
             "failed": {a: rs[a]["failed"], b: rs[b]["failed"]}}]


def _record_counters(records: list[RequestRecord]) -> list[dict]:
    """Per run, per backend: requests, output tokens and computed (uncached) prompt tokens,
    from the engine's own finish records (the in-process rows)."""
    runs: dict[int, dict[str, dict]] = {}
    for r in records:
        c = runs.setdefault(r.run, {}).setdefault(r.backend or "?", {"requests": 0, "output_tokens": 0,
                                                                      "prompt_tokens_computed": 0})
        c["requests"] += 1
        c["output_tokens"] += r.output_tokens
        c["prompt_tokens_computed"] += r.prompt_tokens - max(r.cached_tokens, 0)
    return [runs[k] for k in sorted(runs)]


def _mean_counters(per_run: list[dict]) -> dict:
    out: dict[str, dict] = {}
    for run in per_run:
        for engine, counters in run.items():
            for k, v in counters.items():
                out.setdefault(engine, {}).setdefault(k, []).append(v)
    return {e: {k: (None if any(x is None for x in vs) else sum(vs) / len(vs)) for k, vs in c.items()}
            for e, c in out.items()}


def _policy(make_policy, policy: str, variant: str) -> None:
    try:
        make_policy(policy)
    except EngineError as e:
        raise InvalidRequest(f"variant {variant}: {e}") from None


def _model_id(url: str) -> str | None:
    try:
        with urllib.request.urlopen(f"{url}/v1/models", timeout=5) as r:
            data = json.loads(r.read()).get("data") or []
    except (urllib.error.URLError, OSError, ValueError):
        return None
    return data[0].get("id") if data else None


def _ints(text, flag: str) -> list[int]:
    try:
        values = [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise InvalidRequest(f"{flag} must list integers >= 1, got {text!r}")
    return values


# ---- command ----


def run_fleet(args) -> int:
    if args.runs < 1 or args.requests < 1:
        raise InvalidRequest("--runs and --requests must be >= 1")
    if args.kill_one_at is not None and args.kill_one_at < 0:
        raise InvalidRequest("--kill-one-at must be >= 0 seconds")
    out_dir = Path(args.out or f"out/bench-fleet-{datetime.now():%Y%m%d-%H%M%S}")
    fleet = Fleet(args, out_dir)
    fleet.specs()  # bad workload fields fail before anything starts
    if args.kill_one_at is not None and len(fleet.engines) < 2:
        raise InvalidRequest("--kill-one-at needs at least two engines")
    if args.kill_one_at is not None:
        fleet.notes.append(f"{fleet.engines[-1].name} is killed (SIGKILL) {args.kill_one_at:g} s into every "
                           f"router run; 'single' and in-process runs are not affected")

    def save(plots: bool = False) -> list:
        return bench_report.write_all(out_dir, fleet.summary(), fleet.records, fleet.decisions, plots=plots)

    def on_term(signum, frame):  # a wall-clock limit's SIGTERM: stop the engines, keep the results
        raise KeyboardInterrupt

    interrupted = False
    previous = signal.signal(signal.SIGTERM, on_term) if threading.current_thread() is threading.main_thread() else None
    with Progress(0, "bench fleet") as bar:
        try:
            fleet.run(bar, checkpoint=save)
        except KeyboardInterrupt:
            interrupted = True
            fleet.notes.append("INTERRUPTED: the results below are partial")
        finally:
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)
    if not fleet.records:
        return 130 if interrupted else 1
    written = save(plots=not args.no_plots)
    print(bench_report.markdown(json.loads((out_dir / "summary.json").read_text())))
    print(f"wrote {', '.join(str(p) for p in written)}", file=sys.stderr)
    if interrupted:
        return 130
    failed = sum(not r.success for r in fleet.records)
    return 0 if failed == 0 or args.kill_one_at is not None else 1

