"""The transcript: one bubble per message, code blocks that scroll on their own, the reply in view.

`Transcript` is a vertical scroll area of `Bubble`s that never scrolls sideways: a long line
wraps, and a code block is a `CodeBlock` widget with its own horizontal scroll bar and Copy
button. It follows the bottom while the view is at the bottom (the reply being streamed stays
in view) and stays where the user scrolled to otherwise, a re-render included.

A bubble shows who spoke, the reply's details, a ‹k/n› switcher when the message has several
versions, and its actions (copy, edit, delete, regenerate, continue, token probabilities) while
the mouse is over it; it says what was asked for through `Bubble.action` and never changes the
chat itself. Editing happens in place: the bubble's text becomes an editor with Save and Cancel.

Colours come from the theme in use (`ui.theme.palette()`); the panel rebuilds the bubbles when
it changes. Main thread only.
"""

from __future__ import annotations

import html
import math

from PySide6.QtCore import QSize, Qt, Signal
from PySide6.QtGui import QColor, QGuiApplication, QTextDocument
from PySide6.QtWidgets import (
    QFrame,
    QHBoxLayout,
    QLabel,
    QPlainTextEdit,
    QPushButton,
    QScrollArea,
    QSizePolicy,
    QToolButton,
    QVBoxLayout,
    QWidget,
)

from ..model.formatting import fmt_seconds
from ..model.markdown import COPY_SCHEME, Code, markdown_segments
from ..theme import TranscriptColors, backend_color, palette

# Bubble backgrounds by palette name: the user's tinted, the assistant's close to the page.
BUBBLE_BG = {"dark": {"user": "#27334a", "assistant": "#262b33"},
             "light": {"user": "#e4edfb", "assistant": "#f1f3f6"}}


def _faded(hex_color: str) -> str:
    c = QColor(hex_color)
    return f"rgba({c.red()},{c.green()},{c.blue()},0.35)"


def _plain(rich: str) -> str:
    doc = QTextDocument()
    doc.setHtml(rich)
    return doc.toPlainText()


def _transparent(w: QWidget) -> QWidget:
    """`w` drawn on its bubble (the app's style sheet paints every widget's background); by its
    name only, so its children keep their own styles (a button in an editor stays a button)."""
    if not w.objectName():
        w.setObjectName("clear")
    w.setStyleSheet(f"#{w.objectName()} {{ background: transparent; }}")
    return w


class CodeBlock(QFrame):
    """A code block: its language and a Copy button over the code, which scrolls sideways on its
    own (never wrapped, never widening the transcript)."""

    copied = Signal(str)  # the block's source, put on the clipboard

    def __init__(self, code: Code, parent: QWidget | None = None):
        super().__init__(parent)
        self.source = code.source
        colors = palette().transcript.code
        self.setObjectName("codeblock")
        self.setStyleSheet(f"QFrame#codeblock {{ background: {colors.bg}; border-radius: 4px; }}")
        lay = QVBoxLayout(self)
        lay.setContentsMargins(0, 0, 0, 0)
        lay.setSpacing(0)
        head = QWidget()
        head.setStyleSheet(f"background: {colors.head_bg};")
        hl = QHBoxLayout(head)
        hl.setContentsMargins(8, 2, 4, 2)
        label = QLabel(code.lang or "code")
        label.setStyleSheet(f"color: {colors.label}; background: transparent;")
        self.copy_button = QToolButton()
        self.copy_button.setText("Copy")
        self.copy_button.setAutoRaise(True)
        self.copy_button.setCursor(Qt.CursorShape.PointingHandCursor)
        self.copy_button.setStyleSheet(f"color: {colors.link}; background: transparent; border: none;")
        self.copy_button.clicked.connect(self.copy)
        hl.addWidget(label)
        hl.addStretch(1)
        hl.addWidget(self.copy_button)
        lay.addWidget(head)
        self.code_label = QLabel(code.html)
        self.code_label.setTextFormat(Qt.TextFormat.RichText)
        self.code_label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.code_label.setStyleSheet(f"background: {colors.bg}; padding: 6px;")
        self.scroll_area = QScrollArea()
        self.scroll_area.setWidget(self.code_label)
        self.scroll_area.setWidgetResizable(False)
        self.scroll_area.setFrameShape(QFrame.Shape.NoFrame)
        self.scroll_area.setVerticalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.scroll_area.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAsNeeded)
        self.scroll_area.setStyleSheet(f"QScrollArea {{ background: {colors.bg}; }}")
        self.scroll_area.viewport().setStyleSheet(f"background: {colors.bg};")
        self.scroll_area.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Fixed)  # any width: it scrolls
        lay.addWidget(self.scroll_area)
        self.code_label.adjustSize()
        self._fit()

    def copy(self) -> None:
        QGuiApplication.clipboard().setText(self.source)
        self.copied.emit(self.source)

    def minimumSizeHint(self) -> QSize:
        return QSize(60, super().minimumSizeHint().height())

    def resizeEvent(self, event) -> None:
        super().resizeEvent(event)
        self._fit()

    def _fit(self) -> None:
        """As tall as the code, plus the scroll bar when the code is wider than the view."""
        bar = self.scroll_area.horizontalScrollBar().sizeHint().height()
        wide = self.code_label.width() > self.scroll_area.viewport().width() or self.width() < self.code_label.width()
        self.scroll_area.setFixedHeight(self.code_label.height() + (bar if wide else 0) + 2)


class Bubble(QFrame):
    """One message (or the reply being streamed). `action(name, index)` asks for copy, edit,
    delete, regenerate, continue, probs, prev, next; `edited(index, text)` saves an edit."""

    action = Signal(str, int)
    edited = Signal(int, str)
    link = Signal(str)  # a link in the text: http(s), copy-code:N
    token_hovered = Signal(int, int)  # (message, token) under the mouse; (-1, -1) when none
    copied = Signal(str)  # a code block's source was copied

    def __init__(self, role: str, index: int, parent: QWidget | None = None):
        super().__init__(parent)
        self.role = role
        self.index = index
        self.editor: QPlainTextEdit | None = None
        self.buttons: dict[str, QToolButton] = {}
        self.code_blocks: list[CodeBlock] = []
        self.inline_code: list[str] = []  # sources of code blocks nested in lists or quotes (copy-code:N)
        c = palette().transcript
        self._c = c
        bg = BUBBLE_BG.get(palette().name, BUBBLE_BG["dark"])[role if role == "user" else "assistant"]
        self.setObjectName("bubble")
        self.setStyleSheet(f"QFrame#bubble {{ background: {bg}; border-radius: 8px; }}")
        self._lay = QVBoxLayout(self)
        self._lay.setContentsMargins(10, 6, 10, 8)
        self._lay.setSpacing(4)
        head = _transparent(QWidget())
        self._head = QHBoxLayout(head)
        self._head.setContentsMargins(0, 0, 0, 0)
        self._head.setSpacing(6)
        who = QLabel(f"<b style='color:{c.user if role == 'user' else c.assistant}'>"
                     f"{'You' if role == 'user' else 'Assistant'}</b>")
        self.meta_label = QLabel("")
        self.meta_label.setWordWrap(True)
        self.meta_label.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Preferred)
        self.meta_label.setMinimumWidth(40)
        for w in (who, self.meta_label):
            _transparent(w)
        self._head.addWidget(who)
        self._head.addWidget(self.meta_label, 1)
        self._lay.addWidget(head)
        self.body = _transparent(QWidget())
        self._body = QVBoxLayout(self.body)
        self._body.setContentsMargins(0, 0, 0, 0)
        self._body.setSpacing(4)
        self._lay.addWidget(self.body)
        self.switcher: QWidget | None = None
        self.version_label: QLabel | None = None
        self.tokens_label: QLabel | None = None  # the reply token by token, when shown

    # ---- building ----

    def set_meta(self, rich: str) -> None:
        self.meta_label.setText(rich)

    def add_switcher(self, shown: int, n: int) -> None:
        """‹ k/n ›: the versions of this message (regenerated answers, edited questions)."""
        box = _transparent(QWidget())
        lay = QHBoxLayout(box)
        lay.setContentsMargins(0, 0, 0, 0)
        lay.setSpacing(0)
        prev, nxt = self._tool("‹", "prev", "The previous version"), self._tool("›", "next", "The next version")
        self.version_label = QLabel(f"{shown + 1}/{n}")
        self.version_label.setStyleSheet(f"color:{self._c.muted}; background: transparent;")
        prev.setEnabled(shown > 0)
        nxt.setEnabled(shown < n - 1)
        for w in (prev, self.version_label, nxt):
            lay.addWidget(w)
        self.switcher = box
        self._head.addWidget(box)

    def add_text(self, rich: str, plain: bool = False) -> QLabel:
        label = QLabel()
        label.setTextFormat(Qt.TextFormat.PlainText if plain else Qt.TextFormat.RichText)
        label.setText(rich)
        label.setWordWrap(True)
        label.setTextInteractionFlags(Qt.TextInteractionFlag.TextBrowserInteraction)
        label.setOpenExternalLinks(False)
        label.linkActivated.connect(self._on_link)
        label.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Preferred)
        label.setMinimumWidth(40)
        _transparent(label)
        self._body.addWidget(label)
        return label

    def add_markdown(self, text: str, colors: TranscriptColors) -> None:
        segments, self.inline_code = markdown_segments(text, colors.code)
        for seg in segments:
            if isinstance(seg, Code):
                block = CodeBlock(seg)
                block.copied.connect(self.copied.emit)
                self.code_blocks.append(block)
                self._body.addWidget(block)
            else:  # links in the theme's link colour (a label's default blue is unreadable on the dark theme)
                self.add_text(seg.html.replace("<a href=", f"<a style='color:{colors.code.link}' href="))

    def add_tokens(self, rich: str) -> QLabel:
        label = self.tokens_label = self.add_text(rich)
        label.setMouseTracking(True)
        label.linkHovered.connect(self._on_token_hover)
        return label

    def add_action(self, name: str, text: str, tip: str) -> QToolButton:
        b = self._tool(text, name, tip)
        policy = b.sizePolicy()
        policy.setRetainSizeWhenHidden(True)  # hover shows them without moving the text
        b.setSizePolicy(policy)
        b.setVisible(self.underMouse())
        self._head.addWidget(b)  # at the end of the header line: no room taken from the text
        return b

    def add_button(self, name: str, text: str, tip: str) -> QPushButton:
        """A button under the text, always shown (Continue after a reply cut by its length limit)."""
        b = QPushButton(text)
        b.setToolTip(tip)
        b.clicked.connect(lambda: self.action.emit(name, self.index))
        row = QHBoxLayout()
        row.setContentsMargins(0, 0, 0, 0)
        row.addWidget(b)
        row.addStretch(1)
        self._lay.addLayout(row)
        self.buttons[name] = b  # type: ignore[assignment]
        return b

    def _tool(self, text: str, name: str, tip: str) -> QToolButton:
        b = QToolButton()
        b.setText(text)
        b.setToolTip(tip)
        b.setAutoRaise(True)
        b.setCursor(Qt.CursorShape.PointingHandCursor)
        b.setStyleSheet(f"QToolButton {{ color:{self._c.muted}; background: transparent; border: none; padding: 1px 5px; }}"
                        f"QToolButton:hover {{ text-decoration: underline; }}"
                        f"QToolButton:disabled {{ color: {_faded(self._c.muted)}; }}")
        b.clicked.connect(lambda: self.action.emit(name, self.index))
        self.buttons[name] = b
        return b

    # ---- editing ----

    def start_edit(self, text: str) -> QPlainTextEdit:
        """The text becomes an editor with Save and Cancel."""
        self.body.setVisible(False)
        box = _transparent(QWidget())
        lay = QVBoxLayout(box)
        lay.setContentsMargins(0, 0, 0, 0)
        self.editor = QPlainTextEdit(text)
        lines = max(2, min(10, text.count("\n") + 2))
        self.editor.setFixedHeight(self.editor.fontMetrics().lineSpacing() * lines + 14)
        row = QHBoxLayout()
        row.addStretch(1)
        self.cancel_button = QPushButton("Cancel")
        self.save_button = QPushButton("Save and send")
        self.save_button.setObjectName("primary")
        self.cancel_button.clicked.connect(lambda: self.action.emit("cancel-edit", self.index))
        self.save_button.clicked.connect(lambda: self.edited.emit(self.index, self.editor.toPlainText()))
        row.addWidget(self.cancel_button)
        row.addWidget(self.save_button)
        lay.addWidget(self.editor)
        lay.addLayout(row)
        self._lay.insertWidget(2, box)
        self.editor.setFocus()
        return self.editor

    # ---- reading ----

    def plain_text(self) -> str:
        parts = []
        head = self._head
        for i in range(head.count()):
            w = item.widget() if (item := head.itemAt(i)) is not None else None
            if isinstance(w, QLabel):
                parts.append(_plain(w.text()) if w.textFormat() != Qt.TextFormat.PlainText else w.text())
            elif w is self.switcher and self.version_label is not None:
                parts.append(f"‹{self.version_label.text()}›")
        lines = [" ".join(p for p in parts if p)]
        for i in range(self._body.count()):
            w = item.widget() if (item := self._body.itemAt(i)) is not None else None
            if isinstance(w, QLabel):
                lines.append(w.text() if w.textFormat() == Qt.TextFormat.PlainText else _plain(w.text()))
            elif isinstance(w, CodeBlock):
                lines.append(w.source.rstrip("\n"))
        for b in self.buttons.values():
            if isinstance(b, QPushButton):
                lines.append(b.text())
        return "\n".join(lines)

    # ---- events ----

    def enterEvent(self, event) -> None:
        self._show_actions(True)
        super().enterEvent(event)

    def leaveEvent(self, event) -> None:
        self._show_actions(False)
        super().leaveEvent(event)

    def _show_actions(self, on: bool) -> None:
        for name, b in self.buttons.items():
            if name not in ("prev", "next") and isinstance(b, QToolButton):
                b.setVisible(on)

    def _on_link(self, href: str) -> None:
        scheme, _, rest = href.partition(":")
        if scheme == COPY_SCHEME and rest.isdigit() and int(rest) < len(self.inline_code):
            QGuiApplication.clipboard().setText(self.inline_code[int(rest)])
            self.copied.emit(self.inline_code[int(rest)])
        else:
            self.link.emit(href)

    def _on_token_hover(self, href: str) -> None:
        scheme, _, rest = href.partition(":")
        if scheme == "tok":
            index, _, k = rest.partition(":")
            self.token_hovered.emit(int(index), int(k))
        else:
            self.token_hovered.emit(-1, -1)


class Transcript(QScrollArea):
    """The bubbles, top to bottom; scrolls up and down only, following the bottom while there."""

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.setWidgetResizable(True)
        self.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.setFrameShape(QFrame.Shape.StyledPanel)
        self.inner = QWidget()
        self.inner.setObjectName("transcript")
        self._lay = QVBoxLayout(self.inner)
        self._lay.setContentsMargins(8, 8, 8, 8)
        self._lay.setSpacing(8)
        self._lay.addStretch(1)
        self.setWidget(self.inner)
        self.bubbles: list[QWidget] = []
        self.following = True  # at the bottom: new text keeps the bottom in view
        self._hold: int | None = None  # where the user left the view, kept through re-renders
        self._quiet = False
        bar = self.verticalScrollBar()
        bar.valueChanged.connect(self._on_scrolled)
        bar.rangeChanged.connect(self._on_range)

    def clear(self, keep: int = 0) -> None:
        """Remove the bubbles after the first `keep` (a re-render of the rest follows); the scroll
        position is kept if the user had scrolled up, so re-rendering never yanks the view."""
        bar = self.verticalScrollBar()
        if self._hold is None and not self.following:
            self._hold = bar.value()
        self._quiet = True
        for w in self.bubbles[keep:]:
            self._lay.removeWidget(w)
            w.hide()
            w.setParent(None)
            w.deleteLater()
        del self.bubbles[keep:]
        self._quiet = False

    def add(self, widget: QWidget) -> QWidget:
        self._lay.insertWidget(self._lay.count() - 1, widget)
        self.bubbles.append(widget)
        return widget

    def remove(self, widget: QWidget) -> None:
        if widget in self.bubbles:
            self.bubbles.remove(widget)
            self._lay.removeWidget(widget)
            widget.hide()
            widget.setParent(None)
            widget.deleteLater()

    def to_bottom(self) -> None:
        self.following = True
        self._hold = None
        bar = self.verticalScrollBar()
        bar.setValue(bar.maximum())

    def plain_text(self) -> str:
        out = []
        for w in self.bubbles:
            if isinstance(w, Bubble):
                out.append(w.plain_text())
            elif isinstance(w, QLabel):
                out.append(_plain(w.text()) if w.textFormat() != Qt.TextFormat.PlainText else w.text())
        return "\n\n".join(out)

    def _on_scrolled(self, value: int) -> None:
        if self._quiet:
            return
        bar = self.verticalScrollBar()
        if self._hold is not None:
            if bar.maximum() < self._hold:  # a re-render's layout, shorter for a moment: not the user
                return
            if value == self._hold:
                return
            self._hold = None  # the user moved it
        self.following = value >= bar.maximum() - 4

    def _on_range(self, _lo: int, hi: int) -> None:
        bar = self.verticalScrollBar()
        if self._hold is not None:
            bar.setValue(min(self._hold, hi))
        elif self.following:
            bar.setValue(hi)


# ---- HTML bits ----

def tokens_html(tokens: list, index: int, unlikely: str) -> str:
    """A reply token by token: each a link (`tok:MESSAGE:TOKEN`, hovered for its tooltip) shaded
    by how unlikely it was (clear: near certain; red: a long shot)."""
    parts = []
    for k, (text, lp, _top) in enumerate(tokens):
        alpha = round(0.55 * (1.0 - math.exp(lp)), 2)
        shown = html.escape(text).replace("\n", "↵<br>") or "∅"
        parts.append(f"<a href='tok:{index}:{k}' style='color:inherit;text-decoration:none;"
                     f"background-color:rgba({unlikely},{alpha})'>{shown}</a>")
    return f"<p style='white-space:pre-wrap'>{''.join(parts)}</p>"


def welcome_html(engine) -> str:
    from ..model.formatting import model_title

    names = ", ".join(engine.backend_names)
    model = model_title(engine.model.info) if engine.model is not None else ", ".join(engine.model_ids()) or "?"
    n = len(engine.backend_names)
    return (f"<p>Chatting with <b>{html.escape(model)}</b> on {n} backend{'s' if n != 1 else ''} "
            f"({html.escape(names)}). Each reply says which backend served it and why; the "
            "Monitor (F9) shows every decision.</p>")


def meta_html(meta: dict, index: int, c: TranscriptColors) -> str:
    if not meta:
        return ""
    color = c.backend(backend_color(index))
    bits = [f"<b style='color:{color}'>{html.escape(str(meta.get('backend', '?')))}</b>"]
    bits += [html.escape(b) for b in meta_bits(meta)]
    return f"<span style='color:{c.muted}'>· " + " · ".join(bits) + "</span>"


def meta_plain(meta: dict) -> str:
    return " · ".join([str(meta.get("backend", "?")), *meta_bits(meta)])


def meta_bits(meta: dict) -> list[str]:
    bits = [f"TTFT {fmt_seconds(meta.get('ttft_s'))}"]
    if meta.get("tok_s"):
        bits.append(f"{meta['tok_s']:.1f} tok/s")
    bits.append(f"{meta.get('output_tokens', 0)} tokens")
    bits.append(f"cached {meta.get('cached_tokens', 0)}/{meta.get('prompt_tokens', 0)}")
    reason = meta.get("finish_reason")
    if reason == "cancelled":
        bits.append("stopped")
    elif reason == "length":
        bits.append("cut at max tokens")
    elif reason and reason != "stop":
        bits.append(reason)
    return bits
