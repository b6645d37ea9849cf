"""Tensor parallelism: TP=2 over gloo (two spawned processes) equals TP=1."""

from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp

from pipeline.models.runner import ModelRunner
from pipeline.models.tiny import tiny_config, tiny_model
from pipeline.models.tp import apply_tp, check_tp, init_distributed

# Qwen2-style bias and GQA (4 heads, 2 KV heads) both get sharded.
CONFIG = {"attention_bias": True, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 96}


def _script(runner: ModelRunner) -> list[torch.Tensor]:
    """Prefill two slots, a mixed verify/decode batch, a rollback, then a decode batch."""
    outs: list[torch.Tensor] = []
    a, b = runner.allocate(), runner.allocate()
    outs += runner.forward([a, b], [list(range(3, 20)), list(range(40, 49))])
    outs += runner.forward([b, a], [[7, 8, 9, 10, 11], [12]])
    runner.truncate(b, runner.length(b) - 3)
    outs += runner.forward([a, b], [[5], [6]])
    return [o.clone() for o in outs]


def _worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    init_distributed(rank, world, f"file://{init_file}", backend="gloo")
    config = tiny_config(**CONFIG)
    model = apply_tp(tiny_model(config, seed=3), rank, world)
    runner = ModelRunner(model, config, num_slots=4, max_len=64, backend="sdpa")
    assert runner.cache.k[0].shape[2] == config.num_kv_heads // world
    torch.save(_script(runner), os.path.join(out_dir, f"rank{rank}.pt"))
    torch.distributed.destroy_process_group()


def test_tp2_logits_equal_tp1(tmp_path):
    config = tiny_config(**CONFIG)
    ref = _script(ModelRunner(tiny_model(config, seed=3), config, 4, 64, backend="sdpa"))
    mp.spawn(_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    for rank in (0, 1):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert [g.shape for g in got] == [r.shape for r in ref]
        for g, r in zip(got, ref):
            assert (g - r).abs().max() < 1e-4


@pytest.mark.parametrize("overrides, message", [
    ({"num_heads": 3, "num_kv_heads": 1, "head_dim": 16}, "num_heads=3"),
    ({"num_heads": 6, "num_kv_heads": 3}, "num_kv_heads=3"),
    ({"num_heads": 4, "num_kv_heads": 1}, "num_kv_heads=1"),
    ({"intermediate_size": 99}, "intermediate_size=99"),
])
def test_tp_rejects_sizes_that_do_not_divide(overrides, message):
    config = tiny_config(**overrides)
    with pytest.raises(ValueError, match=message):
        check_tp(config, 2)
    with pytest.raises(ValueError, match=f"size 2 does not divide {message}"):
        apply_tp(tiny_model(config), rank=0, world_size=2)


def test_tp1_is_identity():
    model = tiny_model()
    assert apply_tp(model, 0, 1) is model
    assert model.layers[0].attn.n_heads == 4
