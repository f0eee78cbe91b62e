"""The collection's input: the task file, the rollout ids it makes, and its digest."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollout_checkpoint.client.collect.errors import UsageError
from rollout_checkpoint.client.ledger import GROUP_RECOVERIES, GroupRecovery
from rollout_checkpoint.server.core.episodes import rollout_id_problem


@dataclass(frozen=True)
class TaskRow:
    """One task of the input: its position, its id and the whole JSON row sent to `/run`,
    and the row's own `group_recovery` (None: the run's `--group-recovery`)."""

    index: int
    task_id: str
    row: dict[str, Any]
    group_recovery: GroupRecovery | None = None


def load_input(path: Path, num_repeats: int) -> tuple[list[TaskRow], str]:
    """The task rows of `path` (one JSON object a line) and the SHA-256 of the file.

    The digest goes into every checkpoint: a resume must run exactly the same tasks (a
    replacement attempt whose task differs from its checkpointed one is refused). A row
    without `task_id` is `row<index>`. Raises `UsageError` for an unreadable file, a line that
    is not a JSON object, a `task_id` that is not a string, appears twice or makes an invalid
    rollout id with `num_repeats`, a `group_recovery` other than `sibling` or `group`, and
    for a file without tasks: all before the fleet is touched."""
    try:
        data = path.read_bytes()
    except OSError as error:
        raise UsageError(f"cannot read the input {path}: {error}") from error
    rows: list[TaskRow] = []
    seen: set[str] = set()
    for number, line in enumerate(data.decode("utf-8", errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as error:
            raise UsageError(f"{path}:{number}: not a JSON line: {error}") from error
        if not isinstance(row, dict):
            raise UsageError(f"{path}:{number}: a task is a JSON object")
        task_id = row.get("task_id", f"row{len(rows)}")
        if not isinstance(task_id, str):
            raise UsageError(f"{path}:{number}: task_id must be a string")
        if task_id in seen:
            raise UsageError(f"{path}:{number}: task_id {task_id!r} appears twice")
        problem = rollout_id_problem(rollout_id_of(task_id, max(0, num_repeats - 1)))
        if problem is not None:
            raise UsageError(
                f"{path}:{number}: task_id {task_id!r} makes bad rollout ids: {problem}"
            )
        seen.add(task_id)
        rows.append(TaskRow(len(rows), task_id, row, group_recovery_of(row, f"{path}:{number}")))
    if not rows:
        raise UsageError(f"{path}: no tasks")
    return rows, hashlib.sha256(data).hexdigest()


def group_recovery_of(row: dict[str, Any], where: str) -> GroupRecovery | None:
    """The row's `group_recovery` (None when it has none); `UsageError` naming the row
    (`where`) for any other value than the two policies."""
    value = row.get("group_recovery")
    if value is None:
        return None
    for policy in GROUP_RECOVERIES:
        if value == policy:
            return policy
    raise UsageError(
        f"{where}: group_recovery must be one of {', '.join(GROUP_RECOVERIES)}, not {value!r}"
    )


def rollout_id_of(task_id: str, repeat: int) -> str:
    """`<task_id>.<repeat>`: stable across runs, so the same (task, repeat) is the same
    rollout after any crash."""
    return f"{task_id}.{repeat}"
