"""pipeline.gc_tuning: what the engine and output actors do to the collector once loaded."""

from __future__ import annotations

import gc

import pytest

from pipeline.config import load_config
from pipeline.gc_tuning import DEFAULT_GEN0_THRESHOLD, tune_gc


@pytest.fixture
def restore_gc():
    threshold = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*threshold)


def test_tune_gc_freezes_start_up_objects_and_raises_only_gen0(restore_gc):
    kept = [object() for _ in range(10)] + [[i] for i in range(1000)]  # noqa: F841 - alive
    gen1, gen2 = gc.get_threshold()[1:]
    tune_gc(12_345)
    assert gc.get_threshold() == (12_345, gen1, gen2)
    assert gc.get_freeze_count() >= 1000  # the start-up objects left the collected generations
    assert gc.isenabled()


def test_none_leaves_the_collector_alone(restore_gc):
    before = (gc.get_threshold(), gc.get_freeze_count())
    tune_gc(None)
    assert (gc.get_threshold(), gc.get_freeze_count()) == before


def test_configs_tune_by_default_and_can_opt_out():
    assert load_config(None).gc_gen0_threshold == DEFAULT_GEN0_THRESHOLD
    assert load_config(None, {"gc_gen0_threshold": None}).gc_gen0_threshold is None
