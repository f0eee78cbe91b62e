"""Episode steps: boundaries, parking, wait and replay steps — shared by agents and environments.

An episode is a sequence of steps. After each completed step its owner records a *boundary*
(JSON: what runs next and what it needs); a checkpoint can always be cut there. The rules:

* Recording a boundary while admission is closed *parks* the episode until resume; one woken
  by a resume stays parked if a new checkpoint closes before it runs again. Parked episodes
  are what a checkpoint exports.
* A `wait` step (the default; anything unsafe to run twice) blocks the checkpoint until it is
  done and the owner records the boundary after it.
* A `replay` step (idempotent: a model call whose response the model holds, a relay whose
  callee carries the episode, a pure verification) does not block: the episode counts as
  parked at the boundary *before* the step, and a result that arrives while admission is
  closed is held until resume, so an episode counted at its boundary never leaves it. After
  a crash the step simply runs again.
* Time parked does not count against the episode's own deadline.
* Retire marks the episode, cancels its task once and waits for it to end; it stays tracked
  until then, so a duplicate start of the same key is refused and a retry waits again. The
  cancellation goes through `cancel_request`, so the request ends as a 409 `stale_attempt`
  with one INFO line (request_endings.py), not as a logged traceback and a 500.
* A finished episode leaves only its outcome, kept while a checkpoint may still need it:
  until its reply is delivered, then until the checkpoint that could cut a caller holding
  it ends here (outcomes.py). So what an owner holds, and what its checkpoints name, is
  what is in flight, not its history.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rollout_checkpoint.server.core.episodes import EpisodeId
from rollout_checkpoint.server.episodic.outcomes import FinishedOutcomes
from rollout_checkpoint.server.runtime.attempts import RetiredAttempts
from rollout_checkpoint.server.runtime.participant import (
    AWAITING_RESTORE,
    AWAITING_RESTORE_DETAIL,
    MAX_LISTED_BLOCKERS,
    Blocker,
    BlockerReason,
    EpisodeInfo,
)
from rollout_checkpoint.server.runtime.record_stamps import RecordStamps
from rollout_checkpoint.server.runtime.request_endings import cancel_request


class StepMode(enum.StrEnum):
    """How a checkpoint treats one step of an episode (`EpisodeSteps.step`)."""

    WAIT = "wait"
    """The default: the checkpoint waits for the step; for anything unsafe to run twice."""
    REPLAY = "replay"
    """The checkpoint does not wait: the episode counts as parked at the boundary before the
    step, whose result is held until resume; after a crash the step runs again."""


class Phase(enum.StrEnum):
    """Where a tracked episode is; RUNNING and WAIT_STEP block a checkpoint."""

    RUNNING = "running"
    """Between boundaries: blocks until it records the next one or parks."""
    WAIT_STEP = "wait_step"
    """Inside a `wait` step: blocks until the step ends."""
    REPLAY_STEP = "replay_step"
    """Inside a `replay` step: exported at the boundary before the step."""
    PARKED = "parked"
    """At a boundary while admission is closed: exported, waiting for resume."""


class EpisodeRefused(Exception):
    """A data-plane refusal of an episode start (HTTP 409 with this code)."""

    def __init__(self, code: str, detail: str) -> None:
        super().__init__(detail)
        self.code = code
        self.detail = detail


class EpisodeRetired(Exception):
    """Raised inside an episode whose attempt was retired while it ran."""


NO_BOUNDARY = object()


@dataclass(eq=False)
class TrackedEpisode:
    """One live episode of an owner: its phase, its latest boundary (NO_BOUNDARY before the
    first), whether it is being retired or was restored, the task that runs it (a retire
    cancels that), and the clocks that keep time parked off its own deadline. Compared by
    identity: a new start of the same key is another episode."""

    episode_id: EpisodeId
    phase: Phase = Phase.RUNNING
    boundary: Any = NO_BOUNDARY
    retiring: bool = False
    restored: bool = False
    task: asyncio.Task[Any] | None = None
    parked_since: float | None = None
    parked_total: float = 0.0
    started_at: float = 0.0
    cancelled: bool = False

    @property
    def blocking(self) -> bool:
        """Whether it keeps the owner from a safe cut: running, in a wait step, or retiring."""
        return self.retiring or self.phase in (Phase.RUNNING, Phase.WAIT_STEP)

    def active_seconds(self, now: float) -> float:
        """Time the episode was not parked: what counts against its own deadline."""
        parked = self.parked_total + (
            now - self.parked_since if self.parked_since is not None else 0.0
        )
        return max(0.0, now - self.started_at - parked)


class EpisodeSteps:
    """Tracks the live episodes of one owner; all methods run on the event loop."""

    def __init__(
        self,
        retired: Callable[[], RetiredAttempts],
        changed: Callable[[], None],
        clock: Callable[[], float] = time.monotonic,
        *,
        sealed: Callable[[], bool] = lambda: False,
    ) -> None:
        """`sealed`: whether the owner is a `start_closed` process still waiting for its
        controller's Restore or Resume (its closed admission then refuses `awaiting_restore`)."""
        self._retired = retired
        self._sealed = sealed
        self._changed_callback = changed
        self._clock = clock
        self.episodes: dict[str, TrackedEpisode] = {}
        self._restored: dict[str, Any] = {}
        """Restored boundaries keyed by the replacement's capture key, handed out once."""
        self._outcomes = FinishedOutcomes()
        """Outcomes of finished episodes, keyed by capture key (see `finish`)."""
        self._blocking = 0
        self._served = False
        """An episode began here through the data plane (sticky): see `has_served`."""
        self._open = True
        self._opened = asyncio.Event()
        self._opened.set()
        self._changes = asyncio.Event()
        self.stamps: RecordStamps[str] = RecordStamps(
            lambda key: key in self.episodes or key in self._restored or key in self._outcomes
        )
        """The last change of each key's record (what an incremental export may reference):
        every method that changes what `export` returns for a key stamps it."""

    # -- admission ------------------------------------------------------------------------

    @property
    def admission_open(self) -> bool:
        """False from the participant's `close_admission` until its `open_admission`."""
        return self._open

    def close(self) -> None:
        """Close admission: new episodes are refused, boundaries recorded from now park."""
        self._open = False
        self._opened = asyncio.Event()
        self._notify()

    def open(self) -> None:
        """Open admission: parked episodes and held replay results continue, and the
        delivered outcomes kept for this checkpoint's callers go (see `delivered`)."""
        self._open = True
        self._opened.set()
        self._outcomes.checkpoint_ended(len(self.episodes))
        self._notify()

    async def wait_open(self) -> None:
        """Wait until admission is open *and stays so until this task runs*."""
        while not self._open:
            await self._opened.wait()
            await asyncio.sleep(0)  # let a new close that raced the wake-up take effect

    # -- lifecycle ------------------------------------------------------------------------

    def begin(self, episode_id: EpisodeId) -> tuple[TrackedEpisode, Any]:
        """Start an episode; returns it and its restored boundary (NO_BOUNDARY when none).

        Refused: a retired attempt (`stale_attempt`), a key already live (`episode_running`),
        a new episode while admission is closed: `awaiting_restore` in a `start_closed` process
        before its Restore or Resume (no checkpoint is in progress), else `admission_closed`."""
        key = episode_id.capture_key
        if self._retired().is_retired(episode_id):
            raise EpisodeRefused("stale_attempt", f"attempt {key} was retired")
        if key in self.episodes:
            raise EpisodeRefused("episode_running", f"episode {key} is already running here")
        if not self._open:
            if self._sealed():
                raise EpisodeRefused(AWAITING_RESTORE, AWAITING_RESTORE_DETAIL)
            raise EpisodeRefused(
                "admission_closed", "a checkpoint is in progress; retry after resume"
            )
        self._served = True
        self._outcomes.discard(key)  # a new run of the key supersedes its old outcome
        restored = self._restored.pop(key, NO_BOUNDARY)
        episode = TrackedEpisode(
            episode_id, restored=restored is not NO_BOUNDARY, started_at=self._clock()
        )
        if restored is not NO_BOUNDARY:
            episode.boundary = restored
        episode.task = asyncio.current_task()
        self.episodes[key] = episode
        self.stamps.touch(key)
        self._outcomes.saw_live(len(self.episodes))
        self._set_blocking(episode, True)
        self._notify()
        return episode, restored

    def finish(self, episode: TrackedEpisode, outcome: Any) -> None:
        """End an episode and keep its outcome as its last boundary, until it is released.

        The reply that carries the outcome to the caller can still be on the wire when a
        checkpoint cuts the fleet: the caller (which prepared first) still holds the episode,
        and this owner no longer does. A commit whose scope names the episode exports the
        outcome, so a restored replacement delivers it instead of running the episode again.
        While the reply is on the wire ListEpisodes lists the episode, so a derived scope
        names it too. Once `delivered`, the outcome is no longer listed and goes at this
        owner's next commit or reopening: kept for ever, every finished episode would stay
        in memory and in every later derived scope (outcomes.py states the whole rule).
        """
        self._outcomes.finished(episode.episode_id.capture_key, outcome)
        self.stamps.touch(episode.episode_id.capture_key)
        self.end(episode)

    def delivered(self, episode_id: EpisodeId) -> None:
        """The last body of the reply that carried `episode_id`'s outcome was handed to the
        HTTP server (`ReplyDeliveryMiddleware` calls this; a no-op for an episode that left
        no outcome on the wire).

        The outcome leaves ListEpisodes at once, so no later derived scope names it. It is
        kept, unlisted, only until this owner's next commit or reopening, and only among the
        last max(64, most episodes live here at once) deliveries: a caller that prepared
        before this owner may hold the reply unread, cut at the boundary before its call, and
        its replacement's call must get this outcome rather than run the episode again."""
        self._outcomes.delivered(episode_id.capture_key)
        self._notify()

    def delivery_failed(self, episode_id: EpisodeId) -> None:
        """The reply carrying `episode_id`'s outcome never reached the HTTP server (its send
        or the app raised): the outcome stays, unlisted, for a controller that still counts
        the episode in flight and names it, until a commit leaves it out (or FINISHED_KEPT
        newer failures push it out). A no-op for an episode with no outcome on the wire."""
        self._outcomes.failed(episode_id.capture_key)
        self._notify()

    def receipted(self, episode_id: EpisodeId) -> None:
        """The result of `episode_id`'s run is held in the result outbox under a receipt
        until its caller acknowledges it: the outcome kept for a caller without one goes
        (the outbox offers the result again, after a crash too; kept both ways, a checkpoint
        would carry it twice)."""
        self._outcomes.discard(episode_id.capture_key)
        self._notify()

    def committed(self, scope: frozenset[EpisodeId] | None) -> None:
        """This owner's part of a checkpoint of `scope` is written, with every outcome the
        scope names: release delivered outcomes, and with an explicit scope every outcome it
        leaves out (the controller no longer continues those episodes)."""
        self._outcomes.committed(scope, len(self.episodes))
        self.stamps.prune()
        self._notify()

    def end(self, episode: TrackedEpisode) -> None:
        """Stop tracking `episode` (no outcome kept: a checkpoint no longer exports it).
        Idempotent, and a no-op for an episode already replaced under its key; call it in a
        `finally` so a failed episode never blocks a checkpoint forever."""
        if self.episodes.get(episode.episode_id.capture_key) is episode:
            self._set_blocking(episode, False)
            del self.episodes[episode.episode_id.capture_key]
            self.stamps.touch(episode.episode_id.capture_key)
            self._notify()

    async def boundary(self, episode: TrackedEpisode, value: Any) -> None:
        """Record a boundary; park there while admission is closed."""
        self._check_live(episode)
        episode.boundary = value
        self.stamps.touch(episode.episode_id.capture_key)
        await self._park_while_closed(episode)
        self._set_phase(episode, Phase.RUNNING)

    async def park(self, episode: TrackedEpisode) -> None:
        """Park at the last boundary (e.g. a callee refused: admission closed there) until
        this owner's admission is open again."""
        self._check_live(episode)
        self._set_phase(episode, Phase.PARKED)
        self._start_parked_clock(episode)
        try:
            await self.wait_open()
        finally:
            self._stop_parked_clock(episode)
        self._check_live(episode)
        self._set_phase(episode, Phase.RUNNING)

    @contextlib.asynccontextmanager
    async def step(
        self, episode: TrackedEpisode, mode: StepMode, *, hold_result: bool = True
    ) -> AsyncIterator[None]:
        """Run one step. A replay step's result arriving during a checkpoint is held until
        resume: the episode is still logically at the boundary before the step.

        With `hold_result=False` the owner records the result as the next boundary itself
        (right after the step, with no await in between), so a checkpoint exports the result
        instead of the step: used when running the step again would redo finished work."""
        self._check_live(episode)
        self._set_phase(episode, Phase.WAIT_STEP if mode is StepMode.WAIT else Phase.REPLAY_STEP)
        try:
            yield
        except BaseException:
            if episode.phase is not Phase.PARKED:
                self._set_phase(episode, Phase.RUNNING)
            raise
        if mode is StepMode.REPLAY and not self._open and hold_result:
            await self._park_while_closed(episode)
        self._check_live(episode)
        self._set_phase(episode, Phase.RUNNING)

    async def _park_while_closed(self, episode: TrackedEpisode) -> None:
        if self._open:
            return
        self._set_phase(
            episode, Phase.PARKED if episode.phase is not Phase.REPLAY_STEP else Phase.REPLAY_STEP
        )
        self._start_parked_clock(episode)
        try:
            await self.wait_open()
        finally:
            self._stop_parked_clock(episode)
        self._check_live(episode)

    def _start_parked_clock(self, episode: TrackedEpisode) -> None:
        if episode.parked_since is None:
            episode.parked_since = self._clock()

    def _stop_parked_clock(self, episode: TrackedEpisode) -> None:
        if episode.parked_since is not None:
            episode.parked_total += self._clock() - episode.parked_since
            episode.parked_since = None

    def _check_live(self, episode: TrackedEpisode) -> None:
        if episode.retiring or self._retired().is_retired(episode.episode_id):
            raise EpisodeRetired(episode.episode_id.capture_key)

    def _set_phase(self, episode: TrackedEpisode, phase: Phase) -> None:
        was = episode.blocking
        episode.phase = phase
        if episode.blocking != was:
            self._blocking += 1 if episode.blocking else -1
        self._notify()

    def _set_blocking(self, episode: TrackedEpisode, added: bool) -> None:
        if episode.blocking:
            self._blocking += 1 if added else -1

    def _notify(self) -> None:
        event, self._changes = self._changes, asyncio.Event()
        event.set()
        self._changed_callback()

    # -- participant side ---------------------------------------------------------------

    def ready(self) -> bool:
        """No episode blocks (O(1): the blocking ones are counted as they change)."""
        return self._blocking == 0

    def blockers(self) -> tuple[list[Blocker], int]:
        """The first 100 blockers by capture key, and the count of all of them."""
        keys = sorted(k for k, e in self.episodes.items() if e.blocking)
        listed = [
            Blocker(
                k,
                BlockerReason.EPISODE_STEP_RUNNING,
                "being retired" if self.episodes[k].retiring else self.episodes[k].phase.value,
            )
            for k in keys[:MAX_LISTED_BLOCKERS]
        ]
        return listed, self._blocking

    def counts(self) -> dict[str, int]:
        """The readiness report's gauges: live episodes, parked ones, restored pending, and
        the outcomes of finished episodes still kept."""
        parked = sum(
            1 for e in self.episodes.values() if e.phase in (Phase.PARKED, Phase.REPLAY_STEP)
        )
        return {
            "episodes": len(self.episodes),
            "parked": parked,
            "restored_pending": len(self._restored),
            "outcomes": len(self._outcomes),
        }

    def export(self, scope: frozenset[EpisodeId] | None) -> list[tuple[EpisodeId, Any]]:
        """The latest boundary of every parked or replay-step episode that is not retired
        (None for one with no boundary yet: it starts over), plus restored boundaries whose
        replacement has not started here, re-exported under that replacement (N+1)."""
        exported: list[tuple[EpisodeId, Any]] = []
        for episode in self.episodes.values():
            if (
                episode.retiring
                or episode.blocking
                or self._retired().is_retired(episode.episode_id)
            ):
                continue
            if scope is not None and episode.episode_id not in scope:
                continue
            boundary = None if episode.boundary is NO_BOUNDARY else episode.boundary
            exported.append((episode.episode_id, boundary))
        for key, boundary in self._restored.items():
            episode_id = EpisodeId.from_capture_key(key)
            if scope is None or episode_id in scope:
                exported.append((episode_id, boundary))
        if scope is not None:  # finished episodes are not live: only an explicit scope names them
            for key, outcome in self._outcomes.items():
                episode_id = EpisodeId.from_capture_key(key)
                if (
                    episode_id in scope
                    and key not in self.episodes
                    and not self._retired().is_retired(episode_id)
                ):
                    exported.append((episode_id, outcome))
        return sorted(exported, key=lambda item: item[0])

    def install(self, restored: Mapping[EpisodeId, Any]) -> None:
        """Hold restored boundaries until each replacement's start claims its own, once."""
        for episode_id, boundary in restored.items():
            self._restored[episode_id.capture_key] = boundary
            self.stamps.touch(episode_id.capture_key)
        self._notify()

    def restored_pending(self) -> frozenset[EpisodeId]:
        """Restored boundaries whose replacement has not begun here yet."""
        return frozenset(EpisodeId.from_capture_key(k) for k in self._restored)

    def discard_installed(self, episodes: Iterable[EpisodeId]) -> None:
        """Drop the restored boundaries of `episodes` that no replacement claimed, leaving no
        mark (see `Participant.discard_installed`). A claimed one began an episode here: the
        process has served, and that episode is stopped by a retire, not discarded."""
        for episode in episodes:
            self._restored.pop(episode.capture_key, None)
        self._notify()

    def drop_restored(self, episode: EpisodeId) -> None:
        """Drop the restored boundaries and kept outcomes of every attempt <= `episode`'s
        of its rollout (a retire: nothing may continue them any more)."""
        for key in [k for k in self._restored if _covers(episode, EpisodeId.from_capture_key(k))]:
            del self._restored[key]
        self._outcomes.drop(lambda other: _covers(episode, other))

    def forget(self, rollout_ids: Iterable[str]) -> None:
        """The controller is done with these rollouts: their outcomes are no longer needed."""
        forgotten = set(rollout_ids)
        self._outcomes.drop(lambda episode: episode.rollout_id in forgotten)

    async def retire(self, episode: EpisodeId) -> None:
        """Stop and forget every covered attempt: cancel once, wait for the end (its final
        cleanup is never interrupted twice), drop covered restored boundaries."""
        self.drop_restored(episode)
        covered = [e for e in self.episodes.values() if _covers(episode, e.episode_id)]
        for tracked in covered:
            if not tracked.retiring:
                was = tracked.blocking
                tracked.retiring = True
                if not was:
                    self._blocking += 1
            if (
                tracked.task is not None
                and not tracked.cancelled
                and tracked.task is not asyncio.current_task()
            ):
                tracked.cancelled = True
                detail = f"attempt {tracked.episode_id.capture_key} was retired"
                cancel_request(tracked.task, "stale_attempt", detail)
        self._notify()
        while any(e.episode_id.capture_key in self.episodes for e in covered):
            changes = self._changes
            await changes.wait()

    def has_served(self) -> bool:
        """An episode began here (even one that failed and left nothing), or restored
        boundaries are held. A refused or invalid start began nothing."""
        return self._served or bool(self.episodes) or bool(self._restored) or bool(self._outcomes)

    def forget_served(self) -> None:
        """A rejoining restore retired every live and restored episode: forget having served
        (the sticky flag and the finished outcomes) so the restore may install here. An
        outcome was kept only for a checkpoint cut while its reply travelled; the restore
        brings back whatever the last checkpoint holds of it. Live episodes (none, unless
        one was not retired) still count in `has_served`."""
        self._served = False
        self._outcomes.drop(lambda episode: True)

    def episode_infos(self) -> list[EpisodeInfo]:
        """Every live episode, every restored pending one, and every finished one whose
        reply is still on the wire (at its last boundary: its outcome), for ListEpisodes.
        Never a finished episode whose reply was delivered (see `delivered`)."""
        infos = [
            EpisodeInfo(e.episode_id, at_boundary=not e.blocking, restored_pending=False)
            for e in self.episodes.values()
        ]
        infos.extend(
            EpisodeInfo(EpisodeId.from_capture_key(k), at_boundary=True, restored_pending=True)
            for k in self._restored
        )
        infos.extend(
            EpisodeInfo(EpisodeId.from_capture_key(k), at_boundary=True)
            for k in self._outcomes.on_wire()
            if k not in self.episodes and k not in self._restored
        )
        return infos

    def live(self) -> Sequence[TrackedEpisode]:
        """A snapshot of the live episodes (safe to iterate while they change)."""
        return list(self.episodes.values())


def _covers(retired: EpisodeId, other: EpisodeId) -> bool:
    return other.rollout_id == retired.rollout_id and other.attempt <= retired.attempt


def episodes_in(keys: Iterable[str]) -> list[EpisodeId]:
    """The episodes these capture keys name (ValueError for an invalid key)."""
    return [EpisodeId.from_capture_key(k) for k in keys]
