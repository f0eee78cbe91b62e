"""The "Using it in your own server" code (docs/your-server.md) runs as written, and every
import the README and the docs pages name exists: a user copies that snippet first, and an
import path left behind by a re-cut (or a hook renamed) would fail for them before anything
else."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path
from typing import Any

import pytest
from starlette.applications import Starlette

from .doc_pages import pages

OWN_SERVER_PAGE = Path(__file__).resolve().parent.parent / "docs" / "your-server.md"
SECTION = "## Using it in your own server"


def _section(text: str, heading: str) -> str:
    start = text.index(heading)
    following = re.search(r"^#{1,3} ", text[start + len(heading) :], re.MULTILINE)
    end = start + len(heading) + following.start() if following else len(text)
    return text[start:end]


def _python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text, re.MULTILINE | re.DOTALL)


def _own_server_snippet() -> str:
    blocks = _python_blocks(_section(OWN_SERVER_PAGE.read_text(), SECTION))
    assert len(blocks) == 1, f"expected one python block under {SECTION!r}, found {len(blocks)}"
    return blocks[0]


def _run(snippet: str) -> dict[str, Any]:
    namespace: dict[str, Any] = {"__name__": "readme_snippet"}
    exec(compile(snippet, "docs/your-server.md (Using it in your own server)", "exec"), namespace)
    return namespace


def test_the_snippet_builds_an_app_with_checkpointing_off_by_default() -> None:
    namespace = _run(_own_server_snippet())
    assert isinstance(namespace["app"], Starlette)
    server_class = namespace["MyServer"]
    assert server_class(namespace["ResourcesServerConfig"]()).runtime is None


def test_the_snippet_server_starts_with_checkpointing_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """With checkpointing enabled an `exported` server without its three hooks fails at
    startup (TypeError): the snippet's class must implement exactly the hooks that check asks
    for, so this also fails when a hook is renamed on one side only."""
    monkeypatch.setenv("ROLLOUT_CHECKPOINT_ENABLED", "true")
    monkeypatch.setenv("ROLLOUT_CHECKPOINT_TOKEN", "a-token-for-the-readme-test")
    namespace = _run(_own_server_snippet())
    app = namespace["app"]
    assert isinstance(app, Starlette)
    assert (
        app.state.checkpoint is not None
    )  # install_checkpointing ran (the sidecar starts with the app)


def _imports_in(text: str) -> list[tuple[str, list[str]]]:
    """Every `from rollout_checkpoint... import ...` of a page, in code blocks or inline."""
    found: list[tuple[str, list[str]]] = []
    for block in _python_blocks(text):
        for node in ast.walk(ast.parse(block)):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                "rollout_checkpoint"
            ):
                assert node.module is not None
                found.append((node.module, [alias.name for alias in node.names]))
    for module, names in re.findall(r"`from (rollout_checkpoint[\w.]*) import ([\w, ]+)`", text):
        found.append((module, [name.strip() for name in names.split(",")]))
    return found


def _all_pages() -> str:
    """README.md and every docs page, one text."""
    return "\n".join(page.read_text() for page in pages())


def test_every_import_the_readme_names_exists() -> None:
    text = _all_pages()
    imports = _imports_in(text)
    assert len(imports) >= 4, imports  # the snippet's two, install_checkpointing, Participant
    for module_name, names in imports:
        module = importlib.import_module(module_name)
        for name in names:
            assert hasattr(module, name), f"the docs: {module_name} has no {name}"


def test_every_package_the_readme_names_imports() -> None:
    """The layout table and the prose name Python packages by dotted path; each must import.
    (`rollout_checkpoint.v1.ParticipantService` and the like are gRPC service names.)"""
    pattern = r"`(rollout_checkpoint\.(?:server|client|examples)(?:\.\w+)*)`"
    names = set(re.findall(pattern, _all_pages()))
    assert len(names) >= 5, names
    for name in sorted(names):
        importlib.import_module(name)
