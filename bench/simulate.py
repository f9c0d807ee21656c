"""`tandem simulate seed|grid` and `tandem simulate --replay DIR`: the study's workloads on
simulated hardware (`engine.sim.simulate`), and recorded bench runs predicted.

`seed` and `grid` take `bench seed`/`bench grid`'s own argument declarations (so the same
workload flags mean the same thing) plus `--profile` and `--set`, and write the same files
(`summary.json`, `requests.csv`, `decisions.jsonl`, `results.md`, plots). `--model`,
`--backend`, `--warmup`, `--timeout` and `--online-rates` are accepted and have nothing to act on
(the profile is the hardware; a simulated run needs no warm-up); `--target` is refused.

`--replay DIR` rebuilds each recorded run — its backends, caps, KV sizes and rates from
`summary.json`, its measured arrival times and output lengths from `requests.csv` — simulates
it under the same policy, and compares predicted with measured per row: makespan, TTFT p50/p95,
the routed split, and the share of requests sent to the same backend. Each recorded run is
predicted with its own arrivals and outputs; the row compares the means over runs, and lists
each run (`per_run`) and the measured runs' spread. `--runs N` (default 3) is how many runs a
row needs before a 10 % bar means something: a row recorded with fewer says so in its "why".
A miss says why: routing, decode steps slower than calibrated, a run spread over 10 %, a host
busier than its cores (the 1-minute load average `bench` records after each run), or host
costs per request at a scale of milliseconds.
"""

from __future__ import annotations

import json
import lzma
import math
import statistics
import sys
import time
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path

from engine.core.errors import InvalidRequest
from engine.core.snapshot import Rates
from engine.experiment import Variant
from engine.rates.store import RateStore, rates_from_entry
from engine.sim.benchmark import RequestRecord, RunMetrics, run_metrics
from engine.sim.simulate import (
    PROFILES,
    SAMPLED_TOKEN,
    BackendProfile,
    Profile,
    SimRun,
    apply_overrides,
    profile_from_calibration,
    simulate,
)
from engine.sim.workload import (
    TOKEN_HIGH,
    RecordedTurn,
    Workload,
    WorkloadSpec,
    build_workload,
    conversation_workload,
    with_requests,
)

from . import report as bench_report
from . import study
from .progress import Progress

HELP = "the study's workloads on simulated hardware: the real router and schedulers, a virtual clock"
PROFILE_HELP = ("study-m2 | study-m2-slow | h200 | this-machine | FILE.json/.toml (a profile: "
                "{name, backends: [{name, device, cap, kv_cells, rates: {prefill_tok_s, decode_tok_s, "
                "step_alpha_s, step_beta_s, step_table}, hardware: {...}}]})")
TOLERANCE = 0.10  # predicted within 10 % of measured
PAYS = 0.01  # the crossover map's line: a hybrid policy gains more than this over the best single backend
SAME_BACKEND = 0.90  # and the same backend for 90 % of requests
MIN_RUNS = 3  # recorded runs a replayed row needs (`--runs`)


def add_arguments(p) -> None:
    p.add_argument("--replay", default=None, metavar="DIR",
                   help="predict a recorded `bench seed`/`bench grid` run and compare (summary.json, "
                        "requests.csv[.xz])")
    p.add_argument("--out", dest="replay_out", default=None,
                   help="with --replay: also write replay.md and replay.json here")
    p.add_argument("--runs", dest="replay_runs", type=int, default=MIN_RUNS,
                   help="with --replay: the recorded runs a row needs for its 10 %% bar to be judged on "
                        "more than noise; rows with fewer are predicted and flagged (default: %(default)s)")
    p.add_argument("--hardware", default=None, metavar="PROFILE",
                   help="with --replay: the devices do what this profile's same-named backends do (the "
                        "router keeps the recorded rates); e.g. h200 for runs priced with default rates")
    sub = p.add_subparsers(dest="sim_kind")
    x = sub.add_parser("crossover", help="where hybrid routing pays: CPU:GPU speed ratio x GPU KV budget")
    x.add_argument("--profiles", default="this-machine,h200,study-m2",
                   help="base profiles, one panel each; the second backend is the one made faster or slower "
                        "(default: %(default)s)")
    x.add_argument("--ratios", default="0.01,0.02,0.04,0.07,0.1,0.15,0.25,0.4,0.6,1,1.5",
                   help="decode throughput of the second backend over the first's (default: %(default)s)")
    x.add_argument("--kv-seqs", default="1,2,4,8,16,32",
                   help="the first backend's KV room in whole sequences, its cap 64 (default: %(default)s)")
    x.add_argument("--policies", default="seed-score,predicted-finish", help="hybrid policies (default: %(default)s)")
    x.add_argument("--requests", type=int, default=48, help="the study's workload, N requests (default: %(default)s)")
    x.add_argument("--out", default="docs/results/crossover", help="output directory (default: %(default)s)")
    for kind, help_, declare in (("seed", study.SEED_HELP, study.add_seed_arguments),
                                 ("grid", study.GRID_HELP, study.add_grid_arguments)):
        q = sub.add_parser(kind, help=help_ + ", simulated")
        declare(q)
        add_profile_arguments(q)


def add_profile_arguments(p) -> None:
    p.add_argument("--profile", default="study-m2", help=PROFILE_HELP + " (default: %(default)s)")
    p.add_argument("--set", action="append", default=[], metavar="BACKEND.FIELD=VALUE",
                   help="edit the profile: cap, kv_cells, n_batch, busy_chunk, chunk_fixed_s, admit_s, "
                        "chunk_overhead_s, prefill_tok_s, decode_tok_s, "
                        "step_alpha_s, step_beta_s, step_gamma_s, step_delta_s (router and hardware), hardware.RATE / rates.RATE (one "
                        "side), speed (hardware x); repeatable")


def run_simulate(args) -> int:
    if args.replay:
        hardware = None
        if args.hardware == "this-machine":  # this machine's calibration of the recorded model
            hardware = this_machine(model=recorded_summary(Path(args.replay)).get("model") or {})
        elif args.hardware:
            hardware = load_profile(args.hardware)
        return run_replay(Path(args.replay), Path(args.replay_out) if args.replay_out else None, hardware,
                          min_runs=args.replay_runs)
    if args.sim_kind is None:
        raise InvalidRequest("tandem simulate: give seed, grid, crossover or --replay DIR")
    if args.sim_kind == "crossover":
        return run_crossover(args)
    if args.target:
        raise InvalidRequest("tandem simulate: --target peers cannot be simulated")
    args.warmup = 0
    return (study.run_seed if args.sim_kind == "seed" else study.run_grid)(args, bench=SimBench)


# ---- profiles ----


def load_profile(spec: str, settings=()) -> Profile:
    """A built-in profile, `this-machine`, or a JSON/TOML file; then the `--set` edits."""
    if spec in PROFILES:
        profile = PROFILES[spec]
    elif spec == "this-machine":
        profile = this_machine()
    else:
        path = Path(spec)
        if not path.exists():
            raise InvalidRequest(f"--profile {spec!r}: not one of {', '.join([*PROFILES, 'this-machine'])} "
                                 f"and no such file")
        text = path.read_text()
        try:
            if path.suffix == ".toml":
                import tomllib

                data = tomllib.loads(text)
            else:
                data = json.loads(text)
        except ValueError as e:
            raise InvalidRequest(f"--profile {spec}: {e}") from None
        profile = Profile.from_dict(data)
    return apply_overrides(profile, settings)


def this_machine(store: RateStore | None = None, model: dict | None = None) -> Profile:
    """This machine's latest stored calibration (`tandem calibrate`), one backend per entry of
    the most recently calibrated model, or of `model` (a recorded run's `summary.json` model:
    its `fingerprint`); an entry measured for two backends (`also_for`) gives both."""
    store = store or RateStore()
    entries = list(store.entries().values())
    if model is not None:
        entries = [e for e in entries if e.get("fingerprint") == model.get("fingerprint")]
        if not entries:
            raise InvalidRequest(f"--hardware this-machine: no calibration of the recorded model "
                                 f"({model.get('name') or model.get('spec') or '?'}) in {store.path}: "
                                 f"run `tandem calibrate --model {model.get('spec') or 'MODEL'}` first")
    if not entries:
        raise InvalidRequest(f"no stored calibration in {store.path}: run `tandem calibrate` first")
    latest = max(entries, key=lambda e: e.get("measured_at", ""))
    mine = [e for e in entries if e.get("fingerprint") == latest.get("fingerprint")]
    expanded = []
    for e in sorted(mine, key=lambda e: e.get("backend", "")):
        expanded.append(e)
        expanded += [{**e, "backend": other} for other in e.get("also_for", [])]
    if len(expanded) == 1:  # `tandem calibrate` measures one entry for two equal backends
        expanded.append({**expanded[0], "backend": _second_name(expanded[0].get("backend", "cpu0"))})
    return profile_from_calibration("this-machine", expanded,
                                    description=f"{latest.get('model', '?')} as calibrated here "
                                                f"({latest.get('measured_at', '?')})")


def _second_name(name: str) -> str:
    return name[:-1] + str(int(name[-1]) + 1) if name[-1:].isdigit() else name + "1"


# ---- simulated bench: the engine runner's place taken by the simulation ----


class SimBench(study.Bench):
    """`bench seed`/`bench grid`'s loops over workloads, N, runs and variants, each run simulated."""

    def __init__(self, args, kind, specs, n_list, *, caps, kv_seqs):
        self.profile = load_profile(args.profile, args.set)
        super().__init__(args, kind, specs, n_list, caps=caps, kv_seqs=kv_seqs)
        self.model_info = {"spec": f"simulated: profile {self.profile.name}", "name": self.profile.name,
                           "text": "simulated"}
        self.notes.append(f"simulated on profile {self.profile.name}: {self.profile.description}")
        self.sweep = getattr(args, "sweep_backend", None) or next(
            (b.name for b in self.profile.backends if b.device != "cpu"), self.profile.backends[0].name)
        self.profile.backend(self.sweep)
        self.steps = 0
        self.simulated_requests = 0
        self.sim_seconds = 0.0

    def run(self, bar: Progress) -> None:
        single = ("gpu-only" if any(b.device != "cpu" for b in self.profile.backends)
                  else f"only:{self.profile.backends[0].name}")
        policies = self.policies if self.policies is not None else ["default", "seed-score", "predicted-finish", single]
        variants = [Variant(label=p, policy=p) for p in policies]
        sweep_policies = study._policy_list(getattr(self.args, "sweep_policies", None)) if self.caps else []
        if self.caps and sweep_policies is None:
            sweep_policies = [single]
        for p in (study.swept_policy(p, self.sweep) for p in sweep_policies or []):
            variants += [Variant(label=f"{p}@cap={c or 'auto'}", policy=p, cap=c) for c in self.caps]
        per_seq = max(s.prompt_tokens + s.max_tokens for s in self.specs)
        bar.add_total(len(self.kv_seqs) * len(variants) * self.args.runs * len(self.specs) * sum(self.n_list))
        t0 = time.perf_counter()
        for kv in self.kv_seqs:
            self.engines.append({"kv_seqs": kv, "backends": [b.to_dict() for b in self._profile_for(None, kv, per_seq).backends]})
            for run in range(self.args.runs):
                for spec in self.specs:
                    for n in self.n_list:
                        wl = build_workload(replace(with_requests(spec, n), vocab_size=TOKEN_HIGH,
                                                    label=spec.name() + (f", kv {kv} seqs" if kv else "")), run)
                        for v in variants:
                            if v.policy is None:
                                raise InvalidRequest(f"{v.label}: the simulator runs routing policies, not HTTP targets")
                            bar.update(0, f"{v.label} N={n} run {run + 1}/{self.args.runs}")
                            got = simulate(self._profile_for(v.cap, kv, per_seq), wl, v.policy,
                                           budget=self.args.budget, label=v.label, on_done=bar.update)
                            self.steps += got.steps
                            self.simulated_requests += n
                            self.records.extend(got.records)
                            self.decisions.extend(got.decisions)
                            self.meta[(wl.spec.name(), v.label)] = {"kv_seqs": kv, "cap": v.cap, "single": v.single,
                                                                    "target": False}
        self.sim_seconds = time.perf_counter() - t0
        self.notes.append(f"simulated {self.simulated_requests:,} requests ({self.steps:,} scheduler steps) "
                          f"in {self.sim_seconds:.2f} s of wall time")
        print(f"simulated {self.simulated_requests:,} requests in {self.sim_seconds:.2f} s", file=sys.stderr)

    def _profile_for(self, cap, kv, per_seq) -> Profile:
        b = self.profile.backend(self.sweep)
        if kv:
            b = replace(b, kv_cells=kv * per_seq)
        elif self.caps:
            b = replace(b, kv_cells=max(b.kv_cells, max(self.caps) * per_seq) if b.kv_cells else 0)
        if cap is not None:
            b = replace(b, cap=cap)
        return self.profile.with_backend(b)

    def summary(self) -> dict:
        out = super().summary()
        out["tool"] = f"tandem simulate {self.kind}"
        out["profile"] = self.profile.to_dict()
        out["backends"] = [{**b, "threads": 0, "n_ctx": b["kv_cells"] or "cap x sequence"}
                           for b in (self.engines[0]["backends"] if self.engines else [])]
        out["engine_state"] = ("simulated: the real router and schedulers on a virtual clock; the shared prefix "
                               "warmed on every backend before timing, as the bench does")
        return out


# ---- replay ----


def _open(path: Path):
    if path.exists():
        return path.open()
    xz = path.with_name(path.name + ".xz")
    if xz.exists():
        return lzma.open(xz, "rt")
    raise InvalidRequest(f"--replay: neither {path} nor {xz} exists")


def recorded_summary(directory: Path) -> dict:
    """A recorded bench run's `summary.json`; InvalidRequest for a missing or unreadable one, or
    for a simulated run (`tandem simulate` writes the same files, but there is nothing measured
    to predict)."""
    try:
        summary = json.loads(_open(directory / "summary.json").read())
    except ValueError as e:
        raise InvalidRequest(f"--replay {directory}: summary.json is not JSON: {e}") from None
    if not isinstance(summary, dict):
        raise InvalidRequest(f"--replay {directory}: summary.json is not a bench run's summary")
    if str(summary.get("tool", "")).startswith("tandem simulate"):
        raise InvalidRequest(f"--replay {directory}: a simulated run ({summary['tool']}); replay predicts a "
                             "recorded `tandem bench seed` or `tandem bench grid` run")
    return summary


def replay_profile(engine: dict, model: dict | None = None, store: RateStore | None = None) -> Profile:
    """The backends a recorded run used (one `summary.json` `engines` entry), with the rates it
    recorded; where it recorded placeholders (`source` "default": a run before the benches
    measured at load), this machine's calibration of that model (`model`'s fingerprint) and
    config instead, if there is one (`replay_rates` says which)."""
    rates = replay_rates(engine, model, store)
    return Profile("recorded", tuple(
        BackendProfile(b["name"], b["device"], rates[b["name"]][0], cap=int(b["cap"]), kv_cells=int(b["n_ctx"]),
                       n_batch=int(b.get("n_batch", 512)))
        for b in engine["backends"]), "the backends and rates the recorded run used")


def replay_rates(engine: dict, model: dict | None = None,
                 store: RateStore | None = None) -> dict[str, tuple[Rates, str]]:
    """Per recorded backend, the rates a replay prices it with and where they came from, in
    words: the rates recorded with the run; else (placeholders recorded) this machine's
    calibration of the recorded model and config; else the placeholders, said so."""
    out: dict[str, tuple[Rates, str]] = {}
    for b in engine["backends"]:
        r = dict(b["rates"])
        recorded = Rates(float(r["prefill_tok_s"]), float(r["decode_tok_s"]), float(r.get("step_alpha_s", 0.0)),
                         float(r.get("step_beta_s", 0.0)), str(r.get("source", "recorded")),
                         tuple(r.get("step_table") or ()), step_gamma_s=float(r.get("step_gamma_s", 0.0)),
                         step_cells=tuple(float(c) for c in r.get("step_cells") or ()),
                         step_delta_s=float(r.get("step_delta_s", 0.0)),
                         step_kv=tuple(float(c) for c in r.get("step_kv") or ()),
                         measured_at=str(r.get("measured_at") or ""))
        if not recorded.placeholder:
            out[b["name"]] = (recorded, f"the rates recorded with the run ({recorded.origin})")
            continue
        entry = _calibration_of(b, model or {}, store)
        if entry is None:
            out[b["name"]] = (recorded, "the run's placeholder rates: it was not measured, and this machine has no "
                                        "calibration of its model and config")
        else:
            out[b["name"]] = (rates_from_entry(entry), f"this machine's calibration of its model and config "
                                                       f"({entry.get('measured_at', '?')[:19]}; the run recorded "
                                                       f"placeholders)")
    return out


def _calibration_of(backend: dict, model: dict, store: RateStore | None) -> dict | None:
    """This machine's stored calibration of a recorded backend: its model's fingerprint and its
    `config_key` (recorded since the benches measure at load), else the same device and
    threads (older runs recorded no key); the latest such entry."""
    fingerprint = model.get("fingerprint")
    if not fingerprint:
        return None
    store = store or RateStore()
    key = backend.get("config_key")
    if key:
        return store.lookup(fingerprint, key)
    prefix = f"{backend.get('device')}:threads={backend.get('threads')},"
    found = [e for e in store.entries().values()
             if e.get("fingerprint") == fingerprint and str(e.get("config", "")).startswith(prefix)]
    return max(found, key=lambda e: e.get("measured_at", ""), default=None)


def replay(directory: Path, progress: Progress | None = None, hardware: Profile | None = None,
           min_runs: int = MIN_RUNS) -> list[dict]:
    """Predict every engine row of a recorded bench run; one comparison dict per row.
    `hardware`: its same-named backends' speeds replace the recorded rates as what the
    devices do (the router still sees the recorded rates). A row with fewer than `min_runs`
    recorded runs is predicted and flagged."""
    summary = recorded_summary(directory)
    try:
        return _replay(directory, summary, progress, hardware, min_runs)
    except (KeyError, TypeError, ValueError) as e:
        raise InvalidRequest(f"--replay {directory}: not a bench run's files ({type(e).__name__}: {e})") from None


def _replay(directory: Path, summary: dict, progress: Progress | None, hardware: Profile | None,
            min_runs: int) -> list[dict]:
    rec = _Recorded.read(directory, summary)
    out = []
    for (workload, label, n), runs in rec.groups.items():
        meta = rec.rows_meta.get((workload, label, n), {})
        if meta.get("target"):
            continue
        profile = _row_profile(rec, meta, hardware)
        policy = label.split("@cap=")[0] if rec.chat is None else summary.get("engine_policy") or "seed-score"
        spec = rec.specs.get(workload.split(", kv ")[0])
        if spec is None and rec.chat is None:
            continue  # a workload the summary does not describe
        tally = _Tally()
        for run, recs in sorted(runs.items()):
            recs = sorted(recs, key=lambda r: r.index)
            if rec.chat is not None:
                recs = [r for r in recs if r.success]  # a failed turn ends its conversation
            got = _simulate_run(rec, profile, policy, (workload, label, n), run, recs, spec)
            if got is None:
                continue
            tally.add(run, recs, got.records)
            if progress is not None:
                progress.update(len(recs))
        if tally.measured:
            out.append(tally.row(workload, label, n, min_runs=min_runs,
                                 load=max(rec.loads.get((workload, label, n), []), default=math.nan),
                                 cpus=rec.host.get("cpus")))
    return out


@dataclass
class _Recorded:
    """A recorded bench run as the replay reads it: its records grouped by row (workload,
    policy label, requests) and run, and what its summary says of the workloads and engines."""

    summary: dict
    groups: dict[tuple, dict[int, list[RequestRecord]]]
    chat: dict | None  # a chat run (`tandem bench chat`): its in-process row, each turn sent when it was sent
    specs: dict[str, WorkloadSpec]  # by name
    rows_meta: dict[tuple, dict]
    vocab: int
    engines: list[dict]
    host: dict
    loads: dict[tuple, list[float]]  # each row's 1-minute load averages

    @classmethod
    def read(cls, directory: Path, summary: dict) -> _Recorded:
        with _open(directory / "requests.csv") as f:
            import csv

            records = [bench_report._record_from_csv(row) for row in csv.DictReader(f)]
        chat = next((w for w in summary["workloads"] if w.get("kind") == "chat"), None)
        specs = [] if chat else [WorkloadSpec(**{k: v for k, v in w.items() if k in WorkloadSpec.__dataclass_fields__})
                                 for w in summary["workloads"]]
        rows_meta = {(r["workload"], r["policy"], r["requests"]): r for r in summary["results"]}
        vocab = int((summary.get("model") or {}).get("n_vocab") or TOKEN_HIGH)
        engines = summary.get("engines") or [{"kv_seqs": None, "backends": summary["backends"]}]
        host = summary.get("host") or {}
        loads: dict[tuple, list[float]] = {}
        for x in host.get("load_avg") or []:
            loads.setdefault((x["workload"], x["policy"], x["requests"]), []).append(float(x["load1"]))
        groups: dict[tuple, dict[int, list[RequestRecord]]] = {}
        for r in records:
            groups.setdefault((r.workload, r.policy, r.requests), {}).setdefault(r.run, []).append(r)
        return cls(summary, groups, chat, {s.name(): s for s in specs}, rows_meta, vocab, engines, host, loads)


def _row_profile(rec: _Recorded, meta: dict, hardware: Profile | None) -> Profile:
    """The profile a row ran on: its engine's recorded backends, `hardware`'s speeds where it
    names the same backends, the swept backend at the row's cap."""
    kv = meta.get("kv_seqs")
    engine = next((e for e in rec.engines if e.get("kv_seqs") == kv), rec.engines[0])
    profile = replay_profile(engine, rec.summary.get("model") or {})
    if hardware is not None:
        for hb in hardware.backends:
            if any(b.name == hb.name for b in profile.backends):
                profile = profile.with_backend(replace(profile.backend(hb.name), hardware=hb.hw,
                                                       chunk_overhead_s=hb.chunk_overhead_s,
                                                       chunk_fixed_s=hb.chunk_fixed_s,
                                                       prefill_ref_tokens=hb.prefill_ref_tokens,
                                                       admit_s=hb.admit_s))
    sweep = next((b["name"] for b in engine["backends"] if b.get("swept")), None)
    if meta.get("cap") is not None and sweep:
        profile = profile.with_backend(replace(profile.backend(sweep), cap=int(meta["cap"])))
    return profile


def _simulate_run(rec: _Recorded, profile: Profile, policy: str, row: tuple[str, str, int], run: int,
                  recs: list[RequestRecord], spec: WorkloadSpec | None) -> SimRun | None:
    """One recorded run predicted: a chat run's turns as they were sent, else the row's workload
    with the recorded arrivals and output lengths (None: the run did not record every request)."""
    workload, label, n = row
    budget = rec.summary.get("budget", "raw")
    if rec.chat is not None:
        wl = chat_replay_workload(workload, run, int(rec.chat["turns"]), recs, min(rec.vocab, TOKEN_HIGH))
        return simulate(profile, wl, policy, budget=budget, label=label)
    if spec is None:  # a workload the summary does not describe (`_replay` skips its rows)
        return None
    wl = build_workload(replace(with_requests(spec, n), vocab_size=min(rec.vocab, TOKEN_HIGH), label=workload), run)
    arrivals = [r.t_submit_s for r in recs]
    outputs = [r.output_tokens if r.success and r.output_tokens else wl.requests[r.index].output_tokens
               for r in recs]
    if len(recs) != n:
        return None
    return simulate(profile, wl, policy, budget=budget, label=label, arrivals=arrivals, outputs=outputs)


class _Tally:
    """One row's measured and predicted runs, gathered run by run."""

    def __init__(self) -> None:
        self.measured: list[RunMetrics] = []
        self.predicted: list[RunMetrics] = []
        self.same = self.total = 0  # requests, and those the prediction put on the recorded backend
        self.itl_m: list[float] = []
        self.itl_p: list[float] = []
        self.per_run: list[dict] = []
        self.cached = {"measured": [0, 0], "predicted": [0, 0]}  # cached, prompt tokens (where known)

    def add(self, run: int, recs: list[RequestRecord], predicted: list[RequestRecord]) -> None:
        sim = {p.index: p for p in predicted}
        for r in recs:
            self.total += 1
            self.same += r.backend == sim[r.index].backend
        self.measured.append(run_metrics(recs))
        self.predicted.append(run_metrics(predicted))
        self.per_run.append({"run": run, **{k: {"measured": getattr(self.measured[-1], k),
                                                "predicted": getattr(self.predicted[-1], k)}
                                            for k in ("makespan_s", "ttft_p50_s", "ttft_p95_s")}})
        for side, rs in (("measured", recs), ("predicted", predicted)):
            known = [r for r in rs if r.success and r.cached_tokens >= 0]
            self.cached[side][0] += sum(r.cached_tokens for r in known)
            self.cached[side][1] += sum(r.prompt_tokens for r in known)
        self.itl_m += [r.itl_s for r in recs if r.itl_s]
        self.itl_p += [p.itl_s for p in predicted if p.itl_s]

    def row(self, workload: str, label: str, n: int, *, min_runs: int, load: float, cpus: object) -> dict:
        row = _compare(workload, label, n, self.measured, self.predicted,
                       self.same / self.total if self.total else math.nan, _mean(self.itl_m), _mean(self.itl_p),
                       per_run=self.per_run, min_runs=min_runs, load=load, cpus=cpus)
        row["cached_share"] = {side: c / p if p else math.nan for side, (c, p) in self.cached.items()}
        return row


def chat_replay_workload(label: str, run: int, turns: int, records: list[RequestRecord], vocab: int) -> Workload:
    """A chat run's turns (successful records, index = conversation x turns + turn) as the
    simulator's prompts (`conversation_workload`). The shared system prompt's length is what
    the first turns found cached (their median, over those that found any: the first
    conversation's computes it); replies are their recorded length (`ignore_eos`)."""
    firsts = sorted(r.cached_tokens for r in records if r.index % turns == 0 and r.cached_tokens > 0)
    shared = firsts[len(firsts) // 2] if firsts else 0
    recorded = [RecordedTurn(r.index // turns, r.index % turns, r.index, r.t_submit_s, r.prompt_tokens,
                             max(r.output_tokens, 1), max(r.output_tokens, 1)) for r in records]
    return conversation_workload(label, run, shared, recorded, reply_token=SAMPLED_TOKEN, vocab_size=vocab)


def _mean(xs):
    return statistics.fmean(xs) if xs else math.nan


def _spread(values) -> float:
    """std / mean of a row's measured runs (nan below 2 runs)."""
    vals = [v for v in values if math.isfinite(v)]
    if len(vals) < 2 or not statistics.fmean(vals):
        return math.nan
    return statistics.stdev(vals) / statistics.fmean(vals)


def _compare(workload, label, n, measured, predicted, same, itl_m, itl_p, *, per_run=(), min_runs: int = 1,
             load: float = math.nan, cpus=None) -> dict:
    def avg(ms, key):
        vals = [getattr(m, key) for m in ms if math.isfinite(getattr(m, key))]
        return statistics.fmean(vals) if vals else math.nan

    def split(ms: list[RunMetrics]) -> dict[str, float]:
        total: dict[str, float] = {}
        for m in ms:
            for b, k in m.routed.items():
                total[b] = total.get(b, 0) + k / len(ms)
        return total

    row = {"workload": workload, "policy": label, "requests": n, "runs": len(measured), "same_backend": same,
           "itl_measured_ms": itl_m * 1e3, "itl_predicted_ms": itl_p * 1e3,
           "routed_measured": split(measured), "routed_predicted": split(predicted)}
    for key in ("makespan_s", "ttft_p50_s", "ttft_p95_s"):
        m, p = avg(measured, key), avg(predicted, key)
        row[key] = {"measured": m, "predicted": p, "error": (p - m) / m if m else math.nan}
    row["per_run"] = list(per_run)
    row["spread"] = {key: _spread([getattr(m, key) for m in measured]) for key in ("makespan_s", "ttft_p50_s")}
    row["min_runs"] = min_runs
    row["host_load"] = {"load1_max": load, "cpus": cpus}
    row["ok"] = (abs(row["makespan_s"]["error"]) <= TOLERANCE and abs(row["ttft_p50_s"]["error"]) <= TOLERANCE
                 and same >= SAME_BACKEND)
    row["why"] = _why(row) if not row["ok"] else _caveats(row)
    return row


def _why(row: dict) -> str:
    """The likely reason a prediction missed, from what the records show."""
    reasons = []
    if row["same_backend"] < SAME_BACKEND:
        if row["routed_measured"] == row["routed_predicted"]:
            reasons.append(f"{1 - row['same_backend']:.0%} of requests on the other backend with the same split "
                           f"({_split(row['routed_measured'])}): equal backends tie and swap requests")
        else:
            reasons.append(f"routing differs for {1 - row['same_backend']:.0%} of requests (measured "
                           f"{_split(row['routed_measured'])}, predicted {_split(row['routed_predicted'])})")
    itl_m, itl_p = row["itl_measured_ms"], row["itl_predicted_ms"]
    if math.isfinite(itl_m) and math.isfinite(itl_p) and itl_p and abs(itl_m / itl_p - 1) > TOLERANCE:
        reasons.append(f"decode steps ran {itl_m / itl_p:.2f}x the calibrated time (mean ITL {itl_m:.2f} ms "
                       f"measured, {itl_p:.2f} ms predicted)")
    mk = row["makespan_s"]
    if abs(mk["error"]) > TOLERANCE and not reasons:
        reasons.append(f"makespan {mk['error']:+.0%} with the same routing and step times: time outside "
                       f"the calibrated steps (host work between steps, prefill at other batch shapes)")
    t = row["ttft_p50_s"]
    if abs(t["error"]) > TOLERANCE:
        if t["measured"] < 0.05:
            reasons.append(f"TTFT p50 is {t['measured'] * 1e3:.1f} ms measured: at that scale the host's "
                           f"per-request costs (submission, admission, first step) dominate, which "
                           f"the calibrated rates do not contain")
        elif not reasons:
            reasons.append(f"TTFT p50 {t['error']:+.0%}: queueing differs")
    spread = row.get("spread") or {}
    noisy = [f"{name} {spread[key]:.0%}" for key, name in (("makespan_s", "makespan"), ("ttft_p50_s", "TTFT p50"))
             if math.isfinite(spread.get(key, math.nan)) and spread[key] > TOLERANCE]
    if noisy:
        reasons.append(f"measured run spread (std/mean over {row['runs']} runs) {', '.join(noisy)}: larger than "
                       f"the 10 % bar")
    if row.get("runs", 0) < row.get("min_runs", 1):
        reasons.append(f"{row['runs']} run(s) recorded, {row['min_runs']} needed to judge a 10 % bar")
    host = row.get("host_load") or {}
    load, cpus = host.get("load1_max", math.nan), host.get("cpus")
    if cpus and math.isfinite(load) and load > cpus:
        reasons.append(f"host busier than its cores: 1-minute load average up to {load:.1f} on {cpus} CPUs "
                       f"during the row's runs")
    return "; ".join(reasons)


def _caveats(row: dict) -> str:
    """What makes a row that met the bar weaker evidence (too few runs)."""
    if row.get("runs", 0) < row.get("min_runs", 1):
        return f"{row['runs']} run(s) recorded, {row['min_runs']} needed"
    return ""


def _split(d: dict) -> str:
    return ", ".join(f"{b} {k:g}" for b, k in sorted(d.items()))


def replay_markdown(directory: Path, rows: list[dict]) -> str:
    lines = [f"### `{directory}`", "",
             "| workload | policy | N | runs | makespan s meas / pred (err) | TTFT p50 s meas / pred (err) | "
             "TTFT p95 s meas / pred (err) | run spread makespan / TTFT p50 | routed meas / pred | same backend | "
             "within 10 %? why not |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        cells = []
        for key in ("makespan_s", "ttft_p50_s", "ttft_p95_s"):
            c = r[key]
            cells.append(f"{c['measured']:.3f} / {c['predicted']:.3f} ({c['error']:+.0%})")
        spread = r.get("spread") or {}
        sp = " / ".join(f"{spread.get(k, math.nan):.0%}" if math.isfinite(spread.get(k, math.nan)) else "–"
                        for k in ("makespan_s", "ttft_p50_s"))
        verdict = ("yes" + (f" ({r['why']})" if r["why"] else "")) if r["ok"] else "no: " + r["why"]
        lines.append(f"| {r['workload']} | {r['policy']} | {r['requests']} | {r['runs']} | {' | '.join(cells)} | "
                     f"{sp} | {_split(r['routed_measured'])} / {_split(r['routed_predicted'])} | "
                     f"{r['same_backend']:.0%} | {verdict} |")
    ok = sum(r["ok"] for r in rows)
    lines += ["", f"{ok} of {len(rows)} rows within 10 % (makespan and TTFT p50) with ≥ 90 % of requests on "
                  f"the same backend."]
    few = sum(r["runs"] < r.get("min_runs", 1) for r in rows)
    if few:
        lines.append(f"{few} row(s) recorded with fewer than {rows[0].get('min_runs')} runs.")
    return "\n".join(lines)


def run_replay(directory: Path, out: Path | None, hardware: Profile | None = None, min_runs: int = MIN_RUNS) -> int:
    if min_runs < 1:
        raise InvalidRequest(f"--runs must be >= 1, got {min_runs}")
    t0 = time.perf_counter()
    with Progress(0, f"replay {directory}") as bar:
        rows = replay(directory, bar, hardware, min_runs=min_runs)
    if not rows:
        raise InvalidRequest(f"--replay {directory}: no engine rows to predict")
    text = replay_markdown(directory, rows)
    summary = recorded_summary(directory)
    engines = summary.get("engines") or [{"backends": summary.get("backends") or []}]
    used = replay_rates(engines[0], summary.get("model") or {})
    text += "\n\nRates the router was told: " + "; ".join(f"{name}: {why}" for name, (_, why) in used.items()) + "."
    if hardware is not None:
        text += (f"\n\nDevices simulated with profile {hardware.name}'s speeds ("
                 + "; ".join(f"{b.name}: context term {b.hw.step_gamma_s * 1e6:.2f} µs per row per cell, "
                             f"masked scan {b.hw.step_delta_s * 1e6:.3f} µs per row per pool cell, "
                             f"host {b.admit_s * 1e3:.1f} ms per request" for b in hardware.backends)
                 + "); the router priced with the recorded rates.")
    print(text)
    print(f"replayed {len(rows)} rows in {time.perf_counter() - t0:.2f} s", file=sys.stderr)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "replay.md").write_text(text + "\n")
        (out / "replay.json").write_text(json.dumps({"source": str(directory), "created": datetime.now().astimezone()
                                                     .isoformat(timespec="seconds"),
                                                     "rates": {name: why for name, (_, why) in used.items()},
                                                     "rows": bench_report._clean(rows)},
                                                    indent=1) + "\n")
    return 0


# ---- crossover map ----


def crossover(base: Profile, ratios, kv_seqs, policies, n: int, bar: Progress | None = None) -> list[dict]:
    """Each policy's makespan gain over the best single backend, on the study's workload, for
    every (ratio, KV budget): `ratio` is the second backend's decode throughput (at its cap)
    over the first's, both its rates and its device scaled; the first backend's KV holds
    `kv` whole sequences (cap 64, so memory bounds it)."""
    from engine.sim.simulate import scaled_profile
    from engine.sim.workload import seed_workload

    fast, slow = base.backends[0], base.backends[1]
    wl = build_workload(seed_workload(n), 0)
    per_seq = max(len(r.prompt) + r.max_tokens for r in wl.requests)
    rows = []
    for ratio in ratios:
        factor = ratio * _throughput(fast) / _throughput(slow)
        for kv in kv_seqs:
            p = scaled_profile(base, slow.name, factor)
            p = p.with_backend(replace(p.backend(fast.name), kv_cells=kv * per_seq, cap=64))
            singles = {b.name: run_metrics(simulate(p, wl, f"only:{b.name}").records).makespan_s for b in p.backends}
            best_name = min(singles, key=lambda k: singles[k])
            for policy in policies:
                got = simulate(p, wl, policy)
                m = run_metrics(got.records)
                rows.append({"profile": base.name, "ratio": ratio, "kv_seqs": kv, "policy": policy, "requests": n,
                             "makespan_s": m.makespan_s, "best_single": best_name,
                             "best_single_s": singles[best_name], "gain": 1 - m.makespan_s / singles[best_name],
                             "to_second": m.routed.get(slow.name, 0)})
            if bar is not None:
                bar.update(1)
    return rows


def _throughput(b: BackendProfile) -> float:
    """Decode tokens/s of the device at its cap (an adaptive one's ceiling)."""
    return b.most / b.hw.step_s(b.most)


def marker(base: Profile) -> tuple[float, float]:
    """Where the base profile itself sits on its map: (ratio, KV budget in sequences)."""
    fast, slow = base.backends[0], base.backends[1]
    per_seq = 516 + 128
    kv = (fast.kv_cells / per_seq) if fast.kv_cells else fast.most
    return _throughput(slow) / _throughput(fast), min(kv, fast.most)


def run_crossover(args) -> int:
    import csv

    ratios = [float(x) for x in args.ratios.split(",")]
    kv_seqs = study._int_list(args.kv_seqs, "--kv-seqs")
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    bases = [load_profile(name.strip()) for name in args.profiles.split(",") if name.strip()]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    t0 = time.perf_counter()
    with Progress(len(bases) * len(ratios) * len(kv_seqs), "crossover") as bar:
        for base in bases:
            rows += crossover(base, ratios, kv_seqs, policies, args.requests, bar)
    print(f"simulated {len(rows) // len(policies) * (len(policies) + 2):,} runs of {args.requests} requests "
          f"in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    with (out / "crossover.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    markers = {b.name: marker(b) for b in bases}
    (out / "markers.json").write_text(json.dumps({**{k: {"ratio": r, "kv_seqs": kv} for k, (r, kv) in markers.items()},
                                                  "profiles": {b.name: b.to_dict() for b in bases}}, indent=1) + "\n")
    plot_crossover(out / "crossover.png", rows, markers, policies)
    print(f"wrote {out / 'crossover.csv'}, {out / 'crossover.png'}", file=sys.stderr)
    return 0


def plot_crossover(path: Path, rows: list[dict], markers: dict, policies: list[str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    names = list(dict.fromkeys(r["profile"] for r in rows))
    fig, axes = plt.subplots(1, len(names), figsize=(5.2 * len(names), 4.6), squeeze=False)
    styles = ["-", "--", ":", "-."]
    for ax, name in zip(axes[0], names):
        mine = [r for r in rows if r["profile"] == name]
        ratios = sorted({r["ratio"] for r in mine})
        kvs = sorted({r["kv_seqs"] for r in mine})
        best = np.full((len(kvs), len(ratios)), np.nan)
        for i, kv in enumerate(kvs):
            for j, ratio in enumerate(ratios):
                best[i, j] = max(r["gain"] for r in mine if r["kv_seqs"] == kv and r["ratio"] == ratio)
        lim = max(0.05, float(np.nanmax(np.abs(best))))
        mesh = ax.pcolormesh(ratios, kvs, best * 100, cmap="RdBu", vmin=-lim * 100, vmax=lim * 100, shading="nearest")
        for k, policy in enumerate(policies):
            z = np.array([[next(r["gain"] for r in mine if r["kv_seqs"] == kv and r["ratio"] == ratio
                                and r["policy"] == policy) for ratio in ratios] for kv in kvs])
            # A policy that offloads nothing ties the best single backend to the microsecond;
            # the line marks where it pays more than PAYS (1 %), so ties read as "does not pay".
            z = np.where(z > PAYS, z, -PAYS)
            if np.nanmin(z) < 0 < np.nanmax(z):
                cs = ax.contour(ratios, kvs, z, levels=[0.0], colors="k", linestyles=styles[k % len(styles)])
                ax.clabel(cs, fmt={0.0: policy}, fontsize=7)
        r, kv = markers[name]
        ax.plot([r], [kv], marker="*", color="gold", markeredgecolor="k", markersize=16, linestyle="none")
        ax.annotate(name, (r, kv), textcoords="offset points", xytext=(8, 8), fontsize=9, weight="bold")
        ax.set_xscale("log")
        ax.set_yscale("log", base=2)
        ax.set_xlabel("second backend's decode throughput / first's")
        ax.set_ylabel("first backend's KV room (sequences)")
        ax.set_title(f"base: {name}", fontsize=10)
        fig.colorbar(mesh, ax=ax, label="best hybrid gain over best single backend, %")
    fig.suptitle(f"Where hybrid routing pays (the study's workload, N={rows[0].get('requests', 48)} every 50 ms); "
                 f"black lines: where each policy starts to gain > {PAYS:.0%} (solid seed-score, dashed "
                 f"predicted-finish)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
