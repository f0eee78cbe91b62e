"""Every command a page shows is run by a test (issue 29), and the README stays a short door.

A command is a fenced `sh` block (the convention is `tests/doc_pages.py`'s). A test that runs
the commands of a section declares it, `DOC_SECTIONS = [(page, heading), ...]` at its module's
top level, and reads the section's commands with `doc_pages.commands(page, heading)`, which hands
it every command block there. This test reads the declarations from the test modules' source
(importing nothing) and fails when a page shows a command block in no declared section, when a
declaration names a section without one, and when a declaring module never reads its commands
through the helper (it could run a copy of its own instead of the page).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from .doc_pages import REPO, blocks, commands, pages, relative

TESTS = Path(__file__).resolve().parent
README_MOST_LINES = 250


def declarations() -> dict[tuple[str, str], list[str]]:
    """(page, heading) -> the test modules that declare they run its commands."""
    declared: dict[tuple[str, str], list[str]] = {}
    for module in sorted(TESTS.glob("test_*.py")):
        for node in ast.parse(module.read_text()).body:
            if (
                isinstance(node, ast.Assign)
                and any(isinstance(t, ast.Name) and t.id == "DOC_SECTIONS" for t in node.targets)
            ) or (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and node.target.id == "DOC_SECTIONS"
            ):
                assert node.value is not None
                for page, heading in ast.literal_eval(node.value):
                    declared.setdefault((page, heading), []).append(module.name)
    return declared


def reads_commands_through_the_helper(module: str) -> bool:
    tree = ast.parse((TESTS / module).read_text())
    imported = any(
        isinstance(node, ast.ImportFrom)
        and node.module == "doc_pages"
        and any(alias.name == "commands" for alias in node.names)
        for node in ast.walk(tree)
    )
    called = any(
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "commands"
        for node in ast.walk(tree)
    )
    return imported and called


def test_every_command_block_of_every_page_is_run_by_a_test() -> None:
    declared = declarations()
    unrun = []
    for page in pages():
        for block in blocks(page.read_text()):
            if block.is_command and not any(
                (relative(page), heading) in declared for heading in block.headings
            ):
                first = block.body.strip().splitlines()[0] if block.body.strip() else ""
                unrun.append(f"{relative(page)}:{block.line} {' > '.join(block.headings)}: {first}")
    assert unrun == [], (
        "command blocks (```sh) that no test runs: run them from a test that declares the "
        "section in DOC_SECTIONS, or fence them as what they are (text, toml, yaml, ...):\n"
        + "\n".join(unrun)
    )


def test_every_declared_section_has_commands_that_its_runner_reads_from_the_page() -> None:
    declared = declarations()
    assert declared, "no test declares DOC_SECTIONS"
    for (page, heading), modules in declared.items():
        assert commands(page, heading), (page, heading)  # the section exists and has commands
        for module in modules:
            assert reads_commands_through_the_helper(module), (
                f"{module} declares {page}, {heading!r} but never calls doc_pages.commands"
            )


def test_the_readme_is_short_and_links_every_docs_page() -> None:
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= README_MOST_LINES
    linked = set(re.findall(r"\]\((docs/[^)#\s]+\.md)(?:#[^)]*)?\)", readme))
    for page in sorted((REPO / "docs").rglob("*.md")):
        assert relative(page) in linked, f"README.md does not link {relative(page)}"


def test_the_page_parser_finds_commands_by_their_fence_and_their_headings() -> None:
    """The negative control of the checks above: a `sh` block is a command, under its
    headings; a `#` line inside a block is no heading; other fences are no command."""
    text = (
        "# Page\n\n## Run\n\n```sh\n# a comment, not a heading\necho hi\n```\n\n"
        "### Deeper\n\n  ```sh\n  echo nested\n  ```\n\n## File\n\n```toml\nkey = 1\n```\n"
    )
    found = blocks(text)
    assert [(b.info, b.headings, b.is_command) for b in found] == [
        ("sh", ("Page", "Run"), True),
        ("sh", ("Page", "Run", "Deeper"), True),
        ("toml", ("Page", "File"), False),
    ]
    assert found[0].body == "# a comment, not a heading\necho hi\n"
    assert found[1].body == "echo nested\n"
