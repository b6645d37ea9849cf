"""What every benchmark in scripts/ needs, once: the commit and dirty state a run measured, the
run's metadata and JSON result file, interleaved repetitions, wall and CPU time (this process's or
a whole process tree's), median / percentile / spread, reference checks, markdown tables, config
overrides from `--set`, and a local server's port, health and shutdown.

Plain functions and one small record; a benchmark module keeps only what it measures. Imported as
`scripts.harness` (a script run as a file puts the repository root on sys.path first).
"""

from __future__ import annotations

import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
T = TypeVar("T")
R = TypeVar("R")


# --- the tree a run measured, its metadata and result file --------------------------------------
def git(*args: str) -> str:
    try:
        done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                              check=False)
    except OSError:
        return ""
    return done.stdout.strip()


def tree_state() -> dict[str, object]:
    """{"commit": short hash or "", "dirty": bool, "dirty_files": tracked files changed}."""
    dirty = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": git("rev-parse", "--short", "HEAD"), "dirty": bool(dirty),
            "dirty_files": dirty.splitlines()}


def commit_label(state: dict[str, object] | None = None) -> str:
    """'commit <hash>', with ' (dirty)' when tracked files differ from it."""
    state = tree_state() if state is None else state
    return f"commit {state['commit'] or '?'}{' (dirty)' if state['dirty'] else ''}"


def utc_now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def run_meta(args: Any, elapsed: float, **extra: Any) -> dict[str, Any]:
    """A result file's "meta": the arguments, `extra` (model, versions), the machine, the tree
    state, the date and how long the run took."""
    return {"args": vars(args), **extra, "cpus": os.cpu_count(), "loadavg": os.getloadavg(),
            "platform": platform.platform(), **tree_state(), "date": utc_now(),
            "elapsed_s": elapsed}


def write_json(path: str, result: Any, indent: int = 1) -> None:
    """`result` as JSON at `path`, its folder made first."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=indent)


# --- statistics ---------------------------------------------------------------------------------
def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0-100), linear between the closest ranks; None for no values."""
    if not values:
        return None
    s = sorted(values)
    pos = (len(s) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def spread(values: Sequence[float]) -> float | None:
    """(max - min) / median: how far repetitions of one measurement ran apart (None: median 0)."""
    med = statistics.median(values)
    return (max(values) - min(values)) / med if med else None


# --- interleaving -------------------------------------------------------------------------------
def rotated(items: Sequence[T], turn: int) -> list[T]:
    """`items` starting at the turn-th: every item leads in turn (two items: they alternate)."""
    k = turn % len(items)
    return [*items[k:], *items[:k]]


def alternated(items: Sequence[T], turn: int) -> list[T]:
    """`items` in order on even turns, reversed on odd ones: each item's average position in
    time is the same, so a machine that slows down or warms up hits them alike."""
    return list(items) if turn % 2 == 0 else list(items)[::-1]


def interleaved(arms: Sequence[T], reps: int, measure: Callable[[T, int], R],
                order: Callable[[Sequence[T], int], list[T]] = alternated) -> dict[T, list[R]]:
    """`measure(arm, rep)` for every arm in every repetition, the arms taking turns (`order`)
    rather than running one after another: per arm, its results in repetition order."""
    out: dict[T, list[R]] = {arm: [] for arm in arms}
    for rep in range(reps):
        for arm in order(arms, rep):
            out[arm].append(measure(arm, rep))
    return out


# --- wall and CPU time --------------------------------------------------------------------------
@dataclass
class Timing:
    """What a `stopwatch` block took: wall seconds and CPU seconds (of the clock it was given),
    and when it started (time.perf_counter)."""

    wall_s: float = 0.0
    cpu_s: float = 0.0
    start: float = 0.0


@contextmanager
def stopwatch(cpu: Callable[[], float] = time.process_time) -> Iterator[Timing]:
    """Times the block: wall time, and CPU time by `cpu` (default this process's, every thread;
    `tree_cpu_s` for a process tree such as a local Ray cluster). CPU time is the steadier number
    on a shared machine."""
    t0, c0 = time.perf_counter(), cpu()
    t = Timing(start=t0)
    try:
        yield t
    finally:
        t.wall_s, t.cpu_s = time.perf_counter() - t0, cpu() - c0


def median_time(fn: Callable[[], object], repeats: int, warmup: int = 0,
                reset: Callable[[], object] | None = None) -> float:
    """Median seconds of one `fn()` over `repeats` calls after `warmup` untimed ones; `reset()`
    runs untimed after each call (e.g. to roll a KV cache back)."""
    times = []
    for i in range(warmup + repeats):
        t0 = time.perf_counter()
        fn()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
        if reset is not None:
            reset()
    return statistics.median(times)


def _process_tree(pid: int | None) -> list[Any]:
    import psutil

    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def tree_cpu_s(pid: int | None = None) -> float:
    """CPU seconds of process `pid` (default this one) and all its descendants (a local Ray
    cluster's raylet, GCS and actor workers are the driver's); processes gone are not counted."""
    import psutil

    total = 0.0
    for proc in _process_tree(pid):
        try:
            t = proc.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            continue
    return total


def tree_cpu(pid: int | None = None) -> dict[int, tuple[list[str], float]]:
    """pid -> (command line, CPU seconds) for `pid` (default this process) and its descendants;
    Ray titles an actor's worker after it (`ray::Engine`, `ray::ServeReplica:<app>:...`)."""
    import psutil

    try:
        procs = _process_tree(pid)
    except psutil.Error:
        return {}
    out = {}
    for proc in procs:
        try:
            t = proc.cpu_times()
            out[proc.pid] = (proc.cmdline() or [proc.name()], t.user + t.system)
        except psutil.Error:  # gone meanwhile
            continue
    return out


def cpu_delta(before: dict[int, tuple[list[str], float]],
              after: dict[int, tuple[list[str], float]],
              name: Callable[[int, list[str]], str] = lambda pid, argv: argv[0],
              ) -> dict[str, float]:
    """CPU seconds spent between two `tree_cpu` readings, summed by `name(pid, argv)`."""
    out: dict[str, float] = {}
    for pid, (argv, cpu) in after.items():
        key = name(pid, argv)
        out[key] = out.get(key, 0.0) + cpu - before.get(pid, (argv, 0.0))[1]
    return out


# --- checks -------------------------------------------------------------------------------------
def first_difference(want: Sequence[Any], got: Sequence[Any]) -> int:
    """The first position where two outputs differ (the shorter one's length if one is the
    other's prefix)."""
    return next((i for i, (a, b) in enumerate(zip(want, got)) if a != b),
                min(len(want), len(got)))


def null_tokens(last: int, n: int) -> list[int]:
    """The null model's greedy output after a prompt ending in `last`: its known successor chain
    (pipeline.models.null), the reference a null-model run is checked against."""
    from pipeline.models.null import next_token, null_config

    cfg = null_config()
    out, tok = [], last
    for _ in range(n):
        tok = next_token(tok, cfg.vocab_size, cfg.eos_token_ids)
        out.append(tok)
    return out


# --- report -------------------------------------------------------------------------------------
def markdown_table(columns: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|---" * len(columns) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


# --- configuration ------------------------------------------------------------------------------
def parse_sets(items: Sequence[str], loads: Callable[[str], Any] | None = None
               ) -> dict[str, Any]:
    """`--set KEY=VALUE` items as config overrides, each value read by `loads` (default YAML)."""
    if loads is None:
        import yaml

        loads = yaml.safe_load
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--set {item!r}: expected KEY=VALUE")
        out[key] = loads(value)
    return out


def discarding_tracer_provider(ratio: float, otlp: bool = False) -> Any:
    """An SDK tracer provider sampling at `ratio` whose exporter drops every span (with `otlp`,
    after encoding it as an OTLP exporter would): what tracing costs without a collector."""
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

    from pipeline.tracing.otel import make_provider, resolve_config

    class Discard(SpanExporter):
        def export(self, spans: Any) -> SpanExportResult:
            if otlp:
                encode_spans(spans).SerializeToString()
            return SpanExportResult.SUCCESS

    return make_provider(resolve_config("bench", {"sample_ratio": ratio}, environ={}), Discard())


# --- a local server -----------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, timeout: float = 300.0, proc: subprocess.Popen | None = None,
                 interval: float = 0.5) -> None:
    """Until GET `url`/health answers 200; an error when `proc` (the server) exits first or the
    time runs out."""
    import httpx

    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{' '.join(map(str, proc.args))} exited with {proc.returncode}")
        try:
            last = httpx.get(f"{url}/health", timeout=5)
            if last.status_code == 200:
                return
        except httpx.HTTPError as e:
            last = e
        time.sleep(interval)
    raise TimeoutError(f"{url} not healthy after {timeout:g} s: {last}")


def stop_group(proc: subprocess.Popen, timeout: float = 60.0) -> None:
    """SIGINT to a server started with `start_new_session=True` (its process group: Ray's
    processes too), then SIGKILL to whatever of the group is left."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
