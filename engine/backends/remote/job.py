"""One request inside a remote backend (`Job`): what it streamed, when, and the engine's counts.

Thread contract: the fields the snapshot reads (`work_item`) are written by the loop thread
and read from any thread (single assignments); the rest is the loop thread's.
"""

from __future__ import annotations

import asyncio
import time

from engine.core.handle import RequestHandle
from engine.core.request import FinishRecord, Request, RequestStatus
from engine.core.snapshot import WorkItem

from .client import Usage

Key = str | tuple[int, ...]  # a prompt as the cache prediction keys it: text, or token ids (keys.py)


class Job:
    """A request queued here or in flight at the engine."""

    __slots__ = ("chunks", "done", "estimate", "fail", "finish_reason", "handle", "key", "moved", "parts",
                 "prompt_estimate", "req", "t_first", "t_last", "t_sent", "t_submit", "task", "usage")

    def __init__(self, req: Request, handle: RequestHandle, t_submit: float, estimate: int, key: Key,
                 prompt_estimate: int) -> None:
        self.req = req
        self.handle = handle
        self.t_submit = t_submit
        self.estimate = estimate  # predicted cached tokens (routing time)
        self.key = key  # the cache-prediction key of its prompt
        self.prompt_estimate = prompt_estimate  # prompt tokens (exact for token prompts)
        self.parts: list[str] = []
        self.chunks = 0
        self.t_sent = self.t_first = self.t_last = 0.0
        self.usage: Usage | None = None
        self.finish_reason: str | None = None
        self.task: asyncio.Task | None = None
        self.moved = False  # handed to another backend: finish nothing here
        self.fail: str | None = None  # end with this error when its task is cancelled
        self.done = False

    @property
    def chat(self) -> bool:
        """Sent as messages to `/v1/chat/completions` (else to `/v1/completions`)."""
        return self.req.messages is not None and self.req.text is None

    def streamed(self, delta: str) -> None:
        """One chunk of text arrived."""
        now = time.monotonic()
        self.chunks += 1
        if self.chunks == 1:
            self.t_first = now
        self.t_last = now
        self.parts.append(delta)

    def prompt_tokens(self) -> int:
        if self.usage is not None and self.usage.prompt is not None:
            return self.usage.prompt
        return self.prompt_estimate

    def output_tokens(self) -> int:
        if self.usage is not None and self.usage.completion is not None:
            return self.usage.completion
        return self.chunks

    def end_status(self) -> RequestStatus:
        """How a stream that ended normally finished: `length` as the engine says, else stopped
        (also where it reached the request's own `stop_after`)."""
        if self.req.stop_after is not None and self.output_tokens() >= self.req.stop_after:
            return RequestStatus.FINISHED_STOPPED
        return RequestStatus.FINISHED_LENGTH if self.finish_reason == "length" else RequestStatus.FINISHED_STOPPED

    def work_item(self, running: bool) -> WorkItem:
        generated = self.output_tokens()
        prompt = self.prompt_tokens()
        return WorkItem(request_id=self.req.id, running=running, prompt_tokens=prompt,
                        cached_tokens=min(self.estimate, prompt),
                        prefill_left=0 if self.chunks else max(prompt - self.estimate, 0),
                        decode_left=max(self.req.sampling.max_tokens - generated, 0), generated=generated)

    def record(self, backend: str, status: RequestStatus, now: float, error: str | None = None,
               error_kind: str | None = None) -> FinishRecord:
        """Its finish record: the engine's counts where it gave them, else what was seen here."""
        output = self.output_tokens()
        cached = self.usage.cached if self.usage is not None else None
        if cached is None:
            cached = self.estimate if self.chunks else 0  # no word from the engine: the prediction
        ttft = (self.t_first - self.t_submit) if self.chunks else None
        # Chunks can carry several tokens (a busy engine joins them): the gaps between the first
        # and last chunk over the tokens between them. One chunk says nothing about the gaps.
        itl = (self.t_last - self.t_first) / (output - 1) if self.chunks > 1 and output > 1 else None
        return FinishRecord(
            request_id=self.req.id, backend=backend, status=status, text="".join(self.parts),
            prompt_tokens=self.prompt_tokens(), cached_tokens=cached, output_tokens=output,
            queue_s=(self.t_sent or now) - self.t_submit, ttft_s=ttft, e2e_s=now - self.t_submit, itl_s=itl,
            error=error, error_kind=error_kind if error else None)
