"""Agent and environment participants: episodes with boundaries (episode_steps.py) as records.

Agent record:        {"episode_id": ..., "boundary": <JSON or null>}
Environment record:  {"episode_id": ..., "task_digest": "<sha256>", "boundary": <JSON or null>}

A restored record is held under its replacement (attempt N+1) until that replacement's run
begins here and claims it, once. A checkpoint taken before the replacement starts exports the
restored record again under N+1, so a second crash still continues (as N+2).

A finished episode's outcome is kept only while a checkpoint may need it (outcomes.py): the
participant installs `ReplyDeliveryMiddleware` through `install_checkpointing`, which tells
it when each reply left, and releases the rest at each commit. A run whose caller asked for
a receipt is held longer, in the result outbox, until the caller acknowledges it
(receipts.py, runtime/result_outbox.py): in this process, or in the main process of a
server with several workers (its bridge offers `remote_outbox`).
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Hashable, Mapping, Sequence
from typing import Any, cast

from rollout_checkpoint.server.core.episodes import EpisodeId
from rollout_checkpoint.server.core.errors import CheckpointError, Reason, rejected_checkpoint
from rollout_checkpoint.server.core.receipts import Receipt
from rollout_checkpoint.server.episodic.delivery import ReplyDeliveryMiddleware
from rollout_checkpoint.server.episodic.episode_steps import (
    EpisodeRefused,
    EpisodeSteps,
    TrackedEpisode,
)
from rollout_checkpoint.server.episodic.receipts import OutboxAccess, ResultReceiptMiddleware
from rollout_checkpoint.server.runtime.participant import (
    AsgiWrapper,
    ChangeSet,
    ExportBase,
    ExportRecord,
    Kind,
    Participant,
    ReadinessReport,
    RestoredRecord,
    UnchangedRecord,
)
from rollout_checkpoint.server.runtime.record_stamps import PRUNE_FLOOR
from rollout_checkpoint.server.runtime.result_outbox import (
    Lookup,
    Produced,
    ResultOutbox,
    outbox_identity,
    restored_results,
)


def task_digest(task: Any) -> str:
    """SHA-256 of the task with sorted keys and compact separators."""
    return hashlib.sha256(
        json.dumps(task, sort_keys=True, separators=(",", ":")).encode()
    ).hexdigest()


class EpisodeParticipant(Participant):
    """A participant whose state is its episodes' boundaries.

    The agent participant as is (`Kind.AGENT`); `EnvironmentParticipant` adds the task pin.
    The server drives its episodes through `episodes_tracker` (begin, step, boundary, end)
    once the control plane has attached it; every `Participant` method delegates there.
    """

    def __init__(self, kind: Kind, instance: str, *, incremental: bool = False) -> None:
        """`incremental`: the server declares that its episodes' records change only through
        this participant (see `export_changes`); its checkpoints then reference unchanged
        records in earlier parts.

        Off by default, as `checkpoint_incremental`: only the server can declare that it never
        mutates a boundary it recorded. The project's agent records a JSON copy of its state
        at every step, so it may declare it, and gains most (2,000 episodes of ~3.6 KB, 10 %
        moved: pause 0.14x, bytes 0.13x). The project's environment may too, but its record is
        a task digest that changes only when an episode begins or ends: a reference line is
        about 40 % of it, so it gains little (pause 0.69x of ~100 ms, bytes 0.44x) and
        retention keeps 1.65x: leave it full (benchmarks/episodic_incremental.py)."""
        self.kind = kind
        self.instance = instance
        self.incremental = incremental
        self.steps: EpisodeSteps | None = None
        self.outbox: ResultOutbox | None = None
        """The results held under receipts here; None in a worker, whose outbox is the main
        process's (`remote_outbox`)."""
        self._remote_outbox: OutboxAccess | None = None

    def attach(self, context: Any) -> None:
        super().attach(context)
        self.steps = EpisodeSteps(
            lambda: context.retired,
            context.changed,
            sealed=lambda: bool(context.start_closed_pending),
        )
        self._remote_outbox = getattr(context, "remote_outbox", None)
        if self._remote_outbox is None:
            self.outbox = ResultOutbox.of(context)

    @property
    def episodes_tracker(self) -> EpisodeSteps:
        """The episode steps of this participant; only after `install_checkpointing` attached
        it (AssertionError before: with checkpointing off there is nothing to track)."""
        assert self.steps is not None, "the participant is not attached to a control plane"
        return self.steps

    # -- Participant --------------------------------------------------------------------

    def close_admission(self) -> None:
        self.episodes_tracker.close()

    def open_admission(self) -> None:
        self.episodes_tracker.open()

    def ready(self) -> bool:
        return self.episodes_tracker.ready()

    def report(self) -> ReadinessReport:
        blockers, count = self.episodes_tracker.blockers()
        report = ReadinessReport.build(blockers, self.episodes_tracker.counts())
        return ReadinessReport(report.ready, report.blockers, count, report.counts)

    async def export(self, scope: frozenset[EpisodeId] | None) -> Sequence[ExportRecord]:
        changes = await self.export_changes(scope, None)
        return cast(Sequence[ExportRecord], changes.items)

    def change_clock(self) -> int:
        return self.episodes_tracker.stamps.clock

    async def export_changes(
        self, scope: frozenset[EpisodeId] | None, base: ExportBase | None
    ) -> ChangeSet:
        """Every episode's record, the ones unchanged since the `base` part's cut as
        `UnchangedRecord`s (no copy of their boundary, no line written: the JSON copy and
        the encoding are the cost of a part). Held results are exported whole every time:
        the outbox holds only what its callers have not acknowledged yet.

        Unchanged means that no `EpisodeSteps` method stamped the episode's key since the
        cut (episode_steps.py). That holds only while the server changes a boundary by
        recording it again (`boundary`), never by mutating the object it recorded: the
        project's environment and agent record a fresh value each time, which is what an
        `incremental` server declares too."""
        tracker = self.episodes_tracker
        stamps = tracker.stamps
        items: list[ExportRecord | UnchangedRecord] = []
        for episode_id, boundary in tracker.export(scope):
            if stamps.unchanged(episode_id.capture_key, episode_id, base):
                items.append(UnchangedRecord(episode_id, episode_id))
            else:
                fields = self.record_fields(episode_id, _json_copy(boundary))
                items.append(ExportRecord(episode_id, fields))
        if self.outbox is not None:
            items.extend(self.outbox.export())
        return ChangeSet(items)

    def record_identity(self, episode: EpisodeId, record: Mapping[str, Any]) -> Hashable:
        return outbox_identity(episode, record) or episode

    def record_fields(self, episode_id: EpisodeId, boundary: Any) -> dict[str, Any]:
        """The stored fields of one episode's record (beside `episode_id`), from its boundary
        (already a JSON copy). A kind that stores more overrides it and `validate_record`."""
        return {"boundary": boundary}

    def validate_record(self, record: RestoredRecord) -> Any:
        """The boundary of a stored record; raise `rejected_checkpoint` naming the episode."""
        if set(record.fields) != {"boundary"}:
            raise rejected_checkpoint(
                f"a {self.kind.value} record holds exactly a boundary",
                capture_key=record.checkpointed.capture_key,
            )
        return record.fields["boundary"]

    async def install(self, records: Sequence[RestoredRecord]) -> None:
        if self.has_served():
            raise rejected_checkpoint("restore needs a process that has not run episodes")
        held, own = await restored_results(records)
        boundaries = {record.restored_as: self.validate_record(record) for record in own}
        self.installed(own)
        self.episodes_tracker.install(boundaries)
        if held:
            if self.outbox is None:
                raise rejected_checkpoint("a worker holds no outbox: restore through its server")
            self.outbox.install(held)

    def installed(self, records: Sequence[RestoredRecord]) -> None:
        """Every record is valid and about to be installed: keep what the kind needs of them."""
        return None

    async def discard_installed(self, episodes: Sequence[EpisodeId]) -> None:
        self.episodes_tracker.discard_installed(episodes)
        if self.outbox is not None:
            undone = set(episodes)
            self.outbox.drop_held_as(undone)

    async def retire(self, episode: EpisodeId) -> None:
        if self.outbox is not None:
            self.outbox.retired(episode)
        await self.episodes_tracker.retire(episode)

    def forget(self, rollout_ids: Sequence[str]) -> None:
        if self.outbox is not None:
            self.outbox.forgotten(rollout_ids)
        self.episodes_tracker.forget(rollout_ids)

    def committed(self, scope: frozenset[EpisodeId] | None) -> None:
        self.episodes_tracker.committed(scope)

    def data_plane_middleware(self) -> Sequence[AsgiWrapper]:
        # Delivery outermost: it reports what was really handed to the server, after the
        # receipt middleware released a held-back reply.
        return [
            functools.partial(ReplyDeliveryMiddleware, reports=self),
            functools.partial(ResultReceiptMiddleware, outbox=self),
        ]

    # -- OutboxAccess (receipts.py) --------------------------------------------------------

    async def lookup(self, episode: EpisodeId, route: str) -> Lookup:
        """What the outbox holds of `episode`'s rollout for `route` (here, or in the main
        process of a server with several workers), and whether it has room."""
        if self._remote_outbox is not None:
            return await self._remote_outbox.lookup(episode, route)
        return cast(ResultOutbox, self.outbox).lookup(episode, route)

    async def put(self, produced: Produced) -> Receipt | None:
        """Hold the result; the outcome kept for a caller without a receipt goes, since the
        outbox now holds this result until its acknowledgement (never twice)."""
        if self._remote_outbox is not None:
            receipt = await self._remote_outbox.put(produced)
        else:
            lineage = getattr(self.context, "lineage", ())
            receipt = cast(ResultOutbox, self.outbox).hold(produced, lineage)
        if receipt is not None:
            self.episodes_tracker.receipted(produced.episode)
        return receipt

    def result_outbox(self) -> ResultOutbox | None:
        return self.outbox

    def counters(self) -> Mapping[str, int]:
        return self.outbox.counters() if self.outbox is not None else {}

    def delivered(self, episode_id: EpisodeId) -> None:
        """The reply of `episode_id`'s run left (see `EpisodeSteps.delivered`)."""
        self.episodes_tracker.delivered(episode_id)

    def delivery_failed(self, episode_id: EpisodeId) -> None:
        """The reply of `episode_id`'s run never left (see `EpisodeSteps.delivery_failed`)."""
        self.episodes_tracker.delivery_failed(episode_id)

    def restored_pending(self) -> frozenset[EpisodeId]:
        return self.episodes_tracker.restored_pending()

    def episodes(self) -> Sequence[Any]:
        return self.episodes_tracker.episode_infos()

    def has_served(self) -> bool:
        return self.episodes_tracker.has_served() or (
            self.outbox is not None and self.outbox.restored
        )

    def forget_served(self) -> None:
        """Also forget having installed an outbox, but keep the results held: they are
        finished, and a rejoining restore adds the checkpoint's beside them
        (`ResultOutbox.install`)."""
        self.episodes_tracker.forget_served()
        if self.outbox is not None:
            self.outbox.restored = False

    async def claim_restored(self, episode_id: EpisodeId) -> None:
        """In one worker of several: claim `episode_id`'s restored record from the main
        process before `begin`, so the replacement continues from its boundary whichever
        worker its run reached (exactly one claim gets it; worker_pool.py). A no-op in a
        one-process server, where the install put the record here already.

        Raises `EpisodeRefused` while a checkpoint is open: a record claimed then would be in
        no worker's export and the main process's alike, or in both."""
        claim = getattr(self.context, "claim", None)
        if claim is None:
            return
        try:
            record = await claim(episode_id)
        except CheckpointError as refused:
            code = refused.metadata.get("code", "admission_closed")
            raise EpisodeRefused(code, refused.message) from None
        if record is not None:
            boundary = self.validate_record(record)
            self.installed([record])
            self.episodes_tracker.install({record.restored_as: boundary})

    def begin(self, episode_id: EpisodeId) -> tuple[TrackedEpisode, Any]:
        """Start an episode in the running task (see `EpisodeSteps.begin`: it returns the
        restored boundary, or NO_BOUNDARY, and raises `EpisodeRefused`)."""
        return self.episodes_tracker.begin(episode_id)


class EnvironmentParticipant(EpisodeParticipant):
    """An environment's episodes also pin their task: a replacement must run the same task."""

    def __init__(self, instance: str, *, incremental: bool = False) -> None:
        super().__init__(Kind.ENVIRONMENT, instance, incremental=incremental)
        self.digests: dict[str, str] = {}
        self._restored_digests: dict[str, str] = {}
        self._outcome_digests: dict[str, str] = {}
        """The task pins of ended episodes whose outcome is still held (`end_task` keeps
        them): the outcome's record names its task too, whatever the outcome holds."""
        self._outcome_digests_limit = PRUNE_FLOOR

    def record_fields(self, episode_id: EpisodeId, boundary: Any) -> dict[str, Any]:
        """`{"task_digest", "boundary"}`: the digest pins the task a replacement must run
        (the running episode's, a restored one's, or a finished outcome's).

        A record without it would make the whole checkpoint unrestorable (`validate_record`
        refuses it, and a restore installs all or nothing), found only at the restore that
        needed it: an episode whose task is unknown (begun with `begin`, not `begin_task`)
        fails the Commit instead, typed and naming the episode, with nothing written."""
        key = episode_id.capture_key
        digest = (
            self.digests.get(key)
            or self._restored_digests.get(key)
            or self._outcome_digests.get(key)
        )
        if digest is None and isinstance(boundary, dict):
            digest = boundary.get("task_digest")  # an outcome restored from an older part
        if not isinstance(digest, str) or len(digest) != 64:
            raise CheckpointError(
                Reason.HOOK_FAILED,
                f"environment episode {key} has no task: begin environment episodes with "
                "begin_task (a record without its task could not be restored)",
                metadata={"captureKey": key},
            )
        return {"task_digest": digest, "boundary": boundary}

    def validate_record(self, record: RestoredRecord) -> Any:
        fields = record.fields
        digest = fields.get("task_digest")
        if (
            set(fields) != {"task_digest", "boundary"}
            or not isinstance(digest, str)
            or len(digest) != 64
        ):
            raise rejected_checkpoint(
                "an environment record holds exactly task_digest and boundary",
                capture_key=record.checkpointed.capture_key,
            )
        return fields["boundary"]

    def installed(self, records: Sequence[RestoredRecord]) -> None:
        # Only once every record is valid: a digest kept from a failed install would refuse
        # (TASK_MISMATCH) a fresh start of that key with another task.
        for record in records:
            self._restored_digests[record.restored_as.capture_key] = record.fields["task_digest"]

    async def discard_installed(self, episodes: Sequence[EpisodeId]) -> None:
        await super().discard_installed(episodes)
        for episode in episodes:
            self._restored_digests.pop(episode.capture_key, None)

    def forget_served(self) -> None:
        """Also drop the task pins of restored episodes no longer held (a retire drops the
        boundary, not its pin): a pin kept would refuse (TASK_MISMATCH) a fresh start of
        that key with another task after the rejoining restore."""
        super().forget_served()
        pending = {e.capture_key for e in self.restored_pending()}
        for key in [k for k in self._restored_digests if k not in pending]:
            del self._restored_digests[key]

    def begin_task(self, episode_id: EpisodeId, task: Any) -> tuple[TrackedEpisode, Any]:
        """Start an episode for `task`; a restored replacement must bring the same task."""
        key = episode_id.capture_key
        digest = task_digest(task)
        expected = self._restored_digests.get(key)
        if expected is not None and expected != digest:
            raise CheckpointError(
                Reason.TASK_MISMATCH,
                f"the replacement {key} runs a different task than the checkpointed one",
                metadata={"captureKey": key},
            )
        episode, restored = self.begin(episode_id)
        self._restored_digests.pop(key, None)
        self.digests[key] = digest
        return episode, restored

    def end_task(self, episode: TrackedEpisode) -> None:
        """End an episode begun with `begin_task` and drop its task pin; call it in a
        `finally`, so a failed or retired episode stops blocking and being tracked."""
        key = episode.episode_id.capture_key
        digest = self.digests.pop(key, None)
        stamps = self.episodes_tracker.stamps
        stamps.touch(key)
        self.episodes_tracker.end(episode)
        if digest is not None and stamps.holds(key):  # its outcome is held: keep the pin
            self._outcome_digests[key] = digest
            if len(self._outcome_digests) > self._outcome_digests_limit:
                self._prune_outcome_digests()

    def _prune_outcome_digests(self) -> None:
        """Drop the pins of outcomes no longer held: bounded by the outcomes held (which
        bound themselves), pruned at every commit and when grown past twice the last
        pruning's (as `RecordStamps`)."""
        holds = self.episodes_tracker.stamps.holds
        self._outcome_digests = {k: d for k, d in self._outcome_digests.items() if holds(k)}
        self._outcome_digests_limit = 2 * len(self._outcome_digests) + PRUNE_FLOOR

    def committed(self, scope: frozenset[EpisodeId] | None) -> None:
        super().committed(scope)
        self._prune_outcome_digests()

    def facts(self) -> Mapping[str, str]:
        return {"relay_step": "replay"}


def _json_copy(value: Any) -> Any:
    """Boundaries go to storage as JSON; a copy keeps the live episode's objects unaliased.

    A value JSON cannot carry is left as it is, so the commit's own serializer refuses it
    with UNSERIALIZABLE_STATE naming the episode."""
    try:
        return json.loads(json.dumps(value, allow_nan=False))
    except (TypeError, ValueError, RecursionError):
        return value
