"""The teaching replay's arithmetic without Qt: the worked example goes through the real router,
and every number the panel narrates is the golden number of docs/study.md."""

from __future__ import annotations

import pytest

from engine.core.snapshot import Rates
from engine.sim.teaching import (
    ARTICLE_RATES,
    boundary,
    gpu_decode_to_keep,
    gpu_sum,
    score_formula,
    study_arrivals,
    teaching_steps,
    verdict,
)


@pytest.mark.parametrize("index, prefill, decode, gpu_s, backend", [(0, 60, 880, 3.027, "gpu"),
                                                                     (1, 80, 1000, 3.444, "cpu")])
def test_golden_scores_give_the_verdicts(index, prefill, decode, gpu_s, backend):
    a = study_arrivals()[index]
    assert (a.gpu.prefill_tokens, a.gpu.decode_tokens) == (prefill, decode)
    assert round(a.gpu.score_s, 3) == gpu_s
    assert round(a.cpu.score_s, 3) == 3.118
    assert a.decision.backend == backend


@pytest.mark.parametrize("index, formula", [(0, "60/2551 + 880/293"), (1, "80/2551 + 1000/293")])
def test_gpu_score_formula_reads_as_the_article_writes_it(index, formula):
    assert score_formula(study_arrivals()[index].gpu) == formula


@pytest.mark.parametrize("index, terms", [(0, (2, 20, 256, 496, 128)), (1, (3, 20, 384, 488, 128))])
def test_gpu_sum_terms_add_up_to_the_routers_tokens(index, terms):
    t = gpu_sum(study_arrivals()[index])
    assert (t.queued, t.prompt_left, t.queued_budget, t.running_budget, t.new_budget) == terms
    assert t.queued_budget + t.running_budget + t.new_budget == t.score.decode_tokens
    assert (t.queued + 1) * t.prompt_left == t.score.prefill_tokens


@pytest.mark.parametrize("index, relation, stays", [(0, "<", True), (1, ">", False)])
def test_verdict_compares_the_two_scores(index, relation, stays):
    v = verdict(study_arrivals()[index])
    assert (v.relation, v.stays_on_gpu) == (relation, stays)
    assert v.reason  # the router's own record travels with the verdict


def test_the_prompt_left_follows_the_cached_prefix():
    assert [a.prompt_left for a in study_arrivals(cached=400)] == [116, 116]


def test_a_gpu_decoding_just_faster_than_the_boundary_keeps_request_8():
    keep = gpu_decode_to_keep(study_arrivals()[1])
    rates = dict(ARTICLE_RATES, gpu=Rates(2551.0, keep * 1.01))
    assert study_arrivals(rates)[1].decision.backend == "gpu"


def test_a_gpu_decoding_just_slower_than_the_boundary_sends_request_8_to_the_cpu():
    keep = gpu_decode_to_keep(study_arrivals()[1])
    rates = dict(ARTICLE_RATES, gpu=Rates(2551.0, keep * 0.99))
    assert study_arrivals(rates)[1].decision.backend == "cpu"


def test_without_the_cached_prefix_the_gpu_keeps_both():
    assert [a.decision.backend for a in study_arrivals(cached=0)] == ["gpu", "gpu"]


def test_boundary_prices_the_uncached_idle_cpu():
    b = boundary(study_arrivals(), ARTICLE_RATES)
    assert b.uncached_cpu_formula == "516/73 + 128/45"
    assert b.uncached_cpu_s == pytest.approx(516 / 73 + 128 / 45)
    assert b.keep_decode_tok_s == pytest.approx(gpu_decode_to_keep(study_arrivals()[1]))


def test_steps_are_setup_three_per_arrival_then_the_boundary():
    steps = teaching_steps(study_arrivals())
    assert [s.kind for s in steps] == ["setup", "arrival", "gpu-score", "verdict",
                                       "arrival", "gpu-score", "verdict", "boundary"]
    assert [s.arrival for s in steps] == [None, 0, 0, 0, 1, 1, 1, 1]
    assert steps[4].title == "Request 8 arrives — 50 ms later"
