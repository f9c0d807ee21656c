"""What-if: the real router and the real schedulers on simulated hardware, on a virtual clock.

The step model, what it leaves out, and the profiles: docs/design/sim.md.

Thread contract: none. A `Simulation` is used by one thread; profiles are immutable values."""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from engine.core.decision import RoutingDecision
from engine.core.errors import InvalidRequest
from engine.core.request import Request, RequestStatus, SamplingParams
from engine.core.snapshot import BackendSnapshot, CacheStats, Rates
from engine.routing import RouteQuery, Router
from engine.sched.limiter import CEILING, START, ConcurrencyLimiter
from engine.sched.scheduler import Finished, Plan, Scheduler, SeqState, default_seq_slots
from engine.sim.benchmark import RequestRecord, decision_line
from engine.sim.workload import RequestSpec, Workload

Events = list[tuple[float, int, int, Any]]  # the simulation's heap: (time, order, kind, payload)
Submitted = dict[str, tuple[int, RequestSpec, float]]  # request id -> (index, spec, submitted at)

SAMPLED_TOKEN = 300  # the token every simulated logits row samples (never an end token here)


# ---- profiles ----


@dataclass(frozen=True)
class BackendProfile:
    """One simulated backend: its speed, its KV room and its cap.

    `rates` is what the router is told; `hardware` what the device does (None: the same).
    `cap` 0 is the engine's default, an adaptive cap: the real limiter (engine/sched/limiter.py) fed
    each simulated step, from the device's `START` up to `ceiling` (0: the device's `CEILING`).
    `kv_cells` is the context's size in KV cells (0: room for `cap` (or the ceiling) sequences of
    the workload, computed by the simulation); `busy_chunk` the prompt chunk while others wait
    (0: the engine's default, `n_batch` on a GPU and `n_batch // 8` on a CPU).
    """

    name: str
    device: str
    rates: Rates
    cap: int = 4
    kv_cells: int = 0
    n_batch: int = 512
    busy_chunk: int = 0
    hardware: Rates | None = None
    chunk_overhead_s: float = 0.0  # additive model: what a step carrying a prompt chunk costs beyond its tokens
    # Fixed-cost model (`chunk_fixed_s` > 0): a prompt chunk of p tokens costs
    # `chunk_fixed_s + p * k` on top of the decode step, where `k` makes a `prefill_ref_tokens`
    # prompt alone take what the calibrated prefill rate says (the rate was measured on such
    # prompts, so it already contains the fixed cost once).
    chunk_fixed_s: float = 0.0
    prefill_ref_tokens: int = 512
    admit_s: float = 0.0  # host work per request admitted in a step (sequence setup), on the step
    ceiling: int = 0  # an adaptive cap's (`cap` 0) ceiling; 0: the device's `CEILING`

    @property
    def hw(self) -> Rates:
        return self.hardware or self.rates

    @property
    def adaptive(self) -> bool:
        return self.cap == 0

    @property
    def kind(self) -> str:
        return "cpu" if self.device == "cpu" else "gpu"

    @property
    def most(self) -> int:
        """The most sequences it may run at once: its cap, or an adaptive cap's ceiling."""
        return self.cap or self.ceiling or CEILING[self.kind]

    def step_seconds(self, n_decode: int, n_prefill: int, n_admitted: int = 0, cells: float | None = None,
                     kv: float | None = None) -> float:
        """Seconds one step with `n_decode` decode rows and `n_prefill` prompt tokens takes
        (`n_admitted` of its sequences new this step), over `cells` KV cells a row (None: the
        calibrated context, whatever it was) in a pool of `kv` cells (None: as calibrated)."""
        hw = self.hw
        s = (hw.step_s(n_decode) if cells is None else hw.step_at(n_decode, cells, kv)) if n_decode else 0.0
        if n_prefill:
            if hw.prefill_tok_s <= 0:
                return math.inf
            if self.chunk_fixed_s > 0:
                ref = max(self.prefill_ref_tokens, 1)
                k = max(ref / hw.prefill_tok_s - self.chunk_fixed_s, 0.0) / ref
                s += self.chunk_fixed_s + n_prefill * k
            else:
                s += self.chunk_overhead_s + n_prefill / hw.prefill_tok_s
        return s + n_admitted * self.admit_s

    def chunk(self) -> int:
        if self.busy_chunk:
            return self.busy_chunk
        return self.n_batch if self.device != "cpu" else max(self.n_batch // 8, 1)

    def to_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("rates", "hardware")}
        d["rates"] = _rates_dict(self.rates)
        if self.hardware is not None:
            d["hardware"] = _rates_dict(self.hardware)
        return d

    @classmethod
    def from_dict(cls, d: Mapping) -> BackendProfile:
        try:
            hardware = d.get("hardware")
            return cls(name=str(d["name"]), device=str(d.get("device", "gpu")), rates=_rates(d["rates"]),
                       cap=int(d.get("cap", 4)), kv_cells=int(d.get("kv_cells", 0)),
                       n_batch=int(d.get("n_batch", 512)), busy_chunk=int(d.get("busy_chunk", 0)),
                       hardware=_rates(hardware) if hardware else None,
                       chunk_overhead_s=float(d.get("chunk_overhead_s", 0.0)),
                       chunk_fixed_s=float(d.get("chunk_fixed_s", 0.0)),
                       prefill_ref_tokens=int(d.get("prefill_ref_tokens", 512)),
                       admit_s=float(d.get("admit_s", 0.0)), ceiling=int(d.get("ceiling", 0)))
        except (KeyError, TypeError, ValueError) as e:
            raise InvalidRequest(f"bad backend profile {dict(d)!r}: {e!r}") from None


@dataclass(frozen=True)
class Profile:
    """A named set of simulated backends, in routing order (the first GPU is the swept one)."""

    name: str
    backends: tuple[BackendProfile, ...]
    description: str = ""

    def backend(self, name: str) -> BackendProfile:
        for b in self.backends:
            if b.name == name:
                return b
        raise InvalidRequest(f"profile {self.name!r} has no backend {name!r} "
                             f"({', '.join(b.name for b in self.backends)})")

    def with_backend(self, b: BackendProfile) -> Profile:
        return replace(self, backends=tuple(b if x.name == b.name else x for x in self.backends))

    def to_dict(self) -> dict:
        return {"name": self.name, "description": self.description,
                "backends": [b.to_dict() for b in self.backends]}

    @classmethod
    def from_dict(cls, d: Mapping) -> Profile:
        backends = d.get("backends")
        if not isinstance(backends, list) or not backends:
            raise InvalidRequest("a profile needs a non-empty 'backends' list")
        return cls(name=str(d.get("name", "custom")), description=str(d.get("description", "")),
                   backends=tuple(BackendProfile.from_dict(b) for b in backends))


def _rates(d: Mapping) -> Rates:
    table = tuple(float(x) for x in d.get("step_table", ()) or ())
    return Rates(float(d["prefill_tok_s"]), float(d["decode_tok_s"]), float(d.get("step_alpha_s", 0.0)),
                 float(d.get("step_beta_s", 0.0)), str(d.get("source", "profile")), table,
                 step_gamma_s=float(d.get("step_gamma_s", 0.0)),  # profiles without a context term: 0
                 step_cells=tuple(float(x) for x in d.get("step_cells", ()) or ()),
                 step_delta_s=float(d.get("step_delta_s", 0.0)),  # profiles without the masked scan: 0
                 step_kv=tuple(float(x) for x in d.get("step_kv", ()) or ()))


def _rates_dict(r: Rates) -> dict:
    d = asdict(r)
    d["step_table"] = list(r.step_table)
    d["step_cells"] = list(r.step_cells)
    d["step_kv"] = list(r.step_kv)
    return d


# The article's M2 (docs/study.md): GPU 2,551 / 293 tok/s, CPU 73 / 45, cap 4 each. With no step
# table, a step at batch b takes b / decode_tok_s: the device's decode throughput is shared.
STUDY_M2 = Profile("study-m2", (
    BackendProfile("gpu", "gpu", Rates(2551.0, 293.0, source="article")),
    BackendProfile("cpu", "cpu", Rates(73.0, 45.0, source="article")),
), "the seed study's Apple M2 (docs/study.md): GPU 2,551 / 293 tok/s, CPU 73 / 45, cap 4 each")

# The article's measured makespans imply a GPU far slower than its profiled 293 tok/s: 8 x 128
# tokens took 11.47 s GPU-only (89 tok/s) and 48 x 128 took 68.43 s (90 tok/s). Its states
# at requests 7 and 8 (4 tokens decoded per running request 0.15-0.30 s after admission, 2 more
# in the next 50 ms) imply about 40 tok/s per sequence. This profile keeps the router's rates
# (what the author's router was told) and gives the device the measured 90 tok/s at batch 4.
STUDY_M2_SLOW = Profile("study-m2-slow", (
    BackendProfile("gpu", "gpu", Rates(2551.0, 293.0, source="article"),
                   hardware=Rates(2551.0, 90.0, source="article's makespans")),
    BackendProfile("cpu", "cpu", Rates(73.0, 45.0, source="article")),
), "the M2 as its makespans measured it: the router told 293 tok/s, the GPU doing 90")

# The H200 (synthetic Qwen2.5-0.5B Q8_0; GPU 8 host threads, CPU 15 threads).
#
# The router is told the committed calibration (docs/results/gpu/grid2/rates.json, still what
# the engine's rate store serves): GPU step table at batch 1..16,
# alpha + beta*b beyond; CPU batch 1..4.
#
# The device does what today's engine measures, apart from the replayed runs:
# - decode steps: greedy engine decode at B = 1, 4, 16, 32, 64, 128 with 516-token prompts
#   (docs/results/gpu/round2/overhead_gpu_sampling.txt, engine_bB, median of 3: 808, 2064,
#   3679, 5726, 7928, 8614 tok/s). The calibrated table's shape at 1..16 (its jump between
#   8 and 9) is kept and scaled to those points (x1.00 at 1, x0.97 at 4, x0.85 at 16, linear
#   between); past 16 the step is linear between the measured points. Both tables were taken
#   at ~520-650 KV cells per sequence, so they cannot separate a context-length term from the
#   batch term: the model has none (the grid's prompts are the same 516 tokens).
# - a prompt chunk of p tokens costs `chunk_fixed_s + p*k` on top of the decode step, with k
#   such that a 512-token prompt alone takes what the calibrated 53,514 tok/s says (9.57 ms).
#   3.2 ms fixed: docs/results/gpu/speed9/prefill_gpu.txt, a 2,048-token prompt in 256- vs
#   512-token chunks (9.4 vs 12.6 ms per chunk: 12.5 us a token, so 9.57 - 512*0.0125 ms).
#   The old model added 3 ms to the full rate's cost, counting the fixed cost twice.
# - 0.5 ms per request admitted in a step (sequence and sampler setup on the worker): the one
#   fitted number, fitted on docs/results/gpu/grid2/grid-open alone (it minimises the median
#   TTFT p50 error there over 0-1.5 ms) and validated on grid-kv and both boundary runs
#   (docs/results/simulate/gpu-grid2.md).
# Both backends have the engine's default adaptive caps (cap 0), as `tandem serve --model M`
# makes them; `--set gpu.cap=16` (or a grid's `--caps`) fixes one.
_H200_CALIBRATED_TABLE = (0.0012400, 0.0016133, 0.0017627, 0.0019968, 0.0023091, 0.0025667, 0.0028006, 0.0030280,
                          0.0045841, 0.0046991, 0.0047219, 0.0048108, 0.0049083, 0.0049837, 0.0050488, 0.0051355)
_H200_ENGINE_STEP = {1: 1 / 808.19, 4: 4 / 2064.02, 16: 16 / 3679.22, 32: 32 / 5725.58, 64: 64 / 7927.94,
                     128: 128 / 8613.69}  # seconds per step, round2/overhead_gpu_sampling.txt


def _interp(x: float, points: Mapping[int, float]) -> float:
    xs = sorted(points)
    for a, b in itertools.pairwise(xs):
        if x <= b:
            return points[a] + (points[b] - points[a]) * (x - a) / (b - a)
    return points[xs[-1]]


def _h200_gpu_table() -> tuple[float, ...]:
    """Today's engine's GPU step at batch 1..128 (see above)."""
    ratio = {b: _H200_ENGINE_STEP[b] / _H200_CALIBRATED_TABLE[b - 1] for b in (1, 4, 16)}
    low = [t * _interp(b, ratio) for b, t in enumerate(_H200_CALIBRATED_TABLE, 1)]
    return tuple(low + [_interp(b, _H200_ENGINE_STEP) for b in range(17, 129)])


H200 = Profile("h200", (
    BackendProfile("gpu", "gpu", Rates(53514.1, 3115.6, 0.0010097, 0.00029451, "calibrated", _H200_CALIBRATED_TABLE),
                   cap=0, kv_cells=16384, chunk_fixed_s=0.0032, admit_s=0.0005,
                   hardware=Rates(53514.1, 3115.6, 0.0010097, 0.00029451, "engine microbenchmarks", _h200_gpu_table())),
    BackendProfile("cpu", "cpu", Rates(1969.7, 128.0, 0.0208902, 0.0026692, "calibrated",
                                       (0.0230551, 0.0269214, 0.0290254, 0.0312511)), cap=0, kv_cells=4096),
), "one H200 + 15 Xeon cores, synthetic Qwen2.5-0.5B Q8_0: the router told docs/results/gpu/grid2/rates.json, "
   "the GPU stepping as today's engine measures (docs/results/simulate/README.md)")

PROFILES: dict[str, Profile] = {p.name: p for p in (STUDY_M2, STUDY_M2_SLOW, H200)}


def profile_from_calibration(name: str, entries: Sequence[Mapping], caps: Mapping[str, int] | None = None,
                             description: str = "") -> Profile:
    """A profile from stored calibration entries (`engine.rates`'s store format: each with
    `backend`, `device`, `cap`, `prefill_tok_s`, `decode_tok_s`, `step_alpha_s`, `step_beta_s`,
    `step_s` {batch: seconds}, and where measured `admit_s`, `rates.step_gamma_s`/`step_cells`,
    the context term, and `rates.step_delta_s`/`step_kv`, the masked scan; older entries lack
    them and step at the table's context and pool). Backends named alike get a numeric suffix."""
    if not entries:
        raise InvalidRequest(f"profile {name!r}: no calibration entries")
    out, seen = [], set()
    for e in entries:
        table = tuple(float(v) for _, v in sorted(((int(k), v) for k, v in (e.get("step_s") or {}).items())))
        stored = e.get("rates") or {}
        rates = Rates(float(e["prefill_tok_s"]), float(e["decode_tok_s"]), float(e.get("step_alpha_s", 0.0)),
                      float(e.get("step_beta_s", 0.0)), "calibrated", tuple(stored.get("step_table") or table),
                      step_gamma_s=float(stored.get("step_gamma_s", 0.0)),
                      step_cells=tuple(float(c) for c in stored.get("step_cells") or ()),
                      step_delta_s=float(stored.get("step_delta_s", 0.0)),
                      step_kv=tuple(float(c) for c in stored.get("step_kv") or ()))
        bname = str(e.get("backend") or e.get("device") or "backend")
        k = 1
        while bname in seen:
            bname = f"{e.get('backend') or 'backend'}{k}"
            k += 1
        seen.add(bname)
        cap = int((caps or {}).get(bname, e.get("cap", 4)))
        out.append(BackendProfile(bname, str(e.get("device", "cpu")), rates, cap=cap,
                                  admit_s=float(e.get("admit_s", 0.0))))
    return Profile(name, tuple(out), description)


def profile_from_snapshots(name: str, snapshots: Sequence[BackendSnapshot], description: str = "") -> Profile:
    """A running engine's backends as a profile: their rates, caps and KV sizes right now."""
    return Profile(name, tuple(BackendProfile(s.name, s.device, s.rates, cap=s.cap, kv_cells=s.kv_cells_total or s.n_ctx)
                               for s in snapshots), description)


def apply_overrides(profile: Profile, settings: Iterable[str]) -> Profile:
    """`BACKEND.FIELD=VALUE` edits: `cap` (0: adaptive), `ceiling`, `kv_cells`, `n_batch`, `busy_chunk`, `device`, the
    step costs `chunk_fixed_s`, `admit_s`, `chunk_overhead_s`, `prefill_ref_tokens`, or a
    rate (`prefill_tok_s`, `decode_tok_s`, `step_alpha_s`, `step_beta_s`, `step_gamma_s`, `step_delta_s`) set on both the
    router's rates and the hardware; `hardware.RATE=` or `rates.RATE=` set one side only;
    `speed=X` multiplies the hardware's speed (every rate x X, every step time and fixed cost / X)."""
    for text in settings:
        key, eq, value = (s.strip() for s in text.partition("="))
        name, dot, attr = key.partition(".")
        if not eq or not dot:
            raise InvalidRequest(f"--set {text!r}: expected BACKEND.FIELD=VALUE")
        b = profile.backend(name)
        try:
            number = float(value) if attr != "device" else 0.0
        except ValueError:
            raise InvalidRequest(f"--set {text!r}: {value!r} is not a number") from None
        if attr in ("cap", "kv_cells", "n_batch", "busy_chunk", "ceiling"):
            ints: dict[str, Any] = {attr: int(number)}
            b = replace(b, **ints)
        elif attr in ("chunk_overhead_s", "chunk_fixed_s", "admit_s"):
            floats: dict[str, Any] = {attr: number}
            b = replace(b, **floats)
        elif attr == "prefill_ref_tokens":
            b = replace(b, prefill_ref_tokens=int(number))
        elif attr == "device":
            b = replace(b, device=value)
        elif attr == "speed":
            b = _costs_scaled(replace(b, hardware=_faster(b.hw, number)), number)
        else:
            side, _, rate = attr.rpartition(".")
            if rate not in _RATE_FIELDS or side not in (
                    "", "hardware", "rates"):
                raise InvalidRequest(f"--set {text!r}: unknown field {attr!r}")
            if side in ("", "rates"):
                b = replace(b, rates=_set_rate(b.rates, rate, number), hardware=b.hardware)
            if side in ("", "hardware") and (b.hardware is not None or side == "hardware"):
                b = replace(b, hardware=_set_rate(b.hw if side == "hardware" else b.hardware or b.rates, rate, number))
        profile = profile.with_backend(b)
    return profile


_RATE_FIELDS = ("prefill_tok_s", "decode_tok_s", "step_alpha_s", "step_beta_s", "step_gamma_s", "step_delta_s")


def _set_rate(r: Rates, field_name: str, value: float) -> Rates:
    change: dict[str, Any] = {field_name: value, "source": "edited"}
    r = replace(r, **change)
    if field_name == "decode_tok_s" and r.step_table:  # the measured steps no longer hold
        r = replace(r, step_table=(), step_alpha_s=0.0, step_beta_s=0.0)
    return r


def _faster(r: Rates, x: float) -> Rates:
    if x <= 0:
        raise InvalidRequest(f"speed must be > 0, got {x}")
    alpha, beta, table = r.scaled(1.0 / x)
    return Rates(r.prefill_tok_s * x, r.decode_tok_s * x, alpha, beta, "edited", table,
                 step_gamma_s=r.step_gamma_s / x, step_cells=r.step_cells, step_delta_s=r.step_delta_s / x,
                 step_kv=r.step_kv)


def scaled_profile(profile: Profile, backend: str, speed: float, rates_too: bool = True) -> Profile:
    """`backend` made `speed` times faster (hardware, and the router's rates if `rates_too`)."""
    b = profile.backend(backend)
    hw = _faster(b.hw, speed)
    b = replace(b, hardware=hw, rates=_faster(b.rates, speed) if rates_too else b.rates)
    return profile.with_backend(_costs_scaled(b, speed))


def _costs_scaled(b: BackendProfile, x: float) -> BackendProfile:
    """`b`'s fixed per-chunk and per-admission costs divided by `x` (a device `x` times faster)."""
    return replace(b, chunk_overhead_s=b.chunk_overhead_s / x, chunk_fixed_s=b.chunk_fixed_s / x,
                   admit_s=b.admit_s / x)


# ---- the simulation ----


@dataclass
class SimRun:
    """One simulated run: its records and routing decisions, in `bench`'s formats."""

    records: list[RequestRecord] = field(default_factory=list)
    decisions: list[dict] = field(default_factory=list)
    steps: int = 0
    states: list[dict] = field(default_factory=list)  # per arrival: what each backend held


@dataclass
class _DecodeRun:
    """`m` decode steps from `t0` over the same running sequences, none of which finishes,
    with nothing to admit: the first takes `d` seconds and each next `g` more (its rows attend
    over the cells the last one added: `g` is 0 without a context term); `done` applied so far."""

    t0: float
    d: float
    m: int
    seqs: list
    done: int = 0
    g: float = 0.0

    def end(self, k: int) -> float:
        """When the `k`-th step of the run ends."""
        return self.t0 + k * self.d + self.g * k * (k - 1) / 2

    def _steps_by(self, now: float) -> int:
        """How many steps ended by `now` (of `m`)."""
        if self.d <= 0 and self.g <= 0:
            return self.m
        x = now - self.t0
        if self.g <= 0:
            k = int(x / self.d + 1e-9)
        else:  # the larger root of g/2 k^2 + (d - g/2) k - x = 0, then exact on the boundary
            a, b = self.g / 2, self.d - self.g / 2
            k = max(int((-b + math.sqrt(max(b * b + 4 * a * x, 0.0))) / (2 * a)), 0)
            while k < self.m and self.end(k + 1) <= now + 1e-9:
                k += 1
            while k > 0 and self.end(k) > now + 1e-9:
                k -= 1
        return min(max(k, 0), self.m)

    def apply_until(self, now: float) -> None:
        """Apply the steps that ended by `now`, as `update_from_output` would have."""
        j = self._steps_by(now) - self.done
        if j <= 0:
            return
        t_last = self.end(self.done + j)
        more = [SAMPLED_TOKEN] * j
        for s in self.seqs:
            s.n_past += j
            s.tokens.extend(more)
            s.generated += j
            s.itl_sum += t_last - s.t_last
            s.t_last = t_last
        self.done += j


class _SimBackend:
    """A real scheduler behind a simulated runner."""

    def __init__(self, profile: BackendProfile, n_ctx: int, clock: Callable[[], float]):
        self.p = profile
        self.rates = profile.rates
        limiter = ConcurrencyLimiter(profile.most, initial=START[profile.kind]) if profile.adaptive else None
        self.sched = Scheduler(cap=profile.cap or 1, n_ctx=n_ctx, n_ctx_seq=n_ctx,
                               n_seq_max=default_seq_slots(profile.most, profile.device), n_batch=profile.n_batch,
                               busy_chunk=profile.chunk(), name=profile.name, piece=_no_text, clock=clock,
                               limiter=limiter)
        self.plan: Plan | None = None  # the step in flight
        self.plan_s = 0.0  # its seconds (an adaptive cap's limiter is fed them)
        self.busy = False
        self.gen = 0  # the valid step-end event's generation (a truncated run leaves a stale one)
        self.run: _DecodeRun | None = None  # decode steps fast-forwarded in bulk

    def snapshot(self, now: float) -> BackendSnapshot:
        s = self.sched
        items = tuple(q.work_item(True) for q in s.running) + tuple(q.work_item(False) for q in s.waiting)
        c = s.cache
        return BackendSnapshot(name=self.p.name, device=self.p.device, cap=s.cap, n_ctx=s.n_ctx, rates=self.rates,
                               items=items, kv_cells_used=s.kv_cells_used(), kv_cells_total=s.n_ctx,
                               cache=CacheStats(enabled=s.cache_enabled, cached_tokens=c.cached_tokens,
                                                pinned_tokens=c.pinned_tokens), time=now)


class Simulation:
    """Runs one workload under one policy on a profile; `run()` returns a `SimRun`.

    `cells_per_seq` sizes a backend whose `kv_cells` is 0 (room for `cap` of the workload's
    sequences). `arrivals`/`outputs` replace the workload's arrival times and output lengths
    (a replay uses the measured ones). `label` names the policy column of the records;
    `on_done()` is called as each request ends.

    `fast` (default) fast-forwards runs of identical decode steps: when a step decodes every
    running sequence, prefills nothing and admits nothing, the steps until the first of them
    could finish (or the KV would run short) are the same step repeated, so they are applied
    in bulk — the same tokens, times and ITLs — and the step that finishes one goes through
    `update_from_output` as usual. An arrival routed to the backend cuts the run short at the
    step in flight, and every routing decision first applies the steps that ended before it,
    so the router sees what it would have seen. `tests/test_simulate.py` checks that both
    ways give the same records.
    """

    def __init__(self, profile: Profile, workload: Workload, policy: str, *, budget: str = "raw",
                 label: str | None = None, arrivals: Sequence[float] | None = None,
                 outputs: Sequence[int] | None = None, record_states: bool = False, fast: bool = True,
                 on_done: Callable[[], None] | None = None):
        self.profile = profile
        self.workload = workload
        self.label = label or policy
        self.now = 0.0
        per_seq = max((len(r.prompt) + r.max_tokens for r in workload.requests), default=1)
        clock = self._clock
        self.backends = [_SimBackend(b, b.kv_cells or max(b.most, 1) * per_seq + 64, clock)
                         for b in profile.backends]
        self.by_name = {b.p.name: b for b in self.backends}
        self.router = Router(policy, budget, clock=clock)
        self.arrivals = list(arrivals) if arrivals is not None else [r.arrival_s for r in workload.requests]
        self.outputs = list(outputs) if outputs is not None else [r.output_tokens for r in workload.requests]
        self.record_states = record_states
        self.fast = fast
        self.on_done = on_done  # called as each request ends (a progress bar)

    def _clock(self) -> float:
        return self.now

    def run(self) -> SimRun:
        out = SimRun()
        self._warm()
        wl = self.workload
        n = len(wl.requests)
        name = wl.spec.name()
        events: Events = []
        order = 0
        for i in range(len(wl.requests)):
            heapq.heappush(events, (self.arrivals[i], order, 0, i))
            order += 1
        submitted: Submitted = {}
        while events:
            t, _, kind, payload = heapq.heappop(events)
            self.now = t
            if kind == 0:
                i = payload
                spec = wl.requests[i]
                out_len = self.outputs[i]
                stop = out_len if out_len < spec.max_tokens else None
                req = Request(spec.prompt, SamplingParams(temperature=0.0, max_tokens=spec.max_tokens, ignore_eos=True),
                              id=f"sim-{i}", source="bench", stop_after=stop)
                b, decision = self._route(req, out)
                submitted[req.id] = (i, spec, t)
                if b.run is not None:  # admission is looked at again after the step in flight
                    r = b.run
                    r.m = min(r.m, r.done + 1)
                    b.gen += 1
                    heapq.heappush(events, (r.end(r.m), order, 1, (b, b.gen)))
                    order += 1
                out.decisions.append(decision_line(decision, 0.0, workload=name, run=wl.run, requests=n,
                                                   label=self.label))
                if not b.busy:
                    order = self._start(b, events, order, out, submitted, name, n)
            else:
                b, gen = payload
                if gen != b.gen:
                    continue
                if b.run is not None:
                    b.run.apply_until(t)
                    out.steps += b.run.m
                    b.run = None
                    order = self._start(b, events, order, out, submitted, name, n)
                else:
                    order = self._finish_step(b, events, order, out, submitted, name, n)
        return out

    # ---- internals ----

    def _warm(self) -> None:
        """The workload's shared prefix on every backend, in no time (before timing starts)."""
        prefix = self.workload.prefix
        if not prefix:
            return
        for b in self.backends:
            req = Request(tuple(prefix), SamplingParams(max_tokens=1, temperature=0.0), source="warm")
            b.sched.add(SeqState(req, None, None, b.sched.match_tokens(req.prompt_tokens), 0.0, warm=True))
            while b.sched.running or b.sched.waiting:
                plan = b.sched.schedule()
                b.sched.take_ops()
                b.sched.take_unplaced()
                if plan.empty:
                    break
                b.sched.update_from_output(plan, [SAMPLED_TOKEN] * _logit_rows(plan))
                b.sched.take_ops()

    def _route(self, req: Request, out: SimRun) -> tuple[_SimBackend, RoutingDecision]:
        for x in self.backends:
            if x.run is not None:
                x.run.apply_until(self.now)
        cached = {b.p.name: b.sched.match_tokens(req.prompt_tokens) for b in self.backends}
        query = RouteQuery.from_request(req, cached)
        snaps = [b.snapshot(self.now) for b in self.backends]
        if self.record_states:
            out.states.append({s.name: {"running_left": [w.decode_left for w in s.running],
                                        "queued": len(s.waiting)} for s in snaps})
        decision = self.router.route(query, snaps)
        b = self.by_name[decision.backend]
        estimate, pin = b.sched.pin_prefix(req.prompt_tokens)
        b.sched.add(SeqState(req, None, pin, estimate, self.now, n_ctx_seq=b.sched.n_ctx_seq))
        return b, decision

    def _start(self, b: _SimBackend, events: Events, order: int, out: SimRun, submitted: Submitted, name: str,
               n: int) -> int:
        """Plan `b`'s next step at `now` and schedule its end; nothing when it has no work
        (idle, or its queue waits for KV room only a finish frees)."""
        sched = b.sched
        b.busy = False
        if not (sched.running or sched.waiting):
            return order
        plan = sched.schedule()
        sched.take_ops()
        sched.take_unplaced()
        self._publish(b, sched.take_finished(), out, submitted, name, n)  # failed at admission
        if plan.empty:
            return order
        n_prefill = sum(k for _, _, k, _ in plan.chunks)
        b.busy = True
        b.gen += 1
        n_decode = len(plan.decode)
        cells = sum(s.n_past + 1 for s in plan.decode) / n_decode if n_decode else 0.0  # each row's context
        kv = self._pool(b, plan, n_prefill)
        d = b.p.step_seconds(n_decode, n_prefill, len(plan.admitted), cells, kv)
        m = self._steady_steps(b, plan) if self.fast and sched.limiter is None else 0  # a limiter sees every step
        if m > 1:  # each next step: a cell more per row, and in a unified pool `n_decode` more in the pool
            grow = sched.kv.step_growth(n_decode)
            g = (b.p.step_seconds(n_decode, 0, 0, cells + 1, kv + grow)
                 - b.p.step_seconds(n_decode, 0, 0, cells, kv))
            b.run = _DecodeRun(self.now, d, m, list(plan.decode), g=g)
            heapq.heappush(events, (b.run.end(m), order, 1, (b, b.gen)))
        else:
            b.plan, b.plan_s = plan, d
            heapq.heappush(events, (self.now + d, order, 1, (b, b.gen)))
        return order + 1

    @staticmethod
    def _pool(b: _SimBackend, plan: Plan, n_prefill: int) -> float:
        """The KV cells the step's rows scan (n_kv), as the layout says (KvLayout.scanned_cells)."""
        sched = b.sched
        return sched.kv.scanned_cells(sched.kv_cells_used(), plan.decode, len(plan.decode) + n_prefill)

    @staticmethod
    def _steady_steps(b: _SimBackend, plan: Plan) -> int:
        """How many times `plan` (a pure decode step of every running sequence) repeats
        unchanged before a sequence could finish or the KV run short; 0 if it is not one."""
        sched = b.sched
        if plan.chunks or plan.admitted or len(plan.decode) != len(sched.running) or sched.pending_text:
            return 0
        k = sched.n_ctx
        for s in plan.decode:
            stop = s.max_new if s.req.stop_after is None else min(s.max_new, s.req.stop_after)
            k = min(k, stop - s.generated, sched.n_ctx_seq - 1 - s.n_past)
        return min(k, sched.kv.decode_room(sched.kv_cells_used(), len(plan.decode))) - 1

    def _finish_step(self, b: _SimBackend, events: Events, order: int, out: SimRun, submitted: Submitted, name: str,
                     n: int) -> int:
        plan, b.plan = b.plan, None
        if plan is None:
            raise RuntimeError(f"backend {name}: a step finished that was never planned")
        out.steps += 1
        finished = b.sched.update_from_output(plan, [SAMPLED_TOKEN] * _logit_rows(plan), seconds=b.plan_s)
        b.sched.take_ops()
        b.sched.take_unplaced()
        self._publish(b, finished + b.sched.take_finished(), out, submitted, name, n)
        return self._start(b, events, order, out, submitted, name, n)

    def _publish(self, b: _SimBackend, finished: Sequence[Finished], out: SimRun, submitted: Submitted, name: str,
                 n: int) -> None:
        for f in finished:
            s = f.seq
            _i, spec, t_submit = submitted[s.req.id]
            ok = f.status in (RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_STOPPED)
            out.records.append(RequestRecord(
                workload=name, policy=self.label, run=self.workload.run, requests=n, index=spec.index,
                request_id=s.req.id, backend=b.p.name, success=ok, finish_reason=f.status.finish_reason,
                prompt_tokens=s.n_prompt, cached_tokens=s.n_shared, output_tokens=s.generated,
                t_submit_s=t_submit, queue_s=(s.t_admit or self.now) - t_submit,
                ttft_s=(s.t_first - t_submit) if s.generated else None, e2e_s=self.now - t_submit,
                itl_s=s.itl_sum / (s.generated - 1) if s.generated > 1 else None, error=f.error))
            if self.on_done is not None:
                self.on_done()


def _no_text(token: int) -> Any:
    """A simulated token's bytes: none (the streams stay empty, so no stop string ends a run)."""
    return b""


def _logit_rows(plan: Plan) -> int:
    return len(plan.decode) + sum(1 for c in plan.chunks if c[3])


def simulate(profile: Profile, workload: Workload, policy: str, **kw: Any) -> SimRun:
    """One run of `workload` under `policy` on `profile` (see `Simulation`)."""
    return Simulation(profile, workload, policy, **kw).run()
