"""Test helpers for code built on ckptrepo: ``StoreTests``, the conformance tests of the storage protocol.

Importing it needs pytest, which the library itself does not.
"""
from ckptrepo.testing.store_tests import StoreTests

__all__ = ["StoreTests"]
