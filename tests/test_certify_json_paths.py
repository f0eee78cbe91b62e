"""certify's first differing JSON path (client/certify/json_paths.py).

Properties over generated JSON documents: a document never differs from itself nor from a
copy with its objects' keys reordered; two documents differ exactly when their canonical
JSON texts differ (so `1`, `1.0` and `true` differ, as JSON says); and a document changed at
one place differs exactly there. Then the path syntax and the documented cases one by one.
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout_checkpoint.client.certify.json_paths import (
    first_difference,
    index_path,
    key_path,
    under,
)

SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**53), max_value=2**53)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8)
)
KEYS = st.text(max_size=6) | st.sampled_from(["a", "b", "count", "x.y", 'q"', "[0]", "1"])
DOCUMENTS = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(KEYS, inner, max_size=4),
    max_leaves=20,
)
PROPERTY = settings(max_examples=300, deadline=None)


def canonical(document: Any) -> str:
    return json.dumps(document, sort_keys=True)


def reordered(document: Any) -> Any:
    """The same document with every object's keys in reverse order."""
    if isinstance(document, dict):
        return {k: reordered(document[k]) for k in reversed(list(document))}
    if isinstance(document, list):
        return [reordered(item) for item in document]
    return document


def paths(document: Any, path: str = "$") -> list[tuple[str, list[Any]]]:
    """Every (path, steps) of a document: the steps are the keys and indices to follow."""
    found: list[tuple[str, list[Any]]] = [(path, [])]
    if isinstance(document, dict):
        items: list[tuple[Any, str]] = [(k, key_path(path, k)) for k in document]
    elif isinstance(document, list):
        items = [(i, index_path(path, i)) for i in range(len(document))]
    else:
        items = []
    for step, child in items:
        found += [(p, [step, *rest]) for p, rest in paths(document[step], child)]
    return found


def replaced(document: Any, steps: list[Any], value: Any) -> Any:
    if not steps:
        return value
    copy: Any = dict(document) if isinstance(document, dict) else list(document)
    copy[steps[0]] = replaced(document[steps[0]], steps[1:], value)
    return copy


def value_at(document: Any, steps: list[Any]) -> Any:
    for step in steps:
        document = document[step]
    return document


@PROPERTY
@given(DOCUMENTS)
def test_a_document_and_its_reordered_copy_do_not_differ(document: Any) -> None:
    assert first_difference(document, document) is None
    assert first_difference(document, reordered(document)) is None
    assert first_difference(reordered(document), document) is None


@PROPERTY
@given(DOCUMENTS, DOCUMENTS)
def test_two_documents_differ_exactly_when_their_json_differs(left: Any, right: Any) -> None:
    same = canonical(left) == canonical(right)
    assert (first_difference(left, right) is None) == same
    assert (first_difference(right, left) is None) == same


@PROPERTY
@given(DOCUMENTS, st.data())
def test_a_change_at_one_place_is_found_at_that_place(document: Any, data: st.DataObject) -> None:
    path, steps = data.draw(st.sampled_from(paths(document)))
    old = value_at(document, steps)
    new = data.draw(SCALARS.filter(lambda v: canonical(v) != canonical(old)))
    assert first_difference(document, replaced(document, steps, new)) == path


def test_json_types_differ_where_python_equality_does_not() -> None:
    assert first_difference({"n": 1}, {"n": 1.0}) == "$.n"
    assert first_difference({"n": 1}, {"n": True}) == "$.n"
    assert first_difference([0], [False]) == "$[0]"
    assert first_difference({"n": None}, {"n": 0}) == "$.n"
    assert first_difference(1.5, 1.5) is None
    assert first_difference(float("nan"), float("nan")) is None
    assert first_difference(0.0, -0.0) == "$"


def test_missing_and_extra_keys_differ_at_the_key() -> None:
    assert first_difference({"a": 1, "b": 2}, {"a": 1}) == "$.b"
    assert first_difference({"a": 1}, {"a": 1, "z": 0}) == "$.z"
    # Walked in the expected document's order: its second key before the actual's extra key.
    assert first_difference({"a": 1, "b": 2}, {"z": 0, "a": 1, "b": 3}) == "$.b"


def test_lists_keep_their_order_and_differ_past_the_shorter_one() -> None:
    assert first_difference([1, 2], [2, 1]) == "$[0]"
    assert first_difference({"m": [1, 2, 3]}, {"m": [1, 2]}) == "$.m[2]"
    assert first_difference({"m": [1]}, {"m": [1, 5, 6]}) == "$.m[1]"
    assert first_difference([], {}) == "$"


def test_nested_paths_name_each_step() -> None:
    expected = {"messages": [{"role": "user"}, {"role": "tool", "content": "3"}]}
    actual = {"messages": [{"role": "user"}, {"role": "tool", "content": "4"}]}
    assert first_difference(expected, actual) == "$.messages[1].content"


@pytest.mark.parametrize(
    ("key", "path"),
    [
        ("count", "$.count"),
        ("_private2", "$._private2"),
        ("x.y", '$["x.y"]'),
        ("two words", '$["two words"]'),
        ("1st", '$["1st"]'),
        ("", '$[""]'),
        ('say "hi"', '$["say \\"hi\\""]'),
        ("[0]", '$["[0]"]'),
        ("café", '$["café"]'),
    ],
)
def test_a_key_that_is_not_an_identifier_is_quoted(key: str, path: str) -> None:
    assert first_difference({key: 1}, {key: 2}) == path


def test_a_quoted_key_reads_back_as_json() -> None:
    key = 'a"b\\c]'
    path = first_difference({key: 1}, {key: 2})
    assert path is not None
    match = re.fullmatch(r"\$\[(.*)\]", path)
    assert match is not None and json.loads(match.group(1)) == key


def test_a_path_is_re_rooted_under_a_parent() -> None:
    assert under("$.messages[5]", "$.content") == "$.messages[5].content"
    assert under("$.state", "$") == "$.state"
    assert under("$.state", "$[2]") == "$.state[2]"
    with pytest.raises(ValueError, match="not a path"):
        under("$.state", "content")
