"""Reading the committed locks (`requirements/*.txt`, written by `scripts/lock`).

Each lock is `uv pip compile --generate-hashes` output: one entry per pinned distribution,
`name==version [; marker]`, its `--hash` lines, and `# via` lines naming what required it.
A universal lock may pin one name twice under exclusive markers (one version per Python).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parent.parent
DEV_LOCK = REPO / "requirements" / "dev.txt"
NEMO_GYM_LOCK = REPO / "requirements" / "nemo-gym.txt"

_ENTRY = re.compile(r"^(?P<requirement>[A-Za-z0-9][^\\#]*?)\s*(\\)?$")
_HASH = re.compile(r"^\s+--hash=sha256:[0-9a-f]{64}\s*\\?$")
_VIA_ONE = re.compile(r"^\s+# via (?P<who>.+)$")
_VIA_MORE = re.compile(r"^\s+#   (?P<who>.+)$")


@dataclass
class LockedPin:
    requirement: Requirement  # name==version, with the marker the lock gives it
    hashes: int = 0
    required_by: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        return canonicalize_name(self.requirement.name)

    @property
    def version(self) -> str:
        (specifier,) = self.requirement.specifier
        return specifier.version


def read_lock(path: Path) -> list[LockedPin]:
    """Every entry of a lock, in order. Raises ValueError on a line it cannot place, so a
    hand edit that breaks the format fails loudly instead of being skipped."""
    pins: list[LockedPin] = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        if entry := _ENTRY.match(line):
            requirement = Requirement(entry["requirement"])
            specifiers = list(requirement.specifier)
            if len(specifiers) != 1 or specifiers[0].operator != "==":
                raise ValueError(f"{path.name}:{number}: not an exact pin: {line!r}")
            pins.append(LockedPin(requirement))
        elif not pins:
            raise ValueError(f"{path.name}:{number}: a line before the first entry: {line!r}")
        elif _HASH.match(line):
            pins[-1].hashes += 1
        elif via := _VIA_ONE.match(line) or _VIA_MORE.match(line):
            if via["who"] != "":
                pins[-1].required_by.append(via["who"].strip())
        elif line.strip() != "# via":
            raise ValueError(f"{path.name}:{number}: unexpected line: {line!r}")
    return pins


def constraints_for(pins: list[LockedPin], *, leave_out: set[str]) -> str:
    """A pip constraints file (`name==version ; marker`, no hashes) of `pins`, without the
    names in `leave_out`."""
    return "".join(f"{pin.requirement}\n" for pin in pins if pin.name not in leave_out)
