"""One dialect per kind of engine: everything Tandem knows of an engine beyond OpenAI's API.

A `Dialect` says, for one kind (sglang-router keeps its per-engine readers apart the same way):
- `identify`: how to tell it from its endpoints (`api: auto`, `detect`);
- `body`: the streamed request's JSON, OpenAI's own fields and the ones it takes beyond them
  (sampling knobs, its prompt cache, how a final assistant message is continued);
- `check`: what it can never serve (a GBNF `grammar`; a continued assistant message);
- `load`: its own running and waiting requests, read from its own endpoints.

The generic OpenAI API is the base class: no extras, no grammar, no continuation, no load.
`Undetected` stands for an engine not yet probed (`api: auto`): it refuses nothing, since the
probe names the dialect before anything is sent. Every field read is checked and bounded.

Thread contract: dialects hold no state; the coroutines run on the backend's loop thread.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp

from engine.core.errors import InvalidRequest
from engine.core.request import Request, SamplingParams

from .client import EngineClient, EngineMisbehaved
from .probe import Load, count, read_metrics

Get = Callable[[str], Awaitable[tuple[int, Any]]]  # GET a path: (status, parsed JSON or text)


class Dialect:
    """A generic OpenAI-compatible API: OpenAI's own fields, nothing else."""

    name = "openai"
    grammar = False  # takes a GBNF `grammar` field (structured output, tools)
    continues = False  # can go on with a final assistant message of a chat

    async def identify(self, get: Get) -> bool:
        """Whether the engine behind `get` is of this kind."""
        return False

    def body(self, req: Request, chat: bool, model: str) -> dict[str, Any]:
        """The streamed request's JSON: OpenAI's own fields, then this dialect's."""
        sp = req.sampling
        body: dict[str, Any] = {"stream": True, "stream_options": {"include_usage": True},
                                "temperature": sp.temperature, "top_p": sp.top_p,
                                "max_tokens": min(sp.max_tokens, req.stop_after or sp.max_tokens)}
        if model:
            body["model"] = model
        if chat:
            if req.messages is None:
                raise InvalidRequest(f"request {req.id} has no messages to send as a chat")
            body["messages"] = list(req.messages)
            if req.continue_final:
                body.update(self.continuation())
        else:
            body["prompt"] = req.text if req.text is not None else list(req.prompt_tokens)
        body.update(_openai_sampling(sp))
        if sp.grammar is not None:  # `check` let only dialects that take it have one
            body["grammar"] = sp.grammar
        body.update(self.sampling(sp))
        return body

    def sampling(self, sp: SamplingParams) -> dict[str, Any]:
        """Sampling fields it takes beyond OpenAI's own."""
        return {}

    def continuation(self) -> dict[str, Any]:
        """Fields that make it go on with the chat's final assistant message, in its turn."""
        return {"continue_final_message": True}

    def check(self, backend: str, request: Request) -> None:
        """`InvalidRequest` for what this kind of engine can never serve."""
        if request.continue_final and not self.continues and request.text is None:
            raise InvalidRequest(f"{backend}: continuing the final assistant message needs a Tandem, "
                                 f"llama-server, vLLM or SGLang engine", param="messages")
        if request.sampling.grammar is not None and not self.grammar:
            raise InvalidRequest(f"{backend}: grammar-constrained requests (response_format, tools, grammar) "
                                 f"need a llama-server or Tandem engine, not {self.name}")

    async def load(self, client: EngineClient) -> Load | None:
        """Its running and waiting requests now; None: it has no endpoint that says."""
        return None


class Undetected(Dialect):
    """`api: auto` before the first probe answered (no request is sent to it meanwhile)."""

    name = "auto"
    grammar = True
    continues = True


class Tandem(Dialect):
    """Another Tandem: llama.cpp's sampling knobs, GBNF, `/v1/routing` for its load."""

    name = "tandem"
    grammar = True
    continues = True

    async def identify(self, get: Get) -> bool:
        status, body = await get("/v1/routing?n=0")
        return status == 200 and isinstance(body, dict) and "backends" in body

    def sampling(self, sp: SamplingParams) -> dict[str, Any]:
        return _llama_cpp_sampling(sp)

    async def load(self, client: EngineClient) -> Load | None:
        status, body = await client.get("/v1/routing?n=0")
        if status != 200 or not isinstance(body, dict) or not isinstance(body.get("backends"), list):
            return None
        items = [i for b in body["backends"] if isinstance(b, dict) and isinstance(b.get("items"), list)
                 for i in b["items"] if isinstance(i, dict)]
        running = sum(1 for i in items if i.get("running") is True)
        return Load.reported(running, len(items) - running, [i["decode_left"] for i in items
                                                             if count(i.get("decode_left"), 0)])


class LlamaServer(Dialect):
    """llama.cpp's server: its sampling knobs, GBNF, its prompt cache, `/slots` + `/metrics`.
    It continues a final assistant message by itself (its assistant prefill, on unless run
    with `--no-prefill-assistant`), so nothing asks it to."""

    name = "llama-server"
    grammar = True
    continues = True

    async def identify(self, get: Get) -> bool:
        status, body = await get("/props")
        return status == 200 and isinstance(body, dict) and "default_generation_settings" in body

    def sampling(self, sp: SamplingParams) -> dict[str, Any]:
        return {**_llama_cpp_sampling(sp), "cache_prompt": True}

    def continuation(self) -> dict[str, Any]:
        return {}

    async def load(self, client: EngineClient) -> Load | None:
        status, body = await client.get("/slots")
        running, left = 0, []
        if status == 200 and isinstance(body, list):
            busy = [s for s in body if isinstance(s, dict) and s.get("is_processing") is True]
            running = len(busy)
            for s in busy:
                nxt = s.get("next_token")
                remain = nxt.get("n_remain") if isinstance(nxt, dict) else None
                if count(remain, 0):
                    left.append(remain)
        metrics = await read_metrics(client)
        if status != 200:
            running = int(metrics.get("llamacpp:requests_processing", 0))
        return Load.reported(running, metrics.get("llamacpp:requests_deferred", 0), left)


class Vllm(Dialect):
    """vLLM: its sampling knobs, `continue_final_message` (which it refuses beside its default
    `add_generation_prompt`), its Prometheus gauges for load."""

    name = "vllm"
    continues = True
    gauges = ("vllm:num_requests_running", "vllm:num_requests_waiting")

    async def identify(self, get: Get) -> bool:
        status, body = await get("/metrics")
        return status == 200 and isinstance(body, str) and f"{self.name}:" in body

    def sampling(self, sp: SamplingParams) -> dict[str, Any]:
        out: dict[str, Any] = {"min_p": sp.min_p, "repetition_penalty": sp.repeat_penalty}
        if sp.top_k > 0:
            out["top_k"] = sp.top_k
        if sp.ignore_eos:
            out["ignore_eos"] = True
        return out

    def continuation(self) -> dict[str, Any]:
        return {"continue_final_message": True, "add_generation_prompt": False}

    async def load(self, client: EngineClient) -> Load | None:
        m = await read_metrics(client)
        return Load.reported(m.get(self.gauges[0], 0), m.get(self.gauges[1], 0))


class Sglang(Vllm):
    """SGLang: vLLM's sampling names, `continue_final_message` alone, its own gauges."""

    name = "sglang"
    gauges = ("sglang:num_running_reqs", "sglang:num_queue_reqs")

    def continuation(self) -> dict[str, Any]:
        return {"continue_final_message": True}


GENERIC = Dialect()
DETECTED = (Tandem(), LlamaServer(), Vllm(), Sglang())  # asked in this order; none: GENERIC
DIALECTS: dict[str, Dialect] = {d.name: d for d in (GENERIC, Undetected(), *DETECTED)}


def dialect(api: str) -> Dialect:
    """The dialect an `api=` names (engine/backends/remote/config.py `APIS`)."""
    return DIALECTS[api]


async def detect(client: EngineClient) -> Dialect:
    """Which kind of engine this is, from the endpoints it has (each path fetched once)."""
    seen: dict[str, tuple[int, Any]] = {}

    async def get(path: str) -> tuple[int, Any]:
        if path not in seen:
            seen[path] = await client.get(path)
        return seen[path]

    try:
        for d in DETECTED:
            if await d.identify(get):
                return d
    except (TimeoutError, aiohttp.ClientError, EngineMisbehaved):
        pass
    return GENERIC


def _openai_sampling(sp: SamplingParams) -> dict[str, Any]:
    """OpenAI's own optional fields: every API takes them."""
    out: dict[str, Any] = {}
    if sp.stop:
        out["stop"] = list(sp.stop)
    if sp.seed is not None:
        out["seed"] = sp.seed
    if sp.logit_bias:
        out["logit_bias"] = {str(t): b for t, b in sp.logit_bias}
    if sp.presence_penalty:
        out["presence_penalty"] = sp.presence_penalty
    if sp.frequency_penalty:
        out["frequency_penalty"] = sp.frequency_penalty
    return out


def _llama_cpp_sampling(sp: SamplingParams) -> dict[str, Any]:
    """llama.cpp's names (llama-server, Tandem)."""
    out: dict[str, Any] = {"min_p": sp.min_p, "repeat_penalty": sp.repeat_penalty, "repeat_last_n": sp.repeat_last_n}
    if sp.top_k > 0:
        out["top_k"] = sp.top_k
    if sp.ignore_eos:
        out["ignore_eos"] = True
    return out
