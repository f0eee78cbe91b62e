"""The supervisor's periodic checkpoints: one fleet checkpoint at a time, its end an event.

A supervisor checkpoint is the library's (`checkpointing.checkpoint`, scope derived by the
fleet), announced as `checkpoint_published` or `checkpoint_not_published`. Its own module
because a refused checkpoint is also news about the members, which the supervisor must act on
before anything else (`Held`): a member awaiting its restore is a replacement the watch has not
reported yet, and a member held by something else may be left closed by a dead controller.
The ids it takes are remembered (`own`): a member later found inside one of them is inside a
checkpoint that nothing of this supervisor will finish.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import KW_ONLY, dataclass, field

from rollout_checkpoint.client.checkpointing.checkpoint import CheckpointOutcome, Phase, checkpoint
from rollout_checkpoint.client.checkpointing.fanout import DERIVE, FleetError
from rollout_checkpoint.client.checkpointing.publication import (
    PublicationError,
    PublicationRoot,
    store_call,
)
from rollout_checkpoint.client.checkpointing.publication.history import Trigger
from rollout_checkpoint.client.coordinator.calls import (
    encodable,
    listed_blockers,
    prepare_outcome,
    status_of,
)
from rollout_checkpoint.client.coordinator.fleet_events import FleetEventLog
from rollout_checkpoint.client.fleet import DiscoveryError, Fleet, FleetSpec
from rollout_checkpoint.client.recovery import StepHook
from rollout_checkpoint.server.core.errors import CheckpointError
from rollout_checkpoint.server.core.rpc.wire import episode_message
from rollout_checkpoint.v1 import coordinator_service_pb2 as cpb

log = logging.getLogger(__name__)

CHECKPOINT_STEPS = {
    Phase.COMMIT: "checkpoint-prepared",
    Phase.PUBLISH: "checkpoint-committed",
    Phase.RESUME: "checkpoint-published",
}
"""The `StepHook` points of a supervisor checkpoint, by the phase about to start: every member
PREPARED; COMMITTED, nothing published; COMMITTED and published, not resumed."""


@dataclass(frozen=True)
class Held:
    """The members a refused checkpoint found held, which the supervisor acts on first."""

    awaiting_restore: tuple[str, ...] = ()
    """Replacements the watch has not reported yet: recovered before anything else."""
    elsewhere: tuple[str, ...] = ()
    """Members held by something else (a recovery left RESTORED, a checkpoint the supervisor
    aborted without reaching it): their state is read again."""


@dataclass(eq=False)
class PeriodicCheckpoints:
    """Takes the supervisor's checkpoints of one fleet (see the module docstring)."""

    spec: FleetSpec
    root: PublicationRoot
    events: FleetEventLog
    _: KW_ONLY
    seconds: float
    """The deadline of one checkpoint (prepare, commit, publish)."""
    step: StepHook
    discover: Callable[[FleetSpec], Awaitable[Fleet]]
    own: deque[str] = field(init=False, default_factory=lambda: deque(maxlen=64))
    """The ids of the latest checkpoints taken here."""

    async def take(self) -> Held:
        """Take, publish and announce one checkpoint; what a refusal said about the members
        (nothing when it published, or ended for any other reason)."""
        deadline = time.time() + self.seconds
        try:
            checkpoint_id = await store_call(
                deadline, self.root.location, self.root.new_checkpoint_id
            )
        except PublicationError as error:
            log.warning("supervisor: checkpoint skipped: %s", error)
            return Held()
        self.own.append(checkpoint_id)
        outcome: CheckpointOutcome | None = None
        try:
            fleet = await self.discover(self.spec)
        except DiscoveryError as error:
            log.info("supervisor: checkpoint skipped (%s)", error)
            return Held()
        try:
            async with fleet:
                async for event in checkpoint(
                    fleet,
                    self.root,
                    deadline,
                    checkpoint_id=checkpoint_id,
                    scope=DERIVE,
                    keep=self.spec.keep,
                    asynchronous=self.spec.async_commit,
                    trigger=Trigger.PERIODIC,
                ):
                    if event.phase in CHECKPOINT_STEPS:
                        await self.step(CHECKPOINT_STEPS[event.phase])
                    if event.outcome is not None:
                        outcome = event.outcome
        except (FleetError, PublicationError, CheckpointError) as error:
            self.events.emit(
                checkpoint_not_published=cpb.CheckpointNotPublished(
                    checkpoint_id=checkpoint_id, error=status_of(encodable(error))
                )
            )
            return _held(error)
        assert outcome is not None
        self._announce(checkpoint_id, outcome)
        return Held()

    def _announce(self, checkpoint_id: str, outcome: CheckpointOutcome) -> None:
        if outcome.published is None:
            progress = outcome.progress
            self.events.emit(
                checkpoint_not_published=cpb.CheckpointNotPublished(
                    checkpoint_id=checkpoint_id,
                    prepare_outcome=prepare_outcome(outcome.prepare_outcome),
                    blockers=listed_blockers(progress) if progress is not None else [],
                )
            )
            return
        log.info(
            "supervisor: published %s (%d continued, %d records, %d bytes)",
            checkpoint_id,
            len(outcome.continued),
            outcome.record_count,
            outcome.bytes,
        )
        self.events.emit(
            checkpoint_published=cpb.CheckpointPublished(
                checkpoint_id=checkpoint_id,
                directory=str(outcome.published.directory),
                continued=[episode_message(e) for e in outcome.continued],
                record_count=outcome.record_count,
                bytes=outcome.bytes,
            )
        )


def _held(error: FleetError | PublicationError | CheckpointError) -> Held:
    if isinstance(error, CheckpointError) and "awaitingRestore" in error.metadata:
        return Held(awaiting_restore=tuple(error.metadata["awaitingRestore"].split(",")))
    if isinstance(error, FleetError):
        return Held(elsewhere=tuple(error.failures))
    return Held()
