"""The CLI's one exit-code table, one top-level error handler and one output layer.

Every verb of `rollout-checkpoint` ends through `run_verb`: an error anywhere becomes one line on
stderr (or one JSON object with `--json`) and a code from `ExitCode`, never a traceback; a
SIGINT/SIGTERM becomes 130/143 after the verb undid what it started; a closed pipe
(`… | head`) ends quietly. Scripts switch on the code, so a code means the same for every verb.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
from collections.abc import Callable, Coroutine
from enum import IntEnum
from typing import Any, TypeVar

from rich.console import Console

T = TypeVar("T")

PROG = "rollout-checkpoint"


class ExitCode(IntEnum):
    """What a `rollout-checkpoint` process's exit status means, for every verb."""

    OK = 0
    FAILURES_RECORDED = 1
    USAGE = 2
    NOT_PREPARED = 3
    REFUSED = 4
    UNREACHABLE = 5
    CORRUPT = 6
    OUTPUT_UNWRITABLE = 7
    ADDRESS_IN_USE = 8
    VIOLATIONS_FOUND = 9
    INTERRUPTED = 130
    TERMINATED = 143


EXIT_CODE_MEANINGS: dict[ExitCode, str] = {
    ExitCode.OK: "done",
    ExitCode.FAILURES_RECORDED: "done, with failures recorded (collect: failed rollouts; demo: a check failed)",
    ExitCode.USAGE: "usage or configuration error (bad flag, missing fleet file or token, bad checkpoint root, no such directory; serve: a MODULE:ATTRIBUTE it cannot import or run)",
    ExitCode.NOT_PREPARED: "the fleet was not prepared by the deadline (nothing was taken; the fleet was reopened)",
    ExitCode.REFUSED: "refused by a participant or the coordinator (a typed reason: STALE_CHECKPOINT, CHECKPOINT_CONFLICT, TOKEN_INVALID, STORAGE_FAILED, …)",
    ExitCode.UNREACHABLE: "a participant could not be reached (collect: or was lost more often than --max-recoveries allows)",
    ExitCode.CORRUPT: "corrupt checkpoint, output, dispatch log or certify journal: a manifest, digest, record or journal file does not verify",
    ExitCode.OUTPUT_UNWRITABLE: "the output cannot be written (collect)",
    ExitCode.ADDRESS_IN_USE: "an address to listen on is taken or invalid (serve, coordinator)",
    ExitCode.VIOLATIONS_FOUND: "certify: a check did not hold (report.json names the server, the check and the first counter-example)",
    ExitCode.INTERRUPTED: "stopped by SIGINT (Ctrl-C), after aborting what it started (serve, coordinator: after their graceful stop)",
    ExitCode.TERMINATED: "stopped by SIGTERM, after aborting what it started (serve, coordinator: 0, a graceful stop is how a server ends)",
}


def exit_code_table() -> str:
    """The exit-code table as plain text, for every verb's `--help` epilog."""
    lines = ["exit codes:"]
    lines += [f"  {int(code):>3}  {meaning}" for code, meaning in EXIT_CODE_MEANINGS.items()]
    return "\n".join(lines)


def epilog(example: str, *notes: str) -> str:
    """A verb's `--help` epilog: an example, notes, and the exit-code table."""
    parts = [f"example:\n  {example}", *notes, exit_code_table()]
    return "\n\n".join(parts)


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the epilog's layout and shows every default (`(default: …)`)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if (
            "%(default)" not in text
            and "default" not in text
            and action.default is not argparse.SUPPRESS
            and action.option_strings
            and action.default not in (None, False)
        ):
            text += " (default: %(default)s)"
        return text


class CliError(Exception):
    """An error the user gets as one line and `code`; `reason` is the typed reason (if any)
    shown with `--json`, `details` extra JSON fields."""

    def __init__(
        self,
        code: ExitCode,
        message: str,
        reason: str | None = None,
        details: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.reason = reason
        self.details = details or {}


class Interrupted(Exception):
    """The verb was stopped by `signum`; `message` says what was undone (printed as is)."""

    def __init__(self, signum: int, message: str) -> None:
        super().__init__(message)
        self.signum = signum
        self.message = message

    @property
    def code(self) -> ExitCode:
        return ExitCode.TERMINATED if self.signum == signal.SIGTERM else ExitCode.INTERRUPTED


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


# -- output ---------------------------------------------------------------------------------


def make_console(*, stderr: bool = False) -> Console:
    """A rich console that never wraps or truncates off a terminal.

    Piped output goes to scripts and logs: an 80-column wrap would split ids and a truncated
    table cell (`envir…`) loses the very name the operator needs. On a terminal rich keeps its
    width detection."""
    stream = sys.stderr if stderr else sys.stdout
    if stream.isatty():
        return Console(stderr=stderr)
    return Console(stderr=stderr, width=100_000, soft_wrap=True, no_color=True, highlight=False)


class Output:
    """Where a verb's result goes: one summary line by default, the details with `-v`, only
    JSON (one object per line) with `--json`."""

    def __init__(self, *, as_json: bool = False, verbose: bool = False) -> None:
        self.as_json = as_json
        self.verbose = verbose
        self.console = make_console()

    @classmethod
    def of(cls, args: argparse.Namespace) -> Output:
        return cls(
            as_json=bool(getattr(args, "json", False)), verbose=bool(getattr(args, "verbose", 0))
        )

    def json_line(self, payload: dict[str, Any]) -> None:
        print(json.dumps(payload, sort_keys=True, default=str), flush=True)

    def result(self, summary: str, details: dict[str, Any]) -> None:
        """The verb's outcome: `details` as one JSON line with `--json`, else `summary`, and
        `details` pretty-printed after it with `-v`."""
        if self.as_json:
            self.json_line(details)
            return
        print(summary, flush=True)
        if self.verbose:
            print(json.dumps(details, indent=2, sort_keys=True, default=str), flush=True)


def add_output_flags(parser: argparse.ArgumentParser, *, verbose: bool = True) -> None:
    parser.add_argument(
        "--json", action="store_true", help="machine-readable output, one JSON object per line"
    )
    if verbose:
        parser.add_argument(
            "-v", "--verbose", action="count", default=0, help="print the details after the summary"
        )


def human_bytes(count: int) -> str:
    value = float(count)
    for unit in ("B", "KB", "MB", "GB"):
        if value < 1000 or unit == "GB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    return f"{value:.1f} GB"  # pragma: no cover - the loop always returns


# -- the top-level handler ------------------------------------------------------------------


Classifier = Callable[[BaseException], CliError | None]


def report_error(error: CliError, *, as_json: bool) -> ExitCode:
    """Print `error` as one line (stderr) or one JSON object (stdout, with `--json`)."""
    if as_json:
        payload: dict[str, Any] = {"message": error.message, "exit_code": int(error.code)}
        if error.reason:
            payload["reason"] = error.reason
        print(json.dumps({"error": payload | error.details}, sort_keys=True), flush=True)
    else:
        prefix = f"{error.reason}: " if error.reason else ""
        one_line = " ".join(f"{prefix}{error.message}".split())
        print(f"{PROG}: {one_line}", file=sys.stderr, flush=True)
    return error.code


def run_verb(verb: Callable[[], int], classify: Classifier, *, as_json: bool = False) -> int:
    """Run one verb and turn whatever ends it into an exit code (see `ExitCode`).

    `classify` maps the library's exceptions to `CliError` (None: a bug, re-raised with its
    traceback). A closed stdout ends quietly with the code so far; a KeyboardInterrupt that
    reaches here (outside `run_async`) exits 130 without a traceback."""
    try:
        return verb()
    except CliError as error:
        return report_error(error, as_json=as_json)
    except Interrupted as interrupted:
        print(f"{PROG}: {interrupted.message}", file=sys.stderr, flush=True)
        return interrupted.code
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr, flush=True)
        return ExitCode.INTERRUPTED
    except BrokenPipeError:
        _silence_stdout()
        return ExitCode.OK
    except Exception as exception:
        classified = classify(exception)
        if classified is None:
            raise
        return report_error(classified, as_json=as_json)


def _silence_stdout() -> None:
    """After EPIPE the interpreter's final flush of stdout would raise again (and print an
    `Exception ignored` line): point stdout at /dev/null."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # pragma: no cover - stdout without a descriptor
        pass
    finally:
        os.close(devnull)


class Signals:
    """SIGINT/SIGTERM during an asyncio verb: the first one cancels the verb's task so it can
    undo what it started (`received` says which signal); a second one cancels the undo."""

    def __init__(self) -> None:
        self.received: int | None = None

    def _on_signal(self, signum: int, task: asyncio.Task[Any]) -> None:
        if self.received is None:
            self.received = signum
        task.cancel()


def run_async(verb: Callable[[Signals], Coroutine[Any, Any, T]]) -> T:
    """`asyncio.run` with SIGINT and SIGTERM turned into a cancellation of the verb.

    Without this, Ctrl-C raises KeyboardInterrupt at an arbitrary await and SIGTERM kills the
    process outright: neither lets a checkpoint in progress be aborted, which leaves the
    fleet closed until its lease expires. A verb cancelled by a signal that does not handle
    it ends with `Interrupted` (130/143). Before the loop ends, the history records still
    being written get a few seconds (`recording.finish_records`): their threads die with
    the process, and the attempt that failed at its deadline is the one an operator looks
    for."""
    signals = Signals()

    async def main() -> T:
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, signals._on_signal, signum, task)
        try:
            return await verb(signals)
        except asyncio.CancelledError:
            if signals.received is None:
                raise
            raise Interrupted(
                signals.received, f"interrupted by {signal_name(signals.received)}"
            ) from None
        finally:
            for signum in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(signum)
            # Imported here: most verbs (serve, inspect) never record, and start faster.
            from rollout_checkpoint.client.checkpointing.recording import finish_records

            await finish_records()

    return asyncio.run(main())
