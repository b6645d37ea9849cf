"""A real multi-node Ray cluster on this machine: `ray start --head` plus two `ray start --address`
worker nodes, each with its own custom resources, and an engine placed across them by the config's
`placement:` section (tests/support/multinode_driver.py does the Ray side in its own process).

Checks: the draft, the two TP ranks (gloo) and the output actor land on the nodes the placement
asks for; greedy output equals target-only; one trace holds spans written on two nodes; SIGKILL of
node B's raylet mid-generation ends the in-flight requests with an error within the bound
docs/deploy.md states (the step timeout plus a few seconds), the engine's health() turns
unhealthy and says it is waiting for the verifier placement group, and the engine serves again
(same greedy output) once node B is back.

The nodes are tests/support/local_cluster.py's (each `ray start --block` in its own session).
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

import pytest
from support.local_cluster import Cluster
from support.serve_helpers import ROOT, ray_cli_env

from pipeline.tracing.trace_file import read_spans

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(600)]

DRIVER = os.path.join(ROOT, "tests", "support", "multinode_driver.py")
STEP_TIMEOUT_S = 10.0  # multinode_driver.STEP_TIMEOUT_S
# In-flight requests must end within the step timeout plus this slack (docs/deploy.md).
ERROR_SLACK_S = 10.0
NODES = {
    "head": {"sr_node_head": 1, "sr_head": 1},
    "a": {"sr_node_a": 1, "sr_a": 1, "sr_tp": 1},
    "b": {"sr_node_b": 1, "sr_b": 1, "sr_tp": 1},
}


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    tmp = tempfile.mkdtemp(prefix="srmn", dir="/tmp")
    nodes = Cluster(tmp, NODES)
    try:
        for name in ("head", "a", "b"):
            nodes.start(name)
        yield nodes
    finally:
        nodes.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def run_driver(cluster: Cluster, trace_dir: str) -> dict:
    (raylet_b,) = cluster.pids(cluster.procs["b"], "raylet")
    env = ray_cli_env()
    driver = subprocess.Popen([sys.executable, DRIVER, cluster.address, trace_dir,
                               str(raylet_b)], env=env, cwd=ROOT, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for line in driver.stdout:
            if not line.startswith("{"):
                continue
            event = json.loads(line)
            if event["event"] == "restart-node-b":
                cluster.procs["b"].wait(timeout=60)  # its `ray start --block` saw the raylet die
                cluster.start("b", tag="b2")
                driver.stdin.write("restarted\n")
                driver.stdin.flush()
            elif event["event"] == "result":
                return event
        driver.wait(timeout=30)
        logs = "\n".join(f"--- {tag}:\n{cluster.log(tag)[-800:]}" for tag in cluster.tags)
        pytest.fail(f"driver ended without a result:\n{driver.stderr.read()[-4000:]}\n{logs}")
    finally:
        if driver.poll() is None:
            driver.kill()


def test_engine_across_three_nodes_is_lossless_traced_and_survives_a_node_loss(cluster, tmp_path):
    t0 = time.monotonic()
    result = run_driver(cluster, str(tmp_path))
    numbers = {k: v for k, v in result.items()
               if k not in ("reference", "outputs", "after_recovery")}
    print(f"\nmultinode ({time.monotonic() - t0:.1f}s): {json.dumps(numbers)}")

    # Placement: the nodes the config's resources name.
    where = {name: p["node"] for name, p in result["placement"].items()}
    assert where["engine"] == where["draft"] == "sr_node_head"
    assert where["output"] == "sr_node_a"
    assert {where["rank0"], where["rank1"]} == {"sr_node_a", "sr_node_b"}

    # Lossless across nodes: greedy speculative output == target-only greedy.
    assert result["outputs"] == result["reference"]

    # One trace, spans from processes on two nodes (the engine's on head, the output's on A).
    spans = read_spans(glob.glob(str(tmp_path / "spans-*.jsonl")))
    trace = [s for s in spans if s.trace_id == "4bf92f3577b34da6a3ce929d0e0e4736"]
    nodes = {s.resource.get("specrelay.node") for s in trace}
    assert {"head", "a"} <= nodes, nodes
    names = {s.name for s in trace}
    assert {"spec.engine.request", "spec.request"} <= names, names

    # Node loss: every in-flight request ended with an error, within the documented bound.
    for end in result["in_flight"]:
        assert end["ended"] == "error", end
        assert end["after_kill_s"] <= STEP_TIMEOUT_S + ERROR_SLACK_S, end
    assert result["unhealthy_state"]["healthy"] is False
    assert "placement group" in result["while_gone"]["reason"], result["while_gone"]

    # Back when node B returns: healthy, ranks on A and the new B, output still lossless.
    assert result["recovered_state"]["healthy"] is True, result["recovered_state"]
    assert result["after_recovery"] == result["reference"]
    assert {p["node"] for p in result["placement_after"].values()} == {"sr_node_a", "sr_node_b"}
    assert result["restarts"] >= 1
