"""How a run ends: its exit code, and the last line it prints.

A run that stopped before every rollout was collected (a signal, a member lost past
`--max-recoveries`) is continued by a person or a restart policy from that one line, so the
line says how far the output got, whether a new checkpoint was published (without one, `LATEST`
stays the restore point), and the exact command line again with `--resume`. The exit code
tells a script the same without reading it (the CLI's one table of exit codes).
"""

from __future__ import annotations

import shlex
import signal
from collections.abc import Sequence
from pathlib import Path

from rollout_checkpoint.client.cli.console import ExitCode
from rollout_checkpoint.client.collect.view import Counts


def finished_code(counts: Counts) -> int:
    """The exit code of a run that collected everything: failures recorded or not."""
    return ExitCode.FAILURES_RECORDED if counts.failed else ExitCode.OK


def stopped_code(signum: signal.Signals) -> int:
    """The exit code of a run stopped by `signum` (SIGINT 130, else SIGTERM's 143)."""
    return ExitCode.INTERRUPTED if signum == signal.SIGINT else ExitCode.TERMINATED


def finished_note(counts: Counts, output: Path) -> str:
    """A run that collected everything."""
    reoffered = (
        f", {counts.reoffered} of them re-offered by the entry's outbox (not run again)"
        if counts.reoffered
        else ""
    )
    stale = [
        f"{count} {what}"
        for count, what in (
            (counts.stale_continued, "continued past --max-policy-lag"),
            (counts.stale_regenerated, "regenerated for --max-policy-lag"),
            (counts.dropped, "dropped for --max-policy-lag"),
        )
        if count
    ]
    return (
        f"collect: {counts.done} rollout(s) collected{reoffered}, {counts.failed} failed, "
        f"into {output}; {counts.checkpoints} checkpoint(s) taken"
        + (f"; {', '.join(stale)}" if stale else "")
        + groups_note(counts)
    )


def groups_note(counts: Counts) -> str:
    """What a crash did to the prompt groups, when it touched one (else nothing: a run no
    crash cut says what it always said)."""
    if not (counts.siblings_kept or counts.groups_regenerated):
        return ""
    return (
        f"; {counts.groups_sealed} group(s) sealed, {counts.siblings_kept} finished "
        f"sibling(s) kept, {counts.groups_regenerated} group(s) regenerated"
    )


def stopped_note(
    counts: Counts, output: Path, command: Sequence[str], published: str | None
) -> str:
    """A run stopped by a signal, after checkpoint `published` (None: none could be taken)."""
    again = resume_command(command)
    done = counts.done + counts.failed + counts.dropped
    if published is not None:
        return (
            f"collect: stopped after checkpoint {published} ({done}/{counts.total} "
            f"rollouts in {output}). To continue: {again}"
        )
    return (
        f"collect: stopped WITHOUT a new checkpoint ({done}/{counts.total} rollouts "
        f"in {output}). To continue from the last one: {again}"
    )


def gave_up_note(counts: Counts, output: Path, command: Sequence[str], reason: str) -> str:
    """A run that lost a member and could not recover in place (`reason` says why)."""
    done = counts.done + counts.failed + counts.dropped
    return (
        f"collect: {reason}; stopped WITHOUT a new checkpoint ({done}/{counts.total} "
        f"rollouts in {output}). Once the fleet is whole again, continue from "
        f"the last one: {resume_command(command)}"
    )


def resume_command(command: Sequence[str]) -> str:
    """The command line that started the run, with `--resume` (a placeholder without one)."""
    words = list(command) or ["rollout-checkpoint", "collect", "..."]
    if "--resume" not in words:
        words.append("--resume")
    return " ".join(shlex.quote(part) for part in words)
