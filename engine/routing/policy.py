"""The policy interface every routing policy implements, and the arithmetic and wording
the policies share (seconds from tokens and rates, a `BackendScore` from totals, the lowest
eligible score with its explanation against the runner-up)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TypeVar

from engine.core.errors import InvalidRequest
from engine.core.snapshot import BackendSnapshot, Rates

from .budget import DecodeBudget
from .types import BackendScore, RouteQuery


class Policy:
    """Scores every backend and picks one. Subclasses override `score` and/or `choose`.

    Baselines that ignore scores (round-robin, only:) take the seed score (`SeedScored`), so
    their decisions still record comparable numbers.
    """

    name = ""
    uses_budget = True  # whether the decode-budget mode changes this policy's scores

    def score(self, query: RouteQuery, snap: BackendSnapshot, budget: DecodeBudget) -> BackendScore:
        raise NotImplementedError

    def choose(self, query: RouteQuery, scores: Sequence[BackendScore]) -> tuple[str, str]:
        """Return (backend name, reason) among the eligible `scores` (at least one exists)."""
        raise NotImplementedError

    def pinned(self, query: RouteQuery, backend: str) -> None:
        """The request named its backend and bypassed `choose`: a stateful policy may note it."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


P = TypeVar("P", bound=Policy)


def from_spec(spec: str, prefix: str, params: dict[str, type[int] | type[float]], make: Callable[..., P]) -> P:
    """The policy a spec `PREFIX:KEY=VALUE,...` names: each KEY one of `params` (its value read as
    that type), `make(**values)` builds it; anything else is an InvalidRequest naming the spec. Its
    name is PREFIX with the parameters given, in `params`' order, so `Router.clear()` rebuilds the
    same policy."""
    kw: dict[str, int | float] = {}
    for item in filter(None, (p.strip() for p in spec[len(prefix) + 1:].split(","))):
        key, eq, value = (x.strip() for x in item.partition("="))
        if not eq or key not in params:
            raise InvalidRequest(f"policy {spec!r}: {item!r} is not one of "
                                 f"{', '.join(k + '=' for k in params)}", param="policy")
        try:
            kw[key] = params[key](value)
        except ValueError:
            number = "a whole number" if params[key] is int else "a number"
            raise InvalidRequest(f"policy {spec!r}: {key} must be {number}", param="policy") from None
    try:
        policy = make(**kw)
    except ValueError as e:
        raise InvalidRequest(f"policy {spec!r}: {e}", param="policy") from None
    if kw:
        policy.name = f"{prefix}:" + ",".join(f"{k}={kw[k]:g}" for k in params if k in kw)
    return policy


def seconds_for(tokens: float, rate: float) -> float:
    if tokens <= 0:
        return 0.0
    return tokens / rate if rate > 0 else math.inf


def step_seconds(rates: Rates, batch: int) -> float:
    if not (rates.step_alpha_s or rates.step_beta_s) and rates.decode_tok_s <= 0:
        return math.inf
    return rates.step_s(batch)


def make_score(snap: BackendSnapshot, cached: int, prefill: float, decode: float, prefill_s: float,
               decode_s: float) -> BackendScore:
    return BackendScore(
        name=snap.name,
        device=snap.device,
        cached_tokens=cached,
        prefill_tokens=prefill,
        decode_tokens=decode,
        prefill_s=prefill_s,
        decode_s=decode_s,
        score_s=prefill_s + decode_s,
        rates=snap.rates,
        n_running=len(snap.running),
        n_waiting=len(snap.waiting),
        cap=snap.cap,
        eligible=snap.healthy,
    )


def lowest(scores: Sequence[BackendScore], key: Callable[[BackendScore], float],
           explain: Callable[[BackendScore, BackendScore | None], str]) -> tuple[str, str]:
    """Eligible entry with the lowest key (first wins ties) and the explanation against the runner-up."""
    eligible = [s for s in scores if s.eligible]
    best = min(eligible, key=key)  # min() keeps the first of equal keys
    others = [s for s in eligible if s is not best]
    if not others:
        skipped = [s.name for s in scores if not s.eligible]
        why = f" ({', '.join(skipped)} unhealthy)" if skipped else ""
        return best.name, f"only eligible backend{why}: " + explain(best, None)
    runner_up = min(others, key=key)
    return best.name, explain(best, runner_up)


def fmt_s(seconds: float) -> str:
    return f"{seconds:.3f} s" if math.isfinite(seconds) else "never (no rate)"


def _runner_up(eligible: Sequence[BackendScore], best: BackendScore) -> BackendScore:
    others = [s for s in eligible if s is not best]
    return min(others, key=lambda s: s.score_s) if others else best


def fmt_tok(x: float) -> str:
    """Token counts: whole numbers plain, ratio-scaled ones with one decimal."""
    return f"{x:.0f}" if float(x).is_integer() else f"{x:.1f}"


def names_of(scores: Sequence[BackendScore]) -> str:
    return ", ".join(s.name for s in scores)
