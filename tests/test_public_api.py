"""`rollout_checkpoint.client` is the controller library's one public module.

Its `__all__` is the documented API (the docs' API reference is generated from it): every
name resolves, and every name, every public method or property of a public class and every
field of one says its contract in a docstring. (That importing it loads nothing, not even
grpc, is tests/test_layout.py's `test_importing_the_light_packages_loads_no_grpc_and_no_runtime`.)
"""

from __future__ import annotations

import ast
import importlib
import inspect
import sys
from collections.abc import Iterator

import rollout_checkpoint.client as client

from .processes import REPO
from .test_docstrings import _own_docstring, _undocumented_class, _undocumented_fields


def test_all_is_sorted_and_unique() -> None:
    assert client.__all__ == sorted(set(client.__all__))


def test_every_public_name_resolves_from_its_home_module() -> None:
    assert set(client._HOME_OF) == set(client.__all__)
    for name in client.__all__:
        home = importlib.import_module(client._HOME_OF[name])
        assert getattr(client, name) is getattr(home, name), name


def test_dir_lists_the_public_names() -> None:
    """Sphinx autodoc lists a module's members through dir(): the lazy names must be there
    before anything imported them."""
    assert dir(client) == client.__all__


def test_the_type_checking_imports_match_the_table() -> None:
    """mypy sees the names through the `if TYPE_CHECKING:` imports, the runtime through the
    table: both must name the same home for every name, or a caller type-checks against one
    object and runs another."""
    tree = ast.parse((REPO / "client" / "__init__.py").read_text())
    (guard,) = (
        node
        for node in tree.body
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING"
    )
    imported = {
        alias.name: statement.module
        for statement in guard.body
        if isinstance(statement, ast.ImportFrom)
        for alias in statement.names
    }
    assert imported == client._HOME_OF


def _undocumented(name: str) -> Iterator[str]:
    value = getattr(client, name)
    if inspect.isclass(value):
        yield from _undocumented_class(sys.modules[value.__module__], name, value)
    elif not _own_docstring(value):
        yield f"{client._HOME_OF[name]}.{name}"


def test_every_public_name_and_method_has_a_docstring() -> None:
    missing = [undocumented for name in client.__all__ for undocumented in _undocumented(name)]
    assert not missing, f"public names without a docstring: {missing}"


def test_every_field_of_a_public_class_has_a_docstring() -> None:
    """A public class's fields and constants are what a caller reads (an outcome, a progress
    snapshot) or sets (the settings): each says its meaning in an attribute docstring, the
    string right after it, which editors and the API reference show."""
    missing = [
        field
        for name in client.__all__
        if inspect.isclass(value := getattr(client, name))
        for field in _undocumented_fields(value.__module__, name)
    ]
    assert not missing, f"fields without a docstring: {missing}"
