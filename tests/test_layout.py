"""The layout keeps its architecture: no import circle in g5core, and the plugin contract
(g5core/api/) depends on no implementation module.

Imports are read from the source with ``ast``, every one of them: at module level, inside
functions (late imports) and under ``if TYPE_CHECKING:`` (type-only imports count too).
"""
from __future__ import annotations

import ast
import pathlib

import networkx as nx
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "g5core"


def _modules(package: pathlib.Path) -> dict[str, pathlib.Path]:
    out = {}
    for path in package.rglob("*.py"):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def import_graph(package: pathlib.Path = PACKAGE) -> nx.DiGraph:
    """Module -> the package's modules it imports (``from a.b import c`` names ``a.b.c``
    when that is a module, else ``a.b``; relative imports resolved)."""
    modules = _modules(package)
    graph = nx.DiGraph()
    graph.add_nodes_from(modules)
    for name, path in modules.items():
        here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(here[:len(here) - node.level + 1] + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            else:
                continue
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph.add_edge(name, target)
    return graph


def test_g5core_has_no_import_circle():
    graph = import_graph()
    assert len(graph) > 40
    circles = [sorted(c) for c in nx.strongly_connected_components(graph) if len(c) > 1]
    assert circles == []


def test_the_plugin_contract_imports_only_itself():
    graph = import_graph()
    api = [m for m in graph if m.startswith("g5core.api")]
    assert {"g5core.api.hookspecs", "g5core.api.context", "g5core.api.ops", "g5core.api.records"} <= set(api)
    outside = sorted((m, t) for m in api for t in graph.successors(m) if not t.startswith("g5core.api"))
    assert outside == []


def test_no_core_module_imports_the_package_facade():
    """``g5core/__init__.py`` re-exports the public names for plugins; a core module that
    imported it would close a circle through every module it re-exports from."""
    graph = import_graph()
    assert sorted(m for m in graph.predecessors("g5core")) == []


@pytest.mark.parametrize("source, circle", [
    ({"a.py": "from pkg import b\n", "b.py": "def f():\n    from pkg.a import x\n"}, ["pkg.a", "pkg.b"]),
    ({"a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import B\n",
      "b.py": "from . import a\n"}, ["pkg.a", "pkg.b"]),
    ({"a.py": "from pkg.b import c\n", "b/__init__.py": "", "b/c.py": "import pkg.a\n"}, ["pkg.a", "pkg.b.c"]),
])
def test_the_check_sees_late_type_only_and_relative_imports(tmp_path, source, circle):
    package = tmp_path / "pkg"
    for rel, text in {"__init__.py": "", **source}.items():
        (package / rel).parent.mkdir(parents=True, exist_ok=True)
        (package / rel).write_text(text)
    graph = import_graph(package)
    assert [sorted(c) for c in nx.strongly_connected_components(graph) if len(c) > 1] == [circle]


def _readme_layout() -> set[str]:
    """The paths the README's layout block names (folders end with ``/``; a line of several
    ``name/`` entries lists folders under the one above)."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    block = text.split("<!-- layout: begin -->")[1].split("<!-- layout: end -->")[0]
    lines = [line for line in block.splitlines() if line.strip() and not line.startswith("```")]
    paths, stack = set(), []
    for line in lines:
        depth = (len(line) - len(line.lstrip(" "))) // 2
        names = line.split()
        if all(n.endswith("/") for n in names) and len(names) > 1:   # a row of sibling folders
            paths.update("".join(stack[:depth]) + n for n in names)
            continue
        del stack[depth:]
        stack.append(names[0])
        paths.add("".join(stack))
    return paths


def test_the_readme_layout_matches_the_tree():
    listed = _readme_layout()
    modules = {str(p.relative_to(ROOT)) for p in PACKAGE.rglob("*.py")
               if p.name != "__init__.py" or p.parent == PACKAGE}
    folders = {str(p.relative_to(ROOT)) + "/" for p in PACKAGE.rglob("*") if p.is_dir() and p.name != "__pycache__"
               and (p.parent == PACKAGE or (p / "__init__.py").is_file())}
    plugins = {f"plugins/{p.name}/" for p in (ROOT / "plugins").iterdir() if (p / "__init__.py").is_file()}
    top = {p.name + "/" for p in ROOT.iterdir() if p.is_dir() and not p.name.startswith(".")
           and not p.name.endswith(".egg-info") and p.name not in ("build", "dist", "out")}
    top = {t if t != "contrib/" else "contrib/g5-ulysses/" for t in top}
    want = modules | folders | plugins | top | {"g5core/"}
    assert sorted(want - listed) == [], "in the tree, not in the README's layout"
    assert sorted(listed - want) == [], "in the README's layout, not in the tree"
