"""The trainer's side of exactly-once results: what it received, persisted and still owes.

A fleet's entry holds every finished result under a receipt until the trainer acknowledges
it (the result outbox, `docs/trainers.md`). The trainer's half is this ledger, one code path
for any trainer in Python (`collect` keeps its own output file as the store and follows the
same rules). The protocol, and the crash each rule prevents:

1. `dispatched(rollout, attempt)` before the `/run` leaves: after a crash the trainer knows
   every attempt that may still run.
2. `received(rollout, result, receipt)` when a reply arrives, or when a held result is
   listed again after a crash (ListResults). It says what to do: `PERSIST` a result the
   store lacks; `ACKNOWLEDGE` one it holds already (a late reply, a re-offered result that
   was persisted before the crash: writing it again would duplicate the row); the ledger
   never asks to persist a rollout twice.
3. `persisted(rollout)` once the trainer's store holds the result durably; only then does its
   receipt join `to_acknowledge()`. Acknowledged earlier, a crash between the
   acknowledgement and the write would lose the result on both sides.
4. `acknowledged(receipts)` after AcknowledgeResults returned.

`state()` is the ledger as versioned JSON (`FORMAT`), to publish atomically with the fleet's
checkpoint in its controller state (`checkpoint(..., controller_state=...)`); `load(state,
persisted=...)` reads it back strictly (an unknown field, a foreign format, an attempt list
out of order, a persisted rollout without its digest are refused with `LedgerStateError`)
and reconciles it with what the store holds now: rows persisted after the checkpoint count
as persisted, and their receipts are acknowledged again (idempotent on the fleet's side).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from rollout_checkpoint.server.core.receipts import DIGEST, Receipt

FORMAT = "rollout-checkpoint.ledger/1"
"""The `format` of a ledger's state; another one is refused, never guessed at."""


class LedgerStateError(ValueError):
    """A ledger state that cannot be loaded as it is (the message names the field)."""


class Delivery(enum.Enum):
    """What the trainer does with a result it received (`ResultLedger.received`)."""

    PERSIST = "persist"
    """New: write it to the store, then call `persisted`."""
    ACKNOWLEDGE = "acknowledge"
    """The store has this rollout already: do not write it; its receipt is queued for
    acknowledgement (the entry may hold it)."""


@dataclass
class _RolloutEntry:
    """One rollout in the ledger."""

    attempts: list[int] = field(default_factory=list)
    """Every attempt dispatched, in order."""
    persisted: str | None = None
    """The digest of the result the store holds (None: the store holds none)."""
    receiving: Receipt | None = None
    """A result received and not yet persisted (PERSIST was answered)."""


@dataclass
class ResultLedger:
    """What one trainer received, persisted and still has to acknowledge (module docstring)."""

    _rollouts: dict[str, _RolloutEntry] = field(default_factory=dict)
    _unacknowledged: dict[tuple[str, int], Receipt] = field(default_factory=dict)

    def dispatched(self, rollout_id: str, attempt: int) -> None:
        """The attempt is about to be sent (write the ledger ahead of the request)."""
        entry = self._rollouts.setdefault(rollout_id, _RolloutEntry())
        if entry.attempts and attempt <= entry.attempts[-1]:
            if attempt in entry.attempts:
                return
            raise ValueError(f"{rollout_id}: attempt {attempt} after {entry.attempts[-1]}")
        entry.attempts.append(attempt)

    def received(self, receipt: Receipt) -> Delivery:
        """A result of `receipt.rollout_id` arrived (a reply, or a held result listed again)."""
        entry = self._rollouts.setdefault(receipt.rollout_id, _RolloutEntry())
        if entry.persisted is not None or entry.receiving is not None:
            self._unacknowledged[(receipt.rollout_id, receipt.attempt)] = receipt
            return Delivery.ACKNOWLEDGE
        entry.receiving = receipt
        return Delivery.PERSIST

    def persisted(self, rollout_id: str) -> None:
        """The store holds the result `received` asked to persist, durably."""
        entry = self._rollouts[rollout_id]
        receipt = entry.receiving
        if receipt is None:
            raise ValueError(f"{rollout_id}: nothing was received to persist")
        entry.persisted, entry.receiving = receipt.result_sha256, None
        self._unacknowledged[(receipt.rollout_id, receipt.attempt)] = receipt

    def lost_before_persisting(self, rollout_id: str) -> None:
        """The write of a received result failed: the result is still the entry's (never
        acknowledged), and a later `received` of it asks to persist it again."""
        entry = self._rollouts.get(rollout_id)
        if entry is not None:
            entry.receiving = None

    def to_acknowledge(self) -> list[Receipt]:
        """Receipts of results the store holds (or never needs), not yet acknowledged."""
        return list(self._unacknowledged.values())

    def acknowledged(self, receipts: Iterable[Receipt]) -> None:
        """AcknowledgeResults returned for these receipts: they are owed no more."""
        for receipt in receipts:
            self._unacknowledged.pop((receipt.rollout_id, receipt.attempt), None)

    def forget_settled(self) -> None:
        """Drop what the store can tell again (`load(persisted=...)`): every rollout persisted
        with no receipt of it owed. A trainer with a large store calls it after acknowledging,
        so the published state stays the size of what is in flight, not of the history."""
        owed = {rollout_id for rollout_id, _ in self._unacknowledged}
        for rollout_id in [
            r
            for r, entry in self._rollouts.items()
            if entry.persisted is not None and entry.receiving is None and r not in owed
        ]:
            del self._rollouts[rollout_id]

    def attempts(self, rollout_id: str) -> list[int]:
        """The attempts of `rollout_id` dispatched so far, in order."""
        entry = self._rollouts.get(rollout_id)
        return list(entry.attempts) if entry is not None else []

    def is_persisted(self, rollout_id: str) -> bool:
        """Whether the store holds a result of `rollout_id`."""
        entry = self._rollouts.get(rollout_id)
        return entry is not None and entry.persisted is not None

    # -- state ----------------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        """The ledger as JSON (`FORMAT`): publish it with the fleet's checkpoint. A result
        received and not persisted is left out: after a crash the entry offers it again."""
        return {
            "format": FORMAT,
            "rollouts": {
                rollout_id: {"attempts": list(entry.attempts), "persisted": entry.persisted}
                for rollout_id, entry in sorted(self._rollouts.items())
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
        cls, state: Mapping[str, Any] | None, persisted: Mapping[str, str] | None = None
    ) -> ResultLedger:
        """The ledger a `state()` held (None: a trainer that never published one), made to
        agree with the store: `persisted` maps each rollout the store holds to its result's
        digest. Raises `LedgerStateError` for anything `state()` would not have written."""
        ledger = cls() if state is None else _parse(state)
        for rollout_id, digest in (persisted or {}).items():
            entry = ledger._rollouts.setdefault(rollout_id, _RolloutEntry())
            entry.persisted = digest
        return ledger


def _parse(state: Mapping[str, Any]) -> ResultLedger:
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
        ledger._rollouts[rollout_id] = _RolloutEntry(list(attempts), digest)
    receipts = state["unacknowledged"]
    if not isinstance(receipts, list):
        raise LedgerStateError("unacknowledged: not a list")
    for index, value in enumerate(receipts):
        receipt = _receipt(value, f"unacknowledged[{index}]")
        entry = ledger._rollouts.get(receipt.rollout_id)
        if entry is None or entry.persisted is None:
            raise LedgerStateError(
                f"unacknowledged[{index}]: {receipt.rollout_id} is not persisted"
            )
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
