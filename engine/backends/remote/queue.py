"""The queue of a remote backend: requests waiting here (FCFS), and those in flight at the
engine, at most `cap` of them. The rest wait here rather than at the engine so that they can
move elsewhere if it dies.

Thread contract: every method takes the queue's lock, so any thread may call it.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable

from engine.core.errors import BackendUnavailable, InvalidRequest, QueueFull

from .job import Job

MAX_CAP = 100_000


def check_cap(cap: int) -> int:
    if not 1 <= cap <= MAX_CAP:
        raise InvalidRequest(f"cap must be in [1, {MAX_CAP}], got {cap}", param="cap")
    return cap


class JobQueue:
    """Waiting and in-flight jobs of one backend."""

    def __init__(self, name: str, cap: int, max_queue: int) -> None:
        self.name = name
        self.max_queue = max_queue
        self._cap = check_cap(cap)
        self._lock = threading.Lock()
        self._waiting: collections.deque[Job] = collections.deque()
        self._inflight: dict[str, Job] = {}

    @property
    def cap(self) -> int:
        return self._cap

    def set_cap(self, cap: int) -> None:
        with self._lock:
            self._cap = check_cap(cap)

    def push(self, job: Job, refused: Callable[[], str | None]) -> None:
        """Queue `job`, unless `refused()` (asked under the lock, so that a failure that drains
        the queue meanwhile cannot miss it) names why not, or the queue is full."""
        with self._lock:
            why = refused()
            if why is not None:
                raise BackendUnavailable(f"backend {self.name} is not serving: {why}")
            if len(self._waiting) >= self.max_queue:
                raise QueueFull(f"backend {self.name}'s queue is full ({len(self._waiting)} queued, "
                                f"at most {self.max_queue}); retry later")
            self._waiting.append(job)

    def take(self) -> list[Job]:
        """The jobs to send now (moved in flight) while fewer than `cap` are."""
        started = []
        with self._lock:
            while self._waiting and len(self._inflight) < self._cap:
                job = self._waiting.popleft()
                self._inflight[job.req.id] = job
                started.append(job)
        return started

    def remove(self, request_id: str) -> tuple[Job | None, Job | None]:
        """(the queued job, removed; the job in flight, left there) of `request_id`."""
        with self._lock:
            queued = next((j for j in self._waiting if j.req.id == request_id), None)
            if queued is not None:
                self._waiting.remove(queued)
            return queued, self._inflight.get(request_id)

    def done(self, job: Job) -> int:
        """`job` is no longer in flight; how many of ours are."""
        with self._lock:
            self._inflight.pop(job.req.id, None)
            return len(self._inflight)

    def drain(self, inflight: bool = True) -> tuple[list[Job], list[Job]]:
        """(every queued job, every job in flight): taken out when `inflight`, else only listed."""
        with self._lock:
            queued = list(self._waiting)
            self._waiting.clear()
            running = list(self._inflight.values())
            if inflight:
                self._inflight.clear()
        return queued, running

    def view(self) -> tuple[list[Job], list[Job], int]:
        """(in flight, waiting, cap) at one instant."""
        with self._lock:
            return list(self._inflight.values()), list(self._waiting), self._cap

    def in_flight(self) -> int:
        with self._lock:
            return len(self._inflight)
