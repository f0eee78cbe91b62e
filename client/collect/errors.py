"""How a collection ends: its exit codes and the errors that choose them.

The exit code is what a job scheduler acts on (retry with `--resume`, page someone, give up),
so each failure class maps to exactly one code, in `collect.cli.run_collect`.
"""

from __future__ import annotations

import signal

EXIT_OK = 0
"""Every rollout collected."""
EXIT_SOME_FAILED = 1
"""Done, but some rollouts were recorded as failed after `--max-attempts`."""
EXIT_USAGE = 2
"""Bad arguments, configuration or input (also a collection state that does not fit them)."""
EXIT_REFUSED = 4
"""A participant refused a control call."""
EXIT_UNREACHABLE = 5
"""A participant could not be reached."""
EXIT_CORRUPT = 6
"""The output, the dispatch log or a checkpoint is corrupt."""
EXIT_IO = 7
"""The output or the dispatch log cannot be written."""
EXIT_STOPPED = 128 + signal.SIGTERM
"""Stopped by SIGTERM/SIGINT (after a checkpoint when one could be taken)."""


class UsageError(ValueError):
    """Bad arguments, input, or a collection state that does not fit them (exit 2)."""


class CorruptFile(ValueError):
    """The output or the dispatch log is malformed before its last line (exit 6).

    Only the last line can be torn by a crash; damage before it is not a crash artefact, and
    resuming over it would skip or redo rollouts silently."""


class OutputFailed(Exception):
    """The output or the dispatch log cannot be written (exit 7).

    Raised by every append after the first failed write: appending after a torn line would
    bury it in the middle of the file."""
