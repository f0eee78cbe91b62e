"""certify's `report.html` in a real browser: headless Chromium from Debian's packages.

The page Chromium builds (`--dump-dom`) must show the matrix with every cell labelled, a
hostile rollout id and JSON path as text (had either been markup, the DOM would hold an
`img` or a `script`), and nothing that loads from anywhere; and `scripts/certify-screenshot`
must make a PNG of the asked size from it. The browser runs with every host name mapped to
nothing, so a page that needed the network could not hide it behind a cache.
"""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
from pathlib import Path

import pytest

from rollout_checkpoint.client.certify.findings import Fault, Phase
from rollout_checkpoint.client.certify.report import write_report

from .certify_reports import HOSTILE_ID, HOSTILE_PATH, sample_report
from .processes import REPO
from .test_certify_report import parsed

BROWSER_SECONDS = 180
"""Chromium starts in about a second on an idle machine; the suite's machine is not idle."""


def chromium() -> str:
    found = shutil.which("chromium")
    if found is None:
        pytest.fail("chromium is not installed: apt-get install chromium (scripts/test does)")
    return found


def test_chromium_renders_the_report_with_hostile_ids_as_text(tmp_path: Path) -> None:
    _, html_path = write_report(tmp_path / "report", sample_report())
    run = subprocess.run(
        [
            chromium(),
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--no-first-run",
            f"--user-data-dir={tmp_path / 'profile'}",
            "--host-resolver-rules=MAP * ~NOTFOUND",
            "--dump-dom",
            html_path.as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=BROWSER_SECONDS,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    dom = parsed(run.stdout)
    assert {"img", "script", "link", "iframe", "object"}.isdisjoint(dom.tags)
    assert not [v for _, v in dom.attributes if v and ("://" in v or v.startswith("//"))]
    text = "".join(dom.text)
    assert HOSTILE_ID in text and HOSTILE_PATH in text
    assert "Verdict: violated" in text
    assert len(dom.cells) == len(Fault) * len(Phase)
    assert dom.cells[("kill_fleet", "after_snapshot")] == ("violated", "violated")
    assert dom.cells[("kill_member", "prepare")] == ("held", "held")
    assert dom.cells[("stop_member", "restore")] == ("not_reached", "not reached")


def test_the_screenshot_script_makes_a_png_of_the_asked_size(tmp_path: Path) -> None:
    chromium()
    write_report(tmp_path / "report", sample_report())
    out = tmp_path / "shot.png"
    run = subprocess.run(
        ["bash", str(REPO / "scripts" / "certify-screenshot"), str(tmp_path / "report"), str(out)],
        env=dict(os.environ, CERTIFY_SCREENSHOT_SIZE="1200,900"),
        capture_output=True,
        text=True,
        timeout=BROWSER_SECONDS,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert struct.unpack(">II", data[16:24]) == (1200, 900)  # IHDR: width, height


def test_the_screenshot_script_says_what_is_missing(tmp_path: Path) -> None:
    run = subprocess.run(
        ["bash", str(REPO / "scripts" / "certify-screenshot"), str(tmp_path), "out.png"],
        capture_output=True,
        text=True,
        timeout=BROWSER_SECONDS,
        check=False,
    )
    assert (run.returncode, run.stderr.strip()) == (
        2,
        f"scripts/certify-screenshot: no report.html in {tmp_path}",
    )
