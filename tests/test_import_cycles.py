"""No import cycle between the package's modules: the layers import downwards only.

Every import counts, those inside functions too (a lazy import still ties two modules together); only imports
under `if TYPE_CHECKING:` are left out, as they never run. `from pkg import name` depends on `pkg.name` when that
is a module, else on `pkg` itself (its __init__).
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"


def module_files(src: Path) -> dict[str, Path]:
    found = {}
    for path in src.rglob("*.py"):
        name = ".".join(path.relative_to(src).with_suffix("").parts)
        found[name.removesuffix(".__init__")] = path
    return found


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(child) for child in ast.walk(node))
    return skipped


def _owner(name: str, modules: dict[str, Path]) -> str | None:
    """The module that `name` (a module or a name inside one) lives in, if it is one of ours."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        skipped = _type_checking_nodes(tree)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(tree):
            if id(node) in skipped:
                continue
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: climb level - 1 packages from this module's package
                    parts = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join([*parts, base] if base else parts)
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            else:
                continue
            graph[name].update(t for t in (_owner(target, modules) for target in targets) if t and t != name)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative: no recursion limit)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_import_cycle_in_the_package():
    found = cycles(import_graph(module_files(SRC)))
    assert not found, "import cycles (break them with an interface in a leaf module):\n" + "\n".join(
        " <-> ".join(cycle) for cycle in found)


def test_the_checker_sees_lazy_relative_and_package_imports(tmp_path):
    """A cycle made only by a lazy import inside a function, or through a package's __init__, is found; one under
    TYPE_CHECKING is not."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from pkg.a import f\n")
    (pkg / "a.py").write_text("def f():\n    from . import b\n")
    (pkg / "b.py").write_text("from pkg import f\n")  # pkg/__init__ -> a -> b -> pkg/__init__
    (pkg / "sub" / "__init__.py").write_text("")
    guarded = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.sub import d\n"
    (pkg / "sub" / "c.py").write_text(guarded)
    (pkg / "sub" / "d.py").write_text("from ..sub import c\n")
    assert cycles(import_graph(module_files(tmp_path))) == [["pkg", "pkg.a", "pkg.b"]]
