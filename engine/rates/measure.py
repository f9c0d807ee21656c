"""Measuring a backend's rates: `calibrate_backend` measures one the way it can be seen (its
`calibrate` picks): `calibrate_steps` times prefill and decode steps on one idle local backend,
`calibrate_remote` times an OpenAI-compatible engine by sending it requests, and
`calibrate_at_load` is the short version `Engine.load(calibrate=True)` runs before serving, so
the router never prices a backend with placeholder rates. What is measured, and why before
serving: docs/design/rates.md."""

from __future__ import annotations

import logging
import random
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

from engine.backends.config import BackendConfig
from engine.backends.protocol import BackendProtocol
from engine.core.errors import InvalidRequest
from engine.core.events import StepDone
from engine.core.request import FinishRecord, Request, SamplingParams
from engine.core.snapshot import Rates
from engine.core.tokenizer import TOKEN_HIGH, TOKEN_LOW
from engine.rates.fit import OWN_TOKENS, Calibration, calibration_cells, fit_step_model, fit_step_terms
from engine.rates.store import RateStore, config_key, save_calibration

log = logging.getLogger(__name__)

CALIBRATION_PROMPT = 512
CALIBRATION_GEN = 32

Progress = Callable[[int, int, str], None]  # (done, total, what is being measured)


class SteppedBackend(BackendProtocol, Protocol):
    """A backend whose batched steps run in this process (engine/backends/local.py `Backend`),
    as `calibrate_steps` times it: it publishes `StepDone` on `bus`, its worker takes `call`s,
    and `model` is the llama.cpp model it runs."""

    config: BackendConfig  # as resolved for its device
    n_ctx: int  # KV cells of its context, all sequences together

    def set_cap(self, cap: int | None, adaptive: bool | None = None, reason: str | None = None) -> None:
        """`BackendProtocol.set_cap`, with the `reason` its snapshot shows for the cap."""
        ...

    def call(self, fn: Callable[[Any], object]) -> Future:
        """Run `fn(backend)` on its worker thread between steps; the future holds the result."""
        ...

    def kv_cells_used(self) -> int:
        """KV cells in use now, cached prefixes included."""
        ...


def default_batches(cap: int) -> list[int]:
    """Batch sizes to time: every one up to 16 (GPU kernels change shape there: on the H200
    b = 9 steps slower per token than b = 8), then a few up to the cap; the table between them
    is interpolated (`step_table`)."""
    sparse = [b for b in (24, 32, 48, 64, 96, 128, 192) if 16 < b < cap]
    return list(range(1, min(cap, 16) + 1)) + sparse + ([cap] if cap > 16 else [])


CONTEXT_PROMPT = 128  # `tandem calibrate`'s short context (the grid's prompts)
CONTEXT_GEN = 16
CONTEXT_BATCH = 8  # the short context's largest batch


def context_batches(fits: Sequence[int]) -> list[int]:
    """The batches timed again at the short context: 1 and the largest that fits up to 8."""
    top = max((b for b in fits if b <= CONTEXT_BATCH), default=1)
    return sorted({1, top})


def progress_steps(cap: int, batches: Sequence[int] | None, repeats: int, context_tokens: int) -> int:
    """How many steps `calibrate_backend` reports to `progress` (before any batch is skipped)."""
    return _n_steps(sorted(set(batches or default_batches(cap))), repeats, bool(context_tokens))


def _n_steps(fits: Sequence[int], repeats: int, context: bool) -> int:
    """Warm-up, prefill runs, one per batch, and with the context term: its batches, the host
    cost and the unshared pass (or its skip)."""
    c_batches = context_batches(fits)
    return 1 + repeats + len(fits) + (len(c_batches) + 1 + (c_batches[-1] > 1) if context else 0)


def calibrate_backend(backend: BackendProtocol, *, prompt_tokens: int = CALIBRATION_PROMPT,
                      gen_tokens: int = CALIBRATION_GEN, batches: Sequence[int] | None = None,
                      repeats: int = 3, seed: int = 0, timeout: float = 600.0,
                      progress: Progress | None = None, context_tokens: int = 0,
                      context_gen: int = CONTEXT_GEN) -> Calibration:
    """Measure one idle, started backend the way it can be seen (`BackendProtocol.calibrate`):
    by its own steps (`calibrate_steps`), or by requests sent to it (`calibrate_remote`).

    Raises InvalidRequest for sizes that cannot work, and for a backend with nothing to measure.
    """
    if prompt_tokens < 8 or gen_tokens < 4 or repeats < 1:
        raise InvalidRequest("calibration needs prompt_tokens >= 8, gen_tokens >= 4, repeats >= 1")
    return backend.calibrate(_Measure(dict(prompt_tokens=prompt_tokens, gen_tokens=gen_tokens, batches=batches,
                                           repeats=repeats, seed=seed, timeout=timeout, progress=progress),
                                      dict(context_tokens=context_tokens, context_gen=context_gen)))


def calibration_steps(backend: BackendProtocol, batches: Sequence[int] | None, repeats: int,
                      context_tokens: int) -> int:
    """How many steps `calibrate_backend` will report to `progress` for `backend`."""
    return backend.calibrate(_Count(batches, repeats, context_tokens))


class _Measure:
    """`calibrate_backend`'s two ways, with its options (`stepped`: the steps' own)."""

    def __init__(self, options: dict[str, Any], stepped: dict[str, Any]):
        self.options, self.stepped = options, stepped

    def by_steps(self, backend: SteppedBackend) -> Calibration:
        return calibrate_steps(backend, **self.options, **self.stepped)

    def by_requests(self, backend: BackendProtocol) -> Calibration:
        return calibrate_remote(backend, **self.options)


class _Count:
    """The progress steps of each way (`calibration_steps`)."""

    def __init__(self, batches: Sequence[int] | None, repeats: int, context_tokens: int):
        self.batches, self.repeats, self.context_tokens = batches, repeats, context_tokens

    def by_steps(self, backend: SteppedBackend) -> int:
        return progress_steps(backend.cap, self.batches, self.repeats, self.context_tokens)

    def by_requests(self, backend: BackendProtocol) -> int:
        return 1 + self.repeats + len(set(self.batches or range(1, backend.cap + 1)))


def calibrate_steps(backend: SteppedBackend, *, prompt_tokens: int = CALIBRATION_PROMPT,
                    gen_tokens: int = CALIBRATION_GEN, batches: Sequence[int] | None = None,
                    repeats: int = 3, seed: int = 0, timeout: float = 600.0,
                    progress: Progress | None = None, context_tokens: int = 0,
                    context_gen: int = CONTEXT_GEN) -> Calibration:
    """Measure one idle, started local backend by its steps (see the module docstring). Its
    prefix cache is flushed. `context_tokens` > 0 also measures the context term and the host
    cost per request there. A batch that does not fit the context is skipped with a note."""
    t_start = time.monotonic()
    notes: list[str] = []
    shape = _StepShape.fit(backend, prompt_tokens, gen_tokens, batches, context_tokens, notes)
    probe = _Probe(backend, seed, timeout)
    tick = _ticker(progress, backend.name, _n_steps(shape.fits, repeats, bool(shape.short)))
    old = backend.cap_state()
    old_cap, old_adaptive = (None if old.auto else old.cap), old.adaptive
    old_reason = backend.snapshot().cap_reason or None  # restored below: calibration is not the user
    backend.set_cap(max(max(shape.fits), backend.cap), adaptive=False)  # fixed: each batch runs b at once
    try:
        times = _time_steps(backend, probe, shape, gen_tokens, context_gen, repeats, tick, notes)
    finally:
        probe.close()
        backend.set_cap(old_cap, adaptive=old_adaptive, reason=old_reason)
        try:
            backend.flush().result(timeout)
        except Exception:  # a stopped backend has nothing left to flush
            pass
    if not times.step_s:
        raise InvalidRequest(f"{backend.name}: no decode step could be measured")
    return _fitted(backend, shape, times, gen_tokens, context_gen, notes, time.monotonic() - t_start)


@dataclass(frozen=True)
class _StepShape:
    """What `calibrate_steps` can time on a backend's context: the prompt, the batch sizes that
    fit, and the short context's batches and unshared pass (0 where not measured)."""

    prompt: int
    fits: list[int]
    short: int  # the short context's tokens (0: no context term)
    c_batches: list[int]
    scan: int  # the unshared pass's batch

    @classmethod
    def fit(cls, backend: SteppedBackend, prompt_tokens: int, gen_tokens: int, batches: Sequence[int] | None,
            context_tokens: int, notes: list[str]) -> _StepShape:
        """The shape, with a note for each part cut to fit; InvalidRequest where nothing fits."""
        n_ctx = backend.n_ctx
        prompt = min(prompt_tokens, n_ctx - gen_tokens - OWN_TOKENS - 2)
        if prompt < 8:
            raise InvalidRequest(f"{backend.name}: context of {n_ctx} cells is too small to calibrate")
        if prompt < prompt_tokens:
            notes.append(f"prompt shortened to {prompt} tokens to fit the {n_ctx}-cell context")
        wanted = sorted(set(batches or default_batches(backend.cap)))
        if not wanted or wanted[0] < 1:
            raise InvalidRequest(f"batches must be >= 1, got {list(batches or [])}")
        per_seq = OWN_TOKENS + gen_tokens + 1
        fits = [b for b in wanted if prompt + b * per_seq <= n_ctx and b <= backend.config.n_seq_max - 1]
        if len(fits) < len(wanted):
            notes.append(f"skipped batches {sorted(set(wanted) - set(fits))}: they do not fit "
                         f"{n_ctx} KV cells / {backend.config.n_seq_max} sequences")
        if not fits:
            raise InvalidRequest(f"{backend.name}: no batch size fits the context; lower --gen-tokens or raise ctx")
        short = context_tokens
        if context_tokens and not 8 <= context_tokens <= prompt // 2:  # closer contexts cannot separate γ·b·c from β·b
            notes.append(f"context term not measured: the short context ({context_tokens}) must be >= 8 tokens "
                         f"and at most half the prompt ({prompt})")
            short = 0
        c_batches = context_batches(fits) if short else []
        scan = c_batches[-1] if c_batches and c_batches[-1] > 1 else 0  # the unshared pass's batch
        if scan and scan * (short + per_seq) > n_ctx:
            notes.append(f"masked scan not measured: {scan} unshared {short}-token sequences do not fit {n_ctx} KV cells")
            scan = 0
        return cls(prompt, fits, short, c_batches, scan)


@dataclass
class _StepTimes:
    """What `_time_steps` measured: per batch size, seconds per step cycle (`step_s`), inside
    `llama_decode` (`decode_only_s`) and KV cells in use (`step_kv`); the same at the short
    context and over unshared prefixes; prefill tok/s per run; host seconds per request."""

    prefill_runs: list[float]
    step_s: dict[int, float]
    decode_only_s: dict[int, float]
    step_kv: dict[int, float]
    context_s: dict[int, float] = field(default_factory=dict)
    context_kv: dict[int, float] = field(default_factory=dict)
    scan_s: dict[int, float] = field(default_factory=dict)
    scan_kv: dict[int, float] = field(default_factory=dict)
    admit_runs: list[float] = field(default_factory=list)


def _time_steps(backend: SteppedBackend, probe: _Probe, shape: _StepShape, gen_tokens: int, context_gen: int,
                repeats: int, tick: Callable[[str], None], notes: list[str]) -> _StepTimes:
    """Warm up, time prefill `repeats` times, then decode at each batch size (and at the short
    context, and the unshared pass) on a backend whose cap is fixed above the largest batch."""
    timeout, prompt, short = probe.timeout, shape.prompt, shape.short
    greedy1 = SamplingParams(temperature=0.0, max_tokens=1)
    backend.flush().result(timeout)
    probe.run([Request(probe.tokens(prompt), greedy1, source="calibrate")])  # warm-up, not measured
    tick("warm-up")
    prefill_runs = []
    for k in range(repeats):
        backend.flush().result(timeout)
        steps = [e for e, _ in probe.run([Request(probe.tokens(prompt), greedy1, source="calibrate")])
                 if e.n_prefill]
        prefill_runs.append(sum(e.n_prefill for e in steps) / sum(e.seconds for e in steps))
        tick(f"prefill {k + 1}/{repeats}")
    times = _StepTimes(prefill_runs, *probe.step_times(prompt, gen_tokens, shape.fits, tick, notes))
    if short:
        times.context_s, _, times.context_kv = probe.step_times(short, context_gen, shape.c_batches, tick, notes,
                                                                label="short context, batch")
        times.admit_runs = probe.host_costs(short, repeats, statistics.median(prefill_runs))
        tick("host cost per request")
        if shape.c_batches[-1] > 1:
            if shape.scan:
                times.scan_s, _, times.scan_kv = probe.step_times(short, context_gen, [shape.scan], tick, notes,
                                                                  label="unshared prefixes, batch", unshared=True)
            else:
                tick("masked scan skipped")
    return times


def _context_terms(backend: SteppedBackend, times: _StepTimes, cells: dict[int, float],
                   c_cells: dict[int, float], notes: list[str]) -> tuple[float, float, float, float]:
    """The context fit's (α, β, γ, δ) over the full and the short context's steps (zeros
    without a short context), with a note for each term the steps could not show."""
    if not times.context_s:
        return 0.0, 0.0, 0.0, 0.0
    context_kv, scan_kv = times.context_kv, times.scan_kv
    pairs = [(b, context_kv[b], times.context_s[b], scan_kv[b], t) for b, t in times.scan_s.items()
             if b in times.context_s and scan_kv[b] > context_kv[b]]
    if times.scan_s and not pairs:
        notes.append("masked scan not measured: the unshared pass's pool was no larger than the shared one's")
    points = ([(b, cells[b], times.step_kv[b], t) for b, t in times.step_s.items()]
              + [(b, c_cells[b], context_kv[b], t) for b, t in times.context_s.items()])
    pool = backend.config.flash_attn == "off"  # every row over the whole pool (fit_step_terms)
    c_alpha, c_beta, gamma, delta = fit_step_terms(points, pairs, pool_attention=pool)
    if pool:
        notes.append("no flash attention: every row attends over the whole pool (no context term; "
                     "the pool term fitted over every step)")
    if pairs and not delta:
        notes.append("the unshared prefixes' steps were no slower: no masked-scan term (noise, or none to see)")
    if not gamma and not pool:
        notes.append("the short context's steps were no faster: no context term (noise, or none to see)")
    return c_alpha, c_beta, gamma, delta


def _fitted(backend: SteppedBackend, shape: _StepShape, times: _StepTimes, gen_tokens: int, context_gen: int,
            notes: list[str], seconds: float) -> Calibration:
    """The step model fitted to what was timed, as the stored `Calibration`."""
    step_s, prompt, short = times.step_s, shape.prompt, shape.short
    alpha, beta = fit_step_model(step_s)
    cap = backend.cap
    at_cap = step_s.get(cap) or (alpha + beta * cap)
    cells = {b: calibration_cells(prompt, gen_tokens) for b in step_s}
    c_cells = {b: calibration_cells(short, context_gen) for b in times.context_s}
    c_alpha, c_beta, gamma, delta = _context_terms(backend, times, cells, c_cells, notes)
    admit = max(statistics.median(times.admit_runs), 0.0) if times.admit_runs else 0.0
    return Calibration(
        backend=backend.name,
        device=backend.model.device,
        config_key=config_key(backend.config, backend.model.device),
        cap=cap,
        threads=backend.config.threads,
        prompt_tokens=prompt,
        gen_tokens=gen_tokens,
        prefill_tok_s=statistics.median(times.prefill_runs),
        prefill_runs=tuple(times.prefill_runs),
        step_s=step_s,
        decode_only_s=times.decode_only_s,
        step_alpha_s=alpha,
        step_beta_s=beta,
        decode_tok_s=cap / at_cap,
        seconds=seconds,
        notes=tuple(notes),
        step_cells=cells if gamma else {},
        context_tokens=short,
        context_step_s=times.context_s,
        context_cells=c_cells,
        context_alpha_s=c_alpha,
        context_beta_s=c_beta,
        step_gamma_s=gamma,
        admit_s=admit,
        admit_runs=tuple(times.admit_runs),
        step_kv=times.step_kv if delta else {},
        context_kv=times.context_kv,
        scan_batch=next(iter(times.scan_s), 0),
        scan_step_s=next(iter(times.scan_s.values()), 0.0),
        scan_kv=next(iter(times.scan_kv.values()), 0.0),
        step_delta_s=delta,
    )


def calibrate_remote(backend: BackendProtocol, *, prompt_tokens: int = CALIBRATION_PROMPT,
                     gen_tokens: int = CALIBRATION_GEN, batches: Sequence[int] | None = None, repeats: int = 3,
                     seed: int = 0, timeout: float = 600.0, progress: Progress | None = None) -> Calibration:
    """Measure an idle, healthy remote backend by sending it requests (see the module docstring).

    Prompts are random words, different for every request, so the engine's prefix cache does
    not hit; `prompt_tokens` is a target (about one token per word), the engine's `usage`
    says how many there were. Time includes HTTP: it is what a request waits for.
    """
    if not backend.healthy:
        raise InvalidRequest(f"{backend.name}: the engine is unhealthy ({backend.error}); nothing to calibrate")
    t_start = time.monotonic()
    notes: list[str] = ["measured over HTTP: TTFT and ITL of requests sent to the engine"]
    rng = random.Random(seed)
    wanted = sorted(set(batches or range(1, backend.cap + 1)))
    if not wanted or wanted[0] < 1:
        raise InvalidRequest(f"batches must be >= 1, got {list(batches or [])}")
    tick = _ticker(progress, backend.name, 1 + repeats + len(wanted))

    def words(n: int) -> str:
        return " ".join(f"w{rng.randrange(10**6)}" for _ in range(n))

    def run(prompts: list[str], sampling: SamplingParams) -> list[FinishRecord]:
        handles = [backend.enqueue(Request((), sampling, text=p, source="calibrate")) for p in prompts]
        records = [h.result(timeout) for h in handles]
        for r in records:
            if r.error:
                raise InvalidRequest(f"calibrating {backend.name} failed: {r.error}")
        return records

    old_cap = backend.cap
    if max(wanted) > old_cap:
        backend.set_cap(max(wanted))
    greedy1 = SamplingParams(temperature=0.0, max_tokens=1)
    try:
        run([words(prompt_tokens)], greedy1)  # warm-up, not measured
        tick("warm-up")
        prefill_runs = []
        prompt = prompt_tokens
        for k in range(repeats):
            (r,) = run([words(prompt_tokens)], greedy1)
            prompt = r.prompt_tokens
            prefill_runs.append((r.prompt_tokens - r.cached_tokens) / max(r.ttft_s or r.e2e_s, 1e-6))
            tick(f"prefill {k + 1}/{repeats}")
        decode = SamplingParams(temperature=0.0, max_tokens=gen_tokens, ignore_eos=True)
        step_s: dict[int, float] = {}
        for b in wanted:
            itls = [r.itl_s for r in run([words(OWN_TOKENS) for _ in range(b)], decode) if r.itl_s]
            if itls:
                step_s[b] = statistics.median(itls)
            else:
                notes.append(f"batch {b}: each request streamed as one chunk, no gap to measure "
                             f"(raise --gen-tokens)")
            tick(f"decode at batch {b}")
    finally:
        if backend.cap != old_cap:
            backend.set_cap(old_cap)
    if not step_s:
        raise InvalidRequest(f"{backend.name}: no decode step could be measured (the engine streamed one chunk)")
    alpha, beta = fit_step_model(step_s)
    cap = backend.cap
    at_cap = step_s.get(cap) or (alpha + beta * cap)
    return Calibration(
        backend=backend.name, device=backend.device, config_key=backend.info().rates_key, cap=cap, threads=0,
        prompt_tokens=prompt, gen_tokens=gen_tokens, prefill_tok_s=statistics.median(prefill_runs),
        prefill_runs=tuple(prefill_runs), step_s=step_s, decode_only_s={}, step_alpha_s=alpha, step_beta_s=beta,
        decode_tok_s=cap / at_cap, seconds=time.monotonic() - t_start, notes=tuple(notes))


class _Probe:
    """Sends calibration requests to one backend and collects the steps they caused."""

    def __init__(self, backend: SteppedBackend, seed: int, timeout: float):
        self.backend = backend
        self.timeout = timeout
        self._rng = random.Random(seed)
        self._shared: tuple[int, ...] = ()  # the prefix `step_times` warmed last
        self._high = min(backend.model.n_vocab, TOKEN_HIGH)
        self._events: list[tuple[StepDone, int]] = []  # each step and the pool's cells in use after it
        self.records: list[FinishRecord] = []  # the last `run`'s request records
        self._unsubscribe = backend.bus.subscribe(self._on_step, (StepDone,))

    def _on_step(self, ev: StepDone) -> None:
        """On the worker thread, right after the step's tokens were applied (before any finish
        is retired): the step and the KV cells in use, its own tokens included."""
        if ev.backend == self.backend.name:
            self._events.append((ev, self.backend.kv_cells_used()))

    def tokens(self, n: int) -> tuple[int, ...]:
        return tuple(self._rng.randrange(TOKEN_LOW, self._high) for _ in range(n))

    def run(self, requests: list[Request]) -> list[tuple[StepDone, int]]:
        """Enqueue `requests` while the worker waits in a call, so it admits them all at once;
        wait for them; return the steps taken meanwhile, each with the KV cells in use after it."""
        self._events.clear()
        gate = threading.Event()
        held = self.backend.call(lambda _b: gate.wait(self.timeout))
        try:
            handles = [self.backend.enqueue(r) for r in requests]
        finally:
            gate.set()
        held.result(self.timeout)
        self.records = []
        for h in handles:
            record = h.result(self.timeout)
            if record.error:
                raise InvalidRequest(f"calibrating {self.backend.name} failed: {record.error}")
            self.records.append(record)
        return list(self._events)

    def host_costs(self, prompt: int, n: int, prefill_tok_s: float) -> list[float]:
        """Each of `n` lone requests' TTFT over a warmed `prompt`-token prefix (4 tokens of its
        own, one generated) less `computed prompt tokens / prefill_tok_s`: the host's cost per
        request beyond what the simulator's step model prices (see the module docstring).
        Runs after `step_times` over the same prompt, whose prefix is still cached."""
        greedy1 = SamplingParams(temperature=0.0, max_tokens=1)
        out = []
        for _ in range(n):
            self.run([Request(self._shared + self.tokens(OWN_TOKENS), greedy1, source="calibrate")])
            r = self.records[0]
            if r.ttft_s is not None:
                out.append(r.ttft_s - (r.prompt_tokens - r.cached_tokens) / prefill_tok_s)
        return out

    def step_times(self, prompt: int, gen_tokens: int, batches: list[int], tick: Callable[[str], None],
                   notes: list[str], label: str = "decode batch",
                   unshared: bool = False) -> tuple[dict[int, float], dict[int, float], dict[int, float]]:
        """Median step cycle, median `llama_decode` time and median KV cells in use per batch
        size (see the module docstring). `unshared`: each of a batch's sequences has a
        `prompt`-token prefix of its own (all warmed first), not one shared prefix."""
        self.backend.flush().result(self.timeout)
        if not unshared:
            shared = self._shared = self.tokens(prompt)
            self.backend.warm(shared).result(self.timeout)
        sampling = SamplingParams(temperature=0.0, max_tokens=gen_tokens, ignore_eos=True)
        step_s: dict[int, float] = {}
        decode_only_s: dict[int, float] = {}
        kv: dict[int, float] = {}
        for b in batches:
            if unshared:
                prefixes = [self.tokens(prompt) for _ in range(b)]
                for h in [self.backend.warm(p) for p in prefixes]:
                    h.result(self.timeout)
            else:
                prefixes = [shared] * b
            steps = self.run([Request(p + self.tokens(OWN_TOKENS), sampling, source="calibrate") for p in prefixes])
            steady = [k for k, (e, _) in enumerate(steps) if e.n_decode == b and e.n_prefill == 0]
            cycles = [steps[k][0].time - steps[k - 1][0].time for k in steady if k > 0]
            if not steady:
                notes.append(f"batch {b}: never ran {b} sequences together; skipped")
            else:
                decode_only_s[b] = statistics.median(steps[k][0].seconds for k in steady)
                step_s[b] = statistics.median(cycles) if cycles else decode_only_s[b]
                kv[b] = float(statistics.median(steps[k][1] for k in steady))
            tick(f"{label} {b}")
        return step_s, decode_only_s, kv

    def close(self) -> None:
        self._unsubscribe()


# ---- at load ----

# The short calibration `Engine.load(calibrate=True)` runs: a few seconds per backend config.
LOAD_PROMPT = 128
LOAD_GEN = 8


def calibrate_at_load(backends: Sequence[BackendProtocol], model_path: Path, model_name: str = "", store: RateStore | None = None,
                      status: Callable[[str], None] | None = None, timeout: float = 300.0,
                      progress: Progress | None = None) -> dict[str, Rates]:
    """Measure the local `backends` (started, idle) that still have placeholder rates, one per
    speed-relevant config (`BackendInfo.rates_key`), apply the rates to every backend of that config
    (`source="measured"`) and store them; return {backend name: rates} for those measured.
    `progress(done, total, what)` hears each measuring step (`serve` and the benches show it).

    A backend that cannot be measured (a context too small, a failed step) keeps its
    placeholder rates, with a warning: the engine still serves.
    """
    store = store or RateStore()
    groups: dict[str, list[BackendProtocol]] = {}
    for b in backends:
        if b.model is None or not b.rates.placeholder:  # only a local model is measured here
            continue
        groups.setdefault(b.info().rates_key, []).append(b)
    applied: dict[str, Rates] = {}
    for key, same in groups.items():
        first = same[0]
        if status is not None:
            status(f"measuring {first.name}'s speed (once per model and config on this machine)")
        try:
            cal = calibrate_backend(first, prompt_tokens=LOAD_PROMPT, gen_tokens=LOAD_GEN,
                                    batches=sorted({1, first.cap}), repeats=1, timeout=timeout, progress=progress)
        except Exception as e:  # keep serving on the placeholder; the cards flag it
            log.warning("%s: measuring rates at load failed, placeholder rates stay: %s", first.name, e)
            continue
        rates = replace(cal.rates(), source="measured")
        for b in same:
            b.set_rates(rates)
            applied[b.name] = rates
        try:
            save_calibration(store, model_path, replace(cal, notes=(*cal.notes, "measured at load")), model_name)
        except OSError as e:
            log.warning("could not store the rates measured for %s: %s", first.name, e)
        log.info("%s: rates measured at load in %.1f s: prefill %.0f tok/s, decode %.1f tok/s at cap %d (%s)",
                 first.name, cal.seconds, cal.prefill_tok_s, cal.decode_tok_s, cal.cap, key)
    return applied


def _ticker(progress: Progress | None, name: str, total: int) -> Callable[[str], None]:
    """`tick(what)`: one more of `total` calibration steps done, reported to `progress`."""
    done = 0

    def tick(what: str) -> None:
        nonlocal done
        done += 1
        if progress is not None:
            progress(done, total, f"{name}: {what}")

    return tick
