"""Reading the records a chained part on an object store references in earlier parts.

The format and its checks are `part_references`' (one implementation: `ReferenceLines`); what
differs from the disk is how the referenced bytes are found and read:

* **The root is the checkpoint URL's parent prefix.** A reference names one plain sibling
  (`check_reference_name`), so its records object is `<root>/<name>/participants/<kind>/
  <instance>/<records file>`: a key derived from checked components, never from a manifest's
  text, so a manifest cannot send a reader to `..`, another prefix or another bucket. A
  checkpoint at the top of a bucket has no root, hence no siblings: its references are refused.
* **Only published parts of the same participant.** The referenced part's manifest must exist
  (published), be of the same kind and instance, and name exactly that records object with
  that size (`check_names_file`); a records object no manifest names (a dead writer's
  leftover) is never read as a record's source.
* **One streamed GET per referenced object, the lines picked as the bytes arrive.** A restore
  from the end of a chain needs lines spread over each file (at 5 KB a record, ranged GETs of
  the lines are merged by the client into reads of nearly the whole object anyway, and
  measured no faster on SeaweedFS); the GET's size is checked against the reference before a
  byte is used, the stream stops after the last line needed (never asking for one more chunk),
  is closed however the read ends, and each line is handed on as it is cut: memory holds a
  chunk, never an object or a part's records. Every line's sha256 is checked before it is
  parsed. Unlike the disk (one `pread` per line), a restore from the end of a chain thus
  downloads about what retention keeps for it: up to 1 / (1 - `incremental_max_stale_share`)
  of the live records. A publication reads none of it (`check_files`: the referenced parts
  were verified when they were published; each is checked still published, naming an object
  of that size).

Any failure is INVALID_CHECKPOINT_STATE (DATA_LOSS) naming the referenced object; a store that
fails is the caller's STORAGE_FAILED (`ObjectStoreFailure` propagates). Everything here blocks:
callers run it in a thread.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Generator, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from rollout_checkpoint.server.core import layout
from rollout_checkpoint.server.core.errors import CheckpointError, corrupt_checkpoint
from rollout_checkpoint.server.core.layout import (
    CHAIN_SCHEMA_VERSION,
    MANIFEST_LIMIT,
    MANIFEST_NAME,
    PartReference,
    StoredManifest,
)
from rollout_checkpoint.server.core.object_store import ObjectLocation, ObjectStoreClient
from rollout_checkpoint.server.core.part_reader import check_owner, decode_manifest
from rollout_checkpoint.server.core.part_references import (
    RecordPointer,
    ReferenceLines,
    check_names_file,
    check_reference_name,
)


@dataclass(frozen=True, slots=True)
class PendingReference:
    """A reference line of the part being read, kept until its record is read: the line's
    number in the part, where the record lies, and the episode a version 2 line names."""

    number: int
    pointer: RecordPointer
    episode: object


class ObjectReferenceReader:
    """Resolves the reference lines of one chained part below `checkpoint` (its checkpoint's
    location); each referenced part is checked once (`check_files`)."""

    def __init__(
        self,
        client: ObjectStoreClient,
        checkpoint: ObjectLocation,
        kind: str,
        instance: str,
        references: tuple[PartReference, ...],
        *,
        names_episode: bool = False,
    ) -> None:
        self._client = client
        self._kind = kind
        self._instance = instance
        self._references = references
        self._shown = layout.part_path(checkpoint.url, kind, instance)
        split = checkpoint.split()
        self._root: ObjectLocation | None = split[0] if split is not None else None
        self._own = split[1] if split is not None else ""
        self.lines = ReferenceLines(references, self._shown, names_episode=names_episode)
        self._keys: dict[int, str] = {}
        """The key of each referenced records object whose part was checked."""

    @classmethod
    def of(
        cls, client: ObjectStoreClient, checkpoint: ObjectLocation, manifest: StoredManifest
    ) -> ObjectReferenceReader:
        """The reader of the chained part `manifest` describes, below `checkpoint`."""
        assert manifest.chain is not None
        return cls(
            client,
            checkpoint,
            manifest.kind,
            manifest.instance,
            manifest.chain.references,
            names_episode=manifest.schema_version == CHAIN_SCHEMA_VERSION,
        )

    def check_files(self) -> None:
        """Check every referenced part and its records object's size, reading no record
        (what a size-only verification checks of the part's own records)."""
        for index in range(len(self._references)):
            size = self._client.size(self._records_key(index))
            self._check_size(index, size)

    def pending(self, line: dict[str, Any], number: int) -> PendingReference:
        """What a reference line (line `number` of the part) needs kept until it is resolved:
        its pointer, checked against the referenced object's recorded size, and in version 2
        the episode it names; never the line itself (a part's worth of decoded lines is what
        a chained part's read must not hold)."""
        pointer = self.lines.pointer(line)
        reference = self._references[pointer.reference]
        self.lines.check_within(pointer, reference, self._records_shown(reference))
        return PendingReference(number, pointer, line.get("episode_id"))

    def read_lines(
        self,
        pending: Iterable[PendingReference],
        on_line: Callable[[PendingReference, bytes], None],
    ) -> None:
        """Hand each reference's line to `on_line` as its bytes arrive, whole and of the
        sha256 the reference carries (`decode` parses it): one referenced object at a time,
        its lines in offset order, so memory holds one line, never an object or a part.
        (Reading a chain's objects concurrently was measured no faster on SeaweedFS: the
        bytes, hashing and parsing bound a restore, not one stream's latency.)"""
        by_file: dict[int, list[PendingReference]] = {}
        for reference in pending:
            by_file.setdefault(reference.pointer.reference, []).append(reference)
        for index, lines in sorted(by_file.items()):
            self._read_file(index, sorted(lines, key=lambda p: p.pointer.offset), on_line)

    def decode(self, reference: PendingReference, data: bytes) -> dict[str, Any]:
        """The record in a line `read_lines` handed on (its bytes already checked)."""
        line = {"episode_id": reference.episode}
        return self.lines.parse(data, line, self._shown_of(reference))

    def _read_file(
        self,
        index: int,
        lines: list[PendingReference],
        on_line: Callable[[PendingReference, bytes], None],
    ) -> None:
        """The lines of one referenced object, by one streamed GET closed when they are
        read or a check fails (a GET left open holds a connection until it is collected)."""
        shown = self._records_shown(self._references[index])
        with contextlib.closing(self._stream(index)) as chunks:
            wanted = [(p.pointer.offset, p.pointer.length + 1) for p in lines]
            for reference, data in zip(lines, _picked(chunks, wanted), strict=True):
                self.lines.check_bytes(data, reference.pointer, shown)
                on_line(reference, data)

    def _shown_of(self, reference: PendingReference) -> str:
        return self._records_shown(self._references[reference.pointer.reference])

    def _stream(self, index: int) -> Generator[bytes, None, None]:
        """The referenced object's chunks, once its size matched the reference (checked
        before a byte is read; the refused GET is closed)."""
        key = self._records_key(index)
        streamed = self._client.stream(key)
        if streamed is not None and streamed[0] != self._references[index].bytes:
            _close(streamed[1])
        self._check_size(index, None if streamed is None else streamed[0])
        assert streamed is not None
        return generated_chunks(streamed[1])

    def _check_size(self, index: int, size: int | None) -> None:
        reference = self._references[index]
        shown = self._records_shown(reference)
        if size is None:
            raise corrupt_checkpoint("the referenced records file is missing", shown)
        if size != reference.bytes:
            raise corrupt_checkpoint(
                "referenced records digest mismatch: the file's size differs from its manifest",
                shown,
            )

    def _part(self, reference: PartReference) -> ObjectLocation:
        shown = self._records_shown(reference)
        if self._root is None:
            raise corrupt_checkpoint(
                "a part at the top of a bucket has no sibling checkpoints to reference", shown
            )
        check_reference_name(reference, self._own, shown)
        return self._root.child(
            reference.checkpoint, *layout.part_components(self._kind, self._instance)
        )

    def _records_shown(self, reference: PartReference) -> str:
        base = self._root.url if self._root is not None else "<none>"
        part = layout.part_path(f"{base}/{reference.checkpoint}", self._kind, self._instance)
        return f"{part}/{reference.records_file}"

    def _records_key(self, index: int) -> str:
        """The key of a referenced records object, once its part proved to be a published
        part of this participant naming it."""
        key = self._keys.get(index)
        if key is None:
            reference = self._references[index]
            part = self._part(reference)
            manifest = self._referenced_manifest(part)
            check_names_file(manifest, reference, self._records_shown(reference))
            key = self._keys[index] = part.key(reference.records_file)
        return key

    def _referenced_manifest(self, part: ObjectLocation) -> StoredManifest:
        """The referenced part's manifest; any refusal of it is the referenced part's
        DATA_LOSS (another kind or instance there is a corrupt reference)."""
        try:
            manifest = read_object_manifest(self._client, part)
            check_owner(manifest, part.url, self._kind, self._instance)
        except CheckpointError as error:
            raise corrupt_checkpoint(
                f"the referenced part is unusable: {error}", part.url
            ) from error
        return manifest


def read_object_manifest(client: ObjectStoreClient, part: ObjectLocation) -> StoredManifest:
    """The part's decoded manifest; DATA_LOSS when missing, too large or invalid."""
    raw = read_object_manifest_bytes(client, part)
    if raw is None:
        raise corrupt_checkpoint("the part has no manifest (never published)", part.url)
    return decode_manifest(raw, part.url)


def read_object_manifest_bytes(client: ObjectStoreClient, part: ObjectLocation) -> bytes | None:
    """The raw manifest (None when missing); DATA_LOSS when larger than any manifest."""
    try:
        stored = client.get(part.key(MANIFEST_NAME), limit=MANIFEST_LIMIT)
    except ValueError as exc:
        raise corrupt_checkpoint(
            f"manifest.json is larger than {MANIFEST_LIMIT} bytes", part.url
        ) from exc
    return None if stored is None else stored.data


def _picked(chunks: Iterable[bytes], wanted: Iterable[tuple[int, int]]) -> Iterator[bytes]:
    """The byte ranges (offset, length), in offset order, cut from a stream of chunks: only
    the bytes from the next range on are held, and the stream is left once the last range is
    cut (the rest of the object is never downloaded). An object that ends first yields what
    it holds of the next range: a short line, which its check refuses."""
    ranges = iter(wanted)
    following = next(ranges, None)
    if following is None:
        return
    held = bytearray()
    start = 0  # the object's offset of held[0]
    for chunk in chunks:
        held += chunk
        while following is not None and following[0] + following[1] <= start + len(held):
            offset, length = following
            yield bytes(held[offset - start : offset - start + length])
            following = next(ranges, None)
        if following is None:
            return  # never ask the stream for another chunk: it would be downloaded whole
        drop = min(following[0] - start, len(held))
        del held[:drop]
        start += drop
    yield bytes(held[following[0] - start :])


def generated_chunks(chunks: Iterator[bytes]) -> Generator[bytes, None, None]:
    """`chunks` as a generator whose `close` closes the stream beneath it."""
    try:
        yield from chunks
    finally:
        _close(chunks)


def _close(chunks: Iterator[bytes]) -> None:
    close = getattr(chunks, "close", None)
    if close is not None:
        close()
