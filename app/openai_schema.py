"""The OpenAI API's request bodies, checked and turned into our `Request`; its OpenAPI document.

Everything a client can send wrong is caught here and raised as an `InvalidRequest` (or a
subclass) naming the offending field, so the server answers 4xx, never 5xx, for bad input.
Fields we do not know are ignored (like other local servers); fields we know but cannot honour
(`n > 1`, `logprobs`, tools, ...) are refused with a message rather than silently dropped.

Extensions beyond OpenAI's fields (llama-server's names where they exist): `backend` (pin the
request to one backend), `ignore_eos`, `top_k`, `min_p`, `repeat_penalty`, `repeat_last_n`.
Unset sampling fields take the engine's defaults (`SamplingParams`), like llama-server.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from jinja2 import TemplateError

from engine.errors import EngineError, InvalidRequest
from engine.request import Request, SamplingParams

if TYPE_CHECKING:
    from engine.engine import Engine

INT32_MAX = 2**31 - 1
MAX_REPEAT_LAST_N = 1 << 16  # llama.cpp allocates a ring buffer this long per sequence
ROLES = ("system", "developer", "user", "assistant", "tool")
_DEFAULTS = SamplingParams()


class ModelNotFound(InvalidRequest):
    """The body names a model this server does not serve (OpenAI: 404 `model_not_found`)."""

    kind = "not_found_error"
    code = "model_not_found"

    def __init__(self, model: str, served: str):
        super().__init__(f"the model {model!r} does not exist here; this server serves {served!r} "
                         f"(see GET /v1/models)", param="model")


class AuthenticationFailed(EngineError):
    """No API key, or the wrong one (OpenAI: 401 `invalid_api_key`)."""

    kind = "authentication_error"
    code = "invalid_api_key"


@dataclass(frozen=True)
class ApiRequest:
    """One checked OpenAI request: the engine's request plus how to shape the reply."""

    kind: str  # "chat" | "completion"
    request: Request
    model: str
    stream: bool
    include_usage: bool
    prompt_param: str  # the body field a context-length error points at


@dataclass(frozen=True)
class ServedModel:
    """The one model a server serves: its id in `/v1/models` and the other names it answers to."""

    id: str
    aliases: frozenset[str] = frozenset()

    def check(self, body: dict) -> str:
        """The model a body asks for: absent or null means ours; any other name is a 404."""
        model = body.get("model")
        if model is None:
            return self.id
        if not isinstance(model, str):
            raise InvalidRequest(f"model must be a string, got {_type(model)}", param="model")
        if model != self.id and model not in self.aliases:
            raise ModelNotFound(model, self.id)
        return model


# ---------------------------------------------------------------------------- parsing


def parse_chat(body, engine: Engine, served: ServedModel) -> ApiRequest:
    """A `/v1/chat/completions` body → an `ApiRequest` (raises `InvalidRequest`)."""
    body = _object(body)
    model = served.check(body)
    _refuse_unsupported(body)
    messages = _messages(body.get("messages"))
    try:
        tokens = engine.chat_tokens(messages)
    except EngineError:
        raise
    except (TemplateError, ValueError, TypeError, KeyError, IndexError) as e:
        # The model's own Jinja template refused them (`raise_exception('roles must alternate')`).
        raise InvalidRequest(f"the model's chat template cannot render these messages: {e}",
                             param="messages") from None
    return _api_request("chat", body, tokens, model, "messages", engine.model.n_vocab)


def parse_completion(body, engine: Engine, served: ServedModel) -> ApiRequest:
    """A `/v1/completions` body → an `ApiRequest` (raises `InvalidRequest`)."""
    body = _object(body)
    model = served.check(body)
    _refuse_unsupported(body)
    tokens = _prompt_tokens(body.get("prompt"), engine)
    return _api_request("completion", body, tokens, model, "prompt", engine.model.n_vocab)


def _api_request(kind: str, body: dict, tokens: list[int], model: str, prompt_param: str,
                 n_vocab: int) -> ApiRequest:
    sampling = _sampling(body)
    if sampling.top_k > n_vocab:  # the same filter (none); llama.cpp's on-device top-k asserts k <= n_vocab
        sampling = dataclasses.replace(sampling, top_k=n_vocab)
    backend = _optional(body, "backend", str)
    stream = bool(_optional(body, "stream", bool))
    options = _optional(body, "stream_options", dict) or {}
    include_usage = options.get("include_usage")
    if include_usage is not None and not isinstance(include_usage, bool):
        raise InvalidRequest("stream_options.include_usage must be a boolean", param="stream_options")
    if not tokens:
        raise InvalidRequest(f"the {prompt_param} is empty", param=prompt_param)
    request = Request(tuple(tokens), sampling, backend=backend, source="api")
    return ApiRequest(kind, request, model, stream, bool(include_usage) and stream, prompt_param)


def _object(body) -> dict:
    if not isinstance(body, dict):
        raise InvalidRequest(f"the request body must be a JSON object, got {_type(body)}")
    return body


def _messages(value) -> list[dict]:
    if value is None:
        raise InvalidRequest("messages is required: a non-empty list of {role, content}", param="messages")
    if not isinstance(value, list):
        raise InvalidRequest(f"messages must be a list, got {_type(value)}", param="messages")
    if not value:
        raise InvalidRequest("messages must not be empty", param="messages")
    out = []
    for i, m in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise InvalidRequest(f"{where} must be an object, got {_type(m)}", param="messages")
        role = m.get("role")
        if role not in ROLES:
            raise InvalidRequest(f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}",
                                 param="messages")
        content = _content(m.get("content"), f"{where}.content", allow_null=role == "assistant")
        out.append({"role": "system" if role == "developer" else role, "content": content})
    return out


def _content(value, where: str, allow_null: bool) -> str:
    """A message's content: a string or a list of text parts (joined)."""
    if value is None:
        if allow_null:
            return ""
        raise InvalidRequest(f"{where} is required", param="messages")
    if isinstance(value, str):
        return _text(value, where, "messages")
    if isinstance(value, list):
        texts = []
        for j, part in enumerate(value):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise InvalidRequest(f"{where}[{j}] must be a text part {{\"type\": \"text\", \"text\": ...}}; "
                                     f"only text content is supported", param="messages")
            texts.append(_text(part["text"], f"{where}[{j}].text", "messages"))
        return "".join(texts)
    raise InvalidRequest(f"{where} must be a string or a list of text parts, got {_type(value)}",
                         param="messages")


def _prompt_tokens(value, engine: Engine) -> list[int]:
    """A completion prompt: a string, a list of token ids, or a one-element list of either."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]
    if value is None:
        raise InvalidRequest("prompt is required: a string or a list of token ids", param="prompt")
    if isinstance(value, str):
        if not value:
            raise InvalidRequest("the prompt is empty", param="prompt")
        return engine.model.tokenize(_text(value, "prompt", "prompt"))
    if isinstance(value, list):
        if value and all(isinstance(v, (str, list)) for v in value):
            raise InvalidRequest("batched prompts are not supported: send one prompt per request",
                                 param="prompt")
        n_vocab = engine.model.n_vocab
        for t in value:
            if not _is_int(t) or not 0 <= t < n_vocab:
                raise InvalidRequest(f"prompt token ids must be integers in [0, {n_vocab}), got {t!r}",
                                     param="prompt")
        return list(value)
    raise InvalidRequest(f"prompt must be a string or a list of token ids, got {_type(value)}", param="prompt")


def _text(value: str, where: str, param: str) -> str:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidRequest(f"{where} is not valid Unicode text (it holds a lone surrogate)", param=param) from None
    return value


# Fields we understand but cannot honour: refused, so a client never gets silently less.
_UNSUPPORTED = {
    "n": lambda v: not (_is_int(v) and v == 1),
    "best_of": lambda v: not (_is_int(v) and v == 1),
    "logprobs": lambda v: v not in (False, 0),
    "top_logprobs": lambda v: v != 0,
    "echo": lambda v: v is not False,
    "suffix": lambda v: v != "",
    "tools": lambda v: v != [],
    "functions": lambda v: v != [],
    "logit_bias": lambda v: v != {},
    "response_format": lambda v: not (isinstance(v, dict) and v.get("type") == "text"),
    "frequency_penalty": lambda v: v != 0,
    "presence_penalty": lambda v: v != 0,
}


def _refuse_unsupported(body: dict) -> None:
    for name, refused in _UNSUPPORTED.items():
        value = body.get(name)
        if value is not None and refused(value):
            hint = " (use repeat_penalty)" if name.endswith("_penalty") else ""
            raise InvalidRequest(f"{name}={value!r} is not supported by this server{hint}", param=name)


# ---------------------------------------------------------------------------- sampling

_NUMBER, _INT = "a number", "an integer"
_SAMPLING_TYPES = {
    "temperature": _NUMBER, "top_p": _NUMBER, "min_p": _NUMBER, "repeat_penalty": _NUMBER,
    "top_k": _INT, "repeat_last_n": _INT, "seed": _INT, "max_tokens": _INT,
}


def _sampling(body: dict) -> SamplingParams:
    values: dict = {}
    for name, kind in _SAMPLING_TYPES.items():
        field_name = name
        if name == "max_tokens" and body.get("max_completion_tokens") is not None:
            name = "max_completion_tokens"  # OpenAI's newer name wins when both are sent
        value = body.get(name)
        if value is None:
            continue
        if kind == _INT and not _is_int(value):
            raise InvalidRequest(f"{name} must be an integer, got {value!r}", param=name)
        if kind == _NUMBER and not (_is_number(value) and math.isfinite(value)):
            raise InvalidRequest(f"{name} must be a finite number, got {value!r}", param=name)
        values[field_name] = value
    _bounds(values)
    stop = body.get("stop")
    if stop is not None:
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise InvalidRequest("stop must be a string or a list of strings", param="stop")
        values["stop"] = tuple(_text(s, "stop", "stop") for s in stop)
    ignore_eos = _optional(body, "ignore_eos", bool)
    if ignore_eos is not None:
        values["ignore_eos"] = ignore_eos
    return dataclasses.replace(_DEFAULTS, **values).validate()


def _bounds(values: dict) -> None:
    """Limits the engine does not check but llama.cpp needs: C ints, buffer sizes, and float32
    values that keep the logits finite (an infinite temperature turns a -inf bias into NaN)."""
    limits = {
        "max_tokens": (1, INT32_MAX),
        "top_k": (0, INT32_MAX),
        "repeat_last_n": (0, MAX_REPEAT_LAST_N),
        "temperature": (0, 1e6),
        "repeat_penalty": (1e-3, 1e3),
    }
    for name, (lo, hi) in limits.items():
        v = values.get(name)
        if v is not None and not lo <= v <= hi:
            raise InvalidRequest(f"{name} must be in [{lo}, {hi}], got {v!r}", param=name)


# ---------------------------------------------------------------------------- helpers


def _optional(body: dict, name: str, kind: type):
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
        raise InvalidRequest(f"{name} must be {_KIND_NAMES[kind]}, got {_type(value)}", param=name)
    return value


_KIND_NAMES = {str: "a string", bool: "a boolean", dict: "an object", int: "an integer", list: "a list"}


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _type(v) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "an integer",
            float: "a number", type(None): "null"}.get(type(v), type(v).__name__)


# ---------------------------------------------------------------------------- OpenAPI


def openapi_document(served: ServedModel, n_vocab: int, backends: list[str], *, auth: bool = False) -> dict:
    """The server's OpenAPI 3.0 document (served at `GET /openapi.json`, fuzzed by schemathesis)."""
    def ref(name):
        return {"$ref": f"#/components/schemas/{name}"}

    def errors(*codes):
        return {str(c): {"description": _STATUS_TEXT[c], "content": {"application/json": {"schema": ref("Error")}}}
                for c in codes}

    def post(summary, request, reply):
        op = {
            "summary": summary,
            "requestBody": {"required": True, "content": {"application/json": {"schema": ref(request)}}},
            "responses": {
                "200": {"description": "the reply, or an SSE stream of chunks when `stream` is true",
                        "content": {"application/json": {"schema": ref(reply)},
                                    "text/event-stream": {"schema": {"type": "string"}}}},
                **errors(400, 401, 404, 413, 429, 503),
            },
        }
        if auth:
            op["security"] = [{"bearer": []}]
        return op

    def get(summary, content_type, schema, *extra_codes, params=None):
        op = {"summary": summary,
              "responses": {"200": {"description": "OK", "content": {content_type: {"schema": schema}}},
                            **errors(*extra_codes)}}
        if params:
            op["parameters"] = params
        return op

    int32 = {"type": "integer", "minimum": 0, "maximum": INT32_MAX, "nullable": True}
    sampling = {
        "model": {"type": "string", "enum": sorted({served.id, *served.aliases}), "nullable": True},
        "max_tokens": {**int32, "minimum": 1},
        "max_completion_tokens": {**int32, "minimum": 1},
        "temperature": {"type": "number", "minimum": 0, "maximum": 2, "nullable": True},
        "top_p": {"type": "number", "exclusiveMinimum": True, "minimum": 0, "maximum": 1, "nullable": True},
        "top_k": int32,
        "min_p": {"type": "number", "minimum": 0, "maximum": 1, "nullable": True},
        "repeat_penalty": {"type": "number", "minimum": 0.001, "maximum": 1000, "nullable": True},
        "repeat_last_n": {**int32, "maximum": MAX_REPEAT_LAST_N},
        "seed": {"type": "integer", "minimum": 0, "maximum": 2**32 - 1, "nullable": True},
        "stop": {"oneOf": [{"type": "string", "minLength": 1},
                           {"type": "array", "maxItems": 16, "items": {"type": "string", "minLength": 1}}],
                 "nullable": True},
        "stream": {"type": "boolean", "nullable": True},
        "stream_options": {"type": "object", "nullable": True,
                           "properties": {"include_usage": {"type": "boolean"}}},
        "n": {"type": "integer", "enum": [1], "nullable": True},
        "backend": {"type": "string", "enum": list(backends), "nullable": True,
                    "description": "extension: pin the request to this backend (see /v1/routing)"},
        "ignore_eos": {"type": "boolean", "nullable": True, "description": "extension: never stop at end-of-text"},
    }
    usage = {"type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
             "properties": {k: {"type": "integer"} for k in ("prompt_tokens", "completion_tokens", "total_tokens")}}
    finish = {"type": "string", "enum": ["stop", "length"]}
    schemas = {
        "ChatMessage": {
            "type": "object", "required": ["role", "content"],
            "properties": {
                "role": {"type": "string", "enum": list(ROLES)},
                "content": {"oneOf": [
                    {"type": "string"},
                    {"type": "array", "items": {"type": "object", "required": ["type", "text"],
                                                "properties": {"type": {"type": "string", "enum": ["text"]},
                                                               "text": {"type": "string"}}}},
                ]},
            },
        },
        "ChatCompletionRequest": {
            "type": "object", "required": ["messages"],
            "properties": {"messages": {"type": "array", "minItems": 1, "items": ref("ChatMessage")}, **sampling},
        },
        "CompletionRequest": {
            "type": "object", "required": ["prompt"],
            "properties": {"prompt": {"oneOf": [
                {"type": "string", "minLength": 1},
                {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0, "maximum": n_vocab - 1}},
            ]}, **sampling},
        },
        "ChatCompletion": {
            "type": "object", "required": ["id", "object", "created", "model", "choices", "usage"],
            "properties": {
                "id": {"type": "string"}, "object": {"type": "string", "enum": ["chat.completion"]},
                "created": {"type": "integer"}, "model": {"type": "string"}, "usage": usage,
                "choices": {"type": "array", "items": {
                    "type": "object", "required": ["index", "message", "finish_reason"],
                    "properties": {"index": {"type": "integer"}, "finish_reason": finish,
                                   "message": {"type": "object", "required": ["role", "content"],
                                               "properties": {"role": {"type": "string"},
                                                              "content": {"type": "string"}}}}}},
            },
        },
        "Completion": {
            "type": "object", "required": ["id", "object", "created", "model", "choices", "usage"],
            "properties": {
                "id": {"type": "string"}, "object": {"type": "string", "enum": ["text_completion"]},
                "created": {"type": "integer"}, "model": {"type": "string"}, "usage": usage,
                "choices": {"type": "array", "items": {
                    "type": "object", "required": ["index", "text", "finish_reason"],
                    "properties": {"index": {"type": "integer"}, "text": {"type": "string"},
                                   "finish_reason": finish}}},
            },
        },
        "ModelList": {
            "type": "object", "required": ["object", "data"],
            "properties": {"object": {"type": "string"}, "data": {"type": "array", "items": {
                "type": "object", "required": ["id", "object", "owned_by"],
                "properties": {"id": {"type": "string"}, "object": {"type": "string"},
                               "owned_by": {"type": "string"}}}}},
        },
        "Error": {
            "type": "object", "required": ["error"],
            "properties": {"error": {
                "type": "object", "required": ["message", "type", "param", "code"],
                "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                               "param": {"type": "string", "nullable": True},
                               "code": {"type": "string", "nullable": True}}}},
        },
    }
    models = get("the served model", "application/json", ref("ModelList"), 401)
    routing = get("backends' snapshots and recent routing decisions", "application/json", {"type": "object"},
                  400, 401, params=[{"name": "n", "in": "query", "required": False,
                                     "schema": {"type": "integer", "minimum": 0, "maximum": 1000}}])
    if auth:
        models["security"] = routing["security"] = [{"bearer": []}]
    doc = {
        "openapi": "3.0.3",
        "info": {"title": "Tandem OpenAI-compatible API", "version": "1"},
        "paths": {
            "/v1/chat/completions": {"post": post("chat completion", "ChatCompletionRequest", "ChatCompletion")},
            "/v1/completions": {"post": post("text completion", "CompletionRequest", "Completion")},
            "/v1/models": {"get": models},
            "/v1/routing": {"get": routing},
            "/health": {"get": get("liveness", "application/json", {"type": "object"}, 503)},
            "/metrics": {"get": get("Prometheus metrics", "text/plain", {"type": "string"})},
        },
        "components": {"schemas": schemas},
    }
    if auth:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    return doc


_STATUS_TEXT = {400: "invalid request", 401: "missing or wrong API key", 404: "unknown model",
                413: "body too large", 429: "queue full, retry later", 503: "no backend can serve"}
