"""Server processes in tests: started in a process group of their own, their announcement read
with a bound, the whole group killed at the end.

Every server the tests run as a process (`rollout-checkpoint serve`, the coordinator, the
examples, `python -m tests.double`, the scripts of tests/test_process_crash.py) prints one JSON
line on stdout once it listens: its addresses. A bare `readline()` waits forever for a process
that hangs before it listens (or never flushes), and that hung the whole run; `announcement`
waits at most `ANNOUNCE_SECONDS`, kills a process that stays silent or exits, and says which
one and why (with the tail of its log).
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
ANNOUNCE_SECONDS = 60.0
"""Bound on a server's start (a Python start with grpc and uvicorn: ~1 s quiet, several under
load). A safety net only: nothing waits for it to pass."""


def run(
    *args: str | Path, cwd: Path = REPO, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run a tool to completion, capturing its output for `explain`. Bounded at 300 s: a cold
    Go build of grpc (the conformance controller) takes ~30 s on 2 cores, a wheel build less."""
    return subprocess.run(
        [str(a) for a in args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def run_shell_script(
    script: str, cwd: Path, env: dict[str, str], timeout: float
) -> subprocess.CompletedProcess[str]:
    """Run a documented page's shell commands in one bash, as a reader would paste them, in a
    session of its own: whatever it started (servers in the background) is SIGKILLed as a
    group when it ends or times out, whatever the test's outcome."""
    process = subprocess.Popen(
        ["bash", "-c", script],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def explain(proc: subprocess.CompletedProcess[str]) -> str:
    """What a failed `run` printed, for an assertion message."""
    return f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"


def start(
    command: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    log: Path | None = None,
    cwd: Path = REPO,
) -> subprocess.Popen[str]:
    """Start `command` in a process group of its own, stdout piped (text); stderr goes to
    `log` when given, else to the test's (captured) stderr."""
    with log.open("wb") if log is not None else contextlib.nullcontext() as err:
        return subprocess.Popen(
            list(command),
            cwd=cwd,
            env=dict(env) if env is not None else None,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            start_new_session=True,
        )


def announcement(
    process: subprocess.Popen[str],
    what: str = "the server",
    *,
    log: Path | None = None,
    timeout: float = ANNOUNCE_SECONDS,
) -> dict[str, Any]:
    """The JSON line `process` prints once it listens, waited for at most `timeout` seconds.

    A process that exits first, stays silent or prints something else is killed (its whole
    group) and the failure names it, with the tail of `log`."""
    stdout = process.stdout
    assert stdout is not None, "start the process with stdout=PIPE"
    lines: queue.Queue[str | BaseException] = queue.Queue()

    def read() -> None:
        try:
            lines.put(stdout.readline())
        except BaseException as error:  # a closed or undecodable stdout: report it
            lines.put(error)

    # A thread, not select(): a line is complete only at its newline, and the kill below
    # closes the pipe, so the reader always ends.
    threading.Thread(target=read, name=f"announcement of {process.pid}", daemon=True).start()
    try:
        line = lines.get(timeout=timeout)
    except queue.Empty:
        kill_group(process)
        raise AssertionError(
            f"{what} (pid {process.pid}) announced nothing within {timeout:.0f} s{_tail(log)}"
        ) from None
    if isinstance(line, BaseException):
        kill_group(process)
        raise AssertionError(f"{what}: reading its announcement failed: {line!r}{_tail(log)}")
    if not line:  # its stdout closed: it is exiting (or has closed stdout and hangs)
        try:
            code: object = process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            code = "nothing: it closed its stdout and was killed"
        kill_group(process)  # and whatever else is left of its group
        raise AssertionError(f"{what} exited with {code} before announcing{_tail(log)}")
    try:
        announced = json.loads(line)
    except ValueError:
        announced = None
    if not isinstance(announced, dict):
        kill_group(process)
        raise AssertionError(f"{what} announced {line!r}, not a JSON object{_tail(log)}")
    return announced


def started(
    command: Sequence[str],
    what: str | None = None,
    *,
    env: Mapping[str, str] | None = None,
    log: Path | None = None,
    cwd: Path = REPO,
) -> tuple[subprocess.Popen[str], dict[str, Any]]:
    """`start` then `announcement`: the process and what it announced. `what` names it in a
    failure (by default the command, without the interpreter)."""
    process = start(command, env=env, log=log, cwd=cwd)
    name = what if what is not None else f"`{' '.join(command[1:6])}`"
    return process, announcement(process, name, log=log)


def kill_group(process: subprocess.Popen[Any]) -> None:
    """SIGKILL the process's group (it was started in a session of its own) and reap it."""
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
    process.wait(timeout=30)


def _tail(log: Path | None, limit: int = 4000) -> str:
    if log is None or not log.exists():
        return ""
    return f"; the end of {log.name}:\n{log.read_text(errors='replace')[-limit:]}"
