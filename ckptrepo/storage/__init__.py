"""Storage: the Store protocol, the TensorStore store behind every URL, zarr array geometry, and direct local I/O.

The lowest layer: it knows keys, bytes and arrays, nothing of versions or tensors.
"""
from ckptrepo.storage.protocol import NO_VALUE, Store, StoreCapabilities, open_store

__all__ = ["NO_VALUE", "Store", "StoreCapabilities", "open_store"]
