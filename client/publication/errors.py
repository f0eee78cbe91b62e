"""The errors of publication and of reading published checkpoints."""

from __future__ import annotations

import os
from pathlib import Path


class PublicationError(Exception):
    """Base of every error of publication (an OS error while publishing is one too)."""


class CheckpointCorrupt(PublicationError):
    """A checkpoint (or `LATEST`) on disk is missing, torn, tampered with or malformed.

    `path` is the file or directory at fault. Digest, record count and size mismatches say
    "digest" in their message."""

    def __init__(self, path: str | os.PathLike[str], message: str) -> None:
        super().__init__(f"{os.fspath(path)}: {message}")
        self.path = Path(path)
        self.message = message


class CheckpointConflict(PublicationError):
    """The checkpoint id is already published with a different fleet manifest."""


class NoPublishedCheckpoint(PublicationError):
    """There is no published checkpoint (no `LATEST`, or the named id was never published)."""
