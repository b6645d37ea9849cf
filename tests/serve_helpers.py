"""Start/stop the Serve app for the end-to-end tests (one app per test module)."""

from __future__ import annotations

import contextlib
import os
import socket
import time
from collections.abc import Iterator

import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_app(app_args: dict, name: str, api_key: str | None = None) -> Iterator[str]:
    """Serve `build_app(app_args)` on a free loopback port; yields the base URL."""
    from ray import serve

    from actors.serve_app import build_app

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        serve.run(build_app(app_args), name=name, route_prefix="/", blocking=False)
        base = f"http://127.0.0.1:{port}"
        wait_healthy(base)
        yield base
    finally:
        serve.shutdown()


def wait_healthy(base: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            last = httpx.get(f"{base}/health", timeout=5)
            if last.status_code == 200:
                return
        except httpx.HTTPError as e:
            last = e
        time.sleep(0.5)
    raise TimeoutError(f"server at {base} not healthy: {last}")


def metric(text: str, name: str) -> float:
    """The value of the first sample whose name (with labels) starts with `name`."""
    for line in text.splitlines():
        if line.startswith(name):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)
