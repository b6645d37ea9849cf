"""Chart <-> code contract: what the chart renders is what the code accepts.

For several value sets the rendered `serveConfigV2` is validated with Ray Serve's own schema, then
its application is built exactly as a replica would, without Ray: `import_path` is imported,
called with `args` (build_app), and the bound arguments go through `replica_config` (the engine
config and server settings the replica starts with). Paths inside the image (`/app/...`, as
docker/Dockerfile lays it out) are read from this checkout. Every env var the chart puts on the
Ray containers must be one the code (ours or Ray's) reads, with the meaning the chart intends.
"""

from __future__ import annotations

import importlib
import json
import re
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml
from support.helm_chart import (
    REPO,
    crd_errors,
    env_of,
    one,
    pod_specs,
    ray_container,
    render,
    worker_group,
)

from actors.serve_app import replica_config
from pipeline.config import EngineConfig, load_config
from pipeline.deployment import Autoscaling, DeploymentSettings
from pipeline.frontend.app import API_KEY_ENV, ServerSettings
from pipeline.tracing.otel import resolve_config

DOCKERFILE = REPO / "docker" / "Dockerfile"
IMAGE_ROOT = "/app"  # WORKDIR of docker/Dockerfile, where it copies configs/

# Value sets the chart is rendered with: (id, --set arguments, --set-json arguments).
VALUE_SETS = {
    "defaults": ((), ()),
    "tp2-model-draft": (("specrelay.tensorParallelSize=2", "worker.gpus=4",
                         "specrelay.draft.kind=model", "specrelay.draft.model=/models/draft",
                         "specrelay.draft.numSpeculativeTokens=5"), ()),
    "api-key-existing-secret": (("specrelay.apiKey.existingSecret=team-llm-key",
                                 "specrelay.apiKey.secretKey=token"), ()),
    "otel-grpc": (("otel.endpoint=http://otel-collector.observability:4317",
                   "otel.serviceName=llm-prod"), ()),
    "otel-http": (("otel.endpoint=http://otel-collector.observability:4318",
                   "otel.protocol=http/protobuf"), ()),
    "max-choices": (("specrelay.maxChoicesPerRequest=8",), ()),
    "placement-strict-pack": (
        ("specrelay.tensorParallelSize=2", "worker.gpus=2", "worker.replicas=2"),
        (('specrelay.placement={"verifierStrategy": "STRICT_PACK", '
          '"draftResources": {"draft_node": 0.5}, "engineResources": {"cpu_pool": 1}}'),)),
    "replicas-2-pow2": (("specrelay.deployment.replicas=2", "specrelay.deployment.routing=pow2",
                         "specrelay.deployment.imbalanceThreshold=3", "worker.replicas=2"), ()),
    "autoscaling-tp2": (
        ("specrelay.tensorParallelSize=2", "worker.gpus=2",
         "specrelay.deployment.autoscaling.enabled=true"),
        (('specrelay.deployment.autoscaling={"enabled": true, "minReplicas": 2, "maxReplicas": 4, '
          '"targetOngoingRequests": 2.5, "upscaleDelaySeconds": 5, "downscaleDelaySeconds": 60}'),)),
    "autoscaling-1-6-model-draft": (
        ("specrelay.tensorParallelSize=4", "worker.gpus=8", "specrelay.draft.kind=model",
         "specrelay.draft.model=/models/draft", "specrelay.deployment.autoscaling.enabled=true",
         "specrelay.deployment.autoscaling.maxReplicas=6"), ()),
}


def rendered(name: str) -> dict:
    sets, json_sets = VALUE_SETS[name]
    return one(render(*sets, *(f"json:{j}" for j in json_sets)), "RayService")


def in_checkout(path: str) -> str:
    """A path inside the image, read from this checkout (docker/Dockerfile copies configs/ to
    IMAGE_ROOT/configs)."""
    if path.startswith(IMAGE_ROOT + "/"):
        return str(REPO / path[len(IMAGE_ROOT) + 1:])
    return path


def build_app(serve_config: dict) -> tuple[Any, Any]:
    """The one application of a serveConfigV2, built as Serve builds it: the bound ingress and
    engine deployments."""
    from ray.serve.schema import ServeDeploySchema

    ServeDeploySchema.model_validate(serve_config)  # Serve's own validation (what KubeRay submits)
    (app_config,) = serve_config["applications"]
    module, attr = app_config["import_path"].split(":")
    args = dict(app_config["args"])
    if args.get("config"):  # build_app reads the config's deployment: section
        args["config"] = in_checkout(args["config"])
    app = getattr(importlib.import_module(module), attr)(args)
    ingress = app._bound_deployment
    engine = ingress.init_kwargs["engine"]._bound_deployment
    named = {d["name"] for d in app_config.get("deployments", [])}
    assert named <= {ingress.name, engine.name}, (
        f"serveConfigV2 configures unknown deployments {named}")
    return ingress, engine


def build_replica(serve_config: dict) -> tuple[EngineConfig, ServerSettings]:
    """The engine config and server settings the ingress replica starts with."""
    ingress, _ = build_app(serve_config)
    config_path, overrides, settings = ingress.init_args
    return replica_config(in_checkout(config_path) if config_path else None, overrides, settings)


# --- the contract, per value set -----------------------------------------------------------------


@pytest.mark.parametrize("name", list(VALUE_SETS))
def test_rendered_serve_config_builds_a_replica_config(name):
    rs = rendered(name)
    config, settings = build_replica(yaml.safe_load(rs["spec"]["serveConfigV2"]))
    values = chart_values(name)
    assert config.model == values["specrelay"]["model"]
    assert config.draft == values["specrelay"]["draft"]["kind"]
    assert config.tensor_parallel_size == values["specrelay"]["tensorParallelSize"]
    if config.draft != "none":
        assert config.num_speculative_tokens == values["specrelay"]["draft"]["numSpeculativeTokens"]
    assert settings.api_key is None  # the key comes from the env the chart sets (below)
    assert settings.max_choices_per_request == values["specrelay"]["maxChoicesPerRequest"]
    group = rs["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]
    gpus = int(group["rayStartParams"]["num-gpus"]) * group["replicas"]
    assert config.tensor_parallel_size <= gpus, "not enough GPUs for one verifier per rank"


@pytest.mark.parametrize("name", list(VALUE_SETS))
def test_deployment_values_become_the_config_deployment_settings(name):
    """specrelay.deployment.* -> the engine config's `deployment:` section, parsed by the code."""
    config, _ = build_replica(yaml.safe_load(rendered(name)["spec"]["serveConfigV2"]))
    assert config.deployment_settings == expected_deployment(chart_values(name))


@pytest.mark.parametrize("name", list(VALUE_SETS))
def test_the_engine_deployment_runs_the_replicas_autoscaling_and_router_the_values_say(name):
    """What Serve gets for the engine deployment (EngineReplica): a fixed num_replicas or the
    autoscaling_config, the request router, the drain period; and each engine replica's own
    config (its bound arguments, loaded as the replica loads them) carries the same section."""
    from ray.serve.config import AutoscalingConfig

    serve_config = yaml.safe_load(rendered(name)["spec"]["serveConfigV2"])
    _, engine = build_app(serve_config)
    expected = expected_deployment(chart_values(name))
    options = engine._deployment_config
    if expected.autoscaling is None:
        assert options.autoscaling_config is None
        assert options.num_replicas == expected.replicas
    else:
        assert options.autoscaling_config == AutoscalingConfig(**expected.autoscaling_config)
    router = options.request_router_config.request_router_class
    assert (router == "actors.prefix_router:PrefixAffinityRouter") == (
        expected.routing == "prefix")
    if expected.routing == "prefix":
        kwargs = options.request_router_config.request_router_kwargs
        assert kwargs["imbalance_threshold"] == expected.imbalance_threshold
    (app_config,) = serve_config["applications"]
    grace = {d["name"]: d["graceful_shutdown_timeout_s"] for d in app_config["deployments"]}
    assert grace[engine.name] == chart_values(name)["drain"]["gracePeriodSeconds"]
    config_path, overrides = engine.init_args
    assert load_config(in_checkout(config_path), overrides).deployment_settings == expected


@pytest.mark.parametrize("name", list(VALUE_SETS))
def test_the_worker_group_holds_the_most_engine_replicas_the_config_allows(name):
    """GPUs the engine replicas take at most (each: a GPU per TP rank, and one for a model draft
    on cuda, as actors/engine.py places them) fit in the worker group's largest size, and with
    autoscaling the chart turns KubeRay's autoscaler on."""
    rs = rendered(name)
    config, _ = build_replica(yaml.safe_load(rs["spec"]["serveConfigV2"]))
    deployment = config.deployment_settings
    cluster = rs["spec"]["rayClusterConfig"]
    group = worker_group(rs)
    most = deployment.replicas if deployment.autoscaling is None else (
        deployment.autoscaling.max_replicas)
    per_replica = config.tensor_parallel_size + (config.draft == "model")
    pods = group["maxReplicas"] if deployment.autoscaling else group["replicas"]
    assert most * per_replica <= pods * int(group["rayStartParams"]["num-gpus"])
    assert cluster["enableInTreeAutoscaling"] is (deployment.autoscaling is not None)
    if deployment.autoscaling is not None:
        assert group["minReplicas"] >= 1  # Serve's proxy (the Service's endpoint) on a worker


@pytest.mark.parametrize("name", list(VALUE_SETS))
def test_every_value_set_renders_a_rayservice_the_kuberay_crd_accepts(name):
    assert crd_errors(rendered(name)) == []


@pytest.mark.parametrize("name", list(VALUE_SETS))
def test_every_env_var_the_chart_sets_is_read_by_the_code(name):
    rs = rendered(name)
    for pod, template in pod_specs(rs).items():
        env = env_of(ray_container(template))
        unread = sorted(set(env) - set(ENV_CHECKS))
        assert not unread, f"{pod}: the chart sets {unread}, which no code reads"
        for var, entry in env.items():
            value = entry.get("value", "from-a-secret")  # secretKeyRef: any value will do
            ENV_CHECKS[var](value)


def test_default_chart_config_is_the_shipped_gpu_example_with_tracing_off():
    config, _ = build_replica(yaml.safe_load(rendered("defaults")["spec"]["serveConfigV2"]))
    assert config.attention_backend == "flash" and config.device == "cuda"
    assert config.tracing == {"exporter": "none"}  # the chart's otel values decide
    assert config.placement_spec.verifier_strategy == "PACK"


@pytest.mark.parametrize(("name", "protocol", "endpoint"), [
    ("otel-grpc", "grpc", "http://otel-collector.observability:4317"),
    ("otel-http", "http/protobuf", "http://otel-collector.observability:4318/v1/traces"),
])
def test_otel_values_turn_on_otlp_export_in_every_process(name, protocol, endpoint):
    rs = rendered(name)
    config, _ = build_replica(yaml.safe_load(rs["spec"]["serveConfigV2"]))
    for template in pod_specs(rs).values():
        env = {k: e["value"] for k, e in env_of(ray_container(template)).items() if "value" in e}
        # What each actor process resolves: the config's section over the pod's OTEL_* env.
        resolved = resolve_config("specrelay-output", config.tracing, environ=env)
        assert (resolved.exporter, resolved.otlp_protocol, resolved.otlp_endpoint) == (
            "otlp", protocol, endpoint)
        assert resolved.service_name == env["OTEL_SERVICE_NAME"]


def test_api_key_from_an_existing_secret_reaches_the_server_settings(monkeypatch):
    rs = rendered("api-key-existing-secret")
    _, settings = build_replica(yaml.safe_load(rs["spec"]["serveConfigV2"]))
    docs_secrets = [d["metadata"]["name"] for d in render(*VALUE_SETS["api-key-existing-secret"][0])
                    if d["kind"] == "Secret"]
    assert "team-llm-key" not in docs_secrets  # the chart does not create it
    for template in pod_specs(rs).values():
        ref = env_of(ray_container(template))[API_KEY_ENV]["valueFrom"]["secretKeyRef"]
        assert ref == {"name": "team-llm-key", "key": "token"}
    monkeypatch.setenv(API_KEY_ENV, "k-from-secret")
    assert settings.resolved_api_key() == "k-from-secret"


def test_max_choices_value_caps_the_choices_of_a_request():
    _, settings = build_replica(yaml.safe_load(rendered("max-choices")["spec"]["serveConfigV2"]))
    assert settings.max_choices_per_request == 8


@pytest.mark.parametrize("name", ["defaults", "api-key-existing-secret"])
def test_every_ray_pod_runs_the_proxy_guard_so_serve_routes_need_the_key(name, monkeypatch):
    """The environment the chart gives each Ray container (where Serve's proxy runs): the proxy
    callback it names, imported and called there as Serve does, keys /-/routes."""
    import asyncio

    import httpx

    from pipeline.frontend.proxy_guard import CALLBACK_ENV

    for pod, template in pod_specs(rendered(name)).items():
        env = env_of(ray_container(template))
        assert CALLBACK_ENV in env and API_KEY_ENV in env, pod
        assert "secretKeyRef" in env[API_KEY_ENV]["valueFrom"]
        monkeypatch.setenv(API_KEY_ENV, "key-from-the-secret")  # what the secretKeyRef gives
        module, attr = env[CALLBACK_ENV]["value"].split(":")
        middlewares = getattr(importlib.import_module(module), attr)()

        async def serve_proxy(scope, receive, send):  # Serve's proxy answers /-/routes itself
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b'{"/":"specrelay"}'})

        app = serve_proxy
        for m in reversed(middlewares):  # as Serve wraps its proxy app
            app = m.cls(app, *m.args, **m.kwargs)

        async def get(headers, app=app):
            transport = httpx.ASGITransport(app=app, client=("10.1.2.3", 40000))
            async with httpx.AsyncClient(transport=transport, base_url="http://pod") as c:
                return (await c.get("/-/routes", headers=headers)).status_code

        assert asyncio.run(get({})) == 401, pod
        assert asyncio.run(get({"authorization": "Bearer wrong"})) == 401, pod
        assert asyncio.run(get({"authorization": "Bearer key-from-the-secret"})) == 200, pod


def test_placement_values_become_the_config_placement():
    rs = rendered("placement-strict-pack")
    config, _ = build_replica(yaml.safe_load(rs["spec"]["serveConfigV2"]))
    spec = config.placement_spec
    assert spec.verifier_strategy == "STRICT_PACK"
    assert spec.draft_resources == {"draft_node": 0.5}
    assert spec.engine_resources == {"cpu_pool": 1.0}
    assert spec.verifier_bundles(2, gpu=True) == [{"CPU": 1, "GPU": 1}] * 2


def test_strict_pack_wider_than_a_worker_fails_to_render():
    from support.helm_chart import CHART, RELEASE, helm

    out = helm("template", RELEASE, str(CHART), "--set", "specrelay.tensorParallelSize=2",
               "--set", "worker.replicas=2", "--set",
               "specrelay.placement.verifierStrategy=STRICT_PACK")
    assert out.returncode != 0 and "STRICT_PACK" in out.stderr


@pytest.mark.parametrize(("path", "value", "field"), [
    (("overrides", "num_speculative_tokens"), 0, "num_speculative_tokens"),
    (("overrides", "placement", "verifier_strategy"), "pack", "verifier_strategy"),
    (("overrides", "tracing"), {"exporter": "otlp-grpc"}, "tracing"),
    (("overrides", "speculative_tokens"), 4, "speculative_tokens"),
    (("overrides", "deployment", "routing"), "round_robin", "deployment.routing"),
    (("overrides", "deployment", "autoscaling"), {"min_replicas": 1, "max_replica": 2},
     "max_replica"),
])
def test_a_value_the_code_rejects_fails_the_contract(path, value, field):
    serve_config = yaml.safe_load(rendered("defaults")["spec"]["serveConfigV2"])
    node = serve_config["applications"][0]["args"]
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    with pytest.raises(ValueError, match=field):
        build_replica(serve_config)


def test_every_chart_value_the_config_reference_names_is_in_the_chart():
    """docs/config.md's `chart` column names values.yaml keys that exist (a renamed value shows)."""
    text = (REPO / "docs" / "config.md").read_text()
    values = yaml.safe_load((REPO / "helm/specrelay/values.yaml").read_text())
    named = set()
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and len(cells) >= 5:
            named |= set(re.findall(r"`(specrelay\.[A-Za-z.]+)`", cells[-1]))
    assert "specrelay.deployment.autoscaling.targetOngoingRequests" in named
    for dotted in sorted(named):
        node = values
        for key in dotted.split("."):
            assert isinstance(node, dict) and key in node, f"docs/config.md names {dotted}"
            node = node[key]


def test_the_image_holds_the_configs_where_the_chart_looks():
    text = DOCKERFILE.read_text()
    assert re.search(rf"^WORKDIR {IMAGE_ROOT}$", text, re.MULTILINE), "Dockerfile WORKDIR moved"
    assert re.search(r"^COPY .*\bconfigs \./configs$", text, re.MULTILINE), "configs/ not copied"
    default = yaml.safe_load((REPO / "helm/specrelay/values.yaml").read_text())
    assert default["specrelay"]["config"].startswith(IMAGE_ROOT + "/configs/")
    assert Path(in_checkout(default["specrelay"]["config"])).is_file()


# --- helpers -------------------------------------------------------------------------------------


def chart_values(name: str) -> dict:
    """The chart's values for a value set: values.yaml with the set's --set / --set-json on top."""
    values = yaml.safe_load((REPO / "helm/specrelay/values.yaml").read_text())
    sets, json_sets = VALUE_SETS[name]
    for s in sets:
        key, raw = s.split("=", 1)
        _assign(values, key, {"true": True, "false": False}.get(raw, int(raw) if raw.isdigit()
                                                                else raw))
    for s in json_sets:
        key, raw = s.split("=", 1)
        _assign(values, key, json.loads(raw))
    return values


def expected_deployment(values: dict) -> DeploymentSettings:
    """The DeploymentSettings the chart's values mean (docs/config.md's `chart` column)."""
    d = values["specrelay"]["deployment"]
    a = d["autoscaling"]
    autoscaling = None
    if a["enabled"]:
        autoscaling = Autoscaling(
            min_replicas=a["minReplicas"], max_replicas=a["maxReplicas"],
            target_ongoing_requests=a["targetOngoingRequests"],
            upscale_delay_s=a["upscaleDelaySeconds"],
            downscale_delay_s=a["downscaleDelaySeconds"])
    return DeploymentSettings(replicas=d["replicas"], routing=d["routing"],
                              imbalance_threshold=d["imbalanceThreshold"], autoscaling=autoscaling)


def _assign(values: dict, dotted: str, value: object) -> None:
    *parents, last = dotted.split(".")
    for key in parents:
        values = values.setdefault(key, {})
    values[last] = value


def _read_by_otel(var: str, field: str):
    def check(value: str) -> None:
        resolved = resolve_config("specrelay", {}, environ={var: value})
        assert getattr(resolved, field) == value, f"{var} does not set {field}"
    return check


def _read_by_server_settings(value: str) -> None:
    import os

    old = os.environ.get(API_KEY_ENV)
    os.environ[API_KEY_ENV] = value
    try:
        assert ServerSettings().resolved_api_key() == value
    finally:
        if old is None:
            del os.environ[API_KEY_ENV]
        else:
            os.environ[API_KEY_ENV] = old


@cache
def _ray_reads(var: str) -> bool:
    import ray

    root = Path(ray.__file__).parent
    return any(var.encode() in p.read_bytes()
               for p in [root / "_raylet.so", *root.glob("_private/**/*.py")] if p.is_file())


def _read_by_serve_proxy(value: str) -> None:
    """RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH: Serve's proxy reads it, and the value names a
    function returning middlewares (the proxy guard)."""
    import ray.serve._private.constants as serve_constants

    assert "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH" in Path(serve_constants.__file__).read_text()
    module, attr = value.split(":")
    assert all(hasattr(m, "cls") for m in getattr(importlib.import_module(module), attr)())


def _read_by_ray(var: str):
    """Ray's own variables: the name must occur in the installed Ray (its C++ core reads the
    auth ones, so the compiled module is searched too)."""
    def check(_value: str) -> None:
        assert _ray_reads(var), f"the installed Ray does not read {var}"
    return check


# Every env var the chart may set -> a check that the code reads it with the chart's meaning.
ENV_CHECKS = {
    "OTEL_SERVICE_NAME": _read_by_otel("OTEL_SERVICE_NAME", "service_name"),
    API_KEY_ENV: _read_by_server_settings,
    "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH": _read_by_serve_proxy,
    "RAY_AUTH_MODE": _read_by_ray("RAY_AUTH_MODE"),
    "RAY_AUTH_TOKEN": _read_by_ray("RAY_AUTH_TOKEN"),
}
