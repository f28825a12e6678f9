"""Conformance tests of the storage protocol (:class:`ckptrepo.storage.protocol.Store`).

A backend proves that it implements the protocol by subclassing :class:`StoreTests`
with a ``store`` fixture that returns a fresh, empty store::

    class TestMyStore(StoreTests):
        @pytest.fixture
        def store(self, tmp_path):
            return MyStore(tmp_path)

and every test here runs against it. The tests say what the repository relies
on: absent keys read as None, generations guard every conditional write, listings
are string prefixes (no sibling-prefix leaks), and capabilities tell the truth.
"""
from __future__ import annotations

import os
import threading
from typing import Any

import numpy as np
import pytest
import tensorstore as ts

from ckptrepo.storage.protocol import NO_VALUE, Store, StoreCapabilities

__all__ = ["StoreTests"]

_LARGE = (4 << 20) + 3   # spans several of a client's buffers and requests; odd, so an off-by-one shows


def _pattern(n: int, seed: int = 0) -> bytes:
    """``n`` bytes that differ everywhere a misplaced offset would show."""
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


class StoreTests:
    """Inherit these tests and provide a ``store`` fixture: a fresh, empty store of the backend under test."""

    @pytest.fixture
    def store(self) -> Store:
        raise NotImplementedError("a StoreTests subclass provides the `store` fixture: a fresh, empty store")

    # ---- the protocol itself -------------------------------------------
    def test_implements_the_protocol(self, store: Store) -> None:
        assert isinstance(store, Store)
        assert isinstance(store.capabilities, StoreCapabilities)
        assert isinstance(store.url, str) and store.url
        text = store.describe()
        assert isinstance(text, str) and text and "\n" not in text

    def test_a_fresh_store_is_empty(self, store: Store) -> None:
        assert store.list() == []
        assert store.list("") == []

    # ---- missing keys ---------------------------------------------------
    def test_missing_keys_read_as_none(self, store: Store) -> None:
        assert store.get("missing") is None
        assert store.get("no/such/folder/key") is None
        assert store.get_range("missing", 0, 10) is None
        assert store.get_with_generation("missing") == (None, NO_VALUE)
        assert store.get_many(["missing", "also/missing"]) == [None, None]
        assert store.exists("missing") is False
        assert store.list("missing") == []

    def test_deleting_a_missing_key_or_prefix_is_no_error(self, store: Store) -> None:
        store.delete("missing")
        store.delete("no/such/folder/key")
        store.delete_prefix("no/such/folder/")
        assert store.list() == []

    # ---- round trips ----------------------------------------------------
    def test_round_trip_of_an_empty_value(self, store: Store) -> None:
        store.put("empty", b"")
        assert store.get("empty") == b""
        assert store.get_many(["empty"]) == [b""]
        assert store.get_with_generation("empty")[0] == b""
        assert store.get_range("empty", 0, 5) == b""
        assert store.exists("empty") is True
        assert store.list() == ["empty"]

    def test_round_trip_of_every_byte_value(self, store: Store) -> None:
        value = bytes(range(256)) * 3
        store.put("bytes", value)
        assert store.get("bytes") == value

    def test_round_trip_of_a_large_value(self, store: Store) -> None:
        value = _pattern(_LARGE)
        store.put("large/value", value)
        assert store.get("large/value") == value
        assert store.get_many(["large/value"]) == [value]
        assert store.get_range("large/value", _LARGE - 10, 100) == value[-10:]

    def test_whole_value_reads_refuse_a_value_over_max_bytes(self, store: Store) -> None:
        """Reads of whole values are bounded: a value over ``max_bytes`` is damage, a CorruptionError naming
        the key (a repository's small objects have size limits, docs/format.md)."""
        from ckptrepo.errors import CorruptionError
        store.put("bounded", b"12345")
        assert store.get("bounded", max_bytes=5) == b"12345"
        assert store.get_many(["bounded"], max_bytes=5) == [b"12345"]
        assert store.get_with_generation("bounded", max_bytes=5)[0] == b"12345"
        for read in (lambda: store.get("bounded", max_bytes=4), lambda: store.get_many(["bounded"], max_bytes=4),
                     lambda: store.get_with_generation("bounded", max_bytes=4)):
            with pytest.raises(CorruptionError, match="bounded"):
                read()

    def test_round_trip_of_nested_and_dotted_keys(self, store: Store) -> None:
        keys = ["HEAD", "refs/heads/main", "refs/tags/v1.2", "data/abc/0/float32.x/zarr.json", "config.json"]
        for i, key in enumerate(keys):
            store.put(key, f"value {i}".encode())
        assert [store.get(key) for key in keys] == [f"value {i}".encode() for i in range(len(keys))]
        assert store.list() == sorted(keys)

    def test_round_trip_of_a_non_ascii_key(self, store: Store) -> None:
        store.put("refs/heads/über/ß", b"1")
        store.put("refs/heads/ubung", b"2")
        assert store.get("refs/heads/über/ß") == b"1"
        assert store.list("refs/heads/über/") == ["refs/heads/über/ß"]
        assert store.list("refs/heads/ü") == ["refs/heads/über/ß"]

    def test_put_replaces_the_value(self, store: Store) -> None:
        store.put("k", b"first value, longer than the second")
        store.put("k", b"second")
        assert store.get("k") == b"second"
        assert store.list() == ["k"]

    # ---- ranged reads ---------------------------------------------------
    @pytest.mark.parametrize(("offset", "length", "expected"), [
        (0, 10, slice(0, 10)),        # a prefix
        (3, 4, slice(3, 7)),          # the middle
        (10, 6, slice(10, 16)),       # exactly to the end
        (12, 100, slice(12, 16)),     # past the end: what there is
        (0, 1000, slice(0, 16)),      # more than the whole value
        (16, 5, slice(16, 16)),       # from the end: empty
        (40, 5, slice(16, 16)),       # from past the end: empty
        (5, 0, slice(5, 5)),          # nothing asked, nothing read
    ])
    def test_get_range(self, store: Store, offset: int, length: int, expected: slice) -> None:
        value = b"0123456789abcdef"
        store.put("ranged", value)
        assert store.get_range("ranged", offset, length) == value[expected]

    def test_get_range_of_a_large_value_reads_the_right_bytes(self, store: Store) -> None:
        value = _pattern(_LARGE, seed=1)
        store.put("large", value)
        for offset, length in [(0, 1), (1 << 20, 4096), ((4 << 20) - 2, 8), (_LARGE // 3, _LARGE)]:
            assert store.get_range("large", offset, length) == value[offset:offset + length]

    @pytest.mark.parametrize(("offset", "length"), [(-1, 4), (0, -1)])
    def test_get_range_refuses_negative_numbers(self, store: Store, offset: int, length: int) -> None:
        store.put("ranged", b"0123")
        with pytest.raises(ValueError):
            store.get_range("ranged", offset, length)

    # ---- get_many -------------------------------------------------------
    def test_get_many_answers_in_the_order_asked(self, store: Store) -> None:
        for i in range(8):
            store.put(f"many/{i}", f"v{i}".encode() * (i + 1))
        keys = ["many/5", "missing", "many/0", "many/7", "many/5", "many/missing", "many/2"]
        assert store.get_many(keys) == [store.get(k) for k in keys]
        assert store.get_many(keys) == [b"v5" * 6, None, b"v0", b"v7" * 8, b"v5" * 6, None, b"v2" * 3]

    def test_get_many_of_nothing_is_empty(self, store: Store) -> None:
        assert store.get_many([]) == []

    # ---- exists ---------------------------------------------------------
    def test_exists_sees_keys_and_not_their_folders(self, store: Store) -> None:
        store.put("folder/key", b"x")
        assert store.exists("folder/key") is True
        assert store.exists("folder") is False
        assert store.exists("folder/ke") is False

    # ---- put_if_absent --------------------------------------------------
    def test_put_if_absent_wins_once(self, store: Store) -> None:
        assert store.put_if_absent("once", b"first") is True
        assert store.put_if_absent("once", b"second") is False
        assert store.get("once") == b"first"

    def test_put_if_absent_loses_to_an_empty_value(self, store: Store) -> None:
        store.put("empty", b"")
        assert store.put_if_absent("empty", b"late") is False
        assert store.get("empty") == b""

    def test_put_if_absent_wins_again_after_a_delete(self, store: Store) -> None:
        assert store.put_if_absent("again", b"1") is True
        store.delete("again")
        assert store.put_if_absent("again", b"2") is True
        assert store.get("again") == b"2"

    def test_racing_put_if_absent_has_one_winner(self, store: Store) -> None:
        if not store.capabilities.atomic_conditional_writes:
            pytest.skip("the store does not claim atomic conditional writes")
        writers = 8
        start = threading.Barrier(writers)
        wins: list[bytes] = []
        errors: list[BaseException] = []

        def race(i: int) -> None:
            value = f"writer {i}".encode()
            try:
                start.wait()
                if store.put_if_absent("raced", value):
                    wins.append(value)
            except BaseException as err:  # noqa: BLE001 - reported by the assertion below
                errors.append(err)

        threads = [threading.Thread(target=race, args=(i,)) for i in range(writers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
        assert len(wins) == 1
        assert store.get("raced") == wins[0]

    # ---- compare_and_swap -----------------------------------------------
    def test_generations_change_with_the_value(self, store: Store) -> None:
        store.put("gen", b"1")
        _, first = store.get_with_generation("gen")
        store.put("gen", b"2")
        value, second = store.get_with_generation("gen")
        assert value == b"2"
        assert first != NO_VALUE and second != NO_VALUE
        assert first != second

    def test_compare_and_swap_with_the_current_generation_writes(self, store: Store) -> None:
        store.put("cas", b"old")
        _, gen = store.get_with_generation("cas")
        new_gen = store.compare_and_swap("cas", b"new", gen)
        assert new_gen is not None and new_gen != gen
        value, read_gen = store.get_with_generation("cas")
        assert value == b"new"
        # the returned generation is the token of what was written: a second swap on it succeeds
        assert store.compare_and_swap("cas", b"newer", new_gen) is not None
        assert store.get("cas") == b"newer"
        assert read_gen == new_gen

    def test_compare_and_swap_with_a_stale_generation_fails(self, store: Store) -> None:
        store.put("cas", b"old")
        _, stale = store.get_with_generation("cas")
        store.put("cas", b"moved on")
        assert store.compare_and_swap("cas", b"lost update", stale) is None
        assert store.get("cas") == b"moved on"
        assert store.compare_and_swap("cas", None, stale) is None   # nor a delete
        assert store.get("cas") == b"moved on"

    def test_compare_and_swap_expecting_absent(self, store: Store) -> None:
        created = store.compare_and_swap("absent", b"created", NO_VALUE)
        assert created is not None
        assert store.get("absent") == b"created"
        assert store.compare_and_swap("absent", b"again", NO_VALUE) is None
        assert store.get("absent") == b"created"

    def test_compare_and_swap_on_a_deleted_key_fails(self, store: Store) -> None:
        store.put("gone", b"was here")
        _, gen = store.get_with_generation("gone")
        store.delete("gone")
        assert store.compare_and_swap("gone", b"resurrected", gen) is None
        assert store.get("gone") is None

    def test_compare_and_swap_can_delete(self, store: Store) -> None:
        store.put("doomed", b"x")
        store.put("doomed-sibling", b"y")
        _, gen = store.get_with_generation("doomed")
        assert store.compare_and_swap("doomed", None, gen) is not None
        assert store.get("doomed") is None
        assert store.exists("doomed") is False
        assert store.list() == ["doomed-sibling"]

    # ---- list -----------------------------------------------------------
    _TREE = ["a/b/1", "a/b/2/3", "a/bc/1", "a/bcd", "ab", "b/1", "b1"]

    def _fill(self, store: Store) -> None:
        for key in self._TREE:
            store.put(key, key.encode())

    def test_list_everything_is_sorted(self, store: Store) -> None:
        self._fill(store)
        assert store.list() == sorted(self._TREE)
        assert store.list("") == sorted(self._TREE)

    def test_list_of_a_folder_does_not_leak_its_siblings(self, store: Store) -> None:
        self._fill(store)
        assert store.list("a/b/") == ["a/b/1", "a/b/2/3"]
        assert store.list("a/bc/") == ["a/bc/1"]
        assert store.list("a/") == ["a/b/1", "a/b/2/3", "a/bc/1", "a/bcd"]
        assert store.list("b/") == ["b/1"]
        assert store.list("a/b/2/") == ["a/b/2/3"]

    def test_list_prefixes_are_strings(self, store: Store) -> None:
        self._fill(store)
        assert store.list("a/b") == ["a/b/1", "a/b/2/3", "a/bc/1", "a/bcd"]
        assert store.list("a/bc") == ["a/bc/1", "a/bcd"]
        assert store.list("b") == ["b/1", "b1"]
        assert store.list("a/b/1") == ["a/b/1"]

    def test_list_of_an_absent_prefix_is_empty(self, store: Store) -> None:
        self._fill(store)
        assert store.list("c/") == []
        assert store.list("a/bcde") == []
        assert store.list("a/x/") == []

    # ---- delete ---------------------------------------------------------
    def test_delete_removes_one_key(self, store: Store) -> None:
        self._fill(store)
        store.delete("a/bc/1")
        assert store.get("a/bc/1") is None
        assert store.exists("a/bc/1") is False
        assert store.list() == sorted(set(self._TREE) - {"a/bc/1"})

    def test_delete_prefix_removes_a_folder_and_not_its_siblings(self, store: Store) -> None:
        self._fill(store)
        store.delete_prefix("a/b/")
        assert store.list() == ["a/bc/1", "a/bcd", "ab", "b/1", "b1"]
        assert store.get("a/b/1") is None and store.get("a/b/2/3") is None
        assert store.get("a/bc/1") == b"a/bc/1"
        # the folder can be written again
        store.put("a/b/1", b"back")
        assert store.list("a/b/") == ["a/b/1"]

    def test_delete_prefix_is_a_string_prefix(self, store: Store) -> None:
        self._fill(store)
        store.delete_prefix("a/b")
        assert store.list() == ["ab", "b/1", "b1"]

    def test_delete_prefix_of_everything_at_a_top_folder(self, store: Store) -> None:
        self._fill(store)
        store.delete_prefix("a/")
        store.delete_prefix("b/")
        assert store.list() == ["ab", "b1"]

    # ---- arrays ---------------------------------------------------------
    def test_zarr_arrays_are_reached_through_child_spec(self, store: Store) -> None:
        spec: dict[str, Any] = {
            "driver": "zarr3", "kvstore": store.child_spec("data/v/arr"), "create": True,
            "metadata": {"shape": [10], "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [4]}},
                         "data_type": "int32"},
        }
        arr = ts.open(spec, context=store.context).result()
        arr.write(np.arange(10, dtype=np.int32)).result()
        keys = store.list("data/v/arr/")
        assert "data/v/arr/zarr.json" in keys
        assert len(keys) > 1   # the metadata and the chunks, all under the prefix
        assert store.list("data/v/arr") == keys   # nothing beside it
        spec.pop("create")
        spec.pop("metadata")
        again = ts.open(spec, context=store.context, read=True).result()
        assert again.read().result().tolist() == list(range(10))
        store.delete_prefix("data/v/arr/")
        assert store.list() == []

    # ---- capabilities ---------------------------------------------------
    def test_local_root_holds_the_keys_as_files(self, store: Store) -> None:
        caps = store.capabilities
        store.put("folder/key", b"local bytes")
        if caps.local_root is None:
            assert caps.local_path("folder/key") is None
            return
        assert caps.local_root.endswith("/")
        path = caps.local_path("folder/key")
        assert path is not None
        with open(path, "rb") as f:
            assert f.read() == b"local bytes"
        for odd in ["", "a//b", "a/./b", "../outside", "a/..", "nul\0key"]:
            assert caps.local_path(odd) is None

    def test_files_with_a_reserved_suffix_are_never_listed(self, store: Store) -> None:
        caps = store.capabilities
        self._fill(store)
        if caps.local_root is None or not caps.reserved_suffixes:
            pytest.skip("the store reserves no file names under a local root")
        for suffix in caps.reserved_suffixes:
            with open(os.path.join(caps.local_root, "a", "bcd" + suffix), "wb") as f:   # a writer's leftover
                f.write(b"partial")
            assert caps.local_path("a/bcd" + suffix) is None
        assert store.list() == sorted(self._TREE)
        assert store.list("a/") == ["a/b/1", "a/b/2/3", "a/bc/1", "a/bcd"]
