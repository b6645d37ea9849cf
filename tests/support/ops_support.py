"""Prometheus's binaries for the ops tests: Debian's `prometheus` package (`make install` installs
it where apt is available); tests that need one skip with the reason when it is missing."""

from __future__ import annotations

import shutil

import pytest


def binary(name: str) -> str:
    """Path of `prometheus` or `promtool`, or skip the test saying how to install it."""
    found = shutil.which(name)
    if found is None:
        pytest.skip(f"{name} not found: install Debian's `prometheus` package "
                    "(`make install` does, on a machine with apt and root)")
    return found
