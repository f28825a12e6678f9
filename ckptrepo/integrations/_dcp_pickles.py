"""The bytes of a value DCP pickled, made safe for ``dcp.load`` to unpickle.

DCP's load planners hand every byte item to ``torch.load(weights_only=False)``: full unpickling, which runs
whatever callable the bytes name. A repository is data from wherever it came from, so without the caller's
trust a ``<path>@dcp-pickle`` item is first read with torch's restricted unpickler (``weights_only=True``,
PyTorch's own default for ``torch.load``), which builds only containers, tensors, torch types, the types the
user allowed with ``torch.serialization.add_safe_globals``, and the few types below that DCP states hold;
what it built is then saved again, and only those bytes reach the planner. Bytes that name anything else
are refused with ``TrustRequiredError`` (see docs/decisions/044-untrusted-framework-data.md).
"""
from __future__ import annotations

import io
import pickle
import pickletools
import threading
import zipfile
from typing import Any

import torch

from ckptrepo.errors import CorruptionError, TrustRequiredError, UnsupportedValueError, first_line

_allow_lock = threading.Lock()   # torch's list of allowed globals is one per process


def _extra_safe_globals() -> list[Any]:
    """What DCP states hold besides torch's defaults: ``io.BytesIO`` payloads (DCP's documented way to store
    raw bytes) and numpy arrays, scalars and dtypes (``np.random.get_state()``); each is built from plain
    values only, so nothing in the bytes chooses code to run. Pickles of numpy 1 name ``numpy.core``."""
    import numpy as np
    core = np._core if hasattr(np, "_core") else np.core
    reconstruct, scalar = core.multiarray._reconstruct, core.multiarray.scalar
    dtypes = [c for c in vars(getattr(np, "dtypes", np)).values() if isinstance(c, type) and issubclass(c, np.dtype)]
    return [io.BytesIO, np.ndarray, np.dtype, *dtypes, reconstruct, scalar,
            (reconstruct, "numpy.core.multiarray._reconstruct"), (scalar, "numpy.core.multiarray.scalar"),
            (reconstruct, "numpy._core.multiarray._reconstruct"), (scalar, "numpy._core.multiarray.scalar")]


def _named_globals(data: bytes) -> list[str] | None:
    """The globals the bytes name (torch lists them for its zip format; for the legacy one, those of its first
    pickle); None when they are no pickle at all."""
    if zipfile.is_zipfile(io.BytesIO(data)):
        try:
            return list(torch.serialization.get_unsafe_globals_in_checkpoint(io.BytesIO(data)))
        except Exception:  # noqa: BLE001 - a damaged archive
            return None
    try:
        return [str(arg).replace(" ", ".") for op, arg, _ in pickletools.genops(data) if op.name == "GLOBAL"]
    except Exception:  # noqa: BLE001 - pickletools raises several types for bytes that are no pickle
        return None


def safe_bytes(data: bytes, item: str, vid: str) -> bytes:
    """``data`` (the bytes of byte item ``item`` of version ``vid``) as bytes whose full unpickling builds
    only what torch's restricted unpickler built from them; TrustRequiredError when they name other code,
    CorruptionError when they are no ``torch.save`` bytes at all, UnsupportedValueError when torch cannot load
    them here (a CUDA tensor on a machine without CUDA, as DCP's own load would fail)."""
    try:
        with _allow_lock, torch.serialization.safe_globals(_extra_safe_globals()):
            # no map_location: tensors go back to the device they were saved from, as DCP's own load puts them
            value = torch.load(io.BytesIO(data), weights_only=True)
    except pickle.UnpicklingError:
        found = _named_globals(data)
        if found is None:
            raise CorruptionError(f"DCP item {item!r} of version {vid[:12]} is not a torch.save pickle; run "
                                  f"`ckptrepo fsck`") from None
        allowed = {g[1] if isinstance(g, tuple) else f"{g.__module__}.{g.__qualname__}" for g in _extra_safe_globals()}
        names = [n for n in found if n not in allowed]
        named = f" (it names {', '.join(names[:3])}{', ...' if len(names) > 3 else ''})" if names else ""
        raise TrustRequiredError(
            f"DCP item {item!r} of version {vid[:12]} is a pickle that only full unpickling loads{named}, which "
            f"can run arbitrary code; load with ckptrepo.dcp.Reader(url, rev, trust=True) only if you trust the "
            f"repository, or allow its types with torch.serialization.add_safe_globals") from None
    except Exception as err:  # noqa: BLE001 - torch raises many types for bytes that are no torch file
        cause = f"{type(err).__name__}: {first_line(err)}"
        if _named_globals(data) is None:
            raise CorruptionError(f"DCP item {item!r} of version {vid[:12]} is not a torch.save pickle ({cause}); "
                                  f"run `ckptrepo fsck`") from None
        raise UnsupportedValueError(f"DCP item {item!r} of version {vid[:12]} cannot be loaded here ({cause})") \
            from None
    out = io.BytesIO()
    torch.save(value, out)
    return out.getvalue()
