"""Retention: which checkpoint directories of a root are deleted after a publication, and
deleting them so that a crash never leaves a directory that looks published but lost parts."""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import os
import secrets
import shutil
import stat
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from rollout_checkpoint.client.checkpointing.publication.errors import CheckpointCorrupt
from rollout_checkpoint.client.checkpointing.publication.files import DIR_FLAGS
from rollout_checkpoint.client.checkpointing.publication.latest import (
    created_at_for_ordering,
    read_latest,
)
from rollout_checkpoint.server.core import daemon_threads, layout, safe_files
from rollout_checkpoint.server.core.episodes import is_valid_id
from rollout_checkpoint.server.core.layout import (
    FLEET_MANIFEST_NAME,
    LATEST_NAME,
    MANIFEST_LIMIT,
    MANIFEST_NAME,
    PARTICIPANTS_DIR,
    StoredManifest,
)
from rollout_checkpoint.server.core.safe_files import closing

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _RootScan:
    published: list[tuple[datetime, str]]
    """(created_at, id); created_at is the oldest possible time when unreadable."""
    unpublished: list[tuple[str, int]]
    """(id, directory mtime in ns) of directories that look like unfinished checkpoints."""
    strays: list[str]
    """Our own temporary files and trash directories in the root."""


def scan_root(root_fd: int) -> _RootScan:
    """Classify the entries of a root: published checkpoints, unfinished ones, our strays.
    Anything else (an operator's directory, a symlink, a file) is not ours and is left out."""
    scan = _RootScan([], [], [])
    for name in os.listdir(root_fd):
        if layout.LATEST_TEMPORARY_NAME.fullmatch(name) or layout.TRASH_NAME.fullmatch(name):
            scan.strays.append(name)
            continue
        if name == LATEST_NAME or not is_valid_id(name):
            continue
        try:
            fd = os.open(name, DIR_FLAGS, dir_fd=root_fd)
        except OSError:
            continue  # a file, a symlink, or gone: not a checkpoint directory of ours
        with closing(fd):
            entries = set(os.listdir(fd))
            if FLEET_MANIFEST_NAME in entries:
                if stat.S_ISREG(
                    os.stat(FLEET_MANIFEST_NAME, dir_fd=fd, follow_symlinks=False).st_mode
                ):
                    scan.published.append((created_at_for_ordering(fd, name), name))
                continue
            # Only a directory whose content is what a checkpoint in progress holds (the
            # participants' tree, our temp files) counts as an unfinished checkpoint: any
            # other directory an operator put into the root is not ours to delete.
            if all(
                e == PARTICIPANTS_DIR or layout.FLEET_TEMPORARY_NAME.fullmatch(e) for e in entries
            ):
                scan.unpublished.append((name, os.fstat(fd).st_mtime_ns))
    return scan


def apply_retention(
    root_fd: int, root: Path, keep: int, just_published: str, reference_mtime_ns: int
) -> tuple[str, ...]:
    """Delete old checkpoints; return the ids deleted. Never raises for a failed deletion
    (the publication already succeeded; the next one retries what is left).

    Published checkpoints are ordered by the created_at in their fleet manifest (ties by
    id): that is the time the controller decided on, and it is what a user means by
    "newest". The `keep` newest survive, and always the one just published and whatever
    LATEST names (after a retry of an older id the two need not be among the newest).

    An *unpublished* directory (no `checkpoint.json`; content limited to `participants/` and
    our temp files) is deleted when its mtime is strictly older than the just-published
    checkpoint's directory mtime as it was before this publication touched it. A
    checkpoint directory's mtime is set when its entries are created, i.e. when its first
    participant committed; so this deletes the partial checkpoints started before this one
    (aborted or failed attempts) and keeps any started after it. Not by id: ids are the
    caller's choice and only the generated ones sort by time (and not even within one
    second). Both mtimes come from the same filesystem's clock, so they compare even when
    participants write from other hosts. A tie keeps the directory.
    """
    deleted: list[str] = []
    try:
        scan = scan_root(root_fd)
        latest: str | None = None
        with contextlib.suppress(CheckpointCorrupt, OSError):
            latest = read_latest(root_fd, root)
    except OSError as exc:
        log.warning("retention skipped: cannot scan %s: %s", root, exc)
        return ()
    protected = {just_published} if latest is None else {just_published, latest}
    newest_first = sorted(scan.published, reverse=True)
    survivors = {name for _, name in newest_first[:keep]} | protected
    doomed = [name for _, name in newest_first[keep:] if name not in survivors]
    doomed += [
        name
        for name, mtime_ns in scan.unpublished
        if mtime_ns < reference_mtime_ns and name not in protected
    ]
    kept = {name for _, name in scan.published} | {name for name, _ in scan.unpublished}
    try:
        referenced = referenced_closure(
            kept - set(doomed), functools.partial(_references_of, root_fd)
        )
    except OSError as exc:
        log.warning("retention skipped: cannot read the references in %s: %s", root, exc)
        return ()
    survivors |= referenced & kept
    doomed = [name for name in doomed if name not in referenced]
    for name in doomed:
        if daemon_threads.abandoned():
            break  # the caller gave up at its deadline: the next publication deletes the rest
        try:
            _delete_tree(root_fd, name)
            deleted.append(name)
        except OSError as exc:
            log.warning("retention: cannot delete %s: %s", root / name, exc)
    for name in scan.strays:
        with contextlib.suppress(OSError):
            if layout.TRASH_NAME.fullmatch(name):
                shutil.rmtree(name, dir_fd=root_fd)
            else:
                os.unlink(name, dir_fd=root_fd)
    for name in sorted(survivors):
        with contextlib.suppress(OSError):
            _remove_fleet_temps(root_fd, name)
    with contextlib.suppress(OSError):
        os.fsync(root_fd)
    return tuple(sorted(deleted))


def referenced_closure(kept: set[str], references_of: Callable[[str], set[str]]) -> set[str]:
    """Every checkpoint (directory, or prefix on an object store) whose records a part in
    `kept` references, and the ones those reference in turn (a kept checkpoint restores only
    with them, and so does each one retention keeps for it, so none of them looks published
    yet cannot restore). `references_of(name)`: the checkpoints the parts of `name` reference.

    `references_of` raises (OSError, a store's failure) when a manifest cannot be read:
    retention then deletes nothing rather than a file a kept checkpoint may need. A manifest
    that does not parse references nothing (its part cannot be restored anyway)."""
    found: set[str] = set()
    pending = sorted(kept)
    while pending:
        name = pending.pop()
        for referenced in references_of(name):
            if referenced not in found:
                found.add(referenced)
                pending.append(referenced)
    return found


def _references_of(root_fd: int, name: str) -> set[str]:
    """The sibling directories the parts of checkpoint `name` reference."""
    try:
        ckpt_fd = os.open(name, DIR_FLAGS, dir_fd=root_fd)
    except FileNotFoundError:
        return set()
    references: set[str] = set()
    with closing(ckpt_fd):
        for kind, instance in _parts_of(ckpt_fd):
            try:
                part_fd = safe_files.walk(ckpt_fd, layout.part_components(kind, instance))
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.ENOENT):
                    continue  # not a part directory of ours: nothing it references
                raise
            with closing(part_fd):
                references |= _manifest_references(part_fd)
    return references


def _parts_of(ckpt_fd: int) -> list[tuple[str, str]]:
    """(kind, instance) of every part directory below `participants/`."""
    try:
        participants_fd = os.open(PARTICIPANTS_DIR, DIR_FLAGS, dir_fd=ckpt_fd)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.ENOENT):
            return []
        raise
    with closing(participants_fd):
        parts = []
        for kind in os.listdir(participants_fd):
            if not is_valid_id(kind):
                continue
            try:
                kind_fd = os.open(kind, DIR_FLAGS, dir_fd=participants_fd)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.ENOENT):
                    continue
                raise
            with closing(kind_fd):
                parts += [(kind, i) for i in os.listdir(kind_fd) if is_valid_id(i)]
    return parts


def _manifest_references(part_fd: int) -> set[str]:
    try:
        raw = safe_files.read_regular(part_fd, MANIFEST_NAME, MANIFEST_LIMIT)
    except (FileNotFoundError, safe_files.NotRegular, safe_files.TooLarge):
        return set()
    return manifest_references(raw)


def manifest_references(raw: bytes) -> set[str]:
    """The checkpoints a part's raw manifest references (none when it does not parse)."""
    try:
        chain = StoredManifest.decode(raw).chain
    except ValueError:
        return set()
    return set() if chain is None else {r.checkpoint for r in chain.references}


def _delete_tree(root_fd: int, name: str) -> None:
    """Rename to a trash name (atomic, durable), then remove: a crash part-way through never
    leaves a directory under a checkpoint id that still looks published but lost parts."""
    trash = layout.trash_name(secrets.token_hex(8))
    os.rename(name, trash, src_dir_fd=root_fd, dst_dir_fd=root_fd)
    os.fsync(root_fd)
    shutil.rmtree(trash, dir_fd=root_fd)


def _remove_fleet_temps(root_fd: int, name: str) -> None:
    fd = os.open(name, DIR_FLAGS, dir_fd=root_fd)
    with closing(fd):
        for entry in os.listdir(fd):
            if layout.FLEET_TEMPORARY_NAME.fullmatch(entry):
                os.unlink(entry, dir_fd=fd)
