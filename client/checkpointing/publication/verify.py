"""The verifier of published checkpoints (what `inspect` and every restore rely on) and
the summaries it returns."""

from __future__ import annotations

import base64
import contextlib
import hashlib
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from rollout_checkpoint.client.checkpointing.publication.errors import CheckpointCorrupt
from rollout_checkpoint.client.checkpointing.publication.files import (
    DIR_FLAGS,
    ROOT_FLAGS,
    io_errors,
    open_part_dir,
    read_regular,
)
from rollout_checkpoint.client.checkpointing.publication.manifest import (
    FleetManifest,
    PublishedParticipant,
    format_time,
)
from rollout_checkpoint.server.core import layout, part_reader, safe_files
from rollout_checkpoint.server.core.episodes import EpisodeId
from rollout_checkpoint.server.core.errors import CheckpointError, corrupt_checkpoint
from rollout_checkpoint.server.core.layout import (
    FLEET_MANIFEST_NAME,
    MANIFEST_NAME,
    PARTICIPANTS_DIR,
    REFERENCE_FIELD,
    StoredManifest,
)
from rollout_checkpoint.server.core.part_reader import RecordsCheck
from rollout_checkpoint.server.core.part_references import check_resolved, reader_for
from rollout_checkpoint.server.core.safe_files import closing


@dataclass(frozen=True, slots=True)
class ParticipantSummary:
    """One verified participant part."""

    name: str
    """The member's fleet-file name."""
    kind: str
    """Its kind as a word."""
    instance: str
    """Its instance."""
    manifest_sha256: str
    """Its part manifest's digest (the one the fleet manifest names)."""
    records_file: str
    """Its records file's name (`records-<sha256>.jsonl`)."""
    records_sha256: str
    """The records file's digest."""
    record_count: int
    """How many records it holds."""
    bytes: int
    """The records file's size."""
    episodes: tuple[str, ...]
    """The capture keys of its records, sorted (unique)."""
    referenced_records: int = 0
    """How many of its records are references to earlier parts (an incremental part)."""
    chain_length: int = 1
    """How many parts a restore of it reads at most (1: a full part)."""

    @property
    def own_records(self) -> int:
        """The records its own records file holds (not references)."""
        return self.record_count - self.referenced_records

    def chain_json(self) -> dict[str, Any]:
        """An incremental part's own and referenced records and chain length (else empty:
        a full part's entry stays as it always was)."""
        if self.chain_length == 1:
            return {}
        return {
            "own_records": self.own_records,
            "referenced_records": self.referenced_records,
            "chain_length": self.chain_length,
        }

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready object (one entry of `inspect --json`'s participants)."""
        return self.chain_json() | {
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

    directory: Path | str
    """The checkpoint's directory (a URL on an object store)."""
    fleet_manifest_sha256: str
    """The digest of `checkpoint.json`."""
    manifest: FleetManifest
    """The fleet manifest, decoded."""
    participants: tuple[ParticipantSummary, ...]
    """Every part, verified, in the manifest's order."""
    warnings: tuple[str, ...] = ()
    """Things that do not make the checkpoint unrestorable but an operator should know."""

    @property
    def checkpoint_id(self) -> str:
        """The checkpoint's id (from its fleet manifest)."""
        return self.manifest.checkpoint_id

    @property
    def created_at(self) -> datetime:
        """When the controller published it (from its fleet manifest)."""
        return self.manifest.created_at

    @property
    def continued(self) -> tuple[EpisodeId, ...]:
        """The episodes a restore continues."""
        return self.manifest.continued

    @property
    def controller_state(self) -> bytes:
        """The controller's opaque state blob."""
        return self.manifest.controller_state

    @property
    def total_records(self) -> int:
        """Records over every part."""
        return sum(p.record_count for p in self.participants)

    @property
    def total_bytes(self) -> int:
        """Records bytes over every part."""
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
        chained = [p for p in self.participants if p.chain_length > 1]
        if chained:
            lines.append("")
            lines.append("incremental parts:")
            lines.extend(
                f"  {p.name}: {p.own_records} own record(s), {p.referenced_records} referenced, "
                f"chain length {p.chain_length}"
                for p in chained
            )
        if self.warnings:
            lines.append("")
            lines.append("warnings:")
            lines.extend(f"  - {warning}" for warning in self.warnings)
        return "\n".join(lines)


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
    with io_errors(path), contextlib.ExitStack() as stack:
        try:
            fd = stack.enter_context(safe_files.opened(path, ROOT_FLAGS))
        except FileNotFoundError as exc:
            raise CheckpointCorrupt(path, "no such checkpoint directory") from exc
        except NotADirectoryError as exc:
            raise CheckpointCorrupt(path, "not a directory") from exc
        return verify_open(fd, path, expected_id=expected_id)


def inspect(directory: str | os.PathLike[str]) -> CheckpointSummary:
    """`verify_checkpoint` for the CLI's `inspect <dir>`: render with `to_json()` or
    `format_text()`."""
    return verify_checkpoint(directory)


def verify_open(ckpt_fd: int, path: Path, *, expected_id: str | None) -> CheckpointSummary:
    """`verify_checkpoint` of the checkpoint directory open as `ckpt_fd` (shown as `path`)."""
    fleet_path = path / FLEET_MANIFEST_NAME
    raw = read_regular(
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
        summary, duplicates = verify_part(ckpt_fd, path, entry, manifest.checkpoint_id, "full")
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


def verify_part(
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

    part_fd = open_part_dir(ckpt_fd, ckpt_path, entry.kind, entry.instance)
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
        if manifest.chain is None:
            part_reader.scan_records(part_fd, shown, manifest, episode, check)
        else:
            _scan_chained(ckpt_fd, ckpt_path, part_fd, manifest, episode, check)
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
        referenced_records=manifest.referenced_records,
        chain_length=manifest.chain_length,
    )
    return summary, len(keys) - len(unique)


def _scan_chained(
    ckpt_fd: int,
    ckpt_path: Path,
    part_fd: int,
    manifest: StoredManifest,
    on_record: Callable[[dict[str, Any], int], None],
    check: RecordsCheck,
) -> None:
    """A chained part's own records file, and every record it references in earlier parts
    (sibling directories of the same root), verified as a restore reads them; `size` checks
    only the referenced files' parts and sizes."""
    shown = layout.part_path(str(ckpt_path), manifest.kind, manifest.instance)
    root_fd = os.open("..", DIR_FLAGS, dir_fd=ckpt_fd)
    reader = reader_for(root_fd, str(ckpt_path.parent), ckpt_path.name, manifest)
    try:
        if check == "size":
            part_reader.scan_records(part_fd, shown, manifest, on_record, check)
            reader.check_files()
            return

        def resolved(record: dict[str, Any], number: int) -> None:
            on_record(reader.resolve(record) if REFERENCE_FIELD in record else record, number)

        part_reader.scan_records(part_fd, shown, manifest, resolved, check)
        check_resolved(reader.resolved, manifest, shown)
    finally:
        reader.close()
        os.close(root_fd)


@contextlib.contextmanager
def _as_corrupt(part_path: Path) -> Iterator[None]:
    """The part reader's refusals (CheckpointError) as this module's CheckpointCorrupt."""
    try:
        yield
    except CheckpointError as error:
        raise CheckpointCorrupt(
            error.metadata.get("path", str(part_path)), error.message
        ) from error


def _unlisted_parts(ckpt_fd: int, manifest: FleetManifest) -> list[str]:
    listed = {(p.kind, p.instance) for p in manifest.participants}
    found: list[str] = []
    try:
        participants_fd = os.open(PARTICIPANTS_DIR, DIR_FLAGS, dir_fd=ckpt_fd)
    except OSError:
        return found
    with closing(participants_fd):
        for kind in sorted(os.listdir(participants_fd)):
            try:
                kind_fd = os.open(kind, DIR_FLAGS, dir_fd=participants_fd)
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
