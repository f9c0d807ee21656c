"""The chat panel: the saved chats, the transcript, the message box, and replies streamed from the engine.

Replies stream through asyncio (qasync): the panel submits with `loop=` the running loop and a
task iterates `handle.astream()`, so text deltas arrive on the GUI thread without a worker ever
touching a widget. Each reply records the backend that served it, TTFT, decode tok/s and cached
tokens; chats are saved as JSON under the user data dir (`ui.history.ChatStore`).

The chat itself (`ui.history.Chat`) changes only here: a reply is appended, a regenerated one
becomes a new version of the last reply (‹k/n› switches), an edited question saved becomes a new
version of it and is answered again (Cancel leaves the chat as it was), Continue goes on with a
reply cut by its length limit. A prompt the engine refuses (too long for the context, a bad
setting) never joins the chat: the error is shown, the text stays in the message box, nothing is
saved.

A reply asked for with Token probabilities on keeps each token's logprob and its alternatives;
its bubble can show it token by token, each shaded by its probability, with a tooltip on hover
read from the stored meta (hovering never waits on the engine).

Keys: Enter sends (Shift+Enter for a new line), Esc stops the reply being streamed; Enter while
a reply streams says so and keeps the text in the box.
"""

from __future__ import annotations

import asyncio
import copy
import html
import json
import logging
import math
from pathlib import Path

from PySide6.QtCore import QSettings, Qt, QTimer, QUrl, Signal
from PySide6.QtGui import QCursor, QDesktopServices, QGuiApplication, QKeySequence, QShortcut
from PySide6.QtWidgets import (
    QCheckBox,
    QComboBox,
    QDoubleSpinBox,
    QHBoxLayout,
    QLabel,
    QMessageBox,
    QPlainTextEdit,
    QPushButton,
    QSizePolicy,
    QSpinBox,
    QSplitter,
    QToolButton,
    QToolTip,
    QVBoxLayout,
    QWidget,
)

from engine.core.errors import ContextLengthExceeded, EngineError
from engine.core.handle import RequestHandle
from engine.core.request import Request, SamplingParams

from ..advice import advise
from ..history import Chat, ChatStore, Message
from ..presets import PresetButton
from ..theme import palette
from .chat_list import ChatList
from .composer import PromptEdit, SamplingSettings
from .transcript import Bubble, Transcript, meta_bits, meta_html, meta_plain, tokens_html, welcome_html

log = logging.getLogger(__name__)

AUTO = "auto (router)"


class ChatPanel(QWidget):
    """Chat with the engine. `engine` is read for backends and used to submit; `store` saves chats."""

    reply_started = Signal(str)  # request id
    reply_finished = Signal(object)  # FinishRecord
    status_message = Signal(str)

    # The sampling controls: `self.settings`' own, named here too (`_build`).
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
        self.chat = Chat()
        self.handle: RequestHandle | None = None  # the reply being streamed
        self._task: asyncio.Task | None = None
        self._pending: tuple = ("append", -1)  # what the streaming reply becomes: append / version j / continue j
        self._streamed: list[str] = []
        self._stream_label: QLabel | None = None
        self._stream_prefix = ""  # a continued reply's text so far, shown before what streams
        self._refused: str | None = None  # why the engine refused the last prompt
        self._editing: int | None = None  # the message open in its editor
        self._token_view: set[int] = set()  # messages shown token by token, with probabilities
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
        left = self.chats = ChatList(self.store)
        self.new_button, self.search_edit = self.chats.new_button, self.chats.search_edit
        self.chat_list, self.delete_chat_button = self.chats.chat_list, self.chats.delete_chat_button
        self.chats.new_asked.connect(self.new_chat)
        self.chats.open_asked.connect(self.open_chat)
        self.chats.delete_asked.connect(lambda chat_id: self.delete_chat(chat_id, confirm=True))
        self.chats.rename_asked.connect(self.rename_chat)
        self.chats.export_asked.connect(self._export_asked)
        self.search_edit.textChanged.connect(lambda _t: self._reload_list())

        # Right: system prompt and settings (one row, the settings folded), transcript, message box.
        right = QWidget()
        rv = QVBoxLayout(right)
        rv.setContentsMargins(4, 0, 0, 0)
        rv.setSpacing(6)

        top = QHBoxLayout()
        sys_label = QLabel("System prompt")
        sys_label.setObjectName("muted")
        self.system_edit = QPlainTextEdit(self.chat.system)
        self.system_edit.setFixedHeight(32)
        self.system_edit.setPlaceholderText("(none)")
        self.system_edit.textChanged.connect(self._on_system_changed)
        self.settings_button = QToolButton()
        self.settings_button.setText("Sampling ▸")
        self.settings_button.setCheckable(True)
        self.settings_button.setChecked(False)
        self.presets = PresetButton(self.system_edit)
        self.presets.status_message.connect(self.status_message.emit)
        top.addWidget(sys_label)
        top.addWidget(self.system_edit, 1)
        top.addWidget(self.presets)
        top.addWidget(self.settings_button)
        rv.addLayout(top)

        self.settings = SamplingSettings(self.engine)
        self.settings.setVisible(False)
        for name in ("temperature", "top_p", "top_k", "repeat_penalty", "max_tokens", "seed", "json_mode",
                     "schema_edit", "schema_state", "token_probs"):
            setattr(self, name, getattr(self.settings, name))
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
            warn.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Fixed)  # one line, cut rather than widening
            rv.addWidget(warn)

        self.transcript = Transcript()
        self.transcript.setMinimumHeight(120)
        rv.addWidget(self.transcript, 1)

        compose = QHBoxLayout()
        compose.setSpacing(6)
        self.input = PromptEdit()
        self.input.setPlaceholderText("Message the model — Enter to send, Shift+Enter for a new line, Esc to stop")
        self.input.setFixedHeight(58)
        self.input.submitted.connect(self._on_submit)
        self.send_button = QPushButton("Send")
        self.send_button.setObjectName("primary")
        self.send_button.clicked.connect(self._on_submit)
        self.stop_button = QPushButton("Stop (Esc)")
        self.stop_button.setObjectName("danger")
        self.stop_button.clicked.connect(self.stop)
        side = QVBoxLayout()
        side.setSpacing(4)
        side.addWidget(self.send_button)
        side.addWidget(self.stop_button)
        compose.addWidget(self.input, 1)
        compose.addLayout(side)
        rv.addLayout(compose)

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
        footer.addWidget(self.context_label)
        rv.addLayout(footer)

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

    def json_grammar(self) -> str | None:
        """The grammar JSON mode asks for (None: off); `ValueError` naming what is wrong."""
        return self.settings.json_grammar()

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
            logprobs=self.settings.logprobs() if self.engine.relays_logprobs() else None,  # not every backend relays them
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
        self._editing = None
        self.chat.messages.append(Message("user", text))
        if self._start_reply(("append", -1)):
            return True
        self.chat.messages.pop()
        self._render(notice=self._refused, start=len(self.chat.messages) - 1)
        self._update_buttons()
        return False

    def stop(self) -> None:
        """Cancel the reply being streamed (its partial text is kept, marked stopped)."""
        if self.handle is not None:
            self.handle.cancel()
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
            return self._start_reply(("version", last), self.chat.prompt_messages(upto=last))
        return self._start_reply(("append", -1))

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
        return self._start_reply(("continue", len(self.chat.messages) - 1), continue_final=True)

    def switch_version(self, index: int, k: int) -> bool:
        """Show version `k` of message `index` (and the messages that followed it)."""
        if self.busy or not 0 <= index < len(self.chat.messages):
            return False
        m = self.chat.messages[index]
        if not 0 <= k < m.n_versions or k == m.shown:
            return False
        self._editing = None
        self.chat.switch(index, k)
        self._token_view = set()
        self._render()
        self._save()
        self._update_buttons()
        self.update_context_meter()
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
        self._editing = None
        self._token_view = set()
        self._render()
        if self.chat.messages:
            self._save()
        else:
            self.store.delete(self.chat.id)
        self._reload_list()
        self._update_buttons()
        return True

    def edit_message(self, index: int) -> bool:
        """Open a user message in its editor (Save and send, or Cancel); the chat is unchanged until saved."""
        if self.busy or not 0 <= index < len(self.chat.messages) or self.chat.messages[index].role != "user":
            return False
        self._editing = index
        self._render(start=index)
        return True

    @property
    def editor(self) -> QPlainTextEdit | None:
        """The editor of the message being edited, if any."""
        b = self._bubble_of(self._editing)
        return b.editor if b is not None else None

    def bubble(self, index: int) -> Bubble | None:
        """The bubble that shows message `index` (None while it is hidden or out of range)."""
        return self._bubble_of(index)

    def cancel_edit(self) -> None:
        """Close the editor; the chat stays as it was."""
        if self._editing is not None:
            index, self._editing = self._editing, None
            self._render(start=index)

    def save_edit(self, index: int, text: str) -> bool:
        """The edited text becomes a new version of message `index` (the old one and what followed
        it stay, ‹k/n›) and is answered again; False (the chat unchanged) if empty or refused."""
        text = text.strip()
        if self.busy or self._editing != index or not text:
            return False
        before = copy.deepcopy(self.chat.messages)
        self.chat.add_version(index, text)
        self._editing = None
        if self._start_reply(("append", -1)):
            return True
        self.chat.messages = before  # refused: as it was
        self._editing = index
        self._render(notice=self._refused)
        self._update_buttons()
        return False

    def delete_chat(self, chat_id: str, confirm: bool = False) -> bool:
        """Delete a saved chat; the open one is replaced by an empty chat."""
        if self.busy:
            return False
        if confirm and QMessageBox.question(self, "Delete chat", "Delete this chat? This cannot be undone.") \
                != QMessageBox.StandardButton.Yes:
            return False
        self.store.delete(chat_id)
        if chat_id == self.chat.id:
            self._set_chat(Chat(system=self.system_edit.toPlainText()))
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
        self._set_chat(Chat(system=self.system_edit.toPlainText()))
        self._reload_list()
        self.input.setFocus()

    def open_chat(self, chat_id: str) -> None:
        if self.busy:
            return
        self._save()
        self._set_chat(self.store.load(chat_id))
        self.system_edit.blockSignals(True)
        self.system_edit.setPlainText(self.chat.system)
        self.system_edit.blockSignals(False)
        self._update_buttons()

    def _set_chat(self, chat: Chat) -> None:
        self.chat = chat
        self.chats.current_id = chat.id
        self._editing = None
        self._token_view = set()
        self._render()
        self.transcript.to_bottom()

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
            try:
                prompt = len(self.engine.chat_tokens(messages))
            except ContextLengthExceeded as e:  # refused before it was tokenized whole: at least this long
                prompt = e.n_prompt_tokens
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
        """Sampling settings, whether they are unfolded and token probabilities, for the next session."""
        settings.beginGroup("sampling")
        for key, w in self.settings.widgets().items():
            settings.setValue(key, w.value())
        settings.setValue("expanded", self.settings_button.isChecked())
        settings.setValue("token_probs", self.token_probs.isChecked())
        settings.endGroup()

    def load_settings(self, settings: QSettings) -> None:
        self.presets.attach(settings)
        settings.beginGroup("sampling")
        for key, w in self.settings.widgets().items():
            v = settings.value(key)
            if v is not None:
                try:
                    w.setValue(type(w.value())(v))
                except (TypeError, ValueError):
                    log.warning("ignoring the saved %s setting %r", key, v)
        for key, box in (("expanded", self.settings_button), ("token_probs", self.token_probs)):
            v = settings.value(key)
            if v is not None:
                box.setChecked(str(v).lower() in ("true", "1"))
        settings.endGroup()

    def transcript_text(self) -> str:
        """The transcript as plain text: each bubble's header, text and code, the notices."""
        return self.transcript.plain_text()

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

    def _start_reply(self, pending: tuple, messages: list[dict] | None = None, continue_final: bool = False) -> bool:
        self._refused = None
        try:
            sampling = self.sampling()
            messages = messages if messages is not None else self.chat.prompt_messages()
            if self.engine.model is None:  # remote engines only: each renders its own template
                request = Request((), sampling, backend=self.backend_override(), source="gui",
                                  messages=tuple(messages))
            else:
                tokens = self.engine.chat_tokens(messages, continue_final=continue_final)
                request = Request(tuple(tokens), sampling, backend=self.backend_override(), source="gui")
            loop = asyncio.get_event_loop()
            handle = self.engine.submit(request, loop=loop)
        except (EngineError, ValueError) as e:
            why = advise(e, "engine").text  # a dead engine in plain words; anything else as raised
            self._refused = why
            self._render(notice=why, start=len(self.chat.messages) - 2)
            self.status_message.emit(f"not sent: {why}")
            self._update_buttons()
            return False
        self.handle = handle
        self._pending = pending
        self._streamed = []
        kind, index = pending
        # from the message before the new one (it loses Regenerate / Continue), or the one replaced
        self._render(start=index if kind != "append" else len(self.chat.messages) - 2)
        self.transcript.to_bottom()  # the question just asked and the reply coming
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
        if self._stream_label is not None:
            self._stream_label.setText(self._stream_prefix + self.streamed_text)

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
        kind, index = self._pending
        start = index if kind != "append" else len(self.chat.messages)
        if kind == "version":
            self.chat.add_version(index, record.text, meta)
        elif kind == "continue":
            m = self.chat.messages[index]
            before = m.meta or {}
            merged = {**before, **meta, "output_tokens": before.get("output_tokens", 0) + record.output_tokens,
                      "continued": before.get("continued", 0) + 1}
            if before.get("logprobs") or meta.get("logprobs"):
                merged["logprobs"] = (before.get("logprobs") or []) + (meta.get("logprobs") or [])
            m.content += record.text
            m.meta = merged
            meta = merged
        else:
            self.chat.messages.append(Message("assistant", record.text, meta))
        self.handle = None
        self._task = None
        self._pending = ("append", -1)
        self._render(start=start)
        self._save()
        self._reload_list()
        # The label is short (it shares the row); the reply's header and the tooltip have it all.
        self.state_label.setText(" · ".join([str(meta.get("backend", "?")), *meta_bits(meta)[:2]]))
        self.state_label.setToolTip(meta_plain(meta))
        self.update_context_meter()
        self._update_buttons()
        self.reply_finished.emit(record)

    # ---- rendering ----

    def restyle(self) -> None:
        """Paint the transcript and the coloured labels again in the theme in use."""
        c = palette().transcript
        if self._synthetic_warning is not None:
            self._synthetic_warning.setStyleSheet(f"color:{c.warn}")
        self._render(notice=self._notice)
        self.update_context_meter()

    def _render(self, notice: str | None = None, start: int = 0) -> None:
        """Build the transcript's bubbles again from message `start` on, those before it kept as
        they are (a long chat re-renders in milliseconds after a reply); the scroll position stays
        where the user left it."""
        c = palette().transcript
        self._notice = notice
        t = self.transcript
        kind, hidden = self._pending if self.busy else ("append", -1)
        shown = [w for w in t.bubbles[:start] if isinstance(w, Bubble)]
        if start <= 0 or len(shown) != start or any(b.index != i for i, b in enumerate(shown)) or 0 <= hidden < start:
            start = 0  # what is shown is not those messages in order: all of it again
        t.clear(keep=start)
        self._stream_label = None
        if not self.chat.messages:
            t.add(self._note(welcome_html(self.engine), c.muted))
        for i, m in enumerate(self.chat.messages[start:], start):
            if i != hidden:
                t.add(self._bubble(m, i))
        if notice:
            t.add(self._note(f"⚠ {html.escape(notice)}", c.error))
        if self.handle is not None:  # busy
            b = Bubble("assistant", -1)
            b.set_meta(f"<span style='color:{c.muted}'>· {html.escape(self.handle.backend or '')} · "
                       + ("continuing…" if kind == "continue" else "streaming…") + "</span>")
            self._stream_prefix = self.chat.messages[hidden].content if kind == "continue" else ""
            self._stream_label = b.add_text(self._stream_prefix + self.streamed_text, plain=True)
            t.add(b)
        self._context_timer.start()

    @staticmethod
    def _note(rich: str, color: str) -> QLabel:
        label = QLabel(f"<span style='color:{color}'>{rich}</span>")
        label.setWordWrap(True)
        label.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Preferred)
        label.setStyleSheet("background: transparent;")
        return label

    def _bubble(self, m: Message, index: int) -> Bubble:
        c = palette().transcript
        b = Bubble(m.role, index)
        meta = m.meta or {}
        last = index == len(self.chat.messages) - 1
        if m.role == "assistant":
            b.set_meta(meta_html(meta, self._backend_index(meta.get("backend")), c))
        if m.n_versions > 1:
            b.add_switcher(m.shown, m.n_versions)
        if m.role == "user":
            if m.content:
                b.add_text(m.content, plain=True)
            else:
                b.add_text(f"<i style='color:{c.muted}'>(no text)</i>")
        else:
            tokens = meta.get("logprobs")
            if tokens and index in self._token_view:
                b.add_tokens(tokens_html(tokens, index, c.unlikely))
            elif m.content.strip():
                b.add_markdown(m.content, c)
            else:
                b.add_text(f"<i style='color:{c.muted}'>(no text)</i>")
            if meta.get("error"):  # kept as raised in the chat's store; said as advice
                why = advise(str(meta["error"]), "engine").text
                b.add_text(f"<span style='color:{c.error}'>⚠ {html.escape(why)}</span>")
        b.add_action("copy", "Copy", "Copy this message")
        if m.role == "user":
            b.add_action("edit", "Edit", "Edit this message; Save sends it again, Cancel leaves the chat as it is")
        if m.role == "assistant" and last:
            b.add_action("regenerate", "↻ Regenerate", "Ask again; this answer stays (‹1/2›)")
        if meta.get("logprobs"):
            shown = index in self._token_view
            b.add_action("probs", "Hide probabilities" if shown else "Token probabilities",
                         "Show the reply token by token, shaded by probability (hover a token for its alternatives)")
        b.add_action("delete", "Delete", "Delete this message")
        if last and self.can_continue():
            b.add_button("continue", "Continue", "The reply reached its max tokens: go on from where it stopped")
        if index == self._editing:
            b.start_edit(m.content)
        b.action.connect(self._on_action)
        b.edited.connect(self.save_edit)
        b.link.connect(self._on_link)
        b.token_hovered.connect(self._on_token_hover)
        b.copied.connect(lambda _s: self.status_message.emit("code copied to the clipboard"))
        return b

    def _bubble_of(self, index: int | None) -> Bubble | None:
        if index is None:
            return None
        return next((b for b in self.transcript.bubbles if isinstance(b, Bubble) and b.index == index), None)

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
            self._token_view ^= {index}
            self._render(start=index)

    def _on_link(self, href: str) -> None:
        url = QUrl(href)
        if url.scheme() in ("http", "https"):
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

    def _on_token_hover(self, index: int, k: int) -> None:
        tip = self.token_tip(index, k) if index >= 0 else ""
        if tip:
            QToolTip.showText(QCursor.pos(), tip, self.transcript)
        else:
            QToolTip.hideText()

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
        self.chats.set_busy(busy)

    # ---- slots ----

    def _on_submit(self) -> None:
        text = self.input.toPlainText()
        if self.send(text):
            self.input.clear()

    def _on_system_changed(self) -> None:
        self.chat.system = self.system_edit.toPlainText()

    def _save(self) -> None:
        if not self.chat.messages:
            return
        try:
            self.store.save(self.chat)
        except OSError as e:
            self.status_message.emit(f"could not save the chat: {e}")

    def _export_asked(self, chat_id: str, path: str) -> None:
        try:
            self.export_chat(path, chat_id)
        except OSError as e:
            self.status_message.emit(f"could not export the chat: {e}")

    def _reload_list(self) -> None:
        self.chats.reload(self.chat)


def _piece(piece: bytes) -> str:
    return piece.decode("utf-8", errors="replace")
