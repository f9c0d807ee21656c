"""Health and load probes of a remote engine, one small dialect per engine kind (sglang-router
keeps its per-engine health and load readers apart the same way).

- `probe_health(client)`: `/health` (else `/v1/models`) must answer 200; every body is read
  through the client's size cap, so a huge reply is a failed probe, not a gigabyte.
- `detect(client)`: which engine this is (`api: auto`), from the endpoints it has.
- `read_models(client)`: the model ids it serves, its context and vocabulary where it says.
- `DIALECTS[api].load(client)`: the engine's own running and waiting requests (`Load`):
  Tandem's `/v1/routing`, llama-server's `/slots` + `/metrics`, vLLM's and SGLang's
  `/metrics`; a generic OpenAI API has none. Every field read is checked: a value of the
  wrong type counts as absent.

Thread contract: coroutines for the backend's loop thread.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeGuard

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from .client import EngineClient, EngineFailed, EngineMisbehaved


@dataclass(frozen=True, slots=True)
class Load:
    """The engine's own view of its load at one poll."""

    running: int
    waiting: int
    ours: int  # our requests in flight there when the poll was answered
    decode_left: tuple[int, ...] = ()  # remaining budgets the engine reported, longest first
    time: float = 0.0


async def probe_health(client: EngineClient) -> None:
    """Raise `EngineFailed` unless the engine answers its health check with 200."""
    status, _ = await client.get("/health")
    if status == 404:  # an engine without /health: its model list answers for it
        status, _ = await client.get("/v1/models")
    if status != 200:
        raise EngineFailed(f"{client.url}/health answered {status}")


async def answers_health(client: EngineClient) -> bool:
    """Whether the engine's health endpoint answers 200 now."""
    try:
        status, _ = await client.get("/health")
    except (TimeoutError, aiohttp.ClientError, OSError, EngineMisbehaved):
        return False
    return status == 200


async def detect(client: EngineClient) -> str:
    """Which engine this is, from the endpoints it has."""
    try:
        status, body = await client.get("/v1/routing?n=0")
        if status == 200 and isinstance(body, dict) and "backends" in body:
            return "tandem"
        status, body = await client.get("/props")
        if status == 200 and isinstance(body, dict) and "default_generation_settings" in body:
            return "llama-server"
        status, body = await client.get("/metrics")
        if status == 200 and isinstance(body, str):
            if "vllm:" in body:
                return "vllm"
            if "sglang:" in body:
                return "sglang"
    except (TimeoutError, aiohttp.ClientError, EngineMisbehaved):
        pass
    return "openai"


@dataclass(frozen=True)
class Models:
    ids: list[str]
    n_ctx: int = 0
    n_vocab: int = 0


async def read_models(client: EngineClient) -> Models | None:
    """`/v1/models`: the ids, and the context and vocabulary where the engine says
    (vLLM: `max_model_len`; Tandem and llama-server: `meta`)."""
    status, body = await client.get("/v1/models")
    if status != 200 or not isinstance(body, dict) or not isinstance(body.get("data"), list):
        return None
    data = [m for m in body["data"] if isinstance(m, dict) and isinstance(m.get("id"), str) and m["id"]]
    out = Models([m["id"][:256] for m in data[:256]])
    n_ctx = n_vocab = 0
    for m in data:
        meta = m.get("meta")
        if not isinstance(meta, dict):
            meta = {}
        n = m.get("max_model_len") or meta.get("n_ctx") or 0
        if _count(n):
            n_ctx = n
        v = meta.get("n_vocab") or 0
        if _count(v):
            n_vocab = v
    return Models(out.ids, n_ctx, n_vocab)


class Dialect:
    """How one kind of engine reports its load."""

    async def load(self, client: EngineClient) -> Load | None:
        return None  # a generic OpenAI API has no load endpoint: only our own requests count


class TandemDialect(Dialect):
    async def load(self, client: EngineClient) -> Load | None:
        status, body = await client.get("/v1/routing?n=0")
        if status != 200 or not isinstance(body, dict) or not isinstance(body.get("backends"), list):
            return None
        items = [i for b in body["backends"] if isinstance(b, dict) and isinstance(b.get("items"), list)
                 for i in b["items"] if isinstance(i, dict)]
        running = sum(1 for i in items if i.get("running") is True)
        left = sorted((i["decode_left"] for i in items if _count(i.get("decode_left"), 0)), reverse=True)
        return Load(running, len(items) - running, 0, tuple(left))


class LlamaServerDialect(Dialect):
    async def load(self, client: EngineClient) -> Load | None:
        status, body = await client.get("/slots")
        running, left = 0, []
        if status == 200 and isinstance(body, list):
            busy = [s for s in body if isinstance(s, dict) and s.get("is_processing") is True]
            running = len(busy)
            for s in busy:
                nxt = s.get("next_token")
                remain = nxt.get("n_remain") if isinstance(nxt, dict) else None
                if _count(remain, 0):
                    left.append(remain)
        metrics = await read_metrics(client)
        if status != 200:
            running = int(metrics.get("llamacpp:requests_processing", 0))
        return Load(running, int(metrics.get("llamacpp:requests_deferred", 0)), 0, tuple(sorted(left, reverse=True)))


class MetricsDialect(Dialect):
    """Engines whose Prometheus gauges say it (vLLM, SGLang)."""

    def __init__(self, running: str, waiting: str):
        self.running, self.waiting = running, waiting

    async def load(self, client: EngineClient) -> Load | None:
        m = await read_metrics(client)
        return Load(int(m.get(self.running, 0)), int(m.get(self.waiting, 0)), 0)


DIALECTS: dict[str, Dialect] = {
    "tandem": TandemDialect(),
    "llama-server": LlamaServerDialect(),
    "vllm": MetricsDialect("vllm:num_requests_running", "vllm:num_requests_waiting"),
    "sglang": MetricsDialect("sglang:num_running_reqs", "sglang:num_queue_reqs"),
    "openai": Dialect(),
    "auto": Dialect(),
}


async def read_metrics(client: EngineClient) -> dict[str, float]:
    """Prometheus gauges summed over their labels (finite, non-negative ones)."""
    status, body = await client.get("/metrics")
    if status != 200 or not isinstance(body, str):
        return {}
    out: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families(body):
            for s in family.samples:
                if 0 <= s.value < 1e12:
                    out[s.name] = out.get(s.name, 0.0) + s.value
    except ValueError:  # not Prometheus text
        return {}
    return out


def _count(v, low: int = 1) -> TypeGuard[int]:
    return isinstance(v, int) and not isinstance(v, bool) and low <= v < 1 << 31
