"""The committed locks agree with their inputs, and the test environment is the lock (issue 28).

`scripts/test` installs `requirements/dev.txt` with `--require-hashes`, so the verdict of the
test command depends on the repository alone, not on the day it runs: a new release of a stub
or tool package cannot turn a fresh clone red. That holds only while the lock is what
`pyproject.toml` asks for; a dependency added or tightened without `scripts/lock` fails here.
"""

from __future__ import annotations

import copy
import importlib.metadata
import re
import tomllib
from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from .locks import DEV_LOCK, NEMO_GYM_LOCK, REPO, LockedPin, read_lock

PROJECT = "rollout-checkpoint"


def pyproject() -> dict[str, Any]:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def project_requirements(config: dict[str, Any]) -> list[Requirement]:
    """What the dev lock is compiled from: the runtime dependencies and the `dev` extra."""
    project = config["project"]
    return [Requirement(r) for r in project["dependencies"]] + [
        Requirement(r) for r in project["optional-dependencies"]["dev"]
    ]


def disagreements(config: dict[str, Any], pins: list[LockedPin]) -> list[str]:
    """Every way `pins` fails to be the lock of `config`; empty when they agree."""
    by_name: dict[str, list[LockedPin]] = {}
    for pin in pins:
        by_name.setdefault(pin.name, []).append(pin)
    problems: list[str] = []
    wanted = project_requirements(config)
    for requirement in wanted:
        locked = by_name.get(canonicalize_name(requirement.name), [])
        if not locked:
            problems.append(f"{requirement} is not in the lock")
        for pin in locked:
            if not requirement.specifier.contains(pin.version, prereleases=True):
                problems.append(f"{requirement} does not allow the locked {pin.requirement}")
    direct = {pin.name for pin in pins if f"{PROJECT} (pyproject.toml)" in pin.required_by}
    asked = {canonicalize_name(r.name) for r in wanted}
    problems += [
        f"{name} is locked as a direct requirement but pyproject.toml no longer asks for it"
        for name in sorted(direct - asked)
    ]
    problems += [
        f"{name} is asked for but the lock does not record it as direct"
        for name in sorted(asked - direct)
    ]
    return problems


def test_the_dev_lock_is_the_lock_of_pyproject() -> None:
    assert disagreements(pyproject(), read_lock(DEV_LOCK)) == [], (
        "pyproject.toml and requirements/dev.txt disagree: run scripts/lock"
    )


@pytest.mark.parametrize(
    "change",
    [
        "a dependency added",
        "a dev tool added",
        "a dependency removed",
        "a specifier the locked version leaves",
    ],
)
def test_a_pyproject_that_moved_away_from_its_lock_is_caught(change: str) -> None:
    """The negative control: each kind of edit made without `scripts/lock` is reported."""
    config = copy.deepcopy(pyproject())
    project = config["project"]
    if change == "a dependency added":
        project["dependencies"].append("a-package-nobody-locked>=1")
    elif change == "a dev tool added":
        project["optional-dependencies"]["dev"].append("another-linter")
    elif change == "a dependency removed":
        project["dependencies"] = [d for d in project["dependencies"] if not d.startswith("rich")]
    else:
        project["dependencies"] = [
            "msgspec>=999" if d.startswith("msgspec") else d for d in project["dependencies"]
        ]
    assert disagreements(config, read_lock(DEV_LOCK)) != []


@pytest.mark.parametrize("lock", [DEV_LOCK, NEMO_GYM_LOCK], ids=lambda p: p.name)
def test_every_locked_distribution_is_pinned_with_hashes(lock: Path) -> None:
    pins = read_lock(lock)
    assert pins
    assert [pin.requirement for pin in pins if pin.hashes == 0] == []
    header = lock.read_text().splitlines()[:2]
    assert header[1].strip() == "#    scripts/lock", "written by hand, not by scripts/lock"


def test_the_nemo_gym_lock_pins_the_version_its_env_is_built_for() -> None:
    script = (REPO / "scripts" / "nemo-gym-env").read_text()
    (version,) = re.findall(r"^NEMO_GYM_VERSION=(\S+)$", script, re.MULTILINE)
    pinned = [pin.version for pin in read_lock(NEMO_GYM_LOCK) if pin.name == "nemo-gym"]
    assert pinned == [version]


def test_the_running_test_environment_is_the_dev_lock() -> None:
    """What `scripts/test` installed is exactly what the lock says, for every pin that applies
    to this interpreter (a stale venv, or an install that resolved instead of reading the
    lock, shows here)."""
    wrong = []
    for pin in read_lock(DEV_LOCK):
        marker = pin.requirement.marker
        if marker is not None and not marker.evaluate():
            continue
        try:
            installed = importlib.metadata.version(pin.requirement.name)
        except importlib.metadata.PackageNotFoundError:
            installed = "(missing)"
        if installed != pin.version:
            wrong.append(f"{pin.name}: locked {pin.version}, installed {installed}")
    assert wrong == []
