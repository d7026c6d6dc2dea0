"""The Markdown summary of a bench.py JSON document: one table of every figure, then the
medians each figure came from."""

from __future__ import annotations

import json


def figure_rows(doc: dict) -> list[tuple[str, str, str, str, str]]:
    """(benchmark, figure, value, goal, met) for every figure of every benchmark."""
    rows = []
    for bench, result in doc["benchmarks"].items():
        if "error" in result:
            rows.append((bench, "error", result["error"].splitlines()[0][:120], "", ""))
            continue
        figures = dict(result.get("figures", {}))
        if "sweep" in result:
            figures["sweep_per_trial_vs_ray_train"] = result["sweep"]["figure"]
        for name, fig in figures.items():
            if "value" not in fig:  # a group of values (metric differences)
                value = ", ".join(f"{k} {v:+.4f}" for k, v in fig.items()) or "n/a"
                rows.append((bench, name, value, "", ""))
                continue
            met = {True: "yes", False: "**no**", None: ""}[fig.get("met")]
            if "aim" in fig and fig.get("aim_met") is not None:
                met += f" (aim {fig['aim']:g}: {'yes' if fig['aim_met'] else 'no'})"
            value = "n/a" if fig["value"] is None else f"{fig['value']:.3f}"
            rows.append((bench, name, value, fig.get("goal", ""), met))
    return rows


def markdown(doc: dict) -> str:
    m = doc["machine"]
    lines = [
        "# Benchmarks",
        "",
        f"`{doc['command']}` on {doc['date']}: {m['cpus']} cores, {m['memory_gib']} GiB, "
        f"no GPU; Python {m['python']}, Ray {m['ray']}, torch {m['torch']}. "
        f"Load average (1, 5, 15 min) {doc['loadavg_start']} at start, {doc['loadavg_end']} at "
        f"the end; {doc['elapsed_s']:.0f} s in all. Ratios are orchestrator / baseline, "
        "of medians over interleaved repeats.",
        "",
        "| benchmark | figure | value | goal | met |",
        "|---|---|---|---|---|",
    ]
    lines += [f"| {' | '.join(row)} |" for row in figure_rows(doc)]
    for bench, result in doc["benchmarks"].items():
        lines += ["", f"## {bench}", ""]
        for key in ("job", "median_s", "median_samples_per_s", "median_mib", "sweep"):
            if key in result:
                lines.append(f"- {key}: `{json.dumps(result[key], default=str)}`")
        lines.append(f"- elapsed: {result.get('elapsed_s')} s, load average at the end "
                     f"{result.get('loadavg_end')}")
        if result.get("cpu_s_profile"):
            lines += ["", *profile_table(result["cpu_s_profile"])]
    return "\n".join(lines) + "\n"


def profile_table(profile: dict[str, dict[str, float]]) -> list[str]:
    """CPU seconds per process title, one column per side, the costliest first."""
    sides = list(profile)
    titles = sorted({t for p in profile.values() for t in p} - {"total"},
                    key=lambda t: -max(p.get(t, 0.0) for p in profile.values()))
    lines = ["| CPU seconds (median) | " + " | ".join(sides) + " |",
             "|---|" + "---:|" * len(sides)]
    for title in ["total", *titles]:
        cells = " | ".join(f"{profile[s].get(title, 0.0):.2f}" for s in sides)
        lines.append(f"| {title} | {cells} |")
    return lines
