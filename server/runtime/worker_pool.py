"""The main process's participant of a multi-worker server: every worker, as one participant.

A server with several worker processes is still ONE participant (one instance, one part per
checkpoint): the control plane and the sidecar run in the main process (workers.py) and wrap
a `WorkerPool`, which does what a participant does by asking every worker over the local
bridge (worker_link.py, worker_bridge.py):

* Prepare closes every worker, and readiness is the merge of their reports: ready only when
  every configured worker reported ready for THIS close (reports carry the close's
  generation; an older one says nothing about the cut), blockers the union, counts summed
  plus `workers`. A worker missing (not yet started, restarting) blocks with
  `WORKER_MISSING`; a worker lost while closed blocks with `WORKER_LOST` until Resume, even
  once its replacement reported: the episodes it ran are gone, and a checkpoint that did not
  wait for their retire would name rollouts it cannot continue. A worker that joins while
  closed closes at once (`register`). Every report a worker pushes wakes the Prepare, so a
  change reaches the controller's stream without anyone asking.
* Commit collects every worker's records into the one part, each as the worker's participant
  wrote it: the same records a one-process server writes, so a checkpoint restores into any
  number of workers, one included (records_codec.py). A resources server that declares
  `checkpoint_incremental` sends only the records its workers' change clocks say changed,
  and the part references the rest of the last one (worker_changes.py).
* Restore puts the state back where requests will find it. Sessions (`Placement.SESSIONS`,
  resources: state that spans requests, routed by their id) go to worker
  `session_owner(id) % workers`, the worker their cookie routes to. Episodes
  (`Placement.CLAIMS`, environment, agent: state that lives inside one request, on any
  worker) stay here until the worker that receives the replacement's request claims its
  record: exactly one claim succeeds, claims are refused while a checkpoint is open, and an
  unclaimed record is exported again by the next checkpoint under its attempt N+1.
* Retire, Forget and the marks reach every worker; a retire returns only when every worker
  freed its share, so Forget stays RETIRE_INCOMPLETE while one worker's retire is unfinished
  (the control plane's own bookkeeping, since this one retire is cut short or failed).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import uuid
import zlib
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rollout_checkpoint.server.core.episodes import EpisodeId
from rollout_checkpoint.server.core.errors import CheckpointError, Reason
from rollout_checkpoint.server.runtime.participant import (
    AWAITING_RESTORE,
    MAX_LISTED_BLOCKERS,
    Blocker,
    BlockerReason,
    ChangeSet,
    EpisodeInfo,
    ExportBase,
    ExportRecord,
    Kind,
    Participant,
    ReadinessReport,
    RestoredRecord,
)
from rollout_checkpoint.server.runtime.result_outbox import (
    ResultOutbox,
    outbox_identity,
    restored_results,
)
from rollout_checkpoint.server.runtime.worker_bridge import episode_keys
from rollout_checkpoint.server.runtime.worker_changes import PoolChanges, decoded_records
from rollout_checkpoint.server.runtime.worker_link import Link, WorkerCallFailed

log = logging.getLogger(__name__)

REFRESH_SECONDS = 2.0
"""How long `refresh` waits for a worker's current state: a worker whose event loop is busy
that long is running a request (its count is in flight anyway), and its last push stands."""
REGISTER_SECONDS = 30.0
"""How long a Restore waits for missing workers to register before it fails: the sessions
of a worker that is not there have nowhere to go."""


class Placement(enum.Enum):
    """Where a restored record goes."""

    SESSIONS = "sessions"
    """State that spans requests (resources sessions): installed on the worker the session's
    cookie routes to."""
    CLAIMS = "claims"
    """State that lives inside one request (environment or agent episodes): held here until
    the worker that receives the replacement's request claims it."""


@dataclass
class WorkerState:
    """What a worker last pushed (worker_bridge.WorkerBridge._push)."""

    generation: int = -1
    closed: bool = False
    ready: bool = False
    blockers: list[Blocker] = field(default_factory=list)
    blocker_count: int = 0
    counts: dict[str, int] = field(default_factory=dict)
    served: bool = False
    restored_pending: frozenset[EpisodeId] = frozenset()
    episodes: list[EpisodeInfo] = field(default_factory=list)
    counters: dict[str, int] = field(default_factory=dict)


@dataclass
class Worker:
    index: int
    pid: int
    link: Link
    facts: dict[str, str]
    state: WorkerState = field(default_factory=WorkerState)


def session_owner(session_id: str) -> int:
    """The owner number of a session: CRC-32 of its id. A session lives on worker
    `session_owner(id) % workers` of any server, and both its routing (session_router.py)
    and a restore's placement derive it from the id alone, so no record or cookie has to
    say where it lived: the id is in both, and a session restored into another number of
    workers (one process, or several) is found where its requests go. The worker that seeds
    a session picks an id it owns (`owned_session_id`)."""
    return zlib.crc32(session_id.encode())


def owned_session_id(index: int, workers: int) -> str:
    """A new random session id that worker `index` of `workers` owns: uuid4s drawn until one
    hashes to it (`workers` draws on average). A request always arrives at the worker that
    accepted its connection; choosing the id there lets it seed the session in place."""
    while True:
        session_id = uuid.uuid4().hex
        if session_owner(session_id) % workers == index:
            return session_id


def bridged(record: RestoredRecord) -> dict[str, Any]:
    """A restored record as the bridge carries it to a worker (a claim, an install, a
    validation): the checkpointed episode and the kind's fields, as a one-process server's
    install receives them."""
    return {"checkpointed": record.checkpointed.capture_key, "fields": dict(record.fields)}


def record_identity_by_session(episode: EpisodeId, record: Mapping[str, Any]) -> Hashable:
    """A resources server's record identity (one record per session): the one its workers'
    participants give the record (`session_identity`), so the identities a worker names
    across the bridge are the main process's (worker_changes.py)."""
    session_id = record.get("session_id")
    return (
        episode.rollout_id,
        episode.attempt,
        session_id if isinstance(session_id, str) else None,
    )


class WorkerPool(Participant):
    """`workers` worker processes of one server, as one participant (see the module)."""

    def __init__(
        self,
        kind: Kind,
        instance: str,
        workers: int,
        *,
        placement: Placement,
        identity: Callable[[EpisodeId, Mapping[str, Any]], Hashable] | None = None,
    ) -> None:
        if workers < 1:
            raise ValueError("a server needs at least one worker")
        self.kind = kind
        self.instance = instance
        self.configured = workers
        self.placement = placement
        self.requires_scope = False
        self._identity = identity
        self.workers: dict[int, Worker] = {}
        self._closed = False
        self._generation = 0
        self._lost_while_closed: set[int] = set()
        self._held: dict[str, RestoredRecord] = {}
        self._registered = asyncio.Event()
        self.restarts = 0
        """Workers that registered in the place of one that was there before."""
        self._ever: set[int] = set()
        self.changes = PoolChanges()
        """Incremental parts: which cut each worker's share belongs to (worker_changes.py)."""

    def attach(self, context: Any) -> None:
        super().attach(context)
        self.outbox = ResultOutbox.of(context)
        """The results every worker's runs hold under receipts, in one place: a late run
        finds its result whichever worker it reaches (result_outbox.py)."""

    # -- the bridge: workers register, push state, claim ---------------------------------

    async def serve_connection(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        """One worker's connection, for its whole life (an `asyncio.start_unix_server`
        callback)."""
        worker: Worker | None = None

        async def handle(op: str, body: Any) -> Any:
            nonlocal worker
            if op == "register":
                worker = self._register(body, link)
                return {
                    "closed": self._closed,
                    "generation": self._generation,
                    "sealed": self._sealed(),
                    "marks": self.context.retired.snapshot(),
                }
            if op == "claim":
                return self._claim(EpisodeId.from_capture_key(body["episode"]))
            if op.startswith("outbox_"):
                return self.outbox.answer_worker(op, body, getattr(self.context, "lineage", ()))
            raise ValueError(f"unknown bridge call {op!r}")

        def listen(op: str, body: Any) -> None:
            if worker is None or self.workers.get(worker.index) is not worker:
                return
            if op == "state":
                worker.state = _state_from(body)
            elif op == "report":
                _report_into(worker.state, body)
            else:
                return
            self.context.changed()

        link = Link(reader, writer, handler=handle, listener=listen)
        try:
            await link.run()
        finally:
            if worker is not None:
                self._lost(worker)

    def _register(self, body: Any, link: Link) -> Worker:
        index = int(body["index"])
        if not 0 <= index < self.configured:
            raise ValueError(f"worker index {index} outside 0..{self.configured - 1}")
        old = self.workers.get(index)
        if old is not None:  # its replacement came first: it is as lost as a dead one
            old.link.close()
            if self._closed:
                self._lost_while_closed.add(index)
        if index in self._ever:
            self.restarts += 1
        self._ever.add(index)
        worker = Worker(index, int(body["pid"]), link, dict(body.get("facts") or {}))
        self.workers[index] = worker
        self.changes.workers_changed()
        self.incremental = self.placement is Placement.SESSIONS and bool(body.get("incremental"))
        log.info("worker %d (pid %d) registered", index, worker.pid)
        self._registered.set()
        self._registered = asyncio.Event()
        self.context.changed()
        return worker

    def _lost(self, worker: Worker) -> None:
        if self.workers.get(worker.index) is not worker:
            return
        del self.workers[worker.index]
        self.changes.workers_changed()
        if self._closed:
            self._lost_while_closed.add(worker.index)
        log.warning("worker %d (pid %d) is gone", worker.index, worker.pid)
        self.context.changed()

    def _claim(self, episode: EpisodeId) -> Any:
        key = episode.capture_key
        if key not in self._held:
            return None
        if self._closed:
            sealed = self._sealed()
            raise CheckpointError(
                Reason.INVALID_PHASE,
                "a checkpoint is open: the restored episode is claimed after resume",
                code="FAILED_PRECONDITION",
                metadata={
                    "captureKey": key,
                    "code": AWAITING_RESTORE if sealed else "admission_closed",
                },
            )
        record = self._held.pop(key)
        self.context.changed()
        return bridged(record)

    def _sealed(self) -> bool:
        return bool(self.context.start_closed_pending)

    async def wait_for_workers(self, within: float) -> None:
        """Until every configured worker is registered (TimeoutError after `within` s)."""
        async with asyncio.timeout(within):
            while len(self.workers) < self.configured:
                await self._registered.wait()

    def _broadcast(self, op: str, body: Any = None) -> None:
        for worker in list(self.workers.values()):
            with contextlib.suppress(WorkerCallFailed):
                worker.link.send(op, body)

    async def _call_all(self, op: str, body: Any) -> dict[int, Any]:
        workers = list(self.workers.values())
        replies = await asyncio.gather(*(w.link.call(op, body) for w in workers))
        return {w.index: reply for w, reply in zip(workers, replies, strict=True)}

    # -- Participant ---------------------------------------------------------------------

    def close_admission(self) -> None:
        self._closed = True
        self._generation += 1
        self._lost_while_closed.clear()
        self._broadcast("close", {"generation": self._generation, "sealed": self._sealed()})
        self.context.changed()

    def open_admission(self) -> None:
        self._closed = False
        self._lost_while_closed.clear()
        # The marks a Restore set after its install (the crashed attempts) reach the workers
        # here, before their first request: admission was closed until now.
        self._broadcast("open", {"marks": self.context.retired.snapshot()})
        self.context.changed()

    def _reported(self, worker: Worker) -> bool:
        return worker.state.closed and worker.state.generation == self._generation

    def ready(self) -> bool:
        if self._lost_while_closed or len(self.workers) < self.configured:
            return False
        return all(self._reported(w) and w.state.ready for w in self.workers.values())

    def report(self) -> ReadinessReport:
        blockers: list[Blocker] = []
        count = 0
        counts: dict[str, int] = {}
        for index in range(self.configured):
            worker = self.workers.get(index)
            if index in self._lost_while_closed:
                blockers.append(
                    Blocker(
                        "",
                        BlockerReason.WORKER_LOST,
                        f"worker {index} was lost while the checkpoint was open: resume first",
                    )
                )
                count += 1
            if worker is None:
                blockers.append(
                    Blocker("", BlockerReason.WORKER_MISSING, f"worker {index} is not running")
                )
                count += 1
                continue
            for name, value in worker.state.counts.items():
                counts[name] = counts.get(name, 0) + value
            if self._closed and not self._reported(worker):
                blockers.append(
                    Blocker(
                        "",
                        BlockerReason.WORKER_MISSING,
                        f"worker {index} has not reported since the checkpoint closed",
                    )
                )
                count += 1
                continue
            blockers.extend(worker.state.blockers)
            count += worker.state.blocker_count
        counts["workers"] = len(self.workers)
        if self.placement is Placement.CLAIMS:
            counts["restored_pending"] = counts.get("restored_pending", 0) + len(self._held)
        ordered = sorted(blockers)
        return ReadinessReport(
            ready=self.ready() if self._closed else count == 0,
            blockers=tuple(ordered[:MAX_LISTED_BLOCKERS]),
            blocker_count=count,
            counts=counts,
        )

    async def export(self, scope: frozenset[EpisodeId] | None) -> Sequence[ExportRecord]:
        self._every_worker_running()
        replies = await self._call_all("export", {"scope": episode_keys(scope)})
        # Decoding every worker's lines is JSON of the whole state (50 MB at 10,000 x 5 KB
        # sessions): on the loop it would stall the sidecar and every worker's bridge for
        # the whole commit.
        records = await asyncio.to_thread(_every_share, replies)
        for key, record in self._held.items():
            episode = EpisodeId.from_capture_key(key)
            if scope is None or episode in scope:
                records.append(ExportRecord(episode, dict(record.fields)))
        records.extend(self.outbox.export())
        return records

    def change_clock(self) -> int:
        return self.changes.cut()

    async def export_changes(
        self, scope: frozenset[EpisodeId] | None, base: ExportBase | None
    ) -> ChangeSet:
        """Each worker's share, decided by its own change clock (worker_changes.py). Only
        resources servers are incremental: their records are all in the workers."""
        self._every_worker_running()
        return await self.changes.export(
            self._call_all, episode_keys(scope), base, self.record_identity
        )

    def _every_worker_running(self) -> None:
        missing = [i for i in range(self.configured) if i not in self.workers]
        if missing:
            raise CheckpointError(
                Reason.INVALID_PHASE,
                f"workers {missing} are not running: their share cannot be exported",
                code="FAILED_PRECONDITION",
            )

    async def install(self, records: Sequence[RestoredRecord]) -> None:
        try:
            await self.wait_for_workers(REGISTER_SECONDS)
        except TimeoutError:
            raise CheckpointError(
                Reason.INVALID_PHASE,
                f"only {len(self.workers)} of {self.configured} workers are running",
                code="FAILED_PRECONDITION",
            ) from None
        if self.placement is Placement.CLAIMS:
            held, own = await restored_results(records)
            await self._hold(own)
            self.outbox.install(held)
            return
        marks = self.context.retired.snapshot()
        await install_sessions(list(self.workers.values()), self.configured, records, marks)

    async def _hold(self, records: Sequence[RestoredRecord]) -> None:
        """Claims placement: validate every record on a worker (the kind's own rules), then
        hold them all here."""
        if any(w.state.served for w in self.workers.values()) or self._held or self.outbox.restored:
            raise CheckpointError(
                Reason.INVALID_CHECKPOINT_STATE,
                "restore needs a process that has not run episodes",
                code="FAILED_PRECONDITION",
            )
        items = [bridged(record) for record in records]
        worker = self.workers[min(self.workers)]
        await worker.link.call("validate", {"records": items})
        for record in records:
            self._held[record.restored_as.capture_key] = record
        self.context.changed()

    async def discard_installed(self, episodes: Sequence[EpisodeId]) -> None:
        for episode in episodes:
            self._held.pop(episode.capture_key, None)
        self.outbox.drop_held_as(set(episodes))
        if self.placement is Placement.SESSIONS:
            await self._call_all("discard", {"episodes": episode_keys(episodes)})
        self.context.changed()

    async def retire(self, episode: EpisodeId) -> None:
        self.outbox.retired(episode)
        for key in list(self._held):
            held = EpisodeId.from_capture_key(key)
            if held.rollout_id == episode.rollout_id and held.attempt <= episode.attempt:
                del self._held[key]
        await self._call_all("retire", {"episode": episode.capture_key})
        self.context.changed()

    async def refresh(self) -> None:
        """Every worker pushes its state now (the `state` call's reply comes behind that push
        on the same connection, so it is here when the call returns). Between pushes a
        worker's copy here is up to `worker_bridge.OPEN_PUSH_SECONDS` old while admission is open: a
        GetStatus right after the last reply of a seed, a close or a retire would count
        sessions that are gone or miss new ones."""
        calls = [asyncio.ensure_future(w.link.call("state")) for w in self.workers.values()]
        if not calls:
            return
        done, late = await asyncio.wait(calls, timeout=REFRESH_SECONDS)
        for call in late:
            call.cancel()
        for call in done:
            if not call.cancelled():
                call.exception()  # a worker lost meanwhile: its loss is reported, not this

    def restored_pending(self) -> frozenset[EpisodeId]:
        pending = {EpisodeId.from_capture_key(k) for k in self._held}
        for worker in self.workers.values():
            pending |= worker.state.restored_pending
        return frozenset(pending)

    def episodes(self) -> Sequence[EpisodeInfo]:
        infos: dict[EpisodeId, EpisodeInfo] = {}
        for worker in self.workers.values():
            for info in worker.state.episodes:
                infos.setdefault(info.episode_id, info)
        for key in self._held:
            episode = EpisodeId.from_capture_key(key)
            infos[episode] = EpisodeInfo(episode, at_boundary=True, restored_pending=True)
        return list(infos.values())

    def has_served(self) -> bool:
        return (
            bool(self._held)
            or self.outbox.restored
            or any(w.state.served for w in self.workers.values())
        )

    def forget_served(self) -> None:
        """Every worker forgets; until its next push says so itself, a worker counts as
        fresh iff it holds no episode any more (the rejoining Restore retired every one it
        listed, and its push after each retire is already here). A worker that still holds
        something keeps it served, and its own install refuses to mix anyway."""
        self._broadcast("forget_served")
        self.outbox.restored = False  # the results held stay (`ResultOutbox.install`)
        for worker in self.workers.values():
            state = worker.state
            state.served = bool(state.episodes or state.restored_pending)

    def record_identity(self, episode: EpisodeId, record: Mapping[str, Any]) -> Hashable:
        if self._identity is not None:
            return outbox_identity(episode, record) or self._identity(episode, record)
        return outbox_identity(episode, record) or episode

    def forget(self, rollout_ids: Sequence[str]) -> None:
        self.outbox.forgotten(rollout_ids)
        self._broadcast("forget", {"rollouts": list(rollout_ids)})

    def result_outbox(self) -> ResultOutbox:
        return self.outbox

    def committed(self, scope: frozenset[EpisodeId] | None) -> None:
        self._broadcast("committed", {"scope": episode_keys(scope)})

    def shutting_down_now(self) -> None:
        self._broadcast("shutting_down")

    def facts(self) -> Mapping[str, str]:
        facts: dict[str, str] = {}
        for worker in self.workers.values():
            facts = dict(worker.facts)
            break
        facts["workers"] = str(self.configured)
        return facts

    def counters(self) -> Mapping[str, int]:
        totals: dict[str, int] = (
            dict(self.outbox.counters()) if self.placement is Placement.CLAIMS else {}
        )
        for worker in self.workers.values():
            for name, value in worker.state.counters.items():
                totals[name] = totals.get(name, 0) + value
        return totals


async def install_sessions(
    workers: Sequence[Worker],
    configured: int,
    records: Sequence[RestoredRecord],
    marks: dict[str, int],
) -> None:
    """Sessions placement: each record to the worker that owns its session, all or nothing
    (what some workers installed is discarded when another refused)."""
    by_worker: dict[int, list[dict[str, Any]]] = {}
    for record in records:
        session_id = record.fields.get("session_id")
        # A record without a session id is the worker's participant's to refuse: any
        # worker will do, as long as it is one.
        owner = session_owner(session_id) if isinstance(session_id, str) else 0
        by_worker.setdefault(owner % configured, []).append(bridged(record))
    installed: list[Worker] = []

    async def install_on(worker: Worker) -> None:
        await worker.link.call(
            "install", {"records": by_worker.get(worker.index, []), "marks": marks}
        )
        installed.append(worker)

    results = await asyncio.gather(*(install_on(w) for w in workers), return_exceptions=True)
    failures = [r for r in results if isinstance(r, BaseException)]
    if failures:
        episodes = episode_keys([r.restored_as for r in records])
        await asyncio.gather(
            *(w.link.call("discard", {"episodes": episodes}) for w in installed),
            return_exceptions=True,
        )
        raise failures[0]


def _report_into(state: WorkerState, body: Any) -> None:
    state.generation = int(body["generation"])
    state.closed = bool(body["closed"])
    state.ready = bool(body["ready"])
    state.blockers = [Blocker(k, BlockerReason(r), d) for k, r, d in body["blockers"]]
    state.blocker_count = int(body["blocker_count"])
    state.counts = {str(k): int(v) for k, v in body["counts"].items()}


def _state_from(body: Any) -> WorkerState:
    state = WorkerState(
        served=bool(body["served"]),
        restored_pending=frozenset(EpisodeId.from_capture_key(k) for k in body["restored_pending"]),
        episodes=[
            EpisodeInfo(
                EpisodeId.from_capture_key(k),
                at_boundary=b,
                restored_pending=p,
                oldest_weight_version=v,
            )
            for k, b, p, v in body["episodes"]
        ],
        counters={str(k): int(v) for k, v in body["counters"].items()},
    )
    _report_into(state, body)
    return state


def _every_share(replies: Mapping[int, Sequence[str]]) -> list[ExportRecord]:
    """Every worker's exported lines as records, worker by worker (blocks: JSON)."""
    records: list[ExportRecord] = []
    for _, lines in sorted(replies.items()):
        records.extend(decoded_records(lines))
    return records
