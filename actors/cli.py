"""`specrelay` command line: dispatches to the module that owns each subcommand."""

from __future__ import annotations

import importlib
import os
import sys

# subcommand -> (module, function taking argv); imported lazily so `trace` needs no Ray or torch.
COMMANDS = {
    "serve": ("actors.serve_app", "serve_main"),
    "generate": ("actors.generate", "main"),
    "trace": ("pipeline.tracing.cli", "main"),
    "bench": ("scripts.bench_engine", "main"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print("usage: specrelay {" + ",".join(COMMANDS) + "} [args...]", file=sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    module, func = COMMANDS[argv[0]]
    if module.startswith("scripts."):  # scripts/ is not installed: it lives beside the packages
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return int(getattr(importlib.import_module(module), func)(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
