"""Real `tandem serve` processes for tests: loopback only, free ports, bounded waits, killed at
close (a fleet's engines, a router in front of them)."""

from __future__ import annotations

import glob
import os
import signal
import socket
import subprocess
import sys
import time

import httpx2 as httpx
from waiting import wait_until

WAIT = 90


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`python -m app serve ARGS` on a free loopback port, killed at close."""

    def __init__(self, *args: str, env: dict | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(os.devnull, "w")  # noqa: SIM115  (closed in close())
        self.proc = subprocess.Popen([sys.executable, "-m", "app", "serve", "--port", str(self.port), *args],
                                     stdout=self.log, stderr=subprocess.PIPE, text=True,
                                     env={**os.environ, **(env or {})})

    def wait_healthy(self, timeout: float = WAIT) -> Server:
        def up() -> bool:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited {self.proc.returncode}: {self.proc.stderr.read()[-2000:]}")
            try:
                return httpx.get(self.url + "/health", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(up, timeout, f"{self.url}/health")
        return self

    def get(self, path: str) -> dict:
        r = httpx.get(self.url + path, timeout=10)
        r.raise_for_status()
        return r.json()

    def kill_when(self, cond, what: str = "condition", unless=None, timeout: float = WAIT,
                  slice_s: float = 0.02) -> None:
        """Kill the process at the first moment `cond()` holds, checked while it is stopped.

        A state of a running engine (a request under way) can pass between two polls. Here the
        process runs in slices of `slice_s` (SIGCONT, sleep, SIGSTOP) and `wait_until` checks
        `cond()` and `unless()` between them, once every thread of it has stopped, so what it
        saw still holds when SIGKILL comes."""

        def run_a_slice() -> bool:
            self.proc.send_signal(signal.SIGCONT)
            time.sleep(slice_s)
            self._stop()
            return False

        try:
            self._stop()
            wait_until(lambda: cond() or run_a_slice(), timeout, what, unless=unless)
        except BaseException:
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGCONT)
            raise
        self.kill()

    def _stop(self) -> None:
        """SIGSTOP, then wait until every thread of the process shows as stopped."""
        self.proc.send_signal(signal.SIGSTOP)

        def stopped() -> bool:
            for stat in glob.glob(f"/proc/{self.proc.pid}/task/*/stat"):
                try:
                    with open(stat) as f:
                        state = f.read().rsplit(")", 1)[1].split()[0]
                except OSError:  # a thread that just exited
                    continue
                if state not in ("T", "t", "Z", "X"):
                    return False
            return True

        wait_until(stopped, 10, f"pid {self.proc.pid} stopped")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.kill()
        self.log.close()
