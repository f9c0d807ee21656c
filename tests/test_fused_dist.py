"""Fused temperature sampling on the device (engine/llama/fused_dist.py): the same distribution
as llama.cpp's own chain, one computation for every row of a step, and a seed that reproduces."""

from __future__ import annotations

import ctypes
import math
from dataclasses import replace

import numpy as np
import pytest

from engine.llama import fused_dist, lc
from engine.request import Request, SamplingParams

WAIT = 120
DRAWS = 20_000

# One fixed row of logits: 64 tokens, spread enough that every cut removes something.
LOGITS = np.random.default_rng(7).normal(size=64).astype(np.float32) * 2.5
CONFIGS = {
    "top-k": SamplingParams(temperature=1.0, top_k=8, top_p=1.0, min_p=0.0),
    "top-p": SamplingParams(temperature=1.0, top_k=0, top_p=0.7, min_p=0.0),
    "min-p": SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.1),
    "combined": SamplingParams(temperature=0.8, top_k=20, top_p=0.9, min_p=0.05),
    "temp-0.5": SamplingParams(temperature=0.5, top_k=40, top_p=0.95, min_p=0.05),
    "temp-0.8": SamplingParams(temperature=0.8, top_k=0, top_p=1.0, min_p=0.0),
    "temp-1.5": SamplingParams(temperature=1.5, top_k=0, top_p=1.0, min_p=0.0),
    "ignore-eos": SamplingParams(temperature=0.8, top_k=10, top_p=0.95, min_p=0.05, ignore_eos=True),
}
EOG = [int(np.argmax(LOGITS)), 3]  # the likeliest token is an end token: banning it matters


def _draws(settings: list[SamplingParams], seed: int) -> np.ndarray:
    rows = np.tile(LOGITS, (len(settings), 1))
    return fused_dist.sample_rows(rows, settings, np.random.default_rng(seed).random(len(settings)), EOG)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_device_computation_draws_from_llama_chain_distribution(name):
    """20,000 rows of the same logits, each with its own uniform, through the graph the device
    runs (on ggml's CPU backend): the token counts fit the probabilities llama.cpp's own chain
    (top-k, top-p, min-p, temperature, dist; logit bias for ignore_eos) gives (chi-square, 1e-4)."""
    p = CONFIGS[name]
    probs = fused_dist.reference_probs(LOGITS, p, EOG)
    counts = np.bincount(_draws([p] * DRAWS, seed=1), minlength=LOGITS.size)
    ok, stat, crit = fused_dist.chi_square_ok(counts, probs)
    assert ok, f"{name}: chi-square {stat:.1f} > {crit:.1f}; kept {(probs > 0).sum()} tokens, drew {(counts > 0).sum()}"


def test_rows_with_different_settings_draw_each_from_their_own_distribution():
    """One computation over rows that ask different cuts, temperatures and end-token bans: each
    row's tokens follow its own settings' distribution."""
    names = list(CONFIGS)
    settings = [CONFIGS[names[i % len(names)]] for i in range(DRAWS)]
    tokens = _draws(settings, seed=2)
    for j, name in enumerate(names):
        counts = np.bincount(tokens[j::len(names)], minlength=LOGITS.size)
        ok, stat, crit = fused_dist.chi_square_ok(counts, fused_dist.reference_probs(LOGITS, CONFIGS[name], EOG))
        assert ok, f"{name} among mixed rows: chi-square {stat:.1f} > {crit:.1f}"


@pytest.mark.parametrize("variant", [(True, False), (False, True), (False, False)])
def test_variants_for_devices_lacking_an_operation_draw_the_same_distribution(variant):
    """A device without `ggml_top_k` takes the first k of a whole-row argsort; one without I32
    row gathers gathers token ids as F32. Same distribution."""
    p = CONFIGS["combined"]
    rows = np.tile(LOGITS, (DRAWS, 1))
    tokens = fused_dist.sample_rows(rows, [p] * DRAWS, np.random.default_rng(4).random(DRAWS), EOG, variant=variant)
    ok, stat, crit = fused_dist.chi_square_ok(np.bincount(tokens, minlength=LOGITS.size),
                                              fused_dist.reference_probs(LOGITS, p, EOG))
    assert ok, f"{variant}: chi-square {stat:.1f} > {crit:.1f}"


def test_ignore_eos_rows_never_draw_end_tokens():
    p = CONFIGS["ignore-eos"]
    assert not set(_draws([p] * 2000, seed=3).tolist()) & set(EOG)


def _texts(backend, requests):
    handles = [backend.enqueue(Request((5, 6, 7, 8), sp)) for sp in requests]
    return [h.result(WAIT).text for h in handles]


def test_a_seed_gives_the_same_text_in_any_batch(make_backend, tiny_model):
    """Each sequence draws from its own RNG: a seed gives the same text in another run and
    when it decodes beside requests with other settings, through the fused computation (the
    backend keeps idle chains attached beside them, which llama.cpp hands row 0)."""
    requests = [SamplingParams(temperature=t, top_k=k, top_p=p, seed=s, max_tokens=16)
                for t, k, p, s in ((0.8, 40, 0.95, 11), (1.5, 5, 1.0, 12), (0.5, 0, 0.9, 13), (1.0, 40, 0.95, 14))]
    before = fused_dist.BUILDS.copy()
    b = make_backend(tiny_model, cap=6, cache=False)
    batched = _texts(b, requests)
    built = fused_dist.BUILDS - before
    again = _texts(b, requests)
    alone = [_texts(b, [sp])[0] for sp in requests]
    assert built["shared"] >= 1 and built["row"] >= 4 and built["late"] == 0, built
    assert batched == again == alone
    assert len(set(batched)) > 1, "different seeds, different texts"


def _homogeneous(a: np.ndarray, b: np.ndarray, z: float = 3.719) -> tuple[bool, float, float]:
    """Chi-square test that two samples of tokens come from one distribution (cells with fewer
    than 10 tokens in both pooled; Wilson–Hilferty critical value at the normal quantile z)."""
    n = max(a.max(), b.max()) + 1
    ca, cb = np.bincount(a, minlength=n), np.bincount(b, minlength=n)
    big = ca + cb >= 10
    ca = np.append(ca[big], ca[~big].sum())
    cb = np.append(cb[big], cb[~big].sum())
    keep = ca + cb > 0
    ca, cb = ca[keep], cb[keep]
    tot = ca + cb
    ea, eb = tot * a.size / (a.size + b.size), tot * b.size / (a.size + b.size)
    stat = float(((ca - ea) ** 2 / ea).sum() + ((cb - eb) ** 2 / eb).sum())
    df = max(len(tot) - 1, 1)
    crit = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    return stat <= crit, stat, crit


def test_engine_first_tokens_follow_the_host_chain(make_backend, tiny_model):
    """The first token of one prompt under 400 seeds, sampled by the fused computation inside
    the decode graph, against 400 sampled by llama.cpp's chain on the host: one distribution."""
    sp = dict(temperature=1.5, top_k=40, top_p=0.95, min_p=0.0, max_tokens=1)
    prompt = (9, 4, 17, 3)

    def first(backend, seeds):
        handles = [backend.enqueue(Request(prompt, SamplingParams(**sp, seed=s))) for s in seeds]
        return np.array([tiny_model.tokenize(h.result(WAIT).text, add_special=False)[0] for h in handles])

    fused = first(make_backend(tiny_model, cap=32), range(400))
    host = first(make_backend(tiny_model, cap=32, backend_sampling=False), range(1000, 1400))
    assert len(set(fused.tolist())) > 5, "the prompt was chosen for a spread first-token distribution"
    ok, stat, crit = _homogeneous(fused, host)
    assert ok, f"chi-square {stat:.1f} > {crit:.1f}"


def test_on_the_host_the_sampler_runs_llama_chain():
    """Where llama.cpp keeps a chain on the host it calls the sampler's `apply`: llama.cpp's own
    samplers then choose, with the same distribution (and its seed reproduces after a reset)."""
    p = CONFIGS["combined"]
    sampler = fused_dist.fused_dist(replace(p, seed=5), LOGITS.size, [])
    try:
        def one() -> int:
            arr = (lc.llama_token_data * LOGITS.size)(*[lc.llama_token_data(i, float(x), 0.0)
                                                        for i, x in enumerate(LOGITS)])
            cur = lc.llama_token_data_array(arr, LOGITS.size, -1, False)
            lc.llama_sampler_apply(sampler.ptr, ctypes.byref(cur))
            return arr[cur.selected].id

        tokens = np.array([one() for _ in range(4000)])
        lc.llama_sampler_reset(sampler.ptr)
        again = [one() for _ in range(20)]
    finally:
        lc.llama_sampler_free(sampler.ptr)
    ok, stat, crit = fused_dist.chi_square_ok(np.bincount(tokens, minlength=LOGITS.size),
                                              fused_dist.reference_probs(LOGITS, p))
    assert ok, f"chi-square {stat:.1f} > {crit:.1f}"
    assert again == tokens[:20].tolist()


def test_chains_with_a_repetition_penalty_keep_llama_samplers(make_backend, tiny_model):
    """The fused sampler stands only for a chain with nothing before top-k."""
    b = make_backend(tiny_model, cap=2, cache=False)
    before = fused_dist.BUILDS.copy()
    sp = SamplingParams(temperature=0.8, repeat_penalty=1.1, seed=3, max_tokens=8)
    r = b.enqueue(Request((5, 6, 7), sp)).result(WAIT)
    assert r.output_tokens == 8 and fused_dist.BUILDS == before


def test_only_settings_the_computation_covers_take_the_fused_path():
    """Temperature, the cuts, the seed and ignore_eos are covered; a repetition penalty (or any
    other setting away from its default) keeps llama.cpp's samplers, and greedy has its own."""
    assert fused_dist.supports(SamplingParams(temperature=0.7, top_k=0, top_p=0.5, min_p=0.2, seed=1,
                                              ignore_eos=True, max_tokens=9, stop=("x",)))
    assert not fused_dist.supports(SamplingParams(temperature=0.7, repeat_penalty=1.2))
    assert not fused_dist.supports(SamplingParams(temperature=0.0))


def test_greedy_steps_beside_idle_fused_chains_skip_the_fused_computation(make_backend, tiny_model):
    """After temperature requests end, their fused chains stay attached, idle; greedy requests
    that run next build no shared fused computation (only one argmax per idle chain), and their
    text is what greedy gives without them."""
    b = make_backend(tiny_model, cap=4, cache=False)
    greedy = [SamplingParams(temperature=0.0, max_tokens=12)] * 3
    plain = _texts(b, greedy)
    _texts(b, [SamplingParams(temperature=0.8, seed=s, max_tokens=4) for s in (1, 2)])
    before = fused_dist.BUILDS.copy()
    beside = _texts(b, greedy)
    built = fused_dist.BUILDS - before
    assert built["idle"] >= 1, built
    assert built["shared"] == 0 and built["row"] == 0, built
    assert beside == plain


def test_few_unseeded_temperature_requests_run_llama_chains(make_backend, tiny_model):
    """Below `fused_dist_from` running temperature requests, an unseeded one takes llama.cpp's
    chain per sequence (faster at small batches on the GPU)."""
    b = make_backend(tiny_model, cap=4, cache=False, fused_dist_from=3)
    before = fused_dist.BUILDS.copy()
    _texts(b, [SamplingParams(temperature=0.8, max_tokens=4)] * 2)
    assert (fused_dist.BUILDS - before)["row"] == 0


def test_a_seeded_temperature_request_alone_takes_the_fused_sampler(make_backend, tiny_model):
    """A seed keeps the fused sampler at any load: one RNG, so it reproduces alone or batched."""
    b = make_backend(tiny_model, cap=4, cache=False, fused_dist_from=3)
    before = fused_dist.BUILDS.copy()
    _texts(b, [SamplingParams(temperature=0.8, max_tokens=4, seed=5)])
    assert (fused_dist.BUILDS - before)["row"] >= 1


def test_a_burst_reaching_the_threshold_takes_the_fused_sampler_throughout(make_backend, tiny_model):
    """Temperature requests admitted together count toward `fused_dist_from` at once: all of
    them take the fused sampler, none llama.cpp's chain."""
    b = make_backend(tiny_model, cap=4, cache=False, fused_dist_from=3)
    before = fused_dist.BUILDS.copy()
    _texts(b, [SamplingParams(temperature=0.8, max_tokens=4)] * 4)
    built = fused_dist.BUILDS - before
    assert built["shared"] >= 1 and built["row"] >= 4 * built["shared"], built
