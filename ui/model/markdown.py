"""Replies as Markdown: markdown-it-py for the text, Pygments for code blocks (Qt-free).

`render_markdown(text[, code_blocks])` returns `(html, code_blocks)`: HTML that QTextBrowser's rich-text
subset shows (inline styles only, no classes or scripts), and the source of every fenced or
indented code block in order. Each code block is a monospace `<pre>` (indentation kept) under a
header with the language and a `copy-code:N` link; the chat panel copies `code_blocks[N]` when
it is clicked. Raw HTML in a reply is shown as text, never interpreted (`html: False`). A code
block's colours (backgrounds, header, link, the Pygments style) come from `CodeColors`:
`DARK_CODE` (the default) or `LIGHT_CODE`, as the theme in use says (`ui.theme`).

`markdown_segments(text)` cuts a reply into its prose and its top-level code blocks, in order,
so the chat can show each code block in a widget of its own (scrolling sideways on its own, with
its Copy button): `Prose(html)` and `Code(source, lang, html)` (the block's highlighted `<pre>`), with the sources of
code blocks nested in lists or quotes (left in the prose, with their Copy links).

Pure functions: any thread.
"""

from __future__ import annotations

import html
from dataclasses import dataclass
from functools import cache

from markdown_it import MarkdownIt
from pygments import highlight
from pygments.formatters import HtmlFormatter
from pygments.lexers import get_lexer_by_name
from pygments.util import ClassNotFound

COPY_SCHEME = "copy-code"


@dataclass(frozen=True)
class CodeColors:
    """A code block's colours: body and header backgrounds, the header's label and Copy link,
    the text of a block without a known language, and the Pygments style that colours the rest."""

    bg: str
    head_bg: str
    label: str
    link: str
    text: str
    style: str


DARK_CODE = CodeColors("#161a21", "#232833", "#8a93a6", "#8fbcff", "#d8dee9", "monokai")
LIGHT_CODE = CodeColors("#f3f5f8", "#e3e7ed", "#5f6877", "#1f5fbf", "#1f2329", "friendly")


@cache
def _formatter(style: str) -> HtmlFormatter:
    return HtmlFormatter(noclasses=True, nowrap=True, style=style)


def _highlighted(code: str, lang: str, colors: CodeColors) -> str:
    """`code` as HTML spans coloured by Pygments (escaped plain text without a known `lang`)."""
    body = html.escape(code.rstrip("\n"))
    if lang:
        try:
            body = highlight(code.rstrip("\n"), get_lexer_by_name(lang), _formatter(colors.style)).rstrip("\n")
        except ClassNotFound:
            pass
    return body


def code_pre(code: str, lang: str, colors: CodeColors = DARK_CODE) -> str:
    """A code block's body alone: a monospace `<pre>` (indentation kept), highlighted."""
    return (f"<pre style='font-family:monospace;margin:0;color:{colors.text}'>"
            f"{_highlighted(code, lang, colors)}</pre>")


def _code_html(code: str, lang: str, env: dict) -> str:
    colors: CodeColors = env.get("colors") or DARK_CODE
    blocks = env.setdefault("code_blocks", [])
    index = len(blocks)
    blocks.append(code)
    body = _highlighted(code, lang, colors)
    label = html.escape(lang) if lang else "code"
    return (f"<table width='100%' cellspacing='0' cellpadding='6' style='margin-top:4px;margin-bottom:6px'>"
            f"<tr><td bgcolor='{colors.head_bg}'><span style='color:{colors.label}'>{label}</span>&nbsp;&nbsp;"
            f"<a href='{COPY_SCHEME}:{index}' style='color:{colors.link}'>Copy</a></td></tr>"
            f"<tr><td bgcolor='{colors.bg}'><pre style='font-family:monospace;margin:0;color:{colors.text}'>{body}</pre>"
            f"</td></tr></table>")


def _build() -> MarkdownIt:
    md = MarkdownIt("commonmark", {"html": False, "breaks": True}).enable(["table", "strikethrough"])

    def fence(self, tokens, idx, options, env):
        token = tokens[idx]
        lang = token.info.strip().split()[0] if token.info.strip() else ""
        return _code_html(token.content, lang, env)

    def code_block(self, tokens, idx, options, env):
        return _code_html(tokens[idx].content, "", env)

    md.add_render_rule("fence", fence)
    md.add_render_rule("code_block", code_block)
    return md


_MD = _build()


def render_markdown(text: str, code_blocks: list[str] | None = None,
                    colors: CodeColors = DARK_CODE) -> tuple[str, list[str]]:
    """Markdown `text` -> (HTML for a QTextBrowser, the code blocks' sources).

    Pass `code_blocks` to number this text's blocks after those already in it (one transcript
    of many messages); it is appended to and returned. `colors` paints the code blocks.
    """
    env: dict = {"code_blocks": code_blocks if code_blocks is not None else [], "colors": colors}
    out = _MD.render(text, env)
    return out, env["code_blocks"]


@dataclass(frozen=True)
class Prose:
    """Markdown other than a top-level code block, as HTML."""

    html: str


@dataclass(frozen=True)
class Code:
    """A top-level code block: its source, its language ("" if none) and its highlighted `<pre>`."""

    source: str
    lang: str
    html: str


def markdown_segments(text: str, colors: CodeColors = DARK_CODE) -> tuple[list[Prose | Code], list[str]]:
    """Markdown `text` cut into prose and its top-level code blocks, in order, and the sources
    of the code blocks left inside the prose (in a list or a quote: drawn as `render_markdown`
    draws them, their Copy links `copy-code:N` numbered in this list)."""
    env: dict = {"code_blocks": [], "colors": colors}
    tokens = _MD.parse(text, env)
    out: list[Prose | Code] = []
    start = 0

    def prose(end: int) -> None:
        if end > start:
            rendered = _MD.renderer.render(tokens[start:end], _MD.options, env)
            if rendered.strip():
                out.append(Prose(rendered))

    for i, t in enumerate(tokens):
        if t.level == 0 and t.type in ("fence", "code_block"):
            prose(i)
            lang = t.info.strip().split()[0] if t.type == "fence" and t.info.strip() else ""
            out.append(Code(t.content, lang, code_pre(t.content, lang, colors)))
            start = i + 1
    prose(len(tokens))
    return out, env["code_blocks"]
