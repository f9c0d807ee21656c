"""The chat: the panel (`panel`), its transcript of bubbles (`transcript`) and what the user
writes and asks with (`composer`); the conversation itself is `ui.history.Chat`."""

from .composer import TOP_ALTERNATIVES, PromptEdit, SamplingSettings
from .panel import AUTO, ChatPanel

__all__ = ["AUTO", "TOP_ALTERNATIVES", "ChatPanel", "PromptEdit", "SamplingSettings"]
