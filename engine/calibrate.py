"""Backend rates: measure them (`calibrate_backend`), store them, load them, keep them fresh.

What is measured, on one backend alone (the others idle), with random prompt tokens:

- **prefill tok/s**: a `prompt_tokens` (512) prompt with nothing cached (the backend's prefix
  cache is flushed first), after one unmeasured warm-up prompt; prompt tokens over the
  seconds of the `llama_decode` calls that held them, median of `repeats`.
- **step time at batch b = 1..cap**: `b` requests share a warmed `prompt_tokens` prefix plus
  4 tokens of their own and generate `gen_tokens` each (`ignore_eos`). A step counts when it
  decoded exactly `b` sequences and no prompt chunk; its time is the wall time since the
  backend's previous step ended (the whole cycle: batch building, `llama_decode`, sampling,
  bookkeeping — what a request waits for), median over the steps.
- **α, β**: least squares of `step(b) = α + β·b` over the measured batches. The measured
  steps themselves also go to the router as `Rates.step_table` (GPU kernels change at some
  batch sizes, which a line smooths over); α and β extend it past the cap.
- **decode tok/s**: at the cap, `cap / step(cap)` — the backend's throughput when full.
- **the context term** (`context_tokens` > 0; `tandem calibrate` measures it at 128 tokens):
  the step at batch 1 and at min(cap, 8) again over a short shared prefix (`context_gen` tokens
  each). llama.cpp's unified KV hands every row of a step all n_kv cells (the highest used
  cell + 1) under a mask, and ggml's CPU flash-attention kernel skips a masked cell before its
  dot product, so a row pays for the cells its own sequence holds (shared prefix included): a
  step of b rows over c cells each costs `α' + β'·b + γ·b·c`. One context alone cannot tell γ·b·c
  from β·b; the steps of both contexts, each at its median step's cells (prefix + own tokens +
  half the generated ones), are fitted to it (`fit_context_model`). `Rates.step_gamma_s` is γ and
  `Rates.step_cells` the cells the table's steps were measured at, so the simulator
  (`Rates.step_at`) moves each tabled step by γ·b·(its cells − the table's). Before this, the
  table measured at 512 tokens priced the CPU grid's 128-token steps at 1.3–2× what they took.
- **the masked scan** (with the context term): skipping a masked cell is not free (its mask is
  read per row, layer and head, and llama.cpp builds the mask on the host, row by row over
  n_kv, before every step), so a step also costs `δ·b·n_kv`, n_kv the cells the pool spans.
  The calibration reads n_kv as the scheduler's KV cells in use after each timed step
  (`Backend.kv_cells_used`; the highest used cell + 1 is at least that, padded to 256 with flash
  attention): the simulator counts the same, so the stand-in's bias is the same on both sides.
  A third short pass runs the short context's largest batch b again with sequences that do
  NOT share a prefix: b different `context_tokens` prefixes are warmed into the cache (so the
  timed steps admit 4 own tokens each, as the shared pass does), then b requests, one per
  prefix. Each row holds the same cells as in the shared pass, the pool b times a row's: the
  difference of the two step times over b·(n_kv unshared − n_kv shared) is δ
  (`fit_scan_term`; negative noise gives 0, with a note). α, β, γ are then fitted to the
  shared passes' steps less δ·b·n_kv. `Rates.step_delta_s` is δ and `Rates.step_kv` the pool
  the table's steps were measured in. Before this, γ alone (fitted on shared prefixes, where
  n_kv grows with c) priced eight unshared 128-token sequences on one CPU backend at 0.82 of
  the measured step (docs/results/simulate/cpu-grid3).
  Without flash attention (the CPU's default since 2026-12-01) nothing is skipped: attention is
  a matrix product over every cell of the pool, so γ is 0 and α, β, δ are fitted together over
  all three passes (`fit_step_terms(pool_attention=True)`; docs/results/simulate/cpu-grid5).
- **host cost per request** (`admit_s`, with the context term): `repeats` lone requests over
  the short prefix, 4 tokens of their own and one generated; each one's TTFT less what the
  simulator's step model prices its prompt chunk at (`own tokens / prefill tok/s`), median.
  That is the submission, admission (cache match, sequence setup), sampling and delivery a
  request pays outside `llama_decode` at that scale; the simulator adds it per admitted request.

Rates are stored as JSON in the user cache (`cache_dir()`: `$TANDEM_CACHE_DIR`, else
platformdirs' `user_cache_dir("tandem")`), one entry per (model file fingerprint, backend
config key). The model file's fingerprint stands for the machine too: the store lives in this
user's cache on this machine. `config_key()` keeps what changes speed (device — one GPU's `gpuN` apart from
another's and from `gpu`, all GPUs —, threads, batch sizes, KV layout,
flash attention, sampling in the graph) and not the name, cap, context size or sequence
slots (second-order: a few per cent, which online refresh absorbs), so `cpu0` and `cpu1`
with the same threads share an entry, and so do a GPU backend's cap-sweep variants. `Engine.load` picks a stored entry up automatically (`source="cached"`);
explicit rates (`parse_rates()`, `source="override"`) win over it.

`calibrate_at_load()` is the short version `Engine.load(calibrate=True)` runs (the app and
`tandem serve` do) for every local backend that has neither: a 128-token prefill and decode
steps at batch 1 and the cap, ~2–6 s per backend config on a 2-core laptop, stored like a
full calibration (`source="measured"`, then `cached` on the next start). It runs before the
engine serves anything, so the router never prices a local backend with placeholder rates
(`DEFAULT_RATES`, `source="default"`) unless measuring failed, which the app's cards flag.
Why before serving and not on the first request: on a CPU-only machine a request served
while a backend calibrates shares its cores, which both slows that request and spoils the
measurement; and the wait is the same for the first client either way.

`OnlineRefresh` keeps a running engine's rates current from its own steps (EWMA), leaving
overridden rates alone.

A remote backend (engine/remote.py) has no steps to watch: `calibrate_remote` measures it by
sending requests — prefill from the TTFT of fresh prompts that generate one token (prompt
tokens from the engine's `usage`), the step time at batch b from the mean ITL of b requests
run together (`ignore_eos` where the API has it). `calibrate_backend` takes that path for any
backend whose `device` is "remote"; such a backend refines its rates online by itself.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path

from .backend import Backend, BackendConfig
from .errors import InvalidRequest
from .events import StepDone
from .llama.model import file_fingerprint
from .request import Request, SamplingParams
from .snapshot import Rates
from .workload import TOKEN_HIGH, TOKEN_LOW

log = logging.getLogger(__name__)

STORE_FILE = "rates.json"
STORE_VERSION = 1
CALIBRATION_PROMPT = 512
CALIBRATION_GEN = 32
OWN_TOKENS = 4  # tokens of its own each decode-measuring request adds to the shared prompt

Progress = Callable[[int, int, str], None]  # (done, total, what is being measured)


# ---- where and under which key ----


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
    """What about a backend's configuration changes its speed, as a stable string.

    `device` is the model's resolved device (`cpu` or `gpu`); it names the key only where the
    config says `auto`. A config for one GPU keeps its own (`gpu0`, `gpu1`): each GPU of a
    fleet in one process is calibrated, and priced, on its own (two H200s of one host differ
    by a few per cent, and a mixed host by much more)."""
    c = config.resolved()
    dev = (device or c.device) if c.device == "auto" else c.device
    return (f"{dev}:threads={c.threads},threads_batch={c.threads_batch},"
            f"n_batch={c.n_batch},n_ubatch={min(c.n_ubatch, c.n_batch)},"
            f"kv_unified={int(c.kv_unified)},flash_attn={c.flash_attn},"
            f"backend_sampling={int(c.backend_sampling)}")


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


def step_table(step_s: dict[int, float]) -> tuple[float, ...]:
    """Measured step times at batch 1..max as a table; batches not measured are interpolated
    linearly between their measured neighbours. Empty without a measurement at batch 1."""
    if 1 not in step_s:
        return ()
    points = sorted(step_s.items())
    table = []
    for b in range(1, points[-1][0] + 1):
        lo = max((p for p in points if p[0] <= b), key=lambda p: p[0])
        hi = min((p for p in points if p[0] >= b), key=lambda p: p[0])
        t = lo[1] if hi[0] == lo[0] else lo[1] + (hi[1] - lo[1]) * (b - lo[0]) / (hi[0] - lo[0])
        table.append(t)
    return tuple(table)


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


# ---- measuring ----


@dataclass(frozen=True)
class Calibration:
    """One backend's measured speeds (see the module docstring for how)."""

    backend: str
    device: str
    config_key: str
    cap: int
    threads: int
    prompt_tokens: int
    gen_tokens: int
    prefill_tok_s: float
    prefill_runs: tuple[float, ...]
    step_s: dict[int, float]  # batch -> median step cycle, seconds
    decode_only_s: dict[int, float]  # batch -> median llama_decode time alone, seconds
    step_alpha_s: float
    step_beta_s: float
    decode_tok_s: float
    seconds: float  # how long calibrating took
    notes: tuple[str, ...] = ()
    # The context term (0 / empty: not measured): the KV cells each step at `step_s` held; the
    # short context's steps and their cells; the fit over both (see the module docstring).
    step_cells: dict[int, float] = field(default_factory=dict)
    context_tokens: int = 0
    context_step_s: dict[int, float] = field(default_factory=dict)
    context_cells: dict[int, float] = field(default_factory=dict)
    context_alpha_s: float = 0.0
    context_beta_s: float = 0.0
    step_gamma_s: float = 0.0
    admit_s: float = 0.0  # host cost per request (0: not measured)
    admit_runs: tuple[float, ...] = ()
    # The masked scan (0 / empty: not measured): the pool's cells in use at each timed step
    # (median over the steps), the unshared pass (its batch, step and pool) and δ.
    step_kv: dict[int, float] = field(default_factory=dict)
    context_kv: dict[int, float] = field(default_factory=dict)
    scan_batch: int = 0
    scan_step_s: float = 0.0
    scan_kv: float = 0.0
    step_delta_s: float = 0.0
    measured_at: str = field(default_factory=lambda: datetime.now(timezone.utc).isoformat(timespec="seconds"))

    def rates(self) -> Rates:
        cells = step_table(self.step_cells) if self.step_gamma_s else ()
        kv = step_table(self.step_kv) if self.step_delta_s else ()
        return Rates(prefill_tok_s=self.prefill_tok_s, decode_tok_s=self.decode_tok_s,
                     step_alpha_s=self.step_alpha_s, step_beta_s=self.step_beta_s,
                     step_table=step_table(self.step_s), source="calibrated", measured_at=self.measured_at,
                     step_gamma_s=self.step_gamma_s, step_cells=cells, step_delta_s=self.step_delta_s,
                     step_kv=kv)

    def to_dict(self) -> dict:
        d = asdict(self)
        for k in ("step_s", "decode_only_s", "step_cells", "context_step_s", "context_cells", "step_kv",
                  "context_kv"):
            d[k] = {str(b): s for b, s in getattr(self, k).items()}
        d["rates"] = {k: v for k, v in asdict(self.rates()).items() if k not in ("source", "measured_at")}
        return d


def default_batches(cap: int) -> list[int]:
    """Batch sizes to time: every one up to 16 (GPU kernels change shape there: on the H200
    b = 9 steps slower per token than b = 8), then a few up to the cap; the table between them
    is interpolated (`step_table`)."""
    sparse = [b for b in (24, 32, 48, 64, 96, 128, 192) if 16 < b < cap]
    return list(range(1, min(cap, 16) + 1)) + sparse + ([cap] if cap > 16 else [])


def fit_step_model(points: dict[int, float]) -> tuple[float, float]:
    """Least-squares `step(b) = alpha + beta*b`, both kept >= 0. One point: alpha 0, beta = t/b."""
    if not points:
        raise ValueError("no step times to fit")
    bs = sorted(points)
    if len(bs) == 1:
        return 0.0, points[bs[0]] / bs[0]
    n = len(bs)
    mb = sum(bs) / n
    mt = sum(points[b] for b in bs) / n
    sbb = sum((b - mb) ** 2 for b in bs)
    beta = sum((b - mb) * (points[b] - mt) for b in bs) / sbb
    alpha = mt - beta * mb
    if beta < 0:  # noise on a flat curve: a constant step time
        return mt, 0.0
    if alpha < 0:  # through the origin instead
        return 0.0, sum(b * points[b] for b in bs) / sum(b * b for b in bs)
    return alpha, beta


def fit_context_model(points: Sequence[tuple[int, float, float]]) -> tuple[float, float, float]:
    """Least-squares `step(b, cells) = alpha + beta*b + gamma*b*cells` over (b, cells, seconds)
    points. gamma is kept >= 0 (noise that makes a longer context faster is no context term:
    then `fit_step_model` over the points, gamma 0); a negative alpha or beta is refitted at 0."""
    import numpy as np

    if len(points) < 3:
        raise ValueError("the context model needs at least 3 steps")
    a = np.array([[1.0, b, b * c] for b, c, _ in points])
    t = np.array([s for _, _, s in points])
    if np.linalg.matrix_rank(a) == 3:
        (alpha, beta, gamma), *_ = np.linalg.lstsq(a, t, rcond=None)
        if gamma > 0 and (alpha < 0 or beta < 0):  # refit with the negative one at 0
            keep = [1, 2] if alpha < 0 else [0, 2]
            sub, *_ = np.linalg.lstsq(a[:, keep], t, rcond=None)
            full = dict(zip(keep, (float(v) for v in sub)))
            alpha, beta, gamma = full.get(0, 0.0), full.get(1, 0.0), full[2]
        if gamma > 0 and alpha >= 0 and beta >= 0:
            return float(alpha), float(beta), float(gamma)
    by_b: dict[int, list[float]] = {}
    for b, _, s in points:
        by_b.setdefault(b, []).append(s)
    alpha, beta = fit_step_model({b: statistics.fmean(v) for b, v in by_b.items()})
    return alpha, beta, 0.0


def fit_scan_term(pairs: Sequence[tuple[int, float, float, float, float]]) -> float:
    """δ of the masked scan from steps of b rows whose own cells are equal, in two pools:
    `(b, kv_shared, step_shared, kv_unshared, step_unshared)` each. The step difference is
    δ·b·(kv_unshared − kv_shared); least squares through the origin over the pairs (one pair:
    the ratio). Kept >= 0: noise that makes the larger pool faster is no scan cost (0)."""
    xs = [b * (ku - ks) for b, ks, _, ku, _ in pairs]
    ys = [tu - ts for _, _, ts, _, tu in pairs]
    sxx = sum(x * x for x in xs)
    if not pairs or sxx <= 0:
        raise ValueError("the masked scan needs a pair of steps in pools of different sizes")
    return max(sum(x * y for x, y in zip(xs, ys)) / sxx, 0.0)


def fit_step_terms(points: Sequence[tuple[int, float, float, float]],
                   pairs: Sequence[tuple[int, float, float, float, float]] = (),
                   pool_attention: bool = False) -> tuple[float, float, float, float]:
    """`step(b, cells, kv) = alpha + beta*b + gamma*b*cells + delta*b*kv`: delta from the
    unshared `pairs` (`fit_scan_term`; none: 0), then alpha, beta, gamma by `fit_context_model`
    over the (b, cells, kv, seconds) `points` less delta*b*kv.

    `pool_attention` (a backend without flash attention): attention is a matrix product over
    every cell of the pool, masked or not, so a row's own cells cost nothing apart: gamma is 0
    and alpha, beta, delta are fitted together over every step, the unshared ones included."""
    if pool_attention:
        steps = [(b, kv, t) for b, _, kv, t in points]
        steps += [(b, kv, t) for b, ks, ts, ku, tu in pairs for kv, t in ((ks, ts), (ku, tu))]
        alpha, beta, delta = fit_context_model(steps)  # the same form, the pool for the cells
        return alpha, beta, 0.0, delta
    delta = fit_scan_term(pairs) if pairs else 0.0
    alpha, beta, gamma = fit_context_model([(b, c, t - delta * b * kv) for b, c, kv, t in points])
    return alpha, beta, gamma, delta


def calibration_cells(prompt: int, gen_tokens: int) -> float:
    """The cells each row of a median calibration step sees: the shared prompt, the sequence's
    own tokens and half of what it generates (steps run from 1 to `gen_tokens` - 1)."""
    return prompt + OWN_TOKENS + gen_tokens / 2


CONTEXT_PROMPT = 128  # `tandem calibrate`'s short context (the grid's prompts)
CONTEXT_GEN = 16
CONTEXT_BATCH = 8  # the short context's largest batch


def context_batches(fits: Sequence[int]) -> list[int]:
    """The batches timed again at the short context: 1 and the largest that fits up to 8."""
    top = max((b for b in fits if b <= CONTEXT_BATCH), default=1)
    return sorted({1, top})


def progress_steps(cap: int, batches: Sequence[int] | None, repeats: int, context_tokens: int) -> int:
    """How many steps `calibrate_backend` reports to `progress` (before any batch is skipped)."""
    return _n_steps(sorted(set(batches or default_batches(cap))), repeats, bool(context_tokens))


def _n_steps(fits: Sequence[int], repeats: int, context: bool) -> int:
    """Warm-up, prefill runs, one per batch, and with the context term: its batches, the host
    cost and the unshared pass (or its skip)."""
    c_batches = context_batches(fits)
    return 1 + repeats + len(fits) + (len(c_batches) + 1 + (c_batches[-1] > 1) if context else 0)


def calibrate_backend(backend: Backend, *, prompt_tokens: int = CALIBRATION_PROMPT,
                      gen_tokens: int = CALIBRATION_GEN, batches: Sequence[int] | None = None,
                      repeats: int = 3, seed: int = 0, timeout: float = 600.0,
                      progress: Progress | None = None, context_tokens: int = 0,
                      context_gen: int = CONTEXT_GEN) -> Calibration:
    """Measure one idle, started backend (see the module docstring). Its prefix cache is flushed.
    `context_tokens` > 0 also measures the context term and the host cost per request there.

    Raises InvalidRequest for sizes that cannot work; a batch that does not fit the context
    is skipped with a note.
    """
    if prompt_tokens < 8 or gen_tokens < 4 or repeats < 1:
        raise InvalidRequest("calibration needs prompt_tokens >= 8, gen_tokens >= 4, repeats >= 1")
    if getattr(backend, "device", None) == "remote":
        return calibrate_remote(backend, prompt_tokens=prompt_tokens, gen_tokens=gen_tokens, batches=batches,
                                repeats=repeats, seed=seed, timeout=timeout, progress=progress)
    t_start = time.monotonic()
    notes: list[str] = []
    n_ctx = backend.n_ctx
    prompt = min(prompt_tokens, n_ctx - gen_tokens - OWN_TOKENS - 2)
    if prompt < 8:
        raise InvalidRequest(f"{backend.name}: context of {n_ctx} cells is too small to calibrate")
    if prompt < prompt_tokens:
        notes.append(f"prompt shortened to {prompt} tokens to fit the {n_ctx}-cell context")
    wanted = sorted(set(batches or default_batches(backend.cap)))
    if not wanted or wanted[0] < 1:
        raise InvalidRequest(f"batches must be >= 1, got {list(batches or [])}")
    per_seq = OWN_TOKENS + gen_tokens + 1
    fits = [b for b in wanted if prompt + b * per_seq <= n_ctx and b <= backend.config.n_seq_max - 1]
    if len(fits) < len(wanted):
        notes.append(f"skipped batches {sorted(set(wanted) - set(fits))}: they do not fit "
                     f"{n_ctx} KV cells / {backend.config.n_seq_max} sequences")
    if not fits:
        raise InvalidRequest(f"{backend.name}: no batch size fits the context; lower --gen-tokens or raise ctx")

    probe = _Probe(backend, seed, timeout)
    short = context_tokens
    if context_tokens and not 8 <= context_tokens <= prompt // 2:  # closer contexts cannot separate γ·b·c from β·b
        notes.append(f"context term not measured: the short context ({context_tokens}) must be >= 8 tokens "
                     f"and at most half the prompt ({prompt})")
        short = 0
    c_batches = context_batches(fits) if short else []
    scan = c_batches[-1] if c_batches and c_batches[-1] > 1 else 0  # the unshared pass's batch
    if scan and scan * (short + per_seq) > n_ctx:
        notes.append(f"masked scan not measured: {scan} unshared {short}-token sequences do not fit {n_ctx} KV cells")
        scan = 0
    tick = _ticker(progress, backend.name, _n_steps(fits, repeats, bool(short)))

    old_cap, old_adaptive = (None if backend.cap_auto else backend.cap), backend.cap_adaptive
    old_reason = backend.snapshot().cap_reason or None  # restored below: calibration is not the user
    backend.set_cap(max(max(fits), backend.cap), adaptive=False)  # fixed: each batch runs b at once
    greedy1 = SamplingParams(temperature=0.0, max_tokens=1)
    try:
        backend.flush().result(timeout)
        probe.run([Request(probe.tokens(prompt), greedy1, source="calibrate")])  # warm-up, not measured
        tick("warm-up")
        prefill_runs = []
        for k in range(repeats):
            backend.flush().result(timeout)
            steps = [e for e, _ in probe.run([Request(probe.tokens(prompt), greedy1, source="calibrate")])
                     if e.n_prefill]
            prefill_runs.append(sum(e.n_prefill for e in steps) / sum(e.seconds for e in steps))
            tick(f"prefill {k + 1}/{repeats}")
        step_s, decode_only_s, step_kv = probe.step_times(prompt, gen_tokens, fits, tick, notes)
        context_s: dict[int, float] = {}
        context_kv: dict[int, float] = {}
        scan_s: dict[int, float] = {}
        scan_kv: dict[int, float] = {}
        admit_runs: list[float] = []
        if short:
            context_s, _, context_kv = probe.step_times(short, context_gen, c_batches, tick, notes,
                                                        label="short context, batch")
            admit_runs = probe.host_costs(short, repeats, statistics.median(prefill_runs))
            tick("host cost per request")
            if c_batches[-1] > 1:
                if scan:
                    scan_s, _, scan_kv = probe.step_times(short, context_gen, [scan], tick, notes,
                                                          label="unshared prefixes, batch", unshared=True)
                else:
                    tick("masked scan skipped")
    finally:
        probe.close()
        backend.set_cap(old_cap, adaptive=old_adaptive, reason=old_reason)
        try:
            backend.flush().result(timeout)
        except Exception:  # a stopped backend has nothing left to flush
            pass

    if not step_s:
        raise InvalidRequest(f"{backend.name}: no decode step could be measured")
    alpha, beta = fit_step_model(step_s)
    cap = backend.cap
    at_cap = step_s.get(cap) or (alpha + beta * cap)
    cells = {b: calibration_cells(prompt, gen_tokens) for b in step_s}
    c_cells = {b: calibration_cells(short, context_gen) for b in context_s}
    c_alpha = c_beta = gamma = delta = 0.0
    if context_s:
        pairs = [(b, context_kv[b], context_s[b], scan_kv[b], t) for b, t in scan_s.items()
                 if b in context_s and scan_kv[b] > context_kv[b]]
        if scan_s and not pairs:
            notes.append("masked scan not measured: the unshared pass's pool was no larger than the shared one's")
        points = ([(b, cells[b], step_kv[b], t) for b, t in step_s.items()]
                  + [(b, c_cells[b], context_kv[b], t) for b, t in context_s.items()])
        pool = backend.config.flash_attn == "off"  # every row over the whole pool (fit_step_terms)
        c_alpha, c_beta, gamma, delta = fit_step_terms(points, pairs, pool_attention=pool)
        if pool:
            notes.append("no flash attention: every row attends over the whole pool (no context term; "
                         "the pool term fitted over every step)")
        if pairs and not delta:
            notes.append("the unshared prefixes' steps were no slower: no masked-scan term (noise, or none to see)")
        if not gamma and not pool:
            notes.append("the short context's steps were no faster: no context term (noise, or none to see)")
    admit = max(statistics.median(admit_runs), 0.0) if admit_runs else 0.0
    return Calibration(
        backend=backend.name,
        device=backend.model.device,
        config_key=config_key(backend.config, backend.model.device),
        cap=cap,
        threads=backend.config.threads,
        prompt_tokens=prompt,
        gen_tokens=gen_tokens,
        prefill_tok_s=statistics.median(prefill_runs),
        prefill_runs=tuple(prefill_runs),
        step_s=step_s,
        decode_only_s=decode_only_s,
        step_alpha_s=alpha,
        step_beta_s=beta,
        decode_tok_s=cap / at_cap,
        seconds=time.monotonic() - t_start,
        notes=tuple(notes),
        step_cells=cells if gamma else {},
        context_tokens=short,
        context_step_s=context_s,
        context_cells=c_cells,
        context_alpha_s=c_alpha,
        context_beta_s=c_beta,
        step_gamma_s=gamma,
        admit_s=admit,
        admit_runs=tuple(admit_runs),
        step_kv=step_kv if delta else {},
        context_kv=context_kv,
        scan_batch=next(iter(scan_s), 0),
        scan_step_s=next(iter(scan_s.values()), 0.0),
        scan_kv=next(iter(scan_kv.values()), 0.0),
        step_delta_s=delta,
    )


def calibrate_remote(backend, *, prompt_tokens: int = CALIBRATION_PROMPT, gen_tokens: int = CALIBRATION_GEN,
                     batches: Sequence[int] | None = None, repeats: int = 3, seed: int = 0,
                     timeout: float = 600.0, progress: Progress | None = None) -> Calibration:
    """Measure an idle, healthy remote backend by sending it requests (see the module docstring).

    Prompts are random words, different for every request, so the engine's prefix cache does
    not hit; `prompt_tokens` is a target (about one token per word), the engine's `usage`
    says how many there were. Time includes HTTP: it is what a request waits for.
    """
    if not backend.healthy:
        raise InvalidRequest(f"{backend.name}: the engine is unhealthy ({backend.error}); nothing to calibrate")
    t_start = time.monotonic()
    notes: list[str] = ["measured over HTTP: TTFT and ITL of requests sent to the engine"]
    rng = random.Random(seed)
    wanted = sorted(set(batches or range(1, backend.cap + 1)))
    if not wanted or wanted[0] < 1:
        raise InvalidRequest(f"batches must be >= 1, got {list(batches or [])}")
    tick = _ticker(progress, backend.name, 1 + repeats + len(wanted))

    def words(n: int) -> str:
        return " ".join(f"w{rng.randrange(10**6)}" for _ in range(n))

    def run(prompts: list[str], sampling: SamplingParams) -> list:
        handles = [backend.enqueue(Request((), sampling, text=p, source="calibrate")) for p in prompts]
        records = [h.result(timeout) for h in handles]
        for r in records:
            if r.error:
                raise InvalidRequest(f"calibrating {backend.name} failed: {r.error}")
        return records

    old_cap = backend.cap
    if max(wanted) > old_cap:
        backend.set_cap(max(wanted))
    greedy1 = SamplingParams(temperature=0.0, max_tokens=1)
    try:
        run([words(prompt_tokens)], greedy1)  # warm-up, not measured
        tick("warm-up")
        prefill_runs = []
        prompt = prompt_tokens
        for k in range(repeats):
            (r,) = run([words(prompt_tokens)], greedy1)
            prompt = r.prompt_tokens
            prefill_runs.append((r.prompt_tokens - r.cached_tokens) / max(r.ttft_s or r.e2e_s, 1e-6))
            tick(f"prefill {k + 1}/{repeats}")
        decode = SamplingParams(temperature=0.0, max_tokens=gen_tokens, ignore_eos=True)
        step_s: dict[int, float] = {}
        for b in wanted:
            itls = [r.itl_s for r in run([words(OWN_TOKENS) for _ in range(b)], decode) if r.itl_s]
            if itls:
                step_s[b] = statistics.median(itls)
            else:
                notes.append(f"batch {b}: each request streamed as one chunk, no gap to measure "
                             f"(raise --gen-tokens)")
            tick(f"decode at batch {b}")
    finally:
        if backend.cap != old_cap:
            backend.set_cap(old_cap)
    if not step_s:
        raise InvalidRequest(f"{backend.name}: no decode step could be measured (the engine streamed one chunk)")
    alpha, beta = fit_step_model(step_s)
    cap = backend.cap
    at_cap = step_s.get(cap) or (alpha + beta * cap)
    return Calibration(
        backend=backend.name, device="remote", config_key=f"remote:{backend.url}", cap=cap, threads=0,
        prompt_tokens=prompt, gen_tokens=gen_tokens, prefill_tok_s=statistics.median(prefill_runs),
        prefill_runs=tuple(prefill_runs), step_s=step_s, decode_only_s={}, step_alpha_s=alpha, step_beta_s=beta,
        decode_tok_s=cap / at_cap, seconds=time.monotonic() - t_start, notes=tuple(notes))


class _Probe:
    """Sends calibration requests to one backend and collects the steps they caused."""

    def __init__(self, backend: Backend, seed: int, timeout: float):
        self.backend = backend
        self.timeout = timeout
        self._rng = random.Random(seed)
        self._shared: tuple[int, ...] = ()  # the prefix `step_times` warmed last
        self._high = min(backend.model.n_vocab, TOKEN_HIGH)
        self._events: list[tuple[StepDone, int]] = []  # each step and the pool's cells in use after it
        self.records: list = []  # the last `run`'s request records
        self._unsubscribe = backend.bus.subscribe(self._on_step, (StepDone,))

    def _on_step(self, ev: StepDone) -> None:
        """On the worker thread, right after the step's tokens were applied (before any finish
        is retired): the step and the KV cells in use, its own tokens included."""
        if ev.backend == self.backend.name:
            self._events.append((ev, self.backend.kv_cells_used()))

    def tokens(self, n: int) -> tuple[int, ...]:
        return tuple(self._rng.randrange(TOKEN_LOW, self._high) for _ in range(n))

    def run(self, requests: list[Request]) -> list[tuple[StepDone, int]]:
        """Enqueue `requests` while the worker waits in a call, so it admits them all at once;
        wait for them; return the steps taken meanwhile, each with the KV cells in use after it."""
        self._events.clear()
        gate = threading.Event()
        held = self.backend.call(lambda _b: gate.wait(self.timeout))
        try:
            handles = [self.backend.enqueue(r) for r in requests]
        finally:
            gate.set()
        held.result(self.timeout)
        self.records = []
        for h in handles:
            record = h.result(self.timeout)
            if record.error:
                raise InvalidRequest(f"calibrating {self.backend.name} failed: {record.error}")
            self.records.append(record)
        return list(self._events)

    def host_costs(self, prompt: int, n: int, prefill_tok_s: float) -> list[float]:
        """Each of `n` lone requests' TTFT over a warmed `prompt`-token prefix (4 tokens of its
        own, one generated) less `computed prompt tokens / prefill_tok_s`: the host's cost per
        request beyond what the simulator's step model prices (see the module docstring).
        Runs after `step_times` over the same prompt, whose prefix is still cached."""
        greedy1 = SamplingParams(temperature=0.0, max_tokens=1)
        out = []
        for _ in range(n):
            self.run([Request(self._shared + self.tokens(OWN_TOKENS), greedy1, source="calibrate")])
            r = self.records[0]
            if r.ttft_s is not None:
                out.append(r.ttft_s - (r.prompt_tokens - r.cached_tokens) / prefill_tok_s)
        return out

    def step_times(self, prompt: int, gen_tokens: int, batches: list[int], tick, notes: list[str],
                   label: str = "decode batch", unshared: bool = False):
        """Median step cycle, median `llama_decode` time and median KV cells in use per batch
        size (see the module docstring). `unshared`: each of a batch's sequences has a
        `prompt`-token prefix of its own (all warmed first), not one shared prefix."""
        self.backend.flush().result(self.timeout)
        if not unshared:
            shared = self._shared = self.tokens(prompt)
            self.backend.warm(shared).result(self.timeout)
        sampling = SamplingParams(temperature=0.0, max_tokens=gen_tokens, ignore_eos=True)
        step_s: dict[int, float] = {}
        decode_only_s: dict[int, float] = {}
        kv: dict[int, float] = {}
        for b in batches:
            if unshared:
                prefixes = [self.tokens(prompt) for _ in range(b)]
                for h in [self.backend.warm(p) for p in prefixes]:
                    h.result(self.timeout)
            else:
                prefixes = [shared] * b
            steps = self.run([Request(p + self.tokens(OWN_TOKENS), sampling, source="calibrate") for p in prefixes])
            steady = [k for k, (e, _) in enumerate(steps) if e.n_decode == b and e.n_prefill == 0]
            cycles = [steps[k][0].time - steps[k - 1][0].time for k in steady if k > 0]
            if not steady:
                notes.append(f"batch {b}: never ran {b} sequences together; skipped")
            else:
                decode_only_s[b] = statistics.median(steps[k][0].seconds for k in steady)
                step_s[b] = statistics.median(cycles) if cycles else decode_only_s[b]
                kv[b] = float(statistics.median(steps[k][1] for k in steady))
            tick(f"{label} {b}")
        return step_s, decode_only_s, kv

    def close(self) -> None:
        self._unsubscribe()


def save_calibration(store: RateStore, model_path: Path, cal: Calibration, model_name: str = "") -> str:
    """Store `cal` under its (fingerprint, config key); returns the entry's key."""
    fingerprint = file_fingerprint(Path(model_path))
    store.save(fingerprint, cal.config_key, {"model": model_name or Path(model_path).name,
                                             "model_path": str(model_path), **cal.to_dict()})
    return f"{fingerprint}|{cal.config_key}"


# ---- at load ----

# The short calibration `Engine.load(calibrate=True)` runs: a few seconds per backend config.
LOAD_PROMPT = 128
LOAD_GEN = 8


def calibrate_at_load(backends, model_path: Path, model_name: str = "", store: RateStore | None = None,
                      status: Callable[[str], None] | None = None, timeout: float = 300.0,
                      progress: Progress | None = None) -> dict[str, Rates]:
    """Measure the local `backends` (started, idle) that still have placeholder rates, one per
    speed-relevant config (`config_key`), apply the rates to every backend of that config
    (`source="measured"`) and store them; return {backend name: rates} for those measured.

    A backend that cannot be measured (a context too small, a failed step) keeps its
    placeholder rates, with a warning: the engine still serves.
    """
    store = store or RateStore()
    groups: dict[str, list] = {}
    for b in backends:
        if getattr(b, "device", "") == "remote" or not b.rates.placeholder:
            continue
        groups.setdefault(config_key(b.config, b.model.device), []).append(b)
    applied: dict[str, Rates] = {}
    for key, same in groups.items():
        first = same[0]
        if status is not None:
            status(f"measuring {first.name}'s speed (once per model and config on this machine)")
        try:
            cal = calibrate_backend(first, prompt_tokens=LOAD_PROMPT, gen_tokens=LOAD_GEN,
                                    batches=sorted({1, first.cap}), repeats=1, timeout=timeout, progress=progress)
        except Exception as e:  # keep serving on the placeholder; the cards flag it
            log.warning("%s: measuring rates at load failed, placeholder rates stay: %s", first.name, e)
            continue
        rates = replace(cal.rates(), source="measured")
        for b in same:
            b.set_rates(rates)
            applied[b.name] = rates
        try:
            save_calibration(store, model_path, replace(cal, notes=(*cal.notes, "measured at load")), model_name)
        except OSError as e:
            log.warning("could not store the rates measured for %s: %s", first.name, e)
        log.info("%s: rates measured at load in %.1f s: prefill %.0f tok/s, decode %.1f tok/s at cap %d (%s)",
                 first.name, cal.seconds, cal.prefill_tok_s, cal.decode_tok_s, cal.cap, key)
    return applied


# ---- online refresh ----


@dataclass
class _Track:
    base: Rates
    set_last: Rates | None = None
    factor: float = 1.0  # observed / predicted decode step time, EWMA
    prefill: float = 0.0  # observed prefill tok/s, EWMA (0: none seen yet)
    last: StepDone | None = None
    seen: int = 0


class OnlineRefresh:
    """Keeps an engine's rates current from the steps its backends report (EWMA).

    Decode: each decode-only step's cycle time (since the backend's previous step ended, as in
    calibration) over the step time the base rates predict for that batch gives a correction
    factor; its EWMA scales α, β and the decode rate. Prefill: prompt-only steps of at least
    `min_prefill` tokens update an EWMA of prefill tok/s. Every `every` steps the backend gets
    `Rates(..., source="online")`. A backend whose rates someone else set takes them as its
    new base; rates with `source="override"` are never touched.

    Thread contract: `_on_step` runs on each backend's worker thread and touches only that
    backend's `_Track`, so no lock is needed; `attach`/`detach`/`reset` from any thread
    between runs.
    """

    def __init__(self, engine, weight: float = 0.1, every: int = 8, min_prefill: int = 32):
        if not 0 < weight <= 1:
            raise ValueError(f"weight must be in (0, 1], got {weight}")
        self.engine = engine
        self.weight = weight
        self.every = max(1, every)
        self.min_prefill = min_prefill
        self._tracks: dict[str, _Track] = {}
        self._unsubscribe: Callable[[], None] | None = None

    def attach(self) -> "OnlineRefresh":
        self.reset()
        if self._unsubscribe is None:
            self._unsubscribe = self.engine.bus.subscribe(self._on_step, (StepDone,))
        return self

    def detach(self) -> None:
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None

    @property
    def attached(self) -> bool:
        """Whether it follows the engine's steps now (between `attach` and `detach`)."""
        return self._unsubscribe is not None

    def reset(self, rates: dict[str, Rates] | None = None) -> None:
        """Start over from `rates` (default: each backend's current rates), applied now."""
        for name, b in self.engine.backends.items():
            base = (rates or {}).get(name) or b.rates
            if rates and name in rates:
                self.engine.set_rates(name, base)
            self._tracks[name] = _Track(base=base, set_last=b.rates)

    def _on_step(self, ev: StepDone) -> None:
        track = self._tracks.get(ev.backend)
        backend = self.engine.backends.get(ev.backend)
        if track is None or backend is None:
            return
        prev, track.last = track.last, ev
        current = backend.rates
        if current.source == "override":
            return
        if current is not track.set_last:  # set from elsewhere: a new base
            track.base, track.set_last, track.factor, track.prefill = current, current, 1.0, 0.0
        w = self.weight
        if ev.n_decode and not ev.n_prefill and prev is not None:
            predicted = track.base.step_s(ev.n_decode)
            cycle = ev.time - prev.time
            if predicted > 0 and math.isfinite(predicted) and cycle > 0:
                track.factor += w * (cycle / predicted - track.factor)
        elif not ev.n_decode and ev.n_prefill >= self.min_prefill and ev.seconds > 0:
            observed = ev.n_prefill / ev.seconds
            track.prefill = observed if not track.prefill else track.prefill + w * (observed - track.prefill)
        track.seen += 1
        if track.seen % self.every == 0:
            track.set_last = self.rates_of(track)
            self.engine.set_rates(ev.backend, track.set_last)

    @staticmethod
    def rates_of(track: _Track) -> Rates:
        f = track.factor
        b = track.base
        alpha, beta, table = b.scaled(f)
        return replace(b, prefill_tok_s=track.prefill or b.prefill_tok_s, decode_tok_s=b.decode_tok_s / f,
                       step_alpha_s=alpha, step_beta_s=beta, step_table=table, source="online")


def _ticker(progress, name: str, total: int):
    """`tick(what)`: one more of `total` calibration steps done, reported to `progress`."""
    done = 0

    def tick(what: str) -> None:
        nonlocal done
        done += 1
        if progress is not None:
            progress(done, total, f"{name}: {what}")

    return tick
