"""Lazy exports for the subpackages' facades (PEP 562).

A subpackage's ``__init__`` names what other layers import from it in a table, module -> names; a name is
imported from its module when asked for. So ``from ckptrepo.core import X`` costs what importing the module that
holds X costs, and importing the package alone costs nothing: ``ckptrepo log`` stays free of torch and numpy.
Each lookup reads the module's attribute afresh, as an import from the module itself would: an import inside a
function sees the module's current value (a test that patches ``_version_load.load_version`` reaches
``Repository.load``). A base module, like errors and faults: it imports nothing of the package.
"""
from __future__ import annotations

import importlib
import sys
from typing import Any, Callable


def lazy_exports(package: str, table: dict[str, tuple[str, ...]]) -> tuple[Callable[[str], Any],
                                                                         Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` of ``package`` serving ``table`` (module -> names it exports)."""
    where = {name: module for module, names in table.items() for name in names}
    namespace = sys.modules[package].__dict__

    def __getattr__(name: str) -> Any:
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(sys.modules.get(module) or importlib.import_module(module), name)

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(where))

    return __getattr__, __dir__
