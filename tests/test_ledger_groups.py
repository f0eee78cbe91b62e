"""The trainer ledger's prompt groups and staleness rule, through the public Python API.

`collect` is built on the same ledger (tests/test_collect.py drives it through collect); these
tests hold a trainer's own use of it: a group is asked to be persisted only whole, receipts
are owed only once persisted, a crash that cut a rollout follows the group's recovery, and
the staleness verdict is the documented rule.
"""

from __future__ import annotations

import json

import pytest

from rollout_checkpoint.client import (
    Delivery,
    LedgerStateError,
    Receipt,
    ResultLedger,
    Stale,
    StalenessPolicy,
)


def receipt(rollout_id: str, attempt: int = 0, digest: str = "ab") -> Receipt:
    return Receipt(rollout_id, attempt, digest * 32, ("ckpt-1",))


def grouped(recovery: str = "sibling") -> ResultLedger:
    ledger = ResultLedger()
    ledger.group("t", ["t.0", "t.1", "t.2"], recovery)  # type: ignore[arg-type]
    return ledger


def owed(ledger: ResultLedger) -> list[tuple[str, int]]:
    return sorted((r.rollout_id, r.attempt) for r in ledger.to_acknowledge())


def test_a_group_is_asked_to_be_persisted_only_whole_and_owed_only_once_persisted() -> None:
    ledger = grouped()
    assert ledger.received(receipt("t.2"), {"row": 2}) is Delivery.HOLD
    assert ledger.sealed("t.2") == [] and owed(ledger) == []
    assert ledger.finished_without_receipt("t.1", {"row": 1, "status": "failed"}) is Delivery.HOLD
    assert ledger.received(receipt("t.0"), {"row": 0}) is Delivery.PERSIST
    group = ledger.sealed("t.1")
    assert [(o.rollout_id, o.payload["row"]) for o in group] == [("t.0", 0), ("t.1", 1), ("t.2", 2)]
    assert owed(ledger) == [], "nothing is owed before the store holds the group"
    ledger.persisted(*(o.rollout_id for o in group))
    assert owed(ledger) == [("t.0", 0), ("t.2", 0)], "a failure carries no receipt"
    assert all(ledger.is_persisted(r) for r in ("t.0", "t.1", "t.2"))
    # A late reply of a persisted rollout is never written again; its receipt is owed.
    assert ledger.received(receipt("t.2", 1, "cd")) is Delivery.ACKNOWLEDGE
    assert ("t.2", 1) in owed(ledger)
    with pytest.raises(ValueError, match=r"t\.1: has an outcome already"):
        ledger.finished_without_receipt("t.1", {})
    with pytest.raises(ValueError, match="nothing was received to persist"):
        ledger.persisted("t.0")


def test_the_same_held_result_offered_again_stays_held_and_is_not_acknowledged() -> None:
    """A result re-offered after a crash (ListResults) while the ledger holds it for its
    group: acknowledging it would release the only durable copy before the group is written."""
    ledger = grouped()
    assert ledger.received(receipt("t.0"), "first") is Delivery.HOLD
    assert ledger.received(receipt("t.0"), "again") is Delivery.HOLD
    assert owed(ledger) == []
    held = ledger.holds("t.0")
    assert held is not None and held.payload == "first"
    # A newer attempt's result replaces the held one (the entry keeps only the newest), and
    # nothing is owed: acknowledging it would release the only durable copy.
    assert ledger.received(receipt("t.0", 1, "cd"), "newer") is Delivery.HOLD
    assert ledger.received(receipt("t.0", 0), "older again") is Delivery.HOLD
    held = ledger.holds("t.0")
    assert held is not None and held.payload == "newer" and owed(ledger) == []


@pytest.mark.parametrize("recovery", ["sibling", "group"])
def test_a_cut_follows_the_group_recovery(recovery: str) -> None:
    ledger = grouped(recovery)
    ledger.received(receipt("t.0"), "t.0 row")
    ledger.received(receipt("t.1"), "t.1 row")
    decided = ledger.cut(["t.2"])
    if recovery == "sibling":
        assert (decided.kept, decided.regenerate, decided.groups_regenerated) == (
            ["t.0", "t.1"],
            [],
            [],
        )
    else:
        assert decided.kept == [] and decided.regenerate == ["t.0", "t.1", "t.2"]
        assert decided.groups_regenerated == ["t"]
    # Deciding changes nothing: a recovery tried again decides the same.
    assert ledger.cut(["t.2"]) == decided
    assert ledger.holds("t.0") is not None
    if recovery == "group":
        for rollout_id in decided.regenerate:  # retired everywhere first, then forgotten
            ledger.discard(rollout_id)
        assert ledger.holds("t.0") is None
        assert ledger.received(receipt("t.0", 1, "cd"), "regenerated") is Delivery.HOLD
    assert ledger.received(receipt("t.2", 1), "t.2 row") is (
        Delivery.PERSIST if recovery == "sibling" else Delivery.HOLD
    )


def test_a_loaded_ledger_knows_what_the_store_holds_and_seals_groups_across_the_crash() -> None:
    """The store holds t.0 (a result) and t.1 (a failure, no digest) from before the crash;
    t.2's result re-offered after it seals the group alone."""
    before = grouped()
    before.dispatched("t.2", 0)
    state = before.state()
    after = ResultLedger.load(state, persisted={"t.0": "ab" * 32, "t.1": None})
    after.group("t", ["t.0", "t.1", "t.2"])
    assert after.is_persisted("t.0") and after.is_persisted("t.1")
    assert after.attempts("t.2") == [0]
    assert after.received(receipt("t.2"), "t.2 row") is Delivery.PERSIST
    assert [o.rollout_id for o in after.sealed("t.2")] == ["t.2"]


def test_forgetting_settled_rollouts_keeps_the_state_small_and_the_groups_whole() -> None:
    ledger = grouped()
    for index in range(3):
        ledger.dispatched(f"t.{index}", 0)
        ledger.received(receipt(f"t.{index}"), index)
    ledger.persisted("t.0", "t.1", "t.2")
    ledger.acknowledged(ledger.to_acknowledge())
    ledger.forget_settled()
    assert ledger.state()["rollouts"] == {} and ledger.state()["unacknowledged"] == []
    assert ledger.is_persisted("t.1"), "still known as stored while this process runs"
    assert ledger.received(receipt("t.1", 1, "cd")) is Delivery.ACKNOWLEDGE


def test_a_group_is_declared_once_and_a_rollout_belongs_to_one_group() -> None:
    ledger = grouped()
    ledger.group("t", ["t.0", "t.1", "t.2"])  # the same again: a no-op
    with pytest.raises(ValueError, match="declared before"):
        ledger.group("t", ["t.0", "t.1"])
    with pytest.raises(ValueError, match="already in group t"):
        ledger.group("u", ["t.0"])
    with pytest.raises(ValueError, match="recovery 'all'"):
        ledger.group("v", ["v.0"], "all")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("policy", "oldest", "current", "verdict"),
    [
        (StalenessPolicy(), 0, 100, None),  # no bound
        (StalenessPolicy(2), None, 100, None),  # no measurable lag
        (StalenessPolicy(2), 8, 10, None),  # within the bound
        (StalenessPolicy(2), 7, 10, Stale.REGENERATE),  # past it: the default action
        (StalenessPolicy(2, Stale.DROP), 7, 10, Stale.DROP),
        (StalenessPolicy(0, Stale.CONTINUE), 9, 10, Stale.CONTINUE),
    ],
)
def test_the_staleness_verdict(
    policy: StalenessPolicy, oldest: int | None, current: int, verdict: Stale | None
) -> None:
    assert policy.verdict(oldest, current) is verdict


def test_every_state_the_ledger_writes_loads_back() -> None:
    """Receipts owed for rollouts the state would otherwise not list (forgotten as settled,
    or stored without a digest) are written with their rollout, and load back owed."""
    ledger = grouped()
    for index in range(3):
        ledger.received(receipt(f"t.{index}"), index)
    ledger.persisted("t.0", "t.1", "t.2")
    ledger.acknowledged(ledger.to_acknowledge())
    ledger.forget_settled()
    assert ledger.received(receipt("t.1", 1, "cd")) is Delivery.ACKNOWLEDGE  # re-offered late
    failed = ResultLedger()
    failed.finished_without_receipt("f", {"status": "failed"})
    failed.persisted("f")
    assert failed.received(receipt("f", 1, "cd")) is Delivery.ACKNOWLEDGE
    for written in (ledger, failed):
        state = json.loads(json.dumps(written.state()))
        again = ResultLedger.load(state)
        assert owed(again) == owed(written)
        (rollout_id, _), *_ = owed(written)
        assert again.is_persisted(rollout_id)


def test_the_store_is_the_truth_when_a_ledger_is_loaded() -> None:
    """The state says t.0 is persisted and owes its receipt; the store (replaced since)
    lacks it: it is not persisted, nothing of it is owed, and its re-offered result is to
    be persisted again."""
    before = ResultLedger()
    before.received(receipt("t.0"), "row")
    before.persisted("t.0")
    state = before.state()
    after = ResultLedger.load(state, persisted={})
    assert not after.is_persisted("t.0") and owed(after) == []
    assert after.received(receipt("t.0"), "row") is Delivery.PERSIST


@pytest.mark.parametrize("state", [5, ["format"], "rollout-checkpoint.ledger/1"])
def test_a_state_that_is_no_object_is_refused_typed(state: object) -> None:
    with pytest.raises(LedgerStateError, match="not an object"):
        ResultLedger.load(state)  # type: ignore[arg-type]
