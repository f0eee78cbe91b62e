"""SIGINT and SIGTERM at every moment of a server's life end it quietly with one exit code.

`rollout-checkpoint serve` (one process, and `--workers 2`: a supervisor and its workers) and
`rollout-checkpoint coordinator` are started as an operator starts them, in a process group of
their own, and the whole group gets the signal (as a terminal's Ctrl-C or a `kill -- -PGID`
does) at an offset after the launcher took hold of the signals: during the imports, before
uvicorn or the sidecar listens, around the announcement, while serving. Each run must end with
the documented code (SIGTERM 0, SIGINT 130), nothing on stderr that looks like a traceback, and
no process left in the group (a worker outliving its supervisor is an orphan). A second signal
during the stop (a second Ctrl-C, or the supervisor's SIGTERM after the group's SIGINT) is quiet
too, and the first one's code stands.

The offsets count from the moment the launcher holds SIGINT and SIGTERM (blocked or handled,
read from /proc): a signal in the few milliseconds of CPython's own start before that is the
interpreter's, which no code of ours can see (README, "Exit codes"). The default run covers
each signal before the announcement, right after it and a second into serving; `-m slow` runs
the whole grid.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.processes import announcement, kill_group, start

TOKEN = "signals-token"
ENV = os.environ | {"ROLLOUT_CHECKPOINT_TOKEN": TOKEN}
CLI = [sys.executable, "-m", "rollout_checkpoint.client.cli.main"]
HOLD_SECONDS = 30.0
"""Bound on the launcher's start until it holds the signals (a Python start, loaded machine)."""
EXIT_SECONDS = 60.0
"""Bound on a stop: uvicorn's drain, the sidecar's grace and the workers' own stop fit in it."""
STOP_CODES = {signal.SIGTERM: 0, signal.SIGINT: 130}
"""The documented exit codes of a server stopped by a signal (README, "Exit codes")."""
AFTER_ANNOUNCE = "after-announce"
GRID = (0.0, 0.05, 0.1, 0.2, 0.35, 0.5, 0.75, 1.0, 1.5, 2.0)
DEFAULT = (0.0, AFTER_ANNOUNCE, 1.0)
SIGNALS = (signal.SIGINT, signal.SIGTERM)
Offset = float | str


def serve_command(workers: int) -> list[str]:
    command = [*CLI, "serve", "counter", "--http-address", "127.0.0.1:0"]
    command += ["--grpc-address", "127.0.0.1:0"]
    return command + (["--workers", str(workers)] if workers > 1 else [])


def coordinator_command(tmp_path: Path) -> list[str]:
    fleet = tmp_path / "fleet.toml"
    # Discovery is lazy: the coordinator serves before any member answers.
    fleet.write_text('[[participants]]\nname = "counter"\naddress = "127.0.0.1:9"\n')
    return [*CLI, "coordinator", "--fleet", str(fleet), "--grpc-address", "127.0.0.1:0"]


def signal_mask(pid: int, field: str) -> int:
    """One of /proc/PID/status's signal sets (SigBlk, SigCgt) as a bit mask (0: gone)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return 0
    for line in status.splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1], 16)
    return 0


def holds_the_signals(pid: int) -> bool:
    """Whether `pid` blocks both stop signals or handles SIGTERM: from then on its own code
    decides what a signal does (SIGINT alone is handled by any Python from its start)."""
    both = (1 << (signal.SIGINT - 1)) | (1 << (signal.SIGTERM - 1))
    blocked = signal_mask(pid, "SigBlk") & both == both
    return blocked or bool(signal_mask(pid, "SigCgt") & (1 << (signal.SIGTERM - 1)))


def wait_until_holding(process: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + HOLD_SECONDS
    while not holds_the_signals(process.pid):
        assert process.poll() is None, f"exited with {process.returncode} before holding signals"
        assert time.monotonic() < deadline, f"did not hold the signals in {HOLD_SECONDS:.0f} s"
        time.sleep(0.001)  # polling /proc: there is no event to wait on


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def signal_at(
    command: list[str],
    signum: int,
    offset: Offset,
    log: Path,
    then: Callable[[subprocess.Popen[str], dict[str, Any]], None] | None = None,
) -> tuple[int, str, bool]:
    """Start `command`, signal its whole group at `offset` (seconds after it holds the signals,
    or right after its announcement), run `then` (given the process and its announcement,
    only with `AFTER_ANNOUNCE`), wait for it to exit: its code, its stderr, and whether
    anything of its group outlived it."""
    process = start(command, env=ENV, log=log)
    try:
        announced: dict[str, Any] = {}
        if offset == AFTER_ANNOUNCE:
            announced = announcement(process, log=log)
        else:
            wait_until_holding(process)
            assert isinstance(offset, float)
            time.sleep(offset)  # the offset is what is under test, not a synchronization
        os.killpg(process.pid, signum)
        if then is not None:
            then(process, announced)
        code = process.wait(timeout=EXIT_SECONDS)
        left = group_alive(process.pid)
    finally:
        kill_group(process)
        if group_alive(process.pid):
            os.killpg(process.pid, signal.SIGKILL)
    return code, log.read_text(errors="replace"), left


def assert_quiet_stop(signum: int, run: Callable[[], tuple[int, str, bool]]) -> None:
    code, stderr, left = run()
    name = signal.Signals(signum).name
    assert "Traceback" not in stderr, f"{name}: a traceback on stderr:\n{stderr}"
    assert "KeyboardInterrupt" not in stderr, f"{name}: KeyboardInterrupt on stderr:\n{stderr}"
    assert code == STOP_CODES[signum], f"{name}: exit {code}, stderr:\n{stderr}"
    assert not left, f"{name}: a process of the group outlived the server"


def offset_id(offset: Offset) -> str:
    return offset if isinstance(offset, str) else f"{offset:.2f}s"


SLOW_GRID = [o for o in (*GRID, AFTER_ANNOUNCE) if o not in DEFAULT]
OFFSETS = pytest.mark.parametrize(
    "offset",
    [*DEFAULT, *(pytest.param(o, marks=pytest.mark.slow) for o in SLOW_GRID)],
    ids=offset_id,
)
SIGNUMS = pytest.mark.parametrize("signum", SIGNALS, ids=lambda s: signal.Signals(s).name)


@OFFSETS
@SIGNUMS
@pytest.mark.parametrize("workers", [1, 2], ids=["one-process", "two-workers"])
def test_serve_stops_quietly_at_any_moment(
    tmp_path: Path, signum: int, offset: Offset, workers: int
) -> None:
    command = serve_command(workers)
    assert_quiet_stop(signum, lambda: signal_at(command, signum, offset, tmp_path / "stderr.log"))


@OFFSETS
@SIGNUMS
def test_the_coordinator_stops_quietly_at_any_moment(
    tmp_path: Path, signum: int, offset: Offset
) -> None:
    command = coordinator_command(tmp_path)
    assert_quiet_stop(signum, lambda: signal_at(command, signum, offset, tmp_path / "stderr.log"))


def stopping(address: str) -> None:
    """Returns once the sidecar at `address` says NOT_SERVING (its first step on a stop
    signal: the signal was handled) or is gone."""
    with grpc.insecure_channel(address) as channel:
        watch = health_pb2_grpc.HealthStub(channel).Watch(
            health_pb2.HealthCheckRequest(service=""), timeout=EXIT_SECONDS
        )
        with contextlib.suppress(grpc.RpcError):  # the stream ends with the server
            for update in watch:
                if update.status == health_pb2.HealthCheckResponse.NOT_SERVING:
                    return


@pytest.mark.parametrize(
    ("first", "second"),
    [
        pytest.param(signal.SIGTERM, signal.SIGINT, id="TERM-then-INT"),
        pytest.param(signal.SIGINT, signal.SIGINT, id="INT-then-INT"),
        pytest.param(signal.SIGINT, signal.SIGTERM, id="INT-then-TERM", marks=pytest.mark.slow),
        pytest.param(signal.SIGTERM, signal.SIGTERM, id="TERM-then-TERM", marks=pytest.mark.slow),
    ],
)
@pytest.mark.parametrize(
    "gap",
    [pytest.param(0.0, id="at-once"), pytest.param(0.2, id="0.2s-later", marks=pytest.mark.slow)],
)
@pytest.mark.parametrize("workers", [1, 2], ids=["one-process", "two-workers"])
def test_a_second_signal_during_the_stop_is_quiet_and_the_first_decides_the_code(
    tmp_path: Path, first: int, second: int, gap: float, workers: int
) -> None:
    """The second signal goes to the group once the first was handled (the sidecar said
    NOT_SERVING), at once or a little later in the stop; the first one's code stands."""

    def signal_again(process: subprocess.Popen[str], announced: dict[str, Any]) -> None:
        stopping(announced["grpc"])
        time.sleep(gap)  # the moment in the stop is what is under test
        with contextlib.suppress(ProcessLookupError):  # it may be gone already
            os.killpg(process.pid, second)

    command = serve_command(workers)
    log = tmp_path / "stderr.log"
    assert_quiet_stop(first, lambda: signal_at(command, first, AFTER_ANNOUNCE, log, signal_again))


@SIGNUMS
@pytest.mark.parametrize("workers", [1, 2, 4], ids=["one-process", "two-workers", "four-workers"])
def test_a_signal_to_the_main_process_alone_stops_the_whole_server(
    tmp_path: Path, signum: int, workers: int
) -> None:
    """The kubelet signals a container's main process only, not its group: the supervisor of
    several workers must see that signal and stop its workers itself (a main process left
    with the signals blocked by overlapping worker spawns ignored it until SIGKILL)."""
    process = start(serve_command(workers), env=ENV, log=tmp_path / "stderr.log")
    try:
        announcement(process, log=tmp_path / "stderr.log")
        os.kill(process.pid, signum)
        code = process.wait(timeout=EXIT_SECONDS)
        # The group outlives the main process only by what the main process failed to stop.
        deadline = time.monotonic() + EXIT_SECONDS
        while group_alive(process.pid) and time.monotonic() < deadline:
            time.sleep(0.05)  # polling for the workers' exit: there is no event to wait on
        left = group_alive(process.pid)
    finally:
        kill_group(process)
    stderr = (tmp_path / "stderr.log").read_text(errors="replace")
    assert "Traceback" not in stderr, stderr
    assert code == STOP_CODES[signum], f"exit {code}, stderr:\n{stderr}"
    assert not left, "a worker outlived the main process"
