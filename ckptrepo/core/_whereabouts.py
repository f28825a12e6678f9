"""Where an evicted version's data really is: on the remote its eviction marker names, or nowhere.

A remote-tracking ref says a remote received a version; it does not say the remote kept its data. The
remote's own gc or retention may prune it there since, or a config edited by hand may name this repository
itself as the remote. An evicted version is then history without data: it loads nowhere. Three readers ask:

* ``log`` and ``show`` (``durability``): an evicted version whose remote pruned it, or lacks it, reads as
  pruned and on no remote (``[-]``); a remote that is this repository holds no copy of any version. They look
  only at remotes in a local directory (a few ``stat`` calls); an object store is not contacted, so that
  ``log`` stays fast and works while the remote is down: there, ``fsck`` and a failing load say it.
* ``fsck`` (``check_evicted``): an error for each such version some ref reaches, and for each array that is
  neither here nor there; a remote that cannot be reached is a warning that says its versions went unchecked.
* ``load`` (``require_data_somewhere``): a one-line error that says the data is gone, instead of a missing
  object.
"""
from __future__ import annotations

from typing import Callable, Iterable, Sequence

from ckptrepo.core._manifest import CONFIG_KEY, DATA_PREFIX, PRUNED_PREFIX, VERSIONS_PREFIX
from ckptrepo.core._plumbing import Plumbing
from ckptrepo.core._remotes import EVICTED_PREFIX, evicted_marker, remote_holders, remotes
from ckptrepo.core._same_store import location_spec, same_location
from ckptrepo.core.schema import Manifest, ManifestHeader
from ckptrepo.errors import CkptRepoError, RevisionError, first_line, some_names
from ckptrepo.storage.protocol import Store

Report = Callable[[str], None]
NOT_THERE = "does not hold it"


def _by_remote(plumbing: Plumbing, vids: Iterable[str], spread: set[str] | None = None) -> dict[str, list[str]]:
    """Remote name -> the versions of ``vids`` whose eviction marker names it (a damaged marker is left out:
    fsck names it, loads refuse it); those of a node-local tier are added to ``spread``."""
    out: dict[str, list[str]] = {}
    for vid in vids:
        try:
            marker = evicted_marker(plumbing.store, vid)
        except CkptRepoError:
            continue
        if marker is not None:
            out.setdefault(marker[0], []).append(vid)
            if marker[1] and spread is not None:
                spread.add(vid)
    return out


def _pending(spread: set[str], vid: str, why: str | None) -> bool:
    """Whether a version the remote lacks is a node-local tier's not pushed yet: its data is on the nodes."""
    return vid in spread and why == NOT_THERE


def gone_there(there: Store, vid: str) -> str | None:
    """Why remote store ``there`` does not hold version ``vid``'s data, or None when it does."""
    if there.exists(PRUNED_PREFIX + vid):
        return "pruned it (its gc or retention)"
    if not there.exists(VERSIONS_PREFIX + vid):
        return NOT_THERE
    return None


def data_gone(plumbing: Plumbing, vids: Iterable[str], local_only: bool) -> dict[str, tuple[str, str]]:
    """Version -> (remote, why) for the evicted versions of ``vids`` whose remote no longer holds their data.
    ``local_only``: remotes in a local directory only (no round trip); a remote that cannot be read, or holds no
    repository (not mounted?), is left out: whether the data is there is unknown, not gone."""
    known = remotes(plumbing.store)
    if local_only:   # without reading a marker when no remote is a local directory
        known = {r: url for r, url in known.items() if (location_spec(url) or {}).get("driver") == "file"}
    out: dict[str, tuple[str, str]] = {}
    if not known:
        return out
    spread: set[str] = set()
    for remote, held in _by_remote(plumbing, vids, spread).items():
        if remote not in known:
            continue
        try:
            there = plumbing.remote_store(remote)
            if local_only and there.capabilities.local_root is None:
                continue
            if same_location(plumbing.store.url, known[remote]):
                out.update((vid, (remote, "is this repository itself")) for vid in held
                           if not plumbing.store.list(f"{DATA_PREFIX}{vid}/"))
                continue
            if not there.exists(CONFIG_KEY):
                continue
            for vid in held:
                why = gone_there(there, vid)
                if why is not None and not _pending(spread, vid, why):
                    out[vid] = (remote, why)
        except CkptRepoError:
            continue
    return out


def durability(plumbing: Plumbing, shown: Sequence[ManifestHeader], header: Callable[[str], ManifestHeader],
               pruned: set[str], evicted: set[str]) -> tuple[set[str], dict[str, tuple[str, ...]]]:
    """The versions of ``shown`` whose data is gone (pruned here, or evicted here and gone from the remote: see
    the module docstring), and version -> the remotes holding its data."""
    held = remote_holders(plumbing.store, shown, header)
    known = remotes(plumbing.store) if held else {}
    itself = {r for r, url in known.items() if same_location(plumbing.store.url, url)}
    if itself:   # no copy of anything: a remote that is this repository (a config edited by hand)
        held = {vid: tuple(r for r in names if r not in itself) for vid, names in held.items()}
    candidates = [h.id for h in shown if h.id in evicted and h.id not in pruned]
    gone = data_gone(plumbing, candidates, local_only=True) if candidates else {}
    for vid, (remote, _) in gone.items():
        held[vid] = tuple(r for r in held.get(vid, ()) if r != remote)
    return pruned | set(gone), held


def version_durability(plumbing: Plumbing, header: ManifestHeader) -> tuple[bool, bool, tuple[str, ...]]:
    """One version's (data gone, evicted here, remotes holding its data), as ``durability`` says for a listing."""
    vid, store = header.id, plumbing.store
    evicted = {vid} if store.exists(EVICTED_PREFIX + vid) else set()
    gone, held = durability(plumbing, [header], plumbing.header,
                            {vid} if store.exists(PRUNED_PREFIX + vid) else set(), evicted)
    return vid in gone, bool(evicted), held.get(vid, ())


def require_data_somewhere(plumbing: Plumbing, vid: str, manifest: Manifest) -> None:
    """Refuse, in one line, to read a version whose data gc pruned here or that its remote no longer holds."""
    plumbing.require_data(vid, manifest)
    gone = data_gone(plumbing, [vid], local_only=False)
    if vid in gone:
        remote, why = gone[vid]
        raise RevisionError(f"version {vid[:12]} (step {manifest.step}) has its data nowhere: it was evicted here "
                            f"after a push, and remote {remote!r} {why}; pick a kept version from `ckptrepo log`")


def check_evicted(plumbing: Plumbing, vids: Sequence[str], manifests: dict[str, Manifest], reachable: set[str],
                  error: Report, warning: Report) -> None:
    """fsck of evicted versions ``vids`` against the remotes holding their data (see the module docstring)."""
    known = remotes(plumbing.store)
    spread: set[str] = set()
    for remote, held in sorted(_by_remote(plumbing, vids, spread).items()):
        held = [v for v in held if v in reachable]
        if not held:
            continue
        names = some_names([v[:12] for v in sorted(held)])
        if remote not in known:
            warning(f"{len(held)} version(s) keep their data on remote {remote!r}, which is not a remote here "
                    f"({names}): they do not load until it is added back (`ckptrepo remote add {remote} URL`)")
            continue
        url = known[remote]
        if same_location(plumbing.store.url, url):
            for vid in held:
                for key in _missing_here(plumbing, manifests[vid]):
                    error(f"version {vid[:12]}: array {key} exists nowhere: evicted here, to remote {remote!r} "
                          f"({url}), which is this repository itself")
            continue
        try:
            _check_remote(plumbing, remote, url, held, manifests, error, warning, spread)
        except CkptRepoError as err:
            warning(f"remote {remote!r} ({url}) could not be reached ({first_line(err)}): the data of "
                    f"{len(held)} evicted version(s) there is not checked ({names}); run fsck again when it answers")


def _check_remote(plumbing: Plumbing, remote: str, url: str, held: list[str], manifests: dict[str, Manifest],
                  error: Report, warning: Report, spread: set[str]) -> None:
    there = plumbing.remote_store(remote)
    if not there.exists(CONFIG_KEY):
        there.list("")   # a bucket that does not exist says so here (a warning: unreachable)
        for vid in held:
            error(f"version {vid[:12]}: its data exists nowhere: evicted here, and remote {remote!r} ({url}) holds "
                  f"no repository; check its URL (`ckptrepo remote -v`)")
        return
    for vid in held:
        m = manifests[vid]
        why = gone_there(there, vid)
        if _pending(spread, vid, why):
            warning(f"version {vid[:12]} (step {m.step}) of a node-local tier is not on remote {remote!r} yet: "
                    f"the other nodes' arrays are on their disks until pushed; what is not here is not checked")
            continue
        if why is not None:
            error(f"version {vid[:12]} (step {m.step}): its data exists nowhere: evicted here, and remote "
                  f"{remote!r} {why}; unless another copy exists, record that here with `ckptrepo prune {vid[:12]}`")
            continue
        for key in _missing_here(plumbing, m):
            if not there.exists(f"{key}/zarr.json"):
                error(f"version {vid[:12]} (step {m.step}): array {key} is neither here nor on remote {remote!r}")


def _missing_here(plumbing: Plumbing, m: Manifest) -> list[str]:
    """The arrays version ``m`` points into that are not here (no ``zarr.json``)."""
    return [key for key in sorted(m.arrays) if not plumbing.store.exists(f"{key}/zarr.json")]


__all__ = ["check_evicted", "data_gone", "durability", "require_data_somewhere", "version_durability"]
