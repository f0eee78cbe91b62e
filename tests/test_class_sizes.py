"""No class in server/, client/ or examples/ is over 400 lines (issue 29): a class that large
does several jobs, and the rules its docstring states stop being next to the code enforcing them.

A class that grows past the bound is split by responsibility — each part a module of one
concept whose docstring says why its rules and orderings exist — not cut by line count. The
bound counts a class from its `class` line to its last line, docstrings included.
"""

from __future__ import annotations

import ast
from pathlib import Path

from .processes import REPO

MAX_CLASS_LINES = 400
CHECKED = ("server", "client", "examples")


def class_sizes(folder: Path) -> list[tuple[int, str]]:
    """(lines, "path:Class") of every class, nested ones included, under `folder`."""
    sizes = []
    for path in sorted(folder.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef) and node.end_lineno is not None:
                lines = node.end_lineno - node.lineno + 1
                sizes.append((lines, f"{path.relative_to(REPO)}:{node.name}"))
    return sizes


def test_no_class_is_over_400_lines() -> None:
    too_long = sorted(
        (lines, name)
        for folder in CHECKED
        for lines, name in class_sizes(REPO / folder)
        if lines > MAX_CLASS_LINES
    )
    assert too_long == [], f"classes over {MAX_CLASS_LINES} lines: {too_long}"


def test_the_measure_reads_every_checked_folder() -> None:
    """Not vacuous: a wrong folder would find no class and bound nothing."""
    names = {name for folder in CHECKED for _, name in class_sizes(REPO / folder)}
    assert "server/runtime/control_plane.py:ControlPlane" in names
    assert "client/participant.py:ParticipantClient" in names
    assert any(name.startswith("examples/") for name in names)
