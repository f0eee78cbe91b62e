"""`collect --max-policy-lag N --stale continue|regenerate|drop`: the staleness rule of
`client.staleness` applied by `collect` right after a restore, before anything is dispatched.

A continued rollout past the bound is, by `--stale`: continued anyway (counted);
regenerated (retired like any unfinished rollout, restarted from its input as a later
attempt); or dropped (retired, recorded with `status: "dropped"` and the reason, written
with its prompt group once the group is sealed, never run again).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from rollout_checkpoint.client.collect.rollouts import Rollout, RolloutBook, Status
from rollout_checkpoint.client.collect.view import CollectView
from rollout_checkpoint.client.fleet import Fleet
from rollout_checkpoint.client.staleness import Stale, StalenessPolicy, lagging
from rollout_checkpoint.server.core.episodes import EpisodeId

RecordDropped = Callable[[Rollout, str], Awaitable[None]]
"""Records a rollout's dropped line (with the reason): settled, never sent again, written
with its prompt group once the group is sealed (`groups`)."""


@dataclass
class StaleHandling:
    """Applies the policy to what a restore continues (`screen`), and records the rollouts
    it dropped once they are retired everywhere (`drop_pending`)."""

    policy: StalenessPolicy
    book: RolloutBook
    view: CollectView
    record_dropped: RecordDropped
    _to_drop: dict[str, str] = field(default_factory=dict)

    async def screen(self, fleet: Fleet, continued: Sequence[EpisodeId]) -> set[str]:
        """The rollouts of `continued` (restored N+1) NOT to continue: past the bound, to
        regenerate or drop. They are then retired and restarted like any unfinished rollout
        (and the dropped ones recorded by `drop_pending` instead of being sent)."""
        stale = await lagging(fleet, continued, self.policy)
        if not stale or self.policy.max_lag is None:
            return set()
        counts, action = self.book.counts, self.policy.action
        self.view.note(
            f"collect: {len(stale)} continued rollout(s) past --max-policy-lag "
            f"{self.policy.max_lag} (the first: {stale[0].reason(self.policy.max_lag)}): {action}"
        )
        if action is Stale.CONTINUE:
            counts.stale_continued += len(stale)
            return set()
        if action is Stale.REGENERATE:
            counts.stale_regenerated += len(stale)
        else:
            for lag in stale:
                self._to_drop[lag.episode.rollout_id] = lag.reason(self.policy.max_lag)
        return {lag.episode.rollout_id for lag in stale}

    async def drop_pending(self) -> None:
        """Record every rollout `screen` dropped (retired everywhere by now), never sent.
        One whose reply was already on the wire when it was screened finished on its own
        meanwhile (held for its group, or written): its result stands, nothing is dropped."""
        for rollout_id, reason in sorted(self._to_drop.items()):
            rollout = self.book.rollouts[rollout_id]
            if rollout.status not in (Status.HELD, Status.DONE, Status.FAILED):
                await self.record_dropped(rollout, reason)
        self._to_drop.clear()
