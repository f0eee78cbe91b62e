"""`collect`'s acknowledgement loop (`receipts.Acknowledgements`) against a real entry member.

The entry is the library's `EpisodeParticipant` served on 127.0.0.1:0 (`test_result_outbox`'s
entry app); the loop reaches it through a discovered `Fleet`, over real RPCs. The entry refuses
the loop's first AcknowledgeResults round with a typed error, as a member that is shutting down
or briefly unreachable would: the receipts still owed must be acknowledged by a later round of
the loop's own, after its backoff, not only when another receipt happens to arrive (at the end
of a run none does, and the entry would hold the result until the next run).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from rollout_checkpoint.client.collect.receipts import Acknowledgements
from rollout_checkpoint.client.fleet import Fleet, FleetSpec, MemberSpec
from rollout_checkpoint.client.ledger import ResultLedger
from rollout_checkpoint.client.participant import receipt_from_header
from rollout_checkpoint.server.core.errors import CheckpointError, Reason
from rollout_checkpoint.server.runtime.result_outbox import Acknowledgement, Receipt, ResultOutbox

from .conftest import TOKEN
from .test_result_outbox import ASK, entry_server, run

RETRIED_WITHIN = 30.0
"""Generous: the loop's first backoff is half a second, on a loaded machine."""


class RefusesFirstRound:
    """The entry's outbox, refusing the first acknowledgement it is sent (SHUTTING_DOWN, a
    typed refusal a member really gives), then releasing as usual."""

    def __init__(self, outbox: ResultOutbox) -> None:
        self.acknowledge = outbox.acknowledge
        self.refused = asyncio.Event()

    def __call__(self, receipts: Sequence[Receipt]) -> Acknowledgement:
        if not self.refused.is_set():
            self.refused.set()
            raise CheckpointError(Reason.SHUTTING_DOWN, "the entry refuses this round")
        return self.acknowledge(receipts)


async def test_a_failed_acknowledgement_round_is_retried_after_its_backoff() -> None:
    async with entry_server() as served:
        reply = await run(served, "r1", 21, **ASK)
        assert reply.status_code == 200, reply.text
        receipt = receipt_from_header(reply.headers["x-rollout-receipt"])
        outbox = served.entry.participant.outbox
        assert outbox is not None
        refusing = RefusesFirstRound(outbox)
        outbox.acknowledge = refusing  # type: ignore[method-assign]
        assert served.entry.runtime is not None
        spec = FleetSpec(
            members=(MemberSpec("entry", served.entry.runtime.address),),
            token=TOKEN,
            allow_agents_without_model=True,  # the entry app is an agent with no model
        )
        async with await Fleet.discover(spec) as fleet:
            ledger = ResultLedger()
            ledger.received(receipt)
            ledger.persisted("r1")  # its output line is durable: the receipt is owed
            acknowledged = asyncio.Event()

            def step(name: str, count: int) -> None:
                if name == "acknowledged":  # a round came back, the ledger is told next
                    acknowledged.set()

            acknowledgements = Acknowledgements(lambda: fleet, ledger, step)
            loop = asyncio.create_task(acknowledgements.run())
            try:
                await asyncio.wait_for(refusing.refused.wait(), RETRIED_WITHIN)
                try:
                    await asyncio.wait_for(acknowledged.wait(), RETRIED_WITHIN)
                except TimeoutError:
                    pytest.fail("the receipt a refused round left owed was never sent again")
            finally:
                loop.cancel()
                await asyncio.gather(loop, return_exceptions=True)
            assert acknowledgements.failed_rounds == 0
        assert ledger.to_acknowledge() == []
        assert (await served.client.list_results()).held == 0
