"""The one place an error becomes an HTTP status and OpenAI's error object
(`{"error": {message, type, param, code}}`), after llama.cpp server's `format_error_response`
table; and a finished request's record read as the error its kind says.

Every route module (app/server.py, app/responses.py) answers errors through here."""

from __future__ import annotations

import math

from aiohttp import web

from engine.core.errors import BackendUnavailable, ContextLengthExceeded, EngineError, InvalidRequest, RequestFailed
from engine.core.request import FinishRecord, RequestStatus

from .openai_schema import MESSAGE_CHARS

# kind → (HTTP status, OpenAI `type`, OpenAI `code`); llama.cpp server's table, plus ours.
_ERRORS: dict[str, tuple[int, str, str | None]] = {
    "invalid_request_error": (400, "invalid_request_error", None),
    "exceed_context_size_error": (400, "invalid_request_error", "context_length_exceeded"),
    "not_found_error": (404, "invalid_request_error", "model_not_found"),
    "authentication_error": (401, "invalid_request_error", "invalid_api_key"),
    "queue_full_error": (429, "rate_limit_error", "queue_full"),
    "rate_limit_error": (429, "rate_limit_error", "rate_limit_exceeded"),
    "conflict_error": (409, "invalid_request_error", "restart_in_progress"),
    "forbidden_error": (403, "invalid_request_error", "forbidden"),
    "request_timeout_error": (408, "invalid_request_error", "request_timeout"),
    "payload_too_large_error": (413, "invalid_request_error", "payload_too_large"),
    "unsupported_media_type_error": (415, "invalid_request_error", "unsupported_media_type"),
    "unavailable_error": (503, "unavailable_error", None),
    "model_load_error": (500, "server_error", None),
    "server_error": (500, "server_error", None),
}
RETRY_AFTER_S = 1  # where nothing says how long the wait is
MAX_RETRY_AFTER_S = 60  # the openai SDK honours a Retry-After up to 60 s


def error_payload(exc: EngineError) -> tuple[int, dict]:
    """The one place an error becomes a status and OpenAI's error object."""
    status, type_, code = _ERRORS.get(exc.kind, _ERRORS["server_error"])
    message = exc.message if len(exc.message) <= MESSAGE_CHARS else exc.message[:MESSAGE_CHARS] + "…"
    error = {"message": message, "type": type_, "param": exc.param, "code": getattr(exc, "code", None) or code}
    if isinstance(exc, ContextLengthExceeded):
        error["n_prompt_tokens"] = exc.n_prompt_tokens
        error["n_ctx"] = exc.n_ctx
    return status, {"error": error}


def error_response(exc: EngineError) -> web.Response:
    status, payload = error_payload(exc)
    headers = {}
    if status in (429, 503):
        headers["Retry-After"] = str(retry_after(exc))
    elif status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    response = web.json_response(payload, status=status, headers=headers)
    if getattr(exc, "close_connection", False):
        response.force_close()
    return response


def retry_after(exc: EngineError) -> int:
    """Whole seconds to wait before retrying: the queue's expected wait where the engine knows
    it (`QueueFull.retry_after_s`), in [1, MAX_RETRY_AFTER_S]."""
    wait = getattr(exc, "retry_after_s", None)
    if wait is None:
        return RETRY_AFTER_S
    return min(max(math.ceil(wait), 1), MAX_RETRY_AFTER_S)


def succeeded(record: FinishRecord) -> FinishRecord:
    """`record`, or its failure raised."""
    if record.error:
        raise failure(record)
    return record


def failure(record: FinishRecord) -> EngineError:
    """A failed record as the error its kind says: a backend that shut down, restarted or
    failed with nowhere else to go is 503 (retry), a request the model cannot satisfy 400."""
    message = record.error or f"the request ended {record.status.name}"
    if record.status == RequestStatus.FINISHED_CANCELLED or record.error_kind == "unavailable_error":
        return BackendUnavailable(message)
    if record.error_kind == "invalid_request_error":
        return InvalidRequest(message)
    return RequestFailed(message)
