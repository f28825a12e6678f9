"""The load path: one read engine (plan the byte ranges, read, verify, scatter) behind plain loads,
in-place loads and loads into any parallel layout.
"""

from typing import TYPE_CHECKING

from ckptrepo._lazy import lazy_exports

# Facade: the names other layers import from this package, read from their modules when asked for (PEP 562)
# so that importing the package stays cheap. Its TYPE_CHECKING imports and _LAZY name the same (test_facades.py).
if TYPE_CHECKING:
    from ckptrepo.loading._engine import Engine, Read, ReadStats
    from ckptrepo.loading._entry import entry_keys, load_entry
    from ckptrepo.loading._reshard import VersionReader, read_pieces
    from ckptrepo.loading._targets import check_into, load_device
    from ckptrepo.loading._version_load import load_version

_LAZY = {
    "ckptrepo.loading._engine": ("Engine", "Read", "ReadStats"),
    "ckptrepo.loading._entry": ("entry_keys", "load_entry"),
    "ckptrepo.loading._reshard": ("VersionReader", "read_pieces"),
    "ckptrepo.loading._targets": ("check_into", "load_device"),
    "ckptrepo.loading._version_load": ("load_version",),
}
if not TYPE_CHECKING:
    __getattr__, __dir__ = lazy_exports(__name__, _LAZY)

__all__ = ["Engine", "Read", "ReadStats", "VersionReader", "check_into", "entry_keys", "load_device", "load_entry",
           "load_version", "read_pieces"]
# End of facade.
