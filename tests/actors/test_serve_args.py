"""Serve application arguments: Helm chart names, settings split, config path resolution."""

from __future__ import annotations

import os

import pytest
from support.serve_helpers import ROOT

from actors.serve_app import engine_overrides, parse_args, resolve_config_path, server_settings


def test_helm_override_names_map_to_engine_config_fields_and_blanks_drop():
    assert engine_overrides({"target_model": "Qwen/Qwen2.5-7B-Instruct", "draft_kind": "model",
                             "draft_model": "", "num_speculative_tokens": 4,
                             "tensor_parallel_size": 2}) == {
        "model": "Qwen/Qwen2.5-7B-Instruct", "draft": "model", "num_speculative_tokens": 4,
        "tensor_parallel_size": 2}
    assert engine_overrides(None) == {}


def test_server_settings_take_only_known_fields():
    args = {"config": "x.yaml", "overrides": {}, "api_key": "k", "request_timeout_s": 5}
    assert server_settings(args) == {"api_key": "k", "request_timeout_s": 5}


def test_relative_config_resolves_against_the_repository(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert resolve_config_path("configs/tiny.yaml") == os.path.join(ROOT, "configs", "tiny.yaml")
    assert resolve_config_path("/abs/x.yaml") == "/abs/x.yaml"
    assert resolve_config_path(None) is None


def test_cli_defaults_bind_loopback_port_8000(monkeypatch):
    monkeypatch.delenv("SPECRELAY_API_KEY", raising=False)
    args = parse_args([])
    assert (args.host, args.port, args.api_key) == ("127.0.0.1", 8000, None)
    assert args.config == "configs/smollm2-cpu.yaml"


def engine_deployment(app):
    """The engine deployment bound into the ingress (build_app's `engine` argument)."""
    return app._bound_deployment.init_kwargs["engine"]._bound_deployment


def test_build_app_sizes_and_routes_the_engine_deployment_from_the_config_and_args(tmp_path):
    import yaml

    from actors.serve_app import build_app

    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({"model": "tiny:0", "block_size": 32, "deployment": {
        "replicas": 3, "routing": "prefix", "imbalance_threshold": 5}}))
    engine = engine_deployment(build_app({"config": str(config)}))
    dc = engine._deployment_config
    assert engine.name == "EngineReplica" and dc.num_replicas == 3
    router = dc.request_router_config
    assert router.request_router_class == "actors.prefix_router:PrefixAffinityRouter"
    assert router.request_router_kwargs == {"block_size": 32, "imbalance_threshold": 5}
    # args win over the file; the replica's config carries the merged section
    app = build_app({"config": str(config), "num_replicas": 2, "deployment": {"routing": "pow2"}})
    dc = engine_deployment(app)._deployment_config
    assert dc.num_replicas == 2
    assert dc.request_router_config.request_router_class.endswith(
        "PowerOfTwoChoicesRequestRouter")
    _, overrides = engine_deployment(app).init_args
    assert overrides["deployment"]["routing"] == "pow2"


def test_build_app_turns_on_autoscaling_and_drains_both_deployments():
    from actors.serve_app import build_app

    app = build_app({"config": None, "drain_grace_s": 12, "deployment": {"autoscaling": {
        "min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 2,
        "upscale_delay_s": 1, "downscale_delay_s": 2}}})
    dc = engine_deployment(app)._deployment_config
    auto = dc.autoscaling_config
    assert (auto.min_replicas, auto.max_replicas, auto.target_ongoing_requests) == (1, 2, 2)
    assert (auto.upscale_delay_s, auto.downscale_delay_s) == (1, 2)
    assert dc.graceful_shutdown_timeout_s == 12
    assert app._bound_deployment._deployment_config.graceful_shutdown_timeout_s == 12
    with pytest.raises(ValueError, match="deployment.routing"):
        build_app({"config": None, "deployment": {"routing": "random"}})


def test_cli_replicas_and_routing_flags():
    args = parse_args(["--replicas", "2", "--routing", "pow2"])
    assert (args.replicas, args.routing) == (2, "pow2")
    assert (parse_args([]).replicas, parse_args([]).routing) == (None, None)
    with pytest.raises(SystemExit):
        parse_args(["--routing", "random"])
