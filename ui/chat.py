"""The chat panel: streaming replies from the engine, with who served them and how fast.

Replies stream through asyncio (qasync): the panel submits with `loop=` the running loop and a
task iterates `handle.astream()`, so text deltas arrive on the GUI thread without a worker ever
touching a widget. Each reply records the backend that served it, TTFT, decode tok/s and cached
tokens; chats are saved as JSON under the user data dir (`ui.history.ChatStore`).

Replies are shown as Markdown (`ui.markdown`: markdown-it-py + Pygments), each code block with a
Copy link; while a reply streams its text is shown plain and rendered once it ends. Each message
has copy / edit / delete links; the chat list renames, deletes, exports (Markdown, JSON) and
searches chats. A prompt the engine refuses (too long for the context, a bad setting) never
joins the chat: the error is shown, the text stays in the message box, nothing is saved.

Replies from local backends ask for each token's logprob and its `TOP_ALTERNATIVES` most likely alternatives
(kept in the message's meta and saved with it); a reply's "token probabilities" link shows it
token by token, each shaded by its probability, and hovering a token shows its probability and
the alternatives in a tooltip (`QTextBrowser.highlighted`: read from the stored meta, never
from the engine, so hovering never waits).

JSON mode (the "JSON" box) decodes replies under a grammar: any JSON object, or one matching
the JSON schema typed in the schema box. The schema is checked as it is typed (a quick
conversion, milliseconds) and again at send; a bad one is reported and nothing is sent.

The transcript's inline colours (names, meta lines, links, code blocks, token shading, notices)
come from the theme in use (`ui.theme.palette().transcript`); `restyle()` paints the transcript
again after the theme changes (the main window calls it on `Theme.changed`), a streaming reply
included.

Keys: Enter sends (Shift+Enter for a new line), Esc stops the reply being streamed; Enter while
a reply streams says so and keeps the text in the box.
"""

from __future__ import annotations

import asyncio
import html
import json
import logging
import math
from pathlib import Path

from PySide6.QtCore import QSettings, Qt, QTimer, QUrl, Signal
from PySide6.QtGui import QCursor, QDesktopServices, QGuiApplication, QKeySequence, QShortcut, QTextCursor
from PySide6.QtWidgets import (
    QCheckBox, QComboBox, QDoubleSpinBox, QFileDialog, QFormLayout, QFrame, QHBoxLayout, QInputDialog, QLabel,
    QLineEdit, QListWidget, QListWidgetItem, QMenu, QMessageBox, QPlainTextEdit, QPushButton, QSizePolicy,
    QSpinBox, QSplitter, QTextBrowser, QToolButton, QToolTip, QVBoxLayout, QWidget,
)

from engine.core.errors import EngineError
from engine.core.request import Request, SamplingParams

from .formatting import fmt_seconds, model_title
from .history import Chat, ChatStore, Message
from .markdown import COPY_SCHEME, render_markdown
from .presets import PresetButton
from .theme import TranscriptColors, backend_color, palette

log = logging.getLogger(__name__)

AUTO = "auto (router decides)"
TOP_ALTERNATIVES = 5  # alternatives per token a reply asks for (shown on hover)


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
        self._refused: str | None = None  # why the engine refused the last prompt
        self._earlier: list[dict] = []  # the answers a regenerate replaces, kept with the new one
        self._expanded: set[int] = set()  # messages whose earlier answers are shown
        self._token_view: set[int] = set()  # messages shown token by token, with probabilities
        self._code_blocks: list[str] = []  # the shown transcript's code blocks, by their Copy link
        self._synthetic_warning: QLabel | None = None
        self._notice: str | None = None  # the error shown under the transcript, if any
        self._build()
        self._reload_list()
        self._render()
        self._update_buttons()
        self.max_tokens.valueChanged.connect(self._context_timer.start)
        self.update_context_meter()

    # ---- layout ----

    def _build(self) -> None:
        # Left: saved chats.
        left = QWidget()
        lv = QVBoxLayout(left)
        lv.setContentsMargins(0, 0, 4, 0)
        self.new_button = QPushButton("+ New chat")
        self.new_button.setToolTip("Start an empty chat (the current one stays in the list)")
        self.new_button.clicked.connect(self.new_chat)
        self.search_edit = QLineEdit()
        self.search_edit.setPlaceholderText("Search chats")
        self.search_edit.setClearButtonEnabled(True)
        self.search_edit.textChanged.connect(lambda _t: self._reload_list())
        self.chat_list = QListWidget()
        self.chat_list.setTextElideMode(Qt.ElideRight)
        self.chat_list.setHorizontalScrollBarPolicy(Qt.ScrollBarAlwaysOff)
        self.chat_list.itemClicked.connect(self._on_pick_chat)
        self.chat_list.setContextMenuPolicy(Qt.CustomContextMenu)
        self.chat_list.customContextMenuRequested.connect(self._chat_menu)
        self.delete_chat_button = QPushButton("Delete chat")
        self.delete_chat_button.setToolTip("Delete the open chat from the disk (right-click a chat for more)")
        self.delete_chat_button.clicked.connect(lambda: self.delete_chat(self.chat.id, confirm=True))
        lv.addWidget(self.new_button)
        lv.addWidget(self.search_edit)
        lv.addWidget(self.chat_list, 1)
        lv.addWidget(self.delete_chat_button)
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
        self.system_edit.setFixedHeight(40)
        self.system_edit.setPlaceholderText("(none)")
        self.system_edit.textChanged.connect(self._on_system_changed)
        self.settings_button = QToolButton()
        self.settings_button.setText("Sampling ▾")
        self.settings_button.setCheckable(True)
        self.settings_button.setChecked(True)
        self.presets = PresetButton(self.system_edit)
        self.presets.status_message.connect(self.status_message.emit)
        top.addWidget(sys_label)
        top.addWidget(self.system_edit, 1)
        top.addWidget(self.presets)
        top.addWidget(self.settings_button)
        rv.addLayout(top)

        self.settings = self._build_settings()
        self.settings_button.toggled.connect(self.settings.setVisible)
        self.settings_button.toggled.connect(
            lambda on: self.settings_button.setText("Sampling ▾" if on else "Sampling ▸"))
        rv.addWidget(self.settings)

        if getattr(self.engine.model, "synthetic", False):
            warn = QLabel("⚠ Synthetic model: random weights of a real model's shape — the text is noise; "
                          "use it for timing, not for answers.")
            warn.setStyleSheet(f"color:{palette().transcript.warn}")
            self._synthetic_warning = warn
            warn.setToolTip(warn.text())
            warn.setMinimumWidth(100)
            warn.setSizePolicy(QSizePolicy.Ignored, QSizePolicy.Fixed)  # one line, cut rather than widening
            rv.addWidget(warn)

        self.view = QTextBrowser()
        self.view.setOpenExternalLinks(False)
        self.view.setOpenLinks(False)  # our links (copy, edit, delete) go to _on_link
        self.view.anchorClicked.connect(self._on_link)
        self.view.highlighted.connect(self._on_hover)  # a token under the mouse: its probabilities
        self.view.setMinimumHeight(80)  # a few lines of the transcript, even on a 720 px screen
        self.view.setPlaceholderText("")
        rv.addWidget(self.view, 1)

        self.input = PromptEdit()
        self.input.setPlaceholderText("Message the model — Enter to send, Shift+Enter for a new line, Esc to stop")
        self.input.setFixedHeight(54)
        self.input.submitted.connect(self._on_submit)
        rv.addWidget(self.input)
        # How much of the context the next request would use (chat so far + the draft + max tokens).
        self.context_label = QLabel()
        self.context_label.setObjectName("muted")
        self.context_label.setToolTip("Tokens the next request needs (the whole chat with the chat template, the "
                                      "draft and the max tokens to generate) against the largest backend context")
        self._context_timer = QTimer(self)
        self._context_timer.setSingleShot(True)
        self._context_timer.setInterval(250)
        self._context_timer.timeout.connect(self.update_context_meter)
        self.input.textChanged.connect(self._context_timer.start)

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
        buttons.addWidget(self.context_label)
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
        outer = QVBoxLayout(box)
        outer.setContentsMargins(0, 0, 0, 0)
        row = QHBoxLayout()
        row.setContentsMargins(0, 0, 0, 0)
        row.setSpacing(10)
        outer.addLayout(row)

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
        self.json_mode = QCheckBox("JSON")
        self.json_mode.setToolTip("Replies are a JSON object (decoded under a grammar), matching the schema if one is given")
        row.addWidget(self.json_mode)
        row.addStretch(1)
        self.schema_edit = QPlainTextEdit()
        self.schema_edit.setPlaceholderText('JSON schema (optional), e.g. {"type": "object", "properties": '
                                            '{"answer": {"type": "string"}}, "required": ["answer"]}')
        self.schema_edit.setFixedHeight(60)
        self.schema_state = QLabel("")
        self.schema_state.setObjectName("muted")
        self.schema_state.setWordWrap(True)
        for w in (self.schema_edit, self.schema_state):
            w.setVisible(False)
            outer.addWidget(w)
        self.json_mode.toggled.connect(self._on_json_mode)
        self._schema_timer = QTimer(self, singleShot=True, interval=300)
        self._schema_timer.timeout.connect(self._check_schema)
        self.schema_edit.textChanged.connect(self._schema_timer.start)
        return box

    def json_grammar(self) -> str | None:
        """The grammar JSON mode asks for (None: off); `ValueError` naming what is wrong with
        the schema (not JSON, not an object, or one the converter refuses)."""
        if not self.json_mode.isChecked():
            return None
        text = self.schema_edit.toPlainText().strip()
        if not text:
            return self.engine.json_grammar()
        try:
            schema = json.loads(text)
        except ValueError as e:
            raise ValueError(f"the JSON schema is not JSON: {e}") from None
        if not isinstance(schema, dict):
            raise ValueError("the JSON schema must be a JSON object")
        try:
            return self.engine.json_grammar(schema)
        except EngineError as e:
            raise ValueError(str(e)) from None

    def _on_json_mode(self, on: bool) -> None:
        self.schema_edit.setVisible(on)
        self.schema_state.setVisible(on)
        self._check_schema()

    def _check_schema(self) -> None:
        try:
            grammar = self.json_grammar()
        except ValueError as e:
            self.schema_state.setText(f"⚠ {e}")
            return
        self.schema_state.setText("" if grammar is None else
                                  "replies match this schema" if self.schema_edit.toPlainText().strip()
                                  else "replies are a JSON object")

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
            # Remote engines do not relay logprobs (engine/backends/remote/ refuses them).
            logprobs=TOP_ALTERNATIVES if "remote" not in self.engine.devices.values() else None,
            grammar=self.json_grammar(),
        ).validate()

    def backend_override(self) -> str | None:
        text = self.backend_combo.currentText()
        return None if text == AUTO else text

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
        self.chat.messages.append(Message("user", text))
        if self._start_reply():
            return True
        self.chat.messages.pop()
        self._render(notice=self._refused)
        self._update_buttons()
        return False

    def stop(self) -> None:
        """Cancel the reply being streamed (its partial text is kept, marked stopped)."""
        if self.handle is not None:
            self.handle.cancel()
            self.state_label.setText("stopping…")

    def regenerate(self) -> bool:
        """Ask again for the last reply; the earlier answers stay with the new one (meta "earlier")."""
        if self.busy or not self.chat.messages:
            return False
        popped = self.chat.messages.pop() if self.chat.messages[-1].role == "assistant" else None
        if not self.chat.messages or self.chat.messages[-1].role != "user":
            if popped is not None:
                self.chat.messages.append(popped)
            return False
        if popped is not None:
            meta = popped.meta or {}
            self._earlier = [{"content": popped.content, "backend": meta.get("backend")}, *meta.get("earlier", [])]
        if self._start_reply():
            return True
        if popped is not None:  # refused: the chat stays as it was
            self.chat.messages.append(popped)
            self._earlier = []
            self._render(notice=self._refused)
        return False

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
        self._render()
        if self.chat.messages:
            self._save()
        else:
            self.store.delete(self.chat.id)
        self._reload_list()
        self._update_buttons()
        return True

    def edit_message(self, index: int) -> bool:
        """Put a user message back in the box and drop it and everything after it (edit and resend)."""
        if self.busy or not 0 <= index < len(self.chat.messages) or self.chat.messages[index].role != "user":
            return False
        self.input.setPlainText(self.chat.messages[index].content)
        del self.chat.messages[index:]
        self._render()
        self._save()
        self._reload_list()
        self._update_buttons()
        self.input.setFocus()
        return True

    def delete_chat(self, chat_id: str, confirm: bool = False) -> bool:
        """Delete a saved chat; the open one is replaced by an empty chat."""
        if self.busy:
            return False
        if confirm and QMessageBox.question(self, "Delete chat", "Delete this chat? This cannot be undone.") \
                != QMessageBox.Yes:
            return False
        self.store.delete(chat_id)
        if chat_id == self.chat.id:
            self.chat = Chat(system=self.system_edit.toPlainText())
            self._render()
        self._reload_list()
        self._update_buttons()
        self.status_message.emit("chat deleted")
        return True

    def rename_chat(self, chat_id: str, name: str) -> None:
        chat = self.chat if chat_id == self.chat.id else self.store.load(chat_id)
        chat.name = name.strip()
        if chat.messages:
            self.store.save(chat)
        self._reload_list()

    def export_chat(self, path: str | Path, chat_id: str | None = None) -> Path:
        """Write a chat as Markdown (.md) or JSON (any other suffix)."""
        chat = self.chat if chat_id in (None, self.chat.id) else self.store.load(chat_id)
        path = Path(path)
        if path.suffix.lower() in (".md", ".markdown"):
            path.write_text(chat.to_markdown(), encoding="utf-8")
        else:
            path.write_text(json.dumps(chat.to_dict(), ensure_ascii=False, indent=1), encoding="utf-8")
        self.status_message.emit(f"chat exported to {path}")
        return path

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

    def context_usage(self) -> tuple[int, int, int]:
        """(prompt tokens of the chat plus the draft, max tokens, the largest backend context)."""
        messages = self.chat.prompt_messages()
        draft = self.input.toPlainText().strip()
        if draft:
            messages.append({"role": "user", "content": draft})
        if len(messages) <= (1 if self.chat.system.strip() else 0):
            prompt = 0
        elif self.engine.model is None:  # remote engines only: they tokenize; estimate from characters
            prompt = Request((), messages=tuple(messages)).prompt_estimate
        else:
            prompt = len(self.engine.chat_tokens(messages))
        n_ctx = max((s.n_ctx for s in self.engine.snapshot() if s.healthy), default=0)
        return prompt, self.max_tokens.value(), n_ctx

    def update_context_meter(self) -> None:
        try:
            prompt, budget, n_ctx = self.context_usage()
        except (EngineError, ValueError) as e:
            self.context_label.setText(f"context: ? ({e})")
            return
        if not n_ctx:  # remote engines that do not say their context: no bound to show
            self.context_label.setText(f"context ~{prompt:,} + {budget:,} (the engines check the length)")
            self.context_label.setStyleSheet(f"color:{palette().transcript.muted}")
            return
        over = prompt + 1 > n_ctx
        self.context_label.setText(f"context {prompt:,} + {budget:,} / {n_ctx:,}" + (" — too long" if over else ""))
        c = palette().transcript
        color = c.error if over else (c.warn if prompt + budget > n_ctx else c.muted)
        self.context_label.setStyleSheet(f"color:{color}")

    def save_settings(self, settings: QSettings) -> None:
        """Sampling settings and the Send-to choice, for the next session."""
        settings.beginGroup("sampling")
        for key, w in self._setting_widgets().items():
            settings.setValue(key, w.value())
        settings.setValue("expanded", self.settings_button.isChecked())
        settings.endGroup()

    def load_settings(self, settings: QSettings) -> None:
        self.presets.attach(settings)
        settings.beginGroup("sampling")
        for key, w in self._setting_widgets().items():
            v = settings.value(key)
            if v is not None:
                try:
                    w.setValue(type(w.value())(v))
                except (TypeError, ValueError):
                    log.warning("ignoring the saved %s setting %r", key, v)
        settings.endGroup()

    def _setting_widgets(self) -> dict:
        return {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
                "repeat_penalty": self.repeat_penalty, "max_tokens": self.max_tokens, "seed": self.seed}

    def transcript_text(self) -> str:
        return self.view.toPlainText()

    @property
    def streamed_text(self) -> str:
        """The text of the reply streaming now (or the last one), as far as it has come."""
        return "".join(self._streamed)

    def shutdown(self) -> None:
        """Cancel a running reply and save (the panel is going away)."""
        if self.handle is not None:
            self.handle.cancel()
        if self._task is not None and not self._task.done():
            self._task.cancel()
        self._save()

    # ---- streaming ----

    def _start_reply(self) -> bool:
        self._refused = None
        try:
            sampling = self.sampling()
            messages = self.chat.prompt_messages()
            if self.engine.model is None:  # remote engines only: each renders its own template
                request = Request((), sampling, backend=self.backend_override(), source="gui",
                                  messages=tuple(messages))
            else:
                tokens = self.engine.chat_tokens(messages)
                request = Request(tuple(tokens), sampling, backend=self.backend_override(), source="gui")
            loop = asyncio.get_event_loop()
            handle = self.engine.submit(request, loop=loop)
        except (EngineError, ValueError) as e:
            self._refused = str(e)
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
        if record.logprobs:  # [token text, logprob, [[alternative, logprob], ...]] per token
            meta["logprobs"] = [[_piece(e.piece), round(e.logprob, 4), [[_piece(p), round(lp, 4)] for _, p, lp in e.top]]
                                for e in record.logprobs]
        if self._earlier:
            meta["earlier"] = self._earlier
            self._earlier = []
        self.chat.messages.append(Message("assistant", record.text, meta))
        self.handle = None
        self._task = None
        self._stream_cursor = None
        self._render()
        self._save()
        self._reload_list()
        # The label is short (it shares the row); the reply's header and the tooltip have it all.
        self.state_label.setText(" · ".join([str(meta.get("backend", "?")), *_meta_bits(meta)[:2]]))
        self.state_label.setToolTip(_meta_plain(meta))
        self.update_context_meter()
        self._update_buttons()
        self.reply_finished.emit(record)

    # ---- rendering ----

    def restyle(self) -> None:
        """Paint the transcript and the coloured labels again in the theme in use."""
        c = palette().transcript
        if self._synthetic_warning is not None:
            self._synthetic_warning.setStyleSheet(f"color:{c.warn}")
        self._render(streaming=self.busy, notice=self._notice)
        self.update_context_meter()

    def _render(self, streaming: bool = False, notice: str | None = None) -> None:
        c = palette().transcript
        self._notice = notice
        parts = [f"<div style='color:{c.muted}'>{_welcome(self.engine)}</div>"] if not self.chat.messages else []
        self._code_blocks = []
        for i, m in enumerate(self.chat.messages):
            parts.append(self._message_html(m, i, c))
        if notice:
            parts.append(f"<p style='color:{c.error}'>⚠ {html.escape(notice)}</p>")
        if streaming:
            parts.append(f"<p style='margin-top:10px'><b style='color:{c.assistant}'>Assistant</b> "
                         f"<span style='color:{c.muted}'>· {html.escape(self.handle.backend or '')} · streaming…</span></p>"
                         "<p id='stream'></p>")
        self.view.setHtml("".join(parts))
        cursor = QTextCursor(self.view.document())
        cursor.movePosition(QTextCursor.End)
        self._stream_cursor = cursor if streaming else None
        if streaming and self._streamed:  # re-rendered mid-reply (a theme change): what came so far
            cursor.insertText(self.streamed_text)
        self.view.verticalScrollBar().setValue(self.view.verticalScrollBar().maximum())
        self._context_timer.start()

    def _message_html(self, m: Message, index: int, c: TranscriptColors) -> str:
        muted = c.muted
        links = [f"<a href='msg:copy:{index}' style='color:{muted}'>copy</a>"]
        if m.role == "user":
            links.append(f"<a href='msg:edit:{index}' style='color:{muted}'>edit</a>")
        links.append(f"<a href='msg:delete:{index}' style='color:{muted}'>delete</a>")
        actions = f"<span style='font-size:small'>&nbsp;&nbsp;{' · '.join(links)}</span>"
        if m.role == "user":
            body = html.escape(m.content).replace("\n", "<br>") or f"<i style='color:{muted}'>(no text)</i>"
            return (f"<p style='margin-top:10px'><b style='color:{c.user}'>You</b>{actions}</p>"
                    f"<p style='margin-left:8px'>{body}</p>")
        meta = m.meta or {}
        if m.content.strip():
            body, self._code_blocks = render_markdown(m.content, self._code_blocks, c.code)
        else:
            body = f"<p><i style='color:{muted}'>(no text)</i></p>"
        tokens = meta.get("logprobs")
        if tokens:
            shown = index in self._token_view
            if shown:
                body = _tokens_html(tokens, index, c.unlikely)
            body += (f"<p style='font-size:small'><a href='msg:probs:{index}' style='color:{muted}'>"
                     f"{'hide' if shown else 'show'} token probabilities</a></p>")
        earlier = meta.get("earlier") or []
        if earlier:
            n = len(earlier)
            shown = index in self._expanded
            body += (f"<p style='font-size:small'><a href='msg:earlier:{index}' style='color:{muted}'>"
                     f"{'hide' if shown else 'show'} {n} earlier answer{'s' if n != 1 else ''}</a></p>")
            if shown:
                for k, e in enumerate(earlier, 1):
                    body += (f"<p style='color:{muted};margin-left:12px'>#{k} ({html.escape(str(e.get('backend')))}): "
                             f"{html.escape(e.get('content', '')).replace(chr(10), '<br>')}</p>")
        return (f"<p style='margin-top:10px'><b style='color:{c.assistant}'>Assistant</b> "
                f"{_meta_html(meta, self._backend_index(meta.get('backend')), c)}{actions}</p>"
                f"<div style='margin-left:8px'>{body}</div>"
                + (f"<p style='color:{c.error}'>⚠ {html.escape(meta['error'])}</p>" if meta.get("error") else ""))

    def _on_link(self, url: QUrl) -> None:
        text = url.toString()
        scheme, _, rest = text.partition(":")
        if scheme == COPY_SCHEME:
            index = int(rest)
            if 0 <= index < len(self._code_blocks):
                QGuiApplication.clipboard().setText(self._code_blocks[index])
                self.status_message.emit("code copied to the clipboard")
        elif scheme == "msg":
            action, _, number = rest.partition(":")
            index = int(number)
            if action == "copy" and 0 <= index < len(self.chat.messages):
                QGuiApplication.clipboard().setText(self.chat.messages[index].content)
                self.status_message.emit("message copied to the clipboard")
            elif action == "edit":
                self.edit_message(index)
            elif action == "delete":
                self.delete_message(index)
            elif action == "earlier":
                self._expanded ^= {index}
                self._render()
            elif action == "probs":
                self._token_view ^= {index}
                self._render()
        elif url.scheme() in ("http", "https"):
            QDesktopServices.openUrl(url)

    def token_tip(self, index: int, k: int) -> str:
        """The tooltip of token `k` of message `index`: its probability and the alternatives."""
        tokens = (self.chat.messages[index].meta or {}).get("logprobs") or []
        if not 0 <= k < len(tokens):
            return ""
        text, lp, top = tokens[k]
        lines = [f"{text!r}  p = {math.exp(lp):.3f}  (logprob {lp:.3f})"]
        lines += [f"   {alt!r}  {math.exp(alt_lp):.3f}" for alt, alt_lp in top]
        return "\n".join(lines)

    def _on_hover(self, url: QUrl) -> None:
        scheme, _, rest = url.toString().partition(":")
        if scheme != "tok":
            QToolTip.hideText()
            return
        index, _, k = rest.partition(":")
        tip = self.token_tip(int(index), int(k))
        if tip:
            QToolTip.showText(QCursor.pos(), tip, self.view)

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
        self.delete_chat_button.setEnabled(not busy)

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

    def _chat_menu(self, pos) -> None:
        item = self.chat_list.itemAt(pos)
        if item is None or self.busy:
            return
        chat_id = item.data(Qt.UserRole)
        menu = QMenu(self)
        menu.addAction("Rename…", lambda: self._ask_rename(chat_id, item.text()))
        menu.addAction("Export as Markdown…", lambda: self._ask_export(chat_id, "Markdown (*.md)", ".md"))
        menu.addAction("Export as JSON…", lambda: self._ask_export(chat_id, "JSON (*.json)", ".json"))
        menu.addSeparator()
        menu.addAction("Delete", lambda: self.delete_chat(chat_id, confirm=True))
        menu.exec(self.chat_list.mapToGlobal(pos))

    def _ask_rename(self, chat_id: str, current: str) -> None:
        name, ok = QInputDialog.getText(self, "Rename chat", "Title", text=current)
        if ok:
            self.rename_chat(chat_id, name)

    def _ask_export(self, chat_id: str, filt: str, suffix: str) -> None:
        path, _ = QFileDialog.getSaveFileName(self, "Export chat", f"chat{suffix}", filt)
        if path:
            try:
                self.export_chat(path, chat_id)
            except OSError as e:
                self.status_message.emit(f"could not export the chat: {e}")

    def _reload_list(self) -> None:
        self.chat_list.clear()
        chats = self.store.list()
        if not any(c.id == self.chat.id for c in chats):
            chats.insert(0, self.chat)
        query = self.search_edit.text()
        for c in chats:
            if c.id != self.chat.id and not c.matches(query):
                continue
            item = QListWidgetItem(c.title)
            item.setData(Qt.UserRole, c.id)
            item.setToolTip(f"{c.title}\n{len(c.messages)} messages")
            self.chat_list.addItem(item)
            if c.id == self.chat.id:
                item.setSelected(True)
                self.chat_list.setCurrentItem(item)


def _piece(piece: bytes) -> str:
    return piece.decode("utf-8", errors="replace")


def _tokens_html(tokens: list, index: int, unlikely: str) -> str:
    """A reply token by token: each a link (`tok:MESSAGE:TOKEN`, hovered for its tooltip) shaded
    by how unlikely it was (clear: near certain; red: a long shot)."""
    parts = []
    for k, (text, lp, _top) in enumerate(tokens):
        alpha = round(0.55 * (1.0 - math.exp(lp)), 2)
        shown = html.escape(text).replace("\n", "↵<br>") or "∅"
        parts.append(f"<a href='tok:{index}:{k}' style='color:inherit;text-decoration:none;"
                     f"background-color:rgba({unlikely},{alpha})'>{shown}</a>")
    return f"<p style='margin-left:8px;white-space:pre-wrap'>{''.join(parts)}</p>"


def _welcome(engine) -> str:
    names = ", ".join(engine.backend_names)
    model = model_title(engine.model.info) if engine.model is not None else ", ".join(engine.model_ids()) or "?"
    n = len(engine.backend_names)
    return (f"<p>Chatting with <b>{html.escape(model)}</b> on {n} backend{'s' if n != 1 else ''} "
            f"({html.escape(names)}). Each reply says which backend served it and why; the "
            "Routing tab shows every decision.</p>")


def _meta_html(meta: dict, index: int, c: TranscriptColors) -> str:
    if not meta:
        return ""
    color = c.backend(backend_color(index))
    bits = [f"<b style='color:{color}'>{html.escape(str(meta.get('backend', '?')))}</b>"]
    bits += [html.escape(b) for b in _meta_bits(meta)]
    return f"<span style='color:{c.muted}'>· " + " · ".join(bits) + "</span>"


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
