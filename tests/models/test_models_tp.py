"""Tensor parallelism: TP=2 over gloo (two spawned processes) equals TP=1."""

from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp

from pipeline.models.quant import quantize_linears
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


def _model(config, quantized: bool) -> torch.nn.Module:
    model = tiny_model(config, seed=3)
    if quantized:
        quantize_linears(model)
    return model


def _worker(rank: int, world: int, init_file: str, out_dir: str, quantized: bool) -> None:
    torch.set_num_threads(1)
    init_distributed(rank, world, f"file://{init_file}", backend="gloo")
    config = tiny_config(**_config(quantized))
    model = apply_tp(_model(config, quantized), rank, world)
    runner = ModelRunner(model, config, num_slots=4, max_len=64, backend="sdpa")
    assert runner.cache.k[0].shape[2] == config.num_kv_heads // world
    torch.save(_script(runner), os.path.join(out_dir, f"rank{rank}.pt"))
    torch.distributed.destroy_process_group()


def _config(quantized: bool) -> dict:
    # 4-bit weights split along K at whole groups of 32: the MLP's 96 would give 48 a rank
    return {**CONFIG, "intermediate_size": 128} if quantized else CONFIG


@pytest.mark.parametrize("quantized", [False, True], ids=["float", "int4"])
def test_tp2_logits_equal_tp1(tmp_path, quantized):
    config = tiny_config(**_config(quantized))
    ref = _script(ModelRunner(_model(config, quantized), config, 4, 64, backend="sdpa"))
    mp.spawn(_worker, args=(2, str(tmp_path / "init"), str(tmp_path), quantized), nprocs=2,
             join=True)
    # int4: each rank's kernel rounds its partial sums to bfloat16 before the all-reduce
    tolerance = 0.02 * max(r.abs().max() for r in ref) if quantized else 1e-4
    for rank in (0, 1):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert [g.shape for g in got] == [r.shape for r in ref]
        for g, r in zip(got, ref):
            assert (g - r).abs().max() < tolerance


def test_int4_tp_needs_whole_groups_per_rank():
    config = tiny_config(**CONFIG)  # intermediate 96: 48 columns of w_down a rank
    model = _model(config, quantized=True)
    with pytest.raises(ValueError, match="multiples of 32"):
        apply_tp(model, rank=0, world_size=2)


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
