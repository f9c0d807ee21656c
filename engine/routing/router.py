"""`Router`: routes each request with the current policy and remembers recent decisions.

It holds the current policy, the decode-budget mode and a bounded history of
`RoutingDecision`s, and guards them with one lock. Two policies keep state of their own under
that lock: `round-robin` its turn and `cache-aware` (and `default`) where recent prompts went;
a new policy (`set_policy`, `clear`) starts fresh.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence

from engine.core.errors import BackendUnavailable, InvalidRequest
from engine.core.snapshot import BackendSnapshot

from .budget import RAW, DecodeBudget, NewTokenRatio, check_budget
from .policy import names_of
from .registry import DEFAULT_POLICY, make_policy
from .types import BackendScore, RouteQuery, RoutingDecision

DEFAULT_HISTORY = 1000


class Router:
    """Routes requests with the current policy and remembers recent decisions.

    Thread-safe: `route`, `set_policy`, `set_budget`, `reset_ratio` and `recent` may be called
    from any thread; one lock serialises them (policies such as round-robin keep state).
    """

    def __init__(
        self,
        policy: str = DEFAULT_POLICY,
        budget: str = "raw",
        *,
        history: int = DEFAULT_HISTORY,
        ratio: NewTokenRatio | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self._lock = threading.Lock()
        self._policy = make_policy(policy)
        self._budget = check_budget(budget)
        self._ratio = ratio or NewTokenRatio()
        self._history: deque[RoutingDecision] = deque(maxlen=history)
        self._clock = clock

    @property
    def policy(self) -> str:
        return self._policy.name

    @property
    def budget(self) -> str:
        return self._budget

    @property
    def new_token_ratio(self) -> float:
        return self._ratio.value

    def set_policy(self, name: str) -> str:
        """Switch policy (fresh state); InvalidRequest listing valid names if unknown."""
        policy = make_policy(name)
        with self._lock:
            self._policy = policy
        return policy.name

    def set_budget(self, mode: str) -> str:
        """Switch the decode-budget mode (`raw` or `ratio`); InvalidRequest otherwise."""
        mode = check_budget(mode)
        with self._lock:
            self._budget = mode
        return mode

    def reset_ratio(self) -> float:
        """Reset the `new_token_ratio` to its initial value (call on retraction/preemption)."""
        with self._lock:
            return self._ratio.reset()

    def route(self, query: RouteQuery, snapshots: Sequence[BackendSnapshot], *,
              since: float | None = None, wait_s: float = 0.0) -> RoutingDecision:
        """Choose a backend for `query` among `snapshots` (in backend order) and record it.

        `since`: the `time.perf_counter()` at which the caller began routing it (after `wait_s`
        waiting its turn); the decision's `took_s` counts from there (the snapshots included).

        A pinned query (`query.backend`) bypasses the policy. Raises InvalidRequest for an
        unknown pinned backend, BackendUnavailable if the chosen/pinned backend or every
        backend is unhealthy.
        """
        if not snapshots:
            raise BackendUnavailable("no backends")
        with self._lock:
            policy = self._policy
            budget = self._budget
            ratio = self._ratio.value if budget == "ratio" else None
            decode_budget = DecodeBudget("ratio", ratio) if ratio is not None else RAW
            scores = tuple(policy.score(query, snap, decode_budget) for snap in snapshots)

            if query.backend is not None:
                backend, reason = _pin(query.backend, scores)
                policy.pinned(query, backend)
                pinned = True
            else:
                if not any(s.eligible for s in scores):
                    raise BackendUnavailable(f"no healthy backend among {names_of(scores)}")
                backend, reason = policy.choose(query, scores)
                pinned = False

            if budget == "ratio":
                self._ratio.step()
            decision = RoutingDecision(
                time=self._clock(),
                request_id=query.request_id,
                policy=policy.name,
                backend=backend,
                reason=reason,
                scores=scores,
                budget=budget,
                new_token_ratio=ratio if policy.uses_budget else None,
                pinned=pinned,
                moved_from=query.moved_from,
                continued=query.continued,
                wait_s=wait_s,
                took_s=time.perf_counter() - since if since is not None else 0.0,
                kind=query.kind,
            )
            self._history.append(decision)
            return decision

    def recent(self, n: int | None = None) -> list[RoutingDecision]:
        """The last `n` decisions (all kept if None), oldest first."""
        with self._lock:
            items = list(self._history)
        if n is None:
            return items
        return items[-n:] if n > 0 else []

    def clear(self) -> None:
        """Forget recorded decisions and policy state (e.g. between benchmark runs)."""
        with self._lock:
            self._history.clear()
            self._policy = make_policy(self._policy.name)
            self._ratio.reset()


def _pin(name: str, scores: Sequence[BackendScore]) -> tuple[str, str]:
    for s in scores:
        if s.name == name:
            if not s.eligible:
                raise BackendUnavailable(f"backend {name!r} is unhealthy")
            return name, f"pinned to {name} by the request (policy bypassed)"
    raise InvalidRequest(f"unknown backend {name!r}; backends: {names_of(scores)}", param="backend")
