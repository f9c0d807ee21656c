"""Routing: which backend takes a whole new request.

Policies are pure functions over `BackendSnapshot`s (no model, no threads), so they are tested
with hand-built snapshots and replayed from recorded decisions. One module per policy, with
its help text beside it; `registry` names them; `router.Router` holds the current one and the
recent decisions; `types` holds the query, score and decision values; `budget` the study's
decode-budget modes.

- `finish-first:pack` (`default`, `default.py`): where the request's last token comes first, with
  the queue, the cache and the batch it joins counted; a device's contexts packed while its
  requests start fresh, shared out once it serves conversations. The default. `finish-first`:
  the same, never packed.
- `seed-score` (`seed_score.py`): the study's score, exactly (docs/study.md's golden numbers).
- `predicted-finish` (`predicted_finish.py`): finish time with decode budgets reserved in KV.
- `cache-aware` (`cache_aware.py`): prefix affinity for whole tenants, load-balanced.
- `least-work`, `round-robin`, `only:NAME` / `gpu-only` / `cpu-only`: baselines.
"""

from .budget import BUDGET_MODES, RAW, DecodeBudget, NewTokenRatio
from .cache_aware import CacheAware, RecentPrefixes
from .default import FinishFirst, finish_time
from .least_work import LeastWork
from .only import OnlyBackend
from .policy import Policy
from .predicted_finish import PredictedFinish, predicted_finish, predicted_first_token
from .registry import DEFAULT, DEFAULT_POLICY, HELP, POLICIES, make_policy, policy_names, resolve
from .round_robin import RoundRobin
from .router import DEFAULT_HISTORY, Router
from .seed_score import SeedScore, seed_score
from .types import BackendScore, RouteQuery, RoutingDecision

__all__ = [
    "BUDGET_MODES", "DEFAULT", "DEFAULT_HISTORY", "DEFAULT_POLICY", "HELP", "POLICIES", "RAW", "BackendScore",
    "CacheAware", "DecodeBudget", "FinishFirst", "LeastWork", "NewTokenRatio", "OnlyBackend", "Policy",
    "PredictedFinish", "RecentPrefixes", "RoundRobin", "RouteQuery", "Router", "RoutingDecision", "SeedScore",
    "finish_time", "make_policy", "policy_names", "predicted_finish", "predicted_first_token", "resolve",
    "seed_score",
]
