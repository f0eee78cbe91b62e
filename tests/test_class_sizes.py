"""No class in the controller library over 400 lines (issue 29).

A class that long holds several responsibilities, and the rules its docstring states (each
for a crash at a given step) stop being next to the code that enforces them. The bound is
checked on the source text, so a class that grows past it fails here, not in a review.
"""

from __future__ import annotations

import ast

from .processes import REPO

MAX_CLASS_LINES = 400
ROOTS = ("client",)
"""The folders held to the bound (server/ and examples/ join once their classes are split)."""


def classes_over_the_bound() -> list[str]:
    found = []
    for root in ROOTS:
        for path in sorted((REPO / root).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.ClassDef):
                    assert node.end_lineno is not None
                    lines = node.end_lineno - node.lineno + 1
                    if lines > MAX_CLASS_LINES:
                        where = path.relative_to(REPO).as_posix()
                        found.append(f"{where}: {node.name} ({lines} lines)")
    return found


def test_no_class_in_the_controller_library_is_over_400_lines() -> None:
    assert classes_over_the_bound() == []
