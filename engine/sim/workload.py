"""Benchmark workloads: which prompts arrive when, and how long each one generates.

A `WorkloadSpec` describes a workload; `build_workload(spec, run)` turns it into concrete
`RequestSpec`s, deterministically from `spec.seed` (stdlib `random`, no numpy).

The workloads' choices, and why: docs/design/sim.md."""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from engine.core.tokenizer import TOKEN_HIGH, TOKEN_LOW  # re-exported: the workloads' token range

SEED_PREFIX_TOKENS = 496
SEED_SUFFIX_TOKENS = 20
SEED_GEN_TOKENS = 128
SEED_INTERVAL_S = 0.05

OUTPUT_MODES = ("fixed", "uniform")
ARRIVAL_MODES = ("interval", "poisson", "gamma")

# Common English words of at most three letters. With a leading space each is one token in
# Qwen2.5's and SmolLM2's vocabularies, and in the synthetic models' at Qwen2.5's size (every
# "▁" + up to three letters is a piece there; `engine.llama.synthetic`): T words are ~T tokens.
WORDS = tuple(dict.fromkeys("""the of and to in is it for on as was at by be are or not but had his you one
all her she can an has if who so no out up do any two may new its our way use see day man old end
few put run set top yes yet big far low own red win ago air art bad bed box boy car cut dog eat eye
fly fun hit hot job key law lay leg let lie lot mix net nor oil pay per sea sit six sky son sun tax
ten tie toy try war web why age arm ask bag bit bus buy cup dry egg fit gas hat ice kid map mom""".split()))



@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    """A workload's recipe. `prompt_tokens = shared_tokens + distinct tokens per request`."""

    n_requests: int
    prompt_tokens: int = SEED_PREFIX_TOKENS + SEED_SUFFIX_TOKENS
    shared_tokens: int = SEED_PREFIX_TOKENS
    output: str = "fixed"  # fixed | uniform
    gen_tokens: int = SEED_GEN_TOKENS  # fixed output length
    min_output: int = 16  # uniform output length range, inclusive
    max_output: int = 256  # also the budget (max_tokens) of uniform requests
    arrival: str = "interval"  # interval | poisson | gamma
    interval_s: float = SEED_INTERVAL_S
    rate: float = 0.0  # requests/s for poisson/gamma; 0 means 1 / interval_s
    burstiness: float = 1.0  # gamma shape; 1 = Poisson
    identical: bool = False  # every prompt the same tokens (no per-request suffix)
    seed: int = 0
    vocab_size: int = TOKEN_HIGH
    tenants: int = 0  # K > 0: K tenant prefixes of shared_tokens each (see the module docstring)
    tenant_skew: str = "zipf"  # uniform | zipf | zipf:S
    label: str = ""

    def validate(self) -> WorkloadSpec:
        """Raise ValueError naming the first bad field; return self."""
        checks = [
            ("n_requests", self.n_requests >= 1, ">= 1"),
            ("prompt_tokens", self.prompt_tokens >= 1, ">= 1"),
            ("shared_tokens", 0 <= self.shared_tokens <= self.prompt_tokens, "in [0, prompt_tokens]"),
            ("output", self.output in OUTPUT_MODES, f"one of {', '.join(OUTPUT_MODES)}"),
            ("gen_tokens", self.gen_tokens >= 1, ">= 1"),
            ("min_output", 1 <= self.min_output <= self.max_output, "in [1, max_output]"),
            ("arrival", self.arrival in ARRIVAL_MODES, f"one of {', '.join(ARRIVAL_MODES)}"),
            ("interval_s", self.interval_s >= 0, ">= 0"),
            ("rate", self.rate >= 0 and (self.rate > 0 or self.interval_s > 0 or self.arrival == "interval"),
             "> 0 (or a positive interval_s) for poisson/gamma arrivals"),
            ("burstiness", self.burstiness > 0, "> 0"),
            ("vocab_size", self.vocab_size > TOKEN_LOW + 1, f"> {TOKEN_LOW + 1}"),
            ("tenants", self.tenants >= 0 and (self.tenants == 0 or self.shared_tokens > 0),
             ">= 0, with a shared prefix (shared_tokens > 0) when > 0"),
            ("tenant_skew", _skew_ok(self.tenant_skew), "uniform, zipf or zipf:S with S >= 0"),
        ]
        for name, ok, allowed in checks:
            if not ok:
                raise ValueError(f"workload {name} must be {allowed}, got {getattr(self, name)!r}")
        return self

    @property
    def shared_fraction(self) -> float:
        return self.shared_tokens / self.prompt_tokens

    @property
    def max_tokens(self) -> int:
        """The decode budget every request carries."""
        return self.gen_tokens if self.output == "fixed" else self.max_output

    @property
    def arrival_rate(self) -> float:
        """Requests per second on average."""
        if self.arrival == "interval":
            return 1.0 / self.interval_s if self.interval_s > 0 else math.inf
        return self.rate or 1.0 / self.interval_s

    def name(self) -> str:
        """A short label for tables: the given one, or the varied dimensions."""
        if self.label:
            return self.label
        arrival = (f"every {self.interval_s * 1e3:g} ms" if self.arrival == "interval"
                   else f"{self.arrival} {self.arrival_rate:g}/s" + (f" b={self.burstiness:g}" if self.arrival == "gamma" else ""))
        out = f"out {self.gen_tokens}" if self.output == "fixed" else f"out {self.min_output}-{self.max_output}"
        if self.tenants:
            return (f"{self.tenants} tenants x {self.shared_tokens} ({self.tenant_skew}) "
                    f"+ {self.prompt_tokens - self.shared_tokens}, {out}, {arrival}")
        return f"shared {self.shared_fraction:.0%}, {out}, {arrival}"

    def to_dict(self) -> dict:
        d = asdict(self)
        d["name"] = self.name()
        d["shared_fraction"] = round(self.shared_fraction, 4)
        d["max_tokens"] = self.max_tokens
        return d


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """One request of a built workload.

    `max_tokens` is the budget the request declares; `output_tokens` how many it should
    generate (equal for fixed output; see the module docstring for uniform output).
    """

    index: int
    arrival_s: float
    prompt: tuple[int, ...] = field(repr=False)
    max_tokens: int
    output_tokens: int
    tenant: int = -1  # -1: no tenants
    text: str = field(default="", repr=False)  # the prompt as text (see the module docstring)
    prefix_chars: int = 0  # text[:prefix_chars] is the shared (tenant's) prefix text


@dataclass(frozen=True, slots=True)
class Workload:
    spec: WorkloadSpec
    run: int
    prefix: tuple[int, ...]  # what to warm on every backend before timing starts
    requests: tuple[RequestSpec, ...]
    prefixes: tuple[tuple[int, ...], ...] = ()  # tenants' prefixes (not warmed unless asked)
    prefix_texts: tuple[str, ...] = ()  # the shared prefix's (or each tenant's) text

    @property
    def duration_s(self) -> float:
        """When the last request arrives."""
        return self.requests[-1].arrival_s if self.requests else 0.0


def seed_workload(n_requests: int, *, prefix_tokens: int = SEED_PREFIX_TOKENS,
                  suffix_tokens: int = SEED_SUFFIX_TOKENS, gen_tokens: int = SEED_GEN_TOKENS,
                  interval_s: float = SEED_INTERVAL_S, **kw: Any) -> WorkloadSpec:
    """The study's workload (docs/study.md); sizes can be shrunk for tests."""
    return WorkloadSpec(n_requests=n_requests, prompt_tokens=prefix_tokens + suffix_tokens,
                        shared_tokens=prefix_tokens, gen_tokens=gen_tokens, interval_s=interval_s,
                        label=kw.pop("label", "seed"), **kw).validate()


def shared_tokens_for(fraction: float, prompt_tokens: int) -> int:
    """Shared-prefix length for a fraction of the prompt, rounded up (96 % of 516 is the seed's 496)."""
    if not 0 <= fraction <= 1:
        raise ValueError(f"shared fraction must be in [0, 1], got {fraction}")
    return min(prompt_tokens, math.ceil(fraction * prompt_tokens - 1e-9))


def build_workload(spec: WorkloadSpec, run: int = 0) -> Workload:
    """Concrete prompts, lengths and arrival times for run `run` (deterministic)."""
    spec.validate()
    high = min(spec.vocab_size, TOKEN_HIGH)
    n_prefixes = spec.tenants or 1
    # Tenant 0 (or the single shared prefix) keeps the seed's original prefix stream.
    prefixes = tuple(_tokens(random.Random(f"{spec.seed}:prefix" + (f":{k}" if k else "")), spec.shared_tokens, high)
                     for k in range(n_prefixes))
    texts = tuple(_words(random.Random(f"{spec.seed}:prefix-text:{k}"), spec.shared_tokens)
                  for k in range(n_prefixes))
    rng = random.Random(f"{spec.seed}:{run}:requests")
    text_rng = random.Random(f"{spec.seed}:{run}:text")
    n_distinct = spec.prompt_tokens - spec.shared_tokens
    same_suffix = _tokens(rng, n_distinct, high) if spec.identical else None
    same_text = _words(text_rng, n_distinct) if spec.identical else None
    lengths = output_lengths(spec, random.Random(f"{spec.seed}:{run}:lengths"))
    arrivals = arrival_times(spec, random.Random(f"{spec.seed}:{run}:arrivals"))
    tenants = tenant_draws(spec, random.Random(f"{spec.seed}:{run}:tenants"))
    requests = []
    for i in range(spec.n_requests):
        suffix = same_suffix if same_suffix is not None else _tokens(rng, n_distinct, high)
        suffix_text = same_text if same_text is not None else _words(text_rng, n_distinct)
        k = tenants[i] if spec.tenants else 0
        requests.append(RequestSpec(index=i, arrival_s=arrivals[i], prompt=prefixes[k] + suffix,
                                    max_tokens=spec.max_tokens, output_tokens=lengths[i],
                                    tenant=k if spec.tenants else -1, text=texts[k] + suffix_text,
                                    prefix_chars=len(texts[k])))
    return Workload(spec=spec, run=run, prefix=() if spec.tenants else prefixes[0], requests=tuple(requests),
                    prefixes=prefixes if spec.tenants else (), prefix_texts=texts)


def tenant_weights(spec: WorkloadSpec) -> list[float]:
    """Each tenant's probability under `spec.tenant_skew` (sums to 1)."""
    mode, _, s = spec.tenant_skew.partition(":")
    k = max(spec.tenants, 1)
    raw = [1.0] * k if mode == "uniform" else [1.0 / (i + 1) ** (float(s) if s else 1.0) for i in range(k)]
    total = sum(raw)
    return [w / total for w in raw]


def tenant_draws(spec: WorkloadSpec, rng: random.Random) -> list[int]:
    """The tenant of each request (all 0 without tenants)."""
    if not spec.tenants:
        return [0] * spec.n_requests
    return rng.choices(range(spec.tenants), weights=tenant_weights(spec), k=spec.n_requests)


def tokenized(workload: Workload, tokenize: Callable[[str, bool], Sequence[int]]) -> Workload:
    """`workload` with every prompt replaced by its text's tokens: `tokenize(text, first)` is
    called on the shared prefix text (`first=True`: the model may add its BOS) and on the
    request's own text (`first=False`) separately, so prompts of one tenant share their prefix
    tokens exactly. Each distinct prefix is tokenized once."""
    cache: dict[str, tuple[int, ...]] = {}

    def prefix_tokens(text: str) -> tuple[int, ...]:
        if text not in cache:
            cache[text] = tuple(tokenize(text, True))
        return cache[text]

    requests = tuple(replace(r, prompt=prefix_tokens(r.text[:r.prefix_chars]) + tuple(tokenize(r.text[r.prefix_chars:], False)))
                     for r in workload.requests)
    prefixes = tuple(prefix_tokens(t) for t in workload.prefix_texts) if workload.prefixes else ()
    prefix = prefix_tokens(workload.prefix_texts[0]) if workload.prefix else ()
    return replace(workload, prefix=prefix, prefixes=prefixes, requests=requests)


def output_lengths(spec: WorkloadSpec, rng: random.Random) -> list[int]:
    if spec.output == "fixed":
        return [spec.gen_tokens] * spec.n_requests
    return [rng.randint(spec.min_output, spec.max_output) for _ in range(spec.n_requests)]


def arrival_times(spec: WorkloadSpec, rng: random.Random) -> list[float]:
    """Seconds from the first submission; the first request arrives at 0."""
    n = spec.n_requests
    if spec.arrival == "interval":
        return [i * spec.interval_s for i in range(n)]
    rate = spec.arrival_rate
    shape = 1.0 if spec.arrival == "poisson" else spec.burstiness
    gaps = [rng.gammavariate(shape, 1.0 / (rate * shape)) for _ in range(n - 1)]
    total = sum(gaps)
    if total > 0:  # rescale: the offered load is exactly `rate`
        gaps = [g * (n - 1) / rate / total for g in gaps]
    times = [0.0]
    for g in gaps:
        times.append(times[-1] + g)
    return times


def with_requests(spec: WorkloadSpec, n: int) -> WorkloadSpec:
    return replace(spec, n_requests=n).validate()


@dataclass(frozen=True, slots=True)
class RecordedTurn:
    """One turn of a recorded chat run, as `conversation_workload` needs it."""

    conversation: int
    turn: int  # 0-based
    index: int  # the record's index
    arrival_s: float  # when it was sent
    prompt_tokens: int
    max_tokens: int
    output_tokens: int


def conversation_workload(label: str, run: int, shared_tokens: int, turns: Sequence[RecordedTurn], *,
                          reply_token: int, vocab_size: int = TOKEN_HIGH) -> Workload:
    """A recorded chat run (`tandem bench chat`) as token prompts the simulator can replay.

    Each conversation's first prompt is the shared system prompt (`shared_tokens` ids, the same
    for every conversation) and ids of its own up to the recorded length; each later prompt is
    the previous one, the reply as the simulator writes it (`reply_token` repeated, the
    recorded number of times), then new ids up to the recorded length (at least one). So a
    conversation's next turn finds its prefix wherever the previous turn ran, as it did in the
    run; ids are random per conversation and run, so conversations share only the system
    prompt. Requests keep the records' indices and arrive when the records were sent."""
    rng = random.Random(f"chat-system-{run}")
    system = _tokens(rng, shared_tokens, vocab_size)
    prompts: dict[int, tuple[int, ...]] = {}
    requests = []
    by_turn = sorted(turns, key=lambda t: (t.conversation, t.turn))
    previous: dict[int, RecordedTurn] = {}
    for t in by_turn:
        own = random.Random(f"chat-{run}-{t.conversation}-{t.turn}")
        before = previous.get(t.conversation)
        if before is None:
            base = system[:t.prompt_tokens]
        else:
            base = prompts[before.index] + (reply_token,) * before.output_tokens
        prompt = base + _tokens(own, max(t.prompt_tokens - len(base), 1), vocab_size)
        prompts[t.index] = prompt
        previous[t.conversation] = t
        requests.append(RequestSpec(t.index, t.arrival_s, prompt, t.max_tokens, t.output_tokens))
    requests.sort(key=lambda r: (r.arrival_s, r.index))
    spec = WorkloadSpec(n_requests=max(len(requests), 1), prompt_tokens=max((len(r.prompt) for r in requests), default=1),
                        shared_tokens=0, label=label)
    return Workload(spec, run, (), tuple(requests))


# ---- internal helpers ----


def _tokens(rng: random.Random, n: int, high: int) -> tuple[int, ...]:
    return tuple(rng.randrange(TOKEN_LOW, high) for _ in range(n))


def _words(rng: random.Random, n: int) -> str:
    """n words, each with its leading space (so texts concatenate without merging tokens)."""
    return "".join(" " + rng.choice(WORDS) for _ in range(n))


def _skew_ok(text: str) -> bool:
    mode, colon, s = text.partition(":")
    if mode == "uniform":
        return not colon
    if mode != "zipf":
        return False
    if not colon:
        return True
    try:
        return float(s) >= 0 and math.isfinite(float(s))
    except ValueError:
        return False
