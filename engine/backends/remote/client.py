"""The OpenAI HTTP client a remote backend talks to its engine with, treating the engine as untrusted.

Every call is bounded, so one bad engine costs its own requests, never the router:
- *sizes*: a GET (`/health`, `/v1/models`, `/metrics`, `/slots`...) reads at most
  `PROBE_BODY_BYTES`, an error body `ERROR_BODY_BYTES`, an SSE line `EVENT_BYTES`; past that
  the call fails with `EngineMisbehaved` (a 400 MB `/health` body used to swing the router's
  memory to 1 GB on every probe);
- *time*: the first event of a stream must come within `first_token_s` of the request, each
  next one within `token_gap_s` of the last (`EngineSilent`); the router's only limit used
  to be the request's whole 600 s;
- *output*: a stream is cut at the request's `max_tokens` chunks (an engine sends at most
  one chunk per token) or `max_tokens * TOKEN_BYTES` bytes, and ends as `length` (an engine
  that ignored `max_tokens` had 2.9 MB relayed for a 20-token request);
- *shape*: every field read from a reply is checked (`parse_event`): a `choices` entry whose
  `text` is `12345`, a `usage` that is a string, an event that is not an object are
  `EngineMisbehaved` for that request alone (it used to raise a `TypeError` deep in the
  backend and leave its callers hanging);
- *counts*: `usage` is read into `Usage`, each count clamped where it is parsed (at most
  `MAX_COUNT`; completion tokens at most the request's `max_tokens`, cached at most the prompt):
  a 400-digit count once overflowed the rates' floats and left the request unanswered.

Thread contract: one `EngineClient` per backend, used on that backend's loop thread only.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp

PROBE_TIMEOUT_S = 5.0
PROBE_BODY_BYTES = 1 << 20  # /health, /v1/models, /metrics, /slots, /props: 1 MiB is generous
ERROR_BODY_BYTES = 64 << 10
EVENT_BYTES = 256 << 10  # one SSE line (one chunk's JSON); aiohttp's reader refuses longer lines
TOKEN_BYTES = 64  # the most bytes one streamed token may carry (the longest tokens are ~16-32)
FIRST_TOKEN_S = 60.0  # defaults of `RemoteConfig.first_token_s` / `token_gap_s`
TOKEN_GAP_S = 30.0
MAX_COUNT = 1 << 24  # the most tokens an engine's usage may claim for one prompt (longer contexts do not exist)


class EngineFailed(Exception):
    """The engine failed (connection lost, 5xx): the whole backend goes unhealthy."""


class EngineSilent(EngineFailed):
    """The engine stopped answering within a deadline: unhealthy even if `/health` answers."""


class EngineMisbehaved(Exception):
    """A reply this client will not read (too large, wrong shape): that request fails alone."""


class EngineRefused(Exception):
    """The engine refused this one request (4xx, or an error in its stream)."""

    def __init__(self, message: str, kind: str) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True)
class Usage:
    """An engine's token counts for one request, each bounded (None: it did not say)."""

    prompt: int | None = None
    completion: int | None = None
    cached: int | None = None

    @classmethod
    def read(cls, usage: object, max_tokens: int) -> Usage:
        """`usage` of a stream event: `EngineMisbehaved` for a shape OpenAI's API does not
        have; counts clamped (see the module docstring); a `cached_tokens` that is not a
        count is taken as unsaid."""
        if not isinstance(usage, dict):
            raise EngineMisbehaved(f"usage is {_type(usage)}, not an object")
        for k in ("prompt_tokens", "completion_tokens", "total_tokens"):
            v = usage.get(k)
            if v is not None and not _is_count(v):
                raise EngineMisbehaved(f"usage.{k} is {_type(v)}, not a count")
        details = usage.get("prompt_tokens_details")
        if details is not None and not isinstance(details, dict):
            raise EngineMisbehaved(f"usage.prompt_tokens_details is {_type(details)}, not an object")
        prompt = _bounded(usage.get("prompt_tokens"), MAX_COUNT)
        cached = (details or {}).get("cached_tokens")
        cached = _bounded(cached if _is_count(cached) else None, MAX_COUNT if prompt is None else prompt)
        return cls(prompt, _bounded(usage.get("completion_tokens"), max(max_tokens, 0)), cached)


@dataclass
class StreamResult:
    """What one streamed request produced, beside the deltas handed to `on_delta`."""

    usage: Usage | None = None
    finish_reason: str | None = None
    chunks: int = 0
    cut: bool = False  # stopped here at the request's output bound


class EngineClient:
    """HTTP to one engine: bounded GETs and bounded, validated completion streams."""

    def __init__(self, url: str, key: str | None, *, first_token_s: float = FIRST_TOKEN_S,
                 token_gap_s: float = TOKEN_GAP_S, timeout_s: float = 600.0) -> None:
        self.url = url
        self.first_token_s = first_token_s
        self.token_gap_s = token_gap_s
        self.timeout_s = timeout_s
        self._key = key
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        # No pool limit: the backend's `cap` bounds the connections for requests; probes need their own.
        self.session = aiohttp.ClientSession(
            headers=headers, connector=aiohttp.TCPConnector(limit=0),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=PROBE_TIMEOUT_S),
            read_bufsize=EVENT_BYTES // 2)  # a line may be twice this (aiohttp's StreamReader)

    async def close(self) -> None:
        await self.session.close()

    def _said(self, text: str | bytes | dict) -> str:
        """An error body's message, with our key masked (an engine may echo the request's
        headers back, as aiohttp's own 400 does)."""
        message = error_message(text)
        return message.replace(self._key, "***") if self._key else message

    async def get(self, path: str, timeout: float = PROBE_TIMEOUT_S,
                  limit: int = PROBE_BODY_BYTES) -> tuple[int, Any]:
        """GET a path: (status, parsed JSON or text), its body read up to `limit` bytes
        (`EngineMisbehaved` past it). Raises aiohttp and timeout errors."""
        async with self.session.get(self.url + path, timeout=aiohttp.ClientTimeout(total=timeout)) as r:
            body = await read_capped(r, limit, f"{path}")
            text = body.decode("utf-8", "replace")
            if "json" in (r.content_type or ""):
                try:
                    return r.status, json.loads(text)
                except ValueError:
                    pass
            return r.status, text

    async def stream(self, path: str, body: dict, *, chat: bool, max_tokens: int,
                     on_delta: Callable[[str], None], answers_health: Callable[[], Awaitable[bool]]) -> StreamResult:
        """POST a streaming completion and hand each text delta to `on_delta`, within the
        deadlines and the output bound (see the module docstring). `answers_health()` tells a
        5xx from a live engine (this request's failure) from a failing one."""
        reading = _Reading(max_tokens, chat, on_delta, self._said)
        loop = asyncio.get_running_loop()
        started = loop.time()
        timeout = aiohttp.ClientTimeout(total=self.timeout_s, sock_connect=PROBE_TIMEOUT_S)
        try:
            async with asyncio.timeout(self.first_token_s):
                resp = await self.session.post(self.url + path, json=body, timeout=timeout)
        except TimeoutError:
            raise EngineSilent(f"no answer within {self.first_token_s:g} s (first-token deadline)") from None
        async with resp:  # leaving it closes the connection (a cut stream included): the engine sees it
            if resp.status >= 400:
                raise await self._refusal(resp, path, answers_health)
            deadline = started + self.first_token_s
            done = False
            while not done:
                raw = await self._line(resp, deadline - loop.time(), first=reading.out.chunks == 0)
                if not raw:
                    break
                line = raw.strip()
                if not line.startswith(b"data:"):  # comments and keep-alives move no deadline
                    continue
                done = reading.take(line[5:].strip())
                deadline = loop.time() + self.token_gap_s
            if not done and reading.out.finish_reason is None:
                raise EngineFailed("the stream ended before the request did")
        return reading.out

    async def _refusal(self, resp: aiohttp.ClientResponse, path: str,
                       answers_health: Callable[[], Awaitable[bool]]) -> Exception:
        """What an error status means: this request refused (4xx, or a 5xx from an engine whose
        health still answers), else the engine failed."""
        text = await read_capped(resp, ERROR_BODY_BYTES, path, cut=True)
        if resp.status < 500:
            return EngineRefused(f"refused the request: {self._said(text)}", error_kind(text, resp.status))
        if await answers_health():  # a live engine failed this request, not itself
            return EngineRefused(self._said(text), error_kind(text, resp.status))
        return EngineFailed(f"{path} answered {resp.status}: {self._said(text)}")

    async def _line(self, resp: aiohttp.ClientResponse, wait: float, first: bool) -> bytes:
        """The stream's next line within `wait` seconds (b"" at its end)."""
        try:
            async with asyncio.timeout(max(wait, 0.0)):
                raw = await resp.content.readline()
        except TimeoutError:
            limit, which = (self.first_token_s, "first-token") if first else (self.token_gap_s, "inter-token")
            raise EngineSilent(f"no {'first ' if first else ''}token within {limit:g} s ({which} deadline)") from None
        except ValueError as e:  # aiohttp: a line longer than max_line_size
            raise EngineMisbehaved(f"an event longer than {EVENT_BYTES} bytes ({e})") from None
        if len(raw) > EVENT_BYTES:
            raise EngineMisbehaved(f"an event longer than {EVENT_BYTES} bytes")
        return raw


class _Reading:
    """One stream's events as they are read: deltas handed on, usage kept, the output bound held."""

    def __init__(self, max_tokens: int, chat: bool, on_delta: Callable[[str], None],
                 said: Callable[[dict], str]) -> None:
        self.out = StreamResult()
        self.max_tokens, self.chat, self.on_delta, self.said = max_tokens, chat, on_delta, said
        self.limit_bytes = max(max_tokens, 1) * TOKEN_BYTES
        self.max_events = 2 * max(max_tokens, 1) + 64  # a token's event, and a few for role, finish, usage
        self.seen_bytes = self.events = 0

    def take(self, payload: bytes) -> bool:
        """One event's payload; True when the stream is over (`[DONE]`, or cut at the bound)."""
        out = self.out
        self.events += 1
        if self.events > self.max_events:  # events without text, forever
            return self._cut()
        if payload == b"[DONE]":
            return True
        try:
            obj = json.loads(payload)
        except ValueError:
            raise EngineMisbehaved("an event that is not JSON") from None
        deltas, finish, usage, error = parse_event(obj, self.chat)
        if error is not None:
            raise EngineRefused(self.said(error), error_kind(error, 500))
        if usage is not None:
            out.usage = Usage.read(usage, self.max_tokens)
        for delta in deltas:
            self.seen_bytes += len(delta.encode("utf-8", "surrogatepass"))
            if out.chunks + 1 > self.max_tokens or self.seen_bytes > self.limit_bytes:
                return self._cut()
            out.chunks += 1
            self.on_delta(delta)
        if finish is not None:
            out.finish_reason = finish
        return False

    def _cut(self) -> bool:
        self.out.cut = True
        self.out.finish_reason = "length"
        return True


async def read_capped(resp: aiohttp.ClientResponse, limit: int, what: str, cut: bool = False) -> bytes:
    """A reply's body, at most `limit` bytes: past it, `EngineMisbehaved` (or, with `cut`, the
    first `limit` bytes: an error message needs no more)."""
    if resp.content_length is not None and resp.content_length > limit and not cut:
        raise EngineMisbehaved(f"{what} answered {resp.content_length} bytes; at most {limit} are read")
    data = bytearray()
    while True:
        chunk = await resp.content.read(min(65536, limit + 1 - len(data)))
        if not chunk:
            break
        data += chunk
        if len(data) > limit:
            if cut:
                return bytes(data[:limit])
            raise EngineMisbehaved(f"{what} answered more than {limit} bytes")
    return bytes(data)


def parse_event(obj: object, chat: bool) -> tuple[list[str], str | None, dict | None, dict | None]:
    """One stream event → (text deltas, finish reason, usage, error), every field checked:
    `EngineMisbehaved` names the first that is not what OpenAI's API says it is."""
    if not isinstance(obj, dict):
        raise EngineMisbehaved(f"an event that is {_type(obj)}, not an object")
    error = obj.get("error")
    if error:
        return [], None, None, obj
    usage = obj.get("usage")
    if usage is not None and not isinstance(usage, dict):
        raise EngineMisbehaved(f"usage is {_type(usage)}, not an object")
    usage = usage or None  # its fields are read by `Usage.read`
    choices = obj.get("choices")
    if choices is None:
        choices = []
    if not isinstance(choices, list):
        raise EngineMisbehaved(f"choices is {_type(choices)}, not a list")
    deltas: list[str] = []
    finish = None
    for choice in choices:
        text, reason = _parse_choice(choice, chat)
        if text:
            deltas.append(text)
        if reason is not None:
            finish = reason
    return deltas, finish, usage, None


def _parse_choice(choice: object, chat: bool) -> tuple[str | None, str | None]:
    """One streamed choice → (its text delta, its finish reason), each checked."""
    if not isinstance(choice, dict):
        raise EngineMisbehaved(f"a choice is {_type(choice)}, not an object")
    if chat:
        delta = choice.get("delta")
        if delta is None:
            delta = {}
        if not isinstance(delta, dict):
            raise EngineMisbehaved(f"choices[].delta is {_type(delta)}, not an object")
        text = delta.get("content")
        where = "choices[].delta.content"
    else:
        text = choice.get("text")
        where = "choices[].text"
    if text is not None and not isinstance(text, str):
        raise EngineMisbehaved(f"{where} is {_type(text)}, not a string")
    reason = choice.get("finish_reason")
    if reason is not None and (not isinstance(reason, str) or len(reason) > 64):
        raise EngineMisbehaved(f"choices[].finish_reason is {_type(reason)}, not a short string")
    return text, reason


def error_message(text: str | bytes | dict) -> str:
    """An error body's message: `text` is the body (str or bytes) or its parsed JSON."""
    if isinstance(text, bytes):
        text = text.decode("utf-8", "replace")
    try:
        obj = text if isinstance(text, dict) else json.loads(text)
    except ValueError:
        return text[:500]
    err = obj.get("error") if isinstance(obj, dict) else None
    if isinstance(err, dict):
        return str(err.get("message") or err)[:500]
    if isinstance(err, str):
        return err[:500]
    return str(obj.get("message") or obj.get("detail") or text)[:500] if isinstance(obj, dict) else str(text)[:500]


def error_kind(text: str | bytes | dict, status: int) -> str:
    if isinstance(text, bytes):
        text = text.decode("utf-8", "replace")
    try:
        err = (text if isinstance(text, dict) else json.loads(text)).get("error")
        kind = err.get("type") if isinstance(err, dict) else None
    except (ValueError, AttributeError):
        kind = None
    if isinstance(kind, str) and kind in _KINDS:
        return kind
    return "invalid_request_error" if status < 500 else "server_error"


# The kinds an engine's error may carry through to our clients; anything else is ours to name.
_KINDS = frozenset({"invalid_request_error", "exceed_context_size_error", "not_found_error",
                    "queue_full_error", "unavailable_error", "server_error"})


def _is_count(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _bounded(v: object, most: int) -> int | None:
    """A count no larger than `most` (compared as ints: a 400-digit one never becomes a float)."""
    return min(v, most) if isinstance(v, int) else None


def _type(v: object) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "an integer",
            float: "a number", type(None): "null"}.get(type(v), type(v).__name__)
