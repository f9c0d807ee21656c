"""Connection hygiene and browser safety for `tandem serve`: what sits between a socket and a handler.

Two layers, both on aiohttp's public surfaces:

* **Connections** (`ConnectionGuard`, `GuardedSite`). Every accepted socket gets a
  `GuardedProtocol` wrapped around aiohttp's own `RequestHandler` (the protocol
  `web.Server()` makes). The wrapper forwards every asyncio protocol call and adds:
  - a *header deadline*: a connection that has not sent a whole request head
    (`\\r\\n\\r\\n`) within `header_timeout` seconds of connecting gets a `408` and is closed;
  - a *connection cap* with nginx's and llama.cpp server's answer to a full table: a new
    connection evicts the one that has been *idle* the longest, whatever it is idle in
    (its first head, a kept-alive wait for the next request, a body that stopped coming).
    A connection is busy, and never evicted, only while a handler runs with its whole body
    read (`request_started` / `body_read` / `request_done`, called by `guard_middleware` and
    `read_body`). Only when every connection is busy does a new one get a raw `503`;
  - a *per-client cap* (`max_client_connections`, per remote address; nginx's `limit_conn`):
    a client at its cap has a new connection held briefly, then answered a raw `429` with
    `Retry-After`, so one address cannot hold the table. It does not evict its own: an attacker that reconnects as soon as it is let go then
    made the server set connections up and tear them down as fast as its loop could (1,100
    stalled bodies from one address: normal traffic's p95 2.96-3.10x quiet; docs/security.md).
  - *timeouts charged to their address*: a connection that sends no whole request in time
    charges its address in the `RefusalLedger` (`TIMEOUT_CHARGE_S`); an address in debt has
    its new connections held unread once (`refuse_hold_s`, 1-2x), then admitted if the debt
    is paid, else answered a raw `429` with `Retry-After`, and its stalled bodies wait for
    the debt before their 408. Answered at once, such a client reconnects and stalls again,
    and the churn, not the stalled connections, is what costs the server;
  - *write-side limits*: a connection whose reply fills its reader's socket (`pause_writing`)
    is idle, evictable, and its reply has `send_timeout` to make progress (nginx's);
  - a *head cap*: a request head over `max_head_bytes` gets a raw 431;
  - *trusted proxies* (`ProxyTrust`): behind one, the client is the `X-Forwarded-For` hop the
    proxy saw, and the per-address limits and debts are that client's.
  Kept-alive connections are closed after `keepalive_timeout` (75 s, nginx's: longer than the
  pools of the clients that reuse connections). A body must keep coming: `read_body` allows `body_idle_timeout` from the last
  byte (up to twice that, drawn per wait, so bodies stalled together time out apart) and
  `body_timeout` in all. aiohttp has `keepalive_timeout` and `client_max_size` but no
  header-read timeout and no eviction. We chose to wrap the protocol rather than move to another server
  (uvicorn has `--limit-concurrency` and `--timeout-keep-alive` but no header timeout either;
  hypercorn has one but would mean rewriting the streaming and cancellation paths that the
  GUI also runs on its qasync loop): the wrapper is on asyncio's stable Protocol
  API, keeps `handler_cancellation`, and needs nothing private from aiohttp beyond
  `TCPSite`'s attribute names and `web.Server`'s handler arguments (`_QuietRequestHandler`,
  whose own 400s do not quote the request).
* **Requests** (`guard_middleware`, `on_prepare`). Before auth and parsing: the `Host` must be
  the address the connection arrived on, a loopback name, or one of `allowed_hosts` (DNS
  rebinding); a request carrying an `Origin` that is not in `allowed_origins` is `403`
  (cross-site forms and fetches); CORS preflights are answered only when origins are allowed;
  a POST with a body must be `application/json` (`415`: no CORS-"simple" form or text POST
  can reach a handler); an address in debt gets 429 with `Retry-After` before its body is read; a declared `Content-Length` above `max_body_bytes` is `413` before a
  byte of the body is read, and a chunked body is cut off at the limit. Every response says
  `Server: tandem` (no library versions), including aiohttp's own low-level error replies.

Repeated error logs (`EMFILE` from `accept()`, a peer flood) are rate-limited by
`RepeatFilter`: the attack this module answers logged "Too many open files" 150,000 times
(68 MB) in 40 s.

Thread contract: everything here runs on the server's event loop; `ConnectionGuard` is not
thread-safe and needs none.
"""

from __future__ import annotations

import asyncio
import collections
import ipaddress
import json
import logging
import math
import random
import re
import resource
import threading
import time
from dataclasses import dataclass, field

from aiohttp import hdrs, web
from aiohttp import web_response as _web_response
from aiohttp.http_exceptions import LineTooLong
from aiohttp.web_protocol import RequestHandler

from engine.core.errors import EngineError, InvalidRequest

from .parse_pool import PARSING, trim_heap

log = logging.getLogger(__name__)

SERVER_NAME = "tandem"
# aiohttp puts `Python/3.x aiohttp/3.y` into every reply's `Server` header, including the
# low-level 400s it writes itself before any app code runs; this is the one place it reads it.
_web_response.SERVER_SOFTWARE = SERVER_NAME

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
CORS_MAX_AGE_S = 600
CORS_ALLOWED_HEADERS = "Authorization, Content-Type"  # when the preflight asks for none, or too many
CORS_MAX_HEADERS = 64  # names a preflight's `Access-Control-Request-Headers` may list to be echoed
CORS_METHODS = ("GET", "POST", "DELETE", "OPTIONS")  # what the API serves
# A connection that sent no whole request in time is charged to its address as this much CPU
# in the `RefusalLedger`: ~10x what the loop spends to accept, time out and close it (~2 ms
# under 1,100 stalled bodies), as it also held a connection for 5-20 s. At the ledger's
# defaults an address may time out 25 connections at once and 5 a second after that; past
# it, its new connections are held unread until the debt is paid (`ConnectionGuard._hold`).
TIMEOUT_CHARGE_S = 0.02
MAX_HOLD_S = 60.0  # the longest a connection or stalled body of an address in debt waits at a time (1-2x)
HOLD_FACTOR = 2  # held refusals at most, in `max_connections`: one address's 1,100 fit


# ---- settings and errors ----


@dataclass(frozen=True)
class GuardSettings:
    """The knobs (each a `tandem serve` flag); defaults suit a local single-user server.
    `docs/security.md` lists them with the attacks they answer."""

    header_timeout: float = 10.0  # s from connect to a whole request head
    body_timeout: float = 30.0  # s to receive a whole request body
    body_idle_timeout: float = 5.0  # s a body may pause between bytes (at least: 1-2x, drawn per wait)
    # s an idle kept-alive connection stays open: nginx's 75, longer than the pools of the clients that
    # reuse connections (aiohttp keeps one 15 s, httpx 5 s), so the server never closes a connection that
    # a client is just sending its next request on (5 s dropped one streamed turn in 768)
    keepalive_timeout: float = 75.0
    max_connections: int = 1000  # open connections; above, evict the longest-idle one, else 503
    max_client_connections: int = 512  # open connections per client address; above, 429
    max_client_sequences: int = 512  # sequences (choices) one client address may have generating or queued; above, 429
    refuse_hold_s: float = 2.0  # s (1-2x) a connection over its address's cap, or of an address in debt, waits
    # unread before its 429 (a tarpit that still answers a real client of that address within 4 s)
    send_timeout: float = 30.0  # s a reply may make no progress into a reader's socket (nginx's send_timeout)
    max_head_bytes: int = 32 << 10  # a whole request head (nginx: 4 x 8 KB); above, 431
    trusted_proxies: tuple[str, ...] = ()  # peers (addresses or networks) whose X-Forwarded-For names the client
    refused_cpu_share: float = 0.1  # of a core: what an address's refused requests may cost to parse
    refused_cpu_burst_s: float = 0.5  # s of such parsing an address may spend at once before it waits
    max_body_bytes: int = 2 << 20  # a 128k-token prompt is ~0.5 MB of text; 2 MiB leaves room
    allowed_hosts: tuple[str, ...] = ()  # more `Host` names to accept; "*" accepts any
    allowed_origins: tuple[str, ...] = ()  # browser origins allowed (CORS on); "*" allows any

    def __post_init__(self):
        for name in ("header_timeout", "body_timeout", "body_idle_timeout", "keepalive_timeout", "refuse_hold_s",
                     "refused_cpu_share", "refused_cpu_burst_s", "send_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0")
        if min(self.max_connections, self.max_body_bytes, self.max_client_connections, self.max_client_sequences) < 1:
            raise ValueError("max_connections, max_client_connections, max_client_sequences and max_body_bytes "
                             "must be >= 1")
        if self.max_head_bytes < 1024:
            raise ValueError("max_head_bytes must be >= 1024")
        for proxy in self.trusted_proxies:
            try:
                ipaddress.ip_network(proxy, strict=False)
            except ValueError:
                raise ValueError(f"--trusted-proxy {proxy!r} is not an address or a network") from None
        object.__setattr__(self, "allowed_hosts", tuple(h.lower() for h in self.allowed_hosts))
        object.__setattr__(self, "allowed_origins", tuple(o.rstrip("/").lower() for o in self.allowed_origins))


class Forbidden(EngineError):
    """A cross-site request or a foreign `Host` (403)."""

    kind = "forbidden_error"


class UnsupportedMediaType(EngineError):
    """A POST body that is not `application/json` (415)."""

    kind = "unsupported_media_type_error"


class PayloadTooLarge(EngineError):
    """A body above `max_body_bytes` (413). The connection closes after the reply: the unread
    rest of the body is not worth reading."""

    kind = "payload_too_large_error"
    close_connection = True


class TooManyRequests(EngineError):
    """An address whose refused requests or timed-out connections cost more than its share
    (429, `Retry-After`: when its debt is paid). The connection closes: its body is not read."""

    kind = "rate_limit_error"
    close_connection = True

    def __init__(self, message: str, retry_after_s: float):
        super().__init__(message)
        self.retry_after_s = max(1, math.ceil(retry_after_s))


class BodyTimeout(EngineError):
    """A body that did not arrive within `body_timeout` (408)."""

    kind = "request_timeout_error"
    close_connection = True


GUARD = web.AppKey("guard", GuardSettings)


# ---- connections ----


_RAW_TYPES = {503: "unavailable_error", 429: "rate_limit_error"}


def _raw_reply(status: int, reason: str, message: str, retry_after_s: int = 1) -> bytes:
    body = json.dumps({"error": {"message": message, "type": _RAW_TYPES.get(status, "invalid_request_error"),
                                 "param": None, "code": None}}).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\nServer: {SERVER_NAME}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n")
    if status in _RAW_TYPES:
        head += f"Retry-After: {retry_after_s}\r\n"
    return head.encode() + b"\r\n" + body


def _in_debt(wait_s: float) -> bytes:
    return _raw_reply(429, "Too Many Requests", "this address's refused requests and timed-out connections "
                      "cost more than its share; retry later", max(1, math.ceil(wait_s)))


_BUSY = _raw_reply(503, "Service Unavailable", "too many open connections; retry later")
_OVER_CAP = _raw_reply(429, "Too Many Requests", "too many open connections from this address; retry later")
_HEADER_TIMEOUT = _raw_reply(408, "Request Timeout", "the request headers did not arrive in time")
_EVICTED = _raw_reply(408, "Request Timeout", "the request did not arrive in time (the server needed the connection)")
_EVICTED_HEAD = _raw_reply(408, "Request Timeout",
                           "the request headers did not arrive in time (the server needed the connection)")
_HEAD_TOO_LARGE = _raw_reply(431, "Request Header Fields Too Large", "the request head is larger than this "
                             "server's limit")


_ByConnection = collections.OrderedDict[int, "GuardedProtocol"]  # id(protocol) -> protocol, oldest first


class _IdleOrder:
    """Evictable connections, oldest activity first, in two tiers: connections that have
    already had a request (kept alive between requests, or in a body that stopped coming)
    go before new ones still sending their first head, so a flood of stalled or kept-alive
    connections evicts itself, not a real client whose head is on its way. O(1) each."""

    def __init__(self) -> None:
        # (had a request, new), each oldest first
        self._tiers: tuple[_ByConnection, _ByConnection] = (collections.OrderedDict(), collections.OrderedDict())

    def __len__(self) -> int:
        return len(self._tiers[0]) + len(self._tiers[1])

    @property
    def after_request(self) -> int:
        """Idle connections that have had a request (the first tier)."""
        return len(self._tiers[0])

    def __contains__(self, proto) -> bool:
        return id(proto) in self._tiers[0] or id(proto) in self._tiers[1]

    def put(self, proto: GuardedProtocol) -> None:
        """`proto` is idle as of now (at the end of its tier)."""
        key = id(proto)
        tier = 0 if proto.handlers or proto.served else 1
        self._tiers[1 - tier].pop(key, None)
        self._tiers[tier][key] = proto
        self._tiers[tier].move_to_end(key)

    def touch(self, proto: GuardedProtocol) -> None:
        key = id(proto)
        for table in self._tiers:
            if key in table:
                table.move_to_end(key)

    def remove(self, proto: GuardedProtocol) -> None:
        for table in self._tiers:
            table.pop(id(proto), None)

    def oldest(self) -> GuardedProtocol | None:
        for table in self._tiers:
            if table:
                return next(iter(table.values()))
        return None


class ConnectionGuard:
    """Counts a server's connections, orders the idle ones and arms each one's header deadline
    (loop thread only).

    `_idle` holds every evictable connection (`_IdleOrder`): a byte received or the end of a
    request moves a connection to the end of its tier; a handler that has its whole body takes
    it out until the request is done. Eviction takes the front, so it costs O(1)."""

    def __init__(self, settings: GuardSettings, refusals: RefusalLedger | None = None):
        self.settings = settings
        self.refusals = refusals  # what each address owes (timeouts charged here, refusals by `parse_body`)
        self.open = 0
        self.accepted = 0  # connections admitted, ever
        self.evicted = 0
        self.refused = 0
        self.timed_out = 0
        self.held = 0  # connections held unread: over their address's cap (a 503 follows), or in debt
        self.deferred = 0  # connections held because their address was in debt (then admitted, or held again)
        self.loop: asyncio.AbstractEventLoop | None = None  # set by the site that serves
        self.trust = ProxyTrust(settings.trusted_proxies)
        self.too_large = 0  # request heads over `max_head_bytes` (431)
        self.send_timeouts = 0  # replies that made no progress for `send_timeout`
        self._idle = _IdleOrder()
        self._per_client: collections.Counter[str] = collections.Counter()
        self._by_transport: dict[int, GuardedProtocol] = {}

    @property
    def busy(self) -> int:
        """Connections whose request is inside a handler with its whole body (never evicted)."""
        return self.open - len(self._idle)

    @property
    def idle_after_request(self) -> int:
        """Idle connections that have had a request: kept alive, or in a body that stalls."""
        return self._idle.after_request

    def factory(self, server: web.Server):
        """The protocol factory for `loop.create_server`: aiohttp's handler, guarded."""
        return lambda: GuardedProtocol(self, server)

    # ---- what the request layer tells (guard_middleware, read_body) ----

    def connection_of(self, request: web.Request) -> GuardedProtocol | None:
        transport = request.transport
        return self._by_transport.get(id(transport)) if transport is not None else None

    def request_started(self, proto: GuardedProtocol, expects_body: bool) -> None:
        """A handler took the connection: busy unless it still waits for a body (then idle
        among the connections that had a request, from now)."""
        proto.handlers += 1
        if expects_body:
            self._set_idle(proto)
        else:
            self._set_busy(proto)

    def body_read(self, proto: GuardedProtocol) -> None:
        self._set_busy(proto)

    def request_done(self, proto: GuardedProtocol) -> None:
        proto.handlers = max(proto.handlers - 1, 0)
        proto.served += 1
        if proto.handlers == 0 and proto.admitted:
            self._set_idle(proto)
            proto.expect_head()

    def write_blocked(self, proto: GuardedProtocol) -> None:
        """`proto`'s reply fills its reader's socket: it is idle (evictable) until it drains.
        Counted busy, 1,000 connections that pipelined requests and never read their replies
        held every place in the table."""
        if proto.blocked or not proto.admitted:
            return
        proto.busy_before_block = proto not in self._idle
        proto.blocked = True
        self._idle.put(proto)

    def write_resumed(self, proto: GuardedProtocol) -> None:
        if not proto.blocked:
            return
        proto.blocked = False
        if proto.admitted and proto.busy_before_block and proto.handlers:
            self._idle.remove(proto)

    # ---- the tables ----

    def _admit(self, proto: GuardedProtocol) -> bool:
        """Take `proto` into the tables (True), or hold it unread, or answer it now (False).
        An address in debt, or at its cap, is held `refuse_hold_s` (1-2x) once; still in debt
        then, or still at its cap, it gets a raw 429 with `Retry-After`: a real client of that
        address hears within seconds, and an attacker that reconnects at once cannot make the
        loop accept and refuse as fast as it can."""
        client = proto.client
        trusted = self.trust.trusts(client)
        owed = self.refusals.wait_s(client) if self.refusals is not None and not trusted else 0.0
        if owed > 0:
            if not proto.was_held and self._hold(proto, self.settings.refuse_hold_s, then=proto.enter):
                self.deferred += 1
                return False
            self.refused += 1
            proto.drop(_in_debt(owed))
            return False
        if not trusted and self._per_client[client] >= self.settings.max_client_connections:
            if not proto.was_held and self._hold(proto, self.settings.refuse_hold_s, then=proto.enter):
                return False
            self.refused += 1
            proto.drop(_OVER_CAP)
            return False
        if self.open >= self.settings.max_connections and not self._evict():
            self.refused += 1
            proto.drop(_BUSY)
            return False
        self.open += 1
        self.accepted += 1
        self._per_client[client] += 1
        proto.admitted = True
        self._by_transport[id(proto.transport)] = proto
        self._set_idle(proto)
        return True

    def _hold(self, proto: GuardedProtocol, seconds: float, then) -> bool:
        """Keep a connection unread for 1-2x `seconds` (drawn per connection, so connections
        that came together are let go apart), then call `then`: over its address's cap, a 503;
        from an address in debt, admission tried again. False, to decide now, when
        `HOLD_FACTOR` x `max_connections` are held already. Answered at once, an attacker that
        reconnects at once made the loop accept and close ~750 connections a second (1,100
        stalled bodies from one address; docs/security.md)."""
        if self.held >= HOLD_FACTOR * self.settings.max_connections or self.loop is None or proto.transport is None:
            return False
        self.held += 1
        proto.holding = proto.was_held = True
        proto.transport.pause_reading()

        def release() -> None:
            proto._deadline = None
            self._unhold(proto)
            then()

        proto._deadline = self.loop.call_later(seconds * (1 + random.random()), release)
        return True

    def charge_timeout(self, client: str) -> None:
        """A connection of `client` sent no whole request in time (header or body deadline, or
        evicted idle in one): its address owes `TIMEOUT_CHARGE_S`. A trusted proxy owes nothing:
        its connections are many clients'."""
        if self.refusals is not None and not self.trust.trusts(client):
            self.refusals.charge(client, TIMEOUT_CHARGE_S)

    def _unhold(self, proto: GuardedProtocol) -> None:
        if proto.holding:
            proto.holding = False
            self.held -= 1

    def _evict(self) -> bool:
        """Drop the longest-idle connection (False when none is idle)."""
        victim = self._idle.oldest()
        if victim is None:
            return False
        self.evicted += 1
        if victim.blocked:  # a reply its reader does not read: nothing more can be said
            reply = b""
            self.charge_timeout(victim.client)
        elif victim.handlers:  # a body that stopped coming
            reply = _EVICTED
        elif victim.served == 0:  # its first head never came whole
            reply = _EVICTED_HEAD
        else:  # kept alive between requests: nothing to answer
            reply = b""
        if reply:
            self.charge_timeout(victim.client)
        victim.drop(reply)
        self._release(victim)
        return True

    def _set_idle(self, proto: GuardedProtocol) -> None:
        self._idle.put(proto)

    def _set_busy(self, proto: GuardedProtocol) -> None:
        if proto.blocked:  # stays evictable until its reply drains
            proto.busy_before_block = True
            return
        self._idle.remove(proto)

    def _touch(self, proto: GuardedProtocol) -> None:
        """A byte arrived: an idle connection becomes the most recently active of its tier."""
        if proto in self._idle:
            self._idle.touch(proto)

    def _release(self, proto: GuardedProtocol) -> None:
        """Forget a connection (closed or evicted); idempotent."""
        if not proto.admitted:
            return
        proto.admitted = False
        self._idle.remove(proto)
        self._by_transport.pop(id(proto.transport), None)
        self.open -= 1
        self._per_client[proto.client] -= 1
        if self._per_client[proto.client] <= 0:
            del self._per_client[proto.client]


class GuardedProtocol(asyncio.Protocol):
    """aiohttp's `RequestHandler` with a header deadline, a head-size cap, a send timeout and a
    place in the connection tables."""

    def __init__(self, guard: ConnectionGuard, server: web.Server):
        self._guard = guard
        self._server = server
        self._inner: asyncio.Protocol | None = None
        self.transport: asyncio.Transport | None = None
        self.client = ""
        self.admitted = False
        self.handlers = 0  # requests of this connection inside the app's handlers
        self.served = 0  # requests finished on this connection
        self._deadline: asyncio.TimerHandle | None = None  # the header deadline, or a held refusal's end
        self._tail = b""  # the last 3 bytes seen while looking for the end of the head
        self._in_head = True  # bytes now are a request head's (counted against `max_head_bytes`)
        self._head_bytes = 0
        self.holding = False  # held unread (`ConnectionGuard._hold`)
        self.was_held = False  # held once already: the next refusal is answered
        self.blocked = False  # its reply is stuck in a reader's full socket (`pause_writing`)
        self.busy_before_block = False  # busy when it blocked: busy again when it resumes
        self._send_timer: asyncio.TimerHandle | None = None
        self._send_mark = 0  # write buffer size when the send timer was armed
        self.metrics_window, self.metrics_asked = -math.inf, 0  # /metrics asked in the current second (app/server.py)

    def connection_made(self, transport) -> None:
        self.transport = transport
        peer = transport.get_extra_info("peername")
        self.client = str(peer[0]) if isinstance(peer, (tuple, list)) and peer else ""
        self.enter()

    def enter(self) -> None:
        """Admitted: aiohttp's handler takes the connection; else held (`ConnectionGuard._hold`)
        or answered now."""
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        if not self._guard._admit(self):
            return
        if self._guard.loop is None:
            raise RuntimeError("a connection arrived before its guarded site started")
        self._deadline = self._guard.loop.call_later(self._guard.settings.header_timeout, self._header_timeout)
        self._inner = _quiet_handler(self._server)
        self._inner.connection_made(transport)
        transport.resume_reading()  # paused while it was held; a no-op otherwise

    def expect_head(self) -> None:
        """Its requests are done: what it sends next is a head, and counts."""
        self._in_head, self._head_bytes, self._tail = True, 0, b""

    def data_received(self, data: bytes) -> None:
        if self._inner is None:
            return
        self._guard._touch(self)
        if self._in_head and not self._head_data(data):
            return
        self._inner.data_received(data)

    def _head_data(self, data: bytes) -> bool:
        """Count a head's bytes up to its blank line; False (and a 431) past `max_head_bytes`."""
        seen = self._tail + data
        end = seen.find(b"\r\n\r\n")
        size = self._head_bytes + (len(data) if end < 0 else end + 4 - len(self._tail))
        if size > self._guard.settings.max_head_bytes:
            self._guard.too_large += 1
            self._guard.charge_timeout(self.client)
            self.drop(_HEAD_TOO_LARGE)
            return False
        if end < 0:
            self._head_bytes, self._tail = size, seen[-3:]
        else:
            self._in_head, self._head_bytes, self._tail = False, 0, b""
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None
        return True

    def eof_received(self):
        return self._inner.eof_received() if self._inner is not None else None

    def connection_lost(self, exc) -> None:
        self._stop_timers()
        self._guard._unhold(self)
        self._guard._release(self)
        if self._inner is not None:
            inner, self._inner = self._inner, None
            inner.connection_lost(exc)

    def pause_writing(self) -> None:
        """The reader's socket is full: this connection may be evicted, and its reply has
        `send_timeout` to make progress."""
        self._guard.write_blocked(self)
        self._arm_send_timer()
        if self._inner is not None:
            self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._cancel_send_timer()
        self._guard.write_resumed(self)
        if self._inner is not None:
            self._inner.resume_writing()

    def _arm_send_timer(self) -> None:
        self._cancel_send_timer()
        loop, transport = self._guard.loop, self.transport
        if loop is not None and transport is not None:
            self._send_mark = transport.get_write_buffer_size()
            self._send_timer = loop.call_later(self._guard.settings.send_timeout, self._send_check)

    def _cancel_send_timer(self) -> None:
        if self._send_timer is not None:
            self._send_timer.cancel()
            self._send_timer = None

    def _send_check(self) -> None:
        """`send_timeout` after the reply blocked (or last moved): gone on if the reader took
        some of it since, else dropped (nginx's `send_timeout`)."""
        self._send_timer = None
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        if transport.get_write_buffer_size() < self._send_mark:
            self._arm_send_timer()
            return
        self._guard.send_timeouts += 1
        self._guard.charge_timeout(self.client)
        self.drop(b"")

    def _header_timeout(self) -> None:
        self._deadline = None
        self._guard.timed_out += 1
        self._guard.charge_timeout(self.client)
        self.drop(_HEADER_TIMEOUT)

    def _stop_timers(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        self._cancel_send_timer()

    def drop(self, reply: bytes) -> None:
        """Answer `reply` (if any) and let go of the socket now (no lingering on an unread buffer)."""
        self._stop_timers()
        transport = self.transport
        if transport is not None and not transport.is_closing():
            if reply:
                transport.write(reply)  # sent at once into the socket's buffer; best effort
            transport.abort()  # connection_lost follows on the loop


class _QuietRequestHandler(RequestHandler):
    """aiohttp's handler, whose own error replies (a head it cannot parse) say what went wrong
    without quoting the request: its text had the offending header, `Authorization` included."""

    def handle_error(self, request, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        if status >= 500:
            return super().handle_error(request, status, exc, message)
        status = 431 if isinstance(exc, LineTooLong) else status
        what = "a request header is too long" if status == 431 else "the request could not be parsed as HTTP/1.1"
        self.log_debug("refused a request it could not parse (%s)", type(exc).__name__)
        response = web.json_response({"error": {"message": what, "type": "invalid_request_error", "param": None,
                                                 "code": None}}, status=status)
        response.force_close()
        return response


def _quiet_handler(server: web.Server) -> asyncio.Protocol:
    """`server()`'s handler as a `_QuietRequestHandler` (the same arguments)."""
    kwargs = getattr(server, "_kwargs", None)
    if kwargs is None:  # another aiohttp: its own handler, its own error texts
        return server()
    return _QuietRequestHandler(server, loop=asyncio.get_running_loop(), **kwargs)


class ProxyTrust:
    """Which peers are trusted proxies (`--trusted-proxy`), and the client address behind one:
    the rightmost `X-Forwarded-For` hop that is not itself a trusted proxy (what the last
    trusted proxy saw), as nginx's `real_ip_recursive`. An untrusted peer's header is ignored."""

    MAX_SEEN = 4096

    def __init__(self, proxies: tuple[str, ...]):
        self._nets = tuple(ipaddress.ip_network(p, strict=False) for p in proxies)
        self._seen: dict[str, bool] = {}

    def trusts(self, address: str) -> bool:
        if not self._nets:
            return False
        hit = self._seen.get(address)
        if hit is None:
            try:
                ip = ipaddress.ip_address(address.split("%", 1)[0])
            except ValueError:
                hit = False
            else:
                mapped = getattr(ip, "ipv4_mapped", None)
                hit = any(ip in n or (mapped is not None and mapped in n) for n in self._nets)
            if len(self._seen) < self.MAX_SEEN:
                self._seen[address] = hit
        return hit

    def client(self, peer: str, forwarded: list[str]) -> str:
        if not self.trusts(peer):
            return peer
        hops = [h.strip() for value in forwarded for h in value.split(",") if h.strip()]
        for hop in reversed(hops):
            if not self.trusts(hop):
                return hop[:64]
        return hops[0][:64] if hops else peer


CONNECTIONS = web.AppKey("connections", ConnectionGuard)  # the app's tables (`create_app` sets it)


class RefusalLedger:
    """What parsing the requests each client address sent and was refused (4xx) cost, in CPU
    seconds, and its connections that timed out (`TIMEOUT_CHARGE_S` each), as a leaky bucket:
    it drains at `share` seconds per second, and an address over `burst` seconds waits, before
    its next body is read or its next connection admitted, until it is back at `burst`. A
    client that sends 50,000-message chats (each refused, each ~0.2 s of CPU that holds the GIL
    the backends need between steps) is held to a tenth of a core; one that never errs never
    waits. Every client behind one proxy is one address here."""

    MAX_ADDRESSES = 4096  # past this, addresses whose debt has drained are forgotten

    def __init__(self, share: float, burst: float, clock=time.monotonic):
        self.share, self.burst, self._clock = share, burst, clock
        self._debt: dict[str, tuple[float, float]] = {}  # address -> (seconds owed, when)
        self._lock = threading.Lock()  # parsing threads charge, the loop reads

    def owed(self, address: str) -> float:
        debt, since = self._debt.get(address, (0.0, 0.0))
        return max(0.0, debt - (self._clock() - since) * self.share)

    def charge(self, address: str, seconds: float) -> None:
        with self._lock:
            self._debt[address] = (self.owed(address) + seconds, self._clock())
            if len(self._debt) > self.MAX_ADDRESSES:
                for a in [a for a in self._debt if self.owed(a) == 0.0]:
                    del self._debt[a]

    def wait_s(self, address: str) -> float:
        """Seconds `address` waits before its next request is read (0: none)."""
        return max(0.0, self.owed(address) - self.burst) / self.share


REFUSALS = web.AppKey("refusals", RefusalLedger)  # `create_app` sets it


class GuardedSite(web.TCPSite):
    """`web.TCPSite` whose connections go through a `ConnectionGuard`."""

    def __init__(self, runner: web.BaseRunner, guard: ConnectionGuard, host: str, port: int, *, backlog: int):
        super().__init__(runner, host, port, backlog=backlog)
        self.guard = guard

    async def start(self) -> None:
        await web.BaseSite.start(self)  # registers the site with its runner
        server = self._runner.server
        assert server is not None
        loop = self.guard.loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            self.guard.factory(server), self._host, self._port, backlog=self._backlog,
            reuse_address=self._reuse_address, reuse_port=self._reuse_port)


def debt_hold_s(owed_s: float, floor_s: float) -> float:
    """How long a connection or a stalled body of an address that owes `owed_s` waits before it
    is looked at again: the debt, within `floor_s` (fewer wake-ups) and `MAX_HOLD_S`."""
    return max(floor_s, min(owed_s, MAX_HOLD_S))


def raise_fd_limit(settings: GuardSettings, reserve: int = 256) -> GuardSettings:
    """Make room for `max_connections` sockets, `HOLD_FACTOR` times as many held refusals
    (`ConnectionGuard._hold`) and `reserve` other files (models, logs, threads):
    raise this process's soft RLIMIT_NOFILE toward the hard one, or lower the cap (with a
    warning) so accept() never runs into EMFILE."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = (1 + HOLD_FACTOR) * settings.max_connections + reserve  # the table and the held refusals
    if soft != resource.RLIM_INFINITY and soft < need:
        target = need if hard == resource.RLIM_INFINITY else min(need, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    if soft != resource.RLIM_INFINITY and soft < need:
        cap = max(1, (soft - reserve) // (1 + HOLD_FACTOR))
        log.warning("the open-file limit is %d: serving at most %d connections, not %d",
                    soft, cap, settings.max_connections)
        from dataclasses import replace
        return replace(settings, max_connections=cap)
    return settings


# ---- requests ----


def _host_name(value: str) -> str:
    """`Host` header → the bare lower-case name or address (port and IPv6 brackets dropped)."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1:value.find("]")] if "]" in value else value
    if value.count(":") == 1:
        value = value.split(":", 1)[0]
    return value


def _host_allowed(request: web.Request, settings: GuardSettings) -> bool:
    if "*" in settings.allowed_hosts:
        return True
    name = _host_name(request.headers.get(hdrs.HOST, ""))
    if not name:
        return False
    if name in LOOPBACK_NAMES or name in settings.allowed_hosts:
        return True
    sock = request.transport.get_extra_info("sockname") if request.transport is not None else None
    if sock:  # the address this connection arrived on, whatever the bind (0.0.0.0 too)
        try:
            here = ipaddress.ip_address(sock[0].split("%", 1)[0])
            there = ipaddress.ip_address(name.split("%", 1)[0])
        except ValueError:
            return False
        mapped = getattr(here, "ipv4_mapped", None)
        return there == here or (mapped is not None and there == mapped)
    return False


def origin_allowed(origin: str, settings: GuardSettings) -> bool:
    return "*" in settings.allowed_origins or origin.rstrip("/").lower() in settings.allowed_origins


def _cut(value: str, n: int = 100) -> str:
    return value if len(value) <= n else value[:n] + "…"


@web.middleware
async def guard_middleware(request: web.Request, handler) -> web.StreamResponse:
    """Host, Origin, CORS preflight, content type and declared size, before auth and parsing."""
    settings = request.app[GUARD]
    if not _host_allowed(request, settings):
        raise Forbidden(f"Host {_cut(request.headers.get(hdrs.HOST, ''))!r} is not served here "
                        f"(allow it with --allowed-hosts)", param="Host")
    origin = request.headers.get(hdrs.ORIGIN)
    if origin is not None and not origin_allowed(origin, settings):
        raise Forbidden(f"cross-origin requests from {_cut(origin)!r} are not allowed "
                        f"(allow an origin with --allowed-origins)", param="Origin")
    if request.method == hdrs.METH_OPTIONS and origin is not None \
            and hdrs.ACCESS_CONTROL_REQUEST_METHOD in request.headers:
        return _preflight(request, origin)
    if request.method == hdrs.METH_POST:
        length = request.content_length
        if length is not None and length > settings.max_body_bytes:
            raise _too_large(request, settings)
        if (request.body_exists or (length or 0) > 0) and request.content_type != "application/json":
            raise UnsupportedMediaType(
                f"the body must be application/json, got {_cut(request.content_type or 'none')!r}",
                param="Content-Type")
    guard = request.app.get(CONNECTIONS)
    conn = guard.connection_of(request) if guard is not None else None
    if guard is None or conn is None:  # served by another site (a test server): nothing to track
        return await handler(request)
    guard.request_started(conn, request.body_exists)
    try:
        return await handler(request)
    finally:
        guard.request_done(conn)


def _too_large(request: web.Request, settings: GuardSettings) -> PayloadTooLarge:
    return PayloadTooLarge(f"the body is larger than this server's limit of {settings.max_body_bytes} bytes")


def _preflight(request: web.Request, origin: str) -> web.Response:
    """A CORS preflight from an allowed origin: the methods the API serves, and the headers the
    browser asks for (SDKs send their own, openai-node's `x-stainless-*`), echoed when they are
    header names and few (`_requested_headers`)."""
    method = request.headers[hdrs.ACCESS_CONTROL_REQUEST_METHOD].upper()
    if method not in CORS_METHODS:
        raise Forbidden(f"CORS method {_cut(method)!r} is not allowed", param="Access-Control-Request-Method")
    return web.Response(status=204, headers={
        hdrs.ACCESS_CONTROL_ALLOW_ORIGIN: origin,
        hdrs.ACCESS_CONTROL_ALLOW_METHODS: ", ".join(CORS_METHODS),
        hdrs.ACCESS_CONTROL_ALLOW_HEADERS: _requested_headers(request),
        hdrs.ACCESS_CONTROL_MAX_AGE: str(CORS_MAX_AGE_S),
        hdrs.VARY: "Origin, Access-Control-Request-Method, Access-Control-Request-Headers",
    })


_HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")


def _requested_headers(request: web.Request) -> str:
    """`Access-Control-Request-Headers` echoed (at most `CORS_MAX_HEADERS` names of header-name
    characters, each at most 64), else the headers the API reads."""
    asked = [h.strip() for h in request.headers.get(hdrs.ACCESS_CONTROL_REQUEST_HEADERS, "").split(",") if h.strip()]
    if asked and len(asked) <= CORS_MAX_HEADERS and all(len(h) <= 64 and _HEADER_NAME.fullmatch(h) for h in asked):
        return ", ".join(asked)
    return CORS_ALLOWED_HEADERS


async def on_prepare(request: web.Request, response: web.StreamResponse) -> None:
    """Every app response, streamed or not: our `Server` name and, for allowed origins, CORS."""
    response.headers[hdrs.SERVER] = SERVER_NAME
    origin = request.headers.get(hdrs.ORIGIN)
    if origin is not None and request.app[GUARD].allowed_origins and origin_allowed(origin, request.app[GUARD]):
        response.headers[hdrs.ACCESS_CONTROL_ALLOW_ORIGIN] = origin
        response.headers[hdrs.ACCESS_CONTROL_EXPOSE_HEADERS] = "X-Request-Id, X-Tandem-Backend"
        response.headers.add(hdrs.VARY, "Origin")


def client_address(request: web.Request) -> str:
    """The client's address: the peer's, or behind a trusted proxy (`--trusted-proxy`) the one
    its `X-Forwarded-For` names (`ProxyTrust.client`)."""
    peer = request.remote or ""
    guard = request.app.get(CONNECTIONS)
    if guard is None:
        return peer
    return guard.trust.client(peer, request.headers.getall(hdrs.X_FORWARDED_FOR, []))


async def parse_body(request: web.Request, parse, *args):
    """`parse(body, *args)` on a worker thread, the body read by `read_body`. An address whose
    refused requests (InvalidRequest) cost more than its share to parse gets a 429 with
    `Retry-After` at once, its body unread (`RefusalLedger`): that work holds the GIL the
    backends need between their steps."""
    refusals, address = request.app[REFUSALS], client_address(request)
    wait = refusals.wait_s(address)
    if wait > 0:
        raise TooManyRequests(f"this address's refused requests cost more than its share of the server; retry in "
                              f"{math.ceil(wait)} s", retry_after_s=wait)
    raw = await read_body(request)
    pool = request.app.get(PARSING)
    if pool is None:
        return await asyncio.to_thread(_parse_charged, refusals, address, parse, raw, *args)
    return await pool.run(_parse_charged, refusals, address, parse, raw, *args)


# What reading a body costs the loop, charged with a refusal as CPU seconds: one per this many
# bytes. Uncharged, six near-2 MiB bodies at a time came at ~150 MB/s and held normal traffic's
# p95 at 2.7x quiet on a 2-core machine; charged, at 1.25x (docs/security.md, run 7).
REFUSED_BYTES_PER_S = 100e6


def _parse_charged(refusals: RefusalLedger, address: str, parse, raw: bytes, *args):
    t0 = time.thread_time()
    try:
        return parse(raw, *args)
    except InvalidRequest:  # refused: what reading and parsing it cost stays with its sender
        refusals.charge(address, time.thread_time() - t0 + len(raw) / REFUSED_BYTES_PER_S)
        raise
    finally:
        trim_heap(len(raw))


async def read_body(request: web.Request) -> bytes:
    """The whole body, within `max_body_bytes`, `body_timeout` in all and `body_idle_timeout`
    from the last byte (413 / 408 otherwise). While it comes the connection counts as idle
    (a stalled body can be evicted); once it is whole, as busy.

    Chunked bodies carry no length: reading stops at the limit."""
    settings = request.app[GUARD]
    refusals, address = request.app.get(REFUSALS), client_address(request)
    limit = settings.max_body_bytes
    body = bytearray()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + settings.body_timeout
    try:
        while True:
            # Up to twice the idle timeout, drawn per wait: bodies that stall together (an attack's
            # connections, opened at once) then time out apart, not in one burst of 408s and reconnects.
            wait = min(settings.body_idle_timeout * (1 + random.random()), deadline - loop.time())
            try:
                if wait <= 0:
                    raise TimeoutError
                async with asyncio.timeout(wait):
                    chunk = await request.content.readany()
            except TimeoutError:
                # A stalled body of an address in debt (its connections keep timing out) waits
                # until the debt is paid before its 408: answered at once, its client reconnects
                # and stalls again, and the server's loop spends itself on the churn (1,100
                # stalled bodies from one address; docs/security.md). So its timeouts come at
                # the ledger's rate, `share` / `TIMEOUT_CHARGE_S` a second.
                owed = refusals.wait_s(address) if refusals is not None else 0.0
                if owed <= 0:
                    raise
                deadline = loop.time() + debt_hold_s(owed, settings.body_idle_timeout) * (1 + random.random())
                continue
            if not chunk:
                break
            body += chunk
            if len(body) > limit:
                raise _too_large(request, settings)
    except TimeoutError:
        total = loop.time() >= deadline
        guard = request.app.get(CONNECTIONS)
        if guard is not None:
            guard.charge_timeout(address)
        raise BodyTimeout(f"the body did not arrive within {settings.body_timeout:g} s" if total else
                          f"the body stopped for {settings.body_idle_timeout:g} s or more") from None
    guard = request.app.get(CONNECTIONS)
    conn = guard.connection_of(request) if guard is not None else None
    if guard is not None and conn is not None:
        guard.body_read(conn)
    return bytes(body)


# ---- logs ----


@dataclass
class RepeatFilter(logging.Filter):
    """Lets each distinct message (logger + format string) through `burst` times per `window_s`,
    then drops it, and says how many were dropped when the window turns over."""

    burst: int = 5
    window_s: float = 10.0
    _seen: dict = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self):
        super().__init__()

    def filter(self, record: logging.LogRecord) -> bool:
        key = (record.name, str(record.msg)[:200])
        now = time.monotonic()
        with self._lock:
            start, count, dropped = self._seen.get(key, (now, 0, 0))
            if now - start >= self.window_s:
                if dropped:
                    record.msg = f"{record.msg} (and {dropped} more like it in the last {self.window_s:g} s)"
                start, count, dropped = now, 0, 0
            count += 1
            if count > self.burst:
                self._seen[key] = (start, count, dropped + 1)
                return False
            self._seen[key] = (start, count, dropped)
            if len(self._seen) > 1000:  # a flood of distinct messages: forget the oldest windows
                for k in list(self._seen)[:500]:
                    del self._seen[k]
        return True


_LOGGERS = ("asyncio", "aiohttp.server", "aiohttp.access", "aiohttp.web", "aiohttp.internal")


def install_log_limits(filter_: RepeatFilter | None = None) -> RepeatFilter:
    """Rate-limit the loggers a connection flood writes to (idempotent)."""
    filter_ = filter_ or RepeatFilter()
    for name in _LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, RepeatFilter) for f in logger.filters):
            logger.addFilter(filter_)
    return filter_
