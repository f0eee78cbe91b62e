"""Sharing equal short strings of restored records, and returning glibc's free heap
(server/runtime/restored_memory.py)."""

from __future__ import annotations

import ctypes
import json
import os
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest

from rollout_checkpoint.server.runtime import restored_memory
from rollout_checkpoint.server.runtime.restored_memory import (
    SHARED_LENGTH,
    StringTable,
    release_free_heap,
)


def decoded(value: object) -> Any:
    """`value` as a restore decodes it: fresh objects, equal strings distinct."""
    return msgspec.json.decode(json.dumps(value).encode())


def test_equal_short_strings_become_one_object_across_values() -> None:
    table = StringTable()
    first = decoded({"a": ["x" * SHARED_LENGTH, {"b": "tag"}], "c": "tag"})
    second = decoded([{"d": "tag"}, ["x" * SHARED_LENGTH]])
    assert second[0]["d"] is not first["c"]
    table.share(first)
    table.share(second)
    assert first["c"] is first["a"][1]["b"] is second[0]["d"]
    assert second[1][0] is first["a"][0]
    assert len(table) == 2


def test_longer_strings_keys_numbers_and_containers_are_left_as_they_are() -> None:
    table = StringTable()
    long_text = "y" * (SHARED_LENGTH + 1)
    first = decoded({"long": long_text, "n": [1, True, None, 2**70], "same": {"k": 1}})
    second = decoded({"long": long_text, "n": [1.0, 1, False, 2**70], "same": {"k": 1}})
    before = json.dumps([first, second])
    table.share(first)
    table.share(second)
    assert json.dumps([first, second]) == before
    assert second["long"] is not first["long"]
    assert [type(v) for v in second["n"]] == [float, int, bool, int]
    assert second["same"] is not first["same"]
    assert len(table) == 0


def test_any_nesting_depth_is_walked_without_recursion() -> None:
    depth = 20_000
    deep: list[Any] = ["leaf"]
    for _ in range(depth):
        deep = [deep]
    other = ["le" + "af"]
    table = StringTable()
    table.share(other)
    table.share(deep)
    inner = deep
    for _ in range(depth):
        inner = inner[0]
    assert inner[0] is other[0]


def test_an_unshared_table_changes_nothing() -> None:
    value = decoded({"a": "b", "c": ["d", "d"]})
    StringTable(max_length=0).share(value)
    assert value == {"a": "b", "c": ["d", "d"]}
    assert value["c"][0] is not value["c"][1]


@pytest.fixture
def fresh_lookup() -> Iterator[None]:
    restored_memory._malloc_trim.cache_clear()
    yield
    restored_memory._malloc_trim.cache_clear()


@pytest.mark.skipif(
    not (os.confstr("CS_GNU_LIBC_VERSION") or "").startswith("glibc"), reason="glibc only"
)
def test_the_free_heap_is_returned_on_glibc(fresh_lookup: None) -> None:
    trim = restored_memory._malloc_trim()
    assert trim is not None
    assert trim.restype is ctypes.c_int  # type: ignore[attr-defined]
    assert release_free_heap() is True


def test_release_is_a_no_op_without_glibc(
    monkeypatch: pytest.MonkeyPatch, fresh_lookup: None
) -> None:
    def musl(name: str) -> str:
        raise ValueError(f"unrecognized configuration name {name}")

    monkeypatch.setattr(restored_memory.os, "confstr", musl)
    assert release_free_heap() is False
    restored_memory._malloc_trim.cache_clear()
    monkeypatch.setattr(restored_memory.os, "confstr", lambda name: "other 1.0")
    assert release_free_heap() is False
