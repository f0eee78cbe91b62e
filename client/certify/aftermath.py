"""What a trial left behind, read after (or while) the product recovered: how soon the fleet
reopened, which rollouts the product restarted, and whether every checkpoint it published
restores (`RestoreBench`).
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from rollout_checkpoint.client.certify.fleet_processes import FleetProcesses
from rollout_checkpoint.client.checkpointing import fanout
from rollout_checkpoint.client.checkpointing.checkpoint import restore_published
from rollout_checkpoint.client.checkpointing.fanout import FleetError
from rollout_checkpoint.client.checkpointing.publication import (
    PublicationError,
    PublicationRoot,
    store_call,
)
from rollout_checkpoint.client.errors import ControlError
from rollout_checkpoint.client.fleet import DiscoveryError, Fleet
from rollout_checkpoint.client.fleet.spec import FleetSpec
from rollout_checkpoint.server.core.episodes import EpisodeId
from rollout_checkpoint.server.core.errors import CheckpointError

STATUS_SECONDS = 2.0
"""The timeout of one GetStatus while the fleet reopens (a stopped member does not answer)."""
STATUS_POLL_SECONDS = 0.1
"""Between two rounds of GetStatus: the precision of a reopen time."""
RESTORE_SECONDS = 60.0
"""The deadline of one restore of a published checkpoint into the bench (`RestoreBench`)."""


async def seconds_until_open(spec: FleetSpec, since: float, deadline: float) -> float | None:
    """Seconds from `since` until every member's admission is open at once (GetStatus, read
    every `STATUS_POLL_SECONDS`: a short checkpoint pause keeps readiness SERVING, so the
    health stream cannot tell); None when that did not happen by `deadline` (both
    `time.monotonic()`)."""
    credentials = await asyncio.to_thread(spec.credentials)
    clients = [
        spec.client(m, timeout=STATUS_SECONDS, credentials=credentials) for m in spec.members
    ]
    try:
        while time.monotonic() < deadline:
            statuses = await asyncio.gather(
                *(c.get_status() for c in clients), return_exceptions=True
            )
            if all(not isinstance(s, BaseException) and s.admission_open for s in statuses):
                return time.monotonic() - since
            await asyncio.sleep(STATUS_POLL_SECONDS)
        return None
    finally:
        await asyncio.gather(*(c.close() for c in clients))


def restarted_rollouts(
    rows: Iterable[Mapping[str, Any]],
    dispatched: Mapping[str, list[int]],
    continued: set[EpisodeId],
) -> dict[str, str]:
    """Rollout id -> why the product ran it again from its input: a rollout finished as
    attempt A > 0 whose attempt A-1 no published checkpoint continued was sent again from
    its input (after a failure it retried, or a loss that could continue nothing). A
    continued rollout (A-1 in a checkpoint's scope) is not: it must equal the baseline."""
    restarted = {}
    for row in rows:
        attempt = int(row.get("attempt", 0))
        rollout_id = str(row.get("rollout_id"))
        if row.get("status") != "ok" or attempt == 0:
            continue
        if EpisodeId(rollout_id, attempt - 1) in continued:
            continue
        sent = dispatched.get(rollout_id, [])
        restarted[rollout_id] = (
            f"attempt {attempt} sent from its input (attempts dispatched: "
            f"{', '.join(map(str, sent)) or 'none'}); no checkpoint continued attempt "
            f"{attempt - 1}"
        )
    return restarted


async def continued_episodes(root: PublicationRoot, published: Iterable[str]) -> set[EpisodeId]:
    """Every episode some published checkpoint under `root` continues."""
    episodes: set[EpisodeId] = set()
    for checkpoint_id in published:
        with contextlib.suppress(PublicationError, OSError, ValueError):
            manifest = await store_call(
                time.time() + RESTORE_SECONDS,
                root.location,
                root.read_fleet_manifest,
                checkpoint_id,
            )
            episodes.update(manifest.continued)
    return episodes


class RestoreBench:
    """Where the trials' published checkpoints are restored: one start-closed fleet that takes
    each trial's `LATEST` in turn (restore in place), instead of a fleet started per trial.

    Starting a fleet is most of what a trial costs (each member imports its server, on two
    loaded cores), and the restore check used to start one more fleet per trial. The product
    restores into processes that already hold a restore (a rejoining Restore: each member
    first retires every episode it holds and forgets having served, or refuses), so one
    fleet takes every trial's checkpoint: the first restore goes into fresh processes, each
    later one rejoins, after a Resume that ends the restore before (a member restores only
    from IDLE). A failure in place is never a finding by itself: that checkpoint is restored
    again into fresh processes (the bench's are replaced) and only that verdict counts, so a
    kind that cannot forget having served (FRESH_PROCESS_REQUIRED) costs time, never a false
    finding. What only a fresh process would catch is a restore hook that fails unless an
    earlier restore left process-wide state behind; the bench's first restore, and every
    `--only N` rerun, goes into fresh processes.

    The bench runs between trials, never during one: its members take the fleet's addresses.
    `close` stops it (idempotent); a trial's fleet can start after."""

    def __init__(
        self, spec: FleetSpec, logs: Path, extra_args: Mapping[str, Sequence[str]]
    ) -> None:
        self.spec, self.logs, self.extra_args = spec, logs, extra_args
        self.processes: FleetProcesses | None = None
        self.fleets = 0
        """Fleets the bench started (each logs in a folder of its own)."""

    async def failures(self, root: PublicationRoot, published: list[str]) -> dict[str, str]:
        """Checkpoint id -> why it does not restore: `LATEST` restored into the bench (a
        failure in place is confirmed in fresh processes), every other checkpoint of
        `published` read back and verified whole."""
        if not published:
            return {}
        latest = await store_call(time.time() + RESTORE_SECONDS, root.location, root.latest)
        failures: dict[str, str] = {}
        in_place = self.processes is not None
        failure = await self._restore(root, latest)
        if failure is not None and in_place:
            await self.close()
            failure = await self._restore(root, latest)
        if failure is not None:
            failures[latest or "LATEST"] = failure
            await self.close()  # what a failed restore left is in doubt: the next gets fresh ones
        for checkpoint_id in published:
            if checkpoint_id == latest:
                continue
            try:
                await store_call(
                    time.time() + RESTORE_SECONDS, root.location, root.inspect, checkpoint_id
                )
            except (PublicationError, OSError) as error:
                failures[checkpoint_id] = f"does not read back: {error}"
        return failures

    async def close(self) -> None:
        """Stop the bench's processes (the next restore starts fresh ones)."""
        processes, self.processes = self.processes, None
        if processes is not None:
            await processes.close()

    async def _restore(self, root: PublicationRoot, source: str | None) -> str | None:
        """Restore `source` into the bench (into fresh processes when it has none): None, or
        why it failed. A restored bench is resumed, so that the next restore may rejoin; one
        that does not resume is stopped (the next restore gets fresh processes)."""
        fresh = self.processes is None
        where = "fresh processes" if fresh else "the restored fleet (in place)"
        await self._start()
        try:
            fleet = await Fleet.discover(self.spec)
        except DiscoveryError as error:
            return f"{where} could not be discovered: {error}"
        control_id = f"certify-restore-{secrets.token_hex(6)}"
        deadline = time.time() + RESTORE_SECONDS
        try:
            try:
                await restore_published(
                    fleet, root, control_id, deadline, source=source, rejoin=not fresh
                )
            except (PublicationError, FleetError, ControlError, CheckpointError) as error:
                return f"restore into {where} failed: {error}"
            try:
                await fanout.resume(fleet, control_id, deadline)
            except FleetError:
                await self.close()
            return None
        finally:
            await fleet.close()

    async def _start(self) -> None:
        """Start the bench's fleet, closed, unless it runs (`MemberNotStarted` when a member
        does not come up: certify cannot run the fleet)."""
        if self.processes is not None:
            return
        self.fleets += 1
        logs = self.logs / f"fleet-{self.fleets}"
        processes = FleetProcesses(self.spec, logs, extra_args=self.extra_args)
        self.processes = processes
        await processes.start_all(replacement=True)
