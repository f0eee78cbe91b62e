"""The user's fleet as processes certify starts, kills, stops and replaces.

Certify proves recovery through the product's own paths, so it must do to the fleet what a
crash does: SIGKILL a member's whole process group (a server and the workers it forked), start
its replacement closed on the same addresses from the fleet file's `command`
(`fleet.launch.start_member`), SIGSTOP a member past its lease. Every incarnation of every
member writes its own log files (`<name>.<n>.out`, `<name>.<n>.err`), so a traceback found
after a trial names the process that wrote it, and a replacement does not truncate the log of
the process it replaced.

Every incarnation, of the baselines and of the trials alike, runs with
`ROLLOUT_CHECKPOINT_EXPORT_ENDED_SESSIONS=true`: a resources server stops tracking a session
at its `/verify`, so without it certify's checkpoint after a run would export no finished
rollout's state, and the check that no tool call was applied twice would compare nothing.
Both sides run with it, so a difference between them is the server's.

They also run with a checkpoint lease grace of `LEASE_GRACE` unless the fleet file (or
certify's own environment) sets one: a stop-past-the-lease trial stops a member until the
lease of the checkpoint under way expires, and the default grace (ten minutes) would make each
such trial cost ten minutes. The grace decides how long a dead controller's checkpoint keeps a
member closed, not whether a hook is correct, so certifying with a short one proves the same.

`close()` always leaves nothing running: a trial that failed half way must not leave a member
holding a port the next trial's fleet needs.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import signal
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import MappingProxyType

from rollout_checkpoint.client.certify.findings import ServerFacts
from rollout_checkpoint.client.fleet.discovery import KIND_NAMES
from rollout_checkpoint.client.fleet.launch import LaunchedMember, LaunchError, start_member
from rollout_checkpoint.client.fleet.spec import FleetSpec, MemberSpec

CLOSE_SECONDS = 10.0
"""How long a member may take to stop gracefully on SIGTERM before its group is SIGKILLed."""
FACTS_SECONDS = 10.0
"""The timeout of the GetParticipant call that reads a member's kind."""
EXPORT_ENDED_SESSIONS = {"ROLLOUT_CHECKPOINT_EXPORT_ENDED_SESSIONS": "true"}
"""Set over each member's own `env` (see the module docstring)."""
LEASE_GRACE_VARIABLE = "ROLLOUT_CHECKPOINT_LEASE_GRACE_SECONDS"
LEASE_GRACE = "2"
"""Seconds a checkpoint's lease outlives its deadline in certify's fleets, unless set (see
the module docstring)."""
KINDS = {**KIND_NAMES, **{k: "policy_model" for k, v in KIND_NAMES.items() if v == "model"}}
"""A participant kind as `ServerFacts.kind` spells it."""


class MemberNotStarted(Exception):
    """A member's command did not start (or did not come up): certify cannot run the fleet.
    The message names the member and carries the tail of its stderr."""

    def __init__(self, error: LaunchError) -> None:
        super().__init__(str(error))
        self.member = error.member


def http_url(member: MemberSpec) -> str | None:
    """The member's HTTP base URL: its fleet-file `url`, else the `--http-address HOST:PORT`
    of its command (how every server of this project and `serve MODULE:ATTRIBUTE` take it);
    None when neither says."""
    if member.url is not None:
        return member.url
    arguments = list(member.command)
    for index, argument in enumerate(arguments):
        if argument == "--http-address" and index + 1 < len(arguments):
            return f"http://{arguments[index + 1]}"
        if argument.startswith("--http-address="):
            return f"http://{argument.partition('=')[2]}"
    return None


def _lease_grace(env: Mapping[str, str]) -> dict[str, str]:
    """`LEASE_GRACE`, unless the member's `env` or certify's environment sets a grace."""
    if LEASE_GRACE_VARIABLE in env or LEASE_GRACE_VARIABLE in os.environ:
        return {}
    return {LEASE_GRACE_VARIABLE: LEASE_GRACE}


class FleetProcesses:
    """The members of `spec` as processes, each started from its command plus
    `extra_args[name]` (the policy model's `--record FILE` or `--replay FILE
    --replay-latency S`) with its `env` plus `EXPORT_ENDED_SESSIONS`, logging under `logs`."""

    def __init__(
        self,
        spec: FleetSpec,
        logs: Path,
        *,
        extra_args: Mapping[str, Sequence[str]] = MappingProxyType({}),
    ) -> None:
        self.spec = spec
        self.logs = logs
        self.members = {
            m.name: dataclasses.replace(
                m,
                command=(*m.command, *extra_args.get(m.name, ())),
                env={**_lease_grace(m.env), **m.env, **EXPORT_ENDED_SESSIONS},
            )
            for m in spec.members
        }
        self.running: dict[str, LaunchedMember] = {}
        self._incarnations: dict[str, int] = {}

    async def start_all(self, *, replacement: bool = False) -> None:
        """Start every member that is not running, at once (a fleet starts in the time of
        its slowest member). `MemberNotStarted` for the first that did not come up; the
        others stay running for `close`."""
        names = [name for name in self.members if name not in self.running]
        results = await asyncio.gather(
            *(self._start(name, replacement) for name in names), return_exceptions=True
        )
        for result in results:
            if isinstance(result, BaseException):
                raise result

    async def replace(self, name: str) -> None:
        """Start `name`'s replacement, closed (it takes no work before its restore)."""
        await self._start(name, True)

    async def replace_all(self) -> None:
        """Start a replacement of every member that is not running, closed."""
        await self.start_all(replacement=True)

    async def _start(self, name: str, replacement: bool) -> None:
        number = self._incarnations.get(name, 0) + 1
        self._incarnations[name] = number
        await asyncio.to_thread(self.logs.mkdir, parents=True, exist_ok=True)
        try:
            launched = await start_member(
                self.spec,
                self.members[name],
                replacement=replacement,
                stdout=self.logs / f"{name}.{number}.out",
                stderr=self.logs / f"{name}.{number}.err",
            )
        except LaunchError as error:
            raise MemberNotStarted(error) from None
        self.running[name] = launched

    async def kill(self, name: str) -> None:
        """SIGKILL `name`'s process group and reap it (its ports are free after)."""
        launched = self.running.pop(name)
        launched.kill(signal.SIGKILL)
        await launched.wait()

    async def kill_all(self) -> None:
        """SIGKILL every member's group, all at once (a machine that lost power)."""
        await asyncio.gather(*(self.kill(name) for name in list(self.running)))

    def stop(self, name: str) -> None:
        """SIGSTOP `name`'s group: it holds its ports and answers nothing."""
        self.running[name].kill(signal.SIGSTOP)

    def cont(self, name: str) -> None:
        """SIGCONT `name`'s group."""
        self.running[name].kill(signal.SIGCONT)

    def pid(self, name: str) -> int:
        """The process (and group) id of `name`'s current incarnation."""
        return self.running[name].pid

    def logs_of(self, name: str) -> list[Path]:
        """Every log file `name`'s incarnations wrote, oldest first."""
        count = self._incarnations.get(name, 0)
        return [
            self.logs / f"{name}.{n}.{stream}"
            for n in range(1, count + 1)
            for stream in ("out", "err")
        ]

    async def close(self) -> None:
        """SIGTERM every group (SIGCONT too: a stopped process acts on nothing), SIGKILL what
        is still there after `CLOSE_SECONDS`, and reap everything; idempotent."""
        running, self.running = self.running, {}
        for launched in running.values():
            launched.kill(signal.SIGTERM)
            launched.kill(signal.SIGCONT)
        await asyncio.gather(*(_reap(launched) for launched in running.values()))


async def _reap(launched: LaunchedMember) -> None:
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(asyncio.shield(launched.wait()), CLOSE_SECONDS)
    launched.kill(signal.SIGKILL)  # the workers too, even when the leader exited
    await launched.wait()


async def discover(spec: FleetSpec, logs: Path) -> list[ServerFacts]:
    """Start every member once, read its kind (and a resources server's `mode` fact), stop
    them: the facts, in the fleet file's order. It also proves that every command starts,
    before any baseline is spent on the fleet (`MemberNotStarted` names the one that did
    not)."""
    processes = FleetProcesses(spec, logs)
    try:
        await processes.start_all()
        credentials = await asyncio.to_thread(spec.credentials)
        facts = []
        for member in spec.members:
            async with spec.client(member, timeout=FACTS_SECONDS, credentials=credentials) as c:
                described = await c.get_participant()
            kind = KINDS.get(described.kind, "unknown")
            mode = described.facts.get("mode") if kind == "resources" else None
            facts.append(ServerFacts(member.name, kind, mode))
        return facts
    finally:
        await processes.close()
