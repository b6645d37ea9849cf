"""`specrelay` command line: dispatches to the module that owns each subcommand. Benchmarks are
not subcommands: scripts/ is not installed, so they run as files (python scripts/bench_engine.py)."""

from __future__ import annotations

import importlib
import sys

# subcommand -> (module, function taking argv); imported lazily so `trace` needs no Ray or torch.
COMMANDS = {
    "serve": ("actors.serve_app", "serve_main"),
    "generate": ("actors.generate", "main"),
    "trace": ("pipeline.tracing.cli", "main"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print("usage: specrelay {" + ",".join(COMMANDS) + "} [args...]", file=sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    module, func = COMMANDS[argv[0]]
    return int(getattr(importlib.import_module(module), func)(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
