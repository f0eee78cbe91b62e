"""Live progress of a prepare: a rich table on a terminal (stderr), JSON lines with
`--json`, the blockers as plain lines otherwise."""

from __future__ import annotations

import json
import sys
from typing import Any

from rich.live import Live
from rich.table import Table

from rollout_checkpoint.client.checkpointing.checkpoint import CheckpointEvent, Phase
from rollout_checkpoint.client.checkpointing.fanout import FleetProgress
from rollout_checkpoint.client.cli.console import make_console
from rollout_checkpoint.client.cli.names import state_name
from rollout_checkpoint.client.fleet import KIND_NAMES


class ProgressView:
    """Live progress on stderr: a rich table on a terminal, JSON lines (stdout) with --json,
    plain lines else."""

    def __init__(self, as_json: bool) -> None:
        self.as_json = as_json
        self.console = make_console(stderr=True)
        self.live: Live | None = None
        self.phase = Phase.PREPARE
        if not as_json and self.console.is_terminal:
            self.live = Live(console=self.console, refresh_per_second=10, transient=True)

    def __enter__(self) -> ProgressView:
        if self.live is not None:
            self.live.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.live is not None:
            self.live.__exit__(None, None, None)

    def event(self, event: CheckpointEvent) -> None:
        self.phase = event.phase
        if event.progress is not None and event.phase == Phase.PREPARE:
            self.update(event.progress)
        elif self.as_json:
            print(
                json.dumps({"phase": event.phase, **{k: v for k, v in event.detail.items()}}),
                flush=True,
            )

    def update(self, progress: FleetProgress) -> None:
        if self.as_json:
            print(json.dumps(progress_json(progress), sort_keys=True), flush=True)
        elif self.live is not None:
            self.live.update(_progress_table(progress, self.phase))

    def final(self, progress: FleetProgress) -> None:
        if not self.as_json:
            for member, blocker in progress.blockers():
                print(f"  {member}: {blocker.capture_key or '-'} {blocker.detail}", file=sys.stderr)


def progress_json(progress: FleetProgress) -> dict[str, Any]:
    """A prepare's progress as one JSON object (the `--json` progress lines and `prepare`'s result)."""
    return {
        "phase": "PREPARE",
        "stage": KIND_NAMES.get(progress.stage, "?"),
        "sequence": progress.sequence,
        "elapsed": round(progress.elapsed, 6),
        "outcome": progress.outcome,
        "blocker_count": progress.blocker_count(),
        "members": [
            {
                "name": m.name,
                "reached": m.reached,
                "state": state_name(m.state, "-"),
                "blockers": m.readiness.blocker_count,
            }
            for m in progress.members
        ],
    }


def _progress_table(progress: FleetProgress, phase: str) -> Table:
    title = (
        f"{phase.lower()} — stage {KIND_NAMES.get(progress.stage, '?')} — {progress.elapsed:.2f}s"
    )
    if progress.outcome:
        title += f" — {progress.outcome}"
    table = Table(title=title)
    for column in ("member", "kind", "state", "blockers", "first blockers"):
        table.add_column(column)
    for member in progress.members:
        first = ", ".join(b.capture_key or "-" for b in list(member.readiness.blockers)[:3])
        state = state_name(member.state, "-") if member.reached else "not reached"
        table.add_row(
            member.name,
            KIND_NAMES.get(member.kind, "?"),
            state,
            str(member.readiness.blocker_count),
            first,
        )
    return table
