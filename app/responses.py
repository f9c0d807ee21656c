"""OpenAI's Responses API (`POST /v1/responses`, `GET` / `DELETE /v1/responses/{id}`) on top of
the chat path: a body becomes a chat request (its `input` items become chat messages, the
`instructions` a system message, `text.format` a `response_format`, function `tools` chat
tools), which `parse_chat` checks, tokenizes and constrains as it does any chat; the reply is
shaped as a `response` object, or streamed as OpenAI's typed events (`response.created`,
`response.output_text.delta`, `response.function_call_arguments.delta`, `response.completed`,
...). The shapes follow the `openai` SDK's types (`openai.types.responses`), as vLLM's do.

`previous_response_id` continues a stored conversation: each stored response keeps the chat
messages it was made from and its own output, so the next prompt starts with the same tokens
and hits the prefix cache like any chat (instructions are not carried over, as OpenAI's are
not). The store is in memory and bounded (`ResponseStore`: the oldest go first); `store:
false` keeps a response out of it.

Refused with a 400 naming the field: built-in tools (web search, file search, ...),
`background` mode, items other than messages, function calls and their outputs (reasoning
items are skipped), images, files and audio ("this model does not take images"). The reply is
read as it is decoded (engine/prompts/reply.py): text, a function call's arguments and a
thinking model's reasoning each stream as their own output item. `include:
["message.output_text.logprobs"]` (with `top_logprobs`) gives each output text token's
logprob; `tool_choice: {"type": "allowed_tools", ...}` narrows the tools the reply may call;
a reply cut by `max_output_tokens` leaves its last item `incomplete`. Each stored response keeps
its own input items (`GET /v1/responses/{id}/input_items`, OpenAI's cursor page).

Thread contract: handlers run on the server's loop; `build` runs on a worker thread (it
tokenizes); the store is touched only on the loop.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import sys
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from aiohttp import web
from pydantic import Field

from engine.core.errors import ContextLengthExceeded, EngineError, InvalidRequest
from engine.core.handle import RequestHandle
from engine.core.request import MAX_TOKENS, FinishRecord
from engine.prompts.chat import MAX_MESSAGES
from engine.prompts.reply import ReasoningDelta, ReplyParts, ReplyReader, read_whole
from engine.prompts.tool_calls import ArgumentsDelta, CallStart, TextDelta, ToolCall

from .errors import error_payload, failure, succeeded
from .http_guard import parse_body
from .openai_schema import (
    MAX_CHAT_TOP_LOGPROBS,
    MAX_TOOLS,
    NOT_TAKEN,
    ApiRequest,
    Finite,
    FunctionName,
    ServedModel,
    _Strict,
    parse_chat,
    quote,
    validate,
)
from .settings import ENGINE, SETTINGS

MAX_STORED = 1000  # responses kept for `previous_response_id` / GET, the oldest dropped first
MAX_STORED_CHARS = 64 << 20  # and at most this many bytes of Python memory (`footprint`)
# OpenAI's bounds on `metadata` (16 pairs, keys of 64 characters, values of 512) and a bound on
# `user`: 140,000 metadata keys were stored at 11 MB of memory per 1.9 MB of JSON.
MAX_METADATA = 16
MAX_METADATA_KEY = 64
MAX_METADATA_VALUE = 512
MAX_USER = 256
MetadataKey = Annotated[str, Field(max_length=MAX_METADATA_KEY)]
MetadataValue = Annotated[str, Field(max_length=MAX_METADATA_VALUE)]
# Sampling extensions a Responses body may carry, as in a chat body (llama-server's names).
EXTENSIONS = ("seed", "top_k", "min_p", "repeat_penalty", "repeat_last_n", "backend", "ignore_eos",
              "presence_penalty", "frequency_penalty", "logit_bias", "stop")
BUILT_IN_TOOLS = ("web_search", "web_search_preview", "file_search", "code_interpreter", "computer_use_preview",
                  "image_generation", "mcp", "local_shell", "shell", "apply_patch", "custom")


class ResponseNotFound(InvalidRequest):
    """A response id this server does not hold (never stored, `store: false`, or dropped)."""

    kind = "not_found_error"
    code = "response_not_found"


# ---- the request ----


class TextFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: FunctionName | None = None
    description: str | None = None
    schema_: dict | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(_Strict):
    format: TextFormat | None = None


class FunctionTool(_Strict):
    type: Literal["function"]
    name: FunctionName
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class FunctionChoice(_Strict):
    type: Literal["function"]
    name: FunctionName


class ResponsesRequest(_Strict):
    model: str | None = None
    input: Annotated[str, Field(min_length=1)] | Annotated[list[dict], Field(min_length=1, max_length=MAX_MESSAGES)] | None = None
    instructions: str | None = None
    max_output_tokens: Annotated[int, Field(ge=1, le=MAX_TOKENS)] | None = None
    temperature: Annotated[Finite, Field(ge=0, le=2)] | None = None
    top_p: Annotated[Finite, Field(gt=0, le=1)] | None = None
    tools: Annotated[list[dict], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    previous_response_id: str | None = None
    store: bool | None = None
    stream: bool | None = None
    background: bool | None = None
    metadata: Annotated[dict[MetadataKey, MetadataValue], Field(max_length=MAX_METADATA)] | None = None
    user: Annotated[str, Field(max_length=MAX_USER)] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    conversation: Any = None
    prompt: Any = None
    include: Annotated[list[str], Field(max_length=16)] | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_CHAT_TOP_LOGPROBS)] | None = None


LOGPROBS = "message.output_text.logprobs"  # the one `include` value that changes the reply here


# ---- the store ----


@dataclass
class Stored:
    response: dict  # the response object, as returned
    history: list[dict]  # the chat messages its prompt held (no instructions) and its output
    inputs: list[dict] = field(default_factory=list)  # its request's input items, with ids
    chars: int = 0  # its footprint in bytes (`footprint`)


@dataclass
class ResponseStore:
    """Responses by id, bounded in count and size; the oldest go first."""

    max_items: int = MAX_STORED
    max_chars: int = MAX_STORED_CHARS
    _items: OrderedDict = field(default_factory=OrderedDict)
    _chars: int = 0

    def put(self, stored: Stored) -> None:
        stored.chars = footprint(stored.history) + footprint(stored.response) + footprint(stored.inputs)
        self._items[stored.response["id"]] = stored
        self._chars += stored.chars
        while self._items and (len(self._items) > self.max_items or self._chars > self.max_chars):
            _, old = self._items.popitem(last=False)
            self._chars -= old.chars

    def get(self, response_id: str, param: str | None = None) -> Stored:
        stored = self._items.get(response_id)
        if stored is None:
            what = "previous response" if param == "previous_response_id" else "response"
            raise ResponseNotFound(f"no {what} with id {quote(response_id)} is stored here (responses made with "
                                   f"store: false are not kept, and at most {self.max_items} are)", param=param)
        return stored

    def delete(self, response_id: str) -> None:
        stored = self.get(response_id)
        del self._items[response_id]
        self._chars -= stored.chars

    def __len__(self) -> int:
        return len(self._items)


def footprint(value: Any) -> int:
    """Bytes of Python memory `value` holds (JSON-shaped: dicts, lists, strings, numbers), each
    object's `sys.getsizeof`: JSON's length under-counted a response's ~5.8x. One pass, on an
    explicit stack (no recursion limit)."""
    total, todo = 0, [value]
    while todo:
        v = todo.pop()
        total += sys.getsizeof(v)
        if isinstance(v, dict):
            todo.extend(v.keys())
            todo.extend(v.values())
        elif isinstance(v, (list, tuple)):
            todo.extend(v)
    return total


RESPONSES = web.AppKey("responses", ResponseStore)


# ---- body → chat request ----


@dataclass(frozen=True)
class ResponsesCall:
    body: ResponsesRequest
    parsed: ApiRequest
    history: list[dict]  # the chat messages of the prompt, without the instructions
    tools: list[dict]  # the response's `tools`, as echoed
    tool_choice: Any
    text: dict
    inputs: list[dict]  # this request's input as OpenAI's input items (with ids)


def build(raw: bytes, engine, served: ServedModel, store: ResponseStore) -> ResponsesCall:
    """A `/v1/responses` body → the chat request it means (raises `InvalidRequest`)."""
    body = validate(ResponsesRequest, raw)
    if body.background:
        raise InvalidRequest("background mode is not supported by this server: send background: false and wait "
                             "for the reply (or stream it)", param="background")
    if body.conversation is not None:
        raise InvalidRequest("conversation objects are not supported by this server; use previous_response_id",
                             param="conversation")
    if body.prompt is not None:
        raise InvalidRequest("prompt templates are not supported by this server; send input", param="prompt")
    if body.input is None:
        raise InvalidRequest("input is required", param="input")
    history: list[dict] = []
    if body.previous_response_id is not None:
        history = list(store.get(body.previous_response_id, param="previous_response_id").history)
    history += _messages(body.input)
    tools = [_function_tool(i, t) for i, t in enumerate(body.tools or ())]
    allowed, choice = _tool_choice(body.tool_choice, [t.name for t in tools])
    messages = ([{"role": "system", "content": body.instructions}] if body.instructions else []) + history
    chat: dict = {"model": body.model, "messages": messages, "stream": False}
    for name in ("temperature", "top_p", "parallel_tool_calls"):
        if getattr(body, name) is not None:
            chat[name] = getattr(body, name)
    if body.max_output_tokens is not None:
        chat["max_tokens"] = body.max_output_tokens
    offered = [t for t in tools if allowed is None or t.name in allowed]
    if offered:
        chat["tools"] = [{"type": "function", "function": t.model_dump(exclude_none=True, exclude={"type"})}
                         for t in offered]
    if choice is not None:
        chat["tool_choice"] = choice
    if LOGPROBS in (body.include or ()):
        chat.update(logprobs=True, top_logprobs=body.top_logprobs or 0)
    fmt = body.text.format if body.text is not None else None
    chat.update(_response_format(fmt))
    extras = json.loads(raw)  # valid JSON: `validate` read it
    chat.update({k: extras[k] for k in EXTENSIONS if k in extras})
    try:
        parsed = parse_chat(json.dumps(chat).encode(), engine, served)
    except EngineError as e:
        e.param = _param(e.param)
        raise
    text = {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt is not None else {"type": "text"}}
    return ResponsesCall(body, parsed, history, [t.model_dump(exclude_none=False) for t in tools],
                         body.tool_choice if body.tool_choice is not None else "auto", text, input_items(body.input))


def _response_format(fmt: TextFormat | None) -> dict:
    """`text.format` as the chat body's `response_format` (empty for plain text)."""
    if fmt is not None and fmt.type == "json_schema":
        if fmt.name is None:
            raise InvalidRequest("text.format.name is required when type is 'json_schema'", param="text.format")
        return {"response_format": {"type": "json_schema", "json_schema": {
            "name": fmt.name, "schema": fmt.schema_ if fmt.schema_ is not None else {"type": "object"},
            **({"strict": fmt.strict} if fmt.strict is not None else {})}}}
    if fmt is not None and fmt.type == "json_object":
        return {"response_format": {"type": "json_object"}}
    return {}


def _param(param: str | None) -> str | None:
    """A chat field named in an error → the Responses field it came from."""
    if param is None:
        return None
    if param.startswith("tools[") and param.endswith("].function.parameters"):
        return param.replace(".function.parameters", ".parameters")
    return {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text.format"}.get(param, param)


def _function_tool(i: int, tool: dict) -> FunctionTool:
    kind = tool.get("type")
    if kind != "function":
        builtin = "built-in tool" if kind in BUILT_IN_TOOLS or isinstance(kind, str) else "tool"
        raise InvalidRequest(f"tools[{i}]: the {builtin} {quote(kind)} is not supported by this server; only "
                             f"tools of type 'function' are", param=f"tools[{i}].type")
    try:
        return FunctionTool.model_validate(tool)
    except Exception as e:  # pydantic's ValidationError; its first error says what
        first = e.errors(include_url=False)[0] if hasattr(e, "errors") else {"msg": str(e), "loc": ()}
        where = ".".join(str(p) for p in first["loc"])
        raise InvalidRequest(f"tools[{i}]{'.' + where if where else ''}: {first['msg']}",
                             param=f"tools[{i}]") from None


def _tool_choice(choice, names: list[str]) -> tuple[set[str] | None, str | dict | None]:
    """(the functions the reply may call, None: all; the chat `tool_choice`)."""
    if choice is None or isinstance(choice, str):
        return None, choice
    if choice.get("type") == "function":
        try:
            named = FunctionChoice.model_validate(choice)
        except Exception:
            raise InvalidRequest("tool_choice: a function choice is {\"type\": \"function\", \"name\": NAME}",
                                 param="tool_choice") from None
        return None, {"type": "function", "function": {"name": named.name}}
    if choice.get("type") == "allowed_tools":
        return _allowed_tools(choice, names)
    raise InvalidRequest(f"tool_choice {quote(choice)} is not supported by this server: send none, auto, required, "
                         f"{{\"type\": \"function\", \"name\": NAME}} or {{\"type\": \"allowed_tools\", ...}}",
                         param="tool_choice")


def _allowed_tools(choice: dict, names: list[str]) -> tuple[set[str], str]:
    """`{"type": "allowed_tools", "mode": "auto" | "required", "tools": [{"type": "function", "name": N}]}`."""
    mode, listed = choice.get("mode", "auto"), choice.get("tools")
    if mode not in ("auto", "required") or not isinstance(listed, list) or not listed:
        raise InvalidRequest("tool_choice: allowed_tools takes a mode (auto or required) and a non-empty list of "
                             "tools ({\"type\": \"function\", \"name\": NAME})", param="tool_choice")
    allowed = set()
    for t in listed:
        name = t.get("name") if isinstance(t, dict) and t.get("type") == "function" else None
        if name not in names:
            raise InvalidRequest(f"tool_choice: allowed_tools names {quote(t)}, which is not a function among the "
                                 f"tools ({', '.join(names) or 'none'})", param="tool_choice")
        allowed.add(name)
    return allowed, mode


_TEXT_PARTS = ("input_text", "output_text", "text", "refusal")


def _messages(input_: str | list[dict]) -> list[dict]:
    """`input` → chat messages: a string is one user message; items are messages (with text
    parts), `function_call`s (an assistant's tool calls) and `function_call_output`s."""
    if isinstance(input_, str):
        return [{"role": "user", "content": input_}]
    out: list[dict] = []
    for i, item in enumerate(input_):
        kind = item.get("type", "message" if "role" in item else None)
        where = f"input[{i}]"
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise InvalidRequest(f"{where}.role must be user, system, developer or assistant, got {quote(role)}",
                                     param="input")
            out.append({"role": role, "content": _text(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            call = {"id": _string(item, "call_id", where), "type": "function",
                    "function": {"name": _string(item, "name", where), "arguments": _string(item, "arguments", where)}}
            if out and out[-1]["role"] == "assistant":  # one assistant turn: its text, then its calls
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            out.append({"role": "tool", "tool_call_id": _string(item, "call_id", where),
                        "content": output if isinstance(output, str) else _text(output, f"{where}.output")})
        elif kind == "reasoning":
            continue  # a reasoning model's summary: nothing this model reads
        else:
            raise InvalidRequest(f"{where}: items of type {quote(kind)} are not supported by this server (messages, "
                                 f"function_call and function_call_output are)", param="input")
    if not out:
        raise InvalidRequest("input holds no message", param="input")
    return out


def _string(item: dict, key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise InvalidRequest(f"{where}.{key} must be a string, got {quote(value)}", param="input")
    return value


def _text(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequest(f"{where} must be a string or a list of text parts, got {quote(content)}", param="input")
    texts = []
    for k, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in NOT_TAKEN:
            raise InvalidRequest(f"{where}[{k}]: this model does not take {NOT_TAKEN[kind]} (its {kind!r} part); "
                                 f"send the content as text", param="input")
        if kind not in _TEXT_PARTS:
            raise InvalidRequest(f"{where}[{k}]: parts of type {quote(kind)} are not supported by this server (only "
                                 f"text: input_text, output_text)", param="input")
        texts.append(_string(part, "refusal" if kind == "refusal" else "text", f"{where}[{k}]"))
    return "".join(texts)


def input_items(input_: str | list[dict]) -> list[dict]:
    """A request's `input` as OpenAI's input items, each with an id (`input_items.list`)."""
    items = [{"role": "user", "content": input_}] if isinstance(input_, str) else input_
    out = []
    for item in items:
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            content = item.get("content")
            part = "output_text" if item.get("role") == "assistant" else "input_text"
            parts = [{"type": part, "text": content}] if isinstance(content, str) else [dict(p) for p in content or ()]
            out.append({"id": item.get("id") or _new_id("msg"), "type": "message", "role": item.get("role"),
                        "content": parts, "status": "completed"})
        elif kind in ("function_call", "function_call_output"):
            prefix = "fc" if kind == "function_call" else "fco"
            out.append({**item, "type": kind, "id": item.get("id") or _new_id(prefix), "status": "completed"})
    return out


def _new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(24)}"


# ---- the reply ----


class ResponseShape:
    """One response's object and events (OpenAI's `Response` and `ResponseStreamEvent`s)."""

    def __init__(self, call: ResponsesCall, handle: RequestHandle, fingerprint: str):
        self.call = call
        self.handle = handle
        self.id = _new_id("resp")
        self.msg_id = _new_id("msg")
        self.rs_id = _new_id("rs")
        self.created = int(time.time())
        self.seq = 0
        self.fingerprint = fingerprint
        self.headers = {"X-Request-Id": handle.id, "X-Tandem-Backend": handle.backend or ""}
        parsed = call.parsed
        self.logprobs = parsed.top_logprobs is not None
        self.reader = ReplyReader(parsed.tools, parsed.reasoning, parsed.thinking)

    def obj(self, status: str, output: list[dict], usage: dict | None = None,
            incomplete: str | None = None, error: dict | None = None) -> dict:
        body = self.call.body
        sampling = self.call.parsed.request.sampling
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "background": False, "error": error,
            "incomplete_details": {"reason": incomplete} if incomplete else None,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "model": self.call.parsed.model, "output": output,
            "parallel_tool_calls": body.parallel_tool_calls if body.parallel_tool_calls is not None else True,
            "previous_response_id": body.previous_response_id, "reasoning": {"effort": None, "summary": None},
            "store": body.store is not False,
            "temperature": body.temperature if body.temperature is not None else sampling.temperature,
            "text": self.call.text, "tool_choice": self.call.tool_choice, "tools": self.call.tools,
            "top_p": body.top_p if body.top_p is not None else sampling.top_p,
            "top_logprobs": body.top_logprobs if body.top_logprobs is not None else 0,
            "truncation": body.truncation or "disabled", "usage": usage, "user": body.user,
            "metadata": body.metadata or {}, "service_tier": "default",
            "system_fingerprint": self.fingerprint,
        }

    def event(self, kind: str, **fields) -> dict:
        out = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return out

    # the output, once the reply is whole

    def read(self, record: FinishRecord) -> ReplyParts:
        """The finished reply's parts (a reply cut short holds no call)."""
        parsed = self.call.parsed
        return read_whole(record.text, parsed.tools, parsed.reasoning, parsed.thinking)

    def message_item(self, text: str, status: str = "completed", logprobs: list | None = None) -> dict:
        return {"id": self.msg_id, "type": "message", "status": status, "role": "assistant",
                "content": [self.text_part(text, logprobs)] if status != "in_progress" else []}

    def reasoning_item(self, text: str, status: str = "completed") -> dict:
        return {"id": self.rs_id, "type": "reasoning", "status": status, "summary": [],
                "content": [{"type": "reasoning_text", "text": text}] if status != "in_progress" else []}

    @staticmethod
    def text_part(text: str, logprobs: list | None = None) -> dict:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}

    @staticmethod
    def call_item(call: ToolCall, status: str = "completed", arguments: str | None = None) -> dict:
        return {"id": "fc_" + call.id.removeprefix("call_"), "type": "function_call", "status": status,
                "call_id": call.id, "name": call.name,
                "arguments": call.arguments if arguments is None else arguments}

    def output(self, record: FinishRecord) -> list[dict]:
        parts = self.read(record)
        status = "incomplete" if record.finish_reason == "length" else "completed"
        out = [self.reasoning_item(parts.reasoning)] if parts.reasoning else []
        if parts.calls:
            return out + [self.call_item(c) for c in parts.calls]
        entries = [token_logprob(e) for e in record.logprobs or ()] if self.logprobs else None
        return out + [self.message_item(parts.content or "", status, entries)]

    def finished(self, record: FinishRecord, output: list[dict] | None = None) -> dict:
        incomplete = "max_output_tokens" if record.finish_reason == "length" else None
        return self.obj("incomplete" if incomplete else "completed",
                        self.output(record) if output is None else output, usage(record), incomplete)

    def history(self, record: FinishRecord) -> list[dict]:
        """The conversation to continue from: the prompt's messages and this reply."""
        parts = self.read(record)
        if parts.calls:
            reply = {"role": "assistant", "content": None, "tool_calls": [c.to_dict() for c in parts.calls]}
        else:
            reply = {"role": "assistant", "content": parts.content or ""}
        return [*self.call.history, reply]

    def stored(self, response: dict, record: FinishRecord) -> Stored:
        return Stored(response, self.history(record), self.call.inputs)


def token_logprob(e) -> dict:
    """One output token's logprob in the Responses API's shape."""
    def text(piece: bytes) -> str:
        return piece.decode("utf-8", errors="replace")

    return {"token": text(e.piece), "logprob": e.logprob, "bytes": list(e.piece),
            "top_logprobs": [{"token": text(p), "logprob": lp, "bytes": list(p)} for _, p, lp in e.top]}


def usage(record: FinishRecord) -> dict:
    return {"input_tokens": record.prompt_tokens,
            "input_tokens_details": {"cached_tokens": max(record.cached_tokens, 0)},
            "output_tokens": record.output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": record.prompt_tokens + record.output_tokens}


# ---- handlers ----


async def create(request: web.Request) -> web.StreamResponse:
    """`POST /v1/responses`: a response, whole or as a stream of events."""
    app = request.app
    store = app[RESPONSES]
    call = await parse_body(request, build, app[ENGINE], app[SETTINGS].served, store)
    try:
        handle = app[ENGINE].submit(call.parsed.request, loop=asyncio.get_running_loop())
    except ContextLengthExceeded as e:
        e.param = "input"
        raise
    shape = ResponseShape(call, handle, app[SETTINGS].fingerprint)
    try:
        if call.body.stream:
            return await _stream(request, shape, store)
        async for _ in handle.astream():
            pass
        record = succeeded(handle.result(0))
        response = shape.finished(record)
        if call.body.store is not False:
            store.put(shape.stored(response, record))
        return web.json_response(response, headers=shape.headers)
    finally:
        handle.cancel()  # a no-op once finished; on disconnect, frees the request's KV


async def retrieve(request: web.Request) -> web.Response:
    """`GET /v1/responses/{id}`: a stored response."""
    return web.json_response(request.app[RESPONSES].get(request.match_info["id"]).response)


async def delete(request: web.Request) -> web.Response:
    """`DELETE /v1/responses/{id}`: forget a stored response."""
    response_id = request.match_info["id"]
    request.app[RESPONSES].delete(response_id)
    return web.json_response({"id": response_id, "object": "response", "deleted": True})


async def list_input_items(request: web.Request) -> web.Response:
    """`GET /v1/responses/{id}/input_items`: the stored response's input items, OpenAI's cursor
    page (`limit` 1-100, default 20; `order` desc, the default, or asc; `after` an item id)."""
    items = list(request.app[RESPONSES].get(request.match_info["id"]).inputs)
    query = request.query
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise InvalidRequest(f"order must be asc or desc, got {quote(order)}", param="order")
    try:
        limit = int(query.get("limit", "20"))
    except ValueError:
        limit = 0
    if not 1 <= limit <= 100:
        raise InvalidRequest("limit must be an integer in [1, 100]", param="limit")
    if order == "desc":
        items.reverse()
    after = query.get("after")
    if after is not None:
        ids = [item["id"] for item in items]
        if after not in ids:
            raise InvalidRequest(f"after names no input item of this response: {quote(after)}", param="after")
        items = items[ids.index(after) + 1:]
    page = items[:limit]
    return web.json_response({"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                              "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit})


async def _stream(request: web.Request, shape: ResponseShape, store: ResponseStore) -> web.StreamResponse:
    """OpenAI's event sequence: created, in_progress, the output item(s) with their deltas, then
    completed (or incomplete, or failed)."""
    handle = shape.handle
    deltas = handle.astream().__aiter__()
    try:
        first: str | None = await deltas.__anext__()
    except StopAsyncIteration:
        first = None
        succeeded(handle.result(0))  # failed before any text: still time for a JSON error
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8",
                                           "Cache-Control": "no-cache", "X-Accel-Buffering": "no", **shape.headers})
    await response.prepare(request)
    items = OutputItems(shape, response)
    try:
        await _send(response, shape.event("response.created", response=shape.obj("in_progress", [])))
        await _send(response, shape.event("response.in_progress", response=shape.obj("in_progress", [])))
        delta = first
        while delta is not None:
            if delta:
                await items.on(shape.reader.feed(delta))
            delta = await anext(deltas, None)
        record = handle.result(0)
        if record.error:
            await _send_failure(response, shape, record)
            return response
        await items.on(shape.reader.close())
        finished = shape.finished(record, await items.close(record))
        kind = "response.incomplete" if finished["status"] == "incomplete" else "response.completed"
        await _send(response, shape.event(kind, response=finished))
        if shape.call.body.store is not False:
            store.put(shape.stored(finished, record))
    except ConnectionResetError:
        pass  # the client left; the caller's `finally` cancels the request
    return response


async def _send_failure(response: web.StreamResponse, shape: ResponseShape, record: FinishRecord) -> None:
    _status, payload = error_payload(failure(record))
    error = payload["error"]
    await _send(response, shape.event("error", code=error["code"] or error["type"], message=error["message"],
                                      param=error["param"]))
    await _send(response, shape.event("response.failed", response=shape.obj(
        "failed", [], error={"code": "server_error", "message": error["message"]})))


class OutputItems:
    """A streamed reply's output items, opened and closed as its reader's events come: a
    reasoning item, then a message or a function call, each with its deltas."""

    def __init__(self, shape: ResponseShape, response: web.StreamResponse):
        self.shape, self.response = shape, response
        self.done: list[dict] = []  # closed items, in output order
        self.open: str | None = None  # "reasoning" | "message" | "call"
        self.text = ""
        self.call: CallStart | None = None
        self.arguments = ""
        self._lp_sent = 0

    @property
    def index(self) -> int:
        return len(self.done)

    async def on(self, events: list) -> None:
        for e in events:
            if isinstance(e, ReasoningDelta):
                await self._ensure("reasoning")
                self.text += e.text
                await self._emit("response.reasoning_text.delta", item_id=self.shape.rs_id, output_index=self.index,
                                 content_index=0, delta=e.text)
            elif isinstance(e, TextDelta):
                await self._ensure("message")
                self.text += e.text
                await self._emit("response.output_text.delta", item_id=self.shape.msg_id, output_index=self.index,
                                 content_index=0, delta=e.text, logprobs=self._new_logprobs())
            elif isinstance(e, CallStart):
                await self._finish_open()
                self.open, self.call, self.arguments = "call", e, ""
                await self._emit("response.output_item.added", output_index=self.index,
                                 item=self._call_item("in_progress", ""))
            elif isinstance(e, ArgumentsDelta):
                self.arguments += e.text
                await self._emit("response.function_call_arguments.delta", item_id=self._call_item()["id"],
                                 output_index=self.index, delta=e.text)

    async def close(self, record: FinishRecord) -> list[dict]:
        """Close what is open (a message, even an empty one, where nothing else was said); the output."""
        if self.open is None and not any(item["type"] != "reasoning" for item in self.done):
            await self._ensure("message")
        await self._finish_open("incomplete" if record.finish_reason == "length" else "completed")
        return self.done

    async def _ensure(self, kind: str) -> None:
        if self.open == kind:
            return
        await self._finish_open()
        self.open, self.text = kind, ""
        shape = self.shape
        if kind == "reasoning":
            await self._emit("response.output_item.added", output_index=self.index,
                             item=shape.reasoning_item("", "in_progress"))
            return
        await self._emit("response.output_item.added", output_index=self.index,
                         item=shape.message_item("", status="in_progress"))
        await self._emit("response.content_part.added", item_id=shape.msg_id, output_index=self.index,
                         content_index=0, part=shape.text_part(""))

    async def _finish_open(self, status: str = "completed") -> None:
        shape, i, text = self.shape, self.index, self.text
        if self.open == "reasoning":
            await self._emit("response.reasoning_text.done", item_id=shape.rs_id, output_index=i, content_index=0,
                             text=text)
            item = shape.reasoning_item(text)
        elif self.open == "message":
            entries = self._all_logprobs()
            await self._emit("response.output_text.done", item_id=shape.msg_id, output_index=i, content_index=0,
                             text=text, logprobs=entries)
            await self._emit("response.content_part.done", item_id=shape.msg_id, output_index=i, content_index=0,
                             part=shape.text_part(text, entries))
            item = shape.message_item(text, status, entries)
        elif self.open == "call" and self.call is not None:
            item = self._call_item()
            await self._emit("response.function_call_arguments.done", item_id=item["id"], output_index=i,
                             name=item["name"], arguments=self.arguments)
        else:
            return
        await self._emit("response.output_item.done", output_index=i, item=item)
        self.done.append(item)
        self.open = None

    def _call_item(self, status: str = "completed", arguments: str | None = None) -> dict:
        call = self.call
        if call is None:
            raise RuntimeError("no function call is open")
        return self.shape.call_item(ToolCall(call.call_id, call.name, self.arguments), status, arguments)

    def _new_logprobs(self) -> list:
        entries = self.shape.handle.logprobs
        if not self.shape.logprobs or entries is None:
            return []
        new = entries[self._lp_sent:]
        self._lp_sent += len(new)
        return [token_logprob(e) for e in new]

    def _all_logprobs(self) -> list:
        entries = self.shape.handle.logprobs
        return [token_logprob(e) for e in entries or ()] if self.shape.logprobs else []

    async def _emit(self, kind: str, **fields) -> None:
        await _send(self.response, self.shape.event(kind, **fields))


async def _send(response: web.StreamResponse, event: dict) -> None:
    await response.write(f"event: {event['type']}\ndata: ".encode()
                         + json.dumps(event, ensure_ascii=False).encode() + b"\n\n")


def document(doc: dict, *, auth: bool) -> None:
    """Add these routes and `ResponsesRequest` to the server's OpenAPI document `doc`."""
    schemas = doc["components"]["schemas"]
    request_schema = ResponsesRequest.model_json_schema(ref_template="#/components/schemas/{model}")
    schemas.update(request_schema.pop("$defs", {}))
    schemas["ResponsesRequest"] = request_schema
    schemas["Response"] = {"type": "object", "required": ["id", "object", "created_at", "status", "output"],
                           "properties": {"id": {"type": "string"}, "object": {"type": "string", "enum": ["response"]},
                                          "created_at": {"type": "integer"}, "status": {"type": "string"},
                                          "output": {"type": "array"}, "usage": {"type": ["object", "null"]}}}
    security: dict[str, Any] = {"security": [{"bearer": []}]} if auth else {}
    error = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
    failures = {400: "invalid request", 401: "missing or wrong API key", 404: "unknown model or previous response",
                429: "queue full, retry later", 503: "no backend can serve"}
    answers = {"200": {"description": "the response, or an SSE stream of its events when `stream` is true",
                       "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Response"}},
                                   "text/event-stream": {"schema": {"type": "string"}}}},
               **{str(code): {"description": text, **error} for code, text in failures.items()}}
    by_id = [{"name": "id", "in": "path", "required": True, "schema": {"type": "string"}}]
    stored = {"200": {"description": "the stored response", "content": {"application/json": {
        "schema": {"$ref": "#/components/schemas/Response"}}}}, "404": {"description": "not stored", **error}}
    doc["paths"]["/v1/responses"] = {"post": {"summary": "a response (OpenAI's Responses API)", **security,
                                              "requestBody": {"required": True, "content": {"application/json": {
                                                  "schema": {"$ref": "#/components/schemas/ResponsesRequest"}}}},
                                              "responses": answers}}
    doc["paths"]["/v1/responses/{id}/input_items"] = {"get": {
        "summary": "a stored response's input items (OpenAI's cursor page)", **security,
        "parameters": [*by_id, *({"name": name, "in": "query", "required": False, "schema": schema} for name, schema in (
            ("order", {"type": "string", "enum": ["asc", "desc"]}), ("limit", {"type": "integer", "minimum": 1,
                                                                              "maximum": 100}),
            ("after", {"type": "string"})))],
        "responses": {"200": {"description": "the items", "content": {"application/json": {"schema": {
            "type": "object", "required": ["object", "data", "has_more"]}}}}, "400": {"description": "bad query", **error},
            "404": {"description": "not stored", **error}}}}
    doc["paths"]["/v1/responses/{id}"] = {
        "get": {"summary": "a stored response", "parameters": by_id, "responses": stored, **security},
        "delete": {"summary": "forget a stored response", "parameters": by_id, "responses": stored, **security}}
    doc["paths"]["/v1/models/{model}"] = {"get": {
        "summary": "one served model", **security,
        "parameters": [{"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}],
        "responses": {"200": {"description": "the model", "content": {"application/json": {"schema": {
            "type": "object", "required": ["id", "object", "created", "owned_by"]}}}},
            "404": {"description": "unknown model", **error}}}}


ROUTES = [
    web.post("/v1/responses", create),
    web.get("/v1/responses/{id}", retrieve),
    web.delete("/v1/responses/{id}", delete),
    web.get("/v1/responses/{id}/input_items", list_input_items),
]
