"""Storage keys, the sealed-object encoding, version ids, and the repository config.

A version manifest is msgpack followed by a 4-byte little-endian crc32c of the
msgpack bytes, so a flipped byte is detected before anything is decoded
(``seal``/``unseal``; the manifest's records and its encoder and decoder are in
core/schema.py). Refs are tiny text objects: a version id, or
``ref: refs/heads/NAME`` for HEAD.
"""
from __future__ import annotations

import json
import os
import struct
import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping

import msgpack

from ckptrepo.arguments import utf8_text
from ckptrepo.errors import (
    ArgumentError,
    ConflictError,
    CorruptionError,
    FormatVersionError,
    NotARepositoryError,
    UnsupportedValueError,
    first_line,
)
from ckptrepo.storage import crc32c

if TYPE_CHECKING:
    from ckptrepo.storage.protocol import Store

FORMAT_VERSION = 2
CONFIG_KEY = "ckptrepo.json"
COMPRESSION_SETTING = "compression"   # ckptrepo.json: the arrays' compression, set at init (absent: none)
HEAD_KEY = "HEAD"
HEADS_PREFIX = "refs/heads/"
TAGS_PREFIX = "refs/tags/"
VERSIONS_PREFIX = "versions/"
DATA_PREFIX = "data/"
STAGING_PREFIX = "staging/"   # rank manifests of a distributed snapshot until rank 0 commits it
FAILURES_PREFIX = "failures/"   # a record per background snapshot that failed (log --all, fsck)
LOST_PREFIX = "lost/"   # an empty marker per version whose manifest a gc collected while a ref came to name it
PRUNED_PREFIX = "pruned/"   # an empty marker per version whose data gc deleted (its manifest stays)
# while `prune` deletes one version's data: the arrays it is about to delete, so that a commit reusing one of
# them (dedup) fails instead of landing on deleted bytes (maintenance/_gc.py prune_version, saving/_dedup.py)
PRUNING_PREFIX = "pruning/"
PRUNING_STALE_S = 3600.0   # an intent older than this is a prune that died midway: ignored, and gc deletes it
SYMREF_PREFIX = "ref: "

# The most bytes a reader takes of an object it reads whole (docs/format.md, "Size limits"); a bigger one is
# damage, refused before it is read. A ref holds a version id or "ref: refs/heads/<name>", and no store keeps
# a key (so a branch name) of more than 4096 bytes; the config holds a handful of settings. Manifests, failure
# records and a distributed snapshot's staged parts are bounded by Store.get's default, MAX_VALUE_BYTES.
REF_MAX_BYTES = 8 << 10
CONFIG_MAX_BYTES = 64 << 10


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
BULKY_FIELDS = frozenset({"arrays", "tensors", "tree", "layout", "tensor_stats"})


def unseal_header(blob: bytes, what: str, also: frozenset[str] = frozenset()) -> dict[str, Any]:
    """Like ``unseal`` for a version manifest, but only its small top-level fields (id, parents, step, time,
    message, metrics, size, stats, ...) and the bulky ones named in ``also``: the others are skipped by the
    parser, never built.

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
            if key in BULKY_FIELDS and key not in also:
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
    # local-durable: its data is in this repository (not pruned, not evicted to a remote after a push or a lazy
    # clone); remotes: those holding it, as far as their remote-tracking refs say (remote-durable)
    local: bool = field(default=True, compare=False)
    remotes: tuple[str, ...] = field(default=(), compare=False)
    meta: dict[str, str] = field(default_factory=dict)   # free text recorded with the snapshot (``snapshot(meta=)``)

    @property
    def short_id(self) -> str:
        return self.id[:12]

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "parents": list(self.parents), "step": self.step, "time": self.time,
                "message": self.message, "metrics": self.metrics, "size": self.size, "refs": list(self.refs),
                "pruned": self.pruned, "local": self.local, "remotes": list(self.remotes),
                "meta": self.meta}


def encode_config(settings: dict[str, Any]) -> bytes:
    return json.dumps({"format": "ckptrepo", "format_version": FORMAT_VERSION, **settings}, indent=2).encode()


REPAIR_HINT = "; rebuild it with `ckptrepo fsck --repair-config`"


def decode_config(blob: bytes, url: str) -> dict[str, Any]:
    try:
        cfg = json.loads(blob)
    except ValueError as err:
        raise CorruptionError(f"{url}: {CONFIG_KEY} is not valid JSON ({first_line(err)}); the repository config is "
                              f"damaged{REPAIR_HINT}") from err
    version = cfg.get("format_version") if isinstance(cfg, dict) else None
    if version is None or cfg.get("format") != "ckptrepo" or not isinstance(version, int):
        raise CorruptionError(f"{url}: {CONFIG_KEY} is not a ckptrepo config{REPAIR_HINT}")
    if version > FORMAT_VERSION:
        raise FormatVersionError(
            f"{url} uses repository format {version}, but this ckptrepo reads format {FORMAT_VERSION} at most; "
            f"upgrade ckptrepo (pip install -U ckptrepo)")
    if version < 1:
        raise FormatVersionError(f"{url} uses unknown repository format {version}{REPAIR_HINT}")
    return cfg


def read_config(store: Store) -> bytes | None:
    """``ckptrepo.json``'s bytes (None when absent); one that cannot be read (over ``CONFIG_MAX_BYTES``, not a
    file) is damage that ``fsck --repair-config`` rebuilds, which the error says."""
    try:
        return store.get(CONFIG_KEY, CONFIG_MAX_BYTES)
    except CorruptionError as err:
        raise CorruptionError(f"{store.url}: {CONFIG_KEY} cannot be read ({first_line(err).split(';')[0]})"
                              f"{REPAIR_HINT}") from err


def encode_config_bounded(cfg: dict[str, Any], url: str) -> bytes:
    """``cfg`` as ``ckptrepo.json`` holds it, refused when over ``CONFIG_MAX_BYTES``: a config no reader takes
    would lock every command out of the repository."""
    blob = json.dumps(cfg, indent=2).encode()
    if len(blob) > CONFIG_MAX_BYTES:
        raise ArgumentError(f"{url}: this change would make {CONFIG_KEY} {len(blob)} bytes, more than the "
                            f"{CONFIG_MAX_BYTES} a config may hold; nothing was changed")
    return blob


def update_config(store: Store, changes: dict[str, Any], attempts: int = 8,
                  settled: Callable[[dict[str, Any]], bool] | None = None) -> dict[str, Any]:
    """Set ``changes`` in ``ckptrepo.json`` by compare-and-swap, keeping every other setting, and return the
    config as written. The config is written at init and changed only this way, for settings the repository
    learns later (a store check's verdict, its identity): two writers adding different settings both land."""
    for _ in range(attempts):
        try:
            raw, gen = store.get_with_generation(CONFIG_KEY, CONFIG_MAX_BYTES)
        except CorruptionError as err:
            raise CorruptionError(f"{store.url}: {CONFIG_KEY} cannot be read ({first_line(err).split(';')[0]})"
                                  f"{REPAIR_HINT}") from err
        if raw is None:
            raise NotARepositoryError(f"{store.url} is not a ckptrepo repository (no {CONFIG_KEY}); create one "
                                      f"with `ckptrepo init {store.url}`")
        cfg = decode_config(raw, store.url)
        if all(cfg.get(k) == v for k, v in changes.items()) or (settled is not None and settled(cfg)):
            return cfg   # as asked, or as good (``settled``: another writer recorded the same fact its own way)
        cfg.update(changes)
        if store.compare_and_swap(CONFIG_KEY, encode_config_bounded(cfg, store.url), gen) is not None:
            return cfg
    raise ConflictError(f"{store.url}: {CONFIG_KEY} kept changing while it was being updated; run the command again")


def _is_tensor(v: Any) -> bool:
    """Whether ``v`` is a torch tensor, without importing torch (history commands never need it)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(v, torch.Tensor)


def _is_numpy_scalar(v: Any) -> bool:
    """Whether ``v`` is a numpy scalar, without importing numpy (a value of one exists only once it is loaded)."""
    np = sys.modules.get("numpy")
    return np is not None and isinstance(v, np.generic)


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
        if _is_numpy_scalar(v) or _is_tensor(v):
            v = v.item()
        if not isinstance(v, (int, float, str, bool)) and v is not None:
            raise UnsupportedValueError(f"metric {k!r} must be a number or string, not {type(v).__name__}")
        if isinstance(v, int) and not msgpack_int(v):
            raise UnsupportedValueError(f"metric {k!r} = {v} does not fit in 64 bits; store it as a float or a string")
        out[utf8_text(str(k), f"metric name {k!r}")] = utf8_text(v, f"metric {k!r}") if isinstance(v, str) else v
    return out
