"""`tandem serve`: the engine behind an OpenAI-compatible HTTP API, with Prometheus metrics.

Routes:
    POST /v1/chat/completions, POST /v1/completions   JSON or SSE (`stream: true`)
    POST /v1/responses, GET|DELETE /v1/responses/{id}, GET /v1/responses/{id}/input_items
                           OpenAI's Responses API (app/responses.py)
    POST /v1/embeddings    OpenAI's embeddings, from the loaded model (app/embeddings.py)
    POST /tokenize, POST /detokenize   llama-server's: text <-> token ids of the served model
    GET  /v1/models, GET /v1/models/{id}   the served model(s), OpenAI's model objects
    GET  /v1/routing       backends' snapshots and the router's recent decisions
    GET  /v1/backends      backends' snapshots (each with its live cap and why it last moved)
    GET  /health           200 ok/degraded while a backend serves, else 503 (details with the key)
    GET  /metrics          Prometheus text (`tandem:` names, see `engine.core.metrics`)
    GET  /openapi.json     the API's OpenAPI document

Handlers are thin: parse the body (`app.openai_schema`), submit to the engine, shape the reply.
Every error leaves through one function, `error_response()` (app/errors.py), which maps an `EngineError`'s
`kind` to a status and OpenAI's `{"error": {message, type, param, code}}` (llama.cpp server's
`format_error_response` table), its message cut to `MESSAGE_CHARS`. With an API key, `/v1/*`
(completions, models, routing, backend restarts), `/tokenize`, `/detokenize` and `/openapi.json` need
`Authorization: Bearer KEY`; `/health` and `/metrics` stay open (vLLM does the same).

Before any of that, `app.http_guard` bounds every connection (header, body and keep-alive
timeouts, a connection cap, a body-size cap checked before reading) and refuses what a
browser could be tricked into sending (foreign `Host`, disallowed `Origin`, non-JSON POST
bodies). `docs/security.md` has the threat model and which test covers each defence. Replies
name no file path and no library version (`Server: tandem`; the model id is the file's stem).

Every route also answers without its `/v1` (llama-server serves both) and with a trailing
slash; the key check goes by the path an alias stands for.

Streaming pulls the first text before committing to SSE, so a request that fails early still
gets a JSON error. A chat reply is read as it streams (engine/prompts/reply.py): text, a
thinking block's `reasoning_content`, and tool calls (their name, then their arguments in
pieces) arrive in OpenAI's delta shape as they are decoded. The app must run
with `handler_cancellation=True` (`start_server()` and `run_serve()` do): a client that
disconnects cancels its handler, whose `finally` cancels the engine request, and the backend
frees its KV at its next step.

The engine is synchronous and thread-safe; `Engine.submit` is quick and is called on the
loop. Tokens come back through `RequestHandle.astream()` (marshalled with
`call_soon_threadsafe`). The GUI can run this same app on its qasync loop with `start_server()`.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import hashlib
import hmac
import ipaddress
import json
import logging
import math
import os
import secrets
import signal
import socket
import sys
import threading
import time
from pathlib import Path

from aiohttp import web

from engine.core.errors import ContextLengthExceeded, EngineError, InvalidRequest, RequestFailed
from engine.core.handle import RequestHandle
from engine.core.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from engine.core.metrics import EngineMetrics
from engine.core.request import FinishRecord
from engine.engine import Engine
from engine.prompts.reply import ReasoningDelta, ReplyParts, ReplyReader
from engine.prompts.tool_calls import CallStart, TextDelta
from engine.routing import DEFAULT_POLICY

from . import embeddings, responses
from .errors import error_payload, error_response, failure, succeeded
from .http_guard import (
    CONNECTIONS,
    GUARD,
    REFUSALS,
    ConnectionGuard,
    GuardedSite,
    GuardSettings,
    RefusalLedger,
    TooManyRequests,
    client_address,
    guard_middleware,
    install_log_limits,
    on_prepare,
    parse_body,
    raise_fd_limit,
)
from .openai_schema import (
    MESSAGE_CHARS,
    ApiRequest,
    AuthenticationFailed,
    ServedModel,
    detokenize,
    openapi_document,
    parse_chat,
    parse_completion,
    tokenize,
)
from .parse_pool import PARSING, ParsePool
from .settings import ENGINE, METRICS, SETTINGS, ServerSettings

log = logging.getLogger(__name__)

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8080
MAX_ROUTING_DECISIONS = 1000
BACKLOG = 1024  # many clients connect at once (benchmarks open hundreds of streams)
SHUTDOWN_TIMEOUT_S = 3.0  # on shutdown, open streams get this long before they are cancelled
# After SIGTERM/SIGINT the process is gone within this, whatever still runs: a call into llama.cpp
# that never returns (a grammar's) once kept a server alive through SIGTERM until SIGKILL.
EXIT_DEADLINE_S = 4.5


RUN_TOKEN = secrets.token_hex(6)  # this server process's part of every response id




def create_app(engine: Engine, api_key: str | None = None, *, model_id: str | None = None,
               aliases: tuple[str, ...] = (), metrics: EngineMetrics | None = None,
               guard: GuardSettings | None = None) -> web.Application:
    """The aiohttp app serving `engine`. The caller owns the engine (and `metrics`, if given).

    `model_id` is the id `/v1/models` lists (default: the GGUF file's stem); the model also
    answers to `aliases`, its GGUF `general.name` and its file name (aliases that are paths are
    accepted but never shown). `guard` holds the connection and browser-safety knobs.
    """
    served = _served_models(engine, model_id, aliases)
    guard = guard or GuardSettings()
    app = web.Application(middlewares=[error_middleware, guard_middleware, auth_middleware],
                          client_max_size=guard.max_body_bytes)
    app[GUARD] = guard
    app[REFUSALS] = RefusalLedger(guard.refused_cpu_share, guard.refused_cpu_burst_s)
    app[CONNECTIONS] = ConnectionGuard(guard, app[REFUSALS])
    app.cleanup_ctx.append(_own_parse_pool)
    app[RENDERED] = RenderedMetrics()
    app[IN_FLIGHT] = InFlight()
    app.on_response_prepare.append(on_prepare)
    app[ENGINE] = engine
    started = int(time.time())
    app[SETTINGS] = ServerSettings(api_key or None, served,
                                   openapi_document(served, engine.model.n_vocab if engine.model else 0,
                                                    engine.backend_names,
                                                    auth=bool(api_key)),
                                   started, system_fingerprint(engine, served), _model_created(engine, started))
    if metrics is not None:
        app[METRICS] = metrics
    else:
        app.cleanup_ctx.append(_own_metrics)
    app.add_routes([
        web.post("/v1/chat/completions", chat_completions),
        web.post("/v1/completions", completions),
        web.post("/tokenize", tokenize_text),
        web.post("/detokenize", detokenize_tokens),
        web.get("/v1/models", models),
        web.get("/v1/models/{model:.+}", model_info),
        web.get("/v1/routing", routing),
        web.get("/v1/backends", backends),
        web.post("/v1/backends/{name}/restart", restart_backend),
        web.get("/health", health),
        web.get("/metrics", metrics_text),
        web.get("/openapi.json", openapi),
    ])
    app[responses.RESPONSES] = responses.ResponseStore()
    app.add_routes(responses.ROUTES)
    responses.document(app[SETTINGS].openapi, auth=bool(api_key))
    app.add_routes(embeddings.ROUTES)
    embeddings.document(app[SETTINGS].openapi, auth=bool(api_key))
    app[ALIASES] = _add_aliases(app)
    return app


ALIASES = web.AppKey("aliases", dict)


def _add_aliases(app: web.Application) -> dict[str, str]:
    """Every route also without its `/v1` (llama-server serves both) and with a trailing slash;
    returns alias path -> the path it stands for (what the key check and the 404 list go by)."""
    aliases: dict[str, str] = {}
    for route in list(app.router.routes()):
        if route.method in ("HEAD", "OPTIONS") or route.resource is None:
            continue
        path = route.resource.canonical
        variants = [path.removeprefix("/v1")] if path.startswith("/v1/") else []
        variants = [v + "/" for v in [path, *variants] if not path.endswith(":.+}")] + variants
        for alias in variants:
            if alias not in aliases and alias != path:
                app.router.add_route(route.method, alias, route.handler)
                aliases[alias] = path
    return aliases


def system_fingerprint(engine: Engine, served: ServedModel) -> str:
    """OpenAI's `system_fingerprint` ("fp_" and hex): changes when the model or a backend's
    configuration does, so a client can tell why the same seed gave another reply."""
    facts: dict = {"model": served.ids, "backends": [[s.name, s.device, s.url, s.model, s.n_ctx, s.threads,
                                                      s.cap_ceiling, s.cap_adaptive] for s in engine.snapshot()]}
    if engine.model is not None:
        info = engine.model.info
        facts["info"] = [info.name, info.n_params, info.n_vocab, os.path.getsize(engine.model.path)]
    digest = hashlib.sha256(json.dumps(facts, sort_keys=True, default=str).encode()).hexdigest()
    return "fp_" + digest[:10]


def _model_created(engine: Engine, started: int) -> int:
    """A local model's `created`: its file's modification time (stable across restarts)."""
    try:
        return int(os.path.getmtime(engine.model.path)) if engine.model is not None else started
    except OSError:
        return started


def _served_models(engine: Engine, model_id: str | None, aliases: tuple[str, ...]) -> ServedModel:
    """The local model (its names) first, then the models of the remote engines; a router with
    only remote engines serves theirs."""
    ids = engine.model_ids()
    if engine.model is None:
        return ServedModel(model_id or (ids[0] if ids else "none"), frozenset(), tuple(ids[1:]))
    path = Path(engine.model.path)
    names = frozenset({*aliases, engine.model.info.name, path.name, path.stem}) - {""}
    return ServedModel(model_id or path.stem, names, tuple(i for i in ids if i != path.stem))


async def start_server(app: web.Application, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT, *,
                       access_log: logging.Logger | None = None) -> tuple[web.AppRunner, str]:
    """Serve `app` on the running loop (the GUI's, a test's); returns the runner and base URL.

    Connections go through the app's `GuardSettings` (`app.http_guard`). Port 0 picks a free
    port. Stop with `await runner.cleanup()`.
    """
    guard = app[GUARD]
    # No SO_KEEPALIVE per socket (aiohttp's default): the guard's header, body and keep-alive
    # deadlines already close dead and idle peers, and a setsockopt per accepted connection is
    # work a connection flood makes the server do for nothing.
    runner = web.AppRunner(app, handler_cancellation=True, access_log=access_log,
                           shutdown_timeout=SHUTDOWN_TIMEOUT_S, keepalive_timeout=guard.keepalive_timeout,
                           tcp_keepalive=False)
    await runner.setup()
    try:
        await GuardedSite(runner, app[CONNECTIONS], host, port, backlog=BACKLOG).start()
    except BaseException:
        await runner.cleanup()
        raise
    bound_host, bound_port = runner.addresses[0][:2]
    return runner, f"http://{_url_host(bound_host)}:{bound_port}"


def guard_from_args(args) -> GuardSettings:
    """`tandem serve`'s connection and browser-safety flags → `GuardSettings`."""
    return GuardSettings(
        header_timeout=args.header_timeout, body_timeout=args.body_timeout,
        body_idle_timeout=args.body_idle_timeout, keepalive_timeout=args.keepalive_timeout,
        max_connections=args.max_connections, max_client_connections=args.max_client_connections,
        max_client_sequences=args.max_client_sequences,
        refuse_hold_s=args.refuse_hold, refused_cpu_share=args.refused_cpu_share,
        refused_cpu_burst_s=args.refused_cpu_burst, max_body_bytes=args.max_body_bytes,
        send_timeout=args.send_timeout, max_head_bytes=args.max_head_bytes,
        trusted_proxies=tuple(a.strip() for v in args.trusted_proxy or () for a in v.split(",") if a.strip()),
        allowed_hosts=tuple(h for v in args.allowed_hosts or () for h in v.split(",") if h),
        allowed_origins=tuple(o for v in args.allowed_origins or () for o in v.split(",") if o))


def api_key_from_args(args) -> str | None:
    """The key from `--api-key-file` (its first line), else `--api-key`, else `$TANDEM_API_KEY`.
    A key file that cannot be read, or is empty, is an error (ValueError), not an open server."""
    path = getattr(args, "api_key_file", None)
    if path:
        try:
            with open(path, encoding="utf-8") as f:
                key = f.readline().strip()
        except OSError as e:
            raise ValueError(f"cannot read the API key file {path}: {e.strerror or e}") from None
        if not key:
            raise ValueError(f"the API key file {path} is empty")
        return key
    return args.api_key or os.environ.get("TANDEM_API_KEY") or None


def run_serve(args) -> int:
    """`tandem serve`: load the engine, serve until interrupted, close the engine."""
    from .engine_setup import engine_from_args

    try:
        api_key = api_key_from_args(args)
    except ValueError as e:
        print(f"tandem: {e}", file=sys.stderr)
        return 2
    if not api_key and not _is_loopback(args.host):
        log.warning("serving on %s without an API key: anyone who can reach it can use it", args.host)
    try:
        guard = raise_fd_limit(guard_from_args(args))
    except ValueError as e:
        print(f"tandem: {e}", file=sys.stderr)
        return 2
    install_log_limits()
    engine = engine_from_args(args)
    if engine.model is not None and engine.model.synthetic:
        print("(synthetic model: random weights, the text is noise)", file=sys.stderr)
    app = create_app(engine, api_key, aliases=(args.model,) if engine.model else (), guard=guard)
    backends = ", ".join(f"{s.name} ({s.url or s.device}, cap {s.cap})" for s in engine.snapshot())
    print(f"tandem: serving {app[SETTINGS].served.id} on http://{_url_host(args.host)}:{args.port}/v1 "
          f"with {backends}", file=sys.stderr)
    try:
        asyncio.run(_serve_until_signalled(app, args.host, args.port, log if args.verbose else None))
    except OSError as e:  # the address is taken or not ours
        print(f"tandem: cannot listen on {args.host}:{args.port}: {e.strerror or e}", file=sys.stderr)
        return 2
    finally:
        engine.close()  # after the server stopped: streams still open were cancelled first
    return 0


async def _serve_until_signalled(app: web.Application, host: str, port: int, access_log) -> None:
    """`web.run_app`'s job with our guarded site: serve until SIGINT/SIGTERM, then clean up."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()

    def on_signal() -> None:
        if not stop.is_set():
            stop.set()
            threading.Thread(target=_exit_after, args=(EXIT_DEADLINE_S,), name="tandem-exit", daemon=True).start()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)
    runner, _ = await start_server(app, host, port, access_log=access_log)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


def _exit_after(seconds: float) -> None:
    """End the process `seconds` from now if it has not ended by then (a daemon thread)."""
    time.sleep(seconds)
    print(f"tandem: shutdown did not finish within {seconds:g} s (a call that does not return); exiting now",
          file=sys.stderr, flush=True)
    os._exit(1)


# ---- errors ----

def _http_error_response(exc: web.HTTPException, request: web.Request) -> web.Response:
    """aiohttp's own errors (unknown route, wrong method, body too large) in OpenAI's shape; an
    unknown endpoint's names the path and lists the ones served."""
    type_ = "not_found_error" if exc.status == 404 else "invalid_request_error"
    message = exc.text if exc.text and exc.text != f"{exc.status}: {exc.reason}" else exc.reason
    code = None
    if exc.status == 404 and request.match_info.http_exception is not None:  # no route matched
        message = (f"unknown endpoint {request.method} {_printable(request.path)}; this server serves "
                   f"{', '.join(endpoints(request.app))}")
        code = "unknown_endpoint"
    message = message[:MESSAGE_CHARS]
    payload = {"error": {"message": message, "type": type_, "param": None, "code": code}}
    headers = {k: v for k, v in exc.headers.items() if k in ("Allow",)}
    return web.json_response(payload, status=exc.status, headers=headers)


def endpoints(app: web.Application) -> list[str]:
    """`METHOD /path` of every route, in the order they were added."""
    out = []
    aliases = app.get(ALIASES, {})
    for route in app.router.routes():
        if route.method in ("HEAD", "OPTIONS"):
            continue
        path = route.resource.canonical if route.resource is not None else "?"
        if path not in aliases:
            out.append(f"{route.method} {path}")
    return list(dict.fromkeys(out))


def _printable(path: str, n: int = 100) -> str:
    path = "".join(c if c.isprintable() else "?" for c in path)
    return path if len(path) <= n else path[:n] + "…"


@web.middleware
async def error_middleware(request: web.Request, handler) -> web.StreamResponse:
    t0 = time.perf_counter()
    try:
        response = await handler(request)
    except EngineError as e:
        response = error_response(e)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        response = _http_error_response(e, request)
    except ConnectionResetError:  # the client went away; nothing to answer
        raise
    except Exception:
        log.exception("%s %s failed", request.method, request.path)
        response = error_response(RequestFailed("internal server error (see the server log)"))
    if not response.prepared:
        response.headers["openai-processing-ms"] = str(int((time.perf_counter() - t0) * 1000))
    return response


_KEYED = frozenset({"/openapi.json", "/tokenize", "/detokenize"})  # beside /v1/*


def _authorized(request: web.Request) -> bool:
    """No key is set, or the request carries it (compared in constant time)."""
    key = request.app[SETTINGS].api_key
    if not key:
        return True
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode())


def _route_path(request: web.Request) -> str:
    """The path a request's route stands for (an alias's `/v1/...` path), else its own."""
    resource = request.match_info.route.resource
    canonical = resource.canonical if resource is not None else request.path
    return request.app[ALIASES].get(canonical, request.path)


@web.middleware
async def auth_middleware(request: web.Request, handler) -> web.StreamResponse:
    path = _route_path(request)
    if (path.startswith("/v1/") or path in _KEYED) and not _authorized(request):
        raise AuthenticationFailed("missing or wrong API key: send `Authorization: Bearer KEY`")
    return await handler(request)


# ---- completions ----


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, await _parse(request, parse_chat))


async def completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, await _parse(request, parse_completion))


async def tokenize_text(request: web.Request) -> web.Response:
    """llama-server's `/tokenize`: `{content, add_special?, parse_special?, with_pieces?}` -> `{tokens}`."""
    return web.json_response(await _parse(request, lambda raw, engine, _served: tokenize(raw, engine)))


async def detokenize_tokens(request: web.Request) -> web.Response:
    """llama-server's `/detokenize`: `{tokens}` -> `{content}`."""
    return web.json_response(await _parse(request, lambda raw, engine, _served: detokenize(raw, engine)))


async def _parse(request: web.Request, parse):
    """Check the body and tokenize its prompt on a worker thread (`parse_body`): a long prompt
    (templating, tokenizing megabytes) must not stall the loop that streams everyone else's tokens."""
    return await parse_body(request, parse, request.app[ENGINE], request.app[SETTINGS].served)


async def _serve(request: web.Request, parsed: ApiRequest) -> web.StreamResponse:
    engine = request.app[ENGINE]
    loop = asyncio.get_running_loop()
    client = client_address(request)
    parsed = dataclasses.replace(parsed, request=dataclasses.replace(parsed.request, client=client),
                                 more=tuple((dataclasses.replace(r, client=client), e) for r, e in parsed.more))
    sequences = parsed.n * (1 + len(parsed.more))
    with request.app[IN_FLIGHT].hold(client, sequences, request.app[GUARD].max_client_sequences):
        return await _generate(request, engine, loop, parsed)


class InFlight:
    """Sequences (choices) each client address has generating or queued: past
    `max_client_sequences` its next request is 429 with `Retry-After`, so one address cannot
    fill every backend's queue (40 unread streams of n=16 queued 640 sequences)."""

    def __init__(self) -> None:
        self.by_client: collections.Counter[str] = collections.Counter()

    @contextlib.contextmanager
    def hold(self, client: str, n: int, limit: int):
        if self.by_client[client] + n > limit:
            raise TooManyRequests(f"this address has {self.by_client[client]} sequences generating or queued; this "
                                  f"server takes at most {limit} from one address (--max-client-sequences)",
                                  retry_after_s=1)
        self.by_client[client] += n
        try:
            yield
        finally:
            self.by_client[client] -= n
            if self.by_client[client] <= 0:
                del self.by_client[client]


IN_FLIGHT = web.AppKey("in_flight", InFlight)


async def _generate(request: web.Request, engine: Engine, loop: asyncio.AbstractEventLoop,
                    parsed: ApiRequest) -> web.StreamResponse:
    handles: list[RequestHandle] = []
    echoes: list[str] = []
    try:
        for choices, echo in parsed.groups():
            if len(choices) == 1:
                handles.append(engine.submit(choices[0], loop=loop))
            else:  # the choices go to one backend together and share the prompt's KV
                handles += engine.submit_group(choices, loop=loop)
            echoes += [echo or ""] * len(choices)
    except ContextLengthExceeded as e:
        e.param = parsed.prompt_param
        for h in handles:
            h.cancel()
        raise
    except EngineError:
        for h in handles:
            h.cancel()
        raise
    reply = Reply(parsed, handles, echoes, engine.model.piece if engine.model is not None else None,
                  request.app[SETTINGS].fingerprint)
    try:
        if parsed.stream:
            return await _stream(request, handles, reply)
        # every choice read as it comes: one left unread while another is read would pause
        await asyncio.gather(*(_drain(h) for h in handles))
        records = [succeeded(h.result(0)) for h in handles]
        return web.json_response(reply.whole(records), headers=reply.headers)
    finally:
        for h in handles:
            h.cancel()  # a no-op once finished; on disconnect, frees the request's KV


async def _drain(handle: RequestHandle) -> None:
    async for _ in handle.astream():
        pass


async def _stream(request: web.Request, handles: list[RequestHandle], reply: Reply) -> web.StreamResponse:
    """SSE for every choice, interleaved as their text comes (`choices[].index` says whose)."""
    # Bounded: a client that does not read blocks the writer, then the pumps, then the handles'
    # readers, and its sequences pause (`RequestHandle.reader_behind`) instead of filling memory.
    q: asyncio.Queue = asyncio.Queue(maxsize=2 * len(handles))

    async def pump(i: int, handle: RequestHandle) -> None:
        async for delta in handle.astream():
            await q.put((i, delta))
        await q.put((i, None))

    pumps = [asyncio.create_task(pump(i, h)) for i, h in enumerate(handles)]
    try:
        item = await q.get()
        if item[1] is None:
            succeeded(handles[item[0]].result(0))  # failed before any text: still time for a JSON error
        response = web.StreamResponse(headers={
            "Content-Type": "text/event-stream; charset=utf-8",
            "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no",
            **reply.headers,
        })
        await response.prepare(request)
        _small_send_buffer(request)
        try:
            for chunk in reply.opening():
                await _send(response, chunk)
            records: list[FinishRecord | None] = [None] * len(handles)
            while True:
                i, delta = item
                if delta is not None:
                    for chunk in reply.chunks(i, delta) if delta else ():
                        await _send(response, chunk)
                else:
                    record = records[i] = handles[i].result(0)
                    if record.error:
                        await _send(response, error_payload(failure(record))[1])
                        break
                    for chunk in reply.closing(i, record):
                        await _send(response, chunk)
                    if all(r is not None for r in records):
                        if reply.include_usage:
                            await _send(response, reply.usage_chunk(records))  # type: ignore[arg-type]
                        break
                item = await q.get()
            await response.write(b"data: [DONE]\n\n")
        except ConnectionResetError:
            pass  # the client left; the caller's `finally` cancels the request
        return response
    finally:
        for t in pumps:
            t.cancel()


# A stream's socket send buffer: the kernel grows one to 4 MB, so a reader that stops reading
# took ~125 tokens of each of 16 choices before the writer noticed; 64 KB (the kernel doubles it)
# still carries a fast stream of logprobs over a 200 ms link.
STREAM_SNDBUF = 64 << 10


STREAM_WRITE_BUFFER = 16 << 10  # and the transport's buffer above it (asyncio's default high-water: 64 KB)


def _small_send_buffer(request: web.Request) -> None:
    transport = request.transport
    if transport is None:
        return
    transport.set_write_buffer_limits(high=STREAM_WRITE_BUFFER)
    sock = transport.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, STREAM_SNDBUF)
        except OSError:
            pass


async def _send(response: web.StreamResponse, obj: dict) -> None:
    await response.write(b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n")




class Reply:
    """Shapes one request's output (one or `n` choices per prompt, a completions prompt list's
    prompts one after another) as OpenAI chat or text-completion objects, with logprobs in
    OpenAI's shape for each endpoint when they were asked for: chat `{"content": [{token,
    logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}`, completions `{tokens,
    token_logprobs, top_logprobs: [{token: logprob}], text_offset}`. A stream sends each
    choice's entries with its text (`RequestHandle.logprobs`, read as the text arrives), and the
    rest with its closing chunk. A chat reply is read as it streams (`ReplyReader`): text,
    a thinking block's `reasoning_content`, and tool calls with their arguments in pieces."""

    def __init__(self, parsed: ApiRequest, handles: list[RequestHandle], echoes: list[str], piece=None,
                 fingerprint: str = ""):
        self.chat = parsed.kind == "chat"
        handle = handles[0]
        self.handles = handles
        # unique across restarts (a token drawn once per process) and traceable to the engine's
        # request and its routing decision (`/v1/routing`'s request_id ends the id)
        self.id = f"{'chatcmpl' if self.chat else 'cmpl'}-{RUN_TOKEN}-{handle.request.id}"
        self.object = "chat.completion" if self.chat else "text_completion"
        self.created = int(time.time())
        self.model = parsed.model
        self.fingerprint = fingerprint
        self.include_usage = parsed.include_usage
        self.echoes = echoes  # per choice: the prompt's text before the reply ("" without echo)
        self.n = parsed.n
        self.logprobs = parsed.top_logprobs is not None
        self.piece = piece  # token id -> bytes (a local model's), for the echoed prompt's first token
        self._sent = [0] * len(handles)  # logprob entries streamed, per choice
        self._offset = [0 if self.logprobs else len(e) for e in echoes]  # completions' text_offset
        self.headers = {"X-Request-Id": handle.id, "X-Tandem-Backend": handle.backend or ""}
        self.readers = [ReplyReader(parsed.tools, parsed.reasoning, parsed.thinking)
                        if self.chat and (parsed.tools is not None or parsed.reasoning) else None for _ in handles]

    def parts(self, i: int, record: FinishRecord) -> ReplyParts:
        """Choice `i`'s whole reply (its reader's, once the stream is done; else read now)."""
        reader = self.readers[i]
        if reader is None:
            return ReplyParts(record.text, None)
        if not reader._closed:
            reader.feed(record.text)
            reader.close()
        return reader.parts()

    def _finish_reason(self, i: int, record: FinishRecord) -> str | None:
        return "tool_calls" if self.parts(i, record).calls else record.finish_reason

    def whole(self, records: list[FinishRecord]) -> dict:
        choices = []
        for i, record in enumerate(records):
            lp = None
            echo = self.echoes[i]
            if self.logprobs:
                head = self._prompt_logprobs(i, record.prompt_logprobs) if echo and not self.chat else None
                lp = self._logprobs(i, list(record.logprobs or ()))
                if head is not None:
                    lp = _joined(head, lp)
            if self.chat:
                parts = self.parts(i, record)
                message: dict = {"role": "assistant", "content": parts.content}
                if parts.reasoning is not None:
                    message["reasoning_content"] = parts.reasoning
                if parts.calls:
                    message["tool_calls"] = [c.to_dict() for c in parts.calls]
                choices.append({"index": i, "message": message, "logprobs": lp,
                                "finish_reason": self._finish_reason(i, record)})
            else:
                choices.append({"index": i, "text": echo + record.text, "logprobs": lp,
                                "finish_reason": record.finish_reason})
        return {**self._head(self.object), "choices": choices, "usage": self.usage(records)}

    def opening(self) -> list[dict]:
        """Chunks before any text: chat announces the assistant's role (per choice); an echo
        sends the prompt's text."""
        if self.chat:
            return [self._chunk(i, {"role": "assistant", "content": ""}, None) for i in range(len(self.handles))]
        return [self._chunk(i, echo, None, self._prompt_logprobs(i, h.prompt_logprobs) if self.logprobs else None)
                for i, (h, echo) in enumerate(zip(self.handles, self.echoes)) if echo]

    def chunks(self, i: int, text: str) -> list[dict]:
        """Choice `i`'s next text as chunks (none while a reader holds it back)."""
        reader = self.readers[i]
        if reader is None:
            return [self._chunk(i, {"content": text} if self.chat else text, None, self._new_logprobs(i))]
        return self._event_chunks(i, reader.feed(text))

    def closing(self, i: int, record: FinishRecord) -> list[dict]:
        """What the reader held back, then the chunk with the finish reason."""
        reader = self.readers[i]
        out = self._event_chunks(i, reader.close()) if reader is not None else []
        out.append(self._chunk(i, {} if self.chat else "", self._finish_reason(i, record), self._new_logprobs(i)))
        return out

    def _event_chunks(self, i: int, events: list) -> list[dict]:
        out = []
        for e in events:
            if isinstance(e, TextDelta):
                delta: dict = {"content": e.text}
            elif isinstance(e, ReasoningDelta):
                delta = {"reasoning_content": e.text}
            elif isinstance(e, CallStart):
                delta = {"tool_calls": [{"index": e.index, "id": e.call_id, "type": "function",
                                         "function": {"name": e.name, "arguments": ""}}]}
            else:
                delta = {"tool_calls": [{"index": e.index, "function": {"arguments": e.text}}]}
            out.append(self._chunk(i, delta, None, self._new_logprobs(i)))
        return out

    def usage_chunk(self, records: list[FinishRecord]) -> dict:
        return {**self._head(self._chunk_object), "choices": [], "usage": self.usage(records)}

    def usage(self, records: list[FinishRecord]) -> dict:
        """Each prompt once (its choices share it), every choice's output tokens."""
        firsts = records[::self.n]
        prompt = sum(r.prompt_tokens for r in firsts)
        out = sum(r.output_tokens for r in records)
        return {"prompt_tokens": prompt, "completion_tokens": out, "total_tokens": prompt + out,
                "prompt_tokens_details": {"cached_tokens": sum(max(r.cached_tokens, 0) for r in firsts)}}

    def _new_logprobs(self, i: int) -> dict | None:
        """The entries of choice `i` not streamed yet (None without logprobs or when none)."""
        entries = self.handles[i].logprobs
        if not self.logprobs or entries is None:
            return None
        new = entries[self._sent[i]:]
        self._sent[i] += len(new)
        return self._logprobs(i, new) if new else None

    def _prompt_logprobs(self, i: int, entries) -> dict:
        """Completions' echo with logprobs: the prompt's tokens first, the first of them with
        no logprob (nothing predicts it), then the rest; text offsets run from 0."""
        entries = list(entries or ())
        first = self.handles[i].request.prompt_tokens[:1]
        out = self._logprobs(i, entries, first_piece=self._piece(first[0]) if first else None)
        self._offset[i] = max(self._offset[i], len(self.echoes[i]))  # the reply's tokens start after the echo
        return out

    def _piece(self, token: int) -> bytes:
        return self.piece(token) if self.piece is not None else b""

    def _logprobs(self, i: int, entries: list, first_piece: bytes | None = None) -> dict:
        if self.chat:
            return {"content": [_chat_logprob(e) for e in entries], "refusal": None}
        tokens: list[str] = []
        offsets: list[int] = []
        logprobs: list[float | None] = []
        tops: list[dict[str, float] | None] = []
        if first_piece is not None:  # a prompt's first token: nothing before it predicts it
            tokens.append(_text(first_piece))
            offsets.append(self._offset[i])
            logprobs.append(None)
            tops.append(None)
            self._offset[i] += len(tokens[-1])
        for e in entries:
            text = _text(e.piece)
            tokens.append(text)
            offsets.append(self._offset[i])
            self._offset[i] += len(text)
        return {"tokens": tokens, "token_logprobs": logprobs + [e.logprob for e in entries],
                "top_logprobs": tops + [{_text(p): lp for _, p, lp in e.top} for e in entries],
                "text_offset": offsets}

    @property
    def _chunk_object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": self.fingerprint}

    def _chunk(self, i: int, delta, finish_reason: str | None, logprobs: dict | None = None) -> dict:
        key = "delta" if self.chat else "text"
        out = {**self._head(self._chunk_object),
               "choices": [{"index": i, key: delta, "logprobs": logprobs, "finish_reason": finish_reason}]}
        if self.include_usage:
            out["usage"] = None
        return out




def _joined(head: dict, tail: dict) -> dict:
    """Completions' logprobs of the echoed prompt, then of the reply."""
    return {k: head[k] + tail[k] for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}


def _text(piece: bytes) -> str:
    return piece.decode("utf-8", errors="replace")


def _chat_logprob(e) -> dict:
    return {"token": _text(e.piece), "logprob": e.logprob, "bytes": list(e.piece),
            "top_logprobs": [{"token": _text(p), "logprob": lp, "bytes": list(p)} for _, p, lp in e.top]}


# ---- state ----


async def models(request: web.Request) -> web.Response:
    """The local model (with its facts) and every model the fleet's remote engines serve, each
    with the backends that serve it."""
    settings = request.app[SETTINGS]
    return web.json_response({"object": "list", "data": [_model_object(request.app, m) for m in settings.served.ids]})


async def model_info(request: web.Request) -> web.Response:
    """`GET /v1/models/{id}` (OpenAI's `models.retrieve`): the model by its id or one of its
    names; 404 `model_not_found` otherwise."""
    settings = request.app[SETTINGS]
    asked = request.match_info["model"].rstrip("/")
    settings.served.check(asked)  # raises ModelNotFound
    model_id = settings.served.id if asked in settings.served.aliases else asked
    return web.json_response(_model_object(request.app, model_id))


def _model_object(app: web.Application, model_id: str) -> dict:
    """OpenAI's model object (`id`, `object`, `created`, `owned_by`) plus Tandem's `meta`."""
    engine, settings = app[ENGINE], app[SETTINGS]
    routed = settings.served.routed(model_id)
    meta: dict = {"backends": engine.serving(routed)}
    created = settings.started
    if engine.model is not None and model_id == settings.served.id:
        info = engine.model.info
        meta.update(name=info.name, n_params=info.n_params, n_ctx_train=info.n_ctx_train,
                    n_vocab=info.n_vocab, synthetic=info.synthetic, aliases=settings.served.public_aliases)
        created = settings.created
    return {"id": model_id, "object": "model", "created": created, "owned_by": "tandem", "meta": meta}


async def routing(request: web.Request) -> web.Response:
    try:
        n = int(request.query.get("n", "50"))
    except ValueError:
        n = -1
    if not 0 <= n <= MAX_ROUTING_DECISIONS:
        raise InvalidRequest(f"n must be an integer in [0, {MAX_ROUTING_DECISIONS}]", param="n")
    engine = request.app[ENGINE]
    return web.json_response({
        "policy": engine.router.policy,
        "default_policy": DEFAULT_POLICY,  # what `--policy default` means
        "budget": engine.router.budget,
        "backends": [s.to_dict() for s in engine.snapshot()],
        "decisions": [d.to_dict() for d in engine.router.recent(n)],
    })


async def backends(request: web.Request) -> web.Response:
    """Every backend's snapshot: load, KV, cache, rates, and the live cap with its reason."""
    return web.json_response({"backends": [s.to_dict() for s in request.app[ENGINE].snapshot()]})


async def restart_backend(request: web.Request) -> web.Response:
    """Give a backend a fresh context (after a failure); answers with its new snapshot."""
    engine = request.app[ENGINE]
    # unknown name: 400 invalid_request_error; a restart of it already running: 409 conflict_error
    snap = await asyncio.get_running_loop().run_in_executor(None, engine.restart, request.match_info["name"])
    return web.json_response(snap.to_dict())


async def health(request: web.Request) -> web.Response:
    """`ok` (every backend serves), `degraded` (some do, or a body parser is stuck past its
    deadline: `parsing.stuck`) or `unavailable` (503, none does, or every parser is stuck).
    Cheap: each backend's health flag, no snapshot. Which backend failed and why (error text
    that can name remote engines' URLs) is shown only to a caller with the API key, when one
    is set."""
    engine = request.app[ENGINE]
    up = list(engine.health().values())
    pool = request.app.get(PARSING)
    stuck = pool.stuck if pool is not None else 0
    if pool is not None and pool.exhausted:  # no body can be read: nothing is served
        up = [False]
    status = "ok" if up and all(up) and not stuck else "degraded" if any(up) else "unavailable"
    body: dict = {"status": status}
    if stuck:
        body["parsing"] = {"stuck": stuck, "threads": pool.workers + pool.spares}  # type: ignore[union-attr]
    if _authorized(request):
        body["backends"] = [{"name": s.name, "device": s.device, "healthy": s.healthy, "error": s.error,
                             "running": len(s.running), "waiting": len(s.waiting)} for s in engine.snapshot()]
    return web.json_response(body, status=200 if any(up) else 503)


class RenderedMetrics:
    """`/metrics`' text, rendered at most once per `METRICS_TTL_S`: 1,000 connections
    pipelining `GET /metrics` made the loop render it (2.2 ms) for each of them; now a burst
    of them is served the same bytes (and a reader that does not read them blocks only its own
    connection, which is then evictable: `ConnectionGuard.write_blocked`)."""

    def __init__(self) -> None:
        self.at, self.body = -math.inf, b""

    def get(self, metrics: EngineMetrics) -> bytes:
        now = time.monotonic()
        if now - self.at >= METRICS_TTL_S:
            self.at, self.body = now, metrics.render()
        return self.body


METRICS_TTL_S = 0.1
METRICS_PER_CONNECTION = 3  # /metrics a second on one connection
RENDERED = web.AppKey("rendered_metrics", RenderedMetrics)


async def metrics_text(request: web.Request) -> web.Response:
    """Prometheus text, from one rendering per `METRICS_TTL_S`; past `METRICS_PER_CONNECTION`
    in a second on one connection, 429 and the connection closed (a scraper asks every 10-60 s;
    1,000 connections pipelining 120 each and never reading took 6.6x quiet from other clients)."""
    conn = request.app[CONNECTIONS].connection_of(request)
    if conn is not None:
        now = time.monotonic()
        if now - conn.metrics_window >= 1.0:
            conn.metrics_window, conn.metrics_asked = now, 0
        conn.metrics_asked += 1
        if conn.metrics_asked > METRICS_PER_CONNECTION:
            raise TooManyRequests(f"more than {METRICS_PER_CONNECTION} /metrics a second on this connection",
                                  retry_after_s=1)
    return web.Response(body=request.app[RENDERED].get(request.app[METRICS]),
                        headers={"Content-Type": METRICS_CONTENT_TYPE})


async def openapi(request: web.Request) -> web.Response:
    return web.json_response(request.app[SETTINGS].openapi)


async def _own_parse_pool(app: web.Application):
    app[PARSING] = ParsePool()
    yield
    app[PARSING].close()


async def _own_metrics(app: web.Application):
    app[METRICS] = EngineMetrics(app[ENGINE])
    yield
    app[METRICS].close()


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
