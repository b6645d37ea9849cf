"""scripts/prose_ratio.py: comment, docstring and code lines counted on a small synthetic source."""

from __future__ import annotations

import os
import sys

from support.paths import ROOT

sys.path.insert(0, os.path.join(ROOT, "scripts"))

import prose_ratio

SOURCE = '''\
"""Module docstring,
over two lines."""
# a comment line
import os  # a comment after code


class A:
    """Class docstring."""

    x = """a string assigned:
    code, not a docstring"""

    def f(self):
        # a comment inside a function
        """Still its first statement: a docstring."""
        "a second string expression: code"
        return 1

    async def g(self):
        """Async function docstring,

        with a blank line inside."""

        def inner():
            """Nested function docstring."""  # a comment after it
            return f"{os.sep}"

        return inner


def h():
    return """not first: code"""
'''

# line numbers (1-based) of SOURCE by what they hold
COMMENTS = {3, 4, 14, 25}
DOCSTRINGS = {1, 2, 8, 15, 20, 21, 22, 25}
CODE = {7, 10, 11, 13, 16, 17, 19, 24, 26, 28, 31, 32}


def test_the_synthetic_source_is_labelled_by_hand_consistently():
    lines = SOURCE.splitlines()
    blank = {n for n, line in enumerate(lines, start=1) if not line.strip()}
    assert (COMMENTS | DOCSTRINGS) & CODE == set()
    assert COMMENTS | DOCSTRINGS | CODE | blank == set(range(1, len(lines) + 1))
    assert blank & DOCSTRINGS == {21}  # the blank line inside a docstring is docstring


def test_comment_and_docstring_lines():
    assert prose_ratio.comment_lines(SOURCE) == COMMENTS
    assert prose_ratio.docstring_lines(SOURCE) == DOCSTRINGS


def test_counts_and_ratio():
    counts = prose_ratio.count_source(SOURCE)
    prose = len(COMMENTS | DOCSTRINGS)  # line 25 is both: counted once
    assert counts == prose_ratio.Counts(comment=4, docstring=8, prose=prose, code=len(CODE))
    assert (prose, len(CODE)) == (11, 12)
    assert abs(counts.ratio - 100 * 11 / 12) < 1e-9
    assert prose_ratio.count_source("").ratio == 0.0


def test_a_folder_is_every_python_file_under_it(tmp_path, capsys):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "a.py").write_text(SOURCE)
    (pkg / "sub" / "b.py").write_text("# one comment\nx = 1\ny = 2\n")
    (pkg / "notes.txt").write_text("# not Python\n")
    [(path, total)] = prose_ratio.main([str(pkg)]).items()
    assert path == str(pkg)
    assert total == prose_ratio.Counts(comment=5, docstring=8, prose=12, code=14)
    assert "85.7 prose lines per 100 code lines" in capsys.readouterr().out
