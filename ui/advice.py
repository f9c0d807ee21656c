"""Errors as advice: what went wrong in plain words and what to do next, the raw text on demand.

The engine, the Hub client and aiohttp say what failed in their own terms ("[Errno -2] Name or
service not known", "… is not a GGUF file (it starts with b'52\\xc7G'…)", "ClientConnectorError:
Cannot connect to host 127.0.0.1:9 ssl:default"). `advise(error, where)` matches the few causes a
person can act on (no network, a file that is not a GGUF model, a missing file, an engine that
does not answer, a backend that is down) and returns an `Advice`: one sentence to show, and the original text for a
tooltip or a dialog's details. Anything else is shown as it was raised. Pure and Qt-free: any
thread, no I/O, so it costs nothing on the path that shows the error.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

OFFLINE = re.compile(r"name or service not known|temporary failure in name resolution|nodename nor servname"
                     r"|getaddrinfo failed|no address associated with hostname|failed to resolve"
                     r"|nameresolutionerror|network is unreachable|no route to host", re.IGNORECASE)
NOT_GGUF = re.compile(r"is not a GGUF file|not a GGUF file|bad magic", re.IGNORECASE)
MISSING_FILE = re.compile(r"model file not found: (?P<path>.+)$", re.IGNORECASE | re.MULTILINE)
DEAD_ENGINE = re.compile(r"cannot connect to host|clientconnectorerror|connection refused|connect call failed"
                         r"|serverdisconnectederror|did not answer \d+ health probes|is unreachable|went silent"
                         r"|cannot reach", re.IGNORECASE)
DOWN = re.compile(r"backend '?(?P<name>[\w.:-]+?)'? (?:is unhealthy|is not serving|is down)")
TIMED_OUT = re.compile(r"timed out|timeouterror|read timeout|connecttimeout", re.IGNORECASE)
HOST = re.compile(r"(?:cannot connect to host |https?://)(?P<host>\[[0-9a-f:]+\](?::\d+)?|[\w.-]+(?::\d+)?)",
                  re.IGNORECASE)

GET_FROM_DISK = "load a GGUF from disk with File ▸ Load model"


@dataclass(frozen=True)
class Advice:
    text: str  # plain words: what happened and what to do
    detail: str  # the error as it was raised, for whoever wants the particulars

    def __str__(self) -> str:
        return self.text


def advise(error: BaseException | str, where: str = "") -> Advice:
    """Advice for `error`. `where` is what was being done: "hub" (searching or downloading a
    model), "load" (loading a model file), "engine" (a backend or a request on one); it picks
    the advice where one cause means different things (no network: offline for the Hub, an
    engine that cannot be reached for a backend)."""
    detail = _raw(error)
    engine_host = _host(detail)
    if NOT_GGUF.search(detail):
        return Advice("This file is not a GGUF model: pick a .gguf file with File ▸ Load model, "
                      "or get one with File ▸ Get model.", detail)
    missing = MISSING_FILE.search(detail)
    if missing:
        return Advice(f"The model file was not found at {missing.group('path').strip()}: pick one with "
                      "File ▸ Load model.", detail)
    if where == "hub":
        if OFFLINE.search(detail) or DEAD_ENGINE.search(detail):
            return Advice(f"You seem to be offline: {GET_FROM_DISK}.", detail)
        if TIMED_OUT.search(detail):
            return Advice(f"The Hugging Face Hub did not answer in time: try again, or {GET_FROM_DISK}.", detail)
    elif (down := DOWN.search(detail)) and not engine_host:
        name = down.group("name")
        return Advice(f"{name} is down: send to another backend (Send to: auto), or wait until it answers "
                      "again.", detail)
    elif DEAD_ENGINE.search(detail) or OFFLINE.search(detail) or (where == "engine" and TIMED_OUT.search(detail)):
        at = f"at {engine_host} " if engine_host else ""
        return Advice(f"The engine {at}does not answer: check that it is running; Tandem uses it again as "
                      "soon as it answers.", detail)
    return Advice(detail, detail)


def _raw(error: BaseException | str) -> str:
    if isinstance(error, BaseException):
        text = str(error).strip()
        return text or type(error).__name__
    return str(error).strip()


def _host(text: str) -> str:
    m = HOST.search(text)
    return m.group("host") if m else ""
