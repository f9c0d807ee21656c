"""Structured output and tool calls, the parts that need no llama.cpp: which JSON schema a
request's output must match, how tools reach a chat template, and how a reply becomes
`tool_calls`.

Tool calls follow llama-server's *generic* chat format (common/chat.cpp,
`common_chat_params_init_generic`), the one it uses for templates it has no dedicated parser
for:

- the model is told, in a system message, to "respond in JSON format, either with `tool_call`
  (a request to call tools) or with `response`";
- a template that renders `tools` itself gets them (the `tools` global, as transformers and
  llama-server's `--jinja` pass it); one that does not (SmolLM2's) gets them described in the
  system message, the way minja's tools polyfill does;
- the output is constrained (`output_schema` → a grammar, engine/llama/grammar.py) to
  `{"tool_call": {"name": ..., "arguments": {...}}}` (only that for `required` or a named
  function, where `arguments` is the function's own parameter schema), or, for `auto`, that or
  `{"response": "..."}`. One call per reply (llama-server's default, `parallel_tool_calls`
  false). Whatever the template, replies take this one shape, so one parser reads them all.
- assistant `tool_calls` in the history are written back into the message content in the same
  JSON shape when the template cannot render them (minja's tool-call polyfill), and `tool`
  messages whose content the template drops become user messages holding
  `{"tool_response": {...}}`.

Thread contract: pure functions of their inputs.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass

from engine.core.errors import InvalidRequest

# llama-server's generic format's instruction, in the system message (common/chat.cpp).
GENERIC_INSTRUCTION = ("Respond in JSON format, either with `tool_call` (a request to call tools) or with "
                       "`response` reply to the user's request")
# minja's tools polyfill, for templates that do not render `tools`.
TOOLS_PREAMBLE = "You can call any of the following tools to satisfy the user's requests: "


@dataclass(frozen=True)
class ToolMode:
    """How a chat request's reply is read: `choice` is "auto", "required" or a function's name
    (`named`); `functions` the names the client declared."""

    choice: str
    functions: tuple[str, ...]
    named: bool = False


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON string, as OpenAI sends it

    def to_dict(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class TemplateCaps:
    """What a chat template renders by itself (found by rendering probes, like minja's caps)."""

    tools: bool = False  # the `tools` global
    tool_calls: bool = False  # an assistant message's `tool_calls`
    tool_responses: bool = False  # a `tool` message's content


def function_schema(function: dict) -> dict:
    """A function's parameter schema (OpenAI: absent means no parameters)."""
    params = function.get("parameters")
    return params if params is not None else {"type": "object", "properties": {}}


def output_schema(functions: list[dict], mode: ToolMode, response_schema: dict | None = None) -> dict:
    """The JSON schema every reply must match (llama-server's generic format)."""
    chosen = [f for f in functions if not mode.named or f["name"] == mode.choice]
    calls = []
    for f in chosen:
        call = {"type": "object",
                "properties": {"name": {"type": "string", "const": f["name"]}, "arguments": function_schema(f)},
                "required": ["name", "arguments"]}
        if f.get("description"):
            call["description"] = f["description"]
        calls.append(call)
    tool_call = {"type": "object",
                 "properties": {"tool_call": calls[0] if len(calls) == 1 else {"anyOf": calls}},
                 "required": ["tool_call"]}
    if mode.choice != "auto":
        return tool_call
    response = {"type": "object", "properties": {"response": response_schema or {"type": "string"}},
                "required": ["response"]}
    return {"anyOf": [tool_call, response]}


def tool_prompt(messages: list[dict], tools: list[dict], caps: TemplateCaps) -> tuple[list[dict], list[dict] | None]:
    """`messages` ready for a template that will read the reply in the generic format, and the
    `tools` global to render them with (None where the template ignores it)."""
    text = GENERIC_INSTRUCTION
    if not caps.tools:
        text = TOOLS_PREAMBLE + json.dumps(tools, indent=2) + "\n\n" + text
    out = history(messages, caps)
    if out and out[0]["role"] == "system":
        out[0] = {**out[0], "content": f"{out[0].get('content') or ''}\n\n{text}"}
    else:
        out.insert(0, {"role": "system", "content": text})
    return out, (tools if caps.tools else None)


def history(messages: list[dict], caps: TemplateCaps) -> list[dict]:
    """Assistant tool calls and tool results as a template that cannot render them would
    show them: as message content (minja's polyfills), in the reply's own JSON shape."""
    out = []
    names = {}
    for m in messages:
        calls = m.get("tool_calls")
        if calls:
            for c in calls:
                names[c["id"]] = c["function"]["name"]
            if not caps.tool_calls:
                shown = [{"name": c["function"]["name"], "arguments": _arguments(c["function"]["arguments"]),
                          "id": c["id"]} for c in calls]
                body: dict = {"tool_call": shown[0]} if len(shown) == 1 else {"tool_calls": shown}
                if m.get("content"):
                    body["content"] = m["content"]
                m = {k: v for k, v in m.items() if k != "tool_calls"}
                m["content"] = json.dumps(body, ensure_ascii=False, indent=2)
            else:  # transformers' convention: the template gets arguments as an object
                m = {**m, "content": m.get("content") or "",
                     "tool_calls": [{**c, "function": {**c["function"],
                                                       "arguments": _arguments(c["function"]["arguments"])}}
                                    for c in calls]}
        elif m["role"] == "tool" and not caps.tool_responses:
            response = {"tool": names.get(m.get("tool_call_id"), ""), "content": m.get("content") or ""}
            if m.get("tool_call_id"):
                response["tool_call_id"] = m["tool_call_id"]
            m = {"role": "user", "content": json.dumps({"tool_response": response}, ensure_ascii=False, indent=2)}
        out.append(m)
    return out


def _arguments(arguments: str):
    """A history call's `arguments` (a JSON string) as an object; text that is not JSON stays text."""
    try:
        return json.loads(arguments)
    except (TypeError, ValueError):
        return arguments


def parse_reply(text: str, mode: ToolMode) -> tuple[str | None, list[ToolCall]]:
    """A whole reply in the generic format → (content, tool calls). Raises `InvalidRequest`
    only for text that is not the shape the grammar allowed (a reply cut by `max_tokens`);
    the caller decides what to show then."""
    try:
        obj = json.loads(text)
    except ValueError as e:
        raise InvalidRequest(f"the reply is not complete JSON: {e}") from None
    if isinstance(obj, dict) and isinstance(obj.get("tool_call"), dict):
        call = obj["tool_call"]
        name, args = call.get("name"), call.get("arguments")
        if name in mode.functions:
            return None, [ToolCall(new_call_id(), name, json.dumps(args, ensure_ascii=False))]
    if isinstance(obj, dict) and "response" in obj:
        response = obj["response"]
        return (response if isinstance(response, str) else json.dumps(response, ensure_ascii=False)), []
    raise InvalidRequest("the reply is neither a tool call nor a response")


def new_call_id() -> str:
    """OpenAI's shape: `call_` and 24 random characters."""
    return "call_" + secrets.token_hex(12)
