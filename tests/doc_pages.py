"""The documentation's pages as the tests read them: their sections and the commands in them.

The convention every page follows: a fenced block whose info string is `sh` is a *command*, what
a reader types into a shell; a file's contents are fenced by their language (`python`, `toml`,
`yaml`), and an output, a sketch or a command shown only as an example (placeholders such as
`...`, addresses of another machine) is `text`. Every command block of README.md and
docs/**/*.md is run by a test (issue 29): a test that runs the commands of a section reads them
with `commands(page, heading)`, which hands it every command block of that section, and declares
the section in its module's `DOC_SECTIONS`; `tests/test_doc_commands.py` fails when a command
block lies in no declared section, or a declared section has none.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
COMMAND_FENCE = "sh"
FENCE = re.compile(r"^(?P<indent>[ ]*)```(?P<info>[^`\n]*)$")
HEADING = re.compile(r"^(?P<level>#{1,6}) (?P<title>.+?)\s*$")


def pages() -> list[Path]:
    """README.md and every Markdown page of the docs site."""
    return [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def relative(page: Path) -> str:
    return page.relative_to(REPO).as_posix()


@dataclass(frozen=True)
class Block:
    """One fenced block: its info string, its body, and the headings it lies under."""

    info: str
    body: str
    headings: tuple[str, ...]  # outermost first
    line: int  # of the opening fence, 1-based

    @property
    def is_command(self) -> bool:
        return self.info.split(maxsplit=1)[0] == COMMAND_FENCE if self.info else False


def blocks(text: str) -> list[Block]:
    """Every fenced block of `text`, with the headings above it (a `#` line inside a block is
    a shell comment or an output line, never a heading)."""
    found: list[Block] = []
    open_headings: list[tuple[int, str]] = []
    opening: tuple[str, int, str] | None = None  # (info, line, indent)
    body: list[str] = []
    for number, line in enumerate(text.split("\n"), start=1):
        fence = FENCE.match(line)
        if opening is None:
            if fence:
                opening = (fence["info"].strip(), number, fence["indent"])
                body = []
                continue
            heading = HEADING.match(line)
            if heading:
                level = len(heading["level"])
                open_headings = [(lv, t) for lv, t in open_headings if lv < level]
                open_headings.append((level, heading["title"]))
            continue
        if fence and fence["info"] == "" and len(fence["indent"]) <= len(opening[2]):
            info, start, indent = opening
            text_body = "\n".join(b.removeprefix(indent) for b in body) + "\n"
            found.append(Block(info, text_body, tuple(t for _, t in open_headings), start))
            opening = None
            continue
        body.append(line)
    assert opening is None, f"a fence opened on line {opening[1]} never closes"
    return found


def section_blocks(page: str, heading: str) -> list[Block]:
    """Every block of `page` (a path from the repository root) under the heading `heading`
    (its exact title, any level), its subsections included."""
    path = REPO / page
    text = path.read_text()
    titles = [m["title"] for m in map(HEADING.match, _outside_fences(text)) if m]
    assert heading in titles, f"{page} has no heading {heading!r}"
    return [block for block in blocks(text) if heading in block.headings]


def commands(page: str, heading: str) -> list[str]:
    """The bodies of every command block of the section, in order: what a runner runs."""
    found = [block.body for block in section_blocks(page, heading) if block.is_command]
    assert found, f"{page}, {heading!r}: no command block"
    return found


def _outside_fences(text: str) -> list[str]:
    lines: list[str] = []
    inside = False
    for line in text.split("\n"):
        if FENCE.match(line):
            inside = not inside
            continue
        if not inside:
            lines.append(line)
    return lines
