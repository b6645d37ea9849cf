"""No import cycle between the packages of pipeline/: data flows one way between stages.

The unit is a package-level part of pipeline/ (`pipeline.output`, `pipeline.tracing`, or a
top-level module such as `pipeline.params`); an edge is any import of one part by a file of
another, read from the source (AST), imports inside functions and `TYPE_CHECKING` blocks
included: a lazy import is still a dependency. Cycles inside one package are allowed.
"""

from __future__ import annotations

import ast
from pathlib import Path

from support.paths import REPO

Edges = dict[tuple[str, str], list[str]]  # (importer, imported) -> ["file:line", ...]


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_module(name: str, root: Path) -> bool:
    base = root.joinpath(*name.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def imports(path: Path, root: Path) -> list[tuple[str, int]]:
    """(module, line) for every module `path` imports: `from a import b` is a.b when b is a
    module, else a; relative imports are resolved."""
    package = module_name(path, root).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            for alias in node.names:
                sub = f"{module}.{alias.name}"
                out.append((sub if is_module(sub, root) else module, node.lineno))
    return out


def unit(module: str) -> str:
    """The package-level part a module belongs to (`pipeline` itself for the root __init__)."""
    return ".".join(module.split(".")[:2])


def package_edges(root: Path, top: str = "pipeline") -> Edges:
    edges: Edges = {}
    for path in sorted((root / top).rglob("*.py")):
        src = unit(module_name(path, root))
        for module, line in imports(path, root):
            if module == top or module.startswith(top + "."):
                dst = unit(module)
                where = f"{path.relative_to(root)}:{line}"
                if dst != src and where not in edges.setdefault((src, dst), []):
                    edges[src, dst].append(where)
    return edges


def cycles(edges: Edges) -> list[list[str]]:
    """The sets of parts that import each other through some chain (sorted), each with > 1."""
    graph: dict[str, set[str]] = {}
    for a, b in edges:
        graph.setdefault(a, set()).add(b)
        graph.setdefault(b, set())

    def reach(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for nxt in graph[todo.pop()] - seen:
                seen.add(nxt)
                todo.append(nxt)
        return seen

    reaches = {v: reach(v) for v in graph}
    groups = {tuple(sorted({v} | {w for w in reaches[v] if v in reaches[w]})) for v in graph}
    return sorted(list(g) for g in groups if len(g) > 1)


def test_no_import_cycle_between_the_packages_of_pipeline():
    edges = package_edges(REPO)
    assert edges  # the walk found imports
    found = cycles(edges)
    detail = [f"{a} -> {b}: {', '.join(edges[a, b])}" for group in found
              for a in group for b in group if (a, b) in edges]
    assert found == [], "\n".join(detail)


def test_the_check_finds_a_cycle_through_a_lazy_import(tmp_path):
    """A three-part cycle closed by an import inside a function is found; an import inside
    one package and a one-way edge are not cycles."""
    files = {
        "pkg/__init__.py": "",
        "pkg/a/__init__.py": "from pkg.a import x\n",
        "pkg/a/x.py": "from pkg.b import y\nfrom . import __init__\n",
        "pkg/b/y.py": "import pkg.c\n",
        "pkg/c.py": "def f():\n    from pkg.a.x import g\n",
        "pkg/d.py": "from pkg import c\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    edges = package_edges(tmp_path, "pkg")
    assert set(edges) == {("pkg.a", "pkg.b"), ("pkg.b", "pkg.c"), ("pkg.c", "pkg.a"),
                          ("pkg.d", "pkg.c")}
    assert edges["pkg.c", "pkg.a"] == ["pkg/c.py:2"]
    assert cycles(edges) == [["pkg.a", "pkg.b", "pkg.c"]]
