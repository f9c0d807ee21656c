"""`seed-score`: the study's score, exactly (docs/study.md's golden numbers, tests/test_router.py).

It sums the work queued on a backend and divides it by the backend's aggregate rates; it never
asks when the new request itself would finish. Kept because it is the study's policy and what
the app's Teaching view explains; the default is `engine/routing/default.py`.
"""

from __future__ import annotations

from engine.core.snapshot import BackendSnapshot

from .budget import RAW, DecodeBudget
from .policy import Policy, fmt_tok, lowest, make_score, seconds_for
from .types import BackendScore, RouteQuery

HELP = "The study's score: prefill tokens / prefill rate + decode budget / decode rate; lowest wins."


def seed_score(query: RouteQuery, snap: BackendSnapshot, budget: DecodeBudget = RAW) -> BackendScore:
    """The study's score for sending `query` to `snap`'s backend (lower wins).

    score = (sum of prefill_left over running and queued items + new prompt - cached) / prefill rate
          + (sum of decode_left over running and queued items + new max_tokens) / decode rate

    Queued items carry the cache estimate made when they were routed (`WorkItem.prefill_left`).
    With a `ratio` budget, running items' decode_left is scaled (see module docstring).
    """
    cached = query.cached_on(snap.name)
    prefill = sum(i.prefill_left for i in snap.items) + (query.prompt_tokens - cached)
    decode = sum(budget.running(i.decode_left) if i.running else i.decode_left for i in snap.items)
    decode += query.max_tokens
    prefill_s = seconds_for(prefill, snap.rates.prefill_tok_s)
    decode_s = seconds_for(decode, snap.rates.decode_tok_s)
    return make_score(snap, cached, prefill, decode, prefill_s, decode_s)


class SeedScored(Policy):
    """A policy that scores backends by the study's score (its own `choose` aside)."""

    def score(self, query: RouteQuery, snap: BackendSnapshot, budget: DecodeBudget) -> BackendScore:
        return seed_score(query, snap, budget)


class SeedScore(SeedScored):
    """The study's policy: lowest `seed_score()` wins; ties go to the first backend."""

    name = "seed-score"

    def choose(self, query, scores):
        return lowest(scores, lambda s: s.score_s, _explain_seconds)


def _explain_seconds(best: BackendScore, other: BackendScore | None) -> str:
    if other is None:
        return f"{best.name} {best.score_s:.3f} s"
    rel = "=" if best.score_s == other.score_s else ">"
    tie = f" (tie goes to {best.name}, first in order)" if rel == "=" else ""
    return (
        f"{other.name} {other.score_s:.3f} s {rel} {best.name} {best.score_s:.3f} s{tie}: "
        f"{fmt_tok(other.prefill_tokens)} prefill + {fmt_tok(other.decode_tokens)} decode tokens queued on "
        f"{other.name}, {fmt_tok(best.prefill_tokens)} + {fmt_tok(best.decode_tokens)} on {best.name}"
    )
