"""Opening and reading below a checkpoint root without following a symlink, with every
refusal reported as `CheckpointCorrupt` and every unexpected OS error as `StorageFailed`."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from rollout_checkpoint.client.checkpointing.publication.errors import (
    CheckpointCorrupt,
    StorageFailed,
)
from rollout_checkpoint.server.core import layout, safe_files

ROOT_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
DIR_FLAGS = safe_files.DIR_FLAGS


def open_part_dir(ckpt_fd: int, ckpt_path: Path, kind: str, instance: str) -> int:
    """Open `participants/<kind>/<instance>` refusing symlinks at every component."""
    components = layout.part_components(kind, instance)

    def refused(exc: OSError, parent_fd: int, index: int, name: str) -> Exception | None:
        path = ckpt_path.joinpath(*components[: index + 1])
        if isinstance(exc, FileNotFoundError):
            return CheckpointCorrupt(path, "missing: the participant's part is not here")
        failure = open_failure(exc, parent_fd, name, path)
        return None if failure is exc else failure

    return safe_files.walk(ckpt_fd, components, refused=refused)


def open_failure(exc: OSError, dir_fd: int, name: str, path: Path) -> Exception:
    """The error to raise for an OSError from an O_NOFOLLOW open of `name` below `dir_fd`."""
    what = safe_files.symlink_or_not_directory(exc, dir_fd, name)
    if what is None:
        return exc
    if what == "symlink":
        return CheckpointCorrupt(path, "is a symlink (refused: nothing here is followed)")
    return CheckpointCorrupt(path, "is not a directory")


def read_regular(
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
        raise open_failure(exc, dir_fd, name, path) from exc


@contextlib.contextmanager
def io_errors(path: Path) -> Iterator[None]:
    """Report an unexpected OS error (permissions, EIO, a full disk) as `StorageFailed`: the
    store failed, not the checkpoint."""
    try:
        yield
    except OSError as exc:
        raise StorageFailed(f"{path}: {exc.strerror or exc}") from exc


def replace_atomically(dir_fd: int, name: str, temporary: str, data: bytes) -> None:
    """Replace `name` below `dir_fd` so that readers see the old bytes or the new, never a
    torn file, even across a power loss: `temporary` written and fsynced, renamed over
    `name`, the directory fsynced."""
    try:
        safe_files.write_new_file(dir_fd, temporary, data)
        os.replace(temporary, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary, dir_fd=dir_fd)
        raise
    os.fsync(dir_fd)
