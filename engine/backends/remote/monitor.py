"""Whether a remote engine serves, what it serves, and its own load: a backend's watch on it.

- Health: `/health` (else `/v1/models`) every `health_s`. A connection error or a 5xx marks
  the engine down, and so do `PROBE_FAILURES` probes in a row that time out. An engine that
  went silent on a request (a missed first-token or inter-token deadline) stays out for a
  quarantine (`quarantine_s`, doubling while it keeps failing, up to `MAX_QUARANTINE_S`) even
  if its `/health` answers, since a silent engine often still answers probes. The probe keeps
  running while it is down and brings it back when it answers again.
- Facts: the first good probe names its dialect (`api: auto`) and reads the models it serves,
  its context and vocabulary.
- Load: every `poll_s`, its dialect's load endpoints (`Load`); `external()` prices what is not
  ours: what it reported minus what of ours it held *at that poll*, so our own changes since
  are never counted twice or missed; each running or waiting request of others is a work item
  with the engine's own remaining budget where it tells, else our recent requests' mean.

Thread contract: coroutines run on the backend's loop thread; the facts and `external` are
read from any thread (single assignments of immutable values).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Protocol

import aiohttp

from engine.core.errors import InvalidRequest
from engine.core.snapshot import WorkItem

from . import probe
from .client import EngineClient, EngineFailed, EngineMisbehaved
from .config import RemoteConfig
from .dialects import Dialect, detect, dialect
from .probe import Load

log = logging.getLogger(__name__)

MAX_QUARANTINE_S = 300.0
PROBE_FAILURES = 3  # probes that time out in a row before a live-but-silent engine is down
DEFAULT_DECODE_BUDGET = 256  # others' requests' decode_left before we have seen a request of ours


class Watched(Protocol):
    """What the monitor asks of the backend it watches."""

    name: str
    healthy: bool

    def came_up(self) -> None:
        """The engine answers again (loop thread)."""

    def went_down(self, why: str) -> None:
        """The engine failed (loop thread)."""

    def in_flight(self) -> int:
        """Our requests in flight there now."""
        ...


class Monitor:
    """The health probe, the load poll and what they learnt of one engine."""

    def __init__(self, config: RemoteConfig, client: Callable[[], EngineClient], owner: Watched) -> None:
        self.config = config
        self.dialect: Dialect = dialect(config.api)
        self.models: list[str] = []  # model ids it serves (`/v1/models`)
        self.n_ctx = 0  # its context per request where it says, else 0
        self.n_vocab = 0  # its vocabulary where it says, else 0 (token-id prompts are checked against it)
        self.load = Load(0, 0, 0)
        self.budget_mean = float(DEFAULT_DECODE_BUDGET)  # our recent requests' max_tokens
        self._client = client
        self._owner = owner
        self._missed = 0
        self._tasks: list[asyncio.Task] = []
        self._quarantine_s = config.quarantine_s
        self._out_until = 0.0  # monotonic time before which probes do not bring it back

    async def start(self) -> None:
        """Start the health loop and the load poll on this (the loop's) thread."""
        self._tasks = [asyncio.create_task(self.watch()), asyncio.create_task(self.poll())]

    def stop(self) -> None:
        for t in self._tasks:
            t.cancel()

    # ---- health ----

    async def probe(self, first: bool = False) -> None:
        """One health probe; raises if the engine does not answer healthily. The first good one
        names the dialect and reads the models; one in quarantine is probed but not let back."""
        client = self._client()
        await probe.probe_health(client)
        if time.monotonic() < self._out_until:
            return
        if first or not self._owner.healthy or not self.models:  # (back) up: what does it serve now
            if self.dialect.name == "auto":
                self.dialect = await detect(client)
            models = await probe.read_models(client)
            if models is not None:
                self.models = models.ids
                self.n_ctx = models.n_ctx or self.n_ctx
                self.n_vocab = models.n_vocab or self.n_vocab
        self._missed = 0
        if not self._owner.healthy:
            log.info("%s: %s is healthy (%s, serving %s)", self._owner.name, self.config.url, self.dialect.name,
                     ", ".join(self.models))
            self._owner.came_up()

    async def answers_health(self) -> bool:
        """Whether the engine's health endpoint answers 200 now (a 5xx on one request from an
        engine that does is that request's failure: it stays up)."""
        return await probe.answers_health(self._client())

    def quarantine(self) -> None:
        """Keep a silent engine out for the quarantine (doubling each time, up to the max)."""
        self._out_until = time.monotonic() + self._quarantine_s
        self._quarantine_s = min(self._quarantine_s * 2, MAX_QUARANTINE_S)

    def forget(self) -> None:
        """A restart a person asked for: no quarantine, no load known."""
        self._out_until = 0.0
        self._quarantine_s = self.config.quarantine_s
        self.load = Load(0, 0, 0)

    async def watch(self) -> None:
        """The health loop (runs until cancelled)."""
        while True:
            await asyncio.sleep(self.config.health_s)
            try:
                await self.probe()
            except asyncio.CancelledError:
                raise
            except TimeoutError:
                self._missed += 1
                if self._owner.healthy and self._missed >= PROBE_FAILURES:
                    self._owner.went_down(f"{self.config.url} did not answer {PROBE_FAILURES} health probes")
            except (aiohttp.ClientError, OSError, EngineFailed, EngineMisbehaved, InvalidRequest) as e:
                if self._owner.healthy:  # (InvalidRequest: its key file cannot be read now)
                    self._owner.went_down(f"{self.config.url} is unreachable: {why(e)}")
            except Exception:  # a bug must not end the probing
                log.exception("%s: health probe failed", self._owner.name)

    # ---- load ----

    async def poll(self) -> None:
        """The load loop (runs until cancelled); load is best effort, health is the probe's."""
        while True:
            await asyncio.sleep(self.config.poll_s)
            if not self._owner.healthy:
                continue
            try:
                load = await self.dialect.load(self._client())
            except asyncio.CancelledError:
                raise
            except Exception as e:
                log.debug("%s: load poll failed: %s", self._owner.name, e)
                continue
            if load is not None:
                self.load = replace(load, ours=self._owner.in_flight(), time=time.monotonic())

    def sent(self, max_tokens: int) -> None:
        """One of ours was queued: its budget joins the mean others' are priced with."""
        self.budget_mean += 0.05 * (max_tokens - self.budget_mean)

    def others(self) -> tuple[int, int]:
        """(running, waiting) requests at the engine that are not ours, at the last poll."""
        load = self.load
        return max(load.running - load.ours, 0), max(load.waiting - max(load.ours - load.running, 0), 0)

    def external(self) -> tuple[WorkItem, ...]:
        """The engine's load that is not ours, as work items (see the module docstring)."""
        load = self.load
        if not load.time or time.monotonic() - load.time > 5 * self.config.poll_s + 2:
            return ()  # too old to tell (the engine is not answering)
        running, waiting = self.others()
        budgets = load.decode_left
        return tuple(WorkItem(request_id=f"external:{self._owner.name}:{i}", running=i < running, prompt_tokens=0,
                              cached_tokens=0, prefill_left=0,
                              decode_left=max(budgets[i] if i < len(budgets) else int(self.budget_mean), 0))
                     for i in range(running + waiting))


def why(e: BaseException) -> str:
    """An exception as a message: its type, and its text where it has one."""
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
