"""Ratios from one `tandem bench grid` result folder, printed by the GPU steps (stdlib only).

    python3 scripts/gpu/ratios.py tenants DIR          # output tok/s at K tenants / at the fewest, per policy
    python3 scripts/gpu/ratios.py pairs DIR A/B ...    # output tok/s of policy A / policy B, per workload
    python3 scripts/gpu/ratios.py caps DIR             # adaptive cap vs the best fixed cap, per workload
    python3 scripts/gpu/ratios.py defaults DIR [LABEL [fixed]]  # the default (row LABEL, `default`) vs the best
                                                       # tuned row (every other row; `fixed`: fixed-cap rows only)
    python3 scripts/gpu/ratios.py runs DIR             # each run of each row from requests.csv: its last token,
                                                       # TTFT and ITL p50, prompt tokens computed, requests per backend
    python3 scripts/gpu/ratios.py ttft DIR             # each row over all its runs: TTFT p10 ... p99, prompts that
                                                       # missed their prefix, and why a Tandem peer routed as it did
    python3 scripts/gpu/ratios.py seq DIR...           # workloads run in sequence on the same servers (`run.sh
                                                       # seq_history`): per step, each server's makespan, TTFT
                                                       # p50 and failures, the default (row `default`) over the
                                                       # best `tuned-*` row, and chat_temp over chat per server

Every ratio compares rows of the same invocation (runs interleaved), never across calls.
"""

from __future__ import annotations

import csv
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path


def _rows(folder: str) -> tuple[list[dict], dict]:
    summary = json.loads((Path(folder) / "summary.json").read_text())
    tenants = {w["name"]: w.get("tenants", 0) for w in summary["workloads"]}
    return summary["results"], tenants


def _mean(row: dict, key: str) -> float:
    return row[key]["mean"] or float("nan")


def _runs(row: dict, key: str = "makespan_s") -> str:
    values = row[key].get("values") or []
    return " [" + " ".join(f"{v:.2f}" for v in values) + "]" if len(values) > 1 else ""


def tenants(folder: str) -> None:
    rows, k_of = _rows(folder)
    by_policy: dict[str, dict[int, float]] = defaultdict(dict)
    for r in rows:
        by_policy[r["policy"]][k_of[r["workload"]]] = _mean(r, "output_tok_s")
    for policy, rates in sorted(by_policy.items()):
        low = min(rates)
        parts = [f"{k} tenants {v:,.0f} tok/s ({v / rates[low]:.2f}x)" for k, v in sorted(rates.items())]
        print(f"{policy}: " + ", ".join(parts) + f"   [target: >= 0.90x of {low} tenants]")


def pairs(folder: str, specs: list[str]) -> None:
    rows, _ = _rows(folder)
    rate = {(r["workload"], r["policy"]): _mean(r, "output_tok_s") for r in rows}
    for spec in specs:
        a, _, b = spec.partition("/")
        for workload in sorted({w for w, _ in rate}):
            if (workload, a) in rate and (workload, b) in rate:
                print(f"{workload}: {a} / {b} = {rate[workload, a]:,.0f} / {rate[workload, b]:,.0f} tok/s "
                      f"= {rate[workload, a] / rate[workload, b]:.3f}   [target: within 0.95-1.05]")


def caps(folder: str) -> None:
    rows, _ = _rows(folder)
    by_workload: dict[str, dict[str, dict]] = defaultdict(dict)
    for r in rows:
        by_workload[r["workload"]][r["policy"]] = r
    for workload, variants in by_workload.items():
        fixed = {p: r for p, r in variants.items() if "@cap=" in p and not p.endswith("@cap=auto")}
        # the adaptive rows: `POLICY@cap=auto`, or the policy alone on a backend loaded without a cap
        auto = [r for p, r in variants.items() if p.endswith("@cap=auto") or "@cap=" not in p]
        if not fixed or not auto:
            continue
        best_name, best = min(fixed.items(), key=lambda kv: _mean(kv[1], "makespan_s"))
        print(f"{workload}:")
        for p, r in sorted(fixed.items(), key=lambda kv: int(kv[0].rpartition("=")[2])):
            print(f"  {p}: makespan {_mean(r, 'makespan_s'):.3f} s, TTFT p95 {_mean(r, 'ttft_p95_s'):.3f} s")
        for a in auto:
            m = _mean(a, "makespan_s") / _mean(best, "makespan_s")
            t = _mean(a, "ttft_p95_s") / _mean(best, "ttft_p95_s")
            print(f"  {a['policy']} (adaptive): makespan {_mean(a, 'makespan_s'):.3f} s, TTFT p95 "
                  f"{_mean(a, 'ttft_p95_s'):.3f} s -> {m:.3f}x / {t:.2f}x the best fixed cap ({best_name})"
                  f"   [target: <= 1.05x / <= 1x]")


def defaults(folder: str, label: str = "default", only: str = "") -> None:
    """Per workload: the default row's makespan and TTFT p50 over those of the tuned row with the
    lowest makespan (every other row: fixed caps, other layouts, HTTP targets; with `only` =
    "fixed", the fixed-cap rows `POLICY@cap=N`; with "tuned", those, `target:two-contexts` and
    the servers labelled `tuned-*`, the tuned single-GPU configurations, so other candidate
    layouts are not counted as tuned). Means over the runs, each run's makespan in brackets."""
    rows, _ = _rows(folder)
    by_workload: dict[str, dict[str, dict]] = defaultdict(dict)
    for r in rows:
        by_workload[r["workload"]][r["policy"]] = r
    for workload, variants in by_workload.items():
        mine = variants.get(label)
        fixed = {p for p in variants if "@cap=" in p and not p.endswith("@cap=auto")}
        served = {p for p in variants if p.startswith("target:tuned-")}
        allowed = {"fixed": fixed, "tuned": fixed | served | {"target:two-contexts"}}.get(only)
        tuned = {p: r for p, r in variants.items() if p != label and (allowed is None or p in allowed)}
        if mine is None or not tuned:
            print(f"{workload}: no {label!r} row or no tuned row")
            continue
        best_name, best = min(tuned.items(), key=lambda kv: _mean(kv[1], "makespan_s"))
        m = _mean(mine, "makespan_s") / _mean(best, "makespan_s")
        t = _mean(mine, "ttft_p50_s") / _mean(best, "ttft_p50_s")
        others = ", ".join(f"{p} {_mean(r, 'makespan_s'):.3f} s" for p, r in tuned.items())
        verdict = "met" if m <= 1.03 and t <= 1.10 else "NOT met"
        print(f"{workload}: {label} makespan {_mean(mine, 'makespan_s'):.3f} s{_runs(mine)}, TTFT p50 "
              f"{_mean(mine, 'ttft_p50_s'):.3f} s -> {m:.3f}x / {t:.2f}x the best tuned row ({best_name}: "
              f"{_mean(best, 'makespan_s'):.3f} s{_runs(best)}, {_mean(best, 'ttft_p50_s'):.3f} s)   "
              f"[target: <= 1.03x / <= 1.10x: {verdict}]   tuned: {others}")


def runs(folder: str) -> None:
    """One line per workload, row and run, from the folder's requests.csv: what a mean over runs
    hides (a run slower than its siblings, and where its requests went)."""
    groups: dict[tuple[str, str, int], list[dict]] = defaultdict(list)
    with open(Path(folder) / "requests.csv", newline="") as f:
        for r in csv.DictReader(f):
            groups[(r["workload"], r["policy"], int(r["run"]))].append(r)
    for (workload, policy, run), rows in sorted(groups.items()):
        ok = [r for r in rows if r["success"] == "True"]
        end = max((float(r["t_submit_s"]) + float(r["e2e_s"]) for r in ok), default=0.0)
        ttft = statistics.median(float(r["ttft_s"]) for r in ok) if ok else 0.0
        itls = [float(r["itl_s"]) for r in ok if r["itl_s"]]
        itl = statistics.median(itls) if itls else 0.0
        computed = sum(int(r["prompt_tokens"]) - int(r["cached_tokens"] or 0) for r in ok)
        split = defaultdict(int)
        for r in rows:
            split[r["backend"]] += 1
        where = " ".join(f"{b} {n}" for b, n in sorted(split.items()))
        print(f"{workload} | {policy} | run {run}: last token {end:.2f} s, TTFT p50 {ttft * 1000:.0f} ms, "
              f"ITL p50 {itl * 1000:.1f} ms, {computed:,} prompt tokens computed, "
              f"{len(rows) - len(ok)} failed | {where}")


# What a Tandem router's reasons say (decisions.jsonl, a peer's /v1/routing), phrase -> label.
REASONS = (("kept in use)", "a context opened to keep the minimum in use"),
           ("every context in use is full", "a context opened, all in use full"),
           ("the tenant moves to", "a tenant moved to a less loaded context"),
           ("are uneven", "loads uneven"),
           ("beyond balance", "loads beyond balance"),
           ("no backend holds", "no context held the prompt"),
           ("serves conversations", "conversations shared out"))


def _ms(values, quantiles) -> list[float]:
    """Each quantile of `values` (seconds) in milliseconds: the value at rank p * n."""
    values = sorted(values)
    return [values[min(len(values) - 1, int(p * len(values)))] * 1000 for p in quantiles]


def ttft(folder: str) -> None:
    """One line per workload and row over all its runs: TTFT quantiles, the requests whose prompt
    was mostly computed (less than half cached: a prefix missed), and, where the folder holds a
    Tandem peer's decisions, how often each kind of reason came up and how long its routing took
    (p50 / p99 ms: waiting for the routing lock, then deciding)."""
    groups: dict[tuple[str, str], list[dict]] = defaultdict(list)
    with open(Path(folder) / "requests.csv", newline="") as f:
        for r in csv.DictReader(f):
            groups[(r["workload"], r["policy"])].append(r)
    said: dict[tuple[str, str], dict[str, int]] = defaultdict(lambda: defaultdict(int))
    timed: dict[tuple[str, str], list[tuple[float, float]]] = defaultdict(list)
    path = Path(folder) / "decisions.jsonl"
    for line in path.read_text().splitlines() if path.exists() else []:
        d = json.loads(line)
        key = (d.get("workload", ""), d.get("label", ""))
        for phrase, label in REASONS:
            if phrase in (d.get("reason") or ""):
                said[key][label] += 1
        if "took_s" in d:
            timed[key].append((d.get("wait_s") or 0.0, d["took_s"]))
    for (workload, policy), rows in sorted(groups.items()):
        ok = [float(r["ttft_s"]) for r in rows if r["success"] == "True"]
        if not ok:
            continue
        quantiles = (0.1, 0.25, 0.5, 0.75, 0.9, 0.99)
        q = " ".join(f"p{int(p * 100)} {v:.0f}" for p, v in zip(quantiles, _ms(ok, quantiles)))
        missed = sum(int(r["cached_tokens"] or 0) * 2 < int(r["prompt_tokens"]) for r in rows if r["success"] == "True")
        short = (workload.split(", kv ")[0], policy)  # decisions name it without the bench's ", kv N seqs"
        key = short if short in said or short in timed else (workload, policy)
        why = "; ".join(f"{label} {n}" for label, n in said.get(key, {}).items())
        times = timed.get(key, [])
        took = ""
        if times:
            waited, spent = (_ms(part, (0.5, 0.99)) for part in zip(*times))
            took = f" | routing ms p50/p99: waited {waited[0]:.2f}/{waited[1]:.2f}, took {spent[0]:.2f}/{spent[1]:.2f}"
        print(f"{workload} | {policy} | TTFT ms {q} | {missed} of {len(ok)} missed their prefix"
              + (f" | {why}" if why else "") + took)


def _label(policy: str) -> str:
    return policy.removeprefix("target:")


def seq(folders: list[str]) -> None:
    """Per step folder (in the order run), each row and the default against the best tuned row;
    then each server's temperature chats over its greedy chats (folders named chat and chat_temp)."""
    means: dict[str, dict[str, float]] = {}
    for folder in folders:
        if not (Path(folder) / "summary.json").exists():
            print(f"{Path(folder).name}: no summary.json (the step did not finish)")
            continue
        rows, _ = _rows(folder)
        step = Path(folder).name
        by = {_label(r["policy"]): r for r in rows}
        means[step] = {k: _mean(r, "makespan_s") for k, r in by.items()}
        cells = ", ".join(f"{k} {_mean(r, 'makespan_s'):.2f} s{_runs(r)} / {1e3 * _mean(r, 'ttft_p50_s'):.0f} ms"
                          + (f" ({r['failed']} failed)" if r.get("failed") else "") for k, r in by.items())
        line = f"{step}: {cells}"
        tuned = {k: r for k, r in by.items() if k.startswith("tuned-")}
        if "default" in by and tuned:
            best_name, best = min(tuned.items(), key=lambda kv: _mean(kv[1], "makespan_s"))
            m = _mean(by["default"], "makespan_s") / _mean(best, "makespan_s")
            t = _mean(by["default"], "ttft_p50_s") / _mean(best, "ttft_p50_s")
            line += (f"  | default / best tuned ({best_name}): {m:.3f}x makespan, {t:.2f}x TTFT p50 "
                     f"[target <= 1.03x / <= 1.10x: {'met' if m <= 1.03 and t <= 1.10 else 'NOT met'}]")
        print(line)
    greedy, temp = means.get("chat", {}), means.get("chat_temp", {})
    for k in greedy:
        if k in temp:
            r = temp[k] / greedy[k]
            print(f"{k}: chats at temperature / greedy = {temp[k]:.2f} / {greedy[k]:.2f} s = {r:.3f}x "
                  f"[target <= 1.05x: {'met' if r <= 1.05 else 'NOT met'}]")


def main(argv: list[str]) -> int:
    if len(argv) >= 2 and argv[0] == "seq":
        seq(argv[1:])
        return 0
    if len(argv) < 2 or argv[0] not in ("tenants", "pairs", "caps", "defaults", "runs", "ttft"):
        print(__doc__, file=sys.stderr)
        return 2
    kind, folder = argv[0], argv[1]
    if kind == "tenants":
        tenants(folder)
    elif kind == "pairs":
        pairs(folder, argv[2:])
    elif kind == "defaults":
        defaults(folder, *argv[2:4])
    elif kind == "runs":
        runs(folder)
    elif kind == "ttft":
        ttft(folder)
    else:
        caps(folder)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
