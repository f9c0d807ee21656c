"""Chats, their alternatives, and where they are saved (Qt-free).

A `Chat` is a list of `Message`s. A message can have several versions (an answer regenerated,
a question edited and sent again): `Message.versions` holds them all, each with the messages that
followed it, and `Chat.switch` shows another one with its own continuation (the chat's ‹1/2›
switcher). `Chat.add_version` adds one and shows it.

A reply joins its chat through `Chat.take_reply(to, text, meta)`: as a new last message, as a new
version of a message (regenerated), or added to a message (continued past its length limit, its
counts and token probabilities joined); `reply_meta` is what a reply keeps of its request's
record (backend, times, tokens, why it went there).

`ChatStore(dir)` lists, loads, saves and deletes chats, one JSON file each; `default_dir()` is
`platformdirs.user_data_dir("tandem")/chats`. Writes go through a temporary file and a rename,
so a crash never leaves half a chat.
"""

from __future__ import annotations

import json
import logging
import os
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

DEFAULT_SYSTEM = "You are a helpful assistant."


def default_dir() -> Path:
    import platformdirs

    return Path(platformdirs.user_data_dir("tandem")) / "chats"


@dataclass
class Version:
    """One version of a message and the messages that followed it (empty for the version shown:
    what follows it is the chat itself)."""

    content: str
    meta: dict | None = None
    tail: list[Message] = field(default_factory=list)


@dataclass
class Message:
    role: str  # "user" | "assistant"
    content: str
    meta: dict | None = None  # assistant replies: backend, ttft_s, tok_s, cached_tokens, ...
    # Every version when there are several (versions[shown] is the one in `content` and `meta`);
    # empty when the message has only one.
    versions: list[Version] = field(default_factory=list)
    shown: int = 0

    @property
    def n_versions(self) -> int:
        return max(1, len(self.versions))

    def to_dict(self) -> dict:
        d: dict = {"role": self.role, "content": self.content, "meta": self.meta}
        if self.versions:
            d["versions"] = [
                {"content": self.content, "meta": self.meta, "tail": []} if k == self.shown else
                {"content": v.content, "meta": v.meta, "tail": [m.to_dict() for m in v.tail]}
                for k, v in enumerate(self.versions)]
            d["shown"] = self.shown
        return d

    @classmethod
    def from_dict(cls, d: dict) -> Message:
        meta = d.get("meta")
        m = cls(str(d["role"]), str(d["content"]), meta)
        if d.get("versions"):
            m.versions = [Version(str(v["content"]), v.get("meta"), [cls.from_dict(t) for t in v.get("tail", [])])
                          for v in d["versions"]]
            m.shown = min(max(0, int(d.get("shown", 0))), len(m.versions) - 1)
        elif isinstance(meta, dict) and meta.get("earlier"):
            # Saved before versions: the answers a regenerate replaced, newest first, no meta but the backend.
            earlier = meta.pop("earlier")
            m.versions = [Version(str(e.get("content", "")), {"backend": e.get("backend")})
                          for e in reversed(earlier)] + [Version(m.content, meta)]
            m.shown = len(m.versions) - 1
        return m


@dataclass(frozen=True)
class ReplyTo:
    """What the reply being streamed becomes in its chat."""

    kind: str = "append"  # "append": a new last message; "version": a new version of message
    index: int = -1  # `index`; "continue": text added to message `index`


APPEND = ReplyTo()


def reply_meta(record, decision=None) -> dict:
    """What a reply keeps of its request's `FinishRecord` (and the routing decision, if any):
    the backend, TTFT, end-to-end time, decode tok/s, token counts, why it ended and why it went
    there; each token's text, logprob and alternatives when the request asked for them."""
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
    return meta


def _piece(piece: bytes) -> str:
    return piece.decode("utf-8", errors="replace")


@dataclass
class Chat:
    id: str = field(default_factory=lambda: time.strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6])
    system: str = DEFAULT_SYSTEM
    messages: list[Message] = field(default_factory=list)
    created: float = field(default_factory=time.time)
    updated: float = field(default_factory=time.time)
    name: str = ""  # the user's title (Rename); empty: the first user message

    @property
    def title(self) -> str:
        if self.name.strip():
            return self.name.strip()
        for m in self.messages:
            if m.role == "user":
                text = " ".join(m.content.split())
                return text[:48] + ("…" if len(text) > 48 else "")
        return "New chat"

    def prompt_messages(self, upto: int | None = None) -> list[dict]:
        """The messages to render with the chat template (system first, if any), those before
        message `upto` only if given."""
        out = [{"role": "system", "content": self.system}] if self.system.strip() else []
        out += [{"role": m.role, "content": m.content} for m in self.messages[:upto]]
        return out

    def add_version(self, index: int, content: str, meta: dict | None = None) -> None:
        """A new version of message `index`, shown; the messages after it stay with the version
        they followed (the chat ends with the new version)."""
        m = self.messages[index]
        self._park(index)
        m.versions.append(Version(content, meta))
        m.shown = len(m.versions) - 1
        m.content, m.meta = content, meta
        del self.messages[index + 1:]

    def take_reply(self, to: ReplyTo, text: str, meta: dict) -> dict:
        """The reply `text` joins the chat as `to` says; returns the meta its message now holds
        (a continued reply's: its counts summed, its token probabilities joined)."""
        if to.kind == "version":
            self.add_version(to.index, text, meta)
        elif to.kind == "continue":
            m = self.messages[to.index]
            before = m.meta or {}
            merged = {**before, **meta, "output_tokens": before.get("output_tokens", 0) + meta.get("output_tokens", 0),
                      "continued": before.get("continued", 0) + 1}
            if before.get("logprobs") or meta.get("logprobs"):
                merged["logprobs"] = (before.get("logprobs") or []) + (meta.get("logprobs") or [])
            m.content += text
            m.meta = meta = merged
        else:
            self.messages.append(Message("assistant", text, meta))
        return meta

    def switch(self, index: int, k: int) -> None:
        """Show version `k` of message `index`, with the messages that followed it."""
        m = self.messages[index]
        if not 0 <= k < m.n_versions or k == m.shown:
            return
        self._park(index)
        v = m.versions[k]
        m.content, m.meta, m.shown = v.content, v.meta, k
        self.messages[index + 1:] = v.tail
        v.tail = []

    def _park(self, index: int) -> None:
        """Store the shown version of message `index` and what follows it in its versions."""
        m = self.messages[index]
        parked = Version(m.content, m.meta, self.messages[index + 1:])
        if m.versions:
            m.versions[m.shown] = parked
        else:
            m.versions, m.shown = [parked], 0

    def to_dict(self) -> dict:
        return {"id": self.id, "system": self.system, "messages": [m.to_dict() for m in self.messages],
                "created": self.created, "updated": self.updated, "name": self.name}

    def to_markdown(self) -> str:
        """The chat as a Markdown document (title, system prompt, then each turn)."""
        out = [f"# {self.title}", ""]
        if self.system.strip():
            out += ["**System:** " + self.system.strip(), ""]
        for m in self.messages:
            who = "You" if m.role == "user" else "Assistant"
            meta = m.meta or {}
            where = f" ({meta['backend']})" if meta.get("backend") else ""
            out += [f"## {who}{where}", "", m.content, ""]
        return "\n".join(out)

    def matches(self, query: str) -> bool:
        """Case-insensitive search over the title, system prompt and every message."""
        q = query.casefold().strip()
        return not q or any(q in t.casefold() for t in (self.title, self.system, *(m.content for m in self.messages)))

    @classmethod
    def from_dict(cls, d: dict) -> Chat:
        return cls(
            id=str(d["id"]),
            system=str(d.get("system", "")),
            messages=[Message.from_dict(m) for m in d.get("messages", [])],
            created=float(d.get("created", 0.0)),
            updated=float(d.get("updated", 0.0)),
            name=str(d.get("name", "")),
        )


class ChatStore:
    def __init__(self, directory: Path | str | None = None):
        self.dir = Path(directory) if directory is not None else default_dir()

    def path(self, chat_id: str) -> Path:
        return self.dir / f"{chat_id}.json"

    def list(self) -> list[Chat]:
        """Every readable saved chat, most recently updated first (unreadable files are skipped)."""
        chats = []
        if self.dir.is_dir():
            for p in self.dir.glob("*.json"):
                try:
                    chats.append(Chat.from_dict(json.loads(p.read_text(encoding="utf-8"))))
                except (OSError, ValueError, KeyError, TypeError) as e:
                    log.warning("skipping unreadable chat %s: %s", p, e)
        return sorted(chats, key=lambda c: c.updated, reverse=True)

    def load(self, chat_id: str) -> Chat:
        return Chat.from_dict(json.loads(self.path(chat_id).read_text(encoding="utf-8")))

    def save(self, chat: Chat) -> Path:
        chat.updated = time.time()
        self.dir.mkdir(parents=True, exist_ok=True)
        target = self.path(chat.id)
        tmp = target.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(chat.to_dict(), ensure_ascii=False, indent=1), encoding="utf-8")
        os.replace(tmp, target)
        return target

    def delete(self, chat_id: str) -> None:
        try:
            self.path(chat_id).unlink()
        except FileNotFoundError:
            pass
