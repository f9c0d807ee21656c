"""The chat panel: the open chat and what is done to it, with the parts that show it around it.

The chat itself (`ui.model.history.Chat`) changes only here: a reply is appended, a regenerated
one becomes a new version of the last reply (‹k/n› switches), an edited question saved becomes a
new version of it and is answered again (Cancel leaves the chat as it was), Continue goes on with
a reply cut by its length limit. A prompt the engine refuses (too long for the context, a bad
setting) never joins the chat: the error is shown, the text stays in the message box, nothing is
saved.

Its parts, each with one owner: the saved chats and which one is open (`ChatList`); the system
prompt and sampling settings (`ChatSettings`); the reply being streamed (`ReplyStream`, through
asyncio on the GUI thread); the transcript's bubbles (`ChatView` over a `Transcript`); the
message box (`Composer`) and the context meter. Each reply records the backend that served it,
TTFT, decode tok/s and cached tokens (`reply_meta`); chats are saved as JSON under the user data
dir (`ui.model.history.ChatStore`).

Keys: Enter sends (Shift+Enter for a new line), Esc stops the reply being streamed; Enter while
a reply streams says so and keeps the text in the box.
"""

from __future__ import annotations

import copy

from PySide6.QtCore import QSettings, Qt, Signal
from PySide6.QtGui import QGuiApplication, QKeySequence, QShortcut
from PySide6.QtWidgets import (
    QCheckBox,
    QComboBox,
    QDoubleSpinBox,
    QHBoxLayout,
    QLabel,
    QPlainTextEdit,
    QPushButton,
    QSizePolicy,
    QSpinBox,
    QSplitter,
    QVBoxLayout,
    QWidget,
)

from engine.core.errors import EngineError

from ..model.advice import advise
from ..model.history import APPEND, Chat, ChatStore, Message, ReplyTo, reply_meta
from ..theme import palette
from .chat_list import ChatList
from .composer import ChatSettings, Composer, ContextMeter
from .reply import ReplyStream, chat_request
from .transcript import Bubble, Transcript, meta_bits, meta_plain
from .view import ChatView

AUTO = "auto (router)"
SAMPLING_WIDGETS = ("temperature", "top_p", "top_k", "repeat_penalty", "max_tokens", "seed", "json_mode",
                    "schema_edit", "schema_state", "token_probs")


class ChatPanel(QWidget):
    """Chat with the engine. `engine` is read for backends and used to submit; `store` saves chats."""

    reply_started = Signal(str)  # request id
    reply_finished = Signal(object)  # FinishRecord
    status_message = Signal(str)

    # The sampling controls: the `SamplingSettings`' own, named here too (`_build`).
    temperature: QDoubleSpinBox
    top_p: QDoubleSpinBox
    top_k: QSpinBox
    repeat_penalty: QDoubleSpinBox
    max_tokens: QSpinBox
    seed: QSpinBox
    json_mode: QCheckBox
    schema_edit: QPlainTextEdit
    schema_state: QLabel
    token_probs: QCheckBox

    def __init__(self, engine, store: ChatStore, parent: QWidget | None = None):
        super().__init__(parent)
        self.engine = engine
        self.store = store
        self.reply = ReplyStream(engine, self)
        self._refused: str | None = None  # why the engine refused the last prompt
        self._synthetic_warning: QLabel | None = None
        self._build()
        self.reply.text_changed.connect(self.view.show_streamed)
        self.reply.ended.connect(self._on_reply_ended)
        self._render()
        self._update_buttons()
        self.context_meter.refresh()

    # ---- layout ----

    def _build(self) -> None:
        # Left: saved chats.
        left = self.chats = ChatList(self.store)
        self.new_button, self.search_edit = self.chats.new_button, self.chats.search_edit
        self.chat_list, self.delete_chat_button = self.chats.chat_list, self.chats.delete_chat_button
        self.chats.opened.connect(self._show_chat)
        self.chats.status_message.connect(self.status_message)

        # Right: system prompt and settings (one row, the settings folded), transcript, message box.
        right = QWidget()
        rv = QVBoxLayout(right)
        rv.setContentsMargins(4, 0, 0, 0)
        rv.setSpacing(6)
        self.chat_settings = ChatSettings(self.engine, self.chat.system)
        self.system_edit, self.presets = self.chat_settings.system_edit, self.chat_settings.presets
        self.settings_button, self.settings = self.chat_settings.settings_button, self.chat_settings.sampling_settings
        for name in SAMPLING_WIDGETS:
            setattr(self, name, getattr(self.settings, name))
        self.system_edit.textChanged.connect(self._on_system_changed)
        self.presets.status_message.connect(self.status_message)
        rv.addWidget(self.chat_settings)
        if getattr(self.engine.model, "synthetic", False):
            rv.addWidget(self._synthetic_label())

        self.transcript = Transcript()
        self.transcript.setMinimumHeight(120)
        rv.addWidget(self.transcript, 1)
        self.view = ChatView(self.transcript, self.engine, self)
        self.view.action.connect(self._on_action)
        self.view.edited.connect(self.save_edit)
        self.view.status_message.connect(self.status_message)

        self.composer = Composer()
        self.input = self.composer.input
        self.send_button, self.stop_button = self.composer.send_button, self.composer.stop_button
        self.composer.submitted.connect(self._on_submit)
        self.stop_button.clicked.connect(self.stop)
        self.new_button.clicked.connect(self.input.setFocus)
        rv.addWidget(self.composer)
        # How much of the context the next request would use (chat so far + the draft + max tokens).
        self.context_meter = self.context_label = ContextMeter(
            self.engine, lambda: self.chat, self.input.toPlainText, self.max_tokens)
        self.input.textChanged.connect(self.context_meter.schedule)
        rv.addLayout(self._footer())

        self.split = QSplitter(Qt.Orientation.Horizontal)
        self.split.addWidget(left)
        self.split.addWidget(right)
        self.split.setStretchFactor(0, 0)
        self.split.setStretchFactor(1, 1)
        self.split.setCollapsible(1, False)
        left.setMinimumWidth(120)
        left.setMaximumWidth(260)
        self.split.setSizes([170, 900])
        outer = QVBoxLayout(self)
        outer.setContentsMargins(6, 6, 6, 6)
        outer.addWidget(self.split)

        esc = QShortcut(QKeySequence(Qt.Key.Key_Escape), self)
        esc.setContext(Qt.ShortcutContext.WindowShortcut)
        esc.activated.connect(self.stop)

    def _footer(self) -> QHBoxLayout:
        """Regenerate, Copy reply, the backend to send to, the last reply's figures, the context meter."""
        footer = QHBoxLayout()
        self.regen_button = QPushButton("↻ Regenerate")
        self.regen_button.setToolTip("Ask again for the last reply; the earlier answers stay (‹1/2› on the reply)")
        self.regen_button.clicked.connect(self.regenerate)
        self.copy_button = QPushButton("Copy reply")
        self.copy_button.clicked.connect(self.copy_reply)
        self.backend_combo = QComboBox()
        self.backend_combo.addItem(AUTO)
        for name in self.engine.backend_names:
            self.backend_combo.addItem(name)
        self.backend_combo.setToolTip("Pin replies to one backend, bypassing the routing policy")
        self.state_label = QLabel("")
        self.state_label.setObjectName("muted")
        # Long stats must not widen the window: the label takes what room is left.
        self.state_label.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Preferred)
        send_to = QLabel("Send to")
        send_to.setObjectName("muted")
        footer.addWidget(self.regen_button)
        footer.addWidget(self.copy_button)
        footer.addSpacing(8)
        footer.addWidget(send_to)
        footer.addWidget(self.backend_combo)
        footer.addWidget(self.state_label, 1)
        footer.addWidget(self.context_meter)
        return footer

    def _synthetic_label(self) -> QLabel:
        warn = QLabel("⚠ Synthetic model: random weights of a real model's shape — the text is noise; "
                      "use it for timing, not for answers.")
        warn.setStyleSheet(f"color:{palette().transcript.warn}")
        warn.setToolTip(warn.text())
        warn.setMinimumWidth(100)
        warn.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Fixed)  # one line, cut rather than widening
        self._synthetic_warning = warn
        return warn

    # ---- the open chat ----

    @property
    def chat(self) -> Chat:
        """The open chat (the saved chats' list says which one it is)."""
        return self.chats.chat

    @property
    def busy(self) -> bool:
        return self.reply.busy

    @property
    def streamed_text(self) -> str:
        """The text of the reply streaming now (or the last one), as far as it has come."""
        return self.reply.text

    def send(self, text: str) -> bool:
        """Append a user message and start streaming the reply; False if busy, empty or refused.

        A refused prompt (too long for the context, a bad setting) is taken back out of the chat:
        the error is shown and the chat stays as it was, so the next message works.
        """
        text = text.strip()
        if not text:
            return False
        if self.busy:
            msg = "a reply is still streaming: Esc stops it; your message stays in the box"
            self.state_label.setText(msg)
            self.status_message.emit(msg)
            return False
        self.view.editing = None
        self.chat.messages.append(Message("user", text))
        if self._start_reply(APPEND):
            return True
        self.chat.messages.pop()
        self._render(notice=self._refused, start=len(self.chat.messages) - 1)
        self._update_buttons()
        return False

    def stop(self) -> None:
        """Cancel the reply being streamed (its partial text is kept, marked stopped)."""
        if self.reply.stop():
            self.state_label.setText("stopping…")

    def regenerate(self) -> bool:
        """Ask again for the last reply: the new answer becomes its next version, the earlier ones
        stay (the reply's ‹k/n› switcher)."""
        if self.busy or not self.chat.messages:
            return False
        last = len(self.chat.messages) - 1
        if self.chat.messages[last].role == "assistant":
            if last == 0 or self.chat.messages[last - 1].role != "user":
                return False
            return self._start_reply(ReplyTo("version", last), self.chat.prompt_messages(upto=last))
        return self._start_reply(APPEND)

    def can_continue(self) -> bool:
        """The last reply was cut by its length limit and a local model can go on with it."""
        if self.busy or not self.chat.messages or self.engine.model is None:
            return False
        last = self.chat.messages[-1]
        return last.role == "assistant" and (last.meta or {}).get("finish_reason") == "length" \
            and bool(last.content)

    def continue_reply(self) -> bool:
        """Go on with the last reply where its length limit cut it (the text is added to it)."""
        if not self.can_continue():
            return False
        return self._start_reply(ReplyTo("continue", len(self.chat.messages) - 1), continue_final=True)

    def switch_version(self, index: int, k: int) -> bool:
        """Show version `k` of message `index` (and the messages that followed it)."""
        if self.busy or not 0 <= index < len(self.chat.messages):
            return False
        m = self.chat.messages[index]
        if not 0 <= k < m.n_versions or k == m.shown:
            return False
        self.chat.switch(index, k)
        self.view.forget()
        self._render()
        self.chats.save()
        self._update_buttons()
        self.context_meter.refresh()
        return True

    def copy_reply(self) -> str:
        for m in reversed(self.chat.messages):
            if m.role == "assistant":
                QGuiApplication.clipboard().setText(m.content)
                self.status_message.emit("reply copied to the clipboard")
                return m.content
        return ""

    def delete_message(self, index: int) -> bool:
        """Remove one message from the open chat (and save it); False if busy or out of range."""
        if self.busy or not 0 <= index < len(self.chat.messages):
            return False
        del self.chat.messages[index]
        self.view.forget()
        self._render()
        if self.chat.messages:
            self.chats.save()
        else:
            self.store.delete(self.chat.id)
        self.chats.reload()
        self._update_buttons()
        return True

    def edit_message(self, index: int) -> bool:
        """Open a user message in its editor (Save and send, or Cancel); the chat is unchanged until saved."""
        if self.busy or not 0 <= index < len(self.chat.messages) or self.chat.messages[index].role != "user":
            return False
        self.view.editing = index
        self._render(start=index)
        return True

    def cancel_edit(self) -> None:
        """Close the editor; the chat stays as it was."""
        if self.view.editing is not None:
            index, self.view.editing = self.view.editing, None
            self._render(start=index)

    def save_edit(self, index: int, text: str) -> bool:
        """The edited text becomes a new version of message `index` (the old one and what followed
        it stay, ‹k/n›) and is answered again; False (the chat unchanged) if empty or refused."""
        text = text.strip()
        if self.busy or self.view.editing != index or not text:
            return False
        before = copy.deepcopy(self.chat.messages)
        self.chat.add_version(index, text)
        self.view.editing = None
        if self._start_reply(APPEND):
            return True
        self.chat.messages = before  # refused: as it was
        self.view.editing = index
        self._render(notice=self._refused)
        self._update_buttons()
        return False

    @property
    def editor(self) -> QPlainTextEdit | None:
        """The editor of the message being edited, if any."""
        return self.view.editor

    def bubble(self, index: int) -> Bubble | None:
        """The bubble that shows message `index` (None while it is hidden or out of range)."""
        return self.view.bubble(index)

    def new_chat(self) -> None:
        """Save the open chat and start an empty one (the saved chats' New chat)."""
        self.chats.new_chat()
        self.input.setFocus()

    def transcript_text(self) -> str:
        """The transcript as plain text: each bubble's header, text and code, the notices."""
        return self.transcript.plain_text()

    def save_settings(self, settings: QSettings) -> None:
        """Sampling settings, whether they are unfolded and token probabilities, for the next session."""
        self.chat_settings.save(settings)

    def load_settings(self, settings: QSettings) -> None:
        self.chat_settings.load(settings)

    def restyle(self) -> None:
        """Paint the transcript and the coloured labels again in the theme in use."""
        if self._synthetic_warning is not None:
            self._synthetic_warning.setStyleSheet(f"color:{palette().transcript.warn}")
        self._render(notice=self.view.notice)
        self.context_meter.refresh()

    def shutdown(self) -> None:
        """Cancel a running reply and save (the panel is going away)."""
        self.reply.shutdown()
        self.chats.save()

    # ---- the reply ----

    def _start_reply(self, to: ReplyTo, messages: list[dict] | None = None, continue_final: bool = False) -> bool:
        self._refused = None
        try:
            backend = self.backend_combo.currentText()
            request = chat_request(self.engine, messages if messages is not None else self.chat.prompt_messages(),
                                   self.chat_settings.sampling(), None if backend == AUTO else backend,
                                   continue_final=continue_final)
            handle = self.reply.start(request, to)
        except (EngineError, ValueError) as e:
            why = advise(e, "engine").text  # a dead engine in plain words; anything else as raised
            self._refused = why
            self._render(notice=why, start=len(self.chat.messages) - 2)
            self.status_message.emit(f"not sent: {why}")
            self._update_buttons()
            return False
        # from the message before the new one (it loses Regenerate / Continue), or the one replaced
        self._render(start=to.index if to.kind != "append" else len(self.chat.messages) - 2)
        self.transcript.to_bottom()  # the question just asked and the reply coming
        self.state_label.setText(f"streaming from {handle.backend or '?'}…")
        self._update_buttons()
        self.reply_started.emit(handle.id)
        return True

    def _on_reply_ended(self, record, decision, to: ReplyTo) -> None:
        start = to.index if to.kind != "append" else len(self.chat.messages)
        meta = self.chat.take_reply(to, record.text, reply_meta(record, decision))
        self._render(start=start)
        self.chats.save()
        self.chats.reload()
        # The label is short (it shares the row); the reply's header and the tooltip have it all.
        self.state_label.setText(" · ".join([str(meta.get("backend", "?")), *meta_bits(meta)[:2]]))
        self.state_label.setToolTip(meta_plain(meta))
        self.context_meter.refresh()
        self._update_buttons()
        self.reply_finished.emit(record)

    # ---- showing it ----

    def _render(self, notice: str | None = None, start: int = 0) -> None:
        handle = self.reply.handle
        streaming = (handle.backend or "", self.reply.to, self.reply.text) if handle is not None else None
        self.view.render(self.chat, start=start, notice=notice, streaming=streaming, can_continue=self.can_continue())
        self.context_meter.schedule()

    def _show_chat(self, chat: Chat) -> None:
        """Another chat is open (the saved chats' New, open or Delete)."""
        self.chat_settings.show_system(chat.system)
        self.view.forget()
        self._render()
        self.transcript.to_bottom()
        self._update_buttons()

    def _update_buttons(self) -> None:
        busy = self.busy
        self.composer.set_busy(busy)
        has_user = any(m.role == "user" for m in self.chat.messages)
        self.regen_button.setEnabled(not busy and has_user)
        self.copy_button.setEnabled(any(m.role == "assistant" for m in self.chat.messages))
        self.chats.set_busy(busy)

    # ---- what the user asks ----

    def _on_action(self, action: str, index: int) -> None:
        if action == "copy" and 0 <= index < len(self.chat.messages):
            QGuiApplication.clipboard().setText(self.chat.messages[index].content)
            self.status_message.emit("message copied to the clipboard")
        elif action == "edit":
            self.edit_message(index)
        elif action == "cancel-edit":
            self.cancel_edit()
        elif action == "delete":
            self.delete_message(index)
        elif action == "regenerate":
            self.regenerate()
        elif action == "continue":
            self.continue_reply()
        elif action in ("prev", "next") and 0 <= index < len(self.chat.messages):
            self.switch_version(index, self.chat.messages[index].shown + (1 if action == "next" else -1))
        elif action == "probs":
            self.view.token_view ^= {index}
            self._render(start=index)

    def _on_submit(self) -> None:
        text = self.input.toPlainText()
        if self.send(text):
            self.input.clear()

    def _on_system_changed(self) -> None:
        self.chat.system = self.system_edit.toPlainText()
