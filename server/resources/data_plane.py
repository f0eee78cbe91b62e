"""The data-plane half of the resources participant: what the admission middleware calls.

A resources server keeps tool state under a session id (the signed cookie, or an MCP session
token). The middleware (middleware.py) calls these methods around every request, on the
event loop and synchronously (except the waits), so no cancellation can fall between a
request's end and its count. They learn each session's lifecycle from `/seed_session`,
`/verify` and `/close_session`, count requests and seeds in flight, and decide which request
is refused (`refusal`, whose docstring orders the rules and says why). The control plane's
half (export, install, retire: `participant.ResourcesParticipant`) reads what they track and
waits on the same change event (`_wait_change`).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Mapping

from rollout_checkpoint.server.core.episodes import EpisodeId
from rollout_checkpoint.server.resources.change_log import ChangeLog
from rollout_checkpoint.server.resources.session_table import SessionTable, TrackedSession
from rollout_checkpoint.server.runtime.participant import (
    AWAITING_RESTORE,
    AWAITING_RESTORE_DETAIL,
    ParticipantContext,
)

_STALE = ("stale_attempt", "this attempt was retired")
_MISMATCH = (
    "episode_mismatch",
    "this session belongs to another episode: use its own rollout prefix",
)
_CLOSED = ("admission_closed", "a checkpoint is in progress; retry after resume")


class SessionDataPlane:
    """Sessions tracked per episode from the routes that define their lifecycle, requests and
    seeds counted, refusals decided (see the module docstring). The sessions themselves,
    their indexes and blocker sets live in a `SessionTable`; this class decides when they
    change."""

    context: ParticipantContext

    def __init__(self, *, restart_only: bool, ended_limit: int = 0) -> None:
        self._table = SessionTable(
            restart_only=restart_only, ended_limit=ended_limit, touched=self._touch
        )
        self._seeding: dict[EpisodeId, int] = {}
        self._binding: dict[str, tuple[EpisodeId, int]] = {}
        """Untracked sessions with a seed running under a prefix: the episode the seed will
        bind them to, and how many such seeds run. A concurrent request naming another episode
        is refused, so two racing first seeds cannot bind one session twice."""
        self.inflight = 0
        self.waiting = 0
        """Requests (MCP calls, closes) waiting for a resume; never in flight, never blockers."""
        self._inflight_without_session = 0
        self._admission_open = True
        self._shutting_down = False
        self._served = False
        """The data plane tracked or used a session (sticky): see `has_served`."""
        self._change_clock = 0
        """Raised by every `touch`: a session's `last_change` is the clock at its last one."""
        self._change_lock = threading.Lock()
        """`checkpoint_session_changed` may be called from a thread of the server's own (a
        sandbox, a worker pool): an increment torn by a thread switch could stamp a change
        below a cut already taken, and the session would count as unchanged after it. It
        guards the change log too (`change_log`)."""
        self._change_log = ChangeLog()
        """The sessions touched, by last touch: an incremental export reads what changed
        since its base's cut from it (`ResourcesParticipant.export_changes`)."""
        self._changed: asyncio.Event | None = None

    @property
    def sessions(self) -> Mapping[str, TrackedSession]:
        """Every tracked session by id (read-only: only the participant changes the table)."""
        return self._table.sessions

    @property
    def retired_sessions(self) -> Mapping[str, EpisodeId]:
        """Sessions of retired attempts, refused (`stale_attempt`) until their rollout is forgotten."""
        return self._table.retired_sessions

    # -- notifications ------------------------------------------------------------------

    def _notify(self) -> None:
        """Wake this participant's waiters and the control plane's. Called twice per request,
        so the event is made only when something waits (`_wait_change`)."""
        event, self._changed = self._changed, None
        if event is not None:
            event.set()
        self.context.changed()

    async def _wait_change(self) -> None:
        if self._changed is None:
            self._changed = asyncio.Event()
        await self._changed.wait()

    # -- changes ------------------------------------------------------------------------

    def touch(self, session_id: str | None) -> None:
        """Something may have changed this session's state (a request began or ended on it,
        a seed, a close, a verify, or the server said so): an incremental part must export
        it again. Called at a request's start *and* end, so a request that overlaps a cut
        (a replay-safe seed or verify runs during an export) leaves its session changed."""
        self._touch(self._table.get(session_id))

    def _touch(self, session: TrackedSession | None) -> None:
        with self._change_lock:
            self._change_clock += 1
            if session is not None:
                session.last_change = self._change_clock
                self._change_log.note(session, self._change_clock, len(self._table.sessions))

    # -- data plane: called by the middleware, all synchronous except the waits ---------

    @property
    def admission_open(self) -> bool:
        """False from Prepare until Resume: requests that are not replay-safe are refused."""
        return self._admission_open

    @property
    def sealed(self) -> bool:
        """A `start_closed` process before its Restore or Resume: nothing may start here, not
        even a replay-safe seed, or the process would have served and could not restore."""
        return self.context.start_closed_pending

    @property
    def shutting_down(self) -> bool:
        """True once SIGTERM arrived: waiting requests are answered 503 instead of run."""
        return self._shutting_down

    async def wait_for_admission(self) -> bool:
        """Wait until admission opens; False when the server shuts down first."""
        if self._admission_open:
            return not self._shutting_down
        self.waiting += 1
        self._notify()
        try:
            while not self._admission_open and not self._shutting_down:
                await self._wait_change()
        finally:
            self.waiting -= 1
            self._notify()
        return not self._shutting_down

    def refusal(
        self,
        session_id: str | None,
        episode: EpisodeId | None,
        *,
        close: bool = False,
        replay_safe: bool = False,
    ) -> tuple[str, str] | None:
        """`(code, detail)` of the 409 a data-plane request on `session_id` under `episode`'s
        prefix gets, or None to admit it; the first rule that applies, in this order:

        * `stale_attempt` (never for a `close`): the request belongs to a retired attempt, by
          its prefix's episode or by its session's, so a late call cannot recreate freed
          state;
        * `episode_mismatch`: the prefix names another episode than its session's. A session
          belongs to one episode for its whole life: re-binding it would untrack the episode
          it served (its state silently leaves every later checkpoint), and any tracked
          cookie could act on a made-up rollout. A session not tracked yet is bound by a seed
          still running under a prefix, so a racing request cannot bind it elsewhere either;
        * `awaiting_restore`: the data plane is sealed (`sealed`);
        * `admission_closed` (never for a `replay_safe` request): a checkpoint is open.

        One call that looks the session up once: asked as four predicates (each reaching the
        table and the control plane on its own), the rules cost about twice as much per
        request as the rest of the admission middleware."""
        session = self._table.sessions.get(session_id) if session_id is not None else None
        if not close:
            retired = self.context.retired
            if episode is not None and retired.is_retired(episode):
                return _STALE
            if session_id is not None and (
                session_id in self._table.retired_sessions
                or (
                    session is not None
                    # The same object is the same answer as the prefix's, just asked.
                    and session.episode is not episode
                    and retired.is_retired(session.episode)
                )
            ):
                return _STALE
        if session_id is not None and episode is not None:
            if session is not None:
                # Mostly the very object: the rollout prefix's parsing cache hands out one
                # EpisodeId per capture key, and the seed bound the session to it.
                if session.episode is not episode and session.episode != episode:
                    return _MISMATCH
            else:
                binding = self._binding.get(session_id)
                if binding is not None and binding[0] != episode:
                    return _MISMATCH
        if self.context.start_closed_pending:
            return AWAITING_RESTORE, AWAITING_RESTORE_DETAIL
        if not replay_safe and not self._admission_open:
            return _CLOSED
        return None

    def claim(self, session_id: str | None) -> None:
        """An admitted request used this session: it is no longer restored pending.

        Also for the requests that are not counted in flight (a seed retry, a replay verify):
        whatever ran on restored state continues it, so a commit must not free it as unused."""
        session = self._table.get(session_id)
        self._touch(session)
        if session is not None:
            session.restored_pending = False
            self._served = True

    def request_started(self, session_id: str | None) -> TrackedSession | None:
        """Count a request in flight (per participant and per session); claims a restored session.

        Returns what was counted, to hand back to `request_finished`: the session may be
        untracked (closed, retired) before the request ends, and the decrement must undo
        exactly this increment."""
        self.inflight += 1
        session = self._table.sessions.get(session_id) if session_id is not None else None
        if session is None:
            self._inflight_without_session += 1
        else:
            self._table.request_started(session)
            session.restored_pending = False  # claimed, as `claim` does
            self._served = True
        self._touch(session)
        self._notify()
        return session

    def request_finished(self, counted: TrackedSession | None) -> None:
        """Synchronous, so no cancellation between the request's end and this can skip it."""
        self.inflight -= 1
        if counted is None:
            self._inflight_without_session -= 1
        else:
            self._table.request_finished(counted)
        self._touch(counted)
        self._notify()

    def seed_started(self, episode: EpisodeId | None, session_id: str | None) -> None:
        """A seed was admitted. A seed of a tracked session is a retry and claims it."""
        self.claim(session_id)
        if episode is None:
            return
        self._seeding[episode] = self._seeding.get(episode, 0) + 1
        if session_id is not None and session_id not in self._table.sessions:
            _, running = self._binding.get(session_id, (episode, 0))
            self._binding[session_id] = (episode, running + 1)

    def seed_finished(
        self,
        episode: EpisodeId | None,
        session_id_before: str | None,
        session_id: str | None,
        *,
        succeeded: bool,
    ) -> None:
        """`session_id_before`: the session the request came with (what `seed_started` saw);
        `session_id`: the one the seed left in the cookie (a new session has none before).

        A seed that ends while admission is closed is not the open checkpoint's (its
        episode's boundary precedes it). One that began in a closed window but ends after the
        reopen is an ordinary session: that window is over, and marking it would leave it out
        of the *next* checkpoint too (the mark clears only at a reopen), a live session lost
        to the crash after it."""
        if episode is not None:
            self._seeding[episode] -= 1
            if not self._seeding[episode]:
                del self._seeding[episode]
            self._unbind(session_id_before)
        if succeeded and episode is not None and session_id is not None:
            self._track(session_id, episode, seeded_while_closed=not self._admission_open)
        self.touch(session_id_before)
        self.touch(session_id)
        self._notify()

    def session_started(self, session_id: str, episode: EpisodeId) -> None:
        """For servers whose sessions begin outside `/seed_session` (a Gymnasium `/reset`)."""
        self._track(session_id, episode, seeded_while_closed=not self._admission_open)
        self.touch(session_id)
        self._notify()

    def session_ended(self, session_id: str | None, *, deferred: bool = False) -> None:
        """A successful close or verify. A replay verify during a checkpoint ends the session only
        at reopen, so that checkpoint still exports it: the restore re-runs the verify. An
        ended session is no longer live (`SessionTable.end`)."""
        session = self._table.get(session_id)
        if session is None:
            return
        self._touch(session)
        if deferred:
            self._table.defer_end(session)
            return
        self._table.end(session.session_id)
        self._notify()

    # -- tracking -----------------------------------------------------------------------

    def _unbind(self, session_id: str | None) -> None:
        binding = self._binding.get(session_id) if session_id is not None else None
        if binding is None:
            return
        assert session_id is not None
        episode, running = binding
        if running > 1:
            self._binding[session_id] = (episode, running - 1)
        else:
            del self._binding[session_id]

    def _track(self, session_id: str, episode: EpisodeId, *, seeded_while_closed: bool) -> None:
        """Track a session the data plane began (see `SessionTable.track`): it has served."""
        if self._table.track(session_id, episode, seeded_while_closed=seeded_while_closed):
            self._served = True
