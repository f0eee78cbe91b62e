"""Optional extras: the packages a feature that is off by default needs, checked when it is on.

`mcp` and `grpcio-reflection` are extras (`rollout-checkpoint[mcp]`, `[reflection]`), not
dependencies: nemo-gym 0.4.0 pins `mcp<2`, and a hard `mcp>=2.3` made us uninstallable beside
it for a feature (tools over MCP) that is off by default. So no module imports them at load
time; the code that serves the feature calls `require` first, when the feature is configured,
and a missing (or too old) package ends startup with one line naming the extra to install,
instead of an ImportError traceback from inside the app's lifespan or, worse, from importing
an unrelated module. Stdlib only: the core's values import no third-party package.

nemo-gym is checked the same way (`serve nemo-gym:<server>`), though it is no extra of ours:
it needs Python >= 3.12 and brings ray, and who serves NeMo Gym's servers has it already. Its
line says to install nemo-gym itself (`Extra.install`).
"""

from __future__ import annotations

import importlib
import importlib.metadata
from dataclasses import dataclass

__all__ = ["MCP", "NEMO_GYM", "REFLECTION", "S3", "Extra", "MissingExtra", "require"]


@dataclass(frozen=True)
class Extra:
    """One optional extra: its name in `pip install rollout-checkpoint[name]`, the
    distribution and version range it installs, and the modules that must import.

    `install`: what the operator should install when it is not `rollout-checkpoint[name]`
    (a package that is no extra of ours)."""

    name: str
    distribution: str
    requirement: str
    modules: tuple[str, ...]
    install: str | None = None

    @property
    def remedy(self) -> str:
        """The end of the one line: what to install."""
        return f"install {self.install or f'rollout-checkpoint[{self.name}]'}"


# `mcp_types` is a separate package of the mcp 2.x line: with mcp 1.x (what nemo-gym 0.4.0
# brings) `mcp` imports but `mcp_types` does not, and our MCP module uses the 2.x API.
MCP = Extra("mcp", "mcp", "mcp>=2.3,<3", ("mcp", "mcp_types"))
REFLECTION = Extra(
    "reflection", "grpcio-reflection", "grpcio-reflection>=1.85.1", ("grpc_reflection",)
)
# Checkpoint locations on object stores (s3://, gs://, az://): obstore, chosen by measurement
# (benchmarks/object_store_clients.py), imported only when such a location is named.
S3 = Extra("s3", "obstore", "obstore>=0.12.1,<0.13", ("obstore",))
# What `serve nemo-gym:<server>` needs: NeMo Gym's server utilities (the session key, the
# ServerClient); the server's own module is added per server. 0.4.0 is the version tested
# (tests/test_nemo_gym_*.py), the newest that runs on Python 3.12.
NEMO_GYM = Extra(
    "nemo-gym",
    "nemo-gym",
    "nemo-gym==0.4.0",
    ("nemo_gym.server_utils",),
    install="nemo-gym==0.4.0 in this environment (it needs Python >= 3.12)",
)


class MissingExtra(Exception):
    """A configured feature whose optional package is not installed (or is too old).

    `str()` is the one line to show the operator: the feature, what it needs, what is
    installed instead, and the `pip install` that fixes it."""

    def __init__(self, feature: str, extra: Extra, installed: str | None) -> None:
        self.feature = feature
        self.extra = extra
        self.installed = installed
        found = (
            f"{extra.distribution} {installed} is installed"
            if installed
            else f"{extra.distribution} is not installed"
        )
        super().__init__(f"{feature} needs {extra.requirement} ({found}): {extra.remedy}")


def require(extra: Extra, feature: str) -> None:
    """Import `extra`'s modules, or raise `MissingExtra` naming `feature` and the extra.

    Called when `feature` is configured, before anything is served; an import that fails
    for any reason (absent, another major version, a broken install) is a `MissingExtra`,
    chained to the ImportError for whoever debugs it."""
    for module in extra.modules:
        try:
            importlib.import_module(module)
        except ImportError as error:
            raise MissingExtra(feature, extra, _installed_version(extra.distribution)) from error


def _installed_version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None
