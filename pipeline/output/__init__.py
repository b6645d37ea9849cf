"""The output stage: per-request finish, text, logprobs and speculative statistics per step."""

from pipeline.output.processor import OutputProcessor
from pipeline.output.request_output import RequestOutput

__all__ = ["OutputProcessor", "RequestOutput"]
