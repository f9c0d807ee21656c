"""A lesson: requests that keep arriving, at a rate the teacher sets, until Stop.

The study's demo sends all its arrivals within a second, so a control changed during it changes
nothing a class can see. A lesson's arrivals come one at a time (`ArrivalStream`, at `suggested_rate` unless the teacher
turns it up or down, a step of `RATE_STEPS` at a time) until Stop, so a ceiling or a policy set
mid-lesson decides the next rows. Every prompt starts with one shared prefix (the study's 496-token system
prompt) and draws its kind from a mix (`KINDS`: short replies, long replies, long prompts), so the
backends' queues differ and so do the decisions.

`lesson_specs` are the backends a lesson runs on when none are named: the default ones where
they are several (a GPU and the CPU), else two CPU contexts that share the cores, each priced by
the rates measured for it at load. `warm` fills every backend's prefix cache with the shared
prefix; the app does it while the model loads, so the first arrival comes as soon as the lesson
starts (a cold backend computes the prefix with its first request instead, as a server would).

`Lesson` drives an engine: `pump()` submits the arrivals due now (the app calls it from a timer,
a test from its own thread), `step()` one now, `pause`/`resume`, `set_rate`, `stop`. Qt-free.

Thread contract: one thread drives a lesson (the app's GUI thread); the engine and the arrival
stream it submits through are thread-safe, so other threads may read its state.
"""

from __future__ import annotations

import os
import random
import time
from dataclasses import dataclass, field
from typing import Any

from engine.backends.config import default_specs
from engine.core.errors import EngineError
from engine.core.handle import RequestHandle
from engine.core.request import Request, SamplingParams
from engine.sim.arrivals import ArrivalClock, ArrivalStream
from engine.sim.workload import SEED_PREFIX_TOKENS, TOKEN_HIGH, TOKEN_LOW, build_workload, seed_workload

from .engine import Engine

DEFAULT_RATE = 0.5  # arrivals per second when the backends' rates say nothing
LOAD_SHARE = 0.5  # `suggested_rate` keeps the backends about this busy
MAX_SUGGESTED_RATE = 2.0  # faster than this, a class cannot follow the rows
# The rates a teacher steps through (arrivals per second); a suggested rate is one of them.
RATE_STEPS = (0.1, 0.2, 0.25, 1 / 3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0)
LESSON_CPU_CAP = 4  # each CPU context's ceiling: room to lower it and see the next rows move


@dataclass(frozen=True)
class Kind:
    """One kind of request in the mix: its own prompt tokens after the shared prefix, the tokens
    it generates, and how often it comes (a weight)."""

    name: str
    own_tokens: int
    output_tokens: int
    weight: float


# Short replies are over quickly; long replies hold a slot for a while; long prompts cost prefill.
KINDS = (Kind("short reply", 20, 16, 5.0), Kind("long reply", 20, 128, 3.0), Kind("long prompt", 240, 32, 2.0))


@dataclass(frozen=True)
class LessonRequest:
    index: int
    kind: Kind
    prompt: tuple[int, ...] = field(repr=False)


@dataclass(frozen=True)
class LessonMix:
    """What a lesson's requests carry: the shared prefix and the kinds, drawn per arrival from
    `seed` (the same arrival number always gets the same request)."""

    prefix_tokens: int = SEED_PREFIX_TOKENS
    kinds: tuple[Kind, ...] = KINDS
    seed: int = 0
    vocab_size: int = TOKEN_HIGH

    @classmethod
    def for_engine(cls, engine: Engine, **kw: Any) -> LessonMix:
        """The mix with token ids every backend of `engine` accepts."""
        return cls(vocab_size=min(engine.n_vocab or TOKEN_HIGH, TOKEN_HIGH), **kw)

    def prefix(self) -> tuple[int, ...]:
        """The shared prefix: the study's (`engine.sim.workload.seed_workload`), so a demo after a
        lesson finds it too."""
        spec = seed_workload(1, prefix_tokens=self.prefix_tokens, suffix_tokens=1, gen_tokens=1, seed=self.seed,
                             vocab_size=self.vocab_size)
        return build_workload(spec).prefix

    def request(self, index: int, prefix: tuple[int, ...] | None = None) -> LessonRequest:
        """Arrival `index`'s request (`prefix`: `self.prefix()`, when the caller keeps it)."""
        rng = random.Random(f"{self.seed}:lesson:{index}")
        kind = rng.choices(self.kinds, weights=[k.weight for k in self.kinds])[0]
        high = min(self.vocab_size, TOKEN_HIGH)
        own = tuple(rng.randrange(TOKEN_LOW, high) for _ in range(kind.own_tokens))
        return LessonRequest(index, kind, (self.prefix() if prefix is None else prefix) + own)


def lesson_specs(gpu: bool, cores: int | None = None) -> list[str]:
    """The backends a lesson runs on when none are named: the default ones where there are
    several, else two CPU contexts, each with half the cores."""
    specs = default_specs(gpu)
    if len(specs) >= 2:
        return specs
    threads = max((cores or os.cpu_count() or 2) // 2, 1)
    return [f"cpu:threads={threads},cap={LESSON_CPU_CAP}"] * 2


def suggested_rate(engine: Engine, mix: LessonMix | None = None, cores: int | None = None) -> float:
    """Arrivals a second that keep the backends about LOAD_SHARE busy, by their measured rates: a
    queue forms now and then, so a lowered ceiling moves the next rows, and none grows without end
    (a fixed rate drowned two 1-thread contexts on a busy 2-core machine, and bored an idle 8-core
    laptop). Each backend serves the mix's average request in its average prefill over its prefill
    rate plus its average decode at its peak decode rate up to its ceiling, CPU contexts in the share
    of the `cores` (default: this machine's) their threads get when there are more threads than
    cores (each was measured alone). The rate is the step of
    RATE_STEPS at or below their sum times LOAD_SHARE, at most MAX_SUGGESTED_RATE (DEFAULT_RATE
    when no backend has rates)."""
    mix = mix or LessonMix.for_engine(engine)
    total = sum(k.weight for k in mix.kinds)
    own = sum(k.own_tokens * k.weight for k in mix.kinds) / total
    out = sum(k.output_tokens * k.weight for k in mix.kinds) / total
    snaps = engine.snapshot()
    # Each CPU context was measured alone; contexts with more threads than the cores share them.
    threads = sum(s.threads for s in snaps if s.device == "cpu")
    share = min(1.0, (cores or os.cpu_count() or 1) / threads) if threads else 1.0
    capacity = 0.0
    for snap in snaps:
        r = snap.rates
        peak = r.peak_decode_tok_s(snap.cap_ceiling or snap.cap)
        if r.prefill_tok_s > 0 and peak > 0:
            capacity += (share if snap.device == "cpu" else 1.0) / (own / r.prefill_tok_s + out / peak)
    if capacity <= 0:
        return DEFAULT_RATE
    want = min(MAX_SUGGESTED_RATE, LOAD_SHARE * capacity)
    return max((r for r in RATE_STEPS if r <= want * 1.001), default=RATE_STEPS[0])


def warm(engine: Engine, mix: LessonMix | None = None, timeout: float | None = 600) -> list[RequestHandle]:
    """Fill every backend's prefix cache with the lesson's shared prefix; blocks until done."""
    return engine.warm((mix or LessonMix.for_engine(engine)).prefix(), timeout=timeout)


def cached_everywhere(engine: Engine, tokens: tuple[int, ...]) -> bool:
    """Whether every backend's prefix cache already holds all of `tokens` (a read, no pin)."""
    probe = Request(tuple(tokens) + (tokens[-1],)) if tokens else None  # the last prompt token is never cached
    return probe is not None and all(engine.backend(n).match(probe) >= len(tokens) for n in engine.backend_names)


@dataclass
class Sent:
    """One arrival as sent: its request, the handle (None if the engine refused it, with `error`),
    and when it was submitted (monotonic seconds)."""

    request: LessonRequest
    handle: RequestHandle | None
    t_submit: float
    error: str | None = None


class Lesson:
    """Sends a `LessonMix`'s requests to `engine` as an `ArrivalStream` lets them through, until
    `stop()`. States: idle → running → stopped."""

    def __init__(self, engine: Engine, mix: LessonMix | None = None, rate: float | None = None,
                 clock: ArrivalClock | None = None) -> None:
        """`rate`: arrivals per second (None: `suggested_rate` for this engine and mix)."""
        self.engine = engine
        self.mix = mix or LessonMix.for_engine(engine)
        self.stream = ArrivalStream(suggested_rate(engine, self.mix) if rate is None else rate, clock)
        self._prefix = self.mix.prefix()
        self.sent: list[Sent] = []
        self.state = "idle"
        self.t_start: float | None = None  # monotonic, when start() was called

    @property
    def clock(self) -> ArrivalClock:
        return self.stream.clock

    @property
    def running(self) -> bool:
        return self.state == "running"

    @property
    def paused(self) -> bool:
        return self.clock.paused

    @property
    def rate(self) -> float:
        return self.stream.rate

    @property
    def first_arrival_s(self) -> float | None:
        """Seconds from `start()` to the first submission (None before it)."""
        if not self.sent or self.t_start is None:
            return None
        return self.sent[0].t_submit - self.t_start

    def in_flight(self) -> list[Sent]:
        return [s for s in self.sent if s.handle is not None and not s.handle.done]

    def start(self) -> None:
        if self.state != "idle":
            raise RuntimeError("a lesson starts once")
        self.state = "running"
        self.t_start = time.monotonic()
        self.clock.start()

    def pump(self) -> list[Sent]:
        """Submit every arrival due now (none while paused); what was sent."""
        if not self.running:
            return []
        return [self._submit(n) for n in self.stream.due()]

    def step(self) -> Sent | None:
        """Send the next arrival now and stay paused (pausing first); None once stopped."""
        if not self.running:
            return None
        self.clock.step()
        n = self.stream.take()
        return None if n is None else self._submit(n)

    def pause(self) -> bool:
        """Hold back the arrivals to come (what was sent keeps running); False if not running."""
        return self.running and self.clock.pause()

    def resume(self) -> bool:
        return self.running and self.clock.resume()

    def set_rate(self, rate: float) -> float:
        """Arrivals per second from the next one on (clamped); the rate set."""
        return self.stream.set_rate(rate)

    def seconds_to_next(self) -> float | None:
        """Until the next arrival is due; None while paused or not running."""
        return self.stream.seconds_to_next() if self.running else None

    def stop(self) -> list[Sent]:
        """No more arrivals; the requests still in flight are cancelled. What was cancelled."""
        if self.state == "stopped":
            return []
        self.state = "stopped"
        self.clock.close()
        cancelled = self.in_flight()
        for s in cancelled:
            s.handle.cancel()  # type: ignore[union-attr]  # in_flight() has handles only
        return cancelled

    def _submit(self, index: int) -> Sent:
        req = self.mix.request(index, self._prefix)
        sampling = SamplingParams(temperature=0.0, max_tokens=req.kind.output_tokens, ignore_eos=True)
        t = time.monotonic()
        try:
            sent = Sent(req, self.engine.submit(Request(req.prompt, sampling, source="lesson")), t)
        except EngineError as e:  # a refused request is a row of the lesson, not its end
            sent = Sent(req, None, t, str(e))
        self.sent.append(sent)
        return sent

