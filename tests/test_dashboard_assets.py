"""The dashboard's files as the package ships them: the vendored chart library is exactly the
released one (so nobody edits it by hand), and the page's own files keep the rules that make
hostile text harmless (tests/test_dashboard_browser.py checks the same in a real browser).

That every file is in the wheel is tests/test_layout.py's wheel test."""

from __future__ import annotations

import hashlib
import json
import re
from importlib import resources

from rollout_checkpoint.client.coordinator import dashboard

PACKAGE = resources.files(dashboard.__name__)
MANIFEST = json.loads(PACKAGE.joinpath("vendored.json").read_text())


def test_the_vendored_files_are_the_released_ones() -> None:
    (library,) = MANIFEST.values()
    assert library["license"] == "MIT"
    for name, vendored in library["files"].items():
        digest = hashlib.sha256(PACKAGE.joinpath(name).read_bytes()).hexdigest()
        assert digest == vendored["sha256"], f"{name} is not the file of {library['source']}"
    license_text = PACKAGE.joinpath("uPlot.LICENSE").read_text()
    assert "MIT License" in license_text
    header = PACKAGE.joinpath("uPlot.iife.min.js").read_text()[:80]
    assert f"(v{library['version']})" in header


def test_every_served_file_is_in_the_package() -> None:
    shipped = {path.name for path in PACKAGE.iterdir()}
    assert set(dashboard.ASSETS) <= shipped


def test_the_page_has_no_inline_script_style_or_handler() -> None:
    """`default-src 'self'` would block them anyway; none is written, so nothing the page
    needs depends on the policy being relaxed."""
    page = PACKAGE.joinpath(dashboard.PAGE).read_text()
    scripts = re.findall(r"<script\b[^>]*>", page)
    assert scripts and all(" src=" in tag for tag in scripts)
    assert not re.search(r"<script\b[^>]*>\s*[^<\s]", page)
    assert not re.search(r"\son[a-z]+\s*=", page, re.IGNORECASE)
    assert not re.search(r"<style\b|\sstyle\s*=", page, re.IGNORECASE)
    assert not re.search(r"(src|href)=\"(https?:)?//", page)


def test_the_script_inserts_no_markup() -> None:
    """Every value from the API goes in as text: ids and messages are hostile input."""
    script = PACKAGE.joinpath("app.js").read_text()
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval("):
        assert sink not in script, sink
    assert "textContent" in script
