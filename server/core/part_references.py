"""Reading the records a chained part (manifest version 2 or 3) references in earlier parts.

A reference line `{"$ref": [index, offset, length, sha256]}` (version 3; version 2 adds the
record's `"episode_id"`) stands for the record at `offset` (`length` bytes, its newline
excluded) of the records file `references[index]` of the manifest names: a published part of
the same kind and instance in a sibling checkpoint directory of the same root. The rules
each keep a restore from installing anything but what was exported:

* The sibling is one plain name (`layout.is_reference_name`), walked below the root's
  descriptor with O_NOFOLLOW like every part directory: a manifest cannot send a reader to
  `..`, an absolute path or through a symlink, whatever it says.
* The referenced part must be published (its manifest exists), of the same kind and
  instance, and name exactly that records file with that size: a reference to a file no
  manifest names (a dead writer's leftover) or of another participant is refused.
* Each referenced line is read alone (a `pread`) and checked against the sha256 the reference
  carries before it is parsed: a restore from the end of a chain reads the records it
  needs, not every file of the chain whole, and still verifies every byte it installs.
* The line must be a record, not another reference (chains are flattened when written, so
  a reference always points at the line that holds the state), and in version 2 hold the
  `episode_id` the reference names. A reference line holds exactly the fields of its
  version: a version 3 line with an episode, or a version 2 line without, is refused.

Any failure is DATA_LOSS naming the referenced file. The checks of the lines themselves
(`ReferenceLines`, `check_reference_name`, `check_names_file`) are shared with the object-store
reader (`object_references`), so a part restores and verifies alike wherever it is stored.
Everything here blocks: callers run it in a thread.
"""

from __future__ import annotations

import errno
import hashlib
import os
from dataclasses import dataclass
from typing import Any

from rollout_checkpoint.server.core import layout, safe_files
from rollout_checkpoint.server.core.errors import CheckpointError, corrupt_checkpoint
from rollout_checkpoint.server.core.layout import (
    CHAIN_SCHEMA_VERSION,
    REFERENCE_FIELD,
    SHA256,
    PartReference,
    StoredManifest,
    load_json,
)
from rollout_checkpoint.server.core.part_reader import read_manifest


@dataclass(frozen=True, slots=True)
class RecordPointer:
    """Where one referenced record lies: which reference of the manifest, and the line's
    offset, length (without its newline) and sha256."""

    reference: int
    offset: int
    length: int
    sha256: str

    def to_json(self) -> list[Any]:
        return [self.reference, self.offset, self.length, self.sha256]

    @classmethod
    def from_json(cls, raw: object, references: int) -> RecordPointer:
        if not isinstance(raw, list) or len(raw) != 4:
            raise ValueError("a reference is [index, offset, length, sha256]")
        index, offset, length, digest = raw
        for name, value in (("index", index), ("offset", offset), ("length", length)):
            if type(value) is not int or value < 0:
                raise ValueError(f"a reference's {name} must be a non-negative integer")
        if index >= references:
            raise ValueError(f"a reference names reference {index} of {references}")
        if not isinstance(digest, str) or not SHA256.fullmatch(digest):
            raise ValueError("a reference's sha256 must be 64 lowercase hex digits")
        return cls(index, offset, length, digest)


def reference_line(pointer: RecordPointer) -> bytes:
    """The version 3 line that stands for a record of an earlier part."""
    return (
        f'{{"{REFERENCE_FIELD}":[{pointer.reference},{pointer.offset},{pointer.length},'
        f'"{pointer.sha256}"]}}'
    ).encode()


class ReferenceLines:
    """The checks of a chained part's reference lines and of the lines they point at, the
    same whichever storage holds the referenced files (`ReferenceReader` on disk,
    `object_references` on an object store)."""

    def __init__(
        self, references: tuple[PartReference, ...], shown: str, *, names_episode: bool
    ) -> None:
        self.references = references
        self._shown = shown
        self.fields = {"episode_id", REFERENCE_FIELD} if names_episode else {REFERENCE_FIELD}
        """The exact fields of a reference line: version 2 names the episode, 3 does not."""

    def pointer(self, line: dict[str, Any]) -> RecordPointer:
        """Where the record a reference line stands for lies; DATA_LOSS when the line is not
        exactly a reference of this part's version."""
        if set(line) != self.fields:
            raise corrupt_checkpoint(
                f"a reference line holds exactly {' and '.join(sorted(self.fields))}",
                self._shown,
            )
        try:
            return RecordPointer.from_json(line[REFERENCE_FIELD], len(self.references))
        except ValueError as exc:
            raise corrupt_checkpoint(f"invalid reference: {exc}", self._shown) from exc

    @staticmethod
    def check_within(pointer: RecordPointer, reference: PartReference, shown: str) -> None:
        """A pointer past its file's recorded size is refused before a byte is read (no
        read of a hostile offset, on disk or as a ranged GET)."""
        if pointer.offset + pointer.length + 1 > reference.bytes:
            raise corrupt_checkpoint("a reference points past the end of its records file", shown)

    def record(
        self, data: bytes, pointer: RecordPointer, line: dict[str, Any], shown: str
    ) -> dict[str, Any]:
        """The referenced record from the bytes read at the pointer (the line and its
        newline): its sha256 is checked before it is parsed, and it must be a record (never
        another reference: chains are flattened), in version 2 of the episode named."""
        self.check_bytes(data, pointer, shown)
        return self.parse(data, line, shown)

    @staticmethod
    def check_bytes(data: bytes, pointer: RecordPointer, shown: str) -> None:
        """The bytes read at the pointer are one whole line with the sha256 the reference
        carries: checked before they are parsed, or kept to be parsed later."""
        if len(data) != pointer.length + 1 or data[-1:] != b"\n":
            raise corrupt_checkpoint("a reference does not point at one whole line", shown)
        if hashlib.sha256(data[:-1]).hexdigest() != pointer.sha256:
            raise corrupt_checkpoint(
                f"referenced record digest mismatch at offset {pointer.offset}", shown
            )

    def parse(self, data: bytes, line: dict[str, Any], shown: str) -> dict[str, Any]:
        """The record in bytes `check_bytes` accepted: a record (never another reference:
        chains are flattened), in version 2 of the episode the reference `line` names."""
        try:
            record = load_json(data[:-1])
        except ValueError as exc:
            raise corrupt_checkpoint("a referenced line is not valid JSON", shown) from exc
        if not isinstance(record, dict) or REFERENCE_FIELD in record:
            raise corrupt_checkpoint("a referenced line is not a record", shown)
        if "episode_id" in self.fields and record.get("episode_id") != line["episode_id"]:
            raise corrupt_checkpoint("a referenced record holds another episode", shown)
        return record


def check_reference_name(reference: PartReference, own: str, shown: str) -> None:
    """A reference names one plain sibling (never `..`, a path, a key with a slash, nor the
    part's own checkpoint): whatever a manifest says, a reader stays below the root."""
    if not layout.is_reference_name(reference.checkpoint) or reference.checkpoint == own:
        raise corrupt_checkpoint("a reference names an invalid checkpoint directory", shown)


def check_names_file(manifest: StoredManifest, reference: PartReference, shown: str) -> None:
    """The referenced part's manifest names exactly the referenced records file and size: a
    file no manifest names (a dead writer's leftover) is never read as a record's source."""
    if (manifest.records_file, manifest.bytes) != (reference.records_file, reference.bytes):
        raise corrupt_checkpoint(
            "the referenced part's manifest does not name this records file", shown
        )


def reader_for(root_fd: int, root_path: str, own: str, manifest: StoredManifest) -> ReferenceReader:
    """The reader of a chained part's references."""
    assert manifest.chain is not None
    return ReferenceReader(
        root_fd,
        root_path,
        own,
        manifest.kind,
        manifest.instance,
        manifest.chain.references,
        names_episode=manifest.schema_version == CHAIN_SCHEMA_VERSION,
    )


class ReferenceReader:
    """Resolves the reference lines of one chained part, opening each referenced records
    file once (`close` releases them). `root_fd` is the open root the part's checkpoint
    directory lies in, `own` that directory's name (a part never references itself)."""

    def __init__(
        self,
        root_fd: int,
        root_path: str,
        own: str,
        kind: str,
        instance: str,
        references: tuple[PartReference, ...],
        *,
        names_episode: bool = False,
    ) -> None:
        self._root_fd = root_fd
        self._root_path = root_path.rstrip("/")
        self.lines = ReferenceLines(references, self._root_path, names_episode=names_episode)
        self._own = own
        self._kind = kind
        self._instance = instance
        self._references = references
        self._open: dict[int, int] = {}
        self.resolved = 0
        self.resolved_bytes = 0

    def close(self) -> None:
        for fd in self._open.values():
            os.close(fd)
        self._open.clear()

    def check_files(self) -> None:
        """Check every referenced file's part and size without reading a record (what a
        size-only verification checks of the part's own records file)."""
        for index, reference in enumerate(self._references):
            self._records_fd(index, reference)

    def resolve(self, line: dict[str, Any]) -> dict[str, Any]:
        """The record a reference line stands for, read and verified."""
        pointer = self.lines.pointer(line)
        reference = self._references[pointer.reference]
        shown = self._shown(reference)
        fd = self._records_fd(pointer.reference, reference)
        self.lines.check_within(pointer, reference, shown)
        data = os.pread(fd, pointer.length + 1, pointer.offset)
        record = self.lines.record(data, pointer, line, shown)
        self.resolved += 1
        self.resolved_bytes += len(data)
        return record

    def _shown(self, reference: PartReference) -> str:
        part = layout.part_path(
            f"{self._root_path}/{reference.checkpoint}", self._kind, self._instance
        )
        return f"{part}/{reference.records_file}"

    def _records_fd(self, index: int, reference: PartReference) -> int:
        fd = self._open.get(index)
        if fd is None:
            fd = self._open_records(reference)
            self._open[index] = fd
        return fd

    def _open_records(self, reference: PartReference) -> int:
        """Open a referenced records file after checking that a published part of this
        participant names it, with the size the reference records."""
        shown = self._shown(reference)
        check_reference_name(reference, self._own, shown)
        part_path = layout.part_path(
            f"{self._root_path}/{reference.checkpoint}", self._kind, self._instance
        )
        try:
            part_fd = safe_files.walk(
                self._root_fd,
                (reference.checkpoint, *layout.part_components(self._kind, self._instance)),
            )
        except FileNotFoundError as exc:
            raise corrupt_checkpoint("the referenced part is missing", shown) from exc
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                raise corrupt_checkpoint("the referenced part is not a directory", shown) from exc
            raise
        with safe_files.closing(part_fd):
            manifest = _referenced_manifest(part_fd, part_path, self._kind, self._instance)
            check_names_file(manifest, reference, shown)
            try:
                fd = safe_files.open_regular(part_fd, reference.records_file)
            except FileNotFoundError as exc:
                raise corrupt_checkpoint("the referenced records file is missing", shown) from exc
            except (safe_files.NotRegular, OSError) as exc:
                if isinstance(exc, OSError) and exc.errno != errno.ELOOP:
                    raise
                raise corrupt_checkpoint(
                    "the referenced records file is not a regular file", shown
                ) from exc
        if os.fstat(fd).st_size != reference.bytes:
            os.close(fd)
            raise corrupt_checkpoint(
                "referenced records digest mismatch: the file's size differs from its manifest",
                shown,
            )
        return fd


def _referenced_manifest(part_fd: int, part_path: str, kind: str, instance: str) -> StoredManifest:
    """The referenced part's manifest; any refusal of it is the referenced part's DATA_LOSS
    (another kind or instance there is a corrupt reference, not this restore's mistake)."""
    try:
        return read_manifest(part_fd, part_path, kind, instance)
    except CheckpointError as error:
        raise corrupt_checkpoint(f"the referenced part is unusable: {error}", part_path) from error


def check_resolved(resolved: int, manifest: StoredManifest, part_path: str) -> None:
    """A chained part's reference lines must be exactly as many as its manifest says."""
    assert manifest.chain is not None
    if resolved != manifest.chain.referenced_records:
        raise corrupt_checkpoint(
            f"the part holds {resolved} reference lines, its manifest says "
            f"{manifest.chain.referenced_records}",
            part_path,
        )
