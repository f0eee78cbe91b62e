"""`rollout-checkpoint demo --self-heal`: one member of a live fleet dies, and the fleet heals itself.

No person restores anything. The fleet runs under `rollout-checkpoint coordinator --supervise`
(a real process) and a trainer that drives its rollouts itself and follows `WatchFleet`:

1. baseline: the rollouts on an uninterrupted fleet, every trajectory recorded;
2. the same rollouts on a fresh fleet, while the supervisor checkpoints it every half second;
3. once a published checkpoint continues rollouts that are in flight, one member (the policy
   model by default) is SIGKILLed and its replacement started closed on the same addresses,
   as Kubernetes restarts a pod;
4. the supervisor sees the new boot id, restores the whole fleet from `LATEST` (the survivors
   rejoin) and reopens it; from `recovery_finished` the trainer re-sends each continued rollout
   as its new attempt (it continues from its boundary) and each lost one from its input;
5. checks: every rollout finished exactly once, every trajectory equals the baseline, some
   rollout continued from the checkpoint, no traceback in any server log; numbers: rollouts in
   flight at the kill and the time from the kill to the fleet open again.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from grpc import aio

from rollout_checkpoint.server.core.episodes import EpisodeId
from rollout_checkpoint.server.core.keep_alive import client_limits
from rollout_checkpoint.v1 import coordinator_service_pb2 as cpb
from rollout_checkpoint.v1 import coordinator_service_pb2_grpc as cpb_grpc

from .demo import (
    DemoFailed,
    FleetProcesses,
    Options,
    Report,
    Rollout,
    check_trajectories,
    launch_server,
    make_rollouts,
    signal_group,
    start_announcing,
    start_fleet,
)

RECOVERY_TIMEOUT_SECONDS = 120.0
CHECKPOINT_EVERY_SECONDS = 0.5
"""Often enough that a checkpoint catches rollouts in flight: a checkpoint names only those
(finished ones are released), and the example's rollouts take about a second or two."""


@dataclass
class Recovered:
    """A `recovery_finished` event: what the trainer re-sends, and when the fleet opened."""

    continued: dict[str, int]
    restarted: dict[str, int]
    at: float
    supervisor_seconds: float


@dataclass
class FleetEvents:
    """What the trainer learns from WatchFleet."""

    recoveries: list[Recovered] = field(default_factory=list)
    published: list[cpb.CheckpointPublished] = field(default_factory=list)
    gave_up: str | None = None
    changed: asyncio.Condition = field(default_factory=asyncio.Condition)

    async def follow(self, address: str, token: str) -> None:
        """Read WatchFleet until cancelled."""
        async with aio.insecure_channel(address) as channel:
            stub = cpb_grpc.CoordinatorServiceStub(channel)
            metadata = (("authorization", f"Bearer {token}"),)
            async for reply in stub.WatchFleet(cpb.WatchFleetRequest(), metadata=metadata):
                await self._on(reply.event)

    async def _on(self, event: cpb.FleetEvent) -> None:
        kind = event.WhichOneof("event")
        async with self.changed:
            if kind == "checkpoint_published":
                self.published.append(event.checkpoint_published)
            elif kind == "recovery_finished":
                finished = event.recovery_finished
                self.recoveries.append(
                    Recovered(
                        {e.rollout_id: e.attempt for e in finished.continued},
                        {e.rollout_id: e.attempt for e in finished.restarted},
                        event.time.seconds + event.time.nanos / 1e9,
                        finished.duration.seconds + finished.duration.nanos / 1e9,
                    )
                )
            elif kind == "recovery_given_up":
                self.gave_up = event.recovery_given_up.reason
            self.changed.notify_all()

    async def recovery_after(self, seen: int, within: float) -> Recovered:
        """The newest recovery once there are more than `seen` (waiting `within` seconds)."""
        async with self.changed:
            await asyncio.wait_for(
                self.changed.wait_for(lambda: len(self.recoveries) > seen or bool(self.gave_up)),
                within,
            )
            if self.gave_up:
                raise DemoFailed(f"the supervisor gave up: {self.gave_up}")
            return self.recoveries[-1]

    async def published_with(self, at_least: int, within: float) -> cpb.CheckpointPublished:
        """The first published checkpoint that continues at least `at_least` rollouts."""

        def found() -> bool:
            return any(len(p.continued) >= at_least for p in self.published)

        async with self.changed:
            await asyncio.wait_for(self.changed.wait_for(found), within)
            return next(p for p in self.published if len(p.continued) >= at_least)


class Trainer:
    """Drives every rollout to its final reply, following the supervisor's recoveries.

    A failed attempt (an error reply, `stale_attempt`) waits for a recovery that came after
    the attempt was sent, then goes on as that recovery says: a continued rollout as the
    attempt given, a restarted one from its input as the next attempt after the one given,
    any other as its next attempt. A refusal because admission is closed (a checkpoint in
    progress) sends the same attempt again shortly."""

    def __init__(self, env_url: str, events: FleetEvents, concurrency: int) -> None:
        self.env_url = env_url
        self.events = events
        self.limit = asyncio.Semaphore(concurrency)
        self.continued: set[str] = set()
        self.restarted: set[str] = set()

    async def run(self, rollouts: list[Rollout]) -> None:
        async with httpx.AsyncClient(
            timeout=httpx.Timeout(300.0), limits=client_limits()
        ) as client:
            await asyncio.gather(*(self._drive(client, r) for r in rollouts))

    async def _drive(self, client: httpx.AsyncClient, rollout: Rollout) -> None:
        async with self.limit:
            seen = len(self.events.recoveries)
            while rollout.reply is None:
                outcome = await self._send(client, rollout)
                if outcome == "done":
                    return
                if outcome == "closed":
                    await asyncio.sleep(0.05)
                    continue
                recovery = await self.events.recovery_after(seen, RECOVERY_TIMEOUT_SECONDS)
                seen = len(self.events.recoveries)
                rollout.attempt = self._next_attempt(rollout, recovery)

    def _next_attempt(self, rollout: Rollout, recovery: Recovered) -> int:
        if rollout.rollout_id in recovery.continued:
            self.continued.add(rollout.rollout_id)
            return recovery.continued[rollout.rollout_id]
        if rollout.rollout_id in recovery.restarted:
            self.restarted.add(rollout.rollout_id)
            return recovery.restarted[rollout.rollout_id] + 1
        return rollout.attempt + 1

    async def _send(self, client: httpx.AsyncClient, rollout: Rollout) -> str:
        key = EpisodeId(rollout.rollout_id, rollout.attempt).capture_key
        rollout.dispatched = True
        try:
            response = await client.post(
                f"{self.env_url}/ng-rollout/{key}/run", json={"task": rollout.task}
            )
        except httpx.HTTPError as error:
            rollout.error = type(error).__name__
            return "failed"
        try:
            body: Any = response.json()
        except ValueError:
            body = None
        refusal = body.get("error") if isinstance(body, dict) else None
        code = refusal.get("code") if isinstance(refusal, dict) else None
        if response.status_code == 409 and code in ("admission_closed", "awaiting_restore"):
            return "closed"
        if response.status_code != 200 or not isinstance(body, dict):
            # A failed run answers a failure status (the environment passes its agent's
            # on): the rollout waits for the recovery that says what to re-send.
            rollout.error = f"HTTP {response.status_code}: {response.text[:200]}"
            return "failed"
        rollout.reply = body
        return "done"


class SelfHealDemo:
    """The scenario of the module docstring."""

    def __init__(self, options: Options, victim: str, say: Any, token: str) -> None:
        self.options = options
        self.victim = victim
        self.say = say
        self.token = token
        self.report = Report()
        self.fleets: list[FleetProcesses] = []
        self.coordinator: subprocess.Popen[str] | None = None

    async def run(self, work: Path, baseline: dict[str, Rollout]) -> Report:
        logs = work / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        try:
            await self._supervised_run(work, logs, baseline)
        finally:
            if self.coordinator is not None:
                signal_group(self.coordinator, signal.SIGTERM)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.coordinator.wait(timeout=20)
                signal_group(self.coordinator, signal.SIGKILL)
            for fleet in self.fleets:
                fleet.stop()
        return self.report

    async def _supervised_run(self, work: Path, logs: Path, baseline: dict[str, Rollout]) -> None:
        options = self.options
        self.say(
            f"[bold]2/4 the same rollouts under a supervising coordinator[/] "
            f"(checkpoint every {CHECKPOINT_EVERY_SECONDS:g} s)"
        )
        fleet = await start_fleet("supervised", logs, self.token, options, start_closed=False)
        self.fleets.append(fleet)
        address = self._start_coordinator(work, logs, fleet)
        events = FleetEvents()
        follower = asyncio.ensure_future(events.follow(address, self.token))
        rollouts = make_rollouts(options.rollouts)
        trainer = Trainer(fleet.url("environment"), events, options.concurrency)
        training = asyncio.ensure_future(trainer.run(rollouts))
        try:
            at_least = max(1, min(options.concurrency, options.rollouts) // 4)
            published = await self._first_useful_checkpoint(events, training, at_least)
            in_flight = sum(r.dispatched and r.reply is None for r in rollouts)
            self.say(
                f"[bold]3/4 SIGKILL[/] {self.victim} with {in_flight} rollouts in flight "
                f"(checkpoint {published.checkpoint_id} continues {len(published.continued)}); "
                "its replacement starts closed on the same addresses"
            )
            killed_at = time.time()
            self._replace(fleet, logs)
            recovered = await events.recovery_after(0, RECOVERY_TIMEOUT_SECONDS)
            self.say(
                f"[bold]4/4 recovered[/] in {recovered.at - killed_at:.2f} s: "
                f"{len(recovered.continued)} rollouts continue, {len(recovered.restarted)} restart"
            )
            await asyncio.wait_for(training, options.timeout + RECOVERY_TIMEOUT_SECONDS)
        finally:
            follower.cancel()
            training.cancel()
            await asyncio.gather(follower, training, return_exceptions=True)
        numbers = self.report.numbers
        numbers["in_flight_at_kill"] = in_flight
        numbers["checkpoint_continued"] = len(published.continued)
        numbers["recovery_seconds"] = round(recovered.at - killed_at, 3)
        numbers["supervisor_recovery_seconds"] = round(recovered.supervisor_seconds, 3)
        numbers["recoveries"] = len(events.recoveries)
        numbers["rollouts_continued"] = len(trainer.continued)
        numbers["rollouts_restarted"] = len(trainer.restarted)
        self._compare(rollouts, baseline, trainer)

    async def _first_useful_checkpoint(
        self, events: FleetEvents, training: asyncio.Future[None], at_least: int
    ) -> cpb.CheckpointPublished:
        waiting = asyncio.ensure_future(events.published_with(at_least, self.options.timeout))
        either: set[asyncio.Future[Any]] = {waiting, training}
        done, _ = await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
        if waiting not in done:
            waiting.cancel()
            raise DemoFailed(
                f"every rollout finished before a checkpoint continued {at_least} of them "
                "(raise --rollouts or --latency)"
            )
        return waiting.result()

    def _start_coordinator(self, work: Path, logs: Path, fleet: FleetProcesses) -> str:
        token_file = work / "token"
        token_file.write_text(self.token)
        token_file.chmod(0o600)
        members = "".join(
            f'[[participants]]\nname = "{s.name}"\naddress = "{s.grpc}"\n'
            for s in fleet.servers.values()
        )
        fleet_file = work / "fleet.toml"
        fleet_file.write_text(
            f'token_file = "token"\ncheckpoint_root = "checkpoints"\nkeep = 2\n{members}'
        )
        command = [
            sys.executable,
            "-m",
            "rollout_checkpoint.client.cli.main",
            "coordinator",
            "--fleet",
            str(fleet_file),
            "--grpc-address",
            "127.0.0.1:0",
            "--supervise",
            "--checkpoint-every",
            str(CHECKPOINT_EVERY_SECONDS),
            "--recovery-backoff",
            "0.5",
        ]
        try:
            process, announced = start_announcing(
                command, "the coordinator", logs / "coordinator.log"
            )
        except RuntimeError as error:
            raise DemoFailed(str(error)) from None
        self.coordinator = process
        address: str = announced["grpc"]
        return address

    def _replace(self, fleet: FleetProcesses, logs: Path) -> None:
        """SIGKILL the victim and start its replacement closed on the same addresses."""
        old = fleet.servers[self.victim]
        signal_group(old.process, signal.SIGKILL)
        old.process.wait(timeout=30)
        args = [*old.args, "--http-address", old.http, "--grpc-address", old.grpc]
        if "--start-closed" not in args:
            args.append("--start-closed")
        fleet.servers[self.victim] = launch_server("replacement", logs, old.name, old.kind, args)

    def _compare(
        self, rollouts: list[Rollout], baseline: dict[str, Rollout], trainer: Trainer
    ) -> None:
        report = self.report
        check_trajectories(report, rollouts, baseline)
        report.check(
            "some_rollout_continued_from_the_checkpoint",
            bool(trainer.continued),
            "no rollout was continued from the checkpoint",
        )
        resumed_mid_episode = [
            r.rollout_id
            for r in rollouts
            if r.rollout_id in trainer.continued
            and r.reply is not None
            and r.reply.get("continued_from_step") is not None
        ]
        report.numbers["continued_mid_episode"] = len(resumed_mid_episode)
