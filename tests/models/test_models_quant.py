"""4-bit weights (pipeline.models.quant): GGUF blocks decode to exactly what gguf's own
dequantizer gives, the int4 kernel computes the dequantized matmul, a quantized GGUF load runs
the same model as the float load, and the quantized path shards under tensor parallelism."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from support.gguf_models import hf_model, write_gguf

from pipeline.config import load_config
from pipeline.models import load_runner
from pipeline.models.llama import RescoredHead, TableEmbedding
from pipeline.models.loader import load_model
from pipeline.models.quant import (
    GROUP,
    GroupQuant,
    Int4Linear,
    Int8Rows,
    gguf_group_quant,
    quantize_float,
    quantize_linears,
)
from pipeline.models.runner import ModelRunner
from pipeline.models.tiny import tiny_config, tiny_model

IDS = [int(i) for i in np.random.default_rng(4).integers(0, 320, 41)]


def _logits(runner: ModelRunner, ids: list[int]) -> torch.Tensor:
    return runner.forward([runner.allocate()], [ids])[0]


def _random_blocks(qtype: Q, rows: int, cols: int, seed: int) -> np.ndarray:
    """Random bytes in `qtype`'s layout, with finite float16 scales (any bits are valid codes)."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    halves = 2 if qtype in (Q.Q4_1, Q.Q4_K) else 1  # d (and m / dmin) lead each block
    scales = rng.uniform(-0.05, 0.05, (rows, cols // block, halves)).astype(np.float16)
    raw[..., :2 * halves] = scales.view(np.uint8)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q4_K])
def test_gguf_blocks_decode_exactly(qtype):
    rows, cols = 6, 512
    raw = _random_blocks(qtype, rows, cols, seed=int(qtype))
    want = gguf.quants.dequantize(raw, qtype)
    got = gguf_group_quant(raw, int(qtype), (rows, cols))
    assert got.shape == (rows, cols) and got.codes.max() <= 15
    np.testing.assert_array_equal(got.dequantize().numpy(), want)


def test_a_float_type_is_not_a_group_format():
    with pytest.raises(ValueError, match="not a 4-bit group format: Q8_0"):
        gguf_group_quant(np.zeros((1, 34), np.uint8), int(Q.Q8_0), (1, 32))


@pytest.mark.parametrize("rows, cols, batch", [(64, 96, 1), (128, 64, 5), (320, 256, 17)])
def test_int4_linear_computes_the_dequantized_matmul(rows, cols, batch):
    gen = torch.Generator().manual_seed(rows)
    w = quantize_float(torch.randn(rows, cols, generator=gen))
    bias = torch.randn(rows, generator=gen)
    x = torch.randn(batch, cols, generator=gen)
    dense = w.dequantize()
    layer = Int4Linear(w, bias)
    y = layer(x)
    assert layer.weight is None and layer.packed is not None  # packed on first use
    assert y.dtype == torch.float32 and y.shape == (batch, rows)
    # the kernel's inputs are bfloat16: compare with the same rounding done in float32
    want = x.bfloat16().float() @ dense.bfloat16().float().t() + bias.bfloat16().float()
    assert (y - want).abs().max() <= 0.02 * want.abs().max()


def test_quantize_float_is_round_to_nearest_within_half_a_step():
    w = torch.randn(8, 64) * 3
    q = quantize_float(w)
    step = q.scale.repeat_interleave(GROUP, 1)
    assert ((q.dequantize() - w).abs() <= step / 2 + 1e-6).all()
    with pytest.raises(ValueError, match="divisible by 32"):
        quantize_float(torch.randn(4, 40))


def test_group_quant_slices_like_the_float_weight():
    w = quantize_float(torch.randn(12, 128))
    dense = w.dequantize()
    assert torch.equal(w.rows(slice(2, 5)).dequantize(), dense[2:5])
    assert torch.equal(w.columns(32, 96).dequantize(), dense[:, 32:96])
    assert torch.equal(GroupQuant.cat([w.rows(slice(0, 3)), w.rows(slice(9, 12))]).dequantize(),
                       torch.cat([dense[:3], dense[9:]]))
    with pytest.raises(ValueError, match="multiples of 32"):
        w.columns(16, 48)


@pytest.mark.parametrize("arch, qtype", [("llama", Q.Q4_1), ("llama", Q.Q4_0), ("qwen2", Q.Q4_1)])
def test_quantized_gguf_runs_the_float_model(tmp_path, arch, qtype):
    """The file's 4-bit tensors (the q/k permutation undone on codes and scales) on the int4
    kernel: the float load of the same file is the reference."""
    path = tmp_path / "m.gguf"
    write_gguf(path, hf_model(arch), arch, qtype)
    quant = load_model(str(path), load_tokenizer=False, weights="quantized")
    float_ = load_model(str(path), load_tokenizer=False)
    assert isinstance(quant.model.layers[0].attn.wqkv, Int4Linear)
    assert type(quant.model.embed) is torch.nn.Embedding  # lookups and a tied head: float
    assert type(float_.model.layers[0].attn.wqkv) is torch.nn.Linear
    got = _logits(ModelRunner(quant.model, quant.config, 1, 64), IDS)
    want = _logits(ModelRunner(float_.model, float_.config, 1, 64), IDS)
    assert want.abs().max() > 1.0
    assert (got - want).abs().max() < 0.05 * want.abs().max()
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9


def test_a_float_gguf_stays_float_when_quantized_is_asked(tmp_path):
    path = tmp_path / "m.gguf"
    write_gguf(path, hf_model("llama"), "llama", Q.F32)
    loaded = load_model(str(path), load_tokenizer=False, weights="quantized")
    assert not any(isinstance(m, Int4Linear) for m in loaded.model.modules())


def test_a_tied_table_is_held_once_and_the_logits_are_float32():
    """A 4-bit model's tied LM head is a RescoredHead sharing one row-major float32 table with
    the embedding; decode (one row) and verify (several rows) give a position the same bits,
    and its top logits are the float32 products (bfloat16 logits would be off by steps of
    2**-8 of their size)."""
    config = tiny_config(tie_word_embeddings=True)
    model = tiny_model(config, seed=4)
    table = model.embed.weight.detach().clone()
    quantize_linears(model)
    runner = ModelRunner(model, config, 2, 64)
    assert isinstance(model.lm_head, RescoredHead)
    assert model.embed.weight.data_ptr() == model.lm_head.weight.data_ptr()
    assert model.embed.weight.is_contiguous() and torch.equal(model.embed.weight, table)
    one, many = runner.allocate(), runner.allocate()
    prompt = [3, 14, 15, 92]
    runner.forward([one, many], [prompt, prompt])
    decode = runner.forward([one], [[65]])[0]
    verify = runner.forward([many], [[65, 35, 89]])[0]
    assert decode.dtype == torch.float32
    assert torch.equal(decode[0], verify[0])


def _float_logits(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return (x.double() @ w.double().t()).float()


@pytest.mark.parametrize("seed", range(4))
def test_the_rescored_head_has_float32_top_logits_and_the_float32_argmax(seed):
    """Rows 1 and 2 of the table differ by 1e-4 of their size: bfloat16 ties their logits, the
    rescored head ranks them as float32 does. The leading logits are float32 values (the
    `CANDIDATES` highest bfloat16 ones are recomputed), the rest within bfloat16 rounding."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(1000, 96, generator=g)
    w[2] = w[1] * (1 + 1e-4)
    x = torch.randn(9, 96, generator=g)
    x[:4] = w[1] * (1 + 0.1 * torch.rand(4, 1, generator=g))  # rows 1 and 2 lead, near-tied
    want = _float_logits(w, x)
    got = RescoredHead(w)(x)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    assert (got.argmax(-1)[:4] == torch.where(want[:4, 2] > want[:4, 1], 2, 1)).all()
    top = want.topk(RescoredHead.CANDIDATES // 4, dim=-1).indices
    assert torch.allclose(got.gather(1, top), want.gather(1, top), rtol=1e-5, atol=1e-5)
    assert (got - want).abs().max() <= 2 ** -6 * want.abs().max()


def test_a_rescored_row_is_the_same_bits_at_any_row_count():
    g = torch.Generator().manual_seed(7)
    head = RescoredHead(torch.randn(3000, 64, generator=g))
    x = torch.randn(12, 64, generator=g)
    alone = torch.cat([head(x[i:i + 1]) for i in range(12)])
    for n in (2, 3, 5, 8, 12):
        assert torch.equal(head(x[:n]), alone[:n])


def _q8_0_table(rows: int, cols: int, seed: int) -> torch.Tensor:
    """What a Q8_0 table dequantizes to: float16 scales times int8 codes, each block of 32
    reaching +-127 (Q8_0 scales a block by its largest magnitude)."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(-127, 128, (rows, cols // 32, 32), generator=g)
    codes[..., 0] = torch.where(torch.rand(rows, cols // 32, generator=g) < 0.5, -127, 127)
    scale = (torch.rand(rows, cols // 32, 1, generator=g) * 0.02).half().float()
    return (codes * scale).reshape(rows, cols)


def test_int8_rows_hold_a_q8_0_table_exactly_and_nothing_else():
    w = _q8_0_table(300, 64, 1)
    rows = Int8Rows.exact(w, chunk=128)
    assert rows.codes.dtype == torch.int8 and rows.codes.shape == (300, 64)
    assert torch.equal(rows.rows(torch.arange(300)), w)
    index = torch.tensor([[5, 299], [0, 5]])
    assert torch.equal(rows.rows(index), w[index])
    assert Int8Rows.exact(torch.randn(300, 64)) is None  # a float table: not exactly int8
    off = w.clone()
    off[7, 3] = torch.nextafter(off[7, 3], torch.tensor(1.0))  # one value a float32 step off
    assert Int8Rows.exact(off) is None
    assert Int8Rows.exact(w[:, :48]) is None  # not whole blocks of 32


def test_a_tied_q8_0_table_is_held_as_int8_codes_with_the_same_bits(monkeypatch):
    """SmolLM2's Q8_0 embedding: the rescored head and the lookups read int8 codes, a quarter
    of the float32 table's bytes, and every logit is the bits the float32 table gives."""
    config = tiny_config(tie_word_embeddings=True)

    def runner() -> ModelRunner:
        model = tiny_model(config, seed=4)
        with torch.no_grad():
            model.embed.weight.copy_(_q8_0_table(*model.embed.weight.shape, seed=2))
        quantize_linears(model)
        return ModelRunner(model, config, 1, 64)

    held = runner()
    assert isinstance(held.model.embed, TableEmbedding) and held.model.lm_head.weight is None
    assert torch.equal(held.model.embed.weight, _q8_0_table(*held.model.embed.weight.shape, 2))
    monkeypatch.setattr(Int8Rows, "exact", staticmethod(lambda w, chunk=0: None))
    floats = runner()
    assert floats.model.lm_head.weight is not None
    prompt = [3, 14, 15, 92, 65, 35]
    assert torch.equal(_logits(held, prompt), _logits(floats, prompt))


def test_a_4bit_file_head_stays_4bit(tmp_path):
    """A file whose output.weight is 4-bit keeps it on the int4 kernel, not rescored."""
    path = tmp_path / "m.gguf"
    write_gguf(path, hf_model("llama"), "llama", Q.Q4_1)
    quant = load_model(str(path), load_tokenizer=False, weights="quantized")
    ModelRunner(quant.model, quant.config, 1, 64)
    assert isinstance(quant.model.lm_head, Int4Linear)


def test_hf_folder_int4_at_load(tmp_path):
    hf = hf_model("llama", seed=5)
    hf.save_pretrained(tmp_path)
    quant = load_runner(str(tmp_path), num_slots=1, max_len=64, quantization="int4")
    assert isinstance(quant.model.layers[1].mlp.w_down, Int4Linear)
    assert isinstance(quant.model.lm_head, RescoredHead)  # untied: its own table
    assert quant.model.lm_head.weight.data_ptr() != quant.model.embed.weight.data_ptr()
    with torch.no_grad():  # the reference: HF holding the quantized projections in float32
        for name, p in hf.named_parameters():
            if p.dim() == 2 and "layers" in name:
                p.copy_(quantize_float(p).dequantize())
        ref = hf(torch.tensor([IDS])).logits[0]
    got = _logits(quant, IDS)
    assert (got - ref).abs().max() < 0.03 * ref.abs().max()


def test_weights_and_quantization_are_validated():
    with pytest.raises(ValueError, match="weights: must be one of quantized, float"):
        load_config(None, {"weights": "int4"})
    with pytest.raises(ValueError, match="quantization: must be one of int4"):
        load_config(None, {"quantization": "int8"})
    with pytest.raises(ValueError, match="quantization: int4 runs on the CPU only"):
        load_config(None, {"quantization": "int4", "device": "cuda"})
    with pytest.raises(ValueError, match="weights must be one of"):
        load_model("/nonexistent.gguf", weights="int4")


def test_a_packed_model_runs_again_in_a_second_runner():
    """A second ModelRunner over the same model (its `.to(dtype)`) keeps the packed layers."""
    model = tiny_model(tiny_config(), seed=2)
    quantize_linears(model)
    first = _logits(ModelRunner(model, model.config, 1, 64), [4, 8, 15])
    again = _logits(ModelRunner(model, model.config, 1, 64), [4, 8, 15])
    assert torch.equal(first, again)


def test_tiny_int4_runner_is_the_quantized_float_model():
    config = tiny_config()
    runner = load_runner("tiny:3", num_slots=1, max_len=64, quantization="int4")
    reference = tiny_model(config, seed=3)
    with torch.no_grad():
        for module in reference.layers.modules():
            if type(module) is torch.nn.Linear:
                module.weight.copy_(quantize_float(module.weight).dequantize())
    want = _logits(ModelRunner(reference, config, 1, 64), [5, 9, 17, 3, 44])
    got = _logits(runner, [5, 9, 17, 3, 44])
    assert (got - want).abs().max() < 0.03 * want.abs().max()
