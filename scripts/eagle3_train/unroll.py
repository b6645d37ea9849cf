"""The head's training forward: EAGLE-3's training-time test. Step 0 feeds every position the
target's fused aux state (the head's causal attention over the sequence, as in serving); step s
feeds row p the head's own step s-1 output at position p + s, attending to the target-fed keys
0..p and its own chain's keys (steps 1..s at row p), as chained drafts do in `Eagle3Drafter`."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pipeline.draft.eagle3.head import Eagle3Config, Eagle3Head
from pipeline.models.llama import apply_rope
from scripts.eagle3_train.data import Record


@dataclass
class Batch:
    """`aux` [B, N, n_aux*H] for pairs 0..N-1; `tokens` [B, N + steps + 1] (0-padded), pair p of
    step s reads tokens[:, p + 1 + s] and is labelled tokens[:, p + 2 + s]; `label_ok` [steps,
    B, N]: the label is a generated token inside the sequence."""

    aux: torch.Tensor
    tokens: torch.Tensor
    label_ok: torch.Tensor


def collate(records: list[Record], steps: int) -> Batch:
    n = max(len(r.aux) for r in records)
    aux = torch.zeros((len(records), n, records[0].aux.shape[1]), dtype=torch.float32)
    tokens = torch.zeros((len(records), n + steps + 1), dtype=torch.long)
    ok = torch.zeros((steps, len(records), n), dtype=torch.bool)
    p = torch.arange(n)
    for b, r in enumerate(records):
        aux[b, :len(r.aux)] = r.aux.float()
        tokens[b, :len(r.tokens)] = r.tokens
        for s in range(steps):
            label_at = p + 2 + s
            ok[s, b] = (label_at < len(r.tokens)) & (label_at >= r.prompt_len)
    return Batch(aux, tokens, ok)


def unrolled_hidden(head: Eagle3Head, aux: torch.Tensor, tokens: torch.Tensor,
                    steps: int) -> list[torch.Tensor]:
    """Per step, the head's pre-norm outputs [B, N, H]."""
    b, n = aux.shape[:2]
    attn = head.attn
    nh, kh, hd = attn.n_heads, attn.n_kv_heads, attn.head_dim
    group, scale = nh // kh, 1.0 / math.sqrt(hd)
    causal = torch.ones((n, n), dtype=torch.bool).tril()
    hidden = head.fuse(aux)
    outs: list[torch.Tensor] = []
    k0 = v0 = None
    chain_k: list[torch.Tensor] = []
    chain_v: list[torch.Tensor] = []
    for s in range(steps):
        cos, sin = head.rotary.lookup(torch.arange(s, n + s), hidden.dtype)
        x, residual = head.layer_input(tokens[:, 1 + s:1 + s + n], hidden)
        qk, v = attn.wqkv(x).split([(nh + kh) * hd, kh * hd], -1)
        qk = apply_rope(qk.view(b, n, nh + kh, hd), cos, sin)
        q, k = qk.split([nh, kh], dim=2)
        q = q.transpose(1, 2)                                        # [B, nh, N, hd]
        k = k.transpose(1, 2).repeat_interleave(group, dim=1)
        v = v.view(b, n, kh, hd).transpose(1, 2).repeat_interleave(group, dim=1)
        if s == 0:
            k0, v0 = k, v
        else:
            chain_k.append(k)
            chain_v.append(v)
        scores = (q @ k0.transpose(-1, -2)) * scale
        scores = scores.masked_fill(~causal, float("-inf"))
        diag = [(q * ck).sum(-1, keepdim=True) * scale for ck in chain_k]
        w = torch.softmax(torch.cat([scores, *diag], -1), dim=-1)
        out = w[..., :n] @ v0
        for t, cv in enumerate(chain_v):
            out = out + w[..., n + t:n + t + 1] * cv
        x = residual + attn.wo(out.transpose(1, 2).reshape(b, n, nh * hd))
        hidden = x + head.mlp(head.mlp_norm(x))
        outs.append(hidden)
    return outs


def step_losses(head: Eagle3Head, batch: Batch, steps: int, to_draft: torch.Tensor
                ) -> tuple[list[torch.Tensor], list[float]]:
    """Cross-entropy per step against the target's greedy next token (labels outside the draft
    vocabulary are skipped), and each step's top-1 accuracy over all valid labels."""
    n = batch.aux.shape[1]
    losses, accs = [], []
    for s, h in enumerate(unrolled_hidden(head, batch.aux, batch.tokens, steps)):
        labels = to_draft[batch.tokens[:, 2 + s:2 + s + n]]
        ok = batch.label_ok[s]
        keep = ok & (labels >= 0)
        logits = head.logits(h[keep])
        losses.append(F.cross_entropy(logits, labels[keep]) if keep.any()
                      else h.sum() * 0.0)
        correct = (logits.argmax(-1) == labels[keep]).sum().item()
        accs.append(correct / max(1, int(ok.sum())))
    return losses, accs


def pick_draft_vocab(records: list[Record], size: int, vocab: int,
                     always: list[int]) -> torch.Tensor:
    """`size` target ids, sorted: `always` (e.g. EOS), then by count in the generations, then
    in the prompts, then the lowest ids (a BPE vocabulary's earliest, most frequent merges:
    on SmolLM2's held-out text this covered 95% of tokens at 8192, 90% without it)."""
    generated = torch.zeros(vocab, dtype=torch.float64)
    seen = torch.zeros(vocab, dtype=torch.float64)
    for r in records:
        generated += torch.bincount(r.tokens[r.prompt_len:], minlength=vocab)
        seen += torch.bincount(r.tokens, minlength=vocab)
    rank = generated * 1e9 + seen * 1e4 - torch.arange(vocab, dtype=torch.float64) / vocab
    rank[always] = float("inf")
    return rank.topk(min(size, vocab)).indices.sort().values


def new_head(target_config: object, layer_ids: list[int], draft_ids: torch.Tensor,
             embed: torch.Tensor, lm_head: torch.Tensor, norm: torch.Tensor) -> Eagle3Head:
    """A head with the target's layer dims; the target's embedding shared and frozen; `lm_head`
    and `norm` start from the target's own (its rows for the draft vocabulary), as EAGLE does."""
    import dataclasses
    layer = dataclasses.replace(target_config, num_layers=1)
    config = Eagle3Config(layer=layer, draft_vocab_size=len(draft_ids),
                          target_hidden_size=layer.hidden_size, aux_layer_ids=list(layer_ids),
                          num_aux=len(layer_ids))
    head = Eagle3Head(config)
    with torch.no_grad():
        head.embed.weight = torch.nn.Parameter(embed.detach().float().clone(),
                                               requires_grad=False)
        head.lm_head.weight.copy_(lm_head.detach().float()[draft_ids])
        head.norm.weight.copy_(norm.detach().float())
        head.d2t.copy_(draft_ids - torch.arange(len(draft_ids)))
        head.t2d.zero_()
        head.t2d[draft_ids] = True
    return head


def draft_index(head: Eagle3Head) -> torch.Tensor:
    """Target id -> draft id, -1 where the draft vocabulary has none."""
    out = torch.full((head.config.vocab_size,), -1, dtype=torch.long)
    ids = head.to_target(torch.arange(head.config.draft_vocab_size))
    out[ids] = torch.arange(head.config.draft_vocab_size)
    return out
