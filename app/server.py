"""`tandem serve`: the engine behind an OpenAI-compatible HTTP API, with Prometheus metrics.

Routes:
    POST /v1/chat/completions, POST /v1/completions   JSON or SSE (`stream: true`)
    GET  /v1/models        the one served model
    GET  /v1/routing       backends' snapshots and the router's recent decisions
    GET  /health           200 while a backend serves, else 503
    GET  /metrics          Prometheus text (`tandem:` names, see `engine.metrics`)
    GET  /openapi.json     the API's OpenAPI document

Handlers are thin: parse the body (`app.openai_schema`), submit to the engine, shape the reply.
Every error leaves through one function, `error_response()`, which maps an `EngineError`'s
`kind` to a status and OpenAI's `{"error": {message, type, param, code}}` (llama.cpp server's
`format_error_response` table). With an API key, `/v1/*` needs `Authorization: Bearer KEY`;
`/health`, `/metrics` and `/openapi.json` stay open (vLLM does the same).

Streaming pulls the first text before committing to SSE, so a request that fails early still
gets a JSON error. The app must run with `handler_cancellation=True` (`start_server()` and
`run_serve()` do): a client that disconnects cancels its handler, whose `finally` cancels the
engine request, and the backend frees its KV at its next step.

The engine is synchronous and thread-safe; `Engine.submit` is quick and is called on the
loop. Tokens come back through `RequestHandle.astream()` (marshalled with
`call_soon_threadsafe`). The GUI can run this same app on its qasync loop with `start_server()`.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import logging
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web

from engine.engine import Engine
from engine.errors import BackendUnavailable, ContextLengthExceeded, EngineError, InvalidRequest, RequestFailed
from engine.handle import RequestHandle
from engine.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from engine.metrics import EngineMetrics
from engine.request import FinishRecord, RequestStatus

from .openai_schema import (
    ApiRequest,
    AuthenticationFailed,
    ServedModel,
    openapi_document,
    parse_chat,
    parse_completion,
)

log = logging.getLogger(__name__)

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8080
MAX_BODY_BYTES = 4 << 20
MAX_ROUTING_DECISIONS = 1000
BACKLOG = 1024  # many clients connect at once (benchmarks open hundreds of streams)
SHUTDOWN_TIMEOUT_S = 5.0  # on shutdown, open streams get this long before they are cancelled


@dataclass(frozen=True)
class ServerSettings:
    api_key: str | None
    served: ServedModel
    openapi: dict
    started: int  # unix time, the models' `created`


ENGINE = web.AppKey("engine", Engine)
METRICS = web.AppKey("metrics", EngineMetrics)
SETTINGS = web.AppKey("settings", ServerSettings)


def create_app(engine: Engine, api_key: str | None = None, *, model_id: str | None = None,
               aliases: tuple[str, ...] = (), metrics: EngineMetrics | None = None) -> web.Application:
    """The aiohttp app serving `engine`. The caller owns the engine (and `metrics`, if given).

    `model_id` is the id `/v1/models` lists (default: the GGUF file's stem); the model also
    answers to `aliases`, its GGUF `general.name` and its file name.
    """
    path = Path(engine.model.path)
    served = ServedModel(model_id or path.stem,
                         frozenset({*aliases, engine.model.info.name, path.name, path.stem}) - {""})
    app = web.Application(middlewares=[error_middleware, auth_middleware], client_max_size=MAX_BODY_BYTES)
    app[ENGINE] = engine
    app[SETTINGS] = ServerSettings(api_key or None, served,
                                   openapi_document(served, engine.model.n_vocab, engine.backend_names,
                                                    auth=bool(api_key)),
                                   int(time.time()))
    if metrics is not None:
        app[METRICS] = metrics
    else:
        app.cleanup_ctx.append(_own_metrics)
    app.add_routes([
        web.post("/v1/chat/completions", chat_completions),
        web.post("/v1/completions", completions),
        web.get("/v1/models", models),
        web.get("/v1/routing", routing),
        web.post("/v1/backends/{name}/restart", restart_backend),
        web.get("/health", health),
        web.get("/metrics", metrics_text),
        web.get("/openapi.json", openapi),
    ])
    return app


async def start_server(app: web.Application, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT,
                       ) -> tuple[web.AppRunner, str]:
    """Serve `app` on the running loop (the GUI's, a test's); returns the runner and base URL.

    Port 0 picks a free port. Stop with `await runner.cleanup()`.
    """
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=SHUTDOWN_TIMEOUT_S)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port, backlog=BACKLOG).start()
    except BaseException:
        await runner.cleanup()
        raise
    bound_host, bound_port = runner.addresses[0][:2]
    return runner, f"http://{_url_host(bound_host)}:{bound_port}"


def run_serve(args) -> int:
    """`tandem serve`: load the engine, serve until interrupted, close the engine."""
    from .engine_setup import engine_from_args

    api_key = args.api_key or os.environ.get("TANDEM_API_KEY") or None
    if not api_key and not _is_loopback(args.host):
        log.warning("serving on %s without an API key: anyone who can reach it can use it", args.host)
    engine = engine_from_args(args)
    if engine.model.synthetic:
        print("(synthetic model: random weights, the text is noise)", file=sys.stderr)
    app = create_app(engine, api_key, aliases=(args.model,))
    backends = ", ".join(f"{s.name} ({s.device}, cap {s.cap})" for s in engine.snapshot())
    print(f"tandem: serving {app[SETTINGS].served.id} on http://{_url_host(args.host)}:{args.port}/v1 "
          f"with {backends}", file=sys.stderr)
    try:
        web.run_app(app, host=args.host, port=args.port, handler_cancellation=True,
                    shutdown_timeout=SHUTDOWN_TIMEOUT_S, backlog=BACKLOG, print=None,
                    access_log=log if args.verbose else None)
    except OSError as e:  # the address is taken or not ours
        print(f"tandem: cannot listen on {args.host}:{args.port}: {e.strerror or e}", file=sys.stderr)
        return 2
    finally:
        engine.close()  # after the server stopped: streams still open were cancelled first
    return 0


# ---------------------------------------------------------------------------- errors

# kind → (HTTP status, OpenAI `type`, OpenAI `code`); llama.cpp server's table, plus ours.
_ERRORS: dict[str, tuple[int, str, str | None]] = {
    "invalid_request_error": (400, "invalid_request_error", None),
    "exceed_context_size_error": (400, "invalid_request_error", "context_length_exceeded"),
    "not_found_error": (404, "invalid_request_error", "model_not_found"),
    "authentication_error": (401, "invalid_request_error", "invalid_api_key"),
    "queue_full_error": (429, "rate_limit_error", "queue_full"),
    "conflict_error": (409, "invalid_request_error", "restart_in_progress"),
    "unavailable_error": (503, "unavailable_error", None),
    "model_load_error": (500, "server_error", None),
    "server_error": (500, "server_error", None),
}
RETRY_AFTER_S = 1


def error_payload(exc: EngineError) -> tuple[int, dict]:
    """The one place an error becomes a status and OpenAI's error object."""
    status, type_, code = _ERRORS.get(exc.kind, _ERRORS["server_error"])
    error = {"message": exc.message, "type": type_, "param": exc.param, "code": getattr(exc, "code", None) or code}
    if isinstance(exc, ContextLengthExceeded):
        error["n_prompt_tokens"] = exc.n_prompt_tokens
        error["n_ctx"] = exc.n_ctx
    return status, {"error": error}


def error_response(exc: EngineError) -> web.Response:
    status, payload = error_payload(exc)
    headers = {}
    if status == 429:
        headers["Retry-After"] = str(RETRY_AFTER_S)
    elif status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    return web.json_response(payload, status=status, headers=headers)


def _http_error_response(exc: web.HTTPException) -> web.Response:
    """aiohttp's own errors (unknown route, wrong method, body too large) in OpenAI's shape."""
    type_ = "not_found_error" if exc.status == 404 else "invalid_request_error"
    message = exc.text if exc.text and exc.text != f"{exc.status}: {exc.reason}" else exc.reason
    payload = {"error": {"message": message, "type": type_, "param": None, "code": None}}
    headers = {k: v for k, v in exc.headers.items() if k in ("Allow",)}
    return web.json_response(payload, status=exc.status, headers=headers)


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
        response = _http_error_response(e)
    except ConnectionResetError:  # the client went away; nothing to answer
        raise
    except Exception:
        log.exception("%s %s failed", request.method, request.path)
        response = error_response(RequestFailed("internal server error (see the server log)"))
    if not response.prepared:
        response.headers["openai-processing-ms"] = str(int((time.perf_counter() - t0) * 1000))
    return response


@web.middleware
async def auth_middleware(request: web.Request, handler) -> web.StreamResponse:
    key = request.app[SETTINGS].api_key
    if key and request.path.startswith("/v1/"):
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
            raise AuthenticationFailed("missing or wrong API key: send `Authorization: Bearer KEY`")
    return await handler(request)


# ---------------------------------------------------------------------------- completions


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, await _parse(request, parse_chat))


async def completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, await _parse(request, parse_completion))


async def _parse(request: web.Request, parse) -> ApiRequest:
    """Check the body and tokenize its prompt on a worker thread: a long prompt (templating,
    tokenizing megabytes) must not stall the loop that streams everyone else's tokens."""
    body = await _json_body(request)
    return await asyncio.to_thread(parse, body, request.app[ENGINE], request.app[SETTINGS].served)


async def _serve(request: web.Request, parsed: ApiRequest) -> web.StreamResponse:
    engine = request.app[ENGINE]
    try:
        handle = engine.submit(parsed.request, loop=asyncio.get_running_loop())
    except ContextLengthExceeded as e:
        e.param = parsed.prompt_param
        raise
    reply = Reply(parsed, handle)
    try:
        if parsed.stream:
            return await _stream(request, handle, reply)
        async for _ in handle.astream():
            pass
        record = _succeeded(handle.result(0))
        return web.json_response(reply.whole(record), headers=reply.headers)
    finally:
        handle.cancel()  # a no-op once finished; on disconnect, frees the request's KV


async def _stream(request: web.Request, handle: RequestHandle, reply: Reply) -> web.StreamResponse:
    deltas = handle.astream()
    first = await anext(deltas, None)
    if first is None:
        _succeeded(handle.result(0))  # failed before any text: still time for a JSON error
    response = web.StreamResponse(headers={
        "Content-Type": "text/event-stream; charset=utf-8",
        "Cache-Control": "no-cache",
        "X-Accel-Buffering": "no",
        **reply.headers,
    })
    await response.prepare(request)
    try:
        for chunk in reply.opening():
            await _send(response, chunk)
        if first:
            await _send(response, reply.chunk(first))
        async for delta in deltas:
            await _send(response, reply.chunk(delta))
        record = handle.result(0)
        if record.error:
            await _send(response, error_payload(_failure(record))[1])
        else:
            await _send(response, reply.closing(record))
            if reply.include_usage:
                await _send(response, reply.usage_chunk(record))
        await response.write(b"data: [DONE]\n\n")
    except ConnectionResetError:
        pass  # the client left; the caller's `finally` cancels the request
    return response


async def _send(response: web.StreamResponse, obj: dict) -> None:
    await response.write(b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n")


def _succeeded(record: FinishRecord) -> FinishRecord:
    if record.error:
        raise _failure(record)
    return record


def _failure(record: FinishRecord) -> EngineError:
    if record.status == RequestStatus.FINISHED_CANCELLED:  # the backend shut down under it
        return BackendUnavailable(record.error)
    return RequestFailed(record.error)


class Reply:
    """Shapes one request's output as OpenAI chat or text-completion objects."""

    def __init__(self, parsed: ApiRequest, handle: RequestHandle):
        self.chat = parsed.kind == "chat"
        self.id = f"{'chatcmpl' if self.chat else 'cmpl'}-{handle.id}"
        self.object = "chat.completion" if self.chat else "text_completion"
        self.created = int(time.time())
        self.model = parsed.model
        self.include_usage = parsed.include_usage
        self.headers = {"X-Request-Id": handle.id, "X-Tandem-Backend": handle.backend or ""}

    def whole(self, record: FinishRecord) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": record.text},
                      "logprobs": None, "finish_reason": record.finish_reason}
        else:
            choice = {"index": 0, "text": record.text, "logprobs": None, "finish_reason": record.finish_reason}
        return {**self._head(self.object), "choices": [choice], "usage": _usage(record)}

    def opening(self) -> list[dict]:
        """Chunks before any text: chat announces the assistant's role."""
        return [self._chunk({"role": "assistant", "content": ""}, None)] if self.chat else []

    def chunk(self, text: str) -> dict:
        return self._chunk({"content": text} if self.chat else text, None)

    def closing(self, record: FinishRecord) -> dict:
        return self._chunk({} if self.chat else "", record.finish_reason)

    def usage_chunk(self, record: FinishRecord) -> dict:
        return {**self._head(self._chunk_object), "choices": [], "usage": _usage(record)}

    @property
    def _chunk_object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def _chunk(self, delta, finish_reason: str | None) -> dict:
        key = "delta" if self.chat else "text"
        out = {**self._head(self._chunk_object),
               "choices": [{"index": 0, key: delta, "logprobs": None, "finish_reason": finish_reason}]}
        if self.include_usage:
            out["usage"] = None
        return out


def _usage(record: FinishRecord) -> dict:
    return {
        "prompt_tokens": record.prompt_tokens,
        "completion_tokens": record.output_tokens,
        "total_tokens": record.prompt_tokens + record.output_tokens,
        "prompt_tokens_details": {"cached_tokens": max(record.cached_tokens, 0)},
    }


async def _json_body(request: web.Request):
    raw = await request.read()
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise InvalidRequest(f"the request body is not valid JSON: {e}") from None


# ---------------------------------------------------------------------------- state


async def models(request: web.Request) -> web.Response:
    engine, settings = request.app[ENGINE], request.app[SETTINGS]
    info = engine.model.info
    return web.json_response({"object": "list", "data": [{
        "id": settings.served.id,
        "object": "model",
        "created": settings.started,
        "owned_by": "tandem",
        "meta": {"name": info.name, "n_params": info.n_params, "n_ctx_train": info.n_ctx_train,
                 "n_vocab": info.n_vocab, "synthetic": info.synthetic,
                 "aliases": sorted(settings.served.aliases)},
    }]})


async def routing(request: web.Request) -> web.Response:
    n = request.query.get("n", "50")
    try:
        n = int(n)
    except ValueError:
        n = -1
    if not 0 <= n <= MAX_ROUTING_DECISIONS:
        raise InvalidRequest(f"n must be an integer in [0, {MAX_ROUTING_DECISIONS}]", param="n")
    engine = request.app[ENGINE]
    return web.json_response({
        "policy": engine.router.policy,
        "budget": engine.router.budget,
        "backends": [s.to_dict() for s in engine.snapshot()],
        "decisions": [d.to_dict() for d in engine.router.recent(n)],
    })


async def restart_backend(request: web.Request) -> web.Response:
    """Give a backend a fresh context (after a failure); answers with its new snapshot."""
    engine = request.app[ENGINE]
    # unknown name: 400 invalid_request_error; a restart of it already running: 409 conflict_error
    snap = await asyncio.get_running_loop().run_in_executor(None, engine.restart, request.match_info["name"])
    return web.json_response(snap.to_dict())


async def health(request: web.Request) -> web.Response:
    snaps = request.app[ENGINE].snapshot()
    ok = any(s.healthy for s in snaps)
    return web.json_response({
        "status": "ok" if ok else "unavailable",
        "backends": [{"name": s.name, "device": s.device, "healthy": s.healthy, "error": s.error,
                      "running": len(s.running), "waiting": len(s.waiting)} for s in snaps],
    }, status=200 if ok else 503)


async def metrics_text(request: web.Request) -> web.Response:
    return web.Response(body=request.app[METRICS].render(), headers={"Content-Type": METRICS_CONTENT_TYPE})


async def openapi(request: web.Request) -> web.Response:
    return web.json_response(request.app[SETTINGS].openapi)


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
