"""One interface for a controller's checkpoint root, on disk or on an object store.

Controllers (`checkpoint`, `restore --source`, `collect`, the coordinator and its supervisor)
take a `PublicationRoot` from `open_checkpoint_root(location)` and never learn which backend
holds it: a path gives `CheckpointRoot` (the local filesystem), an `s3://`, `gs://` or `az://`
URL gives `ObjectCheckpointRoot`. Both publish with the same guarantees (see each module's
doc). Every method blocks: run it in a thread from asyncio code.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Protocol

from rollout_checkpoint.client.checkpointing.publication.manifest import (
    FleetManifest,
    PublishedParticipant,
)
from rollout_checkpoint.client.checkpointing.publication.root import (
    CheckpointRoot,
    CrashHook,
    PublishedCheckpoint,
)
from rollout_checkpoint.client.checkpointing.publication.verify import CheckpointSummary
from rollout_checkpoint.server.core.episodes import EpisodeId
from rollout_checkpoint.server.core.object_store import is_object_url


class PublicationRoot(Protocol):
    """What a controller does with its checkpoint root (see `CheckpointRoot`)."""

    location: str
    """The root as an operator names it: a path or a URL (for messages and --json)."""

    def new_checkpoint_id(self) -> str:
        """A fresh id (`ckpt-<UTC time>-<8 hex>`) not yet used under this root."""
        ...

    def directory(self, checkpoint_id: str) -> Path | str:
        """The checkpoint's directory: what a Commit or Restore names as `checkpoint_dir`."""
        ...

    def publish(
        self,
        checkpoint_id: str,
        participants: Sequence[PublishedParticipant],
        continued: Iterable[EpisodeId],
        controller_state: bytes,
        *,
        keep: int = 2,
        created_at: datetime | None = None,
        verify_records: bool = True,
        defer_retention: bool = False,
    ) -> PublishedCheckpoint:
        """Verify every part, write the fleet manifest, move `LATEST`, apply retention (see
        `CheckpointRoot.publish`); safe to retry with the same arguments."""
        ...

    def complete_retention(self, published: PublishedCheckpoint) -> PublishedCheckpoint:
        """Apply a deferred retention (see `PendingRetention`); never raises for a failed
        deletion."""
        ...

    def latest(self) -> str | None:
        """The id `LATEST` names, or None when nothing was published yet."""
        ...

    def load(self, checkpoint_id_or_latest: str | None = None) -> FleetManifest:
        """The verified fleet manifest of a published checkpoint (None or "LATEST": latest);
        verified whole first, because what a restore installs must be what was published."""
        ...

    def inspect(self, checkpoint_id_or_latest: str | None = None) -> CheckpointSummary:
        """`load`, returning the whole verified summary."""
        ...

    def published(self) -> list[str]:
        """Ids of the published checkpoints, oldest first."""
        ...

    def read_fleet_manifest(self, checkpoint_id: str) -> FleetManifest:
        """The fleet manifest of a published checkpoint, decoded (not verified)."""
        ...


def open_checkpoint_root(
    location: str | os.PathLike[str],
    *,
    clock: Callable[[], datetime] | None = None,
    crash_hook: CrashHook | None = None,
) -> PublicationRoot:
    """The root at `location`: an object-store root for a URL, else a local directory
    (created with its parents; OSError when it cannot be). A URL that is not a valid location
    is a ValueError; a store that cannot be configured (or a missing `[s3]` extra) a
    PublicationError."""
    text = os.fspath(location)
    if is_object_url(text):
        from rollout_checkpoint.client.checkpointing.publication.object_root import (
            ObjectCheckpointRoot,
        )

        return ObjectCheckpointRoot(text, clock=clock, crash_hook=crash_hook)
    return CheckpointRoot(text, clock=clock, crash_hook=crash_hook)
