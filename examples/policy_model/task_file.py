"""A user's tasks for the scripted model (`--tasks FILE`): the file `collect --input` takes.

The scripted model then follows the user's own tasks, not only the shipped prompt-injection
ones: each row's `reference_plan` (tool calls, in order) and, if it has one, its `injection`.
The file is read with `collect`'s own reader, so a file the model accepts is one `collect`
accepts, and checked whole at start: a row the model could not follow would otherwise fail
mid-rollout, long after the command that named it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rollout_checkpoint.client.collect.errors import UsageError
from rollout_checkpoint.client.collect.inputs import load_input

from .config import InputFileError
from .policy import ScriptedPolicy


def load_task_file(path: Path) -> tuple[dict[str, Any], ...]:
    """The task rows of `path`, each with a `task_id` (the agent names its task by it) and a
    `reference_plan` the model can follow; `InputFileError` (one line naming the file) for
    anything else. Blocking: call it before the event loop runs, or in a thread."""
    try:
        rows, _ = load_input(path, num_repeats=1)
    except UsageError as error:
        raise InputFileError(str(error)) from None
    for row in rows:
        if "task_id" not in row.row:
            raise InputFileError(
                f"{path}: task {row.index + 1} has no task_id (the agent names its task by it)"
            )
    tasks = tuple(row.row for row in rows)
    try:
        ScriptedPolicy(tasks)
    except ValueError as error:
        raise InputFileError(f"{path}: {error}") from None
    return tasks
