"""Every rollout of a collection, the moves between its states, and what is recorded of it.

`RolloutBook` is the collector's bookkeeping without any I/O: which rollouts wait, run, wait
to be retired, are done or failed; the checkpoint scope and the controller-state blob are
read off it. Keeping it free of I/O keeps each transition one place that says what a
crash at that point leaves behind.

What is delivered, held for a prompt group, persisted and owed is not decided here but by
the trainer ledger (`client.ledger.ResultLedger`, `book.ledger`), the same one any Python
trainer uses: collect is a trainer whose store is its output file. The book schedules; the
ledger decides whether an outcome is written, when its group is sealed, and which receipts
are owed.
"""

from __future__ import annotations

import asyncio
import collections
import enum
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from rollout_checkpoint.client.collect.inputs import TaskRow, rollout_id_of
from rollout_checkpoint.client.collect.journal import STATE_FORMAT, attempts_in, chains_in
from rollout_checkpoint.client.collect.view import Counts
from rollout_checkpoint.client.ledger import Delivery, GroupRecovery, HeldOutcome, ResultLedger
from rollout_checkpoint.client.participant import receipt_of_message
from rollout_checkpoint.server.core.episodes import MAX_ATTEMPT, EpisodeId
from rollout_checkpoint.v1 import participant_service_pb2 as pb


class Status(enum.Enum):
    """Where a rollout is in its life."""

    PENDING = "pending"
    """Waiting for a dispatch slot (also a restored rollout whose attempt N+1 is not sent)."""
    IN_FLIGHT = "in_flight"
    """Its attempt is logged and its `/run` sent (or about to be)."""
    RETIRING = "retiring"
    """Its attempt failed; it is retired in the next batch, then retried or recorded failed
    (or, cut by a lost member, restarted by the recovery)."""
    HELD = "held"
    """Its outcome is known (a result, or a failure that used up its attempts) and the
    ledger holds it for its group to be sealed: the output lacks it, so it is not finished,
    and its result stays in the entry's outbox (its receipt unacknowledged) until the
    group's write is durable."""
    DONE = "done"
    FAILED = "failed"


@dataclass(eq=False)
class Rollout:
    """One (task, repeat): its current attempt and status."""

    rollout_id: str
    task: TaskRow
    repeat: int
    attempt: int = 0
    status: Status = Status.PENDING
    failures: int = 0
    last_error: str | None = None
    continued: bool = False
    """Restored into the fleet as `attempt` (N+1), which has not replied yet."""
    retired_upto: int | None = None
    """The highest retired attempt, until the rollout is forgotten."""
    highest_used: int = -1
    """The highest attempt that was ever sent or installed by a restore (-1: none): every
    attempt that may hold state somewhere is at most this. Unlike `retired_upto` it is never
    forgotten."""
    sent_in: int = 0
    """The book's `generation` when its current attempt was sent."""
    failure_counted: bool = False
    """Whether the failure of its current attempt counts against `max_attempts` (a failure
    of an attempt a lost member cut does not)."""
    handle: asyncio.Task[None] | None = field(default=None, repr=False)
    sent_attempts: list[int] = field(default_factory=list)
    """Every attempt of it ever dispatched, in order (this run's and, on `--resume`, the
    dispatch log's): the attempt chain its output line names."""
    restored_from: list[tuple[str, int]] = field(default_factory=list)
    """The checkpoints restores continued it from, each with the attempt (N+1) it was
    installed as, in order (kept across `--resume` in the controller state; emptied when it
    restarts from its input)."""
    unsent_restore: int | None = None
    """The attempt (N+1) a restore installed that will never be sent: attempt N's result
    came first (taken back from the entry's outbox on `--resume`). It is retired once the
    rollout's line is durable (`unsent_restores`)."""

    @property
    def episode(self) -> EpisodeId:
        """The episode of its current attempt."""
        return EpisodeId(self.rollout_id, self.attempt)

    def finished_line(
        self,
        reply: dict[str, Any],
        receipt: pb.ResultReceipt | None = None,
        source: str = "run",
    ) -> dict[str, Any]:
        """The output line of a collected rollout, with where it came from (`provenance`):
        the attempts dispatched, the attempt that produced the result, the checkpoints the
        fleet state that produced it was restored from, its receipt's digest, whether a run
        or the entry's outbox delivered it, and the policy weight versions of its turns."""
        produced_by = receipt.attempt if receipt is not None else self.attempt
        lineage = list(receipt.lineage) if receipt is not None else []
        return {
            "rollout_id": self.rollout_id,
            "task_id": self.task.task_id,
            "repeat": self.repeat,
            "attempt": self.attempt,
            "status": "ok",
            "reward": reply.get("reward"),
            "reply": reply,
            "provenance": {
                "attempts": sorted({*self.sent_attempts, self.attempt, produced_by}),
                "produced_by_attempt": produced_by,
                "restored_from": restored_chain(self.restored_from, produced_by, lineage),
                "receipt_sha256": receipt.result_sha256 if receipt is not None else None,
                "source": source,
                "weight_versions": reply.get("weight_versions"),
            },
        }

    def dropped_line(self, reason: str) -> dict[str, Any]:
        """The output line of a rollout dropped on purpose (`--stale drop`), never run again."""
        return {
            "rollout_id": self.rollout_id,
            "task_id": self.task.task_id,
            "repeat": self.repeat,
            "attempt": self.attempt,
            "status": "dropped",
            "reward": None,
            "reason": reason,
        }

    def failed_line(self) -> dict[str, Any]:
        """The output line of a rollout that used up its attempts."""
        return {
            "rollout_id": self.rollout_id,
            "task_id": self.task.task_id,
            "repeat": self.repeat,
            "attempt": self.attempt,
            "status": "failed",
            "reward": None,
            "failures": self.failures,
            "error": self.last_error,
        }


class RolloutBook:
    """Every rollout of the input (`num_repeats` per task), its queues and the counts.

    Only the collector's event loop touches it (no locks); nothing here does I/O."""

    def __init__(
        self,
        tasks: Iterable[TaskRow],
        num_repeats: int,
        counts: Counts,
        group_recovery: GroupRecovery = "sibling",
        ledger: ResultLedger | None = None,
    ) -> None:
        self.rollouts: dict[str, Rollout] = {}
        self.groups: dict[str, list[Rollout]] = {}
        """Task id -> its prompt group: the rollouts of its K repeats, in repeat order."""
        self.group_recovery = group_recovery
        """The run's policy for a group whose task row names none."""
        self.ledger = ledger if ledger is not None else ResultLedger()
        """What is held, persisted and owed (a `--resume` passes the checkpoint's, loaded
        and reconciled with the output)."""
        for task in tasks:
            group = self.groups[task.task_id] = []
            for repeat in range(num_repeats):
                rollout = Rollout(rollout_id_of(task.task_id, repeat), task, repeat)
                self.rollouts[rollout.rollout_id] = rollout
                group.append(rollout)
            self.ledger.group(task.task_id, [r.rollout_id for r in group], self.policy_of(group[0]))
        self.pending: collections.deque[Rollout] = collections.deque()
        self.retire_queue: list[Rollout] = []
        self.forget_queue: set[str] = set()
        self.unsent_restores: list[EpisodeId] = []
        """Restored N+1 attempts of written rollouts that no request will ever use: each is
        retired (`Retirement.retire_unsent_restores`), else it stays a live session on
        every member it was installed on, holding state the run never reads."""
        self.in_flight = 0
        self.generation = 0
        """Raised each time a member is seen lost: an attempt sent in an earlier generation
        that fails was cut by the loss, not failed by its rollout."""
        self._counted = CountedOnce()
        self.counts = counts
        counts.total = len(self.rollouts)

    # -- what a previous run left ---------------------------------------------------------------

    def apply_output(self, finished: dict[str, dict[str, Any]]) -> None:
        """Mark the rollouts the output already holds done or failed (others are ignored)."""
        for rollout_id, line in finished.items():
            rollout = self.rollouts.get(rollout_id)
            if rollout is None:
                continue
            rollout.attempt = int(line["attempt"])
            if line.get("status") == "dropped":
                rollout.status = Status.FAILED
                self.counts.dropped += 1
            elif line.get("status") == "failed":
                rollout.status = Status.FAILED
                self.counts.failed += 1
            else:
                rollout.status = Status.DONE
                self.counts.done += 1

    def apply_marks(self, state: dict[str, Any]) -> None:
        """Take the failure counts and retire marks of a checkpoint's controller state."""
        for rollout_id, count in attempts_in(state.get("failures")).items():
            if rollout_id in self.rollouts:
                self.rollouts[rollout_id].failures = count
        for rollout_id, chain in chains_in(state.get("restored_from")).items():
            if rollout_id in self.rollouts:
                self.rollouts[rollout_id].restored_from = chain
        for rollout_id, attempt in attempts_in(state.get("retired")).items():
            if rollout_id in self.rollouts:
                rollout = self.rollouts[rollout_id]
                rollout.retired_upto = attempt
                rollout.highest_used = max(rollout.highest_used, attempt)

    def retired(self, rollout: Rollout, attempt: int) -> None:
        """Every attempt of `rollout` up to `attempt` is retired everywhere (marks set). A
        rollout already done is forgotten next: nothing of it runs any more."""
        rollout.retired_upto = attempt
        rollout.highest_used = max(rollout.highest_used, attempt)
        if rollout.status is Status.DONE:
            self.forget_queue.add(rollout.rollout_id)

    def continues(self, rollout: Rollout, attempt: int, source: str) -> None:
        """A restore of checkpoint `source` installed `rollout` as `attempt` (N+1): it is
        re-sent as that attempt, which continues from its checkpointed boundary."""
        rollout.attempt = attempt
        rollout.continued = True
        if (source, attempt) not in rollout.restored_from:
            rollout.restored_from.append((source, attempt))
        rollout.status = Status.PENDING
        rollout.highest_used = max(rollout.highest_used, attempt)

    def queue_pending(self) -> None:
        """Queue every pending rollout: continued ones first (their N+1 is restored and
        waits), then restarted ones, then the rest in input order."""
        order = sorted(
            (r for r in self.rollouts.values() if r.status is Status.PENDING),
            key=lambda r: (not r.continued, r.retired_upto is None, r.task.index, r.repeat),
        )
        self.pending.extend(order)

    # -- dispatching and replies ----------------------------------------------------------------

    def apply_sent(self, sent: dict[str, list[int]]) -> None:
        """Take the attempts a previous run's dispatch log says were sent (provenance)."""
        for rollout_id, attempts in sent.items():
            if rollout_id in self.rollouts:
                self.rollouts[rollout_id].sent_attempts = list(attempts)

    def take(self, count: int) -> list[Rollout]:
        """Move up to `count` pending rollouts in flight."""
        batch = [self.pending.popleft() for _ in range(min(count, len(self.pending)))]
        for rollout in batch:
            self.ledger.dispatched(rollout.rollout_id, rollout.attempt)
            if rollout.attempt not in rollout.sent_attempts:
                rollout.sent_attempts.append(rollout.attempt)
            rollout.status = Status.IN_FLIGHT
            rollout.highest_used = max(rollout.highest_used, rollout.attempt)
            rollout.sent_in = self.generation
        self.in_flight += len(batch)
        return batch

    def collected(self, rollout: Rollout) -> None:
        """Its reply is durable in the output. A retired rollout is forgotten next: from
        then on nothing of its retired attempts can still run."""
        rollout.status = Status.DONE
        rollout.continued = False
        self.counts.done += 1
        if rollout.retired_upto is not None:
            self.forget_queue.add(rollout.rollout_id)

    def not_started(self, rollout: Rollout) -> None:
        """Refused before it began: the same attempt goes first again."""
        rollout.status = Status.PENDING
        self.pending.appendleft(rollout)

    def attempt_failed(self, rollout: Rollout, error: str | None) -> None:
        """Its attempt failed: retired in the next batch before anything else happens to it.

        The failure counts against `max_attempts` unless a member was seen lost since the
        attempt was sent: then the loss cut it (a callee gone, a rejoin that retired it), and
        a rollout must not be recorded failed for a crash it had no part in."""
        rollout.failure_counted = rollout.sent_in == self.generation
        if rollout.failure_counted:
            rollout.failures += 1
        rollout.last_error = error
        rollout.status = Status.RETIRING
        rollout.continued = False
        self.retire_queue.append(rollout)

    def exhausted(self, rollout: Rollout, max_attempts: int) -> bool:
        """Whether a retired rollout used up its attempts (or the attempt numbers)."""
        return rollout.failures >= max_attempts or rollout.attempt >= MAX_ATTEMPT - 1

    def recorded_failed(self, rollout: Rollout) -> None:
        """Its failed line is durable in the output."""
        rollout.status = Status.FAILED
        self.counts.failed += 1

    def dropped(self, rollout: Rollout) -> None:
        """Its dropped line is durable in the output: it is settled, never sent again (it
        counts as dropped, not failed)."""
        rollout.status = Status.FAILED
        rollout.continued = False
        self.counts.dropped += 1

    def retry(self, rollout: Rollout) -> None:
        """Its failed attempt is retired: send it again as the next attempt."""
        rollout.attempt += 1
        rollout.status = Status.PENDING
        rollout.restored_from = []  # it starts from its input again
        self.pending.append(rollout)
        self.counts.retried += 1

    def forgotten(self, rollout_ids: Iterable[str]) -> None:
        """The fleet dropped these rollouts' retire marks."""
        for rollout_id in rollout_ids:
            self.forget_queue.discard(rollout_id)
            self.rollouts[rollout_id].retired_upto = None

    # -- prompt groups --------------------------------------------------------------------------

    def policy_of(self, rollout: Rollout) -> GroupRecovery:
        """The recovery policy of `rollout`'s group: its task row's, else the run's."""
        return rollout.task.group_recovery or self.group_recovery

    def held(
        self, rollout: Rollout, line: dict[str, Any], receipt: pb.ResultReceipt | None = None
    ) -> list[HeldOutcome]:
        """Its outcome (`line`: a result, or a failure) is known: the ledger holds it for its
        group. Returns the group's outcomes to write now, in one write, if that sealed the
        group (empty otherwise: a sibling is unfinished, or the output has the rollout
        already, whose receipt the ledger then owes). The attempt that produced it counts as
        used (one taken back on `--resume` was never sent by this run): regenerating the
        group retires up to it."""
        if receipt is None:
            delivery = self.ledger.finished_without_receipt(rollout.rollout_id, line)
        else:
            delivery = self.ledger.received(receipt_of_message(receipt), line)
        if delivery is Delivery.ACKNOWLEDGE:
            # The output has it; a rollout not finished here would wait for it for ever.
            if rollout.status not in (Status.DONE, Status.FAILED):
                raise RuntimeError(f"{rollout.rollout_id}: in the output, yet {rollout.status}")
            return []
        produced_by = receipt.attempt if receipt is not None else rollout.attempt
        rollout.highest_used = max(rollout.highest_used, produced_by)
        if rollout.continued and produced_by < rollout.attempt:
            rollout.unsent_restore = rollout.attempt
        rollout.status = Status.HELD
        rollout.continued = False
        if rollout in self.pending:  # dropped after it was queued: never sent again
            self.pending.remove(rollout)
        return self.ledger.sealed(rollout.rollout_id) if delivery is Delivery.PERSIST else []

    def written(self, outcomes: list[HeldOutcome]) -> None:
        """The lines of a sealed group (`held` returned them) are durable: each rollout is
        finished or recorded failed, and the ledger owes their receipts from now on, not
        before."""
        self.ledger.persisted(*(o.rollout_id for o in outcomes))
        for outcome in outcomes:
            rollout, line = self.rollouts[outcome.rollout_id], outcome.payload
            self._queue_unsent_restore(rollout)
            if line["status"] == "failed":
                self.recorded_failed(rollout)
                continue
            if line["status"] == "dropped":
                self.dropped(rollout)
                continue
            self.collected(rollout)
            if line["provenance"]["source"] == "outbox":
                self.counts.reoffered += 1
        self.counts.groups_sealed += 1

    def _queue_unsent_restore(self, rollout: Rollout) -> None:
        """Queue the restored N+1 of the written `rollout` for its Retire. Not before its line
        is durable: a Retire releases every result of the rollout the entry holds, and until
        then the outbox holds the result's only durable copy."""
        if rollout.unsent_restore is not None:
            self.unsent_restores.append(EpisodeId(rollout.rollout_id, rollout.unsent_restore))
            rollout.unsent_restore = None

    def regenerate(self, rollout: Rollout, retired_upto: int) -> None:
        """Every attempt of the unwritten `rollout` up to `retired_upto` is retired: it
        runs again from its input as the next attempt (a result it held is discarded)."""
        rollout.attempt = retired_upto + 1
        rollout.continued = False
        rollout.unsent_restore = None  # retired with the rest, up to `retired_upto`
        rollout.status = Status.PENDING
        rollout.restored_from = []
        self.ledger.discard(rollout.rollout_id)

    def cut(self, cut: Iterable[str]) -> list[Rollout]:
        """A crash cut the unfinished rollouts `cut` (they continue or restart): their
        groups' recovery is the ledger's (`ResultLedger.cut`). A `sibling` group keeps its
        held siblings (counted); every unwritten sibling of a `group` group is returned, to
        be retired and regenerated (the ledger forgot what it held of them)."""
        decided, first = self.ledger.cut(cut), self._counted.first
        self.counts.siblings_kept += sum(first("kept", r, self.generation) for r in decided.kept)
        self.counts.groups_regenerated += sum(
            first("regenerated", g, self.generation) for g in decided.groups_regenerated
        )
        return [self.rollouts[r] for r in decided.regenerate]

    # -- a lost member ----------------------------------------------------------------------------

    def member_lost(self) -> None:
        """A member was seen down or replaced: every attempt sent so far may have been cut by
        it. Failures not yet retired are no longer counted: a failure reply can arrive before
        the loss is seen (a tool call to a resources server that just died), and it could not
        have been retired since (the dead member refuses every Retire)."""
        self.generation += 1
        for rollout in self.retire_queue:
            if rollout.failure_counted:
                rollout.failures -= 1
                rollout.failure_counted = False

    def continuable(self, continued: Iterable[EpisodeId]) -> list[EpisodeId]:
        """The episodes of a checkpoint's `continued` that a restore may continue now: the
        rollout is unfinished and no attempt after the checkpointed one was ever sent or
        installed. A later attempt may still have requests on their way between survivors,
        which would land on the restored N+1 if it were reused; such a rollout restarts."""
        return sorted(
            e
            for e in continued
            if (rollout := self.rollouts.get(e.rollout_id)) is not None
            and rollout.status not in (Status.DONE, Status.FAILED, Status.HELD)
            and rollout.highest_used <= e.attempt
            and e.attempt < MAX_ATTEMPT
        )

    def installing(self, episodes: Iterable[EpisodeId]) -> None:
        """A restore is about to install these episodes' next attempts (N+1): count them as
        used before it starts, so a restore that fails half way is never continued from."""
        for episode in episodes:
            rollout = self.rollouts[episode.rollout_id]
            rollout.highest_used = max(rollout.highest_used, episode.attempt + 1)

    def may_run(self, excluding: set[str]) -> list[EpisodeId]:
        """Every unfinished rollout (other than `excluding`) with an attempt that may hold
        state somewhere and is not retired, at its highest such attempt. A `HELD` one is
        finished: retiring it would release the result its group still waits to write."""
        return sorted(
            EpisodeId(r.rollout_id, r.highest_used)
            for r in self.rollouts.values()
            if r.rollout_id not in excluding
            and r.status not in (Status.DONE, Status.FAILED, Status.HELD)
            and r.highest_used > (r.retired_upto if r.retired_upto is not None else -1)
        )

    def recovered(
        self,
        continued: Iterable[EpisodeId],
        restarted: Iterable[EpisodeId],
        source: str | None = None,
    ) -> None:
        """The fleet was recovered in place and every request cut by the loss has ended:
        `continued` (as N+1) go first, then `restarted` (each retired up to the attempt
        given) from their inputs as the next attempt, then the rest. Rollouts written
        meanwhile stay finished; one that finished meanwhile and waits for its group stays
        so, unless its group is regenerated (`group` policy: it was restarted for that)."""
        for episode in continued:
            rollout = self.rollouts[episode.rollout_id]
            if rollout.status not in (Status.DONE, Status.FAILED, Status.HELD):
                assert source is not None, "a rollout continues from a checkpoint"
                self.continues(rollout, episode.attempt, source)
        for episode in restarted:
            rollout = self.rollouts[episode.rollout_id]
            kept = rollout.status is Status.HELD and self.policy_of(rollout) == "sibling"
            if rollout.status not in (Status.DONE, Status.FAILED) and not kept:
                self.regenerate(rollout, episode.attempt)
        self.retire_queue = [r for r in self.retire_queue if r.status is Status.RETIRING]
        self.pending.clear()
        self.queue_pending()

    def settled(self) -> bool:
        """Every rollout is done or recorded failed."""
        return all(r.status in (Status.DONE, Status.FAILED) for r in self.rollouts.values())

    def all_done(self) -> bool:
        """Settled, and no `/run` is still on its way back."""
        return self.in_flight == 0 and self.settled()

    def still_marked(self) -> list[str]:
        """The rollouts that still have retire marks, sorted."""
        return sorted(r.rollout_id for r in self.rollouts.values() if r.retired_upto is not None)

    def running_handles(self) -> list[asyncio.Task[None]]:
        """The `/run` tasks that have not ended."""
        return [r.handle for r in self.rollouts.values() if r.handle and not r.handle.done()]

    # -- checkpoints ------------------------------------------------------------------------------

    def on_the_wire(self, held: set[EpisodeId]) -> list[asyncio.Task[None]]:
        """The `/run` tasks of rollouts in flight whose episode the entry point no longer
        holds: their reply is on its way back."""
        return [
            r.handle
            for r in self.rollouts.values()
            if r.status is Status.IN_FLIGHT and r.handle is not None and r.episode not in held
        ]

    def scope(self) -> list[EpisodeId]:
        """The checkpoint's scope: every rollout in flight, plus every restored rollout not
        yet re-sent (named by its attempt N+1: left out, the commit would free it)."""
        return sorted(
            r.episode
            for r in self.rollouts.values()
            if r.status is Status.IN_FLIGHT or (r.continued and r.status is Status.PENDING)
        )


def controller_state(
    book: RolloutBook,
    *,
    run_id: str,
    checkpoint_id: str,
    input_digest: str,
    num_repeats: int,
    boot_ids: dict[str, str],
) -> dict[str, Any]:
    """The controller-state blob of `book` (format `STATE_FORMAT`): what `--resume` needs
    besides the output and the dispatch log (read back by `RolloutBook.apply_marks`)."""

    def pick(select: Callable[[Rollout], bool]) -> dict[str, int]:
        return {r.rollout_id: r.attempt for r in book.rollouts.values() if select(r)}

    return {
        "format": STATE_FORMAT,
        "run_id": run_id,
        "checkpoint_id": checkpoint_id,
        "created_at": now_text(),
        "input_sha256": input_digest,
        "num_repeats": num_repeats,
        "boot_ids": boot_ids,
        "finished": pick(lambda r: r.status is Status.DONE),
        "failed": pick(lambda r: r.status is Status.FAILED),
        "in_flight": pick(lambda r: r.status is Status.IN_FLIGHT),
        "restored_pending": pick(lambda r: r.continued and r.status is Status.PENDING),
        "held": pick(lambda r: r.status is Status.HELD),
        "attempts": pick(lambda r: r.attempt > 0 or r.status is not Status.PENDING),
        "failures": {r.rollout_id: r.failures for r in book.rollouts.values() if r.failures},
        "retired": {
            r.rollout_id: r.retired_upto
            for r in book.rollouts.values()
            if r.retired_upto is not None
        },
        "restored_from": {
            r.rollout_id: [list(link) for link in r.restored_from]
            for r in book.rollouts.values()
            if r.restored_from and r.status not in (Status.DONE, Status.FAILED)
        },
    }


class CountedOnce:
    """What a cut counted, per loss generation: a recovery that fails half way and is tried
    again decides the same cut again, and must not count it twice."""

    def __init__(self) -> None:
        self._seen: set[tuple[str, str, int]] = set()

    def first(self, what: str, name: str, generation: int) -> bool:
        """Whether `what` happens to `name` for the first time in `generation`."""
        key = (what, name, generation)
        if key in self._seen:
            return False
        self._seen.add(key)
        return True


def restored_chain(links: list[tuple[str, int]], produced_by: int, lineage: list[str]) -> list[str]:
    """The checkpoints a result descends from: those restores continued its rollout from up
    to the attempt that produced it (a restore that installed a later attempt, whose result
    came from an earlier one, had no part in it), then the further ones its receipt names."""
    chain = [checkpoint for checkpoint, attempt in links if attempt <= produced_by]
    return [*chain, *(c for c in lineage if c not in chain)]


def now_text() -> str:
    """The current UTC time as RFC 3339 with `Z`."""
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")
