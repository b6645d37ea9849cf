"""The reference pages say what the code and the committed results say: docs/benchmarks.md's
tables (and README's) are the newest engine matrix's numbers as printed, and docs/config.md has
one row per config field with the field's default."""

from __future__ import annotations

import dataclasses
import glob
import importlib.util
import json
import os
import re
import sys
import typing
from typing import Any

import pytest
import yaml
from support.paths import ROOT

from pipeline.config import EngineConfig
from pipeline.deployment import Autoscaling, DeploymentSettings
from pipeline.placement import Placement
from pipeline.tracing.otel import CONFIG_KEYS, TracingConfig

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


def newest_matrix() -> tuple[str, dict[str, Any]]:
    """The newest engine matrix committed in docs/bench (by the date the run recorded): its file
    name and its report."""
    reports = []
    for path in glob.glob(os.path.join(BENCH_DIR, "matrix-*.json")):
        with open(path) as f:
            reports.append((os.path.basename(path), json.load(f)))
    assert reports, "docs/bench holds no matrix-*.json"
    return max(reports, key=lambda r: r[1]["meta"]["date"])


@pytest.fixture(scope="module")
def matrix() -> dict[str, Any]:
    return newest_matrix()[1]


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


def test_the_engine_bench_writes_outside_the_tracked_tree_by_default():
    spec = importlib.util.spec_from_file_location(
        "bench_engine_args", os.path.join(ROOT, "scripts", "bench_engine.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)  # dataclasses look their module up
    spec.loader.exec_module(module)
    out = module.parse_args([]).out
    ignored = {line.strip().strip("/") for line in read(".gitignore").splitlines()}
    assert not os.path.isabs(out) and out.strip("/") in ignored


def test_every_docs_bench_file_named_anywhere_exists():
    named = set()
    for pattern in ("README.md", "docs/*.md", "scripts/**/*.py", "tests/**/*.py", "configs/*.yaml"):
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
    heading = "## Results: the engine matrix"
    name = newest_matrix()[0]
    assert f"docs/bench/{name}" in section(text, heading), "the results are not the newest matrix's"
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
    header = next(ln for ln in text.splitlines() if ln.startswith("| SmolLM2"))
    assert f"docs/bench/{newest_matrix()[0]}" in header
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


# --- docs/config.md ------------------------------------------------------------------------
def config_entries() -> dict[str, str]:
    """Field name -> documented default (the cell's text) of every engine config row."""
    text = section(read("docs", "config.md"), "## Engine config fields")
    out = {}
    for row in table_rows(text):
        m = re.fullmatch(r"`([\w.]+)`", row[0])
        if m:
            assert m.group(1) not in out, f"{m.group(1)} documented twice"
            out[m.group(1)] = row[1]
    return out


def fields_of(cls: type, prefix: str = "") -> dict[str, Any]:
    """Name -> default of every field of a dataclass, nested dataclasses by dotted name."""
    out: dict[str, Any] = {}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = dataclasses.MISSING
        out[prefix + f.name] = default
        if isinstance(hints[f.name], type) and dataclasses.is_dataclass(hints[f.name]):
            out |= fields_of(hints[f.name], f"{prefix}{f.name}.")
    return out


def documented_fields() -> dict[str, Any]:
    """Every key an engine config accepts, with its default: the EngineConfig fields, and the
    keys of the mapping sections (placement: Placement's fields; deployment: DeploymentSettings'
    and Autoscaling's; tracing: CONFIG_KEYS,
    defaults from TracingConfig where the key is a setting of its own, None where the code
    derives it: the service name, the endpoints)."""
    out = fields_of(EngineConfig)
    out |= {f"placement.{k}": v for k, v in fields_of(Placement).items()}
    out |= {f"deployment.{k}": v for k, v in fields_of(DeploymentSettings).items()
            if k != "autoscaling"}
    out["deployment.autoscaling"] = None
    out |= {f"deployment.autoscaling.{k}": v for k, v in fields_of(Autoscaling).items()}
    tracing_defaults = {f.name: f.default for f in dataclasses.fields(TracingConfig)}
    for key in CONFIG_KEYS:
        derived = key in ("service_name", "otlp_endpoint", "otlp_traces_endpoint")
        out[f"tracing.{key}"] = None if derived else tracing_defaults[key]
    return out


def test_config_reference_has_one_row_per_field_and_no_other():
    documented, fields = config_entries(), documented_fields()
    assert sorted(set(fields) - set(documented)) == [], "fields without an entry in docs/config.md"
    assert sorted(set(documented) - set(fields)) == [], "entries naming no config field"


def test_config_reference_defaults_are_the_code_defaults():
    documented, fields = config_entries(), documented_fields()
    for name, cell in documented.items():
        m = re.match(r"`([^`]*)`", cell)
        assert m, f"{name}: the default is not written as a literal"
        value = yaml.safe_load(m.group(1))
        want = fields[name]
        assert value == want and type(value) is type(want), (name, value, want)


def test_the_config_reference_is_linked():
    assert "docs/config.md" in read("README.md")
    assert "config.md" in read("docs", "architecture.md")


# --- docs/contracts.md ---------------------------------------------------------------------
def test_every_cited_contract_section_exists():
    """Code, tests and docs cite a section of the contract as docs/contracts.md, a comma and the
    section's heading in asterisks: it must be a heading there (a citation may wrap lines)."""
    headings = {m.group(1).strip() for m in re.finditer(r"^#+ (.+)$", read("docs", "contracts.md"),
                                                        re.MULTILINE)}
    cited = {}
    for pattern in ("README.md", "docs/*.md", "pipeline/**/*.py", "actors/**/*.py",
                    "scripts/**/*.py", "tests/**/*.py"):
        for path in glob.glob(os.path.join(ROOT, pattern), recursive=True):
            with open(path) as f:
                text = f.read()
            for m in re.finditer(r"docs/contracts\.md, \*([^*]+)\*", text):
                cited[" ".join(m.group(1).split())] = os.path.relpath(path, ROOT)
    assert cited, "nothing cites docs/contracts.md by section"
    assert {name: path for name, path in cited.items() if name not in headings} == {}


def test_the_contracts_are_linked():
    assert "docs/contracts.md" in read("README.md")
    assert "docs/contracts.md" in read("docs", "architecture.md")
