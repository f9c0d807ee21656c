"""The chat: the panel (`panel`), its transcript of bubbles (`transcript`), what the user writes
and asks with (`composer`) and the saved chats beside it (`chat_list`); the conversation itself,
with its versions, is `ui.model.history.Chat`."""

from .composer import TOP_ALTERNATIVES, PromptEdit, SamplingSettings
from .panel import AUTO, ChatPanel

__all__ = ["AUTO", "TOP_ALTERNATIVES", "ChatPanel", "PromptEdit", "SamplingSettings"]
