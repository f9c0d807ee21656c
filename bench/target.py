"""The benchmark's workload against an HTTP peer (e.g. `llama-server`), with aiohttp.

Two wire formats, both streamed (SSE, `data: {json}` lines), prompts sent as token ids or,
for a target with `prompt="text"`, as the workload's text (routers such as sglang-router match
text prompts only and answer token ids with a 422):

- `completion`: llama-server's native `POST /completion` with `prompt` (token ids),
  `n_predict`, `ignore_eos`, `cache_prompt`; its last chunk (`"stop": true`) reports
  `tokens_predicted` and `timings.cache_n` (prompt tokens reused from its cache).
- `openai`: `POST /v1/completions` with `prompt` (token ids), `max_tokens`, `ignore_eos`
  (an extension llama-server and vLLM accept), `stream_options.include_usage`; ends with
  `data: [DONE]`.

A router in front of engines is just another target. Which engine served a request comes from
the response where the router says it (Tandem's `X-Tandem-Backend` header) and is the target's
label otherwise; `bench.fleet` reads the engines' own counters for the split.

`probe()` picks the format: a server answering `GET /props` is llama-server (`completion`),
anything else is spoken to as OpenAI-compatible. TTFT is the arrival of the first streamed
token chunk after the request was sent; a request that fails (HTTP error, broken stream,
timeout) becomes a `RequestRecord` with `success=False` and its error — never an exception.

Nothing here can flush a peer's cache: each run warms the shared prefix (`warm_copies`
concurrent prefix-only requests, e.g. one per llama-server slot) and uses suffixes of its
own (see `engine.sim.workload`), so earlier runs cannot give it full-prompt hits. A tenant
workload warms nothing (a router must learn) unless `warm_tenants` asks for every tenant's
prefix to be sent once first (through the target, so a router places it where it likes).
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from engine.backends import sse
from engine.sim.benchmark import RequestRecord
from engine.sim.workload import RequestSpec, Workload

APIS = ("auto", "completion", "openai")
PROMPTS = ("auto", "tokens", "text")
BACKEND_HEADER = "X-Tandem-Backend"


@dataclass(frozen=True, slots=True)
class Target:
    url: str  # base URL, no trailing slash
    label: str  # the "policy" column of its rows, e.g. target:llama-server
    api: str  # completion | openai
    model: str | None = None  # the model name sent to an OpenAI-compatible server
    prompt: str = "tokens"  # tokens | text | auto (text for tenant workloads)

    def to_dict(self) -> dict:
        return {"url": self.url, "label": self.label, "api": self.api, "model": self.model, "prompt": self.prompt}


def parse_target(text: str) -> tuple[str | None, str]:
    """`URL` or `LABEL=URL` → (label or None, base URL)."""
    head, eq, url = text.partition("=")
    label: str | None = head
    if not eq or "://" in head:
        label, url = None, text
    url = url.strip().rstrip("/")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"--target {text!r}: expected [LABEL=]http://HOST:PORT")
    return (label.strip() or None) if label else None, url


async def probe(url: str, api: str = "auto", label: str | None = None, timeout: float = 10.0,
                prompt: str = "tokens") -> Target:
    """Find out what `url` speaks (see the module docstring); raises ConnectionError if nothing answers."""
    import aiohttp

    if api not in APIS:
        raise ValueError(f"target api must be one of {', '.join(APIS)}, got {api!r}")
    if prompt not in PROMPTS:
        raise ValueError(f"target prompt must be one of {', '.join(PROMPTS)}, got {prompt!r}")
    hostport = urlsplit(url).netloc
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as session:
        is_llama_server = False
        if api in ("auto", "completion"):
            try:
                async with session.get(f"{url}/props") as r:
                    is_llama_server = r.status == 200 and "default_generation_settings" in await r.json(content_type=None)
            except (TimeoutError, aiohttp.ClientError, ValueError):
                pass
        model = None
        try:
            async with session.get(f"{url}/v1/models") as r:
                if r.status == 200:
                    data = (await r.json(content_type=None)).get("data") or []
                    model = data[0].get("id") if data else None
                reachable = True
        except (TimeoutError, aiohttp.ClientError, ValueError, AttributeError):
            reachable = is_llama_server
        if not reachable:
            raise ConnectionError(f"--target {url}: no answer from /props or /v1/models")
    if api == "auto":
        api = "completion" if is_llama_server else "openai"
    name = label or ("llama-server" if is_llama_server else hostport)
    return Target(url=url, label=f"target:{name}", api=api, model=model, prompt=prompt)


def routing_decisions(url: str, n: int) -> list[dict]:
    """The last `n` routing decisions of a Tandem router (its /v1/routing), [] if it does not say."""
    try:
        with urllib.request.urlopen(f"{url}/v1/routing?n={n}", timeout=10) as r:
            return list(json.loads(r.read()).get("decisions") or [])
    except (urllib.error.URLError, OSError, ValueError):
        return []


def run_target(target: Target, workload: Workload, *, run: int, warm_copies: int = 1,
               timeout: float = 600.0, on_done=None, warm_tenants: bool = False) -> list[RequestRecord]:
    """Warm the prefix, then send the workload on its schedule; one record per request."""
    return asyncio.run(_run(target, workload, run, warm_copies, timeout, on_done, warm_tenants))


async def _run(target, workload, run, warm_copies, timeout, on_done, warm_tenants=False):
    import aiohttp

    conn = aiohttp.TCPConnector(limit=0)
    client_timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=timeout)
    async with aiohttp.ClientSession(connector=conn, timeout=client_timeout) as session:
        text = target.prompt == "text" or (target.prompt == "auto" and workload.spec.tenants > 0)
        warm = []
        if workload.prefix:
            prompt = workload.prefix_texts[0] if text else workload.prefix
            warm = [_send(session, target, prompt, 1) for _ in range(max(1, warm_copies))]
        elif warm_tenants:
            warm = [_send(session, target, t if text else p, 1)
                    for t, p in zip(workload.prefix_texts, workload.prefixes)]
        for result in await asyncio.gather(*warm):
            if result["error"]:
                raise ConnectionError(f"{target.label}: warming the prefix failed: {result['error']}")
        loop = asyncio.get_running_loop()
        t0 = loop.time()

        async def one(spec: RequestSpec) -> RequestRecord:
            await asyncio.sleep(max(0.0, t0 + spec.arrival_s - loop.time()))
            t_submit = loop.time() - t0
            result = await _send(session, target, spec.text if text else spec.prompt, spec.output_tokens)
            record = _record(target, workload, run, spec, t_submit, result)
            if on_done is not None:
                on_done(record)
            return record

        return list(await asyncio.gather(*(one(s) for s in workload.requests)))


async def _send(session, target: Target, prompt, n_tokens: int) -> dict:
    """One streamed request; returns timings and counts, with `error` set instead of raising.

    `prompt` is token ids or a string."""
    import aiohttp

    prompt = prompt if isinstance(prompt, str) else list(prompt)
    if target.api == "completion":
        path = "/completion"
        body = {"prompt": prompt, "n_predict": n_tokens, "ignore_eos": True, "cache_prompt": True,
                "temperature": 0.0, "stream": True}
    else:
        path = "/v1/completions"
        body = {"prompt": prompt, "max_tokens": n_tokens, "ignore_eos": True, "temperature": 0.0,
                "stream": True, "stream_options": {"include_usage": True}}
        if target.model:
            body["model"] = target.model
    out: dict[str, Any] = {"ttft": None, "e2e": None, "itl": [], "tokens": 0, "reported_tokens": None, "cached": -1,
           "finish_reason": None, "error": None, "backend": None, "prompt_tokens": None}
    t0 = time.perf_counter()
    last = t0
    try:
        async with session.post(target.url + path, json=body) as r:
            out["backend"] = r.headers.get(BACKEND_HEADER) or None
            if r.status != 200:
                text = (await r.text())[:500]
                out["error"] = f"HTTP {r.status}: {text}"
                out["e2e"] = time.perf_counter() - t0
                return out
            async for chunk in stream_chunks(r, out):
                now = time.perf_counter()
                if _is_token(target, chunk):
                    if out["ttft"] is None:
                        out["ttft"] = now - t0
                    else:
                        out["itl"].append(now - last)
                    last = now
                    out["tokens"] += 1
                _read_final(target, chunk, out)
    except (TimeoutError, aiohttp.ClientError, ValueError) as e:
        out["error"] = f"{type(e).__name__}: {e}"
    out["e2e"] = time.perf_counter() - t0
    return out


def _is_token(target: Target, chunk: dict) -> bool:
    if target.api == "completion":
        return not chunk.get("stop") or bool(chunk.get("content"))
    choices = chunk.get("choices") or []
    return bool(choices) and (bool(choices[0].get("text")) or choices[0].get("finish_reason") is None)


def _read_final(target: Target, chunk: dict, out: dict) -> None:
    if target.api == "completion":
        if chunk.get("stop"):
            out["reported_tokens"] = chunk.get("tokens_predicted")
            out["prompt_tokens"] = chunk.get("tokens_evaluated")
            timings = chunk.get("timings") or {}
            cached = timings.get("cache_n", chunk.get("tokens_cached"))
            out["cached"] = -1 if cached is None else int(cached)
            out["finish_reason"] = "length" if chunk.get("stop_type") in (None, "limit") else chunk.get("stop_type")
        return
    for c in chunk.get("choices") or []:
        if c.get("finish_reason"):
            out["finish_reason"] = c["finish_reason"]
    read_usage(chunk.get("usage"), out, completion_key="reported_tokens")


async def stream_chunks(response, out: dict):
    """An OpenAI-compatible stream's JSON events up to `[DONE]`; an error event ends it, kept in
    `out["error"]`."""
    async for chunk in sse.data_events(response.content):
        if chunk is sse.DONE:
            return
        if "error" in chunk:
            out["error"] = json.dumps(chunk["error"])[:500]
            return
        yield chunk


def read_usage(usage: dict | None, out: dict, completion_key: str = "completion_tokens") -> None:
    """Copy an OpenAI `usage` block's counts into a request's record: completion and prompt
    tokens, and the cached prompt tokens where the engine says (`prompt_tokens_details`)."""
    if not usage:
        return
    out[completion_key] = usage.get("completion_tokens")
    out["prompt_tokens"] = usage.get("prompt_tokens")
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    if cached is not None:
        out["cached"] = int(cached)


def _record(target: Target, workload: Workload, run: int, spec: RequestSpec, t_submit: float,
            result: dict) -> RequestRecord:
    tokens = result["reported_tokens"] if result["reported_tokens"] is not None else result["tokens"]
    itl = result["itl"]
    ok = result["error"] is None and tokens > 0
    return RequestRecord(
        workload=workload.spec.name(),
        policy=target.label,
        run=run,
        requests=len(workload.requests),
        index=spec.index,
        request_id=f"{target.label}-{run}-{spec.index}",
        backend=result["backend"] or target.label,
        success=ok,
        finish_reason=result["finish_reason"] if ok else "error",
        prompt_tokens=result["prompt_tokens"] if result["prompt_tokens"] is not None else len(spec.prompt),
        cached_tokens=result["cached"],
        output_tokens=int(tokens),
        t_submit_s=t_submit,
        queue_s=None,
        ttft_s=result["ttft"],
        e2e_s=result["e2e"],
        itl_s=sum(itl) / len(itl) if itl else None,
        error=result["error"] if result["error"] or ok else "the stream ended without a token",
    )
