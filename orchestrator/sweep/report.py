"""What a sweep leaves in its directory: sweep.json (a row per trial), and a scaling report,
scaling.md (a table) and scaling.png (throughput and efficiency against workers).

Speedup and efficiency compare trials that differ only in cluster.workers: each against the
one with the fewest workers among them (efficiency = speedup / (workers / fewest workers)).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from orchestrator.redaction import redact
from orchestrator.strict_json import finite

log = logging.getLogger("orchestrator")
WORKERS_KEY = "cluster.workers"


def group_key(row: dict) -> str:
    """The trial's overrides apart from the number of workers."""
    return " ".join(o for o in row["overrides"] if not o.startswith(f"{WORKERS_KEY}="))


def add_scaling(rows: list[dict]) -> None:
    """Fill speedup and efficiency in place (None where a trial has no throughput)."""
    groups: dict[str, list[dict]] = {}
    for row in rows:
        groups.setdefault(group_key(row), []).append(row)
    for members in groups.values():
        # a failed or interrupted trial's partial rate is no baseline (nor a point)
        measured = [r for r in members if r.get("samples_per_s") and r.get("status") == "succeeded"]
        base = min(measured, key=lambda r: r["workers"], default=None)
        alone = len({r["workers"] for r in measured}) < 2  # nothing to compare it with
        for row in members:
            if base is None or alone or row not in measured:
                row["speedup"] = row["efficiency"] = None
                continue
            row["speedup"] = round(row["samples_per_s"] / base["samples_per_s"], 3)
            row["efficiency"] = round(row["speedup"] / (row["workers"] / base["workers"]), 3)


def _fmt(value, spec: str = ".3g") -> str:
    if value is None:
        return "-"
    return format(value, spec) if isinstance(value, (int, float)) else str(value)


def markdown(summary: dict) -> str:
    metric = summary["metric"]
    lines = [
        f"# Sweep {summary['name']}",
        "",
        f"{len(summary['trials'])} trials, search `{summary['search']}`, "
        f"{summary['max_concurrent']} at a time, {summary['wall_s']:.0f} s wall. "
        f"Throughput is measured while trials ran side by side, each with "
        f"{summary['cpu_budget']:.2g} {'CPU' if summary['cpu_budget'] == 1 else 'CPUs'} "
        "(hydra.sweeper.max_concurrent=1 for solo figures).",
        "",
        f"| trial | overrides | status | workers | samples/s | speedup | efficiency | wall s | {metric} |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in sorted(summary["trials"],
                    key=lambda r: (r["status"] == "not started", group_key(r), r["workers"] or 0,
                                   r["trial"])):
        lines.append(
            f"| {r['trial']} | `{' '.join(r['overrides'])}` | {r['status']} | {_fmt(r['workers'])} | "
            f"{_fmt(r.get('samples_per_s'), '.1f')} | {_fmt(r.get('speedup'), '.2f')} | "
            f"{_fmt(r.get('efficiency'), '.2f')} | {_fmt(r.get('wall_s'), '.1f')} | "
            f"{_fmt(r.get('metric'), '.4g')} |")
    best = summary.get("best")
    if best:
        lines += ["", f"Best ({summary['mode']} {metric}): trial {best['trial']}, "
                  f"`{' '.join(best['overrides'])}`, {metric}={_fmt(best['metric'], '.4g')}"]
    return "\n".join(lines) + "\n"


def plot(summary: dict, path: Path) -> bool:
    """Throughput and efficiency against workers, one line per group; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed: no %s (pip install 'orchestrator[plots]')",
                    path.name)
        return False
    fig, left = plt.subplots(figsize=(7, 4.2))
    right = left.twinx()
    groups: dict[str, list[dict]] = {}
    for r in summary["trials"]:
        if r.get("samples_per_s"):
            groups.setdefault(group_key(r), []).append(r)
    for i, (key, rows) in enumerate(sorted(groups.items())):
        rows.sort(key=lambda r: r["workers"])
        xs = [r["workers"] for r in rows]
        label = key or "all"
        left.plot(xs, [r["samples_per_s"] for r in rows], marker="o", color=f"C{i}",
                  label=f"samples/s {label}")
        right.plot(xs, [r["efficiency"] for r in rows], marker="s", linestyle="--",
                   color=f"C{i}", alpha=0.6, label=f"efficiency {label}")
    left.set_xlabel("workers")
    left.set_ylabel("samples/s")
    right.set_ylabel("parallel efficiency")
    right.set_ylim(0, 1.2)
    left.set_title(f"Sweep {summary['name']}")
    handles = left.get_legend_handles_labels()[0] + right.get_legend_handles_labels()[0]
    if handles:
        left.legend(handles=handles, fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def write_report(summary: dict, sweep_dir: Path) -> dict[str, Path]:
    add_scaling(summary["trials"])
    # A trial's overrides and error can quote a secret (storage.secret_key=..., a URL's
    # credentials): the files get them hidden.
    shown = redact(summary, by_key=False)
    paths = {"json": sweep_dir / "sweep.json", "markdown": sweep_dir / "scaling.md",
             "plot": sweep_dir / "scaling.png"}
    tmp = paths["json"].with_suffix(".json.tmp")
    tmp.write_text(json.dumps(finite(shown), indent=2, default=str) + "\n")
    tmp.replace(paths["json"])
    paths["markdown"].write_text(markdown(shown))
    if not plot(shown, paths["plot"]):
        paths.pop("plot")
    return paths
