"""`collect` as a process that pauses itself at one named step, so certify strikes exactly there.

    python -m rollout_checkpoint.client.certify.controller --pause-at STEP@N --step-fd FD \\
        collect --fleet ... [collect's flags]

At STEP of the N-th checkpoint (or, for the recovery steps, of the N-th recovery try) the
collector writes `STEP N` and a newline to the inherited file descriptor FD, then SIGSTOPs
itself (`collect.checkpoints.CheckpointStepHook` names the steps). A fault aimed at a phase
must meet the fleet in that phase: a timer would land anywhere on a loaded machine, a stopped
collector holds the fleet where it is until certify has struck, then is continued (SIGCONT)
or killed (SIGKILL). The line comes before the stop, and certify waits for both: a process
seen stopped by something else (a debugger) must not be taken for the step. Without
`--pause-at` it is plain `collect`.

`ControllerProcess` starts it from an event loop and waits for the pause.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from rollout_checkpoint.client.collect import add_collect_verb, run_collect

MODULE = "rollout_checkpoint.client.certify.controller"
CHECKPOINT_STEPS = (
    "preparing",
    "prepared",
    "snapshotted",
    "resumed",
    "writing",
    "committed",
    "after_verify",
    "after_fleet_manifest",
    "after_latest",
)
"""Steps numbered by checkpoint (`CheckpointStepHook`)."""
RECOVERY_STEPS = ("recovery_cut_ended", "recovery_restored", "recovered")
"""Steps numbered by recovery try."""
DELIVERY_STEPS = ("received", "persisted", "acknowledging", "acknowledged")
"""Steps of the receipt protocol, numbered by their own count (`receipts.DeliverySteps`)."""
STEPS = CHECKPOINT_STEPS + RECOVERY_STEPS + DELIVERY_STEPS
POLL_SECONDS = 0.02
"""Between two reads of /proc while the line came and the stop has not landed yet (the
SIGSTOP follows the write by microseconds; this is the wait for the scheduler)."""


def pause_point(text: str) -> tuple[str, int]:
    """`STEP@N` (or `STEP`, meaning N = 1) as (step, n)."""
    step, _, number = text.partition("@")
    if step not in STEPS:
        raise argparse.ArgumentTypeError(f"{step!r} is not a step: one of {', '.join(STEPS)}")
    try:
        count = int(number or "1")
    except ValueError:
        raise argparse.ArgumentTypeError(f"{number!r} is not a number") from None
    if count < 1:
        raise argparse.ArgumentTypeError("steps are numbered from 1")
    return step, count


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m {MODULE}")
    parser.add_argument("--pause-at", type=pause_point, default=None, help="STEP@N: pause there")
    parser.add_argument("--step-fd", type=int, default=None, help="where `STEP N` is written")
    add_collect_verb(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    if (args.pause_at is None) != (args.step_fd is None):
        parser.error("--pause-at and --step-fd go together")
    at: tuple[str, int] | None = args.pause_at
    fd: int | None = args.step_fd

    def step_hook(step: str, number: int) -> None:
        if at is not None and fd is not None and (step, number) == at:
            os.write(fd, f"{step} {number}\n".encode())
            os.kill(os.getpid(), signal.SIGSTOP)

    collect_argv = list(argv[argv.index("collect") :]) if "collect" in argv else list(argv)
    command = [sys.executable, "-m", MODULE, *collect_argv]
    return run_collect(args, command, step_hook=step_hook if at is not None else None)


def is_stopped(pid: int) -> bool:
    """Whether process `pid` is stopped by a signal (its /proc state is `T`)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] == "T"


class ControllerProcess:
    """The controller started from an event loop, its stderr to `log`.

    `await reached(within)` is True once the pause line came and the process is stopped;
    False when it exited (or the timeout passed) first. The caller then `cont()`s or
    `kill()`s it, and `wait()`s for its exit code."""

    def __init__(self, process: asyncio.subprocess.Process, log: Path, reader: int | None):
        self.process = process
        self.log = log
        self._reader = reader
        self._line = b""
        self._exit: asyncio.Future[int] = asyncio.ensure_future(process.wait())

    @classmethod
    async def start(
        cls,
        collect_args: Sequence[str],
        *,
        log: Path,
        pause_at: str | None = None,
        env: dict[str, str] | None = None,
    ) -> ControllerProcess:
        """Start `collect collect_args` (paused at `pause_at`, `STEP@N`, when given). stdout
        goes to `log` with `.out` added (the `--json` summary), stderr to `log`."""
        pause: list[str] = []
        reader = writer = None
        if pause_at is not None:
            pause_point(pause_at)  # a typo is the caller's bug: fail before starting
            reader, writer = os.pipe()
            os.set_blocking(reader, False)
            pause = ["--pause-at", pause_at, "--step-fd", str(writer)]
        argv = [sys.executable, "-m", MODULE, *pause, "collect", *collect_args]
        with contextlib.ExitStack() as files:
            err = files.enter_context(await asyncio.to_thread(log.open, "wb"))
            out = files.enter_context(
                await asyncio.to_thread(log.with_name(log.name + ".out").open, "wb")
            )
            try:
                process = await asyncio.create_subprocess_exec(
                    *argv,
                    stdin=asyncio.subprocess.DEVNULL,
                    stdout=out,
                    stderr=err,
                    env=env,
                    pass_fds=(writer,) if writer is not None else (),
                    start_new_session=True,
                )
            finally:
                if writer is not None:
                    os.close(writer)
        return cls(process, log, reader)

    @property
    def pid(self) -> int:
        return self.process.pid

    async def reached(self, within: float) -> bool:
        """Wait until the pause line came and the process is stopped (True), or it exited or
        `within` seconds passed (False)."""
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            if self.process.returncode is not None:
                return False
            if self._read_line() and is_stopped(self.pid):
                return True
            await asyncio.wait({self._exit}, timeout=POLL_SECONDS)
        return False

    def _read_line(self) -> bool:
        if self._reader is None:
            return False
        if not self._line.endswith(b"\n"):
            with contextlib.suppress(BlockingIOError):
                self._line += os.read(self._reader, 4096)
        return self._line.endswith(b"\n")

    def cont(self) -> None:
        """Continue it (SIGCONT to its group)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL its group (a stopped process dies too)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGKILL)

    async def wait(self, within: float | None = None) -> int:
        """Its exit code (a signal that ended it as 128 + the signal, as a shell reports
        it); `TimeoutError` after `within` seconds (None: no bound)."""
        code = await asyncio.wait_for(asyncio.shield(self._exit), within)
        self.close()
        return 128 - code if code < 0 else code

    def close(self) -> None:
        """Close the pipe's read end (idempotent)."""
        if self._reader is not None:
            os.close(self._reader)
            self._reader = None

    async def notes(self) -> list[str]:
        """Its stderr, line by line (the collector's notes and its last error)."""
        text = await asyncio.to_thread(self.log.read_text, errors="replace")
        return text.splitlines()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
