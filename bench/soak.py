"""`tandem bench soak`: hours of mixed traffic in one process, watching for leaks and hangs.

One process holds the engine, the OpenAI-compatible server on 127.0.0.1 and the clients.
`--concurrency` workers each send one request at a time, drawn from their own seeded RNG
(`--seed`, so the traffic is the same from run to run):

- `chat`: `engine.chat(...)` from a client thread, streamed by iterating the handle; a chat
  may continue the worker's previous conversation (multi-turn, so prefixes are shared);
- `api-chat`, `api-chat-stream`, `api-completion`, `api-completion-stream`: real HTTP to
  `/v1/chat/completions` and `/v1/completions` with an aiohttp `ClientSession`.

Prompt lengths and `max_tokens` are log-uniform; some prompts share one of a few system
prompts; some requests carry stop strings, some `ignore_eos`. A `--cancel-rate` share of
requests is abandoned: chats call `handle.cancel()` after a random number of deltas, API
streams close the connection after a random number of chunks, non-streaming API requests
drop the connection after a random delay.

Each request ends as one `Outcome` (vLLM's habit: a failure is data, not an exception): ok,
cancelled, or an error (anything unexpected: an error status or record, a malformed or
truncated reply, streamed text that differs from the final record, more tokens than asked
for, no end within `REQUEST_TIMEOUT_S`). Every `--interval` seconds a line reports requests,
errors, RSS, KV cells in use per backend, open fds and threads.

At the end: traffic stops, the engine goes idle, `engine.flush()` drops the prefix caches,
the server and clients close, `engine.close()`. The last stdout line is one JSON object:

- `rss_growth_pct`: RSS once idle and flushed (engine still loaded) against RSS at the end of
  the warm-up, `min(max(10 % of the run, 20 s), half the run)`, in percent
  (`rss_mb_end_trimmed`: RSS after glibc's `malloc_trim(0)`, taken after that measurement,
  tells memory in use from free memory the allocator kept);
- `kv_cells_idle`: KV cells in use over all backends once idle and flushed (0 expected);
  `kv_state_bytes_growth` checks the same in llama.cpp itself: its state size
  (`llama_state_get_size`) once idle and flushed minus before the traffic (0 expected);
- `threads_end`: Python threads alive after `engine.close()` (and up to `THREAD_JOIN_S` to
  end) that were not alive when the soak started (under `tandem bench soak` that is every
  thread but the main one);
- `fds_growth`: open fds after everything closed minus open fds before the engine loaded;
- `requests`, `errors`, `cancelled`, `minutes`, and details (per kind, RSS, engine-side
  finish counts, samples of error messages).

The server is the app's (`app.server`): `tandem bench soak` hands it in as
`args.start_api(engine)`, an awaitable of `(aiohttp runner, base URL)`, as this package sits
below the app and does not import it.

`--out DIR` writes `soak.csv` (the time series, one row per line printed, appended as it
goes) and `soak.json` (the final object).
"""

from __future__ import annotations

import asyncio
import contextlib
import csv
import ctypes
import gc
import json
import math
import os
import random
import statistics
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from engine.backends.config import parse_backend_specs
from engine.core.errors import EngineError
from engine.core.events import RequestFinished, RequestRouted
from engine.core.request import RequestStatus, SamplingParams
from engine.engine import Engine

DEFAULT_MODEL = "synthetic:tiny"
DEFAULT_BACKENDS = ("cpu:threads=1,cap=4,ctx=2048", "cpu:threads=1,cap=4,ctx=2048")
REQUEST_TIMEOUT_S = 120.0  # a request without an end by then is an error (a hang)
IDLE_TIMEOUT_S = 60.0  # after traffic stops, the engine must be idle within this
THREAD_JOIN_S = 10.0  # after engine.close(), threads the soak started get this long to end
MAX_ERROR_SAMPLES = 20  # distinct error messages kept for the summary

KINDS = ("chat", "api-chat-stream", "api-chat", "api-completion-stream", "api-completion")
KIND_WEIGHTS = (0.5, 0.15, 0.1, 0.15, 0.1)
MAX_TOKENS_HIGH = 256
USER_WORDS_HIGH = 100  # first turn of a chat, API prompts
FOLLOW_UP_WORDS_HIGH = 30
MAX_TURNS = 4
STOPS = ("ar", "aw", "k)", "br", "ae", "zz")  # stop strings; the tiny model's noise hits most of them
MAX_PROMPT_CHARS = 1500  # a conversation longer than this starts over (fits a 2048-token context)
REPLY_KEEP_CHARS = 200  # of an assistant reply, kept in the conversation
WORDS = ("the", "a", "model", "backend", "token", "cache", "prefix", "queue", "router", "request",
         "stream", "answer", "question", "please", "explain", "why", "how", "what", "when", "short",
         "long", "context", "memory", "thread", "device", "graph", "batch", "decode", "prompt", "slot",
         "kernel", "latency", "throughput", "and", "or", "not", "with", "without", "over", "under",
         "seven", "forty", "blue", "green", "quickly", "slowly", "naïve", "café", "日本語", "🙂")


# ---- arguments ----


HELP = "leak and hang hunt: mixed chat/API traffic with cancellations for N minutes"


def add_arguments(p) -> None:
    p.add_argument("--minutes", type=float, default=30.0,
                   help="traffic duration, fractions allowed (default: %(default)s)")
    p.add_argument("--model", default=DEFAULT_MODEL, help="default | PATH.gguf | synthetic:SHAPE (default: %(default)s)")
    p.add_argument("--backend", action="append", default=None, metavar="SPEC",
                   help="DEVICE[:cap=N,threads=N,ctx=N,name=X] (repeatable; default: two CPU "
                        "backends, threads=1 cap=4 ctx=2048)")
    p.add_argument("--policy", default="default", help="routing policy (default: %(default)s)")
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight (default: %(default)s)")
    p.add_argument("--cancel-rate", type=float, default=0.2,
                   help="share of requests the client abandons mid-way (default: %(default)s)")
    p.add_argument("--interval", type=float, default=10.0, help="seconds between report lines (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="traffic seed (default: %(default)s)")
    p.add_argument("--out", default=None, metavar="DIR", help="write soak.csv and soak.json here")
    p.epilog = ("rss_growth_pct compares RSS once idle and flushed (engine still loaded) with RSS at "
                "the end of the warm-up, min(max(10 % of the run, 20 s), half the run). "
                "threads_end counts threads still alive after engine.close() that the soak started; "
                "fds_growth is open fds after everything closed minus before the engine loaded.")


def warmup_seconds(duration_s: float) -> float:
    return min(max(0.1 * duration_s, 20.0), duration_s / 2)


# ---- requests ----


@dataclass(frozen=True)
class Spec:
    """One request a client will send, fully drawn from its worker's RNG."""

    kind: str
    messages: tuple[dict, ...] = ()  # chat kinds
    prompt: str = ""  # completion kinds
    max_tokens: int = 16
    temperature: float = 0.0
    seed: int = 0
    ignore_eos: bool = False
    stop: tuple[str, ...] = ()
    include_usage: bool = False
    cancel_after: int | None = None  # streams: abandon after this many text deltas
    abort_after_s: float | None = None  # non-streaming API: drop the connection after this long

    @property
    def stream(self) -> bool:
        return self.kind == "chat" or self.kind.endswith("-stream")

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.kind.startswith("api-chat") else "/v1/completions"

    def sampling(self) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, seed=self.seed, max_tokens=self.max_tokens,
                              ignore_eos=self.ignore_eos, stop=self.stop)

    def body(self) -> dict:
        body: dict[str, Any] = {"max_tokens": self.max_tokens, "temperature": self.temperature, "seed": self.seed,
                "ignore_eos": self.ignore_eos, "stream": self.stream}
        if self.stop:
            body["stop"] = list(self.stop)
        if self.kind.startswith("api-chat"):
            body["messages"] = list(self.messages)
        else:
            body["prompt"] = self.prompt
        if self.stream and self.include_usage:
            body["stream_options"] = {"include_usage": True}
        return body


@dataclass(frozen=True)
class Outcome:
    kind: str
    status: str  # "ok" | "cancelled" | "error"
    error: str | None = None
    output_tokens: int = 0
    latency_s: float = 0.0


def _ok(spec: Spec, t0: float, tokens: int) -> Outcome:
    return Outcome(spec.kind, "ok", output_tokens=tokens, latency_s=time.monotonic() - t0)


def _cancelled(spec: Spec, t0: float) -> Outcome:
    return Outcome(spec.kind, "cancelled", latency_s=time.monotonic() - t0)


def _error(spec: Spec, t0: float, why: str) -> Outcome:
    return Outcome(spec.kind, "error", error=f"{spec.kind}: {why}", latency_s=time.monotonic() - t0)


class Traffic:
    """One worker's request stream: its own RNG, its own chat conversation."""

    def __init__(self, seed: int, worker: int, cancel_rate: float, systems: list[str]):
        self.rng = random.Random(seed * 1_000_003 + worker)
        self.cancel_rate = cancel_rate
        self.systems = systems
        self.history: list[dict] = []

    def next(self) -> Spec:
        rng = self.rng
        kind = rng.choices(KINDS, KIND_WEIGHTS)[0]
        max_tokens = _log_uniform(rng, MAX_TOKENS_HIGH)
        cancel_after = abort_after = None
        if rng.random() < self.cancel_rate:
            if kind == "chat" or kind.endswith("-stream"):
                cancel_after = rng.randint(1, max(1, max_tokens // 2))
            else:
                abort_after = rng.uniform(0.005, 0.3)
        common = Spec(kind=kind, max_tokens=max_tokens, temperature=rng.choice((0.0, 0.7, 1.0)),
                      seed=rng.randrange(2**31), ignore_eos=rng.random() < 0.3,
                      stop=tuple(rng.sample(STOPS, rng.randint(1, 2))) if rng.random() < 0.2 else (),
                      include_usage=rng.random() < 0.5, cancel_after=cancel_after, abort_after_s=abort_after)
        if kind == "api-completion" or kind == "api-completion-stream":
            return replace(common, prompt=self._words(USER_WORDS_HIGH * 2))
        if kind == "chat" and self.history and len(self.history) < 2 * MAX_TURNS and rng.random() < 0.6:
            turn = {"role": "user", "content": self._words(FOLLOW_UP_WORDS_HIGH)}
            if sum(len(m["content"]) for m in self.history) + len(turn["content"]) < MAX_PROMPT_CHARS:
                return replace(common, messages=(*self.history, turn))
        messages = [{"role": "user", "content": self._words(USER_WORDS_HIGH)}]
        if rng.random() < 0.7:
            messages.insert(0, {"role": "system", "content": rng.choice(self.systems)})
        return replace(common, messages=tuple(messages))

    def replied(self, spec: Spec, text: str | None) -> None:
        """A chat ended: keep its conversation going (text) or start over (None)."""
        if spec.kind != "chat":
            return
        if text is None:
            self.history = []
        else:
            self.history = [*spec.messages, {"role": "assistant", "content": text[:REPLY_KEEP_CHARS]}]

    def _words(self, high: int) -> str:
        return " ".join(self.rng.choices(WORDS, k=_log_uniform(self.rng, high)))


def _log_uniform(rng: random.Random, high: int) -> int:
    return max(1, min(high, int(math.exp(rng.uniform(0.0, math.log(high + 1))))))


def system_prompts(seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choices(WORDS, k=n)) for n in (20, 40, 60, 80)]


def chat_once(engine: Engine, spec: Spec, box: list) -> tuple[Outcome, str | None]:
    """One streamed chat through the engine (a client thread). Returns its outcome and text."""
    t0 = time.monotonic()
    try:
        handle = engine.chat(list(spec.messages), spec.sampling())
    except EngineError as e:
        return _error(spec, t0, f"submit refused: {e}"), None
    box.append(handle)  # so the watchdog can cancel a request that never ends
    parts: list[str] = []
    asked = False
    for delta in handle:
        parts.append(delta)
        if spec.cancel_after is not None and not asked and len(parts) >= spec.cancel_after:
            handle.cancel()
            asked = True
    record = handle.result(0)  # the stream ends only after the record is set
    if record.status == RequestStatus.FINISHED_CANCELLED:
        if asked:
            return _cancelled(spec, t0), None
        return _error(spec, t0, f"cancelled without asking: {record.error}"), None
    if record.error:
        return _error(spec, t0, record.error), None
    if "".join(parts) != record.text:
        return _error(spec, t0, "streamed deltas differ from the record's text"), None
    if record.output_tokens > spec.max_tokens:
        return _error(spec, t0, f"{record.output_tokens} tokens for max_tokens={spec.max_tokens}"), None
    return _ok(spec, t0, record.output_tokens), record.text  # a cancel that came too late is ok


async def api_once(session, base: str, spec: Spec) -> Outcome:
    """One OpenAI-style request over HTTP; abandons it as `spec` says."""
    t0 = time.monotonic()
    if spec.stream:
        return await _api_stream(session, base, spec, t0)
    deadline = asyncio.timeout(spec.abort_after_s)
    try:
        async with deadline, session.post(base + spec.path, json=spec.body()) as resp:
            status, body = resp.status, await resp.json(content_type=None)
    except TimeoutError:
        if deadline.expired() and spec.abort_after_s is not None:
            return _cancelled(spec, t0)  # the connection was dropped mid-request
        raise
    if status != 200:
        return _error(spec, t0, f"HTTP {status}: {_message(body)}")
    choice = body["choices"][0]
    tokens = body["usage"]["completion_tokens"]
    if choice["finish_reason"] not in ("stop", "length"):
        return _error(spec, t0, f"finish_reason {choice['finish_reason']!r}")
    if tokens > spec.max_tokens:
        return _error(spec, t0, f"{tokens} tokens for max_tokens={spec.max_tokens}")
    return _ok(spec, t0, tokens)


async def _api_stream(session, base: str, spec: Spec, t0: float) -> Outcome:
    async with session.post(base + spec.path, json=spec.body()) as resp:
        if resp.status != 200:
            return _error(spec, t0, f"HTTP {resp.status}: {_message(await resp.json(content_type=None))}")
        deltas, finish, usage, done = 0, None, None, False
        async for raw in resp.content:
            line = raw.strip()
            if not line:
                continue
            if not line.startswith(b"data: "):
                return _error(spec, t0, f"not an SSE data line: {line[:80]!r}")
            if line == b"data: [DONE]":
                done = True
                break
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return _error(spec, t0, f"error event: {_message(chunk)}")
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk["choices"]:
                delta = choice["delta"].get("content") if "delta" in choice else choice.get("text")
                if delta:
                    deltas += 1
                finish = choice.get("finish_reason") or finish
            if spec.cancel_after is not None and deltas >= spec.cancel_after:
                resp.close()  # drop the connection mid-stream: the server must cancel the request
                return _cancelled(spec, t0)
    if not done:
        return _error(spec, t0, "the stream ended without [DONE]")
    if finish not in ("stop", "length"):
        return _error(spec, t0, f"finish_reason {finish!r}")
    if spec.include_usage and usage is None:
        return _error(spec, t0, "no usage chunk although include_usage was asked")
    tokens = usage["completion_tokens"] if usage else deltas
    if usage and tokens > spec.max_tokens:
        return _error(spec, t0, f"{tokens} tokens for max_tokens={spec.max_tokens}")
    return _ok(spec, t0, tokens)


def _message(body) -> str:
    try:
        return str(body["error"]["message"])[:200]
    except (KeyError, TypeError):
        return str(body)[:200]


# ---- counting ----


@dataclass
class Tally:
    """Client-side outcomes (touched only on the event loop)."""

    by_kind: dict[str, Counter] = field(default_factory=lambda: {k: Counter() for k in KINDS})
    errors: Counter = field(default_factory=Counter)  # message → count, at most MAX_ERROR_SAMPLES kept
    in_flight: int = 0

    def add(self, o: Outcome) -> None:
        self.by_kind[o.kind][o.status] += 1
        if o.status == "error":
            key = (o.error or "(no message)")[:300]
            if key in self.errors or len(self.errors) < MAX_ERROR_SAMPLES:
                self.errors[key] += 1

    def total(self, status: str | None = None) -> int:
        return sum(c.total() if status is None else c[status] for c in self.by_kind.values())


class EngineTally:
    """Engine-side counts from the bus (backend threads publish; any thread reads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.routed = 0
        self.finished: Counter = Counter()
        self.output_tokens = 0

    def observe(self, event) -> None:
        with self._lock:
            if isinstance(event, RequestRouted):
                self.routed += 1
            else:
                self.finished[event.record.status.name.lower()] += 1
                self.output_tokens += event.record.output_tokens

    @property
    def unfinished(self) -> int:
        with self._lock:
            return self.routed - self.finished.total()


def _kv_state_bytes(engine: Engine) -> dict[str, int]:
    """llama.cpp's own serialised-state size per backend: it grows with the KV cells llama.cpp
    holds, so it checks the engine's bookkeeping (`kv_cells_used`) against the library."""
    return {name: engine.kv_state_bytes(name) for name in engine.backend_names}


def rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:  # not Linux: the peak is the best there is
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def rss_after_trim() -> int | None:
    """RSS after glibc's `malloc_trim(0)` hands free heap pages back: what remains is memory in
    use, what went was free memory the allocator had kept (None where there is no glibc)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        return None
    return rss_bytes()


def open_fds() -> int:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return -1


def py_blocks() -> int:
    """Memory blocks the Python allocator holds. Not `len(gc.get_objects())`: that list holds
    references to tuples other threads are still building, and their `_PyTuple_Resize` then
    fails with SystemError."""
    return sys.getallocatedblocks()


def os_threads() -> int:
    """Native threads of the process (llama.cpp's included), the main one counted."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return -1


@dataclass(frozen=True)
class Sample:
    t: float
    requests: int
    ok: int
    cancelled: int
    errors: int
    in_flight: int
    output_tokens: int
    rss: int
    kv: dict[str, int]
    fds: int
    threads: int
    os_threads: int
    py_blocks: int

    def line(self, tok_s: float, note: str = "") -> str:
        kv = " ".join(f"{k}={v}" for k, v in self.kv.items())
        return (f"{self.t:7.1f} s  requests {self.requests} (cancelled {self.cancelled}, errors {self.errors})  "
                f"in flight {self.in_flight}  rss {self.rss / 2**20:.1f} MB  kv {kv}  fds {self.fds}  "
                f"threads {self.threads}  {tok_s:.0f} tok/s{note}")

    def row(self) -> list:
        return [round(self.t, 2), self.requests, self.ok, self.cancelled, self.errors, self.in_flight,
                self.output_tokens, round(self.rss / 2**20, 2), *self.kv.values(), self.fds, self.threads,
                self.os_threads, self.py_blocks]


def csv_header(backends: list[str]) -> list[str]:
    return ["t_s", "requests", "ok", "cancelled", "errors", "in_flight", "output_tokens", "rss_mb",
            *(f"kv_{b}" for b in backends), "fds", "threads", "os_threads", "py_blocks"]


def summarize(*, minutes: float, elapsed_s: float, warmup_s: float, tally: Tally, engine_tally: EngineTally,
              samples: list[Sample], warm: Sample, rss_end: int, rss_trimmed: int | None, kv_idle: dict[str, int],
              kv_state_growth: dict[str, int], idle: bool,
              hung: int, threads_left: list[str], fds_start: int, fds_end: int, os_threads_end: int,
              config: dict) -> dict:
    """The final JSON object (pure: everything measured is passed in)."""
    after = [s for s in samples if s.t >= warm.t]
    slope = None
    if len(after) >= 3 and len({s.t for s in after}) > 1:
        slope = statistics.linear_regression([s.t for s in after], [s.rss for s in after]).slope
    return {
        "rss_growth_pct": round(100.0 * (rss_end - warm.rss) / warm.rss, 2),
        "kv_cells_idle": sum(kv_idle.values()),
        "threads_end": len(threads_left),
        "fds_growth": fds_end - fds_start,
        "requests": tally.total(),
        "errors": tally.total("error") + hung,
        "cancelled": tally.total("cancelled"),
        "minutes": minutes,
        "ok": tally.total("ok"),
        "hung": hung,
        "idle_reached": idle,
        "elapsed_s": round(elapsed_s, 1),
        "warmup_s": round(warmup_s, 1),
        "rss_mb_warm": round(warm.rss / 2**20, 1),
        "rss_mb_end": round(rss_end / 2**20, 1),
        "rss_mb_end_trimmed": None if rss_trimmed is None else round(rss_trimmed / 2**20, 1),
        "rss_mb_peak": round(max(s.rss for s in samples) / 2**20, 1),
        "rss_slope_mb_per_h": None if slope is None else round(slope * 3600 / 2**20, 2),
        "kv_cells_idle_by_backend": kv_idle,
        "kv_state_bytes_growth": sum(kv_state_growth.values()),
        "kv_cells_peak": max(sum(s.kv.values()) for s in samples),
        "fds_start": fds_start,
        "fds_end": fds_end,
        "fds_peak": max(s.fds for s in samples),
        "threads_peak": max(s.threads for s in samples),
        "threads_left": threads_left,
        "os_threads_end": os_threads_end,
        "py_blocks_warm": warm.py_blocks,
        "py_blocks_end": samples[-1].py_blocks,
        "output_tokens": engine_tally.output_tokens,
        "tok_s": round(engine_tally.output_tokens / elapsed_s, 1) if elapsed_s else 0.0,
        "engine_finished": dict(engine_tally.finished),
        "engine_unfinished": engine_tally.unfinished,
        "by_kind": {k: {"requests": c.total(), "ok": c["ok"], "cancelled": c["cancelled"], "errors": c["error"]}
                    for k, c in tally.by_kind.items()},
        "error_samples": dict(tally.errors.most_common()),
        **config,
    }


# ---- the run ----


def run_soak(args) -> int:
    if args.minutes <= 0 or args.concurrency < 1 or not 0 <= args.cancel_rate <= 1 or args.interval <= 0:
        print("tandem: --minutes and --interval must be > 0, --concurrency >= 1, --cancel-rate in [0, 1]",
              file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else None
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
    threads_start = {t.ident for t in threading.enumerate()}
    fds_start = open_fds()
    specs = args.backend or list(DEFAULT_BACKENDS)
    engine = Engine.load(args.model, parse_backend_specs(specs), policy=args.policy)
    try:
        with open(out / "soak.csv", "w", newline="") if out else contextlib.nullcontext() as series:
            result = asyncio.run(Soak(engine, args, series).run())
    finally:
        engine.close()
    gc.collect()
    started = [t for t in threading.enumerate() if t.ident not in threads_start]
    deadline = time.monotonic() + THREAD_JOIN_S
    for t in started:
        t.join(max(deadline - time.monotonic(), 0))
    left = [t for t in started if t.is_alive()]
    summary = summarize(**result, threads_left=sorted(t.name for t in left), fds_start=fds_start,
                        fds_end=open_fds(), os_threads_end=os_threads() - 1)
    summary["backends"] = specs
    line = json.dumps(summary, ensure_ascii=False)
    if out is not None:
        (out / "soak.json").write_text(json.dumps(summary, indent=2, ensure_ascii=False) + "\n")
    print(line, flush=True)
    return 0


class Soak:
    """The traffic, the monitor and the wind-down, on one asyncio loop."""

    def __init__(self, engine: Engine, args, series=None):
        self.engine = engine
        self.args = args
        self.duration = args.minutes * 60.0
        self.warmup = warmup_seconds(self.duration)
        self.tally = Tally()
        self.engine_tally = EngineTally()
        self.samples: list[Sample] = []
        self.warm: Sample | None = None
        self.systems = system_prompts(args.seed)
        self.t0 = 0.0
        self.stopping = False
        self._last_tokens = (0.0, 0)
        self._series = series  # an open CSV file for the time series, or None
        self._csv = csv.writer(series) if series is not None else None
        if self._csv is not None:
            self._csv.writerow(csv_header(engine.backend_names))

    async def run(self) -> dict:
        import aiohttp  # only this command needs the HTTP client

        eng, args = self.engine, self.args
        unsubscribe = eng.bus.subscribe(self.engine_tally.observe, (RequestRouted, RequestFinished))
        runner, base = await args.start_api(eng)
        pool = ThreadPoolExecutor(max_workers=args.concurrency, thread_name_prefix="soak-chat")
        session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S),
                                        connector=aiohttp.TCPConnector(limit=args.concurrency))
        try:
            backends = ", ".join(f"{b.name} ({i.device}, threads {i.threads}, cap {b.cap}, ctx {i.n_ctx})"
                                 for b, i in ((b, b.info()) for b in eng.backends.values()))
            model = eng.model.info.name if eng.model is not None else "no local model"
            print(f"soak: {model} on {backends}; {args.minutes:g} min, {args.concurrency} in "
                  f"flight, cancel rate {args.cancel_rate:g}, seed {args.seed}, warm-up {self.warmup:.0f} s; "
                  f"server {base}", flush=True)
            state_start = await asyncio.to_thread(_kv_state_bytes, eng)
            self.t0 = time.monotonic()
            monitor = asyncio.create_task(self._monitor())
            workers = [asyncio.create_task(self._worker(i, session, base, pool)) for i in range(args.concurrency)]
            await asyncio.sleep(self.duration)
            self.stopping = True
            elapsed = time.monotonic() - self.t0
            _, pending = await asyncio.wait(workers, timeout=REQUEST_TIMEOUT_S + 60)
            hung = len(pending)  # a worker whose request (and watchdog) never ended
            for w in pending:
                w.cancel()
            idle = await self._wait_idle()
            await asyncio.to_thread(eng.flush)
            kv_idle = {s.name: s.kv_cells_used for s in eng.snapshot()}
            state_end = await asyncio.to_thread(_kv_state_bytes, eng)
            state_growth = {n: state_end[n] - state_start[n] for n in state_end}
            gc.collect()
            monitor.cancel()
            final = self._sample()
            rss_end = final.rss
            self._report(final, "  (idle, flushed)")
            rss_trimmed = rss_after_trim()  # after every other measurement: it changes RSS
        finally:
            await session.close()
            await runner.cleanup()
            # A chat thread stuck in a request that never ends would block a waiting shutdown;
            # engine.close() ends every request, and run_soak() joins the threads after it.
            pool.shutdown(wait=False, cancel_futures=True)
            unsubscribe()
        config = {"model": args.model, "policy": args.policy, "concurrency": args.concurrency,
                  "cancel_rate": args.cancel_rate, "seed": args.seed}
        return {"minutes": args.minutes, "elapsed_s": elapsed, "warmup_s": self.warmup, "tally": self.tally,
                "engine_tally": self.engine_tally, "samples": self.samples, "warm": self.warm or self.samples[0],
                "rss_end": rss_end, "rss_trimmed": rss_trimmed, "kv_idle": kv_idle,
                "kv_state_growth": state_growth, "idle": idle, "hung": hung, "config": config}

    async def _worker(self, i: int, session, base: str, pool: ThreadPoolExecutor) -> None:
        traffic = Traffic(self.args.seed, i, self.args.cancel_rate, self.systems)
        loop = asyncio.get_running_loop()
        while not self.stopping:
            spec = traffic.next()
            self.tally.in_flight += 1
            t0 = time.monotonic()
            text = None
            try:
                if spec.kind == "chat":
                    box: list = []
                    fut = loop.run_in_executor(pool, chat_once, self.engine, spec, box)
                    try:
                        outcome, text = await asyncio.wait_for(asyncio.shield(fut), REQUEST_TIMEOUT_S)
                    except TimeoutError:
                        outcome = _error(spec, t0, f"no end within {REQUEST_TIMEOUT_S:g} s")
                        for h in box:
                            h.cancel()
                        await asyncio.wait({fut}, timeout=30)
                else:
                    outcome = await api_once(session, base, spec)
            except Exception as e:  # a failure is data: the worker goes on
                outcome = _error(spec, t0, f"{type(e).__name__}: {e}")
            finally:
                self.tally.in_flight -= 1
            self.tally.add(outcome)
            traffic.replied(spec, text)

    async def _wait_idle(self) -> bool:
        deadline = time.monotonic() + IDLE_TIMEOUT_S
        while time.monotonic() < deadline:
            if not any(s.items for s in self.engine.snapshot()) and self.engine_tally.unfinished == 0:
                return True
            await asyncio.sleep(0.05)
        return False

    async def _monitor(self) -> None:
        """A line every `--interval` seconds, and one at the warm-up's end (the RSS reference)."""
        interval = self.args.interval
        next_line = interval
        while True:
            await asyncio.sleep(min(0.5, interval))
            t = time.monotonic() - self.t0
            if self.warm is None and t >= self.warmup:
                self.warm = self._sample()
                self._report(self.warm, "  (warm-up end: the RSS reference)")
            elif t >= next_line:
                self._report(self._sample())
            while next_line <= t:
                next_line += interval

    def _sample(self) -> Sample:
        t = self.tally
        return Sample(
            t=time.monotonic() - self.t0,
            requests=t.total(), ok=t.total("ok"), cancelled=t.total("cancelled"), errors=t.total("error"),
            in_flight=t.in_flight, output_tokens=self.engine_tally.output_tokens, rss=rss_bytes(),
            kv={s.name: s.kv_cells_used for s in self.engine.snapshot()}, fds=open_fds(),
            threads=threading.active_count(), os_threads=os_threads(), py_blocks=py_blocks(),
        )

    def _tok_s(self, s: Sample) -> float:
        t_prev, n_prev = self._last_tokens
        self._last_tokens = (s.t, s.output_tokens)
        return (s.output_tokens - n_prev) / (s.t - t_prev) if s.t > t_prev else 0.0

    def _report(self, s: Sample, note: str = "") -> None:
        print(s.line(self._tok_s(s), note), flush=True)
        self.samples.append(s)
        if self._csv is not None:
            self._csv.writerow(s.row())
            self._series.flush()  # a long run leaves its series behind even if it is killed
