"""The alert rules (pipeline/ops/alerts.py, written to helm/specrelay/files/alerts.yaml) checked
and unit-tested by promtool: every alert fires on its synthetic failure and stays quiet on
healthy series (tests/ops/promtool/alerts_test.yaml), and no alert goes without such tests."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml
from support.ops_support import binary
from support.paths import REPO

from pipeline.ops.__main__ import generated
from pipeline.ops.alerts import ALERTS, rule_file

RULES = REPO / "helm" / "specrelay" / "files" / "alerts.yaml"
UNIT_TESTS = Path(__file__).resolve().parent / "promtool" / "alerts_test.yaml"


def promtool(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([binary("promtool"), *args], capture_output=True, text=True,
                          timeout=120, cwd=cwd, check=False)


def test_chart_files_are_the_generators_output():
    for name, text in generated().items():
        path = REPO / "helm" / "specrelay" / "files" / name
        assert path.read_text() == text, f"{path} is stale: run `python -m pipeline.ops`"


def test_promtool_accepts_the_rule_file():
    out = promtool("check", "rules", str(RULES), cwd=REPO)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SUCCESS: {len(ALERTS)} rules found" in out.stdout


def test_promtool_unit_tests_of_every_alert_pass():
    out = promtool("test", "rules", UNIT_TESTS.name, cwd=UNIT_TESTS.parent)
    assert out.returncode == 0, out.stdout + out.stderr


def test_every_alert_has_a_firing_and_a_quiet_unit_test():
    firing, quiet = set(), set()
    for case in yaml.safe_load(UNIT_TESTS.read_text())["tests"]:
        for check in case.get("alert_rule_test", []):
            (firing if check.get("exp_alerts") else quiet).add(check["alertname"])
    names = {a.name for a in ALERTS}
    assert names - firing == set(), "alerts without a test that they fire"
    assert names - quiet == set(), "alerts without a test that they stay quiet"
    assert (firing | quiet) <= names, "unit tests of alerts that do not exist"


@pytest.mark.parametrize("expr", ["vector(0) > 1", "vector(1)"], ids=["never-fires", "always-fires"])
def test_the_unit_tests_catch_an_alert_that_never_or_always_fires(tmp_path, expr):
    """Every alert's unit tests fail against a rule file whose alerts never (always) fire."""
    broken = rule_file()
    for rule in broken["groups"][0]["rules"]:
        rule["expr"] = expr
    (tmp_path / "alerts.yaml").write_text(yaml.safe_dump(broken))
    tests = yaml.safe_load(UNIT_TESTS.read_text())
    tests["rule_files"] = ["alerts.yaml"]
    (tmp_path / "alerts_test.yaml").write_text(yaml.safe_dump(tests))
    out = promtool("test", "rules", "alerts_test.yaml", cwd=tmp_path)
    assert out.returncode != 0
    for alert in ALERTS:
        assert f"alertname: {alert.name}" in out.stdout + out.stderr, alert.name
