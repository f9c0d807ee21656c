"""The chat drawn in the transcript: one bubble per message with its actions, the reply being
streamed, a notice under them.

`ChatView` never changes the chat. What a bubble asks for comes out as `action(name, index)` and
`edited(index, text)`; the view keeps only what is about the view: the message open in its
editor (`editing`), the replies shown token by token with their probabilities (`token_view`) and
the notice shown (`notice`). `render(chat, start=k)` builds the bubbles again from message `k`
on and keeps those before it, so a long chat re-renders in milliseconds after a reply; the
scroll position stays where the user left it. A token's tooltip is read from the stored meta
(hovering never waits on the engine).

Main thread only.
"""

from __future__ import annotations

import html

from PySide6.QtCore import QObject, QUrl, Signal
from PySide6.QtGui import QCursor, QDesktopServices
from PySide6.QtWidgets import QLabel, QPlainTextEdit, QSizePolicy, QToolTip

from ..model.advice import advise
from ..model.formatting import token_tip
from ..model.history import Chat, Message, ReplyTo
from ..theme import palette
from .transcript import Bubble, Transcript, meta_html, tokens_html, welcome_html


class ChatView(QObject):
    """Draws a `Chat` into a `Transcript`; `engine` names the backends and the model."""

    action = Signal(str, int)  # what a bubble asks for (copy, edit, delete, regenerate, probs...), the message
    edited = Signal(int, str)  # a message's edited text, saved
    status_message = Signal(str)

    def __init__(self, transcript: Transcript, engine, parent: QObject | None = None):
        super().__init__(parent)
        self.transcript = transcript
        self.engine = engine
        self.editing: int | None = None  # the message open in its editor
        self.token_view: set[int] = set()  # messages shown token by token, with probabilities
        self.notice: str | None = None  # the error shown under the transcript, if any
        self._chat = Chat()
        self._stream_label: QLabel | None = None
        self._stream_prefix = ""  # a continued reply's text so far, shown before what streams

    def render(self, chat: Chat, start: int = 0, notice: str | None = None, streaming: tuple | None = None,
               can_continue: bool = False) -> None:
        """Bubbles for `chat`'s messages from `start` on, `notice` under them, and, while a reply
        streams, `streaming` = (backend, ReplyTo, text so far) in a bubble of its own (a message
        the reply replaces or continues is not shown twice)."""
        c = palette().transcript
        self._chat, self.notice = chat, notice
        t = self.transcript
        to = streaming[1] if streaming is not None else ReplyTo()
        hidden = to.index if to.kind != "append" else -1
        shown = [w for w in t.bubbles[:start] if isinstance(w, Bubble)]
        if start <= 0 or len(shown) != start or any(b.index != i for i, b in enumerate(shown)) or 0 <= hidden < start:
            start = 0  # what is shown is not those messages in order: all of it again
        t.clear(keep=start)
        self._stream_label = None
        if not chat.messages:
            t.add(self._note(welcome_html(self.engine), c.muted))
        last = len(chat.messages) - 1
        for i, m in enumerate(chat.messages[start:], start):
            if i != hidden:
                t.add(self._bubble(m, i, can_continue and i == last))
        if notice:
            t.add(self._note(f"⚠ {html.escape(notice)}", c.error))
        if streaming is not None:
            self._add_streaming(chat, *streaming)

    def show_streamed(self, text: str) -> None:
        """The streaming reply's text so far."""
        if self._stream_label is not None:
            self._stream_label.setText(self._stream_prefix + text)

    def forget(self) -> None:
        """Close the editor and show every reply as text (another chat or version is shown)."""
        self.editing = None
        self.token_view = set()

    def bubble(self, index: int | None) -> Bubble | None:
        """The bubble that shows message `index` (None while it is hidden or out of range)."""
        if index is None:
            return None
        return next((b for b in self.transcript.bubbles if isinstance(b, Bubble) and b.index == index), None)

    @property
    def editor(self) -> QPlainTextEdit | None:
        """The editor of the message being edited, if any."""
        b = self.bubble(self.editing)
        return b.editor if b is not None else None

    # ---- building ----

    def _add_streaming(self, chat: Chat, backend: str, to: ReplyTo, text: str) -> None:
        muted = palette().transcript.muted
        b = Bubble("assistant", -1)
        b.set_meta(f"<span style='color:{muted}'>· {html.escape(backend)} · "
                   + ("continuing…" if to.kind == "continue" else "streaming…") + "</span>")
        self._stream_prefix = chat.messages[to.index].content if to.kind == "continue" else ""
        self._stream_label = b.add_text(self._stream_prefix + text, plain=True)
        self.transcript.add(b)

    @staticmethod
    def _note(rich: str, color: str) -> QLabel:
        label = QLabel(f"<span style='color:{color}'>{rich}</span>")
        label.setWordWrap(True)
        label.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Preferred)
        label.setStyleSheet("background: transparent;")
        return label

    def _bubble(self, m: Message, index: int, can_continue: bool) -> Bubble:
        c = palette().transcript
        b = Bubble(m.role, index)
        meta = m.meta or {}
        if m.role == "assistant":
            b.set_meta(meta_html(meta, self._backend_index(meta.get("backend")), c))
        if m.n_versions > 1:
            b.add_switcher(m.shown, m.n_versions)
        self._add_body(b, m, index)
        self._add_actions(b, m, index, can_continue)
        if index == self.editing:
            b.start_edit(m.content)
        b.action.connect(self.action)
        b.edited.connect(self.edited)
        b.link.connect(self._on_link)
        b.token_hovered.connect(self._on_token_hover)
        b.copied.connect(lambda _s: self.status_message.emit("code copied to the clipboard"))
        return b

    def _add_body(self, b: Bubble, m: Message, index: int) -> None:
        c = palette().transcript
        meta = m.meta or {}
        tokens = meta.get("logprobs") if m.role == "assistant" else None
        if tokens and index in self.token_view:
            b.add_tokens(tokens_html(tokens, index, c.unlikely))
        elif m.role == "user" and m.content:
            b.add_text(m.content, plain=True)
        elif m.role == "assistant" and m.content.strip():
            b.add_markdown(m.content, c)
        else:
            b.add_text(f"<i style='color:{c.muted}'>(no text)</i>")
        if m.role == "assistant" and meta.get("error"):  # kept as raised in the chat's store; said as advice
            why = advise(str(meta["error"]), "engine").text
            b.add_text(f"<span style='color:{c.error}'>⚠ {html.escape(why)}</span>")

    def _add_actions(self, b: Bubble, m: Message, index: int, can_continue: bool) -> None:
        last = index == len(self._chat.messages) - 1
        b.add_action("copy", "Copy", "Copy this message")
        if m.role == "user":
            b.add_action("edit", "Edit", "Edit this message; Save sends it again, Cancel leaves the chat as it is")
        if m.role == "assistant" and last:
            b.add_action("regenerate", "↻ Regenerate", "Ask again; this answer stays (‹1/2›)")
        if (m.meta or {}).get("logprobs"):
            shown = index in self.token_view
            b.add_action("probs", "Hide probabilities" if shown else "Token probabilities",
                         "Show the reply token by token, shaded by probability (hover a token for its alternatives)")
        b.add_action("delete", "Delete", "Delete this message")
        if can_continue:
            b.add_button("continue", "Continue", "The reply reached its max tokens: go on from where it stopped")

    def _backend_index(self, name) -> int:
        names = self.engine.backend_names
        return names.index(name) if name in names else 0

    # ---- what the bubbles ask ----

    def _on_link(self, href: str) -> None:
        url = QUrl(href)
        if url.scheme() in ("http", "https"):
            QDesktopServices.openUrl(url)

    def _on_token_hover(self, index: int, k: int) -> None:
        messages = self._chat.messages
        tip = token_tip((messages[index].meta or {}).get("logprobs") or [], k) if 0 <= index < len(messages) else ""
        if tip:
            QToolTip.showText(QCursor.pos(), tip, self.transcript)
        else:
            QToolTip.hideText()
