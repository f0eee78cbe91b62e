"""A collection's settings: the `collect` verb's flags as one value the library takes.

Its own module because every part of a run reads it (the start-up reads, the collector, the
CLI) and none of them owns it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path


@dataclass
class CollectOptions:
    """One collection's settings (the CLI's flags of the same names)."""

    fleet: Path
    entry_url: str
    input: Path
    output: Path
    checkpoint_dir: Path | str
    """A directory, or an object-store URL (`s3://bucket/prefix`)."""
    num_repeats: int = 1
    concurrency: int = 32
    checkpoint_every: float | None = None
    resume: bool = False
    max_attempts: int = 3
    max_recoveries: int = 3
    """Recoveries in place after a lost member (0: none; the run stops for a `--resume`)."""
    checkpoint_timeout: float = 300.0
    request_timeout: float = 3600.0
    keep: int | None = None
    straggler_rounds: int = 1
    command: Sequence[str] = ()
    """The command line that started the run, repeated with `--resume` when it stops."""
