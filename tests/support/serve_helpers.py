"""Start/stop the Serve app for the end-to-end tests (one app per test module)."""

from __future__ import annotations

import contextlib
import functools
import os
import random
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from support.paths import ROOT


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@functools.cache
def ray_token() -> str:
    """The token of this test run's `ray start` clusters. `ray start` with RAY_AUTH_MODE=token
    needs one and, unlike `ray.init`, does not make one: on a fresh machine (no
    ~/.ray/auth_token yet) the first `ray start` failed."""
    return secrets.token_hex(32)


def ray_cli_env(**extra: str) -> dict[str, str]:
    """The environment of a `ray start` / `ray job submit` / driver process of these tests:
    token auth on, with this run's token, and never an outer RAY_ADDRESS."""
    env = dict(os.environ, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=ray_token(),
               RAY_USAGE_STATS_ENABLED="0", **extra)
    env.pop("RAY_ADDRESS", None)
    return env


def ray_node_ports(count: int, taken: tuple[int, ...] = ()) -> tuple[range, list[int]]:
    """A range of 100 worker ports and `count` distinct free ports outside it for one `ray start`.

    Ray refuses to start a node whose component ports overlap its worker range or each other,
    and an ephemeral port can fall anywhere: each pick is checked against everything taken.
    """
    workers = range(0)
    while not workers or any(p in workers for p in taken):
        lo = random.randrange(31000, 39000, 100)
        workers = range(lo, lo + 100)
    ports: list[int] = []
    while len(ports) < count:
        p = free_port()
        if p not in workers and p not in ports and p not in taken:
            ports.append(p)
    return workers, ports


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


def app_fixture(name: str, config: str, overrides: dict | None = None, **settings) -> Any:
    """A module-scoped fixture serving configs/`config` as app `name` on the shared Ray cluster
    and yielding its base URL; a module assigns it: `base = app_fixture(APP, "tiny.yaml", {...})`.
    `settings`: ServerSettings fields (request_timeout_s defaults to 120)."""
    app_args = {"config": os.path.join(ROOT, "configs", config), "overrides": overrides or {},
                "request_timeout_s": 120, **settings}

    @pytest.fixture(scope="module")
    def base(ray_cluster) -> Iterator[str]:
        with running_app(app_args, name=name) as url:
            yield url

    return base


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


@dataclass
class ServeProcess:
    proc: subprocess.Popen
    base: str
    port: int
    log_path: Path
    rc: int | None = None  # exit status after the context ends (None: it had to be killed)


@contextlib.contextmanager
def serve_process(config_path: str, tmp: Path, env: dict[str, str], extra_args: list[str] = (),
                  ready_timeout: float = 180, stop_timeout: float = 60) -> Iterator[ServeProcess]:
    """`specrelay serve` in its own session on a free loopback port, as a user starts it; waits
    until it says it serves. On exit: SIGTERM, wait, then kill whatever is left of the session."""
    port = free_port()
    env = {**os.environ, **env}
    env.pop("RAY_ADDRESS", None)
    cmd = [sys.executable, "-m", "actors.cli", "serve", "--config", str(config_path),
           "--port", str(port), "--num-cpus", "4", *extra_args]
    log_path = tmp / "serve.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    run = ServeProcess(proc, f"http://127.0.0.1:{port}", port, log_path)
    try:
        wait_healthy(run.base, timeout=ready_timeout)
        deadline = time.monotonic() + 60
        while f"serving on http://127.0.0.1:{port}/v1" not in log_path.read_text():
            assert time.monotonic() < deadline, log_path.read_text()[-3000:]
            time.sleep(0.2)
        yield run
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            run.rc = proc.wait(timeout=stop_timeout)
        with contextlib.suppress(ProcessLookupError):  # anything left of our own session
            os.killpg(proc.pid, signal.SIGKILL)
