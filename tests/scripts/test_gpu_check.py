"""scripts/gpu_check.sh and its Python half, on CPU: the shell parses, parity runs through the
real vllm-flash-attn wrapper (tests/support/flash_wheel.py), and the bench's smoke mode runs end to end."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from support import flash_wheel
from support.paths import REPO

import pipeline.models.runner as runner_mod

sys.path.insert(0, str(REPO / "scripts"))
import gpu_check


def test_gpu_check_shell_script_parses():
    res = subprocess.run(["bash", "-n", str(REPO / "scripts" / "gpu_check.sh")],
                         capture_output=True, text=True, check=False)
    assert res.returncode == 0, res.stderr


def test_parity_passes_through_the_flash_wrapper_on_cpu(monkeypatch, tmp_path):
    ext = flash_wheel.install(monkeypatch)
    monkeypatch.setattr(runner_mod, "resolve_backend", lambda backend, device, dtype: backend)
    assert gpu_check.main(["parity", "--device", "cpu", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "parity.json").read_text())
    assert result["ok"] and set(result["attention"]) == {
        "smollm2_9x3x64", "llama8b_32x8x128", "mha_4x4x16"}
    assert result["runner"]["greedy_agreement"] >= gpu_check.AGREEMENT
    assert ext.calls == 3 + 2 * 3  # one per attention shape, one per layer per runner forward


def test_parity_fails_when_flash_is_wrong(monkeypatch, tmp_path):
    ext = flash_wheel.install(monkeypatch)
    real = ext.varlen_fwd
    monkeypatch.setattr(ext, "varlen_fwd", lambda *a: real(*a[:14], False, *a[15:]))  # no causal
    monkeypatch.setattr(runner_mod, "resolve_backend", lambda backend, device, dtype: backend)
    assert gpu_check.main(["parity", "--device", "cpu", "--out", str(tmp_path)]) == 1


@pytest.mark.slow
def test_bench_smoke_runs_engine_and_hf_on_cpu(tmp_path):
    assert gpu_check.main(["bench", "--device", "cpu", "--smoke", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "bench.json").read_text())
    assert [r["batch"] for r in result["runs"]] == [1, 2]
    for row in result["runs"]:
        assert row["target_only_tok_s"] > 0 and row["ngram_tok_s"] > 0
        assert row["hf_generate_tok_s"] > 0
        assert row["ngram_equals_target_only"] == row["batch"]  # float32: exactly lossless
