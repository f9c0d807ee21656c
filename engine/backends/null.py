"""The null backend: answers every request at once, with a fixed reply and no model.

For tests and demos of what sits above backends (routing, the server, the app's views) where
no engine is wanted: `null[:name=N,cap=N,reply=TEXT]`. Each request ends as it is enqueued,
`stop`, with `reply` as its text (empty by default) and no tokens counted.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, ClassVar

from engine.backends.protocol import BackendBase, BackendInfo, done_future
from engine.backends.registry import BuildContext, backend_kind, spec_error, spec_kind
from engine.core.errors import BackendUnavailable, InvalidRequest
from engine.core.events import EventBus, RequestFinished
from engine.core.handle import RequestHandle
from engine.core.request import FinishRecord, Request, RequestStatus
from engine.core.snapshot import BackendSnapshot, Rates

INSTANT = Rates(prefill_tok_s=1e9, decode_tok_s=1e9, source="null")


@spec_kind("null")
@dataclass(frozen=True)
class NullConfig:
    builder_module: ClassVar[str] = __name__
    needs_model: ClassVar[bool] = False

    name: str = "null"
    cap: int = 64
    reply: str = ""
    device: str = "null"

    @classmethod
    def from_spec(cls, spec: str, rest: str, defaults: Mapping[str, Any]) -> NullConfig:
        fields: dict = {k: v for k, v in defaults.items() if k in ("name", "cap")}
        for item in filter(None, (p.strip() for p in rest.split(","))):
            key, eq, value = (s.strip() for s in item.partition("="))
            if not eq or key not in ("name", "cap", "reply"):
                raise spec_error(spec, "use null[:name=N,cap=N,reply=TEXT]")
            if key == "cap":
                if not value.isdigit() or int(value) < 1:
                    raise spec_error(spec, "cap must be a whole number >= 1")
                fields["cap"] = int(value)
            else:
                fields[key] = value
        return cls(**fields)


class NullBackend(BackendBase):
    """Thread contract: every method may be called from any thread; `enqueue` delivers the
    finish on the caller's thread."""

    device = "null"
    n_vocab = 0  # any token id: nothing is decoded

    def __init__(self, config: NullConfig, bus: EventBus | None = None, rates: Rates | None = None) -> None:
        self.config = config
        self.name = config.name
        self.bus = bus or EventBus()
        self.rates = rates or INSTANT
        self.models: list[str] = []  # any model: it answers whatever is asked
        self.healthy = False
        self.error: str | None = None
        self.on_unhealthy = None
        self._cap = config.cap
        self._lock = threading.Lock()
        self.answered = 0

    @property
    def cap(self) -> int:
        return self._cap

    def start(self) -> NullBackend:
        self.healthy = True
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self.healthy = False

    def restart(self, timeout: float = 30.0) -> None:
        self.healthy = True

    def validate(self, request: Request) -> None:
        if not self.healthy:
            raise BackendUnavailable(f"backend {self.name} is stopped")

    def match(self, request: Request) -> int:
        return 0

    def cached_prefix(self, request: Request) -> tuple[int, int]:
        return 0, 0

    def pin_prefix(self, request: Request) -> tuple[int, object]:
        return 0, None

    def enqueue(self, request: Request, handle: RequestHandle | None = None, *, pin: object = None,
                cached_estimate: int | None = None, t_submit: float | None = None) -> RequestHandle:
        self.validate(request)
        handle = handle or RequestHandle(request)
        now = time.monotonic()
        t0 = t_submit or now
        record = FinishRecord(request_id=request.id, backend=self.name, status=RequestStatus.FINISHED_STOPPED,
                              text=self.config.reply, prompt_tokens=len(request.prompt_tokens), cached_tokens=0,
                              output_tokens=0, queue_s=0.0, ttft_s=None, e2e_s=now - t0, itl_s=None)
        if self.config.reply:
            handle._deliver_text(self.config.reply)
        handle._deliver_finish(record)
        with self._lock:
            self.answered += 1
        self.bus.publish(RequestFinished(record, now))
        return handle

    def cancel(self, request_id: str) -> None:
        pass  # nothing runs long enough to cancel

    def set_cap(self, cap: int | None, adaptive: bool | None = None) -> None:
        if cap is not None and cap < 1:
            raise InvalidRequest("cap must be >= 1")
        self._cap = cap or self.config.cap

    def set_rates(self, rates: Rates) -> None:
        self.rates = rates

    def set_cache_enabled(self, enabled: bool) -> Future:
        return done_future()

    def flush(self) -> Future:
        return done_future()

    def reset_stats(self) -> Future:
        with self._lock:
            self.answered = 0
        return done_future()

    def info(self) -> BackendInfo:
        return BackendInfo(name=self.name, device=self.device, model="", threads=0, n_ctx=0, n_seq_max=self._cap,
                           n_batch=0, flash_attn="", kv_unified=True, kind="null")

    def warm(self, tokens: Sequence[int]) -> RequestHandle:
        request = Request(tuple(tokens))
        return self.enqueue(request)

    def snapshot(self) -> BackendSnapshot:
        return BackendSnapshot(name=self.name, device=self.device, cap=self._cap, n_ctx=0, rates=self.rates,
                               healthy=self.healthy, error=self.error, steps=self.answered, time=time.monotonic())


@backend_kind(NullConfig)
def build(c: NullConfig, ctx: BuildContext) -> NullBackend:
    return NullBackend(c, ctx.bus, ctx.rates.get(c.name)).start()
