"""The package's shape: small modules with one job (no file of pipeline/ or actors/ over 400
lines), and one request object from the ingress to the core (no layer restates its fields)."""

from __future__ import annotations

import ast
import dataclasses

from support.paths import REPO

from pipeline.protocol import EngineCall

PIPELINE = REPO / "pipeline"
ACTORS = REPO / "actors"
MAX_LINES = 400
# The request's own fields besides its id, prompt and params: a function taking three or more of
# them restates the request instead of taking an EngineCall.
REQUEST_FIELDS = {"traceparent", "group", "last", "tenant"}


def test_no_file_in_pipeline_is_over_400_lines():
    sizes = {str(p.relative_to(PIPELINE)): len(p.read_text().splitlines())
             for p in PIPELINE.rglob("*.py")}
    assert sizes  # the walk found the package
    assert {p: n for p, n in sizes.items() if n > MAX_LINES} == {}


def test_no_file_in_actors_is_over_400_lines():
    """actors/ holds thin Ray shells; their logic lives in pipeline/."""
    sizes = {p.name: len(p.read_text().splitlines()) for p in ACTORS.rglob("*.py")}
    assert "engine.py" in sizes
    assert {p: n for p, n in sizes.items() if n > MAX_LINES} == {}


def test_no_function_restates_the_request_fields_instead_of_taking_an_engine_call():
    assert {f.name for f in dataclasses.fields(EngineCall)} >= REQUEST_FIELDS
    paths = [*PIPELINE.rglob("*.py"), *ACTORS.rglob("*.py"), *(REPO / "scripts").glob("*.py"),
             *(REPO / "tests").rglob("*.py")]
    restated = []
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = node.args
                names = {arg.arg for arg in [*a.posonlyargs, *a.args, *a.kwonlyargs]}
                if len(names & REQUEST_FIELDS) >= 3:
                    restated.append(f"{path.relative_to(REPO)}: {node.name}")
    assert restated == []
