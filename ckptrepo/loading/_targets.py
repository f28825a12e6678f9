"""Where a load puts what it reads, checked before any read: the device (``device=``/``map_location=``) and the
state to fill in place (``into=``). torch and numpy are imported by the checks, not with this module, so the
porcelain imports it at no cost to history commands (decisions/032)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ckptrepo.arguments import shown
from ckptrepo.errors import ArgumentError, StateMismatchError, first_line

if TYPE_CHECKING:
    import torch


def load_device(spec: Any) -> torch.device | None:
    """The device a load puts fresh tensors on (``None``: where they are read, the CPU), checked before any read.

    Why here: torch only complains at the first ``.to()``, after the reads, and on a CPU-only build
    with an ``AssertionError`` ("Torch not compiled with CUDA enabled").
    """
    if spec is None:
        return None
    import torch
    try:
        dev = torch.device(spec)
    except (TypeError, RuntimeError, ValueError):
        raise ArgumentError(f"device {spec!r} is not a device; pass 'cpu', 'cuda', 'cuda:1' or a torch.device "
                            f"(a map_location dict or function is not supported)") from None
    try:
        torch.empty(0, device=dev)
    except (AssertionError, RuntimeError) as e:
        raise ArgumentError(f"cannot load onto device {str(dev)!r} in this process ({first_line(e)}); "
                            f"load with device='cpu' or pick an available device") from None
    return dev


def check_into(into: Any) -> None:
    """``load(into=...)`` takes the state to fill in place; a value that cannot hold one is refused, where it would
    be ignored (the load would return a new state and leave the caller's as it was)."""
    import numpy as np
    import torch

    from ckptrepo.state import is_stateful
    if into is None or isinstance(into, (dict, list, tuple, torch.Tensor, np.ndarray, np.random.Generator)) \
            or is_stateful(into):
        return
    raise StateMismatchError(f"into= takes the state to fill in place (a dict, list, module, optimizer or tensor), "
                             f"not {shown(into)}; leave it out to get a new state")


__all__ = ["check_into", "load_device"]
