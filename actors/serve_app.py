"""Ray Serve wiring: one deployment whose replica owns an Engine actor and serves the FastAPI app.

- `build_app(args)`: the Serve application builder (`serve run actors.serve_app:build_app
  config=...`, or KubeRay `import_path: actors.serve_app:build_app` with `args`).
- `serve_main(argv)`: `specrelay serve --config FILE [--host 127.0.0.1 --port 8000 --api-key K]`
  starts local Ray (or joins RAY_ADDRESS / --address), Serve's proxy and the app, then blocks.

args keys: `config` (YAML path; None = defaults), `overrides` (EngineConfig fields; the Helm
chart's names `target_model` and `draft_kind` are accepted too), and ServerSettings fields
(`api_key`, `request_timeout_s`, `max_body_bytes`, `max_header_bytes`, `model_name`, ...).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import signal
import sys
import threading
from typing import Any

import ray
from ray import serve

from actors.engine import start_engine
from actors.engine_client import EngineClient
from pipeline.config import EngineConfig, load_config
from pipeline.frontend.app import API_KEY_ENV, ServerSettings, create_app
from pipeline.frontend.proxy_guard import proxy_guard_env
from pipeline.grammar.memory import set_memory_budget
from pipeline.tracing.otel import flush_tracing, setup_tracing

log = logging.getLogger(__name__)

APP_NAME = "specrelay"
DEFAULT_CONFIG = "configs/smollm2-cpu.yaml"
# Helm chart (values.yaml) names -> EngineConfig fields.
OVERRIDE_ALIASES = {"target_model": "model", "draft_kind": "draft"}
# Requests are queued by the engine (which answers 429 when full), not by Serve: a high limit
# keeps /health and /metrics from waiting behind long generations.
MAX_ONGOING_REQUESTS = 4096
# In-flight requests get this long to finish when a replica is stopped (Serve's
# graceful_shutdown_timeout_s, `specrelay serve` on SIGTERM); the Helm chart passes its
# drain.gracePeriodSeconds as args.drain_grace_s so both agree (docs/reliability.md).
DRAIN_GRACE_S = 30.0


def engine_overrides(raw: dict[str, Any] | None) -> dict[str, Any]:
    """EngineConfig overrides from args; empty values (unset Helm fields) are dropped."""
    out = {}
    for key, value in (raw or {}).items():
        if value is None or value == "":
            continue
        out[OVERRIDE_ALIASES.get(key, key)] = value
    return out


def server_settings(args: dict[str, Any]) -> dict[str, Any]:
    names = {f.name for f in dataclasses.fields(ServerSettings)}
    return {k: v for k, v in args.items() if k in names}


@serve.deployment(max_ongoing_requests=MAX_ONGOING_REQUESTS, ray_actor_options={"num_cpus": 0},
                  health_check_period_s=10, health_check_timeout_s=60,
                  graceful_shutdown_timeout_s=DRAIN_GRACE_S, graceful_shutdown_wait_loop_s=1)
@serve.ingress()
class SpecrelayServer:
    """A replica: starts its Engine actor (owned by, and dying with, the replica) and the app."""

    async def __init__(self, config_path: str | None, overrides: dict[str, Any],
                       settings: dict[str, Any]) -> None:
        # lazy: the model runners import torch, needed in the replica, not in `specrelay serve`
        from pipeline.models.runners import load_engine_tokenizer

        loopback_replica_grpc()
        config, server_settings = replica_config(config_path, overrides, settings)
        set_memory_budget(config.grammar_memory_mb << 20)  # this process compiles grammars
        setup_tracing("specrelay-frontend", config.tracing, register_global=False)
        # start_engine and tokenizer loading block (model loads): keep the replica's loop free.
        self.engine = await asyncio.to_thread(start_engine, config)
        tokenizer = await asyncio.to_thread(load_engine_tokenizer, config)
        self.client = EngineClient(self.engine)
        self.http_app = create_app(self.client, tokenizer, server_settings)

    def __serve_build_asgi_app__(self) -> Any:
        return self.http_app

    async def check_health(self) -> None:
        # Only a dead engine actor fails the replica (Serve restarts it); an engine that is
        # rebuilding its stages reports unhealthy on /health but recovers by itself.
        await asyncio.wait_for(self.client.health(), 30)

    async def engine_stats(self) -> dict[str, Any]:
        return await self.client.stats()

    async def engine_actor(self) -> Any:
        """The Engine actor's handle (operations and failure tests)."""
        return self.engine

    async def drain(self, timeout_s: float) -> int:
        """Refuse new requests (503, /health 503) and wait up to timeout_s for those in flight;
        returns how many are still running."""
        return await self.http_app.state.server.drain(timeout_s)

    async def __del__(self) -> None:
        # Replica shutdown: stop the engine so its stage actors and placement group go too;
        # the engine and its output actor export their spans first, then this replica does.
        engine = getattr(self, "engine", None)
        if engine is not None:
            try:
                await asyncio.wait_for(engine.shutdown.remote(), 30)
            except Exception as e:  # noqa: BLE001 - killed below either way
                log.warning("engine shutdown: %s", e)
            ray.kill(engine, no_restart=True)
        await asyncio.to_thread(flush_tracing)


def replica_config(config_path: str | None, overrides: dict[str, Any],
                   settings: dict[str, Any]) -> tuple[EngineConfig, ServerSettings]:
    """What a replica builds from build_app's bound arguments, before it starts anything (the
    chart contract test calls this on every rendered serveConfigV2)."""
    config = load_config(resolve_config_path(config_path), overrides)
    return config, ServerSettings(**settings)


def resolve_config_path(path: str | None) -> str | None:
    """A relative config path that is not under the cwd is taken from the repository root
    (replicas do not run in the caller's directory)."""
    if path is None or os.path.isabs(path) or os.path.exists(path):
        return path
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return os.path.join(root, path)


def build_app(args: dict[str, Any]) -> serve.Application:
    """The Serve application for `args` (see the module docstring)."""
    args = dict(args or {})
    config = args.get("config")
    settings = server_settings(args)
    options: dict[str, Any] = {}
    if "drain_grace_s" in args:
        options["graceful_shutdown_timeout_s"] = float(args["drain_grace_s"])
    if "num_replicas" in args:
        options["num_replicas"] = int(args["num_replicas"])
    deployment = SpecrelayServer.options(**options) if options else SpecrelayServer
    return deployment.bind(config, engine_overrides(args.get("overrides")), settings)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="specrelay serve",
                                description="Serve the OpenAI-compatible API on Ray Serve.")
    p.add_argument("--config", default=DEFAULT_CONFIG, help="engine config YAML")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get(API_KEY_ENV),
                   help=f"require 'Authorization: Bearer KEY' (default: ${API_KEY_ENV})")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20)
    p.add_argument("--max-choices", type=int, default=64,
                   help="prompts x n per request (400 above; the engine admits them fairly)")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--address", default=None,
                   help="Ray cluster to join (default: RAY_ADDRESS, else start a local one)")
    p.add_argument("--num-cpus", type=int, default=None, help="CPUs for a local Ray")
    p.add_argument("--drain-grace", type=float, default=DRAIN_GRACE_S,
                   help="seconds in-flight requests get to finish on SIGTERM (new ones: 503)")
    return p.parse_args(argv)


def serve_main(argv: list[str]) -> int:
    args = parse_args(argv)
    args.config = resolve_config_path(args.config)
    if args.config and not os.path.exists(args.config):
        print(f"specrelay serve: config not found: {args.config}", file=sys.stderr)
        return 2
    init: dict[str, Any] = {"address": args.address} if args.address else {}
    if not args.address and not os.environ.get("RAY_ADDRESS"):
        init.update(num_cpus=args.num_cpus, include_dashboard=False)
        loopback_ray()
        # Serve's proxy (a worker of this local cluster, inheriting its env) keys /-/routes.
        os.environ.update(proxy_guard_env(args.api_key or ""))
    ray.init(**init)
    # After ray.init (its failure-signal handler would otherwise end the process on SIGTERM)
    # and before the app starts: a SIGTERM while deploying still drains and shuts down.
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    app_args: dict[str, Any] = {
        "config": os.path.abspath(args.config) if args.config else None,
        "request_timeout_s": args.request_timeout, "max_body_bytes": args.max_body_bytes,
        "max_choices_per_request": args.max_choices,
        # "" disables the key explicitly, so a replica never falls back to its own env.
        "api_key": args.api_key or "", "drain_grace_s": args.drain_grace,
    }
    if args.served_model_name:
        app_args["model_name"] = args.served_model_name
    serve.start(http_options={"host": args.host, "port": args.port})
    serve.run(build_app(app_args), name=APP_NAME, route_prefix="/", blocking=False)
    print(f"specrelay: serving on http://{args.host}:{args.port}/v1 "
          f"(health: /health, metrics: /metrics){' with an API key' if args.api_key else ''}",
          flush=True)
    stop.wait()
    drain_app(args.drain_grace)
    serve.shutdown()
    ray.shutdown()
    return 0


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


def drain_app(grace_s: float) -> None:
    """Stop taking requests and let those in flight finish (at most grace_s seconds)."""
    try:
        left = serve.get_app_handle(APP_NAME).drain.remote(grace_s).result(
            timeout_s=grace_s + 10)
        if left:
            log.warning("drain: %d requests still in flight after %.0fs", left, grace_s)
    except Exception as e:  # noqa: BLE001 - shutting down either way
        log.warning("drain failed: %s", e)
