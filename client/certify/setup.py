"""What every run of one certify invocation shares: the fleet, the tasks and the tempo.

The defaults are chosen so that a trial costs seconds on two loaded cores and still proves
something: the policy model's replayed answers wait `model_latency` each, so a rollout of a
few model calls stays in flight for a fraction of a second and a checkpoint taken every
`checkpoint_every` seconds cuts rollouts mid-step; a checkpoint that a fault breaks fails
within `checkpoint_timeout`, and the run goes on to the next one instead of waiting minutes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from rollout_checkpoint.client.certify.findings import ServerFacts
from rollout_checkpoint.client.fleet.spec import FleetSpec

CHECKPOINT_TIMEOUT = 8.0
"""The trial collector's `--checkpoint-timeout`: bounds one checkpoint and one recovery. A
fault that breaks a checkpoint (a member stopped, storage read-only) costs this much at most,
and a member stopped past its lease stays stopped this long plus the lease grace: at 15 s each
such trial cost 18 s. A healthy checkpoint of a small fleet takes well under a second even on
a loaded machine (under 0.5 s at load 10 on two cores), and a replacement comes up within a
few, so 8 s leaves a wide margin; the engine's own trials run at it too."""
CHECKPOINT_EVERY = 0.3
"""Seconds between a trial's periodic checkpoints: several checkpoints during a run of a few
seconds, so the trial's checkpoint 1 or 2 always comes while rollouts are in flight."""
MODEL_LATENCY = 0.2
"""Seconds added to every replayed model answer (`--replay-latency`)."""
CONCURRENCY = 4
"""Rollouts in flight: fewer than the tasks, so a checkpoint meets rollouts at every stage."""


@dataclass(frozen=True)
class CertifySetup:
    """One certify invocation's fleet and tempo (see the module doc for the defaults)."""

    fleet_path: Path
    """The user's fleet file (a trial may run on a derived one beside `work`)."""
    spec: FleetSpec
    tasks: Path
    """The tasks file (`collect --input`)."""
    entry_url: str
    """The entry point's base URL (`collect --entry-url`)."""
    work: Path
    """The report directory's private work area: every run gets a folder of its own here."""
    facts: list[ServerFacts] = field(default_factory=list)
    """Every member's kind and mode (`fleet_processes.discover`)."""
    num_repeats: int = 1
    concurrency: int = CONCURRENCY
    checkpoint_timeout: float = CHECKPOINT_TIMEOUT
    checkpoint_every: float = CHECKPOINT_EVERY
    model_latency: float = MODEL_LATENCY

    @property
    def model_member(self) -> str | None:
        """The policy model's fleet-file name (None: the fleet has none, nothing is recorded
        or replayed)."""
        return next((f.name for f in self.facts if f.kind == "policy_model"), None)

    @property
    def resources_members(self) -> list[str]:
        """The resources servers' fleet-file names: the members whose exports are compared."""
        return [f.name for f in self.facts if f.kind == "resources"]
