"""The remote kind's spec: `remote:url=http://HOST:PORT[,name=…,api=…,key_file=PATH,cap=…,tokenizer=MODEL]`.

Light on purpose (no HTTP stack, no native code): every command parses specs, and a router
of remote engines only must load no llama.cpp. The engine's key is a secret: `key_file=PATH`
keeps it off the command line (`ps` shows `key=` to every user of the host), it is read again
at each connection (a rotated key is used after a restart), and no message, log line or repr
shows it (`shown` masks a spec's `key=`, the config's repr leaves the key out, a URL may not
carry user:password).
"""

from __future__ import annotations

import logging
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from engine.backends.registry import spec_error, spec_kind
from engine.core.errors import InvalidRequest

log = logging.getLogger(__name__)

# The engine kinds a spec may name (`api=`); each but `auto` is a dialect (dialects.py).
APIS = ("auto", "openai", "llama-server", "vllm", "sglang", "tandem")
KEY_FILE_BYTES = 4096  # a key file is one line; more is not a key file

_INTS = ("cap", "max_queue", "cache_capacity")
_FLOATS = ("poll_s", "health_s", "timeout_s", "first_token_s", "token_gap_s", "quarantine_s")
_TEXTS = ("url", "name", "key", "key_file", "api", "tokenizer")


@spec_kind("remote")
@dataclass(frozen=True)
class RemoteConfig:
    """An OpenAI-compatible engine as a backend. `cap` bounds the requests in flight there (the
    rest wait here, FCFS, so they can move if the engine dies); `api` names the engine's dialect
    (`auto`: detect it); its key (`key_file`, else `key`) is sent as `Authorization: Bearer KEY`."""

    builder_module: ClassVar[str] = "engine.backends.remote.backend"
    needs_model: ClassVar[bool] = False

    url: str
    name: str = "remote"
    device: str = "remote"
    api: str = "auto"
    key: str | None = field(default=None, repr=False)
    key_file: str | None = None  # a file whose first line is the key (read at each connection)
    cap: int = 64
    max_queue: int = 4096
    cache_capacity: int = 1 << 22  # elements (tokens or characters) the cache prediction keeps
    poll_s: float = 0.3  # load polling period
    health_s: float = 1.0  # health probe period
    timeout_s: float = 600.0  # the most one request may take end to end
    first_token_s: float = 60.0  # the first streamed event must come within this of sending
    token_gap_s: float = 30.0  # each next event within this of the last
    quarantine_s: float = 30.0  # a silent engine stays out this long (doubling) though /health answers
    # A model spec (path, `default`, `synthetic:tiny`) whose vocabulary is the engine's: its
    # tokenizer (loaded vocab-only) makes exact token keys for the cache prediction.
    tokenizer: str | None = None

    def secret(self) -> str | None:
        """The key to send: `key_file`'s first line (read now), else `key`; None: none.
        `InvalidRequest`, naming the file but never its content, where it cannot be used."""
        if self.key_file is None:
            return _checked_key(self.key, "key") if self.key else None
        try:
            with open(self.key_file, "rb") as f:
                raw = f.read(KEY_FILE_BYTES + 1)
        except OSError as e:
            why = e.strerror or type(e).__name__
            raise InvalidRequest(f"key_file {self.key_file}: cannot read it ({why})") from None
        if len(raw) > KEY_FILE_BYTES:
            raise InvalidRequest(f"key_file {self.key_file}: longer than {KEY_FILE_BYTES} bytes; it must hold one key")
        lines = raw.decode("utf-8", "replace").splitlines()
        key = lines[0].strip() if lines else ""
        if not key:
            raise InvalidRequest(f"key_file {self.key_file}: its first line is empty")
        return _checked_key(key, f"key_file {self.key_file}")

    @classmethod
    def from_spec(cls, spec: str, rest: str, defaults: Mapping[str, Any]) -> RemoteConfig:
        """The keys after `remote:` (see the class); a command-line default cap applies too."""
        fields = _fields(spec, rest)
        fields["url"] = _url(spec, fields.get("url", ""))
        api = fields.get("api", "auto").lower()
        if api not in APIS:
            raise spec_error(spec, f"api must be one of {', '.join(APIS)}, got {api!r}")
        fields["api"] = api
        if "key" in fields and "key_file" in fields:
            raise spec_error(spec, "give key_file= or key=, not both")
        if "cap" not in fields and "cap" in defaults:
            fields["cap"] = defaults["cap"]
        config = cls(**fields)
        try:
            config.secret()  # a key that cannot be sent fails now, not at every connection
        except InvalidRequest as e:
            raise spec_error(spec, str(e)) from None
        if config.key:
            log.warning("backend %s: key= shows the engine's key to every user of this host (ps); "
                        "use key_file=PATH", config.name)
        return config


def _fields(spec: str, rest: str) -> dict[str, Any]:
    """`key=value` items, each number checked."""
    fields: dict[str, Any] = {}
    for i, item in enumerate(filter(None, (p.strip() for p in rest.split(","))), 1):
        key, eq, value = (s.strip() for s in item.partition("="))
        if not eq:
            raise spec_error(spec, f"item {i} is not key=value")
        if key in _INTS:
            fields[key] = _number(spec, key, value, int)
            if fields[key] < 1:
                raise spec_error(spec, f"{key} must be >= 1")
        elif key in _FLOATS:
            fields[key] = _number(spec, key, value, float)
            if not fields[key] > 0:
                raise spec_error(spec, f"{key} must be > 0")
        elif key in _TEXTS:
            fields[key] = value
        else:
            valid = ", ".join(sorted((*_INTS, *_FLOATS, *_TEXTS)))
            raise spec_error(spec, f"unknown key {key!r} (valid: {valid})")
    if "key_file" in fields:
        fields["key_file"] = str(Path(fields["key_file"]).expanduser())
    return fields


def _number(spec: str, key: str, value: str, kind: type[int] | type[float]) -> int | float:
    try:
        return kind(value)
    except ValueError:
        raise spec_error(spec, f"{key} must be {'an integer' if kind is int else 'a number'}") from None


def _url(spec: str, url: str) -> str:
    """`http(s)://HOST[:PORT][/PATH]` without credentials, query or fragment, less a final `/v1`."""
    parsed = urllib.parse.urlsplit(url)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise spec_error(spec, "url must be http://HOST:PORT or https://HOST:PORT")
    if parsed.username is not None or parsed.password is not None:
        raise spec_error(spec, "url must not carry user:password (messages and /v1/backends show the url); "
                               "put the key in key_file=PATH")
    if parsed.query or parsed.fragment:
        raise spec_error(spec, "url must not carry a query or a fragment")
    try:
        parsed.port  # noqa: B018  # a port that is not a number raises here
    except ValueError:
        raise spec_error(spec, "url's port must be a number") from None
    return url.rstrip("/").removesuffix("/v1")


def _checked_key(key: str, where: str) -> str:
    """A key a header can carry: printable ASCII without spaces (nothing of it is shown)."""
    if not all(33 <= ord(c) < 127 for c in key):
        raise InvalidRequest(f"{where}: the key holds characters an HTTP header cannot carry "
                             f"(it must be printable ASCII without spaces)")
    return key
