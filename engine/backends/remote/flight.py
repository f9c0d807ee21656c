"""Requests in flight at a remote engine: sent while fewer than `cap` are, streamed, finished.

Each request sent gets a task on the backend's loop (`run`): its body in the engine's dialect,
its deltas to its handle as they arrive (a caller that does not stream gets the text whole at
the end, so that an attempt dropped by a failover was never seen), then its finish: the record
(the engine's usage, else what was counted here) to the handle and the bus, the prediction and
the online rates told, the next request sent. How a request ends follows what went wrong:
the engine refused it (4xx, an error event: that request's error), its reply cannot be read
(that request fails, `server_error`, the engine stays), it went silent (quarantined, then
down) or failed (down: failover.py). No exception escapes a finish: one whose record cannot be
made still ends its request, with an error its client sees.

Thread contract: the backend's loop thread.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Protocol

import aiohttp

from engine.core.events import EventBus, RequestAdmitted, RequestFinished
from engine.core.request import FinishRecord, RequestStatus, error_record

from .client import EngineClient, EngineFailed, EngineMisbehaved, EngineRefused, EngineSilent
from .job import Job
from .loop import LoopThread
from .monitor import Monitor, why
from .online import OnlineRates
from .prediction import CachePrediction
from .queue import JobQueue

log = logging.getLogger(__name__)

ENDED = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH)


class Owner(Protocol):
    """What the flights ask of their backend."""

    name: str
    url: str

    def serving(self) -> bool:
        """Healthy and not stopped: queued requests may be sent."""
        ...

    def went_down(self, why: str, failing: Job | None = None) -> None:
        """The engine failed while `failing` ran (failover.py)."""


class Flights:
    """The request flow of one backend, from its queue to each finish."""

    def __init__(self, owner: Owner, bus: EventBus, queue: JobQueue, cache: CachePrediction, online: OnlineRates,
                 loop: LoopThread, monitor: Monitor, client: Callable[[], EngineClient]) -> None:
        self.owner, self.bus, self.queue, self.cache, self.online = owner, bus, queue, cache, online
        self.loop, self.monitor, self.client = loop, monitor, client
        self.finished = 0  # requests finished (a remote engine's steps are not visible)

    def pump(self) -> None:
        """Send queued requests while fewer than `cap` are in flight."""
        if not self.owner.serving():
            return
        for job in self.queue.take():
            job.t_sent = time.monotonic()
            job.task = self.loop.loop.create_task(self.run(job))
            job.task.add_done_callback(functools.partial(self._reap, job))
            self.bus.publish(RequestAdmitted(self.owner.name, job.req.id, job.estimate, job.t_sent))

    def cancel(self, request_id: str) -> None:
        queued, running = self.queue.remove(request_id)
        if queued is not None:
            self.finish(queued, RequestStatus.FINISHED_CANCELLED)
        elif running is not None and running.task is not None:
            running.task.cancel()  # closes its connection: the engine sees the disconnect

    async def run(self, job: Job) -> None:
        """One request's task: stream it, then finish it as its outcome says."""
        name, url = self.owner.name, self.owner.url
        try:
            await self._stream(job)
        except asyncio.CancelledError:
            if not job.moved:
                self.finish(job, RequestStatus.FINISHED_ERROR if job.fail else RequestStatus.FINISHED_CANCELLED,
                            job.fail, "unavailable_error" if job.fail else None)
        except EngineRefused as e:
            self.finish(job, RequestStatus.FINISHED_ERROR, f"{name} ({url}): {e}", e.kind)
        except EngineMisbehaved as e:  # this reply cannot be read: this request fails, not the engine
            log.warning("%s: request %s: %s", name, job.req.id, e)
            self.finish(job, RequestStatus.FINISHED_ERROR,
                        f"backend {name} sent a reply this server will not relay: {e}", "server_error")
        except EngineSilent as e:  # unhealthy even if its /health answers: out for a while
            self.monitor.quarantine()
            self.owner.went_down(f"{url} went silent: {e}", job)
        except (TimeoutError, aiohttp.ClientError, OSError, EngineFailed) as e:
            self.owner.went_down(f"{url} failed: {why(e)}", job)
        except Exception as e:  # a bug: this request fails, not the engine
            log.exception("%s: request %s failed", name, job.req.id)
            self.finish(job, RequestStatus.FINISHED_ERROR, f"backend {name}: {type(e).__name__}", "server_error")
        else:
            self.finish(job, job.end_status())

    def _reap(self, job: Job, task: asyncio.Task) -> None:
        """A task that raised past `run` (a failover that failed): its request still ends."""
        if task.cancelled() or task.exception() is None:
            return
        log.error("%s: request %s's task failed", self.owner.name, job.req.id, exc_info=task.exception())
        if not job.moved:
            self.finish(job, RequestStatus.FINISHED_ERROR, f"backend {self.owner.name}: "
                                                           f"{type(task.exception()).__name__}", "server_error")

    async def _stream(self, job: Job) -> None:
        models = self.monitor.models
        body = self.monitor.dialect.body(job.req, job.chat, models[0] if models else "")
        bound = body["max_tokens"]
        result = await self.client().stream("/v1/chat/completions" if job.chat else "/v1/completions", body,
                                            chat=job.chat, max_tokens=bound, on_delta=lambda d: self._deliver(job, d),
                                            answers_health=self.monitor.answers_health)
        job.usage, job.finish_reason = result.usage, result.finish_reason
        if result.cut:  # the engine went on past the request's bound: what it is owed is what it got
            log.warning("%s: request %s cut at its output bound (%d tokens)", self.owner.name, job.req.id, bound)
            if job.usage is not None:
                job.usage = replace(job.usage, completion=min(job.chunks, bound))

    def _deliver(self, job: Job, delta: str) -> None:
        job.streamed(delta)
        if job.req.stream:  # else the whole text goes at the end: an attempt may be dropped
            self.loop.batch()
            job.handle._deliver_text(delta)

    def finish(self, job: Job, status: RequestStatus, error: str | None = None, error_kind: str | None = None) -> None:
        """End a request (once): its record to the handle and the bus, the next one sent. Never
        raises: a record that cannot be made ends the request with an error."""
        if job.done:
            return
        job.done = True
        try:
            record = self._account(job, status, error, error_kind)
        except Exception as e:  # a bug, or an answer no check foresaw: the request still ends
            log.exception("%s: request %s could not be finished as it ended", self.owner.name, job.req.id)
            record = replace(error_record(job.req, self.owner.name, f"backend {self.owner.name} could not read the "
                                                                    f"engine's answer ({type(e).__name__})",
                                          job.t_submit), error_kind="server_error")
        self.finished += 1
        if self.loop.here():
            self.loop.batch()  # behind this request's text in the same hand-over
        if record.text and not job.req.stream:
            job.handle._deliver_text(record.text)
        job.handle._deliver_finish(record)
        self.bus.publish(RequestFinished(record, time.monotonic()))
        self.pump()

    def _account(self, job: Job, status: RequestStatus, error: str | None, error_kind: str | None) -> FinishRecord:
        """The record of a request that left the engine; one that ended well teaches the
        prediction (prompt + output) and the rates (at the batch it ran in)."""
        in_flight = self.queue.done(job)
        record = job.record(self.owner.name, status, time.monotonic(), error, error_kind)
        if status in ENDED:
            self.cache.finished(job, record.text)
            self.online.observe(record, in_flight + 1 + self.monitor.others()[0])
        return record
