"""The layout keeps its architecture: the layer order (``docs/architecture.md``), no import
circle in g5core, the plugin contract (g5core/api/) depending on no implementation module, and
function-local imports only where each says why.

Imports are read from the source with ``ast``, every one of them: at module level, inside
functions (late imports) and under ``if TYPE_CHECKING:`` (type-only imports count too).
"""
from __future__ import annotations

import ast
import functools
import pathlib

import networkx as nx
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "g5core"


@functools.lru_cache(maxsize=None)
def _parsed(text: str) -> ast.Module:
    """The syntax tree of a source text, parsed once for all the checks that read it (they
    only walk it)."""
    return ast.parse(text)


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
        for node in ast.walk(_parsed(path.read_text(encoding="utf-8"))):
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


# The layer order, bottom to top (docs/architecture.md, "The layers"): a module imports only
# its own layer or lower ones. Above the layers: the facade (g5core/__init__.py), the contract
# suite (g5core/testing/), the command (g5core/__main__.py). version.py, imported by all and
# importing nothing, is below them.
LAYERS = ("api", "inputs", "lower", "sim", "session", "serve", "study", "present")
ABOVE = ("", "testing", "__main__")
BELOW = ("version",)


def layer_rank(module: str) -> int:
    """The rank of ``module`` (``root.layer...``) in the order; a module outside it raises."""
    root, _, rest = module.partition(".")
    head = rest.split(".")[0]
    if head in BELOW:
        return -1
    if head in LAYERS:
        return LAYERS.index(head)
    if head in ABOVE:
        return len(LAYERS) + ABOVE.index(head)
    raise AssertionError(f"{module} is in no layer: put it in one of {LAYERS} (or name it in test_layout.py)")


def upward_imports(graph: nx.DiGraph) -> list[tuple[str, str]]:
    """The imports that go up the layer order, (importer, imported)."""
    return sorted((a, b) for a, b in graph.edges if layer_rank(b) > layer_rank(a))


def test_every_module_is_in_a_layer():
    graph = import_graph()
    assert {m.split(".")[1] for m in graph if "." in m} <= set(LAYERS) | set(ABOVE) | set(BELOW)
    for m in graph:
        layer_rank(m)


def test_no_import_goes_up_the_layer_order():
    assert upward_imports(import_graph()) == []


@pytest.mark.parametrize("source, upward", [
    # module level, inside a function, type-only: each is an import up the order
    ({"lower/a.py": "from pkg.sim import b\n"}, [("pkg.lower.a", "pkg.sim.b")]),
    ({"lower/a.py": "def f():\n    from pkg.sim.b import x\n"}, [("pkg.lower.a", "pkg.sim.b")]),
    ({"api/a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..serve.b import B\n"},
     [("pkg.api.a", "pkg.serve.b")]),
    # down the order and within a layer: allowed
    ({"sim/c.py": "from pkg.lower.a import x\nfrom pkg.sim import b\n"}, []),
])
def test_the_check_sees_a_planted_upward_import(tmp_path, source, upward):
    package = tmp_path / "pkg"
    files = {"__init__.py": "", "lower/__init__.py": "", "lower/a.py": "", "sim/__init__.py": "", "sim/b.py": "",
             "api/__init__.py": "", "serve/__init__.py": "", "serve/b.py": "", **source}
    for rel, text in files.items():
        (package / rel).parent.mkdir(parents=True, exist_ok=True)
        (package / rel).write_text(text)
    assert upward_imports(import_graph(package)) == upward


def function_local_imports(package: pathlib.Path = PACKAGE) -> list[tuple[str, int, bool]]:
    """Every import inside a function: (file, line, whether its line says why in a comment)."""
    out = []
    for path in sorted(package.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        lines = text.splitlines()
        for fn in ast.walk(_parsed(text)):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for node in ast.walk(fn):
                    if isinstance(node, (ast.Import, ast.ImportFrom)):
                        out.append((str(path.relative_to(package.parent)), node.lineno,
                                    "#" in lines[node.lineno - 1]))
    return sorted(set(out))


# Function-local imports allowed, a budget that only goes down: each breaks a real import
# circle or defers a heavy optional dependency (matplotlib, distributed, scipy), and says
# which in a comment on its line.
LOCAL_IMPORTS_BUDGET = 9
# Files being split while this test was written (issue 30: the serving search into a
# package); their late imports are counted but not yet each given a reason. Empty this.
REASONS_PENDING: set = set()


def test_function_local_imports_are_few_and_say_why():
    found = function_local_imports()
    assert len(found) <= LOCAL_IMPORTS_BUDGET, (
        f"{len(found)} function-local imports, over the budget of {LOCAL_IMPORTS_BUDGET}: import at module level")
    assert len(found) == LOCAL_IMPORTS_BUDGET, f"only {len(found)} now: lower LOCAL_IMPORTS_BUDGET to it"
    unexplained = [(f, line) for f, line, why in found if not why and f not in REASONS_PENDING]
    assert unexplained == [], "a function-local import without a one-line reason (a circle it breaks, " \
                              "or the optional dependency it defers) on its line"


def test_the_local_import_count_sees_nested_and_commented_imports(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("import os\n")
    (package / "a.py").write_text("def f():\n    import json\n    def g():\n        import csv  # optional\n")
    assert function_local_imports(package) == [("pkg/a.py", 2, False), ("pkg/a.py", 4, True)]


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
