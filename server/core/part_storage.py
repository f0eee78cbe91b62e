"""One participant's part of a checkpoint: the one writer and the one reader of a part.

    <checkpoint_dir>/participants/<kind>/<instance>/records-<sha256>.jsonl
    <checkpoint_dir>/participants/<kind>/<instance>/manifest.json

The names and the manifest's schema are `layout`'s; the safe-open rules are `safe_files`'; the
one reader is `part_reader`'s. The participant runtime writes and restores parts with
`LocalStorage`; the controller's publication verifies them with the same reader, so the format
has one implementation.

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

Nothing a stopped, failed or killed writer leaves may linger, and no cleanup may take a file
a publication needs. Two writers of one part can produce the same records file name (same
content: a retry from a restarted process, a second commit job), so a writer that is stopped
after renaming its records into place cannot simply delete `records-<digest>.jsonl`: the
other may have renamed its identical file over it a moment earlier and be about to link a
manifest naming it, and the part would be published with its records file gone. Hence:

* Every writer takes an exclusive `flock` on the part directory around rename -> begin
  publishing -> link -> directory fsync, and around every cleanup. Under that lock no other
  writer is between its rename and its link, so a records file no manifest names is nobody's
  publication: a writer stopped or failed after its rename removes its records file under the
  lock, unless a manifest names it.
* Every writer holds a `flock` on its own temporary files (created under the part lock) for
  as long as it uses them; the kernel drops it when the writer dies. The next write of the
  part sweeps, under the part lock, every `.records-*.tmp` and `.manifest-*.tmp` whose lock
  it can take without waiting (its writer is gone: SIGKILL, a power loss) and every
  `records-*.jsonl` the manifest does not name. The file a manifest names is never removed.
* The part lock is polled, never waited for in a blocking `flock`, which has no timeout: a
  process that holds it and never lets go makes the commit fail (STORAGE_FAILED,
  retryable) after `lock_timeout` rather than wedging the thread, and a Resume ends the wait.

The lock only orders writers whose filesystem honours `flock` between them (local
filesystems do; Linux NFS clients emulate it with POSIX locks).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import secrets
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from rollout_checkpoint.server.core import layout, safe_files
from rollout_checkpoint.server.core.episodes import ID_PATTERN, is_valid_id
from rollout_checkpoint.server.core.errors import (
    CheckpointError,
    Reason,
    corrupt_checkpoint,
    invalid_request,
    rejected_checkpoint,
)
from rollout_checkpoint.server.core.layout import (
    COMPACT_CHAIN_SCHEMA_VERSION,
    MANIFEST_LIMIT,
    MANIFEST_NAME,
    REFERENCE_FIELD,
    SCHEMA_VERSION,
    PartChain,
    StoredManifest,
    load_json,
)
from rollout_checkpoint.server.core.object_store import is_object_url
from rollout_checkpoint.server.core.part_reader import read_manifest, scan_records
from rollout_checkpoint.server.core.part_references import (
    ReferenceReader,
    check_resolved,
    reader_for,
)


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
        chain: PartChain | None = None,
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


def strictly_below_allowed_root(path: str, allowed_roots: Sequence[str]) -> bool:
    """Whether the real path `path` lies strictly below an allowed directory root (any path
    when no roots are set): then its parent, where a chained part's sibling references
    resolve, is inside that root. A checkpoint at a root itself would send its references
    beside it, outside every allowed root. Blocks (realpath)."""
    if not allowed_roots:
        return True
    return any(
        _is_within(path, root) and path != os.path.realpath(root)
        for root in allowed_roots
        if not is_object_url(root)
    )


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
    """Parts on a local (or mounted) POSIX filesystem.

    `lock_timeout` bounds the wait for the part directory's lock: another writer holds it for
    a rename, a link and an fsync, so a wait that long means the holder is wedged or hostile,
    and the commit fails (retryably) instead of its thread waiting forever.
    """

    def __init__(
        self,
        crash_hook: CrashHook | None = None,
        lock_timeout: float = 60.0,
        allowed_roots: Sequence[str] = (),
    ) -> None:
        self._crash_hook = crash_hook
        self._lock_timeout = lock_timeout
        self._allowed_roots = tuple(allowed_roots)

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
        chain: PartChain | None = None,
    ) -> PublishedPart:
        """Write and publish this participant's part; blocks (run it in a thread).

        `checkpoint_dir` is the real path `validate_checkpoint_dir` returned. `fence` is
        checked between records and while waiting for the part lock; StopRequested means
        nothing was published and nothing of this write is left behind. `chain`: the part's
        lines include references to earlier parts (a version 2 manifest); each reference must
        name a sibling of `checkpoint_dir` (`check_chain`), checked before a byte is written.
        """
        part_path = layout.part_path(checkpoint_dir, kind, instance)
        check_chain(chain, checkpoint_dir, part_path)
        if chain is not None:
            if not strictly_below_allowed_root(checkpoint_dir, self._allowed_roots):
                raise references_outside_roots(part_path)
            _check_referenced(checkpoint_dir, kind, instance, chain)
        try:
            part_fd = _open_part_dir(checkpoint_dir, kind, instance, create=True)
        except OSError as exc:
            raise _storage_error(exc, part_path) from exc
        try:
            part = _Part(part_fd, part_path)
            header = ManifestHeader(kind, instance, checkpoint_id, chain)
            return self._write_in(part, header, lines, fence)
        except OSError as exc:
            raise _storage_error(exc, part_path) from exc
        finally:
            os.close(part_fd)

    def _write_in(
        self, part: _Part, header: ManifestHeader, lines: Iterable[bytes], fence: WriteFence
    ) -> PublishedPart:
        self._step("before_sweep")
        with self._locked(part, fence):
            _sweep(part.fd)
            records_tmp, tmp_fd = _create_temporary(part.fd, "records")
        try:
            digest, count, size = self._write_records(tmp_fd, lines, fence)
            manifest = header.manifest(digest, count, size)
            self._step("before_part_lock")
            with self._locked(part, fence):
                return self._publish(part, records_tmp, manifest, fence)
        finally:
            with contextlib.suppress(FileNotFoundError):  # gone once renamed
                os.unlink(records_tmp, dir_fd=part.fd)
            os.close(tmp_fd)  # releases its lock: only now may a sweep take what is left

    def _write_records(
        self, fd: int, lines: Iterable[bytes], fence: WriteFence
    ) -> tuple[str, int, int]:
        hasher = hashlib.sha256()
        count = size = 0
        # closefd=False: the descriptor carries the writer's lock on its temporary until the
        # write is over, not just until the records are on disk.
        with os.fdopen(fd, "wb", buffering=safe_files.READ_CHUNK, closefd=False) as out:
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
            os.fsync(fd)
            self._step("after_fsync")
        return hasher.hexdigest(), count, size

    def _publish(
        self, part: _Part, records_tmp: str, manifest: StoredManifest, fence: WriteFence
    ) -> PublishedPart:
        """Rename the records into place and link the manifest; under the part lock."""
        self._step("before_rename")
        os.rename(records_tmp, manifest.records_file, src_dir_fd=part.fd, dst_dir_fd=part.fd)
        try:
            self._step("after_rename")
            return self._link_manifest(part, manifest, fence)
        except BaseException:
            # Stopped, refused or failed: our records file goes unless a manifest names it
            # (an identical one published by another writer, or ours linked before an fsync
            # failed). Under the part lock no other writer is between its rename and its
            # link, so nothing can come to name it while we look.
            _discard_unnamed(part.fd, manifest.records_file)
            raise

    def _link_manifest(
        self, part: _Part, manifest: StoredManifest, fence: WriteFence
    ) -> PublishedPart:
        manifest_bytes = manifest.encode()
        manifest_tmp, tmp_fd = _create_temporary(part.fd, "manifest")
        try:
            safe_files.write_all(tmp_fd, manifest_bytes)
            self._step("before_publish")
            # From here on the publication is under way: a Resume's stop() learns so and waits
            # for it instead of stopping it, since a link cannot be withdrawn.
            fence.begin_publish()
            self._step("before_manifest_link")
            try:
                os.link(
                    manifest_tmp,
                    MANIFEST_NAME,
                    src_dir_fd=part.fd,
                    dst_dir_fd=part.fd,
                    follow_symlinks=False,
                )
            except FileExistsError:
                return self._settle_existing(part, manifest, manifest_bytes)
            self._step("after_manifest_link")
            os.unlink(manifest_tmp, dir_fd=part.fd)
            self._step("before_dir_fsync")
            os.fsync(part.fd)
            return PublishedPart(manifest, hashlib.sha256(manifest_bytes).hexdigest())
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(manifest_tmp, dir_fd=part.fd)
            os.close(tmp_fd)

    def _settle_existing(
        self, part: _Part, manifest: StoredManifest, manifest_bytes: bytes
    ) -> PublishedPart:
        """Another writer published first: identical means our retry is done; else refuse."""
        try:
            existing = safe_files.read_regular(part.fd, MANIFEST_NAME, MANIFEST_LIMIT)
        except safe_files.TooLarge:
            existing = b""  # larger than any manifest: not ours, so a different commit
        except safe_files.NotRegular as exc:
            raise _foreign_manifest(part.path, "not a regular file") from exc
        except OSError as exc:
            if exc.errno != errno.ELOOP:
                raise
            raise _foreign_manifest(part.path, "a symlink") from exc
        if existing == manifest_bytes:
            # The writer that linked it may have died (or failed its fsync) before the
            # directory fsync: make the part durable before this retry reports it published.
            os.fsync(part.fd)
            return PublishedPart(manifest, hashlib.sha256(existing).hexdigest())
        raise rejected_checkpoint(
            "the participant directory already holds a different commit", path=part.path
        )

    @contextlib.contextmanager
    def _locked(self, part: _Part, fence: WriteFence) -> Iterator[None]:
        """Hold the part directory's exclusive flock.

        Polled (LOCK_NB) rather than blocking: a blocking flock has no timeout, and a process
        that holds the lock and never lets go would wedge this thread for good. The fence is
        checked between attempts, so a Resume ends the wait at once.
        """
        deadline = time.monotonic() + self._lock_timeout
        delay = 0.001
        while True:
            try:
                fcntl.flock(part.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                fence.check()
                if time.monotonic() >= deadline:
                    raise CheckpointError(
                        Reason.STORAGE_FAILED,
                        "storage failed: the participant directory stayed locked by another "
                        f"writer for {self._lock_timeout:g} s",
                        code="UNAVAILABLE",
                        metadata={"path": part.path},
                    ) from None
                time.sleep(delay)
                delay = min(delay * 2, 0.05)
        try:
            yield
        finally:
            fcntl.flock(part.fd, fcntl.LOCK_UN)

    # -- read ----------------------------------------------------------------------------

    def read_part(
        self,
        checkpoint_dir: str,
        kind: str,
        instance: str,
        select: Callable[[dict[str, Any]], bool],
    ) -> tuple[StoredManifest, list[dict[str, Any]]]:
        part_path = layout.part_path(checkpoint_dir, kind, instance)
        try:
            part_fd = _open_part_dir(checkpoint_dir, kind, instance, create=False)
        except FileNotFoundError as exc:
            raise corrupt_checkpoint(
                "no part of this participant in the checkpoint", part_path
            ) from exc
        except OSError as exc:
            raise _storage_error(exc, part_path) from exc
        try:
            manifest = read_manifest(part_fd, part_path, kind, instance)
            if manifest.chain is not None:
                if not strictly_below_allowed_root(checkpoint_dir, self._allowed_roots):
                    raise unreadable_references(part_path)
                return manifest, _read_chained(checkpoint_dir, part_fd, part_path, manifest, select)
            kept: list[dict[str, Any]] = []

            def keep(record: dict[str, Any], number: int) -> None:
                if select(record):
                    kept.append(record)

            scan_records(part_fd, part_path, manifest, keep)
            return manifest, kept
        except OSError as exc:
            raise _storage_error(exc, part_path) from exc
        finally:
            os.close(part_fd)


def references_outside_roots(part_path: str) -> CheckpointError:
    """INVALID_REQUEST for a chained part written at an allowed root itself: its references
    would name checkpoints beside the root, outside every allowed root."""
    return invalid_request(
        "checkpoint_dir",
        f"{part_path}: a part at an allowed checkpoint root itself cannot reference earlier "
        "checkpoints: they would lie outside the allowed roots",
    )


def unreadable_references(part_path: str) -> CheckpointError:
    """DATA_LOSS for a chained part read at an allowed root itself: no reference of it can
    be read without leaving the allowed roots, so it is refused before any is."""
    return corrupt_checkpoint(
        "the part references checkpoints beside an allowed checkpoint root, outside the "
        "allowed roots",
        part_path,
    )


def check_chain(chain: PartChain | None, checkpoint_dir: str, part_path: str) -> None:
    """A chained part's references name siblings of its own checkpoint directory: one plain
    name each, never its own, never a path. Refused before anything is written, so a
    manifest that a reader would refuse is never published."""
    if chain is None:
        return
    own = os.path.basename(checkpoint_dir.rstrip("/"))
    for reference in chain.references:
        if not layout.is_reference_name(reference.checkpoint) or reference.checkpoint == own:
            raise invalid_request(
                "checkpoint_dir",
                f"{part_path}: a reference may name only a sibling checkpoint directory, "
                f"not {reference.checkpoint!r}",
            )


def _check_referenced(checkpoint_dir: str, kind: str, instance: str, chain: PartChain) -> None:
    """Every file a chained part references is there: a published part of this kind and
    instance names it, with its size. Checked before a byte is written, so a part whose
    references were deleted meanwhile (an operator, a retention that did not know them) is
    refused (DATA_LOSS naming the file) instead of published and found unrestorable later."""
    root, own = os.path.split(checkpoint_dir.rstrip("/"))
    try:
        root_fd = _open_checkpoint_dir(root or "/", create=False)
    except OSError as exc:
        raise _storage_error(exc, root) from exc
    reader = ReferenceReader(root_fd, root, own, kind, instance, chain.references)
    try:
        reader.check_files()
    except OSError as exc:
        raise _storage_error(exc, root) from exc
    finally:
        reader.close()
        os.close(root_fd)


def _read_chained(
    checkpoint_dir: str,
    part_fd: int,
    part_path: str,
    manifest: StoredManifest,
    select: Callable[[dict[str, Any]], bool],
) -> list[dict[str, Any]]:
    """The selected records of a chained part: each reference line replaced by the record it
    points at in an earlier part (`part_references`), read below the same root."""
    root, own = os.path.split(checkpoint_dir.rstrip("/"))
    root_fd = _open_checkpoint_dir(root or "/", create=False)
    reader = reader_for(root_fd, root, own, manifest)
    kept: list[dict[str, Any]] = []

    def keep(record: dict[str, Any], number: int) -> None:
        if REFERENCE_FIELD in record:
            record = reader.resolve(record)
        if select(record):
            kept.append(record)

    try:
        scan_records(part_fd, part_path, manifest, keep)
        check_resolved(reader.resolved, manifest, part_path)
    finally:
        reader.close()
        os.close(root_fd)
    return kept


@dataclass(frozen=True, slots=True)
class ManifestHeader:
    """What a part's manifest says besides its records file's digest, count and size."""

    kind: str
    instance: str
    checkpoint_id: str
    chain: PartChain | None

    def manifest(self, digest: str, count: int, size: int) -> StoredManifest:
        """The manifest of the records just written; a chain whose counts do not add up to
        what was written is a bug of the caller and publishes nothing."""
        chain = self.chain
        if chain is not None and chain.own_records + chain.referenced_records != count:
            raise ValueError(
                f"the chain counts {chain.own_records} + {chain.referenced_records} records, "
                f"{count} were written"
            )
        return StoredManifest(
            SCHEMA_VERSION if chain is None else COMPACT_CHAIN_SCHEMA_VERSION,
            self.kind,
            self.instance,
            self.checkpoint_id,
            layout.records_name(digest),
            digest,
            count,
            size,
            chain,
        )


def _foreign_manifest(part_path: str, what: str) -> CheckpointError:
    """A FIFO, a directory or a symlink holds the manifest's name: nothing can be published
    here. The refusal is typed; reading the thing to compare it would block on a FIFO."""
    return rejected_checkpoint(
        f"the participant directory holds a manifest.json that is {what}", path=part_path
    )


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
    ckpt_fd = _open_checkpoint_dir(checkpoint_dir, create=create)
    with safe_files.closing(ckpt_fd):
        return safe_files.walk(
            ckpt_fd,
            layout.part_components(kind, instance),
            create=lambda index: create,
            refused=lambda exc, parent, index, name: _refused_component(
                exc, parent, name, f"participant subdirectory {name!r}"
            ),
        )


def _open_checkpoint_dir(checkpoint_dir: str, *, create: bool) -> int:
    """Open the validated real path without resolving a name again.

    `validate_checkpoint_dir` checked the allowed roots against the real path once; opening
    that path by name afterwards would resolve it a second time, and a parent swapped for a
    symlink in between would put the part outside every root. So the path is walked from `/`,
    one component at a time, each opened relative to the previous descriptor with O_NOFOLLOW:
    a component that became a symlink is refused, never followed. Only the last component
    (the checkpoint directory itself) is created when missing.
    """
    try:
        components = safe_files.components_of(checkpoint_dir)
    except ValueError as exc:
        raise invalid_request("checkpoint_dir", str(exc)) from exc
    root_fd = safe_files.open_root()
    with safe_files.closing(root_fd):
        return safe_files.walk(
            root_fd,
            components,
            create=lambda index: create and index == len(components) - 1,
            refused=lambda exc, parent, index, name: _refused_component(
                exc, parent, name, "/" + "/".join(components[: index + 1])
            ),
        )


def _refused_component(exc: OSError, parent_fd: int, name: str, shown: str) -> Exception | None:
    what = safe_files.symlink_or_not_directory(exc, parent_fd, name)
    if what is None:
        return None
    if what == "symlink":
        return invalid_request(
            "checkpoint_dir", f"{shown} is a symlink (refused: nothing is followed)"
        )
    return invalid_request("checkpoint_dir", f"{shown} is not a directory")


@dataclass(frozen=True, slots=True)
class _Part:
    """The open part directory (its descriptor carries the part lock) and its path for errors."""

    fd: int
    path: str


def _create_temporary(part_fd: int, kind: str) -> tuple[str, int]:
    """Create and lock a fresh temporary; call it under the part lock.

    The lock, held until the writer is done with the file, is what tells a sweep that the
    file's writer is alive. Taking it under the part lock, which every sweep holds, leaves no
    moment in which a sweep could find the file unlocked and take a live writer's file.
    """
    name = layout.part_temporary_name(kind, secrets.token_hex(8))
    fd = safe_files.open_regular(part_fd, name, safe_files.CREATE_FLAGS)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # new: no one else can hold it
    except BaseException:
        os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=part_fd)
        raise
    return name, fd


class _Unknown:
    """The manifest could not be read (an I/O error): which records file it names is unknown."""


_UNKNOWN = _Unknown()


def _named_records(part_fd: int) -> str | _Unknown | None:
    """The records file the part's manifest names; None when no manifest names any.

    A FIFO, a directory or a symlink under the manifest's name is no manifest, and a file that
    does not parse as one (planted garbage, larger than any manifest) names nothing either: no
    reader would ever follow it to a records file. Only a read that fails leaves it UNKNOWN,
    and the callers then remove no records file at all rather than guess.
    """
    try:
        raw = safe_files.read_regular(part_fd, MANIFEST_NAME, MANIFEST_LIMIT)
    except (FileNotFoundError, safe_files.NotRegular, safe_files.TooLarge):
        return None
    except OSError as exc:
        return None if exc.errno == errno.ELOOP else _UNKNOWN
    try:
        named = load_json(raw).get("records_file")
    except (ValueError, AttributeError, RecursionError):
        return None
    return named if isinstance(named, str) else None


def _unnamed(records_file: str, named: str | _Unknown | None) -> bool:
    """Whether it is known that no manifest names `records_file`."""
    return named is None or (isinstance(named, str) and named != records_file)


def _discard_unnamed(part_fd: int, records_file: str) -> None:
    """Remove `records_file` unless a manifest names it; under the part lock, best effort
    (a file left here is swept by the next write)."""
    with contextlib.suppress(OSError):
        if _unnamed(records_file, _named_records(part_fd)):
            os.unlink(records_file, dir_fd=part_fd)


def _sweep(part_fd: int) -> None:
    """Remove what dead and stopped writers left; under the part lock, best effort.

    A temporary goes when its lock can be taken (its writer is gone: the kernel released the
    lock when the process died). A records file goes when the manifest does not name it:
    every writer renames its records and links its manifest under the part lock, which we
    hold, so such a file is no live writer's.
    """
    named = _named_records(part_fd)
    for name in os.listdir(part_fd):
        if layout.PART_TEMPORARY_NAME.match(name):
            _sweep_temporary(part_fd, name)
        elif layout.RECORDS_NAME.match(name) and _unnamed(name, named):
            with contextlib.suppress(OSError):
                os.unlink(name, dir_fd=part_fd)


def _sweep_temporary(part_fd: int, name: str) -> None:
    try:
        fd = safe_files.open_regular(part_fd, name)
    except (OSError, safe_files.NotRegular):
        return  # gone, or no writer's file (a symlink, a FIFO): not ours to judge
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return  # its writer is alive (BlockingIOError) or the lock is unavailable
    else:
        with contextlib.suppress(OSError):
            os.unlink(name, dir_fd=part_fd)
    finally:
        os.close(fd)
