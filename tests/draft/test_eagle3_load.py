"""EAGLE-3 heads in both checkpoint layouts (EAGLE's `midlayer.*`, speculators' `layers.0.*`)
load and run; every kind of mismatch with the target fails at load, naming what differs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from support.eagle3_heads import (
    DRAFT_VOCAB,
    HIDDEN,
    eagle_config,
    head_tensors,
    layer_config,
    speculators_config,
    tiny_target_config,
    to_speculators,
    write_head,
    write_layout,
)

from pipeline.draft.eagle3 import Eagle3Drafter, HeadStep, load_eagle3_head
from pipeline.models.tiny import tiny_config, tiny_model

TARGET = tiny_target_config()


@pytest.fixture(scope="module")
def target_embed() -> torch.Tensor:
    return tiny_model(TARGET).embed.weight.detach()


def run(head, seed: int = 0, k: int = 4):
    gen = torch.Generator().manual_seed(seed)
    aux = torch.randn(7, 3 * TARGET.hidden_size, generator=gen)
    tokens = torch.randint(0, TARGET.vocab_size, (7,), generator=gen).tolist()
    drafter = Eagle3Drafter(head)
    drafter.add("r")
    return drafter.propose(["r"], [HeadStep(0, aux, tokens)], [k])


@pytest.mark.parametrize("layout", ["eagle", "speculators"])
def test_a_head_in_each_layout_loads_and_drafts_in_its_draft_vocabulary(tmp_path, layout,
                                                                         target_embed):
    head = load_eagle3_head(str(write_layout(tmp_path, layout, TARGET)), TARGET, target_embed)
    assert head.config.layout == layout
    assert head.aux_layer_ids == [2, 4, 5]  # [2, L//2, L-3] for the 8-layer target
    assert torch.equal(head.embed.weight, target_embed)  # no embed_tokens: the target's
    drafts = run(head)
    assert len(drafts.tokens[0]) == 4
    assert head.t2d[drafts.tokens[0]].all()
    assert all(0 < p <= 1 for p in drafts.probs[0])


def test_both_layouts_with_the_same_weights_give_identical_drafts(tmp_path, target_embed):
    heads = [load_eagle3_head(str(write_layout(tmp_path / layout, layout, TARGET, seed=3)),
                              TARGET, target_embed) for layout in ("eagle", "speculators")]
    for seed in range(3):
        a, b = run(heads[0], seed), run(heads[1], seed)
        # tokens exactly; probabilities to float32 rounding (BLAS paths vary with alignment)
        assert a.tokens == b.tokens
        assert a.probs[0] == pytest.approx(b.probs[0], rel=1e-5)


def test_the_checkpoint_names_map_onto_the_computation(tmp_path, target_embed):
    """One position attends only to itself: out = h + o(v) then the MLP, computed here from the
    checkpoint's own tensors, so a misplaced or swapped tensor shows."""
    t = head_tensors(TARGET, seed=5)
    head = load_eagle3_head(str(write_head(tmp_path, eagle_config(TARGET), t)), TARGET,
                            target_embed)

    def norm(x, w):
        return F.rms_norm(x, (x.shape[-1],), w, 1e-5)

    aux = torch.randn(1, 3 * TARGET.hidden_size)
    token = 17
    h = aux @ t["fc.weight"].T
    x = torch.cat([norm(target_embed[token:token + 1], t["midlayer.input_layernorm.weight"]),
                   norm(h, t["midlayer.hidden_norm.weight"])], dim=-1)
    v = (x @ t["midlayer.self_attn.v_proj.weight"].T).view(1, 2, 16).repeat_interleave(2, 1)
    h = h + v.reshape(1, -1) @ t["midlayer.self_attn.o_proj.weight"].T
    m = norm(h, t["midlayer.post_attention_layernorm.weight"])
    gate, up = m @ t["midlayer.mlp.gate_proj.weight"].T, m @ t["midlayer.mlp.up_proj.weight"].T
    h = h + (F.silu(gate) * up) @ t["midlayer.mlp.down_proj.weight"].T
    logits = norm(h, t["norm.weight"]) @ t["lm_head.weight"].T
    draft = int(logits.argmax())
    drafter = Eagle3Drafter(head)
    drafter.add("r")
    out = drafter.propose(["r"], [HeadStep(0, aux, [token])], [1])
    assert out.tokens == [[draft + int(t["d2t"][draft])]]
    assert out.probs[0][0] == pytest.approx(float(logits.softmax(-1).max()), rel=1e-4)


def test_a_checkpoint_embedding_fc_bias_and_aux_layer_ids_are_used(tmp_path, target_embed):
    t = to_speculators(head_tensors(TARGET, with_embed=True))
    t["fc.bias"] = torch.randn(HIDDEN)  # early speculators heads have one
    config = speculators_config(TARGET, eagle_aux_hidden_state_layer_ids=[6, 1, 3])
    head = load_eagle3_head(str(write_head(tmp_path, config, t)), TARGET, target_embed)
    assert torch.equal(head.embed.weight, t["embed_tokens.weight"])
    assert torch.equal(head.fc.bias, t["fc.bias"])
    assert head.aux_layer_ids == [1, 3, 6]  # concatenated in layer order, as captured


def test_pytorch_bin_weights_load_as_safetensors_do(tmp_path, target_embed):
    t = head_tensors(TARGET, seed=2)
    a = load_eagle3_head(str(write_head(tmp_path / "st", eagle_config(TARGET), t)), TARGET,
                         target_embed)
    folder = tmp_path / "bin"
    folder.mkdir()
    (folder / "config.json").write_text((tmp_path / "st" / "config.json").read_text())
    torch.save(t, folder / "pytorch_model.bin")
    b = load_eagle3_head(str(folder), TARGET, target_embed)
    drafts_a, drafts_b = run(a), run(b)
    assert drafts_a.tokens == drafts_b.tokens
    assert drafts_a.probs[0] == pytest.approx(drafts_b.probs[0], rel=1e-5)


def _drop(name):
    return lambda t: {k: v for k, v in t.items() if k != name}


def _with(name, value):
    return lambda t: {**t, name: value}


def _shift_d2t(t):
    d2t = t["d2t"].clone()
    d2t[-1] += 300
    return {**t, "d2t": d2t}


# (id, layout, config overrides, tensor edit, target, expected fragments of the message)
MISMATCHES = [
    ("hidden size", "eagle", {"target_hidden_size": 48},
     _with("fc.weight", torch.zeros(HIDDEN, 3 * 48)), TARGET, ["target_hidden_size", "48", "64"]),
    ("hidden size, no target_hidden_size", "speculators",
     {"transformer_layer_config": layer_config(TARGET, hidden_size=48)}, None, TARGET,
     ["hidden_size: the head takes hidden states of size 48", "64"]),
    ("vocab size", "eagle", {"vocab_size": 300}, None, TARGET, ["vocab_size", "300", "256"]),
    ("vocab size (speculators)", "speculators",
     {"transformer_layer_config": layer_config(TARGET, vocab_size=512)}, None, TARGET,
     ["vocab_size", "512", "256"]),
    ("layer ids", "eagle", {"eagle_aux_hidden_state_layer_ids": [2, 4, 9]}, None, TARGET,
     ["eagle_aux_hidden_state_layer_ids", "[9]", "num_layers=8"]),
    ("layer ids (speculators)", "speculators", {"eagle_aux_hidden_state_layer_ids": [-1, 4, 5]},
     None, TARGET, ["eagle_aux_hidden_state_layer_ids", "[-1]", "num_layers=8"]),
    ("default layer ids", "eagle", {}, None, tiny_config(num_layers=2),
     ["default aux layers", "[2, -1]", "num_layers=2"]),
    ("layer count vs fc", "eagle", {"eagle_aux_hidden_state_layer_ids": [2, 5]}, None, TARGET,
     ["fc.weight", "[64, 128]", "[64, 192]"]),
    ("missing tensor", "eagle", {}, _drop("midlayer.hidden_norm.weight"), TARGET,
     ["missing", "midlayer.hidden_norm.weight"]),
    ("missing tensor (speculators)", "speculators", {}, _drop("layers.0.mlp.up_proj.weight"),
     TARGET, ["missing", "layers.0.mlp.up_proj.weight"]),
    ("unknown tensor", "eagle", {}, _with("midlayer.self_attn.rotary_emb.inv_freq",
                                          torch.zeros(8)), TARGET,
     ["unknown", "midlayer.self_attn.rotary_emb.inv_freq"]),
    ("wrong shape", "eagle", {}, _with("lm_head.weight", torch.zeros(DRAFT_VOCAB, 32)), TARGET,
     ["lm_head.weight", f"[{DRAFT_VOCAB}, 64]", f"[{DRAFT_VOCAB}, 32]"]),
    ("draft vocab size", "speculators", {"draft_vocab_size": 80}, None, TARGET,
     ["lm_head.weight", "[80, 64]", f"[{DRAFT_VOCAB}, 64]"]),
    ("d2t out of vocab", "eagle", {}, _shift_d2t, TARGET, ["d2t", "vocab_size 256"]),
    ("two layers", "eagle", {"num_hidden_layers": 2}, None, TARGET, ["num_hidden_layers", "2"]),
    ("model type", "speculators", {"speculators_model_type": "eagle"}, None, TARGET,
     ["speculators_model_type", "'eagle3'", "'eagle'"]),
]


@pytest.mark.parametrize("case", MISMATCHES, ids=[c[0] for c in MISMATCHES])
def test_each_mismatch_fails_at_load_naming_what_differs(tmp_path, case):
    _, layout, overrides, edit, target, fragments = case
    tensors = head_tensors(TARGET)
    if layout == "eagle":
        config = eagle_config(TARGET, **overrides)
    else:
        config, tensors = speculators_config(TARGET, **overrides), to_speculators(tensors)
    if edit is not None:
        tensors = edit(tensors)
    embed = torch.zeros(target.vocab_size, target.hidden_size)
    with pytest.raises(ValueError) as err:
        load_eagle3_head(str(write_head(tmp_path, config, tensors)), target, embed)
    for fragment in fragments:
        assert fragment in str(err.value), (fragment, str(err.value))


def test_a_head_without_an_embedding_needs_the_targets(tmp_path):
    folder = write_layout(tmp_path, "eagle", TARGET)
    with pytest.raises(ValueError, match="embed_tokens"):
        load_eagle3_head(str(folder), TARGET)
    with pytest.raises(ValueError, match=r"embed_tokens.*\[256, 32\].*\[256, 64\]"):
        load_eagle3_head(str(folder), TARGET, torch.zeros(256, 32))
