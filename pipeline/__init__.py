"""specrelay's logic: everything that is not Ray. Importable and testable without a cluster."""

from pipeline.params import SamplingParams
from pipeline.request_output import RequestOutput

__all__ = ["RequestOutput", "SamplingParams"]
