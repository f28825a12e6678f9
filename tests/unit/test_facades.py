"""Each subpackage's facade serves what other layers import from it: every name in its lazy table is the object
of the module that holds it, mypy sees the same names (its TYPE_CHECKING imports), and importing the facade
alone imports none of them."""
from __future__ import annotations

import ast
import importlib
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

import ckptrepo
from ckptrepo._lazy import lazy_exports

PACKAGE = Path(ckptrepo.__file__).parent
FACADES = sorted(f"ckptrepo.{p.parent.name}" for p in PACKAGE.glob("*/__init__.py")
                 if "_LAZY" in p.read_text())


def _table(facade: str) -> dict[str, str]:
    return {name: module for module, names in importlib.import_module(facade)._LAZY.items() for name in names}


def _typed_names(facade: str) -> dict[str, str]:
    """name -> module of the imports under ``if TYPE_CHECKING:`` in the facade's __init__."""
    tree = ast.parse((PACKAGE.parent / Path(*facade.split(".")) / "__init__.py").read_text())
    out = {}
    for node in tree.body:
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            for imp in node.body:
                if isinstance(imp, ast.ImportFrom) and imp.module.startswith(facade + "."):
                    out.update({a.asname or a.name: imp.module for a in imp.names})
    return out


def test_there_are_facades():
    assert {"ckptrepo.core", "ckptrepo.storage", "ckptrepo.tools"} <= set(FACADES)


@pytest.mark.parametrize("facade", FACADES)
def test_each_lazy_name_is_its_modules_object_and_typed_and_listed(facade):
    package = importlib.import_module(facade)
    table = _table(facade)
    assert table and _typed_names(facade) == table
    for name, module in table.items():
        assert module.startswith(facade + "."), (name, module)
        assert getattr(package, name) is getattr(importlib.import_module(module), name), name
        assert name in package.__all__ and name in dir(package), name
    with pytest.raises(AttributeError, match=f"module '{facade}' has no attribute 'no_such_name'"):
        package.no_such_name  # noqa: B018


def test_importing_the_facades_imports_no_module_behind_them(tmp_path):
    """Importing a facade costs its own __init__ and what that imports eagerly by hand, nothing more."""
    code = ("import sys, importlib\n"
            f"facades = {FACADES!r}\n"
            "for f in facades: importlib.import_module(f)\n"
            "lazy = {m for f in facades for m in sys.modules[f]._LAZY}\n"
            "loaded = sorted(lazy & set(sys.modules))\n"
            "heavy = [m for m in ('torch', 'numpy', 'tensorstore', 'rich') if m in sys.modules]\n"
            "assert not heavy, heavy\n"
            "print(' '.join(loaded))\n")
    env = dict(os.environ, PYTHONPATH=str(PACKAGE.parent))
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=str(tmp_path), env=env,
                       timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    # a facade that imports some of its modules eagerly by hand (storage: open_store's) may load what they import
    by_hand = {f for f in FACADES if any(m.startswith(f + ".") for m in _eager_modules(f))}
    unexpected = [m for m in p.stdout.split() if ".".join(m.split(".")[:2]) not in by_hand]
    assert not unexpected, unexpected


def _eager_modules(facade: str) -> set[str]:
    tree = ast.parse((PACKAGE.parent / Path(*facade.split(".")) / "__init__.py").read_text())
    return {n.module for n in tree.body if isinstance(n, ast.ImportFrom) and n.module}


def test_lazy_exports_import_when_asked_and_read_the_modules_current_value(monkeypatch):
    package = types.ModuleType("facade_probe")
    monkeypatch.setitem(sys.modules, "facade_probe", package)
    getattr_, dir_ = lazy_exports("facade_probe", {"json": ("dumps", "loads")})
    package.__getattr__ = getattr_   # type: ignore[attr-defined]
    import json
    assert package.dumps is json.dumps
    assert {"dumps", "loads"} <= set(dir_())
    monkeypatch.setattr(json, "dumps", len)   # a patch of the module is what the facade serves
    assert package.dumps is len
    with pytest.raises(AttributeError, match="no attribute 'dump'"):
        package.dump  # noqa: B018


def test_an_import_in_a_function_through_a_facade_sees_a_patched_module(monkeypatch):
    """As an import from the private module itself does: Repository.load imports load_version when called."""
    import ckptrepo.loading._version_load as version_load
    from ckptrepo.loading import load_version
    assert load_version is version_load.load_version

    def stand_in(*args, **kwargs):
        raise RuntimeError("the patched reader ran")
    monkeypatch.setattr(version_load, "load_version", stand_in)
    from ckptrepo.loading import load_version as now
    assert now is stand_in
