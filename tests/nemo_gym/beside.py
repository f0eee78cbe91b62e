"""Install this tree beside nemo-gym: a throwaway venv that sees the cached nemo-gym env.

The cached environment (`scripts/nemo-gym-env`) is shared by every test and must not be
modified, so this makes a venv of the same interpreter that *sees* the cached env's
site-packages through a `.pth` file (after its own, so anything it installs would shadow the
env's copy) and `pip install`s a copy of this tree into it, without extras (the core install,
as a NeMo Gym user gets it). pip resolves our dependencies against everything visible: what the
env already satisfies stays, what is missing lands in the throwaway venv, at the version the dev
lock holds (a pip constraints file made from `requirements/dev.txt`; also for the isolated
build's setuptools), so the install is the same on any later day. Used by the tests'
`beside_nemo_gym` fixture and by the NeMo Gym benchmark (`benchmarks/nemo_gym.py`).

Standard library only (the benchmark imports it from the 3.11 venv, the tests from pytest).
About 3-10 s; needs PyPI (or pip's cache) for the few dependencies nemo-gym does not bring.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent.parent
ENV_SCRIPT = REPO / "scripts" / "nemo-gym-env"
# The parts of the tree a wheel is built from (pyproject's package-dir, readme).
WHEEL_SOURCES = ("pyproject.toml", "README.md", "gen", "server", "client", "examples")
PIP_TIMEOUT_S = 300.0
DEV_LOCK = REPO / "requirements" / "dev.txt"
NEMO_GYM_LOCK = REPO / "requirements" / "nemo-gym.txt"
# Needed only to build the wheel; pinned even where nemo-gym's env has its own copy.
BUILD_ONLY = {"setuptools"}


class BesideError(RuntimeError):
    """The install beside nemo-gym failed, or changed the shared env; the message says how."""


def child_env() -> dict[str, str]:
    """Our environment minus what would point the 3.12 interpreter at the 3.11 venv."""
    drop = {"PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV"}
    return {k: v for k, v in os.environ.items() if k not in drop}


def run(
    *command: str | Path, timeout: float = PIP_TIMEOUT_S, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(part) for part in command],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=child_env() | {"PIP_DISABLE_PIP_VERSION_CHECK": "1"} | (env or {}),
        stdin=subprocess.DEVNULL,
    )


def locked_entries(lock: Path) -> dict[str, str]:
    """Normalized name -> `name==version [; marker]` for every entry of a `scripts/lock` lock."""
    entries: dict[str, str] = {}
    for line in lock.read_text().splitlines():
        if line[:1].isalnum():
            requirement = line.rstrip(" \\")
            name = re.split(r"[=<>!~;\s\[]", requirement, maxsplit=1)[0]
            entries[re.sub(r"[-_.]+", "-", name).lower()] = requirement
    return entries


def locked_constraints() -> str:
    """A pip constraints file: every dev-lock pin of a distribution nemo-gym's env lacks.
    Those nemo-gym's env holds are left free: pip keeps the env's copy (a constraint naming
    another version would make it replace nemo-gym's, which the install must never do)."""
    in_env = set(locked_entries(NEMO_GYM_LOCK)) - BUILD_ONLY
    return "".join(
        f"{requirement}\n"
        for name, requirement in locked_entries(DEV_LOCK).items()
        if name not in in_env
    )


def purelib(python: Path) -> Path:
    result = run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    if result.returncode != 0:
        raise BesideError(f"{python} cannot tell its site-packages: {result.stderr[-2000:]}")
    return Path(result.stdout.strip())


def ready_env() -> Path:
    """The cached env's python if it is built, never building it (`--if-ready`); BesideError
    with the script's one line otherwise."""
    result = run("bash", ENV_SCRIPT, "--if-ready", timeout=120)
    if result.returncode != 0:
        lines = result.stderr.strip().splitlines() or [f"exit {result.returncode}"]
        raise BesideError(lines[-1])
    return Path(result.stdout.strip().splitlines()[-1])


def install_beside(nemo_python: Path, root: Path) -> Path:
    """The python of a new venv under `root` that sees `nemo_python`'s site-packages, with
    `pip install <a copy of this tree>` (core install). Raises BesideError when pip fails,
    when it would replace one of the env's packages, or when the env changed."""
    site_packages = purelib(nemo_python)
    env_before = sorted(p.name for p in site_packages.glob("*.dist-info"))
    created = run(nemo_python, "-m", "venv", "--without-pip", root / "venv", timeout=60)
    if created.returncode != 0:
        raise BesideError(f"python -m venv failed: {created.stderr[-2000:]}")
    python = root / "venv" / "bin" / "python"
    (purelib(python) / "nemo_gym_env.pth").write_text(f"{site_packages}\n")
    # From a copy of the tree: setuptools writes build/ next to the sources.
    tree = root / "tree"
    tree.mkdir()
    for name in WHEEL_SOURCES:
        source = REPO / name
        if source.is_dir():
            shutil.copytree(source, tree / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(source, tree / name)
    # The cached env's pip drives the throwaway interpreter (`--python`), so the venv needs
    # no pip of its own; without extras: the core install.
    # PIP_CONSTRAINT, not -c: it reaches the isolated build environment too.
    constraints = root / "constraints.txt"
    constraints.write_text(locked_constraints())
    installed = run(
        nemo_python,
        "-m",
        "pip",
        "--python",
        python,
        "install",
        "--no-compile",
        tree,
        env={"PIP_CONSTRAINT": str(constraints)},
    )
    if installed.returncode != 0:
        raise BesideError(
            f"pip install of this tree beside nemo-gym failed:\n{installed.stdout[-3000:]}"
            f"{installed.stderr[-3000:]}"
        )
    if "Not uninstalling" in installed.stdout:
        raise BesideError(f"pip wanted to replace a package of nemo-gym's env:\n{installed.stdout}")
    if sorted(p.name for p in site_packages.glob("*.dist-info")) != env_before:
        raise BesideError(f"installing beside nemo-gym changed its env at {site_packages}")
    return python
