"""A local cache of what is derived from a model file and slow to derive again.

Loading SmolLM2's GGUF cost every process that does it (each verifier rank, the output actor,
each front end) ~20 s on one core, nearly all in Python over the 49k-entry vocabulary: gguf's
reader parses every metadata string (~10 s), and transformers converts the GGUF tokenizer after
parsing the file again (~10 s). The weights themselves take ~3 s to dequantize. So two small
things are cached: the converted tokenizer (`save_pretrained`, loaded back in ~0.3 s) and the
GGUF's tensor table (offsets, types, shapes and the model config, a few kB; the weights are still
read from the GGUF itself). No weights are ever written here.

An entry is keyed by the source file's real path, size and mtime and by the versions of the code
that derives it, so a changed file or library misses rather than reads a stale entry. It is
written into a temporary folder and renamed into place, so concurrent first loads race
harmlessly and no reader sees half an entry. Where: $SPECRELAY_CACHE_DIR, else
$XDG_CACHE_HOME/specrelay, else ~/.cache/specrelay. SPECRELAY_CACHE_DIR=off, or a folder that
cannot be written (a read-only container), turns it off: everything is derived as before.
"""

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
    """The cache folder, or None when the cache is turned off."""
    configured = os.environ.get(ENV)
    if configured is not None:
        return None if configured.strip().lower() in ("", "off", "0", "none") else configured
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "specrelay")


def entry_path(kind: str, source: str, versions: list[str]) -> str | None:
    """Where the `kind` entry derived from file `source` by code at `versions` lives (it may not
    exist yet); None when the cache is off or the source cannot be stat'ed."""
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
    """Fill a new folder with `write(folder)` and move it to `path` at once. False (logged, not
    raised) when it could not be stored: the caller has what it derived and goes on without."""
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
