"""What the control plane reports: its state, readiness, GetStatus and ListEpisodes.

These reads never take the state machine's lock and never change anything: they answer at
once whatever a call is doing, and keep working after shutdown began (only changes are
refused then). GetStatus and ListEpisodes first let the participant refresh what it
reports (`Participant.refresh`): a pool of workers then reads their current state, not a
copy up to 0.25 s old.
"""

from __future__ import annotations

from dataclasses import dataclass

from rollout_checkpoint.server.core.layout import StoredManifest
from rollout_checkpoint.server.runtime.attempts import RetiredAttempts
from rollout_checkpoint.server.runtime.paging import page_by_key, page_of
from rollout_checkpoint.server.runtime.part_chain import PartChains
from rollout_checkpoint.server.runtime.participant import (
    EpisodeInfo,
    Participant,
    ReadinessReport,
)
from rollout_checkpoint.server.runtime.result_outbox import HeldResult
from rollout_checkpoint.server.runtime.state_machine import State, StateMachine


@dataclass(frozen=True, slots=True)
class LastPart:
    """The last part this process published (GetStatus's `last_part`): where, by which mode
    of commit, and its manifest; `generation` is the restore boundary it was cut in
    (`PartChains.generation`)."""

    checkpoint_dir: str
    asynchronous: bool
    manifest: StoredManifest
    generation: int


@dataclass(frozen=True, slots=True)
class StatusSnapshot:
    state: State
    checkpoint_id: str
    lease_expires_at: float | None
    admission_open: bool
    report: ReadinessReport
    retired_rollouts: int
    restored_pending: int
    facts: dict[str, str]
    counters: dict[str, int]
    last_part: LastPart | None


RESULTS_PAGE_SIZE = 100
"""ListResults' page when none is asked for: results are larger than episodes."""


class ControlViews:
    """The read-only views of a control plane (see the module docstring) over its state
    machine and participant."""

    participant: Participant
    retired_attempts: RetiredAttempts
    part_chains: PartChains
    _last_part: LastPart | None
    _machine: StateMachine

    @property
    def last_part(self) -> LastPart | None:
        """The last part published since the last Restore: a Restore abandons the history
        before it (a fresh process restored from the same checkpoint has published nothing),
        and an asynchronous write cut before the Restore that ends after it is not this
        history's part either."""
        last = self._last_part
        return last if last is not None and last.generation == self.part_chains.generation else None

    @property
    def state(self) -> State:
        return self._machine.state

    @property
    def active_checkpoint_id(self) -> str | None:
        return self._machine.active_id

    @property
    def admission_open(self) -> bool:
        return self._machine.admission_open

    @property
    def shutting_down(self) -> bool:
        return self._machine.shutting_down

    @property
    def start_closed_pending(self) -> bool:
        """The data plane is sealed: a `start_closed` process before its restore or resume,
        or one whose rejoining restore is under way (`ParticipantContext`)."""
        return self._machine.awaiting_restore

    @property
    def lease_expires_at(self) -> float | None:
        return self._machine.lease.expires_at

    def readiness_serving(self) -> bool:
        """The `participant-readiness` health answer: should new HTTP traffic come here?

        Not before a `start_closed` process is resumed, not while RESTORED (the restored
        state is not live until Resume), and not for a pause longer than the threshold;
        a short checkpoint pause keeps the pod in its Service so clients see no churn.
        """
        return self._machine.readiness_serving()

    def readiness_changes_at(self) -> float | None:
        """When `readiness_serving` flips without any event (a pause crossing the threshold)."""
        return self._machine.readiness_changes_at()

    async def status(self) -> StatusSnapshot:
        """What GetStatus reports, read after the participant refreshed it (`refresh`: a
        pool of workers reads their current state, not a copy up to 0.25 s old)."""
        await self.participant.refresh()
        machine = self._machine
        return StatusSnapshot(
            state=machine.state,
            checkpoint_id=machine.active_id or "",
            lease_expires_at=machine.lease.expires_at,
            admission_open=machine.admission_open,
            report=self.participant.report(),
            retired_rollouts=len(self.retired_attempts),
            restored_pending=len(self.participant.restored_pending()),
            facts=dict(self.participant.facts()),
            counters=dict(self.participant.counters()),
            last_part=self.last_part,
        )

    async def list_episodes(self, page_size: int, page_token: str) -> tuple[list[EpisodeInfo], str]:
        await self.participant.refresh()  # as `status`
        return page_of(self.participant.episodes(), page_size, page_token)

    async def list_results(
        self, page_size: int, page_token: str
    ) -> tuple[list[HeldResult], str, int, int]:
        """A page of the results held under receipts, the next token, how many are held and
        the cap (nothing held and cap 0 for a kind without an outbox)."""
        outbox = self.participant.result_outbox()
        held = outbox.results() if outbox is not None else []
        page, token = page_by_key(
            held, lambda h: h.episode_id.capture_key, page_size, page_token, RESULTS_PAGE_SIZE
        )
        return page, token, len(held), outbox.cap if outbox is not None else 0
