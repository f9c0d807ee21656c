"""The caller's side of a submitted request: stream its text, wait for its end, cancel it.

A backend thread delivers text deltas and, last, one `FinishRecord`. The handle hands them
to a blocking iterator (`for delta in handle`) or, when created with an asyncio loop, to an
async iterator (`async for delta in handle.astream()`), marshalled with
`loop.call_soon_threadsafe` — once per backend step for all of a loop's handles when the
delivering thread gathers them in an `Outbox`. Token logprobs, when asked for, are read from
`handle.logprobs` beside the text. `cancel()` may be called from any thread, at
any time.

A stream can outlive its backend: a remote engine that dies mid-answer leaves the part it
streamed on the handle (`_interrupt`), the engine continues the request on another backend,
and the final record joins the parts (`joined`). Part and continuation are delivered by two
backend threads one after the other (the second starts only once the first has handed over).
"""

from __future__ import annotations

import asyncio
import enum
import queue
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import replace
from typing import TYPE_CHECKING, Final, Literal

from engine.core.errors import RequestFailed
from engine.core.request import FinishRecord, Request

if TYPE_CHECKING:
    from engine.core.decision import RoutingDecision

class _Sentinel(enum.Enum):
    END = enum.auto()


_END: Final = _Sentinel.END  # delivered after the last text: the stream ends
Delivery = str | Literal[_Sentinel.END]  # what a handle's queue carries
_gathering = threading.local()
# Text deltas an asyncio reader may leave unread before its request pauses (`reader_behind`): a
# client that asked for n=16 with top_logprobs=20 and never read made the server buffer its
# whole reply (6.9 MB for a 135-byte request) while the sequences kept their rows.
STREAM_BACKLOG = 8


class Outbox:
    """Deliveries to asyncio handles, gathered on one thread and handed to each event loop in
    one `call_soon_threadsafe` at `flush()`.

    A backend worker gathers a whole step's text (`with outbox:` around its loop) and flushes
    once the text is made — on a GPU backend while it waits for the device to finish the next
    step (`Backend._step`, during `ContextRunner.execute`), else at the end of its iteration. Handed over token by token,
    every delivery would wake the loop, whose thread then wants the GIL while the worker is
    still sampling and bookkeeping — and the worker waits a switch interval to get it back.
    Handed over in one go, the loop runs while the worker waits in llama.cpp, without the GIL.
    """

    def __init__(self) -> None:
        self._batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[Delivery], Delivery]]] = {}

    def __enter__(self) -> Outbox:
        _gathering.outbox = self
        return self

    def __exit__(self, *exc: object) -> None:
        _gathering.outbox = None
        self.flush()

    def add(self, loop: asyncio.AbstractEventLoop, q: asyncio.Queue[Delivery], item: Delivery) -> None:
        self._batches.setdefault(loop, []).append((q, item))

    def flush(self) -> None:
        if not self._batches:
            return
        batches, self._batches = self._batches, {}
        for loop, batch in batches.items():
            try:
                loop.call_soon_threadsafe(_hand_over, batch)
            except RuntimeError:  # the loop is closed: nobody is listening any more
                pass


def _hand_over(batch: list[tuple[asyncio.Queue[Delivery], Delivery]]) -> None:
    for q, item in batch:
        q.put_nowait(item)


def joined(parts: list[FinishRecord], last: FinishRecord) -> FinishRecord:
    """One record for a request that was streamed in parts by several backends: the whole
    text; prompt, cached and output tokens summed over the parts (each continuation computed
    its prompt, the text before it included, again); queueing and first token from the first
    part, the end, status and backend from the last."""
    every = [*parts, last]
    return replace(last, text="".join(r.text for r in every), prompt_tokens=sum(r.prompt_tokens for r in every),
                   cached_tokens=sum(r.cached_tokens for r in every),
                   output_tokens=sum(r.output_tokens for r in every), queue_s=parts[0].queue_s,
                   ttft_s=parts[0].ttft_s)


class RequestHandle:
    def __init__(self, request: Request, loop: asyncio.AbstractEventLoop | None = None):
        self.request = request
        self.id = request.id
        self.backend: str | None = None
        self.decision: RoutingDecision | None = None  # set by the engine
        self._loop = loop
        self._aq: asyncio.Queue[Delivery] | None = asyncio.Queue() if loop is not None else None
        self._q: queue.SimpleQueue[Delivery] | None = None if loop is not None else queue.SimpleQueue()
        self._done = threading.Event()
        self._record: FinishRecord | None = None
        self._cancel: Callable[[str], None] | None = None
        # One TokenLogprob per generated token when the request asked for logprobs: the
        # backend thread appends a token's entry before its text is delivered, so a reader
        # that got some text finds the entries of its tokens here (list appends are atomic).
        self.logprobs: list | None = None
        self.prompt_logprobs: list | None = None  # the prompt's, filled while it is computed
        # What backends that failed mid-stream had streamed (`_interrupt`), oldest first: the
        # request went on elsewhere from their text, and the final record counts every part.
        self._parts: list[FinishRecord] = []
        self._unresumed: FinishRecord | None = None
        # Deltas handed to an asyncio reader, and taken by it: each count has one writer (the
        # backend thread, the loop), so their difference is the reader's backlog without a lock.
        self._handed = 0
        self._taken = 0

    # ---- called by the backend thread ----

    def _deliver_text(self, delta: str) -> None:
        self._put(delta)

    def _interrupt(self, part: FinishRecord) -> None:
        """The backend streaming this request failed after `part` (its text so far, its
        counts and timings); the engine continues the request elsewhere (`_take_interrupted`)."""
        self._parts.append(part)
        self._unresumed = part

    def _take_interrupted(self) -> FinishRecord | None:
        """The part an interruption left, once (None: the request starts from its prompt)."""
        part, self._unresumed = self._unresumed, None
        return part

    def _deliver_finish(self, record: FinishRecord) -> None:
        if self._parts:
            record = joined(self._parts, record)
        self._record = record
        self._done.set()
        self._put(_END)

    def _put(self, item: Delivery) -> None:
        loop, aq = self._loop, self._aq
        if loop is not None and aq is not None:
            self._handed += 1
            outbox = getattr(_gathering, "outbox", None)
            if outbox is not None:
                outbox.add(loop, aq, item)
                return
            try:
                loop.call_soon_threadsafe(aq.put_nowait, item)
            except RuntimeError:  # the loop is closed: nobody is listening any more
                pass
        elif self._q is not None:
            self._q.put(item)
        else:
            raise RuntimeError(f"{self.id} has neither a loop nor a queue to stream to")

    # ---- called by the caller ----

    def __iter__(self) -> Iterator[str]:
        """Yield text deltas until the request ends (blocking)."""
        if self._q is None:
            raise TypeError("this handle streams to an asyncio loop: use astream()")
        while (item := self._q.get()) is not _END:
            yield item

    async def astream(self) -> AsyncIterator[str]:
        """Yield text deltas until the request ends (asyncio). Text that piled up while the
        consumer was busy comes as one delta."""
        if self._aq is None:
            raise TypeError("this handle was created without a loop: iterate it instead")
        q = self._aq
        while (item := await q.get()) is not _END:
            parts = [item]
            while not q.empty():
                if (more := q.get_nowait()) is _END:
                    self._taken += len(parts)
                    yield "".join(parts)
                    return
                parts.append(more)
            self._taken += len(parts)
            yield parts[0] if len(parts) == 1 else "".join(parts)

    @property
    def reader_behind(self) -> bool:
        """An asyncio reader has left more than `STREAM_BACKLOG` deltas unread: its request
        should make no more until it reads (the scheduler's `paused` predicate)."""
        return self._handed - self._taken > STREAM_BACKLOG

    def result(self, timeout: float | None = None) -> FinishRecord:
        """Wait for the finish record (does not consume the stream)."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"{self.id} did not finish within {timeout} s")
        if self._record is None:
            raise RuntimeError(f"{self.id} is done without a finish record")
        return self._record

    def text(self, timeout: float | None = None) -> str:
        """Wait for the end and return the whole text; raise if the request failed."""
        record = self.result(timeout)
        if record.error:
            raise RequestFailed(record.error)
        return record.text

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def cancel(self) -> None:
        """Stop the request wherever it is; its KV is freed at the backend's next step."""
        if self._cancel is not None and not self.done:
            self._cancel(self.id)
