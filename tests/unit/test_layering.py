"""The package's layers import only downwards.

ckptrepo's subpackages form a stack (``LAYERS``: arguments < storage < core < state < parallel < rules < loading <
maintenance < saving < tools < repository < the package's __init__ < integrations < dcp < ui < cli < testing): a
module may import from its own layer and the ones below it, never above, so each layer can be read, tested and changed
without the ones built on it. Imports made only for type checking (under ``if TYPE_CHECKING:``) are not
run and do not count; imports inside functions do.

Across packages a module imports what another package's facade (its ``__init__``) exports, never that package's
``_private`` modules (type-checking imports included): the underscore says who may use a module. Top-level modules
(arguments, _lazy, repository, dcp, rules, errors, faults, the package's __init__) are packages of their own here.
"""
from __future__ import annotations

import ast
import functools
from pathlib import Path

import ckptrepo

PACKAGE = Path(ckptrepo.__file__).parent

# Bottom to top. errors, faults and _lazy (the facades' lazy exports) are shared by every layer; arguments (the
# argument checks) builds on errors alone, so every layer can use it; rules re-exports parallel.rules for users.
LAYERS = ("errors", "faults", "_lazy", "arguments", "storage", "core", "state", "parallel", "rules", "loading",
          "maintenance", "remotes", "saving", "tools", "repository", "__init__", "integrations", "dcp", "ui", "cli",
          "testing")
BASE = {"errors", "faults", "_lazy"}   # importable from anywhere, and import nothing of the package themselves


def _layer(module: str) -> str:
    """The layer of a dotted module name inside the package (``ckptrepo.core._refs`` -> ``core``)."""
    parts = module.split(".")
    assert parts[0] == "ckptrepo", module
    return parts[1] if len(parts) > 1 else "__init__"


def _rank(layer: str) -> int:
    return 0 if layer in BASE else LAYERS.index(layer)


def _module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__" and len(parts) > 1 and parts[:-1] != ["ckptrepo"]:
        parts = parts[:-1]
    return ".".join(parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _is_module(dotted: str) -> bool:
    path = PACKAGE.parent / Path(*dotted.split("."))
    return path.with_suffix(".py").exists() or path.is_dir()


@functools.cache
def _lazy_exports(package: str) -> dict[str, str]:
    """name -> module of a facade's lazy table (``_LAZY = {module: (names, ...)}`` in its ``__init__``)."""
    init = PACKAGE.parent / Path(*package.split(".")) / "__init__.py"
    if package == "ckptrepo" or not init.exists():
        return {}
    for node in ast.parse(init.read_text()).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "_LAZY" for t in node.targets):
            table = ast.literal_eval(node.value)
            if all(isinstance(names, tuple) for names in table.values()):
                return {name: module for module, names in table.items() for name in names}
    return {}


def _imports(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, module) of every ckptrepo import that runs, ``from X import y`` naming ``X.y`` where that is a
    module (``from ckptrepo import faults``), the module a facade's lazy table serves ``y`` from, and ``X``
    otherwise."""
    found: list[tuple[int, str]] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.extend((node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "ckptrepo")
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                and node.module.split(".")[0] == "ckptrepo":
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                is_module = _is_module(sub)
                lazy = _lazy_exports(node.module)
                found.append((node.lineno, sub if is_module else lazy.get(a.name, node.module)))
        for child in ast.iter_child_nodes(node):
            visit(child)
    visit(tree)
    # `import ckptrepo` and `from ckptrepo import Repository` run the package's __init__: name it as
    # _module_name names that file, so the layer check and the cycle graph both see the edge
    return [(line, "ckptrepo.__init__" if m == "ckptrepo" else m) for line, m in found]


def _violations() -> list[str]:
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        mine = _layer(_module_name(path))
        for line, imported in _imports(ast.parse(path.read_text(), str(path))):
            theirs = _layer(imported)
            if _rank(theirs) > _rank(mine) or (mine in BASE and theirs != mine):
                out.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {mine} imports {imported} ({theirs})")
    return out


def test_every_module_belongs_to_a_known_layer():
    layers = {_layer(_module_name(p)) for p in PACKAGE.rglob("*.py")}
    assert layers <= set(LAYERS), f"add {sorted(layers - set(LAYERS))} to LAYERS in the order they build on"


def test_no_module_imports_from_a_higher_layer():
    violations = _violations()
    assert not violations, "imports against the layer order:\n" + "\n".join(violations)


def test_the_checker_sees_upward_imports(tmp_path, monkeypatch):
    """A lower layer importing the porcelain, at module level or inside a function, is caught; one under
    TYPE_CHECKING is not."""
    source = ("from typing import TYPE_CHECKING\nfrom ckptrepo.repository import Repository\n"
              "if TYPE_CHECKING:\n    from ckptrepo.saving._writer import PlanCache\n"
              "def f():\n    from ckptrepo import repository\n")
    found = [m for _, m in _imports(ast.parse(source))]
    assert found == ["ckptrepo.repository", "ckptrepo.repository"]
    assert all(_rank(_layer(m)) > _rank("maintenance") for m in found)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan): each is an import cycle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles_inside_a_layer():
    """The layer order rules out cycles between layers; within one, modules must not import each other
    either (lazily included), so each can be read, and tested, from the bottom up."""
    graph = {}
    for path in PACKAGE.rglob("*.py"):
        module = _module_name(path)
        graph[module] = {m for _, m in _imports(ast.parse(path.read_text(), str(path))) if m != module}
    assert _cycles(graph) == []


def _private_imports_in(tree: ast.AST, mine: str) -> list[tuple[int, str]]:
    """(line, module) of each import, anywhere in ``tree``, of a private module of a package other than ``mine``."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names
                                     if _is_module(f"{node.module}.{a.name}")]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] == "ckptrepo" and len(parts) > 2 and parts[1] != mine \
                    and any(p.startswith("_") for p in parts[2:]):
                found.append((node.lineno, name))
                break
    return found


def test_no_module_imports_another_packages_private_module():
    found = [f"{path.relative_to(PACKAGE.parent)}:{line}: imports {name}; import it from its package's facade "
             f"(from ckptrepo.{name.split('.')[1]} import ...), exporting it there if it is not yet"
             for path in sorted(PACKAGE.rglob("*.py"))
             for line, name in _private_imports_in(ast.parse(path.read_text(), str(path)),
                                                   _layer(_module_name(path)))]
    assert not found, f"{len(found)} imports of another package's private module:\n" + "\n".join(found)


def test_the_checker_sees_private_imports_across_packages():
    """In functions and under TYPE_CHECKING too, and module objects; not inside the package, not the facade."""
    source = ("from typing import TYPE_CHECKING\nfrom ckptrepo.core import Plumbing\n"
              "from ckptrepo.saving._writer import PlanCache\nif TYPE_CHECKING:\n"
              "    from ckptrepo.core._refs import Head\ndef f():\n    from ckptrepo.storage import _crc\n"
              "    import ckptrepo.tools._plot as plot\n")
    assert [m for _, m in _private_imports_in(ast.parse(source), "loading")] == \
        ["ckptrepo.saving._writer", "ckptrepo.core._refs", "ckptrepo.storage._crc", "ckptrepo.tools._plot"]
    assert [m for _, m in _private_imports_in(ast.parse(source), "saving")] == \
        ["ckptrepo.core._refs", "ckptrepo.storage._crc", "ckptrepo.tools._plot"]


def test_the_cycle_finder_finds_a_lazy_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []
