"""The demo's checkpoint steps against a live fleet: take one, restore one, take the second."""

from __future__ import annotations

import asyncio
import shutil
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from rollout_checkpoint import client
from rollout_checkpoint.client import CheckpointRoot, Fleet, PublishedParticipant, restore_published
from rollout_checkpoint.server.core.episodes import EpisodeId

from .comparison import records_by_rollout
from .fleet import FleetProcesses
from .options import Options
from .report import DemoFailed, Report
from .rollouts import Rollout


def _state(state: int) -> str:
    return {1: "IDLE", 2: "PREPARING", 3: "PREPARED", 4: "COMMITTED", 5: "RESTORED"}.get(state, "?")


class CheckpointSteps:
    """Checkpointing and restoring a live demo fleet, as a controller does it: prepare with
    streaming progress, commit the in-flight rollouts as the scope, publish; restore LATEST
    all or nothing, then resume.

    Apart from the tour because these steps talk to the fleet through the controller library
    (`fanout`, `restore_published`), while the tour only sequences them: a test can
    take a checkpoint of its own fleet with the very steps the demo uses."""

    def __init__(
        self, options: Options, token: str, report: Report, say: Callable[[str], None]
    ) -> None:
        self.options = options
        self.token = token
        self.report = report
        self.say = say

    async def take_checkpoint(
        self, processes: FleetProcesses, root: CheckpointRoot, rollouts: list[Rollout]
    ) -> dict[str, Any]:
        deadline = time.time() + self.options.timeout
        checkpoint_id = root.new_checkpoint_id()
        async with await Fleet.discover(processes.spec(self.token)) as fleet:
            started = time.monotonic()
            last = None
            async for progress in client.prepare(fleet, checkpoint_id, deadline):
                last = progress
                states = " ".join(
                    f"{m.name}:{_state(m.state) if m.reached else '-'}({m.readiness.blocker_count})"
                    for m in progress.members
                )
                self.say(
                    f"   prepare #{progress.sequence} {progress.elapsed * 1000:.1f} ms  {states}"
                )
            assert last is not None
            self.report.numbers["prepare_ms"] = round((time.monotonic() - started) * 1000, 2)
            if not last.prepared:
                raise DemoFailed(
                    f"the fleet did not get prepared: {last.outcome}, blockers {last.blockers()}"
                )
            agent = next(m for m in last.members if m.name == "agent")
            self.report.numbers["episodes_parked_at_boundary"] = agent.readiness.counts.get(
                "parked", 0
            )
            in_flight = await self.fix_scope(fleet, rollouts)
            commit_started = time.monotonic()
            directory = root.directory(checkpoint_id)
            result = await client.commit(
                fleet,
                checkpoint_id,
                deadline,
                str(directory),
                in_flight,
                asynchronous=self.options.async_commit,
            )
            self.report.numbers["commit_ms"] = round((time.monotonic() - commit_started) * 1000, 2)
            if self.options.async_commit:
                # The fleet is killed next, so it stays closed; the parts are awaited here.
                durable_started = time.monotonic()
                result = await client.await_parts(fleet, checkpoint_id, result, deadline)
                self.report.numbers["durable_ms"] = round(
                    (time.monotonic() - durable_started) * 1000, 2
                )
            parts = [
                PublishedParticipant(
                    m.name, m.kind_name, m.instance, result.members[m.name].manifest_sha256
                )
                for m in fleet.members
            ]
            published = await asyncio.to_thread(
                root.publish, checkpoint_id, parts, in_flight, b"", keep=2
            )
            self.report.numbers["in_flight_at_checkpoint"] = len(in_flight)
            self.report.numbers["sessions_exported"] = len(
                result.members["prompt_injection"].exported
            ) + len(result.members["counter"].exported)
            self.report.numbers["records"] = result.record_count()
            self.report.numbers["bytes"] = result.bytes()
            self.say(
                f"   committed and published {checkpoint_id}: {len(in_flight)} rollouts in flight, "
                f"{result.record_count()} records, {result.bytes()} bytes"
            )
            return {"id": checkpoint_id, "directory": published.directory, "scope": in_flight}

    async def fix_scope(self, fleet: Fleet, rollouts: list[Rollout]) -> list[EpisodeId]:
        """Every dispatched rollout without a reply: a reply already on the wire for an episode
        the environment no longer holds is awaited first, so it is neither lost nor redone."""
        environment = fleet.member("environment")
        for _ in range(200):
            held = {e.capture_key for e in await environment.client.all_episodes()}
            on_wire = [
                r
                for r in rollouts
                if r.dispatched and r.reply is None and r.error is None and r.rollout_id not in held
            ]
            if not on_wire:
                break
            await asyncio.sleep(0.01)
        return sorted(EpisodeId(r.rollout_id) for r in rollouts if r.dispatched and r.reply is None)

    async def restore_into(
        self,
        processes: FleetProcesses,
        root: CheckpointRoot,
        restore_id: str,
        *,
        timed: bool = False,
    ) -> tuple[EpisodeId, ...]:
        """Restore LATEST into fresh processes (all or nothing) and resume them."""
        deadline = time.time() + self.options.timeout
        async with await Fleet.discover(processes.spec(self.token)) as fleet:
            target = fleet
            if self.options.skip_resources_restore:
                # Negative control: without the resources' state the continuation cannot match.
                target = Fleet(fleet.spec, [m for m in fleet.members if m.kind_name != "resources"])
            started = time.monotonic()
            restored = await restore_published(target, root, restore_id, deadline)
            if timed:
                self.report.numbers["restore_ms"] = round((time.monotonic() - started) * 1000, 2)
            await client.resume(fleet, restore_id, deadline)
            return restored.continued

    async def second_checkpoint(
        self,
        fleet: Fleet,
        root: CheckpointRoot,
        first: dict[str, Any],
        continued: Iterable[EpisodeId],
    ) -> None:
        """A checkpoint of the restored state, before any replacement starts: it must export
        every restored session and boundary byte for byte as the first did (under N+1)."""
        scope = sorted(e.next_attempt() for e in continued)
        deadline = time.time() + self.options.timeout
        checkpoint_id = root.new_checkpoint_id()
        last = await client.prepare_until_done(fleet, checkpoint_id, deadline)
        if not last.prepared:
            raise DemoFailed(f"the restored fleet did not get prepared: {last.blockers()}")
        directory = root.directory(checkpoint_id)
        result = await client.commit(
            fleet,
            checkpoint_id,
            deadline,
            str(directory),
            scope,
            asynchronous=self.options.async_commit,
        )
        if self.options.async_commit:
            # Resume first, then await the parts: the restored fleet may move on while they
            # are written, and the parts must still hold the state of the cut, byte for byte.
            await client.resume(fleet, checkpoint_id, deadline)
            result = await client.await_parts(fleet, checkpoint_id, result, deadline)
        if self.options.crash_twice:
            parts = [
                PublishedParticipant(
                    m.name, m.kind_name, m.instance, result.members[m.name].manifest_sha256
                )
                for m in fleet.members
            ]
            await asyncio.to_thread(root.publish, checkpoint_id, parts, scope, b"", keep=2)
        if not self.options.async_commit:
            await client.resume(fleet, checkpoint_id, deadline)
        mismatches = []
        first_directory = Path(first["directory"])
        for part in (first_directory / "participants").glob("*/*"):
            before = records_by_rollout(first_directory, part.parent.name, part.name)
            after = records_by_rollout(directory, part.parent.name, part.name)
            if before != after:
                mismatches.append(f"{part.parent.name}/{part.name}")
        self.report.check(
            "second_checkpoint_matches_first", not mismatches, f"parts differ: {mismatches}"
        )
        if not self.options.crash_twice:
            shutil.rmtree(directory, ignore_errors=True)
