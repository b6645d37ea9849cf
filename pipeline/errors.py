"""Errors that cross module and actor boundaries; the front end maps them to HTTP statuses."""


class EngineOverloadedError(RuntimeError):
    """The waiting queue is full (HTTP 429/503)."""


class EngineDeadError(RuntimeError):
    """An actor the request depended on died or hung."""


class RequestTimeoutError(RuntimeError):
    """The request ran past its deadline (HTTP 408)."""


class GrammarOutputError(RuntimeError):
    """The request's grammar could not accept its output (finish reason "error")."""


class KVDivergenceError(RuntimeError):
    """Tensor-parallel ranks disagree on their KV blocks, so the engine fails and rebuilds."""
