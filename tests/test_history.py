"""A context that has served conversations serves the next workload as one that has not
(`tandem bench history` measures the time on the default model; here, on the tiny model, the
cells each context holds, which every decode step of unified KV without flash attention scans)."""

from __future__ import annotations

import random

from engine.core.request import Request, SamplingParams

WAIT = 300


def _tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(n)]


def _chats(backend, model, conversations: int = 4, turns: int = 3) -> None:
    """Conversations sharing a system prompt, each turn sending the history so far and the reply."""
    rng = random.Random(5)
    vocab = model.n_vocab
    system = _tokens(rng, 200, vocab)
    histories = [list(system) for _ in range(conversations)]
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    for _ in range(turns):
        handles = []
        for h in histories:
            h += _tokens(rng, 30, vocab)
            handles.append(backend.enqueue(Request(tuple(h), sp)))
        for h, handle in zip(histories, handles):
            r = handle.result(WAIT)
            assert r.output_tokens == 16
            h += model.tokenize(r.text, add_special=False)  # the reply as a client sends it back


def _study(backend, vocab: int) -> None:
    """The study's shape: a warmed shared prefix, then requests of it and their own tokens."""
    rng = random.Random(9)
    prefix = _tokens(rng, 120, vocab)
    backend.warm(prefix).result(WAIT)
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    handles = [backend.enqueue(Request(tuple(prefix + _tokens(rng, 10, vocab)), sp)) for _ in range(8)]
    assert all(h.result(WAIT).output_tokens == 24 for h in handles)


def test_a_context_that_served_chats_holds_no_more_cells_for_the_next_workload(make_backend, tiny_model):
    """Without the rule that clears an idle context's cache for unrelated work, the chats'
    histories stayed beside the study's cells (the idle budget is n_ctx / B) and every step
    of the study scanned them."""
    vocab = tiny_model.n_vocab
    history = make_backend(tiny_model, cap=8, n_ctx=4096)
    fresh = make_backend(tiny_model, cap=8, n_ctx=4096)
    _chats(history, tiny_model)
    assert history.kv_cells_used() > 600, "the conversations' histories stay cached while nothing else runs"
    _study(history, vocab)
    _study(fresh, vocab)
    assert history.kv_cells_used() <= 1.10 * fresh.kv_cells_used(), (history.kv_cells_used(), fresh.kv_cells_used())
