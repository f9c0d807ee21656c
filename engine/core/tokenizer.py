"""What prompt rendering asks of a model: text to tokens and its chat template. The loaded
llama.cpp model (engine/llama/model.py `Model`) is one; engine/prompts/ depends on this protocol,
so it loads no native code and reads the same for any model that offers these. And the
range of token ids that made-up prompts (workloads, calibration) are drawn from."""

from __future__ import annotations

from typing import Protocol

# Made-up prompts' token ids are drawn from this range: above the control tokens most
# vocabularies start with, below the size of every vocabulary we use (SmolLM2 49152, Qwen2.5 151936).
TOKEN_LOW = 256
TOKEN_HIGH = 32000


class Tokenizer(Protocol):
    """A model's vocabulary and chat template (thread-safe to call from any thread)."""

    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = True) -> list[int]:
        """`text`'s token ids; `parse_special`: special tokens' text becomes those tokens."""
        ...

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None,
                            extra: dict | None = None) -> str:
        """`messages` (and OpenAI's `tools`) rendered by the model's template, ending with the
        assistant's turn; `extra`: more template variables (`chat_template_kwargs`)."""
        ...

    @property
    def chat_template(self) -> str:
        """The template's text ("" where the model has none)."""
        ...

    def longest_token_bytes(self) -> int:
        """The most bytes one token stands for, so a text's length bounds its token count."""
        ...
