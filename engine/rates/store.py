"""Where backend rates are kept: one JSON file in the user cache, one entry per (model file
fingerprint, speed-relevant backend config), written atomically; lookups that never raise, and
typed overrides (`parse_rates`). Why per config and not per name: docs/design/rates.md."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from engine.backends.config import BackendConfig
from engine.core.errors import InvalidRequest
from engine.core.snapshot import Rates

if TYPE_CHECKING:
    from engine.rates.fit import Calibration

log = logging.getLogger(__name__)

STORE_FILE = "rates.json"
STORE_VERSION = 1


# ---- where and under which key ----


def file_fingerprint(path: Path) -> str:
    """A cheap, stable identity for a model file: size + hash of its first and last MiB."""
    h = hashlib.sha256()
    size = path.stat().st_size
    h.update(str(size).encode())
    with path.open("rb") as f:
        h.update(f.read(1 << 20))
        f.seek(max(size - (1 << 20), 0))
        h.update(f.read(1 << 20))
    return h.hexdigest()[:16]


def cache_dir() -> Path:
    """`$TANDEM_CACHE_DIR`, else the platform's user cache dir for "tandem"."""
    env = os.environ.get("TANDEM_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    try:
        from platformdirs import user_cache_dir
    except ImportError:  # the GPU machine has no platformdirs: the XDG default it would give
        return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tandem"
    return Path(user_cache_dir("tandem"))


def config_key(config: BackendConfig, device: str | None = None) -> str:
    """What about a backend's configuration changes its speed, as a stable string
    (`BackendConfig.speed_key`: the local kind owns what its speed depends on)."""
    return config.speed_key(device)


# ---- the store ----


class RateStore:
    """The calibration file: `{"version", "entries": {"FINGERPRINT|CONFIG_KEY": entry}}`.

    Thread-safe within a process (one lock); writes are atomic (temp file + rename), so a
    reader never sees half a file. Unreadable files are treated as empty, with a warning.
    """

    def __init__(self, path: Path | None = None):
        self.path = Path(path) if path is not None else cache_dir() / STORE_FILE
        self._lock = threading.Lock()

    def entries(self) -> dict[str, dict]:
        with self._lock:
            return self._read()

    def lookup(self, fingerprint: str, key: str) -> dict | None:
        return self.entries().get(f"{fingerprint}|{key}")

    def save(self, fingerprint: str, key: str, entry: dict) -> None:
        with self._lock:
            entries = self._read()
            entries[f"{fingerprint}|{key}"] = {"fingerprint": fingerprint, "config": key, **entry}
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
            tmp.write_text(json.dumps({"version": STORE_VERSION, "entries": entries}, indent=1, sort_keys=True))
            os.replace(tmp, self.path)

    def _read(self) -> dict[str, dict]:
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as e:
            log.warning("ignoring unreadable calibration file %s: %s", self.path, e)
            return {}
        if not isinstance(data, dict) or data.get("version") != STORE_VERSION:
            log.warning("ignoring calibration file %s: not version %d", self.path, STORE_VERSION)
            return {}
        return dict(data.get("entries") or {})


def rates_from_entry(entry: dict) -> Rates:
    r = entry["rates"]
    return Rates(prefill_tok_s=float(r["prefill_tok_s"]), decode_tok_s=float(r["decode_tok_s"]),
                 step_alpha_s=float(r.get("step_alpha_s", 0.0)), step_beta_s=float(r.get("step_beta_s", 0.0)),
                 step_table=tuple(float(t) for t in r.get("step_table") or ()), source="cached",
                 measured_at=str(entry.get("measured_at") or ""),
                 step_gamma_s=float(r.get("step_gamma_s", 0.0)),  # entries before the context term: 0
                 step_cells=tuple(float(c) for c in r.get("step_cells") or ()),
                 step_delta_s=float(r.get("step_delta_s", 0.0)),  # entries before the masked scan: 0
                 step_kv=tuple(float(c) for c in r.get("step_kv") or ()))


class ModelRates:
    """The stored rates of one model file, looked up per backend config. Never raises."""

    def __init__(self, model_path: Path, store: RateStore | None = None):
        self.store = store or RateStore()
        try:
            self.fingerprint = file_fingerprint(Path(model_path))
            self._entries = self.store.entries()
        except OSError as e:
            log.warning("no calibrated rates for %s: %s", model_path, e)
            self.fingerprint, self._entries = "", {}

    def get(self, config: BackendConfig, device: str | None = None) -> Rates | None:
        entry = self._entries.get(f"{self.fingerprint}|{config_key(config, device)}")
        if entry is None:
            return None
        try:
            return rates_from_entry(entry)
        except (KeyError, TypeError, ValueError) as e:
            log.warning("ignoring a malformed calibration entry in %s: %s", self.store.path, e)
            return None


def parse_rates(spec: str) -> tuple[str, Rates]:
    """`NAME:prefill=73,decode=45[,alpha=S,beta=S]` → (backend name, override rates).

    Rates in tokens/s, alpha/beta in seconds (one decode step at batch b is alpha + beta*b).
    """
    name, sep, rest = spec.partition(":")
    values: dict[str, float] = {}
    for item in filter(None, (p.strip() for p in rest.split(","))):
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq or key not in ("prefill", "decode", "alpha", "beta"):
            raise InvalidRequest(f"rates {spec!r}: use NAME:prefill=TOK_S,decode=TOK_S[,alpha=S,beta=S]",
                                 param="rates")
        try:
            values[key] = float(value)
        except ValueError:
            raise InvalidRequest(f"rates {spec!r}: {key} must be a number", param="rates") from None
    if not name.strip() or not sep or "prefill" not in values or "decode" not in values:
        raise InvalidRequest(f"rates {spec!r}: use NAME:prefill=TOK_S,decode=TOK_S[,alpha=S,beta=S]",
                             param="rates")
    if values["prefill"] <= 0 or values["decode"] <= 0 or values.get("alpha", 0) < 0 or values.get("beta", 0) < 0:
        raise InvalidRequest(f"rates {spec!r}: rates must be > 0 and alpha, beta >= 0", param="rates")
    return name.strip(), Rates(prefill_tok_s=values["prefill"], decode_tok_s=values["decode"],
                               step_alpha_s=values.get("alpha", 0.0), step_beta_s=values.get("beta", 0.0),
                               source="override")


def save_calibration(store: RateStore, model_path: Path, cal: Calibration, model_name: str = "") -> str:
    """Store `cal` under its (fingerprint, config key); returns the entry's key."""
    fingerprint = file_fingerprint(Path(model_path))
    store.save(fingerprint, cal.config_key, {"model": model_name or Path(model_path).name,
                                             "model_path": str(model_path), **cal.to_dict()})
    return f"{fingerprint}|{cal.config_key}"
