"""A lesson's arrivals (engine.lesson, engine.sim.arrivals.ArrivalStream), without Qt: they keep
coming until Stop at a rate that can change, Pause and Step act on them, and a ceiling lowered
mid-lesson decides the next routed request.

The stream's own tests run on a hand-moved time source, so they assert exact counts on any
machine. The engine's tests run the tiny synthetic model on two CPU contexts; where the state
must hold still (a backend running a request while the next one is routed), its worker is held
inside a step (`StepGate`)."""

from __future__ import annotations

import threading
import time
from dataclasses import replace

import pytest
from ui_fixtures import StepGate

import engine.llama  # noqa: F401  (llama.cpp before numpy)
from engine.backends.config import parse_backend_specs
from engine.core.request import Request, SamplingParams
from engine.core.snapshot import Rates
from engine.engine import Engine
from engine.lesson import (
    KINDS,
    MAX_SUGGESTED_RATE,
    Kind,
    Lesson,
    LessonMix,
    lesson_specs,
    suggested_rate,
    warm,
)
from engine.sim.arrivals import MAX_RATE, MIN_RATE, ArrivalClock, ArrivalStream
from engine.sim.workload import build_workload, seed_workload

SPECS = ["cpu:threads=1,cap=4,ctx=1024", "cpu:threads=1,cap=4,ctx=1024"]
SMALL = LessonMix(prefix_tokens=32, kinds=(Kind("short", 4, 4, 1.0), Kind("long", 4, 48, 1.0)))
WAIT_S = 60
# Two 1-thread CPU contexts of the default model on this 2-core machine, as calibration measured
# them: a step at batch b takes alpha + beta * b seconds.
MEASURED = Rates(prefill_tok_s=134.0, decode_tok_s=97.0, step_alpha_s=0.013, step_beta_s=0.0094, source="override")


class Hand:
    """A time source that moves only when told to."""

    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def stream(rate: float = 2.0) -> tuple[ArrivalStream, Hand]:
    hand = Hand()
    s = ArrivalStream(rate, ArrivalClock(clock=hand))
    s.clock.start()
    return s, hand


def run_for(s: ArrivalStream, hand: Hand, seconds: float, tick: float = 0.01) -> list[int]:
    out: list[int] = []
    for _ in range(round(seconds / tick)):
        hand.t += tick
        out += s.due()
    return out


# ---- the stream ----


def test_arrivals_keep_coming_until_the_stream_is_closed():
    s, hand = stream(rate=2.0)
    first = s.due()
    assert first == [0]  # the first arrival comes when the clock starts
    got = run_for(s, hand, 600.0)  # ten minutes of a lesson: no end of its own
    assert got == list(range(1, len(got) + 1))
    assert len(got) == pytest.approx(1200, abs=2)
    s.clock.close()
    assert run_for(s, hand, 60.0) == []


def test_a_rate_change_applies_to_the_next_arrival():
    s, hand = stream(rate=0.5)
    assert s.due() == [0]
    hand.t += 0.5
    assert s.due() == []  # the next is 2 s after the first
    assert s.set_rate(4.0) == 4.0
    assert s.due() == [1]  # due 0.25 s after the first: already late, so now
    assert s.next_s == pytest.approx(0.75)
    assert len(run_for(s, hand, 10.0)) == pytest.approx(40, abs=1)
    s.set_rate(0.5)
    assert len(run_for(s, hand, 10.0)) == pytest.approx(5, abs=1)


def test_the_rate_is_clamped_to_positive_bounds():
    s, _hand = stream()
    assert s.set_rate(1e9) == MAX_RATE
    assert s.set_rate(1e-9) == MIN_RATE
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError):
            s.set_rate(bad)


def test_a_paused_stream_lets_arrivals_through_only_by_step():
    s, hand = stream(rate=2.0)
    assert s.due() == [0]
    s.clock.pause()
    assert run_for(s, hand, 30.0) == []
    assert s.seconds_to_next() is None
    s.clock.step()
    assert s.take() == 1
    assert s.take() is None  # one step, one arrival
    assert run_for(s, hand, 30.0) == []
    s.clock.resume()
    assert s.due() == []  # not a burst: the next is half a second on the clock after the stepped one
    assert run_for(s, hand, 0.5) == [2]


def test_a_late_taker_gets_no_burst():
    s, hand = stream(rate=2.0)
    assert s.due() == [0]
    hand.t += 10.0  # the app's loop stalled for 10 s
    assert s.due() == [1]
    hand.t += 0.49
    assert s.due() == []


# ---- the mix ----


def test_the_mix_draws_its_kinds_after_the_studys_prefix():
    mix = LessonMix()
    prefix = mix.prefix()
    assert prefix == build_workload(seed_workload(8)).prefix  # a demo after a lesson finds it cached
    reqs = [mix.request(i, prefix) for i in range(40)]
    assert [r.prompt for r in reqs] == [mix.request(i).prompt for i in range(40)]
    assert {r.kind for r in reqs} == set(KINDS)
    for r in reqs:
        assert r.prompt[:len(prefix)] == prefix
        assert len(r.prompt) == len(prefix) + r.kind.own_tokens
    assert len({r.prompt for r in reqs}) == 40


def test_a_lesson_on_a_cpu_only_machine_gets_two_cpu_contexts_sharing_the_cores():
    specs = lesson_specs(gpu=False, cores=8)
    assert specs == ["cpu:threads=4,cap=4", "cpu:threads=4,cap=4"]
    assert [c.name for c in parse_backend_specs(specs)] == ["cpu0", "cpu1"]
    assert lesson_specs(gpu=False, cores=1) == ["cpu:threads=1,cap=4"] * 2


# ---- on a real engine ----


@pytest.fixture(scope="module")
def eng():
    e = Engine.load("synthetic:tiny", parse_backend_specs(SPECS), policy="default")
    yield e
    e.close()


@pytest.fixture
def fresh(eng):
    """The shared engine at a fixed cap of 4 (an adaptive live cap may move below its ceiling while
    requests run), and idle, adaptive and with its rates and policy as loaded after each test."""
    rates = {name: eng.rates(name) for name in eng.backend_names}
    adaptive = {name: b.cap_state().adaptive for name, b in eng.backends.items()}
    for b in eng.backends.values():
        b.set_cap(4, adaptive=False)
    yield eng
    deadline = time.monotonic() + WAIT_S
    while any(s.items for s in eng.snapshot()) and time.monotonic() < deadline:
        time.sleep(0.02)
    for name, b in eng.backends.items():
        b.set_cap(4, adaptive=adaptive[name])
        eng.set_rates(name, rates[name])
    eng.router.set_policy("default")
    eng.flush()
    assert not any(s.items for s in eng.snapshot()), "the engine was still busy after the test"


def test_the_suggested_rate_keeps_the_backends_about_half_busy_by_their_measured_rates(fresh):
    for name in fresh.backend_names:
        fresh.set_rates(name, MEASURED)
    # Per backend: the mix's average request (64 prompt tokens of its own, 52.8 generated) takes
    # 64 / 134 + 52.8 / 79.1 (peak decode at batch 4) = 1.15 s: two backends serve 1.75 a second,
    # half of that is 0.87, and the step at or below it is 0.75.
    assert suggested_rate(fresh, cores=2) == 0.75
    assert suggested_rate(fresh, cores=1) == pytest.approx(1 / 3)  # two 1-thread contexts sharing one core: 0.44
    slow = replace(MEASURED, prefill_tok_s=MEASURED.prefill_tok_s / 4, step_alpha_s=MEASURED.step_alpha_s * 4,
                   step_beta_s=MEASURED.step_beta_s * 4)
    for name in fresh.backend_names:  # the same machine four times as busy
        fresh.set_rates(name, slow)
    assert suggested_rate(fresh, cores=2) == 0.2
    fast = replace(MEASURED, prefill_tok_s=MEASURED.prefill_tok_s * 8, step_alpha_s=MEASURED.step_alpha_s / 8,
                   step_beta_s=MEASURED.step_beta_s / 8)
    for name in fresh.backend_names:  # a laptop with cores to spare: as fast as a class can follow
        fresh.set_rates(name, fast)
    assert suggested_rate(fresh, cores=2) == MAX_SUGGESTED_RATE
    assert Lesson(fresh).rate == suggested_rate(fresh)


def test_arrivals_keep_coming_until_stop_which_cancels_what_is_in_flight(fresh):
    lesson = Lesson(fresh, replace(SMALL, vocab_size=fresh.n_vocab), rate=MAX_RATE)
    lesson.start()
    deadline = time.monotonic() + WAIT_S
    while len(lesson.sent) < 12 and time.monotonic() < deadline:  # more than a demo's 8, and on
        lesson.pump()
        time.sleep(0.005)
    assert len(lesson.sent) >= 12
    assert [s.request.index for s in lesson.sent] == list(range(len(lesson.sent)))
    assert all(s.handle is not None for s in lesson.sent)
    assert lesson.first_arrival_s is not None and lesson.first_arrival_s < 0.5
    lesson.stop()
    n = len(lesson.sent)
    time.sleep(0.2)  # four arrivals' worth at this rate
    assert lesson.pump() == [] and lesson.step() is None
    assert len(lesson.sent) == n
    for s in lesson.sent:
        s.handle.result(WAIT_S)  # each one finished or was cancelled: nothing left running


def test_a_paused_lesson_sends_only_stepped_arrivals(fresh):
    lesson = Lesson(fresh, replace(SMALL, vocab_size=fresh.n_vocab), rate=MAX_RATE)
    lesson.start()
    lesson.pump()
    assert len(lesson.sent) == 1  # the first arrival at once
    assert lesson.pause()
    time.sleep(0.3)  # six arrivals fall due meanwhile
    assert lesson.pump() == []
    stepped = lesson.step()
    assert stepped is not None and stepped.request.index == 1
    assert lesson.paused  # a step leaves the lesson paused
    time.sleep(0.2)
    assert lesson.pump() == []
    assert lesson.resume()
    deadline = time.monotonic() + WAIT_S
    while len(lesson.sent) < 4 and time.monotonic() < deadline:
        lesson.pump()
        time.sleep(0.005)
    assert [s.request.index for s in lesson.sent] == [0, 1, 2, 3]
    lesson.stop()


def test_a_ceiling_lowered_mid_lesson_is_honoured_by_the_next_routed_request(fresh):
    mix = replace(SMALL, vocab_size=fresh.n_vocab, kinds=(Kind("long", 4, 48, 1.0),))
    for name in fresh.backend_names:  # a CPU's step as this machine measured it: batching pays
        fresh.set_rates(name, MEASURED)
    lesson = Lesson(fresh, mix)
    long_reply = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    # One request running on cpu0, three on cpu1, held there so that the state the router sees
    # holds still: each worker waits in a call while its requests queue, so it takes them all at
    # once and its next step admits them together (their prefix is cached); its gate holds it
    # inside that step. At the
    # ceiling loaded (4) the next arrival goes to cpu0, where fewer run.
    warm(fresh, mix)
    release = threading.Event()
    inside = {name: threading.Event() for name in ("cpu0", "cpu1")}
    calls = [fresh.backend(name).call(lambda _b, e=e: e.set() or release.wait(WAIT_S)) for name, e in inside.items()]
    for e in inside.values():  # each worker is in its call: what is submitted now waits for one take
        assert e.wait(WAIT_S)
    held = [fresh.submit(Request(mix.request(100 + i).prompt, long_reply, backend=name))
            for i, name in enumerate(("cpu0", "cpu1", "cpu1", "cpu1"))]
    gates = [StepGate(fresh.bus, name, after=1) for name in ("cpu0", "cpu1")]
    release.set()
    for c in calls:
        c.result(WAIT_S)
    try:
        for g in gates:
            assert g.reached.wait(WAIT_S)
        assert [(len(s.running), len(s.waiting)) for s in fresh.snapshot()] == [(1, 0), (3, 0)]
        lesson.start()
        lesson.pause()
        before = lesson.step()
        assert before is not None and before.handle.decision.backend == "cpu0"
        fresh.set_cap("cpu0", 1)  # mid-lesson: the teacher lowers cpu0's ceiling
        after = lesson.step()
        assert after is not None
        d0, d1 = before.handle.decision, after.handle.decision
        assert d0.score_of("cpu0").cap == 4
        assert d1.score_of("cpu0").cap == 1  # the very next request was routed under the new ceiling
        # cpu0 runs one request at its new ceiling with one more waiting: the next arrival would
        # wait behind both there, so it goes to cpu1, where it joins the batch at once.
        assert d1.backend == "cpu1"
        assert d1.score_of("cpu0").score_s > d1.score_of("cpu1").score_s
    finally:
        for g in gates:
            g.release()
    lesson.stop()
    for h in held:
        h.cancel()
        h.result(WAIT_S)
