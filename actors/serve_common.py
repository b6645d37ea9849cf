"""What both Serve deployments (the ingress in actors/serve_app.py, the engine replicas in
actors/engine_replica.py) share: Serve options, the config path rule, and the loopback bindings
of a local `specrelay serve`."""

from __future__ import annotations

import os
from typing import Any

import ray

# Requests are queued by the engine (which answers 429 when full), not by Serve: a high limit
# keeps /health and /metrics from waiting behind long generations.
MAX_ONGOING_REQUESTS = 4096
# In-flight requests get this long to finish when a replica is stopped (Serve's
# graceful_shutdown_timeout_s, `specrelay serve` on SIGTERM, an autoscaling scale-down); the
# Helm chart passes its drain.gracePeriodSeconds as args.drain_grace_s so both agree
# (docs/reliability.md).
DRAIN_GRACE_S = 30.0


def resolve_config_path(path: str | None) -> str | None:
    """A relative config path that is not under the cwd is taken from the repository root
    (replicas do not run in the caller's directory)."""
    if path is None or os.path.isabs(path) or os.path.exists(path):
        return path
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return os.path.join(root, path)


def loopback_ray() -> None:
    """Make a local Ray bind its ports (GCS, raylet, agents, workers) to 127.0.0.1 only.

    On Linux Ray resolves even an explicit 127.0.0.1 node address to the routable one and binds
    every interface; its RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 switch (the macOS/Windows default)
    keeps a single-node cluster on loopback. The switch is read when ray is imported, so the
    constant is set too; the env var reaches the processes Ray starts."""
    from ray._private import ray_constants

    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False


def loopback_replica_grpc() -> None:
    """Ray Serve 2.60 replicas open their inter-deployment gRPC server on [::]:0 (every
    interface) whatever the node's address. On a loopback-only node (a local `specrelay serve`,
    see loopback_ray) peers reach it at 127.0.0.1, so bind it there like the rest of Ray.
    Call in the replica before Serve finishes initializing it; a no-op on cluster nodes.
    tests/e2e/test_security_serve.py scans the sockets, so a Ray upgrade that moves this shows."""
    from ray.serve._private import replica

    if ray.util.get_node_ip_address() not in ("127.0.0.1", "::1"):
        return
    bind = getattr(replica, "add_port_to_grpc_server", None)
    if bind is None or getattr(bind, "loopback_only", False):
        return

    def bind_loopback(server: Any, address: str) -> int:
        if address.startswith("[::]:"):
            address = "127.0.0.1:" + address[len("[::]:"):]
        return bind(server, address)

    bind_loopback.loopback_only = True  # type: ignore[attr-defined]
    replica.add_port_to_grpc_server = bind_loopback
