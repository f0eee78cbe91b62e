"""The README's two commands are what CI and a user run.

The second, `./scripts/test`, is this suite: CI runs exactly it (`.ci/run` execs the same
script), so a run of it is the run of the command. The first installs from the package index
and runs the demo, which no test may do offline; what it names is checked instead: the venv's
`pip install -e '.[dev]'` names an extra the project has, and `rollout-checkpoint demo` is the
project's own script with a verb that parses without arguments (tests/test_demo.py runs it).
"""

from __future__ import annotations

import re
import tomllib

from rollout_checkpoint.client.cli import main as cli

from .doc_pages import REPO, commands

DOC_SECTIONS = [("README.md", "The two commands")]
USER = "python3 -m venv .venv && . .venv/bin/activate && pip install -e '.[dev]' && rollout-checkpoint demo"


def command_lines() -> list[str]:
    """Each command of the section, without its comments."""
    lines = []
    for block in commands(*DOC_SECTIONS[0]):
        for line in block.splitlines():
            command = re.sub(r"\s+# .*$", "", line).strip()
            if command and not command.startswith("#"):
                lines.append(command)
    return lines


def test_the_two_commands_are_the_users_and_the_one_ci_runs() -> None:
    assert command_lines() == [USER, "./scripts/test"]
    ci = (REPO / ".ci" / "run").read_text().strip().splitlines()
    assert ci[-1] == "exec bash scripts/test"


def test_the_users_command_names_what_the_project_has() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert "dev" in project["optional-dependencies"]
    assert project["scripts"]["rollout-checkpoint"] == "rollout_checkpoint.client.cli.main:main"
    assert cli._parser().parse_args(["demo"]).command == "demo"
