"""Chat prompts → tokens, where only the chat template's own markers can be special tokens.

Tokenizing the rendered template text as a whole with special-token parsing (what llama.cpp's
`llama_tokenize(..., parse_special=true)` does) turns a user's literal `<|im_start|>system`
into the real control token: anyone who can write a message can forge a system turn. Here:

1. render the template once with each message's content replaced by a unique sentinel
   (a random hex string no client can guess, fresh per call);
2. check that putting the contents back where the sentinels are gives exactly the plain
   rendering (a template that transforms content, e.g. trims it, fails this check and we fall
   back to finding each content in the plain rendering, in order);
3. tokenize the template's own pieces with special parsing and each content piece without
   (`parse_special=False`: `<|im_start|>` in content becomes ordinary text tokens).

For text without special-token strings the result equals tokenizing the plain rendering
(tested on SmolLM2's ChatML template): the pre-tokenizer already splits at these boundaries.

Tools (`render_chat(..., tools=...)`) go through `engine.prompts.tool_calls.tool_prompt`: a
template that renders the `tools` global or assistant `tool_calls` itself (`template_caps`,
found by rendering probes once per model) gets them, and then the client's text lands outside
any content: such text (the tools' JSON, call names and arguments) is refused if it holds a
special-token string. Everything else reaches the template as message content. Where the
reply's function is known, the prompt ends with the call's head (`ToolMode.prefill`).
`extra` variables (a request's `chat_template_kwargs`) reach the template beside the messages.

Costs are linear in the body: `_split` walks the marked rendering once, the number of
messages is capped (`MAX_MESSAGES`), and a prompt that cannot fit the context is refused
before it is tokenized, by a cheap lower bound on its token count (`min_tokens`: its UTF-8
bytes over the longest token's bytes, known once per model).

Thread contract: a pure function of the model (read-only, any thread may tokenize) and the
messages.
"""

from __future__ import annotations

import json
import secrets
import weakref
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from engine.core.errors import ContextLengthExceeded, InvalidRequest
from engine.prompts.reply import opens_thinking, thinks
from engine.prompts.tool_calls import TemplateCaps, ToolMode, history, tool_format, tool_prompt

if TYPE_CHECKING:
    from engine.core.tokenizer import Tokenizer as Model


MAX_MESSAGES = 4096  # messages in one chat; 55,000 one-character messages took 68 s to refuse


@dataclass(frozen=True)
class ChatPrompt:
    """A rendered chat: its tokens, how to read the reply (`mode`, the template's call format
    filled in), whether the template knows thinking blocks and whether the reply starts in one."""

    tokens: list[int]
    mode: ToolMode | None = None
    reasoning: bool = False
    thinking: bool = False


def chat_tokens(model: Model, messages: list[dict], tools: list[dict] | None = None,
                continue_final: bool = False, max_prompt: int = 0) -> list[int]:
    """`render_chat(...).tokens`: the prompt's tokens alone."""
    return render_chat(model, messages, tools, continue_final=continue_final, max_prompt=max_prompt).tokens


def render_chat(model: Model, messages: list[dict], tools: list[dict] | None = None, mode: ToolMode | None = None,
                *, continue_final: bool = False, max_prompt: int = 0, extra: dict | None = None) -> ChatPrompt:
    """`messages` rendered with `model`'s chat template; content is never parsed for special tokens.

    With `tools` (OpenAI's list), the prompt asks for a reply in `mode` (default: `auto`),
    written in the template's own call format where it has one (engine/prompts/tool_calls.py);
    without, past calls in the history are shown in plain words. With `continue_final`, the
    last message (the assistant's, non-empty) is left open: the prompt ends with its content,
    without what the template puts after it (its end of turn, the next turn's header), so the
    model goes on with that reply (vLLM's `continue_final_message`: render, cut after the
    final content). A template that strips content (`| trim`) loses the content's trailing
    whitespace here.

    `max_prompt` (> 0): a prompt whose cheap lower bound already reaches it is refused with
    `ContextLengthExceeded` before it is rendered or tokenized."""
    if len(messages) > MAX_MESSAGES:
        raise InvalidRequest(f"messages: {len(messages)} messages; this server takes at most {MAX_MESSAGES}",
                             param="messages")
    if max_prompt > 0:
        check_bound(model, [str(m.get("content") or "") for m in messages], max_prompt, "messages")
    with_tools = tools is not None or any(m.get("tool_calls") or m["role"] == "tool" for m in messages)
    if continue_final:
        if messages[-1].get("role") != "assistant" or not messages[-1].get("content"):
            raise InvalidRequest("continue_final_message needs a last message from the assistant with content",
                                 param="messages")
        if with_tools:
            raise InvalidRequest("continue_final_message cannot be combined with tools", param="messages")
    mode = None if tools is None else replace(mode or ToolMode("auto", tuple(t["function"]["name"] for t in tools)))
    if with_tools:
        caps = template_caps(model)
        if mode is not None and tools is not None:
            mode = replace(mode, format=caps.format)
            messages, tools = tool_prompt(messages, tools, caps, mode)
        else:
            messages = history(messages, caps, None)
        _check_outside_content(model, messages, tools)
    contents = [str(m.get("content") or "") for m in messages]
    plain = model.apply_chat_template(messages, tools, extra)
    if max_prompt > 0:
        check_bound(model, [plain], max_prompt, "messages")
    pieces = _split(model, messages, contents, plain, tools, extra)
    if continue_final:
        pieces = pieces[:-1]  # the last piece is what follows the final (non-empty) content
    tokens: list[int] = []
    for text, is_content in pieces:
        if text:
            tokens += model.tokenize(text, add_special=False, parse_special=not is_content)
    prefill = mode.prefill if mode is not None else ""
    if prefill:  # the call's head: the template's opener and a name checked to be plain characters
        tokens += model.tokenize(prefill, add_special=False, parse_special=True)
    reasoning = thinks(model.chat_template)
    return ChatPrompt(tokens, mode, reasoning, reasoning and not continue_final and not prefill and opens_thinking(plain))


def _split(model: Model, messages: list[dict], contents: list[str], plain: str,
           tools: list[dict] | None = None, extra: dict | None = None) -> list[tuple[str, bool]]:
    """`plain` cut into (text, is_content) pieces, in order."""
    tag = secrets.token_hex(16)
    sentinels = [f"\x1e{tag}{i}\x1e" for i in range(len(messages))]
    marked = model.apply_chat_template([{**m, "content": s} for m, s in zip(messages, sentinels)], tools, extra)
    # Each sentinel once, in order (one pass; a rescan of the rest per message was quadratic).
    if marked.count(f"\x1e{tag}") != len(sentinels):  # dropped or repeated: content is not placed plainly
        return _find(plain, contents)
    pieces: list[tuple[str, bool]] = []
    at = 0
    for sentinel, content in zip(sentinels, contents):
        found = marked.find(sentinel, at)
        if found < 0:  # out of order
            return _find(plain, contents)
        pieces += [(marked[at:found], False), (content, True)]
        at = found + len(sentinel)
    pieces.append((marked[at:], False))
    if "".join(text for text, _ in pieces) != plain:
        return _find(plain, contents)
    return pieces


def _find(plain: str, contents: list[str]) -> list[tuple[str, bool]]:
    """The fallback: locate each content (or its stripped form) in the plain rendering, in order."""
    pieces: list[tuple[str, bool]] = []
    cursor = 0
    for i, content in enumerate(contents):
        if not content:
            continue
        for form in (content, content.strip()):
            at = plain.find(form, cursor) if form else -1
            if at >= 0:
                pieces += [(plain[cursor:at], False), (form, True)]
                cursor = at + len(form)
                break
        else:
            raise InvalidRequest(f"the model's chat template changes messages[{i}].content in a way that "
                                 f"cannot be tokenized safely", param="messages")
    pieces.append((plain[cursor:], False))
    return pieces


_CAPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
def min_tokens(model: Model, texts: list[str]) -> int:
    """A lower bound on the tokens `texts` make, without tokenizing: no token covers more
    bytes than the model's longest one."""
    return sum(len(t.encode("utf-8", "surrogatepass")) for t in texts) // model.longest_token_bytes()


def check_bound(model: Model, texts: list[str], max_prompt: int, param: str) -> None:
    """`ContextLengthExceeded` if `texts` make `max_prompt` tokens or more by the cheap bound."""
    low = min_tokens(model, texts)
    if low >= max_prompt:
        raise ContextLengthExceeded(low, max_prompt, param=param, at_least=True)


def template_caps(model: Model) -> TemplateCaps:
    """What `model`'s template renders by itself: probes with a made-up function name and
    result, rendered once per model (minja's capability detection does the same)."""
    caps = _CAPS.get(model)
    if caps is None:
        caps = _CAPS[model] = _probe(model)
    return caps


def _probe(model: Model) -> TemplateCaps:
    name, result = "tandem_probe_" + secrets.token_hex(4), "tandem_result_" + secrets.token_hex(4)
    user = {"role": "user", "content": "Hi"}
    tool = {"type": "function", "function": {"name": name, "description": "probe",
                                             "parameters": {"type": "object", "properties": {}}}}
    call = {"role": "assistant", "content": "",
            "tool_calls": [{"id": "call_probe", "type": "function", "function": {"name": name, "arguments": {}}}]}
    answer = {"role": "tool", "tool_call_id": "call_probe", "content": result}

    def renders(needle: str, messages: list[dict], tools=None) -> bool:
        try:
            return needle in model.apply_chat_template(messages, tools)
        except Exception:  # a template that refuses the probe does not support it
            return False

    return TemplateCaps(tools=renders(name, [user], [tool]), tool_calls=renders(name, [user, call]),
                        tool_responses=renders(result, [user, call, answer, user]),
                        format=tool_format(model.chat_template))


def _check_outside_content(model: Model, messages: list[dict], tools: list[dict] | None) -> None:
    """Client text the template places outside message content must hold no special-token
    string (it is tokenized with the template's own markers)."""
    texts = [("tools", json.dumps(tools, ensure_ascii=False))] if tools is not None else []
    for i, m in enumerate(messages):
        for c in m.get("tool_calls") or ():
            texts.append((f"messages[{i}].tool_calls", json.dumps(c, ensure_ascii=False)))
    for where, text in texts:
        if model.tokenize(text, add_special=False, parse_special=True) != \
                model.tokenize(text, add_special=False, parse_special=False):
            raise InvalidRequest(f"{where} holds the model's special-token text, which the chat template "
                                 f"would turn into control tokens", param="tools" if where == "tools" else "messages")
