"""Serve application arguments: Helm chart names, settings split, config path resolution."""

from __future__ import annotations

import os

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
