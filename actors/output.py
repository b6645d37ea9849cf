"""OutputActor: the (traced) OutputProcessor; receives each request's NewRequest and each step's
VerifyStep as msgpack bytes and answers with msgpack deltas."""

from __future__ import annotations

from pipeline.config import EngineConfig
from pipeline.gc_tuning import tune_gc
from pipeline.grammar.memory import set_memory_budget
from pipeline.models.runners import load_engine_tokenizer
from pipeline.output.delta_codec import encode_deltas
from pipeline.output.processor import OutputProcessor
from pipeline.output.spans import TracedOutputProcessor
from pipeline.protocol import decode_new_request
from pipeline.tokenizer import eos_token_ids
from pipeline.tracing.otel import flush_tracing, setup_tracing


class OutputActor:
    def __init__(self, config: EngineConfig) -> None:
        setup_tracing("specrelay-output", config.tracing)  # config, else the OTEL_* environment
        set_memory_budget(config.grammar_memory_mb << 20)
        tokenizer = load_engine_tokenizer(config)
        self.eos_token_ids = eos_token_ids(tokenizer)
        inner = OutputProcessor(tokenizer, self.eos_token_ids)
        self.processor = TracedOutputProcessor(inner)
        tune_gc(config.gc_gen0_threshold)  # after loading: the tokenizer is never garbage

    def add_request(self, request: bytes, traceparent: str | None) -> None:
        """Register a request (a NewRequest message) before any step carries it."""
        req = decode_new_request(request)
        self.processor.add_request(req.rid, req.prompt_ids, req.params, traceparent=traceparent)

    def process(self, payload: bytes) -> bytes:
        """A VerifyStep message in, the step's deltas out (pipeline.output.delta_codec)."""
        return encode_deltas(self.processor.process(payload))

    def abort(self, rid: str) -> bytes:
        """The abort delta (none when the request is unknown), as a deltas message."""
        out = self.processor.abort(rid)
        return encode_deltas([] if out is None else [out])

    def reset(self) -> int:
        """Abort every request without output (kept across an engine rebuild that failed
        them); how many there were."""
        return self.processor.reset()

    def dropped_steps(self) -> int:
        return int(self.processor.dropped_steps)

    def info(self) -> dict:
        return {"eos_token_ids": self.eos_token_ids}

    def ping(self) -> bool:
        return True

    def flush_telemetry(self, timeout_s: float) -> bool:
        """Export the spans ended so far (before this actor is killed or the job ends)."""
        return flush_tracing(timeout_s)
