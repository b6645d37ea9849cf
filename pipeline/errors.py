"""Errors that cross module and actor boundaries (the front end maps them to HTTP statuses)."""


class EngineOverloadedError(RuntimeError):
    """The waiting queue is full (HTTP 429/503)."""


class EngineDeadError(RuntimeError):
    """An actor the request depended on died or hung; the request ended with an error."""


class RequestTimeoutError(RuntimeError):
    """The request ran past its deadline (HTTP 408)."""
