"""Refs: HEAD, branches and tags, moved only by compare-and-swap.

HEAD holds ``ref: refs/heads/NAME`` (attached), ``orphan: refs/heads/NAME``
(``checkout --orphan``: on a branch its first snapshot creates, as a new root)
or a version id (detached). Branch refs hold a version id and move by
compare-and-swap on the storage generation; tag refs are written once, if
absent. No locks, no renames.

A ref is read as exactly what a writer writes: the text, optionally ended by
one newline (git's refs and ``echo`` end in one; ckptrepo writes none).
Anything else (spaces, a second newline, a carriage return) is damage, named:
read leniently, a HEAD that names ``"evil\n"`` read as ``evil``, another branch.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from itertools import islice
from typing import Callable, Sequence

from ckptrepo.core._manifest import (
    HEAD_KEY,
    HEADS_PREFIX,
    REF_MAX_BYTES,
    SYMREF_PREFIX,
    TAGS_PREFIX,
    VERSIONS_PREFIX,
    is_version_id,
)
from ckptrepo.core._manifest_reads import first_parent_chain
from ckptrepo.errors import ConflictError, CorruptionError, RefError
from ckptrepo.storage import LOCK_SUFFIX, remove_empty_parents
from ckptrepo.storage.protocol import NO_VALUE, Store

_HEX_RE = re.compile(r"[0-9a-f]{4,32}")
# matched whole (fullmatch): `$` also matches before a final newline, which let a branch be named "evil\n"
_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._/=+,-]*")   # "=", "+", ",": file names frameworks choose
ORPHAN_PREFIX = "orphan: "   # HEAD of `checkout --orphan NAME` until NAME's first snapshot


def is_ref_name(name: str) -> bool:
    """Whether ``name`` can be a branch or tag some ckptrepo made: not ambiguous in a revision (``~``, ``@``,
    ``..``, ``HEAD``), no whitespace or control character. Listings keep exactly these, so a stray
    ``.DS_Store`` or ``main~`` is no ref, while gc and fsck still see every ref ever created (skipping one would
    let gc collect what only it reaches; see :func:`_legacy_name` for names older releases let through)."""
    return bool(_NAME_RE.fullmatch(name)) and ".." not in name and not name.endswith(("/", ".")) \
        and name != "HEAD" and "//" not in name


def _legacy_name(name: str) -> bool:
    """A ref name ending in one newline: older releases matched names with ``$`` and so created them. Not a ref
    name any more, yet such a ref may hold the only way to a history: gc and fsck name it as damage."""
    return name.endswith("\n") and is_ref_name(name[:-1])


def is_new_ref_name(name: str) -> bool:
    """What a new branch or tag may be called: :func:`is_ref_name`, no component starting with '.' or ending in
    '.lock' (as git's check-ref-format), and not ending in TensorStore's ``.__lock`` (its file store's lock
    files; such a ref would fail as a storage error)."""
    return is_ref_name(name) and "/." not in name and not name.endswith(LOCK_SUFFIX) \
        and not any(part.endswith(".lock") for part in name.split("/"))


def check_ref_name(name: str, kind: str) -> None:
    """Refuse names :func:`is_new_ref_name` refuses, saying what a name may hold."""
    if not isinstance(name, str) or not is_new_ref_name(name):
        raise RefError(f"invalid {kind} name {name!r}: use letters, digits and '._-/=+,' (no spaces or control "
                       f"characters), not starting with '-', '.' or '/', no part ending in '.lock', and not 'HEAD'")


def ref_text(raw: bytes) -> str | None:
    """A ref's text as its writer wrote it: the bytes as UTF-8, less one final newline; None when not UTF-8.
    Nothing else is stripped (see the module docstring)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return None
    return text[:-1] if text.endswith("\n") else text


def ref_value(raw: bytes | None, key: str) -> str | None:
    """The version id a branch or tag ref (or a detached HEAD) holds; None when the ref does not exist.

    A ref that exists but holds no version id (empty, not text, garbage) is damage, named here: read as
    "no ref", an empty branch ref would make the next snapshot start a new root history, and a byte that is
    not UTF-8 would fail every command with a bare UnicodeDecodeError.
    """
    if raw is None:
        return None
    text = ref_text(raw)
    if text is None or not is_version_id(text):
        shown = "empty" if not raw.strip() else f"holds {raw[:40]!r}"
        fix = f"write '{SYMREF_PREFIX}{HEADS_PREFIX}main' (or a version id) into it" if key == HEAD_KEY else \
            f"write a version id into it (the names under {VERSIONS_PREFIX}) or delete it"
        raise CorruptionError(f"ref {key} is damaged ({shown}, not a version id); {fix}")
    return text


@dataclass(frozen=True)
class Head:
    """What HEAD says: a branch (possibly without versions yet) or a detached version id."""

    branch: str | None
    version: str | None
    generation: bytes
    damage: str | None = None   # HEAD's branch ref is damaged: why (its version is then unknown, not None)
    orphan: bool = False        # `checkout --orphan`: the branch is yet to be created, as a new root


def head_target(raw: bytes) -> tuple[str, bool] | None:
    """The branch an attached or orphan HEAD names, and whether it is an orphan; None for a detached HEAD (a
    version id, checked by ``ref_value``). A symbolic HEAD whose branch is no ref name (a second newline, a
    space, ``refs/tags/...``) is damage named here: read as another name, it put snapshots on a new root."""
    for prefix, orphan in ((SYMREF_PREFIX, False), (ORPHAN_PREFIX, True)):
        if raw.startswith(prefix.encode()):
            text = ref_text(raw)
            target = (text if text is not None else raw[:64].decode("utf-8", "replace"))[len(prefix):]
            branch = target.removeprefix(HEADS_PREFIX)
            if text is None or branch == target or not is_ref_name(branch):
                raise CorruptionError(f"{HEAD_KEY} is damaged (it names {target!r}, not a branch); write "
                                      f"'{SYMREF_PREFIX}{HEADS_PREFIX}main' (or another branch) into it")
            return branch, orphan
    return None


def _exists(kind: str, name: str) -> RefError:
    hint = "pick another name or check it out" if kind == "branch" else "pick another name, or move it (`tag -f`)"
    return RefError(f"{kind} {name!r} already exists; {hint}")


@dataclass(frozen=True)
class BranchMove:
    """A branch move that happened. ``generation``: the branch's generation with the new version at its tip,
    to move it on from; None when another writer had already committed on top of the version before this
    writer read the branch back (its own reply lost): the version is committed, the branch no longer this
    writer's to move."""

    generation: bytes | None


# How far back from a branch's tip a writer whose reply was lost looks for its version: commits others made
# on top of it between its write and its read-back (a retry's backoff), never a long history.
LANDED_WALK = 1000


class Refs:
    """Reads and compare-and-swap updates of HEAD, branches and tags.

    ``before_write`` runs before every ref write (the handle's store check, which refuses a store whose
    server ignores the conditions these writes rely on)."""

    def __init__(self, store: Store, before_write: Callable[[], None] | None = None) -> None:
        self.store = store
        self._before_write = before_write

    def head(self, for_update: bool = False) -> Head:
        """What HEAD says; its storage generation (for ``set_head``) only ``for_update``: a plain read is
        cheaper on a local store (see ``Store.get``), and most callers only look."""
        raw, gen = self.store.get_with_generation(HEAD_KEY, REF_MAX_BYTES) if for_update \
            else (self.store.get(HEAD_KEY, REF_MAX_BYTES), b"")
        if raw is None:
            path = self.store.capabilities.local_path(HEAD_KEY)
            if path is not None and os.path.isdir(path):
                raise CorruptionError(f"{HEAD_KEY} is a folder, not a ref; move it away, then `ckptrepo init "
                                      f"--exist-ok` writes HEAD again")
            raise CorruptionError(f"{HEAD_KEY} is missing (an init interrupted before writing it?); "
                                  f"`ckptrepo init --exist-ok` writes it again")
        target = head_target(raw)
        if target is not None:
            branch, orphan = target
            try:
                return Head(branch, self.branch_tip(branch), gen, orphan=orphan)
            except CorruptionError as err:   # raised by what needs HEAD's version; checkout -b still works
                return Head(branch, None, gen, str(err), orphan=orphan)
        return Head(None, ref_value(raw, HEAD_KEY), gen)

    def set_head(self, branch: str | None, version: str | None, expected: bytes, orphan: bool = False) -> None:
        prefix = ORPHAN_PREFIX if orphan else SYMREF_PREFIX
        value = f"{prefix}{HEADS_PREFIX}{branch}" if branch else str(version)
        if self._swap(HEAD_KEY, value.encode(), expected) is None:
            raise ConflictError("HEAD was changed by another process at the same time; run the command again")

    def start_orphan(self, name: str) -> None:
        """``git checkout --orphan NAME``: HEAD onto branch ``name``, which does not exist yet; its first
        snapshot creates it as a new root. Saying so in HEAD is what lets a snapshot start a new history in a
        repository that has versions (without it, a HEAD on a missing branch is a lost ref or damage)."""
        check_ref_name(name, "branch")
        head = self.head(for_update=True)
        if not (head.orphan and head.branch == name):
            self._check_new_name("branch", name)
        self.set_head(name, None, head.generation, orphan=True)

    def settle_orphan(self, branch: str) -> None:
        """After the first snapshot on an orphan branch: HEAD ``ref:`` again, if it still says orphan of it (a
        HEAD moved meanwhile is left alone). Left orphan, a branch ref lost later would let the next snapshot
        start yet another root without a word."""
        raw, gen = self.store.get_with_generation(HEAD_KEY)
        if raw is not None and raw == f"{ORPHAN_PREFIX}{HEADS_PREFIX}{branch}".encode():
            self.store.compare_and_swap(HEAD_KEY, f"{SYMREF_PREFIX}{HEADS_PREFIX}{branch}".encode(), gen)

    def branch_tip(self, name: str) -> str | None:
        return ref_value(self.store.get(HEADS_PREFIX + name, REF_MAX_BYTES), HEADS_PREFIX + name)

    def branch_tip_with_generation(self, name: str) -> tuple[str | None, bytes]:
        raw, gen = self.store.get_with_generation(HEADS_PREFIX + name, REF_MAX_BYTES)
        return ref_value(raw, HEADS_PREFIX + name), gen

    def move_branch(self, name: str, version: str, expected: bytes, base: str | None,
                    first_parent: Callable[[str], str | None]) -> BranchMove | None:
        """Point branch ``name`` at ``version`` (committed on top of ``base``) if it is still at ``expected``;
        None when it was not (another writer moved it first).

        A write whose reply was lost reads back as done (see ``_swap``), and so does one another writer has
        since committed on top of: ``version`` is then on the branch's first-parent chain, found by walking
        back from the tip (``first_parent``) until ``base``, which the branch left only by some writer's move
        off it. Counted as a conflict, the version would be reported lost while the branch holds it.
        """
        key = HEADS_PREFIX + name
        gen = self._swap(key, version.encode(), expected)
        if gen is not None:
            return BranchMove(gen)
        for v in islice(first_parent_chain(self.branch_tip(name), first_parent), LANDED_WALK):
            if v == base:
                return None
            if v == version:
                return BranchMove(None)
        return None

    def _swap(self, key: str, value: bytes | None, expected: bytes) -> bytes | None:
        """``store.compare_and_swap``, with a write whose reply was lost counted as done: an object store retries
        the request, finds the ref already changed (by that very write) and reports the condition as failed.
        Read back, a ref that holds exactly ``value`` (ids are unique) was written; the new generation."""
        if self._before_write is not None:
            self._before_write()
        gen = self.store.compare_and_swap(key, value, expected)
        if gen is None:
            raw, now = self.store.get_with_generation(key, REF_MAX_BYTES)
            if (ref_text(raw) if raw is not None else None) == (value.decode() if value is not None else None):
                return now or b"deleted"
        return gen

    def _names(self, kind: str) -> set[str]:
        """The names of every branch or tag (one listing; their targets are not read)."""
        prefix = HEADS_PREFIX if kind == "branch" else TAGS_PREFIX
        return {k[len(prefix):] for k in self.store.list(prefix) if is_ref_name(k[len(prefix):])}

    def _check_new_name(self, kind: str, name: str) -> None:
        """Refuse a name that exists or clashes with another ref. git's rule: ``a`` and ``a/b`` cannot both
        exist (on a local store one would be a file, the other a folder of the same name, and the write would
        fail with a raw storage error)."""
        names = self._names(kind)
        if name in names:
            # checked before the create-if-absent write, whose failure reads back as a lost reply when the ref
            # already holds the very version asked for; racing creators are still decided by that write
            raise _exists(kind, name)
        parents = ["/".join(name.split("/")[:i]) for i in range(1, name.count("/") + 1)]
        clash = next((n for n in names if n.startswith(name + "/")), None) \
            or next((p for p in parents if p in names), None)
        other = "tag" if kind == "branch" else "branch"
        other_names = self._names(other)
        if name in other_names:   # git warns "refname is ambiguous"; here the revision would name the branch only
            raise RefError(f"cannot create {kind} {name!r}: a {other} of that name exists, and {name!r} as a revision "
                           f"would name only the branch; pick another name")
        if _HEX_RE.fullmatch(name) and self.store.list(VERSIONS_PREFIX + name):
            raise RefError(f"cannot create {kind} {name!r}: it is the start of a version id, which it would hide "
                           f"from revisions; pick another name")
        if clash is not None:
            plural = "branches" if kind == "branch" else "tags"
            raise RefError(f"cannot create {kind} {name!r}: {kind} {clash!r} exists, and one name cannot be both a "
                           f"{kind} and a folder of {plural}; pick another name")

    def create_branch(self, name: str, version: str) -> None:
        check_ref_name(name, "branch")
        self._check_new_name("branch", name)
        if self._swap(HEADS_PREFIX + name, version.encode(), NO_VALUE) is None:
            raise _exists("branch", name)

    def create_tag(self, name: str, version: str) -> None:
        check_ref_name(name, "tag")
        self._check_new_name("tag", name)
        if self._swap(TAGS_PREFIX + name, version.encode(), NO_VALUE) is None:
            raise _exists("tag", name)

    def check_tag_name(self, name: str, may_exist: bool) -> None:
        """Refuse a tag ``set_tag`` would refuse: a bad name, one of a branch or a version-id prefix, and (unless
        ``may_exist``) one that exists; before a snapshot is written, not after its commit."""
        check_ref_name(name, "tag")
        if not may_exist:
            self._check_new_name("tag", name)
            return
        if name in self._names("branch"):
            raise RefError(f"cannot use tag {name!r}: a branch of that name exists, and {name!r} as a revision "
                           f"would name only the branch; pick another name")
        if _HEX_RE.fullmatch(name) and self.store.list(VERSIONS_PREFIX + name):
            raise RefError(f"cannot use tag {name!r}: it is the start of a version id, which it would hide from "
                           f"revisions; pick another name")

    def set_tag(self, name: str, version: str, force: bool = False) -> None:
        """Create tag ``name`` at ``version``; with ``force`` an existing tag moves there (``git tag -f``).

        A move is a compare-and-swap on the tag as read: two writers moving one tag at once each land or lose
        whole, and the loser retries on what it then reads (the last writer wins, as with git)."""
        if not force:
            self.create_tag(name, version)
            return
        check_ref_name(name, "tag")
        key = TAGS_PREFIX + name
        for _ in range(16):
            raw, gen = self.store.get_with_generation(key, REF_MAX_BYTES)
            if raw is None:
                self._check_new_name("tag", name)
                if self._swap(key, version.encode(), NO_VALUE) is not None:
                    return
                continue
            if self._swap(key, version.encode(), gen) is not None:
                return
        raise ConflictError(f"tag {name!r} kept moving under other writers; try again")

    def delete(self, kind: str, name: str, seen: tuple[str | None, bytes] | None = None) -> str:
        """Delete branch or tag ``name`` (``kind``) unless it moved meanwhile; returns what it pointed at.

        ``seen``: the value and generation the caller read (and judged safe to delete); default: read here.
        """
        key = (HEADS_PREFIX if kind == "branch" else TAGS_PREFIX) + name
        if seen is None:
            raw, gen = self.store.get_with_generation(key, REF_MAX_BYTES)
            try:
                seen = ref_value(raw, key), gen
            except CorruptionError:   # a damaged ref points at nothing: deleting it is the repair it asks for
                seen = "", gen
        value, gen = seen
        if value is None:
            raise RefError(f"no {kind} named {name!r}; list them with `ckptrepo {kind}`")
        if self._swap(key, None, gen) is None:
            raise ConflictError(f"{kind} {name!r} moved while it was being deleted (a snapshot landed on it); "
                                f"run the command again")
        self._remove_empty_folders(key)
        return value

    def checkout(self, rev: str, branch: str | None, resolve: Callable[[str], str]) -> str:
        """Move HEAD to the version ``rev`` names (``resolve``): onto a branch if ``rev`` is one, else detached;
        ``branch`` creates one there. Returns that version. HEAD is read first, and moved only if unchanged."""
        head = self.head(for_update=True)
        vid = resolve(rev)
        rev = rev.strip()   # as resolve() reads it: " main" resolved to main's tip, then detached there
        if branch is not None:
            self.create_branch(branch, vid)
            self.set_head(branch, None, head.generation)
        elif rev == "HEAD" and head.branch is not None:
            pass   # already there, on its branch: git's `checkout HEAD` is a no-op, not a detach
        elif self.branch_tip(rev) is not None:
            self.set_head(rev, None, head.generation)
        else:
            self.set_head(None, vid, head.generation)
        return vid

    def delete_branch(self, name: str, force: bool, parents: Callable[[str], Sequence[str]]) -> str:
        """Delete branch ``name`` (``git branch -d``; ``force``: ``-D``); returns the version it pointed at.

        Refused for the branch HEAD is on, and, unless ``force``, when its tip is reachable (through
        ``parents``) from no other branch, tag or a detached HEAD: its versions would then be left to gc.
        """
        head = self.head()
        if head.branch == name:
            raise RefError(f"branch {name!r} is checked out; check out another branch or version first")
        try:
            tip, gen = self.branch_tip_with_generation(name)   # deleted only if still there after the check
        except CorruptionError:
            if not force:
                raise
            tip, gen = "", self.store.get_with_generation(HEADS_PREFIX + name)[1]   # damaged: -D is the repair
        if tip and not force:
            others = [v for b, v in self.branches(strict=False).items() if b != name] + \
                list(self.tags(strict=False).values())
            if head.version:
                others.append(head.version)
            if not reaches(others, tip, parents):
                raise RefError(f"no other branch, tag or HEAD reaches {name!r}'s tip {tip[:12]}, so gc would delete "
                               f"the versions only it holds; tag it to keep them, or delete anyway (`branch -D`)")
        return self.delete("branch", name, seen=(tip, gen))

    def _remove_empty_folders(self, key: str) -> None:
        """On a local store, the folders a deleted ``a/b`` leaves behind, which would make ``a`` unwritable."""
        root = self.store.capabilities.local_root
        if root is None:
            return
        top = os.path.join(root, (HEADS_PREFIX if key.startswith(HEADS_PREFIX) else TAGS_PREFIX).rstrip("/"))
        remove_empty_parents(os.path.dirname(os.path.join(root, key)), top)

    def tag_target(self, name: str) -> str | None:
        raw = self.store.get(TAGS_PREFIX + name, REF_MAX_BYTES)
        return ref_value(raw, TAGS_PREFIX + name)

    def branches(self, strict: bool = True) -> dict[str, str]:
        """Branch name -> version id (see :meth:`read_all`)."""
        return self.read_all("branch", strict)[0]

    def tags(self, strict: bool = True) -> dict[str, str]:
        """Tag name -> version id (see :meth:`read_all`)."""
        return self.read_all("tag", strict)[0]

    def damaged(self, kind: str | None = None) -> list[str]:
        """What is wrong with each damaged ref of ``kind`` ("branch", "tag"; None: both), one line each (what
        ``strict=False`` leaves out)."""
        return [line for k in ((kind,) if kind else ("branch", "tag")) for line in self.read_all(k, False)[1]]

    def read_all(self, kind: str, strict: bool = True) -> tuple[dict[str, str], list[str]]:
        """Every branch or tag ref (``kind``), read in one batch (one round trip on S3, not one per ref), and the
        damage found. Files whose names no ref can have (``.DS_Store``) are not refs; a ref deleted since the
        listing is left out. A damaged ref raises when ``strict`` (gc must not run past it), and is left out
        otherwise (``log`` and ``show`` name versions with the refs that can be read; ``fsck`` names the
        damage)."""
        prefix = HEADS_PREFIX if kind == "branch" else TAGS_PREFIX
        listed = self.store.list(prefix)
        keys = [k for k in listed if is_ref_name(k[len(prefix):])]
        out: dict[str, str] = {}
        damage = [f"{kind} ref {k!r} has a name ending in a newline (an older release let it through): no command "
                  f"can name it; make a branch or tag of its version under another name, then delete the file"
                  for k in listed if _legacy_name(k[len(prefix):])]
        if damage and strict:
            raise CorruptionError(damage[0])
        raws: list[bytes | None | CorruptionError]
        try:
            raws = list(self.store.get_many(keys, REF_MAX_BYTES))
        except CorruptionError:   # one is no ref at all (a FIFO, a huge file): read one by one, to name it
            raws = [_read_ref(self.store, key) for key in keys]
        for key, raw in zip(keys, raws):
            try:
                if isinstance(raw, CorruptionError):
                    raise raw
                value = ref_value(raw, key)
            except CorruptionError as err:
                if strict:
                    raise
                damage.append(str(err))
                continue
            if value is not None:
                out[key[len(prefix):]] = value
        return out, damage


def reaches(starts: Sequence[str], target: str, parents: Callable[[str], Sequence[str]]) -> bool:
    """Whether ``target`` is one of ``starts`` or an ancestor of one (``parents`` read as the walk needs them,
    and only until it is found)."""
    seen: set[str] = set()
    stack = list(starts)
    while stack:
        vid = stack.pop()
        if vid == target:
            return True
        if vid in seen:
            continue
        seen.add(vid)
        stack.extend(parents(vid))
    return False


def _read_ref(store: Store, key: str) -> bytes | None | CorruptionError:
    try:
        return store.get(key, REF_MAX_BYTES)
    except CorruptionError as err:
        return err


def head_ref_blocked(store: Store, head: Head) -> bool:
    """Whether HEAD is on a branch that reads as having no versions because something that is not a ref
    sits where its ref should be (a folder or a broken symbolic link on a local store, keys under it on an
    object store): the ref was replaced, not never created, so the branch's history would look unreachable
    and be collected."""
    if head.branch is None or head.version is not None:
        return False
    key = HEADS_PREFIX + head.branch
    path = store.capabilities.local_path(key)
    if path is not None and (os.path.isdir(path) or (os.path.islink(path) and not os.path.exists(path))):
        return True
    if path is not None and os.path.exists(path):   # a file: the ref, readable or damaged (named elsewhere)
        return False
    return bool(store.list(key + "/"))


def replaced_refs(store: Store) -> list[str]:
    """Ref keys on a local store where an empty folder or a broken symbolic link sits: a ref replaced by
    something that reads as "no ref", so the versions only it reached would look unreachable and be collected.
    (Deleting a ref removes the folders it leaves empty, so an empty one is never a name's remains. An object
    store has no folders: a key there is a ref or nothing.)"""
    out = []
    for prefix in (HEADS_PREFIX, TAGS_PREFIX):
        root = store.capabilities.local_path(prefix.rstrip("/"))
        if root is None or not os.path.isdir(root):
            continue
        for dirpath, dirnames, filenames in os.walk(root):
            rel = os.path.relpath(dirpath, root)
            here = "" if rel == "." else rel.replace(os.sep, "/") + "/"
            if not dirnames and not filenames and here:
                out.append(prefix + here.rstrip("/"))
            out.extend(prefix + here + f for f in filenames
                       if os.path.islink(os.path.join(dirpath, f)) and not os.path.exists(os.path.join(dirpath, f)))
    return sorted(out)


def head_branch_lost(branch: str, versions: int) -> str:
    """What to say of a HEAD branch whose ref ``head_ref_blocked`` found replaced, and how to restore it."""
    return (f"HEAD is on branch {branch!r}, whose ref is replaced by a folder or a broken link, and the repository "
            f"has {versions} version(s); remove it and restore the ref (`ckptrepo branch {branch} ID`, an id from "
            f"versions/), or check out another branch")


def count_versions(store: Store) -> int:
    """How many version manifests the store holds (one listing)."""
    return sum(is_version_id(k[len(VERSIONS_PREFIX):]) for k in store.list(VERSIONS_PREFIX))


def lost_head_branch(store: Store, head: Head, versions: int | None = None) -> str | None:
    """Why HEAD's branch reads as empty when it cannot be, or None: its ref is replaced (``head_ref_blocked``),
    or it does not exist while the repository has versions (``versions``; None: counted here) and HEAD is not
    an orphan checkout. A lost ref, a deleted one or a bit flip in HEAD look like this; taken for an empty
    branch, they make `log` say "no versions yet", the next snapshot start a new root, and gc collect the
    whole history."""
    if head.branch is None or head.version is not None or head.damage is not None:
        return None
    if head_ref_blocked(store, head):
        return head_branch_lost(head.branch, count_versions(store) if versions is None else versions)
    if head.orphan:
        return None
    n = count_versions(store) if versions is None else versions
    if not n:
        return None
    b = head.branch
    return (f"HEAD is on branch {b!r}, which does not exist, while the repository has {n} version(s): its ref was "
            f"lost or HEAD is damaged; check out the branch HEAD belongs on (`ckptrepo checkout BRANCH`, see "
            f"`ckptrepo branch`), restore a lost ref (`ckptrepo branch {b} ID`, ID a version fsck lists as not "
            f"reachable), or start a new history on purpose with `ckptrepo checkout --orphan {b}`")


def init_head(store: Store, branch: str = "main") -> None:
    """Point HEAD at an unborn branch; used once by ``init``."""
    store.compare_and_swap(HEAD_KEY, f"{SYMREF_PREFIX}{HEADS_PREFIX}{branch}".encode(), NO_VALUE)
