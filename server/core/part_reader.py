"""The one reader of a participant's part: the runtime's restore and the controller's
verification (`inspect`, publication) both read parts through it, so the format has one
implementation.

Every file is opened with O_NONBLOCK and checked to be a regular file before a byte is read
(`safe_files`): a FIFO planted under a manifest's or a records file's name would otherwise wedge
the reading thread for good. A records file is checked against the size its manifest records
before it is read, and always hashed whole before any of its lines is reported as bad, so a
file that does not match its manifest is a digest mismatch whatever its lines look like.
Everything here blocks: callers run it in a thread.
"""

from __future__ import annotations

import errno
import hashlib
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal

from rollout_checkpoint.server.core import safe_files
from rollout_checkpoint.server.core.errors import (
    CheckpointError,
    corrupt_checkpoint,
    rejected_checkpoint,
)
from rollout_checkpoint.server.core.layout import (
    MANIFEST_LIMIT,
    MANIFEST_NAME,
    StoredManifest,
    load_json,
)


def read_manifest_bytes(part_fd: int, part_path: str) -> bytes:
    """The raw `manifest.json` of the open part directory; DATA_LOSS when it is missing, not a
    regular file, a symlink or larger than any manifest. Other OSErrors propagate."""
    try:
        raw = safe_files.read_regular(part_fd, MANIFEST_NAME, MANIFEST_LIMIT)
    except FileNotFoundError as exc:
        raise corrupt_checkpoint("the part has no manifest (never published)", part_path) from exc
    except safe_files.NotRegular as exc:
        raise corrupt_checkpoint("manifest.json is not a regular file", part_path) from exc
    except safe_files.TooLarge as exc:
        raise corrupt_checkpoint(
            f"manifest.json is larger than {MANIFEST_LIMIT} bytes", part_path
        ) from exc
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise corrupt_checkpoint("manifest.json is a symlink", part_path) from exc
        raise
    if len(raw) > MANIFEST_LIMIT:  # it grew while being read
        raise corrupt_checkpoint(f"manifest.json is larger than {MANIFEST_LIMIT} bytes", part_path)
    return raw


def decode_manifest(raw: bytes, part_path: str) -> StoredManifest:
    """`StoredManifest.decode`, its ValueError as DATA_LOSS."""
    try:
        return StoredManifest.decode(raw)
    except ValueError as exc:
        raise corrupt_checkpoint(f"invalid participant manifest: {exc}", part_path) from exc


def check_owner(
    manifest: StoredManifest,
    part_path: str,
    kind: str,
    instance: str,
    checkpoint_id: str | None = None,
) -> None:
    """FAILED_PRECONDITION when the manifest names another kind, instance (or checkpoint)."""
    expected = [("kind", kind), ("instance", instance)]
    if checkpoint_id is not None:
        expected.append(("checkpoint_id", checkpoint_id))
    for field_name, value in expected:
        actual = getattr(manifest, field_name)
        if actual != value:
            raise rejected_checkpoint(
                f"the manifest's {field_name} is {actual!r}, expected {value!r}", path=part_path
            )


def read_manifest(part_fd: int, part_path: str, kind: str, instance: str) -> StoredManifest:
    """The validated manifest of the open part directory of `kind`/`instance`."""
    manifest = decode_manifest(read_manifest_bytes(part_fd, part_path), part_path)
    check_owner(manifest, part_path, kind, instance)
    return manifest


RecordsCheck = Literal["full", "size"]
"""How much of a records file to check: everything, or only its size."""


def scan_records(
    part_fd: int,
    part_path: str,
    manifest: StoredManifest,
    on_record: Callable[[dict[str, Any], int], None],
    check: RecordsCheck = "full",
) -> None:
    """Check the records file the manifest names; `on_record(record, line_number)` sees each
    record (a JSON object) in order and may raise CheckpointError to refuse one.

    The size the manifest records is checked first, before a byte is read: a hostile sparse
    file of a terabyte under the records name would otherwise keep this thread hashing zeros
    for hours. Then the file is read in fixed-size chunks and always hashed whole: the first
    bad line (torn, not JSON, not an object, refused by `on_record`) is reported only after
    the digest, count and size matched, so a file that does not match its manifest is a
    digest mismatch whatever its lines look like. Lines are reassembled from chunks only
    while they can still be valid, so memory stays bounded by the manifest's size."""
    try:
        fd = safe_files.open_regular(part_fd, manifest.records_file)
    except FileNotFoundError as exc:
        raise corrupt_checkpoint(
            "the records file named by the manifest is missing", part_path
        ) from exc
    except safe_files.NotRegular as exc:
        raise corrupt_checkpoint("the records file is not a regular file", part_path) from exc
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise corrupt_checkpoint("the records file is a symlink", part_path) from exc
        raise
    with safe_files.closing(fd):
        size = os.fstat(fd).st_size
        if size != manifest.bytes:
            raise corrupt_checkpoint(
                f"records digest mismatch: the records file has {size} bytes, "
                f"the manifest says {manifest.bytes}",
                part_path,
            )
        if check == "size":
            return
        scan = _scan(
            iter(lambda: os.read(fd, safe_files.READ_CHUNK), b""),
            manifest.bytes,
            part_path,
            on_record,
        )
    check_scan(scan, manifest, part_path)


def scan_record_chunks(
    chunks: Iterable[bytes],
    part_path: str,
    manifest: StoredManifest,
    on_record: Callable[[dict[str, Any], int], None],
) -> None:
    """`scan_records` over a records file that arrives in chunks (an object store's streamed
    GET): the same hashing, counting and line checks, the same errors. The caller checks the
    object's size against the manifest before it starts the stream."""
    check_scan(_scan(chunks, manifest.bytes, part_path, on_record), manifest, part_path)


def check_scan(scan: _Scan, manifest: StoredManifest, part_path: str) -> None:
    """Digest, count and size must match the manifest before a bad line is reported."""
    if (scan.sha256, scan.count, scan.size) != (
        manifest.records_sha256,
        manifest.record_count,
        manifest.bytes,
    ):
        raise corrupt_checkpoint(
            "records digest mismatch: the records file does not match its manifest "
            f"(sha256 {scan.sha256}, {scan.count} records, {scan.size} bytes; the manifest "
            f"says sha256 {manifest.records_sha256}, {manifest.record_count} records, "
            f"{manifest.bytes} bytes)",
            part_path,
        )
    if scan.problem is not None:
        raise scan.problem


@dataclass(slots=True)
class _Scan:
    sha256: str
    count: int
    size: int
    problem: CheckpointError | None


def _scan(
    chunks: Iterable[bytes],
    expected_bytes: int,
    part_path: str,
    on_record: Callable[[dict[str, Any], int], None],
) -> _Scan:
    """Hash, count and check every line, reading fixed-size chunks (see `scan_records`)."""
    hasher = hashlib.sha256()
    count = size = 0
    pending: list[bytes] = []
    problem: CheckpointError | None = None
    parsing = True
    last = b"\n"
    for chunk in chunks:
        if not chunk:
            continue
        hasher.update(chunk)
        size += len(chunk)
        last = chunk[-1:]
        if size > expected_bytes:
            parsing = False  # grown past its manifest: the digest cannot match
        start = 0
        while parsing:
            end = chunk.find(b"\n", start)
            if end < 0:
                if start < len(chunk):
                    pending.append(chunk[start:])
                start = len(chunk)
                break
            pending.append(chunk[start : end + 1])
            start = end + 1
            count += 1
            line = b"".join(pending)
            pending.clear()
            problem = _check_line(line, count, part_path, on_record)
            if problem is not None:
                parsing = False
        if not parsing:
            pending.clear()
            count += chunk.count(b"\n", start)
    if last != b"\n":
        count += 1  # a final line without its newline is a (torn) line too
        if parsing and problem is None:
            problem = corrupt_checkpoint(f"line {count} is torn (no final newline)", part_path)
    return _Scan(hasher.hexdigest(), count, size, problem)


def _check_line(
    line: bytes,
    number: int,
    part_path: str,
    on_record: Callable[[dict[str, Any], int], None],
) -> CheckpointError | None:
    """Parse one line and hand it on; return the problem instead of raising it."""
    try:
        record = load_json(line)
    except ValueError:
        return corrupt_checkpoint(f"line {number} is not valid JSON", part_path)
    if not isinstance(record, dict):
        return corrupt_checkpoint(f"line {number} is not a JSON object", part_path)
    try:
        on_record(record, number)
    except CheckpointError as error:
        return error
    return None
