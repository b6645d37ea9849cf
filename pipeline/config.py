"""Engine deployment config: one dataclass, loaded from YAML, validated field by field."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

import yaml

from pipeline import validate as check
from pipeline.deployment import DeploymentSettings, parse_deployment
from pipeline.gc_tuning import DEFAULT_GEN0_THRESHOLD
from pipeline.model_files import smollm2_path
from pipeline.placement import Placement, parse_placement
from pipeline.spec_settings import FIELDS as SPEC_FIELDS
from pipeline.spec_settings import SpecSettings, config_name
from pipeline.spec_settings import validate as validate_spec

DRAFT_KINDS = ("ngram", "suffix", "model", "eagle3", "none")
BACKENDS = ("auto", "sdpa", "flash")
DTYPES = ("float32", "bfloat16", "float16")
WEIGHTS = ("quantized", "float")
ATTENTION_INVARIANT = ("auto", "on", "off")
QUANTIZATIONS = ("int4",)
STEP_TRANSPORTS = ("calls", "compiled")
ASYNC_SCHEDULING = ("auto", "on", "off")


@dataclass
class EngineConfig:
    """Everything needed to start one engine; docs/config.md describes every field."""

    model: str = "smollm2"
    name: str | None = None
    draft: str = "ngram"
    draft_model: str | None = None
    eagle3_head: str | None = None  # a head's folder (docs/eagle3.md), for draft: eagle3
    draft_agreement_noise: float = 0.1
    # SpecSettings' fields: `speculation` is its `mode`, `spec_<x>` its `<x>`.
    num_speculative_tokens: int = SpecSettings.num_speculative_tokens
    speculation: str = SpecSettings.mode
    spec_ema_alpha: float = SpecSettings.ema_alpha
    spec_prior: float = SpecSettings.prior
    spec_probe_every: int = SpecSettings.probe_every
    spec_probe_backoff: int = SpecSettings.probe_backoff
    spec_cost_decay: float = SpecSettings.cost_decay
    spec_prior_weight: float = SpecSettings.prior_weight
    spec_pool_alpha: float = SpecSettings.pool_alpha
    spec_margin: float = SpecSettings.margin
    tensor_parallel_size: int = 1
    num_slots: int = 8
    max_model_len: int = 2048
    kv_cache_tokens: int | None = None
    max_num_seqs: int | None = None
    block_size: int = 16  # flash needs a multiple of 16
    max_num_batched_tokens: int | None = 64
    enable_prefix_caching: bool = True
    attention_backend: str = "auto"
    attention_invariant: str = "auto"
    dtype: str = "float32"
    device: str = "cpu"
    # Not "quantized" by default: its 64-token prefill and (invariant) decode are not yet faster
    # everywhere (docs/quantized-weights.md).
    weights: str = "float"
    quantization: str | None = None
    max_waiting: int = 256
    reserved_slots: int = 1
    reserved_waiting: int | None = None
    overlap: bool = True
    async_scheduling: str = "auto"
    # "compiled" hangs with stages across nodes (docs/reliability.md).
    step_transport: str = "calls"
    step_timeout_s: float = 30.0
    step_timeout_floor_s: float = 5.0
    step_timeout_p99_multiple: float = 10.0
    grammar_memory_mb: int = 256
    ngram_min_n: int = 3
    ngram_max_n: int = 4
    suffix_max_depth: int = 32
    suffix_min_score: float = 0.1
    suffix_spec_factor: float = 1.0
    suffix_global_requests: int = 1000
    suffix_global_tokens: int = 262_144
    # True lets one tenant learn another's recent text through its drafts.
    suffix_share_across_tenants: bool = False
    suffix_max_tenants: int = 64
    torch_threads: int | None = None
    tool_call_parser: str = "none"
    gc_gen0_threshold: int | None = DEFAULT_GEN0_THRESHOLD
    tracing: dict[str, Any] = field(default_factory=dict)
    placement: dict[str, Any] = field(default_factory=dict)
    deployment: dict[str, Any] = field(default_factory=dict)

    @property
    def num_seqs(self) -> int:
        """The most requests in flight: the `num_slots` every stage inside uses; the config's
        own num_slots is only this default and the KV pool's default size."""
        return self.num_slots if self.max_num_seqs is None else self.max_num_seqs

    @property
    def kv_blocks(self) -> int:
        if self.kv_cache_tokens is not None:
            return -(-self.kv_cache_tokens // self.block_size)
        return self.num_slots * -(-self.max_model_len // self.block_size)

    def __post_init__(self) -> None:
        for name in ("attention_invariant", "async_scheduling"):  # YAML reads on/off as booleans
            if isinstance(getattr(self, name), bool):
                setattr(self, name, "on" if getattr(self, name) else "off")
        validate_spec(self.spec_settings)
        check.integer("tensor_parallel_size", self.tensor_parallel_size, 1)
        check.integer("num_slots", self.num_slots, 1)
        check.integer("max_model_len", self.max_model_len, 2)
        check.integer("block_size", self.block_size, 1)
        if self.max_num_seqs is not None:
            check.integer("max_num_seqs", self.max_num_seqs, 1)
        if self.kv_cache_tokens is not None:
            check.integer("kv_cache_tokens", self.kv_cache_tokens, self.max_model_len)
        if self.max_num_batched_tokens is not None:
            check.integer("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        check.integer("max_waiting", self.max_waiting, 0)
        check.integer("reserved_slots", self.reserved_slots, 0)
        if self.reserved_waiting is not None:
            check.integer("reserved_waiting", self.reserved_waiting, 0, self.max_waiting)
        check.integer("ngram_min_n", self.ngram_min_n, 1)
        check.integer("ngram_max_n", self.ngram_max_n, self.ngram_min_n)
        check.integer("suffix_max_depth", self.suffix_max_depth, 1)
        check.integer("suffix_global_requests", self.suffix_global_requests, 1)
        check.integer("suffix_global_tokens", self.suffix_global_tokens, 64)
        check.positive("suffix_spec_factor", self.suffix_spec_factor)
        check.number("suffix_min_score", self.suffix_min_score, lo=0, hi=1)
        check.integer("suffix_max_tenants", self.suffix_max_tenants, 1)
        if self.suffix_share_across_tenants is not True and \
                self.suffix_share_across_tenants is not False:
            raise ValueError("suffix_share_across_tenants: must be a boolean")
        if self.torch_threads is not None:
            check.integer("torch_threads", self.torch_threads, 1)
        if self.gc_gen0_threshold is not None:
            check.integer("gc_gen0_threshold", self.gc_gen0_threshold, 100)
        check.choice("draft", self.draft, DRAFT_KINDS)
        check.choice("attention_backend", self.attention_backend, BACKENDS)
        check.choice("attention_invariant", self.attention_invariant, ATTENTION_INVARIANT)
        check.choice("dtype", self.dtype, DTYPES)
        check.choice("weights", self.weights, WEIGHTS)
        check.choice("step_transport", self.step_transport, STEP_TRANSPORTS)
        _check_tool_call_parser(self.tool_call_parser)
        if self.quantization is not None:
            check.choice("quantization", self.quantization, QUANTIZATIONS)
            if self.device != "cpu":
                raise ValueError(f"quantization: int4 runs on the CPU only, device is "
                                 f"{self.device!r}")
        if self.attention_invariant == "on" and (self.device != "cpu" or self.dtype != "float32"):
            raise ValueError("attention_invariant: on runs on the CPU in float32 only, device is "
                             f"{self.device!r}, dtype {self.dtype!r}")
        if not isinstance(self.model, str) or not self.model:
            raise ValueError("model: must be a non-empty model source")
        if self.draft == "model" and not self.draft_model:
            raise ValueError("draft_model: required when draft is 'model'")
        if self.draft == "eagle3" and not self.eagle3_head:
            raise ValueError("eagle3_head: required when draft is 'eagle3' (a head's folder)")
        if self.draft == "none":
            self.num_speculative_tokens = 0
        elif self.num_speculative_tokens == 0:
            raise ValueError("num_speculative_tokens: must be >= 1 with a draft (or use draft: none)")
        check.integer("grammar_memory_mb", self.grammar_memory_mb, 1)
        for name in ("step_timeout_s", "step_timeout_floor_s", "step_timeout_p99_multiple"):
            check.positive(name, getattr(self, name))
        check.number("draft_agreement_noise", self.draft_agreement_noise, lo=0)
        if self.overlap is not True and self.overlap is not False:
            raise ValueError("overlap: must be a boolean")
        check.choice("async_scheduling", self.async_scheduling, ASYNC_SCHEDULING)
        if self.enable_prefix_caching is not True and self.enable_prefix_caching is not False:
            raise ValueError("enable_prefix_caching: must be a boolean")
        if type(self.tracing) is not dict:
            raise ValueError("tracing: must be a mapping")
        _check_tracing(self.tracing)
        if type(self.placement) is not dict:
            raise ValueError("placement: must be a mapping")
        parse_placement(self.placement)
        if type(self.deployment) is not dict:
            raise ValueError("deployment: must be a mapping")
        parse_deployment(self.deployment)
        if not isinstance(self.device, str) or not self.device:
            raise ValueError("device: must be a device string such as cpu or cuda")

    @property
    def waiting_reserve(self) -> int:
        return self.max_waiting // 4 if self.reserved_waiting is None else self.reserved_waiting

    @property
    def spec_settings(self) -> SpecSettings:
        return SpecSettings(**{f: getattr(self, config_name(f)) for f in SPEC_FIELDS})

    @property
    def placement_spec(self) -> Placement:
        return parse_placement(self.placement)

    @property
    def deployment_settings(self) -> DeploymentSettings:
        return parse_deployment(self.deployment)

    @property
    def served_name(self) -> str:
        if self.name:
            return self.name
        return os.path.basename(os.path.normpath(self.model)).removesuffix(".gguf")

    def replace(self, **changes: Any) -> EngineConfig:
        return dataclasses.replace(self, **changes)


def load_config(path: str | None, overrides: dict[str, Any] | None = None) -> EngineConfig:
    """Unknown keys and bad values raise ValueError naming the field."""
    data: dict[str, Any] = {}
    if path is not None:
        with open(path) as f:
            loaded = yaml.safe_load(f) or {}
        if not isinstance(loaded, dict):
            raise ValueError(f"{path}: config must be a YAML mapping")
        data.update(loaded)
    data.update(overrides or {})
    known = {f.name for f in dataclasses.fields(EngineConfig)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"unknown config field(s): {', '.join(unknown)}")
    return EngineConfig(**data)


def resolve_source(source: str) -> str:
    if source == "smollm2":
        return smollm2_path()
    if is_builtin(source):
        return source
    if not os.path.exists(source):
        raise FileNotFoundError(f"model: source not found: {source}")
    return source


def parse_tiny_source(source: str) -> int | None:
    """None for a non-tiny source; a bare `tiny` is an error: there is no default seed."""
    if source != "tiny" and not source.startswith("tiny:"):
        return None
    try:
        return int(source[len("tiny:"):])
    except ValueError:
        raise ValueError(f"model: expected tiny:<integer seed>, got {source!r}") from None


def is_tiny(source: str) -> bool:
    return parse_tiny_source(source) is not None


def parse_null_source(source: str) -> float | None:
    """The forward ms of a `null:<ms>` source (`null` alone: 0); None for any other source."""
    if source != "null" and not source.startswith("null:"):
        return None
    try:
        ms = float(source[len("null:"):] or 0) if source != "null" else 0.0
    except ValueError:
        raise ValueError(f"model: expected null:<forward ms>, got {source!r}") from None
    if not ms >= 0:
        raise ValueError(f"model: null:<forward ms> must be >= 0, got {source!r}")
    return ms


def is_builtin(source: str) -> bool:
    """Tiny or null: no files, the byte tokenizer."""
    return is_tiny(source) or parse_null_source(source) is not None


def _check_tracing(tracing: dict[str, Any]) -> None:
    # Without the environment: an OTEL_* variable here must not make a bad file pass or a good
    # one fail, since each actor resolves the section with its own.
    # Lazy: opentelemetry takes ~300 ms to import.
    from pipeline.tracing.otel import resolve_config

    try:
        resolve_config("specrelay", tracing, environ={})
    except (ValueError, TypeError) as e:
        raise ValueError(f"tracing: {e}") from None


def _check_tool_call_parser(name: str) -> None:
    from pipeline.output.tool_parsers import PARSERS  # lazy: the output package loads llguidance

    check.choice("tool_call_parser", name, PARSERS)
