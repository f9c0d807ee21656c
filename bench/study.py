"""`tandem bench seed` and `tandem bench grid`: the study's experiment, its missing baselines,
and HTTP peers, side by side in one invocation.

One *variant* is one row of the results: a routing policy on the engine (optionally with the
swept backend's cap changed, `gpu-only@cap=8`) or an HTTP peer (`target:llama-server`).
Variants run interleaved, run by run (run 1 of every variant and N, then run 2, ...), so
drift hits all alike, and each run starts one variant further on (`run_order`), so no variant
always runs first, or always right after the same one.

Fresh state per run, without reloading the model (the runner is `engine.experiment`'s
`EngineRunner`, which the desktop app's experiments use too): the engine stays loaded (per KV
budget) and each run first flushes every backend's prefix cache (freeing its KV), re-warms the workload's
shared prefix on every backend, clears the router's history and policy state (round-robin's
turn, `new_token_ratio`), restores caps and rates; timing starts at the first submission.

Tenant workloads (`--tenants K`, see `engine.sim.workload`): nothing is warmed — a router must
learn where each tenant's prefix lives — unless `--warm-tenants` warms every tenant's prefix
on every backend (engine) or sends each once through the target. The engine runs the text
prompts tokenized by its model (`engine.sim.workload.tokenized`), the same text peers get with
`--target-prompt text`.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from dataclasses import replace
from datetime import datetime
from pathlib import Path

from engine import llama
from engine.backends.config import BackendConfig, default_specs, parse_backend_specs
from engine.backends.registry import BackendSpec
from engine.core.errors import BackendUnavailable, EngineError, InvalidRequest
from engine.core.snapshot import Rates
from engine.engine import Engine
from engine.experiment import Collected, EngineRunner, Variant
from engine.rates.measure import calibrate_at_load
from engine.rates.store import parse_rates
from engine.routing import RouteQuery, Router, make_policy
from engine.sim.benchmark import RequestRecord, aggregate, oracle, run_metrics, run_order
from engine.sim.workload import (
    ARRIVAL_MODES,
    OUTPUT_MODES,
    SEED_GEN_TOKENS,
    SEED_PREFIX_TOKENS,
    SEED_SUFFIX_TOKENS,
    TOKEN_HIGH,
    Workload,
    WorkloadSpec,
    build_workload,
    seed_workload,
    shared_tokens_for,
    tokenized,
    with_requests,
)

from . import report as bench_report
from .progress import Progress

FRESH_STATE = ("the engine is loaded once{per_kv} and kept across runs; each run starts from a fresh "
               "engine state: every backend's prefix cache flushed (KV freed), the shared prefix "
               "re-warmed on every backend, router history and policy state cleared, caps and rates "
               "restored; timing starts at the first submission")
WARMUP_MAX_N = 8  # warm-up runs pay first-use costs (allocations, kernels); they need not be long


# ---- arguments ----


def add_common_arguments(p, *, requests: str, runs: int) -> None:
    p.add_argument("--model", default="default", help="default | PATH.gguf | synthetic:SHAPE[:QUANT]")
    p.add_argument("--backend", action="append", default=None, metavar="SPEC",
                   help="DEVICE[:cap=N,threads=N,ctx=N,name=X] (repeatable; default: GPU+CPU, or two CPU backends)")
    p.add_argument("--policies", default=None,
                   help="comma-separated routing policies, run interleaved; 'none' for targets only "
                        "(default: default,seed-score,predicted-finish and the first GPU backend alone)")
    p.add_argument("--requests", default=requests, help="request counts N (default: %(default)s)")
    p.add_argument("--runs", type=int, default=runs, help="runs per configuration (default: %(default)s)")
    p.add_argument("--interval-ms", type=float, default=50.0, help="fixed arrival interval (default: %(default)s)")
    p.add_argument("--gen-tokens", type=int, default=SEED_GEN_TOKENS, help="fixed output length (default: %(default)s)")
    p.add_argument("--identical-prompts", action="store_true",
                   help="send the very same prompt every time, as the study did (default: a prefix "
                        "shared by all plus a suffix of each request's own)")
    p.add_argument("--budget", default="raw", choices=["raw", "ratio"], help="router decode budget mode")
    p.add_argument("--rates", action="append", default=[], metavar="NAME:prefill=R,decode=R[,alpha=S,beta=S]",
                   help="override a backend's rates (tokens/s; step seconds); repeatable")
    p.add_argument("--online-rates", action="store_true",
                   help="refresh rates from observed steps during each run (reset at each run's start)")
    p.add_argument("--target", action="append", default=[], metavar="[LABEL=]URL",
                   help="also run the workload against this OpenAI-compatible server (repeatable)")
    p.add_argument("--target-api", default="auto", choices=["auto", "completion", "openai"],
                   help="llama-server's /completion or /v1/completions (default: probe)")
    p.add_argument("--target-warm", type=int, default=1,
                   help="concurrent prefix-warming requests per target run, e.g. its slot count")
    p.add_argument("--target-prompt", default="auto", choices=["auto", "tokens", "text"],
                   help="send targets the prompts as token ids or as text (routers such as sglang-router "
                        "match text only); auto: text for --tenants workloads, else tokens (default: %(default)s)")
    p.add_argument("--target-model", default=None,
                   help="the model name sent to targets (default: the first of their /v1/models; a router "
                        "that lists none of its engines' models, e.g. sglang-router's 'unknown', needs it)")
    p.add_argument("--warmup", type=int, default=1,
                   help="unrecorded runs of every variant before timing, at the smallest N (at most "
                        f"{WARMUP_MAX_N}) (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="workload seed (default: %(default)s)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take")
    p.add_argument("--out", default=None, help="output directory (default: out/bench-KIND-TIME)")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")


SEED_HELP = "the seed study's experiment, several policies interleaved"
GRID_HELP = "the study's missing baselines: caps, prefix share, outputs, arrivals, KV"


def add_seed_arguments(p) -> None:
    add_common_arguments(p, requests="4,8,48", runs=3)
    p.add_argument("--prefix-tokens", type=int, default=SEED_PREFIX_TOKENS, help="shared prefix (default: %(default)s)")
    p.add_argument("--suffix-tokens", type=int, default=SEED_SUFFIX_TOKENS,
                   help="prompt tokens after the prefix (default: %(default)s)")


def add_grid_arguments(p) -> None:
    add_common_arguments(p, requests="48", runs=3)
    p.add_argument("--prompt-tokens", type=int, default=SEED_PREFIX_TOKENS + SEED_SUFFIX_TOKENS,
                   help="prompt length (default: %(default)s)")
    p.add_argument("--shared", default="0,50,96", help="shared-prefix percentages of the prompt (default: %(default)s)")
    p.add_argument("--outputs", default="fixed,uniform", help=f"output lengths: {', '.join(OUTPUT_MODES)}")
    p.add_argument("--min-output", type=int, default=16)
    p.add_argument("--max-output", type=int, default=256, help="uniform output's upper bound and budget")
    p.add_argument("--arrivals", default="interval,poisson", help=f"arrival processes: {', '.join(ARRIVAL_MODES)}")
    p.add_argument("--rate", type=float, default=0.0, help="poisson/gamma requests/s (default: 1000/interval-ms)")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape (1 = Poisson)")
    p.add_argument("--caps", default="1,2,4,8,16,32,64",
                   help="caps of the swept backend for the --sweep-policies, fixed; 'auto' for its adaptive "
                        "cap (default: %(default)s; 'none' to skip)")
    p.add_argument("--sweep-policies", default=None,
                   help="policies run at every --caps value; 'only:swept' is the swept backend alone "
                        "(default: the first GPU backend alone)")
    p.add_argument("--sweep-backend", default=None, help="backend whose cap and KV budget vary (default: first GPU, else first)")
    p.add_argument("--kv-seqs", default=None,
                   help="KV budgets of the swept backend: room for K whole sequences of the workload "
                        "(e.g. 4,8,16,64; default: unconstrained)")
    add_tenant_arguments(p)


def add_tenant_arguments(p, *, tenants: str | None = None) -> None:
    p.add_argument("--tenants", default=tenants,
                   help="K[,K...]: K tenants, each with a shared prefix of its own (replaces --shared)")
    p.add_argument("--tenant-prefix-tokens", type=int, default=1500, help="each tenant's prefix (default: %(default)s)")
    p.add_argument("--tenant-suffix-tokens", type=int, default=50,
                   help="each request's own tokens after its tenant's prefix (default: %(default)s)")
    p.add_argument("--tenant-skew", default="zipf", help="tenant popularity: uniform | zipf | zipf:S (default: %(default)s)")
    p.add_argument("--warm-tenants", action="store_true",
                   help="warm every tenant's prefix before each run (default: nothing; routers must learn)")


# ---- commands ----


def run_seed(args, bench: type[Bench] | None = None) -> int:
    n_list = _int_list(args.requests, "--requests")
    spec = seed_workload(1, prefix_tokens=args.prefix_tokens, suffix_tokens=args.suffix_tokens,
                         gen_tokens=args.gen_tokens, interval_s=args.interval_ms / 1e3,
                         identical=args.identical_prompts, seed=args.seed)
    return _bench(args, "seed", [spec], n_list, caps=[], kv_seqs=[None], bench=bench)


def run_grid(args, bench: type[Bench] | None = None) -> int:
    n_list = _int_list(args.requests, "--requests")
    shared = _int_list(args.shared, "--shared", low=0)
    if max(shared) > 100:
        raise InvalidRequest(f"--shared takes percentages in [0, 100], got {args.shared!r}")
    outputs = _choices(args.outputs, OUTPUT_MODES, "--outputs")
    arrivals = _choices(args.arrivals, ARRIVAL_MODES, "--arrivals")
    specs = []
    tenants = _int_list(args.tenants, "--tenants") if args.tenants else []
    shapes = ([(args.tenant_prefix_tokens + args.tenant_suffix_tokens, args.tenant_prefix_tokens, k) for k in tenants]
              or [(args.prompt_tokens, shared_tokens_for(pct / 100, args.prompt_tokens), 0) for pct in shared])
    for prompt_tokens, shared_tokens, k in shapes:
        for output in outputs:
            for arrival in arrivals:
                try:
                    specs.append(WorkloadSpec(
                        n_requests=1, prompt_tokens=prompt_tokens, shared_tokens=shared_tokens, output=output,
                        gen_tokens=args.gen_tokens, min_output=args.min_output, max_output=args.max_output,
                        arrival=arrival, interval_s=args.interval_ms / 1e3, rate=args.rate,
                        burstiness=args.burstiness, identical=args.identical_prompts, seed=args.seed,
                        tenants=k, tenant_skew=args.tenant_skew).validate())
                except ValueError as e:
                    raise InvalidRequest(str(e)) from None
    caps = [] if args.caps.strip().lower() == "none" else _cap_list(args.caps)
    kv = [None] if not args.kv_seqs else _int_list(args.kv_seqs, "--kv-seqs")
    return _bench(args, "grid", specs, n_list, caps=caps, kv_seqs=kv, bench=bench)


def _bench(args, kind: str, specs: list[WorkloadSpec], n_list: list[int], *, caps: list[int],
           kv_seqs: list, bench: type[Bench] | None = None) -> int:
    """Run (`Bench`, or a class that runs the same loops another way: `bench.simulate.SimBench`),
    then write the results."""
    if args.runs < 1 or args.warmup < 0:
        raise InvalidRequest("--runs must be >= 1 and --warmup >= 0")
    bench_class = bench or Bench
    runner = bench_class(args, kind, specs, n_list, caps=caps, kv_seqs=kv_seqs)
    prefix = "bench" if bench_class is Bench else "simulate"
    out_dir = Path(args.out or f"out/{prefix}-{kind}-{datetime.now():%Y%m%d-%H%M%S}")

    def save() -> list:
        return bench_report.write_all(out_dir, runner.summary(), runner.records, runner.decisions,
                                      plots=not args.no_plots)

    # Results are saved before each engine is closed too: measurements must outlive a crash there.
    runner.checkpoint = lambda: save() if runner.records else None
    interrupted = False
    with Progress(0, f"{prefix} {kind}") as bar:
        try:
            runner.run(bar)
        except KeyboardInterrupt:  # keep what was measured
            interrupted = True
            runner.notes.append("INTERRUPTED: the results below are partial")
    if not runner.records:
        return 130 if interrupted else 1
    summary = runner.summary()
    written = save()
    print(bench_report.markdown(summary))
    print(f"wrote {', '.join(str(p) for p in written)}", file=sys.stderr)
    if interrupted:
        return 130
    return 0 if all(r.success for r in runner.records) else 1


class Bench:
    """One invocation: every KV budget (an engine each) x run x workload x N x variant."""

    def __init__(self, args, kind: str, specs: list[WorkloadSpec], n_list: list[int], *,
                 caps: list[int], kv_seqs: list):
        self.args = args
        self.kind = kind
        self.specs = specs
        self.n_list = n_list
        self.caps = caps
        self.kv_seqs = kv_seqs
        self.overrides = dict(parse_rates(s) for s in args.rates)
        self.policies = _policy_list(args.policies)  # None: defaults, []: no engine
        self.targets = _probe_targets(args)
        if self.policies == [] and not self.targets:
            raise InvalidRequest("nothing to run: --policies none and no --target")
        self.records: list[RequestRecord] = []
        self.decisions: list[dict] = []
        self.meta: dict[tuple[str, str], dict] = {}  # (workload, label) -> row facts
        self.engines: list[dict] = []  # per KV budget: backends as configured
        self.loads: list[dict] = []  # per recorded run of a row: the host's 1-minute load average after it
        self.model_info = {"spec": args.model}
        self.notes: list[str] = []
        self.checkpoint: Callable[[], object] = lambda: None  # saves what was measured so far (set by the command)
        self.warmup_n = min(min(n_list), WARMUP_MAX_N)
        if args.warmup:
            self.notes.append(f"before timing, {args.warmup} unrecorded warm-up run(s) of every variant "
                              f"at N={self.warmup_n}")
        if any(s.output == "uniform" for s in specs):
            self.notes.append("variable output: engine requests carry max_tokens = the budget (routers and "
                              "KV reservations see only that) and stop early at their drawn length, unseen; "
                              "peers (--target) are sent max_tokens = the drawn length")

    def run(self, bar: Progress) -> None:
        for k, kv in enumerate(self.kv_seqs):
            eng = sweep = runner = None
            try:
                if self.policies != []:
                    eng, sweep, notes = _load_engine(self.args, self.specs, self.caps, kv, self.overrides)
                    self.notes.extend(n for n in notes if n not in self.notes)
                variants = _variants(eng, self.policies, self.caps, [] if k else self.targets, self.args, sweep)
                if eng is not None:
                    _check_policies(eng, [v for v in variants if v.policy], sweep)
                    self.engines.append({"kv_seqs": kv, "backends": bench_report.engine_info(eng, sweep)})
                    self.model_info = bench_report.model_info(self.args.model, eng)
                    runner = EngineRunner(eng, sweep_backend=sweep, budget=self.args.budget,
                                          online=self.args.online_rates, timeout=self.args.timeout,
                                          warm_tenants=getattr(self.args, "warm_tenants", False))
                per_variant = (self.args.runs * len(self.specs) * sum(self.n_list)
                               + self.args.warmup * self.warmup_n)
                bar.add_total(len(variants) * per_variant)
                vocab = (eng.n_vocab if eng is not None else 0) or self._vocab()  # remote engines may not say
                self._run_variants(variants, runner, kv, vocab, bar)
            finally:
                if runner is not None:
                    runner.close()
                if eng is not None:
                    if self.engines and self.engines[-1]["kv_seqs"] == kv:
                        self.engines[-1]["counters"] = _engine_counters(eng)
                    self.checkpoint()
                    eng.close()

    def _vocab(self) -> int:
        """The size of `--model`'s vocabulary with no engine loaded (peers alone), read without its
        weights: the prompts' token ids are drawn below it (and below TOKEN_HIGH), so a peer
        serving that model accepts them. TOKEN_HIGH where the model cannot be read."""
        from engine.backends.remote.keys import VocabOnly

        try:
            vocab = VocabOnly(self.args.model)
        except EngineError as e:
            self.notes.append(f"token ids drawn below {TOKEN_HIGH:,}: the vocabulary of {self.args.model} "
                              f"could not be read ({e})")
            return TOKEN_HIGH
        try:
            return vocab.n_vocab
        finally:
            vocab.close()

    def _run_variants(self, variants, runner, kv, vocab: int, bar: Progress) -> None:
        args = self.args
        for k in range(args.warmup):
            wl = build_workload(replace(with_requests(self.specs[0], self.warmup_n), vocab_size=vocab), -1 - k)
            for v in variants:
                self._one(wl, v, runner, kv, bar, keep=False)
        for run in range(args.runs):
            for spec in self.specs:
                for n in self.n_list:
                    wl = build_workload(replace(with_requests(spec, n), vocab_size=vocab,
                                                label=spec.name() + (f", kv {kv} seqs" if kv else "")), run)
                    for v in run_order(variants, run):
                        self._one(wl, v, runner, kv, bar)

    def _one(self, wl: Workload, v: Variant, runner, kv, bar: Progress, keep: bool = True) -> None:
        args = self.args
        bar.update(0, f"{v.label} N={len(wl.requests)} " + (f"run {wl.run + 1}/{args.runs}" if keep else "warm-up"))
        if v.target is not None:
            from .target import Target, routing_decisions, run_target

            if not isinstance(v.target, Target):
                raise TypeError(f"variant {v.label!r}: its target is a {type(v.target).__name__}, not a bench Target")
            try:
                got = Collected(run_target(v.target, wl, run=wl.run, warm_copies=args.target_warm,
                                           timeout=args.timeout, on_done=lambda _r: bar.update(1),
                                           warm_tenants=getattr(args, "warm_tenants", False)))
            except ConnectionError as e:  # a peer that refused its warm-up: a clear error, not a traceback
                raise BackendUnavailable(str(e)) from None
            if keep:  # a Tandem peer says where each request of the run went and why (others: nothing)
                got.decisions = [{"workload": wl.spec.name(), "run": wl.run, "requests": len(wl.requests),
                                  "label": v.label, "target": True, **d}
                                 for d in routing_decisions(v.target.url, len(got.records))]
        else:
            if wl.spec.tenants:  # the same text the peers get, tokenized by the engine's model
                model = runner.eng.model
                wl = tokenized(wl, lambda text, first: model.tokenize(text, add_special=first, parse_special=False))
            got = runner.run(wl, v, on_done=bar.update)
        if keep:
            self.records.extend(got.records)
            self.decisions.extend(got.decisions)
            self.meta[(wl.spec.name(), v.label)] = {"kv_seqs": kv, "cap": v.cap, "single": v.single,
                                                    "target": v.target is not None}
            if hasattr(os, "getloadavg"):  # what else ran on the host (`tandem simulate --replay` reads it)
                self.loads.append({"workload": wl.spec.name(), "policy": v.label, "requests": len(wl.requests),
                                   "run": wl.run, "load1": round(os.getloadavg()[0], 2)})

    def summary(self) -> dict:
        rows = summarize(self.records, self.meta)
        single = {label for (_, label), m in self.meta.items() if m["single"]}
        return {
            "tool": f"tandem bench {self.kind}",
            "argv": list(sys.argv),
            "created": datetime.now().astimezone().isoformat(timespec="seconds"),
            "model": self.model_info,
            "backends": self.engines[0]["backends"] if self.engines else [],
            "engines": self.engines,
            "targets": [t.to_dict() for t in self.targets],
            "workloads": [s.to_dict() for s in self.specs],
            "requests": self.n_list,
            "runs": self.args.runs,
            "policies": list(dict.fromkeys(label for _, label in self.meta)),
            "engine_state": FRESH_STATE.format(per_kv=" per KV budget" if self.kv_seqs != [None] else ""),
            "notes": self.notes,
            "results": rows,
            "oracle": oracle(rows, group=("workload", "requests"), single=single),
            "host": {"cpus": os.cpu_count(), "load_avg": self.loads},
        }


def summarize(records: list[RequestRecord], meta: dict | None = None) -> list[dict]:
    """Summary rows, one per (workload, policy, N), in first-seen order, metrics over runs."""
    groups: dict[tuple, dict[int, list[RequestRecord]]] = {}
    for r in records:
        groups.setdefault((r.workload, r.policy, r.requests), {}).setdefault(r.run, []).append(r)
    rows = []
    for (workload, policy, n), runs in groups.items():
        per_run = [run_metrics(recs) for _, recs in sorted(runs.items())]
        rows.append({"workload": workload, "policy": policy, "requests": n,
                     **(meta or {}).get((workload, policy), {}), **aggregate(per_run)})
    return rows


# ---- helpers ----


def _load_engine(args: argparse.Namespace, specs: list[WorkloadSpec], caps: list[int], kv: int | None,
                 overrides: dict[str, Rates]) -> tuple[Engine, str, list[str]]:
    """Load the engine for one KV budget; returns (engine, swept backend name, notes)."""
    notes: list[str] = []
    raw = args.backend or default_specs(gpu=llama.gpu_offload_supported())
    configs = parse_backend_specs(raw)
    sweep = args.sweep_backend if getattr(args, "sweep_backend", None) else _default_sweep(configs)
    if sweep not in {c.name for c in configs}:
        raise InvalidRequest(f"--sweep-backend {sweep!r} is not a backend ({', '.join(c.name for c in configs)})")
    explicit_ctx = {c.name for c, s in zip(configs, raw) if "ctx=" in s}
    per_seq = max(s.prompt_tokens + s.max_tokens for s in specs)
    new = [_sized_for_sweep(c, s, caps, kv, per_seq, c.name in explicit_ctx, notes) if c.name == sweep else c
           for c, s in zip(configs, raw)]
    unknown = set(overrides) - {c.name for c in new}
    if unknown:
        raise InvalidRequest(f"--rates names unknown backend(s) {', '.join(sorted(unknown))}")
    eng = Engine.load(args.model, new, rates=overrides)
    sweep = loaded_name(sweep, list(eng.backends))
    try:
        measured = _measure_placeholders(eng, args.model)
    except BaseException:
        eng.close()
        raise
    if measured:
        notes.append("rates measured at load (no stored calibration of this model and config on this machine): "
                     + ", ".join(f"{name} prefill {r.prefill_tok_s:,.0f} / decode {r.decode_tok_s:,.1f} tok/s"
                                 for name, r in measured.items()))
    if kv:
        notes.append(f"KV budget {kv}: {sweep}'s context asked for room for {kv} whole sequences of "
                     f"{per_seq} tokens ({kv * per_seq} cells; llama.cpp made {eng.info(sweep).n_ctx}); "
                     f"a shared prefix lets more run")
    return eng, sweep, notes


def _sized_for_sweep(c: BackendSpec, spec: str, caps: list[int], kv: int | None, per_seq: int,
                     explicit_ctx: bool, notes: list[str]) -> BackendSpec:
    """The swept backend's config with room for its largest cap (`auto`: its ceiling) or for
    `kv` whole sequences. Only a local backend's context is this process's to size: another
    kind keeps its config (its cap is set while it serves), and a KV budget is refused for it."""
    if not isinstance(c, BackendConfig):
        if kv:
            raise InvalidRequest(f"--kv-seqs sizes a local backend's context: the swept backend {c.name} is not one")
        return c
    max_cap = max(caps, default=0)
    if 0 in caps:  # `auto`: room for its ceiling too
        max_cap = max(max_cap, c.resolved().cap)
    if not (max_cap or kv):
        return c
    if max_cap and "n_seq_max=" not in spec:
        c = replace(c, n_seq_max=max(c.resolved().n_seq_max, replace(c, cap=max_cap).resolved().n_seq_max))
    if kv:
        return replace(c, n_ctx=kv * per_seq)
    need = max_cap * per_seq
    if not explicit_ctx and need > c.resolved().n_ctx:
        c = replace(c, n_ctx=need)
        notes.append(f"{c.name}'s context raised to {need} cells so cap {max_cap} is not memory-bound "
                     f"(each sequence's positions stay within the model's training context)")
    return c


def _measure_placeholders(eng, model: str) -> dict:
    """Measure, as `serve` does at load, every local backend this machine has no stored rates
    for (`engine.rates.measure.calibrate_at_load`, a few seconds per config, stored for the next
    run), with its progress on stderr: a bench never routes on placeholder rates. Backends
    given `--rates` are not placeholders and are left alone."""
    local = [b for b in eng.backends.values() if b.model is not None]  # the local model's backends
    if not any(b.rates.placeholder for b in local) or eng.model is None:
        return {}
    bar: list[Progress] = []

    def progress(done: int, total: int, what: str) -> None:
        if not bar:
            bar.append(Progress(total, "measuring rates"))
        bar[0].set(done, what)

    def say(text: str) -> None:
        print(f"tandem bench: {text}", file=sys.stderr, flush=True)

    try:
        return calibrate_at_load(local, Path(eng.model.path), eng.model.info.name, status=say, progress=progress)
    finally:
        if bar:
            bar[0].close()


def loaded_name(spec_name: str, loaded: list[str]) -> str:
    """The backend a spec's name stands for once loaded: a spec with `contexts` (auto on a GPU,
    resolved at load) loads as NAME-a, NAME-b, ...; its first context stands for it."""
    if spec_name in loaded:
        return spec_name
    return next((n for n in loaded if n.startswith(f"{spec_name}-")), spec_name)


def _default_sweep(configs) -> str:
    for c in configs:
        if c.device != "cpu":
            return c.name
    return configs[0].name


def _variants(eng, policies, caps, targets, args, sweep) -> list[Variant]:
    out = []
    if eng is not None:
        single = _single_policy(eng)
        for p in (policies if policies is not None else ["default", "seed-score", "predicted-finish", single]):
            out.append(Variant(label=p, policy=p))
        sweep_policies = _policy_list(getattr(args, "sweep_policies", None)) if caps else []
        if caps and sweep_policies is None:
            sweep_policies = [single]
        for p in (swept_policy(p, sweep) for p in sweep_policies or []):
            for cap in caps:
                out.append(Variant(label=f"{p}@cap={cap or 'auto'}", policy=p, cap=cap))
    for t in targets:
        out.append(Variant(label=t.label, target=t))
    labels = [v.label for v in out]
    if len(set(labels)) != len(labels):
        raise InvalidRequest(f"two variants share a label: {labels}")
    return out


SWEPT = "only:swept"  # in --sweep-policies: the swept backend alone, whatever its name


def swept_policy(policy: str, sweep: str) -> str:
    """A --sweep-policies entry with `only:swept` naming the swept backend (`only:gpu-a` where the
    default layout made several GPU contexts), so a fixed-cap row is that one backend at that cap."""
    return f"only:{sweep}" if policy == SWEPT else policy


def _single_policy(eng) -> str:
    if any(d.startswith("gpu") for d in eng.devices.values()):
        return "gpu-only"
    return f"only:{next(iter(eng.backends))}"


def _check_policies(eng, variants, sweep) -> None:
    """Fail early, with the reason, for a policy that cannot route on these backends."""
    snaps = eng.snapshot()
    for v in variants:
        try:
            Router(v.policy).route(RouteQuery("dry-run", 1, 1), snaps)
        except EngineError as e:
            raise InvalidRequest(f"policy {v.policy}: {e}") from None
        if v.cap is not None and v.cap > eng.info(sweep).n_seq_max:
            raise InvalidRequest(f"cap {v.cap} exceeds {sweep}'s n_seq_max {eng.info(sweep).n_seq_max}")


def _probe_targets(args) -> list:
    if not args.target:
        return []
    import asyncio

    from .target import parse_target, probe

    targets = []
    for text in args.target:
        try:
            label, url = parse_target(text)
        except ValueError as e:
            raise InvalidRequest(str(e)) from None
        try:
            target = asyncio.run(probe(url, args.target_api, label, prompt=getattr(args, "target_prompt", "auto")))
            if getattr(args, "target_model", None):
                target = replace(target, model=args.target_model)
            targets.append(target)
        except (ConnectionError, OSError) as e:
            raise InvalidRequest(f"--target {url}: {e}") from None
    return targets


def _engine_counters(eng) -> dict:
    """Per backend, over the whole invocation: steps, how many reused the previous step's
    graph, sampler chains attached (each a graph reserve) and end tokens taken back."""
    return {b.name: {"steps": b.steps, "graphs_reused": b.graphs_reused, "sampler_attaches": b.sampler_attaches,
                     "eog_redos": b.eog_redos} for b in eng.backends.values()}


def _label(spec: WorkloadSpec, kv) -> str:
    return spec.name() + (f", kv {kv} seqs" if kv else "")


def _policy_list(text):
    if text is None:
        return None
    if text.strip().lower() == "none":
        return []
    names = [p.strip() for p in text.split(",") if p.strip()]
    for p in names:
        make_policy(p)
    return names


def _cap_list(text: str) -> list[int]:
    """`--caps`: integers >= 1 (fixed caps), or `auto` (0: the adaptive cap)."""
    out = []
    for x in (x.strip().lower() for x in str(text).split(",") if x.strip()):
        out += [0] if x == "auto" else _int_list(x, "--caps")
    if not out:
        raise InvalidRequest(f"--caps must list caps, got {text!r}")
    return out


def _int_list(text: str, flag: str, low: int = 1) -> list[int]:
    try:
        values = [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise InvalidRequest(f"{flag} must be comma-separated integers, got {text!r}") from None
    if not values or min(values) < low:
        raise InvalidRequest(f"{flag} must list integers >= {low}, got {text!r}")
    return values


def _choices(text: str, valid, flag: str) -> list[str]:
    values = [x.strip() for x in text.split(",") if x.strip()]
    bad = [v for v in values if v not in valid]
    if not values or bad:
        raise InvalidRequest(f"{flag}: {', '.join(bad) or 'nothing'} not in {', '.join(valid)}")
    return values
