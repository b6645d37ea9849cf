"""Tasks that outlive the (possibly cancelled) request task that started them."""

from __future__ import annotations

import asyncio
from typing import Any

_background: set[asyncio.Task] = set()


def fire_and_forget(coro: Any) -> None:
    try:
        task = asyncio.get_running_loop().create_task(coro)
    except RuntimeError:  # no loop: the interpreter is shutting down
        coro.close()
        return
    _background.add(task)
    task.add_done_callback(_background.discard)
