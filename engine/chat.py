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

Thread contract: a pure function of the model (read-only, any thread may tokenize) and the
messages.
"""

from __future__ import annotations

import secrets
from typing import TYPE_CHECKING

from .errors import InvalidRequest

if TYPE_CHECKING:
    from .llama.model import Model


def chat_tokens(model: Model, messages: list[dict]) -> list[int]:
    """`messages` rendered with `model`'s chat template; content is never parsed for special tokens."""
    contents = [str(m.get("content") or "") for m in messages]
    plain = model.apply_chat_template(messages)
    pieces = _split(model, messages, contents, plain)
    tokens: list[int] = []
    for text, is_content in pieces:
        if text:
            tokens += model.tokenize(text, add_special=False, parse_special=not is_content)
    return tokens


def _split(model: Model, messages: list[dict], contents: list[str], plain: str) -> list[tuple[str, bool]]:
    """`plain` cut into (text, is_content) pieces, in order."""
    tag = secrets.token_hex(16)
    sentinels = [f"\x1e{tag}{i}\x1e" for i in range(len(messages))]
    marked = model.apply_chat_template([{**m, "content": s} for m, s in zip(messages, sentinels)])
    pieces: list[tuple[str, bool]] = []
    rest = marked
    for sentinel, content in zip(sentinels, contents):
        head, found, tail = rest.partition(sentinel)
        if not found or sentinel in tail:  # dropped or repeated: the template does not place content plainly
            return _find(plain, contents)
        pieces += [(head, False), (content, True)]
        rest = tail
    pieces.append((rest, False))
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
