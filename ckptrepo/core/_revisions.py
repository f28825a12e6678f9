"""Revision syntax: what a user may type to name a version.

``HEAD``, a branch, a tag, a full id or a unique id prefix (4+ hex digits),
``@STEP`` (the newest version with that step on the current branch whose data gc kept; the newest with that
step when gc pruned them all), each optionally followed by ``~N`` (N first-parent generations back; ``~`` is
``~1``). A step saved twice on one line (a resumed run) names the newer version, unless retention pruned it
and kept the older: a user asking for ``@1000`` wants the step's state, which only the kept one still holds.

A revision is at most ``MAX_REVISION_CHARS`` long, parsed in one pass, and a
walk back that meets a version twice (a parent cycle, which only damaged
manifests can make) stops with a CorruptionError instead of going round.
"""
from __future__ import annotations

import re
from typing import Protocol

from ckptrepo.core._manifest_reads import first_parent_chain
from ckptrepo.core._refs import is_ref_name
from ckptrepo.errors import RevisionError

_HEX_RE = re.compile(r"[0-9a-f]{4,32}")
_DIGITS = frozenset("0123456789")
# far beyond any name or id a user types (a ref name plus a few ~N), and short enough that no revision costs
# more than a moment to read; a longer one is refused, not parsed
MAX_REVISION_CHARS = 1024


class RevisionSource(Protocol):
    def head_version(self) -> str | None: ...
    def head_description(self) -> str: ...
    def branch_tip(self, name: str) -> str | None: ...
    def tag_target(self, name: str) -> str | None: ...
    def ids_with_prefix(self, prefix: str) -> list[str]: ...
    def first_parent(self, version: str) -> str | None: ...
    def step_of(self, version: str) -> int | None: ...
    def is_pruned(self, version: str) -> bool: ...


def parse(rev: str) -> tuple[str, int]:
    """Split ``rev`` into its base and how many first-parent steps back to go.

    One pass from the end over the ``~N`` suffix: each ``~`` with the digits after it, as long as a non-empty
    base stays in front (a regular expression with a lazy base backtracked quadratically on a long
    ``HEAD~1~1...x``).
    """
    if not isinstance(rev, str):
        raise RevisionError(f"a revision is text (HEAD, a branch, a tag, an id, @STEP, REV~N), not {rev!r}")
    if len(rev) > MAX_REVISION_CHARS:
        raise RevisionError(f"revision of {len(rev)} characters is too long (at most {MAX_REVISION_CHARS}); "
                            f"name a branch, a tag or an id, with ~N to go back N versions")
    rev = rev.strip()
    if not rev:
        raise RevisionError(f"empty or malformed revision {rev!r}; use HEAD, a branch, a tag, an id, @STEP, or REV~N")
    start, back = len(rev), 0
    while True:
        i = start
        while i > 0 and rev[i - 1] in _DIGITS:
            i -= 1
        if i < 2 or rev[i - 1] != "~":   # no '~' before the digits, or nothing left in front of it
            break
        back += int(rev[i:start]) if i < start else 1
        start = i - 1
    return rev[:start], back


def resolve(src: RevisionSource, rev: str) -> str:
    """The full version id ``rev`` names; RevisionError saying why when it names none or several."""
    base, back = parse(rev)
    ancestors = -1
    for ancestors, vid in enumerate(first_parent_chain(_resolve_base(src, base, rev), src.first_parent)):
        if ancestors == back:
            return vid
    what = f"name {base}" if ancestors == 0 else f"name one of {base} to {base}~{ancestors}"
    raise RevisionError(f"{rev!r} goes back {back} versions but {base!r} has only {ancestors} ancestors "
                        f"({ancestors + 1} version{'s' if ancestors else ''} in its history): {what}, or see "
                        f"`ckptrepo log`")


def _resolve_base(src: RevisionSource, base: str, rev: str) -> str:
    if base == "HEAD":
        vid = src.head_version()
        if vid is None:
            raise RevisionError(f"HEAD ({src.head_description()}) has no versions yet; take a snapshot first")
        return vid
    if base.startswith("@"):
        try:
            step = int(base[1:])
        except ValueError:
            raise RevisionError(f"{rev!r}: after '@' comes a step number, e.g. @1000") from None
        pruned: str | None = None   # the newest match gc pruned: named only where no kept one has the step
        for vid in first_parent_chain(src.head_version(), src.first_parent):
            if src.step_of(vid) == step:
                if not src.is_pruned(vid):
                    return vid
                pruned = pruned or vid
        if pruned is not None:
            return pruned
        raise RevisionError(f"no version with step {step} on {src.head_description()}; see `ckptrepo log`")
    if is_ref_name(base):   # `main/` or `../tags/v1` is no ref: looked up, it would be a raw storage error
        tip = src.branch_tip(base)
        if tip is not None:
            return tip
        target = src.tag_target(base)
        if target is not None:
            return target
    if _HEX_RE.fullmatch(base.lower()):   # ids are lower case; git takes an upper-case prefix too
        matches = src.ids_with_prefix(base.lower())
        if len(matches) == 1:
            return matches[0]
        if len(matches) > 1:
            raise RevisionError(f"revision {base!r} is ambiguous: {len(matches)} versions start with it "
                                f"({', '.join(m[:12] for m in matches[:3])}…); type more digits")
    if src.head_version() is None and src.head_description() == f"branch {base!r}":
        raise RevisionError(f"branch {base!r} has no versions yet; take a snapshot first")
    short = " (an id prefix needs at least 4 digits)" if re.fullmatch(r"[0-9a-fA-F]{1,3}", base) else ""
    raise RevisionError(f"unknown revision {rev!r}{short}: not a branch, tag, version id or @STEP; "
                        f"see `ckptrepo log`")

