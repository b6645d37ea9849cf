"""The scheduler's record of one engine request (one choice of a client request)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from pipeline.params import SamplingParams


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class EngineRequest:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    status: Status = Status.WAITING
    num_output: int = 0
    last_token: int = -1  # not yet in the target KV cache
    pending: list[int] = field(default_factory=list)
    group: str = ""
    tenant: str = ""
    seq: int = 0
    output_ids: list[int] = field(default_factory=list)
    reserved: int = 0  # KV tokens its stages may hold after the step last planned for it
    prefill_len: int = 0  # what its current admission prefills
    computed: int = 0  # of those, what the steps planned so far compute

    def __post_init__(self) -> None:
        self.group = self.group or self.rid

    @property
    def num_prompt(self) -> int:
        return len(self.prompt_ids)

    @property
    def seq_len(self) -> int:
        return self.num_prompt + self.num_output

    @property
    def prefill_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def prefilling(self) -> bool:
        return self.computed < self.prefill_len

    @property
    def kv_len(self) -> int:
        return self.seq_len - 1

    @property
    def remaining(self) -> int:
        return self.params.max_new_tokens - self.num_output
