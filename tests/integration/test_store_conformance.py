"""The storage protocol's conformance tests (ckptrepo.testing.StoreTests) on every backend a URL can name."""
from __future__ import annotations

import os
import uuid

import pytest

from ckptrepo.storage import Store, open_store
from ckptrepo.testing import StoreTests


class TestFileStore(StoreTests):
    @pytest.fixture
    def store(self, tmp_path) -> Store:
        return open_store(str(tmp_path / "repo"))

    def test_capabilities(self, store: Store, tmp_path) -> None:
        caps = store.capabilities
        assert caps.local_root == str(tmp_path / "repo") + "/"
        assert caps.atomic_conditional_writes and not caps.keeps_written_buffers

    def test_delete_prefix_leaves_no_empty_folders_below_the_top_one(self, store: Store, tmp_path) -> None:
        root = tmp_path / "repo"
        store.put("data/v1/0/float32/c/0", b"x")
        store.put("data/v1/0/float32/zarr.json", b"{}")
        store.put("data/v2/zarr.json", b"{}")
        store.delete_prefix("data/v1/")
        assert sorted(os.listdir(root / "data")) == ["v2"]

    def test_a_file_url_is_the_same_store(self, store: Store, tmp_path) -> None:
        store.put("k", b"v")
        assert open_store(f"file://{tmp_path}/repo").get("k") == b"v"


class TestFileStoreWithOptions(StoreTests):
    """A file store whose spec has more than a path: TensorStore does its I/O, and no local root is offered."""

    @pytest.fixture
    def store(self, tmp_path) -> Store:
        return open_store(str(tmp_path / "repo"), {"file_io_sync": True})

    def test_offers_no_local_root(self, store: Store) -> None:
        assert store.capabilities.local_root is None


class TestMemoryStore(StoreTests):
    @pytest.fixture
    def store(self) -> Store:
        return open_store(f"memory://{uuid.uuid4().hex}")

    def test_capabilities(self, store: Store) -> None:
        caps = store.capabilities
        assert caps.local_root is None and caps.keeps_written_buffers

    def test_stores_of_one_name_share_their_keys(self, store: Store) -> None:
        store.put("k", b"v")
        assert open_store(store.url).get("k") == b"v"
        assert open_store(f"memory://{uuid.uuid4().hex}").get("k") is None


class TestS3Store(StoreTests):
    @pytest.fixture
    def store(self, s3_url) -> Store:
        return open_store(s3_url)

    def test_capabilities(self, store: Store) -> None:
        caps = store.capabilities
        # the server decides, which the store check probes (tests/integration/test_store_check.py)
        assert caps.local_root is None and not caps.atomic_conditional_writes and not caps.keeps_written_buffers
