"""`tandem bench attack`: each attack of the hardening rounds beside normal traffic, against a
real `tandem serve`, in one invocation.

It starts `tandem serve --model M` (a subprocess on a free 127.0.0.1 port; attack traffic goes
to 127.0.0.1 only, bounded in count and time), then runs phases of `--phase-s` seconds each.
In every phase `--concurrency` normal clients send 8-token chats one after another (a new
connection each, as curl would, from `--normal-source`: 127.0.0.2, another address than the
attack's), and from the second phase on one attack runs beside them:

- `keepalive`: `--connections` kept-alive connections that each send `GET /health` every 10 s
  (reconnecting when the server lets go of them);
- `stalled`: `--connections` connections that send a whole `POST` head and never the body
  (reopened when the server lets go);
- `grammar`: chats with a 20,000-alternative grammar (~200 KB), one after another;
- `schema`: chats whose `json_schema` is a 20,000-value enum, one after another;
- `users`: not an attack but its control: two more users, each sending 16-token chats at
  temperature 1 one after another (what any two clients beside the normal ones cost);
- `schema-max`: what is still accepted: chats whose schema is an enum at `MAX_ENUM` values,
  sampled at temperature 1 (every token a full grammar pass over the vocabulary), two at once;
  its row also gives p95 over the `users` phase's, when that ran: what the grammar adds;
- `messages`: chats of 50,000 one-character messages, one after another;
- `bodies`: six near-2 MiB chats at once, again and again;
- `pattern`: chats whose schema has the nested-repetition pattern
  `^(([a-z]{0,999}){0,999}){0,999}$`, six at once (it wedged llama.cpp's grammar check);
- `unread`: two addresses' connections (up to 500 each) with 2 KB receive buffers that
  pipeline 120 `GET /metrics` and never read;
- `heads`: two addresses' connections (up to 480 each) that send 126 header lines of 8,000
  bytes and never end the head (reopened when the server lets go);
- `tools`: chats with 128 tools of 300 properties (1.4 MB), one after another (refused, and
  what their refusals cost their address);
- `stream`: 40 connections asking a streamed chat with n=16 and top_logprobs=20 that never
  read it;
- `metadata`: Responses with 90,000 metadata keys (1.9 MB, under the body limit), one after another.

Beside the normal clients from `--normal-source`, one client sends the same chats from the
attack's own address, 127.0.0.1 (one connection each, honouring `Retry-After`): what a user
behind the attacker's address (a NAT, a proxy) gets. Each phase prints normal traffic's p50
and p95 latency, its errors, p95 over the quiet baseline's, the own-address client's replies
(200s, 429s with `Retry-After`, anything else) and its longest wait, what the attack's
requests got, the server's RSS at the phase's end and its peak growth over the phase's start,
the cores the server and this process (normal clients and attack) used during the phase, and
the machine's load average (the machine may be shared: the phases' ratios are side by side,
their figures are not); the last line is one JSON object (`--out DIR` also writes it, with the
command, date and commit, to `attack.json`). The bar: under each attack, p95 <= 2x quiet and 0
errors for the other address; only 200s and 429s with `Retry-After`, none slower than 5 s, for
the attacker's own; peak RSS growth <= 300 MB.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import os
import resource
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from . import report as bench_report

HELP = ("each attack (idle, stalled and unread connections, huge heads, grammar, schema and pattern bombs, 50,000 "
        "messages, near-2 MiB bodies, huge tool lists and metadata, unread streams) beside normal traffic from another "
        "address and from the attacker's own against a real tandem serve: p50/p95, errors, 429s and RSS vs quiet")
ATTACKS = ("keepalive", "stalled", "grammar", "schema", "users", "schema-max", "messages", "bodies", "pattern",
           "unread", "heads", "tools", "stream", "metadata")
ATTACKER = "127.0.0.1"  # the attack's own address (its own normal client's too)
OTHER_ATTACKER = "127.0.0.3"  # the second address of the two-address attacks
OWN_MAX_S = 5.0  # the longest the attacker's own address may wait for any answer
RSS_GROWTH_MB = 300.0  # the most a phase may grow the server's peak RSS over its start
NORMAL = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8, "temperature": 0}
UP_S = 180  # the server loads the model and answers /health within this
REQUEST_S = 60  # the most one normal request may take
ATTACK_REQUESTS = 2000  # per phase, at most, for the request-level attacks
PROBE_EVERY_S = 10.0
NEAR_2MIB = 1_900_000


def add_arguments(p) -> None:
    p.add_argument("--model", default="default", help="the model `tandem serve` loads (default: %(default)s)")
    p.add_argument("--backend", action="append", default=None, metavar="SPEC",
                   help="backend specs for the server (default: its own)")
    p.add_argument("--phase-s", type=float, default=20.0, help="seconds per phase (default: %(default)s)")
    p.add_argument("--attacks", default=",".join(ATTACKS), help="which, in order (default: all)")
    p.add_argument("--connections", type=int, default=1100,
                   help="connections of the keepalive and stalled attacks (default: %(default)s)")
    p.add_argument("--concurrency", type=int, default=2, help="normal clients (default: %(default)s)")
    p.add_argument("--normal-source", default="127.0.0.2", metavar="ADDR",
                   help="the address normal clients connect from, apart from the attack's 127.0.0.1 as a user "
                        "elsewhere on the LAN would be; 127.0.0.1 puts them beside the attacker, where no "
                        "per-address limit can tell them apart (default: %(default)s)")
    p.add_argument("--out", default=None, metavar="DIR", help="write attack.json there")
    p.add_argument("--serve-from", default=None, metavar="DIR",
                   help="run the server from this source tree (another commit's checkout) with this Python: "
                        "the same attacks against code before a change (default: this tree)")


@dataclass
class Phase:
    name: str
    latencies: list[float] = field(default_factory=list)
    sent_at: list[float] = field(default_factory=list)  # each latency's request start, s into the phase
    started: float = field(default_factory=time.perf_counter)
    errors: list[str] = field(default_factory=list)
    attack: collections.Counter = field(default_factory=collections.Counter)
    rss_mb: float = 0.0
    seconds: float = 0.0
    server_cpu_s: float = 0.0  # the server process's CPU (user + system) during the phase
    client_cpu_s: float = 0.0  # this process's: the normal clients and the attack
    load: float = 0.0  # the machine's 1-minute load average at the phase's end
    own: collections.Counter = field(default_factory=collections.Counter)  # the attacker's own address's replies
    own_max_s: float = 0.0  # its longest wait for any answer
    rss_peak_mb: float = 0.0  # the server's peak RSS during the phase (sampled)
    rss_start_mb: float = 0.0  # and at its start

    def summary(self, quiet_p95: float | None) -> dict:
        lat = sorted(self.latencies)
        p50 = statistics.median(lat) if lat else float("nan")
        p95 = lat[min(int(0.95 * len(lat)), len(lat) - 1)] if lat else float("nan")
        out: dict[str, Any] = {"phase": self.name, "normal_requests": len(lat) + len(self.errors), "errors": len(self.errors),
               "p50_ms": round(p50 * 1000, 1), "p95_ms": round(p95 * 1000, 1),
               "p95_vs_quiet": round(p95 / quiet_p95, 2) if quiet_p95 else 1.0,
               "attack": dict(self.attack), "server_rss_mb": round(self.rss_mb, 1),
               "server_cores": round(self.server_cpu_s / self.seconds, 2) if self.seconds else 0.0,
               "client_cores": round(self.client_cpu_s / self.seconds, 2) if self.seconds else 0.0,
               "load_average": round(self.load, 1),
               "error_samples": self.errors[:3], "p95_ms_by_quarter": self._by_quarter(),
               "own": dict(self.own), "own_max_s": round(self.own_max_s, 2),
               "rss_peak_mb": round(self.rss_peak_mb, 1),
               "rss_growth_mb": round(self.rss_peak_mb - self.rss_start_mb, 1)}
        own_ok = set(self.own) <= {"200", "429"} and self.own_max_s <= OWN_MAX_S
        out["pass"] = (out["errors"] == 0 and out["p95_vs_quiet"] <= 2.0 and own_ok
                       and out["rss_growth_mb"] <= RSS_GROWTH_MB)
        return out

    def _by_quarter(self) -> list[float | None]:
        """p95 of the requests sent in each quarter of the phase: when in an attack it hurt."""
        end = max(self.sent_at, default=0.0) + 1e-9
        quarters: list[list[float]] = [[], [], [], []]
        for t, lat in zip(self.sent_at, self.latencies, strict=True):
            quarters[min(int(4 * t / end), 3)].append(lat)
        return [round(sorted(q)[min(int(0.95 * len(q)), len(q) - 1)] * 1000, 1) if q else None
                for q in quarters]


def run_attack(args) -> int:
    attacks = [a.strip() for a in args.attacks.split(",") if a.strip()]
    unknown = [a for a in attacks if a not in ATTACKS]
    if unknown:
        print(f"tandem: unknown attack {', '.join(unknown)} (known: {', '.join(ATTACKS)})", file=sys.stderr)
        return 2
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 2 * args.connections + 512
    if soft != resource.RLIM_INFINITY and soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want if hard == resource.RLIM_INFINITY else min(want, hard), hard))
    with _server(args) as (proc, base):
        rows = asyncio.run(_phases(args, attacks, proc, base))
    bench_report.write_result(args.out, "attack.json", {"model": args.model, "phase_s": args.phase_s,
                                                        "serve_from": args.serve_from,
                                                        "normal_source": args.normal_source, "phases": rows,
                                                        "pass": all(r["pass"] for r in rows if r["pass"] is not None)})
    return 0


@contextlib.contextmanager
def _server(args):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "app", "serve", "--model", args.model, "--port", str(port), "--no-calibrate"]
    for spec in args.backend or ():
        cmd += ["--backend", spec]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            cwd=args.serve_from or None)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + UP_S
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"tandem serve exited {proc.returncode}: {proc.stderr.read()[-2000:] if proc.stderr else ''}")
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1) as c:
                    c.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
                    if c.recv(64).startswith(b"HTTP/1.1 200"):
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"tandem serve did not answer /health within {UP_S} s")
            time.sleep(0.5)
        yield proc, base
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)


async def _phases(args, attacks: list[str], proc, base: str) -> list[dict]:
    rows = []
    connector = _normal_connector(args)
    async with aiohttp.ClientSession(connector=connector) as session:  # warm-up: not measured
        warm = Phase("warm-up")
        await _normal(session, base, asyncio.get_running_loop().time() + 3, warm)
    quiet = await _phase(args, "quiet", proc, base)
    rows.append(quiet.summary(None))
    _print(rows[-1], header=True)
    quiet_p95 = rows[0]["p95_ms"] / 1000 or None
    for name in attacks:
        await asyncio.sleep(2)  # the previous attack's connections close
        phase = await _phase(args, name, proc, base)
        rows.append(phase.summary(quiet_p95))
        if name == "users":  # a control, not an attack: no bar
            rows[-1]["pass"] = None
        elif name == "schema-max":
            users = next((r for r in rows if r["phase"] == "users"), None)
            if users is not None and users["p95_ms"]:
                rows[-1]["p95_vs_users"] = round(rows[-1]["p95_ms"] / users["p95_ms"], 2)
        _print(rows[-1])
    return rows


async def _phase(args, name: str, proc, base: str) -> Phase:
    phase = Phase(name)
    loop = asyncio.get_running_loop()
    stop_at = loop.time() + args.phase_s
    t0, server0, client0 = time.perf_counter(), _cpu_s(proc.pid), _own_cpu_s()
    phase.rss_start_mb = phase.rss_peak_mb = _rss_mb(proc.pid)
    attack = None
    if name != "quiet":
        attack = asyncio.create_task(ATTACK_FNS[name](args, base, stop_at, phase.attack))
        await asyncio.sleep(min(3.0, args.phase_s / 4))  # let it build up before measuring
    sampler = asyncio.create_task(_sample_rss(proc.pid, phase))
    connector = _normal_connector(args)
    async with aiohttp.ClientSession(connector=connector) as session, \
            aiohttp.ClientSession(connector=_own_connector()) as own:
        await asyncio.gather(_own(own, base, stop_at, phase),
                             *(_normal(session, base, stop_at, phase) for _ in range(args.concurrency)))
    for task in (attack, sampler):
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    phase.rss_mb = _rss_mb(proc.pid)
    phase.rss_peak_mb = max(phase.rss_peak_mb, phase.rss_mb)
    phase.seconds = time.perf_counter() - t0
    phase.server_cpu_s, phase.client_cpu_s = _cpu_s(proc.pid) - server0, _own_cpu_s() - client0
    phase.load = os.getloadavg()[0]
    return phase


async def _sample_rss(pid: int, phase: Phase) -> None:
    while True:
        phase.rss_peak_mb = max(phase.rss_peak_mb, _rss_mb(pid))
        await asyncio.sleep(0.25)


def _own_connector() -> aiohttp.TCPConnector:
    return aiohttp.TCPConnector(force_close=True, limit=0, local_addr=(ATTACKER, 0))


async def _own(session: aiohttp.ClientSession, base: str, stop_at: float, phase: Phase) -> None:
    """A normal client at the attacker's address: a 200, or a 429 whose `Retry-After` it honours."""
    loop = asyncio.get_running_loop()
    while loop.time() < stop_at:
        t0 = time.perf_counter()
        wait = 0.0
        try:
            async with session.post(base + "/v1/chat/completions", json=NORMAL,
                                    timeout=aiohttp.ClientTimeout(total=REQUEST_S)) as r:
                await r.read()
                retry = r.headers.get("Retry-After")
                key = str(r.status) if r.status != 429 or retry else "429 without Retry-After"
                phase.own[key] += 1
                if r.status == 429 and retry:
                    wait = min(float(retry), max(stop_at - loop.time(), 0.0))
        except (aiohttp.ClientError, TimeoutError, OSError) as e:
            phase.own[type(e).__name__] += 1
        phase.own_max_s = max(phase.own_max_s, time.perf_counter() - t0)
        await asyncio.sleep(wait)


def _normal_connector(args) -> aiohttp.TCPConnector:
    """Normal clients: a new connection per request (as curl), from `--normal-source`."""
    return aiohttp.TCPConnector(force_close=True, limit=0, local_addr=(args.normal_source, 0))


async def _normal(session: aiohttp.ClientSession, base: str, stop_at: float, phase: Phase) -> None:
    loop = asyncio.get_running_loop()
    while loop.time() < stop_at:
        t0 = time.perf_counter()
        try:
            async with session.post(base + "/v1/chat/completions", json=NORMAL,
                                    timeout=aiohttp.ClientTimeout(total=REQUEST_S)) as r:
                body = await r.read()
                if r.status != 200:
                    phase.errors.append(f"{r.status}: {body[:200].decode('utf-8', 'replace')}")
                    continue
        except (aiohttp.ClientError, TimeoutError, OSError) as e:
            phase.errors.append(f"{type(e).__name__}: {e}")
            continue
        phase.latencies.append(time.perf_counter() - t0)
        phase.sent_at.append(t0 - phase.started)


# ---- attacks (127.0.0.1 only, bounded in count and time) ----


def _addr(base: str) -> tuple[str, int]:
    host, port = base.removeprefix("http://").rsplit(":", 1)
    assert host == "127.0.0.1", "attack traffic goes to 127.0.0.1 only"
    return host, int(port)


async def _keepalive(args, base: str, stop_at: float, tally: collections.Counter) -> None:
    host, port = _addr(base)
    loop = asyncio.get_running_loop()

    async def one(i: int) -> None:
        await asyncio.sleep(i * 0.002)
        writer = None
        while loop.time() < stop_at:
            try:
                if writer is None:
                    reader, writer = await asyncio.open_connection(host, port)
                    tally["connections"] += 1
                writer.write(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
                await writer.drain()
                head = await asyncio.wait_for(reader.read(4096), 10)
                if not head:
                    raise ConnectionResetError
                tally[head[9:12].decode("ascii", "replace")] += 1
            except (OSError, TimeoutError):
                tally["dropped"] += 1
                if writer is not None:
                    writer.close()
                writer = None
                await asyncio.sleep(0.5)
                continue
            await asyncio.sleep(PROBE_EVERY_S)
        if writer is not None:
            writer.close()

    await asyncio.gather(*(one(i) for i in range(args.connections)))


async def _stalled(args, base: str, stop_at: float, tally: collections.Counter) -> None:
    host, port = _addr(base)
    loop = asyncio.get_running_loop()
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: 1000\r\n\r\n{")

    async def one(i: int) -> None:
        await asyncio.sleep(i * 0.002)
        while loop.time() < stop_at:
            writer = None
            try:
                reader, writer = await asyncio.open_connection(host, port)
                tally["connections"] += 1
                writer.write(head)
                await writer.drain()
                reply = await asyncio.wait_for(reader.read(4096), max(stop_at - loop.time(), 0.1))
                tally[reply[9:12].decode("ascii", "replace") if reply else "dropped"] += 1
            except TimeoutError:
                tally["held to the end"] += 1
            except OSError:
                tally["dropped"] += 1
            finally:
                if writer is not None:
                    writer.close()
            await asyncio.sleep(0.5)

    await asyncio.gather(*(one(i) for i in range(args.connections)))


def _grammar_body() -> bytes:
    grammar = "root ::= " + " | ".join(f'"w{i}"' for i in range(20_000))
    return json.dumps({**NORMAL, "grammar": grammar}).encode()


def _schema_body() -> bytes:
    schema = {"enum": [f"value{i}" for i in range(20_000)]}
    return json.dumps({**NORMAL, "response_format": {"type": "json_schema",
                                                     "json_schema": {"name": "x", "schema": schema}}}).encode()


def _schema_max_body() -> bytes:
    from engine.llama.grammar import MAX_ENUM  # native code: only when this attack runs

    schema = {"enum": [f"value{i}" for i in range(MAX_ENUM)]}
    return json.dumps({**NORMAL, "temperature": 1.0, "max_tokens": 16,
                       "response_format": {"type": "json_schema",
                                           "json_schema": {"name": "x", "schema": schema}}}).encode()


def _messages_body() -> bytes:
    return json.dumps({**NORMAL, "messages": [{"role": "user", "content": "x"}] * 50_000}).encode()


def _big_body() -> bytes:
    return json.dumps({**NORMAL, "messages": [{"role": "user", "content": "hello world " * (NEAR_2MIB // 12)}]}).encode()


async def _posting(base: str, body: bytes, stop_at: float, tally: collections.Counter, parallel: int = 1,
                   path: str = "/v1/chat/completions") -> None:
    _addr(base)
    loop = asyncio.get_running_loop()
    sent = 0
    connector = aiohttp.TCPConnector(force_close=True, limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        async def one() -> None:
            nonlocal sent
            while loop.time() < stop_at and sent < ATTACK_REQUESTS:
                sent += 1
                t0 = time.perf_counter()
                try:
                    async with session.post(base + path, data=body, headers={"Content-Type": "application/json"},
                                            timeout=aiohttp.ClientTimeout(total=REQUEST_S)) as r:
                        await r.read()
                        tally[str(r.status)] += 1
                except (aiohttp.ClientError, TimeoutError, OSError) as e:
                    tally[type(e).__name__] += 1
                tally["max_ms"] = max(tally["max_ms"], int((time.perf_counter() - t0) * 1000))

        await asyncio.gather(*(one() for _ in range(parallel)))


async def _grammar(args, base, stop_at, tally):
    await _posting(base, _grammar_body(), stop_at, tally)


async def _schema(args, base, stop_at, tally):
    await _posting(base, _schema_body(), stop_at, tally)


async def _users(args, base, stop_at, tally):
    body = json.dumps({**NORMAL, "temperature": 1.0, "max_tokens": 16, "ignore_eos": True}).encode()
    await _posting(base, body, stop_at, tally, parallel=2)


async def _schema_max(args, base, stop_at, tally):
    await _posting(base, _schema_max_body(), stop_at, tally, parallel=2)


async def _messages(args, base, stop_at, tally):
    await _posting(base, _messages_body(), stop_at, tally)


async def _bodies(args, base, stop_at, tally):
    await _posting(base, _big_body(), stop_at, tally, parallel=6)


def _pattern_body() -> bytes:
    schema = {"type": "object", "properties": {"a": {"type": "string", "pattern": "^(([a-z]{0,999}){0,999}){0,999}$"}}}
    return json.dumps({**NORMAL, "response_format": {"type": "json_schema",
                                                     "json_schema": {"name": "x", "schema": schema}}}).encode()


def _tools_body() -> bytes:
    tools = [{"type": "function", "function": {"name": f"f{i}", "parameters": {
        "type": "object", "properties": {f"p{k}": {"type": "string"} for k in range(300)}}}} for i in range(128)]
    return json.dumps({**NORMAL, "tools": tools}).encode()


def _metadata_body() -> bytes:
    return json.dumps({"input": "Say hello.", "max_output_tokens": 8,
                       "metadata": {f"k{i}": f"v{i}" for i in range(90_000)}}).encode()


async def _pattern(args, base, stop_at, tally):
    await _posting(base, _pattern_body(), stop_at, tally, parallel=6)


async def _tools(args, base, stop_at, tally):
    await _posting(base, _tools_body(), stop_at, tally)


async def _metadata(args, base, stop_at, tally):
    await _posting(base, _metadata_body(), stop_at, tally, path="/v1/responses")


async def _raw(host: str, port: int, source: str, rcvbuf: int | None = None) -> socket.socket:
    """A non-blocking socket connected from `source` (with a small receive buffer if asked)."""
    sock = socket.socket()
    sock.setblocking(False)
    if rcvbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.bind((source, 0))
    try:
        await asyncio.get_running_loop().sock_connect(sock, (host, port))
    except BaseException:
        sock.close()
        raise
    return sock


async def _held(sock: socket.socket, request: bytes, stop_at: float, tally: collections.Counter) -> None:
    """Send `request`, never read, hold the connection to the phase's end."""
    loop = asyncio.get_running_loop()
    try:
        await asyncio.wait_for(loop.sock_sendall(sock, request), max(stop_at - loop.time(), 0.1))
        tally["sent"] += 1
        await asyncio.sleep(max(stop_at - loop.time(), 0.0))
    except TimeoutError:
        tally["send blocked"] += 1
    except OSError:
        tally["dropped"] += 1
    finally:
        sock.close()


async def _unread(args, base, stop_at, tally):
    host, port = _addr(base)
    per = min(args.connections // 2, 500)
    request = b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n" * 120

    async def one(i: int) -> None:
        await asyncio.sleep(i * 0.002)
        try:
            sock = await _raw(host, port, (ATTACKER, OTHER_ATTACKER)[i % 2], rcvbuf=2048)
        except OSError:
            tally["refused"] += 1
            return
        tally["connections"] += 1
        await _held(sock, request, stop_at, tally)

    await asyncio.gather(*(one(i) for i in range(2 * per)))


async def _heads(args, base, stop_at, tally):
    host, port = _addr(base)
    per = min(args.connections // 2, 480)
    line = b"X-Pad: " + b"a" * 7993 + b"\r\n"
    loop = asyncio.get_running_loop()

    async def one(i: int) -> None:
        await asyncio.sleep(i * 0.002)
        while loop.time() < stop_at:
            reader, writer = None, None
            try:
                reader, writer = await asyncio.open_connection(host, port, local_addr=((ATTACKER, OTHER_ATTACKER)[i % 2], 0))
                tally["connections"] += 1
                writer.write(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")
                for _ in range(126):
                    writer.write(line)
                    await writer.drain()
                reply = await asyncio.wait_for(reader.read(64), max(stop_at - loop.time(), 0.1))
                tally[reply[9:12].decode("ascii", "replace") if reply else "dropped"] += 1
            except TimeoutError:
                tally["held to the end"] += 1
            except OSError:
                tally["dropped"] += 1
            finally:
                if writer is not None:
                    writer.close()
            await asyncio.sleep(0.5)

    await asyncio.gather(*(one(i) for i in range(2 * per)))


async def _stream(args, base, stop_at, tally):
    host, port = _addr(base)
    body = json.dumps({"messages": NORMAL["messages"], "max_tokens": 512, "n": 16, "logprobs": True,
                       "top_logprobs": 20, "stream": True, "ignore_eos": True, "temperature": 1}).encode()
    request = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
               b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)

    async def one(i: int) -> None:
        await asyncio.sleep(i * 0.01)
        try:
            sock = await _raw(host, port, ATTACKER, rcvbuf=2048)
        except OSError:
            tally["refused"] += 1
            return
        tally["connections"] += 1
        await _held(sock, request, stop_at, tally)

    await asyncio.gather(*(one(i) for i in range(40)))


ATTACK_FNS = {"keepalive": _keepalive, "stalled": _stalled, "grammar": _grammar, "schema": _schema, "users": _users,
              "schema-max": _schema_max, "messages": _messages, "bodies": _bodies, "pattern": _pattern,
              "unread": _unread, "heads": _heads, "tools": _tools, "stream": _stream, "metadata": _metadata}


# ---- reporting ----


def _print(row: dict, header: bool = False) -> None:
    if header:
        print(f"{'phase':<11} {'normal':>6} {'errors':>6} {'p50 ms':>8} {'p95 ms':>8} {'p95/quiet':>9} "
              f"{'own 200/429/other':>17} {'own max s':>9} {'rss MB':>7} {'rss+ MB':>7} {'server':>6} {'client':>6} "
              f"{'load':>5}  attack replies", flush=True)
    attack = ", ".join(f"{k}: {v}" for k, v in sorted(row["attack"].items()))
    if "p95_vs_users" in row:
        attack += f"; p95 / users' {row['p95_vs_users']:.2f}"
    own = row["own"]
    other = sum(v for k, v in own.items() if k not in ("200", "429"))
    own_cell = f"{own.get('200', 0)}/{own.get('429', 0)}/{other}"
    print(f"{row['phase']:<11} {row['normal_requests']:>6} {row['errors']:>6} {row['p50_ms']:>8.1f} "
          f"{row['p95_ms']:>8.1f} {row['p95_vs_quiet']:>9.2f} {own_cell:>17} {row['own_max_s']:>9.2f} "
          f"{row['server_rss_mb']:>7.1f} {row['rss_growth_mb']:>7.1f} "
          f"{row['server_cores']:>6.2f} {row['client_cores']:>6.2f} {row['load_average']:>5.1f}  {attack}", flush=True)
    for e in row["error_samples"]:
        print(f"{'':<10} error: {e}", flush=True)


def _cpu_s(pid: int) -> float:
    """A process's CPU seconds so far (user + system, its threads included)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


def _own_cpu_s() -> float:
    t = os.times()
    return t.user + t.system


def _rss_mb(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0



