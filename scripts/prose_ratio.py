"""How much prose a package carries: comment and docstring lines per 100 code lines.

    .venv/bin/python scripts/prose_ratio.py [PATH ...] [--per-file]

PATH is a package folder (every `*.py` under it) or a file; default `pipeline/`. Each line of a
file is one of:

- a **comment** line: a line holding a COMMENT token (`tokenize`), a comment after code on the
  same line included;
- a **docstring** line: a line of a string-expression statement that is the first statement of a
  module, class or function (`ast`), every line of its span, blank ones inside it included;
- a **code** line: any other non-blank line.

A line that is both a comment and a docstring line (a comment after a docstring) counts once as
prose, in both the comment and the docstring column. The ratio is prose lines (comment or
docstring) per 100 code lines.
"""

from __future__ import annotations

import argparse
import ast
import io
import os
import sys
import tokenize
from collections.abc import Sequence
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_DEFINITIONS = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


@dataclass
class Counts:
    comment: int = 0
    docstring: int = 0
    prose: int = 0  # comment or docstring lines, each line once
    code: int = 0

    def __add__(self, other: Counts) -> Counts:
        return Counts(self.comment + other.comment, self.docstring + other.docstring,
                      self.prose + other.prose, self.code + other.code)

    @property
    def ratio(self) -> float:
        """Prose lines per 100 code lines (0 for a file without code)."""
        return 100.0 * self.prose / self.code if self.code else 0.0


def comment_lines(source: str) -> set[int]:
    """1-based numbers of the lines that hold a COMMENT token."""
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    return {tok.start[0] for tok in tokens if tok.type == tokenize.COMMENT}


def docstring_lines(source: str) -> set[int]:
    """1-based numbers of the lines spanned by the docstrings of the module, its classes and its
    functions (nested ones included)."""
    lines: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, _DEFINITIONS) or not node.body:
            continue
        first = node.body[0]
        if (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)):
            lines.update(range(first.lineno, first.end_lineno + 1))
    return lines


def count_source(source: str) -> Counts:
    comments, docstrings = comment_lines(source), docstring_lines(source)
    prose = comments | docstrings
    code = sum(1 for n, line in enumerate(source.splitlines(), start=1)
               if line.strip() and n not in prose)
    return Counts(len(comments), len(docstrings), len(prose), code)


def count_file(path: str) -> Counts:
    with tokenize.open(path) as f:  # the file's declared encoding, as Python reads it
        return count_source(f.read())


def python_files(path: str) -> list[str]:
    if os.path.isfile(path):
        return [path]
    found = []
    for folder, dirs, files in os.walk(path):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__" and not d.startswith("."))
        found += [os.path.join(folder, name) for name in sorted(files) if name.endswith(".py")]
    return found


def report(counts: Counts, label: str) -> str:
    return (f"{label}: {counts.code} code lines, {counts.comment} comment lines, "
            f"{counts.docstring} docstring lines, {counts.prose} prose lines; "
            f"{counts.ratio:.1f} prose lines per 100 code lines")


def main(argv: Sequence[str] | None = None) -> dict[str, Counts]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("paths", nargs="*", default=[os.path.join(ROOT, "pipeline")])
    p.add_argument("--per-file", action="store_true", help="also one line per file")
    args = p.parse_args(argv)
    totals = {}
    for path in args.paths:
        files = python_files(path)
        if not files:
            p.error(f"no Python files under {path}")
        per_file = {f: count_file(f) for f in files}
        if args.per_file:
            for f, c in per_file.items():
                print(report(c, os.path.relpath(f, path) if f != path else f))
        totals[path] = sum(per_file.values(), Counts())
        print(report(totals[path], f"{os.path.relpath(path)} ({len(files)} files)"))
    return totals


if __name__ == "__main__":
    main(sys.argv[1:])
