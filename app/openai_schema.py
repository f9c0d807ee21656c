"""The OpenAI API's request bodies as pydantic models: parsed, checked, turned into our `Request`,
and documented (`/openapi.json`) from the same definitions.

One source of truth: every limit a client can hit lives in a `Field(...)` below; the validator
is pydantic's, and `openapi_document()` is built from `model_json_schema()` of the same
classes, so the documented limits and the enforced ones cannot drift apart (tested value by
value in tests/test_security.py). The few facts only a running server knows (the model's
names, its vocabulary size, its backends' names) are checked in code here and written into
the generated schema by `openapi_document()`.

Everything a client can send wrong is raised as an `InvalidRequest` (or a subclass) naming the
offending top-level field in `param`, with the bad value quoted cut to `QUOTE_CHARS`, so the
server answers 4xx, never 5xx, and never echoes megabytes. Fields we do not know are ignored
(like other local servers); fields we know but cannot honour (`best_of`, `suffix`, ...) are
refused rather than silently dropped.

Structured output: `response_format` `json_object` or `json_schema`, chat `tools` /
`tool_choice`, and llama-server's `grammar` (GBNF) become one grammar on `SamplingParams`
(the schema converted by llama-cpp-python's converter, engine/llama/grammar.py; tool calls in
the format of engine/prompts/tool_calls.py, the prompt holding what is settled before the model
writes). A schema the converter cannot take is a 400 with its reason. Without `max_tokens`, such a request may write `STRUCTURED_MAX_TOKENS`
(a JSON value cut short is no JSON at all; a reply cut by `max_tokens` ends with `length` and
is not valid).

OpenAI's sampling extras, with OpenAI's limits: `n` (1–`MAX_N`, choices that share the
prompt's KV), `logit_bias` (at most 300 token ids, each below the vocabulary size, bias in
[-100, 100]), `logprobs` / `top_logprobs` (chat: a boolean and 0–20 alternatives;
completions: an integer 0–5), `presence_penalty` / `frequency_penalty` (-2–2), `seed`,
`stop` (at most 4 strings), `echo` (completions: the prompt's text before the reply; with
`logprobs`, the prompt's tokens come first in the logprobs, the first with none, as OpenAI's).

Extensions beyond OpenAI's fields (llama-server's names where they exist): `backend` (pin the
request to one backend), `ignore_eos`, `top_k`, `min_p`, `repeat_penalty`, `repeat_last_n`,
`grammar`, `chat_template_kwargs` (template variables; the template's own globals refused).
Content parts a text model cannot read (images, audio, files) are refused in plain words.
Completions take a list of prompts (`MAX_PROMPTS`), each with `n` choices. Unset sampling fields take the engine's defaults (`SamplingParams`), like llama-server.

Thread contract: pure functions of their inputs; `parse_chat`/`parse_completion` run on a worker
thread (they tokenize).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any, Literal, TypeVar

from jinja2 import TemplateError
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic.json_schema import models_json_schema

from engine.core.errors import EngineError, InvalidRequest
from engine.core.request import MAX_TOKENS, Request, SamplingParams
from engine.llama.grammar import MAX_GRAMMAR_BYTES, object_grammar, schema_grammar
from engine.prompts.chat import MAX_MESSAGES, ChatPrompt, min_tokens
from engine.prompts.structured import function_schema, standalone_schema
from engine.prompts.tool_calls import ToolMode, reply_grammar

if TYPE_CHECKING:
    from engine.engine import Engine

INT32_MAX = 2**31 - 1
MAX_REPEAT_LAST_N = 8192  # the engine's own bound (`SamplingParams.validate`)
MAX_STOPS = 4  # OpenAI's limit (the engine takes up to 16)
MAX_N = 16  # choices per request
MAX_PROMPTS = 64  # prompts in one completions request (choices: prompts × n, at most MAX_CHOICES)
MAX_CHOICES = 128
MAX_LOGIT_BIAS = 300  # OpenAI's limit
MAX_CHAT_TOP_LOGPROBS = 20  # OpenAI's limits
MAX_COMPLETION_LOGPROBS = 5
MAX_STOP_CHARS = 512
QUOTE_CHARS = 200  # a bad value is quoted at most this long in an error message
MESSAGE_CHARS = 600  # and a whole error message at most this long
ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_TOOLS = 128  # OpenAI's limit
# The default `max_tokens` of a grammar-constrained request (the engine's own is 256): long
# enough for the JSON replies small schemas describe (the tests' take under 100 tokens on
# SmolLM2-135M), bounded because a string value has no end of its own; the context's end still
# clamps it.
STRUCTURED_MAX_TOKENS = 1024
_DEFAULTS = SamplingParams()


class ModelNotFound(InvalidRequest):
    """The body names a model this server does not serve (OpenAI: 404 `model_not_found`)."""

    kind = "not_found_error"
    code = "model_not_found"

    def __init__(self, model: str, served: str):
        super().__init__(f"the model {quote(model)} does not exist here; this server serves {served!r} "
                         f"(see GET /v1/models)", param="model")


class AuthenticationFailed(EngineError):
    """No API key, or the wrong one (OpenAI: 401 `invalid_api_key`)."""

    kind = "authentication_error"
    code = "invalid_api_key"


def quote(value: Any, n: int = QUOTE_CHARS) -> str:
    """`repr(value)` cut to about `n` characters (an error never echoes a whole prompt)."""
    if isinstance(value, (str, bytes)) and len(value) > n:
        return repr(value[:n]) + f"… ({len(value)} long)"
    if isinstance(value, (list, dict)) and len(value) > 20:
        return f"a {type(value).__name__} of {len(value)} items"
    text = repr(value)
    return text if len(text) <= n else text[:n] + "…"


# ---- the models ----

Int32 = Annotated[int, Field(ge=0, le=INT32_MAX)]
Finite = Annotated[float, Field(allow_inf_nan=False)]
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]
Nothing = Annotated[list, Field(max_length=0)]
Penalty = Annotated[Finite, Field(ge=-2, le=2)]
TokenIdKey = Annotated[str, Field(pattern=r"^[0-9]{1,10}$")]
Bias = Annotated[Finite, Field(ge=-100, le=100)]


class _Strict(BaseModel):
    # strict: "8" is not 8 and true is not 1; unknown fields are ignored, like OpenAI's other servers
    model_config = ConfigDict(strict=True, extra="ignore")


M = TypeVar("M", bound=_Strict)


# Content parts a text-only model cannot read, and what to call them in a refusal.
NOT_TAKEN = {"image_url": "images", "input_image": "images", "image": "images", "input_audio": "audio",
             "audio": "audio", "file": "files", "input_file": "files", "video_url": "video"}
NOT_TAKEN_PREFIX = "this model does not take"
TEMPLATE_GLOBALS = frozenset({"messages", "tools", "functions", "function_call", "tool_choice", "eos_token",
                              "bos_token", "raise_exception", "add_generation_prompt", "strftime_now"})


class TextPart(_Strict):
    type: Literal["text"]
    text: str


FunctionName = Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]


class FunctionCall(_Strict):
    name: FunctionName
    arguments: str = Field(description="the arguments as a JSON string")


class ToolCallItem(_Strict):
    id: str
    type: Literal["function"]
    function: FunctionCall


class ChatMessage(_Strict):
    role: Literal[ROLES]  # type: ignore[valid-type]
    content: str | list[TextPart] | None = Field(
        default=None, description="required except on assistant messages")
    tool_calls: Annotated[list[ToolCallItem], Field(max_length=MAX_TOOLS)] | None = Field(
        default=None, description="an assistant message's earlier tool calls")
    tool_call_id: str | None = Field(default=None, description="a tool message: the call it answers")
    name: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _text_parts_only(cls, data):
        parts = data.get("content") if isinstance(data, dict) else None
        for part in parts if isinstance(parts, list) else ():
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in NOT_TAKEN:
                raise ValueError(f"{NOT_TAKEN_PREFIX} {NOT_TAKEN[kind]} (its {kind!r} part); send the "
                                 "content as text")
        return data

    @model_validator(mode="after")
    def _content_present(self):
        if self.content is None and self.role != "assistant":
            raise ValueError("content is required")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        return self

    def as_dict(self) -> dict:
        """The message as the chat template sees it (`developer` is the system role)."""
        out: dict = {"role": "system" if self.role == "developer" else self.role, "content": self.text()}
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        return out

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class StreamOptions(_Strict):
    include_usage: bool | None = None


class JsonSchemaFormat(_Strict):
    model_config = ConfigDict(strict=True, extra="ignore", populate_by_name=True)

    name: FunctionName
    description: str | None = None
    schema_: dict | None = Field(default=None, alias="schema",
                                 description="the JSON Schema the reply matches (absent: any object)")
    strict: bool | None = Field(default=None, description="always enforced: the reply is decoded under the schema")


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_present(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("json_schema is required when type is 'json_schema'")
        return self


class FunctionDef(_Strict):
    name: FunctionName
    description: str | None = None
    parameters: dict | None = Field(default=None, description="a JSON Schema (absent: no parameters)")
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Strict):
    name: FunctionName


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class _Sampling(_Strict):
    """Fields shared by both endpoints: the model, sampling, streaming, extensions, refusals."""

    model: str | None = None
    max_tokens: Annotated[int, Field(ge=1, le=MAX_TOKENS)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1, le=MAX_TOKENS)] | None = Field(
        default=None, description="OpenAI's newer name for max_tokens; wins when both are sent")
    temperature: Annotated[Finite, Field(ge=0, le=2)] | None = None
    top_p: Annotated[Finite, Field(gt=0, le=1)] | None = None
    top_k: Int32 | None = None
    min_p: Annotated[Finite, Field(ge=0, le=1)] | None = None
    repeat_penalty: Annotated[Finite, Field(ge=1e-3, le=1e3)] | None = None
    repeat_last_n: Annotated[int, Field(ge=0, le=MAX_REPEAT_LAST_N)] | None = None
    seed: Annotated[int, Field(ge=0, le=2**32 - 1)] | None = None
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOPS)] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    backend: str | None = Field(default=None, description="extension: pin the request to this backend")
    ignore_eos: bool | None = Field(default=None, description="extension: never stop at end-of-text")
    n: Annotated[int, Field(ge=1, le=MAX_N)] | None = Field(
        default=None, description="choices; they share the prompt's KV (computed once)")
    logit_bias: Annotated[dict[TokenIdKey, Bias], Field(max_length=MAX_LOGIT_BIAS)] | None = Field(
        default=None, description="token id (a string) -> bias added to its logit; -100 bans it")
    frequency_penalty: Penalty | None = None
    presence_penalty: Penalty | None = None
    grammar: Annotated[str, Field(min_length=1)] | None = Field(
        default=None, description="extension (llama-server's): constrain the reply to this GBNF grammar")
    # Understood but not honoured: only their neutral values pass.
    best_of: Literal[1] | None = None
    suffix: Literal[""] | None = None
    tools: Nothing | None = None
    functions: Nothing | None = None
    response_format: ResponseFormat | None = None

    def top_logprobs_asked(self) -> int | None:
        """Alternatives per token the reply must carry; None: no logprobs."""
        raise NotImplementedError

    def prompt_logprobs_asked(self) -> bool:
        """The prompt's tokens' logprobs too (completions' echo)."""
        return False

    def sampling(self, n_vocab: int, grammar: str | None = None) -> SamplingParams:
        values = {name: getattr(self, name) for name in
                  ("temperature", "top_p", "top_k", "min_p", "repeat_penalty", "repeat_last_n", "seed", "ignore_eos",
                   "presence_penalty", "frequency_penalty")
                  if getattr(self, name) is not None}
        if self.logit_bias:
            bias = sorted((int(k), float(v)) for k, v in self.logit_bias.items())
            if bias[-1][0] >= n_vocab:
                raise InvalidRequest(f"logit_bias: token id {bias[-1][0]} is not in the model's vocabulary "
                                     f"[0, {n_vocab})", param="logit_bias")
            values["logit_bias"] = tuple(bias)
        values["logprobs"] = self.top_logprobs_asked()
        values["prompt_logprobs"] = self.prompt_logprobs_asked()
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        if max_tokens is not None:
            values["max_tokens"] = max_tokens
        if grammar is not None:
            values["grammar"] = grammar
            values.setdefault("max_tokens", STRUCTURED_MAX_TOKENS)
        if self.stop is not None:
            values["stop"] = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if values.get("top_k", 0) > n_vocab:  # the same filter (none); llama.cpp's top-k asserts k <= n_vocab
            values["top_k"] = n_vocab
        return dataclasses.replace(_DEFAULTS, **values).validate()


class ChatCompletionRequest(_Sampling):
    # max_length stops validation at the limit: messages past it are never looked at
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
    logprobs: bool | None = Field(default=None, description="each output token's logprob")
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_CHAT_TOP_LOGPROBS)] | None = Field(
        default=None, description="alternatives per token (needs logprobs: true)")
    tools: Annotated[list[Tool], Field(min_length=1, max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        default=None, description="default: auto with tools; a reply holds at most one call")
    parallel_tool_calls: bool | None = Field(default=None, description="accepted; a reply holds at most one call")
    continue_final_message: bool = Field(
        default=False, description="vLLM's extension: the last message is the assistant's reply so far; "
                                   "the answer continues it in the same turn")
    chat_template_kwargs: dict[str, Any] | None = Field(
        default=None, description="vLLM's and llama-server's extension: variables for the model's chat template "
                                  "(e.g. enable_thinking)")

    @model_validator(mode="after")
    def _top_needs_logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    def top_logprobs_asked(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_Sampling):
    prompt: (Annotated[str, Field(min_length=1)] | Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
             | Annotated[list[str], Field(min_length=1, max_length=MAX_PROMPTS)]
             | Annotated[list[list[Annotated[int, Field(ge=0)]]], Field(min_length=1, max_length=MAX_PROMPTS)]) = Field(
        description="a string or a list of token ids, or a list of either (one reply per prompt)")
    logprobs: Annotated[int, Field(ge=0, le=MAX_COMPLETION_LOGPROBS)] | None = Field(
        default=None, description="each output token's logprob and this many alternatives")
    echo: bool | None = Field(default=None, description="the prompt's text before the reply; with logprobs, "
                                                         "the prompt's tokens' logprobs too")

    def top_logprobs_asked(self) -> int | None:
        return self.logprobs

    def prompt_logprobs_asked(self) -> bool:
        return bool(self.echo) and self.logprobs is not None


class TokenizeRequest(_Strict):
    """llama-server's `POST /tokenize`."""

    content: Annotated[str, Field(description="the text to tokenize")]
    add_special: bool = Field(default=False, description="add the model's BOS (and other special) tokens")
    parse_special: bool = Field(default=True, description="turn special-token text into the special token")
    with_pieces: bool = Field(default=False, description="each token as {id, piece} (piece: a string, or its "
                                                         "bytes when they are not valid UTF-8)")


class DetokenizeRequest(_Strict):
    """llama-server's `POST /detokenize`."""

    tokens: list[Annotated[int, Field(ge=0)]] = Field(description="token ids to turn back into text")


MAX_TOKENIZE_TOKENS = 32768  # tokens one /tokenize answers (with pieces, ~1.3 MB); 1.9 MB made 17 MB


def tokenize(raw: bytes, engine: Engine) -> dict:
    """A `/tokenize` body → `{"tokens": [...]}` (raises `InvalidRequest`). At most
    `MAX_TOKENIZE_TOKENS` tokens, refused by a cheap bound before tokenizing where it can."""
    body = validate(TokenizeRequest, raw)
    model = _local_model(engine)
    low = min_tokens(model, [body.content])
    if low > MAX_TOKENIZE_TOKENS:
        raise InvalidRequest(f"content: at least {low} tokens; /tokenize answers at most {MAX_TOKENIZE_TOKENS}",
                             param="content")
    tokens = model.tokenize(body.content, add_special=body.add_special, parse_special=body.parse_special)
    if len(tokens) > MAX_TOKENIZE_TOKENS:
        raise InvalidRequest(f"content: {len(tokens)} tokens; /tokenize answers at most {MAX_TOKENIZE_TOKENS}",
                             param="content")
    if not body.with_pieces:
        return {"tokens": tokens}
    out = []
    for t in tokens:
        piece = model.piece(t)
        try:
            out.append({"id": t, "piece": piece.decode("utf-8")})
        except UnicodeDecodeError:
            out.append({"id": t, "piece": list(piece)})
    return {"tokens": out}


def detokenize(raw: bytes, engine: Engine) -> dict:
    """A `/detokenize` body → `{"content": text}` (raises `InvalidRequest`)."""
    body = validate(DetokenizeRequest, raw)
    model = _local_model(engine)
    bad = next((t for t in body.tokens if t >= model.n_vocab), None)
    if bad is not None:
        raise InvalidRequest(f"tokens: token ids must be integers in [0, {model.n_vocab}), got {bad}", param="tokens")
    return {"content": model.detokenize(body.tokens)}


def _local_model(engine: Engine):
    if engine.model is None:
        raise InvalidRequest("this server routes to remote engines and has no tokenizer of its own; "
                             "ask an engine's /tokenize")
    return engine.model


# Fields whose only accepted values are neutral ones, with how to say so.
_UNSUPPORTED = {"best_of", "suffix", "tools", "functions"}


# ---- parsing ----


@dataclass(frozen=True)
class ApiRequest:
    """One checked OpenAI request: the engine's request plus how to shape the reply."""

    kind: str  # "chat" | "completion"
    request: Request
    model: str
    stream: bool
    include_usage: bool
    prompt_param: str  # the body field a context-length error points at
    n: int = 1  # choices per prompt (`groups()`)
    echo: str | None = None  # the prompt's text, to put before each choice's text
    top_logprobs: int | None = None  # None: no logprobs in the reply
    tools: ToolMode | None = None  # a chat with tools: the reply is read for a tool call
    reasoning: bool = False  # the template knows thinking blocks: split them into reasoning_content
    thinking: bool = False  # the reply starts inside one (the prompt opened it)
    more: tuple[tuple[Request, str | None], ...] = ()  # a completions prompt list's other prompts, with echoes

    def groups(self) -> list[tuple[list[Request], str | None]]:
        """Per prompt, one engine request per choice and the prompt's echo. With a seed, choice
        i draws from `seed + i` (the same body gives the same choices, and the choices differ)."""
        return [(self._choices(r), echo) for r, echo in ((self.request, self.echo), *self.more)]

    def _choices(self, request: Request) -> list[Request]:
        if self.n == 1:
            return [request]
        sp = request.sampling
        return [dataclasses.replace(request, id=f"{request.id}-{i}", sampling=dataclasses.replace(
            sp, seed=None if sp.seed is None else (sp.seed + i) % 2**32)) for i in range(self.n)]


@dataclass(frozen=True)
class ServedModel:
    """The models a server serves: the first one's id in `/v1/models` and the other names it
    answers to, then the ids of the fleet's other models (remote engines that serve another).

    `aliases` are accepted in `model`; only `public_aliases` (no paths) are ever shown."""

    id: str
    aliases: frozenset[str] = frozenset()
    others: tuple[str, ...] = ()

    @property
    def public_aliases(self) -> list[str]:
        return sorted(a for a in self.aliases if "/" not in a and "\\" not in a)

    @property
    def ids(self) -> list[str]:
        return [self.id, *self.others]

    def check(self, model: str | None) -> str:
        """The model a body asks for: absent or null means the first; any other name is a 404."""
        if model is None:
            return self.id
        if model != self.id and model not in self.aliases and model not in self.others:
            raise ModelNotFound(model, ", ".join(self.ids))
        return model

    def canonical(self, model: str) -> str:
        """The id a reply names for `model`: the served id for any of its aliases."""
        return self.id if model in self.aliases else model

    def routed(self, model: str) -> str | None:
        """The model id the engine routes on: None (any backend) when the server serves one."""
        if not self.others:
            return None
        return self.id if model in self.aliases else model


def validate(cls: type[M], raw: bytes) -> M:
    """Raw JSON bytes → a checked model, or `InvalidRequest` naming the first bad field."""
    try:
        return cls.model_validate_json(raw)
    except ValidationError as e:
        raise _invalid(e, cls) from None


def _invalid(e: ValidationError, cls: type[_Strict] | None = None) -> InvalidRequest:
    # Too many messages first, without the inputs: a union's other branch (`input` as a string)
    # would quote the whole list.
    for brief in e.errors(include_url=False, include_input=False):
        field = str(brief["loc"][0]) if brief["loc"] else ""
        if brief["type"] == "too_long" and field in ("messages", "input"):  # validation stopped at the limit
            return InvalidRequest(f"{field}: {brief['ctx']['actual_length']} items; this server takes at most "
                                  f"{MAX_MESSAGES} messages", param=field)
    errors = e.errors(include_url=False)
    first = errors[0]
    if first["type"] == "json_invalid":
        return InvalidRequest(f"the request body is not valid JSON: {first['msg'].removeprefix('Invalid JSON: ')}")
    if first["type"] == "model_type" and not first["loc"]:
        return InvalidRequest(f"the request body must be a JSON object, got {_type(first['input'])}")
    loc = first["loc"]
    param = str(loc[0]) if loc else None
    if param in _UNSUPPORTED and cls is not None and issubclass(cls, _Sampling) \
            and not (param == "tools" and cls is ChatCompletionRequest):
        return InvalidRequest(f"{param}={quote(first['input'])} is not supported by this server"
                              f"{' (use repeat_penalty)' if param.endswith('_penalty') else ''}", param=param)
    if not loc and first["type"] == "value_error":  # a rule across fields (`_top_needs_logprobs`)
        msg = first["msg"].removeprefix("Value error, ")
        return InvalidRequest(msg, param=msg.split(" ", 1)[0])
    if param == "stop" and len(loc) <= 3:  # the union's branch errors say less than this
        return InvalidRequest(f"stop must be a non-empty string or a list of at most {MAX_STOPS} of them "
                              f"(each at most {MAX_STOP_CHARS} characters), got {quote(first['input'])}",
                              param="stop")
    msg = first["msg"].removeprefix("Value error, ")
    if msg.startswith(NOT_TAKEN_PREFIX):  # said in plain words already; the input may be a whole image
        return InvalidRequest(f"{_path(loc)}: {msg}", param=param)
    if first["type"] == "missing":
        return InvalidRequest(f"{_path(loc)} is required", param=param)
    return InvalidRequest(f"{_path(loc)}: {msg}, got {quote(first['input'])}", param=param)


def _path(loc: tuple) -> str:
    """('messages', 0, 'content', 'str') → 'messages[0].content' (union branch tags dropped)."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part.isidentifier() and part not in _TYPE_TAGS:
            out += f".{part}" if out else part
    return out


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "TextPart", "StreamOptions", "ResponseFormat",
              "NamedToolChoice"}


def parse_chat(raw: bytes, engine: Engine, served: ServedModel) -> ApiRequest:
    """A `/v1/chat/completions` body → an `ApiRequest` (raises `InvalidRequest`)."""
    body = validate(ChatCompletionRequest, raw)
    model = served.check(body.model)
    messages = [m.as_dict() for m in body.messages]
    plan = _tool_plan(body)
    grammar = _format_grammar(body) if plan is None else None
    extra = _template_kwargs(body)
    if engine.model is None:  # a router in front of remote engines: each renders its own template
        if plan is not None or any(m.tool_calls or m.role == "tool" for m in body.messages):
            raise InvalidRequest("tools need a local model to render them (this server routes to remote "
                                 "engines only)", param="tools")
        if extra:
            raise InvalidRequest("chat_template_kwargs need a local model's template (this server routes to "
                                 "remote engines only)", param="chat_template_kwargs")
        if body.continue_final_message and (messages[-1]["role"] != "assistant" or not messages[-1].get("content")):
            raise InvalidRequest("continue_final_message needs a last message from the assistant with content",
                                 param="messages")
        return _api_request("chat", body, [], model, "messages", 0, served, messages=tuple(messages),
                            grammar=grammar, continue_final=body.continue_final_message)
    prompt = _render(engine, messages, plan, body.continue_final_message, extra)
    if plan is not None and prompt.mode is not None:
        grammar = _tools_grammar(plan[1], prompt.mode)
    return _api_request("chat", body, prompt.tokens, model, "messages", engine.model.n_vocab, served, engine=engine,
                        grammar=grammar, tools=prompt.mode, reasoning=(prompt.reasoning, prompt.thinking))


def _render(engine: Engine, messages: list[dict], plan: tuple[list[dict], list[dict], ToolMode] | None,
            continue_final: bool, extra: dict | None) -> ChatPrompt:
    try:
        return engine.chat_prompt(messages, plan[0] if plan else None, plan[2] if plan else None,
                                  continue_final=continue_final, extra=extra)
    except EngineError:
        raise
    except (TemplateError, ValueError, TypeError, KeyError, IndexError) as e:
        # The model's own Jinja template refused them (`raise_exception('roles must alternate')`).
        raise InvalidRequest(f"the model's chat template cannot render these messages: {quote(str(e))}",
                             param="messages") from None


def _template_kwargs(body: ChatCompletionRequest) -> dict | None:
    """`chat_template_kwargs`, without the names the template's own globals take."""
    extra = body.chat_template_kwargs
    if not extra:
        return None
    taken = sorted(TEMPLATE_GLOBALS & extra.keys())
    if taken:
        raise InvalidRequest(f"chat_template_kwargs cannot set {', '.join(taken)}: the server sets "
                             f"{'it' if len(taken) == 1 else 'them'} from the request", param="chat_template_kwargs")
    return extra


def _tool_plan(body: ChatCompletionRequest) -> tuple[list[dict], list[dict], ToolMode] | None:
    """The tools to render, their functions and how the reply may call them (None: no tool may be called)."""
    if not body.tools:
        if body.tool_choice not in (None, "none", "auto"):
            raise InvalidRequest("tool_choice needs tools", param="tool_choice")
        return None
    if body.tool_choice == "none":
        return None
    if body.grammar is not None:
        raise InvalidRequest("grammar cannot be combined with tools", param="grammar")
    _check_tools_size([t.function.parameters for t in body.tools])
    functions = [t.function.model_dump(exclude_none=True) for t in body.tools]
    names = tuple(f["name"] for f in functions)
    if len(set(names)) != len(names):
        raise InvalidRequest("tools: function names must be unique", param="tools")
    for i, f in enumerate(functions):  # each schema alone first, so an error names its function
        schema_grammar(standalone_schema(function_schema(f), f["name"]), param=f"tools[{i}].function.parameters")
    choice = body.tool_choice if body.tool_choice is not None else "auto"
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in names:
            raise InvalidRequest(f"tool_choice names {quote(choice.function.name)}, which is not among the tools "
                                 f"({', '.join(names)})", param="tool_choice")
        mode = ToolMode(choice.function.name, names, named=True)
    else:
        mode = ToolMode(choice, names)
    fmt = body.response_format
    if mode.choice == "auto" and fmt is not None and fmt.type != "text":
        raise InvalidRequest("response_format cannot be combined with tools that the model may or may not call "
                             "(tool_choice auto): a text answer is plain text here; send one or the other, or "
                             "tool_choice required", param="response_format")
    return [t.model_dump(exclude_none=True) for t in body.tools], functions, mode


def _tools_grammar(functions: list[dict], mode: ToolMode) -> str:
    """The grammar of a reply in `mode` (compact calls of the allowed functions; under `auto`,
    a text answer too)."""
    grammars = {f["name"]: schema_grammar(standalone_schema(function_schema(f), f["name"]), param="tools")
                for f in functions if f["name"] in mode.allowed}
    return reply_grammar(mode, grammars)


def _check_tools_size(parameters: list[dict | None]) -> None:
    """The functions' parameter schemas, as JSON, within `MAX_GRAMMAR_BYTES` before any is
    converted (or copied): their grammar is at least that long, and 128 tools x 300 properties
    (1.4 MB) took 1.2-6.5 s of CPU to convert before the grammar's size refused them."""
    size = len(json.dumps(parameters, ensure_ascii=False))
    if size > MAX_GRAMMAR_BYTES:
        raise InvalidRequest(f"tools: the functions' parameters are {size} bytes of JSON Schema; this server turns "
                             f"at most {MAX_GRAMMAR_BYTES} into a grammar (MAX_GRAMMAR_BYTES)", param="tools")


def _format_grammar(body: _Sampling) -> str | None:
    """The grammar `response_format` (or the `grammar` extension) asks for; None: free text."""
    fmt = body.response_format
    if fmt is None or fmt.type == "text":
        return body.grammar
    if body.grammar is not None:
        raise InvalidRequest("grammar cannot be combined with a response_format", param="grammar")
    if fmt.type == "json_object" or fmt.json_schema is None or fmt.json_schema.schema_ is None:
        return object_grammar()
    return schema_grammar(standalone_schema(fmt.json_schema.schema_, fmt.json_schema.name), param="response_format")


def _prompts(prompt: object) -> list[str | list[int]]:
    """A completion's prompts: text or token ids, alone or as a list (as validated)."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        return list(prompt)
    if isinstance(prompt, str) or (isinstance(prompt, list) and all(isinstance(t, int) for t in prompt)):
        return [prompt]
    raise InvalidRequest("the prompt must be a string or a list of token ids, or a list of either", param="prompt")


def parse_completion(raw: bytes, engine: Engine, served: ServedModel) -> ApiRequest:
    """A `/v1/completions` body → an `ApiRequest` (raises `InvalidRequest`): one request per
    prompt of a list, each with `n` choices."""
    body = validate(CompletionRequest, raw)
    model = served.check(body.model)
    grammar = _format_grammar(body)
    prompts = _prompts(body.prompt)
    if len(prompts) * (body.n or 1) > MAX_CHOICES:
        raise InvalidRequest(f"{len(prompts)} prompts × n={body.n} choices; this server makes at most {MAX_CHOICES} "
                             f"choices per request", param="prompt")
    parsed = [_one_completion(body, p, engine, served, model, grammar) for p in prompts]
    return dataclasses.replace(parsed[0], more=tuple((p.request, p.echo) for p in parsed[1:]))


def _one_completion(body: CompletionRequest, prompt: str | list[int], engine: Engine, served: ServedModel,
                    model: str, grammar: str | None) -> ApiRequest:
    if engine.model is None:  # a router in front of remote engines: they tokenize
        text = prompt if isinstance(prompt, str) else None
        return _api_request("completion", body, [] if isinstance(prompt, str) else list(prompt), model, "prompt", 0,
                            served, text=text, grammar=grammar)
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidRequest("the prompt is empty", param="prompt")
        tokens = engine.prompt_tokens(prompt)  # the raw API: the client writes the whole prompt
    else:
        n_vocab = engine.model.n_vocab
        bad = next((t for t in prompt if t >= n_vocab), None)
        if bad is not None:
            raise InvalidRequest(f"prompt token ids must be integers in [0, {n_vocab}), got {bad}", param="prompt")
        if not prompt:
            raise InvalidRequest("the prompt is empty", param="prompt")
        tokens = list(prompt)
    echo = (prompt if isinstance(prompt, str) else engine.model.detokenize(tokens)) if body.echo else None
    return _api_request("completion", body, tokens, model, "prompt", engine.model.n_vocab, served, echo=echo,
                        engine=engine, grammar=grammar)


def _api_request(kind: str, body: _Sampling, tokens: list[int], model: str, prompt_param: str,
                 n_vocab: int, served: ServedModel, *, text: str | None = None,
                 messages: tuple[dict, ...] | None = None, echo: str | None = None,
                 engine: Engine | None = None, grammar: str | None = None,
                 tools: ToolMode | None = None, continue_final: bool = False,
                 reasoning: tuple[bool, bool] = (False, False)) -> ApiRequest:
    """`n_vocab` 0: unknown here (remote engines check their own vocabulary)."""
    sampling = body.sampling(n_vocab or INT32_MAX, grammar)
    if grammar is not None and engine is not None and engine.model is not None:
        # compiled and tried here, on the parsing thread (cached by hash): not on the loop or a step
        engine.model.check_grammar(grammar, "tools" if tools is not None else
                                   "grammar" if body.grammar is not None else "response_format")
    n = body.n or 1
    if n > 1 and engine is not None and engine.model is not None:
        _check_choices_fit(n, len(tokens), sampling, engine)
    if not (tokens or text or messages):
        raise InvalidRequest(f"the {prompt_param} is empty", param=prompt_param)
    stream = bool(body.stream)
    include_usage = bool(body.stream_options and body.stream_options.include_usage) and stream
    request = Request(tuple(tokens), sampling, backend=body.backend, source="api", text=text, messages=messages,
                      model=served.routed(model), stream=stream, continue_final=continue_final)
    return ApiRequest(kind, request, served.canonical(model), stream, include_usage, prompt_param, n=n, echo=echo,
                      top_logprobs=sampling.logprobs, tools=tools, reasoning=reasoning[0], thinking=reasoning[1])


def _check_choices_fit(n: int, n_prompt: int, sampling: SamplingParams, engine: Engine) -> None:
    """n choices share one prompt: prompt + n × max_tokens cells must fit one backend's KV
    (they run on one backend). A budget left unset is the context's rest, as for n = 1."""
    n_ctx = max((s.kv_cells_total for s in engine.snapshot()), default=0)  # 0: a pool not known here
    if not n_ctx:
        return
    budget = min(sampling.max_tokens, max(n_ctx - n_prompt, 1))
    if n_prompt + n * budget > n_ctx:
        most = max((n_ctx - n_prompt) // budget, 0)
        raise InvalidRequest(f"n={n} choices of up to {budget} tokens after a {n_prompt}-token prompt need "
                             f"{n_prompt + n * budget} KV cells; a backend holds {n_ctx} (send n <= {most} or a "
                             f"smaller max_tokens)", param="n")


def _type(v) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "an integer",
            float: "a number", type(None): "null"}.get(type(v), type(v).__name__)


# ---- OpenAPI ----


def request_schemas() -> dict[str, dict]:
    """The request bodies' JSON Schemas, as `components.schemas` entries (from the models)."""
    _, top = models_json_schema([(ChatCompletionRequest, "validation"), (CompletionRequest, "validation"),
                                 (TokenizeRequest, "validation"), (DetokenizeRequest, "validation")],
                                ref_template="#/components/schemas/{model}")
    return top["$defs"]


def openapi_document(served: ServedModel, n_vocab: int, backends: list[str], *, auth: bool = False) -> dict:
    """The server's OpenAPI 3.1 document (served at `GET /openapi.json`, fuzzed by schemathesis)."""
    schemas = request_schemas()
    _served_facts(schemas, served, n_vocab, backends)
    schemas.update(_reply_schemas())
    doc: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {"title": "Tandem OpenAI-compatible API", "version": "1"},
        "paths": _Operations(auth).paths(),
        "components": {"schemas": schemas},
    }
    if auth:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    return doc


def _served_facts(schemas: dict, served: ServedModel, n_vocab: int, backends: list[str]) -> None:
    """What only the running server knows, written into the generated request schemas: the
    model names it answers to, its backends, the largest token id it takes."""
    names = sorted({*served.ids, *served.public_aliases})
    for name in ("ChatCompletionRequest", "CompletionRequest"):
        props = schemas[name]["properties"]
        props["model"]["anyOf"][0]["enum"] = names
        props["backend"]["anyOf"][0]["enum"] = list(backends)
    for branch in schemas["CompletionRequest"]["properties"]["prompt"]["anyOf"] if n_vocab else ():
        items = branch.get("items", {})
        if items.get("type") == "integer":
            items["maximum"] = n_vocab - 1
        elif items.get("type") == "array":
            items["items"]["maximum"] = n_vocab - 1


def _reply_schemas() -> dict[str, Any]:
    """The replies' schemas, and the one error shape."""
    usage = {"type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
             "properties": {k: {"type": "integer"} for k in ("prompt_tokens", "completion_tokens", "total_tokens")}}
    finish = {"type": "string", "enum": ["stop", "length", "tool_calls"]}
    return {
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
                                                              "content": {"type": ["string", "null"]},
                                                              "tool_calls": {"type": "array"}}}}}},
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
        "TokenizeResponse": {
            "type": "object", "required": ["tokens"],
            "properties": {"tokens": {"type": "array", "items": {"anyOf": [
                {"type": "integer"},
                {"type": "object", "required": ["id", "piece"],
                 "properties": {"id": {"type": "integer"},
                                "piece": {"anyOf": [{"type": "string"},
                                                    {"type": "array", "items": {"type": "integer"}}]}}}]}}},
        },
        "DetokenizeResponse": {
            "type": "object", "required": ["content"], "properties": {"content": {"type": "string"}},
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
                "properties": {"message": {"type": "string", "maxLength": MESSAGE_CHARS + 1},
                               "type": {"type": "string"},
                               "param": {"type": ["string", "null"]},
                               "code": {"type": ["string", "null"]}}}},
        },
    }


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


class _Operations:
    """The document's paths: each operation with its replies and error codes, secured by the
    bearer scheme where the server asks for a key (`auth`)."""

    def __init__(self, auth: bool) -> None:
        self.auth = auth

    def paths(self) -> dict[str, Any]:
        post, get, secured = self.post, self.get, self.secured
        models = secured(get("the served model", "application/json", _ref("ModelList"), 401))
        routing = secured(get("backends' snapshots and recent routing decisions", "application/json",
                              {"type": "object"}, 400, 401,
                              params=[{"name": "n", "in": "query", "required": False,
                                       "schema": {"type": "integer", "minimum": 0, "maximum": 1000}}]))
        return {
            "/v1/chat/completions": {"post": post("chat completion", "ChatCompletionRequest", "ChatCompletion")},
            "/v1/completions": {"post": post("text completion", "CompletionRequest", "Completion")},
            "/v1/models": {"get": models},
            "/tokenize": {"post": post("text to token ids (llama-server's)", "TokenizeRequest", "TokenizeResponse")},
            "/detokenize": {"post": post("token ids to text (llama-server's)", "DetokenizeRequest",
                                         "DetokenizeResponse")},
            "/v1/routing": {"get": routing},
            "/v1/backends": {"get": secured(get("backends' snapshots, each with its live cap and why it last moved",
                                                "application/json", {"type": "object"}, 401))},
            "/health": {"get": get("liveness", "application/json", {"type": "object"}, 503)},
            "/metrics": {"get": get("Prometheus metrics", "text/plain", {"type": "string"})},
        }

    @staticmethod
    def errors(*codes: int) -> dict[str, Any]:
        return {str(c): {"description": _STATUS_TEXT[c], "content": {"application/json": {"schema": _ref("Error")}}}
                for c in codes}

    def secured(self, op: dict[str, Any]) -> dict[str, Any]:
        if self.auth:
            op["security"] = [{"bearer": []}]
        return op

    def post(self, summary: str, request: str, reply: str) -> dict[str, Any]:
        return self.secured({
            "summary": summary,
            "requestBody": {"required": True, "content": {"application/json": {"schema": _ref(request)}}},
            "responses": {
                "200": {"description": "the reply, or an SSE stream of chunks when `stream` is true",
                        "content": {"application/json": {"schema": _ref(reply)},
                                    "text/event-stream": {"schema": {"type": "string"}}}},
                **self.errors(400, 401, 403, 404, 408, 413, 415, 429, 503),
            },
        })

    def get(self, summary: str, content_type: str, schema: dict, *extra_codes: int,
            params: list[dict] | None = None) -> dict[str, Any]:
        op: dict[str, Any] = {"summary": summary,
                              "responses": {"200": {"description": "OK", "content": {content_type: {"schema": schema}}},
                                            **self.errors(403, *extra_codes)}}
        if params:
            op["parameters"] = params
        return op


_STATUS_TEXT = {400: "invalid request", 401: "missing or wrong API key", 403: "foreign Host or Origin",
                404: "unknown model", 408: "body too slow", 413: "body too large",
                415: "body not application/json", 429: "queue full, retry later", 503: "no backend can serve"}
