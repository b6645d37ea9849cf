"""specrelay's logic: everything that is not Ray. Importable and testable without a cluster."""

from pipeline.output.request_output import RequestOutput
from pipeline.params import SamplingParams

__all__ = ["RequestOutput", "SamplingParams"]
