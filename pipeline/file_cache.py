"""A local cache of what is slow to derive from a model file: the converted tokenizer and the
GGUF tensor table (~20 s of Python per process for SmolLM2), never weights. An entry is keyed by
the file's real path, size and mtime and the deriving code's versions, and renamed into place
whole. Where: $SPECRELAY_CACHE_DIR (`off` disables), else $XDG_CACHE_HOME or ~/.cache."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable

log = logging.getLogger(__name__)

ENV = "SPECRELAY_CACHE_DIR"


def cache_root() -> str | None:
    configured = os.environ.get(ENV)
    if configured is not None:
        return None if configured.strip().lower() in ("", "off", "0", "none") else configured
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "specrelay")


def entry_path(kind: str, source: str, versions: list[str]) -> str | None:
    """None when the cache is off or the source cannot be stat'ed."""
    root = cache_root()
    if root is None:
        return None
    try:
        real = os.path.realpath(source)
        st = os.stat(real)
    except OSError:
        return None
    key = json.dumps([kind, real, st.st_size, st.st_mtime_ns, versions])
    return os.path.join(root, kind, hashlib.sha256(key.encode()).hexdigest()[:32])


def publish(path: str, write: Callable[[str], None]) -> bool:
    """Fill a new folder with `write(folder)` and rename it to `path`; False when it could not
    be stored."""
    parent = os.path.dirname(path)
    tmp = None
    try:
        os.makedirs(parent, exist_ok=True)
        tmp = tempfile.mkdtemp(dir=parent, prefix=".partial-")
        write(tmp)
        os.rename(tmp, path)  # fails if another process stored it first: theirs is as good
        return True
    except Exception as e:  # noqa: BLE001 - a cache that cannot be written is only slower
        if not os.path.isdir(path):
            log.warning("specrelay cache: could not store %s (%s); set %s=off to skip it",
                        path, e, ENV)
        return False
    finally:
        if tmp is not None and os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
