"""EngineConfig: YAML loading, overrides, validation errors that name the field."""

from __future__ import annotations

import glob
import os

import pytest

from pipeline.config import EngineConfig, load_config, resolve_source


@pytest.mark.parametrize("path", sorted(glob.glob("configs/*.yaml")))
def test_every_shipped_config_loads(path):
    config = load_config(path)
    assert config.max_model_len > 1 and config.num_slots > 0


def test_smollm2_default_config_values():
    config = load_config("configs/smollm2-cpu.yaml")
    assert (config.model, config.draft, config.k) == ("smollm2", "ngram", 4)
    assert config.served_name == "SmolLM2-135M-Instruct"


def test_overrides_win_over_the_file():
    config = load_config("configs/tiny.yaml", {"num_slots": 3, "overlap": False})
    assert config.num_slots == 3 and config.overlap is False and config.model == "tiny:0"


def test_draft_none_forces_zero_speculative_tokens():
    assert load_config(None, {"draft": "none"}).num_speculative_tokens == 0


@pytest.mark.parametrize(("overrides", "field"), [
    ({"num_slots": 0}, "num_slots"),
    ({"draft": "eagle"}, "draft"),
    ({"draft": "model"}, "draft_model"),
    ({"num_speculative_tokens": -1}, "num_speculative_tokens"),
    ({"dtype": "int8"}, "dtype"),
    ({"attention_backend": "xformers"}, "attention_backend"),
    ({"step_timeout_s": 0}, "step_timeout_s"),
    ({"ngram_min_n": 3, "ngram_max_n": 2}, "ngram_max_n"),
    ({"overlap": "yes"}, "overlap"),
    ({"max_waiting": -1}, "max_waiting"),
    ({"tracing": ["x"]}, "tracing"),
    ({"gc_gen0_threshold": 0}, "gc_gen0_threshold"),
    ({"gc_gen0_threshold": 1.5}, "gc_gen0_threshold"),
    ({"colour": "blue"}, "colour"),
])
def test_bad_values_name_the_field(overrides, field):
    with pytest.raises(ValueError, match=field):
        load_config(None, overrides)


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


def test_dataclass_defaults_are_valid():
    assert EngineConfig().draft == "ngram"
