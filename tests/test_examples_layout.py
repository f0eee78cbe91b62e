"""The examples' source layout: what keeps `mypy --strict examples/` clean (issue 29; the bound
on class sizes, examples/ included, is tests/test_class_sizes.py).

Checked on the source text (no import, no mypy run): `scripts/typecheck` runs the real
`mypy --strict examples/`, these say which rule a failure there comes from.
"""

from __future__ import annotations

import ast
from pathlib import Path

from .processes import REPO

EXAMPLES = REPO / "examples"


def _example_modules() -> list[Path]:
    return sorted(p for p in EXAMPLES.rglob("*.py") if "__pycache__" not in p.parts)


def _absolute_example_imports(path: Path) -> list[str]:
    """`rollout_checkpoint.examples...` imports of `path`, as `file:line module`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        for name in names:
            if name == "rollout_checkpoint.examples" or name.startswith(
                "rollout_checkpoint.examples."
            ):
                found.append(f"{path.relative_to(REPO)}:{node.lineno} {name}")
    return found


def test_the_examples_import_one_another_relatively() -> None:
    """`mypy --strict examples/` names each file by its path (`examples.demo.tour`); an
    absolute import reaches the same file under its installed name
    (`rollout_checkpoint.examples.demo.tour`). One file, two modules: a class one of them
    hands to the other is two incompatible types, and mypy reports it (`demo` passing its
    `Options` to `self_heal` did). A relative import resolves under either name."""
    absolute = [hit for path in _example_modules() for hit in _absolute_example_imports(path)]
    assert absolute == [], "import sibling examples relatively:\n" + "\n".join(absolute)


def _private_names_imported(path: Path) -> list[str]:
    """Underscore names `path` imports from a sibling example module, as `file:line module.name`
    (`import x as _x`, a private alias of a public name, is not one)."""
    return [
        f"{path.relative_to(REPO)}:{node.lineno} {'.' * node.level}{node.module or ''}.{alias.name}"
        for node in ast.walk(ast.parse(path.read_text(), str(path)))
        if isinstance(node, ast.ImportFrom) and node.level > 0
        for alias in node.names
        if alias.name.startswith("_")
    ]


def test_no_example_module_imports_another_ones_private_names() -> None:
    """The large examples are packages split by concept; a helper one module of a package
    needs from another is that module's public name. An underscore name imported across
    modules is a promise the owner does not know it made: renaming or changing it looks
    local and breaks a sibling."""
    private = [hit for path in _example_modules() for hit in _private_names_imported(path)]
    assert private == [], "make these public names of the module that owns them:\n" + "\n".join(
        private
    )
