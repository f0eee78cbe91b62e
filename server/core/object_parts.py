"""A participant's part on an object store: the same format, the same guarantees as on disk.

    <url>/participants/<kind>/<instance>/records-<sha256>.jsonl
    <url>/participants/<kind>/<instance>/manifest.json

An object store has no rename, no hard link, no fsync and no flock; each guarantee of the local
backend (`part_storage`) has an object-store counterpart, and the order is the same:

* **Records first, manifest last.** The records object is uploaded whole (one PUT, or a
  multipart upload that the store makes visible only when it completes; a failed one is
  aborted, so nothing readable is left under its name), and only then is the manifest put.
  A manifest therefore never names records that are not there.
* **The manifest is created only if absent** (`If-None-Match: *`): of two racing writers
  exactly one publishes, and a published part is never replaced, exactly as `link` refuses an
  existing name on disk. An identical manifest already there is an idempotent retry; a
  different one is INVALID_CHECKPOINT_STATE ("already holds a different commit").
* **The records object is named by its digest**, so two writers of the same content write the
  same bytes under the same key: overwriting it can never change what a manifest names.
* **Nothing is deleted that a manifest may come to name.** Without a lock no writer can know
  that another writer of identical content is not between its records PUT and its manifest
  create, so a stopped or failed write leaves its records object (named by no manifest:
  never read as a part); retention removes the checkpoint's prefix later. Only the loser of
  a conflict deletes its records, and only when the published manifest names other records.
* **The WriteFence** is checked between records and taken (`begin_publish`) right before the
  manifest create, so a Resume either stops the write before it publishes or waits for it.
* **Reads are streamed and verified**: the records object's size is checked against the
  manifest before its body is read, then every chunk is hashed and every line checked by the
  one part reader (`part_reader.scan_record_chunks`), so the format has one implementation; a
  chained part's referenced records are streamed too and handed on one at a time
  (`scan_part_records`), never all held at once.
* **A chained part (incremental) references only published parts in sibling prefixes of the
  same root**, as on disk: its references are checked before a byte is written (plain sibling
  names; every referenced manifest published, of this participant, naming that object with
  that size), and resolved on every read by `object_references` with the checks of
  `part_references`, so a restore and `inspect` accept exactly the same parts (a publication
  checks the referenced parts without downloading them: they were verified when published).
  It is read and written only strictly below an allowed root: at a root itself its siblings
  would lie outside every allowed root.

Everything here blocks (network I/O, hashing): callers run it in a thread.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from rollout_checkpoint.server.core import layout
from rollout_checkpoint.server.core.episodes import ID_PATTERN, is_valid_id
from rollout_checkpoint.server.core.errors import (
    CheckpointError,
    Reason,
    corrupt_checkpoint,
    invalid_request,
    rejected_checkpoint,
)
from rollout_checkpoint.server.core.extras import MissingExtra
from rollout_checkpoint.server.core.layout import (
    MANIFEST_LIMIT,
    MANIFEST_NAME,
    REFERENCE_FIELD,
    PartChain,
    StoredManifest,
)
from rollout_checkpoint.server.core.object_references import (
    ObjectReferenceReader,
    PendingReference,
    generated_chunks,
    read_object_manifest,
)
from rollout_checkpoint.server.core.object_store import (
    ObjectLocation,
    ObjectStoreClient,
    ObjectStoreFailure,
    client_for,
    parse_object_url,
    strictly_below_allowed_root,
)
from rollout_checkpoint.server.core.part_reader import (
    check_owner,
    scan_record_chunks,
)
from rollout_checkpoint.server.core.part_references import check_resolved
from rollout_checkpoint.server.core.part_storage import (
    ManifestHeader,
    PublishedPart,
    WriteFence,
    check_chain,
    references_outside_roots,
    unreadable_references,
)

CrashHook = Callable[[str], None]
"""Called with the name of each step of a write (`before_records_put`, `before_publish`,
`before_manifest_create`); fault tests stop the writer or the store there."""

_JOIN = 1 << 20
"""Records are joined into chunks of about this size before the upload."""


def storage_failed(error: ObjectStoreFailure | MissingExtra) -> CheckpointError:
    """STORAGE_FAILED (UNAVAILABLE): the store is unreachable, refused the credentials, or the
    extra is missing. The message is the failure's own, which never holds a credential."""
    metadata = {"storage": "object_store"}
    if isinstance(error, ObjectStoreFailure):
        metadata["url"] = error.url
        metadata["error_type"] = error.error_type
        if error.credentials_refused:
            metadata["cause"] = "credentials_refused"
    else:
        metadata["missing_extra"] = "s3"
    return CheckpointError(
        Reason.STORAGE_FAILED, f"storage failed: {error}", code="UNAVAILABLE", metadata=metadata
    )


class ObjectPartStorage:
    """Parts below object-store URLs (see the module doc); implements `CheckpointStorage`."""

    def __init__(
        self,
        crash_hook: CrashHook | None = None,
        client: Callable[[ObjectLocation], ObjectStoreClient] = client_for,
        allowed_roots: Sequence[str] = (),
    ) -> None:
        self._crash_hook = crash_hook
        self._client = client
        self._allowed_roots = tuple(allowed_roots)

    def _step(self, name: str) -> None:
        if self._crash_hook is not None:
            self._crash_hook(name)

    def write_part(
        self,
        checkpoint_dir: str,
        kind: str,
        instance: str,
        checkpoint_id: str,
        lines: Iterable[bytes],
        fence: WriteFence,
        chain: PartChain | None = None,
    ) -> PublishedPart:
        """Write and publish this participant's part below the URL `checkpoint_dir`.

        A `chain` (a part referencing earlier parts) must name sibling checkpoints of the
        URL (`check_chain`: plain names, never its own; a URL at the top of a bucket has no
        siblings), and every part it references must be published with the records object it
        names (`ObjectReferenceReader.check_files`): checked before a byte is written, so a
        manifest that a reader would refuse, or whose references were deleted meanwhile, is
        never published (INVALID_REQUEST, DATA_LOSS naming the referenced object)."""
        part = _part_location(checkpoint_dir, kind, instance)
        header = ManifestHeader(kind, instance, checkpoint_id, chain)
        try:
            client = self._client(part)
            if chain is not None:
                if not strictly_below_allowed_root(
                    parse_object_url(checkpoint_dir), self._allowed_roots
                ):
                    raise references_outside_roots(part.url)
                _check_references(client, checkpoint_dir, kind, instance, chain)
            return self._write(client, part, header, lines, fence)
        except (ObjectStoreFailure, MissingExtra) as exc:
            raise storage_failed(exc) from None

    def _write(
        self,
        client: ObjectStoreClient,
        part: ObjectLocation,
        header: ManifestHeader,
        lines: Iterable[bytes],
        fence: WriteFence,
    ) -> PublishedPart:
        hasher = hashlib.sha256()
        chunks: list[bytes] = []
        pending: list[bytes] = []
        pending_size = count = size = 0
        for line in lines:
            fence.check()
            data = line + b"\n"
            hasher.update(data)
            pending.append(data)
            pending_size += len(data)
            count += 1
            size += len(data)
            if pending_size >= _JOIN:
                chunks.append(b"".join(pending))
                pending.clear()
                pending_size = 0
        if pending:
            chunks.append(b"".join(pending))
        fence.check()
        manifest = header.manifest(hasher.hexdigest(), count, size)
        manifest_bytes = manifest.encode()
        manifest_key = part.key(MANIFEST_NAME)
        existing = _published_manifest(client, manifest_key)
        if existing is not None:
            # A retry of a write that published already (or a different commit): settle it
            # without uploading the records again.
            return _settle_existing(client, part, manifest, manifest_bytes, existing, False)
        self._step("before_records_put")
        body: bytes | list[bytes] = b"".join(chunks) if len(chunks) <= 1 else chunks
        client.put(part.key(manifest.records_file), body, size=size)
        self._step("before_publish")
        # From here on the publication is under way: a Resume's stop() learns so and waits.
        fence.begin_publish()
        self._step("before_manifest_create")
        if client.create(manifest_key, manifest_bytes):
            return PublishedPart(manifest, hashlib.sha256(manifest_bytes).hexdigest())
        existing = _published_manifest(client, manifest_key)
        return _settle_existing(client, part, manifest, manifest_bytes, existing or b"", True)

    def read_part(
        self,
        checkpoint_dir: str,
        kind: str,
        instance: str,
        select: Callable[[dict[str, Any]], bool],
    ) -> tuple[StoredManifest, list[dict[str, Any]]]:
        """The part's manifest and the selected records, every byte verified (a chained
        part's references resolved below the same root, `scan_part_records`)."""
        part = _part_location(checkpoint_dir, kind, instance)
        try:
            client = self._client(part)
            manifest = read_object_manifest(client, part)
            check_owner(manifest, part.url, kind, instance)
            checkpoint = parse_object_url(checkpoint_dir)
            if manifest.chain is not None and not strictly_below_allowed_root(
                checkpoint, self._allowed_roots
            ):
                raise unreadable_references(part.url)
            kept: list[dict[str, Any]] = []

            def keep(record: dict[str, Any], number: int) -> None:
                if select(record):
                    kept.append(record)

            scan_part_records(client, checkpoint, manifest, keep, in_part_order=True)
            return manifest, kept
        except (ObjectStoreFailure, MissingExtra) as exc:
            raise storage_failed(exc) from None


def scan_part_records(
    client: ObjectStoreClient,
    checkpoint: ObjectLocation,
    manifest: StoredManifest,
    on_record: Callable[[dict[str, Any], int], None],
    *,
    size_only: bool = False,
    read_references: bool = True,
    in_part_order: bool = False,
) -> None:
    """Every record of the part below `checkpoint`, verified (`on_record` sees each with its
    line number in the part): a full part's records object streamed (`scan_object_records`);
    a chained part's own object streamed and checked whole, then the records its reference
    lines stand for read from the earlier parts (`object_references`), each handed on as it
    is read, so no more than one record is held whatever the part's size.

    A chained part's records come own lines first, then each referenced object's in offset
    order, unless `in_part_order` (a restore: the records of a full part of the same cut, in
    its order), which keeps each referenced line's checked bytes (never decoded records)
    until the lines before it are handed on. `read_references=False` (a publication: every
    referenced part was verified when it was published) checks each reference line, and each
    referenced part as published with the object of that size, without reading that object;
    `on_record` then sees the own records only. `size_only` checks sizes without reading a
    record."""
    part = checkpoint.child(*layout.part_components(manifest.kind, manifest.instance))
    if manifest.chain is None:
        scan_object_records(client, part, manifest, on_record, size_only=size_only)
        return
    reader = ObjectReferenceReader.of(client, checkpoint, manifest)
    if size_only:
        scan_object_records(client, part, manifest, on_record, size_only=True)
        reader.check_files()
        return
    if in_part_order:
        _scan_in_part_order(client, part, manifest, reader, on_record)
        return
    pending: list[PendingReference] = []

    def own_or_pending(record: dict[str, Any], number: int) -> None:
        if REFERENCE_FIELD in record:
            pending.append(reader.pending(record, number))
        else:
            on_record(record, number)

    scan_object_records(client, part, manifest, own_or_pending)
    check_resolved(len(pending), manifest, part.url)
    if not read_references:
        reader.check_files()
        return
    reader.read_lines(pending, lambda line, data: on_record(reader.decode(line, data), line.number))


def _scan_in_part_order(
    client: ObjectStoreClient,
    part: ObjectLocation,
    manifest: StoredManifest,
    reader: ObjectReferenceReader,
    on_record: Callable[[dict[str, Any], int], None],
) -> None:
    """`scan_part_records` in the part's order: own records before the first reference line
    are handed on as they stream; from there each line waits (an own record decoded, a
    reference as its checked bytes) until the referenced objects are read, then every
    waiting line is decoded and handed on in order, its bytes released as it goes."""
    waiting: list[tuple[int, dict[str, Any] | PendingReference]] = []

    def own_or_waiting(record: dict[str, Any], number: int) -> None:
        if REFERENCE_FIELD in record:
            waiting.append((number, reader.pending(record, number)))
        elif waiting:
            waiting.append((number, record))
        else:
            on_record(record, number)

    scan_object_records(client, part, manifest, own_or_waiting)
    pending = [line for _, line in waiting if isinstance(line, PendingReference)]
    check_resolved(len(pending), manifest, part.url)
    lines: dict[int, bytes] = {}
    reader.read_lines(pending, lambda line, data: lines.__setitem__(line.number, data))
    pending.clear()
    for number, line in waiting:
        if isinstance(line, PendingReference):
            on_record(reader.decode(line, lines.pop(number)), number)
        else:
            on_record(line, number)
    waiting.clear()


def _check_references(
    client: ObjectStoreClient, checkpoint_dir: str, kind: str, instance: str, chain: PartChain
) -> None:
    """A chained part's references, before it is written: siblings only, every referenced
    part published with the object it names (the size of each object checked)."""
    checkpoint = parse_object_url(checkpoint_dir)
    shown = layout.part_path(checkpoint.url, kind, instance)
    if checkpoint.split() is None:
        raise invalid_request(
            "checkpoint_dir",
            f"{shown}: a part at the top of a bucket has no sibling checkpoints to reference",
        )
    check_chain(chain, checkpoint.url, shown)
    ObjectReferenceReader(client, checkpoint, kind, instance, chain.references).check_files()


def scan_object_records(
    client: ObjectStoreClient,
    part: ObjectLocation,
    manifest: StoredManifest,
    on_record: Callable[[dict[str, Any], int], None],
    *,
    size_only: bool = False,
) -> None:
    """Stream the records object the manifest names through the one part reader: its size
    is checked before a byte is read (a huge object under the name costs nothing), then every
    chunk is hashed and every line checked."""
    streamed = client.stream(part.key(manifest.records_file))
    if streamed is None:
        raise corrupt_checkpoint("the records file named by the manifest is missing", part.url)
    size, chunks = streamed
    # Closed however the scan ends: a GET left open holds a connection until collected.
    with contextlib.closing(generated_chunks(chunks)) as stream:
        if size != manifest.bytes:
            raise corrupt_checkpoint(
                f"records digest mismatch: the records file has {size} bytes, "
                f"the manifest says {manifest.bytes}",
                part.url,
            )
        if not size_only:
            scan_record_chunks(stream, part.url, manifest, on_record)


def _published_manifest(client: ObjectStoreClient, key: str) -> bytes | None:
    """The bytes of the manifest published under `key` (None when there is none). One larger
    than any manifest is nobody's manifest of ours: it compares as a different commit."""
    try:
        stored = client.get(key, limit=MANIFEST_LIMIT)
    except ValueError:
        return b""
    return None if stored is None else stored.data


def _settle_existing(
    client: ObjectStoreClient,
    part: ObjectLocation,
    manifest: StoredManifest,
    manifest_bytes: bytes,
    existing: bytes,
    uploaded: bool,
) -> PublishedPart:
    """A manifest is already published: identical means our retry is done; else refuse, and
    remove our records object if (and only if) the published manifest names other records —
    then no writer can ever publish ours."""
    if existing == manifest_bytes:
        return PublishedPart(manifest, hashlib.sha256(existing).hexdigest())
    if uploaded:
        try:
            named = StoredManifest.decode(existing).records_file
        except ValueError:
            named = None
        if named != manifest.records_file:
            # Left behind on failure, named by nothing: retention removes the prefix later.
            with contextlib.suppress(ObjectStoreFailure):
                client.delete([part.key(manifest.records_file)])
    raise rejected_checkpoint(
        "the participant directory already holds a different commit", path=part.url
    )


def _part_location(checkpoint_dir: str, kind: str, instance: str) -> ObjectLocation:
    """The part's location; kind and instance become key components, so only plain names."""
    for field, value in (("kind", kind), ("instance", instance)):
        if not is_valid_id(value) or value in (".", ".."):
            raise invalid_request(field, f"must match {ID_PATTERN.pattern}")
    try:
        location = parse_object_url(checkpoint_dir)
    except ValueError as exc:
        raise invalid_request("checkpoint_dir", str(exc)) from exc
    return location.child(*layout.part_components(kind, instance))
