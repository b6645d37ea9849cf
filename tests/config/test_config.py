"""EngineConfig: YAML loading, overrides, validation errors that name the field."""

from __future__ import annotations

import glob
import os

import pytest

from pipeline.config import EngineConfig, load_config, parse_tiny_source, resolve_source


@pytest.mark.parametrize("path", sorted(glob.glob("configs/*.yaml")))
def test_every_shipped_config_loads(path):
    config = load_config(path)
    assert config.max_model_len > 1 and config.num_slots > 0


def test_smollm2_default_config_values():
    config = load_config("configs/smollm2-cpu.yaml")
    assert (config.model, config.draft, config.num_speculative_tokens) == ("smollm2", "ngram", 4)
    assert config.served_name == "SmolLM2-135M-Instruct"


def test_overrides_win_over_the_file():
    config = load_config("configs/tiny.yaml", {"num_slots": 3, "overlap": False})
    assert config.num_slots == 3 and config.overlap is False and config.model == "tiny:0"


def test_draft_none_forces_zero_speculative_tokens():
    assert load_config(None, {"draft": "none"}).num_speculative_tokens == 0


@pytest.mark.parametrize(("overrides", "field"), [
    ({"num_slots": 0}, "num_slots"),
    ({"block_size": 0}, "block_size"),
    ({"max_num_seqs": 0}, "max_num_seqs"),
    ({"kv_cache_tokens": 100, "max_model_len": 256}, "kv_cache_tokens"),
    ({"enable_prefix_caching": "yes"}, "enable_prefix_caching"),
    ({"draft": "eagle"}, "draft"),
    ({"draft": "model"}, "draft_model"),
    ({"num_speculative_tokens": -1}, "num_speculative_tokens"),
    ({"dtype": "int8"}, "dtype"),
    ({"attention_backend": "xformers"}, "attention_backend"),
    ({"step_timeout_s": 0}, "step_timeout_s"),
    ({"step_timeout_floor_s": -1}, "step_timeout_floor_s"),
    ({"step_timeout_p99_multiple": float("inf")}, "step_timeout_p99_multiple"),
    ({"reserved_slots": -1}, "reserved_slots"),
    ({"ngram_min_n": 3, "ngram_max_n": 2}, "ngram_max_n"),
    ({"overlap": "yes"}, "overlap"),
    ({"step_transport": "dag"}, "step_transport"),
    ({"async_scheduling": "sometimes"}, "async_scheduling"),
    ({"step_transport": None}, "step_transport"),
    ({"max_waiting": -1}, "max_waiting"),
    ({"tracing": ["x"]}, "tracing"),
    ({"gc_gen0_threshold": 0}, "gc_gen0_threshold"),
    ({"gc_gen0_threshold": 1.5}, "gc_gen0_threshold"),
    ({"colour": "blue"}, "colour"),
])
def test_bad_values_name_the_field(overrides, field):
    with pytest.raises(ValueError, match=field):
        load_config(None, overrides)


def test_on_off_settings_read_yamls_booleans_as_on_and_off(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("async_scheduling: off\nattention_invariant: on\n")  # YAML 1.1: booleans
    config = load_config(str(path))
    assert (config.async_scheduling, config.attention_invariant) == ("off", "on")


def test_yaml_must_be_a_mapping(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("- just\n- a list\n")
    with pytest.raises(ValueError, match="mapping"):
        load_config(str(bad))


def test_sources_resolve_without_any_download(tmp_path):
    assert resolve_source("tiny:7") == "tiny:7"
    assert resolve_source("smollm2").endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    assert os.path.isfile(resolve_source("smollm2"))
    with pytest.raises(FileNotFoundError, match="not found"):
        resolve_source(str(tmp_path / "missing.gguf"))
    with pytest.raises(ValueError, match="tiny"):
        resolve_source("tiny:x")


@pytest.mark.parametrize(("source", "seed"), [("tiny:7", 7), ("tiny:0", 0), ("smollm2", None),
                                              ("models/tiny.gguf", None), ("tinyllama", None)])
def test_tiny_sources_name_their_seed(source, seed):
    assert parse_tiny_source(source) == seed


@pytest.mark.parametrize("source", ["tiny", "tiny:", "tiny:x"])
def test_a_tiny_source_without_an_integer_seed_is_refused(source):
    # one rule for the config and the model factory: the seed is part of the name
    with pytest.raises(ValueError, match=r"tiny:<integer seed>"):
        parse_tiny_source(source)


def test_dataclass_defaults_are_valid():
    assert EngineConfig().draft == "ngram"


def test_gpu_example_as_shipped_sets_otlp_grpc_tracing():
    config = load_config("configs/gpu-example.yaml")
    assert config.tracing == {"exporter": "otlp", "otlp_protocol": "grpc",
                              "otlp_endpoint": "http://otel-collector:4317"}
    assert config.placement_spec.verifier_strategy == "PACK"


@pytest.mark.parametrize(("tracing", "message"), [
    ({"exporter": "otlp-grpc"}, "otlp_protocol: grpc"),  # the old gpu-example spelling: a hint
    ({"exporter": "otlp", "endpoint": "http://c:4317"}, "endpoint.*otlp_endpoint"),
    ({"exporter": "jaeger"}, "exporter"),
    ({"otlp_protocol": "udp"}, "otlp_protocol"),
    ({"sample_ratio": 2}, "sample_ratio"),
    ({"sample_ratio": "half"}, "sample_ratio"),
])
def test_bad_tracing_section_fails_at_load(tracing, message):
    with pytest.raises(ValueError, match=f"tracing: .*{message}"):
        load_config(None, {"tracing": tracing})


def test_tracing_is_checked_without_the_loading_process_environment(monkeypatch):
    # The actors read their own OTEL_* environment; the loading process's must not decide.
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "bogus")
    assert load_config(None, {"tracing": {"exporter": "file"}}).tracing == {"exporter": "file"}
    assert load_config(None).tracing == {}


@pytest.mark.parametrize(("placement", "field"), [
    ("PACK", "placement"),
    ({"verifier_strategy": "pack"}, "placement.verifier_strategy"),
    ({"verifier_stratgy": "PACK"}, "verifier_stratgy"),
    ({"draft_resources": ["node_a"]}, "placement.draft_resources"),
    ({"output_resources": {"node_a": 0}}, "placement.output_resources.node_a"),
    ({"output_resources": {"node_a": 1.5}}, "placement.output_resources.node_a"),
    ({"verifier_resources": {"GPU": 1}}, "placement.verifier_resources"),
    ({"engine_resources": {"head": True}}, "placement.engine_resources.head"),
])
def test_bad_placement_names_the_field(placement, field):
    with pytest.raises(ValueError, match=field):
        load_config(None, {"placement": placement})


def test_placement_builds_one_bundle_per_rank_with_its_custom_resources():
    config = load_config("configs/tiny-tp2.yaml", {"placement": {
        "verifier_strategy": "STRICT_PACK", "verifier_resources": {"tp_slot": 1},
        "draft_resources": {"node_a": 0.5}}})
    spec = config.placement_spec
    assert spec.verifier_strategy == "STRICT_PACK"
    assert spec.verifier_bundles(2, gpu=False) == [{"CPU": 1, "tp_slot": 1.0}] * 2
    assert spec.verifier_bundles(1, gpu=True) == [{"CPU": 1, "GPU": 1, "tp_slot": 1.0}]
    assert spec.draft_resources == {"node_a": 0.5} and spec.output_resources == {}


def test_the_default_kv_pool_is_num_slots_rows_of_max_model_len_and_seqs_default_to_slots():
    cfg = load_config(None, {"num_slots": 8, "max_model_len": 2048})
    assert (cfg.kv_blocks, cfg.block_size, cfg.num_seqs) == (8 * 2048 // 16, 16, 8)
    cfg = load_config(None, {"kv_cache_tokens": 16_390, "max_num_seqs": 64})
    assert (cfg.kv_blocks, cfg.num_seqs) == (1025, 64)  # rounded up to whole blocks
