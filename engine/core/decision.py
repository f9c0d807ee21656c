"""A routing decision as every layer reads it: each backend's score (`BackendScore`) and the
explained choice (`RoutingDecision`) that `/v1/routing`, the app, the benchmarks and a request's
handle carry. Plain frozen values; the router (engine/routing/) makes them."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from engine.core.snapshot import Rates


@dataclass(frozen=True, slots=True)
class BackendScore:
    """One backend's side of a routing decision.

    `prefill_tokens` and `decode_tokens` are the totals the score counted (work already on the
    backend plus the new request); `prefill_s + decode_s == score_s`. Lower `score_s` is better.
    For `predicted-finish`, `score_s` is the predicted finish time of the new request and
    `decode_tokens` the tokens all sequences decode until then.
    """

    name: str
    device: str
    cached_tokens: int
    prefill_tokens: float
    decode_tokens: float
    prefill_s: float
    decode_s: float
    score_s: float
    rates: Rates
    n_running: int
    n_waiting: int
    cap: int
    eligible: bool

    @property
    def queue_wait_s(self) -> float | None:
        """About how long a request arriving now waits before it is admitted: the share of the
        scored work that the requests queued ahead of it hold (None: no finite score)."""
        if not math.isfinite(self.score_s):
            return None
        return self.score_s * self.n_waiting / max(self.n_waiting + self.n_running, 1)

    @property
    def work_tokens(self) -> float:
        """Prefill plus decode tokens: the `least-work` measure."""
        return self.prefill_tokens + self.decode_tokens

    def to_dict(self) -> dict:
        d = {f.name: json_number(getattr(self, f.name)) for f in fields(self) if f.name != "rates"}
        d["rates"] = {f.name: json_number(getattr(self.rates, f.name)) for f in fields(self.rates)}
        return d


@dataclass(frozen=True, slots=True)
class RoutingDecision:
    """Where one request went and why, with every backend's score at that instant."""

    time: float
    request_id: str
    policy: str
    backend: str
    reason: str
    scores: tuple[BackendScore, ...]
    budget: str = "raw"
    new_token_ratio: float | None = None
    pinned: bool = False
    moved_from: str | None = None  # the backend that gave the request back (`RouteQuery`)
    continued: int = 0  # output tokens streamed there, continued here
    # Seconds the engine spent on it: waiting for its routing lock (other requests being routed),
    # then looking up every backend's cached prefix, taking their snapshots and choosing.
    wait_s: float = 0.0
    took_s: float = 0.0
    kind: str = "completion"  # what was routed: a completion (chat, text) or an "embedding"

    def score_of(self, backend: str) -> BackendScore:
        """The score entry for `backend` (KeyError if it was not in the snapshot)."""
        for s in self.scores:
            if s.name == backend:
                return s
        raise KeyError(backend)

    @property
    def chosen(self) -> BackendScore:
        return self.score_of(self.backend)

    def to_dict(self) -> dict:
        return {
            "time": self.time,
            "request_id": self.request_id,
            "policy": self.policy,
            "backend": self.backend,
            "reason": self.reason,
            "budget": self.budget,
            "new_token_ratio": self.new_token_ratio,
            "pinned": self.pinned,
            "moved_from": self.moved_from,
            "continued": self.continued,
            "wait_s": self.wait_s,
            "took_s": self.took_s,
            "kind": self.kind,
            "scores": [s.to_dict() for s in self.scores],
        }


def json_number(x: object) -> object:
    """JSON has no infinity: an unreachable backend's infinite score becomes null."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x
