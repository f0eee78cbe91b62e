"""The demo's report: numbers, named boolean checks and the problems behind failed ones."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Report:
    """What `report.json` holds. A check recorded several times (once per part, per rollout)
    stays failed once it failed, so a later success cannot hide an earlier problem; each
    failure's reason is kept in `problems`."""

    numbers: dict[str, Any] = field(default_factory=dict)
    checks: dict[str, bool] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    def check(self, name: str, ok: bool, problem: str = "") -> None:
        self.checks[name] = self.checks.get(name, True) and ok
        if not ok and problem:
            self.problems.append(f"{name}: {problem}")

    @property
    def passed(self) -> bool:
        return all(self.checks.values())


class DemoFailed(Exception):
    """A step that cannot go on (the fleet did not get prepared): the tour stops, and `main`
    records it as the failed check `demo_completed` (exit 1) instead of a traceback."""
