"""The storage protocol (``protocol.Store``) implemented over TensorStore's key-value stores.

A repository is a prefix in any TensorStore key-value store. This module turns
a URL into a kvstore spec and wraps the handful of operations the repository
needs: get, put, conditional put (compare-and-swap), byte-range read, list and
delete. Nothing here depends on POSIX rename, append or locks beyond what the
TensorStore driver itself does, so the same code runs on S3 and GCS. Whether a
store's keys are local files (and so open to direct I/O) is decided here, once
per store, in its capabilities.

On such a local store, the small-object operations history commands make (get, get_many, exists, list) are
plain file system calls, and TensorStore itself is imported and opened only at the first operation that
needs it (a write, a byte range, an array): ``ckptrepo log`` starts in a fraction of the time.
"""
from __future__ import annotations

import os
import posixpath
import re
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence
from urllib.parse import unquote

from ckptrepo.errors import CkptRepoError, StorageError, first_line, storage_failure_hint
from ckptrepo.storage._localfs import (
    LOCK_SUFFIX,
    ByteCounter,
    check_lock_file,
    file_size,
    look,
    read_regular,
    remove_empty_folders,
    too_big,
)
from ckptrepo.storage.protocol import MAX_VALUE_BYTES, NO_VALUE, StoreCapabilities

if TYPE_CHECKING:
    import tensorstore as ts

_memory_lock = threading.Lock()
_memory_context: ts.Context | None = None


def _shared_memory_context() -> ts.Context:
    """One context for every ``memory://`` store, so they share one in-process memory."""
    import tensorstore as ts
    global _memory_context
    with _memory_lock:
        if _memory_context is None:
            _memory_context = ts.Context()
        return _memory_context


# How often one S3 or GCS request is tried, with exponential backoff from 0.5 s up to 8 s between tries.
# TensorStore's own default (32 tries, up to 32 s apart) keeps a request to an unreachable endpoint (a
# misspelt AWS_ENDPOINT_URL, a stopped server) going for about 15 minutes, so `ckptrepo log` or a load
# seems to hang; 8 tries give up after ~40 s with the cause, while riding out a short outage or a burst
# of throttling. CKPTREPO_STORE_RETRIES sets the count; a URL's ``options`` can carry a whole
# ``s3_request_retries``/``gcs_request_retries`` object instead (it overrides this one).
DEFAULT_STORE_RETRIES = 8


def request_retries() -> dict[str, Any]:
    """The retry policy of every S3 and GCS request this process makes (see DEFAULT_STORE_RETRIES)."""
    raw = os.environ.get("CKPTREPO_STORE_RETRIES", "")
    try:
        tries = int(raw) if raw else DEFAULT_STORE_RETRIES
    except ValueError:
        raise StorageError(f"CKPTREPO_STORE_RETRIES={raw!r} is not a whole number; set a count such as "
                           f"{DEFAULT_STORE_RETRIES}, or unset it") from None
    if tries < 1:
        raise StorageError(f"CKPTREPO_STORE_RETRIES={raw!r} must be at least 1")
    return {"max_retries": tries, "initial_delay": "0.5s", "max_delay": "8s"}


# How long one S3 or GCS operation (a read, write, listing or delete, with all its retries) may take before it is
# given up: the retries and the stall detection below bound each try, not their sum, and an endpoint that
# accepts connections and never answers, or trickles a byte every few seconds, would otherwise hold a command
# for minutes. CKPTREPO_STORE_TIMEOUT sets it, in seconds. An operation that moves a known number of bytes (a
# write, a ranged read) is given that much more time at MIN_STORE_RATE, so a large shard on a slow link is not
# cut off while a trickle is still bounded by the size the reader asked for.
DEFAULT_STORE_TIMEOUT_S = 60.0
MIN_STORE_RATE = 1 << 20   # bytes per second


def store_timeout() -> float:
    """The seconds one S3 or GCS operation may take (see DEFAULT_STORE_TIMEOUT_S)."""
    raw = os.environ.get("CKPTREPO_STORE_TIMEOUT", "")
    try:
        seconds = float(raw) if raw else DEFAULT_STORE_TIMEOUT_S
    except ValueError:
        seconds = -1.0
    if not seconds > 0 or seconds == float("inf"):
        raise StorageError(f"CKPTREPO_STORE_TIMEOUT={raw!r} is not a number of seconds above 0; set one such as "
                           f"{DEFAULT_STORE_TIMEOUT_S:g}, or unset it")
    return seconds


class _TimedOut(Exception):
    """An S3 or GCS operation that did not end within the store timeout (see ``store_timeout``)."""


STALLED_REQUEST_S = 15


def _detect_stalled_requests() -> None:
    """A request that gets no byte for ``STALLED_REQUEST_S`` seconds is given up (and retried), unless the
    environment says otherwise: curl's own threshold lets an endpoint that accepts connections and never
    answers hold ``ckptrepo log`` for ~10 minutes (60 s a try). TensorStore reads these when its HTTP
    transport starts, at the first request of the process, which no S3 or GCS store has made before this."""
    os.environ.setdefault("TENSORSTORE_CURL_LOW_SPEED_TIME_SECONDS", str(STALLED_REQUEST_S))
    os.environ.setdefault("TENSORSTORE_CURL_LOW_SPEED_LIMIT_BYTES", "1")


def _local_file_path(url: str, rest: str) -> str:
    """The path of a file URL after ``file://``: ``/data/run``, or with the host ``localhost`` (RFC 8089), which
    would otherwise make the repository ``./localhost/data/run``. Another host, or none before a relative path, is
    refused: the store is this machine's file system."""
    if rest.startswith("/"):
        return rest
    host, _, path = rest.partition("/")
    if host == "localhost" and path:
        return "/" + path
    raise StorageError(f"{url!r} names host {host!r} and no path on this machine; write file:///ABSOLUTE/PATH, "
                       f"or the path itself")


def kvstore_spec_from_url(url: str, options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Return the TensorStore kvstore spec (JSON) for a repository URL.

    Accepted: a plain path or ``file://PATH`` (local directory), ``memory://NAME``,
    ``s3://BUCKET/PREFIX`` (endpoint and region from the usual AWS variables
    ``AWS_ENDPOINT_URL_S3``/``AWS_ENDPOINT_URL`` and ``AWS_REGION``/``AWS_DEFAULT_REGION``;
    credentials through the AWS default chain) and ``gs://BUCKET/PREFIX``.
    ``options`` are merged into the spec last (e.g. ``{"endpoint": ...}``).
    """
    options = dict(options or {})
    if url.startswith("file:") and not url.startswith("file://"):
        url = "file://" + url[len("file:"):]   # file:/data/run, RFC 8089's form without an authority
    if "://" not in url:
        spec: dict[str, Any] = {"driver": "file", "path": _dir(os.path.abspath(url))}
    else:
        scheme, rest = url.split("://", 1)
        if scheme == "file":   # a URL: percent-encoded (file:///data/my%20runs is /data/my runs)
            spec = {"driver": "file", "path": _dir(os.path.abspath(unquote(_local_file_path(url, rest))))}
        elif scheme == "memory":
            spec = {"driver": "memory", "path": _dir(rest) if rest else ""}
        elif scheme in ("s3", "gs"):
            bucket, _, prefix = rest.partition("/")
            if not bucket:
                raise StorageError(f"{url!r} names no bucket; use {scheme}://BUCKET/PREFIX")
            if {".", ".."} & set(prefix.split("/")):
                # object keys are not paths: reads and writes would go to the normalised key, listings would not
                # (a repository that sees none of its own versions, and an fsck that says ok)
                clean = posixpath.normpath("/" + prefix).lstrip("/")
                raise StorageError(f"{url!r}: '.' and '..' are not allowed in an object store prefix; write it "
                                   f"out: {scheme}://{bucket}/{clean}")
            spec = {"driver": "s3" if scheme == "s3" else "gcs", "bucket": bucket,
                    "path": _dir(prefix) if prefix else ""}
            if scheme == "s3":
                endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
                region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
                if endpoint:
                    spec["endpoint"] = endpoint
                if region:
                    spec["aws_region"] = region
                credentials = _aws_credentials()
                if credentials is not None:
                    spec["aws_credentials"] = credentials
        else:
            raise StorageError(f"unsupported repository URL scheme {scheme!r}; use a path, file://, memory://, s3:// or gs://")
    spec.update(options)
    return spec


def _aws_credentials() -> dict[str, Any] | None:
    """The first source of the AWS default chain that is there: the environment, then the shared credentials file
    (``aws configure``'s ``~/.aws/credentials``, profile ``AWS_PROFILE`` or default), named to TensorStore; None
    leaves TensorStore's own chain (instance roles). Its chain, built whole, logs several lines to stderr per process
    when the files are absent, and does not find the default profile in ``~/.aws/credentials`` at all."""
    if os.environ.get("AWS_ACCESS_KEY_ID") and os.environ.get("AWS_SECRET_ACCESS_KEY"):
        return {"type": "environment"}
    files = os.environ.get("AWS_SHARED_CREDENTIALS_FILE") or os.path.expanduser("~/.aws/credentials")
    profile = os.environ.get("AWS_PROFILE") or "default"
    if not _has_profile(files, profile):   # instance roles, web identity: TensorStore's chain finds them
        return None
    spec: dict[str, Any] = {"type": "profile", "profile": profile, "credentials_file": files}
    config = os.environ.get("AWS_CONFIG_FILE") or os.path.expanduser("~/.aws/config")
    # the provider fails to start without a config file to read; an empty one is what no file means
    spec["config_file"] = config if os.path.isfile(config) else os.devnull
    return spec


def _has_profile(path: str, profile: str) -> bool:
    """Whether the shared credentials file at ``path`` has a ``[profile]`` section."""
    import configparser
    parser = configparser.ConfigParser()
    try:
        parser.read(path)
    except (OSError, configparser.Error):
        return False
    return parser.has_section(profile)


def _dir(path: str) -> str:
    return path if path.endswith("/") else path + "/"


def _wrap(err: Exception, what: str) -> StorageError:
    if isinstance(err, _TimedOut):
        return StorageError(f"storage error while {what}: {err}")
    cause = first_line(err)
    return StorageError(f"storage error while {what}: {cause}{storage_failure_hint(cause)}")


_local_reads = ByteCounter()


def local_bytes_read() -> int:
    """Bytes this process has read from local stores' small objects with plain reads (see ``TensorStoreStore.get``)."""
    return _local_reads.total()


def _open_kvstore(url: str, spec: dict[str, Any]) -> "tuple[ts.Context, ts.KvStore]":
    """A TensorStore context (request limits and retries for the scheme) and the kvstore of ``spec`` in it."""
    import tensorstore as ts
    if spec["driver"] == "memory":
        context = _shared_memory_context()
    else:
        resources: dict[str, Any] = {
            "cache_pool": {"total_bytes_limit": 0},
            "file_io_concurrency": {"limit": 32},
            "s3_request_concurrency": {"limit": 32},
        }
        if spec["driver"] in ("s3", "gcs"):
            resources[f"{spec['driver']}_request_retries"] = request_retries()
            _detect_stalled_requests()
        context = ts.Context(resources)
    try:
        kv = ts.KvStore.open(spec, context=context).result()
    except Exception as err:  # noqa: BLE001 - TensorStore raises ValueError and friends
        raise _wrap(err, f"opening {url}") from err
    return context, kv


def _capabilities(spec: dict[str, Any]) -> StoreCapabilities:
    """What the store of kvstore ``spec`` offers: the one place that decides whether its keys are local files.

    Only a ``file`` spec with nothing but its path maps keys plainly onto files under
    that path for direct I/O; options such as a file_io_sync override leave I/O to TensorStore. Either way
    its files are looked at before TensorStore opens one (``file_root``): its file store blocks on a FIFO.
    """
    driver = spec.get("driver")
    if driver == "file":
        plain = not set(spec) - {"driver", "path"}
        return StoreCapabilities(local_root=spec["path"] if plain else None, reserved_suffixes=(LOCK_SUFFIX,),
                                 file_root=spec["path"])
    # the memory kvstore keeps the bytes it is handed as the value, not a copy of them; an object store's
    # conditional writes are as atomic as its server makes them, which the store check finds out
    return StoreCapabilities(keeps_written_buffers=driver == "memory",
                             atomic_conditional_writes=driver not in ("s3", "gcs"))


@dataclass
class TensorStoreStore:
    """The :class:`~ckptrepo.storage.protocol.Store` of every URL scheme, over a TensorStore kvstore.

    A store with a local root opens its kvstore at the first operation that needs TensorStore (see the module
    docstring); every other store opens it in ``open``, which reports a spec TensorStore refuses there.
    """

    url: str
    spec: dict[str, Any]
    capabilities: StoreCapabilities = field(init=False)
    _handles: "tuple[ts.Context, ts.KvStore] | None" = field(default=None, init=False, repr=False, compare=False)
    _opening: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False, compare=False)
    _timeout: float | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.capabilities = _capabilities(self.spec)
        self._timeout = store_timeout() if self.spec.get("driver") in ("s3", "gcs") else None

    def _wait(self, future: Any, nbytes: int = 0) -> Any:
        """``future``'s result, within the store timeout on S3 and GCS, plus ``nbytes`` (what the operation moves)
        at ``MIN_STORE_RATE`` (then cancelled, and ``_TimedOut``)."""
        if self._timeout is None:
            return future.result()
        timeout = self._timeout + nbytes / MIN_STORE_RATE
        try:
            return future.result(timeout=timeout)
        except TimeoutError:
            future.cancel()
            raise _TimedOut(f"no answer from {self.url} within {timeout:g} s; check the endpoint "
                            f"(AWS_ENDPOINT_URL) and the network, or set CKPTREPO_STORE_TIMEOUT to wait "
                            f"longer") from None

    @classmethod
    def open(cls, url: str, options: dict[str, Any] | None = None) -> "TensorStoreStore":
        """Open the store named by ``url``, without touching storage."""
        store = cls(url=url, spec=kvstore_spec_from_url(url, options))
        if store.capabilities.local_root is None:
            store._open()
        return store

    def _open(self) -> "tuple[ts.Context, ts.KvStore]":
        """The TensorStore context and kvstore of this store, opened once."""
        with self._opening:
            if self._handles is None:
                self._handles = _open_kvstore(self.url, self.spec)
            return self._handles

    @property
    def context(self) -> "ts.Context":
        return self._open()[0]

    @property
    def kv(self) -> "ts.KvStore":
        return self._open()[1]

    def describe(self) -> str:
        """The URL and the TensorStore driver serving it."""
        return f"{self.url} ({self.spec.get('driver')} kvstore)"

    # ---- plain objects -------------------------------------------------
    def _look(self, key: str, max_bytes: int | None = None) -> None:
        look(self.capabilities.file_path(key), key, max_bytes)

    def _before_write(self, key: str) -> None:
        """On a file store, refuse to write ``key`` past a lock file that is not a file (see check_lock_file)."""
        path = self.capabilities.file_path(key)
        if path is not None:
            check_lock_file(path, key)

    def get(self, key: str, max_bytes: int = MAX_VALUE_BYTES) -> bytes | None:
        """The value at ``key``, or None when absent; over ``max_bytes``, CorruptionError.

        On a store with a local root a plain key is read with one ``open``: TensorStore's first read in a
        process starts its I/O threads, which a load that reads its data through the direct path
        (localread) would otherwise pay for two small objects (HEAD, the ref). Only a regular file is read,
        and no more of it than ``max_bytes`` and one byte; where no file holds the key (absent, a folder, a
        broken link) the value is absent, as TensorStore reads it. A failure to open it goes through
        TensorStore, which reports it.
        """
        return self._get(key, max_bytes)

    def _get(self, key: str, max_bytes: int) -> bytes | None:
        path = self.capabilities.local_path(key)
        if path is not None:
            try:
                data = read_regular(path, key, max_bytes)
            except OSError:
                pass
            else:
                if data is not None:
                    _local_reads.add(len(data))
                return data
        value, _ = self.get_with_generation(key, max_bytes)
        return value

    def get_range(self, key: str, offset: int, length: int) -> bytes | None:
        """Up to ``length`` bytes of the value at ``key`` from ``offset`` (fewer at its end), None when absent.

        TensorStore refuses a byte range that runs past the value's end; such a
        read is retried as "from ``offset`` to the end", which is then shorter than
        ``length``, or empty when ``offset`` itself is past the end.
        """
        if offset < 0 or length < 0:
            raise ValueError(f"a byte range needs a non-negative offset and length, not {offset}, {length}")
        self._look(key)
        r, size = self._read_range(key, offset, offset + length)
        if r is None and size is not None and offset >= size:
            return b""   # the refusal said how long the value is: nothing from offset on, and no second request
        if r is None:   # the range runs past the value's end
            r, _ = self._read_range(key, offset, size)
            if r is None:   # so does its start
                return b"" if self.exists(key) else None
        return bytes(r.value) if r.state == "value" else None

    def _read_range(self, key: str, start: int, stop: int | None) -> tuple[Any, int | None]:
        """TensorStore's read result for bytes ``[start, stop)`` of ``key``; None when the value is shorter, with
        the value's size where TensorStore's refusal names it."""
        try:
            nbytes = 0 if stop is None else max(0, stop - start)
            return self._wait(self.kv.read(key, byte_range=slice(start, stop)), nbytes), None
        except Exception as err:  # noqa: BLE001
            if isinstance(err, ValueError) and str(err).startswith("OUT_OF_RANGE"):
                found = _REFUSED_SIZE.search(str(err))
                return None, int(found.group(1)) if found else None
            raise _wrap(err, f"reading {key}") from err

    def get_many(self, keys: Sequence[str], max_bytes: int = MAX_VALUE_BYTES) -> list[bytes | None]:
        """The values at ``keys`` (None where absent), all requested at once: on S3 or GCS one round trip's
        latency instead of one per key. Each is bounded by ``max_bytes``: on a file store before it is read,
        elsewhere once it is (TensorStore tells no size first). A local store reads each with one ``open``, as
        ``get`` does: a few microseconds each, where a TensorStore read costs tens."""
        if self.capabilities.local_root is not None:
            return [self._get(key, max_bytes) for key in keys]
        for key in keys:
            self._look(key, max_bytes)
        futures = [self.kv.read(key) for key in keys]
        out: list[bytes | None] = []
        for key, fut in zip(keys, futures):
            try:
                r = self._wait(fut)
            except Exception as err:  # noqa: BLE001
                raise _wrap(err, f"reading {key}") from err
            out.append(_bounded(key, r, max_bytes))
        return out

    def get_with_generation(self, key: str, max_bytes: int = MAX_VALUE_BYTES) -> tuple[bytes | None, bytes]:
        """The value (bounded as in ``get_many``) and its storage generation (the token for compare-and-swap)."""
        self._look(key, max_bytes)
        try:
            r = self._wait(self.kv.read(key))
        except Exception as err:  # noqa: BLE001
            raise _wrap(err, f"reading {key}") from err
        value = _bounded(key, r, max_bytes)
        return (None, NO_VALUE) if value is None else (value, r.stamp.generation)

    def put(self, key: str, value: bytes) -> None:
        """Write ``value`` durably (to the extent the driver guarantees)."""
        self._before_write(key)
        try:
            self._wait(self.kv.write(key, value), len(value))
        except Exception as err:  # noqa: BLE001
            raise _wrap(err, f"writing {key}") from err

    def compare_and_swap(self, key: str, value: bytes | None, expected_generation: bytes) -> bytes | None:
        """Write (or delete, with None) only if ``key`` is still at ``expected_generation``.

        ``NO_VALUE`` as the expected generation means "only if absent". Returns
        the new generation when the write happened, None when the condition failed.
        On a file store the present value is looked at first: TensorStore reads it to compare.
        """
        self._look(key)
        self._before_write(key)
        try:
            stamp = self._wait(self.kv.write(key, value, if_equal=expected_generation), len(value or b""))
        except Exception as err:  # noqa: BLE001
            raise _wrap(err, f"writing {key}") from err
        return stamp.generation or None

    def put_if_absent(self, key: str, value: bytes) -> bool:
        """Create ``key`` unless it exists; returns whether this call created it."""
        return self.compare_and_swap(key, value, NO_VALUE) is not None

    def exists(self, key: str) -> bool:
        """Whether ``key`` holds a value; on a file store, a FIFO, socket or device there counts without being
        opened (it is something in the value's place, which reading it reports as damage). On a local root, a
        plain key with no file (absent, a folder, a broken link) is absent without asking TensorStore."""
        path = self.capabilities.file_path(key)
        if path is not None:
            try:
                size = file_size(path, key)
            except CkptRepoError:
                return True
            except OSError:
                pass
            else:
                if size is not None or self.capabilities.local_path(key) is not None:
                    return size is not None
        try:
            r = self._wait(self.kv.read(key, byte_range=slice(0, 0)))
        except Exception as err:  # noqa: BLE001
            raise _wrap(err, f"reading {key}") from err
        return r.state == "value"

    def list(self, prefix: str = "") -> list[str]:
        """Every key under ``prefix`` (relative to the repository root), sorted; the file driver's lock files
        are left out. On a local root, the folders are read directly (see ``_list_files``)."""
        root = self.capabilities.local_root
        if root is not None:
            try:
                return _list_files(root, prefix, self.capabilities.reserved_suffixes)
            except OSError as err:
                raise _wrap(err, f"listing {prefix or '/'}") from err
        import tensorstore as ts
        try:
            if prefix:
                rng = ts.KvStore.KeyRange(inclusive_min=prefix.encode(), exclusive_max=_prefix_end(prefix))
                keys = self._wait(self.kv.list(rng))
            else:
                keys = self._wait(self.kv.list())
        except Exception as err:  # noqa: BLE001
            raise _wrap(err, f"listing {prefix or '/'}") from err
        reserved = tuple(s.encode() for s in self.capabilities.reserved_suffixes)
        return sorted(k.decode() for k in keys if not k.endswith(reserved))

    def delete(self, key: str) -> None:
        """Delete ``key`` (no error when absent)."""
        self._before_write(key)
        try:
            self._wait(self.kv.write(key, None))
        except Exception as err:  # noqa: BLE001
            raise _wrap(err, f"deleting {key}") from err

    def delete_prefix(self, prefix: str) -> None:
        """Delete every key under ``prefix``; on a local store also the folders that leaves empty (up to the
        prefix's top-level folder, which stays): gc would otherwise leave a tree of empty folders per version."""
        import tensorstore as ts
        try:
            self._wait(self.kv.delete_range(ts.KvStore.KeyRange(inclusive_min=prefix.encode(),
                                                                exclusive_max=_prefix_end(prefix))))
        except Exception as err:  # noqa: BLE001
            raise _wrap(err, f"deleting {prefix}") from err
        root = self.capabilities.local_root
        if root is not None and "/" in prefix.rstrip("/"):
            remove_empty_folders(root, prefix)

    def child_spec(self, key_prefix: str) -> dict[str, Any]:
        """The kvstore spec for a sub-directory, for TensorStore drivers such as zarr3."""
        spec = dict(self.spec)
        spec["path"] = spec.get("path", "") + _dir(key_prefix)
        return spec


def _list_files(root: str, prefix: str, reserved: tuple[str, ...]) -> list[str]:
    """The keys under ``prefix`` of the local store at ``root``, sorted, as TensorStore's file kvstore lists them:
    every entry that is not a folder (a symbolic link, even to a folder, is a key and is not followed; a FIFO
    is a key too, which reading then reports), empty folders none, ``reserved`` endings (lock files) left out.
    Only the folders that can hold such keys are read."""
    head = prefix.rpartition("/")[0]
    keys: list[str] = []
    folders = [(os.path.join(root, head) if head else root, head + "/" if head else "")]
    while folders:
        folder, above = folders.pop()
        try:
            with os.scandir(folder) as it:
                entries = list(it)
        except (FileNotFoundError, NotADirectoryError):
            continue
        for entry in entries:
            key = above + entry.name
            if entry.is_dir(follow_symlinks=False):
                if (key + "/").startswith(prefix) or prefix.startswith(key + "/"):
                    folders.append((entry.path, key + "/"))
            elif key.startswith(prefix) and not key.endswith(reserved):
                keys.append(key)
    return sorted(keys)


# how TensorStore's refusal of a byte range past a value's end names the value's size (S3's own error body
# carries it as ActualObjectSize)
_REFUSED_SIZE = re.compile(r"(?:value of size |total size |ActualObjectSize>)(\d+)")


def _bounded(key: str, r: Any, max_bytes: int) -> bytes | None:
    """A TensorStore read result's value, None when absent; one over ``max_bytes`` raises CorruptionError."""
    if r.state != "value":
        return None
    if len(r.value) > max_bytes:
        raise too_big(key, len(r.value), max_bytes)
    return bytes(r.value)


def _prefix_end(prefix: str) -> bytes:
    """The smallest key greater than every key that starts with ``prefix``, as bytes: TensorStore orders keys by
    their UTF-8 bytes, and a string made of those bytes would be encoded again."""
    b = prefix.encode()
    while b and b[-1] == 0xFF:
        b = b[:-1]
    if not b:
        return b""
    return b[:-1] + bytes([b[-1] + 1])
