"""What the user writes and how the reply is asked for: the message box, the system prompt, the
sampling settings and how much of the context the next request would use.

`Composer` is the message box with Send and Stop; its `PromptEdit` sends on Enter (Shift+Enter:
a new line). `ChatSettings` is the system prompt with its presets (`ui.chat.presets`) and, folded
under "Sampling ▸", `SamplingSettings`: the sampling knobs (temperature, top-p, top-k, repeat
penalty, max tokens, seed), JSON mode with its optional schema (checked as it is typed: a quick
conversion, milliseconds; and again at send), and "Token probabilities": only a reply asked for
with it on stores each token's probability and its alternatives (a chat file stays small
otherwise). `ContextMeter` counts the tokens the next request needs against the largest backend
context.

Main thread only.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable

from PySide6.QtCore import QSettings, Qt, QTimer, Signal
from PySide6.QtWidgets import (
    QCheckBox,
    QDoubleSpinBox,
    QFormLayout,
    QFrame,
    QHBoxLayout,
    QLabel,
    QPlainTextEdit,
    QPushButton,
    QSpinBox,
    QToolButton,
    QVBoxLayout,
    QWidget,
)

from engine.core.errors import ContextLengthExceeded, EngineError
from engine.core.request import Request, SamplingParams

from ..model.history import Chat
from ..theme import palette
from .presets import PresetButton

log = logging.getLogger(__name__)

TOP_ALTERNATIVES = 5  # alternatives per token a reply asks for, with Token probabilities on


class PromptEdit(QPlainTextEdit):
    """The message box: Enter submits, Shift+Enter inserts a new line."""

    submitted = Signal()

    def keyPressEvent(self, event):
        if event.key() in (Qt.Key.Key_Return, Qt.Key.Key_Enter) and not event.modifiers() & Qt.KeyboardModifier.ShiftModifier:
            self.submitted.emit()
            return
        super().keyPressEvent(event)


class SamplingSettings(QFrame):
    """The sampling knobs, JSON mode and token probabilities of the replies asked for next."""

    def __init__(self, engine, parent: QWidget | None = None):
        super().__init__(parent)
        self.engine = engine
        outer = QVBoxLayout(self)
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
        field("Temp", self.temperature, "Sampling temperature; 0 = greedy")
        field("Top-p", self.top_p, "Nucleus sampling: keep the smallest set of tokens with this much probability")
        field("Top-k", self.top_k, "Keep the k most likely tokens (0 = off)")
        field("Repeat", self.repeat_penalty, "Repetition penalty (1 = off)")
        field("Max", self.max_tokens, "Max tokens: the generation budget; the router counts it as decode work")
        field("Seed", self.seed, "Sampling seed (random when unset)")
        for w in (self.temperature, self.top_p, self.top_k, self.repeat_penalty, self.max_tokens):
            w.setFixedWidth(66)
        self.seed.setFixedWidth(90)
        self.json_mode = QCheckBox("JSON")
        self.json_mode.setToolTip("Replies are a JSON object (decoded under a grammar), matching the schema if one is given")
        self.token_probs = QCheckBox("Token probabilities")
        self.token_probs.setToolTip("Keep each token's probability and its most likely alternatives with the "
                                    "reply (shown token by token on request; makes the saved chat larger)")
        self.token_probs.setEnabled(engine.relays_logprobs())  # remote engines do not relay them
        row.addWidget(self.json_mode)
        row.addWidget(self.token_probs)
        row.addStretch(1)
        self.schema_edit = QPlainTextEdit()
        self.schema_edit.setPlaceholderText('JSON schema (optional), e.g. {"type": "object", "properties": '
                                            '{"answer": {"type": "string"}}, "required": ["answer"]}')
        self.schema_edit.setFixedHeight(60)
        self.schema_state = QLabel("")
        self.schema_state.setObjectName("muted")
        self.schema_state.setWordWrap(True)
        for widget in (self.schema_edit, self.schema_state):
            widget.setVisible(False)
            outer.addWidget(widget)
        self.json_mode.toggled.connect(self._on_json_mode)
        self._schema_timer = QTimer(self, singleShot=True, interval=300)
        self._schema_timer.timeout.connect(self._check_schema)
        self.schema_edit.textChanged.connect(self._schema_timer.start)

    def logprobs(self) -> int | None:
        """How many alternatives per token to ask for (None: no probabilities)."""
        return TOP_ALTERNATIVES if self.token_probs.isChecked() and self.token_probs.isEnabled() else None

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

    def widgets(self) -> dict:
        """The settings kept across sessions, by key."""
        return {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
                "repeat_penalty": self.repeat_penalty, "max_tokens": self.max_tokens, "seed": self.seed}

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


class Composer(QWidget):
    """The message box with Send and Stop (Esc) beside it; `submitted` on Enter or Send."""

    submitted = Signal()

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        row = QHBoxLayout(self)
        row.setContentsMargins(0, 0, 0, 0)
        row.setSpacing(6)
        self.input = PromptEdit()
        self.input.setPlaceholderText("Message the model — Enter to send, Shift+Enter for a new line, Esc to stop")
        self.input.setFixedHeight(58)
        self.input.submitted.connect(self.submitted)
        self.send_button = QPushButton("Send")
        self.send_button.setObjectName("primary")
        self.send_button.clicked.connect(self.submitted)
        self.stop_button = QPushButton("Stop (Esc)")
        self.stop_button.setObjectName("danger")
        side = QVBoxLayout()
        side.setSpacing(4)
        side.addWidget(self.send_button)
        side.addWidget(self.stop_button)
        row.addWidget(self.input, 1)
        row.addLayout(side)

    def set_busy(self, busy: bool) -> None:
        """While a reply streams Stop is on and Send off (the box stays editable)."""
        self.send_button.setEnabled(not busy)
        self.stop_button.setEnabled(busy)


class ChatSettings(QWidget):
    """The system prompt, its presets and the Sampling ▸ toggle on one row; the sampling settings
    folded under it. Kept across sessions in `QSettings` (`save` / `load`)."""

    def __init__(self, engine, system: str, parent: QWidget | None = None):
        super().__init__(parent)
        self.engine = engine
        outer = QVBoxLayout(self)
        outer.setContentsMargins(0, 0, 0, 0)
        outer.setSpacing(6)
        top = QHBoxLayout()
        sys_label = QLabel("System prompt")
        sys_label.setObjectName("muted")
        self.system_edit = QPlainTextEdit(system)
        self.system_edit.setFixedHeight(32)
        self.system_edit.setPlaceholderText("(none)")
        self.settings_button = QToolButton()
        self.settings_button.setText("Sampling ▸")
        self.settings_button.setCheckable(True)
        self.settings_button.setChecked(False)
        self.presets = PresetButton(self.system_edit)
        top.addWidget(sys_label)
        top.addWidget(self.system_edit, 1)
        top.addWidget(self.presets)
        top.addWidget(self.settings_button)
        outer.addLayout(top)
        self.sampling_settings = SamplingSettings(engine)
        self.sampling_settings.setVisible(False)
        self.settings_button.toggled.connect(self.sampling_settings.setVisible)
        self.settings_button.toggled.connect(
            lambda on: self.settings_button.setText("Sampling ▾" if on else "Sampling ▸"))
        outer.addWidget(self.sampling_settings)

    def sampling(self) -> SamplingParams:
        """The sampling the next reply asks for; `ValueError` naming a bad setting or schema."""
        s = self.sampling_settings
        seed = s.seed.value()
        return SamplingParams(
            temperature=s.temperature.value(),
            top_p=s.top_p.value(),
            top_k=s.top_k.value(),
            repeat_penalty=s.repeat_penalty.value(),
            max_tokens=s.max_tokens.value(),
            seed=None if seed < 0 else seed,
            logprobs=s.logprobs() if self.engine.relays_logprobs() else None,  # not every backend relays them
            grammar=s.json_grammar(),
        ).validate()

    def show_system(self, text: str) -> None:
        """Show another chat's system prompt (not an edit of the open chat's)."""
        self.system_edit.blockSignals(True)
        self.system_edit.setPlainText(text)
        self.system_edit.blockSignals(False)

    def save(self, settings: QSettings) -> None:
        """Sampling settings, whether they are unfolded and token probabilities, for the next session."""
        settings.beginGroup("sampling")
        for key, w in self.sampling_settings.widgets().items():
            settings.setValue(key, w.value())
        settings.setValue("expanded", self.settings_button.isChecked())
        settings.setValue("token_probs", self.sampling_settings.token_probs.isChecked())
        settings.endGroup()

    def load(self, settings: QSettings) -> None:
        """What `save` kept, and the presets (which persist in `settings` from now on)."""
        self.presets.attach(settings)
        settings.beginGroup("sampling")
        for key, w in self.sampling_settings.widgets().items():
            v = settings.value(key)
            if v is not None:
                try:
                    w.setValue(type(w.value())(v))
                except (TypeError, ValueError):
                    log.warning("ignoring the saved %s setting %r", key, v)
        for key, box in (("expanded", self.settings_button), ("token_probs", self.sampling_settings.token_probs)):
            v = settings.value(key)
            if v is not None:
                box.setChecked(str(v).lower() in ("true", "1"))
        settings.endGroup()


class ContextMeter(QLabel):
    """Tokens the next request needs (the whole chat with the chat template, the draft and the
    max tokens to generate) against the largest healthy backend's context: muted while it fits,
    amber when the reply could run past it, red when the prompt alone is too long. Recounted
    250 ms after the last change (`schedule`), or at once (`refresh`)."""

    def __init__(self, engine, chat: Callable[[], Chat], draft: Callable[[], str], max_tokens: QSpinBox,
                 parent: QWidget | None = None):
        super().__init__(parent)
        self.engine = engine
        self._chat, self._draft, self._max_tokens = chat, draft, max_tokens
        self.setObjectName("muted")
        self.setToolTip("Tokens the next request needs (the whole chat with the chat template, the "
                        "draft and the max tokens to generate) against the largest backend context")
        self._timer = QTimer(self)
        self._timer.setSingleShot(True)
        self._timer.setInterval(250)
        self._timer.timeout.connect(self.refresh)
        max_tokens.valueChanged.connect(self.schedule)

    def schedule(self, *_args) -> None:
        self._timer.start()

    def usage(self) -> tuple[int, int, int]:
        """(prompt tokens of the chat plus the draft, max tokens, the largest backend context)."""
        chat = self._chat()
        messages = chat.prompt_messages()
        draft = self._draft().strip()
        if draft:
            messages.append({"role": "user", "content": draft})
        if len(messages) <= (1 if chat.system.strip() else 0):
            prompt = 0
        elif self.engine.model is None:  # remote engines only: they tokenize; estimate from characters
            prompt = Request((), messages=tuple(messages)).prompt_estimate
        else:
            try:
                prompt = len(self.engine.chat_tokens(messages))
            except ContextLengthExceeded as e:  # refused before it was tokenized whole: at least this long
                prompt = e.n_prompt_tokens
        n_ctx = max((s.n_ctx for s in self.engine.snapshot() if s.healthy), default=0)
        return prompt, self._max_tokens.value(), n_ctx

    def refresh(self) -> None:
        try:
            prompt, budget, n_ctx = self.usage()
        except (EngineError, ValueError) as e:
            self.setText(f"context: ? ({e})")
            return
        c = palette().transcript
        if not n_ctx:  # remote engines that do not say their context: no bound to show
            self.setText(f"context ~{prompt:,} + {budget:,} (the engines check the length)")
            self.setStyleSheet(f"color:{c.muted}")
            return
        over = prompt + 1 > n_ctx
        self.setText(f"context {prompt:,} + {budget:,} / {n_ctx:,}" + (" — too long" if over else ""))
        color = c.error if over else (c.warn if prompt + budget > n_ctx else c.muted)
        self.setStyleSheet(f"color:{color}")
