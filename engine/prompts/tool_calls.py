"""Tool calls as the model writes them: the format, the prompt that asks for it, the grammar
that forces it, and the reader that turns the reply into text and calls while it streams.

Two formats (`ToolFormat`). A wrapper the model writes is compact JSON, no whitespace at all,
so it costs the same few tokens whatever indentation the prompt shows; the arguments take at
most one space between tokens (the schema converter's own rule: no newline, no indentation) —
forced to write them compact, SmolLM2-135M falls into loops a space avoids:

- the template's own, where it has one (`<tool_call>` in it: Hermes, Qwen, SmolLM3):
  `<tool_call>\\n{"name":"NAME","arguments":{...}}`; under `auto` a text answer is plain text
  (what llama-server's lazy grammar for native formats allows too);
- else `JSON_FORMAT`: `{"name":"NAME","arguments":{...}}` for a call, `{"response":"..."}`
  for a text answer. The prompt ends with `{"`, so the model's first token chooses between
  `name` and `response` in the frame of mind the instruction set, as llama-server's generic
  format has it choose between `tool_call` and `response`: a model with no tool training
  (SmolLM2-135M) never opens a call from free text, but from `{"` it does (`name` is a key
  such models like to write). The answer's string is decoded as it streams, so it still
  arrives token by token.

The prompt ends with what is settled before the model chooses (`ToolMode.prefill`): `{"`,
the Hermes opener and `{"name":"` under `required`, and the whole head where the function is
known (a named choice, or `required` with one function), which leaves only the arguments to
write; a head in the prompt costs no generated token, so it is written as the model would
(`{"name": "f", "arguments": `, as Hermes and Qwen templates render past calls). Past calls in the history: while a tool may be called, in the call format (or the
template's own rendering of `tool_calls`); when none may be (`tool_choice: none`, no tools), in
plain words (`get_weather(city="Paris")`), so the model has no wrapper to imitate.

`ToolReplyReader` reads the reply incrementally: text deltas as they come, a call's name once
its head is complete, its arguments as they are written (all but the last character, which
may be the wrapper's closing brace). A call cut short (`max_tokens`) is no call.

Thread contract: pure functions and per-request readers (one thread each).
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Literal

TOOLS_PREAMBLE = "You can call these tools: "  # for a template that does not render tools itself
RESPONSE_KEY = "response"  # JSON_FORMAT's text answer: {"response":"..."}


@dataclass(frozen=True)
class ToolFormat:
    """How a call is written, what a text answer looks like under `auto`, and the instructions."""

    name: str
    opener: str  # before the call object
    closer: str  # after it, in the history
    plain_text: bool  # under `auto`, a text answer is plain text (else `{"response":"..."}`)
    auto_instruction: str
    required_instruction: str

    def head(self, function: str, spaced: bool = False) -> str:
        """What a call of `function` starts with, up to its arguments: compact where the model
        writes it, `spaced` as models write JSON where the prompt holds it."""
        if spaced:
            return f'{self.opener}{{"name": "{function}", "arguments": '
        return f'{self.opener}{{"name":"{function}","arguments":'

    def chooser(self, choice: str) -> str:
        """What the prompt ends with while the model still chooses (`auto`, or `required` among several)."""
        if choice == "auto":
            return "" if self.plain_text else '{"'
        return self.opener + '{"name":"'

    def call_text(self, function: str, arguments: object) -> str:
        """A whole call as the history shows it."""
        return f"{self.head(function, spaced=True)}{json.dumps(arguments, ensure_ascii=False)}}}{self.closer}"

    def read_head(self, text: str) -> tuple[str, int] | None:
        """(function name, length of the head) once `text` starts with a whole head."""
        if not text.startswith(self.opener):
            return None
        m = _HEAD.match(text, len(self.opener))
        return (m.group(1), m.end()) if m is not None else None


JSON_FORMAT = ToolFormat(
    "json", "", "", False,
    auto_instruction=('Reply in JSON. If the user asks for something a tool does, call the tool: '
                      '{"name":"<tool name>","arguments":{<its arguments>}}. Else answer: {"response":"<your answer>"}.'),
    required_instruction='Reply in JSON, calling one of the tools: {"name":"<tool name>","arguments":{<its arguments>}}.')
HERMES_FORMAT = ToolFormat(
    "hermes", "<tool_call>\n", "\n</tool_call>", True,
    auto_instruction=('To call a tool, reply with nothing but <tool_call>\n{"name":"<tool name>",'
                      '"arguments":{<its arguments>}}. Otherwise answer in plain text.'),
    required_instruction='Reply with nothing but <tool_call>\n{"name":"<tool name>","arguments":{<its arguments>}}.')
FORMATS = (HERMES_FORMAT,)  # detected by their opener's tag in the template; else JSON_FORMAT
_HEAD = re.compile(r'\{ ?"name": ?"([a-zA-Z0-9_-]+)", ?"arguments": ?')


def tool_format(template: str) -> ToolFormat:
    """The model's own call format where its template has one, else `JSON_FORMAT`."""
    for fmt in FORMATS:
        if fmt.opener.strip() in template:
            return fmt
    return JSON_FORMAT


@dataclass(frozen=True)
class ToolMode:
    """How a chat request's reply is read: `choice` is "auto", "required" or a function's name
    (`named`); `functions` the names the client declared; `format` how a call is written."""

    choice: str
    functions: tuple[str, ...]
    named: bool = False
    format: ToolFormat = JSON_FORMAT

    @property
    def known(self) -> str | None:
        """The function a reply must call, when there is only one it may."""
        if self.named:
            return self.choice
        if self.choice == "required" and len(self.functions) == 1:
            return self.functions[0]
        return None

    @property
    def allowed(self) -> tuple[str, ...]:
        """The functions the reply may call."""
        return (self.choice,) if self.named else self.functions

    @property
    def prefill(self) -> str:
        """The start of the reply the prompt already holds."""
        known = self.known
        return self.format.head(known, spaced=True) if known is not None else self.format.chooser(self.choice)


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON string, as OpenAI sends it

    def to_dict(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def new_call_id() -> str:
    """OpenAI's shape: `call_` and 24 random characters."""
    return "call_" + secrets.token_hex(12)


# ---- the prompt ----


@dataclass(frozen=True)
class TemplateCaps:
    """What a chat template renders by itself (found by rendering probes, like minja's caps)."""

    tools: bool = False  # the `tools` global
    tool_calls: bool = False  # an assistant message's `tool_calls`
    tool_responses: bool = False  # a `tool` message's content
    format: ToolFormat = JSON_FORMAT  # its own call format, where it has one


def tool_prompt(messages: list[dict], tools: list[dict], caps: TemplateCaps,
                mode: ToolMode) -> tuple[list[dict], list[dict] | None]:
    """`messages` ready for a template that will read the reply in `mode`, and the `tools`
    global to render them with (None where the template ignores it). A template that renders
    tools in its own call format needs no instruction of ours."""
    out = history(messages, caps, mode.format)
    if caps.tools and mode.format is not JSON_FORMAT:
        return out, tools
    fmt = mode.format
    text = fmt.auto_instruction if mode.choice == "auto" else fmt.required_instruction
    if not caps.tools:
        functions = [t.get("function", t) for t in tools]
        text = TOOLS_PREAMBLE + json.dumps(functions, ensure_ascii=False) + "\n\n" + text
    if out and out[0]["role"] == "system":
        out[0] = {**out[0], "content": f"{out[0].get('content') or ''}\n\n{text}"}
    else:
        out.insert(0, {"role": "system", "content": text})
    return out, (tools if caps.tools else None)


def history(messages: list[dict], caps: TemplateCaps, fmt: ToolFormat | None) -> list[dict]:
    """Past tool calls and results as the template should see them. With `fmt` (a tool may be
    called now): in the call format, or as the template renders `tool_calls` itself. Without
    (no tool may be called): in plain words, which hold no wrapper to imitate."""
    out = []
    names: dict[str, str] = {}
    for m in messages:
        calls = m.get("tool_calls")
        if calls:
            for c in calls:
                names[c["id"]] = c["function"]["name"]
            m = _calls_shown(m, calls, caps, fmt)
        elif m["role"] == "tool" and (fmt is None or not caps.tool_responses):
            m = _result_shown(m, names.get(m.get("tool_call_id") or "", ""), caps, fmt)
        out.append(m)
    return out


def _calls_shown(m: dict, calls: list[dict], caps: TemplateCaps, fmt: ToolFormat | None) -> dict:
    rest = {k: v for k, v in m.items() if k != "tool_calls"}
    said = m.get("content") or ""
    if fmt is None:
        words = "; ".join(_in_words(c["function"]["name"], arguments(c["function"]["arguments"])) for c in calls)
        return {**rest, "content": f"{said}\n\n(I called {words}.)".strip()}
    if caps.tool_calls:  # transformers' convention: the template gets arguments as an object
        return {**m, "content": said, "tool_calls": [
            {**c, "function": {**c["function"], "arguments": arguments(c["function"]["arguments"])}} for c in calls]}
    shown = "\n".join(fmt.call_text(c["function"]["name"], arguments(c["function"]["arguments"])) for c in calls)
    return {**rest, "content": f"{said}\n{shown}" if said else shown}


def _result_shown(m: dict, name: str, caps: TemplateCaps, fmt: ToolFormat | None) -> dict:
    content = m.get("content") or ""
    if fmt is None:
        text = f"{name} returned: {content}" if name else f"The tool returned: {content}"
        return {"role": "tool", "content": text} if caps.tool_responses else {"role": "user", "content": text}
    response = {"tool": name, "content": content}
    if m.get("tool_call_id"):
        response["tool_call_id"] = m["tool_call_id"]
    return {"role": "user", "content": json.dumps({"tool_response": response}, ensure_ascii=False)}


def _in_words(name: str, args: object) -> str:
    """`name(key="value", n=3)`: a call as code reads, with no JSON object in it."""
    if not isinstance(args, dict):
        return f"{name}({args!s})"
    return f"{name}(" + ", ".join(f"{k}={json.dumps(v, ensure_ascii=False)}" for k, v in args.items()) + ")"


def arguments(text: str) -> object:
    """A history call's `arguments` (a JSON string) as an object; text that is not JSON stays text."""
    try:
        return json.loads(text)
    except (TypeError, ValueError):
        return text


# ---- the grammar ----

_LITERAL = re.compile(r'"(?:\\.|[^"\\])*"|\[(?:\\.|[^\]\\])*\]')
_RULE = re.compile(r"^([a-zA-Z0-9-]+) ::=", re.MULTILINE)
_NAME = re.compile(r"(?<![\w-])[a-zA-Z0-9-]+(?![\w-])")
JSON_CHAR = ('[^"\\\\\\x7F\\x00-\\x1F] | "\\\\" (["\\\\/bfnrt] | "u" [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F] '
             '[0-9a-fA-F])')  # a JSON string's character, as the converter writes it (no control characters)


def prefixed(grammar: str, prefix: str) -> str:
    """`grammar` with every rule it defines renamed `prefix` + name (references too), so that
    several converted grammars can live in one."""
    defined = set(_RULE.findall(grammar))

    def rename(text: str) -> str:
        return _NAME.sub(lambda m: prefix + m.group(0) if m.group(0) in defined else m.group(0), text)

    out, at = [], 0
    for m in _LITERAL.finditer(grammar):
        out += [rename(grammar[at:m.start()]), m.group(0)]
        at = m.end()
    out.append(rename(grammar[at:]))
    return "".join(out)


def reply_grammar(mode: ToolMode, arguments_grammars: dict[str, str]) -> str:
    """The grammar of what the model writes after `mode.prefill`. `arguments_grammars` maps
    each function the reply may call to the converted grammar of its parameters."""
    fmt, prefill = mode.format, mode.prefill
    rules, branches = [], []
    for i, name in enumerate(mode.allowed):
        rules.append(prefixed(arguments_grammars[name], f"tandem-f{i}-"))
        rest = "" if mode.known is not None else fmt.head(name)[len(prefill):]  # the head past the prompt's part
        branches.append((json.dumps(rest) + " " if rest else "") + f'tandem-f{i}-root "}}"')
    if mode.choice == "auto":
        if fmt is JSON_FORMAT:
            branches.append(f'"{RESPONSE_KEY}\\":\\"" tandem-char* "\\"}}"')
            rules.append(f"tandem-char ::= {JSON_CHAR}")
        else:  # plain text that opens no call (a thinking block may)
            branches.append('([^<] | "<think>") tandem-any*')
            rules.append("tandem-any ::= [^\\x00]")
    return "\n".join(rules) + "\nroot ::= " + " | ".join(branches) + "\n"


# ---- reading the reply ----


@dataclass(frozen=True)
class TextDelta:
    text: str


@dataclass(frozen=True)
class CallStart:
    index: int
    call_id: str
    name: str


@dataclass(frozen=True)
class ArgumentsDelta:
    index: int
    text: str


ReplyEvent = TextDelta | CallStart | ArgumentsDelta


@dataclass
class ToolReplyReader:
    """One reply read as it streams (`feed`), then closed (`finish`): events in OpenAI's order.
    The reply's text is read after `mode.prefill`, which the prompt holds.

    States: `start` (not yet known whether the reply is text or a call), `text`, `string` (a
    text answer inside `{"response":"..."}`, decoded as it comes), `arguments` (a call's
    arguments being written)."""

    mode: ToolMode
    state: Literal["start", "text", "string", "arguments"] = "start"
    _buf: str = ""  # read and not yet settled: the head, or the start of an escape
    _args: str = ""  # arguments read so far
    _sent: int = 0  # of `_args`, characters already sent
    _call: CallStart | None = None
    content: str = ""  # the text answer so far
    _string_closed: bool = False  # a `{"response":"..."}` answer's string has ended

    def __post_init__(self) -> None:
        self._buf = self.mode.prefill  # a known function's call is announced at the first `feed`

    def feed(self, text: str) -> list[ReplyEvent]:
        """Events for the next piece of the reply's text."""
        if self.state == "text":
            self.content += text
            return [TextDelta(text)] if text else []
        self._buf += text
        if self.state == "string":
            return self._read_string()
        if self.state == "arguments":
            return self._read_arguments()
        return self._decide()

    def finish(self) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of the whole reply; a call cut short gives neither."""
        if self.state in ("text", "string"):
            return self.content, []
        if self.state == "start" or self._call is None:  # nothing yet, or a head cut short
            return None, []
        if not self._args.endswith("}"):
            return None, []
        args = self._args[:-1].rstrip()
        try:
            json.loads(args)
        except ValueError:
            return None, []
        return None, [ToolCall(self._call.call_id, self._call.name, args)]

    def remaining_arguments(self) -> str:
        """The arguments not yet sent, once the reply is whole and its call complete."""
        _, calls = self.finish()
        return calls[0].arguments[self._sent:] if calls else ""

    def _decide(self) -> list[ReplyEvent]:
        fmt, buf = self.mode.format, self._buf
        head = fmt.read_head(buf)
        if head is not None and head[0] in self.mode.allowed:
            self._call = CallStart(0, new_call_id(), head[0])
            self.state, self._buf = "arguments", buf[head[1]:]
            return [self._call, *self._read_arguments()]
        answer = '{"' + RESPONSE_KEY + '":"'
        if fmt is JSON_FORMAT and buf.startswith(answer):
            self.state, self._buf = "string", buf[len(answer):]
            return self._read_string()
        if self._may_open(buf):
            return []
        self.state, self.content, self._buf = "text", buf, ""  # plain text (or not the grammar's shape)
        return [TextDelta(buf)] if buf else []

    def _may_open(self, buf: str) -> bool:
        """Whether `buf` may still become a call's head or the start of an answer's string."""
        fmt = self.mode.format
        starts = [fmt.head(f) for f in self.mode.allowed]
        if fmt is JSON_FORMAT:
            starts.append('{"' + RESPONSE_KEY + '":"')
        return any(s.startswith(buf) or buf.startswith(s) for s in starts)

    def _read_string(self) -> list[ReplyEvent]:
        """A text answer's JSON string, decoded up to what may be the start of an escape; what
        follows its closing quote (`}`) is the wrapper's."""
        if self._string_closed:
            self._buf = ""
            return []
        text, used, self._string_closed = json_string_prefix(self._buf)
        self._buf = self._buf[used:]
        if not text:
            return []
        self.content += text
        return [TextDelta(text)]

    def _read_arguments(self) -> list[ReplyEvent]:
        self._args += self._buf
        self._buf = ""
        ready = len(self._args[:-1].rstrip())  # the last character may be the wrapper's closing brace
        if ready <= self._sent:
            return []
        piece, self._sent = self._args[self._sent:ready], ready
        return [ArgumentsDelta(0, piece)]


_STRING_PIECE = re.compile(r'[^"\\]+|\\u[0-9a-fA-F]{4}|\\["\\/bfnrt]')
_HIGH_SURROGATE = re.compile(r"\\u[dD][89abAB][0-9a-fA-F]{2}")
_LOW_SURROGATE = re.compile(r"\\u[dD][c-fC-F][0-9a-fA-F]{2}")


def json_string_prefix(raw: str) -> tuple[str, int, bool]:
    """The decoded start of a JSON string's body `raw` (after its opening quote): (text, raw
    characters used, whether the closing quote was reached). An escape cut short, or a high
    surrogate whose low half has not come yet, is left for the next piece; a lone half of a
    surrogate pair is U+FFFD."""
    out: list[str] = []
    at = 0
    while at < len(raw):
        if raw[at] == '"':
            return "".join(out), at + 1, True
        m = _STRING_PIECE.match(raw, at)
        if m is None:
            break  # an escape cut short
        piece, end = m.group(0), m.end()
        if _HIGH_SURROGATE.fullmatch(piece):
            low = _STRING_PIECE.match(raw, end)
            if low is None and raw[end:end + 1] != '"':
                break  # its low half may be still to come
            if low is not None and _LOW_SURROGATE.fullmatch(low.group(0)):
                piece, end = piece + low.group(0), low.end()
            else:
                piece = "\\ufffd"
        elif _LOW_SURROGATE.fullmatch(piece):
            piece = "\\ufffd"
        at = end
        out.append(json.loads(f'"{piece}"') if piece.startswith("\\") else piece)
    return "".join(out), at, False


def read_reply(text: str, mode: ToolMode) -> tuple[str | None, list[ToolCall]]:
    """A whole reply (after the prefill) → (content, calls), as the streamed reading gives them."""
    reader = ToolReplyReader(mode)
    reader.feed(text)
    return reader.finish()
