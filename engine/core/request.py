"""Values that describe a request and how it ended. They cross threads; treat them as frozen.

`SamplingParams` holds OpenAI's sampling fields as the engine takes them: `logit_bias` (token
id -> bias, applied in the sampler chain), `presence_penalty` / `frequency_penalty`
(llama.cpp's penalties sampler, over the generated tokens), `seed`, `stop`, and `logprobs`
(None: off; k >= 0: each output token's log-probability and its k most likely alternatives,
`TokenLogprob`; `prompt_logprobs` adds the prompt's tokens'). A finished request's `FinishRecord.logprobs` holds one `TokenLogprob` per
output token; while it streams, the same values arrive through `RequestHandle.logprobs`.
"""

from __future__ import annotations

import enum
import itertools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from engine.core.errors import InvalidRequest

_ids = itertools.count(1)
MAX_TOKENS = 1 << 20  # beyond any context; keeps values inside llama.cpp's int32
MAX_LOGIT_BIAS = 300  # entries; OpenAI's own limit
MAX_TOP_LOGPROBS = 20  # alternatives per token; OpenAI's chat limit
CHARS_PER_TOKEN = 4  # English text in BPE vocabularies; only for prompts no tokenizer has seen


def next_request_id() -> str:
    return f"req-{next(_ids)}"


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How tokens are chosen. `temperature == 0` means greedy.

    `grammar` (GBNF, root rule `root`) constrains every token to it (llama.cpp's grammar
    sampler, first in the chain); the sequence ends when the grammar is complete, since then
    only end-of-generation tokens are allowed. Such a sequence samples on the host.
    """

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    seed: int | None = None
    max_tokens: int = 256
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    # (token id, bias) pairs, sorted by id; a bias of -100 or less bans the token outright.
    logit_bias: tuple[tuple[int, float], ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # None: no logprobs; k: each output token's logprob and its k most likely alternatives.
    logprobs: int | None = None
    # Also each prompt token's logprob (after the first), with `logprobs` alternatives: the
    # prompt is computed whole (no prefix-cache hit: cached tokens have no logits).
    prompt_logprobs: bool = False
    grammar: str | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def plain(self) -> bool:
        """Nothing in it needs more than the fused greedy / device chain of plain sampling:
        no bias, no OpenAI penalties, no logprobs, no grammar."""
        return (not self.logit_bias and self.logprobs is None and self.presence_penalty == 0.0
                and self.frequency_penalty == 0.0 and self.grammar is None)

    def validate(self) -> SamplingParams:
        """Raise `InvalidRequest` naming the first value out of range; return self."""
        checks = [
            ("max_tokens", isinstance(self.max_tokens, int) and 1 <= self.max_tokens <= MAX_TOKENS,
             f"an integer in [1, {MAX_TOKENS}]"),
            ("temperature", _finite(self.temperature) and self.temperature >= 0, "a number >= 0"),
            ("top_k", isinstance(self.top_k, int) and 0 <= self.top_k < 2**31, "an integer >= 0 (0 = off)"),
            ("top_p", _finite(self.top_p) and 0 < self.top_p <= 1, "in (0, 1]"),
            ("min_p", _finite(self.min_p) and 0 <= self.min_p <= 1, "in [0, 1]"),
            ("repeat_penalty", _finite(self.repeat_penalty) and self.repeat_penalty > 0, "a number > 0"),
            ("repeat_last_n", isinstance(self.repeat_last_n, int) and 0 <= self.repeat_last_n <= 8192,
             "an integer in [0, 8192]"),
            ("seed", self.seed is None or (isinstance(self.seed, int) and 0 <= self.seed < 2**32), "in [0, 2^32)"),
            ("stop", all(isinstance(s, str) and s for s in self.stop) and len(self.stop) <= 16,
             "at most 16 non-empty strings"),
            ("logit_bias", len(self.logit_bias) <= MAX_LOGIT_BIAS and all(
                isinstance(t, int) and t >= 0 and _finite(b) and -100 <= b <= 100 for t, b in self.logit_bias),
             f"at most {MAX_LOGIT_BIAS} (token id >= 0, bias in [-100, 100]) pairs"),
            ("presence_penalty", _finite(self.presence_penalty) and -2 <= self.presence_penalty <= 2, "in [-2, 2]"),
            ("frequency_penalty", _finite(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2,
             "in [-2, 2]"),
            ("logprobs", self.logprobs is None or (isinstance(self.logprobs, int)
                                                   and 0 <= self.logprobs <= MAX_TOP_LOGPROBS),
             f"None or an integer in [0, {MAX_TOP_LOGPROBS}]"),
            ("prompt_logprobs", not self.prompt_logprobs or self.logprobs is not None, "False unless logprobs is set"),
            ("grammar", self.grammar is None or (isinstance(self.grammar, str) and self.grammar.strip() != ""),
             "a non-empty GBNF string"),
            # A complete grammar allows only end tokens: banning them too leaves nothing to sample.
            ("ignore_eos", not (self.ignore_eos and self.grammar is not None), "false with a grammar"),
        ]
        for name, ok, allowed in checks:
            if not ok:
                raise InvalidRequest(f"{name} must be {allowed}, got {getattr(self, name)!r}", param=name)
        return self


def _finite(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@dataclass(frozen=True, slots=True)
class Request:
    """One whole generation request: a prompt and how to sample its continuation.

    `backend` names a backend to pin the request to, bypassing the routing policy.

    The prompt is `prompt_tokens` wherever a tokenizer is at hand (local backends need it).
    A request that came in as text keeps it in `text` (a completion prompt) or `messages`
    (a chat, as the client sent it): a remote engine is sent those, and a router with no
    model at all routes on them, with `prompt_tokens` left empty.
    """

    prompt_tokens: tuple[int, ...]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    id: str = field(default_factory=next_request_id)
    backend: str | None = None
    source: str = "api"
    retry: bool = False  # may restart from its prompt on another backend if its own fails early
    # Whether the caller reads the text as it is made (an SSE stream, the chat panel). One that
    # does not (`stream: false` over HTTP) sees nothing until the end, so a remote backend
    # that dies mid-answer hands it to another backend, which starts again from the prompt.
    stream: bool = True
    # End after this many tokens as if the model had stopped there; routers and admission see
    # only `max_tokens`. Benchmarks use it for outputs whose length no one knows in advance.
    stop_after: int | None = None
    text: str | None = None
    messages: tuple[dict, ...] | None = None
    # The model the client named, where an engine serves several (a fleet): only backends
    # that serve it are candidates. None: any backend.
    model: str | None = None
    # The last of `messages` is the assistant's reply so far: the engine continues it in the
    # same turn (vLLM's and Tandem's `continue_final_message`, llama-server's assistant prefill).
    continue_final: bool = False
    # Who asked (an HTTP client's address; "": unknown): a backend's queue gives each client a
    # fair turn (`Scheduler._fair_head`), so one client's hundreds of sequences do not queue
    # everyone else's behind them.
    client: str = ""

    @property
    def prompt_estimate(self) -> int:
        """Prompt tokens: exact when tokenized, else about one per `CHARS_PER_TOKEN` characters."""
        if self.prompt_tokens:
            return len(self.prompt_tokens)
        chars = len(self.text or "") + sum(len(str(m.get("content") or "")) for m in self.messages or ())
        return max(chars // CHARS_PER_TOKEN, 1)

    def continued(self, text: str, n_tokens: int, tokenize: Callable[[str], list[int]] | None = None) -> Request:
        """This request as it goes on after `text` (`n_tokens` output tokens) was streamed
        from it: the same id and sampling, the prompt followed by `text` (a completion's text,
        a chat's assistant message continued in its turn, or token ids with `tokenize(text)`
        appended), `max_tokens` and `stop_after` less `n_tokens`. Raises `InvalidRequest`
        where that would not continue the same answer: a grammar (it would start over on the
        continuation) or token ids with no tokenizer at hand."""
        if self.sampling.grammar is not None:
            raise InvalidRequest("a grammar-constrained answer cannot be continued elsewhere (the grammar would "
                                 "start over)")
        more: dict = {}
        if self.text is not None:
            more["text"] = self.text + text
        elif self.messages is not None:
            last = self.messages[-1]
            if self.continue_final:
                messages = (*self.messages[:-1], {**last, "content": str(last.get("content") or "") + text})
            else:
                messages = (*self.messages, {"role": "assistant", "content": text})
            more.update(messages=messages, continue_final=True)
        if self.prompt_tokens:
            if tokenize is not None:
                more["prompt_tokens"] = self.prompt_tokens + tuple(tokenize(text))
            elif more:  # its text or messages say the same: engines that take those go on from them
                more["prompt_tokens"] = ()
            else:
                raise InvalidRequest("a token-id prompt cannot be continued without a tokenizer for its text")
        sp = self.sampling
        return replace(self, sampling=replace(sp, max_tokens=max(sp.max_tokens - n_tokens, 1)),
                       stop_after=None if self.stop_after is None else max(self.stop_after - n_tokens, 1), **more)

    def __post_init__(self) -> None:
        if not (self.prompt_tokens or self.text or self.messages):
            raise InvalidRequest("the prompt is empty", param="prompt")
        self.sampling.validate()
        if self.stop_after is not None and not (isinstance(self.stop_after, int) and self.stop_after >= 1):
            raise InvalidRequest(f"stop_after must be a positive integer, got {self.stop_after!r}")


class RequestStatus(enum.IntEnum):
    """Ordered so that `status > RUNNING` means finished (vLLM's habit)."""

    WAITING = 0
    RUNNING = 1
    FINISHED_STOPPED = 2
    FINISHED_LENGTH = 3
    FINISHED_CANCELLED = 4
    FINISHED_ERROR = 5

    @property
    def finished(self) -> bool:
        return self > RequestStatus.RUNNING

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASON.get(self)


_FINISH_REASON = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_CANCELLED: "cancelled",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One output token with its log-probability under the model's raw distribution
    (log-softmax of the logits, before temperature, penalties or bias: what OpenAI and vLLM
    report), and the `top` most likely tokens at that step as (token id, bytes, logprob),
    most likely first. `piece` is the token's bytes."""

    token: int
    piece: bytes
    logprob: float
    top: tuple[tuple[int, bytes, float], ...] = ()


@dataclass(frozen=True, slots=True)
class FinishRecord:
    """How a request ended, with its timings in seconds (monotonic clock).

    `queue_s` is submit → admission, `ttft_s` submit → first token, `e2e_s` submit → end,
    `itl_s` the mean gap between output tokens after the first.
    """

    request_id: str
    backend: str
    status: RequestStatus
    text: str
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    queue_s: float
    ttft_s: float | None
    e2e_s: float
    itl_s: float | None
    error: str | None = None
    error_kind: str | None = None
    logprobs: tuple[TokenLogprob, ...] | None = None  # one per output token, when asked for
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None  # one per prompt token after the first
    # the backend's live cap at admission and why it was there (engine/sched/limiter.py); None where
    # the backend has no cap of its own (a remote one) or the request was never admitted
    cap_at_admit: int | None = None
    cap_reason: str | None = None

    @property
    def finish_reason(self) -> str | None:
        return self.status.finish_reason

    @property
    def decode_tok_s(self) -> float | None:
        if self.itl_s:
            return 1.0 / self.itl_s
        return None

    def to_dict(self) -> dict:
        return {
            "request_id": self.request_id,
            "backend": self.backend,
            "finish_reason": self.finish_reason,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "output_tokens": self.output_tokens,
            "queue_s": self.queue_s,
            "ttft_s": self.ttft_s,
            "e2e_s": self.e2e_s,
            "itl_s": self.itl_s,
            "error": self.error,
        }


def error_record(req: Request, backend: str, why: str, t_submit: float) -> FinishRecord:
    """The record of a request that ended with `why` before it ran (its backend could not serve it)."""
    now = time.monotonic()
    return FinishRecord(request_id=req.id, backend=backend, status=RequestStatus.FINISHED_ERROR, text="",
                        prompt_tokens=len(req.prompt_tokens), cached_tokens=0, output_tokens=0,
                        queue_s=now - t_submit, ttft_s=None, e2e_s=now - t_submit, itl_s=None,
                        error=why, error_kind="unavailable_error")
