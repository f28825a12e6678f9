"""Storage keys, the sealed-object encoding, version ids, and the repository config.

A version manifest is msgpack followed by a 4-byte little-endian crc32c of the
msgpack bytes, so a flipped byte is detected before anything is decoded
(``seal``/``unseal``; the manifest's records and its encoder and decoder are in
core/schema.py). Refs are tiny text objects: a version id, or
``ref: refs/heads/NAME`` for HEAD.
"""
from __future__ import annotations

import json
import operator
import os
import struct
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Mapping

import msgpack
import numpy as np

from ckptrepo.errors import CorruptionError, FormatVersionError, UnsupportedValueError
from ckptrepo.storage._crc import crc32c

FORMAT_VERSION = 1
CONFIG_KEY = "ckptrepo.json"
HEAD_KEY = "HEAD"
HEADS_PREFIX = "refs/heads/"
TAGS_PREFIX = "refs/tags/"
VERSIONS_PREFIX = "versions/"
DATA_PREFIX = "data/"
STAGING_PREFIX = "staging/"   # rank manifests of a distributed snapshot until rank 0 commits it
FAILURES_PREFIX = "failures/"   # a record per background snapshot that failed (log --all, fsck)
PRUNED_PREFIX = "pruned/"   # an empty marker per version whose data gc deleted (its manifest stays)
SYMREF_PREFIX = "ref: "


def new_version_id() -> str:
    """A fresh 32-hex-digit id: 80 random bits, then the creation time in milliseconds (48 bits).

    Random first, so that, as in git, a short prefix names a version uniquely
    in practice; the time last, so that garbage collection can tell the age of
    objects an interrupted or in-flight snapshot left without a manifest.
    """
    return f"{os.urandom(10).hex()}{int(time.time() * 1000) & ((1 << 48) - 1):012x}"


def is_version_id(name: str) -> bool:
    """Whether ``name`` is a version id (32 lower-case hex digits): what a listing of ``versions/`` or ``data/``
    keeps, so that a stray file there (an editor's backup, a Finder ``.DS_Store``) is not read as a version."""
    return len(name) == 32 and all(c in "0123456789abcdef" for c in name)


def version_id_time(vid: str) -> float | None:
    """The creation time (unix seconds) encoded in a version id, or None if it is not an id."""
    if len(vid) != 32:
        return None
    try:
        return int(vid[20:], 16) / 1000.0
    except ValueError:
        return None


def msgpack_int(v: int) -> bool:
    """Whether msgpack (the manifest's encoding) stores ``v`` as an integer: int64 through uint64."""
    return -(1 << 63) <= v < (1 << 64)


def seal(payload: dict[str, Any]) -> bytes:
    """msgpack ``payload`` and append its crc32c."""
    body = msgpack.packb(payload, use_bin_type=True)
    return body + struct.pack("<I", crc32c(body))


def unseal(blob: bytes, what: str) -> dict[str, Any]:
    """Check the crc32c trailer of ``blob`` and decode it; ``what`` names it in errors."""
    body = _checked_body(blob, what)
    try:
        return msgpack.unpackb(body, raw=False, strict_map_key=False)
    except Exception as err:  # noqa: BLE001
        raise CorruptionError(f"{what} cannot be decoded: {err}") from err


# The bulky parts of a version manifest: everything `log` and revision walks do not need.
BULKY_FIELDS = frozenset({"arrays", "tensors", "tree", "layout"})


def unseal_header(blob: bytes, what: str) -> dict[str, Any]:
    """Like ``unseal`` for a version manifest, but only its small top-level fields (id, parents, step, time,
    message, metrics, size, stats, ...): the bulky ones are skipped by the parser, never built.

    Why: ``log`` of a long run reads every version's header, and building the objects
    of a manifest with hundreds of tensors for each of them would be most of its time.
    """
    body = _checked_body(blob, what)
    try:
        unpacker = msgpack.Unpacker(raw=False, strict_map_key=False, max_buffer_size=len(body))
        unpacker.feed(body)
        header = {}
        for _ in range(unpacker.read_map_header()):
            key = unpacker.unpack()
            if key in BULKY_FIELDS:
                unpacker.skip()
            else:
                header[key] = unpacker.unpack()
        return header
    except Exception as err:  # noqa: BLE001
        raise CorruptionError(f"{what} cannot be decoded: {err}") from err


def _checked_body(blob: bytes, what: str) -> bytes:
    if len(blob) < 5:
        raise CorruptionError(f"{what} is truncated ({len(blob)} bytes); run `ckptrepo fsck`")
    body, (stored,) = blob[:-4], struct.unpack("<I", blob[-4:])
    if crc32c(body) != stored:
        raise CorruptionError(f"{what} failed its crc32c check (the object is corrupt); run `ckptrepo fsck`")
    return body


@dataclass(frozen=True)
class Version:
    """One immutable snapshot as listed by ``log``: no tensor data, just the header."""

    id: str
    parents: tuple[str, ...]
    step: int | None
    time: float
    message: str
    metrics: dict[str, Any]
    size: int
    refs: tuple[str, ...] = field(default=(), compare=False)
    pruned: bool = field(default=False, compare=False)   # gc deleted its data; the manifest remains

    @property
    def short_id(self) -> str:
        return self.id[:12]

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "parents": list(self.parents), "step": self.step, "time": self.time,
                "message": self.message, "metrics": self.metrics, "size": self.size, "refs": list(self.refs),
                "pruned": self.pruned}


def encode_config(settings: dict[str, Any]) -> bytes:
    return json.dumps({"format": "ckptrepo", "format_version": FORMAT_VERSION, **settings}, indent=2).encode()


def decode_config(blob: bytes, url: str) -> dict[str, Any]:
    try:
        cfg = json.loads(blob)
    except ValueError as err:
        raise CorruptionError(f"{url}: {CONFIG_KEY} is not valid JSON ({err}); the repository config is "
                              f"damaged") from err
    version = cfg.get("format_version") if isinstance(cfg, dict) else None
    if version is None or cfg.get("format") != "ckptrepo" or not isinstance(version, int):
        raise CorruptionError(f"{url}: {CONFIG_KEY} is not a ckptrepo config")
    if version > FORMAT_VERSION:
        raise FormatVersionError(
            f"{url} uses repository format {version}, but this ckptrepo reads format {FORMAT_VERSION} at most; "
            f"upgrade ckptrepo (pip install -U ckptrepo)")
    if version < 1:
        raise FormatVersionError(f"{url} uses unknown repository format {version}")
    return cfg


def _is_tensor(v: Any) -> bool:
    """Whether ``v`` is a torch tensor, without importing torch (history commands never need it)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(v, torch.Tensor)


def plain_metrics(metrics: Any) -> dict[str, Any]:
    """Metrics are stored as plain numbers and strings (tensors and numpy scalars converted); anything else is
    refused here, at ``snapshot()``, not when the manifest is written in the background."""
    if metrics is None:
        return {}
    if not isinstance(metrics, Mapping):
        raise UnsupportedValueError(f"metrics must be a dict of numbers and strings, not {type(metrics).__name__}")
    out = {}
    for k, v in metrics.items():
        if _is_tensor(v) and v.numel() != 1:   # .item() would raise a bare RuntimeError
            raise UnsupportedValueError(f"metric {k!r} is a tensor of {v.numel()} elements, not one number; pass "
                                        f"one (e.g. loss.item() or loss.mean())")
        if isinstance(v, np.generic) or _is_tensor(v):
            v = v.item()
        if not isinstance(v, (int, float, str, bool)) and v is not None:
            raise UnsupportedValueError(f"metric {k!r} must be a number or string, not {type(v).__name__}")
        if isinstance(v, int) and not msgpack_int(v):
            raise UnsupportedValueError(f"metric {k!r} = {v} does not fit in 64 bits; store it as a float or a string")
        out[_text(str(k), f"metric name {k!r}")] = _text(v, f"metric {k!r}") if isinstance(v, str) else v
    return out


def checked_step(step: Any) -> int | None:
    """``step`` as an int (numpy ints too) that fits the manifest's 64 bits, or None; a float, string or bool
    is refused (1.7 would become 1, and 2**64 would kill the background commit)."""
    if step is None:
        return None
    if isinstance(step, bool) or not hasattr(step, "__index__"):
        raise UnsupportedValueError(f"step must be an int or None, not {type(step).__name__} {step!r}")
    step = operator.index(step)
    if not -(1 << 63) <= step < (1 << 63):
        raise UnsupportedValueError(f"step {step} does not fit in 64 bits")
    return step


def checked_message(message: Any) -> str:
    """The commit message: text (``None`` is empty). Another type, once committed, breaks `ckptrepo log` for good."""
    if message is None:
        return ""
    if not isinstance(message, str):
        raise UnsupportedValueError(f"message must be a str, not {type(message).__name__}")
    return _text(message, "message")


def _text(value: str, what: str) -> str:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as err:
        raise UnsupportedValueError(f"{what} is not valid text ({err.reason} at position {err.start})") from None
    return value
