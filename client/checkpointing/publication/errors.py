"""The errors of publication and of reading published checkpoints."""

from __future__ import annotations

import os
from pathlib import Path

from rollout_checkpoint.server.core.errors import CheckpointError, Reason


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


class StorageFailed(PublicationError):
    """The checkpoint store failed or did not answer: an I/O error, an unreachable or
    refusing object store, or no answer by the operation's deadline. Nothing is wrong with
    any checkpoint; a retry may succeed (`STORAGE_FAILED`)."""


def reason_of(error: PublicationError) -> Reason:
    """The typed reason of a publication error, as an operator should read it: a store that
    failed is STORAGE_FAILED (retryable), a checkpoint that does not verify is
    INVALID_CHECKPOINT_STATE, an id published with another manifest CHECKPOINT_CONFLICT."""
    if isinstance(error, StorageFailed):
        return Reason.STORAGE_FAILED
    if isinstance(error, CheckpointConflict):
        return Reason.CHECKPOINT_CONFLICT
    return Reason.INVALID_CHECKPOINT_STATE


def as_checkpoint_error(error: PublicationError) -> CheckpointError:
    """The coordinator's typed error for a publication error (`reason_of`); a checkpoint that
    was never published is FAILED_PRECONDITION, not DATA_LOSS."""
    if isinstance(error, NoPublishedCheckpoint):
        return CheckpointError(
            Reason.INVALID_CHECKPOINT_STATE, str(error), code="FAILED_PRECONDITION"
        )
    if isinstance(error, StorageFailed):
        return CheckpointError(Reason.STORAGE_FAILED, str(error), retry_after=1.0)
    return CheckpointError(reason_of(error), str(error))
