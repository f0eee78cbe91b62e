"""Policy staleness for any trainer: how far behind the current weights a continued rollout is.

After a restore a rollout cut mid-episode continues as attempt N+1, and its next turns are
sampled under whatever weights the policy model serves now, while its first turns were
sampled under the weights of their time. The policy model stamps every call with the weight
version it was admitted under (`SetWeightVersion`, `x-weight-version`), and ListEpisodes
tells, for each ledger a restore installed, the oldest version among its recorded calls.
`lagging(fleet, continued, policy)` measures, right after a restore and before anything is
dispatched, each continued rollout's lag (the model's current version minus its oldest
turn's) and returns those past the policy's bound; `StalenessPolicy.verdict` is the same
rule for one rollout. What to do with one past the bound (`Stale`):

* `continue`: continue it anyway (count it, so the lag is known);
* `regenerate`: do not continue it: retire it like any unfinished rollout and restart it
  from its input as a later attempt, all of it under the current weights;
* `drop`: retire it and record it as dropped (with `Lagging.reason`), never run again.

A rollout the models list no version for (no recorded call yet, or a model that does not
stamp) has no measurable lag and continues. `collect --max-policy-lag N --stale ...` is this
module applied by `collect` (`collect.staleness`).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from rollout_checkpoint.client.checkpointing import fanout
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

    def verdict(self, oldest: int | None, current: int) -> Stale | None:
        """What to do with a continued rollout whose oldest turn was sampled under weight
        version `oldest` (None: unknown) when the model serves `current`: None to continue
        it as it is (within the bound, no bound, or no measurable lag), else `action`."""
        if self.max_lag is None or oldest is None or current - oldest <= self.max_lag:
            return None
        return self.action


@dataclass(frozen=True)
class Lagging:
    """A continued rollout past the bound: its restored attempt and its lag in versions."""

    episode: EpisodeId
    """The continued attempt (N+1) the restore installed."""
    oldest: int
    """The weight version of its oldest recorded model call."""
    current: int
    """The weight version the policy model serves now."""

    @property
    def lag(self) -> int:
        """How many weight versions its oldest turn is behind."""
        return self.current - self.oldest

    def reason(self, max_lag: int) -> str:
        """The reason a dropped row records (`policy_lag: ...`)."""
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
        (lag for lag in found.values() if policy.verdict(lag.oldest, lag.current) is not None),
        key=lambda lag: lag.episode,
    )
