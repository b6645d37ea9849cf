"""What the engine's stage actors ask of the cluster (pipeline/engine/stage_resources.py) and what
the engine says about its model (pipeline/engine/model_info.py): plain data, no Ray."""

from __future__ import annotations

from pipeline.config import EngineConfig
from pipeline.engine.model_info import model_info
from pipeline.engine.stage_resources import (
    engine_needs,
    engine_of_group,
    live_stage_groups,
    orphan_stage_groups,
    stage_group_name,
    stage_resources,
)

GPU_TP2 = EngineConfig(device="cuda", draft="model", draft_model="tiny", tensor_parallel_size=2,
                       placement={"verifier_strategy": "STRICT_PACK",
                                  "verifier_resources": {"a100": 1}, "draft_resources": {"d": 1},
                                  "output_resources": {"o": 0.5},
                                  "engine_resources": {"head": 1}})


def test_on_the_cpu_no_stage_takes_a_gpu_and_each_rank_a_cpu():
    need = stage_resources(EngineConfig(tensor_parallel_size=2))
    assert need.verifier_bundles == [{"CPU": 1}, {"CPU": 1}]
    assert (need.verifier_strategy, need.verifier_gpus, need.draft_gpus) == ("PACK", 0, 0)
    assert engine_needs(EngineConfig()) == (
        "a PACK placement group of 1 bundle(s) [{'CPU': 1}] for the verifier ranks, a draft "
        "actor (GPU: 0, no custom resources), an output actor (no custom resources) and the "
        "engine actor (no custom resources)")


def test_on_cuda_each_rank_and_a_draft_model_take_a_gpu_with_the_placement_resources():
    need = stage_resources(GPU_TP2)
    assert need.verifier_bundles == [{"CPU": 1, "GPU": 1, "a100": 1.0}] * 2
    assert (need.verifier_strategy, need.verifier_gpus, need.draft_gpus) == ("STRICT_PACK", 1, 1)
    assert (need.draft_resources, need.output_resources, need.engine_resources) == (
        {"d": 1.0}, {"o": 0.5}, {"head": 1.0})
    assert stage_resources(GPU_TP2.replace(draft="ngram", draft_model=None)).draft_gpus == 0
    assert engine_needs(GPU_TP2) == (
        "a STRICT_PACK placement group of 2 bundle(s) [{'CPU': 1, 'GPU': 1, 'a100': 1.0}, "
        "{'CPU': 1, 'GPU': 1, 'a100': 1.0}] for the verifier ranks, a draft actor (GPU: 1, "
        "{'d': 1.0}), an output actor ({'o': 0.5}) and the engine actor ({'head': 1.0})")


def test_an_engines_live_groups_are_its_own_builds_not_yet_removed():
    assert stage_group_name("ab", 3) == "specrelay-stages:ab:3"
    table = {
        "p1": {"name": stage_group_name("ab", 1), "state": "REMOVED"},
        "p2": {"name": stage_group_name("ab", 2), "state": "CREATED"},
        "p3": {"name": stage_group_name("ab", 3), "state": "PENDING"},
        "p4": {"name": stage_group_name("abc", 1), "state": "CREATED"},  # another engine
        "p5": {"name": "", "state": "CREATED"},
    }
    assert live_stage_groups(table, "ab") == ["p2", "p3"]


def test_orphan_groups_are_the_live_groups_of_dead_engines_asked_once_each():
    assert engine_of_group(stage_group_name("ab", 3)) == "ab"
    assert engine_of_group("specrelay-stages") is None and engine_of_group("other:ab:1") is None
    table = {
        "p1": {"name": stage_group_name("dead", 1), "state": "REMOVED"},
        "p2": {"name": stage_group_name("dead", 2), "state": "CREATED"},
        "p3": {"name": stage_group_name("dead", 3), "state": "PENDING"},
        "p4": {"name": stage_group_name("alive", 1), "state": "CREATED"},
        "p5": {"name": "someone-elses", "state": "CREATED"},
    }
    asked = []

    def is_dead(engine_id: str) -> bool:
        asked.append(engine_id)
        return engine_id == "dead"

    assert orphan_stage_groups(table, is_dead) == ["p2", "p3"]
    assert sorted(asked) == ["alive", "dead"]


def test_model_info_is_the_config_and_what_the_loaded_stages_reported():
    assert model_info(GPU_TP2, {"vocab_size": 49152, "eos_token_ids": [2], "other": 1}) == {
        "name": "smollm2", "source": "smollm2", "max_model_len": 2048, "vocab_size": 49152,
        "eos_token_ids": [2], "draft": "model", "num_speculative_tokens": 4,
        "tensor_parallel_size": 2}
    before_the_first_build = model_info(EngineConfig(), {})
    assert (before_the_first_build["vocab_size"], before_the_first_build["eos_token_ids"]) == (
        None, [])
