"""The staging round of generation cuts at a Prepare's close (generation_cuts.py says why).

Each rule keeps a cut an optimisation that can never cost the checkpoint:

* One round per close, asked of the backend once for all the calls: the Prepare waits for it
  (a `STAGING_GENERATION_CUTS` blocker), so its cost must be one backend round, not one per
  call.
* The round is bounded by half the Prepare time left: the Prepare must still reach PREPARED
  before its deadline with the other half.
* At most one call per episode, the last admitted: an episode has at most one call its agent
  will re-issue (the one after its boundary). A streaming response is never cut: it is
  delivered (and blocks the Prepare) instead. A call cancelled by a retire is never cut.
* A timeout or failure is logged, never raised: what was not staged is generated again after
  a restore. A stop (the reopen, a shutdown) cancels the round: the calls go on and deliver.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable

from rollout_checkpoint.server.core.episodes import EpisodeId
from rollout_checkpoint.server.model.generation_cuts import (
    GenerationBackend,
    GenerationCut,
    conversation_digest,
)
from rollout_checkpoint.server.model.ledger import ModelCall
from rollout_checkpoint.server.runtime.participant import ParticipantContext

log = logging.getLogger(__name__)


class CutStaging:
    """The staging round of one model participant: running from a Prepare's close until the
    backend answered, the round's time bound passed, or the round was stopped."""

    def __init__(self, changed: Callable[[], None]) -> None:
        self._changed = changed
        self._task: asyncio.Task[None] | None = None
        self.calls: list[ModelCall] = []
        """The calls of the running round (each a blocker while it runs)."""

    @property
    def running(self) -> bool:
        return self._task is not None

    def start(
        self,
        backend: GenerationBackend | None,
        calls: Iterable[ModelCall],
        context: ParticipantContext,
    ) -> None:
        """At a Prepare's close: ask `backend` for a round for the last undelivered call of
        each episode, bounded by half the Prepare time left. Nothing without a backend, or while a round
        runs. Nor at a close for a Restore or a `start_closed` start (nothing of this process
        will be checkpointed), nor under a context that cannot tell the Prepare's time
        (`ControlPlane.prepare_seconds_left` can; a worker's bridge cannot): a round without a
        bound could make the Prepare miss its deadline."""
        prepare_seconds_left = getattr(context, "prepare_seconds_left", None)
        seconds_left = prepare_seconds_left() if callable(prepare_seconds_left) else None
        if backend is None or seconds_left is None or self._task is not None:
            return
        latest: dict[EpisodeId, ModelCall] = {}
        for call in calls:
            episode = call.episode
            if episode is None or call.streaming or call.retired:
                continue  # a streaming response blocks instead: it is delivered, never cut
            if episode not in latest or call.sequence > latest[episode].sequence:
                latest[episode] = call
        if not latest:
            return
        self.calls = sorted(latest.values(), key=lambda c: c.sequence)
        self._task = asyncio.ensure_future(self._stage(backend, self.calls, seconds_left / 2))

    async def _stage(
        self, backend: GenerationBackend, calls: list[ModelCall], budget: float
    ) -> None:
        """Ask the backend once; whatever it cannot stage in time is generated again after a
        restore. A failure is logged, never raised: a cut is an optimisation, not state."""
        try:
            async with asyncio.timeout(budget):
                staged = await backend.stage(calls)
            for call in calls:
                prefix = staged.get(call)
                if prefix is None or prefix.tokens < 1 or not prefix.text:
                    continue
                digest = conversation_digest(call.body)
                if digest is not None:
                    call.staged = GenerationCut(digest, prefix)
        except TimeoutError:
            log.warning(
                "generation cuts: the backend did not stage %d call(s) within %.3f s "
                "(half the prepare time left); they will be generated again after a restore",
                len(calls),
                budget,
            )
        except Exception:
            log.warning(
                "generation cuts: staging failed; the calls will be generated again after a "
                "restore",
                exc_info=True,
            )
        finally:
            if self._task is asyncio.current_task():
                self._task = None
                self.calls = []
            self._changed()

    def stop(self) -> None:
        """Cancel the running round, if any (the reopen, a shutdown)."""
        task, self._task, self.calls = self._task, None, []
        if task is not None:
            task.cancel()
