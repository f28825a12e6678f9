"""Remotes: push, fetch, pull and clone between repositories, and local retention after a push."""

from typing import TYPE_CHECKING

from ckptrepo._lazy import lazy_exports

# Facade: the names other layers import from this package, read from their modules when asked for (PEP 562)
# so that importing the package stays cheap. Its TYPE_CHECKING imports and _LAZY name the same (test_facades.py).
if TYPE_CHECKING:
    from ckptrepo.remotes._clone import clone
    from ckptrepo.remotes._evict import EvictReport, evict
    from ckptrepo.remotes._remote import REPOSITORY_ID, open_remote
    from ckptrepo.remotes._sync import SyncResult, fetch, pull, push
    from ckptrepo.remotes._transfer import Progress, VersionCopier

_LAZY = {
    "ckptrepo.remotes._clone": ("clone",),
    "ckptrepo.remotes._evict": ("EvictReport", "evict"),
    "ckptrepo.remotes._remote": ("REPOSITORY_ID", "open_remote"),
    "ckptrepo.remotes._sync": ("SyncResult", "fetch", "pull", "push"),
    "ckptrepo.remotes._transfer": ("Progress", "VersionCopier"),
}
if not TYPE_CHECKING:
    __getattr__, __dir__ = lazy_exports(__name__, _LAZY)

__all__ = ["EvictReport", "Progress", "REPOSITORY_ID", "SyncResult", "VersionCopier", "clone", "evict", "fetch",
           "open_remote", "pull", "push"]
# End of facade.
