"""Cache-prediction keys of a remote backend's requests: token ids where a tokenizer is at hand
(`VocabOnly`, the engine's model loaded vocab-only), else text.

Thread contract: `VocabOnly` is immutable after construction but for its piece cache (see
`Model`); the functions are pure.
"""

from __future__ import annotations

import json
import logging

from engine.core.errors import ModelLoadError
from engine.core.request import CHARS_PER_TOKEN, Request

from .job import Key

log = logging.getLogger(__name__)


class VocabOnly:
    """A GGUF's vocabulary and chat template without its weights (llama.cpp `vocab_only`):
    the remote engine's tokenizer, when it serves the same model, for exact cache keys.

    Thread contract: immutable after construction but for the piece cache (see `Model`)."""

    def __init__(self, spec: str) -> None:
        from ...llama import cpu_only, lc  # native code only where a tokenizer is asked for
        from ...llama.model import check_gguf, resolve_model

        path = resolve_model(spec)
        check_gguf(path)
        params = lc.llama_model_default_params()
        params.vocab_only = True
        cpu_only(params)
        self.path = path
        self.ptr = lc.llama_model_load_from_file(str(path).encode(), params)
        if not self.ptr:
            raise ModelLoadError(f"llama.cpp could not load the vocabulary of {path}")
        self.vocab = lc.llama_model_get_vocab(self.ptr)
        self.bos = lc.llama_vocab_bos(self.vocab)
        self.eos = lc.llama_vocab_eos(self.vocab)
        self.n_vocab = lc.llama_vocab_n_tokens(self.vocab)
        self._pieces: dict[int, bytes] = {}
        self._chat = None

    # Model's own tokenize/piece/apply_chat_template, which use only what is set above.
    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = True) -> list[int]:
        from ...llama.model import Model

        return Model.tokenize(self, text, add_special=add_special, parse_special=parse_special)  # type: ignore[arg-type]  # duck-typed

    def piece(self, token: int) -> bytes:
        from ...llama.model import Model

        return Model.piece(self, token)  # type: ignore[arg-type]  # duck-typed

    def apply_chat_template(self, messages: list[dict]) -> str:
        from ...llama.model import Model

        return Model.apply_chat_template(self, messages)  # type: ignore[arg-type]  # duck-typed

    def close(self) -> None:
        if self.ptr:
            from ...llama import lc

            lc.llama_model_free(self.ptr)
            self.ptr = None

    def key(self, request: Request) -> tuple[int, ...]:
        """The token ids the engine will compute for this request's prompt (the same
        tokenization `Engine.generate` and `Engine.chat` do)."""
        if request.text is not None:
            return tuple(self.tokenize(request.text))
        if request.messages is None:
            raise ValueError(f"request {request.id} has neither text nor messages to tokenize")
        return tuple(self.tokenize(self.apply_chat_template(list(request.messages)), add_special=False))


def key_of(request: Request, tokenizer: VocabOnly | None = None) -> tuple[Key, int]:
    """(cache-prediction key, key elements per token): token ids where the request carries
    them or a tokenizer makes them, else its text, else its messages rendered as text."""
    if request.prompt_tokens:
        return tuple(request.prompt_tokens), 1
    if tokenizer is not None:
        try:
            return tokenizer.key(request), 1
        except Exception:  # a template that refuses these messages: the engine will say why
            log.debug("tokenizing %s for the cache prediction failed", request.id, exc_info=True)
    if request.text is not None:
        return request.text, CHARS_PER_TOKEN
    return "".join(render_message(m) for m in request.messages or ()), CHARS_PER_TOKEN


def render_message(m: dict) -> str:
    content = m.get("content")
    if not isinstance(content, str):
        content = json.dumps(content, sort_keys=True, ensure_ascii=False)
    return f"<|{m.get('role', '')}|>{content}"
