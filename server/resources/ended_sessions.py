"""Sessions that ended (a successful `/verify` or `/close_session`), kept exportable.

Off by default (`CheckpointSettings.export_ended_sessions`): a resources participant stops
tracking a session when it ends, so no checkpoint carries it. `rollout-checkpoint certify`
compares each server's session state after a run with its baseline's ("no tool call applied
twice"), and every finished rollout's session has ended by then: without this its scoped
checkpoint would export nothing and the check would prove nothing. With it on, an ended
session stays here, outside the live table, until a Commit whose scope names its episode
exports it through the server's own `export_session_states`.

An ended session is never live: it blocks no Prepare, is not listed by ListEpisodes (a
controller would take it for a running episode and retire or continue it), is not counted
in any readiness report, and an unscoped Commit (every live episode) does not export it.
Held state must stay bounded, so an entry goes when its rollout is retired (the server's
`retire_session_state` frees it), when its id is tracked live again, when the server's export
no longer holds it, and, past `ENDED_SESSIONS_KEPT`, the oldest first. A Forget drops none:
a controller forgets a retired rollout once a *later* attempt of it finished (its reply is
durable), and that attempt's ended session is the rollout's final state, the very one a
scoped checkpoint after the run must export (the Retire already dropped the retired
attempts' own; a Forget waits for it).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from rollout_checkpoint.server.core.episodes import EpisodeId
from rollout_checkpoint.server.runtime.attempts import RetiredAttempts

if TYPE_CHECKING:  # the table imports this module
    from rollout_checkpoint.server.resources.session_table import TrackedSession

ENDED_SESSIONS_KEPT = 10_000
"""How many ended sessions a participant keeps exportable: the oldest to end goes first.
Far beyond a certify run's rollouts; it bounds what a long run with the setting on holds."""


class EndedSessions:
    """Ended sessions by id in the order they ended (oldest first), indexed by rollout so a
    scoped export or a retire costs O(its rollouts), not O(ended sessions).

    `limit` 0 keeps nothing: the setting is off, or the server exports no state."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._sessions: dict[str, TrackedSession] = {}
        self._by_rollout: dict[str, set[str]] = {}

    def __contains__(self, session_id: object) -> bool:
        return session_id in self._sessions

    def keep(self, session: TrackedSession) -> None:
        """Keep a session that just ended, dropping the oldest past the limit."""
        if not self.limit:
            return
        self.drop(session.session_id)
        self._sessions[session.session_id] = session
        self._by_rollout.setdefault(session.episode.rollout_id, set()).add(session.session_id)
        while len(self._sessions) > self.limit:
            self.drop(next(iter(self._sessions)))

    def drop(self, session_id: str) -> None:
        """Stop keeping this session; no-op if not kept."""
        session = self._sessions.pop(session_id, None)
        if session is None:
            return
        rollout = self._by_rollout[session.episode.rollout_id]
        rollout.discard(session_id)
        if not rollout:
            del self._by_rollout[session.episode.rollout_id]

    def in_scope(
        self, scope: frozenset[EpisodeId], retired: RetiredAttempts
    ) -> Iterator[TrackedSession]:
        """The kept sessions of these episodes, not of a retired attempt: a retire marks the
        attempt before it frees anything, so a Commit beside it never exports a session its
        hook is freeing."""
        for rollout_id in {episode.rollout_id for episode in scope}:
            for session_id in self._by_rollout.get(rollout_id, ()):
                session = self._sessions[session_id]
                if session.episode in scope and not retired.is_retired(session.episode):
                    yield session

    def covered_by(self, episode: EpisodeId) -> list[str]:
        """The kept sessions a Retire of `episode` covers: its rollout, attempts up to its own."""
        return sorted(
            session_id
            for session_id in self._by_rollout.get(episode.rollout_id, ())
            if self._sessions[session_id].episode.attempt <= episode.attempt
        )
