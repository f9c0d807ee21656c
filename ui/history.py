"""Saved chats: one JSON file per chat under the user data dir (Qt-free).

`ChatStore(dir)` lists, loads, saves and deletes `Chat`s; `default_dir()` is
`platformdirs.user_data_dir("tandem")/chats`. Writes go through a temporary file and a rename,
so a crash never leaves half a chat.
"""

from __future__ import annotations

import json
import logging
import os
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

DEFAULT_SYSTEM = "You are a helpful assistant."


def default_dir() -> Path:
    import platformdirs

    return Path(platformdirs.user_data_dir("tandem")) / "chats"


@dataclass
class Message:
    role: str  # "user" | "assistant"
    content: str
    meta: dict | None = None  # assistant replies: backend, ttft_s, tok_s, cached_tokens, ...


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

    def prompt_messages(self) -> list[dict]:
        """The messages to render with the chat template (system first, if any)."""
        out = [{"role": "system", "content": self.system}] if self.system.strip() else []
        out += [{"role": m.role, "content": m.content} for m in self.messages]
        return out

    def to_dict(self) -> dict:
        return asdict(self)

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
    def from_dict(cls, d: dict) -> "Chat":
        return cls(
            id=str(d["id"]),
            system=str(d.get("system", "")),
            messages=[Message(m["role"], m["content"], m.get("meta")) for m in d.get("messages", [])],
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
