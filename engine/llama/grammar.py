"""JSON schemas → GBNF grammars for llama.cpp's grammar sampler, and checking a grammar parses.

The conversion is llama-cpp-python's own (`llama_cpp.llama_grammar.json_schema_to_gbnf`, a port
of llama.cpp's `json_schema_to_grammar`): we write no converter. One fix on its output: its
string character rule (`[^"\\]`) lets raw control characters into strings, which JSON forbids
(Python's `json.loads` refuses them); llama.cpp's newer converter excludes them, and so do we,
by putting that rule's text in place (`_strict_strings`). What the converter cannot take (an unknown `type`, a `$ref` it cannot resolve, a
`pattern` without `^…$`) it reports with an `AssertionError` or a `ValueError`; that reason is
passed to the client as an `InvalidRequest`.

Costs stay with the sender. A grammar's per-token work in llama.cpp grows with its stacks
(a 20,000-alternative grammar ran past 90 s and stalled its backend's other sequences), so
every grammar, raw or converted, is measured first (`measure`: one pass over its text) and
refused with a 400 naming the limit: `MAX_GRAMMAR_BYTES`, `MAX_ALTERNATIVES` (`|` outside
literals), `MAX_STATES` (literal characters, classes, references and repetitions, llama.cpp's
grammar elements); schemas also by `MAX_ENUM` values before converting. Impossible schemas
(`minLength` > `maxLength` and the like, an empty `enum`) and grammars with a character class
that matches nothing (a pattern's `[z-a]`) are refused as unsatisfiable, and `check` asks
llama.cpp's own sampler whether any token can start the reply, timing that full pass over the
vocabulary (a grammar chain pays one whenever the model's first choice is not allowed):
over `MAX_PASS_MS` of CPU it is refused too. `check` caches its verdict by
the grammar's hash, so a grammar is compiled and tried once (on the request's parsing thread,
off the backend's step loop), not once per request.

Thread contract: pure functions but `check`'s cache (under its lock); `check` creates and
frees a llama.cpp sampler on the calling thread (the vocabulary is read-only, any thread may).
"""

from __future__ import annotations

import collections
import ctypes
import hashlib
import json
import re
import threading
import time
from dataclasses import dataclass
from typing import TypeGuard

import numpy as np
from llama_cpp.llama_grammar import json_schema_to_gbnf

from engine.core.errors import InvalidRequest

from . import gbnf_cost, lc

ROOT = b"root"
# The converter writes a bound of n as n copies of a rule (`minItems: 10**9` would build a
# gigabyte string): bounds above this are refused before converting, in the schema and in its
# patterns' `{m,n}` quantifiers.
MAX_REPEAT = 1000
_COUNTS = {"minItems", "maxItems", "minLength", "maxLength", "minProperties", "maxProperties",
           "minContains", "maxContains"}
_QUANTIFIER = re.compile(r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")
# Parse stacks one advance of llama.cpp's grammar may create (`gbnf_cost.stacks`): its per-token
# work grows with their square (one chunk of a first pass took 0.9 s at 1,000 stacks, 0.17 s at
# 500 on this 2-core machine), and nested repetitions of what may match nothing multiply them.
MAX_STACKS = 512
MAX_GRAMMAR_BYTES = 64 << 10  # a grammar's text (raw, or converted from a schema)
MAX_ALTERNATIVES = 256  # `|` in the whole grammar: 1,000 cost 3.9 s a full pass over SmolLM2's vocabulary
MAX_STATES = 32768  # grammar elements (literal characters, classes, references), repetitions expanded
MAX_ENUM = 128  # values of one `enum` in a schema (256 cost 70 ms of CPU a full pass)
MAX_PASS_MS = 100  # CPU ms one full pass of the grammar over the vocabulary may take, measured at its start
_PASS_CHUNK = 2048  # candidates between two looks at that pass's CPU time
_PAIRS = (("minLength", "maxLength"), ("minItems", "maxItems"), ("minProperties", "maxProperties"),
          ("minimum", "maximum"), ("minContains", "maxContains"))
_LOOSE_CHAR = 'char ::= [^"\\\\] |'
_STRICT_CHAR = 'char ::= [^"\\\\\\x7F\\x00-\\x1F] |'


def schema_grammar(schema: dict, *, param: str = "response_format") -> str:
    """`schema` (a JSON Schema) as a GBNF grammar; `InvalidRequest` with the converter's reason."""
    schema = _root_ref(schema)
    try:
        text = json.dumps(schema)
    except (TypeError, ValueError) as e:
        raise InvalidRequest(f"{param}: the JSON schema is not JSON: {e}", param=param) from None
    if len(text) > MAX_GRAMMAR_BYTES:
        raise InvalidRequest(f"{param}: the JSON schema is {len(text)} bytes; this server takes at most "
                             f"{MAX_GRAMMAR_BYTES} (MAX_GRAMMAR_BYTES)", param=param)
    _check_bounds(schema, param)
    try:
        grammar = _strict_strings(json_schema_to_gbnf(text))
    except RecursionError:
        raise InvalidRequest(f"{param}: the JSON schema nests too deeply to convert to a grammar",
                             param=param) from None
    except KeyError as e:  # a `$ref` it did not resolve
        raise InvalidRequest(f"{param}: the JSON schema's $ref {str(e.args[0])[:100]!r} cannot be resolved (refer "
                             f"to $defs or definitions of this schema as #/$defs/NAME)", param=param) from None
    except Exception as e:  # the converter asserts; its message is the reason
        reason = str(e) or type(e).__name__
        raise InvalidRequest(f"{param}: the JSON schema cannot be turned into a grammar: {reason}",
                             param=param) from None
    measure(grammar, param=param, what="the JSON schema's grammar")
    return grammar


def _root_ref(schema):
    """A root `$ref` beside `$defs` as a one-branch `anyOf`: the converter resolves the root's
    `$ref` but never looks into its siblings, so a recursive `$defs` schema (`#/$defs/node`
    referring to itself) failed with its internal `KeyError`."""
    ref = schema.get("$ref") if isinstance(schema, dict) else None
    if isinstance(ref, str) and ref.startswith(("#/$defs/", "#/definitions/")) and len(schema) > 1 \
            and "anyOf" not in schema:
        rest = {k: v for k, v in schema.items() if k != "$ref"}
        return {**rest, "anyOf": [{"$ref": ref}]}
    return schema


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
        enum = schema.get("enum")
        if isinstance(enum, list) and len(enum) > MAX_ENUM:
            raise InvalidRequest(f"{param}: an enum of {len(enum)} values; this server takes at most {MAX_ENUM} "
                                 f"(MAX_ENUM)", param=param)
        if isinstance(enum, list) and not enum:
            raise InvalidRequest(f"{param}: an empty enum: no value can satisfy the schema", param=param)
        for low, high in _PAIRS:
            a, b = schema.get(low), schema.get(high)
            if _number(a) and _number(b) and a > b:
                raise InvalidRequest(f"{param}: {low}={a} is more than {high}={b}: no value can satisfy the schema",
                                     param=param)
        a, b = schema.get("exclusiveMinimum"), schema.get("exclusiveMaximum")
        if _number(a) and _number(b) and a >= b:
            raise InvalidRequest(f"{param}: exclusiveMinimum={a} is not below exclusiveMaximum={b}: no value can "
                                 f"satisfy the schema", param=param)
        for key, value in schema.items():
            if key in _COUNTS and isinstance(value, (int, float)) and not isinstance(value, bool) \
                    and value > MAX_REPEAT:
                raise InvalidRequest(f"{param}: {key}={value} is more than this server turns into a grammar "
                                     f"(at most {MAX_REPEAT})", param=param)
            if key == "pattern" and isinstance(value, str):
                check_pattern(value, param)
            _check_bounds(value, param, depth + 1)
    elif isinstance(schema, list):
        for item in schema:
            _check_bounds(item, param, depth + 1)


def check_pattern(pattern: str, param: str) -> None:
    """A schema's `pattern`, before the converter writes it out: well formed (balanced groups
    and classes: `^((((a$` was accepted as `a`), and the product of its nested repetitions'
    bounds within `MAX_REPEAT`, llama.cpp's own rule for its `{m,n}` (`*`, `+`, `?` count 1).
    `^(([a-z]{0,999}){0,999}){0,999}$` is 230 bytes of request and ~10^9 parse stacks."""
    def bad(why: str) -> InvalidRequest:
        return InvalidRequest(f"{param}: the pattern {pattern[:60]!r} {why}", param=param)

    frames = [1]  # per open group: the largest repetition product inside it
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        if c == "\\":
            i += 2
            frames[-1] = max(frames[-1], _repeat_at(pattern, i, bad))
            continue
        if c == "[":
            j = i + 1 + (pattern.startswith("^", i + 1)) + (pattern.startswith("]", i + 1))
            while j < n and pattern[j] != "]":
                j += 2 if pattern[j] == "\\" else 1
            if j >= n:
                raise bad("has a [ without its ]")
            i = j + 1
            frames[-1] = max(frames[-1], _repeat_at(pattern, i, bad))
            continue
        if c == "(":
            frames.append(1)
        elif c == ")":
            if len(frames) == 1:
                raise bad("has a ) without its (")
            inner = frames.pop() * _repeat_at(pattern, i + 1, bad)
            if inner > MAX_REPEAT:
                raise bad(f"nests repetitions of {inner} in all; this server turns at most {MAX_REPEAT} into a "
                          f"grammar (MAX_REPEAT)")
            frames[-1] = max(frames[-1], inner)
        elif c in "*+?" and (i == 0 or pattern[i - 1] in "(|"):
            raise bad(f"has a {c} with nothing to repeat")
        else:
            frames[-1] = max(frames[-1], _repeat_at(pattern, i + 1, bad) if c not in "*+?{}|^$" else 1)
        i += 1
    if len(frames) > 1:
        raise bad("has a ( without its )")


def _repeat_at(pattern: str, i: int, bad) -> int:
    """The bound of a `{m,n}` quantifier at `i` (1 for none, `*`, `+`, `?`); refused above
    `MAX_REPEAT` or reversed."""
    m = _QUANTIFIER.match(pattern, i)
    if not m:
        return 1
    low, high = int(m.group(1)), m.group(2)
    top = low if high is None else (int(high) if high else low)
    if top > MAX_REPEAT or (high and low > int(high)):
        raise bad(f"repeats {m.group(0)}: at most {MAX_REPEAT} (MAX_REPEAT), lower bound first")
    return max(top, 1)


def _strict_strings(grammar: str) -> str:
    return grammar.replace(_LOOSE_CHAR, _STRICT_CHAR)


def _number(v) -> TypeGuard[float]:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


@dataclass(frozen=True)
class GrammarSize:
    """What `measure` counted in a grammar."""

    bytes: int
    rules: int
    alternatives: int
    states: int


_NAME = re.compile(r"[A-Za-z0-9_-]+")
_REPEAT = re.compile(r"\{\s*(\d*)\s*(,\s*(\d*)\s*)?\}")


def measure(grammar: str, *, param: str = "grammar", what: str = "the grammar") -> GrammarSize:
    """Count a GBNF grammar's rules, alternatives and elements in one pass over its text, and
    refuse it (`InvalidRequest` naming the limit) when it is over a limit or holds a character
    class that matches nothing. Not a parser: llama.cpp's (`check`) has the last word."""
    size = len(grammar.encode("utf-8"))
    if size > MAX_GRAMMAR_BYTES:
        raise InvalidRequest(f"{param}: {what} is {size} bytes; this server takes at most {MAX_GRAMMAR_BYTES} "
                             f"(MAX_GRAMMAR_BYTES)", param=param)
    rules = alternatives = states = 0
    last = 1  # elements of the last item, which a repetition multiplies
    i, n = 0, len(grammar)
    while i < n:
        c = grammar[i]
        if c == "#":
            j = grammar.find("\n", i)
            i = n if j < 0 else j + 1
            continue
        if c == '"':
            j, count = i + 1, 0
            while j < n and grammar[j] != '"':
                j += 2 if grammar[j] == "\\" else 1
                count += 1
            last = max(count, 1)
            states += last
            i = j + 1
            continue
        if c == "[":
            j = i + 1
            negated = j < n and grammar[j] == "^"
            chars: list[str] = []
            j += 1 if negated else 0
            while j < n and grammar[j] != "]":
                if grammar[j] == "\\" and j + 1 < n:
                    chars.append(grammar[j:j + 2])
                    j += 2
                else:
                    chars.append(grammar[j])
                    j += 1
            if not negated and _class_is_empty(chars):
                raise InvalidRequest(f"{param}: {what} has a character class that matches nothing "
                                     f"({grammar[i:j + 1][:40]}): no text can satisfy it", param=param)
            last = 1
            states += 1
            i = j + 1
            continue
        if c == "|":
            alternatives += 1
        elif c == ":" and grammar.startswith("::=", i):
            rules += 1
            i += 3
            continue
        elif c == "{":
            m = _REPEAT.match(grammar, i)
            if m:
                high = max(int(g) for g in (m.group(1), m.group(3)) if g) if (m.group(1) or m.group(3)) else 0
                if high > MAX_REPEAT:
                    raise InvalidRequest(f"{param}: {what} repeats an item {high} times; this server takes at most "
                                         f"{MAX_REPEAT} (MAX_REPEAT)", param=param)
                states += last * max(high - 1, 0)
                i = m.end()
                continue
        elif c == ".":
            last = 1
            states += 1
        else:
            m = _NAME.match(grammar, i)
            if m:
                last = 1
                states += 1
                i = m.end()
                continue
        i += 1
        if alternatives > MAX_ALTERNATIVES:
            raise InvalidRequest(f"{param}: {what} has more than {MAX_ALTERNATIVES} alternatives ('|'); this "
                                 f"server takes at most {MAX_ALTERNATIVES} (MAX_ALTERNATIVES)", param=param)
    if states > MAX_STATES:
        raise InvalidRequest(f"{param}: {what} has {states} elements (literal characters, classes, references, "
                             f"repetitions expanded); this server takes at most {MAX_STATES} (MAX_STATES)",
                             param=param)
    _check_stacks(grammar, param, what)
    return GrammarSize(size, rules, alternatives, states)


def _check_stacks(grammar: str, param: str, what: str) -> None:
    """Refuse a grammar one advance of which may create more than `MAX_STACKS` parse stacks."""
    try:
        fan = gbnf_cost.stacks(grammar, MAX_STACKS)
    except gbnf_cost.Unreadable:
        return  # llama.cpp's parser refuses it (`check`)
    if fan > MAX_STACKS:
        raise InvalidRequest(f"{param}: {what} can make llama.cpp follow more than {MAX_STACKS} parses at once "
                             f"(MAX_STACKS): repetitions of what may match nothing, nested; bound or remove "
                             f"the inner ones", param=param)


def _class_is_empty(chars: list[str]) -> bool:
    """A non-negated class whose every item is a reversed range (`[z-a]`): it matches nothing."""
    if not chars:
        return True
    k, ranges = 0, 0
    while k < len(chars):
        if k + 2 < len(chars) and chars[k + 1] == "-":
            lo, hi = _char(chars[k]), _char(chars[k + 2])
            if lo is None or hi is None or lo <= hi:
                return False
            ranges += 1
            k += 3
        else:
            return False  # a single character: it matches
    return ranges > 0


def _char(item: str) -> int | None:
    if len(item) == 1:
        return ord(item)
    if item.startswith("\\") and len(item) == 2 and item[1] not in "xuUntr":
        return ord(item[1])
    return None  # an escape whose value this scan does not decode: assume it matches


class _Verdicts:
    """Grammar hash → None (takes it) or the refusal's message and param, most recent 256."""

    def __init__(self, size: int = 256):
        self._lock = threading.Lock()
        self._seen: collections.OrderedDict[bytes, tuple[str, str | None] | None] = collections.OrderedDict()
        self._size = size

    def get(self, key: bytes):
        with self._lock:
            if key in self._seen:
                self._seen.move_to_end(key)
                return True, self._seen[key]
            return False, None

    def put(self, key: bytes, verdict) -> None:
        with self._lock:
            self._seen[key] = verdict
            while len(self._seen) > self._size:
                self._seen.popitem(last=False)


_VERDICTS = _Verdicts()


def check(vocab, grammar: str, *, param: str = "grammar", n_vocab: int = 0) -> None:
    """Raise `InvalidRequest` unless `grammar` is within the limits (`measure`), llama.cpp's
    grammar parser takes it (its own error goes to the log) and, given `n_vocab`, some token
    can start a reply under it. The verdict is cached by the grammar's hash (and vocabulary)."""
    key = hashlib.sha256(grammar.encode("utf-8", "surrogatepass")).digest() + str(vocab).encode() + \
        str(n_vocab).encode()
    seen, verdict = _VERDICTS.get(key)
    if not seen:
        try:
            _compile(vocab, grammar, param, n_vocab)
            verdict = None
        except InvalidRequest as e:
            verdict = (e.message, e.param)
        _VERDICTS.put(key, verdict)
    if verdict is not None:
        message, where = verdict
        raise InvalidRequest(message, param=where)


def _compile(vocab, grammar: str, param: str, n_vocab: int) -> None:
    measure(grammar, param=param)
    ptr = lc.llama_sampler_init_grammar(vocab, grammar.encode("utf-8"), ROOT)
    if not ptr:
        raise InvalidRequest(f"{param}: llama.cpp cannot parse this grammar (GBNF)", param=param)
    try:
        if n_vocab > 0:
            allowed = _first_pass(ptr, n_vocab, MAX_PASS_MS / 1000, param)
            if not allowed:
                raise InvalidRequest(f"{param}: no token of this model's vocabulary can start a reply under this "
                                     f"grammar: no text satisfies it", param=param)
    finally:
        lc.llama_sampler_free(ptr)


def _first_pass(sampler, n_vocab: int, budget_s: float, param: str) -> bool:
    """Whether the grammar sampler leaves any token (an end token counts) at its start, from
    one pass over the vocabulary in chunks; refused (`InvalidRequest`) as soon as the pass has
    taken more than `budget_s` of this thread's CPU, so a costly grammar costs its check no
    more than that."""
    cur = np.zeros(n_vocab, np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)]))
    cur["id"] = np.arange(n_vocab, dtype=np.int32)
    t0 = time.thread_time()
    for start in range(0, n_vocab, _PASS_CHUNK):
        k = min(_PASS_CHUNK, n_vocab - start)
        data = ctypes.cast(cur.ctypes.data + start * cur.itemsize, ctypes.POINTER(lc.llama_token_data))
        lc.llama_sampler_apply(sampler, ctypes.byref(lc.llama_token_data_array(data, k, -1, False)))
        spent = time.thread_time() - t0
        if spent > budget_s:
            done = (start + k) / n_vocab
            raise InvalidRequest(f"{param}: checking this grammar against the model's vocabulary took more than "
                                 f"{budget_s * 1000:.0f} ms of CPU by {done:.0%} of it, which a reply may pay at "
                                 f"every token; this server allows {MAX_PASS_MS} ms (MAX_PASS_MS): use fewer "
                                 f"alternatives", param=param)
    return bool(np.isfinite(cur["logit"]).any())
