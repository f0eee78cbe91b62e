"""What one run of the fleet left behind, as the invariants read it.

A run is the baseline, its second pass, or one trial. The engine (`trial`, `baseline`)
fills a `RunObservation` from what a user could see themselves (the collector's output file,
its exit code and notes, the published checkpoints, the members' health and logs, a scoped
checkpoint of the sessions after the run); the checks (`invariants`, `determinism`) are pure
functions of observations, so each can be tested on a hand-made observation and a finding
can always be traced back to a file.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class RunObservation:
    """One run of the fleet, seen from outside."""

    label: str
    """`baseline`, `baseline-2` or `trial N`."""
    expected: list[str]
    """Every rollout id the run had to finish (task x repeat), in input order."""
    tasks: dict[str, dict[str, Any]]
    """Rollout id -> its task row (its `resources_server` names the server its tools hit)."""
    rows: list[dict[str, Any]] = field(default_factory=list)
    """Every line of the collector's output, in file order (a rollout written twice is here
    twice)."""
    exports: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Resources member (fleet-file name) -> rollout id -> the session state it exported
    after the run (a scoped checkpoint of every finished attempt). A member that exports
    nothing (stateless, restart_only) is absent."""
    published: list[str] = field(default_factory=list)
    """Checkpoint ids the run published (each read back, the latest restored: `RestoreBench`)."""
    restore_failures: dict[str, str] = field(default_factory=dict)
    """Checkpoint id -> why it did not read back, or restore (a failure in place is confirmed
    in fresh processes: `aftermath.RestoreBench`)."""
    reopen_seconds: float | None = None
    """From the fault to every member ready (admission open) again; None: never within
    `reopen_deadline` (or, on a run without a fault, not measured)."""
    reopen_deadline: float = 0.0
    untyped: list[str] = field(default_factory=list)
    """Refusals and failures without a reason of the contract, each `where: line` (an
    unknown exit code, an INTERNAL status, a traceback in a member's log)."""
    model_misses: list[tuple[str, str]] = field(default_factory=list)
    """(rollout id, path) of every policy-model call the replay did not find recorded."""
    restarted: dict[str, str] = field(default_factory=dict)
    """Rollout id -> the reason the product gave for restarting it from its input."""
    sent_before_kill: dict[str, list[tuple[str, int]]] = field(default_factory=dict)
    """Member -> every (rollout id, attempt) the collector had sent (its dispatch log, written
    ahead of the send) when that member was SIGKILLed. Such an attempt's ended session died
    with the process (a finished rollout is in no checkpoint's scope to restore it from), so
    its missing export is the fault's doing, not the server's; an attempt sent after the kill
    can only hold state in the replacement, which must export it."""
    held_after: dict[str, int] = field(default_factory=dict)
    """Entry member (fleet-file name) -> the results it still held under receipts after the
    run (ListResults), for those holding any."""
    controller_exit: int | None = None
    """The collector's last exit code (None: it never ended)."""
    notes: list[str] = field(default_factory=list)
    """What the collector said along the way (its progress notes), for the report."""
