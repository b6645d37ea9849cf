"""The Helm chart in helm/specrelay rendered with the real helm binary, and the schemas it is
checked against: what the chart tests (tests/deploy/) and the drain test share.

helm comes from .tools/helm (the Makefile runs scripts/install_helm.sh) or PATH; without it the
tests fail rather than skip. The CRDs are vendored in tests/deploy/crds/ (KubeRay's in
tests/deploy/crds/kuberay/, see its README).
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
from functools import cache

import jsonschema
import pytest
import yaml

from support.paths import REPO

CHART = REPO / "helm" / "specrelay"
CRDS = REPO / "tests" / "deploy" / "crds"
CRD = CRDS / "kuberay" / "ray.io_rayservices.yaml"
RELEASE = "sr"


@cache
def helm_bin() -> str:
    local = REPO / ".tools" / "helm"
    if local.is_file():
        return str(local)
    found = shutil.which("helm")
    if found is None:
        pytest.fail("helm not found: run `bash scripts/install_helm.sh .tools/helm` (make install)")
    return found


def helm(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [helm_bin(), *args], capture_output=True, text=True, timeout=60, check=False
    )


@cache
def _render(sets: tuple[str, ...]) -> str:
    argv = ["template", RELEASE, str(CHART), "--namespace", "llm"]
    for s in sets:  # "json:key=<json>" is passed as --set-json (helm --set reads 0.5 as a string)
        argv += ["--set-json", s[5:]] if s.startswith("json:") else ["--set", s]
    out = helm(*argv)
    assert out.returncode == 0, f"helm template {shlex.join(argv)} failed:\n{out.stderr}"
    return out.stdout


def render(*sets: str) -> list[dict]:
    """Rendered manifests (fresh copies, safe to mutate)."""
    return [d for d in yaml.safe_load_all(_render(tuple(sets))) if d]


def one(docs: list[dict], kind: str) -> dict:
    found = [d for d in docs if d["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, got {len(found)}"
    return found[0]


def render_drain(grace: int | None, shutdown: int | None) -> tuple[dict, int, int]:
    """The RayService rendered with these drain values (None: the chart's defaults, 30 and 10),
    and the grace and shutdown seconds it should carry."""
    if grace is None:
        return one(render(), "RayService"), 30, 10
    sets = (f"drain.gracePeriodSeconds={grace}", f"drain.shutdownSeconds={shutdown}")
    return one(render(*sets), "RayService"), grace, shutdown


def pod_specs(rs: dict) -> dict[str, dict]:
    """Pod template of the head and of each worker group, by name."""
    cluster = rs["spec"]["rayClusterConfig"]
    specs = {"head": cluster["headGroupSpec"]["template"]}
    for group in cluster["workerGroupSpecs"]:
        specs[group["groupName"]] = group["template"]
    return specs


def ray_container(template: dict) -> dict:
    return template["spec"]["containers"][0]


def env_of(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


def worker_group(rs: dict) -> dict:
    (group,) = rs["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    return group


def strict_schema(schema: object) -> object:
    """Reject unknown fields where the CRD lists the known ones (as `kubectl apply` does with
    server-side strict field validation; plain jsonschema would accept any typo)."""
    if isinstance(schema, dict):
        schema = {k: strict_schema(v) for k, v in schema.items()}
        if (
            "properties" in schema
            and "additionalProperties" not in schema
            and not schema.get("x-kubernetes-preserve-unknown-fields")
        ):
            schema["additionalProperties"] = False
        return schema
    if isinstance(schema, list):
        return [strict_schema(v) for v in schema]
    return schema


@cache
def rayservice_validator() -> jsonschema.Draft7Validator:
    assert CRD.is_file(), f"KubeRay CRD missing at {CRD} (see tests/deploy/crds/kuberay/README.md)"
    crd = yaml.safe_load(CRD.read_text())
    (v1,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    schema = strict_schema(v1["schema"]["openAPIV3Schema"])
    # Top-level apiVersion/kind/metadata are checked by the API server, not the CRD schema.
    schema["properties"]["metadata"] = {"type": "object"}
    return jsonschema.Draft7Validator(schema)


def crd_errors(rs: dict) -> list[str]:
    return [
        f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
        for e in rayservice_validator().iter_errors(rs)
    ]


def rule_ports(rule: dict) -> set[int] | None:
    """Ports a NetworkPolicy ingress rule opens (None: all ports)."""
    if not rule.get("ports"):
        return None
    ports: set[int] = set()
    for p in rule["ports"]:
        end = p.get("endPort", p["port"])
        ports.update(range(p["port"], end + 1))
    return ports
