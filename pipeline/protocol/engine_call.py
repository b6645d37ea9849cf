"""The ingress -> engine replica call: one parsed request choice, what the engine's `generate`
takes. The HTTP ingress builds it from the OpenAI request and sends it through Ray Serve's
deployment handle, so the request router sees the prompt's token ids (prefix affinity,
pipeline/routing/prefix_affinity.py) before a replica is chosen. The replica answers with a
stream of msgpack delta messages (pipeline/output/delta_codec.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from pipeline.params import SamplingParams


@dataclass
class EngineCall:
    """`group`: the client request the choice belongs to (fair admission; None: its own);
    `last`: a batch job's final request; `tenant`: whose drafting state it may share."""

    rid: str
    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    traceparent: str | None = None
    group: str | None = None
    last: bool = False
    tenant: str = ""
