"""Starting a fleet member from its fleet-file `command`, and starting its replacement.

A controller that kills members on purpose (fault injection, a supervisor of its own) must
also start them, exactly as the fleet file says, and know when one is up. `start_member` runs
the member's argv (no shell) in a process group of its own, so that a signal to the group
reaches the server and every worker it forked: a SIGKILL of the leader alone would leave its
workers holding the ports, and the replacement could not bind them. It returns once the
member's sidecar answers `participant-liveness` SERVING on the member's address. A
replacement (`replacement=True`) is the same command with `ROLLOUT_CHECKPOINT_START_CLOSED=true`,
so it takes no new work before a controller restores it (its readiness stays NOT_SERVING until
the Resume that follows its Restore): a process that served cannot be restored.

The command's environment is the controller's, then `ROLLOUT_CHECKPOINT_TOKEN` set to the
fleet's token (a fleet that reads its token from `token_file` starts members that accept its
controller), then the member's `env`, then the start-closed setting of a replacement.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import grpc
from grpc_health.v1 import health_pb2

from rollout_checkpoint.client.errors import ControlError
from rollout_checkpoint.client.fleet.spec import FleetSpec, MemberSpec
from rollout_checkpoint.client.participant import LIVENESS_HEALTH

START_CLOSED_VARIABLE = "ROLLOUT_CHECKPOINT_START_CLOSED"
TOKEN_VARIABLE = "ROLLOUT_CHECKPOINT_TOKEN"
READY_SECONDS = 60.0
"""How long a member may take to answer its liveness (a Python server with grpc and uvicorn
starts in about a second, several on a loaded machine)."""
CONNECT_RETRY_SECONDS = 0.1
"""Between attempts to reach a sidecar that does not listen yet (grpc's own reconnect backoff
grows to minutes, far too slow to notice a server that just bound its port)."""
STDERR_TAIL_LINES = 20
"""How much of a failed command's stderr its `LaunchError` carries: its last lines."""
PROBE_SECONDS = 5.0
"""The timeout of one call to a member's address while it starts."""

Output = Path | int | IO[Any] | None
"""Where a member's stdout or stderr goes: a file (created or truncated), `subprocess.PIPE`
(the caller reads `LaunchedMember.process`), `subprocess.DEVNULL`, an open file, or None (the
controller's own)."""


class LaunchError(Exception):
    """A member could not be started from its command, or did not come up."""

    def __init__(self, member: str, message: str, stderr_tail: str = "") -> None:
        detail = f"\n{stderr_tail}" if stderr_tail else ""
        super().__init__(f"{member}: {message}{detail}")
        self.member = member
        """The member's name in the fleet file."""
        self.stderr_tail = stderr_tail
        """The last lines its command wrote on stderr ("" when stderr was not captured in a
        file or a pipe)."""


class CommandNotStarted(LaunchError):
    """The command could not be run at all (no such program, not executable, no command in
    the fleet file, or the member's address already answers: another process serves it)."""


class ExitedBeforeReady(LaunchError):
    """The command ran and exited before its sidecar answered SERVING."""

    def __init__(self, member: str, returncode: int, stderr_tail: str) -> None:
        super().__init__(member, f"exited with {returncode} before it was ready", stderr_tail)
        self.returncode = returncode
        """Its exit status (negative: the signal that ended it)."""


class NotReadyInTime(LaunchError):
    """The command kept running but its sidecar did not answer SERVING before the deadline;
    its process group was killed."""


@dataclass
class LaunchedMember:
    """A member's process started from its command: its own process group, up and serving."""

    member: MemberSpec
    """The fleet file's entry it was started from."""
    process: asyncio.subprocess.Process
    """The command's process, the leader of its process group."""
    replacement: bool
    """Started closed, as the replacement of a member that went away."""

    @property
    def pid(self) -> int:
        """The process id, which is also its process group's id."""
        return self.process.pid

    @property
    def returncode(self) -> int | None:
        """Its exit status once it has exited (and was reaped); None while it runs."""
        return self.process.returncode

    def kill(self, sig: signal.Signals = signal.SIGKILL) -> None:
        """Send `sig` to the whole process group (the server and every worker it forked);
        a group that is already gone is not an error."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, sig)

    async def wait(self) -> int:
        """Wait for the command's process to exit and its pipes to close (`kill` closes
        those its workers hold); its exit status."""
        return await self.process.wait()


async def start_member(
    spec: FleetSpec,
    member: MemberSpec,
    *,
    replacement: bool = False,
    stdout: Output = None,
    stderr: Output = None,
    ready_seconds: float = READY_SECONDS,
) -> LaunchedMember:
    """Start `member` from its fleet-file command and return once its sidecar answers
    `participant-liveness` SERVING on `member.address`.

    A replacement starts closed (its readiness stays NOT_SERVING until it is resumed).
    The address is probed first: a process already serving it would answer the readiness
    wait, and a controller would then restore into the old process instead of the new one.
    Raises `CommandNotStarted`, `ExitedBeforeReady` (with the tail of stderr when it went to a
    file or a pipe) or `NotReadyInTime`; a command that did not come up is killed, group and
    all, before the error is raised, so nothing it forked outlives the failure."""
    if not member.command:
        raise CommandNotStarted(member.name, "the fleet file gives it no command")
    credentials = await asyncio.to_thread(spec.credentials)
    if await _answers(spec, member, credentials):
        raise CommandNotStarted(member.name, f"{member.address} already answers")
    process = await _spawn(spec, member, replacement, stdout, stderr)
    launched = LaunchedMember(member, process, replacement)
    try:
        await _until_ready(
            _serving(spec, member, credentials),
            launched,
            stderr,
            time.monotonic() + ready_seconds,
        )
    except BaseException:
        launched.kill()
        await launched.wait()
        raise
    return launched


def _environment(spec: FleetSpec, member: MemberSpec, replacement: bool) -> dict[str, str]:
    """The environment `start_member` runs `member`'s command with (see the module). Whether
    it starts closed is the launcher's decision or the member's `env`, never an accident of
    the controller's own environment: a first fleet inheriting it would never open."""
    environment = dict(os.environ, **{TOKEN_VARIABLE: spec.token})
    environment.pop(START_CLOSED_VARIABLE, None)
    environment.update(member.env)
    if replacement:
        environment[START_CLOSED_VARIABLE] = "true"
    return environment


async def _spawn(
    spec: FleetSpec, member: MemberSpec, replacement: bool, stdout: Output, stderr: Output
) -> asyncio.subprocess.Process:
    with contextlib.ExitStack() as files:

        async def opened(output: Output) -> int | IO[Any] | None:
            if not isinstance(output, Path):
                return output
            return files.enter_context(await asyncio.to_thread(output.open, "wb"))

        out, err = await opened(stdout), await opened(stderr)
        try:
            return await asyncio.create_subprocess_exec(
                *member.command,
                cwd=member.directory,
                env=_environment(spec, member, replacement),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                start_new_session=True,
            )
        except OSError as error:
            raise CommandNotStarted(member.name, f"{member.command[0]}: {error}") from None


async def _answers(
    spec: FleetSpec, member: MemberSpec, credentials: grpc.ChannelCredentials | None
) -> bool:
    """Whether something already answers gRPC at the member's address (a refusal is an
    answer too: only an unreachable address is free)."""
    async with spec.client(member, timeout=PROBE_SECONDS, credentials=credentials) as client:
        try:
            await client.get_participant()
        except ControlError as error:
            return error.code != grpc.StatusCode.UNAVAILABLE
    return True


async def _until_ready(
    serving_soon: Awaitable[None], launched: LaunchedMember, stderr: Output, deadline: float
) -> None:
    """Wait for liveness SERVING, for the process to exit, or for the deadline, whichever
    comes first: a server that dies at start-up must fail the start at once, with its
    reason, not after the whole deadline."""
    serving = asyncio.ensure_future(serving_soon)
    exited = asyncio.ensure_future(_leader_exit(launched.process))
    try:
        done, _ = await asyncio.wait(
            {serving, exited},
            timeout=max(0.0, deadline - time.monotonic()),
            return_when=asyncio.FIRST_COMPLETED,
        )
    finally:
        serving.cancel()
        exited.cancel()
    if serving in done:
        serving.result()
        return
    name = launched.member.name
    if exited in done:
        launched.kill()  # the workers it forked, if any, which hold its pipes open
        returncode = await launched.wait()
        raise ExitedBeforeReady(name, returncode, await _stderr_tail(launched, stderr))
    launched.kill()
    await launched.wait()
    raise NotReadyInTime(
        name,
        f"{launched.member.address} did not answer {LIVENESS_HEALTH} SERVING in time",
        await _stderr_tail(launched, stderr),
    )


async def _leader_exit(process: asyncio.subprocess.Process) -> None:
    """Return once the command's own process has exited, whatever its children do.

    `Process.wait` also waits until every pipe of the process is closed, and a worker the
    server forked keeps them open after the server died: a start would then wait out its
    whole deadline for a server that is long gone. A pidfd is readable the moment the
    process exits."""
    try:
        pidfd = os.pidfd_open(process.pid)
    except ProcessLookupError:  # already exited and reaped
        return
    loop = asyncio.get_running_loop()
    exited: asyncio.Future[None] = loop.create_future()

    def readable() -> None:
        if not exited.done():
            exited.set_result(None)

    loop.add_reader(pidfd, readable)
    try:
        await exited
    finally:
        loop.remove_reader(pidfd)
        os.close(pidfd)


async def _serving(
    spec: FleetSpec, member: MemberSpec, credentials: grpc.ChannelCredentials | None
) -> None:
    """Return once the sidecar's liveness is SERVING, reconnecting while it does not listen.

    Each attempt dials on a client of its own: a channel whose first call found nothing
    listening waits out grpc's reconnect backoff (up to two minutes) before it dials again."""
    while True:
        async with spec.client(member, timeout=PROBE_SECONDS, credentials=credentials) as client:
            with contextlib.suppress(ControlError):
                async for status in client.watch_health(LIVENESS_HEALTH):
                    if status == health_pb2.HealthCheckResponse.SERVING:
                        return
        await asyncio.sleep(CONNECT_RETRY_SECONDS)


async def _stderr_tail(launched: LaunchedMember, stderr: Output) -> str:
    if isinstance(stderr, Path):
        text = await asyncio.to_thread(stderr.read_text, errors="replace")
    elif launched.process.stderr is not None:
        try:
            data = await asyncio.wait_for(launched.process.stderr.read(), PROBE_SECONDS)
        except TimeoutError:
            return ""
        text = data.decode(errors="replace")
    else:
        return ""
    return "\n".join(text.splitlines()[-STDERR_TAIL_LINES:])
