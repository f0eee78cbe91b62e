"""Taking one checkpoint of a running collection, with the collector's state inside.

The fleet prepares; replies already on the wire for episodes the entry point no longer holds
are awaited (else a rollout that finished would be restored as running, or lost); the scope
is then every rollout in flight plus every restored rollout not yet re-sent; commit; publish
with the collector state as the fleet manifest's controller-state blob; resume. Stragglers
that keep the fleet from preparing are retired and the checkpoint is tried again.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rollout_checkpoint.client.checkpointing import fanout
from rollout_checkpoint.client.checkpointing.checkpoint import CheckpointEvent, Phase, checkpoint
from rollout_checkpoint.client.checkpointing.fanout import FleetError
from rollout_checkpoint.client.checkpointing.publication import (
    PublicationError,
    PublicationRoot,
)
from rollout_checkpoint.client.collect.control import ControlCalls
from rollout_checkpoint.client.collect.journal import DurableAppender
from rollout_checkpoint.client.collect.rollouts import RolloutBook, controller_state
from rollout_checkpoint.client.collect.view import CollectView
from rollout_checkpoint.client.errors import ControlError
from rollout_checkpoint.client.fleet import Fleet
from rollout_checkpoint.server.core.episodes import EpisodeId
from rollout_checkpoint.server.core.errors import CheckpointError
from rollout_checkpoint.v1 import types_pb2

ON_WIRE_SECONDS = 30.0
"""How long a checkpoint waits for replies already on the wire. One still missing after that
stays in the scope: the agent keeps a finished episode's outcome for exactly this case, so the
restored attempt N+1 delivers it instead of running the episode again."""

CheckpointStepHook = Callable[[str, int], None]
"""Called with (step, number) at each step of each checkpoint and of each in-place recovery,
in the order a run meets them. A checkpoint's steps carry its number (from 1): `preparing`
(its Prepare went out), `prepared` (the fleet is prepared, nothing committed), `snapshotted`
(asynchronous: every member snapshotted, the fleet not resumed yet), `resumed` (its resume of
the fleet finished), `writing` (asynchronous: resumed, the parts being written), `committed`
(parts durable, nothing published) and the publication steps (`after_verify`,
`after_fleet_manifest`, `after_latest`). A recovery's steps carry its number (from 1, every
try counted): `recovery_cut_ended`, `recovery_restored` (`recovery.Step`) and `recovered`
(the fleet resumed, the cut rollouts queued again). The delivery steps of the receipt
protocol carry their own count (from 1): `received`, `persisted`, `acknowledging`,
`acknowledged` (`receipts.DeliverySteps`). Fault tests and `certify` stop or kill the
collector there, at the exact moment a fault is meant to meet; production passes none."""


class NumberedSteps:
    """A `CheckpointStepHook` bound to the number of the checkpoint under way (0 before the
    first: the checkpoint root's own steps at start-up), as the one-argument step the
    checkpoint library and the root call. The control loop counts each checkpoint it
    starts, so a fault test can kill the collector at a step of its Nth checkpoint."""

    def __init__(self, hook: CheckpointStepHook | None) -> None:
        self.hook = hook
        self.number = 0

    def __call__(self, name: str) -> None:
        if self.hook is not None:
            self.hook(name, self.number)


@dataclass(frozen=True)
class CheckpointSettings:
    """What one checkpoint of a collection needs to know besides the fleet."""

    run_id: str
    input_digest: str
    num_repeats: int
    timeout: float
    """Seconds for one attempt at a checkpoint (prepare to publish)."""
    straggler_rounds: int
    """How often stragglers are retired and the checkpoint tried again."""
    keep: int
    """Published checkpoints kept by retention."""


@dataclass(eq=False)
class CheckpointTaker:
    """Takes the checkpoints of one collection; `take` runs one while dispatching is paused.

    `step` is called with each step's name (see `CheckpointStepHook`): `NumberedSteps` binds
    the checkpoint number to it. `fleet` is replaced by the one discovered again after an
    in-place recovery."""

    fleet: Fleet
    root: PublicationRoot
    book: RolloutBook
    output: DurableAppender
    view: CollectView
    control: ControlCalls
    settings: CheckpointSettings
    step: Callable[[str], None]
    resumed: Callable[[], None] | None = None
    """Called when an asynchronous checkpoint resumed the fleet, before its parts are
    durable: the cut is taken (scope and collector state fixed at prepare), so dispatching
    may go on; what is dispatched from here is after the cut, as after a synchronous one."""
    ledger_state: Callable[[], dict[str, Any]] | None = None
    """The receipt ledger's state (`receipts.Acknowledgements`), published in the controller
    state: a resumed run acknowledges what a crash left owed."""
    _deadline: float = field(default=0.0, init=False)
    _checkpoint_id: str | None = field(default=None, init=False)
    _published: bool = field(default=False, init=False)
    _last_phase: str | None = field(default=None, init=False)

    async def take(self, *, stop: bool, trigger: str) -> str | None:
        """Take and publish one checkpoint: its id, or None when none could be taken (the
        previous one stays the restore point; the failure is noted, never raised). With
        `stop` the fleet stays closed afterwards."""
        settings = self.settings
        try:
            for round_number in range(settings.straggler_rounds + 1):
                self._deadline = time.time() + settings.timeout
                self._checkpoint_id, self._published, self._last_phase = None, False, None
                outcome = None
                async for event in checkpoint(
                    self.fleet,
                    self.root,
                    self._deadline,
                    keep=settings.keep,
                    keep_closed=stop,
                    fix_scope=self._fix_scope,
                    asynchronous=self.fleet.spec.async_commit,
                    trigger=trigger,
                ):
                    self._on_event(event)
                    if event.final:
                        outcome = event.outcome
                assert outcome is not None
                if outcome.published is not None:
                    return outcome.checkpoint_id
                blocking = sorted(outcome.progress.blocking_episodes()) if outcome.progress else []
                if not blocking or round_number == settings.straggler_rounds:
                    self.view.note(
                        f"collect: the fleet was not prepared in time ({outcome.prepare_outcome}); "
                        "no checkpoint taken"
                    )
                    return None
                # Controller obligation 2: the checkpoint was aborted (fleet resumed); retire
                # the stragglers, whose /run then fails and is retried as a later attempt.
                await fanout.retire(
                    self.fleet, self.control.new_id("retire"), self._deadline, blocking
                )
                self.view.note(f"collect: retired {len(blocking)} straggler(s); preparing again")
        except (FleetError, ControlError, CheckpointError, PublicationError, OSError) as error:
            # CheckpointError: a member started closed awaits its restore (a replacement the
            # member watch reports too, and the collector recovers from).
            if self._published and self._checkpoint_id is not None:
                # Published, then a member was lost before it resumed: the checkpoint is whole
                # (every part was committed) and LATEST names it.
                self.view.note(
                    f"collect: resuming the fleet after checkpoint {self._checkpoint_id} "
                    f"failed ({error})"
                )
                return self._checkpoint_id
            self.view.note(
                f"collect: checkpoint failed ({error}); the previous one stays the restore point"
            )
        return None

    def _on_event(self, event: CheckpointEvent) -> None:
        self.book.counts.phase = f"checkpoint: {event.phase.lower()}"
        self._name_steps(event)
        if event.phase == Phase.RESUME and not event.detail.get("asynchronous"):
            # Synchronous: the resume comes after the publication. Asynchronous: before it,
            # so nothing is published yet (a failure after it is a checkpoint not taken).
            self._published = True
        elif event.phase == Phase.AWAIT_PARTS and event.detail.get("resumed"):
            self.view.note(
                f"collect: checkpoint {self._checkpoint_id} resumed the fleet at its snapshot; "
                "awaiting its parts"
            )
            if self.resumed is not None:
                self.resumed()

    def _name_steps(self, event: CheckpointEvent) -> None:
        """Call `step` at the checkpoint's steps (`CheckpointStepHook`). An event is yielded
        before the step it names runs, so the end of a resume is the event after RESUME."""
        phase, last = event.phase, self._last_phase
        self._last_phase = phase
        if phase == Phase.PREPARE and last is None:
            self.step("preparing")
        elif phase == Phase.SCOPE:
            self.step("prepared")
        elif phase == Phase.RESUME and event.detail.get("asynchronous"):
            self.step("snapshotted")
        elif phase == Phase.AWAIT_PARTS and not event.detail.get("resumed"):
            self.step("snapshotted")  # kept closed (a stop): no resume comes between
        if last == Phase.RESUME:
            self.step("resumed")
        if phase == Phase.AWAIT_PARTS and event.detail.get("resumed"):
            self.step("writing")
        elif phase == Phase.PUBLISH:
            self.step("committed")

    async def _fix_scope(self, checkpoint_id: str) -> tuple[list[EpisodeId], bytes]:
        """Called once the fleet is prepared (nothing starts or ends any more): await the
        replies already on the wire, then name the scope and build the collector state."""
        self._checkpoint_id = checkpoint_id
        fleet = self.fleet
        entry = [m for m in fleet.members if m.kind == types_pb2.PARTICIPANT_KIND_ENVIRONMENT]
        entry = entry or [m for m in fleet.members if m.kind == types_pb2.PARTICIPANT_KIND_AGENT]
        pages = await fanout.fan_out(
            "list episodes", entry, lambda m: m.client.all_episodes(), fleet.spec.fan_out
        )
        held = {
            EpisodeId(e.episode_id.rollout_id, e.episode_id.attempt)
            for episodes in pages.values()
            for e in episodes
        }
        on_wire = self.book.on_the_wire(held)
        if on_wire:
            self.book.counts.phase = f"checkpoint: awaiting {len(on_wire)} reply(ies) on the wire"
            remaining = self._deadline - time.time() - 5.0
            await asyncio.wait(on_wire, timeout=max(0.5, min(ON_WIRE_SECONDS, remaining)))
        await self.output.drain()  # "finished" in the state means durable in the output
        boots = await fanout.fan_out(
            "describe", fleet.members, lambda m: m.client.get_participant(), fleet.spec.fan_out
        )
        state = controller_state(
            self.book,
            run_id=self.settings.run_id,
            checkpoint_id=checkpoint_id,
            input_digest=self.settings.input_digest,
            num_repeats=self.settings.num_repeats,
            boot_ids={name: boot.boot_id for name, boot in boots.items()},
        )
        if self.ledger_state is not None:
            state["ledger"] = self.ledger_state()
        return self.book.scope(), json.dumps(state, separators=(",", ":"), sort_keys=True).encode()
