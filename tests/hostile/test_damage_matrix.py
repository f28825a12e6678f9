"""Every kind of repository object, damaged every way, under every command (issue 27, "Tests and figures").

For each case (see ``_matrix.cases``) a copy of a small repository is damaged and ``log``, ``show HEAD``,
``fsck``, ``load("HEAD")``, ``gc`` and ``gc --grace 0`` run on it, each in a child process with a timeout. Each
case asserts:

- no run hangs, dies of a signal, or shows a traceback or Python's own exception text;
- ``load`` either fails with ckptrepo's error or returns the tip's state, bit for bit;
- the read-only commands (log, show, fsck, load) change nothing;
- gc deletes nothing but the damaged object (``Case.gc_may_collect`` says where it may still collect what it
  collects from the intact repository);
- fsck exits non-zero, except where the damage is harmless by design (``Case.harmless`` says which and why).

``python -m tests.hostile.tally`` runs the same matrix and prints the counts per outcome.
"""
from __future__ import annotations

import pytest

from hostile import _matrix as matrix

pytestmark = pytest.mark.hostile

CASES = matrix.cases()


@pytest.mark.slow   # the whole matrix: about a minute on two cores
@pytest.mark.parametrize("case", [c.id for c in CASES])
def test_damaged_repository(case: str, matrix_results: dict[str, matrix.CaseResult]) -> None:
    result = matrix_results[case]
    if result.problems():
        pytest.fail(result.report(), pytrace=False)


def test_matrix_covers_every_kind_and_damage() -> None:
    """Every object kind takes every damage but the combinations ``cases()`` documents as meaningless, and each
    manifest takes every re-sealing."""
    ids = {c.id for c in CASES}
    assert len(ids) == len(CASES)
    skipped = {f"{k}/swap" for k in ("HEAD", "config", "branch", "tag", "pruned_marker")} | {"pruned_marker/truncate"}
    for kind in matrix.KINDS:
        for damage in matrix.BASIC_DAMAGE:
            assert (f"{kind}/{damage}" in ids) != (f"{kind}/{damage}" in skipped), f"{kind}/{damage}"
    for kind in matrix.MANIFESTS:
        assert {f"{kind}/reseal_{r}" for r in matrix.RESEALS} <= ids


@pytest.mark.parametrize("text,leak", [
    ("ckptrepo: error: HEAD is missing; run `ckptrepo init --exist-ok`", None),
    ("ckptrepo: error: MemoryError:  (set CKPTREPO_DEBUG=1 for a traceback)", "MemoryError"),
    ("Traceback (most recent call last):\n  File ...", "Traceback (most recent call last)"),
    ("ckptrepo: error: 'int' object is not subscriptable", "object is not subscriptable"),
    ("warning: snapshot 1234 failed and was not committed", None),
])
def test_leak_detection(text: str, leak: str | None) -> None:
    """What counts as Python's own error text, and what is ckptrepo's own one-line message."""
    assert matrix.leaked(text) == leak
