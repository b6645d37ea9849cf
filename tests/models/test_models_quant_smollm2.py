"""SmolLM2's Q4_1 file on 4-bit weights against its float32-dequantized forward: the quality
bound of `weights: quantized` (scripts/bench_quant.py quality measures it on more positions)."""

from __future__ import annotations

import importlib.util
import os

import pytest
from support.paths import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300), pytest.mark.usefixtures("one_torch_thread")]


def _bench_quant():
    spec = importlib.util.spec_from_file_location(
        "bench_quant", os.path.join(ROOT, "scripts", "bench_quant.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_quantized_smollm2_agrees_with_the_float32_forward():
    bench = _bench_quant()
    reference = bench.runner_for("float32", num_slots=1)
    quantized = bench.runner_for("int4/f32", num_slots=1)
    prompts = [bench.chat_ids(reference.tokenizer, p) for p in bench.PROMPTS[:4]]
    got = bench.agreement(reference, quantized, prompts, tokens=64)
    assert got["positions"] == 256
    # measured over 8 prompts x 128 tokens: 98.3% top-1, mean KL 0.0006
    assert got["top1_agreement"] >= 0.95
    assert got["mean_kl"] <= 0.005
    # and the float32 reference agrees with itself exactly (the scorer can tell agreement)
    assert bench.agreement(reference, reference, prompts[:1], tokens=16)["top1_agreement"] == 1.0
