"""The chat panel: streaming replies from the engine, with who served them and how fast.

Replies stream through asyncio (qasync): the panel submits with `loop=` the running loop and a
task iterates `handle.astream()`, so text deltas arrive on the GUI thread without a worker ever
touching a widget. Each reply records the backend that served it, TTFT, decode tok/s and cached
tokens; chats are saved as JSON under the user data dir (`ui.history.ChatStore`).

Keys: Enter sends (Shift+Enter for a new line), Esc stops the reply being streamed.
"""

from __future__ import annotations

import asyncio
import html
import logging

from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QGuiApplication, QKeySequence, QShortcut, QTextCursor
from PySide6.QtWidgets import (
    QComboBox, QDoubleSpinBox, QFormLayout, QFrame, QHBoxLayout, QLabel, QListWidget,
    QListWidgetItem, QPlainTextEdit, QPushButton, QSizePolicy, QSpinBox, QSplitter, QTextBrowser, QToolButton,
    QVBoxLayout, QWidget,
)

from engine.errors import EngineError
from engine.request import Request, SamplingParams

from .history import Chat, ChatStore, Message
from .metrics import fmt_seconds
from .theme import MUTED, backend_color

log = logging.getLogger(__name__)

AUTO = "auto (router decides)"
_USER = "#8fbcff"
_ASSISTANT = "#9be39b"
_ERROR = "#ff7b7b"


class PromptEdit(QPlainTextEdit):
    """The message box: Enter submits, Shift+Enter inserts a new line."""

    submitted = Signal()

    def keyPressEvent(self, event):
        if event.key() in (Qt.Key_Return, Qt.Key_Enter) and not event.modifiers() & Qt.ShiftModifier:
            self.submitted.emit()
            return
        super().keyPressEvent(event)


class ChatPanel(QWidget):
    """Chat with the engine. `engine` is read for backends and used to submit; `store` saves chats."""

    reply_started = Signal(str)  # request id
    reply_finished = Signal(object)  # FinishRecord
    status_message = Signal(str)

    def __init__(self, engine, store: ChatStore, parent: QWidget | None = None):
        super().__init__(parent)
        self.engine = engine
        self.store = store
        self.chat = Chat()
        self.handle = None  # RequestHandle of the reply being streamed
        self._task: asyncio.Task | None = None
        self._stream_cursor: QTextCursor | None = None
        self._streamed: list[str] = []
        self._build()
        self._reload_list()
        self._render()
        self._update_buttons()

    # ---- layout ----

    def _build(self) -> None:
        # Left: saved chats.
        left = QWidget()
        lv = QVBoxLayout(left)
        lv.setContentsMargins(0, 0, 4, 0)
        self.new_button = QPushButton("+ New chat")
        self.new_button.setToolTip("Start an empty chat (the current one stays in the list)")
        self.new_button.clicked.connect(self.new_chat)
        self.chat_list = QListWidget()
        self.chat_list.itemClicked.connect(self._on_pick_chat)
        lv.addWidget(self.new_button)
        lv.addWidget(self.chat_list, 1)
        saved = QLabel("Saved locally")
        saved.setObjectName("muted")
        saved.setToolTip(str(self.store.dir))
        lv.addWidget(saved)

        # Right: system prompt, settings, transcript, input.
        right = QWidget()
        rv = QVBoxLayout(right)
        rv.setContentsMargins(4, 0, 0, 0)
        rv.setSpacing(6)

        top = QHBoxLayout()
        sys_label = QLabel("System prompt")
        sys_label.setObjectName("muted")
        self.system_edit = QPlainTextEdit(self.chat.system)
        self.system_edit.setFixedHeight(46)
        self.system_edit.setPlaceholderText("(none)")
        self.system_edit.textChanged.connect(self._on_system_changed)
        self.settings_button = QToolButton()
        self.settings_button.setText("Sampling ▾")
        self.settings_button.setCheckable(True)
        self.settings_button.setChecked(True)
        top.addWidget(sys_label)
        top.addWidget(self.system_edit, 1)
        top.addWidget(self.settings_button)
        rv.addLayout(top)

        self.settings = self._build_settings()
        self.settings_button.toggled.connect(self.settings.setVisible)
        rv.addWidget(self.settings)

        if getattr(self.engine.model, "synthetic", False):
            warn = QLabel("⚠ Synthetic model: random weights of a real model's shape — the text is noise; "
                          "use it for timing, not for answers.")
            warn.setStyleSheet("color:#f5c26b")
            warn.setWordWrap(True)
            rv.addWidget(warn)

        self.view = QTextBrowser()
        self.view.setOpenExternalLinks(False)
        self.view.setPlaceholderText("")
        rv.addWidget(self.view, 1)

        self.input = PromptEdit()
        self.input.setPlaceholderText("Message the model — Enter to send, Shift+Enter for a new line, Esc to stop")
        self.input.setFixedHeight(64)
        self.input.submitted.connect(self._on_submit)
        rv.addWidget(self.input)

        buttons = QHBoxLayout()
        self.send_button = QPushButton("Send")
        self.send_button.setObjectName("primary")
        self.send_button.clicked.connect(self._on_submit)
        self.stop_button = QPushButton("Stop (Esc)")
        self.stop_button.setObjectName("danger")
        self.stop_button.clicked.connect(self.stop)
        self.regen_button = QPushButton("↻ Regenerate")
        self.regen_button.clicked.connect(self.regenerate)
        self.copy_button = QPushButton("Copy reply")
        self.copy_button.clicked.connect(self.copy_reply)
        self.state_label = QLabel("")
        self.state_label.setObjectName("muted")
        # Long stats must not widen the window: the label takes what room is left.
        self.state_label.setSizePolicy(QSizePolicy.Ignored, QSizePolicy.Preferred)
        for b in (self.send_button, self.stop_button, self.regen_button, self.copy_button):
            buttons.addWidget(b)
        send_to = QLabel("Send to")
        send_to.setObjectName("muted")
        buttons.addSpacing(8)
        buttons.addWidget(send_to)
        buttons.addWidget(self.backend_combo)
        buttons.addWidget(self.state_label, 1)
        rv.addLayout(buttons)

        split = QSplitter(Qt.Horizontal)
        split.addWidget(left)
        split.addWidget(right)
        split.setStretchFactor(0, 0)
        split.setStretchFactor(1, 1)
        left.setMinimumWidth(140)
        left.setMaximumWidth(260)
        split.setSizes([170, 900])
        outer = QVBoxLayout(self)
        outer.setContentsMargins(6, 6, 6, 6)
        outer.addWidget(split)

        esc = QShortcut(QKeySequence(Qt.Key_Escape), self)
        esc.setContext(Qt.WindowShortcut)
        esc.activated.connect(self.stop)

    def _build_settings(self) -> QWidget:
        box = QFrame()
        row = QHBoxLayout(box)
        row.setContentsMargins(0, 0, 0, 0)
        row.setSpacing(10)

        def field(label: str, widget: QWidget, tip: str) -> None:
            f = QFormLayout()
            f.setContentsMargins(0, 0, 0, 0)
            lab = QLabel(label)
            lab.setObjectName("muted")
            widget.setToolTip(tip)
            f.addRow(lab, widget)
            row.addLayout(f)

        self.temperature = QDoubleSpinBox(decimals=2, minimum=0.0, maximum=2.0, singleStep=0.05, value=0.7)
        self.top_p = QDoubleSpinBox(decimals=2, minimum=0.01, maximum=1.0, singleStep=0.05, value=0.95)
        self.top_k = QSpinBox(minimum=0, maximum=1000, value=40)
        self.repeat_penalty = QDoubleSpinBox(decimals=2, minimum=0.5, maximum=2.0, singleStep=0.05, value=1.1)
        self.max_tokens = QSpinBox(minimum=1, maximum=8192, value=256)
        self.seed = QSpinBox(minimum=-1, maximum=2**31 - 1, value=-1)
        self.seed.setSpecialValueText("random")
        self.backend_combo = QComboBox()
        self.backend_combo.addItem(AUTO)
        for name in self.engine.backend_names:
            self.backend_combo.addItem(name)
        field("Temp", self.temperature, "Sampling temperature; 0 = greedy")
        field("Top-p", self.top_p, "Nucleus sampling: keep the smallest set of tokens with this much probability")
        field("Top-k", self.top_k, "Keep the k most likely tokens (0 = off)")
        field("Repeat", self.repeat_penalty, "Repetition penalty (1 = off)")
        field("Max", self.max_tokens, "Max tokens: the generation budget; the router counts it as decode work")
        field("Seed", self.seed, "Sampling seed (random when unset)")
        for w in (self.temperature, self.top_p, self.top_k, self.repeat_penalty, self.max_tokens):
            w.setFixedWidth(66)
        self.seed.setFixedWidth(90)
        self.backend_combo.setToolTip("Pin replies to one backend, bypassing the routing policy")
        row.addStretch(1)
        return box

    # ---- public API ----

    @property
    def busy(self) -> bool:
        return self.handle is not None

    def sampling(self) -> SamplingParams:
        seed = self.seed.value()
        return SamplingParams(
            temperature=self.temperature.value(),
            top_p=self.top_p.value(),
            top_k=self.top_k.value(),
            repeat_penalty=self.repeat_penalty.value(),
            max_tokens=self.max_tokens.value(),
            seed=None if seed < 0 else seed,
        ).validate()

    def backend_override(self) -> str | None:
        text = self.backend_combo.currentText()
        return None if text == AUTO else text

    def send(self, text: str) -> bool:
        """Append a user message and start streaming the reply; False if busy or empty."""
        text = text.strip()
        if self.busy or not text:
            return False
        self.chat.messages.append(Message("user", text))
        return self._start_reply()

    def stop(self) -> None:
        """Cancel the reply being streamed (its partial text is kept, marked stopped)."""
        if self.handle is not None:
            self.handle.cancel()
            self.state_label.setText("stopping…")

    def regenerate(self) -> bool:
        """Drop the last reply and ask again."""
        if self.busy or not self.chat.messages:
            return False
        if self.chat.messages[-1].role == "assistant":
            self.chat.messages.pop()
        if not self.chat.messages or self.chat.messages[-1].role != "user":
            return False
        return self._start_reply()

    def copy_reply(self) -> str:
        for m in reversed(self.chat.messages):
            if m.role == "assistant":
                QGuiApplication.clipboard().setText(m.content)
                self.status_message.emit("reply copied to the clipboard")
                return m.content
        return ""

    def new_chat(self) -> None:
        if self.busy:
            return
        self._save()
        self.chat = Chat(system=self.system_edit.toPlainText())
        self._render()
        self._reload_list()
        self.input.setFocus()

    def open_chat(self, chat_id: str) -> None:
        if self.busy:
            return
        self._save()
        self.chat = self.store.load(chat_id)
        self.system_edit.blockSignals(True)
        self.system_edit.setPlainText(self.chat.system)
        self.system_edit.blockSignals(False)
        self._render()
        self._update_buttons()

    def transcript_text(self) -> str:
        return self.view.toPlainText()

    def shutdown(self) -> None:
        """Cancel a running reply and save (the panel is going away)."""
        if self.handle is not None:
            self.handle.cancel()
        if self._task is not None and not self._task.done():
            self._task.cancel()
        self._save()

    # ---- streaming ----

    def _start_reply(self) -> bool:
        try:
            sampling = self.sampling()
            tokens = self.engine.chat_tokens(self.chat.prompt_messages())
            request = Request(tuple(tokens), sampling, backend=self.backend_override(), source="gui")
            loop = asyncio.get_event_loop()
            handle = self.engine.submit(request, loop=loop)
        except (EngineError, ValueError) as e:
            self._render(notice=str(e))
            self.status_message.emit(f"not sent: {e}")
            self._update_buttons()
            return False
        self.handle = handle
        self._streamed = []
        self._render(streaming=True)
        backend = handle.backend or "?"
        self.state_label.setText(f"streaming from {backend}…")
        self._task = loop.create_task(self._stream(handle))
        self._update_buttons()
        self.reply_started.emit(handle.id)
        return True

    async def _stream(self, handle) -> None:
        try:
            async for delta in handle.astream():
                self._on_delta(delta)
        except asyncio.CancelledError:
            handle.cancel()
            raise
        self._on_finished(handle)

    def _on_delta(self, delta: str) -> None:
        self._streamed.append(delta)
        if self._stream_cursor is None:
            return
        bar = self.view.verticalScrollBar()
        at_bottom = bar.value() >= bar.maximum() - 4
        self._stream_cursor.insertText(delta)
        if at_bottom:
            bar.setValue(bar.maximum())

    def _on_finished(self, handle) -> None:
        record = handle.result(0)
        decision = handle.decision
        meta = {
            "request_id": record.request_id,
            "backend": record.backend,
            "ttft_s": record.ttft_s,
            "e2e_s": record.e2e_s,
            "tok_s": record.decode_tok_s,
            "prompt_tokens": record.prompt_tokens,
            "cached_tokens": record.cached_tokens,
            "output_tokens": record.output_tokens,
            "finish_reason": record.finish_reason,
            "error": record.error,
            "policy": getattr(decision, "policy", None),
            "reason": getattr(decision, "reason", None),
        }
        self.chat.messages.append(Message("assistant", record.text, meta))
        self.handle = None
        self._task = None
        self._stream_cursor = None
        self._render()
        self._save()
        self._reload_list()
        self.state_label.setText(_meta_plain(meta))
        self._update_buttons()
        self.reply_finished.emit(record)

    # ---- rendering ----

    def _render(self, streaming: bool = False, notice: str | None = None) -> None:
        parts = [f"<div style='color:{MUTED}'>{_welcome(self.engine)}</div>"] if not self.chat.messages else []
        for m in self.chat.messages:
            parts.append(self._message_html(m))
        if notice:
            parts.append(f"<p style='color:{_ERROR}'>⚠ {html.escape(notice)}</p>")
        if streaming:
            parts.append(f"<p style='margin-top:10px'><b style='color:{_ASSISTANT}'>Assistant</b> "
                         f"<span style='color:{MUTED}'>· {html.escape(self.handle.backend or '')} · streaming…</span></p>"
                         "<p id='stream'></p>")
        self.view.setHtml("".join(parts))
        cursor = QTextCursor(self.view.document())
        cursor.movePosition(QTextCursor.End)
        self._stream_cursor = cursor if streaming else None
        self.view.verticalScrollBar().setValue(self.view.verticalScrollBar().maximum())

    def _message_html(self, m: Message) -> str:
        body = html.escape(m.content).replace("\n", "<br>") or f"<i style='color:{MUTED}'>(no text)</i>"
        if m.role == "user":
            return (f"<p style='margin-top:10px'><b style='color:{_USER}'>You</b></p>"
                    f"<p style='margin-left:8px'>{body}</p>")
        meta = m.meta or {}
        return (f"<p style='margin-top:10px'><b style='color:{_ASSISTANT}'>Assistant</b> "
                f"{_meta_html(meta, self._backend_index(meta.get('backend')))}</p>"
                f"<p style='margin-left:8px'>{body}</p>"
                + (f"<p style='color:{_ERROR}'>⚠ {html.escape(meta['error'])}</p>" if meta.get("error") else ""))

    def _backend_index(self, name) -> int:
        names = self.engine.backend_names
        return names.index(name) if name in names else 0

    def _update_buttons(self) -> None:
        busy = self.busy
        self.send_button.setEnabled(not busy)
        self.stop_button.setEnabled(busy)
        has_user = any(m.role == "user" for m in self.chat.messages)
        self.regen_button.setEnabled(not busy and has_user)
        self.copy_button.setEnabled(any(m.role == "assistant" for m in self.chat.messages))
        self.new_button.setEnabled(not busy)
        self.chat_list.setEnabled(not busy)

    # ---- slots ----

    def _on_submit(self) -> None:
        text = self.input.toPlainText()
        if self.send(text):
            self.input.clear()

    def _on_system_changed(self) -> None:
        self.chat.system = self.system_edit.toPlainText()

    def _on_pick_chat(self, item: QListWidgetItem) -> None:
        chat_id = item.data(Qt.UserRole)
        if chat_id and chat_id != self.chat.id:
            self.open_chat(chat_id)

    def _save(self) -> None:
        if not self.chat.messages:
            return
        try:
            self.store.save(self.chat)
        except OSError as e:
            self.status_message.emit(f"could not save the chat: {e}")

    def _reload_list(self) -> None:
        self.chat_list.clear()
        chats = self.store.list()
        if not any(c.id == self.chat.id for c in chats):
            chats.insert(0, self.chat)
        for c in chats:
            item = QListWidgetItem(c.title)
            item.setData(Qt.UserRole, c.id)
            item.setToolTip(f"{len(c.messages)} messages")
            self.chat_list.addItem(item)
            if c.id == self.chat.id:
                item.setSelected(True)
                self.chat_list.setCurrentItem(item)


def _welcome(engine) -> str:
    names = ", ".join(engine.backend_names)
    return (f"<p>Chatting with <b>{html.escape(engine.model.info.name)}</b> on {len(engine.backend_names)} "
            f"backends ({html.escape(names)}). Each reply says which backend served it and why; the "
            "Routing tab shows every decision.</p>")


def _meta_html(meta: dict, index: int) -> str:
    if not meta:
        return ""
    color = backend_color(index)
    bits = [f"<b style='color:{color}'>{html.escape(str(meta.get('backend', '?')))}</b>"]
    bits += [html.escape(b) for b in _meta_bits(meta)]
    return f"<span style='color:{MUTED}'>· " + " · ".join(bits) + "</span>"


def _meta_plain(meta: dict) -> str:
    return " · ".join([str(meta.get("backend", "?")), *_meta_bits(meta)])


def _meta_bits(meta: dict) -> list[str]:
    bits = [f"TTFT {fmt_seconds(meta.get('ttft_s'))}"]
    if meta.get("tok_s"):
        bits.append(f"{meta['tok_s']:.1f} tok/s")
    bits.append(f"{meta.get('output_tokens', 0)} tokens")
    bits.append(f"cached {meta.get('cached_tokens', 0)}/{meta.get('prompt_tokens', 0)}")
    reason = meta.get("finish_reason")
    if reason == "cancelled":
        bits.append("stopped")
    elif reason and reason != "stop":
        bits.append(reason)
    return bits
