"""The controller's checkpoint root: publishing a checkpoint (see the package doc for the
order of its steps and why), and loading a published one."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import secrets
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path

from rollout_checkpoint.client.checkpointing.publication.errors import (
    CheckpointConflict,
    CheckpointCorrupt,
    NoPublishedCheckpoint,
    StorageFailed,
)
from rollout_checkpoint.client.checkpointing.publication.files import (
    DIR_FLAGS,
    ROOT_FLAGS,
    io_errors,
    open_failure,
    read_regular,
)
from rollout_checkpoint.client.checkpointing.publication.latest import (
    is_published,
    latest_is_newer,
    read_latest,
    write_latest,
)
from rollout_checkpoint.client.checkpointing.publication.manifest import (
    FleetManifest,
    PublishedParticipant,
    check_unique,
)
from rollout_checkpoint.client.checkpointing.publication.retention import apply_retention, scan_root
from rollout_checkpoint.client.checkpointing.publication.verify import (
    CheckpointSummary,
    verify_open,
    verify_part,
)
from rollout_checkpoint.server.core import daemon_threads, layout, safe_files
from rollout_checkpoint.server.core.episodes import EpisodeId, is_valid_id
from rollout_checkpoint.server.core.layout import (
    FLEET_MANIFEST_NAME,
    LATEST_NAME,
    PARTICIPANTS_DIR,
)
from rollout_checkpoint.server.core.part_reader import RecordsCheck
from rollout_checkpoint.server.core.safe_files import closing

log = logging.getLogger(__name__)

CrashHook = Callable[[str], None]
"""Called with the name of each publication step; fault tests stop the publisher there."""


@dataclass(frozen=True, slots=True)
class PublishedCheckpoint:
    """The result of a publication."""

    checkpoint_id: str
    """The published checkpoint's id."""
    directory: Path | str
    """The checkpoint's directory (a URL on an object store)."""
    fleet_manifest_sha256: str
    """The digest of its `checkpoint.json`."""
    manifest: FleetManifest
    """Its fleet manifest."""
    already_published: bool = False
    """True when an identical fleet manifest was already there (an idempotent retry)."""
    deleted: tuple[str, ...] = ()
    """Checkpoint directories retention removed (published and unpublished)."""
    pending_retention: PendingRetention | None = None
    """Set when the publication deferred its retention (`publish(..., defer_retention=True)`):
    what `complete_retention` needs. None once retention ran."""


@dataclass(frozen=True, slots=True)
class PendingRetention:
    """A publication's retention, deferred until the fleet runs again.

    Retention deletes whole checkpoints: at 1,000 members that is thousands of files, seconds
    on a busy disk, and inside the publication it kept the fleet closed for all of it. Nothing
    a restore needs is at stake (LATEST already names the new checkpoint and is read again
    before anything is deleted), so a controller publishes, resumes, then completes it."""

    keep: int
    """How many published checkpoints survive (the publication's `keep`)."""
    unpublished_before: int | datetime
    """Unpublished checkpoints older than this are abandoned attempts: the checkpoint
    directory's mtime in ns (a local root) or its oldest object's time (an object store), as
    it was before the publication wrote anything."""


class CheckpointRoot:
    """The controller's checkpoint root: checkpoint directories, `LATEST`, retention.

    All methods block; run them in a thread from asyncio code.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        clock: Callable[[], datetime] | None = None,
        crash_hook: CrashHook | None = None,
    ) -> None:
        """Use (and create, with its parents) the root directory `path`.

        `clock` gives the created_at of new publications and ids (default: now, UTC).
        `crash_hook` (fault tests only) is called with each publication step's name
        (`after_verify`, `after_fleet_manifest`, `after_latest`). Raises OSError when the
        directory cannot be created."""
        self.path = Path(path).absolute()
        self.location = str(self.path)
        """The root as an operator names it (a path here, a URL for an object-store root)."""
        if not self.path.is_dir():
            # Only when missing: mkdir is a write, which blocks on a frozen filesystem even
            # for a directory that exists, while reads (a restore, `inspect`) still answer.
            self.path.mkdir(parents=True, exist_ok=True)
        self._clock = clock or (lambda: datetime.now(UTC))
        self._crash_hook = crash_hook
        self._lock = threading.Lock()

    # -- ids ------------------------------------------------------------------------------

    def new_checkpoint_id(self) -> str:
        """`ckpt-<UTC YYYYmmddTHHMMSSZ>-<8 hex>`, not yet used under this root."""
        while True:
            stamp = self._clock().astimezone(UTC).strftime("%Y%m%dT%H%M%SZ")
            checkpoint_id = f"ckpt-{stamp}-{secrets.token_hex(4)}"
            if not os.path.lexists(self.path / checkpoint_id):
                return checkpoint_id

    def directory(self, checkpoint_id: str) -> Path:
        """`<root>/<checkpoint_id>`; ValueError for anything that is not a checkpoint id."""
        _check_checkpoint_id(checkpoint_id)
        return self.path / checkpoint_id

    # -- publish --------------------------------------------------------------------------

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
        """Verify every part, write `checkpoint.json`, move `LATEST`, apply retention.

        Safe to retry with the same arguments: an identical fleet manifest already in place
        is success (`already_published`), and the rest of the publication (LATEST,
        retention) is completed. Without `created_at` a retry adopts the created_at already
        published, so a retry after a crash is identical; with `created_at` a different
        time is a different manifest. Raises `CheckpointCorrupt` when a part is missing or
        does not verify (nothing is published, LATEST unchanged), `CheckpointConflict` when
        the id is published with a different manifest, ValueError for invalid arguments.

        `verify_records=True` (the default) verifies each records file exactly as `load`
        does (digest, count, size, every line a JSON object with a valid episode id), so a
        published checkpoint is a loadable one. False checks only the records files' sizes:
        for very large checkpoints where the participants' own digests are trusted.

        `keep` (>= 1) published checkpoints survive retention, newest by created_at (ties
        by id), plus always the one just published and the one LATEST names. Unpublished
        checkpoint directories older than this one are deleted (see `apply_retention`).
        `defer_retention=True` leaves that to `complete_retention` (see `PendingRetention`).
        """
        _check_checkpoint_id(checkpoint_id)
        entries = check_participants(participants)
        episodes = check_continued(continued)
        if not isinstance(controller_state, bytes | bytearray | memoryview):
            raise TypeError("controller_state must be bytes")
        state = bytes(controller_state)
        if type(keep) is not int or keep < 1:
            raise ValueError("keep must be an integer >= 1")
        if created_at is not None and created_at.utcoffset() is None:
            raise ValueError("created_at must be timezone-aware")
        directory = self.path / checkpoint_id
        with (
            self._lock,
            io_errors(directory),
            safe_files.opened(self.path, ROOT_FLAGS) as root_fd,
        ):
            try:
                ckpt_fd = os.open(checkpoint_id, DIR_FLAGS, dir_fd=root_fd)
            except FileNotFoundError as exc:
                raise CheckpointCorrupt(
                    directory, "no such checkpoint directory: no participant has committed"
                ) from exc
            except OSError as exc:
                raise open_failure(exc, root_fd, checkpoint_id, directory) from exc
            with closing(ckpt_fd):
                # Captured before this publication touches the directory: the age retention
                # compares unpublished directories with (see apply_retention).
                reference_mtime_ns = os.fstat(ckpt_fd).st_mtime_ns
                check: RecordsCheck = "full" if verify_records else "size"
                for entry in entries:
                    verify_part(ckpt_fd, directory, entry, checkpoint_id, check)
                _fsync_part_dirs(ckpt_fd, {entry.kind for entry in entries})
                self._step("after_verify")
                if created_at is None:
                    created_at = _existing_created_at(ckpt_fd) or self._clock()
                manifest = FleetManifest(
                    checkpoint_id, created_at.astimezone(UTC), entries, episodes, state
                )
                data = manifest.encode()
                existed = _link_fleet_manifest(ckpt_fd, directory, data)
                os.fsync(root_fd)  # the <checkpoint_id> entry itself
            self._step("after_fleet_manifest")
            # A late retry of an older checkpoint completes, but never moves LATEST back
            # behind a newer publication: a restore must find the newest state.
            if not latest_is_newer(root_fd, self.path, checkpoint_id, manifest.created_at):
                write_latest(root_fd, checkpoint_id)
            self._step("after_latest")
            published = PublishedCheckpoint(
                checkpoint_id,
                directory,
                hashlib.sha256(data).hexdigest(),
                manifest,
                already_published=existed,
                pending_retention=PendingRetention(keep, reference_mtime_ns),
            )
            if defer_retention:
                return published
            return self._retain(root_fd, published)

    def complete_retention(self, published: PublishedCheckpoint) -> PublishedCheckpoint:
        """Apply the retention `publish(..., defer_retention=True)` left pending; `published`
        with `deleted` set and nothing pending. Never raises for a failed deletion."""
        if published.pending_retention is None:
            return published
        try:
            with self._lock, safe_files.opened(self.path, ROOT_FLAGS) as root_fd:
                return self._retain(root_fd, published)
        except OSError as exc:
            log.warning("retention skipped: cannot open %s: %s", self.path, exc)
            return replace(published, pending_retention=None)

    def _retain(self, root_fd: int, published: PublishedCheckpoint) -> PublishedCheckpoint:
        pending = published.pending_retention
        assert pending is not None and isinstance(pending.unpublished_before, int)
        deleted = apply_retention(
            root_fd, self.path, pending.keep, published.checkpoint_id, pending.unpublished_before
        )
        return replace(published, deleted=deleted, pending_retention=None)

    def _step(self, name: str) -> None:
        if self._crash_hook is not None:
            self._crash_hook(name)
        stop_if_abandoned(self.location, name)

    # -- read -----------------------------------------------------------------------------

    def latest(self) -> str | None:
        """The id `LATEST` names, or None when nothing was published yet.

        `CheckpointCorrupt` when LATEST is malformed or names a directory with no fleet
        manifest: LATEST is written only after the fleet manifest is durable, so that is
        never a state publication leaves behind."""
        with io_errors(self.path), safe_files.opened(self.path, ROOT_FLAGS) as root_fd:
            checkpoint_id = read_latest(root_fd, self.path)
            if checkpoint_id is None:
                return None
            if not is_published(root_fd, checkpoint_id):
                raise CheckpointCorrupt(
                    self.path / LATEST_NAME,
                    f"LATEST names {checkpoint_id}, which has no {FLEET_MANIFEST_NAME} "
                    "(it was never published)",
                )
            return checkpoint_id

    def load(self, checkpoint_id_or_latest: str | None = None) -> FleetManifest:
        """The verified fleet manifest of a published checkpoint (None or "LATEST": latest).

        Verifies everything (`verify_checkpoint`) before returning: what a restore installs
        must be exactly what was published."""
        return self.inspect(checkpoint_id_or_latest).manifest

    def inspect(self, checkpoint_id_or_latest: str | None = None) -> CheckpointSummary:
        """`load`, returning the whole verified summary."""
        if checkpoint_id_or_latest is None or checkpoint_id_or_latest == LATEST_NAME:
            checkpoint_id = self.latest()
            if checkpoint_id is None:
                raise NoPublishedCheckpoint(f"{self.path}: no checkpoint was published yet")
        else:
            checkpoint_id = checkpoint_id_or_latest
            _check_checkpoint_id(checkpoint_id)
        directory = self.path / checkpoint_id
        with io_errors(directory), safe_files.opened(self.path, ROOT_FLAGS) as root_fd:
            if not is_published(root_fd, checkpoint_id):
                raise NoPublishedCheckpoint(f"{directory}: checkpoint was never published")
            try:
                ckpt_fd = os.open(checkpoint_id, DIR_FLAGS, dir_fd=root_fd)
            except OSError as exc:
                raise open_failure(exc, root_fd, checkpoint_id, directory) from exc
            with closing(ckpt_fd):
                return verify_open(ckpt_fd, directory, expected_id=checkpoint_id)

    def published(self) -> list[str]:
        """Ids of the published checkpoints, oldest first (by created_at, ties by id)."""
        with io_errors(self.path), safe_files.opened(self.path, ROOT_FLAGS) as root_fd:
            return [name for _, name in sorted(scan_root(root_fd).published)]

    def read_fleet_manifest(self, checkpoint_id: str) -> FleetManifest:
        """The fleet manifest of a published checkpoint, decoded (not verified)."""
        return FleetManifest.decode(
            (self.directory(checkpoint_id) / FLEET_MANIFEST_NAME).read_bytes()
        )


# -- publication steps --------------------------------------------------------------------


def _link_fleet_manifest(ckpt_fd: int, directory: Path, data: bytes) -> bool:
    """Create `checkpoint.json` without replacing one; True when an identical one existed."""
    tmp = layout.fleet_temporary_name(secrets.token_hex(8))
    try:
        safe_files.write_new_file(ckpt_fd, tmp, data)
        try:
            os.link(
                tmp,
                FLEET_MANIFEST_NAME,
                src_dir_fd=ckpt_fd,
                dst_dir_fd=ckpt_fd,
                follow_symlinks=False,
            )
            existed = False
        except FileExistsError:
            existing = read_regular(
                ckpt_fd, FLEET_MANIFEST_NAME, directory / FLEET_MANIFEST_NAME, limit=None
            )
            if existing != data:
                raise CheckpointConflict(
                    f"{directory}: checkpoint {directory.name} is already published with a "
                    "different fleet manifest"
                ) from None
            existed = True
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp, dir_fd=ckpt_fd)
    # Also on a retry: the first attempt may have crashed between the link and this fsync.
    os.fsync(ckpt_fd)
    return existed


def _fsync_part_dirs(ckpt_fd: int, kinds: Iterable[str]) -> None:
    """Make `participants/` and each `participants/<kind>/` durable (see the module doc)."""
    participants_fd = os.open(PARTICIPANTS_DIR, DIR_FLAGS, dir_fd=ckpt_fd)
    with closing(participants_fd):
        for kind in sorted(kinds):
            kind_fd = os.open(kind, DIR_FLAGS, dir_fd=participants_fd)
            with closing(kind_fd):
                os.fsync(kind_fd)
        os.fsync(participants_fd)
    os.fsync(ckpt_fd)


def _existing_created_at(ckpt_fd: int) -> datetime | None:
    """The created_at of a fleet manifest already published here, if it can be read."""
    try:
        raw = read_regular(ckpt_fd, FLEET_MANIFEST_NAME, Path(FLEET_MANIFEST_NAME), limit=None)
        return FleetManifest.decode(raw).created_at
    except (CheckpointCorrupt, ValueError):
        return None


def stop_if_abandoned(location: str, step: str) -> None:
    """Stop a publication whose caller gave up waiting (its deadline passed while the store
    hung) before its next step: the caller already reported the checkpoint as not published
    and resumed the fleet, so a thread that wakes up later must not go on to publish it (see
    `bounded`)."""
    if daemon_threads.abandoned():
        raise StorageFailed(
            f"{location}: publication stopped {step.replace('_', ' ')}: its caller stopped "
            "waiting at the deadline"
        )


# -- argument checks ----------------------------------------------------------------------


def _check_checkpoint_id(checkpoint_id: str) -> None:
    if not isinstance(checkpoint_id, str) or not is_valid_id(checkpoint_id):
        raise ValueError(f"not a valid checkpoint id: {checkpoint_id!r}")
    if checkpoint_id == LATEST_NAME:
        raise ValueError(f"{LATEST_NAME!r} is reserved and cannot be a checkpoint id")


def check_participants(
    participants: Sequence[PublishedParticipant],
) -> tuple[PublishedParticipant, ...]:
    entries = tuple(participants)
    if not entries:
        raise ValueError("a fleet checkpoint needs at least one participant")
    for entry in entries:
        if not isinstance(entry, PublishedParticipant):
            raise TypeError("participants must be PublishedParticipant values")
        problem = entry.problem()
        if problem is not None:
            raise ValueError(problem)
    check_unique(entries)
    # Sorted by name: the same fleet in another order is the same fleet manifest.
    return tuple(sorted(entries, key=lambda e: e.name))


def check_continued(continued: Iterable[EpisodeId]) -> tuple[EpisodeId, ...]:
    episodes = set(continued)
    for episode in episodes:
        if not isinstance(episode, EpisodeId):
            raise TypeError("continued must hold EpisodeId values")
    return tuple(sorted(episodes))
