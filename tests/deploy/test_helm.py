"""The Helm chart in helm/specrelay, rendered with the real helm binary.

helm comes from .tools/helm (the Makefile runs scripts/install_helm.sh) or PATH; without it
these tests fail rather than skip. The RayService is validated against the KubeRay CRD schema
vendored in tests/deploy/crds/kuberay/, core kinds with kubernetes-validate.
"""

from __future__ import annotations

import base64
from functools import cache

import jsonschema
import pytest
import yaml
from support.helm_chart import (
    CHART,
    CRDS,
    RELEASE,
    crd_errors,
    env_of,
    helm,
    one,
    pod_specs,
    ray_container,
    render,
    render_drain,
    rule_ports,
    strict_schema,
    worker_group,
)

KUBE_VERSION = "1.30.0"

# Ray's ports as the chart's defaults pin them (values.yaml: ray.ports).
RAY_PORTS = {6379, 8265, 10001, 8080, 52365, 52366, 52367, 6380, 6381}
RAY_WORKER_PORT_RANGE = (10002, 19999)
HTTP_PORT = 8000


# Values used by the custom-render tests, as --set arguments.
CUSTOM = (
    "worker.gpus=4",
    "worker.replicas=2",
    "specrelay.tensorParallelSize=4",
    "specrelay.model=meta-llama/Llama-3.1-70B-Instruct",
    "specrelay.draft.kind=model",
    "specrelay.draft.model=meta-llama/Llama-3.2-1B-Instruct",
    "specrelay.draft.numSpeculativeTokens=6",
    "specrelay.config=/app/configs/llama70b.yaml",
    "otel.endpoint=http://otel-collector.observability:4318",
    "otel.protocol=http/protobuf",
    r"worker.nodeSelector.cloud\.google\.com/gke-accelerator=nvidia-h100-80gb",
    "worker.tolerations[0].key=dedicated",
    "worker.tolerations[0].operator=Equal",
    "worker.tolerations[0].value=llm",
    "worker.tolerations[0].effect=NoSchedule",
)


# Engine replicas: autoscaling between two and four TP-2 replicas on 2-GPU workers, and a fixed two.
AUTOSCALING_TWO = (
    "specrelay.deployment.autoscaling.enabled=true",
    "specrelay.deployment.autoscaling.minReplicas=2",
    "specrelay.deployment.autoscaling.maxReplicas=4",
    "specrelay.tensorParallelSize=2",
    "worker.gpus=2",
)
FIXED_TWO = ("specrelay.deployment.replicas=2", "specrelay.deployment.routing=pow2",
             "worker.replicas=2")


# --- the tool and the chart ----------------------------------------------------------------------


def test_helm_lint_passes_strict():
    out = helm("lint", "--strict", str(CHART))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "0 chart(s) failed" in out.stdout


def test_default_render_has_exactly_the_expected_objects():
    kinds = sorted(d["kind"] for d in render())
    assert kinds == ["NetworkPolicy", "RayService", "Secret", "Secret", "Service"]


# --- values flow into the RayService -------------------------------------------------------------


def test_custom_values_render_into_the_rayservice():
    rs = one(render(*CUSTOM), "RayService")
    group = worker_group(rs)
    worker = ray_container(group["template"])

    assert group["replicas"] == 2
    assert group["minReplicas"] == 2 and group["maxReplicas"] == 2
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == 4
    assert group["rayStartParams"]["num-gpus"] == "4"
    assert group["template"]["spec"]["nodeSelector"] == {
        "cloud.google.com/gke-accelerator": "nvidia-h100-80gb"
    }
    assert group["template"]["spec"]["tolerations"] == [
        {"key": "dedicated", "operator": "Equal", "value": "llm", "effect": "NoSchedule"}
    ]

    serve = yaml.safe_load(rs["spec"]["serveConfigV2"])
    (app,) = serve["applications"]
    assert app["import_path"] == "actors.serve_app:build_app"
    assert app["route_prefix"] == "/"
    assert app["args"] == {
        "config": "/app/configs/llama70b.yaml",
        "max_choices_per_request": 64,
        "overrides": {
            "target_model": "meta-llama/Llama-3.1-70B-Instruct",
            "draft_kind": "model",
            "draft_model": "meta-llama/Llama-3.2-1B-Instruct",
            "num_speculative_tokens": 6,
            "tensor_parallel_size": 4,
            "tracing": {"exporter": "otlp", "otlp_protocol": "http/protobuf",
                        "otlp_endpoint": "http://otel-collector.observability:4318"},
            "placement": {"verifier_strategy": "PACK", "verifier_resources": {},
                          "draft_resources": {}, "output_resources": {}, "engine_resources": {}},
            "deployment": {"replicas": 1, "routing": "prefix", "imbalance_threshold": 8,
                           "autoscaling": None},
        },
    }
    assert serve["http_options"]["port"] == HTTP_PORT


def test_defaults_suit_a_gpu_cluster():
    rs = one(render(), "RayService")
    group = worker_group(rs)
    app = yaml.safe_load(rs["spec"]["serveConfigV2"])["applications"][0]
    assert app["args"]["overrides"]["tensor_parallel_size"] == 1
    assert app["args"]["overrides"]["draft_kind"] == "ngram"
    assert "draft_model" not in app["args"]["overrides"]
    assert ray_container(group["template"])["resources"]["limits"]["nvidia.com/gpu"] == 1
    head = rs["spec"]["rayClusterConfig"]["headGroupSpec"]
    assert head["rayStartParams"]["num-gpus"] == "0"
    assert "nvidia.com/gpu" not in ray_container(head["template"])["resources"].get("limits", {})
    # Without an endpoint tracing is off, whatever the config file says.
    assert app["args"]["overrides"]["tracing"] == {"exporter": "none"}


def test_api_key_comes_from_a_secret_on_every_ray_container():
    docs = render("specrelay.apiKey.value=sk-test-123")
    rs = one(docs, "RayService")
    secrets = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Secret"}
    for name, template in pod_specs(rs).items():
        ref = env_of(ray_container(template))["SPECRELAY_API_KEY"]["valueFrom"]["secretKeyRef"]
        data = secrets[ref["name"]]["data"]
        assert base64.b64decode(data[ref["key"]]).decode() == "sk-test-123", name


def test_workers_probe_health_on_the_http_port():
    worker = ray_container(worker_group(one(render(), "RayService"))["template"])
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert worker[probe]["httpGet"] == {"path": "/health", "port": HTTP_PORT}, probe
    assert {"name": "serve", "containerPort": HTTP_PORT} in worker["ports"]


# --- schemas -------------------------------------------------------------------------------------


@pytest.mark.parametrize("sets", [(), CUSTOM, ("rayAuth.enabled=false", "worker.gpus=0"),
                                  AUTOSCALING_TWO, FIXED_TWO])
def test_rendered_rayservice_validates_against_the_kuberay_crd(sets):
    rs = one(render(*sets), "RayService")
    assert rs["apiVersion"] == "ray.io/v1"
    assert crd_errors(rs) == []


@pytest.mark.parametrize(
    "path, value, field",
    [
        (("spec", "rayClusterConfig", "workerGroupSpecs", 0, "replicas"), "two", "replicas"),
        (("spec", "rayClusterConfig", "authOptions", "mode"), "password", "mode"),
        (
            ("spec", "rayClusterConfig", "headGroupSpec", "template", "spec", "nodeSelectr"),
            {},
            "nodeSelectr",
        ),
    ],
)
def test_crd_validation_rejects_a_broken_rayservice(path, value, field):
    rs = one(render(), "RayService")
    node = rs
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    errors = crd_errors(rs)
    assert errors, f"setting {path} to {value!r} passed the CRD schema"
    assert any(field in e for e in errors)


def test_core_kinds_validate_against_kubernetes_schemas():
    try:
        import kubernetes_validate
    except ImportError:
        pytest.fail("kubernetes-validate is not installed (pip install kubernetes-validate)")

    for sets in [(), CUSTOM, ("service.type=LoadBalancer",)]:
        for doc in render(*sets):
            if doc["apiVersion"].startswith("ray.io/"):
                continue
            kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)


@pytest.mark.parametrize(
    "bad, message",
    [
        ("worker.gpus=-1", "/worker/gpus"),
        ("specrelay.draft.kind=eagle", "/specrelay/draft/kind"),
        ("specrelay.draft.kind=model", "/specrelay/draft/model"),  # kind model needs a model
        ("specrelay.tensorParallelSize=0", "/specrelay/tensorParallelSize"),
        ("specrelay.draft.numSpeculativeTokens=0", "/specrelay/draft/numSpeculativeTokens"),
        ("worker.replicas=two", "/worker/replicas"),
        ("service.type=Ingress", "/service/type"),
        ("drain.gracePeriodSeconds=-5", "/drain/gracePeriodSeconds"),
        ("ray.ports.gcs=70000", "/ray/ports/gcs"),
        ("otel.endpoint=collector:4317", "/otel/endpoint"),
        ("wroker.gpus=2", "wroker"),  # typo of a top-level key
        ("specrelay.deployment.routing=round_robin", "/specrelay/deployment/routing"),
        ("specrelay.deployment.replicas=0", "/specrelay/deployment/replicas"),
        ("specrelay.deployment.imbalanceThreshold=-1", "/specrelay/deployment/imbalanceThreshold"),
        ("specrelay.deployment.autoscaling.enabled=yes", "/specrelay/deployment/autoscaling/enabled"),
        ("specrelay.deployment.autoscaling.maxReplicas=0",
         "/specrelay/deployment/autoscaling/maxReplicas"),
        # no engine replica: /health 503, the probes empty the Service, nothing scales it up
        ("specrelay.deployment.autoscaling.minReplicas=0",
         "/specrelay/deployment/autoscaling/minReplicas"),
        ("specrelay.deployment.autoscaling.targetOngoingRequests=0",
         "/specrelay/deployment/autoscaling/targetOngoingRequests"),
        ("specrelay.deployment.autoscaling.upscaleDelaySeconds=-1",
         "/specrelay/deployment/autoscaling/upscaleDelaySeconds"),
        ("specrelay.deployment.autoscaling.minReplica=1", "minReplica"),
        ("autoscaler.upscalingMode=Fast", "/autoscaler/upscalingMode"),
        ("autoscaler.idleTimeoutSeconds=-1", "/autoscaler/idleTimeoutSeconds"),
    ],
)
def test_values_schema_rejects_bad_values(bad, message):
    out = helm("template", RELEASE, str(CHART), "--set", bad)
    assert out.returncode != 0, f"--set {bad} rendered"
    assert "schema" in out.stderr and message in out.stderr, out.stderr


def test_tensor_parallel_size_beyond_the_gpus_fails():
    sets = ["specrelay.tensorParallelSize=4", "worker.gpus=1", "worker.replicas=2"]
    out = helm("template", RELEASE, str(CHART), *(a for s in sets for a in ("--set", s)))
    assert out.returncode != 0
    assert "tensorParallelSize (4)" in out.stderr and "has 2" in out.stderr


# --- engine replicas and autoscaling -------------------------------------------------------------


def test_autoscaling_is_off_by_default():
    cluster = one(render(), "RayService")["spec"]["rayClusterConfig"]
    assert cluster["enableInTreeAutoscaling"] is False
    assert "autoscalerOptions" not in cluster
    app = yaml.safe_load(one(render(), "RayService")["spec"]["serveConfigV2"])["applications"][0]
    assert app["args"]["overrides"]["deployment"]["autoscaling"] is None


def test_autoscaling_turns_on_the_kuberay_autoscaler_with_the_ray_token():
    docs = render(*AUTOSCALING_TWO, "autoscaler.idleTimeoutSeconds=300",
                  "autoscaler.upscalingMode=Conservative")
    cluster = one(docs, "RayService")["spec"]["rayClusterConfig"]
    assert cluster["enableInTreeAutoscaling"] is True
    options = cluster["autoscalerOptions"]
    assert options["idleTimeoutSeconds"] == 300 and options["upscalingMode"] == "Conservative"
    env = {e["name"]: e for e in options["env"]}
    assert env["RAY_AUTH_MODE"]["value"] == "token"
    ref = env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]
    assert ref == {"name": cluster["authOptions"]["secretName"], "key": "auth_token"}
    no_auth = one(render(*AUTOSCALING_TWO, "rayAuth.enabled=false"), "RayService")
    assert "env" not in no_auth["spec"]["rayClusterConfig"]["autoscalerOptions"]


def test_autoscaling_values_reach_the_serve_app_in_the_engine_config_names():
    rs = one(render(*AUTOSCALING_TWO, "specrelay.deployment.autoscaling.upscaleDelaySeconds=5",
                    "specrelay.deployment.autoscaling.downscaleDelaySeconds=60",
                    "specrelay.deployment.imbalanceThreshold=3",
                    "json:specrelay.deployment.autoscaling.targetOngoingRequests=2.5"),
             "RayService")
    app = yaml.safe_load(rs["spec"]["serveConfigV2"])["applications"][0]
    assert app["args"]["overrides"]["deployment"] == {
        "replicas": 1, "routing": "prefix", "imbalance_threshold": 3,
        "autoscaling": {"min_replicas": 2, "max_replicas": 4, "target_ongoing_requests": 2.5,
                        "upscale_delay_s": 5, "downscale_delay_s": 60},
    }


# (values, worker pods: replicas, minReplicas, maxReplicas). Pods = engine replicas x GPUs per
# replica (TP, +1 for a model draft) / worker.gpus, rounded up; STRICT_PACK keeps each replica's
# ranks in one pod; at least one pod (Serve's proxy, which the Service sends clients to, runs on
# the workers).
WORKER_SIZING = [
    (("worker.gpus=1",), (1, 1, 4)),
    (("specrelay.tensorParallelSize=2", "worker.gpus=1"), (2, 2, 8)),
    (("specrelay.tensorParallelSize=2", "worker.gpus=8"), (1, 1, 1)),
    (("specrelay.tensorParallelSize=4", "worker.gpus=8",
      "specrelay.deployment.autoscaling.maxReplicas=3"), (1, 1, 2)),
    (("specrelay.tensorParallelSize=2", "worker.gpus=4", "specrelay.draft.kind=model",
      "specrelay.draft.model=/models/draft"), (1, 1, 3)),
    (("specrelay.tensorParallelSize=3", "worker.gpus=4",
      "specrelay.placement.verifierStrategy=STRICT_PACK"), (1, 1, 4)),
    (("specrelay.tensorParallelSize=2", "worker.gpus=4", "worker.minReplicas=2",
      "worker.maxReplicas=5"), (2, 2, 5)),
]


@pytest.mark.parametrize(("sets", "pods"), WORKER_SIZING)
def test_autoscaling_sizes_the_gpu_worker_group_to_follow_the_replicas(sets, pods):
    rs = one(render("specrelay.deployment.autoscaling.enabled=true", *sets), "RayService")
    group = worker_group(rs)
    assert (group["replicas"], group["minReplicas"], group["maxReplicas"]) == pods
    assert crd_errors(rs) == []


def test_max_replicas_beyond_what_the_worker_group_holds_fails_clearly():
    sets = ["specrelay.deployment.autoscaling.enabled=true", "specrelay.tensorParallelSize=2",
            "worker.gpus=2", "worker.maxReplicas=3",
            "specrelay.deployment.autoscaling.maxReplicas=4"]
    out = helm("template", RELEASE, str(CHART), *(a for s in sets for a in ("--set", s)))
    assert out.returncode != 0
    assert ("autoscaling.maxReplicas: 4 engine replica(s) x 2 GPU(s) (tensorParallelSize 2) "
            "need 4 worker pod(s)") in out.stderr
    assert "worker.maxReplicas (3) x worker.gpus (2) cannot hold them" in out.stderr


@pytest.mark.parametrize(("sets", "message"), [
    (("specrelay.deployment.replicas=2",),
     "2 engine replica(s) x 1 GPU(s) (tensorParallelSize 1) need 2 worker pod(s)"),
    # the model draft's GPU counts: TP 2 + 1 on 2-GPU pods is two pods for one replica
    (("specrelay.tensorParallelSize=2", "worker.gpus=2", "specrelay.draft.kind=model",
      "specrelay.draft.model=/models/draft"),
     "1 engine replica(s) x 3 GPU(s) (tensorParallelSize 2 + 1 for the model draft) need 2"),
])
def test_fixed_replicas_beyond_the_worker_pods_fail_clearly(sets, message):
    out = helm("template", RELEASE, str(CHART), *(a for s in sets for a in ("--set", s)))
    assert out.returncode != 0
    assert message in out.stderr and "worker.replicas is 1" in out.stderr


def test_autoscaling_min_above_max_fails():
    sets = ["specrelay.deployment.autoscaling.enabled=true",
            "specrelay.deployment.autoscaling.minReplicas=3",
            "specrelay.deployment.autoscaling.maxReplicas=2"]
    out = helm("template", RELEASE, str(CHART), *(a for s in sets for a in ("--set", s)))
    assert out.returncode != 0 and "minReplicas (3) must not exceed maxReplicas (2)" in out.stderr


# --- network exposure ----------------------------------------------------------------------------


def test_network_policy_lets_only_ray_pods_reach_ray_ports():
    docs = render()
    policy = one(docs, "NetworkPolicy")["spec"]
    rs = one(docs, "RayService")

    selector = policy["podSelector"]["matchLabels"]
    for name, template in pod_specs(rs).items():
        labels = template["metadata"]["labels"]
        assert selector.items() <= labels.items(), f"policy does not select the {name} pods"
    assert policy["policyTypes"] == ["Ingress"]

    worker_range = set(range(RAY_WORKER_PORT_RANGE[0], RAY_WORKER_PORT_RANGE[1] + 1))
    ray_ports = RAY_PORTS | worker_range
    peer_rule_ports: set[int] = set()
    for rule in policy["ingress"]:
        opened = rule_ports(rule)
        assert opened is not None, f"rule opens every port: {rule}"
        ray_opened = opened & ray_ports
        if not ray_opened:
            continue
        peers = rule.get("from")
        assert peers, f"Ray ports {sorted(ray_opened)[:5]} open to everyone"
        for peer in peers:
            if "ipBlock" in peer:
                pytest.fail(f"Ray ports open to an IP block: {peer}")
            if peer.get("podSelector", {}).get("matchLabels") == selector:
                assert "namespaceSelector" not in peer
                peer_rule_ports |= ray_opened
            else:
                # Any other peer (the KubeRay operator) may reach the dashboard only.
                assert ray_opened == {8265}, f"{peer} reaches {sorted(ray_opened)[:5]}"
                assert peer["podSelector"]["matchLabels"] == {
                    "app.kubernetes.io/name": "kuberay-operator"
                }
    assert peer_rule_ports == ray_ports  # Ray pods reach each other on all of Ray's ports

    http_rules = [r for r in policy["ingress"] if HTTP_PORT in rule_ports(r)]
    assert http_rules == [{"ports": [{"protocol": "TCP", "port": HTTP_PORT}]}]  # open to clients


def test_network_policy_http_sources_can_be_restricted():
    policy = one(
        render("networkPolicy.httpFrom[0].namespaceSelector.matchLabels.team=apps"),
        "NetworkPolicy",
    )["spec"]
    (http,) = [r for r in policy["ingress"] if HTTP_PORT in rule_ports(r)]
    assert http["from"] == [{"namespaceSelector": {"matchLabels": {"team": "apps"}}}]


def test_ray_start_params_pin_the_ports_the_policy_opens():
    rs = one(render(), "RayService")
    head = rs["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParams"]
    worker = worker_group(rs)["rayStartParams"]
    assert head["port"] == "6379"
    assert head["dashboard-port"] == "8265"
    assert head["ray-client-server-port"] == "10001"
    for params in (head, worker):
        assert params["node-manager-port"] == "6380"
        assert params["object-manager-port"] == "6381"
        assert params["metrics-export-port"] == "8080"
        assert (params["min-worker-port"], params["max-worker-port"]) == ("10002", "19999")


@pytest.mark.parametrize("service_type", ["ClusterIP", "LoadBalancer", "NodePort"])
def test_only_the_http_service_is_exposed(service_type):
    docs = render(f"service.type={service_type}")
    services = [d for d in docs if d["kind"] == "Service"]
    assert len(services) == 1
    (svc,) = services
    assert svc["spec"]["type"] == service_type
    assert [p["port"] for p in svc["spec"]["ports"]] == [HTTP_PORT]
    assert svc["spec"]["selector"]["ray.io/node-type"] == "worker"
    assert not [d for d in docs if d["kind"] in ("Ingress", "Route")]

    head = one(docs, "RayService")["spec"]["rayClusterConfig"]["headGroupSpec"]
    assert head["serviceType"] == "ClusterIP"
    assert head["enableIngress"] is False


# --- Ray token authentication --------------------------------------------------------------------


def test_ray_token_auth_is_set_on_head_and_workers():
    docs = render("rayAuth.token=tok-abc-123")
    rs = one(docs, "RayService")
    secrets = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Secret"}
    auth = rs["spec"]["rayClusterConfig"]["authOptions"]
    assert auth["mode"] == "token"
    assert base64.b64decode(secrets[auth["secretName"]]["data"]["auth_token"]) == b"tok-abc-123"

    specs = pod_specs(rs)
    assert set(specs) == {"head", "gpu-workers"}
    for name, template in specs.items():
        env = env_of(ray_container(template))
        assert env["RAY_AUTH_MODE"]["value"] == "token", name
        ref = env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]
        assert ref == {"name": auth["secretName"], "key": "auth_token"}, name


def test_ray_token_auth_can_use_an_existing_secret():
    docs = render("rayAuth.existingSecret=team-ray-token")
    rs = one(docs, "RayService")
    assert "team-ray-token" not in {d["metadata"]["name"] for d in docs if d["kind"] == "Secret"}
    assert rs["spec"]["rayClusterConfig"]["authOptions"]["secretName"] == "team-ray-token"
    for template in pod_specs(rs).values():
        ref = env_of(ray_container(template))["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]
        assert ref["name"] == "team-ray-token"


def test_generated_ray_token_is_long_and_random():
    tokens = set()
    for i in range(2):
        docs = render(f"podLabels.try=r{i}")
        (secret,) = [d for d in docs if d["kind"] == "Secret" and "auth_token" in d["data"]]
        tokens.add(base64.b64decode(secret["data"]["auth_token"]))
    assert len(tokens) == 2 and all(len(t) >= 32 for t in tokens)


# --- graceful drain ------------------------------------------------------------------------------


@pytest.mark.parametrize("grace, shutdown", [(None, None), (45, 5), (0, 10)])
def test_termination_grace_and_prestop_follow_the_drain_grace_period(grace, shutdown):
    rs, grace, shutdown = render_drain(grace, shutdown)
    for name, template in pod_specs(rs).items():
        assert template["spec"]["terminationGracePeriodSeconds"] == grace + shutdown, name
        command = ray_container(template)["lifecycle"]["preStop"]["exec"]["command"]
        assert command[-1] == f"sleep {grace}", name


# --- monitoring (prometheus-operator) ------------------------------------------------------------

PROM_CRDS = CRDS / "prometheus-operator"
MONITORING = ("monitoring.enabled=true",)
RAY_PORTS_METRICS = 8080  # values.yaml: ray.ports.metrics


@cache
def monitoring_validator(kind: str) -> jsonschema.Draft7Validator:
    """The v1 openAPIV3Schema of a vendored prometheus-operator CRD (tests/deploy/crds/, see README)."""
    path = PROM_CRDS / f"monitoring.coreos.com_{kind.lower()}s.yaml"
    crd = yaml.safe_load(path.read_text())
    assert crd["spec"]["names"]["kind"] == kind
    (v1,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    schema = strict_schema(v1["schema"]["openAPIV3Schema"])
    schema["properties"]["metadata"] = {"type": "object"}
    return jsonschema.Draft7Validator(schema)


def monitoring_errors(doc: dict) -> list[str]:
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
            for e in monitoring_validator(doc["kind"]).iter_errors(doc)]


def test_monitoring_is_off_by_default():
    kinds = {d["kind"] for d in render()}
    assert not kinds & {"ServiceMonitor", "PodMonitor", "PrometheusRule", "ConfigMap"}


@pytest.mark.parametrize("sets", [MONITORING, (*MONITORING, "monitoring.labels.release=kps",
                                               "specrelay.apiKey.existingSecret=team-key")])
def test_monitoring_objects_validate_against_the_prometheus_operator_crds(sets):
    docs = render(*sets)
    for kind in ("ServiceMonitor", "PodMonitor", "PrometheusRule"):
        doc = one(docs, kind)
        assert doc["apiVersion"] == "monitoring.coreos.com/v1"
        assert monitoring_errors(doc) == [], kind


def test_crd_validation_rejects_a_broken_servicemonitor():
    sm = one(render(*MONITORING), "ServiceMonitor")
    sm["spec"]["endpoints"][0]["interval"] = "soon"
    sm["spec"]["endpoints"][0]["bearerTokenFil"] = "/x"
    errors = " ".join(monitoring_errors(sm))
    assert "interval" in errors and "bearerTokenFil" in errors


def test_monitors_scrape_the_server_with_the_api_key_and_the_ray_metrics_port():
    docs = render(*MONITORING, "specrelay.apiKey.existingSecret=team-key",
                  "specrelay.apiKey.secretKey=token")
    sm, pm, svc = one(docs, "ServiceMonitor"), one(docs, "PodMonitor"), one(docs, "Service")
    rs = one(docs, "RayService")
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    (endpoint,) = sm["spec"]["endpoints"]
    assert endpoint["port"] in [p["name"] for p in svc["spec"]["ports"]]
    assert endpoint["path"] == "/metrics"
    assert endpoint["authorization"] == {"type": "Bearer",
                                         "credentials": {"name": "team-key", "key": "token"}}
    (pod_endpoint,) = pm["spec"]["podMetricsEndpoints"]
    for name, template in pod_specs(rs).items():
        assert pm["spec"]["selector"]["matchLabels"].items() <= template["metadata"]["labels"].items()
        ports = {p["name"]: p["containerPort"] for p in ray_container(template)["ports"]}
        assert ports[pod_endpoint["port"]] == RAY_PORTS_METRICS, name





def test_prometheus_rule_and_dashboard_are_the_generated_files():
    import json

    from pipeline.ops.alerts import rule_file
    from pipeline.ops.dashboard import dashboard

    docs = render(*MONITORING)
    assert one(docs, "PrometheusRule")["spec"] == rule_file()
    cm = one(docs, "ConfigMap")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(cm["data"]["specrelay.json"]) == dashboard()
    kinds = {d["kind"] for d in render(*MONITORING, "monitoring.rules.enabled=false",
                                       "monitoring.dashboard.enabled=false")}
    assert {"ServiceMonitor", "PodMonitor"} <= kinds and not kinds & {"PrometheusRule", "ConfigMap"}


def test_core_kinds_validate_with_monitoring_on():
    import kubernetes_validate

    for doc in render(*MONITORING):
        if doc["apiVersion"].split("/")[0] in ("ray.io", "monitoring.coreos.com"):
            continue
        kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)


def test_network_policy_admits_the_scraper_to_the_metrics_ports_only():
    policy = one(render(*MONITORING, "networkPolicy.httpFrom[0].podSelector.matchLabels.app=web"),
                 "NetworkPolicy")["spec"]
    scraper = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
               "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}}
    rules = [r for r in policy["ingress"] if scraper in r.get("from", [])]
    assert len(rules) == 1 and rules[0]["from"] == [scraper]
    assert rule_ports(rules[0]) == {HTTP_PORT, RAY_PORTS_METRICS}
    # HTTP stays restricted to httpFrom otherwise; the default policy has no scraper rule
    (http,) = [r for r in policy["ingress"] if HTTP_PORT in rule_ports(r) and r is not rules[0]]
    assert http["from"] == [{"podSelector": {"matchLabels": {"app": "web"}}}]
    assert not [r for r in one(render(), "NetworkPolicy")["spec"]["ingress"]
                if scraper in r.get("from", [])]


@pytest.mark.parametrize("bad, message", [
    ("monitoring.enabled=maybe", "/monitoring/enabled"),
    ("monitoring.interval=often", "/monitoring/interval"),
    ("monitoring.dashbord.enabled=true", "dashbord"),
])
def test_values_schema_rejects_bad_monitoring_values(bad, message):
    out = helm("template", RELEASE, str(CHART), "--set", bad)
    assert out.returncode != 0, f"--set {bad} rendered"
    assert "schema" in out.stderr and message in out.stderr, out.stderr
