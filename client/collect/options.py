"""A collection's settings: the `collect` verb's flags as one value the library takes.

Its own module because every part of a run reads it (the start-up reads, the collector, the
CLI) and none of them owns it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from rollout_checkpoint.client.ledger import GroupRecovery
from rollout_checkpoint.client.staleness import StalenessPolicy


@dataclass
class CollectOptions:
    """One collection's settings (the CLI's flags of the same names)."""

    fleet: Path
    """The fleet file (TOML or YAML)."""
    entry_url: str
    """The entry point's base URL (the environment server's or the agent's HTTP address)."""
    input: Path
    """The tasks, one JSON object a line."""
    output: Path
    """The rollouts, one JSON line each."""
    checkpoint_dir: Path | str
    """A directory, or an object-store URL (`s3://bucket/prefix`)."""
    num_repeats: int = 1
    """Rollouts per task (K)."""
    concurrency: int = 32
    """Rollouts in flight at once."""
    checkpoint_every: float | None = None
    """Seconds between checkpoints (None: only on SIGUSR1 and when the run stops)."""
    resume: bool = False
    """Continue the collection in `output` and `checkpoint_dir`."""
    group_recovery: GroupRecovery = "sibling"
    """What a prompt group does after a crash cut one of its rollouts (a task's row may
    say otherwise)."""
    max_attempts: int = 3
    """Failures of one rollout before it is recorded as failed."""
    max_recoveries: int = 3
    """Recoveries in place after a lost member (0: none; the run stops for a `--resume`)."""
    checkpoint_timeout: float = 300.0
    """Seconds for one checkpoint, and for one recovery including the wait for a lost member to
    answer again."""
    request_timeout: float = 3600.0
    """Seconds for one `/run`."""
    keep: int | None = None
    """Published checkpoints kept (None: the fleet file's `keep`)."""
    straggler_rounds: int = 1
    """Retries of a checkpoint whose prepare was not done in time, each after retiring the
    rollouts still blocking it; then that checkpoint is given up."""
    staleness: StalenessPolicy = field(default_factory=StalenessPolicy)
    """`--max-policy-lag` and `--stale`: what a restore does with a rollout whose oldest turn
    is too many weight versions behind (staleness.py)."""
    command: Sequence[str] = ()
    """The command line that started the run, repeated with `--resume` when it stops."""
