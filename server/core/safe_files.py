"""Safe file access below a directory descriptor: no symlink followed, no open() that blocks.

Every reader and writer of the checkpoint format (the participant's part storage, the
controller's publication) opens files through these helpers:

* directories are opened with O_NOFOLLOW | O_DIRECTORY, relative to their parent's
  descriptor, so a symlink planted anywhere below a checkpoint directory is refused rather
  than followed; `walk` opens an absolute path from `/` one component at a time, so a path
  checked once is never resolved by name again;
* files are opened with O_NOFOLLOW | O_NONBLOCK and checked with fstat to be regular before a
  byte moves: open() of a FIFO planted under a file's name otherwise waits forever for a
  writer, wedging the thread (and the commit, restore or publication) with it.

Errors stay OSErrors (plus `NotRegular` and `TooLarge`); `symlink_or_not_directory` tells the
two meanings of the ELOOP/ENOTDIR an O_NOFOLLOW open reports, so each caller maps them to its
own error type. Everything here blocks: callers run it in a thread.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Callable, Iterator, Sequence
from typing import Literal

# O_NONBLOCK on directories is harmless; on files it keeps open() of a FIFO from blocking.
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
FILE_FLAGS = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL
READ_CHUNK = 1 << 20


class NotRegular(Exception):
    """A name that must be a regular file is something else: a FIFO, a directory, a device."""


class TooLarge(Exception):
    """A file is larger than the caller's limit (`size` is what fstat said)."""

    def __init__(self, name: str, size: int) -> None:
        super().__init__(f"{name} is too large ({size} bytes)")
        self.size = size


def open_regular(dir_fd: int, name: str, flags: int = os.O_RDONLY, mode: int = 0o644) -> int:
    """Open `name` below `dir_fd` without following a symlink and without ever blocking.

    O_NONBLOCK makes open() of a FIFO return at once instead of waiting for a writer; fstat
    then refuses anything but a regular file (`NotRegular`) before a byte moves. For a
    regular file O_NONBLOCK means nothing, but it is cleared all the same so reads and
    writes are plain.
    """
    fd = os.open(name, flags | FILE_FLAGS, mode, dir_fd=dir_fd)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise NotRegular(name)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_regular(dir_fd: int, name: str, limit: int | None = None) -> bytes:
    """A regular file's bytes (see `open_regular`). With `limit`, `TooLarge` when fstat says
    the file is larger, and never more than `limit + 1` bytes read (a file that grows while
    being read comes back too long, so the caller can tell)."""
    fd = open_regular(dir_fd, name)
    try:
        if limit is not None:
            size = os.fstat(fd).st_size
            if size > limit:
                raise TooLarge(name, size)
        remaining = -1 if limit is None else limit + 1
        chunks: list[bytes] = []
        while remaining != 0:
            want = READ_CHUNK if remaining < 0 else min(remaining, READ_CHUNK)
            chunk = os.read(fd, want)
            if not chunk:
                break
            chunks.append(chunk)
            if remaining > 0:
                remaining -= len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def write_all(fd: int, data: bytes) -> None:
    """Write every byte and fsync. (A participant's part writes its records here:
    `tests/frozen_storage.py` stalls it to freeze the participant's filesystem.)"""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
    os.fsync(fd)


def write_new_file(dir_fd: int, name: str, data: bytes) -> None:
    """Create `name` below `dir_fd` (never an existing name, never through a symlink), write
    `data` and fsync it."""
    fd = open_regular(dir_fd, name, CREATE_FLAGS)
    with closing(fd):
        write_all(fd, data)


def symlink_or_not_directory(
    exc: OSError, dir_fd: int, name: str
) -> Literal["symlink", "not a directory"] | None:
    """What an OSError of an O_NOFOLLOW open of `name` below `dir_fd` means.

    Linux reports a symlink opened with O_NOFOLLOW as ELOOP, or as ENOTDIR together with
    O_DIRECTORY; lstat (which never opens, so it cannot block either) tells which of the two
    it really is. None for any other error."""
    if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
        return None
    try:
        is_link = stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError:
        is_link = exc.errno == errno.ELOOP
    return "symlink" if is_link else "not a directory"


def descend(parent_fd: int, name: str) -> int:
    """Open directory `name` below `parent_fd` without following a symlink; on success the
    parent descriptor is closed and the child's returned (on failure the caller closes it)."""
    child = os.open(name, DIR_FLAGS, dir_fd=parent_fd)
    os.close(parent_fd)
    return child


def walk(
    dir_fd: int,
    components: Sequence[str],
    *,
    create: Callable[[int], bool] = lambda index: False,
    refused: Callable[[OSError, int, int, str], Exception | None] | None = None,
) -> int:
    """Open `components` below `dir_fd` (which stays open), one at a time, none followed.

    `create(index)` says whether component `index` is created when missing (its parent must
    exist, so nothing above it is ever created). `refused(exc, parent_fd, index, name)` maps
    an OSError of one step to the caller's error (None: re-raise it)."""
    fd = os.dup(dir_fd)
    try:
        for index, component in enumerate(components):
            if create(index):
                with contextlib.suppress(FileExistsError):
                    os.mkdir(component, 0o755, dir_fd=fd)
            try:
                fd = descend(fd, component)
            except OSError as exc:
                mapped = None if refused is None else refused(exc, fd, index, component)
                if mapped is None:
                    raise
                raise mapped from exc
        return fd
    except BaseException:
        os.close(fd)
        raise


def open_root() -> int:
    """`/`, the start of every absolute walk."""
    return os.open("/", DIR_FLAGS)


def components_of(path: str) -> list[str]:
    """The names of an absolute, normalized path; ValueError for anything else."""
    if not os.path.isabs(path) or os.path.normpath(path) != path:
        raise ValueError("must be an absolute, normalized path")
    components = [c for c in path.split("/") if c]
    if any(c in (".", "..") for c in components):
        raise ValueError("must not contain a '.' or '..' component")
    return components


@contextlib.contextmanager
def closing(fd: int) -> Iterator[int]:
    """Close a raw descriptor at the end of the block."""
    try:
        yield fd
    finally:
        os.close(fd)


@contextlib.contextmanager
def opened(path: str | os.PathLike[str], flags: int) -> Iterator[int]:
    """`os.open(path, flags)` for the block (the caller's own choice of path and flags).

    Every access of a controller to a local checkpoint root or directory starts here, so
    `tests/frozen_storage.py` replaces it with a call that never returns to stall them all
    like a frozen filesystem."""
    fd = os.open(path, flags)
    try:
        yield fd
    finally:
        os.close(fd)
