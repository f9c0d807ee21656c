"""What becomes of a failed engine's requests.

When an engine goes down, every queued and in-flight request goes to the backend's
`on_unhealthy(backend, [(request, handle, t_submit), ...])`, and the engine re-routes them:
- queued ones, in-flight ones that streamed nothing, and in-flight ones whose caller does not
  stream (`Request.stream` false: their text goes over whole at the end, so a dropped attempt
  was never seen) start again from the prompt;
- one that streamed text to its caller leaves that part on its handle
  (`RequestHandle._interrupt`: text, tokens, timings) and goes on elsewhere from that text
  (`Request.continued`: the prompt followed by the text, `max_tokens` less what streamed; a
  grammar-constrained answer or a chat on a generic OpenAI API cannot, and ends with the
  error), so its caller sees one stream;
- without `on_unhealthy` (a backend outside an engine), those that streamed end with the error.
Only when no healthy engine is left does a stream end with an `unavailable_error`.

Thread contract: the backend's loop thread.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from engine.backends.protocol import Handed
from engine.core.request import RequestStatus

from .job import Job


def triage(jobs: Sequence[Job], backend: str, why: str, movable: bool) -> list[Job]:
    """The in-flight `jobs` of a failed engine that move elsewhere (marked moved and done; one
    that streamed has its part left on its handle). The rest, which streamed and cannot move,
    get `fail`: they end with it when their task is cancelled."""
    moved = []
    now = time.monotonic()
    failed = f"backend {backend} failed while streaming: {why}"
    for job in jobs:
        if job.done:
            continue
        if job.chunks and job.req.stream:
            if not movable:
                job.fail = failed
                continue
            job.handle._interrupt(job.record(backend, RequestStatus.FINISHED_ERROR, now, failed, "unavailable_error"))
        job.moved = job.done = True
        moved.append(job)
    return moved


def handed(jobs: Sequence[Job]) -> list[Handed]:
    """Jobs as `on_unhealthy` takes them."""
    return [(j.req, j.handle, j.t_submit) for j in jobs]
