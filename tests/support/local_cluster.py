"""A real multi-node Ray cluster on this machine: `ray start --head` plus `ray start --address`
worker nodes, each with its own custom resources, one CPU and no GPU (tests/e2e/test_multinode.py,
tests/e2e/test_replicas_multinode.py).

Every node is started with `--block` in its own session and stopped through its own processes
(never `ray stop`, which stops every Ray on the machine). Every process on a node labels its
spans with the node's name (`specrelay.node`).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time

from support.serve_helpers import free_port, ray_cli_env, ray_node_ports

RAY = os.path.join(os.path.dirname(sys.executable), "ray")


class Cluster:
    """Three raylets on this machine; each node is one `ray start --block` process group."""

    def __init__(self, tmp: str, nodes: dict[str, dict[str, float]]) -> None:
        self.tmp = tmp
        self.nodes = nodes  # node name -> its custom resources
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
               f"--resources={json.dumps(self.nodes[name])}", f"--temp-dir={self.tmp}/{tag}",
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
