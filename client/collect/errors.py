"""The errors that end a collection, and the exit code each one chooses.

The exit code is what a job scheduler acts on (retry with `--resume`, page someone, give up),
so each failure class maps to exactly one code of the CLI's one table (`console.ExitCode`),
in `collect.cli.classify`.
"""

from __future__ import annotations


class UsageError(ValueError):
    """Bad arguments, input, or a collection state that does not fit them (exit 2)."""


class CorruptFile(ValueError):
    """The output or the dispatch log is malformed before its last line (exit 6).

    Only the last line can be torn by a crash; damage before it is not a crash artefact, and
    resuming over it would skip or redo rollouts silently."""


class OutputFailed(Exception):
    """The output or the dispatch log cannot be written (exit 7).

    Raised before the fleet is touched when `--output` cannot be opened for appending, and by
    every append after the first failed write: appending after a torn line would bury it in
    the middle of the file."""
