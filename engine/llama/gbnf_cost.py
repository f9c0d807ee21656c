"""How many parse stacks a GBNF grammar can make llama.cpp hold at once, before llama.cpp sees it.

llama.cpp's grammar keeps one stack per way the text so far can go on, and advancing a stack
expands every alternative and every element that may match nothing (`x?`, `x*`, `x{0,n}`).
Nested repetitions of something that may match nothing multiply: the converter turns the
pattern `^(([a-z]{0,999}){0,999}){0,999}$` into a 30 KB grammar whose start fans out to ~10^9
stacks, and one `llama_sampler_apply` call spun for 25 minutes on it. llama.cpp's own parser
refuses such nesting in its `{m,n}` syntax (`MAX_REPETITION_THRESHOLD`); written out as rules,
as the converter does, it is not seen. So `stacks` parses the grammar as llama.cpp does
(`llama_grammar_parser::parse`: rules, alternatives, sequences, groups and quantifiers) and
counts, for every place the parse can stand, the stacks one advance from there creates:

    first(x)      stacks entering x makes; nullable(x): x may match nothing
    first(a b c)  first(a) + [nullable(a)] first(b) + [nullable(a b)] first(c)
    first(a | b)  first(a) + first(b)
    first(x{m,n}) first(x) * (n if nullable(x) else 1): each copy is reachable through the
                  empty ones before it

solved over the rules as a fixpoint (recursion through a first position grows without bound:
llama.cpp refuses that left recursion too). The answer is the largest `first` of any suffix
of any sequence: what one advance may build. Pure Python, linear in the grammar's text.
A grammar this parser cannot read is left to llama.cpp's parser, which has the last word.
"""

from __future__ import annotations

import collections
import re
from dataclasses import dataclass

_NAME = re.compile(r"[A-Za-z0-9_-]+")
_REPEAT = re.compile(r"\{\s*(\d*)\s*(,\s*(\d*)\s*)?\}")


class Unreadable(ValueError):
    """Not GBNF this parser reads (llama.cpp's parser decides)."""


@dataclass(slots=True)
class Item:
    """One element of a sequence: a terminal (`ref` None) or a rule reference (a group is a rule
    of its own, as llama.cpp makes it), repeated `low` to `high` times (`high` None: unbounded)."""

    ref: str | None = None
    low: int = 1
    high: int | None = 1
    empty: bool = False  # a literal "" (matches nothing)


Rules = dict[str, list[list[Item]]]


class _Parser:
    """llama.cpp's GBNF grammar read into `rules` (name → alternatives → sequences of `Item`),
    each parenthesized group a rule of its own; iterative, so nesting depth costs no stack."""

    def __init__(self, text: str):
        self.text, self.pos = text, 0
        self.rules: Rules = {}
        self.groups = 0

    def parse(self) -> Rules:
        self.space(True)
        while self.pos < len(self.text):
            name = self.name()
            self.space(False)
            if not self.text.startswith("::=", self.pos):
                raise Unreadable("expected ::=")
            self.pos += 3
            self.space(True)
            self.rules[name] = self.rules.get(name, []) + self.body()
            self.space(True)
        return self.rules

    def space(self, newlines: bool) -> None:
        text, n = self.text, len(self.text)
        while self.pos < n:
            c = text[self.pos]
            if c in " \t" or (newlines and c in "\r\n"):
                self.pos += 1
            elif c == "#":
                while self.pos < n and text[self.pos] not in "\r\n":
                    self.pos += 1
            else:
                return

    def name(self) -> str:
        m = _NAME.match(self.text, self.pos)
        if not m:
            raise Unreadable("expected a name")
        self.pos = m.end()
        return m.group(0)

    def body(self) -> list[list[Item]]:
        """A rule's alternatives, up to the newline that ends it outside parentheses."""
        text = self.text
        frames: list[list[list[Item]]] = [[[]]]  # open groups' alternatives; the rule's at the bottom
        while self.pos < len(text):
            c, seq = text[self.pos], frames[-1][-1]
            if c == "|":
                self.pos += 1
                self.space(True)
                frames[-1].append([])
                continue
            if c == "(":
                self.pos += 1
                self.space(True)
                frames.append([[]])
                continue
            if c == ")":
                if len(frames) == 1:
                    raise Unreadable("an unmatched )")
                self.pos += 1
                self.groups += 1
                name = f"\x00{self.groups}"
                self.rules[name] = frames.pop()
                frames[-1][-1].append(Item(ref=name))
            elif not self.element(c, seq):
                break
            self.space(len(frames) > 1)
        if len(frames) > 1:
            raise Unreadable("expected )")
        return frames[0]

    def element(self, c: str, seq: list[Item]) -> bool:
        """Read one element (or a quantifier of the last) into `seq`; False at anything else."""
        if c == '"':
            seq.append(Item(empty=self.quoted('"') == 0))
        elif c == "[":
            self.quoted("]")
            seq.append(Item())
        elif c == ".":
            self.pos += 1
            seq.append(Item())
        elif c in "*+?{":
            if not seq:
                raise Unreadable("a quantifier with nothing before it")
            self.quantify(seq[-1], c)
        elif _NAME.match(self.text, self.pos):
            seq.append(Item(ref=self.name()))
        else:
            return False
        return True

    def quoted(self, close: str) -> int:
        """Skip a literal or a class; how many characters it holds."""
        text, j, count = self.text, self.pos + 1, 0
        while j < len(text) and text[j] != close:
            j += 2 if text[j] == "\\" else 1
            count += 1
        if j >= len(text):
            raise Unreadable(f"expected {close}")
        self.pos = j + 1
        return count

    def quantify(self, item: Item, c: str) -> None:
        if c == "{":
            m = _REPEAT.match(self.text, self.pos)
            if not m or not m.group(1):
                raise Unreadable("a malformed {m,n}")
            low = int(m.group(1))
            high = low if m.group(2) is None else (int(m.group(3)) if m.group(3) else None)
            self.pos = m.end()
        else:
            low, high = {"*": (0, None), "+": (1, None), "?": (0, 1)}[c]
            self.pos += 1
        item.low, item.high = item.low * low, (None if item.high is None or high is None else item.high * high)


def parse(text: str) -> Rules:
    """The grammar's rules; `Unreadable` when it is not GBNF as llama.cpp reads it."""
    return _Parser(text).parse()


class _Cost:
    """`first` and `nullable` of every rule (a worklist fixpoint: a rule is looked at again when
    one it refers to changes), each count capped at `cap + 1`."""

    def __init__(self, rules: Rules, cap: int):
        self.rules, self.cap = rules, cap
        self.first = dict.fromkeys(rules, 0)
        self.nullable = dict.fromkeys(rules, False)
        self.widest = 0  # the largest `first` of any suffix of any sequence

    def solve(self) -> int:
        users: dict[str, set[str]] = {name: set() for name in self.rules}
        for name, alts in self.rules.items():
            for seq in alts:
                for item in seq:
                    if item.ref in users:
                        users[item.ref].add(name)
        todo = collections.deque(self.rules)  # inner groups first: they are defined before their rule
        queued = set(todo)
        budget = 64 * (len(self.rules) + 1)  # rounds a capped, monotone fixpoint needs, with room
        while todo:
            budget -= 1
            if budget < 0:
                return self.cap + 1
            name = todo.popleft()
            queued.discard(name)
            f, e = self.alternates(self.rules[name], record=False)
            if (f, e) != (self.first[name], self.nullable[name]):
                self.first[name], self.nullable[name] = f, e
                for user in users[name] - queued:
                    todo.append(user)
                    queued.add(user)
        for alts in self.rules.values():
            self.alternates(alts, record=True)
        return max(self.widest, *self.first.values(), 0)

    def alternates(self, alts: list[list[Item]], record: bool) -> tuple[int, bool]:
        total, nullable = 0, False
        for seq in alts:
            f, e = self.sequence(seq, record)
            total, nullable = min(total + f, self.cap + 1), nullable or e
        return total, nullable

    def sequence(self, seq: list[Item], record: bool) -> tuple[int, bool]:
        """Walk from the end: each suffix's `first` (recorded when asked) and nullability."""
        f, e = 0, True
        for item in reversed(seq):
            fi, ei = self.item(item)
            f, e = min(fi + (f if ei else 0), self.cap + 1), ei and e
            if record:
                self.widest = max(self.widest, f)
        return f, e

    def item(self, item: Item) -> tuple[int, bool]:
        if item.high == 0:
            return 0, True
        if item.ref is not None:
            f, e = self.first.get(item.ref, 0), self.nullable.get(item.ref, False)
        else:
            f, e = (0, True) if item.empty else (1, False)
        copies = (item.high if item.high is not None else item.low + 1) if e else 1
        return min(f * copies, self.cap + 1), e or item.low == 0


def stacks(text: str, cap: int) -> int:
    """The most parse stacks one advance of llama.cpp's grammar over `text` may create, counted
    up to `cap` (`cap + 1`: more). `Unreadable` when the text is not GBNF this parser reads."""
    return _Cost(parse(text), cap).solve()
