"""Errors that cross module and actor boundaries (the front end maps them to HTTP statuses)."""


class EngineOverloadedError(RuntimeError):
    """The waiting queue is full (HTTP 429/503)."""


class EngineDeadError(RuntimeError):
    """An actor the request depended on died or hung; the request ended with an error."""


class RequestTimeoutError(RuntimeError):
    """The request ran past its deadline (HTTP 408)."""


class GrammarOutputError(RuntimeError):
    """The request's grammar could not accept its output (a dead end, a rejected token or one of
    the matcher's internal limits met while generating): the output stage ended it with finish
    reason "error" (HTTP 400 `invalid_grammar`, or an in-band error event in a stream)."""


class KVDivergenceError(RuntimeError):
    """Tensor-parallel ranks disagree on their KV blocks (prefix-cache hits, block tables or
    lengths): their forwards would no longer match, so the engine fails and rebuilds."""
