"""A scripted output-stage run for the tracing tests: six requests with mixed finishes, one
dropped step and one abort, through TracedOutputProcessor over the real OutputProcessor."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter

from pipeline import SamplingParams
from pipeline.output.processor import OutputProcessor
from pipeline.output.request_output import RequestOutput
from pipeline.output.spans import TracedOutputProcessor
from pipeline.protocol import VerifyStep, encode
from pipeline.tracing.otel import make_provider, resolve_config

EOS = 2


@dataclass
class ScenarioRun:
    finals: dict[str, RequestOutput]  # last delta of every finished or aborted request
    steps: list[VerifyStep]
    provider: TracerProvider
    tokens: dict[str, list[int]] = field(default_factory=dict)  # retained ids per request


def toks(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def run_scenario(tokenizer, exporter: SpanExporter, ratio: float = 1.0) -> ScenarioRun:
    """Six requests, mixed finishes, one dropped step, one abort.

    Token pieces (SmolLM2): "Hello", " world", ".", " ###", " The", " end", " is", " near".
    """
    provider = make_provider(
        resolve_config("test", {"sample_ratio": ratio, "exporter": "none"}, environ={})
    )
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    proc = TracedOutputProcessor(
        OutputProcessor(tokenizer, eos_token_ids=[EOS]), tracer=provider.get_tracer("test")
    )
    hello, world, dot, hashes, the, end = toks(tokenizer, "Hello world. ### The end")
    is_, near = toks(tokenizer, " is near")
    params = {
        "eos": SamplingParams(max_new_tokens=32),  # EOS mid-window
        "hash": SamplingParams(max_new_tokens=32, stop=["###"]),  # stop string mid-window
        "len": SamplingParams(max_new_tokens=6),  # length inside a window
        "split": SamplingParams(max_new_tokens=32, stop=["world."]),  # stop string across steps
        "abort": SamplingParams(max_new_tokens=32),
        "last": SamplingParams(max_new_tokens=32, stop_token_ids=[near]),  # stop token, window end
    }
    for rid, p in params.items():
        proc.add_request(rid, [1, 2, 3] if rid != "len" else [1], p)
    steps = [
        # prefill: one token each, drafted 0
        VerifyStep(0, list(params), [[hello]] * 6, [0] * 6),
        VerifyStep(
            1,
            ["eos", "hash", "len", "split", "abort", "last"],
            [
                [world, dot, EOS, the],  # EOS at window position 2
                [world, dot, hashes, the, end],  # "###" at window position 2
                [world, dot, the],  # output positions 1..3
                [world],  # all drafts rejected, bonus only
                [world, dot],
                [world, dot, the],
            ],
            [4, 4, 4, 4, 4, 4],
        ),
        VerifyStep(
            2,
            ["eos", "len", "split", "last"],  # "eos" already finished: dropped whole
            [[the], [end, is_, near, dot], [dot, the], [is_, near]],
            [0, 4, 3, 1],  # eos: drafted 0 on purpose (a dropped prefill-like entry)
        ),
    ]
    finals: dict[str, RequestOutput] = {}
    tokens: dict[str, list[int]] = defaultdict(list)
    for i, step in enumerate(steps):
        if i == 2:
            out = proc.abort("abort")
            assert out is not None
            finals["abort"] = out
        for out in proc.process(encode(step)):
            tokens[out.rid] += out.token_ids
            if out.finished:
                finals[out.rid] = out
    return ScenarioRun(finals, steps, provider, dict(tokens))
