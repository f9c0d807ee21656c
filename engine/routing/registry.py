"""The policies by name: `POLICIES`, `make_policy()` and each policy's one-line help (`HELP`,
what the app's policy list shows).

`default` names the default policy (`DEFAULT_POLICY`, today `finish-first:pack`): `--policy
default`, `--policies default,...` and the app's choice mean it, and a router made with it
reports the policy's own name, so `/v1/routing` and the app say which policy the default is.
"""

from __future__ import annotations

from collections.abc import Callable

from engine.core.errors import InvalidRequest

from .cache_aware import HELP as CACHE_AWARE_HELP
from .cache_aware import CacheAware, from_spec
from .default import HELP as DEFAULT_HELP
from .default import NAME as DEFAULT_NAME
from .default import PACK_HELP, PACK_NAME, FinishFirst, pack_from_spec
from .least_work import HELP as LEAST_WORK_HELP
from .least_work import LeastWork
from .only import HELP as ONLY_HELP
from .only import OnlyBackend
from .policy import Policy
from .predicted_finish import HELP as PREDICTED_FINISH_HELP
from .predicted_finish import PredictedFinish
from .round_robin import HELP as ROUND_ROBIN_HELP
from .round_robin import RoundRobin
from .seed_score import HELP as SEED_SCORE_HELP
from .seed_score import SeedScore

DEFAULT = "default"  # the name that means the default policy
DEFAULT_POLICY = PACK_NAME

POLICIES: dict[str, Callable[[], Policy]] = {
    DEFAULT_NAME: FinishFirst,
    PACK_NAME: lambda: FinishFirst(pack=True),
    "seed-score": SeedScore,
    "predicted-finish": PredictedFinish,
    "least-work": LeastWork,
    "round-robin": RoundRobin,
    "cache-aware": CacheAware,
    "gpu-only": lambda: OnlyBackend(device="gpu"),
    "cpu-only": lambda: OnlyBackend(device="cpu"),
}

HELP: dict[str, str] = {
    DEFAULT_NAME: DEFAULT_HELP,
    PACK_NAME: PACK_HELP,
    "seed-score": SEED_SCORE_HELP,
    "predicted-finish": PREDICTED_FINISH_HELP,
    "least-work": LEAST_WORK_HELP,
    "round-robin": ROUND_ROBIN_HELP,
    "cache-aware": CACHE_AWARE_HELP,
    **ONLY_HELP,
}


def resolve(name: str) -> str:
    """The policy a name means: `default` is `DEFAULT_POLICY`, any other name itself."""
    name = (name or "").strip()
    return DEFAULT_POLICY if name == DEFAULT else name


def policy_names() -> list[str]:
    """Every valid policy name, with `only:NAME` and `cache-aware:KEY=VALUE,...` as patterns."""
    return [DEFAULT, *POLICIES, "only:NAME", "cache-aware:KEY=VALUE,...", f"{PACK_NAME}:KEY=VALUE,..."]


def make_policy(name: str) -> Policy:
    """A fresh policy for `name`; InvalidRequest otherwise.

    `name` is `default`, a `POLICIES` key, `only:NAME`, `cache-aware:` with `CacheAware`'s
    parameters, e.g. `cache-aware:cache_threshold=0.3,balance_abs=8`, or `finish-first:pack:` with
    its own, e.g. `finish-first:pack:min_contexts=2,fill=16` (the policy's name is then that spec
    with the parameters in a fixed order, so `Router.clear()` rebuilds the same policy).
    """
    name = resolve(name)
    if name in POLICIES:
        return POLICIES[name]()
    if name.startswith("only:") and name[len("only:"):].strip():
        return OnlyBackend(backend=name[len("only:"):].strip())
    if name.startswith("cache-aware:"):
        return from_spec(name)
    if name.startswith(PACK_NAME + ":"):
        return pack_from_spec(name)
    raise InvalidRequest(
        f"unknown routing policy {name!r}; valid: {', '.join(policy_names())}", param="policy"
    )
