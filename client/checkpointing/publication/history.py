"""The checkpoint history of a root: one compact record per checkpoint or restore attempted.

    <root>/.history.json                      {"format": 1, "entries": [...]}, oldest first
    <root>/.history-<entry id>.<8 hex>.json   one attempt's per-member details

It lives in the checkpoint root itself (a directory or an object-store URL), so it survives a
coordinator restart and any coordinator of that root, or `rollout-checkpoint history`, reads
it without the coordinator that wrote it. Its names start with a dot, which no checkpoint id
may (`episodes.ID_PATTERN`), and retention only ever looks at names that are ids; they are
files, not directories, so nothing that looks for checkpoint directories in a root sees them.

Why two levels: the index is what a list reads (10,000 entries must page in milliseconds), so
it never carries per-member details, which for a 1,000-member fleet are a hundred times an
entry's size; those go into one details object per attempt, read only for that attempt, and
only the newest `DETAILS_KEPT` attempts keep theirs (older entries stay, without details).

The rules, each for a failure:

* **Bounded**: the index is kept under `max_bytes` (`DEFAULT_HISTORY_BYTES`) by dropping the
  oldest entries, so a coordinator that checkpoints every minute for a year neither fills
  the root nor slows its own writes.
* **Atomic**: locally the details, then the index, are each a temp file, fsynced, renamed
  over the name, then the root fsynced (like `LATEST`): a crash leaves the old index or the
  new one, never a torn one. On an object store each is a single PUT.
* **Two writers do not lose each other's entries**: locally the read-modify-write holds an
  exclusive `flock` on the root directory; on an object store the index is replaced by
  compare-and-swap on its ETag and a writer that lost re-reads and appends again
  (`_INDEX_SWAPS` times, then `StorageFailed`: that record is lost, logged, and counted).
* **A corrupt index never stops a checkpoint**: a reader gets the problem (`HistoryRead`)
  and no entries; the next write keeps the bad bytes aside (`.history.corrupt.json`) and
  starts a fresh index. An index of a newer `format` is never overwritten (that would
  destroy what a newer coordinator wrote): this version reports it and does not record.

Everything here blocks: run it through `store_call` from asyncio code.
"""

from __future__ import annotations

import contextlib
import enum
import fcntl
import functools
import json
import os
import re
import secrets
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path
from typing import Any, Protocol

from rollout_checkpoint.client.checkpointing.publication.errors import (
    PublicationError,
    StorageFailed,
)
from rollout_checkpoint.client.checkpointing.publication.files import replace_atomically
from rollout_checkpoint.server.core import safe_files
from rollout_checkpoint.server.core.object_store import (
    ObjectLocation,
    ObjectStoreClient,
    ObjectStoreFailure,
    StoredObject,
    client_for,
    is_object_url,
    parse_object_url,
)

INDEX_NAME = ".history.json"
CORRUPT_INDEX_NAME = ".history.corrupt.json"
DETAILS_KEPT = 100
"""How many of the newest attempts keep their per-member details (a root holds at most this
many details objects)."""
FORMAT = 1
"""The version of the index and details encoding. Fields added later do not change it (a
reader ignores fields it does not know); a change an older reader would misread does."""
DEFAULT_HISTORY_BYTES = 5 << 20
"""The index's cap: about 9,000 entries of a 1,000-member fleet's checkpoints (about 600
bytes each)."""
READ_LIMIT = 64 << 20
"""The largest index or details object read: anything larger is reported as corrupt."""
_INDEX_SWAPS = 16
DETAILS_NAME = re.compile(r"\.history-[A-Za-z0-9][A-Za-z0-9._-]*\.[0-9a-f]{8}\.json")
"""A details object's name: one name below the root (no `/`), never a checkpoint id."""


class Trigger(enum.StrEnum):
    """What started an attempt."""

    MANUAL = "manual"
    """An operator or a controller asked (CLI, the Checkpoint and Restore RPCs, collect's
    resume)."""
    PERIODIC = "periodic"
    """A schedule: the supervisor's period, `collect --checkpoint-every`."""
    SIGNAL = "signal"
    """A stop: `collect` checkpointing on SIGTERM or SIGINT."""
    SUPERVISOR = "supervisor"
    """An automatic recovery (the supervisor's, `collect`'s after a member loss)."""


class Status(enum.StrEnum):
    """How an attempt ended."""

    COMPLETED = "completed"
    """Published (a checkpoint) or restored and resumed (a restore)."""
    FAILED = "failed"
    """An error ended it (`reason`, `failed_members`); nothing was published."""
    ABORTED = "aborted"
    """It stopped without an error of its own: not prepared by the deadline, or interrupted;
    the fleet was resumed."""


@dataclass(frozen=True)
class StageTiming:
    """One step of an attempt and how long it took. An attempt's stages follow each other
    without a gap from its `started_at`, so each one's start is the sum of those before it
    (not stored: it would double an entry's size)."""

    stage: str
    seconds: float


@dataclass(frozen=True)
class HistoryEntry:
    """One attempt, as a list shows it (never per-member details: `details` names them)."""

    id: str
    """The checkpoint's id, or the restore's control id."""
    operation: str
    """`checkpoint` or `restore`."""
    trigger: str
    """`Trigger`."""
    mode: str
    """`sync` or `async` (checkpoints); `rejoin` or `fresh` (restores)."""
    status: str
    """`Status`."""
    started_at: str
    ended_at: str
    duration_seconds: float
    reason: str = ""
    """The typed reason of a failure (`Reason`, or NOT_PREPARED, ENDED, INTERRUPTED)."""
    message: str = ""
    """The failure's one line (at most `MESSAGE_LIMIT` characters)."""
    failed_members: tuple[str, ...] = ()
    """The members that caused the failure."""
    stages: tuple[StageTiming, ...] = ()
    members: int = 0
    records: int = 0
    bytes: int = 0
    source: str = ""
    """Restores: the published checkpoint restored."""
    continued: int = 0
    """Episodes continued (checkpoints: published as continued; restores: restored)."""
    restarted: int = 0
    """Restores by recovery: rollouts in flight that restart from their inputs."""
    details: str = ""
    """The name of its details object in the root ("" when it has none, or no longer)."""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, value: object) -> HistoryEntry:
        """Strict on the fields this version knows (ValueError), ignoring newer ones."""
        known = checked_entry(value)
        known["failed_members"] = tuple(known.get("failed_members", ()))
        known["stages"] = tuple(StageTiming(**s) for s in known.get("stages", ()))
        return cls(**known)


@dataclass(frozen=True)
class MemberRecord:
    """One member's part in one attempt (the details object)."""

    name: str
    kind: str
    instance: str
    part: str = ""
    """Where its part is (checkpoints)."""
    records: int = 0
    bytes: int = 0
    prepared_seconds: float | None = None
    """From the prepare's start until it reported PREPARED (None: it never did)."""
    blockers_max: int = 0
    """The most blockers it reported at once while preparing."""
    blocked_seconds: float = 0.0
    """How long it reported blockers: from the first report until it prepared."""
    error: str = ""
    """Its typed reason when it caused the failure."""
    commit_seconds: float | None = None
    """From the commit call to its reply (checkpoints; None: it never replied)."""
    durable_seconds: float | None = None
    """From the commit call until its part was durable (asynchronous commits; None: not
    asynchronous, or it never became durable)."""
    restore_seconds: float | None = None
    """From the restore call to its reply (restores; None: it never replied)."""

    def to_json(self) -> dict[str, Any]:
        # Every field is a scalar, so a copy of the fields is the JSON object: `asdict`'s
        # deep copy took 15 ms of a 1,000-member checkpoint's record.
        return dict(vars(self))

    @classmethod
    def from_json(cls, value: object) -> MemberRecord:
        return cls(**_checked_fields(cls, value))


MESSAGE_LIMIT = 500


@dataclass(frozen=True)
class HistoryRead:
    """What a read found: the entries, oldest first, or the problem that made it skip them."""

    entries: tuple[HistoryEntry, ...]
    problem: str | None = None


class HistoryNewer(PublicationError):
    """The index is of a format this version does not know: it is neither read nor replaced."""


Decoder = Callable[[bytes], tuple[HistoryEntry, ...]]
"""Decodes an index (`decode_index`'s contract: ValueError or `HistoryNewer` when it cannot)."""


class History(Protocol):
    """A root's history (`open_history`)."""

    location: str

    def append(
        self,
        entry: HistoryEntry,
        members: Sequence[MemberRecord],
        *,
        max_bytes: int = DEFAULT_HISTORY_BYTES,
    ) -> None:
        """Add `entry` (and its members' details) and drop the oldest entries beyond
        `max_bytes`. Raises `StorageFailed` (or OSError) when the store fails."""
        ...

    def read(self, decode: Decoder = ...) -> HistoryRead:
        """Every entry, oldest first; a corrupt or newer index is a `problem`, never raised.
        Raises `StorageFailed` (or OSError) when the store fails. `decode` (default
        `decode_index`) lets a reader that keeps what it decoded before reuse it."""
        ...

    def members(self, entry: HistoryEntry) -> tuple[MemberRecord, ...]:
        """The per-member details of `entry` (empty when it has none); ValueError when they
        do not decode."""
        ...


def open_history(location: str | os.PathLike[str]) -> History:
    """The history of the checkpoint root at `location` (a path or an object-store URL).
    Nothing is created until the first `append`."""
    text = os.fspath(location)
    if is_object_url(text):
        return ObjectHistory(parse_object_url(text))
    return LocalHistory(Path(text))


# -- encoding ------------------------------------------------------------------------------


def decode_index(raw: bytes) -> tuple[HistoryEntry, ...]:
    """The entries of an index (ValueError when it is not one; `HistoryNewer` when it is of
    a newer format)."""
    return tuple(HistoryEntry.from_json(e) for e in _index_items(raw))


def _index_items(raw: bytes) -> list[Any]:
    return _checked_document(parsed_json(raw), "entries")


def parsed_json(raw: bytes) -> Any:
    """`raw` parsed, ValueError when it is not JSON. RecursionError (JSON nested deeper than
    the interpreter recurses, e.g. 100,000 `[`) is a ValueError too: it is neither a
    ValueError nor a TypeError, so it escaped every reader's "corrupt" path, failed the API
    with INTERNAL and the CLI with a traceback, and kept every later append from setting the
    index aside, so nothing was recorded again."""
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise ValueError(f"not JSON: {type(exc).__name__}: {str(exc)[:200]}") from None


def encode_index(lines: Sequence[bytes]) -> bytes:
    """One entry per line, so an entry's share of the cap is its line's length."""
    return b'{"format": %d, "entries": [\n' % FORMAT + b",\n".join(lines) + b"\n]}\n"


def _encode(fields: dict[str, Any]) -> bytes:
    return json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()


def appended(
    raw: bytes | None, entry: HistoryEntry, max_bytes: int
) -> tuple[bytes, tuple[str, ...], bool]:
    """The index `raw` (None: none yet) with `entry` added and the oldest entries dropped
    beyond `max_bytes`: (the new index, the details of the dropped entries, whether `raw`
    was corrupt and is replaced). `HistoryNewer` for an index of a newer format."""
    corrupt = False
    kept: list[dict[str, Any]] = []
    lines: list[bytes] = []
    if raw is not None:
        try:
            kept = _LAST_WRITTEN.entries(raw)
            lines = _lines_of(raw, len(kept)) or [_encode(e) for e in kept]
        except HistoryNewer:
            raise
        except (ValueError, TypeError):
            corrupt, kept, lines = True, [], []
    kept.append(entry.to_json())
    lines.append(_encode(kept[-1]))
    dropped = []
    for index in range(max(0, len(kept) - DETAILS_KEPT)):
        if kept[index].get("details"):
            dropped.append(kept[index]["details"])
            kept[index] = {**kept[index], "details": ""}
            lines[index] = _encode(kept[index])
    size = len(encode_index([])) + sum(len(line) + 2 for line in lines)
    start = 0
    while size > max_bytes and start < len(kept) - 1:
        size -= len(lines[start]) + 2
        if kept[start].get("details"):
            dropped.append(kept[start]["details"])
        start += 1
    encoded = encode_index(lines[start:])
    _LAST_WRITTEN.remember(encoded, kept[start:])
    return encoded, tuple(dropped), corrupt


class _LastWritten:
    """The entries of the last index this process wrote, checked, by its bytes: the next
    write of a coordinator (which is the one that wrote the index, as a rule) reuses them
    instead of checking thousands of entries again (a fifth of a second at 9,000). Any other
    bytes (another writer's, a hand-edited file) are checked in full."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._index = b""
        self._entries: list[dict[str, Any]] = []

    def entries(self, raw: bytes) -> list[dict[str, Any]]:
        """The checked entries of `raw` (a new list; the entries are never changed in place)."""
        with self._lock:
            if raw == self._index:
                return list(self._entries)
        return [checked_entry(e) for e in _index_items(raw)]

    def remember(self, index: bytes, entries: list[dict[str, Any]]) -> None:
        with self._lock:
            self._index, self._entries = index, list(entries)


_LAST_WRITTEN = _LastWritten()


def _lines_of(raw: bytes, count: int) -> list[bytes] | None:
    """`index_lines` of an index of `count` entries: kept byte for byte, so a write encodes
    only what it adds or changes."""
    lines = index_lines(raw)
    return lines if lines is not None and len(lines) == count else None


def index_lines(raw: bytes) -> list[bytes] | None:
    """The entries' lines of an index in `encode_index`'s layout, each one entry's JSON
    (None for another layout). Compact JSON escapes every newline inside a string, so `,\n`
    only ever separates entries; the head names this `FORMAT`."""
    head, tail = encode_index([]).split(b"\n\n")
    if not (raw.startswith(head + b"\n") and raw.endswith(b"\n" + tail)):
        return None
    body = raw[len(head) + 1 : len(raw) - len(tail) - 1]
    return body.split(b",\n") if body else []


def encode_details(entry: HistoryEntry, members: Sequence[MemberRecord]) -> bytes:
    document = {"format": FORMAT, "id": entry.id, "members": [m.to_json() for m in members]}
    return json.dumps(document, sort_keys=True, separators=(",", ":")).encode()


def decode_details(raw: bytes) -> tuple[MemberRecord, ...]:
    document = parsed_json(raw)
    return tuple(MemberRecord.from_json(m) for m in _checked_document(document, "members"))


def details_name(entry_id: str) -> str:
    """A details object's name: the entry's id (a retried id gets a fresh token).
    ValueError for an id that is not a checkpoint id (it could name a path)."""
    name = f".history-{entry_id}.{secrets.token_hex(4)}.json"
    if not DETAILS_NAME.fullmatch(name):
        raise ValueError(f"not a checkpoint id: {entry_id!r}")
    return name


def _checked_document(document: object, key: str) -> list[Any]:
    if not isinstance(document, dict):
        raise ValueError("not a JSON object")
    version = document.get("format")
    if type(version) is not int:
        raise ValueError("no format version")
    if version != FORMAT:
        raise HistoryNewer(
            f"history format {version} is not the one this version reads ({FORMAT}): "
            "upgrade rollout-checkpoint to read it"
        )
    items = document.get(key)
    if not isinstance(items, list):
        raise ValueError(f"{key} is not a list")
    return items


def checked_entry(value: object) -> dict[str, Any]:
    """The fields this version knows of an entry's JSON object, each of its type (ValueError
    otherwise). Checks without building anything: a write checks every entry of an index."""
    known = _checked_fields(HistoryEntry, value)
    _strings(known.get("failed_members", []), "failed_members")
    stages = known.get("stages", [])
    if not isinstance(stages, list):
        raise ValueError("stages is not a list")
    known["stages"] = [_checked_fields(StageTiming, stage) for stage in stages]
    details = known.get("details", "")
    if details and not DETAILS_NAME.fullmatch(details):
        # Never a path: a hand-edited index must not make a write unlink, or a read open,
        # anything but a details file of this root.
        raise ValueError(f"details {details[:80]!r} is not a details object's name")
    return known


_TYPES: dict[str, tuple[type, ...]] = {
    "str": (str,),
    "int": (int,),
    "float": (int, float),
    "float | None": (int, float, type(None)),
}


def _checked_fields(cls: type, value: object) -> dict[str, Any]:
    """The fields of `cls` in the JSON object `value`: every required one present, each
    scalar of its declared type, fields this version does not know left out."""
    if not isinstance(value, dict):
        raise ValueError(f"a {cls.__name__} is not a JSON object")
    known = {}
    for name, expected, required in _field_types(cls):
        if name not in value:
            if required:
                raise ValueError(f"a {cls.__name__} has no {name}")
            continue
        actual = value[name]
        if expected is not None and (not isinstance(actual, expected) or isinstance(actual, bool)):
            raise ValueError(f"{name} is not a {' or '.join(t.__name__ for t in expected)}")
        if expected is not None and actual is not None:
            _check_range(name, expected, actual)
        known[name] = actual
    return known


_UINT32_FIELDS = frozenset({"members", "blockers_max"})
"""The integer fields whose wire field is a uint32; every other one is a uint64."""


def _check_range(name: str, expected: tuple[type, ...], value: Any) -> None:
    """An integer must fit its proto field (`Attempt`, `AttemptMember`: uint32 or uint64)
    and a number must be a finite double (JSON's 1e400 parses as infinity, NaN compares
    false; Python compares an int with a float exactly). Before, `"members": -1`
    or `"bytes": 2**70` passed the type check and made building the wire message raise
    ValueError: every page holding the entry failed with INTERNAL."""
    if expected == (int,):
        bits = 32 if name in _UINT32_FIELDS else 64
        if not 0 <= value < 1 << bits:
            raise ValueError(f"{name} {value} is not a uint{bits}")
    elif float in expected and not -sys.float_info.max <= value <= sys.float_info.max:
        raise ValueError(f"{name} is not a finite number")


@functools.cache
def _field_types(cls: type) -> tuple[tuple[str, tuple[type, ...] | None, bool], ...]:
    """Each field's name, the JSON types its scalar value may have (None: not a scalar) and
    whether it is required, computed once per class."""
    return tuple(
        (f.name, _TYPES.get(str(f.type)), f.default is MISSING and f.default_factory is MISSING)
        for f in fields(cls)
    )


def _strings(value: object, name: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{name} is not a list of strings")
    return tuple(value)


def _read_result(raw: bytes | None, where: str, decode: Decoder) -> HistoryRead:
    if raw is None:
        return HistoryRead(())
    try:
        return HistoryRead(decode(raw))
    except (ValueError, TypeError, HistoryNewer) as exc:
        return HistoryRead((), f"{where}: history skipped: {exc}")


# -- local ---------------------------------------------------------------------------------


class LocalHistory:
    """The history in a local checkpoint root."""

    def __init__(self, root: Path) -> None:
        self.root = root.absolute()
        self.location = str(self.root / INDEX_NAME)

    def append(
        self,
        entry: HistoryEntry,
        members: Sequence[MemberRecord],
        *,
        max_bytes: int = DEFAULT_HISTORY_BYTES,
    ) -> None:
        """The index is read and checked before the details file is written, and the
        details file is removed when the index is not written after all: before, a details
        file written first and then refused (a newer-format index, a corrupt one that could
        not be replaced) was referenced by no index and deleted by no one, one more per
        attempt."""
        with safe_files.opened(self.root, safe_files.DIR_FLAGS) as root_fd:
            fcntl.flock(root_fd, fcntl.LOCK_EX)  # released when root_fd closes
            raw = _index_for_append(root_fd)
            index, dropped, corrupt = appended(raw, entry, max_bytes)
            with _removed_on_failure(root_fd, entry.details if members else None):
                if members:
                    _replace_file(root_fd, entry.details, encode_details(entry, members))
                if corrupt and raw is not None:
                    _replace_file(root_fd, CORRUPT_INDEX_NAME, raw)
                _replace_file(root_fd, INDEX_NAME, index)
            for name in dropped:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(name, dir_fd=root_fd)

    def read(self, decode: Decoder = decode_index) -> HistoryRead:
        try:
            with safe_files.opened(self.root, safe_files.DIR_FLAGS) as root_fd:
                raw = _read_optional(root_fd, INDEX_NAME)
        except FileNotFoundError:
            return HistoryRead(())
        except StorageFailed as exc:
            return HistoryRead((), f"{self.location}: history skipped: {exc}")
        return _read_result(raw, self.location, decode)

    def members(self, entry: HistoryEntry) -> tuple[MemberRecord, ...]:
        """ValueError when the details file is missing, not a regular file, too large or
        not details: a details problem beside the entry (as on an object store), never a
        storage failure of the whole call. Only the root itself failing raises OSError."""
        if not entry.details:
            return ()
        with safe_files.opened(self.root, safe_files.DIR_FLAGS) as root_fd:
            try:
                raw = safe_files.read_regular(root_fd, entry.details, READ_LIMIT)
            except FileNotFoundError:
                raise ValueError("missing") from None
            except safe_files.NotRegular:
                raise ValueError("not a regular file") from None
            except safe_files.TooLarge as exc:
                raise ValueError(str(exc)) from None
        return decode_details(raw)


def _index_for_append(root_fd: int) -> bytes | None:
    """The index's bytes for an append (None: none, or set aside unread). An index larger
    than `READ_LIMIT` is renamed aside as `CORRUPT_INDEX_NAME` without reading it, as a
    corrupt one is copied aside: before, it made every append raise StorageFailed, so
    nothing was recorded again. One that is not a regular file (nothing this module writes:
    an operator's doing) is a StorageFailed, left as it is."""
    try:
        return _read_optional(root_fd, INDEX_NAME)
    except _TooLarge:
        try:
            os.rename(INDEX_NAME, CORRUPT_INDEX_NAME, src_dir_fd=root_fd, dst_dir_fd=root_fd)
        except OSError as exc:
            raise StorageFailed(f"{INDEX_NAME} could not be set aside: {exc}") from None
        return None


@contextlib.contextmanager
def _removed_on_failure(root_fd: int, details: str | None) -> Iterator[None]:
    """Remove the details file `details` when the block fails: no index names it then."""
    try:
        yield
    except BaseException:
        if details:
            with contextlib.suppress(OSError):
                os.unlink(details, dir_fd=root_fd)
        raise


def _read_optional(dir_fd: int, name: str) -> bytes | None:
    """The file's bytes, None when it is not there; `StorageFailed` when it is something
    else than a regular file or larger than `READ_LIMIT` (nothing this module wrote)."""
    try:
        return safe_files.read_regular(dir_fd, name, READ_LIMIT)
    except FileNotFoundError:
        return None
    except safe_files.NotRegular:
        raise StorageFailed(f"{name} is not a regular file") from None
    except safe_files.TooLarge as exc:
        raise _TooLarge(str(exc)) from None


class _TooLarge(StorageFailed):
    """A file larger than `READ_LIMIT`: a storage failure to a reader, set aside by an
    append (`_index_for_append`)."""


def _replace_file(dir_fd: int, name: str, data: bytes) -> None:
    """Replace `name` atomically (like LATEST: `files.replace_atomically`)."""
    replace_atomically(dir_fd, name, f".{name}.{secrets.token_hex(8)}.tmp", data)


# -- object store --------------------------------------------------------------------------


class ObjectHistory:
    """The history below an object-store checkpoint root."""

    def __init__(self, root: ObjectLocation) -> None:
        self.directory = root
        self.location = root.child(INDEX_NAME).url

    def append(
        self,
        entry: HistoryEntry,
        members: Sequence[MemberRecord],
        *,
        max_bytes: int = DEFAULT_HISTORY_BYTES,
    ) -> None:
        """As `LocalHistory.append`: the details object is written once the index has been
        read and checked, and deleted again when no swap of the index lands."""
        client = self._client()
        details = self.directory.key(entry.details) if members else None
        written = False
        with _store_failures(), self._deleted_on_failure(client, details):
            key = self.directory.key(INDEX_NAME)
            for _ in range(_INDEX_SWAPS):
                current, raw = self._index_for_append(client, key)
                index, dropped, corrupt = appended(raw, entry, max_bytes)
                if details is not None and not written:
                    data = encode_details(entry, members)
                    client.put(details, data, size=len(data))
                    written = True
                if corrupt and raw is not None:
                    aside = self.directory.key(CORRUPT_INDEX_NAME)
                    client.put(aside, raw, size=len(raw))
                if client.swap(key, index, current):
                    if dropped:
                        client.delete([self.directory.key(name) for name in dropped])
                    return
            raise StorageFailed(
                f"{self.location}: the index kept changing under {_INDEX_SWAPS} swaps"
            )

    def _index_for_append(
        self, client: ObjectStoreClient, key: str
    ) -> tuple[StoredObject | None, bytes | None]:
        """The index for an append. One larger than `READ_LIMIT` is copied aside as
        `CORRUPT_INDEX_NAME` (a server-side copy: never read) and stands as an empty index whose
        swap names the version copied: before, it made every append fail for good."""
        try:
            current = client.get(key, limit=READ_LIMIT)
        except ValueError:
            tag = client.tag(key)
            if tag is None:
                return None, None
            client.copy(key, self.directory.key(CORRUPT_INDEX_NAME))
            return StoredObject(b"", tag, None), None
        return current, None if current is None else current.data

    @contextlib.contextmanager
    def _deleted_on_failure(self, client: ObjectStoreClient, details: str | None) -> Iterator[None]:
        try:
            yield
        except BaseException:
            if details is not None:
                with contextlib.suppress(ObjectStoreFailure):
                    client.delete([details])
            raise

    def read(self, decode: Decoder = decode_index) -> HistoryRead:
        try:
            with _store_failures():
                stored = self._client().get(self.directory.key(INDEX_NAME), limit=READ_LIMIT)
        except ValueError as exc:  # larger than READ_LIMIT
            return HistoryRead((), f"{self.location}: history skipped: {exc}")
        return _read_result(None if stored is None else stored.data, self.location, decode)

    def members(self, entry: HistoryEntry) -> tuple[MemberRecord, ...]:
        if not entry.details:
            return ()
        with _store_failures():
            stored = self._client().get(self.directory.key(entry.details), limit=READ_LIMIT)
        if stored is None:
            raise ValueError(f"{self.directory.url}/{entry.details}: missing")
        return decode_details(stored.data)

    def tag_of(self, name: str) -> str | None:
        """The ETag of `name` below the root, the index or a details object (None: there
        is none): what changes with every write, read without its bytes."""
        with _store_failures():
            return self._client().tag(self.directory.key(name))

    def _client(self) -> ObjectStoreClient:
        with _store_failures():
            return client_for(self.directory)


@contextlib.contextmanager
def _store_failures() -> Iterator[None]:
    try:
        yield
    except ObjectStoreFailure as exc:
        raise StorageFailed(str(exc)) from None
