"""The receipt protocol under random interleavings: no row lost, no row written twice.

A hypothesis state machine plays a trainer (the `ResultLedger` and an append-only store) and
an entry (the real `ResultOutbox`) through every interleaving of dispatch, a run finishing,
a reply delivered or lost, persist, acknowledge, checkpoint (the outbox and the ledger's
state published together), a crash of the trainer, a crash of the entry (restored from the
last checkpoint, every held result under its attempt N+1) and the recovery the docs give
(list what the entry holds, persist what the store lacks, acknowledge). After every step
no rollout is in the store twice; at the end, once everything drains, every rollout is in
the store exactly once and the entry holds nothing. A held result is never run again: a
dispatch of a rollout the entry holds is answered from the outbox. The rollouts form prompt
groups of two: the ledger asks to persist a group only whole, in one write, so the store
never holds part of a group.

The ledger's state must load strictly, too: tests below refuse what it would not write.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from rollout_checkpoint.client.ledger import (
    FORMAT,
    Delivery,
    LedgerStateError,
    Receipt,
    ResultLedger,
)
from rollout_checkpoint.server.core.episodes import EpisodeId
from rollout_checkpoint.server.runtime.records_codec import EncodedJSON
from rollout_checkpoint.server.runtime.result_outbox import (
    HeldResult,
    Produced,
    ResultOutbox,
    canonical_json,
    result_digest,
)

ROUTE = "/run"
ROLLOUTS = [f"r{i}" for i in range(4)]
GROUPS = {"g0": ["r0", "r1"], "g1": ["r2", "r3"]}


def stored(fields: dict[str, Any]) -> dict[str, Any]:
    """A record's fields as a restore reads them back (EncodedJSON parsed)."""
    return {k: json.loads(v.data) if isinstance(v, EncodedJSON) else v for k, v in fields.items()}


def produced(rollout: str, attempt: int) -> Produced:
    """What the entry's run of `rollout`'s attempt produced (each attempt its own result)."""
    canonical = canonical_json({"rollout": rollout, "attempt": attempt})
    request = result_digest(canonical_json({"task": rollout}))
    return Produced(
        EpisodeId(rollout, attempt), ROUTE, request, canonical, result_digest(canonical)
    )


def ledger_receipt(receipt: Receipt) -> Receipt:
    """The receipt as the trainer keeps it (the header's JSON, read back)."""
    return Receipt.from_json(json.loads(json.dumps(receipt.as_json())))


class ReceiptProtocol(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.outbox = ResultOutbox(cap=100)
        self.running: dict[str, int] = {}
        self.ledger = self._grouped(ResultLedger())
        self.store: list[tuple[str, str]] = []
        self.inbox: list[Receipt] = []
        self.to_persist: list[list[Receipt]] = []
        """Sealed groups the ledger asked to persist, each one write."""
        self.published: tuple[list[tuple[EpisodeId, dict[str, Any]]], dict[str, Any]] | None = None
        self.runs = 0
        self.offered_again = 0

    # -- the trainer ---------------------------------------------------------------------

    def _next_attempt(self, rollout: str) -> int:
        attempts = self.ledger.attempts(rollout)
        return attempts[-1] + 1 if attempts else 0

    @staticmethod
    def _grouped(ledger: ResultLedger) -> ResultLedger:
        for group_id, rollouts in GROUPS.items():
            ledger.group(group_id, rollouts)
        return ledger

    def _waiting(self, rollout: str) -> bool:
        return (
            self.ledger.is_persisted(rollout)
            or self.ledger.holds(rollout) is not None
            or rollout in self.running
            or any(r.rollout_id == rollout for r in self.inbox)
            or any(r.rollout_id == rollout for group in self.to_persist for r in group)
        )

    def _received(self, receipt: Receipt) -> list[Receipt] | None:
        """The group to persist if `receipt` sealed it (None: nothing to write)."""
        kept = ledger_receipt(receipt)
        if self.ledger.received(kept, payload=kept) is not Delivery.PERSIST:
            return None
        return [outcome.payload for outcome in self.ledger.sealed(kept.rollout_id)]

    def _write(self, group: list[Receipt]) -> None:
        """One append of a whole group, then the ledger is told."""
        self.store.extend((r.rollout_id, r.result_sha256) for r in group)
        self.ledger.persisted(*(r.rollout_id for r in group))

    @rule(index=st.integers(0, len(ROLLOUTS) - 1))
    def dispatch(self, index: int) -> None:
        rollout = ROLLOUTS[index]
        if self._waiting(rollout):
            return
        attempt = self._next_attempt(rollout)
        self.ledger.dispatched(rollout, attempt)
        found = self.outbox.lookup(EpisodeId(rollout, attempt), ROUTE)
        if found.held is not None:
            self.offered_again += 1
            self.inbox.append(found.held.receipt)
        else:
            self.running[rollout] = attempt

    @precondition(lambda self: bool(self.inbox))
    @rule(data=st.data())
    def deliver(self, data: st.DataObject) -> None:
        receipt = self.inbox.pop(data.draw(st.integers(0, len(self.inbox) - 1)))
        group = self._received(receipt)
        if group is not None:
            self.to_persist.append(group)

    @precondition(lambda self: bool(self.inbox))
    @rule(data=st.data())
    def lose_reply(self, data: st.DataObject) -> None:
        self.inbox.pop(data.draw(st.integers(0, len(self.inbox) - 1)))

    @precondition(lambda self: bool(self.to_persist))
    @rule(data=st.data())
    def persist(self, data: st.DataObject) -> None:
        self._write(self.to_persist.pop(data.draw(st.integers(0, len(self.to_persist) - 1))))

    @rule()
    def acknowledge(self) -> None:
        receipts = self.ledger.to_acknowledge()
        if receipts:
            self.outbox.acknowledge(
                [Receipt(r.rollout_id, r.attempt, r.result_sha256) for r in receipts]
            )
            self.ledger.acknowledged(receipts)

    @rule()
    def checkpoint(self) -> None:
        records = [(r.episode_id, stored(dict(r.fields))) for r in self.outbox.export()]
        self.published = (records, copy.deepcopy(self.ledger.state()))

    @rule()
    def crash_trainer(self) -> None:
        self.inbox.clear()
        self.to_persist.clear()
        state = self.published[1] if self.published is not None else None
        self.ledger = self._grouped(ResultLedger.load(state, persisted=dict(self.store)))
        self._take_back()

    # -- the entry -----------------------------------------------------------------------

    @precondition(lambda self: bool(self.running))
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        rollout = data.draw(st.sampled_from(sorted(self.running)))
        attempt = self.running.pop(rollout)
        self.runs += 1
        self.inbox.append(self.outbox.hold(produced(rollout, attempt), ()))

    @rule()
    def crash_entry(self) -> None:
        self.running.clear()
        self.outbox = ResultOutbox(cap=100)
        if self.published is not None:
            self.outbox.install(
                HeldResult.from_record(episode.next_attempt(), fields)
                for episode, fields in self.published[0]
            )
        self._take_back()

    def _take_back(self) -> None:
        """The documented recovery: what the entry holds, persisted if the store lacks it,
        then every receipt the store covers acknowledged."""
        for held in self.outbox.results():
            group = self._received(held.receipt)
            if group is not None:
                self._write(group)
        self.acknowledge()

    # -- the properties ------------------------------------------------------------------

    @invariant()
    def no_row_twice(self) -> None:
        rollouts = [rollout for rollout, _ in self.store]
        assert len(rollouts) == len(set(rollouts)), self.store
        for group_id, members in GROUPS.items():
            assert sum(r in rollouts for r in members) in (0, len(members)), (group_id, rollouts)

    def teardown(self) -> None:
        for _ in range(4 * len(ROLLOUTS) + 4):
            for rollout in sorted(self.running):
                self.finish_now(rollout)
            while self.inbox:
                group = self._received(self.inbox.pop(0))
                if group is not None:
                    self.to_persist.append(group)
            while self.to_persist:
                self._write(self.to_persist.pop(0))
            self.acknowledge()
            for index in range(len(ROLLOUTS)):
                self.dispatch(index)
        assert sorted(rollout for rollout, _ in self.store) == ROLLOUTS, "nothing lost"
        assert len(self.outbox) == 0, "every held result acknowledged"

    def finish_now(self, rollout: str) -> None:
        attempt = self.running.pop(rollout)
        self.inbox.append(self.outbox.hold(produced(rollout, attempt), ()))


ReceiptProtocol.TestCase.settings = settings(
    max_examples=40,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_receipt_protocol_never_loses_or_duplicates_a_row = ReceiptProtocol.TestCase


# -- the ledger's state loads strictly ------------------------------------------------------


def a_state() -> dict[str, Any]:
    ledger = ResultLedger()
    ledger.dispatched("a", 0)
    ledger.dispatched("a", 1)
    assert ledger.received(Receipt("a", 1, "ab" * 32, ("c1",))) is Delivery.PERSIST
    ledger.persisted("a")
    ledger.dispatched("b", 0)
    return ledger.state()


def test_a_state_round_trips_and_reconciles_with_the_store() -> None:
    state = a_state()
    assert state["format"] == FORMAT
    store = {"a": "ab" * 32, "b": "cd" * 32}
    loaded = ResultLedger.load(json.loads(json.dumps(state)), persisted=store)
    assert loaded.state()["rollouts"]["a"] == {"attempts": [0, 1], "persisted": "ab" * 32}
    assert loaded.is_persisted("b")  # the store wrote it after the checkpoint
    assert [r.rollout_id for r in loaded.to_acknowledge()] == ["a"]
    # A result of a persisted rollout received again is acknowledged, never persisted twice.
    assert loaded.received(Receipt("b", 0, "cd" * 32)) is Delivery.ACKNOWLEDGE


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda s: s.update(format="rollout-checkpoint.ledger/2"), "format"),
        (lambda s: s.update(extra=1), "unknown fields"),
        (lambda s: s["rollouts"]["a"].update(attempts=[1, 0]), "increasing"),
        (lambda s: s["rollouts"]["a"].update(attempts=[0, 0]), "increasing"),
        (lambda s: s["rollouts"]["a"].update(persisted="xyz"), "SHA-256"),
        (lambda s: s["unacknowledged"][0].update(result_sha256="no"), "64 lowercase hex"),
        (lambda s: s["unacknowledged"][0].update(rollout_id="c"), "not in rollouts"),
        (lambda s: s["rollouts"]["a"].pop("persisted"), "missing fields"),
    ],
)
def test_a_state_it_would_not_write_is_refused(change: Any, message: str) -> None:
    state = a_state()
    change(state)
    with pytest.raises(LedgerStateError, match=message):
        ResultLedger.load(state)
