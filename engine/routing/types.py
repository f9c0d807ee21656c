"""The router's values: what it is asked (`RouteQuery`), what it weighs per backend
(`BackendScore`) and what it answers (`RoutingDecision`, the explained decision that
`/v1/routing`, the app and the benchmarks record). Pure data, no policy. The score and the
decision live in `engine/core/decision.py`, beside the other values every layer reads."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.core.decision import BackendScore, RoutingDecision

if TYPE_CHECKING:
    from engine.core.request import Request

__all__ = ["BackendScore", "RouteQuery", "RoutingDecision", "prompt_text"]


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


def prompt_text(request: Request) -> str:
    """A text request's prompt as one string (messages joined role by role), for prefix hashing."""
    if request.text is not None:
        return request.text
    return "".join(f"<|{m.get('role', '')}|>{m.get('content') or ''}" for m in request.messages or ())
