"""The trainer's side of exactly-once results: what it received, persisted and still owes.

A fleet's entry holds every finished result under a receipt until the trainer acknowledges
it (the result outbox, `docs/trainers.md`). The trainer's half is this ledger, one code path
for any trainer in Python: `collect` is built on it too (its output file is the store). The
protocol, and the crash each rule prevents:

1. `dispatched(rollout, attempt)` before the `/run` leaves: after a crash the trainer knows
   every attempt that may still run.
2. `received(receipt, payload)` when a reply arrives, or when a held result is listed again
   after a crash (ListResults); `finished_without_receipt(rollout, payload)` for an outcome
   no receipt covers (a failure recorded as such, an entry that issues no receipts). The
   answer (`Delivery`) says what to do: `PERSIST` the group `sealed(rollout)` returns, in one
   write; `HOLD`: nothing yet, a sibling is unfinished (the result stays in the entry's
   outbox, unacknowledged, so every checkpoint carries it; a newer attempt's result of a
   held rollout replaces the held one, nothing is owed for it); `ACKNOWLEDGE`: the store
   holds this rollout already (a late reply, a re-offered result persisted before the
   crash: writing it again would duplicate the row). The ledger never asks to persist a
   rollout twice.
3. `persisted(*rollouts)` once the store holds them durably; only then do their receipts
   join `to_acknowledge()`. Acknowledged earlier, a crash between the acknowledgement and the
   write would lose the result on both sides.
4. `acknowledged(receipts)` after AcknowledgeResults returned.

**Prompt groups.** `group(group_id, rollouts, recovery)` declares the K rollouts of one
prompt: none of them is asked to be persisted before all of them have an outcome, and then
all at once, so a crash or a checkpoint sees none or all of a group. When a crash cuts
unfinished rollouts, `cut(rollouts)` applies each group's `GroupRecovery`: `sibling` keeps
the finished siblings (only the cut ones continue or restart); `group` discards every
outcome of the group not yet persisted: it names every unpersisted sibling to regenerate
from its input (retire those attempts first: a Retire releases what the entry held of
them; then `discard` forgets the outcome here). Groups are not part of the state: a trainer
declares them again from its input when it starts.

`state()` is the ledger as versioned JSON (`FORMAT`), to publish atomically with the fleet's
checkpoint in its controller state (`checkpoint(..., controller_state=...)`); `load(state,
persisted=...)` reads it back strictly (an unknown field, a foreign format, an attempt list
out of order, a receipt owed for a rollout it does not list are refused with
`LedgerStateError`) and reconciles it with what the store holds now, the store being the
truth: rows persisted after the checkpoint count as persisted, and their receipts are
acknowledged again (idempotent on the fleet's side).
An outcome held for its group is not in the state: after a crash the entry offers the
result again (ListResults), and `received` holds it for its group again.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from rollout_checkpoint.server.core.receipts import DIGEST, Receipt

FORMAT = "rollout-checkpoint.ledger/1"
"""The `format` of a ledger's state; another one is refused, never guessed at."""

GroupRecovery = Literal["sibling", "group"]
"""What a crash that cut a rollout does to its prompt group (`ResultLedger.cut`)."""
GROUP_RECOVERIES: tuple[GroupRecovery, ...] = get_args(GroupRecovery)


class LedgerStateError(ValueError):
    """A ledger state that cannot be loaded as it is (the message names the field)."""


class Delivery(enum.Enum):
    """What the trainer does with an outcome it received (`ResultLedger.received`)."""

    PERSIST = "persist"
    """Its group is complete: write `sealed(rollout)` to the store in one write, then call
    `persisted` for each of them."""
    HOLD = "hold"
    """Its group waits for a sibling: write nothing yet (the ledger keeps the payload; the
    entry keeps the result, unacknowledged)."""
    ACKNOWLEDGE = "acknowledge"
    """The store has this rollout already: do not write it; its receipt is queued for
    acknowledgement (the entry may hold it)."""


@dataclass(frozen=True)
class HeldOutcome:
    """An outcome the ledger holds until its group is persisted."""

    rollout_id: str
    """The rollout it is the outcome of."""
    payload: Any
    """What the trainer persists for the rollout (its row), as it was handed over."""
    receipt: Receipt | None
    """The receipt to acknowledge once it is persisted (None: none covers it)."""


@dataclass(frozen=True)
class GroupCut:
    """What `ResultLedger.cut` decided for the groups of the rollouts a crash cut."""

    kept: list[str]
    """Finished siblings kept (`sibling` groups): their held outcomes wait for the cut ones."""
    regenerate: list[str]
    """Every unpersisted rollout of a `group` group: retire it, `discard` what the ledger
    holds of it, run it again from its input as a later attempt."""
    groups_regenerated: list[str]
    """The `group` groups that lost a rollout."""


@dataclass
class _RolloutEntry:
    """One rollout in the ledger."""

    attempts: list[int] = field(default_factory=list)
    """Every attempt dispatched, in order."""
    persisted: str | None = None
    """The digest of the result the store holds (None: none, or an outcome without one)."""
    stored: bool = False
    """Whether the store holds an outcome of it (a result, or a failure)."""
    outcome: HeldOutcome | None = None
    """An outcome received and not yet persisted (held for its group, or being written)."""
    group: str | None = None
    """Its prompt group (None: a group of its own)."""


@dataclass
class _Group:
    rollout_ids: list[str]
    recovery: GroupRecovery


@dataclass
class ResultLedger:
    """What one trainer received, persisted and still has to acknowledge (module docstring)."""

    _rollouts: dict[str, _RolloutEntry] = field(default_factory=dict)
    _unacknowledged: dict[tuple[str, int], Receipt] = field(default_factory=dict)
    _groups: dict[str, _Group] = field(default_factory=dict)

    def group(
        self, group_id: str, rollout_ids: Sequence[str], recovery: GroupRecovery = "sibling"
    ) -> None:
        """Declare a prompt group: `rollout_ids` are persisted together, never in part. A
        rollout belongs to one group; declaring the same group again is a no-op."""
        if recovery not in GROUP_RECOVERIES:
            raise ValueError(f"{group_id}: recovery {recovery!r} is not one of {GROUP_RECOVERIES}")
        known = self._groups.get(group_id)
        if known is not None:
            if known.rollout_ids != list(rollout_ids) or known.recovery != recovery:
                raise ValueError(f"{group_id}: declared before with other rollouts or recovery")
            return
        for rollout_id in rollout_ids:
            entry = self._rollouts.setdefault(rollout_id, _RolloutEntry())
            if entry.group is not None:
                raise ValueError(f"{rollout_id}: already in group {entry.group}")
            entry.group = group_id
        self._groups[group_id] = _Group(list(rollout_ids), recovery)

    def dispatched(self, rollout_id: str, attempt: int) -> None:
        """The attempt is about to be sent (write the ledger ahead of the request)."""
        entry = self._rollouts.setdefault(rollout_id, _RolloutEntry())
        if entry.attempts and attempt <= entry.attempts[-1]:
            if attempt in entry.attempts:
                return
            raise ValueError(f"{rollout_id}: attempt {attempt} after {entry.attempts[-1]}")
        entry.attempts.append(attempt)

    def received(self, receipt: Receipt, payload: Any = None) -> Delivery:
        """A result of `receipt.rollout_id` arrived (a reply, or a held result listed
        again); `payload` is what the trainer will persist for it."""
        entry = self._rollouts.setdefault(receipt.rollout_id, _RolloutEntry())
        if entry.stored:
            self._unacknowledged[(receipt.rollout_id, receipt.attempt)] = receipt
            return Delivery.ACKNOWLEDGE
        held = entry.outcome
        if held is not None:
            # Nothing is owed for a rollout held for its group: the entry keeps one result
            # per rollout (the newest attempt's), and acknowledging any receipt of it would
            # release the only durable copy of what this ledger holds in memory. A newer
            # attempt's result replaces the held one, as it did in the entry.
            if held.receipt is not None and receipt.attempt > held.receipt.attempt:
                entry.outcome = HeldOutcome(receipt.rollout_id, payload, receipt)
            return Delivery.HOLD
        entry.outcome = HeldOutcome(receipt.rollout_id, payload, receipt)
        return Delivery.PERSIST if self.sealed(receipt.rollout_id) else Delivery.HOLD

    def finished_without_receipt(self, rollout_id: str, payload: Any) -> Delivery:
        """An outcome no receipt covers (a failure the trainer records, a result of an entry
        that issues no receipts): `PERSIST` or `HOLD` as for `received`. Raises `ValueError`
        for a rollout that is stored or holds an outcome already."""
        entry = self._rollouts.setdefault(rollout_id, _RolloutEntry())
        if entry.stored or entry.outcome is not None:
            raise ValueError(f"{rollout_id}: has an outcome already")
        entry.outcome = HeldOutcome(rollout_id, payload, None)
        return Delivery.PERSIST if self.sealed(rollout_id) else Delivery.HOLD

    def sealed(self, rollout_id: str) -> list[HeldOutcome]:
        """The outcomes to persist in one write once `rollout_id`'s group is complete (every
        rollout of it stored or holding an outcome), in the group's order; empty while one
        is unfinished."""
        entries = [self._rollouts[r] for r in self._members(rollout_id)]
        if not all(e.stored or e.outcome is not None for e in entries):
            return []
        return [e.outcome for e in entries if e.outcome is not None]

    def persisted(self, *rollout_ids: str) -> None:
        """The store holds the outcomes of `rollout_ids` (`sealed` returned them), durably."""
        for rollout_id in rollout_ids:
            entry = self._rollouts.get(rollout_id)
            if entry is None or entry.outcome is None:
                raise ValueError(f"{rollout_id}: nothing was received to persist")
        for rollout_id in rollout_ids:
            entry = self._rollouts[rollout_id]
            outcome, entry.outcome = entry.outcome, None
            assert outcome is not None
            entry.stored = True
            receipt = outcome.receipt
            if receipt is not None:
                entry.persisted = receipt.result_sha256
                self._unacknowledged[(receipt.rollout_id, receipt.attempt)] = receipt

    def lost_before_persisting(self, *rollout_ids: str) -> None:
        """The write of a sealed group failed (name all of it): its results are still the
        entry's (never acknowledged), and once `received` again the group is sealed again."""
        for rollout_id in rollout_ids:
            self.discard(rollout_id)

    def discard(self, rollout_id: str) -> None:
        """Forget the outcome held of `rollout_id` without acknowledging it (it is
        regenerated: the Retire of its attempts releases what the entry held)."""
        entry = self._rollouts.get(rollout_id)
        if entry is not None:
            entry.outcome = None

    def cut(self, rollout_ids: Iterable[str]) -> GroupCut:
        """A crash cut the unfinished `rollout_ids` (they continue or restart): apply their
        groups' recovery (module docstring). Nothing changes here: the trainer retires the
        rollouts to regenerate, then calls `discard` for each (a recovery that fails half way and is
        tried again decides the same)."""
        kept: list[str] = []
        regenerate: list[str] = []
        regenerated: list[str] = []
        for group_id in sorted({self._group_of(r) for r in rollout_ids}):
            members = self._members_of_group(group_id)
            policy = self._groups[group_id].recovery if group_id in self._groups else "sibling"
            held = [r for r in members if self._rollouts[r].outcome is not None]
            if policy == "sibling":
                kept += held
                continue
            regenerated.append(group_id)
            regenerate += [r for r in members if not self._rollouts[r].stored]
        return GroupCut(kept, regenerate, regenerated)

    def holds(self, rollout_id: str) -> HeldOutcome | None:
        """The outcome held of `rollout_id` for its group (None: none)."""
        entry = self._rollouts.get(rollout_id)
        return entry.outcome if entry is not None else None

    def to_acknowledge(self) -> list[Receipt]:
        """Receipts of results the store holds (or never needs), not yet acknowledged."""
        return list(self._unacknowledged.values())

    def acknowledged(self, receipts: Iterable[Receipt]) -> None:
        """AcknowledgeResults returned for these receipts: they are owed no more."""
        for receipt in receipts:
            self._unacknowledged.pop((receipt.rollout_id, receipt.attempt), None)

    def forget_settled(self) -> None:
        """Drop what the store can tell again (`load(persisted=...)`): every rollout stored
        with no receipt of it owed (its group membership stays). A trainer with a large
        store calls it after acknowledging, so the published state stays the size of what
        is in flight, not of the history."""
        owed = {rollout_id for rollout_id, _ in self._unacknowledged}
        for rollout_id, entry in self._rollouts.items():
            if entry.stored and entry.outcome is None and rollout_id not in owed:
                self._rollouts[rollout_id] = _RolloutEntry(stored=True, group=entry.group)

    def attempts(self, rollout_id: str) -> list[int]:
        """The attempts of `rollout_id` dispatched so far, in order."""
        entry = self._rollouts.get(rollout_id)
        return list(entry.attempts) if entry is not None else []

    def is_persisted(self, rollout_id: str) -> bool:
        """Whether the store holds an outcome of `rollout_id`."""
        entry = self._rollouts.get(rollout_id)
        return entry is not None and entry.stored

    def _group_of(self, rollout_id: str) -> str:
        entry = self._rollouts.get(rollout_id)
        return entry.group if entry is not None and entry.group is not None else rollout_id

    def _members_of_group(self, group_id: str) -> list[str]:
        group = self._groups.get(group_id)
        members = group.rollout_ids if group is not None else [group_id]
        for rollout_id in members:
            self._rollouts.setdefault(rollout_id, _RolloutEntry())
        return members

    def _members(self, rollout_id: str) -> list[str]:
        return self._members_of_group(self._group_of(rollout_id))

    # -- state ----------------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        """The ledger as JSON (`FORMAT`): publish it with the fleet's checkpoint. A result
        received and not persisted is left out: after a crash the entry offers it again."""
        owed = {rollout_id for rollout_id, _ in self._unacknowledged}
        return {
            "format": FORMAT,
            "rollouts": {
                rollout_id: {"attempts": list(entry.attempts), "persisted": entry.persisted}
                for rollout_id, entry in sorted(self._rollouts.items())
                if entry.attempts or entry.persisted is not None or rollout_id in owed
            },
            "unacknowledged": [
                receipt.as_json()
                for receipt in sorted(
                    self._unacknowledged.values(), key=lambda r: (r.rollout_id, r.attempt)
                )
            ],
        }

    @classmethod
    def load(
        cls, state: Mapping[str, Any] | None, persisted: Mapping[str, str | None] | None = None
    ) -> ResultLedger:
        """The ledger a `state()` held (None: a trainer that never published one), made to
        agree with the store: `persisted` maps every rollout the store holds an outcome of to
        its result's digest (None: an outcome no receipt covered, such as a failure). The
        store is the truth: a rollout it holds counts as persisted (written after the
        checkpoint), and one the state calls persisted that the store lacks (a store lost or
        replaced since) does not, and nothing of it is owed: the entry still holds its result,
        which is then taken again. Raises `LedgerStateError` for anything `state()` would not
        have written."""
        ledger = cls() if state is None else _parse(state)
        if persisted is None:
            return ledger
        for rollout_id, entry in ledger._rollouts.items():
            if entry.stored and rollout_id not in persisted:
                entry.stored, entry.persisted = False, None
        for rollout_id, digest in persisted.items():
            entry = ledger._rollouts.setdefault(rollout_id, _RolloutEntry())
            entry.stored = True
            entry.persisted = digest if digest is not None else entry.persisted
        ledger._unacknowledged = {
            key: receipt
            for key, receipt in ledger._unacknowledged.items()
            if ledger._rollouts[key[0]].stored
        }
        return ledger


def _parse(state: Mapping[str, Any]) -> ResultLedger:
    if not isinstance(state, Mapping):
        raise LedgerStateError("the ledger state: not an object")
    _exactly(state, {"format", "rollouts", "unacknowledged"}, "the ledger state")
    if state["format"] != FORMAT:
        raise LedgerStateError(f"format: {state['format']!r} is not {FORMAT!r}")
    rollouts = state["rollouts"]
    if not isinstance(rollouts, dict):
        raise LedgerStateError("rollouts: not an object")
    ledger = ResultLedger()
    for rollout_id, value in rollouts.items():
        where = f"rollouts[{rollout_id!r}]"
        if not isinstance(value, dict):
            raise LedgerStateError(f"{where}: not an object")
        _exactly(value, {"attempts", "persisted"}, where)
        attempts = value["attempts"]
        if not (
            isinstance(attempts, list)
            and all(type(a) is int and a >= 0 for a in attempts)
            and attempts == sorted(set(attempts))
        ):
            raise LedgerStateError(f"{where}.attempts: not increasing attempt numbers")
        digest = value["persisted"]
        if digest is not None and not (isinstance(digest, str) and DIGEST.fullmatch(digest)):
            raise LedgerStateError(f"{where}.persisted: not a SHA-256 digest or null")
        ledger._rollouts[rollout_id] = _RolloutEntry(
            list(attempts), digest, stored=digest is not None
        )
    receipts = state["unacknowledged"]
    if not isinstance(receipts, list):
        raise LedgerStateError("unacknowledged: not a list")
    for index, value in enumerate(receipts):
        receipt = _receipt(value, f"unacknowledged[{index}]")
        entry = ledger._rollouts.get(receipt.rollout_id)
        if entry is None:
            raise LedgerStateError(
                f"unacknowledged[{index}]: {receipt.rollout_id} is not in rollouts"
            )
        entry.stored = True  # a receipt is owed only for what the store holds
        ledger._unacknowledged[(receipt.rollout_id, receipt.attempt)] = receipt
    return ledger


def _receipt(value: Any, where: str) -> Receipt:
    try:
        return Receipt.from_json(value)
    except ValueError as exc:
        raise LedgerStateError(f"{where}: {exc}") from None


def _exactly(value: Mapping[str, Any], fields: set[str], where: str) -> None:
    unknown, missing = set(value) - fields, fields - set(value)
    if unknown or missing:
        raise LedgerStateError(
            f"{where}: unknown fields {sorted(unknown)}, missing fields {sorted(missing)}"
        )
