"""Controller-side publication of fleet checkpoints, and an independent verifier of them.

    <root>/LATEST                                                 id of the latest publication
    <root>/<checkpoint_id>/checkpoint.json                        the fleet manifest (last)
    <root>/<checkpoint_id>/participants/<kind>/<instance>/manifest.json
    <root>/<checkpoint_id>/participants/<kind>/<instance>/records-<sha256>.jsonl

Every participant writes its own part of a checkpoint into the controller's checkpoint
directory. A part is complete iff its `manifest.json` exists; a *checkpoint* is published iff
its fleet manifest `checkpoint.json` exists. Only a published checkpoint is ever restored, and
`LATEST` names the one a restore without an explicit id uses.

Everything here blocks (file I/O, fsync, hashing whole records files): an asyncio caller runs
it in a thread (`await asyncio.to_thread(root.publish, ...)`). One `CheckpointRoot` serializes
its own publications with a lock; one controller process owns a root (two controllers
publishing into the same root are not supported: retention of one could delete the other's
unfinished checkpoint).

Why publication happens in this order — each step exists for a crash (or a bad part) at the
step before it:

1. **Verify every participant part first** (its manifest's sha256 is the one the participant
   reported at commit, its kind, instance and checkpoint id are right, its records match their
   digest, count and size, every record names a valid episode). The fleet manifest is the
   promise that the whole fleet can be restored all or nothing; written before this check, a
   missing or torn part would become the restore point and every restore of it would fail —
   after retention may already have deleted the previous, good checkpoint.
2. **Make the parts' directory entries durable.** Participants fsync their own instance
   directory, but the `participants/`, `<kind>/` and `<checkpoint_id>/` entries above it were
   created by `mkdir` and may still be in the page cache: a power loss could drop a whole part
   that the fleet manifest names. Publication fsyncs them before naming them.
3. **Write the fleet manifest without ever replacing one**: a temp file, fsynced, hard-linked to
   `checkpoint.json` (`link` fails when the name exists, so a published checkpoint never changes
   and of two racing publishers exactly one wins), then the directory fsynced. An identical
   manifest already there is an idempotent retry; a different one is `CheckpointConflict`.
4. **Only then move `LATEST`** (temp file, fsync, `os.replace`, fsync of the root). Moved
   earlier, a crash could leave `LATEST` naming a directory whose `checkpoint.json` never
   reached the disk: the fleet would have no loadable restore point although the previous
   checkpoint was fine. A crash between 3 and 4 leaves `LATEST` on the previous checkpoint
   (still loadable), and publishing the same id again completes idempotently.
5. **Retention last**, after `LATEST` moved, so it never deletes what `LATEST` still names.
   A directory is deleted by renaming it to a hidden trash name first (then removing the
   tree): a crash in the middle of a removal never leaves a directory that still looks
   published but has lost parts.

Every file below the root is opened through directory descriptors with O_NOFOLLOW, so a
symlink planted anywhere in a checkpoint directory is refused rather than followed. The
format (names, paths, the part manifest's schema) is `server.core.layout`'s, the safe-open
rules are `server.core.safe_files`', and each part is verified by the participants' own part
reader (`server.core.part_reader`): one implementation of the format. What keeps that
reader honest is not a second parser but the golden checkpoints under `tests/fixtures/`,
which both the writer's round trip and `inspect` must reproduce byte for byte.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import hashlib
import json
import logging
import os
import re
import secrets
import shutil
import stat
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from rollout_checkpoint.server.core import layout, part_reader, safe_files
from rollout_checkpoint.server.core.episodes import EpisodeId, is_valid_id
from rollout_checkpoint.server.core.errors import CheckpointError, corrupt_checkpoint
from rollout_checkpoint.server.core.layout import (
    FLEET_MANIFEST_NAME,
    LATEST_NAME,
    MANIFEST_NAME,
    PARTICIPANTS_DIR,
    SCHEMA_VERSION,
    exact_fields,
    load_json,
)
from rollout_checkpoint.server.core.part_reader import RecordsCheck
from rollout_checkpoint.server.core.safe_files import closing

__all__ = [
    "CheckpointConflict",
    "CheckpointCorrupt",
    "CheckpointRoot",
    "CheckpointSummary",
    "FleetManifest",
    "NoPublishedCheckpoint",
    "ParticipantSummary",
    "PublicationError",
    "PublishedCheckpoint",
    "PublishedParticipant",
    "format_time",
    "inspect",
    "parse_time",
    "verify_checkpoint",
]

log = logging.getLogger(__name__)

_FLEET_FIELDS = frozenset(
    {
        "schema_version",
        "checkpoint_id",
        "created_at",
        "participants",
        "continued",
        "controller_state",
    }
)
_ENTRY_FIELDS = frozenset({"name", "kind", "instance", "manifest", "manifest_sha256"})
_RFC3339 = re.compile(r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(?:\.\d{1,9})?(?:Z|[+-]\d{2}:\d{2})$")
# The root itself may be a symlink (the caller's choice); nothing below it is followed.
_ROOT_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
_DIR_FLAGS = safe_files.DIR_FLAGS
_OLDEST = datetime.min.replace(tzinfo=UTC)

CrashHook = Callable[[str], None]
"""Called with the name of each publication step; fault tests stop the publisher there."""

# -- errors -------------------------------------------------------------------------------


class PublicationError(Exception):
    """Base of every error of this module (an OS error while publishing is one too)."""


class CheckpointCorrupt(PublicationError):
    """A checkpoint (or `LATEST`) on disk is missing, torn, tampered with or malformed.

    `path` is the file or directory at fault. Digest, record count and size mismatches say
    "digest" in their message."""

    def __init__(self, path: str | os.PathLike[str], message: str) -> None:
        super().__init__(f"{os.fspath(path)}: {message}")
        self.path = Path(path)
        self.message = message


class CheckpointConflict(PublicationError):
    """The checkpoint id is already published with a different fleet manifest."""


class NoPublishedCheckpoint(PublicationError):
    """There is no published checkpoint (no `LATEST`, or the named id was never published)."""


# -- value types --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PublishedParticipant:
    """One fleet member's committed part: what its Commit reply reported."""

    name: str
    kind: str
    instance: str
    manifest_sha256: str

    @property
    def manifest_path(self) -> str:
        """The part's manifest, relative to the checkpoint directory."""
        return layout.part_manifest_path(self.kind, self.instance)

    def problem(self) -> str | None:
        """Why this entry cannot be part of a fleet manifest, or None."""
        for field_name, value in (
            ("name", self.name),
            ("kind", self.kind),
            ("instance", self.instance),
        ):
            if not isinstance(value, str) or not is_valid_id(value):
                return f"participant {field_name} {value!r} is not a valid id"
        if not isinstance(self.manifest_sha256, str) or not layout.SHA256.fullmatch(
            self.manifest_sha256
        ):
            return f"participant {self.name}: manifest_sha256 must be 64 lowercase hex digits"
        return None


@dataclass(frozen=True, slots=True)
class FleetManifest:
    """The content of `checkpoint.json`."""

    checkpoint_id: str
    created_at: datetime
    participants: tuple[PublishedParticipant, ...]
    continued: tuple[EpisodeId, ...]
    controller_state: bytes
    schema_version: int = SCHEMA_VERSION

    def to_json(self) -> dict[str, Any]:
        return {
            "schema_version": self.schema_version,
            "checkpoint_id": self.checkpoint_id,
            "created_at": format_time(self.created_at),
            "participants": [
                {
                    "name": p.name,
                    "kind": p.kind,
                    "instance": p.instance,
                    "manifest": p.manifest_path,
                    "manifest_sha256": p.manifest_sha256,
                }
                for p in self.participants
            ],
            "continued": [e.to_json() for e in self.continued],
            "controller_state": base64.b64encode(self.controller_state).decode("ascii"),
        }

    def encode(self) -> bytes:
        """The canonical bytes: sorted keys, so the same manifest is always the same file
        (which is what makes a re-publication comparable byte for byte)."""
        return (json.dumps(self.to_json(), sort_keys=True, indent=2) + "\n").encode()

    @classmethod
    def decode(cls, data: bytes) -> FleetManifest:
        """Parse and validate `checkpoint.json`; ValueError says what is wrong."""
        fields = load_json(data)
        if not isinstance(fields, dict):
            raise ValueError("not a JSON object")
        exact_fields(fields, _FLEET_FIELDS, "fleet manifest")
        version = fields["schema_version"]
        if type(version) is not int:
            raise ValueError("schema_version must be an integer")
        if version != SCHEMA_VERSION:
            raise ValueError(f"unsupported schema_version {version} (expected {SCHEMA_VERSION})")
        checkpoint_id = fields["checkpoint_id"]
        if not isinstance(checkpoint_id, str) or not is_valid_id(checkpoint_id):
            raise ValueError("checkpoint_id is not a valid id")
        created_at = parse_time(fields["created_at"])
        participants = _decode_participants(fields["participants"])
        continued = _decode_continued(fields["continued"])
        state = fields["controller_state"]
        if not isinstance(state, str):
            raise ValueError("controller_state must be a base64 string")
        try:
            controller_state = base64.b64decode(state, validate=True)
        except binascii.Error as exc:
            raise ValueError(f"controller_state is not valid base64: {exc}") from exc
        return cls(checkpoint_id, created_at, participants, continued, controller_state, version)


@dataclass(frozen=True, slots=True)
class PublishedCheckpoint:
    """The result of a publication."""

    checkpoint_id: str
    directory: Path
    fleet_manifest_sha256: str
    manifest: FleetManifest
    already_published: bool = False
    """True when an identical fleet manifest was already there (an idempotent retry)."""
    deleted: tuple[str, ...] = ()
    """Checkpoint directories retention removed (published and unpublished)."""


@dataclass(frozen=True, slots=True)
class ParticipantSummary:
    """One verified participant part."""

    name: str
    kind: str
    instance: str
    manifest_sha256: str
    records_file: str
    records_sha256: str
    record_count: int
    bytes: int
    episodes: tuple[str, ...]
    """The capture keys of its records, sorted (unique)."""

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "kind": self.kind,
            "instance": self.instance,
            "manifest_sha256": self.manifest_sha256,
            "records_file": self.records_file,
            "records_sha256": self.records_sha256,
            "record_count": self.record_count,
            "bytes": self.bytes,
            "episodes": list(self.episodes),
        }


@dataclass(frozen=True, slots=True)
class CheckpointSummary:
    """A verified published checkpoint: every manifest and digest checked."""

    directory: Path
    fleet_manifest_sha256: str
    manifest: FleetManifest
    participants: tuple[ParticipantSummary, ...]
    warnings: tuple[str, ...] = ()
    """Things that do not make the checkpoint unrestorable but an operator should know."""

    @property
    def checkpoint_id(self) -> str:
        return self.manifest.checkpoint_id

    @property
    def created_at(self) -> datetime:
        return self.manifest.created_at

    @property
    def continued(self) -> tuple[EpisodeId, ...]:
        return self.manifest.continued

    @property
    def controller_state(self) -> bytes:
        return self.manifest.controller_state

    @property
    def total_records(self) -> int:
        return sum(p.record_count for p in self.participants)

    @property
    def total_bytes(self) -> int:
        return sum(p.bytes for p in self.participants)

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready object (what `inspect --json` prints)."""
        return {
            "checkpoint_id": self.checkpoint_id,
            "directory": str(self.directory),
            "created_at": format_time(self.created_at),
            "fleet_manifest_sha256": self.fleet_manifest_sha256,
            "participants": [p.to_json() for p in self.participants],
            "record_count": self.total_records,
            "bytes": self.total_bytes,
            "continued": [e.to_json() for e in self.continued],
            "controller_state": base64.b64encode(self.controller_state).decode("ascii"),
            "controller_state_bytes": len(self.controller_state),
            "warnings": list(self.warnings),
        }

    def format_text(self) -> str:
        """A human summary (what `inspect` prints), without a trailing newline."""
        lines = [
            f"checkpoint {self.checkpoint_id}  (verified)",
            f"  directory       {self.directory}",
            f"  created at      {format_time(self.created_at)}",
            f"  fleet manifest  sha256 {self.fleet_manifest_sha256}",
            f"  participants    {len(self.participants)}",
            f"  records         {self.total_records} ({_human_bytes(self.total_bytes)})",
            f"  continued       {len(self.continued)} episode(s)"
            + (f": {_preview(e.capture_key for e in self.continued)}" if self.continued else ""),
            f"  controller      {len(self.controller_state)} byte(s) of state",
            "",
        ]
        header = ("NAME", "KIND", "INSTANCE", "RECORDS", "BYTES", "EPISODES")
        rows = [
            (
                p.name,
                p.kind,
                p.instance,
                str(p.record_count),
                str(p.bytes),
                _preview(p.episodes) if p.episodes else "-",
            )
            for p in self.participants
        ]
        widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header) - 1)]
        for row in (header, *rows):
            cells = [cell.ljust(width) for cell, width in zip(row, widths, strict=False)]
            lines.append("  " + "  ".join([*cells, row[-1]]))
        if self.warnings:
            lines.append("")
            lines.append("warnings:")
            lines.extend(f"  - {warning}" for warning in self.warnings)
        return "\n".join(lines)


# -- the checkpoint root ------------------------------------------------------------------


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
        self.path = Path(path).absolute()
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
        checkpoint directories older than this one are deleted (see `_apply_retention`).
        """
        _check_checkpoint_id(checkpoint_id)
        entries = _check_participants(participants)
        episodes = _check_continued(continued)
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
            _io_errors(directory),
            safe_files.opened(self.path, _ROOT_FLAGS) as root_fd,
        ):
            try:
                ckpt_fd = os.open(checkpoint_id, _DIR_FLAGS, dir_fd=root_fd)
            except FileNotFoundError as exc:
                raise CheckpointCorrupt(
                    directory, "no such checkpoint directory: no participant has committed"
                ) from exc
            except OSError as exc:
                raise _open_failure(exc, root_fd, checkpoint_id, directory) from exc
            with closing(ckpt_fd):
                # Captured before this publication touches the directory: the age retention
                # compares unpublished directories with (see _apply_retention).
                reference_mtime_ns = os.fstat(ckpt_fd).st_mtime_ns
                check: RecordsCheck = "full" if verify_records else "size"
                for entry in entries:
                    _verify_part(ckpt_fd, directory, entry, checkpoint_id, check)
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
            if not _latest_is_newer(root_fd, self.path, checkpoint_id, manifest.created_at):
                _write_latest(root_fd, checkpoint_id)
            self._step("after_latest")
            deleted = _apply_retention(root_fd, self.path, keep, checkpoint_id, reference_mtime_ns)
        return PublishedCheckpoint(
            checkpoint_id,
            directory,
            hashlib.sha256(data).hexdigest(),
            manifest,
            already_published=existed,
            deleted=deleted,
        )

    def _step(self, name: str) -> None:
        if self._crash_hook is not None:
            self._crash_hook(name)

    # -- read -----------------------------------------------------------------------------

    def latest(self) -> str | None:
        """The id `LATEST` names, or None when nothing was published yet.

        `CheckpointCorrupt` when LATEST is malformed or names a directory with no fleet
        manifest: LATEST is written only after the fleet manifest is durable, so that is
        never a state publication leaves behind."""
        with _io_errors(self.path), safe_files.opened(self.path, _ROOT_FLAGS) as root_fd:
            checkpoint_id = _read_latest(root_fd, self.path)
            if checkpoint_id is None:
                return None
            if not _is_published(root_fd, checkpoint_id):
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
        with _io_errors(directory), safe_files.opened(self.path, _ROOT_FLAGS) as root_fd:
            if not _is_published(root_fd, checkpoint_id):
                raise NoPublishedCheckpoint(f"{directory}: checkpoint was never published")
            try:
                ckpt_fd = os.open(checkpoint_id, _DIR_FLAGS, dir_fd=root_fd)
            except OSError as exc:
                raise _open_failure(exc, root_fd, checkpoint_id, directory) from exc
            with closing(ckpt_fd):
                return _verify_open(ckpt_fd, directory, expected_id=checkpoint_id)

    def published(self) -> list[str]:
        """Ids of the published checkpoints, oldest first (by created_at, ties by id)."""
        with _io_errors(self.path), safe_files.opened(self.path, _ROOT_FLAGS) as root_fd:
            return [name for _, name in sorted(_scan_root(root_fd).published)]


# -- verification -------------------------------------------------------------------------


def verify_checkpoint(
    directory: str | os.PathLike[str], *, expected_id: str | None = None
) -> CheckpointSummary:
    """Verify a published checkpoint directory completely; `CheckpointCorrupt` otherwise.

    Checks the fleet manifest (exact fields and types, schema 1), then for every listed
    participant: the manifest path is exactly `participants/<kind>/<instance>/manifest.json`,
    no component is a symlink, the manifest's sha256 is the one the fleet manifest recorded,
    its fields are valid and name the same kind, instance and checkpoint id, and its records
    file matches its digest, record count and size with every line a JSON object carrying a
    valid `episode_id`. The records are streamed in chunks and always hashed whole; a file
    that does not match its manifest is reported as a digest mismatch whatever its lines
    look like. Parts on disk that the fleet manifest does not list are only warnings.

    The directory path itself may be a symlink (it is the caller's choice); nothing below it
    is followed. Blocks: run it in a thread from asyncio code.
    """
    path = Path(directory)
    with _io_errors(path):
        try:
            fd = os.open(path, _ROOT_FLAGS)
        except FileNotFoundError as exc:
            raise CheckpointCorrupt(path, "no such checkpoint directory") from exc
        except NotADirectoryError as exc:
            raise CheckpointCorrupt(path, "not a directory") from exc
        with closing(fd):
            return _verify_open(fd, path, expected_id=expected_id)


def inspect(directory: str | os.PathLike[str]) -> CheckpointSummary:
    """`verify_checkpoint` for the CLI's `inspect <dir>`: render with `to_json()` or
    `format_text()`."""
    return verify_checkpoint(directory)


def _verify_open(ckpt_fd: int, path: Path, *, expected_id: str | None) -> CheckpointSummary:
    fleet_path = path / FLEET_MANIFEST_NAME
    raw = _read_regular(
        ckpt_fd,
        FLEET_MANIFEST_NAME,
        fleet_path,
        limit=None,
        missing=f"no {FLEET_MANIFEST_NAME}: the checkpoint was never published",
    )
    try:
        manifest = FleetManifest.decode(raw)
    except ValueError as exc:
        raise CheckpointCorrupt(fleet_path, f"invalid fleet manifest: {exc}") from exc
    warnings: list[str] = []
    if expected_id is not None and manifest.checkpoint_id != expected_id:
        raise CheckpointCorrupt(
            fleet_path, f"the fleet manifest is of {manifest.checkpoint_id}, not {expected_id}"
        )
    if expected_id is None and path.name != manifest.checkpoint_id:
        warnings.append(
            f"the directory is named {path.name!r} but holds checkpoint {manifest.checkpoint_id}"
        )
    summaries: list[ParticipantSummary] = []
    for entry in manifest.participants:
        summary, duplicates = _verify_part(ckpt_fd, path, entry, manifest.checkpoint_id, "full")
        summaries.append(summary)
        if duplicates:
            warnings.append(
                f"{entry.name}: {duplicates} record(s) repeat an episode already in the part"
            )
    warnings.extend(_unlisted_parts(ckpt_fd, manifest))
    return CheckpointSummary(
        directory=path,
        fleet_manifest_sha256=hashlib.sha256(raw).hexdigest(),
        manifest=manifest,
        participants=tuple(summaries),
        warnings=tuple(warnings),
    )


def _verify_part(
    ckpt_fd: int,
    ckpt_path: Path,
    entry: PublishedParticipant,
    checkpoint_id: str,
    check: RecordsCheck,
) -> tuple[ParticipantSummary, int]:
    """Verify one listed part with the participants' own part reader; returns its summary
    and how many records repeat an episode."""
    part_path = Path(layout.part_path(str(ckpt_path), entry.kind, entry.instance))
    shown = str(part_path)
    keys: list[str] = []

    def episode(record: dict[str, Any], number: int) -> None:
        try:
            keys.append(EpisodeId.from_json(record.get("episode_id")).capture_key)
        except ValueError as exc:
            raise corrupt_checkpoint(
                f"line {number} has an invalid episode_id: {exc}", shown
            ) from exc

    part_fd = _open_part_dir(ckpt_fd, ckpt_path, entry.kind, entry.instance)
    with closing(part_fd), _as_corrupt(part_path):
        raw = part_reader.read_manifest_bytes(part_fd, shown)
        digest = hashlib.sha256(raw).hexdigest()
        if digest != entry.manifest_sha256:
            raise CheckpointCorrupt(
                part_path / MANIFEST_NAME,
                f"manifest digest mismatch: its sha256 is {digest}, the fleet manifest "
                f"records {entry.manifest_sha256}",
            )
        manifest = part_reader.decode_manifest(raw, shown)
        part_reader.check_owner(manifest, shown, entry.kind, entry.instance, checkpoint_id)
        part_reader.scan_records(part_fd, shown, manifest, episode, check)
    unique = tuple(sorted(set(keys)))
    summary = ParticipantSummary(
        name=entry.name,
        kind=entry.kind,
        instance=entry.instance,
        manifest_sha256=digest,
        records_file=manifest.records_file,
        records_sha256=manifest.records_sha256,
        record_count=manifest.record_count,
        bytes=manifest.bytes,
        episodes=unique,
    )
    return summary, len(keys) - len(unique)


@contextlib.contextmanager
def _as_corrupt(part_path: Path) -> Iterator[None]:
    """The part reader's refusals (CheckpointError) as this module's CheckpointCorrupt."""
    try:
        yield
    except CheckpointError as error:
        raise CheckpointCorrupt(
            error.metadata.get("path", str(part_path)), error.message
        ) from error


def _decode_participants(value: object) -> tuple[PublishedParticipant, ...]:
    if not isinstance(value, list) or not value:
        raise ValueError("participants must be a non-empty list")
    entries: list[PublishedParticipant] = []
    for item in value:
        if not isinstance(item, dict):
            raise ValueError("a participant entry is not an object")
        exact_fields(item, _ENTRY_FIELDS, "participant entry")
        entry = PublishedParticipant(
            item["name"], item["kind"], item["instance"], item["manifest_sha256"]
        )
        problem = entry.problem()
        if problem is not None:
            raise ValueError(problem)
        # Only this exact relative path is accepted: no `..`, no absolute path, no other
        # file name; the path is derived from kind and instance, never trusted on its own.
        if item["manifest"] != entry.manifest_path:
            raise ValueError(
                f"participant {entry.name}: manifest must be {entry.manifest_path!r}, "
                f"not {item['manifest']!r}"
            )
        entries.append(entry)
    _check_unique(entries)
    return tuple(entries)


def _decode_continued(value: object) -> tuple[EpisodeId, ...]:
    if not isinstance(value, list):
        raise ValueError("continued must be a list")
    episodes = tuple(EpisodeId.from_json(item) for item in value)
    if len(set(episodes)) != len(episodes):
        raise ValueError("continued lists an episode twice")
    return episodes


def _unlisted_parts(ckpt_fd: int, manifest: FleetManifest) -> list[str]:
    listed = {(p.kind, p.instance) for p in manifest.participants}
    found: list[str] = []
    try:
        participants_fd = os.open(PARTICIPANTS_DIR, _DIR_FLAGS, dir_fd=ckpt_fd)
    except OSError:
        return found
    with closing(participants_fd):
        for kind in sorted(os.listdir(participants_fd)):
            try:
                kind_fd = os.open(kind, _DIR_FLAGS, dir_fd=participants_fd)
            except OSError:
                found.append(f"{PARTICIPANTS_DIR}/{kind} is not a plain directory (ignored)")
                continue
            with closing(kind_fd):
                for instance in sorted(os.listdir(kind_fd)):
                    if (kind, instance) not in listed:
                        found.append(
                            f"{PARTICIPANTS_DIR}/{kind}/{instance} is on disk but not listed "
                            "in the fleet manifest (a restore ignores it)"
                        )
    return found


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
            existing = _read_regular(
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


def _write_latest(root_fd: int, checkpoint_id: str) -> None:
    """Point LATEST at `checkpoint_id` atomically: readers see the old or the new id."""
    tmp = layout.latest_temporary_name(secrets.token_hex(8))
    try:
        safe_files.write_new_file(root_fd, tmp, f"{checkpoint_id}\n".encode())
        os.replace(tmp, LATEST_NAME, src_dir_fd=root_fd, dst_dir_fd=root_fd)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp, dir_fd=root_fd)
        raise
    os.fsync(root_fd)


def _fsync_part_dirs(ckpt_fd: int, kinds: Iterable[str]) -> None:
    """Make `participants/` and each `participants/<kind>/` durable (see the module doc)."""
    participants_fd = os.open(PARTICIPANTS_DIR, _DIR_FLAGS, dir_fd=ckpt_fd)
    with closing(participants_fd):
        for kind in sorted(kinds):
            kind_fd = os.open(kind, _DIR_FLAGS, dir_fd=participants_fd)
            with closing(kind_fd):
                os.fsync(kind_fd)
        os.fsync(participants_fd)
    os.fsync(ckpt_fd)


def _existing_created_at(ckpt_fd: int) -> datetime | None:
    """The created_at of a fleet manifest already published here, if it can be read."""
    try:
        raw = _read_regular(ckpt_fd, FLEET_MANIFEST_NAME, Path(FLEET_MANIFEST_NAME), limit=None)
        return FleetManifest.decode(raw).created_at
    except (CheckpointCorrupt, ValueError):
        return None


# -- retention ----------------------------------------------------------------------------


@dataclass(slots=True)
class _RootScan:
    published: list[tuple[datetime, str]]
    """(created_at, id); created_at is the oldest possible time when unreadable."""
    unpublished: list[tuple[str, int]]
    """(id, directory mtime in ns) of directories that look like unfinished checkpoints."""
    strays: list[str]
    """Our own temporary files and trash directories in the root."""


def _scan_root(root_fd: int) -> _RootScan:
    scan = _RootScan([], [], [])
    for name in os.listdir(root_fd):
        if layout.LATEST_TEMPORARY_NAME.fullmatch(name) or layout.TRASH_NAME.fullmatch(name):
            scan.strays.append(name)
            continue
        if name == LATEST_NAME or not is_valid_id(name):
            continue
        try:
            fd = os.open(name, _DIR_FLAGS, dir_fd=root_fd)
        except OSError:
            continue  # a file, a symlink, or gone: not a checkpoint directory of ours
        with closing(fd):
            entries = set(os.listdir(fd))
            if FLEET_MANIFEST_NAME in entries:
                if stat.S_ISREG(
                    os.stat(FLEET_MANIFEST_NAME, dir_fd=fd, follow_symlinks=False).st_mode
                ):
                    scan.published.append((_created_at_for_ordering(fd, name), name))
                continue
            # Only a directory whose content is what a checkpoint in progress holds (the
            # participants' tree, our temp files) counts as an unfinished checkpoint: any
            # other directory an operator put into the root is not ours to delete.
            if all(
                e == PARTICIPANTS_DIR or layout.FLEET_TEMPORARY_NAME.fullmatch(e) for e in entries
            ):
                scan.unpublished.append((name, os.fstat(fd).st_mtime_ns))
    return scan


def _created_at_for_ordering(ckpt_fd: int, name: str) -> datetime:
    """created_at read leniently (only that field), so a manifest of a newer schema written
    by a newer controller still orders by its time instead of counting as oldest."""
    try:
        raw = _read_regular(ckpt_fd, FLEET_MANIFEST_NAME, Path(name), limit=None)
        fields = load_json(raw)
        if isinstance(fields, dict):
            return parse_time(fields.get("created_at"))
    except (CheckpointCorrupt, ValueError, OSError):
        pass
    log.warning("checkpoint %s: created_at unreadable; it counts as the oldest", name)
    return _OLDEST


def _apply_retention(
    root_fd: int, root: Path, keep: int, just_published: str, reference_mtime_ns: int
) -> tuple[str, ...]:
    """Delete old checkpoints; return the ids deleted. Never raises for a failed deletion
    (the publication already succeeded; the next one retries what is left).

    Published checkpoints are ordered by the created_at in their fleet manifest (ties by
    id): that is the time the controller decided on, and it is what a user means by
    "newest". The `keep` newest survive, and always the one just published and whatever
    LATEST names (after a retry of an older id the two need not be among the newest).

    An *unpublished* directory (no `checkpoint.json`; content limited to `participants/` and
    our temp files) is deleted when its mtime is strictly older than the just-published
    checkpoint's directory mtime as it was before this publication touched it. A
    checkpoint directory's mtime is set when its entries are created, i.e. when its first
    participant committed; so this deletes the partial checkpoints started before this one
    (aborted or failed attempts) and keeps any started after it. Not by id: ids are the
    caller's choice and only the generated ones sort by time (and not even within one
    second). Both mtimes come from the same filesystem's clock, so they compare even when
    participants write from other hosts. A tie keeps the directory.
    """
    deleted: list[str] = []
    try:
        scan = _scan_root(root_fd)
        latest: str | None = None
        with contextlib.suppress(CheckpointCorrupt, OSError):
            latest = _read_latest(root_fd, root)
    except OSError as exc:
        log.warning("retention skipped: cannot scan %s: %s", root, exc)
        return ()
    protected = {just_published} if latest is None else {just_published, latest}
    newest_first = sorted(scan.published, reverse=True)
    survivors = {name for _, name in newest_first[:keep]} | protected
    doomed = [name for _, name in newest_first[keep:] if name not in survivors]
    doomed += [
        name
        for name, mtime_ns in scan.unpublished
        if mtime_ns < reference_mtime_ns and name not in protected
    ]
    for name in doomed:
        try:
            _delete_tree(root_fd, name)
            deleted.append(name)
        except OSError as exc:
            log.warning("retention: cannot delete %s: %s", root / name, exc)
    for name in scan.strays:
        with contextlib.suppress(OSError):
            if layout.TRASH_NAME.fullmatch(name):
                shutil.rmtree(name, dir_fd=root_fd)
            else:
                os.unlink(name, dir_fd=root_fd)
    for name in sorted(survivors):
        with contextlib.suppress(OSError):
            _remove_fleet_temps(root_fd, name)
    with contextlib.suppress(OSError):
        os.fsync(root_fd)
    return tuple(sorted(deleted))


def _delete_tree(root_fd: int, name: str) -> None:
    """Rename to a trash name (atomic, durable), then remove: a crash part-way through never
    leaves a directory under a checkpoint id that still looks published but lost parts."""
    trash = layout.trash_name(secrets.token_hex(8))
    os.rename(name, trash, src_dir_fd=root_fd, dst_dir_fd=root_fd)
    os.fsync(root_fd)
    shutil.rmtree(trash, dir_fd=root_fd)


def _remove_fleet_temps(root_fd: int, name: str) -> None:
    fd = os.open(name, _DIR_FLAGS, dir_fd=root_fd)
    with closing(fd):
        for entry in os.listdir(fd):
            if layout.FLEET_TEMPORARY_NAME.fullmatch(entry):
                os.unlink(entry, dir_fd=fd)


# -- LATEST -------------------------------------------------------------------------------


def _latest_is_newer(root_fd: int, root: Path, checkpoint_id: str, created_at: datetime) -> bool:
    try:
        current = _read_latest(root_fd, root)
    except CheckpointCorrupt:
        return False
    if current is None or current == checkpoint_id or not _is_published(root_fd, current):
        return False
    try:
        current_fd = os.open(current, _DIR_FLAGS, dir_fd=root_fd)
    except OSError:
        return False
    with closing(current_fd):
        return _created_at_for_ordering(current_fd, current) > created_at


def _read_latest(root_fd: int, root: Path) -> str | None:
    path = root / LATEST_NAME
    try:
        raw = _read_regular(root_fd, LATEST_NAME, path, limit=layout.LATEST_LIMIT)
    except CheckpointCorrupt:
        if not os.path.lexists(path):
            return None
        raise
    text = raw.decode("utf-8", errors="replace")
    checkpoint_id = text[:-1] if text.endswith("\n") else text
    if not is_valid_id(checkpoint_id) or checkpoint_id == LATEST_NAME:
        raise CheckpointCorrupt(path, f"LATEST does not hold a checkpoint id: {text[:80]!r}")
    return checkpoint_id


def _is_published(root_fd: int, checkpoint_id: str) -> bool:
    try:
        info = os.stat(
            f"{checkpoint_id}/{FLEET_MANIFEST_NAME}", dir_fd=root_fd, follow_symlinks=False
        )
    except (FileNotFoundError, NotADirectoryError):
        return False
    return stat.S_ISREG(info.st_mode)


# -- argument checks ----------------------------------------------------------------------


def _check_checkpoint_id(checkpoint_id: str) -> None:
    if not isinstance(checkpoint_id, str) or not is_valid_id(checkpoint_id):
        raise ValueError(f"not a valid checkpoint id: {checkpoint_id!r}")
    if checkpoint_id == LATEST_NAME:
        raise ValueError(f"{LATEST_NAME!r} is reserved and cannot be a checkpoint id")


def _check_participants(
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
    _check_unique(entries)
    # Sorted by name: the same fleet in another order is the same fleet manifest.
    return tuple(sorted(entries, key=lambda e: e.name))


def _check_unique(entries: Sequence[PublishedParticipant]) -> None:
    if len({e.name for e in entries}) != len(entries):
        raise ValueError("two participants share a name")
    if len({(e.kind, e.instance) for e in entries}) != len(entries):
        raise ValueError("two participants share a kind and instance")


def _check_continued(continued: Iterable[EpisodeId]) -> tuple[EpisodeId, ...]:
    episodes = set(continued)
    for episode in episodes:
        if not isinstance(episode, EpisodeId):
            raise TypeError("continued must hold EpisodeId values")
    return tuple(sorted(episodes))


# -- small helpers ------------------------------------------------------------------------


def format_time(value: datetime) -> str:
    """RFC 3339 in UTC with microseconds: `2025-01-31T12:00:00.000000Z`."""
    return value.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def parse_time(value: object) -> datetime:
    """An RFC 3339 timestamp (with `Z` or an offset) as an aware UTC datetime."""
    if not isinstance(value, str) or not _RFC3339.fullmatch(value):
        raise ValueError(f"created_at must be an RFC 3339 timestamp, not {value!r}")
    return datetime.fromisoformat(value).astimezone(UTC)


def _open_part_dir(ckpt_fd: int, ckpt_path: Path, kind: str, instance: str) -> int:
    """Open `participants/<kind>/<instance>` refusing symlinks at every component."""
    components = layout.part_components(kind, instance)

    def refused(exc: OSError, parent_fd: int, index: int, name: str) -> Exception | None:
        path = ckpt_path.joinpath(*components[: index + 1])
        if isinstance(exc, FileNotFoundError):
            return CheckpointCorrupt(path, "missing: the participant's part is not here")
        failure = _open_failure(exc, parent_fd, name, path)
        return None if failure is exc else failure

    return safe_files.walk(ckpt_fd, components, refused=refused)


def _open_failure(exc: OSError, dir_fd: int, name: str, path: Path) -> Exception:
    """The error to raise for an OSError from an O_NOFOLLOW open of `name` below `dir_fd`."""
    what = safe_files.symlink_or_not_directory(exc, dir_fd, name)
    if what is None:
        return exc
    if what == "symlink":
        return CheckpointCorrupt(path, "is a symlink (refused: nothing here is followed)")
    return CheckpointCorrupt(path, "is not a directory")


def _read_regular(
    dir_fd: int, name: str, path: Path, *, limit: int | None, missing: str = "missing"
) -> bytes:
    """Read a regular file below `dir_fd` without following a symlink."""
    try:
        return safe_files.read_regular(dir_fd, name, limit)
    except FileNotFoundError as exc:
        raise CheckpointCorrupt(path, missing) from exc
    except safe_files.NotRegular as exc:
        raise CheckpointCorrupt(path, "is not a regular file") from exc
    except safe_files.TooLarge as exc:
        raise CheckpointCorrupt(path, f"is too large ({exc.size} bytes)") from exc
    except OSError as exc:
        raise _open_failure(exc, dir_fd, name, path) from exc


@contextlib.contextmanager
def _io_errors(path: Path) -> Iterator[None]:
    """Report an unexpected OS error (permissions, EIO, a full disk) as a PublicationError."""
    try:
        yield
    except OSError as exc:
        raise PublicationError(f"{path}: {exc.strerror or exc}") from exc


def _preview(keys: Iterable[str], limit: int = 5) -> str:
    items = list(keys)
    shown = ", ".join(items[:limit])
    return shown + (f", ... (+{len(items) - limit})" if len(items) > limit else "")


def _human_bytes(size: int) -> str:
    value = float(size)
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{size} bytes" if unit == "bytes" else f"{value:.1f} {unit} ({size} bytes)"
        value /= 1024
    return f"{size} bytes"
