"""`draft: eagle3`: a Proposer over Eagle3Drafter. Each plan brings the target's aux states of
the positions the last step kept (`StepPlan.hidden`) and, in `commits`, the tokens after them:
together one `HeadStep` per request, fed with the step's drafting in one batch."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import torch

from pipeline.config import EngineConfig, is_tiny, parse_tiny_source, resolve_source
from pipeline.draft.base import Proposal, Proposer
from pipeline.draft.eagle3.checkpoint import (
    check_against_target,
    load_eagle3_head,
    read_head_config,
)
from pipeline.draft.eagle3.drafter import Eagle3Drafter, HeadDrafts, HeadStep
from pipeline.draft.eagle3.head import Eagle3Head
from pipeline.models.config import ModelConfig
from pipeline.models.llama import use_column_major_weights
from pipeline.models.loader import resolve_dtype
from pipeline.params import SamplingParams
from pipeline.protocol import HiddenStates


@dataclass
class _Seq:
    tokens: list[int]  # prompt + every committed token
    pending: list[tuple[int, torch.Tensor]] = field(default_factory=list)  # (start, aux rows)
    # its states were lost (a replaced draft stage): it drafts nothing, which stays lossless
    blind: bool = False


class Eagle3Proposer(Proposer):
    scores_drafts = True

    def __init__(self, head: Eagle3Head) -> None:
        self.drafter = Eagle3Drafter(head)
        self._seqs: dict[str, _Seq] = {}

    def add(self, rid: str, prompt_ids: list[int], params: SamplingParams,
            tenant: str = "") -> None:
        self.drafter.add(rid)
        self._seqs[rid] = _Seq(list(prompt_ids))

    def commit(self, rid: str, tokens: list[int]) -> None:
        self._seqs[rid].tokens.extend(tokens)

    def remove(self, rid: str) -> None:
        self.drafter.remove(rid)
        self._seqs.pop(rid, None)

    def requests(self) -> list[str]:
        return list(self._seqs)

    def hidden_states(self, states: HiddenStates) -> None:
        for rid, start, rows in zip(states.rids, states.starts, states.split()):
            seq = self._seqs.get(rid)
            if seq is not None and not seq.blind:
                seq.pending.append((start, rows))

    def propose(self, rids: list[str], ks: list[int]) -> Proposal:
        asks = dict(zip(rids, ks))
        # requests not drafting this step (a prefill chunk) still feed their states
        order = rids + [r for r, s in self._seqs.items() if s.pending and r not in asks]
        fed, steps, fed_ks = [], [], []
        for rid in order:
            step = self._step(rid)
            if step is not None:
                fed.append(rid)
                steps.append(step)
                fed_ks.append(asks.get(rid, 0) if step.next_tokens else 0)
        out = self.drafter.propose(fed, steps, fed_ks) if fed else HeadDrafts([], [])
        got = dict(zip(fed, zip(out.tokens, out.probs)))
        return HeadDrafts([list(got.get(r, ([], []))[0]) for r in rids],
                          [list(got.get(r, ([], []))[1]) for r in rids]).to_proposal()

    def _step(self, rid: str) -> HeadStep | None:
        """The request's pending states as one HeadStep, up to the last position whose next
        token is known (the rest stays pending); None without states or when blind."""
        seq = self._seqs[rid]
        if not seq.pending or seq.blind:
            return None
        start, rows = seq.pending[0]
        gap = start > self.drafter.length(rid)
        for s, more in seq.pending[1:]:  # more than one step's: still one run
            gap = gap or s > start + rows.shape[0]
            start, rows = (s, more) if s <= start else (start, torch.cat([rows[:s - start], more]))
        seq.pending = []
        if gap:  # states never sent: the head cannot catch up
            seq.blind = True
            return None
        n = min(rows.shape[0], len(seq.tokens) - start - 1)
        if n < rows.shape[0]:
            seq.pending = [(start + n, rows[n:])]
        return HeadStep(start, rows[:n], seq.tokens[start + 1:start + 1 + n])


def head_aux_layers(path: str, target: ModelConfig) -> list[int]:
    """The layer ids whose states the verifier captures for the head at `path`."""
    with open(os.path.join(path, "config.json")) as f:
        return check_against_target(read_head_config(json.load(f)), target)


def verifier_aux_layers(config: EngineConfig, target: ModelConfig) -> list[int] | None:
    if config.draft != "eagle3" or config.eagle3_head is None:
        return None
    return head_aux_layers(config.eagle3_head, target)


def target_embedding(config: EngineConfig) -> tuple[ModelConfig, torch.Tensor]:
    """The target's config and input embedding (a head without `embed_tokens` shares it)."""
    from pipeline.models.loader import load_model
    from pipeline.models.tiny import make_draft_target_pair, tiny_config

    if is_tiny(config.model):
        target = make_draft_target_pair(parse_tiny_source(config.model), 0.0, tiny_config())
        return tiny_config(), target.target.embed.weight.detach()
    loaded = load_model(resolve_source(config.model), "float32", load_tokenizer=False)
    return loaded.config, loaded.model.embed.weight.detach()


def build_eagle3_proposer(config: EngineConfig, target: ModelConfig | None = None,
                          embed: torch.Tensor | None = None) -> Eagle3Proposer:
    """`target`/`embed` None: read from `config.model` (the draft stage loads the target)."""
    if target is None:
        target, embed = target_embedding(config)
    dtype = torch.float32 if config.device == "cpu" else resolve_dtype(config.dtype)
    head = load_eagle3_head(config.eagle3_head, target, embed, dtype=dtype).to(config.device)
    if config.device == "cpu":
        use_column_major_weights(head)
    return Eagle3Proposer(head)
