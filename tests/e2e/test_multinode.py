"""A real multi-node Ray cluster on this machine: `ray start --head` plus two `ray start --address`
worker nodes, each with its own custom resources, and an engine placed across them by the config's
`placement:` section (tests/support/multinode_driver.py does the Ray side in its own process).

Checks: the draft, the two TP ranks (gloo) and the output actor land on the nodes the placement
asks for; greedy output equals target-only; one trace holds spans written on two nodes; SIGKILL of
node B's raylet mid-generation ends the in-flight requests with an error within the bound
docs/deploy.md states (the step timeout plus a few seconds), the engine's health() turns
unhealthy and says it is waiting for the verifier placement group, and the engine serves again
(same greedy output) once node B is back.

Every node is started here with `--block` in its own session and stopped through its own
processes (never `ray stop`, which stops every Ray on the machine).
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

import pytest
from support.serve_helpers import ROOT, free_port, ray_cli_env, ray_node_ports

from pipeline.tracing.trace_file import read_spans

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(600)]

BIN = os.path.dirname(sys.executable)
RAY = os.path.join(BIN, "ray")
DRIVER = os.path.join(ROOT, "tests", "support", "multinode_driver.py")
STEP_TIMEOUT_S = 10.0  # multinode_driver.STEP_TIMEOUT_S
# In-flight requests must end within the step timeout plus this slack (docs/deploy.md).
ERROR_SLACK_S = 10.0
NODES = {
    "head": {"sr_node_head": 1, "sr_head": 1},
    "a": {"sr_node_a": 1, "sr_a": 1, "sr_tp": 1},
    "b": {"sr_node_b": 1, "sr_b": 1, "sr_tp": 1},
}


class Cluster:
    """Three raylets on this machine; each node is one `ray start --block` process group."""

    def __init__(self, tmp: str) -> None:
        self.tmp = tmp
        self.gcs_port = free_port()
        self.address = f"127.0.0.1:{self.gcs_port}"
        self.procs: dict[str, subprocess.Popen] = {}
        self.started: list[subprocess.Popen] = []
        self.tags: list[str] = []

    def start(self, name: str, tag: str | None = None) -> None:
        tag = tag or name
        self.tags.append(tag)
        workers, ports = ray_node_ports(7, taken=(self.gcs_port,))
        port = iter(ports).__next__
        cmd = [RAY, "start", "--block", "--node-ip-address=127.0.0.1",
               "--num-cpus=1", "--num-gpus=0",
               f"--resources={json.dumps(NODES[name])}", f"--temp-dir={self.tmp}/{tag}",
               f"--node-manager-port={port()}", f"--object-manager-port={port()}",
               f"--dashboard-agent-listen-port={port()}",
               f"--dashboard-agent-grpc-port={port()}",
               f"--metrics-export-port={port()}", f"--runtime-env-agent-port={port()}",
               f"--min-worker-port={workers.start}", f"--max-worker-port={workers.stop - 1}",
               "--object-store-memory=100000000", "--disable-usage-stats"]
        if name == "head":
            cmd += ["--head", f"--port={self.gcs_port}", "--include-dashboard=false",
                    f"--ray-client-server-port={port()}"]
        else:
            cmd += [f"--address={self.address}"]
        # Every process on this node labels its spans with the node's name.
        env = ray_cli_env(OTEL_RESOURCE_ATTRIBUTES=f"specrelay.node={name}")
        os.makedirs(f"{self.tmp}/{tag}", exist_ok=True)
        with open(f"{self.tmp}/{tag}.log", "w") as log:
            proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        self.procs[name] = proc
        self.started.append(proc)
        self._wait_up(proc, tag)

    def _wait_up(self, proc: subprocess.Popen, tag: str) -> None:
        deadline = time.monotonic() + 120
        while not self.pids(proc, "raylet"):
            assert proc.poll() is None, self.log(tag)
            assert time.monotonic() < deadline, self.log(tag)
            time.sleep(0.5)

    def log(self, tag: str) -> str:
        with open(f"{self.tmp}/{tag}.log") as f:
            return f.read()[-3000:]

    @staticmethod
    def pids(proc: subprocess.Popen, comm: str) -> list[int]:
        """Processes of this node's session (its process group) named `comm`, leaving out any
        whose parent has the name too: a child forked and not yet exec'd carries its name."""
        parents: dict[int, int] = {}
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            with contextlib.suppress(OSError):
                if os.getpgid(int(entry)) != proc.pid:
                    continue
                with open(f"/proc/{entry}/comm") as f:
                    if f.read().strip() != comm:
                        continue
                with open(f"/proc/{entry}/stat") as f:  # the ppid follows "(comm) state"
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
        return [pid for pid, ppid in parents.items() if ppid not in parents]

    def stop(self) -> None:
        for proc in reversed(self.started):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in reversed(self.started):
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=30)
            with contextlib.suppress(ProcessLookupError):  # leftovers of this node's session
                os.killpg(proc.pid, signal.SIGKILL)
        # Workers a raylet started outlive a SIGKILLed raylet: they name our temp dir.
        for entry in os.listdir("/proc"):
            if entry.isdigit() and int(entry) != os.getpid():
                with contextlib.suppress(OSError), open(f"/proc/{entry}/cmdline", "rb") as f:
                    if self.tmp.encode() in f.read():
                        os.kill(int(entry), signal.SIGKILL)


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    tmp = tempfile.mkdtemp(prefix="srmn", dir="/tmp")
    nodes = Cluster(tmp)
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
