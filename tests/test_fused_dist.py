"""Fused temperature sampling on the device (engine/llama/fused_dist.py): the same distribution
as llama.cpp's own chain, one computation for every row of a step, and a seed that reproduces."""

from __future__ import annotations

import ctypes
import math
from dataclasses import replace

import numpy as np
import pytest

from engine.core.request import Request, SamplingParams
from engine.llama import fused_dist, lc

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

# A wide row for the top-k in stages: 5,000 tokens in chunks of 256 (padded to 5,120, 20 chunks;
# the 800 survivors padded to 1,024 for a second stage), every top-k of CONFIGS (<= 40) at most a
# quarter of a chunk. Spread so that a top-k 40 cut falls among tokens of visible probability.
WIDE = np.random.default_rng(8).normal(size=5000).astype(np.float32) * 2.5
CHUNK = 256
WIDE_EOG = [int(np.argmax(WIDE)), 3]


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


@pytest.mark.parametrize("variant", [(True, False, False), (False, True, False), (False, False, False)])
def test_variants_for_devices_lacking_an_operation_draw_the_same_distribution(variant):
    """A device without `ggml_top_k` takes the first k of a whole-row argsort; one without I32
    row gathers gathers token ids as F32. Same distribution."""
    p = CONFIGS["combined"]
    rows = np.tile(LOGITS, (DRAWS, 1))
    tokens = fused_dist.sample_rows(rows, [p] * DRAWS, np.random.default_rng(4).random(DRAWS), EOG, variant=variant)
    ok, stat, crit = fused_dist.chi_square_ok(np.bincount(tokens, minlength=LOGITS.size),
                                              fused_dist.reference_probs(LOGITS, p, EOG))
    assert ok, f"{variant}: chi-square {stat:.1f} > {crit:.1f}"


@pytest.mark.parametrize("name", [n for n, p in CONFIGS.items() if p.top_k > 0])
def test_top_k_in_stages_draws_from_llama_chain_distribution(name):
    """The top-k in stages of small sorts (a wide row, chunks of 256, two stages with padding):
    20,000 draws fit llama.cpp's chain's probabilities on that row (chi-square, 1e-4)."""
    p = CONFIGS[name]
    assert fused_dist.in_stages(WIDE.size, p.top_k, CHUNK)
    tokens = fused_dist.sample_rows(np.tile(WIDE, (DRAWS, 1)), [p] * DRAWS, np.random.default_rng(5).random(DRAWS),
                                    WIDE_EOG, chunk=CHUNK)
    probs = fused_dist.reference_probs(WIDE, p, WIDE_EOG)
    ok, stat, crit = fused_dist.chi_square_ok(np.bincount(tokens, minlength=WIDE.size), probs)
    assert ok, f"{name}: chi-square {stat:.1f} > {crit:.1f}"


def test_rows_with_different_top_k_in_stages_draw_each_from_their_own_distribution():
    """Rows asking top-k 8, 20 and 40 share one staged top-k of 40 (the smaller ones masked
    after it): each row's tokens follow its own chain's distribution."""
    names = ["top-k", "combined", "temp-0.5"]
    settings = [CONFIGS[names[i % len(names)]] for i in range(DRAWS)]
    tokens = fused_dist.sample_rows(np.tile(WIDE, (DRAWS, 1)), settings, np.random.default_rng(6).random(DRAWS),
                                    WIDE_EOG, chunk=CHUNK)
    for j, name in enumerate(names):
        counts = np.bincount(tokens[j::len(names)], minlength=WIDE.size)
        ok, stat, crit = fused_dist.chi_square_ok(counts, fused_dist.reference_probs(WIDE, CONFIGS[name], WIDE_EOG))
        assert ok, f"{name} among mixed rows: chi-square {stat:.1f} > {crit:.1f}"


@pytest.mark.parametrize("vocab, chunk, k", [(5000, 256, 40), (4096, 256, 64), (151936, 1024, 40), (49152, 1024, 1)])
def test_top_k_in_stages_keeps_exactly_the_k_best(vocab, chunk, k):
    """The staged top-k keeps the same tokens as numpy's top-k of the same logits, in descending
    order, on rows that need padding or not, one stage or two, with a third of a row at -1e30
    (banned end tokens look like that)."""
    logits = np.random.default_rng(vocab + k).normal(size=(3, vocab)).astype(np.float32) * 3
    logits[1, : vocab // 3] = -1e30
    assert fused_dist.in_stages(vocab, k, chunk)
    ids = fused_dist.top_k_rows(logits, k, chunk=chunk)
    for r in range(3):
        assert set(ids[r].tolist()) == set(np.argpartition(-logits[r], k - 1)[:k].tolist())
        assert np.all(np.diff(logits[r][ids[r]]) <= 0)


def test_top_k_in_stages_keeps_k_of_the_best_values_among_ties():
    """Integer logits, many equal: the staged top-k keeps k distinct tokens whose logits are the
    k largest values (which of the tokens tied at the cut it keeps is not specified, as in
    llama.cpp's own top-k; tied tokens have equal probability)."""
    logits = np.random.default_rng(9).integers(0, 20, size=(4, 5000)).astype(np.float32)
    ids = fused_dist.top_k_rows(logits, 40, chunk=CHUNK)
    for r in range(4):
        assert len(set(ids[r].tolist())) == 40
        assert np.array_equal(np.sort(logits[r][ids[r]]), np.sort(logits[r])[-40:])


def test_stages_apply_only_to_a_small_k_over_few_wide_rows():
    """k at most a quarter of a chunk, rows of at least four chunks, at most STAGES_MAX_ROWS rows."""
    assert fused_dist.in_stages(151936, 40, 1024, n_rows=fused_dist.STAGES_MAX_ROWS)
    assert not fused_dist.in_stages(151936, 40, 1024, n_rows=fused_dist.STAGES_MAX_ROWS + 1)
    assert not fused_dist.in_stages(151936, 257, 1024)
    assert not fused_dist.in_stages(4095, 40, 1024)
    assert not fused_dist.in_stages(151936, 40, 0)


def test_a_top_k_chunk_must_be_a_power_of_two():
    with pytest.raises(ValueError, match="power of two"):
        fused_dist.top_k_rows(WIDE[None, :], 40, chunk=300)
    with pytest.raises(ValueError, match="power of two"), fused_dist.top_k_stages(1000):
        pass


def test_the_cpu_backend_keeps_one_top_k_per_row_by_default(make_backend, default_model):
    """On the CPU backend ggml's own top-k is faster than the stages: a top-k 40 over the
    default model's 49,152 tokens runs without them unless asked."""
    before = fused_dist.BUILDS.copy()
    _texts(make_backend(default_model, cap=2, cache=False),
           [SamplingParams(temperature=0.8, top_k=40, seed=s, max_tokens=4) for s in (1, 2)])
    built = fused_dist.BUILDS - before
    assert built["shared"] >= 1 and built["two-stage"] == 0, built


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


def _first_tokens_fit_host_chain(make_backend, model, prompt: tuple[int, ...], cap: int = 32) -> None:
    """The first token of `prompt` under 400 seeds, sampled by the fused computation inside the
    decode graph, against 400 sampled by llama.cpp's chain on the host: one distribution (each
    distinct text a category)."""
    sp = dict(temperature=1.5, top_k=40, top_p=0.95, min_p=0.0, max_tokens=1)
    names: dict[str, int] = {}

    def first(backend, seeds):
        handles = [backend.enqueue(Request(prompt, SamplingParams(**sp, seed=s))) for s in seeds]
        return np.array([names.setdefault(h.result(WAIT).text, len(names)) for h in handles])

    fused = first(make_backend(model, cap=cap), range(400))
    host = first(make_backend(model, cap=cap, backend_sampling=False), range(1000, 1400))
    assert len(set(fused.tolist())) > 5, "the prompt was chosen for a spread first-token distribution"
    ok, stat, crit = _homogeneous(fused, host)
    assert ok, f"chi-square {stat:.1f} > {crit:.1f}"


def test_engine_first_tokens_follow_the_host_chain(make_backend, tiny_model):
    """A small vocabulary (512 tokens): one `ggml_top_k` per row."""
    before = fused_dist.BUILDS.copy()
    _first_tokens_fit_host_chain(make_backend, tiny_model, (9, 4, 17, 3))
    built = fused_dist.BUILDS - before
    assert built["shared"] >= 1 and built["two-stage"] == 0, built


@pytest.mark.parametrize("path", ["staged", "sortfree"])
def test_engine_first_tokens_with_top_k_in_stages_follow_the_host_chain(make_backend, default_model, path):
    """The default model's 49,152 tokens, the top-k 40 taken as a GPU takes it (asked of the CPU
    backend, which runs the graph a GPU would): in stages of 1,024 (`staged`) or by maxima
    (`sortfree`), inside the decode graph, with the same distribution as llama.cpp's chain."""
    assert fused_dist.in_stages(default_model.info.n_vocab, 40, 1024)
    before = fused_dist.BUILDS.copy()
    # "My favourite": some 36 distinct first tokens in 200 draws at this temperature
    with fused_dist.top_k_stages(1024, on_cpu=True), fused_dist.fused_path(path, pooled_on_cpu=True):
        _first_tokens_fit_host_chain(make_backend, default_model, tuple(default_model.tokenize("My favourite",
                                                                                              add_special=False)),
                                     cap=16)
    built = fused_dist.BUILDS - before
    assert built["two-stage" if path == "staged" else "maxima"] >= 1 and built["host"] == 0, built


@pytest.mark.parametrize("vocab, k", [(151936, 40), (151936, 64), (5000, 20), (49152, 1), (300, 2)])
def test_top_k_by_maxima_keeps_exactly_the_k_best(vocab, k):
    """The top-k by chunk maxima keeps the same tokens as numpy's top-k, in descending order,
    whatever the spread: rows whose best values crowd into one chunk, one per chunk, or lie anywhere."""
    rng = np.random.default_rng(vocab + k)
    logits = rng.normal(size=(4, vocab)).astype(np.float32)
    logits[1, 512:512 + 2 * k] += 10.0  # the best of row 1 crowd into one or two chunks
    logits[2, ::256] += 10.0  # row 2: one standout a chunk
    ids = fused_dist.top_k_rows(logits, k, maxima=True)
    for r in range(4):
        want = np.argsort(-logits[r], kind="stable")[:k]
        assert set(ids[r]) == set(want), f"row {r}"
        assert np.all(np.diff(logits[r][ids[r]]) <= 0), f"row {r} not in descending order"


@pytest.mark.parametrize("name", [n for n, p in CONFIGS.items() if 0 < p.top_k <= 20])
def test_top_k_by_maxima_draws_from_llama_chain_distribution(name):
    """The sort-free computation over a wide row (the top-k by maxima, the short draw): 20,000
    draws fit llama.cpp's chain's probabilities (chi-square, 1e-4)."""
    p = CONFIGS[name]
    with fused_dist.fused_path("sortfree", pooled_on_cpu=True):
        tokens = fused_dist.sample_rows(np.tile(WIDE, (DRAWS, 1)), [p] * DRAWS,
                                        np.random.default_rng(15).random(DRAWS), WIDE_EOG)
    probs = fused_dist.reference_probs(WIDE, p, WIDE_EOG)
    ok, stat, crit = fused_dist.chi_square_ok(np.bincount(tokens, minlength=WIDE.size), probs)
    assert ok, f"{name}: chi-square {stat:.1f} > {crit:.1f}"


@pytest.mark.parametrize("p", [SamplingParams(temperature=0.8, top_k=0, top_p=0.95, min_p=0.0),
                               SamplingParams(temperature=1.0, top_k=0, top_p=0.8, min_p=0.02)])
def test_rows_without_top_k_draw_by_proposals_from_llama_chain_distribution(p):
    """No top-k: each row draws proposals from its whole distribution (1,024-token chunks, then
    the token) and keeps the first inside the cuts; 20,000 draws over a 5,000-token row fit
    llama.cpp's chain (chi-square, 1e-4). Every proposal of a row fails with probability at most
    (1 - q)^PROPOSALS, q the mass the cuts keep at the row's temperature (here at least 0.8: at
    most 1.6e-3 of the draws take the fallback, the likeliest token)."""
    part = DRAWS // 5  # five computations: the proposals' intermediates are rows x 5,000 x PROPOSALS
    uniforms = np.random.default_rng(16).random((DRAWS, fused_dist.sortfree.PROPOSALS))
    tokens = np.concatenate([fused_dist.sample_rows(np.tile(WIDE, (part, 1)), [p] * part,
                                                    uniforms[i * part:(i + 1) * part], WIDE_EOG) for i in range(5)])
    probs = fused_dist.reference_probs(WIDE, p, WIDE_EOG)
    ok, stat, crit = fused_dist.chi_square_ok(np.bincount(tokens, minlength=WIDE.size), probs)
    assert ok, f"chi-square {stat:.1f} > {crit:.1f}; kept {(probs > 0).sum()} tokens"


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
    assert r.output_tokens == 8 and before == fused_dist.BUILDS


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
