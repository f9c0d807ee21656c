"""`SeqState`: a request inside one backend, the unit the scheduler plans with (engine/sched/scheduler.py)
and the runner decodes (engine/llama/runner.py); vLLM keeps its `Request` apart from its scheduler
the same way (`vllm/v1/request.py`). Fields and their owners: the class's docstring."""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.core.request import Request, RequestStatus, SamplingParams
from engine.core.snapshot import WorkItem
from engine.core.textstream import TextStream
from engine.sched.prefix_cache import Pin

if TYPE_CHECKING:
    from engine.sched.sampler import Sampler


class SeqState:
    """A request inside a backend. The scheduler owns every field except `sampler`, `row`
    (the batch row of a prompt chunk's last token) and `prompt_logprobs`, which the runner sets."""

    __slots__ = (
        "admit_cap",
        "admit_reason",
        "choice",
        "error",
        "estimate",
        "generated",
        "handle",
        "itl_sum",
        "lock",
        "logprobs",
        "max_new",
        "n_hit",
        "n_past",
        "n_prompt",
        "n_shared",
        "paused_at",
        "pin",
        "preemptions",
        "prompt_logprobs",
        "ran_on",
        "req",
        "row",
        "sampler",
        "seq_id",
        "sp",
        "status",
        "stream",
        "t_admit",
        "t_first",
        "t_last",
        "t_submit",
        "tokens",
        "warm",
    )

    def __init__(self, req: Request, handle, pin, estimate: int, t_submit: float, warm: bool = False,
                 n_ctx_seq: int | None = None, choice: bool = False):
        self.req = req
        self.handle = handle
        self.sp: SamplingParams = req.sampling
        self.tokens = list(req.prompt_tokens)
        self.n_prompt = len(self.tokens)
        # max_tokens, clamped to what the context can hold after the prompt.
        room = (n_ctx_seq - self.n_prompt) if n_ctx_seq else self.sp.max_tokens
        self.max_new = max(1, min(self.sp.max_tokens, room))
        self.seq_id = -1
        self.ran_on = -1  # the id it last ran on (its sampler chain stays there)
        self.n_past = 0  # tokens whose KV is in the context
        self.n_shared = 0  # leading tokens aliased from the prefix cache (or published there)
        self.n_hit = 0  # cached tokens reused at its last admission (what its record reports)
        self.generated = 0
        self.sampler: Sampler | None = None
        self.stream = TextStream(self.sp.stop)
        self.pin = pin  # routing-time pin on the cached prefix, released at admission
        self.lock: Pin | None = None  # pin held while running, so the aliased prefix is never evicted
        self.estimate = estimate  # cached tokens the router counted on
        self.warm = warm
        self.t_submit = t_submit
        self.t_admit = self.t_first = self.t_last = 0.0
        self.itl_sum = 0.0
        self.row = -1
        self.status = RequestStatus.WAITING
        self.error: str | None = None
        self.preemptions = 0
        self.choice = choice  # one of a request's `n` choices: its prompt is always shared (module doc)
        # One TokenLogprob per generated token, when the request asked for logprobs.
        self.logprobs: list | None = [] if self.sp.logprobs is not None else None
        # One TokenLogprob per prompt token after the first, when the request asked for them.
        self.prompt_logprobs: list | None = [] if self.sp.prompt_logprobs else None
        self.paused_at = 0.0  # when the scheduler's `paused` predicate began to hold (0: it does not)
        self.admit_cap = 0  # the live cap when it was first admitted, and the limiter's reason then
        self.admit_reason = ""

    @property
    def prefilling(self) -> bool:
        """Tokens other than the next decode input still need computing."""
        return len(self.tokens) - self.n_past > 1 or self.n_past < self.n_prompt

    def work_item(self, running: bool) -> WorkItem:
        cached = self.n_shared if running else self.estimate
        return WorkItem(
            request_id=self.req.id,
            running=running,
            prompt_tokens=self.n_prompt,
            cached_tokens=cached,
            prefill_left=max(len(self.tokens) - max(self.n_past, cached) - (1 if self.generated else 0), 0),
            decode_left=0 if self.warm else self.max_new - self.generated,
            generated=self.generated,
        )
