"""Policy staleness: a rollout continued after a restore may be sampled under newer weights.

After a restore a rollout cut mid-episode continues as attempt N+1, and its next turns are
sampled under whatever weights the policy model serves now, while its first turns were
sampled under the weights of their time. The policy model stamps every call with the weight
version it was admitted under (`SetWeightVersion`, `x-weight-version`), and ListEpisodes
tells, for each ledger a restore installed, the oldest version among its recorded calls. So
right after a restore, before anything is dispatched, `collect --max-policy-lag N` measures
each continued rollout's lag (the model's current version minus its oldest turn's) and,
past N, applies `--stale`:

* `continue`: continue it anyway (counted, so the lag is known);
* `regenerate`: do not continue it: it is retired like any unfinished rollout and restarts
  from its input as a later attempt, all of it under the current weights;
* `drop`: retire it and record it as dropped (`status: "dropped"`, with the reason), never
  run again.

A rollout the models list no version for (no recorded call yet, or a model that does not
stamp) has no measurable lag and continues.
"""

from __future__ import annotations

import enum
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from rollout_checkpoint.client.checkpointing import fanout
from rollout_checkpoint.client.collect.rollouts import Rollout, RolloutBook
from rollout_checkpoint.client.collect.view import CollectView
from rollout_checkpoint.client.fleet import Fleet
from rollout_checkpoint.server.core.episodes import EpisodeId
from rollout_checkpoint.v1 import types_pb2

WEIGHT_VERSION = "weight_version"
"""The policy model's GetStatus counter of its current weight version."""


class Stale(enum.StrEnum):
    """What `--stale` does with a rollout continued past `--max-policy-lag`."""

    CONTINUE = "continue"
    """Continue it anyway (counted in the summary)."""
    REGENERATE = "regenerate"
    """Retire it and restart it from its input as a later attempt."""
    DROP = "drop"
    """Retire it and record it as dropped, with the reason; never sent again."""


@dataclass(frozen=True)
class StalenessPolicy:
    """`--max-policy-lag` (None: no bound) and `--stale`."""

    max_lag: int | None = None
    """The most weight versions a continued rollout's oldest turn may lag (None: no bound)."""
    action: Stale = Stale.REGENERATE
    """What happens to a continued rollout past `max_lag`."""


@dataclass(frozen=True)
class Lagging:
    """A continued rollout past the bound: its restored attempt and its lag in versions."""

    episode: EpisodeId
    oldest: int
    current: int

    @property
    def lag(self) -> int:
        return self.current - self.oldest

    def reason(self, max_lag: int) -> str:
        return (
            f"policy_lag: its oldest turn was sampled under weight version {self.oldest}, "
            f"{self.lag} behind the current {self.current} (--max-policy-lag {max_lag})"
        )


async def lagging(
    fleet: Fleet, continued: Sequence[EpisodeId], policy: StalenessPolicy
) -> list[Lagging]:
    """The continued (restored N+1) episodes whose oldest turn is more than the policy's
    bound behind the policy model's current weights, as the models list them now."""
    if policy.max_lag is None or not continued:
        return []
    models = [m for m in fleet.members if m.kind == types_pb2.PARTICIPANT_KIND_MODEL]
    if not models:
        return []
    statuses = await fanout.fan_out(
        "status", models, lambda m: m.client.get_status(), fleet.spec.fan_out
    )
    episodes = await fanout.fan_out(
        "episodes", models, lambda m: m.client.all_episodes(), fleet.spec.fan_out
    )
    wanted = set(continued)
    found: dict[EpisodeId, Lagging] = {}
    for name, listed in episodes.items():
        current = statuses[name].counters.get(WEIGHT_VERSION, 0)
        for episode in listed:
            if not episode.HasField("oldest_weight_version"):
                continue
            key = EpisodeId(episode.episode_id.rollout_id, episode.episode_id.attempt)
            if key not in wanted:
                continue
            lag = Lagging(key, episode.oldest_weight_version, current)
            if key not in found or found[key].lag < lag.lag:
                found[key] = lag
    return sorted(
        (lag for lag in found.values() if lag.lag > policy.max_lag), key=lambda lag: lag.episode
    )


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
        """Record every rollout `screen` dropped (retired everywhere by now), never sent."""
        for rollout_id, reason in sorted(self._to_drop.items()):
            await self.record_dropped(self.book.rollouts[rollout_id], reason)
        self._to_drop.clear()
