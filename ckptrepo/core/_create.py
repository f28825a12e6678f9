"""Creating a repository in a store: its config written if absent, then HEAD on the default branch.

Both writes are create-if-absent, so an init killed between them is finished by the next one, and two inits
racing on one URL make one repository (the loser finds it there: RepositoryExistsError, or, with
``exist_ok``, opens it).
"""
from __future__ import annotations

from typing import Any

from ckptrepo.core._manifest import CONFIG_KEY, CONFIG_MAX_BYTES, encode_config, update_config
from ckptrepo.core._refs import init_head
from ckptrepo.errors import RepositoryExistsError, StorageError
from ckptrepo.storage import Store, open_store


def create_store(url: str, options: dict[str, Any] | None, exist_ok: bool, settings: dict[str, Any],
                 default_branch: str, existing: dict[str, Any] | None = None) -> Store:
    """The store of a repository at ``url``: created with ``settings`` as its config, or, with ``exist_ok``,
    the one already there, whose config then takes ``existing`` (the settings an init names explicitly)."""
    store = open_store(url, options, create=True)
    if not store.put_if_absent(CONFIG_KEY, encode_config(settings)):
        if store.get(CONFIG_KEY, CONFIG_MAX_BYTES) is None:
            # nothing there and nothing written: TensorStore's S3 driver answers a conditional write into a
            # bucket that does not exist as a failed condition; listing says why (NoSuchBucket, ...)
            try:
                store.list()
                reason = "the store did not take the write"
            except StorageError as err:
                reason = str(err)
            raise StorageError(f"could not create a repository at {url} ({reason}); check that the bucket exists "
                               f"and is writable")
        if not exist_ok:
            raise RepositoryExistsError(f"a repository already exists at {url}; open it with ckptrepo.open, "
                                        f"or pass exist_ok=True")
        init_head(store, default_branch)   # only if absent: an init killed before it wrote HEAD is finished
        if existing:
            update_config(store, existing)
        return store
    init_head(store, default_branch)
    return store


__all__ = ["create_store"]
