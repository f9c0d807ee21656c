"""`tandem bench chat`: many people chatting at once, against the engine or any OpenAI-compatible
server, each turn sending the whole conversation so far.

The workload (`build_chat`, pure, deterministic per seed and run): conversations start as a
Poisson stream at `--rate`/s; all share one system prompt of `--system-words` words; each of
`--turns` user turns has `--user-words` words and asks for a reply of `--reply-tokens` tokens
(`max_tokens`, with `ignore_eos` so a model of noise still writes that many); between a reply
and the next turn a person thinks for an exponential time of mean `--think` s. Words come from
one fixed list, so a seed gives the same text everywhere.

Each turn is a streamed `POST /v1/chat/completions` carrying the system prompt, every earlier
turn and every earlier reply exactly as the server streamed it, so a server that keeps a
conversation's prefix finds it. TTFT is the first chunk with content; cached prompt tokens are
usage's `prompt_tokens_details.cached_tokens` where the server gives them, else llama-server's
`timings.cache_n`, else -1.

Without `--target` the engine runs in this process (`--model`, `--backend`, `--policy`, as
`tandem serve` takes them) behind the real HTTP server on a loopback port, and the client
shares that process's event loop; its prefix caches are flushed between runs. With `--target`
(repeatable) every target runs the same workload, one after another, run by run.

The output files are `bench grid`'s (`bench.report`: summary.json, requests.csv, decisions.jsonl
from each Tandem target's `/v1/routing`, results.md), one row per target, and `tandem simulate
--replay` predicts the in-process row; a turn that failed ends its conversation, and the turns it never sent are
failed records too, as are turns still unfinished at `--time-limit`. summary.json adds, per row,
TTFT of first and of later turns, and per turn index the prompt and cached tokens and
`cached_share`.
"""

from __future__ import annotations

import asyncio
import os
import random
import sys
import time
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from engine.core.errors import InvalidRequest
from engine.sim.benchmark import RequestRecord, aggregate, percentile, run_metrics, run_order, spread

from . import report as bench_report
from .progress import Progress
from .target import read_usage, routing_decisions, stream_chunks

HELP = "many conversations at once over /v1/chat/completions: TTFT of returning users, cached tokens per turn"
TOOL = "tandem bench chat"
IN_PROCESS = "in-process"
BACKEND_HEADER = "X-Tandem-Backend"

# A fixed vocabulary of common English words: the prompts are text a real tokenizer splits
# like prose, and the same seed gives the same conversations on every machine.
WORDS = tuple("""
the of and to in is was that for on are with as at be this have from or one had by word but not
what all were when we there can an your which their said if do will each about how up out them then
she many some so these would other into has more her two like him see time could no make than first
been its who now people my made over did down only way find use may water long little very after
words called just where most know get through back much before go good new write our used me man
too any day same right look think also around another came come work three must because does part
even place well such here take why help put different away again off went old number great tell
men say small every found still between name should home big give air line set own under read last
never us left end along while might next sound below saw something thought both few those always
show large often together asked house world going want school important until form food keep
children feet land side without boy once animal life enough took four head above kind began almost
live page got earth need far hand high year mother light country father let night picture being
study second soon story since white ever paper hard near sentence better best across during today
however sure knew try told young sun thing whole hear example heard several change answer room sea
against top turned learn point city play toward five himself usually money seen car morning
river garden window summer winter question music color table market letter office doctor
""".split())

PERCENTILES = (50, 95)


@dataclass(frozen=True, slots=True)
class ChatSpec:
    conversations: int = 96
    turns: int = 8
    rate: float = 6.0  # conversations starting per second (Poisson)
    think_s: float = 1.0  # mean of the exponential think time between a reply and the next turn
    system_words: int = 600
    user_words: tuple[int, int] = (40, 120)
    reply_tokens: tuple[int, int] = (32, 192)
    seed: int = 0

    def validate(self) -> ChatSpec:
        if self.conversations < 1 or self.turns < 1:
            raise ValueError("--conversations and --turns must be >= 1")
        if self.rate <= 0 or self.think_s < 0 or self.system_words < 0:
            raise ValueError("--rate must be > 0, --think and --system-words >= 0")
        for name, (lo, hi) in (("--user-words", self.user_words), ("--reply-tokens", self.reply_tokens)):
            if lo < 1 or hi < lo:
                raise ValueError(f"{name} must be LOW-HIGH with 1 <= LOW <= HIGH, got {lo}-{hi}")
        return self

    def name(self) -> str:
        return (f"chat {self.conversations}x{self.turns}, {self.rate:g}/s, think {self.think_s:g} s, "
                f"system {self.system_words} words, user {_span(self.user_words)} words, "
                f"replies {_span(self.reply_tokens)} tokens")

    @property
    def requests(self) -> int:
        return self.conversations * self.turns

    def to_dict(self) -> dict:
        return {"kind": "chat", "name": self.name(), **asdict(self)}


@dataclass(frozen=True, slots=True)
class Turn:
    user: str
    reply_tokens: int
    think_s: float  # before this turn is sent (0 for the first)


@dataclass(frozen=True, slots=True)
class Conversation:
    index: int
    start_s: float
    turns: tuple[Turn, ...]


@dataclass(frozen=True, slots=True)
class ChatWorkload:
    spec: ChatSpec
    run: int
    system: str
    conversations: tuple[Conversation, ...]


def _span(lo_hi: tuple[int, int]) -> str:
    lo, hi = lo_hi
    return f"{lo}" if lo == hi else f"{lo}-{hi}"


def parse_range(text: str, flag: str) -> tuple[int, int]:
    """`N` or `LOW-HIGH` → (low, high)."""
    lo, _, hi = str(text).partition("-")
    try:
        out = (int(lo), int(hi or lo))
    except ValueError:
        raise InvalidRequest(f"{flag} must be N or LOW-HIGH, got {text!r}") from None
    if out[0] < 1 or out[1] < out[0]:
        raise InvalidRequest(f"{flag} must be N or LOW-HIGH with 1 <= LOW <= HIGH, got {text!r}")
    return out


def _words(rng: random.Random, n: int) -> str:
    """`n` words from WORDS as sentences of 6-14 words."""
    out, left = [], n
    while left > 0:
        k = min(left, rng.randint(6, 14))
        words = rng.choices(WORDS, k=k)
        out.append(" ".join([words[0].capitalize(), *words[1:]]) + ".")
        left -= k
    return " ".join(out)


def build_chat(spec: ChatSpec, run: int) -> ChatWorkload:
    """The conversations of one run: the same for the same (seed, run), different across runs
    (so no run finds an earlier run's text in a server's cache)."""
    rng = random.Random(f"chat-{spec.seed}-{run}")
    system = _words(rng, spec.system_words)
    convs, t = [], 0.0
    for i in range(spec.conversations):
        if i:
            t += rng.expovariate(spec.rate)
        turns = []
        for k in range(spec.turns):
            think = rng.expovariate(1.0 / spec.think_s) if k and spec.think_s > 0 else 0.0
            turns.append(Turn(_words(rng, rng.randint(*spec.user_words)), rng.randint(*spec.reply_tokens), think))
        convs.append(Conversation(i, t, tuple(turns)))
    return ChatWorkload(spec, run, system, tuple(convs))


# ---- the client ----


@dataclass(frozen=True, slots=True)
class ChatTarget:
    url: str  # base URL, no trailing slash
    label: str  # the row's "policy" column
    model: str | None = None  # sent as `model`
    ignore_eos: bool = True

    def to_dict(self) -> dict:
        return {"url": self.url, "label": self.label, "api": "chat", "model": self.model,
                "ignore_eos": self.ignore_eos}


async def send_turn(session, target: ChatTarget, messages: list[dict], max_tokens: int, *,
                    temperature: float = 0.0, top_p: float | None = None) -> dict:
    """One streamed chat completion; returns the reply text, timings and usage, with `error`
    set instead of raising."""
    import aiohttp

    body = {"messages": messages, "max_tokens": max_tokens, "temperature": temperature, "stream": True,
            "stream_options": {"include_usage": True}}
    if top_p is not None:
        body["top_p"] = top_p
    if target.ignore_eos:
        body["ignore_eos"] = True
    if target.model:
        body["model"] = target.model
    out: dict[str, Any] = {"text": "", "ttft": None, "e2e": None, "itl": [], "chunks": 0, "completion_tokens": None,
           "prompt_tokens": None, "cached": -1, "finish_reason": None, "error": None, "backend": None}
    t0 = time.perf_counter()
    last = t0
    parts: list[str] = []
    llama_timings = None
    try:
        async with session.post(target.url + "/v1/chat/completions", json=body) as r:
            out["backend"] = r.headers.get(BACKEND_HEADER) or None
            if r.status != 200:
                out["error"] = f"HTTP {r.status}: {(await r.text())[:500]}"
                return out
            async for chunk in stream_chunks(r, out):
                now = time.perf_counter()
                for c in chunk.get("choices") or []:
                    text = (c.get("delta") or {}).get("content")
                    if text:
                        parts.append(text)
                        out["chunks"] += 1
                        if out["ttft"] is None:
                            out["ttft"] = now - t0
                        else:
                            out["itl"].append(now - last)
                        last = now
                    if c.get("finish_reason"):
                        out["finish_reason"] = c["finish_reason"]
                read_usage(chunk.get("usage"), out)
                timings = chunk.get("timings")  # llama-server: cache_n prompt tokens reused, prompt_n computed
                if isinstance(timings, dict) and timings.get("cache_n") is not None:
                    llama_timings = timings
        if out["cached"] < 0 and llama_timings is not None:
            out["cached"] = int(llama_timings["cache_n"])
            if out["prompt_tokens"] is None and llama_timings.get("prompt_n") is not None:
                out["prompt_tokens"] = int(llama_timings["prompt_n"]) + out["cached"]
    except (TimeoutError, aiohttp.ClientError, ValueError, TypeError) as e:
        out["error"] = f"{type(e).__name__}: {e}"
    finally:
        out["e2e"] = time.perf_counter() - t0
        out["text"] = "".join(parts)
    return out


def _record(target: ChatTarget, wl: ChatWorkload, conv: int, turn: int, t_submit: float,
            result: dict | None, error: str | None = None) -> RequestRecord:
    spec = wl.spec
    result = result or {}
    tokens = result.get("completion_tokens")
    tokens = int(tokens if tokens is not None else result.get("chunks", 0))
    error = error or result.get("error")
    ok = error is None and tokens > 0
    itl = result.get("itl") or []
    return RequestRecord(
        workload=spec.name(), policy=target.label, run=wl.run, requests=spec.requests,
        index=conv * spec.turns + turn, request_id=f"{target.label}-{wl.run}-c{conv}-t{turn + 1}",
        backend=result.get("backend") or target.label, success=ok,
        finish_reason=result.get("finish_reason") if ok else "error",
        prompt_tokens=int(result.get("prompt_tokens") or 0), cached_tokens=int(result.get("cached", -1)),
        output_tokens=tokens, t_submit_s=t_submit, queue_s=None,
        ttft_s=result.get("ttft"), e2e_s=result.get("e2e"), itl_s=sum(itl) / len(itl) if itl else None,
        error=None if ok else (error or "the stream ended without content"))


def turn_of(record: RequestRecord, turns: int) -> int:
    """A record's turn, 1-based."""
    return record.index % turns + 1


async def run_workload(target: ChatTarget, wl: ChatWorkload, *, timeout: float = 600.0,
                       time_limit: float | None = None, temperature: float = 0.0, top_p: float | None = None,
                       on_done=None) -> list[RequestRecord]:
    """Every conversation of `wl` against `target`, on its schedule; one record per turn (those
    never sent, or cut by `time_limit` seconds, as failures)."""
    import aiohttp

    spec = wl.spec
    got: dict[tuple[int, int], RequestRecord] = {}
    sent: dict[tuple[int, int], float] = {}
    loop = asyncio.get_running_loop()
    conn = aiohttp.TCPConnector(limit=0)
    client_timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=timeout)
    async with aiohttp.ClientSession(connector=conn, timeout=client_timeout) as session:
        t0 = loop.time()

        def done(record: RequestRecord, key) -> None:
            got[key] = record
            if on_done is not None:
                on_done(record)

        async def converse(conv: Conversation) -> None:
            messages = [{"role": "system", "content": wl.system}] if wl.system else []
            await asyncio.sleep(max(0.0, t0 + conv.start_s - loop.time()))
            for k, turn in enumerate(conv.turns):
                if turn.think_s:
                    await asyncio.sleep(turn.think_s)
                messages.append({"role": "user", "content": turn.user})
                t_submit = sent[(conv.index, k)] = loop.time() - t0
                result = await send_turn(session, target, messages, turn.reply_tokens, temperature=temperature,
                                         top_p=top_p)
                record = _record(target, wl, conv.index, k, t_submit, result)
                done(record, (conv.index, k))
                if not record.success:
                    for j in range(k + 1, spec.turns):
                        done(_record(target, wl, conv.index, j, loop.time() - t0, None,
                                     f"not sent: turn {k + 1} of this conversation failed"), (conv.index, j))
                    return
                messages.append({"role": "assistant", "content": result["text"]})

        tasks = [asyncio.ensure_future(converse(c)) for c in wl.conversations]
        _, pending = await asyncio.wait(tasks, timeout=time_limit)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for task in tasks:  # a bug in the client is not a measurement: say so
            if not task.cancelled() and (error := task.exception()) is not None:
                raise error
    for c in wl.conversations:  # cut by the time limit: submitted when sent, or at the limit
        for k in range(spec.turns):
            if (c.index, k) not in got:
                if time_limit is None:
                    raise RuntimeError(f"conversation {c.index}, turn {k + 1}: neither answered nor failed")
                why = (f"not finished within the time limit of {time_limit:g} s" if (c.index, k) in sent
                       else f"not sent within the time limit of {time_limit:g} s")
                done(_record(target, wl, c.index, k, sent.get((c.index, k), time_limit), None, why), (c.index, k))
    return [got[(c.index, k)] for c in wl.conversations for k in range(spec.turns)]


# ---- metrics (pure) ----


def turn_table(records: list[RequestRecord], turns: int) -> list[dict]:
    """Per turn index (1-based), over the successful records: how many, prompt and cached tokens,
    `cached_share` (cached over prompt tokens; None where the server reported no cached
    tokens), TTFT p50/p95."""
    out = []
    for k in range(1, turns + 1):
        ok = [r for r in records if r.success and turn_of(r, turns) == k]
        reported = [r for r in ok if r.cached_tokens >= 0]
        prompt = sum(r.prompt_tokens for r in reported)
        cached = sum(r.cached_tokens for r in reported)
        ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
        out.append({"turn": k, "completed": len(ok),
                    "failed": sum(1 for r in records if not r.success and turn_of(r, turns) == k),
                    "prompt_tokens": sum(r.prompt_tokens for r in ok),
                    "cached_tokens": cached if reported else None,
                    "cached_share": (cached / prompt) if reported and prompt else None,
                    "ttft_p50_s": percentile(ttft, 50), "ttft_p95_s": percentile(ttft, 95)})
    return out


def ttft_split(records: list[RequestRecord], turns: int) -> dict:
    """TTFT p50/p95 of first turns and of later turns (successful records)."""
    first = [r.ttft_s for r in records if r.success and r.ttft_s is not None and turn_of(r, turns) == 1]
    later = [r.ttft_s for r in records if r.success and r.ttft_s is not None and turn_of(r, turns) > 1]
    return {f"{which}_ttft_p{q}_s": percentile(xs, q) for which, xs in (("first", first), ("later", later))
            for q in PERCENTILES}


def summarize(records: list[RequestRecord], spec: ChatSpec) -> list[dict]:
    """One row per label, in first-seen order: `bench grid`'s metrics (mean ± spread over runs),
    first/later-turn TTFT (same), the turn table (runs pooled), errors."""
    groups: dict[str, dict[int, list[RequestRecord]]] = {}
    for r in records:
        groups.setdefault(r.policy, {}).setdefault(r.run, []).append(r)
    rows = []
    for label, runs in groups.items():
        per_run = [recs for _, recs in sorted(runs.items())]
        pooled = [r for recs in per_run for r in recs]
        split = [ttft_split(recs, spec.turns) for recs in per_run]
        errors: dict[str, int] = {}
        for r in pooled:
            if not r.success:
                errors[r.error or "?"] = errors.get(r.error or "?", 0) + 1
        rows.append({"workload": spec.name(), "policy": label, "requests": spec.requests,
                     "target": label != IN_PROCESS,
                     **aggregate([run_metrics(recs) for recs in per_run]),
                     **{k: spread([s[k] for s in split]) for k in split[0]},
                     "turns": turn_table(pooled, spec.turns),
                     "errors": dict(sorted(errors.items(), key=lambda kv: -kv[1])[:10])})
    return rows


# ---- the command ----


def add_arguments(p) -> None:
    p.add_argument("--model", default="default", help="default | PATH.gguf | synthetic:SHAPE[:QUANT] (in-process)")
    p.add_argument("--backend", action="append", default=None, metavar="SPEC",
                   help="the in-process engine's backends, as `tandem serve` takes them (repeatable)")
    p.add_argument("--policy", default="default", help="the in-process engine's routing policy (default: %(default)s, the engine's default policy)")
    p.add_argument("--no-calibrate", action="store_true", help="the in-process engine: no calibration at start")
    p.add_argument("--conversations", type=int, default=96, help="(default: %(default)s)")
    p.add_argument("--turns", type=int, default=8, help="user turns per conversation (default: %(default)s)")
    p.add_argument("--rate", type=float, default=6.0, help="conversations starting per second, Poisson (default: %(default)s)")
    p.add_argument("--think", type=float, default=1.0,
                   help="mean think time between a reply and the next turn, exponential, s (default: %(default)s)")
    p.add_argument("--system-words", type=int, default=600, help="the shared system prompt (default: %(default)s)")
    p.add_argument("--user-words", default="40-120", help="words per user turn, N or LOW-HIGH (default: %(default)s)")
    p.add_argument("--reply-tokens", default="32-192", help="max_tokens per reply, N or LOW-HIGH (default: %(default)s)")
    p.add_argument("--no-ignore-eos", action="store_true",
                   help="do not send ignore_eos (a server that refuses it); replies may then be shorter")
    p.add_argument("--temperature", type=float, default=0.0, help="(default: %(default)s)")
    p.add_argument("--top-p", type=float, default=None, help="sent as top_p (default: not sent, the server's)")
    p.add_argument("--target", action="append", default=[], metavar="[LABEL=]URL",
                   help="an OpenAI-compatible server to run against (repeatable; none: the engine in-process)")
    p.add_argument("--target-model", default=None, help="the model name sent (default: the first of /v1/models)")
    p.add_argument("--runs", type=int, default=1, help="runs per target, interleaved (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="workload seed (default: %(default)s)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds a stream may stay silent (default: %(default)s)")
    p.add_argument("--time-limit", type=float, default=0.0,
                   help="seconds one run may take; turns unfinished then are failures (default: none)")
    p.add_argument("--out", default=None, help="output directory (default: out/bench-chat-TIME)")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")


def spec_from_args(args) -> ChatSpec:
    try:
        return ChatSpec(conversations=args.conversations, turns=args.turns, rate=args.rate, think_s=args.think,
                        system_words=args.system_words, user_words=parse_range(args.user_words, "--user-words"),
                        reply_tokens=parse_range(args.reply_tokens, "--reply-tokens"), seed=args.seed).validate()
    except ValueError as e:
        raise InvalidRequest(str(e)) from None


def run_chat(args) -> int:
    spec = spec_from_args(args)
    if args.runs < 1 or args.time_limit < 0:
        raise InvalidRequest("--runs must be >= 1 and --time-limit >= 0")
    out_dir = Path(args.out or f"out/bench-chat-{datetime.now():%Y%m%d-%H%M%S}")
    bench = ChatBench(args, spec)
    interrupted = False
    with Progress(0, "bench chat") as bar:
        try:
            asyncio.run(bench.run(bar))
        except KeyboardInterrupt:
            interrupted = True
            bench.notes.append("INTERRUPTED: the results below are partial")
    if not bench.records:
        return 130 if interrupted else 1
    summary = bench.summary()
    written = bench_report.write_all(out_dir, summary, bench.records, bench.decisions, plots=not args.no_plots)
    print(bench_report.chat_markdown(summary))
    print(f"wrote {', '.join(str(p) for p in written)}", file=sys.stderr)
    if interrupted:
        return 130
    return 0 if all(r.success for r in bench.records) else 1


class ChatBench:
    """One invocation: run x target, the in-process engine when no target is given."""

    def __init__(self, args, spec: ChatSpec):
        self.args = args
        self.spec = spec
        self.records: list[RequestRecord] = []
        self.decisions: list[dict] = []  # from each Tandem target's /v1/routing after a run
        self.targets: list[ChatTarget] = []
        self.notes: list[str] = []
        self.model_info: dict = {"spec": args.model}
        self.engine_info: list[dict] = []
        self.loads: list[dict] = []

    async def run(self, bar: Progress) -> None:
        args = self.args
        eng = runner = None
        try:
            if args.target:
                self.targets = [await _probe(t, args) for t in args.target]
            else:
                eng, runner, target = await self._start_engine()
                self.targets = [target]
            bar.add_total(len(self.targets) * args.runs * self.spec.requests)
            for run in range(args.runs):
                wl = build_chat(self.spec, run)
                for target in run_order(self.targets, run):
                    if eng is not None:
                        await asyncio.to_thread(eng.flush, None, 120)
                    state = {"n": 0, "later": []}

                    def on_done(r: RequestRecord, state=state, target=target, run=run) -> None:
                        state["n"] += 1
                        if r.success and turn_of(r, self.spec.turns) > 1 and r.ttft_s is not None:
                            state["later"].append(r.ttft_s)
                        later = percentile(state["later"], 50)
                        bar.update(1, f"{target.label} run {run + 1}/{args.runs}"
                                      + (f", later-turn TTFT p50 {later:.2f} s" if state["later"] else ""))

                    got = await run_workload(target, wl, timeout=args.timeout, time_limit=args.time_limit or None,
                                             temperature=args.temperature, top_p=args.top_p, on_done=on_done)
                    self.records.extend(got)
                    # Tandem's router says where each turn went and why (its last 1,000 decisions); other servers nothing
                    decided = await asyncio.to_thread(routing_decisions, target.url, len(got))
                    self.decisions += [{"workload": self.spec.name(), "target": target.label, "run": run, **d}
                                       for d in decided]
                    if hasattr(os, "getloadavg"):
                        self.loads.append({"workload": self.spec.name(), "policy": target.label,
                                           "requests": self.spec.requests, "run": run,
                                           "load1": round(os.getloadavg()[0], 2)})
        finally:
            if runner is not None:
                await runner.cleanup()
            if eng is not None:
                eng.close()

    async def _start_engine(self):
        args = self.args
        eng = await asyncio.to_thread(args.load_engine, args)
        try:
            runner, base = await args.start_api(eng)
        except BaseException:
            eng.close()
            raise
        self.model_info = bench_report.model_info(args.model, eng)
        self.engine_info = [{"kv_seqs": None, "backends": bench_report.engine_info(eng, None)}]
        self.notes.append(f"in-process: the engine ({args.policy}) behind Tandem's HTTP server on {base}, the "
                          "client on the same event loop; prefix caches flushed before each run")
        return eng, runner, ChatTarget(base, IN_PROCESS, None, not args.no_ignore_eos)

    def summary(self) -> dict:
        return {
            "tool": TOOL,
            "argv": list(sys.argv),
            "created": datetime.now().astimezone().isoformat(timespec="seconds"),
            "model": self.model_info,
            "backends": self.engine_info[0]["backends"] if self.engine_info else [],
            "engines": self.engine_info,
            "targets": [t.to_dict() for t in self.targets],
            "workloads": [self.spec.to_dict()],
            "requests": [self.spec.requests],
            "runs": self.args.runs,
            "policies": [t.label for t in self.targets],
            # the in-process engine's routing policy (`simulate --replay` routes with it)
            "engine_policy": self.args.policy if any(t.label == IN_PROCESS for t in self.targets) else None,
            "engine_state": "",
            "notes": self.notes,
            "results": summarize(self.records, self.spec),
            "oracle": [],
            "host": {"cpus": os.cpu_count(), "load_avg": self.loads},
        }


async def _probe(text: str, args) -> ChatTarget:
    """A `--target`, with the model name it serves (its /v1/models, or `--target-model`)."""
    from .target import parse_target, probe

    try:
        label, url = parse_target(text)
    except ValueError as e:
        raise InvalidRequest(str(e)) from None
    try:
        t = await probe(url, "auto", label)
    except (ConnectionError, OSError) as e:
        raise InvalidRequest(f"--target {url}: {e}") from None
    return ChatTarget(url, label or t.label.removeprefix("target:"), args.target_model or t.model,
                      not args.no_ignore_eos)

