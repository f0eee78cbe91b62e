"""A trial's fault, done to the running fleet at the moment its plan names.

Each fault is what a real failure does, and recovery is left to the product: a killed member
is replaced by the same command started closed (as Kubernetes restarts a pod) and the running
collector notices and recovers in place; a killed collector is followed by the product's own
`collect --resume`; a stopped member stays stopped past the lease of the checkpoint it froze,
so it reopens on its own as the contract says; the storage fails for the rest of one
checkpoint, then comes back. Certify never restores, resumes or retires anything itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

from rollout_checkpoint.client.certify.controller import ControllerProcess
from rollout_checkpoint.client.certify.findings import Fault, TrialPlan
from rollout_checkpoint.client.certify.fleet_processes import FleetProcesses
from rollout_checkpoint.client.errors import ControlError
from rollout_checkpoint.client.fleet.spec import FleetSpec, MemberSpec

LEASE_MARGIN_SECONDS = 1.0
"""How long past a lease a stopped member stays stopped: its lease has certainly expired."""
STOP_BOUND_SECONDS = 120.0
"""The longest a member stays stopped. A lease further out than this (the default lease
grace is 600 s) is not waited for: the trial says so in its note, and the member is
continued, its lease not expired."""
STATUS_SECONDS = 2.0
"""The timeout of one GetStatus while a member is stopped."""
POLL_SECONDS = 0.25
"""Between two reads of the members' leases, or of the collector's log, while a fault lasts:
the wait is for other processes' state, which sends no event certify could await."""
STORAGE_SECONDS_PAST_TIMEOUT = 5.0
"""How long past `--checkpoint-timeout` the storage stays failed at most, should the
collector never say that the checkpoint under way ended."""
CHECKPOINT_ENDED = ("collect: checkpoint", "collect: the fleet was not prepared")
"""The collector's notes that end a checkpoint (published, failed, not prepared)."""

Resume = Callable[[], Awaitable[ControllerProcess]]
"""Starts the product's `collect --resume` with the run's flags."""


@dataclass
class Striker:
    """Does one trial's fault (`strike`) on `processes`, with `controller` paused at the
    plan's step (or running, for a mid-step fault)."""

    plan: TrialPlan
    spec: FleetSpec
    processes: FleetProcesses
    checkpoint_root: Path
    checkpoint_timeout: float
    resume: Resume
    notes: list[str] = field(default_factory=list)
    """What the fault did (one line each), for the trial's note."""
    killed_controllers: int = 0
    """Collectors this fault killed (their exit code is certify's doing, not the product's)."""

    async def strike(self, controller: ControllerProcess) -> ControllerProcess:
        """Do the fault; the collector that runs on afterwards (a new one after a kill)."""
        fault = self.plan.fault
        if fault is Fault.KILL_CONTROLLER:
            controller.kill()
            await controller.wait()
            self.killed_controllers += 1
            self.notes.append("collector SIGKILLed; `collect --resume` continues the run")
            return await self.resume()
        if fault is Fault.KILL_MEMBER:
            await self._kill_and_replace([self._target()])
        elif fault is Fault.KILL_FLEET:
            await self._kill_and_replace(list(self.processes.running))
        elif fault is Fault.STOP_MEMBER:
            await self._stop_past_lease(self._target(), controller)
            return controller
        elif fault is Fault.STORAGE:
            await self._storage_fails(controller)
            return controller
        controller.cont()
        return controller

    def _target(self) -> str:
        if self.plan.target is None:
            raise ValueError(f"trial {self.plan.number}: {self.plan.fault} needs a target")
        return self.plan.target

    async def _kill_and_replace(self, names: list[str]) -> None:
        """SIGKILL every group at once, then start each replacement closed."""
        await asyncio.gather(*(self.processes.kill(name) for name in names))
        await asyncio.gather(*(self.processes.replace(name) for name in names))
        self.notes.append(f"SIGKILLed {', '.join(names)}; replacement(s) started closed")

    async def _stop_past_lease(self, name: str, controller: ControllerProcess) -> None:
        """SIGSTOP `name` and continue the collector; SIGCONT `name` once the lease of every
        checkpoint that met it meanwhile has expired (read from the other members), but not
        before a checkpoint had the time to give up on it."""
        member = next(m for m in self.spec.members if m.name == name)
        lease = await self._lease(member) or 0.0
        self.processes.stop(name)
        controller.cont()
        started = time.time()
        until = max(lease + LEASE_MARGIN_SECONDS, started + self.checkpoint_timeout)
        others = [m for m in self.spec.members if m.name != name]
        while time.time() < until and controller.process.returncode is None:
            if time.time() - started > STOP_BOUND_SECONDS:
                self.notes.append(
                    f"{name}'s lease ends {until - started:.0f} s after the stop; "
                    f"continued after {STOP_BOUND_SECONDS:g} s, its lease not expired"
                )
                break
            leases = await asyncio.gather(*(self._lease(m) for m in others))
            seen = max((x for x in leases if x is not None), default=0.0)
            until = max(until, seen + LEASE_MARGIN_SECONDS)
            await asyncio.sleep(POLL_SECONDS)
        self.processes.cont(name)
        self.notes.append(f"SIGSTOPped {name} for {time.time() - started:.1f} s")

    async def _lease(self, member: MemberSpec) -> float | None:
        """When `member`'s lease of the checkpoint it is in expires (None: in none, or it
        does not answer)."""
        credentials = await asyncio.to_thread(self.spec.credentials)
        async with self.spec.client(member, timeout=STATUS_SECONDS, credentials=credentials) as c:
            try:
                status = await c.get_status()
            except ControlError:
                return None
        if not status.HasField("lease_expires_at"):
            return None
        return float(status.lease_expires_at.ToNanoseconds()) / 1e9

    async def _storage_fails(self, controller: ControllerProcess) -> None:
        """The checkpoint root fails for the rest of the checkpoint under way: it is moved
        aside and a regular file takes its place, so every write below it fails (ENOTDIR),
        for the collector and the members alike, whoever runs them (a read-only mode does
        not stop root). Open files (the dispatch log) keep working, as on a volume that
        turned read-only. Once the collector says the checkpoint ended, the root is back."""
        root = self.checkpoint_root
        aside = root.with_name(root.name + ".certify-aside")
        offset = await asyncio.to_thread(_size, controller.log)
        await asyncio.to_thread(_swap_in_file, root, aside)
        try:
            controller.cont()
            deadline = time.time() + self.checkpoint_timeout + STORAGE_SECONDS_PAST_TIMEOUT
            while time.time() < deadline and controller.process.returncode is None:
                if await asyncio.to_thread(_said_after, controller.log, offset, CHECKPOINT_ENDED):
                    break
                await asyncio.sleep(POLL_SECONDS)
        finally:
            await asyncio.to_thread(_swap_back, root, aside)
        self.notes.append("checkpoint root failing (not a directory) until that checkpoint ended")


def _size(path: Path) -> int:
    return path.stat().st_size if path.exists() else 0


def _said_after(log: Path, offset: int, phrases: tuple[str, ...]) -> bool:
    with contextlib.suppress(FileNotFoundError), log.open("rb") as file:
        file.seek(offset)
        text = file.read().decode(errors="replace")
        return any(phrase in text for phrase in phrases)
    return False


def _swap_in_file(root: Path, aside: Path) -> None:
    root.rename(aside)
    root.write_bytes(b"certify: the checkpoint storage is failing on purpose\n")


def _swap_back(root: Path, aside: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        root.unlink()
    aside.rename(root)
