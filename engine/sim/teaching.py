"""The study's worked example as numbers: backend states, the real router's verdicts, and every
value the Teaching panel narrates. Qt-free and pure (no llama.cpp, no threads, no clock), so its
arithmetic is tested without a window; `ui/panels/teaching.py` only renders it.

The example is the article's requests 7 and 8: the GPU has 4 running requests with 124 then 122
tokens of decode budget left and 2 then 3 queued; the CPU is idle; every request is a 516-token
prompt whose first 496 tokens are cached on both backends, and generates 128 tokens. Each arrival
is routed by a fresh `engine.routing.Router` under `seed-score`, and every number here is read from
the resulting `RoutingDecision` (3.027 s stays on the GPU; 3.444 s > 3.118 s goes to the CPU), so
changing a rate or the cached prefix moves the verdicts.

Thread contract: none needed; every function builds new immutable values from its arguments.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from engine.core.snapshot import BackendSnapshot, Rates, WorkItem
from engine.routing import BackendScore, RouteQuery, Router, RoutingDecision

# The article's rates (Apple M2, Qwen2.5-0.5B, profiled alone).
ARTICLE_RATES: Mapping[str, Rates] = {"gpu": Rates(2551.0, 293.0, source="article"),
                                      "cpu": Rates(73.0, 45.0, source="article")}
PROMPT, CACHED, MAX_TOKENS, CAP = 516, 496, 128, 4
ARRIVAL_GAP_S = 0.05
# Where the article's eight requests went.
ARTICLE_CHOICES = ("gpu",) * 7 + ("cpu",)


@dataclass(frozen=True)
class Arrival:
    """One arrival of the worked example: the states the router saw and what it decided."""

    number: int
    gpu_left: int  # decode budget left on each of the 4 running GPU requests
    gpu_queued: int
    query: RouteQuery
    snapshots: tuple[BackendSnapshot, BackendSnapshot]
    decision: RoutingDecision

    @property
    def gpu(self) -> BackendScore:
        return self.decision.score_of("gpu")

    @property
    def cpu(self) -> BackendScore:
        return self.decision.score_of("cpu")

    @property
    def prompt_left(self) -> int:
        """Prompt tokens each waiting request (and the new one) still has to compute on the GPU."""
        return self.query.prefill_on("gpu")


def study_snapshots(gpu_left: int, gpu_queued: int, rates: Mapping[str, Rates] = ARTICLE_RATES,
                    cached: int = CACHED, prompt: int = PROMPT,
                    max_tokens: int = MAX_TOKENS) -> tuple[BackendSnapshot, BackendSnapshot]:
    """The GPU with 4 running (`gpu_left` budget each) + `gpu_queued` queued; the CPU idle."""
    running = tuple(WorkItem(f"run-{i + 1}", True, prompt, cached, 0, gpu_left, max_tokens - gpu_left)
                    for i in range(CAP))
    queued = tuple(WorkItem(f"queued-{i + 1}", False, prompt, cached, prompt - cached, max_tokens)
                   for i in range(gpu_queued))
    gpu = BackendSnapshot("gpu", "gpu", CAP, 4096, rates["gpu"], running + queued)
    cpu = BackendSnapshot("cpu", "cpu", CAP, 4096, rates["cpu"], ())
    return gpu, cpu


def replay_arrival(number: int, gpu_left: int, gpu_queued: int, rates: Mapping[str, Rates] = ARTICLE_RATES,
                   cached: int = CACHED) -> Arrival:
    """Route one arrival of the worked example through a fresh seed-score `Router`."""
    snaps = study_snapshots(gpu_left, gpu_queued, rates, cached)
    query = RouteQuery(f"request-{number}", PROMPT, MAX_TOKENS, {"gpu": cached, "cpu": cached})
    decision = Router("seed-score").route(query, snaps)
    return Arrival(number, gpu_left, gpu_queued, query, snaps, decision)


def study_arrivals(rates: Mapping[str, Rates] = ARTICLE_RATES, cached: int = CACHED) -> tuple[Arrival, Arrival]:
    """Requests 7 and 8 as the article describes them."""
    return (replay_arrival(7, 124, 2, rates, cached), replay_arrival(8, 122, 3, rates, cached))


def gpu_decode_to_keep(arrival: Arrival) -> float:
    """The GPU decode rate at which this arrival's GPU score would equal the CPU's."""
    gpu, cpu = arrival.gpu, arrival.cpu
    room = cpu.score_s - gpu.prefill_s
    return gpu.decode_tokens / room if room > 0 else math.inf


def score_formula(score: BackendScore) -> str:
    """'prefill tokens/prefill rate + decode tokens/decode rate', as the narration writes it."""
    return (f"{score.prefill_tokens:.0f}/{score.rates.prefill_tok_s:g} + "
            f"{score.decode_tokens:.0f}/{score.rates.decode_tok_s:g}")


@dataclass(frozen=True)
class GpuSum:
    """The terms of the GPU's score for one arrival, as the narration adds them up."""

    queued: int
    prompt_left: int  # per waiting request and for the new one
    queued_budget: int  # queued × max_tokens
    running_budget: int  # cap × budget left per running request
    new_budget: int
    score: BackendScore


def gpu_sum(arrival: Arrival) -> GpuSum:
    return GpuSum(arrival.gpu_queued, arrival.prompt_left, arrival.gpu_queued * MAX_TOKENS,
                  CAP * arrival.gpu_left, MAX_TOKENS, arrival.gpu)


@dataclass(frozen=True)
class Verdict:
    """Where an arrival went and the comparison that sent it there."""

    number: int
    backend: str
    gpu_s: float
    cpu_s: float
    relation: str  # "<", "=" or ">": the GPU's score against the CPU's
    reason: str  # the router's own record

    @property
    def stays_on_gpu(self) -> bool:
        return self.backend == "gpu"


def verdict(arrival: Arrival) -> Verdict:
    g, c = arrival.gpu.score_s, arrival.cpu.score_s
    relation = "<" if g < c else "=" if g == c else ">"
    return Verdict(arrival.number, arrival.decision.backend, g, c, relation, arrival.decision.reason)


@dataclass(frozen=True)
class Boundary:
    """Where the verdict of request 8 would flip, and what the idle CPU costs without the cache."""

    keep_decode_tok_s: float  # the GPU decode rate that would keep request 8
    gpu_decode_tok_s: float  # the GPU decode rate in use
    uncached_cpu_formula: str
    uncached_cpu_s: float


def boundary(arrivals: tuple[Arrival, Arrival], rates: Mapping[str, Rates]) -> Boundary:
    c = rates["cpu"]
    return Boundary(gpu_decode_to_keep(arrivals[1]), rates["gpu"].decode_tok_s,
                    f"{PROMPT}/{c.prefill_tok_s:g} + {MAX_TOKENS}/{c.decode_tok_s:g}",
                    PROMPT / c.prefill_tok_s + MAX_TOKENS / c.decode_tok_s)


@dataclass(frozen=True)
class Step:
    """One step of the replay: its title, what it explains, and the arrival its chart shows."""

    title: str
    kind: str  # "setup", "arrival", "gpu-score", "verdict" or "boundary"
    arrival: int | None  # index into the arrivals, or None when the chart is empty


def teaching_steps(arrivals: tuple[Arrival, Arrival]) -> list[Step]:
    """The replay's steps in order: the setup, three per arrival, then the boundary."""
    steps = [Step("The setup", "setup", None)]
    for k, a in enumerate(arrivals):
        when = "" if k == 0 else f" — {ARRIVAL_GAP_S * 1000:.0f} ms later"
        steps.append(Step(f"Request {a.number} arrives{when}", "arrival", k))
        steps.append(Step(f"Request {a.number}: the GPU's score", "gpu-score", k))
        steps.append(Step(f"Request {a.number}: the CPU's score, and the verdict", "verdict", k))
    steps.append(Step("Where the boundary lies", "boundary", len(arrivals) - 1))
    return steps
