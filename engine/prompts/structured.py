"""Structured output and tool calls, the schema side (no llama.cpp): the pass that makes a
client's schema (a function's parameters, a `response_format`) convertible to a grammar
(engine/prompts/tool_calls.py has the call format, the prompt and the reader).

- each function's parameter schema keeps its own `$defs` / `definitions` and local `$ref`s
  (every pydantic model with a nested model has them), which would point at nothing once the
  schema is converted beside others: `standalone_schema` / `lift_definitions` move them to the
  top-level `$defs`, renamed per function (`defs-<function>-<name>`) so that two tools'
  definitions never collide, and rewrite the `$ref`s to match (a `$ref` to the schema's own
  root, or to a path inside it, points at a lifted copy of the whole schema). OpenAPI's
  `nullable: true` becomes a null branch. `response_format` schemas go through the same pass.

Thread contract: pure functions of their inputs.
"""

from __future__ import annotations

import copy
import re
from typing import Any


def function_schema(function: dict) -> dict:
    """A function's parameter schema (OpenAI: absent means no parameters)."""
    params = function.get("parameters")
    return params if params is not None else {"type": "object", "properties": {}}


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
