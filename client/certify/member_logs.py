"""The failures without a reason of the contract that a member's log shows.

A traceback in a member's log is untyped evidence when an error *escaped* the server's code:
the web or RPC framework caught it (a 500 or an INTERNAL status without a reason), asyncio
found it in a task nobody awaited, our runtime logged it, or the process died of it (a bare
traceback, no log record before it). A traceback the server's own application logged for an
error it *handled* is not: NeMo Gym's IPI server logs one (`logger.exception`) for every tool
call whose arguments its handler rejects, and answers 200 with the error as the tool's output,
which the model reads like any other. Counting those would fail every run of a fleet whose
model ever gets a tool's arguments wrong.

A record's logger is read from the two formats `rollout-checkpoint serve` logs in
(`server/runtime/logs.py`: text, or JSON lines); a traceback whose record cannot be read that
way counts.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Final

__all__ = ["FRAMEWORK_LOGGERS", "untyped_in_log", "untyped_lines"]

UNTYPED_STATUS: Final = re.compile(r"StatusCode\.INTERNAL|\bINTERNAL:")
"""An INTERNAL status: always untyped, whoever logged it."""
TRACEBACK: Final = "Traceback (most recent call last)"
TEXT_RECORD: Final = re.compile(
    r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} [A-Z]+ (?P<logger>\S+) \[checkpoint_id="
)
"""The head of a record in `serve`'s text format (`logs.TEXT_FORMAT`); a traceback logged with
a record (`exc_info`) starts on the line right after it."""
FRAMEWORK_LOGGERS: Final = (
    "rollout_checkpoint.server",
    "rollout_checkpoint.client",
    "uvicorn",
    "starlette",
    "fastapi",
    "grpc",
    "asyncio",
    "concurrent",
    "root",
)
"""Loggers whose tracebacks are errors that escaped a server's code (and the root logger,
which any code may use without saying whose it is)."""


def untyped_in_log(member: str, log: Path) -> list[str]:
    """`member: file: line` for each untyped line of `member`'s log file `log` (none when it
    does not exist). The member's name comes first: the finding names the server by it."""
    if not log.exists():
        return []
    return [
        f"{member}: {log.name}: {line}" for line in untyped_lines(log.read_text(errors="replace"))
    ]


def untyped_lines(text: str) -> list[str]:
    """Each line of a member's log that shows a failure without a reason of the contract; for
    a traceback, the exception it ended with (what a user acts on), not its first line."""
    lines = text.splitlines()
    found: list[str] = []
    for index, line in enumerate(lines):
        if UNTYPED_STATUS.search(line):
            found.append(line.strip())
            continue
        record = _json_record(line)
        if record is not None:
            exception = str(record.get("exception", ""))
            if TRACEBACK in exception and _is_framework(str(record["logger"])):
                found.append(f"{TRACEBACK}: {_raised(exception.splitlines()[1:])}")
        elif TRACEBACK in line and not _handled(lines[index - 1] if index else ""):
            found.append(f"{line.strip()} {_raised(lines[index + 1 :])}".rstrip())
    return found


def _handled(previous: str) -> bool:
    """Whether the line before a traceback is the record of an application's own logger."""
    head = TEXT_RECORD.match(previous)
    return head is not None and not _is_framework(head["logger"])


def _is_framework(logger: str) -> bool:
    return any(logger == name or logger.startswith(f"{name}.") for name in FRAMEWORK_LOGGERS)


def _json_record(line: str) -> dict[str, Any] | None:
    if not line.startswith("{"):
        return None
    try:
        record = json.loads(line)
    except ValueError:
        return None
    return record if isinstance(record, dict) and "logger" in record else None


def _raised(following: list[str]) -> str:
    """The exception a traceback ended with: its first line that is not indented (a frame)."""
    for line in following:
        if line and not line[0].isspace():
            return line.strip()
    return ""
