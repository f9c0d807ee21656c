"""What the user writes and how the reply is asked for: the message box and the sampling settings.

`PromptEdit` sends on Enter (Shift+Enter: a new line). `SamplingSettings` is the row of sampling
knobs under "Sampling ▸" (temperature, top-p, top-k, repeat penalty, max tokens, seed), JSON mode
with its optional schema (checked as it is typed: a quick conversion, milliseconds; and again
at send), and "Token probabilities": only a reply asked for with it on stores each token's
probability and its alternatives (a chat file stays small otherwise).

Main thread only.
"""

from __future__ import annotations

import json

from PySide6.QtCore import Qt, QTimer, Signal
from PySide6.QtWidgets import (
    QCheckBox,
    QDoubleSpinBox,
    QFormLayout,
    QFrame,
    QHBoxLayout,
    QLabel,
    QPlainTextEdit,
    QSpinBox,
    QVBoxLayout,
    QWidget,
)

from engine.core.errors import EngineError

TOP_ALTERNATIVES = 5  # alternatives per token a reply asks for, with Token probabilities on


class PromptEdit(QPlainTextEdit):
    """The message box: Enter submits, Shift+Enter inserts a new line."""

    submitted = Signal()

    def keyPressEvent(self, event):
        if event.key() in (Qt.Key_Return, Qt.Key_Enter) and not event.modifiers() & Qt.ShiftModifier:
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
