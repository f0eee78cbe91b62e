"""The interface a participant kind implements, and the value types it speaks in.

A participant is the part of one server process that owns checkpointable state: it can close
and open its data plane, say cheaply whether it is ready, export records, install them, and
stop and free an attempt. The control plane (control_plane.py) wraps it with states, fencing,
the lease, deadlines and storage; the participant never sees any of that, and never sees gRPC.
"""

from __future__ import annotations

import abc
import enum
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from rollout_checkpoint.server.core.episodes import EpisodeId
from rollout_checkpoint.server.runtime.attempts import RetiredAttempts

if TYPE_CHECKING:
    from rollout_checkpoint.server.runtime.result_outbox import ResultOutbox

MAX_LISTED_BLOCKERS = 100
MAX_WEIGHT_VERSION = 2**63 - 1
"""The highest weight version SetWeightVersion takes (and a stored call may carry): GetStatus
reports the current one in its int64 `counters`, which could not carry a larger one."""

AsgiWrapper = Callable[[Any], Any]
"""A middleware as a function of the ASGI app it wraps (`wrapper(app)` is the wrapped app):
this module names no Starlette type, so the control plane stays free of the web stack."""

AWAITING_RESTORE = "awaiting_restore"
"""The data-plane refusal (HTTP 409 code) of a `start_closed` process before its Restore or
Resume (and of a survivor during its rejoining Restore), in every participant kind. Not `admission_closed`: no checkpoint is in progress, and
an operator reading "retry after resume" would look for one; the process waits for its
controller (`ParticipantContext.start_closed_pending`). A caller retries it like
`admission_closed`: the request did not run."""
AWAITING_RESTORE_DETAIL = (
    "this process started closed and waits for its controller's Restore or Resume"
)
"""The `detail` beside `AWAITING_RESTORE`."""


class Kind(enum.StrEnum):
    """Participant kinds, in prepare order. The value is the kind's storage directory name."""

    ENVIRONMENT = "environment"
    MODEL = "model"
    AGENT = "agent"
    RESOURCES = "resources"


class BlockerReason(enum.StrEnum):
    """Why a participant is not ready: types.proto `BlockerReason` without its prefix (the
    wire mapping adds it back, so a value here that the proto lacks would not serialize)."""

    REQUEST_IN_FLIGHT = "REQUEST_IN_FLIGHT"
    """A data-plane request is running; the blocker's capture key names its episode."""
    REQUEST_WITHOUT_EPISODE = "REQUEST_WITHOUT_EPISODE"
    """A data-plane request that belongs to no episode is running (empty capture key)."""
    SEED_IN_PROGRESS = "SEED_IN_PROGRESS"
    """A session seed is still running."""
    RETIRE_INCOMPLETE = "RETIRE_INCOMPLETE"
    """A Retire was cut short and the episode's state is still held: retire it again."""
    RESTART_ONLY_SESSION = "RESTART_ONLY_SESSION"
    """A live session of a `restart_only` resources server: it blocks until retired."""
    EPISODE_STEP_RUNNING = "EPISODE_STEP_RUNNING"
    """An episode step is running, is a `wait` step, or is being retired."""
    STREAMING_RESPONSE = "STREAMING_RESPONSE"
    """A policy-model response has already started streaming."""
    INSTALL_IN_PROGRESS = "INSTALL_IN_PROGRESS"
    """An install (a Restore) is still running."""
    WORKER_MISSING = "WORKER_MISSING"
    """A worker of a multi-worker server is not running, or has not reported since the
    checkpoint closed (worker_pool.py)."""
    WORKER_LOST = "WORKER_LOST"
    """A worker of a multi-worker server died while the checkpoint was open: what it ran is
    gone, so the checkpoint is not ready until Resume (worker_pool.py)."""
    STAGING_GENERATION_CUTS = "STAGING_GENERATION_CUTS"
    """The policy model's backend is staging the prefixes of undelivered calls (bounded)."""


@dataclass(frozen=True, slots=True, order=True)
class Blocker:
    """One thing that keeps a participant from a safe cut, as a Prepare reports it.

    `capture_key` names the episode it belongs to ("" for none), `detail` is for humans.
    Blockers sort by (capture key, reason, detail), which is the order they are listed in."""

    capture_key: str
    reason: BlockerReason
    detail: str = ""


@dataclass(frozen=True, slots=True)
class ReadinessReport:
    """What keeps a participant from a safe cut. At most 100 blockers are listed."""

    ready: bool
    blockers: tuple[Blocker, ...] = ()
    blocker_count: int = 0
    counts: Mapping[str, int] = field(default_factory=dict)

    @classmethod
    def build(
        cls, blockers: Iterable[Blocker], counts: Mapping[str, int] | None = None
    ) -> ReadinessReport:
        """A report from every blocker: ready iff there is none; the first 100 are listed."""
        ordered = sorted(blockers)
        return cls(
            ready=not ordered,
            blockers=tuple(ordered[:MAX_LISTED_BLOCKERS]),
            blocker_count=len(ordered),
            counts=dict(counts or {}),
        )


@dataclass(frozen=True, slots=True)
class ExportRecord:
    """One record of a commit: stored as `{"episode_id": {...}, **fields}`.

    `fields` must not alias live state: the write serializes it in a thread, possibly after
    the data plane ran again (copy it, for example through JSON, when exporting)."""

    episode_id: EpisodeId
    fields: Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class UnchangedRecord:
    """A record an incremental export did not take again: nothing changed it since the
    published part that holds `identity` (`Participant.export_changes`), so the new part
    references that part's line instead of storing the state a second time."""

    episode_id: EpisodeId
    identity: Hashable


class ExportBase(Protocol):
    """The published part an incremental export may reference (`part_chain.PublishedChain`)."""

    @property
    def cut(self) -> int:
        """The change clock (`Participant.change_clock`) read at the part's cut."""
        ...

    @property
    def complete(self) -> bool:
        """Whether the part's export was unscoped: it holds every record exportable at its cut."""
        ...

    @property
    def record_count(self) -> int:
        """How many records the part holds."""
        ...

    def holds(self, identity: Hashable) -> bool:
        """Whether the part holds a record of this identity."""
        ...


@dataclass(frozen=True, slots=True)
class KeptRecords:
    """What an incremental export keeps of its base without naming each record: every record
    the base holds, except the `dropped` identities (changed since, or no longer exported),
    is unchanged and part of this export too. `count` of them are kept.

    The kept records are merged with the changed ones by their identities
    (`record_identity`), which must therefore sort in export order: the part's lines must
    come in the order a full export of the same cut writes them, or the two would differ.

    A participant that knows what changed since the base's cut says so in O(changed): naming
    each unchanged record (an `UnchangedRecord` each) costs the pause O(everything held)."""

    dropped: frozenset[Hashable]
    count: int


@dataclass(frozen=True, slots=True)
class ChangeSet:
    """An incremental export (`Participant.export_changes`): `items` in export order (every
    record, or with `kept` only the changed ones), and `kept` (None: `items` is everything)."""

    items: Sequence[ExportRecord | UnchangedRecord]
    kept: KeptRecords | None = None


@dataclass(frozen=True, slots=True)
class RestoredRecord:
    """One stored record to install: checkpointed as attempt N, installed as attempt N+1."""

    checkpointed: EpisodeId
    fields: Mapping[str, Any]

    @property
    def restored_as(self) -> EpisodeId:
        """The attempt this record is installed as (N+1 of the checkpointed attempt N)."""
        return self.checkpointed.next_attempt()


@dataclass(frozen=True, slots=True)
class EpisodeInfo:
    """One live episode as ListEpisodes reports it: whether it is parked at a boundary (a
    cut now would export it), whether it is a restored attempt no request used yet, and for
    a policy model how old the weights its recorded calls were sampled under are."""

    episode_id: EpisodeId
    at_boundary: bool = False
    restored_pending: bool = False
    oldest_weight_version: int | None = None
    """The lowest weight version among the episode's recorded calls (a policy model's
    only; None when no recorded call has a known version)."""


class ParticipantContext(Protocol):
    """What the control plane offers the participant it wraps (handed over once, by
    `Participant.attach`); every member is cheap and runs on the event loop."""

    @property
    def retired(self) -> RetiredAttempts:
        """The retired-attempt marks the data plane must honour (refuse `stale_attempt`).

        Marks are set by Retire (and by a Restore for the crashed attempts) before the
        participant's `retire` runs, only rise, and are dropped by Forget; a request of a
        marked attempt that ran anyway could recreate state that nothing would free."""
        ...

    def changed(self) -> None:
        """Tell the control plane that readiness may have changed (cheap; call freely).

        A Prepare re-checks `ready()` on the next wake-up; forgetting to call this after a
        blocker goes away leaves the Prepare waiting until its next heartbeat."""
        ...

    @property
    def shutting_down(self) -> bool:
        """True once SIGTERM arrived: requests waiting for a resume should get 503 now."""
        ...

    @property
    def start_closed_pending(self) -> bool:
        """A `start_closed` process that has not yet been restored or resumed, or a process
        whose rejoining Restore is under way (or RESTORED by one, until Resume). Either waits
        for its controller: the data plane refuses everything new `awaiting_restore`, even
        what a closed admission lets through, because what it tracked now would be served
        state beside what the restore installs."""
        ...


class Participant(abc.ABC):
    """A participant kind. Hooks run on the event loop; none may block it.

    Raise `CheckpointError` for refusals with a reason (for example an invalid stored record
    from `install`); any other exception from a hook is reported as `HOOK_FAILED`.

    Implement it to make any Starlette/FastAPI server a participant, then hand an instance to
    `install_checkpointing`. Set `kind` and `instance` in `__init__`. The control plane owns
    every state transition, the fencing of checkpoint ids, the lease and the deadlines; it
    calls these methods only when the transition is allowed, one RPC's hook at a time, so a
    participant needs no checkpoint state of its own. The synchronous methods must not
    await anything; the coroutines may be slow but run under the calling RPC's deadline.
    """

    kind: Kind
    instance: str
    requires_scope: bool = False
    """True for a participant that keeps state for episodes it cannot tell finished (the
    policy model, until a commit leaves them out: see `committed`): an unscoped commit would
    export all of it, so it is refused (`SCOPE_REQUIRED`)."""

    incremental: bool = False
    """True for a participant whose `export_changes` leaves out what did not change (a
    resources server that declares `checkpoint_incremental`, in one process or several
    workers; an environment, agent or policy model constructed with `incremental=True`): its
    checkpoints may reference records of earlier parts instead of storing them again."""

    def change_clock(self) -> int:
        """A counter that every change of checkpointed state raises (only an `incremental`
        participant keeps one). Read at the cut, before the export: a record whose last
        change is at most the clock of the part that holds it is unchanged since."""
        return 0

    async def export_changes(
        self, scope: frozenset[EpisodeId] | None, base: ExportBase | None
    ) -> ChangeSet:
        """`export`, but a record unchanged since the `base` part's cut may come back as an
        `UnchangedRecord`, or be left out with the rest of the base's unchanged records
        (`ChangeSet.kept`). The default exports everything, which is always correct."""
        return ChangeSet(await self.export(scope))

    def attach(self, context: ParticipantContext) -> None:
        """Called once by the control plane before anything else.

        An override must call `super().attach(context)`: the other methods reach the retired
        marks and `changed()` through `self.context`."""
        self.context = context

    @abc.abstractmethod
    def close_admission(self) -> None:
        """Stop taking new data-plane work. Raising aborts the Prepare (the plane reopens).

        Called when a Prepare starts a checkpoint (and when a Restore or a `start_closed`
        process closes), always alternating with `open_admission`: never twice in a row.
        Work already admitted keeps running; `ready()` says when it is out of the way. A
        raise fails the Prepare with `HOOK_FAILED`, and `open_admission` is called so state
        and admission never disagree."""

    @abc.abstractmethod
    def open_admission(self) -> None:
        """Take new work again and release whatever waited for it.

        Called by Resume (also the abort of a checkpoint), by lease expiry, after a failed
        Restore, and when a `start_closed` process gives up waiting; only after
        `close_admission`. Must not raise: a Resume must always reopen."""

    @abc.abstractmethod
    def ready(self) -> bool:
        """Whether a safe cut is possible now. Called on every wake-up: keep it O(1).

        Also checked again by Commit: a participant that is no longer ready refuses it
        (`INVALID_PHASE`) with nothing written. Must agree with `report().ready`."""

    @abc.abstractmethod
    def report(self) -> ReadinessReport:
        """The full readiness report; built only when a message is sent.

        Build it with `ReadinessReport.build` (it lists at most 100 blockers and counts all
        of them); `counts` are the kind's gauges (inflight, sessions, ...), shown to humans
        and exported as metrics."""

    @abc.abstractmethod
    async def export(self, scope: frozenset[EpisodeId] | None) -> Sequence[ExportRecord]:
        """Snapshot the records of the episodes in scope (None: every live episode).

        Called by Commit, with admission closed and `ready()` true, once per checkpoint id
        and scope (a retried Commit reuses the records unless this raised). Leave out retired
        attempts; return one record per `record_identity`. Records must not alias live state
        (see `ExportRecord`); a field JSON cannot carry fails the Commit with
        `UNSERIALIZABLE_STATE` naming the episode. Raising fails the Commit (`HOOK_FAILED`,
        or the `CheckpointError` raised) with nothing written; the state stays PREPARED."""

    @abc.abstractmethod
    async def install(self, records: Sequence[RestoredRecord]) -> None:
        """Validate every record, then install all of them as attempt N+1, or none.

        Called by Restore, only while `has_served()` is False (so at most one install per
        process succeeds, unless a rejoining Restore made it forget having served; a failed
        one is undone and may be retried) and with admission
        closed, with the records of the restore's scope (read and checked
        against the manifest already, but their fields unvalidated). Refuse an invalid
        record with `rejected_checkpoint(..., capture_key=record.checkpointed.capture_key)`;
        a raise must leave nothing installed. The control plane shields the install from
        the deadline and calls `discard_installed` if the Restore fails after it."""

    @abc.abstractmethod
    async def discard_installed(self, episodes: Sequence[EpisodeId]) -> None:
        """Undo a restore: free exactly what `install()` installed for these attempt-N+1 episodes.

        A Restore can fail after its install succeeded (the install outlived the deadline, a
        Resume raced it). On any failed restore nothing may stay installed and the process must
        stay fresh, so that a retry of the same restore works: a leftover would make
        `has_served()` refuse it (FRESH_PROCESS_REQUIRED), and restored state that nothing
        continues would never be freed. So this frees the installed state through the server's
        own hooks and stops tracking it, but leaves NO retired marks (a retire's marks would
        refuse the very attempt the retry installs): nothing here is a Retire. It tolerates
        repeats and episodes it never installed. Afterwards `has_served()` is False again,
        unless the data plane served something else meanwhile."""

    @abc.abstractmethod
    async def retire(self, episode: EpisodeId) -> None:
        """Stop and free every attempt <= `episode.attempt` of its rollout; tolerate repeats.

        Called by Retire (in IDLE or RESTORED) and by a Commit for restored episodes its
        scope leaves out, after the attempts are marked retired (`context.retired`), so new
        requests of them are already refused. The episodes of one Retire are retired
        concurrently, one call each. Return only once nothing of them runs or is
        held. An unknown episode, or one already retired, succeeds. Cut short by the
        deadline, or raising (`HOOK_FAILED`), it leaves the marks in place and the rollout
        `RETIRE_INCOMPLETE`: the controller retries, and this runs again."""

    @abc.abstractmethod
    def restored_pending(self) -> frozenset[EpisodeId]:
        """Installed episodes (attempt N+1) that no request has used yet.

        A Commit retires those its scope leaves out (nothing continues them); GetStatus and
        ListEpisodes report them."""

    @abc.abstractmethod
    def episodes(self) -> Sequence[EpisodeInfo]:
        """Every live episode held, restored pending ones included (ListEpisodes pages them,
        sorted by capture key; the order returned here does not matter).

        Live means in flight here now, never merely served once: a controller that derives
        its commit scope unions these lists, so an episode listed after it finished would
        enter every later checkpoint's scope and `continued` list, and the state kept for it
        would never be released (see `committed`)."""

    async def refresh(self) -> None:
        """Bring what `report`, `restored_pending`, `episodes` and `counters` read up to
        date; awaited before a controller reads them (GetStatus, ListEpisodes) and before a
        rejoining Restore lists what it retires.

        A participant that reads its own state when asked (every one of one process) has
        nothing to do. One that reads copies pushed from elsewhere (`WorkerPool`: its
        workers push at most every 0.25 s while admission is open) fetches them now: a
        count read from a copy behind the last reply the controller saw is false (a session
        seeded, closed or retired missing), and a controller decides on it. Must not raise;
        bounded in time (a source that does not answer keeps its last copy)."""
        return None

    @abc.abstractmethod
    def has_served(self) -> bool:
        """Whether this process holds or has tracked a session or an episode (then it cannot
        restore: a restore would mix its state with the checkpoint's).

        Only tracking makes a process unfit. A request refused or failed before any session or
        episode existed (400, 404, 409, a seed without a rollout prefix) leaves it fresh: a
        stray probe must not cost a replacement process its restore."""

    def forget_served(self) -> None:
        """Called by a rejoining Restore once every held episode was retired: drop the memory
        of having served (finished outcomes, ledgers of finished episodes, sticky served
        flags) so that `has_served()` is False again.

        A survivor of a fleet whose crashed member was replaced is restored with the rest of
        the fleet from the last checkpoint; without this it could never restore, and the
        whole fleet would have to start over. By the time this runs, admission is closed,
        nothing new can start here, and every episode `episodes()` listed is retired (its
        attempt marked, its work ended, its state freed), so what is left is only the
        memory of it. Keep what still runs: something not retired (not listed) must keep
        `has_served()` True, and the Restore is then refused FRESH_PROCESS_REQUIRED rather
        than installing beside it. Never touch the retired-attempt marks (`context.retired`):
        they fence the late requests of what was discarded. Runs on the event loop with the
        control plane's lock held: it must not block or await.

        The default keeps the memory, so a kind that does not implement this is refused
        FRESH_PROCESS_REQUIRED, as without `rejoin`."""
        return None

    def record_identity(self, episode: EpisodeId, record: Mapping[str, Any]) -> Hashable:
        """What no two stored records of one checkpoint may share (`record` as read, unvalidated).

        The default is the episode: one record per episode, so two records of one episode
        would install one state and silently drop the other. A kind whose episode may hold
        several records (resources: one per session) says what tells them apart; a restore
        that refused what Commit published would lose the checkpoint. Called off the event
        loop (the restore reads in a thread), so it must be a pure function of its arguments."""
        return episode

    def forget(self, rollout_ids: Sequence[str]) -> None:
        """The controller forgot these rollouts: drop what refuses their late requests, and
        whatever else is still kept of them."""
        return None

    def committed(self, scope: frozenset[EpisodeId] | None) -> None:
        """This participant's part of a checkpoint of `scope` is durably written (None: an
        unscoped commit): release state of episodes the checkpoint no longer needs.

        The commit scope is every episode the controller continues, so what an explicit
        scope leaves out will not be continued from this fleet's state; a participant that
        cannot tell by itself when an episode ended (the policy model) frees it here, or it
        would keep every episode it ever served. Called once per Commit's job, after the
        write and the retire of unscoped restored episodes, never for a failed commit (whose
        retry must find the state it exports), and not again for a replayed one. A raise is
        logged and changes nothing else: the part is already published."""
        return None

    def data_plane_middleware(self) -> Sequence[AsgiWrapper]:
        """ASGI middleware of this kind that `install_checkpointing` puts innermost into the
        app, in this order (the first outermost): inside the rollout prefix (so `episode_of`
        works) and next to the routes. The episode owners' reply-delivery report
        (episodic/delivery.py) comes this way, so no server can forget to install it."""
        return ()

    def result_outbox(self) -> ResultOutbox | None:
        """The results this participant holds under receipts until the trainer acknowledges
        them (result_outbox.py), which ListResults pages and AcknowledgeResults releases;
        None for a kind that answers no trainer's run (both RPCs then find nothing). The
        participant exports it with every commit and installs it at restore itself."""
        return None

    def set_weight_version(self, version: int) -> int | None:
        """Stamp the calls admitted from now on with weight version `version` (SetWeightVersion)
        and return the version before; None for a kind that holds no policy weights (the call
        is then refused). A call already admitted keeps its stamp: a response held across a
        checkpoint was sampled under the weights of its admission, and recording it under
        newer ones would hide the lag a controller bounds."""
        return None

    def shutting_down_now(self) -> None:
        """SIGTERM arrived: release whatever waits for a resume (it will get 503)."""
        return None

    def facts(self) -> Mapping[str, str]:
        """Kind-specific facts for GetParticipant and GetStatus."""
        return {}

    def counters(self) -> Mapping[str, int]:
        """Kind-specific counters for GetStatus."""
        return {}
