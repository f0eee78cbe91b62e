"""`LATEST`: reading it, moving it atomically, and what "newer" means for it."""

from __future__ import annotations

import logging
import os
import secrets
import stat
from datetime import UTC, datetime
from pathlib import Path

from rollout_checkpoint.client.checkpointing.publication.errors import CheckpointCorrupt
from rollout_checkpoint.client.checkpointing.publication.files import (
    DIR_FLAGS,
    read_regular,
    replace_atomically,
)
from rollout_checkpoint.client.checkpointing.publication.manifest import parse_time
from rollout_checkpoint.server.core import layout
from rollout_checkpoint.server.core.episodes import is_valid_id
from rollout_checkpoint.server.core.layout import (
    FLEET_MANIFEST_NAME,
    LATEST_NAME,
    load_json,
)
from rollout_checkpoint.server.core.safe_files import closing

log = logging.getLogger(__name__)

_OLDEST = datetime.min.replace(tzinfo=UTC)


def write_latest(root_fd: int, checkpoint_id: str) -> None:
    """Point LATEST at `checkpoint_id` atomically: readers see the old or the new id."""
    tmp = layout.latest_temporary_name(secrets.token_hex(8))
    replace_atomically(root_fd, LATEST_NAME, tmp, f"{checkpoint_id}\n".encode())


def latest_is_newer(root_fd: int, root: Path, checkpoint_id: str, created_at: datetime) -> bool:
    """Whether `LATEST` names another published checkpoint created after `created_at`: a late
    retry of an older publication then must not move `LATEST` back. An unreadable `LATEST` is
    not newer (the publication repairs it)."""
    try:
        current = read_latest(root_fd, root)
    except CheckpointCorrupt:
        return False
    if current is None or current == checkpoint_id or not is_published(root_fd, current):
        return False
    try:
        current_fd = os.open(current, DIR_FLAGS, dir_fd=root_fd)
    except OSError:
        return False
    with closing(current_fd):
        return created_at_for_ordering(current_fd, current) > created_at


def read_latest(root_fd: int, root: Path) -> str | None:
    """The id `LATEST` holds (None when there is no `LATEST`); `CheckpointCorrupt` when it is
    not a regular file holding one valid checkpoint id. Does not check that it is published."""
    path = root / LATEST_NAME
    try:
        raw = read_regular(root_fd, LATEST_NAME, path, limit=layout.LATEST_LIMIT)
    except CheckpointCorrupt:
        if not os.path.lexists(path):
            return None
        raise
    text = raw.decode("utf-8", errors="replace")
    checkpoint_id = text[:-1] if text.endswith("\n") else text
    if not is_valid_id(checkpoint_id) or checkpoint_id == LATEST_NAME:
        raise CheckpointCorrupt(path, f"LATEST does not hold a checkpoint id: {text[:80]!r}")
    return checkpoint_id


def is_published(root_fd: int, checkpoint_id: str) -> bool:
    """Whether `<checkpoint_id>/checkpoint.json` is a regular file (never following a link)."""
    try:
        info = os.stat(
            f"{checkpoint_id}/{FLEET_MANIFEST_NAME}", dir_fd=root_fd, follow_symlinks=False
        )
    except (FileNotFoundError, NotADirectoryError):
        return False
    return stat.S_ISREG(info.st_mode)


def created_at_for_ordering(ckpt_fd: int, name: str) -> datetime:
    """created_at read leniently (only that field), so a manifest of a newer schema written
    by a newer controller still orders by its time instead of counting as oldest."""
    try:
        raw = read_regular(ckpt_fd, FLEET_MANIFEST_NAME, Path(name), limit=None)
        fields = load_json(raw)
        if isinstance(fields, dict):
            return parse_time(fields.get("created_at"))
    except (CheckpointCorrupt, ValueError, OSError):
        pass
    log.warning("checkpoint %s: created_at unreadable; it counts as the oldest", name)
    return _OLDEST
