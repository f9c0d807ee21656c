"""Where a fresh server's first chat requests spend their time (stdlib only, for the GPU steps).

    python3 scripts/gpu/first_probe.py PORT [N]

Sends one streamed chat completion with a ~1,400-token system prompt, then N (24) at once, each on
its own connection, and prints per request: connect, response head and first content chunk, in
seconds from its start. A thread samples the listening socket's accept queue and the unread
bytes of the server's connections (`ss`) every 0.25 s into ss-PORT.txt beside the output.
"""

from __future__ import annotations

import http.client
import json
import random
import subprocess
import sys
import threading
import time


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(["alpha", "bravo", "charlie", "delta", "echo", "fox", "golf", "hotel"])
                    for _ in range(n))


def one(port: int, system: str, user: str, out: list, t_base: float) -> None:
    t0 = time.perf_counter()
    row = {"start": t0 - t_base}
    try:
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        c.connect()
        row["connect"] = time.perf_counter() - t0
        body = json.dumps({"messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
                           "max_tokens": 32, "stream": True, "temperature": 0})
        c.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
        r = c.getresponse()
        row["head"] = time.perf_counter() - t0
        row["status"] = r.status
        while True:
            line = r.readline()
            if not line:
                break
            if b'"content"' in line and "first" not in row:
                row["first"] = time.perf_counter() - t0
        row["done"] = time.perf_counter() - t0
    except Exception as e:  # a probe: report, never stop
        row["error"] = f"{type(e).__name__}: {e}"
    out.append(row)


def sample(port: int, path: str, stop: threading.Event, t_base: float) -> None:
    with open(path, "w") as f:
        while not stop.is_set():
            ss = subprocess.run(["ss", "-tn", "-l", f"sport = :{port}"], capture_output=True, text=True).stdout
            conns = subprocess.run(["ss", "-tn", f"sport = :{port}"], capture_output=True, text=True).stdout
            syn = subprocess.run(["ss", "-tn", "state", "syn-sent", f"dport = :{port}"], capture_output=True,
                                 text=True).stdout
            unread = [ln.split()[1] for ln in conns.splitlines()[1:] if ln.split()]
            f.write(f"{time.perf_counter() - t_base:7.2f} listen {ss.splitlines()[1:]!r} conns {len(unread)} "
                    f"unread {sum(int(u) for u in unread if u.isdigit())} syn-sent {len(syn.splitlines()[1:])}\n")
            f.flush()
            time.sleep(0.25)


def main() -> None:
    port = int(sys.argv[1])
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 24
    rng = random.Random(0)
    system = _words(rng, 600)
    t_base = time.perf_counter()
    stop = threading.Event()
    threading.Thread(target=sample, args=(port, f"ss-{port}.txt", stop, t_base), daemon=True).start()
    rows: list[dict] = []
    one(port, system, _words(rng, 60), rows, t_base)
    threads = [threading.Thread(target=one, args=(port, system, _words(rng, 60), rows, t_base)) for _ in range(n)]
    for t in threads:
        t.start()
        time.sleep(0.05)
    for t in threads:
        t.join()
    stop.set()
    for r in sorted(rows, key=lambda r: r["start"]):
        print("  ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in r.items()))


if __name__ == "__main__":
    main()
