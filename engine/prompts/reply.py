"""A chat reply read as it streams: a thinking model's `<think>…</think>` block apart from the
answer (`reasoning_content`, as llama-server's `deepseek` format and vLLM's reasoning parsers
give it), and the answer as text or tool calls (engine/prompts/tool_calls.py).

The block is read where the model's template knows it (`thinks`, from the template's text):
at the start of the reply (leading whitespace allowed), or from the first token when the
prompt already opened it (`ChatPrompt.thinking`: a template that ends the generation prompt
with `<think>`). A block never closed is reasoning to its end, as in llama-server. Text that
may be the start of a tag is held back until the next piece says what it is.

Thread contract: one reader per reply, used on one thread.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.prompts.tool_calls import ArgumentsDelta, ReplyEvent, TextDelta, ToolCall, ToolMode, ToolReplyReader

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def thinks(template: str) -> bool:
    """Whether a chat template knows thinking blocks (Qwen3, DeepSeek-R1, SmolLM3, ...)."""
    return THINK_CLOSE in template


def opens_thinking(prompt: str) -> bool:
    """Whether a rendered prompt leaves the reply inside a thinking block."""
    return prompt.rstrip().endswith(THINK_OPEN)


@dataclass(frozen=True)
class ReasoningDelta:
    text: str


@dataclass
class ReasoningSplitter:
    """Text pieces → (reasoning, answer) pieces. `state`: `start` (a block may open),
    `reasoning`, `answer`."""

    state: str = "start"
    _held: str = ""
    _trim: bool = False  # the answer after a block starts past the newlines that follow `</think>`

    def feed(self, text: str) -> tuple[str, str]:
        if self.state == "answer":
            return "", self._answer(text)
        self._held += text
        if self.state == "start":
            head = self._held.lstrip()
            if head.startswith(THINK_OPEN):
                self.state, self._held = "reasoning", head[len(THINK_OPEN):]
            elif THINK_OPEN.startswith(head):
                return "", ""
            else:
                self.state, answer, self._held = "answer", self._held, ""
                return "", answer
        return self._in_block()

    def _answer(self, text: str) -> str:
        if self._trim:
            text = text.lstrip("\n")
            self._trim = not text
        return text

    def finish(self) -> tuple[str, str]:
        """What was held back: reasoning inside an unclosed block, else answer text."""
        held, self._held = self._held, ""
        return (held, "") if self.state == "reasoning" else ("", held)

    def _in_block(self) -> tuple[str, str]:
        end = self._held.find(THINK_CLOSE)
        if end >= 0:
            reasoning, rest = self._held[:end], self._held[end + len(THINK_CLOSE):]
            self.state, self._held, self._trim = "answer", "", True
            return reasoning, self._answer(rest)
        keep = _partial_suffix(self._held, THINK_CLOSE)
        out = self._held[:len(self._held) - keep]
        self._held = self._held[len(out):]
        return out, ""


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (0: none)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


@dataclass
class ReplyParts:
    """A whole reply: its answer text (None: a call, or a call cut short), its reasoning, its calls."""

    content: str | None
    reasoning: str | None
    calls: list[ToolCall] = field(default_factory=list)


class ReplyReader:
    """One chat reply: `feed` each text delta, get events (`TextDelta`, `ReasoningDelta`,
    `CallStart`, `ArgumentsDelta`); `close` gives the last events; `parts` the whole reply."""

    def __init__(self, tools: ToolMode | None = None, reasoning: bool = False, thinking: bool = False):
        self.splitter = ReasoningSplitter("reasoning" if thinking else "start") if reasoning else None
        self.tools = ToolReplyReader(tools) if tools is not None else None
        self.reasoning = ""
        self.content = ""
        self._closed = False

    def feed(self, text: str) -> list[ReplyEvent | ReasoningDelta]:
        if self.splitter is None:
            return self._answer(text)
        thought, answer = self.splitter.feed(text)
        return self._thought(thought) + self._answer(answer)

    def close(self) -> list[ReplyEvent | ReasoningDelta]:
        """The events held back until the end (once)."""
        if self._closed:
            return []
        self._closed = True
        out: list[ReplyEvent | ReasoningDelta] = []
        if self.splitter is not None:
            thought, answer = self.splitter.finish()
            out += self._thought(thought) + self._answer(answer)
        if self.tools is not None:
            rest = self.tools.remaining_arguments()
            if rest:
                out.append(ArgumentsDelta(0, rest))
        return out

    def parts(self) -> ReplyParts:
        """The whole reply (after `close`)."""
        reasoning = self.reasoning if self.splitter is not None and self.splitter.state != "start" else None
        if self.tools is None:
            return ReplyParts(self.content, reasoning)
        content, calls = self.tools.finish()
        return ReplyParts(content, reasoning, calls)

    def _thought(self, text: str) -> list[ReplyEvent | ReasoningDelta]:
        if not text:
            return []
        self.reasoning += text
        return [ReasoningDelta(text)]

    def _answer(self, text: str) -> list[ReplyEvent | ReasoningDelta]:
        if self.tools is not None:
            return list(self.tools.feed(text))
        if not text:
            return []
        self.content += text
        return [TextDelta(text)]


def read_whole(text: str, tools: ToolMode | None = None, reasoning: bool = False,
               thinking: bool = False) -> ReplyParts:
    """A whole reply's parts, as reading it streamed would give them."""
    reader = ReplyReader(tools, reasoning, thinking)
    reader.feed(text)
    reader.close()
    return reader.parts()
