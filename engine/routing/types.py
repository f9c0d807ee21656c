"""The router's values: what it is asked (`RouteQuery`), what it weighs per backend
(`BackendScore`) and what it answers (`RoutingDecision`, the explained decision that
`/v1/routing`, the app and the benchmarks record). Pure data, no policy."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING

from engine.core.snapshot import Rates

if TYPE_CHECKING:
    from engine.core.request import Request


@dataclass(frozen=True, slots=True)
class RouteQuery:
    """What the router needs to know about a new request.

    `cached` maps backend name to the prefix tokens that backend's cache already holds for
    this prompt (a missing name means 0). `backend` pins the request to one backend.
    `tokens`, when given, are the prompt's token ids: `cache-aware` remembers where recent
    prompts went, so requests sharing a prefix that is still being computed find it too, and
    groups requests by shared prefix (tenants). `text` is the prompt as text where no token ids
    are at hand (a router in front of remote engines): `cache-aware` uses it the same way, in
    blocks of characters.
    """

    request_id: str
    prompt_tokens: int
    max_tokens: int
    cached: Mapping[str, int] = field(default_factory=dict)
    backend: str | None = None
    tokens: tuple[int, ...] = field(default=(), repr=False)
    text: str = field(default="", repr=False)
    # A request its backend gave back (it failed or restarts): that backend's name, and the
    # output tokens it had streamed, which the new backend continues from (0: from the prompt).
    moved_from: str | None = None
    continued: int = 0
    # Of `cached`, per backend, the own history of an earlier request this prompt resumes there
    # (a conversation's next turn), past a system prompt others share (PrefixCache.match_resumed).
    resumed: Mapping[str, int] = field(default_factory=dict)
    kind: str = "completion"  # or "embedding": prompt tokens only, nothing decoded

    @classmethod
    def from_request(cls, request: Request, cached: Mapping[str, int] | None = None,
                     moved_from: str | None = None, continued: int = 0,
                     resumed: Mapping[str, int] | None = None) -> RouteQuery:
        """Build the query for an engine `Request` and its per-backend cache matches."""
        return cls(
            resumed=dict(resumed or {}),
            moved_from=moved_from,
            continued=continued,
            request_id=request.id,
            prompt_tokens=request.prompt_estimate,
            max_tokens=request.sampling.max_tokens,
            cached=dict(cached or {}),
            backend=request.backend,
            tokens=tuple(request.prompt_tokens),
            text="" if request.prompt_tokens else prompt_text(request),
        )

    def cached_on(self, backend: str) -> int:
        """Cached prefix tokens on `backend`, clamped to [0, prompt_tokens]."""
        return min(max(int(self.cached.get(backend, 0)), 0), self.prompt_tokens)

    def resumed_on(self, backend: str) -> int:
        """Of `cached_on(backend)`, the own history of an earlier request this one resumes there."""
        return min(max(int(self.resumed.get(backend, 0)), 0), self.cached_on(backend))

    def prefill_on(self, backend: str) -> int:
        """Prompt tokens the new request would still have to compute on `backend`."""
        return self.prompt_tokens - self.cached_on(backend)


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
        d: dict[str, object] = {f.name: json_number(getattr(self, f.name)) for f in fields(self) if f.name != "rates"}
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


def prompt_text(request: Request) -> str:
    """A text request's prompt as one string (messages joined role by role), for prefix hashing."""
    if request.text is not None:
        return request.text
    return "".join(f"<|{m.get('role', '')}|>{m.get('content') or ''}" for m in request.messages or ())


def json_number(x: object) -> object:
    """A field's value for JSON, which has no infinity: an unreachable backend's infinite
    score becomes null; anything else stays as it is."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x
