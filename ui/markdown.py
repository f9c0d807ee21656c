"""Replies as Markdown: markdown-it-py for the text, Pygments for code blocks (Qt-free).

`render_markdown(text[, code_blocks])` returns `(html, code_blocks)`: HTML that QTextBrowser's rich-text
subset shows (inline styles only, no classes or scripts), and the source of every fenced or
indented code block in order. Each code block is a monospace `<pre>` (indentation kept) under a
header with the language and a `copy-code:N` link; the chat panel copies `code_blocks[N]` when
it is clicked. Raw HTML in a reply is shown as text, never interpreted (`html: False`).

Pure functions: any thread.
"""

from __future__ import annotations

import html

from markdown_it import MarkdownIt
from pygments import highlight
from pygments.formatters import HtmlFormatter
from pygments.lexers import get_lexer_by_name
from pygments.util import ClassNotFound

CODE_BG = "#161a21"
CODE_HEAD_BG = "#232833"
COPY_SCHEME = "copy-code"
_FORMATTER = HtmlFormatter(noclasses=True, nowrap=True, style="monokai")


def _code_html(code: str, lang: str, env: dict) -> str:
    blocks = env.setdefault("code_blocks", [])
    index = len(blocks)
    blocks.append(code)
    body = html.escape(code.rstrip("\n"))
    if lang:
        try:
            body = highlight(code.rstrip("\n"), get_lexer_by_name(lang), _FORMATTER).rstrip("\n")
        except ClassNotFound:
            pass
    label = html.escape(lang) if lang else "code"
    return (f"<table width='100%' cellspacing='0' cellpadding='6' style='margin-top:4px;margin-bottom:6px'>"
            f"<tr><td bgcolor='{CODE_HEAD_BG}'><span style='color:#8a93a6'>{label}</span>&nbsp;&nbsp;"
            f"<a href='{COPY_SCHEME}:{index}' style='color:#8fbcff'>Copy</a></td></tr>"
            f"<tr><td bgcolor='{CODE_BG}'><pre style='font-family:monospace;margin:0'>{body}</pre></td></tr>"
            f"</table>")


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


def render_markdown(text: str, code_blocks: list[str] | None = None) -> tuple[str, list[str]]:
    """Markdown `text` -> (HTML for a QTextBrowser, the code blocks' sources).

    Pass `code_blocks` to number this text's blocks after those already in it (one transcript
    of many messages); it is appended to and returned.
    """
    env: dict = {"code_blocks": code_blocks if code_blocks is not None else []}
    out = _MD.render(text, env)
    return out, env["code_blocks"]
