"""The chat: the panel (`panel`) holds the open chat and what is done to it; the reply being
streamed (`reply`); the transcript of bubbles (`transcript`) and the view that draws the chat in
it (`view`); what the user writes and asks with (`composer`, `presets`); the saved chats beside
it (`chat_list`). The conversation itself, with its versions, is `ui.model.history.Chat`."""

from .composer import TOP_ALTERNATIVES, PromptEdit, SamplingSettings
from .panel import AUTO, ChatPanel

__all__ = ["AUTO", "TOP_ALTERNATIVES", "ChatPanel", "PromptEdit", "SamplingSettings"]
