"""The reference pages say what the committed results say: docs/benchmarks.md's tables (and
README's) are the newest engine matrix's numbers as printed."""

from __future__ import annotations

import glob
import json
import os
import re
from typing import Any

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH_DIR = os.path.join(ROOT, "docs", "bench")
MODES = ("none", "adaptive", "k2", "k4", "k8")


def read(*path: str) -> str:
    with open(os.path.join(ROOT, *path)) as f:
        return f.read()


def section(text: str, heading: str) -> str:
    """The text under `heading` (a markdown heading line) up to the next heading of its level."""
    level = heading.split(" ", 1)[0]
    start = text.index(heading + "\n") + len(heading) + 1
    nxt = re.search(rf"^{level} ", text[start:], re.MULTILINE)
    return text[start:start + nxt.start()] if nxt else text[start:]


def table_rows(text: str) -> list[list[str]]:
    """The body rows of every markdown table in `text`, as stripped cells."""
    rows = []
    for line in text.splitlines():
        if line.startswith("|") and not re.match(r"^\|\s*-", line):
            rows.append([c.strip() for c in line.strip().strip("|").split("|")])
    return rows


def newest_matrix() -> dict[str, Any]:
    """The newest engine matrix committed in docs/bench (by the date the run recorded)."""
    reports = []
    for path in glob.glob(os.path.join(BENCH_DIR, "matrix-*.json")):
        with open(path) as f:
            reports.append(json.load(f))
    assert reports, "docs/bench holds no matrix-*.json"
    return max(reports, key=lambda r: r["meta"]["date"])


@pytest.fixture(scope="module")
def matrix() -> dict[str, Any]:
    return newest_matrix()


def rates(report: dict[str, Any]) -> dict[tuple[str, str, int], float]:
    return {(r["mode"], r["workload"], r["batch"]): r["tokens_per_s"]
            for r in report["runs"] if r["engine"] == "local"}


def test_the_benchmarks_page_is_a_reference_not_a_log():
    text = read("docs", "benchmarks.md")
    assert len(text.splitlines()) <= 400
    assert not re.search(r"\bissue[- ]?\d+|must-show", text, re.IGNORECASE)
    assert len(os.listdir(BENCH_DIR)) <= 6
    for name in os.listdir(BENCH_DIR):  # the folder keeps only what the page shows
        assert f"bench/{name}" in text, f"docs/bench/{name} is not on docs/benchmarks.md"


def test_every_docs_bench_file_named_anywhere_exists():
    named = set()
    for pattern in ("README.md", "docs/*.md", "scripts/**/*.py", "tests/*.py", "configs/*.yaml"):
        for path in glob.glob(os.path.join(ROOT, pattern), recursive=True):
            with open(path) as f:
                named |= set(re.findall(r"docs/bench/([\w.-]+\.\w+)", f.read()))
            if path.endswith(".md"):
                with open(path) as f:
                    named |= set(re.findall(r"\]\(bench/([\w.-]+\.\w+)\)", f.read()))
    assert named
    missing = sorted(n for n in named if not os.path.exists(os.path.join(BENCH_DIR, n)))
    assert not missing


def test_the_results_table_is_the_newest_matrix_as_printed(matrix):
    text = read("docs", "benchmarks.md")
    heading = f"## Results: the engine matrix (commit {matrix['meta']['commit']})"
    assert heading + "\n" in text, "the page's results are not the newest matrix's"
    rows = [r for r in table_rows(section(text, heading)) if re.match(r"^\w+ b\d+$", r[0])]
    tok = rates(matrix)
    cells = {(r["workload"], r["batch"]) for r in matrix["runs"] if r["engine"] == "local"}
    assert {(r[0].split()[0], int(r[0].split()[1][1:])) for r in rows} == cells
    runs = {(r["mode"], r["workload"], r["batch"]): r for r in matrix["runs"]
            if r["engine"] == "local"}
    for row in rows:
        workload, batch = row[0].split()[0], int(row[0].split()[1][1:])
        target = matrix["targets"][f"{workload}/b{batch}"]
        assert int(row[1]) == len(runs[("none", workload, batch)]["rep_tokens_per_s"])
        assert row[2:7] == [f"{tok[(m, workload, batch)]:.1f}" for m in MODES], row
        assert row[7] == " / ".join(f"{target[k]:.3f}" for k in (
            "adaptive_vs_none (>= 0.97)", "adaptive_vs_none_paired", "adaptive_vs_none_pooled"))
        assert row[8] == (f"{target['adaptive_vs_best_fixed (>= 0.97)']:.3f} "
                          f"({target['best_fixed']}) / "
                          f"{target['adaptive_vs_best_fixed_paired']:.3f} / "
                          f"{target['adaptive_vs_best_fixed_pooled']:.3f}")
        assert row[9] == " / ".join(f"{runs[(m, workload, batch)]['mean_accepted_len']:.2f}"
                                    for m in ("adaptive", "k8"))
    checked = f"{matrix['requests_checked']:,}"
    assert matrix["greedy_equals_reference"] and matrix["stats_identity_holds"]
    assert f"All {checked} greedy outputs" in text


def test_the_readme_table_is_the_newest_matrix_as_printed(matrix):
    text = read("README.md")
    tok = rates(matrix)
    commit = matrix["meta"]["commit"]
    header = next(ln for ln in text.splitlines() if ln.startswith("| SmolLM2"))
    assert f"commit {commit}" in header
    batches = [int(b[1:]) for b in re.findall(r"\| (b\d+)", header)]
    rows = [r for r in table_rows(section(text, "## Benchmarks"))
            if r[0].endswith("target only / adaptive / best fixed k")]
    assert {r[0].split(":")[0] for r in rows} == {r["workload"] for r in matrix["runs"]}
    for row in rows:
        workload = row[0].split(":")[0]
        for batch, cell in zip(batches, row[1:], strict=True):
            best = matrix["targets"][f"{workload}/b{batch}"]["best_fixed"]
            assert cell == (f"{tok[('none', workload, batch)]:.1f} / "
                            f"{tok[('adaptive', workload, batch)]:.1f} / "
                            f"{tok[(best, workload, batch)]:.1f} ({best})"), (workload, batch)
