"""What a trial left behind, read after (or while) the product recovered: how soon the fleet
reopened, which rollouts the product restarted, and whether every checkpoint it published
restores into fresh processes.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from rollout_checkpoint.client.certify.fleet_processes import FleetProcesses
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
"""The deadline of the restore of a published checkpoint into fresh processes."""


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


async def restore_failures(
    spec: FleetSpec,
    root: PublicationRoot,
    published: list[str],
    logs: Path,
    extra_args: Mapping[str, list[str]],
) -> dict[str, str]:
    """Checkpoint id -> why it does not restore: `LATEST` restored into fresh processes of
    every member (started closed, as after losing the whole fleet), every other kept
    checkpoint read back and verified whole. The fresh processes are always stopped."""
    if not published:
        return {}
    failures: dict[str, str] = {}
    latest = await store_call(time.time() + RESTORE_SECONDS, root.location, root.latest)
    fresh = FleetProcesses(spec, logs, extra_args=extra_args)
    try:
        await fresh.start_all(replacement=True)
        fleet = await Fleet.discover(spec)
        try:
            await restore_published(
                fleet,
                root,
                f"certify-restore-{secrets.token_hex(6)}",
                time.time() + RESTORE_SECONDS,
                source=latest,
            )
        except (PublicationError, FleetError, ControlError, CheckpointError) as error:
            failures[latest or "LATEST"] = f"restore into fresh processes failed: {error}"
        finally:
            await fleet.close()
    except DiscoveryError as error:
        failures[latest or "LATEST"] = f"fresh processes could not be discovered: {error}"
    finally:
        await fresh.close()
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
