"""Events the engine publishes, and the thread-safe bus that carries them.

Publishers call `EventBus.publish()` from any thread (backend workers, the submitting
thread); subscribers are called synchronously on the publisher's thread, so they must be
quick and must not block — a UI marshals to its own thread, a server to its loop.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engine.core.decision import RoutingDecision
from engine.core.request import FinishRecord

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RequestRouted:
    decision: RoutingDecision


@dataclass(frozen=True, slots=True)
class RequestAdmitted:
    backend: str
    request_id: str
    cached_tokens: int
    time: float


@dataclass(frozen=True, slots=True)
class RequestFinished:
    record: FinishRecord
    time: float


@dataclass(frozen=True, slots=True)
class StepDone:
    """One `llama_decode` of a backend: how many sequences decoded and prompt tokens it held."""

    backend: str
    n_decode: int
    n_prefill: int
    n_seqs: int
    seconds: float
    time: float


Event = RequestRouted | RequestAdmitted | RequestFinished | StepDone


class EventBus:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._subs: list[tuple[Callable[[Any], None], tuple[type, ...] | None]] = []

    def subscribe(self, fn: Callable[[Any], None], kinds: tuple[type, ...] | None = None) -> Callable[[], None]:
        """Call `fn(event)` for every event (or only those of `kinds`: `fn` may take just those);
        returns an unsubscribe."""
        entry = (fn, kinds)
        with self._lock:
            self._subs = [*self._subs, entry]

        def unsubscribe() -> None:
            with self._lock:
                self._subs = [s for s in self._subs if s is not entry]

        return unsubscribe

    @property
    def n_subscribers(self) -> int:
        """Subscriptions now open (each `subscribe` not yet undone)."""
        return len(self._subs)

    def publish(self, event: Event) -> None:
        for fn, kinds in self._subs:  # copy-on-write list: safe to iterate without the lock
            if kinds is None or isinstance(event, kinds):
                try:
                    fn(event)
                except Exception:  # a broken subscriber must not break a backend
                    log.exception("event subscriber %r failed", fn)
