"""clone: a new repository holding another's history, with it as a remote, its HEAD on the remote HEAD's branch.

The source is checked whole before anything is written here (``sound_history``): a damaged or hostile source is
refused in one line and leaves no repository behind. The new repository's ``ckptrepo.json`` records the clone
in progress (``cloning``: the URL and remote name) from its first write until HEAD is set, the clone's last
step: a clone killed midway is then named as such by every command and by fsck, and running the same clone
again finishes it (what is copied stays; the rest is fetched), where git would have a half-made directory.
"""
from __future__ import annotations

import time
import uuid
from typing import Any

from ckptrepo.core import (
    CLONING_SETTING,
    CONFIG_KEY,
    CONFIG_MAX_BYTES,
    Plumbing,
    add_remote,
    check_not_itself,
    check_remote_name,
    decode_config,
    encode_config,
    init_head,
    remotes,
    tracking_tip,
    update_config,
)
from ckptrepo.errors import CkptRepoError, RepositoryExistsError, first_line
from ckptrepo.remotes._remote import REPOSITORY_ID, open_source, sound_history
from ckptrepo.remotes._sync import fetch
from ckptrepo.remotes._transfer import Progress
from ckptrepo.storage import Store, open_store


def clone(url: str, target: str, default_branch: str, depth: int | None = None, lazy: bool = False,
          remote: str = "origin", progress: Progress | None = None) -> Plumbing:
    """Clone the repository at ``url`` into ``target`` (see the module docstring); ``default_branch`` names
    HEAD's branch when the source names none."""
    check_remote_name(remote)
    theirs = open_source(url)
    history = sound_history(theirs, f"cannot clone {url}: the repository there")
    head = history.head
    branch = head.branch or str(theirs.config.get("default_branch") or default_branch)
    check_not_itself(target, remote, url)   # before anything is made there
    store = open_store(target, create=True)
    _start(store, url, target, remote, {"created": time.time(), "default_branch": branch,
                                        REPOSITORY_ID: theirs.config.get(REPOSITORY_ID) or uuid.uuid4().hex})
    init_head(store, branch)
    local = Plumbing(store)
    try:
        fetch(local, remote, lazy=lazy, depth=depth, progress=progress, source=(theirs, history))
    except CkptRepoError as err:   # what is copied stays: the same clone again copies only the rest
        raise type(err)(f"{first_line(err)}; the clone in {target} is incomplete: finish it by running the same "
                        f"clone again (`ckptrepo clone {url} {target}`)") from err
    refs = local.refs
    if head.branch is not None:
        tip = tracking_tip(store, f"{remote}/{head.branch}")
        if tip is not None and refs.branch_tip(branch) is None:   # else the remote's branch has no versions yet
            refs.create_branch(branch, tip)
    elif head.version is not None:   # the remote's HEAD is detached: so is the clone's, at the same version
        refs.set_head(None, head.version, refs.head(for_update=True).generation)
    local.config = update_config(store, {CLONING_SETTING: None})
    return local


def _start(store: Store, url: str, target: str, remote: str, settings: dict[str, Any]) -> None:
    """Create the clone's repository at ``target``, its config naming the clone in progress, or take up the
    interrupted clone of the same URL that is there; anything else in ``target`` is refused."""
    raw = store.get(CONFIG_KEY, CONFIG_MAX_BYTES)
    if raw is not None:
        config = decode_config(raw, target)
        cloning = config.get(CLONING_SETTING)
        if isinstance(cloning, dict) and cloning.get("url") == url and cloning.get("remote") == remote:
            if remote not in remotes(store):   # killed between the config and the remote's record
                add_remote(store, remote, url)
            return
    if store.list(""):
        raise RepositoryExistsError(f"{target} is not empty; clone into a new directory")
    settings[CLONING_SETTING] = {"url": url, "remote": remote}
    store.put_if_absent(CONFIG_KEY, encode_config(settings))
    add_remote(store, remote, url)
