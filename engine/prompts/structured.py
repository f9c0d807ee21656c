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
- each function's parameter schema keeps its own `$defs` / `definitions` and local `$ref`s
  (every pydantic model with a nested model has them), which would point at nothing once the
  schema sits under `tool_call.arguments`: `standalone_schema` / `lift_definitions` move them
  to the wrapper's top-level `$defs`, renamed per function (`defs-<function>-<name>`) so that
  two tools' definitions never collide, and rewrite the `$ref`s to match (a `$ref` to the
  schema's own root, or to a path inside it, points at a lifted copy of the whole schema).
  OpenAPI's `nullable: true` becomes a null branch. `response_format` schemas go through the
  same pass.
- assistant `tool_calls` in the history are written back into the message content in the same
  JSON shape when the template cannot render them (minja's tool-call polyfill), and `tool`
  messages whose content the template drops become user messages holding
  `{"tool_response": {...}}`.

Thread contract: pure functions of their inputs.
"""

from __future__ import annotations

import copy
import json
import re
import secrets
from dataclasses import dataclass
from typing import Any

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
    """The JSON schema every reply must match (llama-server's generic format), every nested
    schema's definitions lifted to its top level (`lift_definitions`)."""
    chosen = [f for f in functions if not mode.named or f["name"] == mode.choice]
    defs: dict = {}
    calls = []
    for f in chosen:
        arguments = lift_definitions(function_schema(f), f["name"], defs)
        call = {"type": "object",
                "properties": {"name": {"type": "string", "const": f["name"]}, "arguments": arguments},
                "required": ["name", "arguments"]}
        if f.get("description"):
            call["description"] = f["description"]
        calls.append(call)
    tool_call = {"type": "object",
                 "properties": {"tool_call": calls[0] if len(calls) == 1 else {"anyOf": calls}},
                 "required": ["tool_call"]}
    if mode.choice != "auto":
        return _with_defs(tool_call, defs)
    response_body = lift_definitions(response_schema, "response", defs) if response_schema else {"type": "string"}
    response = {"type": "object", "properties": {"response": response_body}, "required": ["response"]}
    return _with_defs({"anyOf": [tool_call, response]}, defs)


def standalone_schema(schema: dict, name: str = "schema") -> dict:
    """`schema` with its definitions at its top level under names the grammar converter can
    resolve (`lift_definitions`): what a `response_format` or one function's parameters are
    converted from."""
    defs: dict = {}
    return _with_defs(lift_definitions(schema, name, defs), defs)


def lift_definitions(schema: dict, owner: str, defs: dict) -> dict:
    """`schema` without its `$defs` / `definitions`, which go into `defs` (the top level's)
    as `defs-<owner>-<name>`; every local `$ref` in it rewritten to match. A `$ref` to the
    root (`#`) or to another path inside the schema points into a copy of the whole schema
    kept in `defs` as `defs-<owner>` (the body itself stays where it was). `nullable: true` (OpenAPI's) becomes a null branch.
    Names are unique within `defs`, so many schemas can share one top level."""
    if not isinstance(schema, dict):
        return schema
    lift = _Lift(schema, owner, defs)
    body = lift.rewrite(schema)
    lift.store(body)
    return body


class _Lift:
    """One schema's definitions on their way into a shared `defs` (`lift_definitions`): their
    names there are reserved first, then the body is rewritten, then they are stored."""

    def __init__(self, schema: dict, owner: str, defs: dict) -> None:
        self.defs = defs
        self.own: dict[str, str] = {}  # a definition's name here -> its name in `defs`
        for section in ("$defs", "definitions"):
            for name in (schema.get(section) or {}):
                if name not in self.own:
                    self.own[name] = _fresh(f"defs-{owner}-{name}", defs)
        self.root = _fresh(f"defs-{owner}", defs) if _refers_inside(schema) else None

    def ref(self, target: str) -> str:
        """A local `$ref` as it reads once the definitions are lifted."""
        pointer = target[1:]
        parts = pointer.split("/")[1:] if pointer.startswith("/") else []
        if len(parts) >= 2 and parts[0] in ("$defs", "definitions"):
            name = parts[1].replace("~1", "/").replace("~0", "~")
            if name in self.own:
                return "#/$defs/" + "/".join([self.own[name], *parts[2:]])
        if self.root is None:  # only refs into definitions, and this one is not among them
            return target
        return "#/$defs/" + self.root + pointer if pointer else "#/$defs/" + self.root

    def rewrite(self, node: Any) -> Any:
        """`node` with its local `$ref`s rewritten and `nullable` as a null branch."""
        if isinstance(node, list):
            return [self.rewrite(x) for x in node]
        if not isinstance(node, dict):
            return node
        out: dict[str, Any] = {}
        for key, value in node.items():
            if key == "$ref" and isinstance(value, str) and value.startswith("#"):
                out[key] = self.ref(value)
            elif key in _MAPS:  # a map of names to schemas: the names are data, not keywords
                out[key] = {k: self.rewrite(v) for k, v in value.items()} if isinstance(value, dict) else value
            elif key in _VALUES:
                out[key] = value
            else:
                out[key] = self.rewrite(value)
        if isinstance(out.get("nullable"), bool) and out.pop("nullable"):
            out = {"anyOf": [out, {"type": "null"}]}
        return out

    def store(self, body: dict) -> None:
        """Move the rewritten body's definitions into `defs`, and a copy of the body where a
        `$ref` points inside it."""
        for section in ("$defs", "definitions"):
            for name, sub in (body.pop(section, None) or {}).items():
                if name in self.own and self.defs.get(self.own[name]) is None:
                    self.defs[self.own[name]] = sub
        if self.root is not None:  # the body stays in place (the converter registers only the refs it can
            self.defs[self.root] = copy.deepcopy(body)  # reach from the root's keys, never from behind a root `$ref`)


_RULE_CHARS = re.compile(r"[^a-zA-Z0-9-]+")
_MAPS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")  # name -> schema
_VALUES = ("const", "enum", "default", "examples")  # JSON values, not schemas


def _fresh(name: str, taken: dict) -> str:
    """`name` with characters the grammar's rule names cannot hold replaced, and made unique
    in `taken` (a placeholder reserves it until the definition is stored)."""
    base = _RULE_CHARS.sub("-", name)
    key, i = base, 1
    while key in taken:
        key, i = f"{base}-{i}", i + 1
    taken[key] = None
    return key


def _refers_inside(schema) -> bool:
    """Whether `schema` holds a local `$ref` to something other than one of its definitions."""
    return any(not re.match(r"^#/(\$defs|definitions)/[^/]+", target) for target in _local_refs(schema))


def _local_refs(node):
    """The local `$ref`s of a schema, where they are keywords (not inside values, not names)."""
    if isinstance(node, list):
        for x in node:
            yield from _local_refs(x)
        return
    if not isinstance(node, dict):
        return
    for key, value in node.items():
        if key == "$ref" and isinstance(value, str) and value.startswith("#"):
            yield value
        elif key in _MAPS and isinstance(value, dict):
            for sub in value.values():
                yield from _local_refs(sub)
        elif key not in _VALUES:
            yield from _local_refs(value)


def _with_defs(schema: dict, defs: dict) -> dict:
    live = {k: v for k, v in defs.items() if v is not None}
    if not live:
        return schema
    return {**schema, "$defs": live}


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
