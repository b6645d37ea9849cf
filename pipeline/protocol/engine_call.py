"""One request choice on its way from the ingress to the engine core: the one object every layer
takes and passes on (ReplicaClient -> EngineReplica -> EngineClient -> the Engine actor ->
EngineCore.add_request -> Scheduler.prepare; LocalEngineClient without Ray), so its fields are
declared here only. Through Ray it travels as a pickled argument: Serve's request router must
read the prompt's token ids (prefix affinity, pipeline/routing/prefix_affinity.py) before a
replica is chosen, and the params may hold a compiled grammar. The answer is a stream of msgpack
delta messages (pipeline/output/delta_codec.py). Validation stays with the engine
(Scheduler.check_prompt, the output stage's add_request): a ValueError naming the field."""

from __future__ import annotations

from dataclasses import dataclass, field

from pipeline.params import SamplingParams


@dataclass
class EngineCall:
    """One choice of a client request, as the engine takes it."""

    rid: str  # unique among the engine's requests in flight
    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    traceparent: str | None = None  # W3C trace context: the engine's spans join the request's
    # the client request it belongs to (its choices are admitted fairly as one); None: its own
    group: str | None = None
    last: bool = False  # a batch job's final request: the batch drains after it
    # a hash of the API key and `user` it came from (pipeline.frontend.tenant; "" = anonymous):
    # the draft stage shares state across requests of one tenant only
    tenant: str = ""
