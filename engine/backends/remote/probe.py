"""What every engine kind answers alike: health, the models it serves, Prometheus gauges.
(What differs per kind, its load endpoints included, is its dialect: dialects.py.)

- `probe_health(client)`: `/health` (else `/v1/models`) must answer 200; every body is read
  through the client's size cap, so a huge reply is a failed probe, not a gigabyte.
- `read_models(client)`: the model ids it serves, its context and vocabulary where it says.
- `read_metrics(client)`: Prometheus gauges, finite and bounded.
- `Load`: the engine's own running and waiting requests at one poll, each count clamped
  (`MAX_EXTERNAL`): the router prices every one of them as a work item.
Every field read is checked: a value of the wrong type counts as absent.

Thread contract: coroutines for the backend's loop thread.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeGuard

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from .client import EngineClient, EngineFailed, EngineMisbehaved

MAX_EXTERNAL = 4096  # the most running (and waiting) requests an engine's report may claim


@dataclass(frozen=True, slots=True)
class Load:
    """The engine's own view of its load at one poll."""

    running: int
    waiting: int
    ours: int  # our requests in flight there when the poll was answered
    decode_left: tuple[int, ...] = ()  # remaining budgets the engine reported, longest first
    time: float = 0.0

    @classmethod
    def reported(cls, running: float, waiting: float, decode_left: list[int] | tuple[int, ...] = ()) -> Load:
        """What an engine reported, each count clamped to `MAX_EXTERNAL`."""
        left = sorted(decode_left, reverse=True)[:MAX_EXTERNAL]
        return cls(_clamp(running), _clamp(waiting), 0, tuple(left))


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
        if count(n):
            n_ctx = n
        v = meta.get("n_vocab") or 0
        if count(v):
            n_vocab = v
    return Models(out.ids, n_ctx, n_vocab)


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


def count(v: object, low: int = 1) -> TypeGuard[int]:
    """An int in [low, 2**31) (a bool is not one)."""
    return isinstance(v, int) and not isinstance(v, bool) and low <= v < 1 << 31


def _clamp(v: float) -> int:
    return int(min(max(v, 0), MAX_EXTERNAL))
