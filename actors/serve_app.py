"""Ray Serve wiring: two deployments in one application, as Ray Serve LLM builds it.

- `SpecrelayServer`, the ingress: the OpenAI FastAPI app (pipeline/frontend/app.py) and the
  tokenizer, no model. Its engine client (actors/replica_client.py) calls the engine deployment
  through a deployment handle with the parsed request (pipeline/protocol/engine_call.py), so the
  request router sees the prompt's token ids.
- `EngineReplica` (actors/engine_replica.py): each replica owns a whole engine. How many, and
  how requests reach them, is the config's `deployment:` section (pipeline/deployment.py):
  `num_replicas` or `autoscaling_config`, and the request router (`prefix`: actors/
  prefix_router.py; `pow2`: Ray's power of two choices).

- `build_app(args)`: the Serve application builder (`serve run actors.serve_app:build_app
  config=...`, or KubeRay `import_path: actors.serve_app:build_app` with `args`).
- `serve_main(argv)`: `specrelay serve --config FILE [--host 127.0.0.1 --port 8000 --api-key K
  --replicas N --routing prefix|pow2]` starts local Ray (or joins RAY_ADDRESS / --address),
  Serve's proxy and the app, then blocks.

args keys: `config` (YAML path; None = defaults), `overrides` (EngineConfig fields; the Helm
chart's names `target_model` and `draft_kind` are accepted too), `deployment` (keys of the
config's `deployment:` section, over the file's), `num_replicas` (an alias of
`deployment.replicas`: a fixed count), `drain_grace_s`, and ServerSettings fields (`api_key`,
`request_timeout_s`, `max_body_bytes`, `max_header_bytes`, `model_name`, ...).
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
import time
from typing import Any

import ray
from ray import serve
from ray.serve.config import RequestRouterConfig

from actors.engine_replica import EngineReplica
from actors.prefix_router import ROUTER_PATH
from actors.replica_client import EngineDirectory, ReplicaClient
from actors.serve_common import (
    DRAIN_GRACE_S,
    MAX_ONGOING_REQUESTS,
    loopback_ray,
    loopback_replica_grpc,
    resolve_config_path,
)
from pipeline.config import EngineConfig, load_config
from pipeline.deployment import ROUTINGS, DeploymentSettings, parse_deployment
from pipeline.frontend.app import API_KEY_ENV, ServerSettings, create_app
from pipeline.frontend.proxy_guard import proxy_guard_env
from pipeline.grammar.memory import set_memory_budget
from pipeline.tracing.otel import flush_tracing, setup_tracing

__all__ = ["DRAIN_GRACE_S", "EngineReplica", "SpecrelayServer", "build_app", "loopback_ray",
           "resolve_config_path", "serve_main"]

log = logging.getLogger(__name__)

APP_NAME = "specrelay"
DEFAULT_CONFIG = "configs/smollm2-cpu.yaml"
# Helm chart (values.yaml) names -> EngineConfig fields.
OVERRIDE_ALIASES = {"target_model": "model", "draft_kind": "draft"}


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
    """The ingress replica: the HTTP app over the engine deployment (`engine`, a handle)."""

    async def __init__(self, config_path: str | None, overrides: dict[str, Any],
                       settings: dict[str, Any], engine: Any) -> None:
        # lazy: the tokenizer loaders import torch, needed in the replica, not in `serve`
        from pipeline.models.runners import load_engine_tokenizer

        loopback_replica_grpc()
        config, server_settings = replica_config(config_path, overrides, settings)
        set_memory_budget(config.grammar_memory_mb << 20)  # this process compiles grammars
        setup_tracing("specrelay-frontend", config.tracing, register_global=False)
        tokenizer = await asyncio.to_thread(load_engine_tokenizer, config)
        app = serve.get_replica_context().app_name
        self.client = ReplicaClient(engine, EngineDirectory(app))
        self.http_app = create_app(self.client, tokenizer, server_settings)

    def __serve_build_asgi_app__(self) -> Any:
        return self.http_app

    async def engine_stats(self) -> dict[str, Any]:
        """Every replica's engine stats merged; per replica under `replicas`."""
        return await self.client.stats()

    async def engine_actor(self) -> Any:
        """The first replica's Engine actor handle (operations and failure tests)."""
        engines = await self.client.engine_actors()
        return next(iter(engines.values()), None)

    async def engine_actors(self) -> dict[str, Any]:
        """{replica id: Engine actor handle} of every engine replica."""
        return await self.client.engine_actors()

    async def drain(self, timeout_s: float) -> int:
        """Refuse new requests (503, /health 503) and wait up to timeout_s for those in flight;
        returns how many are still running."""
        return await self.http_app.state.server.drain(timeout_s)

    async def __del__(self) -> None:
        await asyncio.to_thread(flush_tracing)


def replica_config(config_path: str | None, overrides: dict[str, Any],
                   settings: dict[str, Any]) -> tuple[EngineConfig, ServerSettings]:
    """What a replica builds from build_app's bound arguments, before it starts anything (the
    chart contract test calls this on every rendered serveConfigV2)."""
    config = load_config(resolve_config_path(config_path), overrides)
    return config, ServerSettings(**{"tool_call_parser": config.tool_call_parser, **settings})


def deployment_section(args: dict[str, Any], config: EngineConfig,
                       ) -> tuple[dict[str, Any], DeploymentSettings]:
    """The engine deployment's `deployment:` section: the config's (file, then `overrides`),
    then args' `deployment` keys (blank ones dropped; `autoscaling: null` turns it off), then
    `num_replicas` (a fixed count: autoscaling off); and its parsed settings (ValueError naming
    the key)."""
    given = args.get("deployment") or {}
    if not isinstance(given, dict):
        raise ValueError("deployment: must be a mapping")  # noqa: TRY004 - an args error
    raw = dict(config.deployment)
    for key, value in given.items():
        if value == "" or (value is None and key != "autoscaling"):
            continue
        raw[key] = value
    if args.get("num_replicas") is not None:
        raw.update(replicas=int(args["num_replicas"]), autoscaling=None)
    return raw, parse_deployment(raw)


def engine_options(settings: DeploymentSettings, config: EngineConfig) -> dict[str, Any]:
    """Serve options of the engine deployment: its size (fixed or autoscaled) and router."""
    options: dict[str, Any] = {}
    if settings.autoscaling is not None:
        options["autoscaling_config"] = settings.autoscaling_config
    else:
        options["num_replicas"] = settings.replicas
    if settings.routing == "prefix":
        options["request_router_config"] = RequestRouterConfig(
            request_router_class=ROUTER_PATH,
            request_router_kwargs={"block_size": config.block_size,
                                   "imbalance_threshold": settings.imbalance_threshold})
    return options


def build_app(args: dict[str, Any]) -> serve.Application:
    """The Serve application for `args` (see the module docstring)."""
    args = dict(args or {})
    config_path = args.get("config")
    overrides = engine_overrides(args.get("overrides"))
    config = load_config(resolve_config_path(config_path), overrides)
    section, settings = deployment_section(args, config)
    grace: dict[str, Any] = {}
    if "drain_grace_s" in args:  # both: the ingress's streams and each replica's
        grace["graceful_shutdown_timeout_s"] = float(args["drain_grace_s"])
    engine = EngineReplica.options(
        **engine_options(settings, config), **grace,
    ).bind(config_path, {**overrides, "deployment": section})
    ingress = SpecrelayServer.options(**grace) if grace else SpecrelayServer
    return ingress.bind(config_path, overrides, server_settings(args), engine=engine)


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
    p.add_argument("--replicas", type=int, default=None,
                   help="engine replicas (a fixed count; default: the config's deployment:)")
    p.add_argument("--routing", choices=ROUTINGS, default=None,
                   help="prefix: to the replica holding the prompt's prefix; pow2: by load")
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
    if args.replicas is not None:
        app_args["num_replicas"] = args.replicas
    if args.routing is not None:
        app_args["deployment"] = {"routing": args.routing}
    serve.start(http_options={"host": args.host, "port": args.port})
    serve.run(build_app(app_args), name=APP_NAME, route_prefix="/", blocking=False)
    print(f"specrelay: serving on http://{args.host}:{args.port}/v1 "
          f"(health: /health, metrics: /metrics){' with an API key' if args.api_key else ''}",
          flush=True)
    stop.wait()
    if not init.get("address") and not local_ray_survived():
        # A signal to the whole process group (systemd's default KillMode, `timeout`) ended the
        # local Ray's GCS and raylet too: nothing is left to drain, and Serve's and Ray's
        # shutdowns would wait a minute for the GCS. The actors went with their raylet.
        print("specrelay: the local Ray was stopped with this process; exiting", flush=True)
        sys.stderr.flush()
        os._exit(0)
    drain_app(args.drain_grace)
    serve.shutdown()
    ray.shutdown()
    return 0


def local_ray_survived(settle_s: float = 1.0) -> bool:
    """Whether this process's local Ray (GCS, raylet) is still running `settle_s` after the stop
    signal (a signal sent to the process group reaches them at the same moment)."""
    node = getattr(ray._private.worker, "_global_node", None)
    if node is None:
        return True
    deadline = time.monotonic() + settle_s
    while time.monotonic() < deadline:
        if not node.remaining_processes_alive():
            return False
        time.sleep(0.1)
    return node.remaining_processes_alive()


def drain_app(grace_s: float) -> None:
    """Stop taking requests and let those in flight finish (at most grace_s seconds)."""
    try:
        left = serve.get_app_handle(APP_NAME).drain.remote(grace_s).result(
            timeout_s=grace_s + 10)
        if left:
            log.warning("drain: %d requests still in flight after %.0fs", left, grace_s)
    except Exception as e:  # noqa: BLE001 - shutting down either way
        log.warning("drain failed: %s", e)
