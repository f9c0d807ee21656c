"""`cache-aware` on a real engine: two CPU backends of the tiny synthetic model."""

from __future__ import annotations

import pytest
from waiting import WAIT

from engine.backends.config import parse_backend_specs
from engine.core.request import SamplingParams
from engine.engine import Engine

PREFIX = list(range(10, 210))  # a 200-token "system prompt"


@pytest.fixture
def engine(tiny_path):
    eng = Engine.load(tiny_path, parse_backend_specs(["cpu:threads=1,cap=2,ctx=1024"] * 2), policy="cache-aware")
    yield eng
    eng.close()


def ask(eng, tokens):
    h = eng.generate(tokens, SamplingParams(max_tokens=2, ignore_eos=True))
    record = h.result(WAIT)
    assert record.error is None
    return h.decision, record


def test_repeat_prefix_follows_the_backend_that_caches_it(engine):
    engine.warm(PREFIX, backend="cpu1")
    for k in range(3):
        decision, record = ask(engine, PREFIX + [250 + k, 251 + k])
        assert decision.backend == "cpu1", decision.reason
        assert decision.reason.startswith("cpu1: 200 of 202 tokens cached")
        assert record.cached_tokens >= 200


def test_a_cold_prompt_decision_says_nothing_is_cached(engine):
    decision, _ = ask(engine, list(range(300, 500)))
    assert decision.policy == "cache-aware"
    assert "no backend holds 50% of the prompt (nothing cached anywhere)" in decision.reason
    assert {s.name for s in decision.scores} == {"cpu0", "cpu1"}


def test_a_prompt_sent_again_goes_where_its_prefix_went(engine):
    first, _ = ask(engine, list(range(300, 500)))
    again, _ = ask(engine, list(range(300, 500)) + [1])
    assert again.backend == first.backend and "tokens cached" in again.reason


def test_back_to_back_requests_share_a_backend_before_the_first_is_cached(engine):
    # Submitted without waiting: the second may arrive before the first's prefill is in the
    # cache; the router's memory of where the prefix went (or the cache) sends it along.
    sampling = SamplingParams(max_tokens=2, ignore_eos=True)
    first = engine.generate(PREFIX + [1], sampling)
    second = engine.generate(PREFIX + [2], sampling)
    for h in (first, second):
        assert h.result(WAIT).error is None
    assert second.decision.backend == first.decision.backend
    assert "in flight" in second.decision.reason or "tokens cached" in second.decision.reason
