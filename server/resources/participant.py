"""The resources participant: per-session tool state, tracked from the routes that define it.

A resources server keeps tool state under a session id (the signed cookie, or an MCP session
token). The participant has two halves. The data plane (`data_plane.SessionDataPlane`)
learns each session's lifecycle from `/seed_session`, `/verify` and `/close_session`, counts
requests in flight and refuses what must not run; the admission middleware (middleware.py)
calls it per request. The checkpoint half (`ResourcesParticipant`, here) is what the control
plane calls: it reaches the server's own session hooks (`SessionHooks`) to export, restore
and free state, under the rules of the server's `CheckpointMode` and `VerifyMode`. It knows
nothing of gRPC."""

from __future__ import annotations

import enum
from collections.abc import Hashable, Mapping, Sequence
from typing import Any, Protocol

from rollout_checkpoint.server.core.episodes import EpisodeId
from rollout_checkpoint.server.core.errors import rejected_checkpoint
from rollout_checkpoint.server.resources.data_plane import SessionDataPlane
from rollout_checkpoint.server.resources.ended_sessions import ENDED_SESSIONS_KEPT
from rollout_checkpoint.server.resources.session_table import (
    TrackedSession,
    export_order,
    session_identity,
)
from rollout_checkpoint.server.runtime.participant import (
    Blocker,
    BlockerReason,
    ChangeSet,
    EpisodeInfo,
    ExportBase,
    ExportRecord,
    KeptRecords,
    Kind,
    Participant,
    ReadinessReport,
    RestoredRecord,
    UnchangedRecord,
)


class CheckpointMode(enum.StrEnum):
    """How a resources server's session state survives a checkpoint (`checkpoint_mode`).

    A class attribute of the server, read once at construction (a string value is accepted
    and converted; an unknown one raises ValueError there). The mode decides what blocks a
    Prepare and what a Commit exports; it never changes while the process runs.
    """

    RESTART_ONLY = "restart_only"
    """The default: live sessions block prepare until their rollout is retired. A server
    nobody has audited fails closed instead of silently losing state.

    Each live session is a `RESTART_ONLY_SESSION` blocker until the controller retires its
    rollout, which then restarts from its input as a later attempt. Nothing is exported, and
    a Restore that carries records for this server is refused (`INVALID_CHECKPOINT_STATE`)."""
    STATELESS = "stateless"
    """Tool results depend only on the request: there is no state to lose. Only requests in
    flight block a Prepare; nothing is exported; records for this server refuse a Restore."""
    EXPORTED = "exported"
    """The server implements the three session hooks (`SessionHooks`): a Commit exports every
    covered session through `export_session_states`, a Restore installs them through
    `restore_session_states`, a Retire frees them through `retire_session_state`. With
    checkpointing enabled a server missing a hook fails at construction (TypeError)."""


class VerifyMode(enum.StrEnum):
    """Whether a crash may run `/verify` again (`checkpoint_verify`).

    Every `/seed_session` reply announces it in the `x-ng-checkpoint-verify` header (only
    when checkpointing is on), so the caller knows before it ever verifies whether a
    restored episode will re-issue a verify that was in flight at the cut.
    """

    WAIT = "wait"
    """The default: a checkpoint waits for `/verify` to finish. The verify counts as in flight
    (it blocks Prepare) and is refused `admission_closed` (409) while a checkpoint is open.
    Choose it when verifying changes or drops state (it cannot be replayed)."""
    REPLAY = "replay"
    """`/verify` may run again after a crash and does not change checkpointed state: it is
    admitted even while admission is closed and never blocks Prepare. A verify that succeeds
    during a checkpoint ends its session only when admission reopens, so that checkpoint
    still exports the session and a restored episode can verify again."""


class InvalidSessionState(ValueError):
    """Raised by `restore_session_states` for a stored state it rejects (installs nothing).

    `session_id` names the rejected session; the Restore then fails with
    `INVALID_CHECKPOINT_STATE` (FAILED_PRECONDITION) whose `captureKey` names that session's
    checkpointed episode, nothing stays installed, and the process stays fresh for a retry
    with another checkpoint. Any other exception from the hook fails the Restore with
    `HOOK_FAILED` instead (the same rollback, but no episode named).
    """

    def __init__(self, session_id: str, message: str) -> None:
        super().__init__(message)
        self.session_id = session_id


class DecodedSessionStates(dict[str, Any]):
    """The states a Restore hands `restore_session_states`: decoded from the checkpoint's
    records for this call, so they hold plain JSON values only (string keys, finite numbers,
    no objects), and nothing else references them.

    A hook may install them as they are: no walk to check that they are JSON (the decoder
    did), no copy to keep them from aliasing. A plain dict (a test, a caller of its own)
    promises neither. A hook that checks for this type keeps a Restore from paying twice for
    what the decoder already guarantees (`EnvironmentStates` does)."""


class SessionHooks(Protocol):
    """The three coroutines an `exported` resources server implements (`ResourcesServer`
    declares them; the participant calls them).

    They run on the event loop that serves the HTTP handlers, under the deadline of the RPC
    that calls them: they may be slow (a sandbox snapshot) but must never block the loop with
    synchronous I/O (use `asyncio.to_thread`). A `CheckpointError` raised by a hook passes to
    the controller as is; any other exception fails the RPC with `HOOK_FAILED` (logged with
    its traceback). Export runs only at Commit, with admission closed and no counted request
    in flight (a replay-safe seed retry or `replay` verify may still run); restore only at
    Restore, in a process that holds no session; retire may run for several sessions at once
    (a Retire frees its episodes concurrently) and, from the default `close_session`, beside
    any request of other sessions.
    """

    async def export_session_states(self, session_ids: list[str]) -> Mapping[str, Any]:
        """Snapshot the state of every session in `session_ids`, all at once.

        Receives the ids of every tracked, not retired session the Commit's scope covers,
        sorted by (episode, session id), in one call, so a server whose state lives outside
        the process can snapshot them concurrently. Returns `{session_id: state}`; each state
        must be JSON (no NaN/Infinity, no objects) and must not alias live state: the records
        are serialized later, in a thread, possibly after the data plane ran again (copy it,
        e.g. through JSON). A session missing from the result is treated as already dropped
        (a failed verification freed it): it stops being tracked and the commit still
        succeeds. Ids not asked for are ignored.

        Called once per checkpoint id and scope: a retried Commit reuses a finished export,
        and calls this again only when the export itself failed (or the retry names another
        scope), so no later state enters the cut. Raising fails the Commit (`HOOK_FAILED`) with
        nothing written and the participant still PREPARED; a state JSON cannot carry fails it
        with `UNSERIALIZABLE_STATE` naming the episode.
        """
        ...

    async def restore_session_states(self, states: dict[str, Any]) -> None:
        """Install `states` (`{session_id: state}`, as exported) all or nothing.

        Called by a Restore, only before any session exists here (a failed restore is undone
        through `retire_session_state`, and its retry calls this again) and with admission
        closed, with every record in the restore's scope in one call. Validate
        every state first, then install them all: never a partial set. Reject a state with
        `InvalidSessionState(session_id, message)` (the Restore fails with
        `INVALID_CHECKPOINT_STATE` naming its episode); any other exception fails it with
        `HOOK_FAILED`. Either way the participant tracks none of the sessions, so a state
        left installed by a partial install would be held with nothing to free it. The
        session ids are the originals, so the old cookies (and MCP tokens) keep working.
        """
        ...

    async def retire_session_state(self, session_id: str) -> None:
        """Free the state of one session; idempotent.

        Called by a Retire (and by a Commit for restored sessions its scope no longer
        continues) once no request runs on the session and new ones are refused
        (`stale_attempt`); by a failed Restore to undo its install; and by the default
        `close_session`. Must tolerate a second call for state already freed, and an id it
        never held: a retire cut short by its deadline is retried. Raising fails the RPC
        (`HOOK_FAILED`) and leaves the session tracked, so the retry calls this again.
        """
        ...


class ResourcesParticipant(SessionDataPlane, Participant):
    """The participant of a resources server: sessions tracked per episode from the routes
    that define their lifecycle (`SessionDataPlane`), and the server's `SessionHooks` reached
    for their state.

    `ResourcesServer.build_app` makes one when checkpointing is on, and its admission
    middleware calls the data-plane methods (synchronous, on the event loop); the control
    plane calls the `Participant` methods, defined here. It never touches gRPC. A server
    whose sessions begin outside `/seed_session` reports them through
    `session_started`/`session_ended` (via `ResourcesServer.checkpoint_session_started`/
    `checkpoint_session_ended`). This half waits for the data plane's seeds and requests
    before it frees a session, and calls the hooks.

    `keep_ended` (`CheckpointSettings.export_ended_sessions`): an `exported` server keeps its
    ended sessions exportable by a scope naming them (`ended_sessions`), for certify's check
    of each session's final state; the other modes export nothing, so they keep none.
    """

    def __init__(
        self,
        instance: str,
        mode: CheckpointMode,
        verify: VerifyMode,
        hooks: SessionHooks,
        *,
        keep_ended: bool = False,
        incremental: bool = False,
    ) -> None:
        keeps_ended = keep_ended and mode is CheckpointMode.EXPORTED
        super().__init__(
            restart_only=mode is CheckpointMode.RESTART_ONLY,
            ended_limit=ENDED_SESSIONS_KEPT if keeps_ended else 0,
        )
        self.kind = Kind.RESOURCES
        self.instance = instance
        self.mode = mode
        self.verify = verify
        self._hooks = hooks
        self.incremental = incremental and mode is CheckpointMode.EXPORTED

    # -- Participant --------------------------------------------------------------------

    def close_admission(self) -> None:
        self._admission_open = False
        self._notify()

    def open_admission(self) -> None:
        self._admission_open = True
        self._table.reopened()
        self._notify()

    def shutting_down_now(self) -> None:
        self._shutting_down = True
        self._notify()

    def ready(self) -> bool:
        return self.inflight == 0 and self._table.ready()

    def report(self) -> ReadinessReport:
        blockers = self._table.blockers()
        if self._inflight_without_session:
            blockers.append(
                Blocker(
                    "",
                    BlockerReason.REQUEST_WITHOUT_EPISODE,
                    f"{self._inflight_without_session} request(s) with no session in flight",
                )
            )
        return ReadinessReport.build(
            blockers, {"inflight": self.inflight, "sessions": len(self._table.sessions)}
        )

    async def export(self, scope: frozenset[EpisodeId] | None) -> Sequence[ExportRecord]:
        changes = await self.export_changes(scope, None)
        return [r for r in changes.items if isinstance(r, ExportRecord)]

    def change_clock(self) -> int:
        return self._change_clock

    async def export_changes(
        self, scope: frozenset[EpisodeId] | None, base: ExportBase | None
    ) -> ChangeSet:
        """Every covered session, its state asked of the server only when it may have changed
        since the `base` part's cut: something touched it after that cut, or the base does
        not hold it. Ended sessions are always asked (a close after the verify that ended
        one may free its state without the session being live to be touched).

        An unscoped export after an unscoped base reads what changed from the change log
        (`_kept_since`): the pause then costs O(changed), and the base's other records are
        kept without being named. Otherwise every covered session is visited."""
        if self.mode is not CheckpointMode.EXPORTED:
            return ChangeSet(())
        if scope is None and base is not None and base.complete:
            fast = self._kept_since(base)
            if fast is not None:
                changed, kept = fast
                return ChangeSet(await self._exported(changed, {}), kept)
        candidates = self._table.exportable(scope, self.context.retired)
        if not candidates:
            return ChangeSet(())
        unchanged = self._unchanged(candidates, base)
        return ChangeSet(await self._exported(candidates, unchanged))

    async def _exported(
        self, sessions: Sequence[TrackedSession], unchanged: Mapping[str, UnchangedRecord]
    ) -> list[ExportRecord | UnchangedRecord]:
        """The records of `sessions` (export order): the `unchanged` ones as they are, the
        others' states asked of the server in one call."""
        changed = [s.session_id for s in sessions if s.session_id not in unchanged]
        states = await self._hooks.export_session_states(changed) if changed else {}
        records: list[ExportRecord | UnchangedRecord] = []
        for session in sessions:
            session_id = session.session_id
            if session_id in unchanged:
                records.append(unchanged[session_id])
            elif session_id not in states:
                # The server no longer holds it (e.g. a verification failed after dropping it).
                self._table.untrack(session_id)
            else:
                records.append(
                    ExportRecord(
                        session.episode, {"session_id": session_id, "state": states[session_id]}
                    )
                )
        self._notify()
        return records

    def _kept_since(self, base: ExportBase) -> tuple[list[TrackedSession], KeptRecords] | None:
        """The sessions to export again and what the base keeps, from the change log: the
        sessions touched since the base's cut are the only ones that may differ from it
        (the base is complete: it holds every session exportable at its cut). None when the
        log cannot tell (it no longer reaches back to the base's cut) or its answer does not
        add up to the sessions held: the export then visits every session."""
        with self._change_lock:
            touched = self._change_log.since(base.cut)
            self._change_log.forget_until(base.cut)
        if touched is None:
            return None
        sessions = self._table.sessions
        excluded = self._table.unexportable(self.context.retired)
        changed: list[TrackedSession] = []
        dropped: set[Hashable] = set()
        for session in touched:
            identity = session.as_unchanged().identity
            if sessions.get(session.session_id) is session and session not in excluded:
                changed.append(session)
            if base.holds(identity):
                dropped.add(identity)
        for session in excluded:
            identity = session.as_unchanged().identity
            if base.holds(identity):
                dropped.add(identity)
        kept = base.record_count - len(dropped)
        if kept + len(changed) != len(sessions) - len(excluded):
            return None
        changed.sort(key=export_order)
        return changed, KeptRecords(frozenset(dropped), kept)

    def _unchanged(
        self, candidates: Sequence[TrackedSession], base: ExportBase | None
    ) -> dict[str, UnchangedRecord]:
        """The live sessions nothing touched since the base part's cut and the base holds,
        by session id. An ended session is never one (see `export_changes`)."""
        if base is None:
            return {}
        with self._change_lock:
            self._change_log.forget_until(base.cut)
        live = self._table.sessions
        unchanged: dict[str, UnchangedRecord] = {}
        for session in candidates:
            session_id = session.session_id
            if live.get(session_id) is not session:
                continue
            record = session.as_unchanged()
            if session.last_change <= base.cut and base.holds(record.identity):
                unchanged[session_id] = record
        return unchanged

    async def install(self, records: Sequence[RestoredRecord]) -> None:
        if not records:
            return
        if self.mode is not CheckpointMode.EXPORTED:
            raise rejected_checkpoint(
                f"a {self.mode} resources server cannot restore session state"
            )
        if self._table.sessions or self.inflight:
            raise rejected_checkpoint("restore needs a process that has not served sessions")
        states = DecodedSessionStates()
        episode_of: dict[str, RestoredRecord] = {}
        for record in records:
            session_id = record.fields.get("session_id")
            if (
                set(record.fields) != {"session_id", "state"}
                or not isinstance(session_id, str)
                or not session_id
            ):
                raise rejected_checkpoint(
                    "a resources record holds exactly session_id and state",
                    capture_key=record.checkpointed.capture_key,
                )
            if session_id in states:
                raise rejected_checkpoint(
                    f"session {session_id} appears twice",
                    capture_key=record.checkpointed.capture_key,
                )
            states[session_id] = record.fields["state"]
            episode_of[session_id] = record
        try:
            await self._hooks.restore_session_states(states)
        except InvalidSessionState as exc:
            rejected = episode_of.get(exc.session_id)
            key = rejected.checkpointed.capture_key if rejected is not None else None
            raise rejected_checkpoint(
                f"the server rejected a stored session state: {exc}", capture_key=key
            ) from exc
        for session_id, record in episode_of.items():
            self._table.track(
                session_id, record.restored_as, seeded_while_closed=False, restored=True
            )
            self.touch(session_id)  # installed after every part the chain could reference
        self._notify()

    async def discard_installed(self, episodes: Sequence[EpisodeId]) -> None:
        """Free what `install` installed for `episodes` as a retire would, minus the marks.

        Like a retire it first waits for seeds of these episodes and for requests on their
        sessions, so nothing running recreates the state it frees."""
        discarded = frozenset(episodes)
        sessions = self._table.sessions
        while any(e in discarded for e in self._seeding):
            await self._wait_change()
        while any(sessions[s].inflight for s in self._table.installed_in(discarded)):
            await self._wait_change()
        for session_id in self._table.installed_in(discarded):
            if not self._table.is_installed(session_id):
                continue  # freed meanwhile (a retire, a concurrent discard)
            if self.mode is CheckpointMode.EXPORTED:
                await self._hooks.retire_session_state(session_id)
            self._table.untrack(session_id)
            self._notify()

    async def retire(self, episode: EpisodeId) -> None:
        """Wait for seeds, refuse and drain the covered sessions, free them, stop tracking;
        then free the covered ended sessions (`_retire_ended`)."""

        def covered(other: EpisodeId) -> bool:
            return other.rollout_id == episode.rollout_id and other.attempt <= episode.attempt

        while any(covered(e) for e in self._seeding):
            await self._wait_change()
        session_ids = self._table.begin_retire(episode)
        self._notify()
        sessions = self._table.sessions
        while any(s in sessions and sessions[s].inflight for s in session_ids):
            await self._wait_change()
        for session_id in session_ids:
            if session_id not in sessions:
                continue
            if self.mode is CheckpointMode.EXPORTED:
                await self._hooks.retire_session_state(session_id)
            self._table.untrack(session_id)
            self._notify()
        await self._retire_ended(episode)

    async def _retire_ended(self, episode: EpisodeId) -> None:
        """Free the kept ended sessions `episode`'s Retire covers, as a live one is freed.

        The server still holds their state (a verify does not free it), and the controller
        retiring the rollout is the one sign that nothing will name them again: left kept,
        they would be held until the limit pushes them out. Each is dropped only once its
        hook returned, so a hook that raises fails the RPC and the retry frees it again; the
        Retire marked the attempt first, so no Commit meanwhile exports it. One no longer
        kept when its turn comes is skipped: a seed may have tracked its id live again (a
        reused cookie), and the hook would free that live session's state."""
        for session_id in self._table.ended.covered_by(episode):
            if session_id not in self._table.ended:
                continue
            await self._hooks.retire_session_state(session_id)
            self._table.ended.drop(session_id)

    def record_identity(self, episode: EpisodeId, record: Mapping[str, Any]) -> Hashable:
        """One record per session: an episode may hold several sessions (one per cookie jar
        seeded under its prefix), and each is a record of its own (`session_identity`)."""
        session_id = record.get("session_id")
        return session_identity(episode, session_id if isinstance(session_id, str) else None)

    def forget(self, rollout_ids: Sequence[str]) -> None:
        self._table.forget(rollout_ids)

    def restored_pending(self) -> frozenset[EpisodeId]:
        return self._table.restored_pending()

    def episodes(self) -> Sequence[EpisodeInfo]:
        return self._table.episodes()

    def has_served(self) -> bool:
        """A session tracked (or used) by the data plane, one held now, one retired here and
        not yet forgotten, or a seed under a prefix still running (it is about to track one).
        A refused request, a 400 without a session, a 404 or a seed without a prefix tracked
        nothing and leaves the process fresh."""
        return (
            self._served
            or bool(self._table.sessions)
            or bool(self._table.retired_sessions)
            or bool(self._seeding)
        )

    def forget_served(self) -> None:
        """A rejoining restore retired every tracked session: forget the sticky flag and the
        retired sessions, so the process counts as fresh.

        The retired sessions go too, though they fence late requests: the restore installs
        the checkpointed sessions under their original ids, which are the very sessions just
        retired here, and a remembered one would refuse its restored successor
        `stale_attempt` for good. The attempt marks stay, so every late request that names
        a discarded attempt is still refused; one that names no rollout reaches a session
        the server no longer holds, as it would in a fresh replacement. A seed still running
        keeps the process served (it is about to track a session).

        Ended sessions stay kept: the rejoin retired only the live episodes (freeing the
        ended sessions of their rollouts), and the server still holds the others' state, so
        a scope naming a finished rollout still exports it, as from a process never
        rejoined."""
        self._served = False
        self._table.forget_retired_sessions()

    def facts(self) -> Mapping[str, str]:
        return {"mode": self.mode.value, "verify": self.verify.value}

    def counters(self) -> Mapping[str, int]:
        return {"retired_sessions": len(self._table.retired_sessions)}
