"""Storage of one participant's part of a checkpoint.

    <checkpoint_dir>/participants/<kind>/<instance>/records-<sha256>.jsonl
    <checkpoint_dir>/participants/<kind>/<instance>/manifest.json

A part is complete if and only if its manifest exists, and a directory with a manifest never
changes. Everything here blocks (file I/O, fsync, hashing): callers run it in a thread.

The ordering exists for crashes. Records are written to a temporary file and fsynced before
they get their digest name, so a crash never leaves a torn file under a published name. The
manifest comes last and is hard-linked into place, never renamed over: `link` fails when the
name exists, so of two racing writers exactly one publishes and a published manifest is never
replaced. The directory is fsynced last, so a manifest that survives a crash names a records
file that survived too.

Every file operation goes through directory descriptors opened with O_NOFOLLOW, so a symlink
planted anywhere under the checkpoint directory cannot redirect a write outside it. The same
holds above it: the checkpoint directory is the real path `validate_checkpoint_dir` checked
against the allowed roots, and it is never resolved by name again but walked from `/` one
component at a time. Otherwise a parent swapped for a symlink between the check and the write
would put the part outside every allowed root (and a restore would read one from there).

Every file is opened with O_NONBLOCK and checked with fstat to be a regular file before a
byte is read or written: open() of a FIFO planted under a file's name (a manifest, a records
file) otherwise waits forever for a writer, and the thread it wedges holds the commit or the
restore with it. Such a file is a typed refusal instead.
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import hashlib
import json
import os
import re
import secrets
import stat
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from .episodes import ID_PATTERN, is_valid_id
from .errors import (
    CheckpointError,
    Reason,
    corrupt_checkpoint,
    invalid_request,
    rejected_checkpoint,
)

SCHEMA_VERSION = 1
MANIFEST_NAME = "manifest.json"
RECORDS_NAME = re.compile(r"^records-([0-9a-f]{64})\.jsonl$")
# O_NONBLOCK on directories is harmless; on files it keeps open() of a FIFO from blocking.
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_FILE_FLAGS = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL
_READ_CHUNK = 1 << 20
# A manifest is a few hundred bytes; a larger file under its name is not one (and reading a
# hostile multi-gigabyte file into memory must not be the way to find that out).
MANIFEST_LIMIT = 1 << 16


@dataclass(frozen=True, slots=True)
class StoredManifest:
    schema_version: int
    kind: str
    instance: str
    checkpoint_id: str
    records_file: str
    records_sha256: str
    record_count: int
    bytes: int  # the records file's size; the name is the manifest's field name

    def encode(self) -> builtins.bytes:
        return (json.dumps(asdict(self), sort_keys=True, indent=2) + "\n").encode()


@dataclass(frozen=True, slots=True)
class PublishedPart:
    manifest: StoredManifest
    manifest_sha256: str


class StopRequested(Exception):
    """The write was stopped (a Resume) before it began to publish."""


class WriteFence:
    """Decides, atomically between a writer thread and the event loop, whether a part may still publish.

    A Resume that stops a write must know which of two things it is facing: a writer that will
    never publish (admission may reopen at once), or one whose manifest link is under way and
    cannot be withdrawn (the Resume must wait for it, or a checkpoint it abandoned would appear
    after it reopened admission). A bare flag checked by the writer cannot tell: the writer may
    read it unset and link a moment after the Resume set it. Here the writer's last check and
    its "I am publishing" are one step under a lock, and so is the Resume's stop and its
    answer, so exactly one of the two orders happens and both sides agree on which.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stopped = False
        self._publishing = False

    def stop(self) -> bool:
        """Refuse publication from now on. Returns True if the writer had already begun
        publishing (the manifest link is under way and cannot be withdrawn: the caller may
        wait for it), False if the writer will never publish. Never blocks on I/O (a
        threading.Lock held only around flag updates)."""
        with self._lock:
            self._stopped = True
            return self._publishing

    @property
    def stopped(self) -> bool:
        with self._lock:
            return self._stopped

    @property
    def publishing(self) -> bool:
        with self._lock:
            return self._publishing

    def check(self) -> None:
        """Raise StopRequested if stopped (called between records)."""
        if self.stopped:
            raise StopRequested()

    def begin_publish(self) -> None:
        """Atomically: raise StopRequested if stopped, else mark publishing. Called right before the manifest link."""
        with self._lock:
            if self._stopped:
                raise StopRequested()
            self._publishing = True


CrashHook = Callable[[str], None]
"""Called with the name of each step of a write; fault tests kill the writer there."""


class CheckpointStorage(Protocol):
    """Where parts live. The local filesystem is the default; an object store fits here."""

    def write_part(
        self,
        checkpoint_dir: str,
        kind: str,
        instance: str,
        checkpoint_id: str,
        lines: Iterable[bytes],
        fence: WriteFence,
    ) -> PublishedPart: ...

    def read_part(
        self,
        checkpoint_dir: str,
        kind: str,
        instance: str,
        select: Callable[[dict[str, Any]], bool],
    ) -> tuple[StoredManifest, list[dict[str, Any]]]: ...


def validate_checkpoint_dir(raw: str, allowed_roots: Sequence[str]) -> str:
    """Check a requested checkpoint directory and return its real path.

    Refused (INVALID_REQUEST, field `checkpoint_dir`): a relative path, one that is not
    normalized, one with a `..` component, and one that resolves outside every allowed root.
    Blocks (realpath): run it in a thread. Pass the returned path, never the raw one, to
    `write_part` and `read_part`: they walk it without following any symlink, so what was
    checked here is what they open.
    """
    field = "checkpoint_dir"
    if not raw:
        raise invalid_request(field, "must not be empty")
    if "\x00" in raw:
        raise invalid_request(field, "must not contain NUL")
    if not os.path.isabs(raw):
        raise invalid_request(field, "must be an absolute path")
    if ".." in raw.split("/"):
        raise invalid_request(field, "must not contain a '..' component")
    if os.path.normpath(raw) != raw:
        raise invalid_request(field, "must be a normalized path")
    real = os.path.realpath(raw)
    if allowed_roots and not any(_is_within(real, root) for root in allowed_roots):
        raise invalid_request(field, "lies outside the allowed checkpoint roots")
    return real


def _is_within(path: str, root: str) -> bool:
    real_root = os.path.realpath(root)
    return path == real_root or path.startswith(real_root.rstrip("/") + "/")


def _storage_error(exc: OSError, path: str) -> CheckpointError:
    full = exc.errno in (errno.ENOSPC, errno.EDQUOT)
    return CheckpointError(
        Reason.STORAGE_FAILED,
        f"storage failed: {exc.strerror or exc}",
        code="RESOURCE_EXHAUSTED" if full else "UNAVAILABLE",
        metadata={"path": path, "errno": errno.errorcode.get(exc.errno or 0, str(exc.errno))},
    )


class LocalStorage:
    """Parts on a local (or mounted) POSIX filesystem."""

    def __init__(self, crash_hook: CrashHook | None = None) -> None:
        self._crash_hook = crash_hook

    def _step(self, name: str) -> None:
        if self._crash_hook is not None:
            self._crash_hook(name)

    # -- write ---------------------------------------------------------------------------

    def write_part(
        self,
        checkpoint_dir: str,
        kind: str,
        instance: str,
        checkpoint_id: str,
        lines: Iterable[bytes],
        fence: WriteFence,
    ) -> PublishedPart:
        """Write and publish this participant's part; blocks (run it in a thread).

        `checkpoint_dir` is the real path `validate_checkpoint_dir` returned. `fence` is
        checked between records; StopRequested means nothing was published.
        """
        part_path = os.path.join(checkpoint_dir, "participants", kind, instance)
        try:
            part_fd = _open_part_dir(checkpoint_dir, kind, instance, create=True)
        except OSError as exc:
            raise _storage_error(exc, part_path) from exc
        try:
            return self._write_in(part_fd, part_path, kind, instance, checkpoint_id, lines, fence)
        except OSError as exc:
            raise _storage_error(exc, part_path) from exc
        finally:
            os.close(part_fd)

    def _write_in(
        self,
        part_fd: int,
        part_path: str,
        kind: str,
        instance: str,
        checkpoint_id: str,
        lines: Iterable[bytes],
        fence: WriteFence,
    ) -> PublishedPart:
        temporaries: list[str] = []
        try:
            records_tmp = f".records-{secrets.token_hex(8)}.tmp"
            temporaries.append(records_tmp)
            digest, count, size = self._write_records(part_fd, records_tmp, lines, fence)
            records_file = f"records-{digest}.jsonl"
            self._step("before_rename")
            os.rename(records_tmp, records_file, src_dir_fd=part_fd, dst_dir_fd=part_fd)
            temporaries.remove(records_tmp)
            self._step("after_rename")
            manifest = StoredManifest(
                SCHEMA_VERSION, kind, instance, checkpoint_id, records_file, digest, count, size
            )
            manifest_bytes = manifest.encode()
            manifest_tmp = f".manifest-{secrets.token_hex(8)}.tmp"
            temporaries.append(manifest_tmp)
            _write_file(part_fd, manifest_tmp, manifest_bytes)
            # From here on the publication is under way: a Resume's stop() learns so and waits
            # for it instead of stopping it, since a link cannot be withdrawn.
            self._step("before_publish")
            fence.begin_publish()
            self._step("before_manifest_link")
            try:
                os.link(
                    manifest_tmp,
                    MANIFEST_NAME,
                    src_dir_fd=part_fd,
                    dst_dir_fd=part_fd,
                    follow_symlinks=False,
                )
            except FileExistsError:
                return self._settle_existing(part_fd, part_path, manifest, manifest_bytes)
            self._step("after_manifest_link")
            os.unlink(manifest_tmp, dir_fd=part_fd)
            temporaries.remove(manifest_tmp)
            self._step("before_dir_fsync")
            os.fsync(part_fd)
            return PublishedPart(manifest, hashlib.sha256(manifest_bytes).hexdigest())
        finally:
            for name in temporaries:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(name, dir_fd=part_fd)

    def _write_records(
        self, part_fd: int, name: str, lines: Iterable[bytes], fence: WriteFence
    ) -> tuple[str, int, int]:
        hasher = hashlib.sha256()
        count = size = 0
        fd = _open_regular(part_fd, name, _CREATE_FLAGS)
        with os.fdopen(fd, "wb", buffering=_READ_CHUNK) as out:
            for line in lines:
                fence.check()
                self._step("before_record")
                data = line + b"\n"
                out.write(data)
                hasher.update(data)
                count += 1
                size += len(data)
                self._step("after_record")
            fence.check()
            out.flush()
            os.fsync(out.fileno())
            self._step("after_fsync")
        return hasher.hexdigest(), count, size

    def _settle_existing(
        self, part_fd: int, part_path: str, manifest: StoredManifest, manifest_bytes: bytes
    ) -> PublishedPart:
        """Another writer published first: identical means our retry is done; else refuse."""
        try:
            existing = _read_file(part_fd, MANIFEST_NAME, MANIFEST_LIMIT)
        except _NotRegular as exc:
            raise _foreign_manifest(part_fd, part_path, manifest, "not a regular file") from exc
        except OSError as exc:
            if exc.errno != errno.ELOOP:
                raise
            raise _foreign_manifest(part_fd, part_path, manifest, "a symlink") from exc
        if existing == manifest_bytes:
            # The writer that linked it may have died (or failed its fsync) before the
            # directory fsync: make the part durable before this retry reports it published.
            os.fsync(part_fd)
            return PublishedPart(manifest, hashlib.sha256(existing).hexdigest())
        other_records: str | None = None
        with contextlib.suppress(ValueError, TypeError, AttributeError, RecursionError):
            other_records = json.loads(existing).get("records_file")
        if other_records != manifest.records_file:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(manifest.records_file, dir_fd=part_fd)
        raise rejected_checkpoint(
            "the participant directory already holds a different commit", path=part_path
        )

    # -- read ----------------------------------------------------------------------------

    def read_part(
        self,
        checkpoint_dir: str,
        kind: str,
        instance: str,
        select: Callable[[dict[str, Any]], bool],
    ) -> tuple[StoredManifest, list[dict[str, Any]]]:
        part_path = os.path.join(checkpoint_dir, "participants", kind, instance)
        try:
            part_fd = _open_part_dir(checkpoint_dir, kind, instance, create=False)
        except FileNotFoundError as exc:
            raise corrupt_checkpoint(
                "no part of this participant in the checkpoint", part_path
            ) from exc
        except OSError as exc:
            raise _storage_error(exc, part_path) from exc
        try:
            manifest = self._read_manifest(part_fd, part_path, kind, instance)
            records = self._read_records(part_fd, part_path, manifest, select)
            return manifest, records
        except OSError as exc:
            raise _storage_error(exc, part_path) from exc
        finally:
            os.close(part_fd)

    def _read_manifest(
        self, part_fd: int, part_path: str, kind: str, instance: str
    ) -> StoredManifest:
        try:
            raw = _read_file(part_fd, MANIFEST_NAME, MANIFEST_LIMIT)
        except FileNotFoundError as exc:
            raise corrupt_checkpoint(
                "the part has no manifest (never published)", part_path
            ) from exc
        except _NotRegular as exc:
            raise corrupt_checkpoint("manifest.json is not a regular file", part_path) from exc
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise corrupt_checkpoint("manifest.json is a symlink", part_path) from exc
            raise
        if len(raw) > MANIFEST_LIMIT:
            raise corrupt_checkpoint(
                f"manifest.json is larger than {MANIFEST_LIMIT} bytes", part_path
            )
        try:
            fields = json.loads(raw, parse_constant=_refuse_constant)
            manifest = _manifest_from_json(fields)
        except (ValueError, TypeError, RecursionError) as exc:
            raise corrupt_checkpoint(f"unreadable manifest: {exc}", part_path) from exc
        if manifest.kind != kind or manifest.instance != instance:
            raise rejected_checkpoint(
                f"the part belongs to {manifest.kind}/{manifest.instance}, not {kind}/{instance}",
                path=part_path,
            )
        return manifest

    def _read_records(
        self,
        part_fd: int,
        part_path: str,
        manifest: StoredManifest,
        select: Callable[[dict[str, Any]], bool],
    ) -> list[dict[str, Any]]:
        try:
            fd = _open_regular(part_fd, manifest.records_file, os.O_RDONLY)
        except FileNotFoundError as exc:
            raise corrupt_checkpoint(
                "the records file named by the manifest is missing", part_path
            ) from exc
        except _NotRegular as exc:
            raise corrupt_checkpoint("the records file is not a regular file", part_path) from exc
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise corrupt_checkpoint("the records file is a symlink", part_path) from exc
            raise
        size = os.fstat(fd).st_size
        if size != manifest.bytes:
            # Checked before reading: a hostile sparse file of a terabyte under the records
            # name would otherwise keep this thread hashing zeros for hours.
            os.close(fd)
            raise corrupt_checkpoint(
                f"records digest mismatch: the records file has {size} bytes, "
                f"the manifest says {manifest.bytes}",
                part_path,
            )
        hasher = hashlib.sha256()
        count = size = 0
        kept: list[dict[str, Any]] = []
        # The first bad line is reported only once the whole file has been hashed: a file that
        # does not match its manifest is a digest mismatch, whatever its lines look like.
        problem: CheckpointError | None = None
        with os.fdopen(fd, "rb", buffering=_READ_CHUNK) as records:
            for line in records:
                hasher.update(line)
                count += 1
                size += len(line)
                if problem is None:
                    problem = _select_line(line, count, part_path, select, kept)
        if (hasher.hexdigest(), count, size) != (
            manifest.records_sha256,
            manifest.record_count,
            manifest.bytes,
        ):
            raise corrupt_checkpoint(
                "records digest mismatch: the records file does not match its manifest "
                f"(sha256 {hasher.hexdigest()}, {count} records, {size} bytes)",
                part_path,
            )
        if problem is not None:
            raise problem
        return kept


def _foreign_manifest(
    part_fd: int, part_path: str, manifest: StoredManifest, what: str
) -> CheckpointError:
    """A FIFO, a directory or a symlink holds the manifest's name: nothing can be published
    here and nothing names our records file, so it goes; the refusal is typed (reading the
    thing to compare it would have blocked on a FIFO)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(manifest.records_file, dir_fd=part_fd)
    return rejected_checkpoint(
        f"the participant directory holds a manifest.json that is {what}", path=part_path
    )


def _select_line(
    line: bytes,
    number: int,
    part_path: str,
    select: Callable[[dict[str, Any]], bool],
    kept: list[dict[str, Any]],
) -> CheckpointError | None:
    """Parse one line and keep it if selected; return the problem instead of raising it."""
    if not line.endswith(b"\n"):
        return corrupt_checkpoint(f"line {number} is torn", part_path)
    try:
        record = json.loads(line, parse_constant=_refuse_constant)
    except (ValueError, RecursionError):  # RecursionError: nesting deeper than the parser goes
        return corrupt_checkpoint(f"corrupt record at line {number}", part_path)
    if not isinstance(record, dict):
        return corrupt_checkpoint(f"record at line {number} is not an object", part_path)
    try:
        if select(record):
            kept.append(record)
    except CheckpointError as error:
        return error
    return None


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _manifest_from_json(fields: object) -> StoredManifest:
    if not isinstance(fields, dict):
        raise ValueError("manifest is not an object")
    expected = set(StoredManifest.__dataclass_fields__)
    if set(fields) != expected:
        raise ValueError("manifest fields differ from schema version 1")
    manifest = StoredManifest(**fields)
    ints = (manifest.schema_version, manifest.record_count, manifest.bytes)
    strs = (manifest.kind, manifest.instance, manifest.checkpoint_id, manifest.records_file)
    if any(type(v) is not int or v < 0 for v in ints) or any(type(v) is not str for v in strs):
        raise ValueError("manifest field of the wrong type")
    if manifest.schema_version != SCHEMA_VERSION:
        raise ValueError(f"unsupported schema version {manifest.schema_version}")
    match = RECORDS_NAME.match(manifest.records_file)
    if match is None or match.group(1) != manifest.records_sha256:
        raise ValueError("records_file must be records-<records_sha256>.jsonl")
    return manifest


def _check_names(kind: str, instance: str) -> None:
    """Kind and instance become path components: only plain names, never `..` or a slash."""
    for field, value in (("kind", kind), ("instance", instance)):
        if not is_valid_id(value) or value in (".", ".."):
            raise invalid_request(field, f"must match {ID_PATTERN.pattern}")


def _open_part_dir(checkpoint_dir: str, kind: str, instance: str, *, create: bool) -> int:
    """Open `participants/<kind>/<instance>` below the checkpoint directory, refusing symlinks.

    The checkpoint directory itself is created when missing (its parent must exist, so nothing
    outside it is ever created); each component below it is opened with O_NOFOLLOW.
    """
    _check_names(kind, instance)
    fd = _open_checkpoint_dir(checkpoint_dir, create=create)
    try:
        for component in ("participants", kind, instance):
            if create:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(component, 0o755, dir_fd=fd)
            fd = _descend(fd, component, f"participant subdirectory {component!r}")
        return fd
    except BaseException:
        os.close(fd)
        raise


def _open_checkpoint_dir(checkpoint_dir: str, *, create: bool) -> int:
    """Open the validated real path without resolving a name again.

    `validate_checkpoint_dir` checked the allowed roots against the real path once; opening
    that path by name afterwards would resolve it a second time, and a parent swapped for a
    symlink in between would put the part outside every root. So the path is walked from `/`,
    one component at a time, each opened relative to the previous descriptor with O_NOFOLLOW:
    a component that became a symlink is refused, never followed. Only the last component
    (the checkpoint directory itself) is created when missing.
    """
    components = _components(checkpoint_dir)
    fd = os.open("/", _DIR_FLAGS)
    try:
        for index, component in enumerate(components):
            if create and index == len(components) - 1:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(component, 0o755, dir_fd=fd)
            shown = "/" + "/".join(components[: index + 1])
            fd = _descend(fd, component, shown)
        return fd
    except BaseException:
        os.close(fd)
        raise


def _components(checkpoint_dir: str) -> list[str]:
    """The names of an absolute, normalized path (what `validate_checkpoint_dir` returns)."""
    if not os.path.isabs(checkpoint_dir) or os.path.normpath(checkpoint_dir) != checkpoint_dir:
        raise invalid_request("checkpoint_dir", "must be an absolute, normalized path")
    components = [c for c in checkpoint_dir.split("/") if c]
    if any(c in (".", "..") for c in components):
        raise invalid_request("checkpoint_dir", "must not contain a '.' or '..' component")
    return components


def _descend(parent_fd: int, name: str, shown: str) -> int:
    """Open directory `name` below `parent_fd` without following a symlink; on success the
    parent descriptor is closed and the child's returned (on failure the caller closes it)."""
    try:
        child = os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
    except OSError as exc:
        if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
            raise
        # Linux reports a symlink opened with O_NOFOLLOW | O_DIRECTORY as ELOOP or ENOTDIR:
        # lstat tells which it is (it never opens, so it cannot block either).
        try:
            is_link = stat.S_ISLNK(os.stat(name, dir_fd=parent_fd, follow_symlinks=False).st_mode)
        except OSError:
            is_link = exc.errno == errno.ELOOP
        what = "is a symlink (refused: nothing is followed)" if is_link else "is not a directory"
        raise invalid_request("checkpoint_dir", f"{shown} {what}") from exc
    os.close(parent_fd)
    return child


class _NotRegular(Exception):
    """A name that must be a regular file is something else: a FIFO, a directory, a device."""


def _open_regular(dir_fd: int, name: str, flags: int, mode: int = 0o644) -> int:
    """Open `name` below `dir_fd` without following a symlink and without ever blocking.

    O_NONBLOCK makes open() of a FIFO return at once instead of waiting for a writer; fstat
    then refuses anything but a regular file before a byte moves. For a regular file
    O_NONBLOCK means nothing, but it is cleared all the same so reads and writes are plain.
    """
    fd = os.open(name, flags | _FILE_FLAGS, mode, dir_fd=dir_fd)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise _NotRegular(name)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _write_file(dir_fd: int, name: str, data: bytes) -> None:
    fd = _open_regular(dir_fd, name, _CREATE_FLAGS)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)


def _read_file(dir_fd: int, name: str, limit: int) -> bytes:
    """The file's bytes, at most `limit + 1` of them (so a caller can tell "too large")."""
    fd = _open_regular(dir_fd, name, os.O_RDONLY)
    chunks: list[bytes] = []
    remaining = limit + 1
    try:
        while remaining > 0 and (chunk := os.read(fd, min(remaining, _READ_CHUNK))):
            chunks.append(chunk)
            remaining -= len(chunk)
    finally:
        os.close(fd)
    return b"".join(chunks)
