"""Retired-attempt marks: which attempts of which rollouts the data plane must refuse."""

from __future__ import annotations

from collections.abc import Iterable

from rollout_checkpoint.server.core.episodes import EpisodeId


class RetiredAttempts:
    """Per rollout, the highest retired attempt; a request of attempt <= mark is refused.

    Marks only rise. A caller's request sent just before its own retire travels on another
    connection and can arrive after the callee's retire completed; a mark that a later retire
    of an earlier attempt could lower would let that late request recreate state nothing frees.
    Marks go only when the controller forgets the rollout, once nothing of it can still run.
    """

    def __init__(self) -> None:
        self._highest: dict[str, int] = {}

    def mark(self, episode: EpisodeId) -> None:
        current = self._highest.get(episode.rollout_id, -1)
        self._highest[episode.rollout_id] = max(current, episode.attempt)

    def is_retired(self, episode: EpisodeId) -> bool:
        mark = self._highest.get(episode.rollout_id)
        return mark is not None and episode.attempt <= mark

    def highest(self, rollout_id: str) -> int | None:
        return self._highest.get(rollout_id)

    def forget(self, rollout_ids: Iterable[str]) -> None:
        for rollout_id in rollout_ids:
            self._highest.pop(rollout_id, None)

    def snapshot(self) -> dict[str, int]:
        """Every mark, rollout -> highest retired attempt: what a worker that joins later
        must refuse too (worker_bridge.py)."""
        return dict(self._highest)

    def __len__(self) -> int:
        return len(self._highest)
