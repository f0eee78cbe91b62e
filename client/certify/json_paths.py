"""The first place where two JSON documents differ, as a path a user can follow.

A finding must point at the field a hook lost, not print two documents: `$.state.count`
opens the exported state at the counter, `$.messages[5].content` the sixth message. The
comparison is JSON's, not Python's: an object's key order does not matter (a server may
rebuild a dict in another order and mean the same state), a list's order does, and `1`,
`1.0` and `true` are three different values (a restore that turns a count into a float, or
a flag into a number, changed what the next reply serialises).

Paths: `$` is the root, `.key` an object key that is an identifier, `["key"]` any other key
(quoted as a JSON string, so a key holding `.`, `[` or `"` cannot be mistaken for
structure), `[i]` a list index.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

ROOT = "$"
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


def first_difference(expected: Any, actual: Any) -> str | None:
    """The path of the first difference of `actual` from `expected`; None when they are
    equal as JSON.

    "First" is a walk of `expected` in its own order (object keys as they appear, then the
    keys only `actual` has, in its order), so the same two documents always give the same
    path. A key missing on one side is a difference at that key's path; two lists of
    different lengths that agree on their common part differ at the first index past the
    shorter one."""
    return _difference(expected, actual, ROOT)


def key_path(parent: str, key: object) -> str:
    """The path of object key `key` under `parent`."""
    text = str(key)
    if _IDENTIFIER.match(text):
        return f"{parent}.{text}"
    return f"{parent}[{json.dumps(text, ensure_ascii=False)}]"


def index_path(parent: str, index: int) -> str:
    """The path of list index `index` under `parent`."""
    return f"{parent}[{index}]"


def under(parent: str, path: str) -> str:
    """`path` (relative to its own `$`) re-rooted at `parent`: `under("$.messages[5]",
    "$.content")` is `$.messages[5].content`."""
    if not path.startswith(ROOT):
        raise ValueError(f"not a path from {ROOT}: {path!r}")
    return parent + path[len(ROOT) :]


def _difference(expected: Any, actual: Any, path: str) -> str | None:
    if _json_type(expected) != _json_type(actual):
        return path
    if isinstance(expected, Mapping):
        return _object_difference(expected, actual, path)
    if isinstance(expected, list | tuple):
        return _list_difference(expected, actual, path)
    if isinstance(expected, float):
        # As their JSON texts: NaN read twice is the same value, -0.0 is not 0.0.
        return None if json.dumps(expected) == json.dumps(actual) else path
    return None if expected == actual else path


def _object_difference(
    expected: Mapping[Any, Any], actual: Mapping[Any, Any], path: str
) -> str | None:
    for key, value in expected.items():
        if key not in actual:
            return key_path(path, key)
        found = _difference(value, actual[key], key_path(path, key))
        if found is not None:
            return found
    for key in actual:
        if key not in expected:
            return key_path(path, key)
    return None


def _list_difference(expected: Any, actual: Any, path: str) -> str | None:
    for index, (left, right) in enumerate(zip(expected, actual, strict=False)):
        found = _difference(left, right, index_path(path, index))
        if found is not None:
            return found
    if len(expected) != len(actual):
        return index_path(path, min(len(expected), len(actual)))
    return None


_JSON_TYPES: tuple[tuple[type | tuple[type, ...], str], ...] = (
    (type(None), "null"),
    (bool, "boolean"),  # before int: Python's `True == 1` is not JSON's
    (int, "integer"),
    (float, "float"),
    (str, "string"),
    (Mapping, "object"),
    ((list, tuple), "array"),
)


def _json_type(value: Any) -> str:
    """JSON's type of a value (a value JSON has no type for is its own Python type)."""
    for kinds, name in _JSON_TYPES:
        if isinstance(value, kinds):
            return name
    return type(value).__qualname__
