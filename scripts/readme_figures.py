"""The figures README.md and docs/*.md quote from the default job and the examples, measured by
running them (issue 24: a quoted figure cannot go stale silently).

    python scripts/readme_figures.py [--address HOST:PORT]  # run; write figures.json, the pages
    python scripts/readme_figures.py --check                 # the pages against docs/figures.json

Runs the default job (`python -m orchestrator` from the repository's root) and the three
examples (`python -m orchestrator -cd conf +experiment=...` from each one's folder) as a user
would, on 2 workers of an embedded Ray, or of the running Ray head at --address; each run with
a run folder and storage of its own, so none resumes an earlier one. Reads each run.json, writes
docs/figures.json, then rewrites every figure a page quotes between markers:

    <!-- fig:image_cnn.test_accuracy -->0.975<!-- /fig -->     in a sentence or a table
    <!-- fig-line: at step {default.steps}: test_accuracy={default.test_accuracy} -->
                          on the line before a fenced block (a comment inside one would show):
                          the line of that block that matches it

A figure is shown to as many decimals as the page shows it; a marker must not begin a line (Markdown
would take the line out of its paragraph). --check runs nothing: it exits 1 naming every quote
that differs from docs/figures.json, every figure no page quotes and every line that begins with
a marker. Prints one JSON line. tests/test_what_users_read.py runs the check.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from scripts.local_cluster import clean_env  # noqa: E402

FIGURES = REPO / "docs" / "figures.json"
WORKERS = 2
RUNS = {  # name: (folder, arguments, the metrics of run.json the pages quote)
    "default": (".", [], ("test_accuracy", "test_loss")),
    "image_cnn": ("examples/image_cnn", ["-cd", "conf", "+experiment=cnn"], ("test_accuracy",)),
    "char_lm": ("examples/char_lm", ["-cd", "conf", "+experiment=char_lm"], ("test_perplexity",)),
    "regression": ("examples/regression", ["-cd", "conf", "+experiment=diabetes"], ("test_r2",)),
}
INLINE = re.compile(r"<!-- fig:(?P<key>\w+\.\w+) -->(?P<shown>.*?)<!-- /fig -->")
LINE = re.compile(r"^<!-- fig-line: (?P<template>.*?) -->\n(?P<block>```.*?\n```)", re.M | re.S)
NUMBER = r"(-?\d+(?:\.\d+)?)"


def pages() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


# --- measuring ---------------------------------------------------------------------------------


def command(name: str) -> list[str]:
    return ["python", "-m", "orchestrator", *RUNS[name][1], f"cluster.workers={WORKERS}"]


def measure(name: str, address: str | None, tmp: Path) -> dict:
    folder, _, quoted = RUNS[name]
    own = [f"hydra.run.dir={tmp / name / 'run'}", f"storage.uri={tmp / name / 'ckpt'}"]
    if address:
        own.append(f"cluster.address={address}")
    print(f"running {name}: cd {folder} && {' '.join(command(name))}", file=sys.stderr, flush=True)
    proc = subprocess.run([sys.executable, *command(name)[1:], *own], cwd=REPO / folder,
                          env=clean_env(), capture_output=True, text=True)
    record_path = tmp / name / "run" / "run.json"
    record = json.loads(record_path.read_text()) if record_path.exists() else {}
    if proc.returncode != 0 or record.get("status") != "succeeded":
        raise SystemExit(f"{name} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    entry = {"command": " ".join(command(name)), "folder": folder,
             "date": datetime.datetime.now(datetime.UTC).date().isoformat(),
             "ray": address or "embedded", "steps": record["steps"], "wall_s": record["wall_s"],
             "metrics": {m: record["metrics"][m] for m in quoted}}
    if name == "char_lm":
        entry["baselines"] = {"unigram_perplexity": unigram_perplexity()}
    return entry


def unigram_perplexity() -> float:
    # As tests/test_examples.py computes it: the example's own package, from its folder.
    sys.path.insert(0, str(REPO / "examples" / "char_lm"))
    try:
        from charlm.data import unigram_perplexity
    finally:
        sys.path.pop(0)
    return unigram_perplexity()


# --- quoting -----------------------------------------------------------------------------------


@dataclass
class Quote:
    key: str     # run.field: a metric, a baseline, steps, wall_s or date of figures.json's run
    shown: str   # the text the page shows
    start: int   # where that text is in the page
    end: int


def quotes(text: str) -> list[Quote]:
    found = [Quote(m["key"], m["shown"], m.start("shown"), m.end("shown"))
             for m in INLINE.finditer(text)]
    for m in LINE.finditer(text):
        parts = re.split(r"\{([\w.]+)\}", m["template"])  # literal, key, literal, key, ...
        keys = parts[1::2]
        pattern = NUMBER.join(re.escape(literal) for literal in parts[::2])
        hits = list(re.finditer(pattern, m["block"]))
        if len(hits) != 1:
            raise ValueError(f"<!-- fig-line: {m['template']} --> matches {len(hits)} lines of the "
                             "block after it, not 1")
        base = m.start("block")
        found += [Quote(key, hits[0][i + 1], base + hits[0].start(i + 1), base + hits[0].end(i + 1))
                  for i, key in enumerate(keys)]
    return sorted(found, key=lambda q: q.start)


def measured(figures: dict, key: str):
    run, _, field = key.partition(".")
    entry = figures.get(run, {})
    for source in (entry.get("metrics", {}), entry.get("baselines", {}), entry):
        if field in source:
            return source[field]
    return None


def shown_as(figure, shown: str) -> str:
    """The figure as the page would show it: to the decimals the page shows now."""
    if isinstance(figure, str):
        return figure
    decimals = len(shown.partition(".")[2]) if re.fullmatch(NUMBER, shown) else 4
    return f"{figure:.{decimals}f}"


def mismatches(text: str, figures: dict) -> list[dict]:
    wrong = []
    for q in quotes(text):
        v = measured(figures, q.key)
        expected = "not in figures.json" if v is None else shown_as(v, q.shown)
        if q.shown != expected:
            wrong.append({"figure": q.key, "shown": q.shown, "measured": expected})
    return wrong


def rewrite(text: str, figures: dict) -> str:
    for q in reversed(quotes(text)):  # from the end: the earlier quotes' positions stay valid
        v = measured(figures, q.key)
        if v is None:
            raise ValueError(f"{q.key} is quoted but not in figures.json")
        text = text[:q.start] + shown_as(v, q.shown) + text[q.end:]
    return text


def unquoted(texts: list[str], figures: dict) -> list[str]:
    """The figures no page quotes: every metric and baseline of every run must be (steps, wall_s
    and date say when and how, and may be quoted too)."""
    keys = {q.key for text in texts for q in quotes(text)}
    return [f"{run}.{name}" for run, entry in figures.items()
            for name in (*entry.get("metrics", {}), *entry.get("baselines", {}))
            if f"{run}.{name}" not in keys]


def misplaced(text: str) -> list[str]:
    """Lines that begin with a figure's marker: Markdown takes such a line for an HTML block,
    out of its paragraph."""
    return [line for line in text.splitlines() if line.startswith("<!-- fig:")]


def load() -> dict:
    return json.loads(FIGURES.read_text())["runs"]


# --- the command -------------------------------------------------------------------------------


def check() -> int:
    figures = load()
    wrong = [{"page": str(p.relative_to(REPO)), **w} for p in pages()
             for w in mismatches(p.read_text(), figures)]
    missing = unquoted([p.read_text() for p in pages()], figures)
    lines = [line for p in pages() for line in misplaced(p.read_text())]
    failed = bool(wrong or missing or lines)
    print(json.dumps({"check": "failed" if failed else "ok", "mismatches": wrong,
                      "unquoted": missing, "lines_beginning_with_a_marker": lines}))
    return 1 if failed else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--address", help="join the Ray head at HOST:PORT instead of an embedded Ray")
    ap.add_argument("--check", action="store_true", help="compare the pages with figures.json")
    args = ap.parse_args()
    if args.check:
        return check()
    with tempfile.TemporaryDirectory(prefix="readme-figures-") as tmp:
        figures = {name: measure(name, args.address, Path(tmp)) for name in RUNS}
    FIGURES.write_text(json.dumps({"written_by": "python scripts/readme_figures.py",
                                   "runs": figures}, indent=2) + "\n")
    changed = []
    for page in pages():
        text = page.read_text()
        if (new := rewrite(text, figures)) != text:
            page.write_text(new)
            changed.append(str(page.relative_to(REPO)))
    print(json.dumps({"figures": str(FIGURES.relative_to(REPO)), "pages_changed": changed,
                      "runs": {n: {"steps": e["steps"], **e["metrics"], **e.get("baselines", {})}
                               for n, e in figures.items()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
