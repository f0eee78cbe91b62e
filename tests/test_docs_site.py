"""The docs site (docs/, Sphinx) builds strictly, its API page lists the public API, and its
contract page is what the protos' comments generate.

The build is the command the landing page shows (`scripts/docs`: sphinx-build -W --keep-going),
run as written: a warning (a broken link or cross-reference, a missing page, a page outside
every toctree, a docstring autodoc cannot render) fails it. A second build of a copy with
broken pages checks that it does fail, so the strictness cannot be dropped unnoticed.
"""

from __future__ import annotations

import importlib
import inspect
import os
import re
import shutil
import sys
from pathlib import Path
from types import ModuleType

import pytest

from .doc_pages import commands
from .processes import REPO, explain, run, run_shell_script

DOCS = REPO / "docs"
DOC_SECTIONS = [("docs/index.md", "About this site")]
BUILD_SECONDS = 240.0
"""Bound on one build: about 5 s of CPU, several times that on a loaded 2-core machine."""

# The modules whose names a user's code imports: the controller library's one public module
# and the server side a user's own server is built from. Each must have a section on the page.
PUBLIC_MODULES = (
    "rollout_checkpoint.client",
    "rollout_checkpoint.server.resources",
    "rollout_checkpoint.server.nemo_gym",
    "rollout_checkpoint.server.runtime.install",
    "rollout_checkpoint.server.runtime.settings",
    "rollout_checkpoint.server.runtime.participant",
)


def build(out: Path, src: Path = DOCS) -> tuple[str, str, int | None]:
    """Run the landing page's build command as a reader would, into `out`."""
    (command,) = commands(*DOC_SECTIONS[0])
    env = {**os.environ, "PYTHON": sys.executable, "DOCS_OUT": str(out), "DOCS_SRC": str(src)}
    ran = run_shell_script(command, REPO, env, BUILD_SECONDS)
    return ran.stdout, ran.stderr, ran.returncode


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    stdout, stderr, status = build(out)
    assert status == 0, f"the strict docs build failed (exit {status}):\n{stdout}\n{stderr}"
    return out


def test_the_landing_page_shows_exactly_the_build_command() -> None:
    assert commands(*DOC_SECTIONS[0]) == ["scripts/docs\n"]


def toctree_pages() -> list[str]:
    """The pages of the landing page's table of contents, in its order."""
    toctree = re.search(r"```\{toctree\}\n(.*?)```", (DOCS / "index.md").read_text(), re.DOTALL)
    assert toctree is not None
    return [line for line in toctree.group(1).splitlines() if line and not line.startswith(":")]


def test_the_readme_table_lists_the_site_pages_in_its_order() -> None:
    """The README's table of the docs pages is the site's table of contents: a newcomer who
    reads one and browses the other meets the same pages in the same order."""
    readme = (REPO / "README.md").read_text()
    section = readme.split("## The documentation", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| \[[^\]]+\]\(docs/([\w-]+)\.md\) \|", section, re.MULTILINE)
    assert rows == toctree_pages()


def test_what_is_in_the_box_has_a_row_for_every_folder() -> None:
    """The getting-started page's "What is in the box" table is the layout a newcomer goes
    by: every top-level folder of the repository, and every package of the server side and
    of the controller library, has its row (a row may name a folder below it)."""
    page = (DOCS / "getting-started.md").read_text()
    section = page.split("## What is in the box", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `([\w./-]+)` \|", section, re.MULTILINE)
    tracked = run("git", "ls-files").stdout.splitlines()
    folders = {path.split("/")[0] for path in tracked if "/" in path and not path.startswith(".")}
    assert sorted(f for f in folders if not any(r.split("/")[0] == f for r in rows)) == []
    packages = {
        f"{init.parent.relative_to(REPO)}/"
        for side in ("server", "client")
        for init in (REPO / side).glob("*/__init__.py")
    }
    assert sorted(packages - set(rows)) == []


def test_the_site_builds_strictly_with_every_page(site: Path) -> None:
    pages = toctree_pages()
    assert pages == [
        "getting-started",
        "your-server",
        "controllers",
        "grpcurl",
        "operations",
        "kubernetes",
        "object-store",
        "guarantees",
        "certify",
        "trainers",
        "benchmarks",
        "api",
        "contract",
    ]
    for page in ["index", *pages]:
        assert (site / f"{page}.html").is_file(), page


def test_a_broken_page_fails_the_build(tmp_path: Path) -> None:
    broken = tmp_path / "docs"
    shutil.copytree(DOCS, broken, ignore=shutil.ignore_patterns("_build"))
    # The API page without its modules: this build is about pages and links, and importing
    # the package for autodoc is most of a build's time.
    (broken / "api.md").write_text("# Python API reference\n")
    (broken / "orphan.md").write_text("# A page no toctree lists\n")
    with (broken / "guarantees.md").open("a") as page:
        page.write(
            "\nSee [a missing page](missing.md), [a missing anchor](#no-such-heading) and"
            " {py:class}`rollout_checkpoint.client.NoSuchName`.\n"
        )
    stdout, stderr, status = build(tmp_path / "out", broken)
    assert status != 0, f"the build passed with broken pages:\n{stdout}\n{stderr}"
    for problem in (
        "orphan.md: WARNING: document isn't included in any toctree",
        "target not found: 'missing.md'",
        "target not found: 'no-such-heading'",
        "reference target not found: rollout_checkpoint.client.NoSuchName",
    ):
        assert problem in stderr, f"{problem!r} not reported:\n{stderr}"


def public_names(module: ModuleType) -> list[str]:
    """Its `__all__`; for a module without one, the public classes and functions it defines."""
    if hasattr(module, "__all__"):
        return list(module.__all__)
    return [
        name
        for name, value in vars(module).items()
        if not name.startswith("_")
        and (inspect.isclass(value) or inspect.isfunction(value))
        and value.__module__ == module.__name__
    ]


def test_the_api_page_lists_every_public_name(site: Path) -> None:
    """Read from the page itself, so a section added to docs/api.md is held to it too; a
    name added to a module's `__all__` must appear without editing the page."""
    documented = re.findall(r"^\.\. automodule:: (\S+)$", (DOCS / "api.md").read_text(), re.M)
    assert set(PUBLIC_MODULES) <= set(documented), set(PUBLIC_MODULES) - set(documented)
    ids = set(re.findall(r'id="([^"]+)"', (site / "api.html").read_text()))
    missing = [
        f"{module_name}.{name}"
        for module_name in documented
        for name in public_names(importlib.import_module(module_name))
        if f"{module_name}.{name}" not in ids
    ]
    assert not missing, f"public names missing from the API page: {missing}"


def test_the_contract_page_is_what_the_protos_generate(tmp_path: Path) -> None:
    # PYTHON pins buf to this interpreter's venv, as test_contract does for gen/.
    env = {**os.environ, "PYTHON": sys.executable}
    proc = run("bash", "scripts/contract-doc", tmp_path / "contract.md", env=env)
    assert proc.returncode == 0, explain(proc)
    fresh = (tmp_path / "contract.md").read_text()
    assert "### Service `ParticipantService`" in fresh, "the generator wrote no services"
    assert fresh == (DOCS / "contract.md").read_text(), (
        "docs/contract.md is stale: run scripts/contract-doc and commit it"
    )
