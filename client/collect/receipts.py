"""Receipts in `collect`: acknowledge what the output holds, take back what it lacks.

Every `/run` asks the entry point for a receipt (`x-rollout-receipt: request`): the entry
keeps the result in its outbox until it is acknowledged, and every checkpoint carries the
outbox. The two rules below make each (task, repeat) reach the output exactly once, however
the collector, the entry or everything crashes:

* **Acknowledge only what is durable** (`Acknowledgements`): a receipt is acknowledged after
  its output line is durable, never before: the book's `ResultLedger` owes it from then on
  (`persisted`), and `Acknowledgements` sends what the ledger owes. A collector killed between the reply and its
  line leaves the result held by the entry; one killed after the line and before the
  acknowledgement leaves it held too, and the next run acknowledges it without writing it
  again (the output already names the rollout).
* **Take back before restarting anything** (`HeldResults.take_back`): a `--resume` lists the
  results the entry members hold (ListResults) right after the fleet is restored or reopened
  and before the unfinished rollouts are retired (a Retire releases the rollout's held
  result): one the output lacks goes to its prompt group (`groups`), written with it once
  the group is sealed, counted as re-offered, not run again. Its receipt is acknowledged
  only then: until its group is durable, the outbox is the result's only durable copy.

Acknowledgements go to every entry member (environment and agent): the one that issued a
receipt releases it, the others hold nothing of it and count it `not_held`. A failed round
keeps the receipts for the next one; it never fails the run (held results cost the entry
memory, and at worst a full outbox refuses new runs, which `collect` backs off from).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable, Sequence
from typing import Any

import grpc

from rollout_checkpoint.client.checkpointing import fanout
from rollout_checkpoint.client.collect.errors import UsageError
from rollout_checkpoint.client.collect.groups import GroupWriter
from rollout_checkpoint.client.collect.journal import DurableAppender
from rollout_checkpoint.client.collect.rollouts import RolloutBook, Status
from rollout_checkpoint.client.collect.view import CollectView
from rollout_checkpoint.client.errors import ControlError
from rollout_checkpoint.client.fleet import Fleet
from rollout_checkpoint.client.fleet.discovery import Member
from rollout_checkpoint.client.ledger import ResultLedger
from rollout_checkpoint.client.participant import receipt_of_message
from rollout_checkpoint.server.core.receipts import Receipt
from rollout_checkpoint.v1 import participant_service_pb2 as pb
from rollout_checkpoint.v1 import types_pb2

RECEIPT_REQUEST = {"x-rollout-receipt": "request"}
"""The header every `/run` of `collect` carries."""
RECEIPT_HEADER = "x-rollout-receipt"
"""The reply header holding the receipt (JSON)."""
SOURCE_HEADER = "x-rollout-result-source"
"""The reply header saying whether a run (`run`) or the outbox (`outbox`) delivered it."""
ENTRY_KINDS = (types_pb2.PARTICIPANT_KIND_ENVIRONMENT, types_pb2.PARTICIPANT_KIND_AGENT)
ACK_BATCH = 1000
ACK_SECONDS = 10.0
"""The deadline of one AcknowledgeResults call."""
ACK_EVERY = 0.2
"""Receipts wait at most this long to be acknowledged in a batch."""
ACK_SETTLE_SECONDS = 5.0
"""At the end of a run, how long acknowledging what waits may take."""


def entry_members(fleet: Fleet) -> list[Member]:
    """The members that may hold results under receipts: environments and agents."""
    return [m for m in fleet.members if m.kind in ENTRY_KINDS]


class DeliverySteps:
    """The delivery steps of a run, each numbered by its own count from 1 (`received`: the
    Nth result's reply arrived, its line not written; `persisted`: the Nth write of a sealed
    prompt group is durable, its receipts not acknowledged; `acknowledging` /
    `acknowledged`: the Nth acknowledgement round is about to leave / came back), handed to
    the run's step hook: fault tests kill the collector at an exact edge of the receipt
    protocol."""

    def __init__(self, hook: Callable[[str, int], None] | None) -> None:
        self._hook = hook
        self._counts: dict[str, int] = {}

    def __call__(self, step: str) -> None:
        if self._hook is not None:
            self._counts[step] = self._counts.get(step, 0) + 1
            self._hook(step, self._counts[step])


class Acknowledgements:
    """Sends what the run's `ResultLedger` owes (the receipts of durable output lines) in
    batches to the entry members of the current fleet (`fleet()`: a recovery swaps it). The
    ledger's state goes into every checkpoint's controller state (`ledger_state`), so a
    resumed run acknowledges what a crash left owed."""

    def __init__(
        self,
        fleet: Callable[[], Fleet | None],
        ledger: ResultLedger,
        step_hook: Callable[[str, int], None] | None = None,
    ) -> None:
        self._fleet = fleet
        self._steps = DeliverySteps(step_hook)
        self.ledger = ledger
        self.ledger.forget_settled()  # the output tells those; the state carries what is owed
        self._wake = asyncio.Event()
        self.owed()
        self.failed_rounds = 0

    def owed(self) -> None:
        """The ledger may owe receipts now (a group's write is durable): send them soon."""
        if self.ledger.to_acknowledge():
            self._wake.set()

    def ledger_state(self) -> dict[str, Any]:
        """The ledger's state, for the controller state of a checkpoint."""
        return self.ledger.state()

    async def run(self) -> None:
        """Acknowledge as receipts come, until cancelled. A failed round is tried again after
        its backoff, on its own: the wake-up that started it is spent, and waiting for the
        next one would leave what it owed held until another receipt happens to come, which
        at the end of a run none does."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            await asyncio.sleep(ACK_EVERY)  # gather a batch
            if not await self.flush():
                await asyncio.sleep(self.backoff())
                self._wake.set()  # what the failed round owed goes with the next one

    def backoff(self) -> float:
        """Seconds before the round after `failed_rounds` failed ones: doubling from half a
        second, at most ten (a member restarting is back within seconds; one gone for long
        is not hammered)."""
        return min(0.5 * 2.0**self.failed_rounds, 10.0)

    async def flush(self) -> bool:
        """Acknowledge every owed receipt now; False (the receipts still owed) on a failure."""
        fleet = self._fleet()
        owed = self.ledger.to_acknowledge()
        if fleet is None or not owed:
            return True
        batch = owed[:ACK_BATCH]
        self._steps("acknowledging")
        try:
            await acknowledge(fleet, batch)
        except (ControlError, fanout.FleetError, OSError):
            self.failed_rounds += 1
            return False
        self._steps("acknowledged")
        self.ledger.acknowledged(batch)
        self.ledger.forget_settled()  # the output tells them again on --resume
        self.failed_rounds = 0
        if self.ledger.to_acknowledge():
            self._wake.set()
        return True

    async def flush_now(self) -> None:
        """Acknowledge everything owed now, batch after batch, until a round fails (what is
        left waits for `run`)."""
        while self.ledger.to_acknowledge():
            if not await self.flush():
                self._wake.set()
                return

    async def settle(self, within: float) -> None:
        """At the end of the run: acknowledge what waits, for at most `within` seconds."""
        end = time.monotonic() + within
        while self.ledger.to_acknowledge() and time.monotonic() < end:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(0.0, end - time.monotonic())):
                    if not await self.flush():
                        await asyncio.sleep(0.2)


def serves_no_outbox(error: ControlError) -> bool:
    """Whether a failed outbox call says the member has no outbox at all: a participant of
    an earlier release (UNIMPLEMENTED) or another implementation of the contract that does
    not serve these RPCs (UNKNOWN, no reason). Such an entry issues no receipts, so it holds
    nothing to take back and owes nothing to acknowledge; any other failure is a failure."""
    return not error.reason and error.code in (
        grpc.StatusCode.UNIMPLEMENTED,
        grpc.StatusCode.UNKNOWN,
    )


async def acknowledge_all(fleet: Fleet, receipts: Sequence[pb.ResultReceipt | Receipt]) -> None:
    """Acknowledge `receipts` on every entry member, `ACK_BATCH` at a time."""
    for start in range(0, len(receipts), ACK_BATCH):
        await acknowledge(fleet, receipts[start : start + ACK_BATCH])


async def acknowledge(fleet: Fleet, receipts: Sequence[pb.ResultReceipt | Receipt]) -> None:
    deadline = time.time() + ACK_SECONDS

    async def on(member: Member) -> None:
        try:
            await member.client.acknowledge_results(receipts, deadline)
        except ControlError as error:
            if not serves_no_outbox(error):
                raise

    await fanout.fan_out("acknowledge", entry_members(fleet), on, fleet.spec.fan_out)


async def held_results(fleet: Fleet) -> list[pb.HeldResult]:
    """Every result the entry members hold, one per rollout (the newest attempt's)."""

    async def of(member: Member) -> list[pb.HeldResult]:
        try:
            return await member.client.all_results()
        except ControlError as error:
            if serves_no_outbox(error):
                return []
            raise

    pages = await fanout.fan_out("list results", entry_members(fleet), of, fleet.spec.fan_out)
    newest: dict[str, pb.HeldResult] = {}
    for results in pages.values():
        for held in results:
            known = newest.get(held.receipt.rollout_id)
            if known is None or known.receipt.attempt < held.receipt.attempt:
                newest[held.receipt.rollout_id] = held
    return [newest[r] for r in sorted(newest)]


async def owe_what_the_restore_holds_again(fleet: Fleet, ledger: ResultLedger) -> int:
    """After an in-place restore into `fleet`: make the ledger owe an acknowledgement for
    every result the entry members hold again of a rollout the output already holds; how
    many.

    A restore installs the outbox as the checkpoint saw it. A result persisted before that
    checkpoint and acknowledged after it was released by the members the loss took, and the
    ledger forgot it (`forget_settled`): the restored members hold it again and nothing
    would ever acknowledge it, since no `--resume` (whose `take_back` does this) follows a
    recovery in place. Only a result the output holds is owed (acknowledging one it lacks
    would release its only durable copy): a rollout that restarted had its result released
    by its Retire, and one held for its group is owed once the group is written. The
    acknowledgement itself goes out with the next round, to the fleet the recovery hands
    over, so a failed round here never fails the recovery."""
    owed = 0
    for held in await held_results(fleet):
        if not ledger.is_persisted(held.receipt.rollout_id):
            continue
        with contextlib.suppress(ValueError):  # a malformed receipt: no entry issues one
            ledger.received(receipt_of_message(held.receipt))
            owed += 1
    return owed


class HeldResults:
    """What `collect` does with the results the entry members hold before it dispatches."""

    def __init__(
        self,
        fleet: Fleet,
        book: RolloutBook,
        output: DurableAppender,
        view: CollectView,
        acknowledgements: Acknowledgements,
    ) -> None:
        self.fleet = fleet
        self.book = book
        self.output = output
        self.view = view
        self.acknowledgements = acknowledgements
        self.taken = 0
        """Held results taken back into their groups by `take_back`."""

    async def take_back(self) -> None:
        """`--resume`: hand every held result to the ledger (`received`): one the output
        lacks joins its group, written once the group is sealed (until then its receipt is
        not owed); one the output holds is owed its acknowledgement. A held result no row
        can come from (not JSON, an error reply, a rollout of no task) is released. Then
        acknowledge what the ledger owes."""
        held = await held_results(self.fleet)
        release: list[pb.ResultReceipt] = []
        self.taken = 0
        for result in held:
            if not await self._take(result):
                release.append(result.receipt)
        await acknowledge_all(self.fleet, release)
        await self.acknowledgements.flush_now()
        if held:
            self.view.note(
                f"collect: the entry held {len(held)} result(s) never acknowledged; "
                f"{self.taken} of them were not in the output and are taken from it, not run "
                "again"
            )

    async def release(self) -> None:
        """A new collection: release whatever the entry members still hold of rollouts of
        these ids (an earlier collection's, never acknowledged), so no run of this one is
        answered with another collection's result."""
        held = await held_results(self.fleet)
        await acknowledge_all(self.fleet, [h.receipt for h in held])
        if held:
            self.view.note(f"collect: released {len(held)} result(s) an earlier run left held")

    async def _take(self, held: pb.HeldResult) -> bool:
        """Hand `held` to the ledger (False: it is released instead)."""
        rollout = self.book.rollouts.get(held.receipt.rollout_id)
        try:
            receipt = receipt_of_message(held.receipt)
        except ValueError:
            return False
        if rollout is None:
            return False
        if rollout.status in (Status.DONE, Status.FAILED):
            # The output holds it already: the ledger owes its acknowledgement.
            self.book.ledger.received(receipt)
            return True
        try:
            reply = json.loads(held.result_json)
        except ValueError:
            return False
        if not isinstance(reply, dict) or "error" in reply:
            return False
        self.taken += 1
        line = rollout.finished_line(reply, held.receipt, "outbox")
        await GroupWriter(self.book, self.output).hold(rollout, line, held.receipt)
        return True


async def check_outbox_room(fleet: Fleet, concurrency: int, num_repeats: int) -> None:
    """Refuse (`UsageError`, before anything is dispatched) a run an entry's outbox cannot
    hold: a prompt group's finished siblings stay held until the group is written, so up to
    `concurrency` groups of `num_repeats` results may be held at once, and an outbox full of
    them would refuse (`outbox_full`) the very runs their groups wait for, for ever."""
    need = concurrency * num_repeats

    async def cap_of(member: Member) -> int:
        try:
            return (await member.client.list_results(page_size=1)).cap
        except ControlError as error:
            if serves_no_outbox(error):
                return 0
            raise

    caps = await fanout.fan_out("list results", entry_members(fleet), cap_of, fleet.spec.fan_out)
    for name, cap in sorted(caps.items()):
        if 0 < cap < need:
            raise UsageError(
                f"{name}'s result outbox holds at most {cap} results, and --concurrency "
                f"{concurrency} x --num-repeats {num_repeats} = {need} may be held at once "
                "until their prompt groups are written: lower --concurrency, or raise "
                f"ROLLOUT_CHECKPOINT_OUTBOX_CAP on {name}"
            )
