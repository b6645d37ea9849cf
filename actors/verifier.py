"""TargetVerifier: one actor per tensor-parallel rank of the target model.

Start-up: rank 0 names a rendezvous address, every rank joins the process group (gloo on CPU,
NCCL on GPU) and loads its shard. Each step every rank runs the same plan in lockstep; rank 0
returns (outcome, payload) as two objects so the engine reads only the small outcome while the
VerifyStep payload goes straight to the output actor. Every message in and out is
pipeline.protocol's msgpack bytes, never a pickled object.
"""

from __future__ import annotations

import socket

from pipeline.config import EngineConfig
from pipeline.draft.eagle3.proposer import verifier_aux_layers
from pipeline.grammar.memory import set_memory_budget
from pipeline.models.runners import build_runner, set_torch_threads
from pipeline.models.tp import check_ranks_agree, init_distributed, share_from_rank0
from pipeline.protocol import decode_plan, decode_proposal, encode_outcome, encode_rank_report
from pipeline.verify.verifier import Verifier


class TargetVerifier:
    def __init__(self, config: EngineConfig, rank: int) -> None:
        set_torch_threads(config)
        set_memory_budget(config.grammar_memory_mb << 20)
        self.config = config
        self.rank = rank
        self.verifier: Verifier | None = None

    def rendezvous_address(self) -> str:
        """A TCP address on this node with a free port (called on rank 0)."""
        import ray

        host = ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"
        with socket.socket() as s:
            s.bind((host, 0))
            return f"tcp://{host}:{s.getsockname()[1]}"

    def load(self, init_method: str | None) -> dict:
        """Join the TP group (when world > 1), load this rank's shard; returns model facts."""
        world = self.config.tensor_parallel_size
        if world > 1:
            init_distributed(self.rank, world, init_method)
        runner = build_runner(self.config, "target", tp_rank=self.rank, tp_world=world)
        self.verifier = Verifier(runner, driver=self.rank == 0,
                                 agree=check_ranks_agree if world > 1 else None,
                                 aux_layers=verifier_aux_layers(self.config, runner.config),
                                 share=share_from_rank0 if world > 1 else None)
        return {"vocab_size": runner.vocab_size,
                "eos_token_ids": list(runner.config.eos_token_ids)}

    def verify(self, plan: bytes, proposal: bytes | None) -> tuple[bytes | None, bytes | None]:
        """(StepOutcome, VerifyStep) messages from rank 0; (RankReport, None) from the others."""
        drafts = None if proposal is None else decode_proposal(proposal)
        step = decode_plan(plan)
        outcome = self.verifier.step(step, drafts)
        if outcome is None:
            return encode_rank_report(self.verifier.report(step.step, self.rank)), None
        return encode_outcome(outcome), outcome.payload

    def reset(self) -> int:
        """Release every request (kept across an engine rebuild that failed them)."""
        return self.verifier.reset()

    def ping(self) -> bool:
        return True
