"""JSON schemas → GBNF grammars for llama.cpp's grammar sampler, and checking a grammar parses.

The conversion is llama-cpp-python's own (`llama_cpp.llama_grammar.json_schema_to_gbnf`, a port
of llama.cpp's `json_schema_to_grammar`): we write no converter. One fix on its output: its
string character rule (`[^"\\]`) lets raw control characters into strings, which JSON forbids
(Python's `json.loads` refuses them); llama.cpp's newer converter excludes them, and so do we,
by putting that rule's text in place (`_strict_strings`). What the converter cannot take (an unknown `type`, a `$ref` it cannot resolve, a
`pattern` without `^…$`) it reports with an `AssertionError` or a `ValueError`; that reason is
passed to the client as an `InvalidRequest`.

Thread contract: pure functions; `check` creates and frees a llama.cpp sampler on the calling
thread (the vocabulary is read-only, any thread may).
"""

from __future__ import annotations

import json
import re

from llama_cpp.llama_grammar import json_schema_to_gbnf

from engine.core.errors import InvalidRequest
from . import lc

ROOT = b"root"
# The converter writes a bound of n as n copies of a rule (`minItems: 10**9` would build a
# gigabyte string): bounds above this are refused before converting, in the schema and in its
# patterns' `{m,n}` quantifiers.
MAX_REPEAT = 1000
_COUNTS = {"minItems", "maxItems", "minLength", "maxLength", "minProperties", "maxProperties",
           "minContains", "maxContains"}
_QUANTIFIER = re.compile(r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")
_LOOSE_CHAR = 'char ::= [^"\\\\] |'
_STRICT_CHAR = 'char ::= [^"\\\\\\x7F\\x00-\\x1F] |'


def schema_grammar(schema: dict, *, param: str = "response_format") -> str:
    """`schema` (a JSON Schema) as a GBNF grammar; `InvalidRequest` with the converter's reason."""
    try:
        text = json.dumps(schema)
    except (TypeError, ValueError) as e:
        raise InvalidRequest(f"{param}: the JSON schema is not JSON: {e}", param=param) from None
    _check_bounds(schema, param)
    try:
        return _strict_strings(json_schema_to_gbnf(text))
    except RecursionError:
        raise InvalidRequest(f"{param}: the JSON schema nests too deeply to convert to a grammar",
                             param=param) from None
    except Exception as e:  # noqa: BLE001  (the converter asserts; its message is the reason)
        reason = str(e) or type(e).__name__
        raise InvalidRequest(f"{param}: the JSON schema cannot be turned into a grammar: {reason}",
                             param=param) from None


def object_grammar() -> str:
    """Any JSON object (OpenAI's `json_object`): the converter's grammar for {"type": "object"},
    as llama-server does, not llama.cpp's json.gbnf, whose `ws` allows a newline and up to 20
    blanks after every token, which 135M-parameter models fill."""
    return schema_grammar({"type": "object"})


def _check_bounds(schema, param: str, depth: int = 0) -> None:
    """Refuse repetition bounds the converter would expand into an enormous grammar."""
    if depth > 64:
        raise InvalidRequest(f"{param}: the JSON schema nests too deeply to convert to a grammar", param=param)
    if isinstance(schema, dict):
        for key, value in schema.items():
            if key in _COUNTS and isinstance(value, (int, float)) and not isinstance(value, bool) \
                    and value > MAX_REPEAT:
                raise InvalidRequest(f"{param}: {key}={value} is more than this server turns into a grammar "
                                     f"(at most {MAX_REPEAT})", param=param)
            if key == "pattern" and isinstance(value, str):
                for m in _QUANTIFIER.finditer(value):
                    if any(g and int(g) > MAX_REPEAT for g in m.groups()):
                        raise InvalidRequest(f"{param}: the pattern's repetition {m.group(0)} is more than this "
                                             f"server turns into a grammar (at most {MAX_REPEAT})", param=param)
            _check_bounds(value, param, depth + 1)
    elif isinstance(schema, list):
        for item in schema:
            _check_bounds(item, param, depth + 1)


def _strict_strings(grammar: str) -> str:
    return grammar.replace(_LOOSE_CHAR, _STRICT_CHAR)


def check(vocab, grammar: str, *, param: str = "grammar") -> None:
    """Raise `InvalidRequest` unless llama.cpp's grammar parser takes `grammar` (its own
    error goes to the log; a grammar the sampler cannot build would fail on the worker)."""
    ptr = lc.llama_sampler_init_grammar(vocab, grammar.encode("utf-8"), ROOT)
    if not ptr:
        raise InvalidRequest(f"{param}: llama.cpp cannot parse this grammar (GBNF)", param=param)
    lc.llama_sampler_free(ptr)
