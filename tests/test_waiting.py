"""The test suite's own waits: a wait that can no longer succeed fails at once, and a held
worker keeps the state it was held at."""

from __future__ import annotations

import time

import pytest
from waiting import WAIT, held_when, wait_until

from engine.core.request import Request, SamplingParams


def test_a_wait_whose_state_can_no_longer_come_fails_at_once():
    t0 = time.monotonic()
    with pytest.raises(AssertionError, match="the answer can no longer come"):
        wait_until(lambda: False, timeout=60, what="the answer", unless=lambda: True)
    assert time.monotonic() - t0 < 1


def test_a_wait_returns_when_its_state_comes_even_if_it_is_then_impossible():
    wait_until(lambda: True, timeout=1, unless=lambda: True)


def test_a_wait_without_its_state_times_out():
    with pytest.raises(TimeoutError, match=r"the answer not reached within 0\.05 s"):
        wait_until(lambda: False, timeout=0.05, what="the answer")


def test_a_held_worker_runs_no_step_until_released(make_backend, tiny_model):
    b = make_backend(tiny_model, cap=1)
    h = b.enqueue(Request((1, 40, 41), SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)))
    with held_when(b, lambda s: any(i.generated >= 5 for i in s.items), "decoding", unless=lambda s: h.done) as snap:
        steps = b.steps
        time.sleep(0.2)  # a free worker runs dozens of steps in this time
        assert b.steps == steps
        assert snap.items[0].generated == 5, "held at the first step boundary where the state held"
    assert h.result(WAIT).output_tokens == 200


def test_holding_for_a_state_that_cannot_come_fails_at_once(make_backend, tiny_model):
    b = make_backend(tiny_model, cap=1)
    h = b.enqueue(Request((1, 40, 41), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)))
    t0 = time.monotonic()
    with (pytest.raises(AssertionError, match="9 tokens can no longer come"),
          held_when(b, lambda s: any(i.generated >= 9 for i in s.items), "9 tokens")):
        pass
    assert time.monotonic() - t0 < 10
    assert h.result(WAIT).output_tokens == 8
