"""Writing a benchmark's results: summary.json, requests.csv, decisions.jsonl, results.md and
PNG plots (makespan by policy, TTFT CDF).

Plots need matplotlib, which the GPU machine lacks: without it they are skipped, and
`summary.json` and `results.md` say so (`plots_skipped`). Non-finite numbers are written to
JSON as null.
"""

from __future__ import annotations

import csv
import json
import lzma
import math
import subprocess
import sys
from dataclasses import asdict, fields
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from engine.rates.store import file_fingerprint
from engine.sim.benchmark import CSV_FIELDS, RequestRecord


def write_all(out_dir: Path, summary: dict, records: list[RequestRecord], decisions: list[dict], *,
              plots: bool = True) -> list[Path]:
    """Write the data files first, then draw the plots in a child process.

    The child keeps a crash in a plotting library (seen: matplotlib segfaulting on import in
    a process that has CUDA's llama.cpp loaded) from costing the measurements.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    files = {"summary": "summary.json", "requests": "requests.csv", "decisions": "decisions.jsonl",
             "table": "results.md"}
    summary["plots"], summary["plots_skipped"] = [], None if plots else "--no-plots"
    summary["files"] = {**files, "plots": []}
    with (out_dir / files["requests"]).open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        w.writeheader()
        for r in records:
            w.writerow({k: ("" if v is None else v) for k, v in r.to_dict().items()})
    with (out_dir / files["decisions"]).open("w") as f:
        for d in decisions:
            f.write(json.dumps(_clean(d)) + "\n")
    _write_summary(out_dir, summary)
    made = []
    if plots:
        proc = subprocess.run([sys.executable, "-m", "bench.report", str(out_dir)],
                              capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            summary["plots_skipped"] = f"the plotting process failed ({proc.returncode}): {proc.stderr[-300:]}"
            _write_summary(out_dir, summary)
        else:
            summary.update(json.loads((out_dir / files["summary"]).read_text()))
            made = [out_dir / name for name in summary["plots"]]
    return [out_dir / name for name in files.values()] + made


def _write_summary(out_dir: Path, summary: dict) -> None:
    (out_dir / "results.md").write_text(markdown(summary) + "\n")
    (out_dir / "summary.json").write_text(json.dumps(_clean(summary), indent=1) + "\n")


def plot_dir(out_dir: Path) -> None:
    """Draw the PNGs of a written result directory and record them in its summary."""
    summary = json.loads((out_dir / "summary.json").read_text())
    records = read_records(out_dir / "requests.csv")
    made, skipped = write_plots(out_dir, summary, records)
    summary["plots"] = [p.name for p in made]
    summary["plots_skipped"] = skipped
    summary["files"]["plots"] = summary["plots"]
    _write_summary(out_dir, summary)


def read_records(path: Path) -> list[RequestRecord]:
    """The records of a written requests.csv (or, where only that is there, its .csv.xz:
    committed results keep their raw files xz-compressed)."""
    path = Path(path)
    with path.open() if path.exists() else lzma.open(path.with_suffix(".csv.xz"), "rt") as f:
        return [_record_from_csv(row) for row in csv.DictReader(f)]


def _record_from_csv(row: dict) -> RequestRecord:
    types = {f.name: f.type for f in fields(RequestRecord)}
    out: dict[str, Any] = {}
    for k, v in row.items():
        t = str(types[k])
        if v == "":
            out[k] = None
        elif "bool" in t:
            out[k] = v == "True"
        elif "int" in t:
            out[k] = int(v)
        elif "float" in t:
            out[k] = float(v)
        else:
            out[k] = v
    return RequestRecord(**out)


# ---- Markdown ----


def markdown(summary: dict) -> str:
    """The results as Markdown: one table per workload, then the oracle and the notes."""
    if summary.get("tool") == "tandem bench fleet":
        return fleet_markdown(summary)
    if summary.get("tool") == "tandem bench chat":
        return chat_markdown(summary)
    lines = [f"# {summary['tool']}", ""]
    model = summary.get("model") or {}
    if model.get("name"):
        lines.append(f"Model: {model['name']} ({model.get('text', '')}), {summary['runs']} run(s) per row; "
                     f"mean ± std over runs.")
    for b in summary.get("backends") or []:
        r = b["rates"]
        lines.append(f"- backend {b['name']}: {b['device']}, cap {b['cap']}, {b['threads']} threads, "
                     f"ctx {b['n_ctx']}; rates ({r['source']}) prefill {r['prefill_tok_s']:,.0f} tok/s, "
                     f"decode {r['decode_tok_s']:,.1f} tok/s")
    for t in summary.get("targets") or []:
        lines.append(f"- peer {t['label']}: {t['url']} ({t['api']})")
    lines.append("")
    for workload, rows in _by_workload(summary["results"]).items():
        lines += [f"## {workload}", "",
                  "| policy | N | makespan s | output tok/s | TTFT p50 s | TTFT p95 s | E2E p50 s | E2E p95 s "
                  "| computed prompt tok | routed | failed |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for row in sorted(rows, key=lambda r: (r["requests"], r["makespan_s"]["mean"] is None, r["makespan_s"]["mean"] or 0)):
            routed = ", ".join(f"{b} {n:g}" for b, n in sorted(row["routed"].items()))
            lines.append(f"| {row['policy']} | {row['requests']} | {_pm(row['makespan_s'])} | "
                         f"{_pm(row['output_tok_s'], 1)} | {_pm(row['ttft_p50_s'])} | {_pm(row['ttft_p95_s'])} | "
                         f"{_pm(row['e2e_p50_s'])} | {_pm(row['e2e_p95_s'])} | "
                         f"{_pm(row.get('computed_prompt_tokens') or {'mean': None}, 0)} | {routed} | {row['failed']} |")
        lines.append("")
    if summary.get("oracle"):
        lines += ["## Best in hindsight (oracle: lowest mean makespan)", "",
                  "| workload | N | best | policy: gap to best (within run spread of the best single backend?) |",
                  "|---|---|---|---|"]
        for o in summary["oracle"]:
            gaps = "; ".join(_oracle_cell(p) for p in o["policies"])
            lines.append(f"| {o['workload']} | {o['requests']} | {o['best'] or 'none (every row failed requests)'} "
                         f"| {gaps} |")
        lines.append("")
        lines.append("Rows with failed requests are never best: they are listed last with their time and "
                     "failure count.")
        lines.append("")
    notes = [summary.get("engine_state", "")] + list(summary.get("notes") or [])
    if summary.get("plots_skipped"):
        notes.append(f"plots skipped: {summary['plots_skipped']}")
    lines += [f"- {n}" for n in notes if n]
    return "\n".join(lines)


def _by_workload(results: list[dict]) -> dict[str, list[dict]]:
    """Result rows grouped by their workload, in first-seen order."""
    groups: dict[str, list[dict]] = {}
    for row in results:
        groups.setdefault(row["workload"], []).append(row)
    return groups


def fleet_markdown(summary: dict) -> str:
    """`bench fleet`'s results: per workload, one row per variant (fastest first), per-engine
    requests and computed prompt tokens, then the ratios the router work is judged by."""
    lines = [f"# {summary['tool']}", "",
             f"Model {summary['model']['spec']}; {summary['runs']} run(s) per row, mean ± std over runs; "
             f"{summary['engine_state']}. Per-engine numbers: {summary['engines_counted_from']}.", ""]
    for e in summary.get("engines") or []:
        env = " ".join(f"{k}={v}" for k, v in (e.get("env") or {}).items())
        lines.append(f"- engine {e['name']}: `{(env + ' ') if env else ''}{e['cmd']}`")
    lines.append("")
    for workload, rows in _by_workload(summary["results"]).items():
        lines += [f"## {workload}, N={rows[0]['requests']}", "",
                  "| variant | makespan s | output tok/s | TTFT p50 s | TTFT p95 s | E2E p50 s | failed "
                  "| requests per engine | prompt tokens computed per engine |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for row in sorted(rows, key=lambda r: (bool(r["failed"]), r["makespan_s"]["mean"] is None,
                                               r["makespan_s"]["mean"] or 0)):
            engines = row.get("engines") or {}
            per_req = ", ".join(f"{e} {_num(c.get('requests'))}" for e, c in engines.items()) or \
                ", ".join(f"{b} {n:g}" for b, n in sorted(row["routed"].items()))
            per_prompt = ", ".join(f"{e} {_num(c.get('prompt_tokens_computed'))}" for e, c in engines.items()) or "—"
            killed = f" (killed {row['killed']['engine']} at {row['killed']['at_s']:g} s)" if row.get("killed") else ""
            lines.append(f"| {row['policy']}{killed} | {_pm(row['makespan_s'])} | {_pm(row['output_tok_s'], 1)} | "
                         f"{_pm(row['ttft_p50_s'])} | {_pm(row['ttft_p95_s'])} | {_pm(row['e2e_p50_s'])} | "
                         f"{row['failed']} | {per_req} | {per_prompt} |")
        lines.append("")
        for o in summary.get("oracle") or []:
            if o["workload"] == workload:
                excluded = [f"{p['policy']} ({p['failed']} failed)" for p in o["policies"] if p.get("excluded")]
                lines += [f"Best makespan without failed requests: {o['best'] or 'none'}"
                          + (f"; not ranked: {', '.join(excluded)}" if excluded else ""), ""]
    if summary.get("ratios"):
        lines += ["## Ratios (a / b of the means; < 1 is better for times, > 1 for throughput)", "",
                  "| workload | a | b | metric | a / b | failed a, b |", "|---|---|---|---|---|---|"]
        for r in summary["ratios"]:
            value = "—" if r["value"] is None else f"{r['value']:.3f}"
            lines.append(f"| {r['workload']} | {r['a']} | {r['b']} | {r['metric']} | {value} | "
                         f"{r['failed'][r['a']]}, {r['failed'][r['b']]} |")
        lines.append("")
    notes = list(summary.get("notes") or [])
    notes.append("requests per engine: Tandem engines count finished requests; llama-server does not count "
                 "requests (its split shows in prompt tokens computed); '?' where an engine did not answer "
                 "(killed) or does not say; in-process rows: each backend is an engine, counted from its finish records")
    if summary.get("plots_skipped"):
        notes.append(f"plots skipped: {summary['plots_skipped']}")
    lines += [f"- {n}" for n in notes if n]
    return "\n".join(lines)


def _num(x) -> str:
    return "?" if x is None else f"{x:,.0f}"


def _oracle_cell(p: dict) -> str:
    if p.get("excluded"):
        value = "no time" if p["value"] is None else f"{p['value']:.3f} s"
        return f"{p['policy']} {value} with {p['failed']} failed (excluded)"
    return f"{p['policy']} +{p['gap_pct']:.1f}%" + (
        "" if "within_spread" not in p else (" ✓" if p["within_spread"] else " ✗"))


def _pm(s: dict, digits: int = 3) -> str:
    if s["mean"] is None:
        return "–"
    if s["std"]:
        return f"{s['mean']:.{digits}f} ± {s['std']:.{digits}f}"
    return f"{s['mean']:.{digits}f}"


def chat_markdown(summary: dict) -> str:
    """results.md for a chat run: one row per target, then each target's turns."""
    lines = [f"# {summary['tool']}", ""]
    for w in summary.get("workloads") or []:
        lines.append(f"Workload: {w['name']} (seed {w['seed']}); {summary['runs']} run(s) per row; "
                     "mean ± std over runs.")
    model = summary.get("model") or {}
    if model.get("name"):
        lines.append(f"Model: {model['name']} ({model.get('text', '')}).")
    for t in summary.get("targets") or []:
        lines.append(f"- {t['label']}: {t['url']}")
    lines += ["", "| target | makespan s | output tok/s | TTFT p50 first | TTFT p95 first | TTFT p50 later "
              "| TTFT p95 later | cached share, turns 2+ | failed |", "|---|---|---|---|---|---|---|---|---|"]
    for row in summary["results"]:
        later = [t for t in row["turns"][1:] if t["cached_share"] is not None]
        prompt = sum(t["prompt_tokens"] for t in later)
        share = f"{sum(t['cached_tokens'] for t in later) / prompt:.1%}" if later and prompt else "-"
        lines.append(f"| {row['policy']} | {_chat_pm(row['makespan_s'])} | {_chat_pm(row['output_tok_s'], 1)} | "
                     f"{_chat_pm(row['first_ttft_p50_s'])} | {_chat_pm(row['first_ttft_p95_s'])} | "
                     f"{_chat_pm(row['later_ttft_p50_s'])} | {_chat_pm(row['later_ttft_p95_s'])} | {share} | {row['failed']} |")
    for row in summary["results"]:
        lines += ["", f"## {row['policy']}: per turn (runs pooled)", "",
                  "| turn | completed | failed | prompt tok | cached tok | cached share | TTFT p50 s | TTFT p95 s |",
                  "|---|---|---|---|---|---|---|---|"]
        for t in row["turns"]:
            share = "-" if t["cached_share"] is None else f"{t['cached_share']:.1%}"
            lines.append(f"| {t['turn']} | {t['completed']} | {t['failed']} | {t['prompt_tokens']} | "
                         f"{'-' if t['cached_tokens'] is None else t['cached_tokens']} | {share} | "
                         f"{_chat_num(t['ttft_p50_s'])} | {_chat_num(t['ttft_p95_s'])} |")
        for err, n in (row.get("errors") or {}).items():
            lines.append(f"- {n} x {err}")
    notes = list(summary.get("notes") or [])
    if summary.get("plots_skipped"):
        notes.append(f"plots skipped: {summary['plots_skipped']}")
    if notes:
        lines.append("")
        lines += [f"- {n}" for n in notes]
    return "\n".join(lines)


def _chat_num(x, digits: int = 3) -> str:
    return "-" if x is None or (isinstance(x, float) and not math.isfinite(x)) else f"{x:.{digits}f}"


def _chat_pm(s: dict, digits: int = 3) -> str:
    if s.get("mean") is None:
        return "-"
    return f"{s['mean']:.{digits}f}" + (f" ± {s['std']:.{digits}f}" if s.get("std") else "")


# ---- what a summary records of the engine ----


def engine_info(eng, sweep) -> list[dict]:
    """Each backend of `eng` as summary.json records it (`sweep`: the backend a sweep varied)."""
    out = []
    for name in eng.backend_names:
        i = eng.info(name)
        out.append({"name": name, "device": i.device, "cap": eng.backend(name).cap_state().cap, "n_ctx": i.n_ctx,
                    "threads": i.threads, "n_seq_max": i.n_seq_max, "n_batch": i.n_batch,
                    "kv_unified": i.kv_unified, "swept": name == sweep, "config_key": i.rates_key,
                    "rates": asdict(eng.rates(name))})
    return out


def model_info(spec, eng) -> dict:
    """The engine's local model as summary.json records it (`spec`: as the command named it)."""
    m = eng.model
    return {"spec": spec, "name": m.info.name, "path": str(m.path), "fingerprint": file_fingerprint(m.path),
            "synthetic": m.synthetic, "n_params": m.info.n_params, "n_vocab": m.n_vocab,
            "text": "noise (synthetic weights)" if m.synthetic else "real model"}


# ---- plots ----


def write_plots(out_dir: Path, summary: dict, records: list[RequestRecord]) -> tuple[list[Path], str | None]:
    """makespan.png and ttft_cdf.png; returns (files, why skipped or None)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return [], "matplotlib is not installed (pip install matplotlib to get PNG plots)"
    rows = summary["results"]
    groups = list(dict.fromkeys((r["workload"], r["requests"]) for r in rows))
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    many = len({w for w, _ in groups}) > 1
    made = []
    if len(groups) == 1:  # one workload: a labelled bar per variant, fastest on top
        made.append(_makespan_ranked(plt, out_dir, summary, rows, groups[0]))
    else:
        made.append(_makespan_grouped(plt, out_dir, summary, rows, groups, policies, many))
    made.append(_ttft_cdfs(plt, out_dir, records, groups, policies, many))
    return made, None


def _family(policy: str) -> str:
    """The colour group of a variant label: its policy without the cap, or `target`."""
    return "target" if policy.startswith("target:") else policy.split("@")[0]


_FAMILY_COLORS = {"gpu-only": "#1f77b4", "predicted-finish": "#2ca02c", "seed-score": "#ff7f0e",
                  "target": "#7f7f7f"}


def _makespan_ranked(plt, out_dir: Path, summary: dict, rows: list[dict], group) -> Path:
    workload, n = group
    ranked = sorted((r for r in rows if r["makespan_s"]["mean"] is not None), key=lambda r: r["makespan_s"]["mean"])
    fig, ax = plt.subplots(figsize=(8.0, 1.2 + 0.32 * len(ranked)))
    ys = range(len(ranked))
    means = [r["makespan_s"]["mean"] for r in ranked]
    colors = [_FAMILY_COLORS.get(_family(r["policy"]), "#9467bd") for r in ranked]
    ax.barh(ys, means, xerr=[r["makespan_s"]["std"] or 0.0 for r in ranked], color=colors, capsize=2)
    for y, m in zip(ys, means):
        ax.text(m, y, f" {m:.2f}", va="center", fontsize=7)
    ax.set_yticks(list(ys))
    ax.set_yticklabels([r["policy"] for r in ranked], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("makespan (s), mean ± std over runs")
    ax.set_title(f"{summary['tool']}: {workload}, N={n}", fontsize=10)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    path = out_dir / "makespan.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _makespan_grouped(plt, out_dir: Path, summary: dict, rows, groups, policies, many) -> Path:
    fig, ax = plt.subplots(figsize=(max(6.0, 1.2 * len(groups) * max(1, len(policies)) * 0.35 + 3), 4.2))
    width = 0.8 / max(len(policies), 1)
    index = {(r["workload"], r["requests"], r["policy"]): r for r in rows}
    palette = plt.get_cmap("tab20" if len(policies) > 10 else "tab10")
    for k, policy in enumerate(policies):
        xs, ys, es = [], [], []
        for g, (workload, n) in enumerate(groups):
            row = index.get((workload, n, policy))
            if row and row["makespan_s"]["mean"] is not None:
                xs.append(g + (k - (len(policies) - 1) / 2) * width)
                ys.append(row["makespan_s"]["mean"])
                es.append(row["makespan_s"]["std"] or 0.0)
        ax.bar(xs, ys, width, yerr=es, capsize=2, label=policy, color=palette(k % palette.N))
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels([f"{w}\nN={n}" if many else f"N={n}" for w, n in groups], fontsize=7 if many else 9,
                       rotation=30 if many else 0, ha="right" if many else "center")
    ax.set_ylabel("makespan (s), mean ± std over runs")
    ax.set_title(f"{summary['tool']}: makespan by policy")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    path = out_dir / "makespan.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _ttft_cdfs(plt, out_dir: Path, records, groups, policies, many) -> Path:
    shown = groups[:12]
    cols = min(3, len(shown))
    nrows = math.ceil(len(shown) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(4.2 * cols, 3.2 * nrows), squeeze=False)
    for ax, (workload, n) in zip(axes.flat, shown):
        for policy in policies:
            ttft = sorted(r.ttft_s for r in records if r.success and r.ttft_s is not None
                          and r.workload == workload and r.requests == n and r.policy == policy)
            if ttft:
                ax.step([ttft[0], *ttft], [0.0, *((i + 1) / len(ttft) for i in range(len(ttft)))],
                        where="post", label=policy)
        ax.set_title(f"{workload}, N={n}" if many else f"N={n}", fontsize=8)
        ax.set_xlabel("TTFT (s)")
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(shown):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7)
    fig.suptitle("TTFT CDF (all runs)" + (f"; first {len(shown)} of {len(groups)} groups" if len(groups) > 12 else ""))
    fig.tight_layout()
    path = out_dir / "ttft_cdf.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _clean(obj):
    """JSON has no NaN or infinity: write null."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    return obj


if __name__ == "__main__":  # python -m bench.report DIR: (re)draw a result directory's plots
    plot_dir(Path(sys.argv[1]))


def write_result(out: str | None, name: str, values: dict) -> dict:
    """A one-shot bench's result: the command, date and commit before its own `values`, written
    to `out/name` when `out` is given and printed as one JSON line."""
    result = {"command": "tandem " + " ".join(sys.argv[1:]), "date": datetime.now(UTC).isoformat(),
              "commit": git_commit(), **values}
    if out:
        folder = Path(out)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))
    return result


def git_commit() -> str:
    """The checkout's HEAD, which a result file records ("" outside a git checkout)."""
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10,
                              cwd=Path(__file__).resolve().parent.parent).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""
