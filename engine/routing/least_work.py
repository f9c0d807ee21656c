"""`least-work`: fewest remaining tokens (prefill + decode, the new request's included); the
rates are ignored. A baseline."""

from __future__ import annotations

from collections.abc import Sequence

from .policy import fmt_tok, lowest
from .seed_score import SeedScored
from .types import BackendScore, RouteQuery

HELP = "Fewest remaining prefill + decode tokens; ignores the rates."


class LeastWork(SeedScored):
    """Fewest remaining tokens (prefill + decode, new request included); rates ignored."""

    name = "least-work"

    def choose(self, query: RouteQuery, scores: Sequence[BackendScore]) -> tuple[str, str]:
        return lowest(scores, lambda s: s.work_tokens, _explain_work)


def _explain_work(best: BackendScore, other: BackendScore | None) -> str:
    if other is None:
        return f"{best.name} {fmt_tok(best.work_tokens)} tokens of work"
    rel = "=" if best.work_tokens == other.work_tokens else ">"
    return (
        f"{other.name} {fmt_tok(other.work_tokens)} tokens {rel} {best.name} {fmt_tok(best.work_tokens)} tokens "
        f"of remaining prefill + decode work"
    )
