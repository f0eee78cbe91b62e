"""The result outbox: finished results held, under a receipt, until the trainer acknowledges them.

Without it a finished rollout exists only as the HTTP reply to its `/run`: a trainer that
crashes after the reply arrived and before it persisted it has lost the result, and the
only way back is running the rollout again (minutes of generation, and tools with side
effects applied twice). So a request that asks for a receipt (episodic/receipts.py) has its result
put here *before* its reply goes on the wire, and it stays until one of:

* the trainer acknowledges the receipt (`acknowledge`): it persisted the result;
* a Retire or Forget of the rollout (`drop`): the controller gave it up;
* a failed Restore that installed it (`drop_held_as`).

A rejoining Restore keeps what a survivor holds: those results are finished, newer than the
checkpoint's, and the trainer may not have them; it adds the checkpoint's for the rollouts
the survivor holds nothing of.

Every checkpoint exports the whole outbox, whatever its scope (an unacknowledged result is
in flight as far as the trainer is concerned), so after a crash the restored outbox offers
again every result finished before the cut and never acknowledged. Outcomes of callers that
asked for no receipt keep the older, shorter rule (episodic/outcomes.py); a receipt supersedes that
outcome, so one result is never held twice.

The outbox is bounded by a cap the operator sets: a full outbox refuses new receipted runs
(HTTP 429 `outbox_full`, retryable) rather than growing without end, because a trainer that
never acknowledges would otherwise grow every checkpoint with its history. Acknowledged
receipts are remembered (the last `ACKNOWLEDGED_KEPT`) so that an acknowledgement repeated
after its release is recognised as such, and a digest that contradicts it is still refused.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from rollout_checkpoint.server.core.episodes import EpisodeId
from rollout_checkpoint.server.core.errors import (
    CheckpointError,
    Reason,
    invalid_request,
    rejected_checkpoint,
)
from rollout_checkpoint.server.core.receipts import DIGEST, Receipt, checked_receipt
from rollout_checkpoint.server.runtime.participant import ExportRecord, RestoredRecord
from rollout_checkpoint.server.runtime.records_codec import EncodedJSON

DEFAULT_OUTBOX_CAP = 10_000
"""Results held at most by default (`ROLLOUT_CHECKPOINT_OUTBOX_CAP`)."""
ACKNOWLEDGED_KEPT = 100_000
"""Acknowledged receipts remembered after their release: a repeated acknowledgement is then
a no-op, and one with another digest is still refused."""
RECEIPT_FIELD = "outbox_receipt"
ROUTE_FIELD = "outbox_route"
REQUEST_FIELD = "outbox_request_sha256"
RESULT_FIELD = "outbox_result"
OUTBOX_FIELDS = (RECEIPT_FIELD, ROUTE_FIELD, REQUEST_FIELD, RESULT_FIELD)
"""The fields of an outbox record in a part (beside `episode_id`): names no kind's own
record uses, so a restore tells them apart."""


def canonical_json(value: Any) -> str:
    """`value` as its canonical JSON: keys sorted, no whitespace, UTF-8 (what a receipt's
    digest is taken of). orjson when it can; the standard library keeps big integers."""
    try:
        return orjson.dumps(value, option=orjson.OPT_SORT_KEYS).decode()
    except (TypeError, orjson.JSONEncodeError):
        return json.dumps(
            value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
        )


def result_digest(canonical: str) -> str:
    """The SHA-256 of a canonical JSON text, as 64 lowercase hex characters."""
    return hashlib.sha256(canonical.encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class HeldResult:
    """One result in the outbox: the capture key it is held under (the producing attempt's,
    or the restored attempt N+1's), its receipt, the route that produced it and the result's
    canonical JSON (what the receipt's digest was taken of, and what a late run gets)."""

    episode_id: EpisodeId
    receipt: Receipt
    route: str
    canonical: str
    request_sha256: str
    """The digest of the request that produced it (`request_digest`): a late run of the
    rollout gets this result only if it asks the same (receipts.py)."""

    def record_fields(self) -> dict[str, Any]:
        """The fields of this result's record in a part (beside `episode_id`); the result
        goes as the canonical text it already is, never serialized again."""
        return {
            RECEIPT_FIELD: self.receipt.as_json(),
            ROUTE_FIELD: self.route,
            REQUEST_FIELD: self.request_sha256,
            RESULT_FIELD: EncodedJSON(self.canonical.encode()),
        }

    @classmethod
    def from_record(cls, episode_id: EpisodeId, fields: Mapping[str, Any]) -> HeldResult:
        """The result a stored outbox record holds, held under `episode_id`; ValueError
        for a record that is not exactly what `record_fields` writes or whose digest does
        not match its result. CPU-bound on a large result: call it off the event loop."""
        if set(fields) != set(OUTBOX_FIELDS):
            raise ValueError(f"an outbox record holds exactly {', '.join(OUTBOX_FIELDS)}")
        receipt = Receipt.from_json(fields[RECEIPT_FIELD])
        route = fields[ROUTE_FIELD]
        if not isinstance(route, str) or not route.startswith("/"):
            raise ValueError("an outbox result's route is a path")
        request = fields[REQUEST_FIELD]
        if not isinstance(request, str) or not DIGEST.fullmatch(request):
            raise ValueError("an outbox result's request digest is 64 lowercase hex characters")
        canonical = canonical_json(fields[RESULT_FIELD])
        if result_digest(canonical) != receipt.result_sha256:
            raise ValueError("the result does not match its receipt's digest")
        return cls(episode_id, receipt, route, canonical, request)


def is_outbox_record(fields: Mapping[str, Any]) -> bool:
    """Whether a stored record (its fields, unvalidated) is an outbox record."""
    return RECEIPT_FIELD in fields


def outbox_identity(episode: EpisodeId, fields: Mapping[str, Any]) -> Hashable | None:
    """An outbox record's identity in a part (None for the kind's own records): apart from
    any record of the kind for the same episode."""
    return (episode, RECEIPT_FIELD) if is_outbox_record(fields) else None


def split_records(
    records: Sequence[RestoredRecord],
) -> tuple[list[RestoredRecord], list[RestoredRecord]]:
    """(outbox records, the kind's own records) of a restore."""
    outbox = [r for r in records if is_outbox_record(r.fields)]
    own = [r for r in records if not is_outbox_record(r.fields)]
    return outbox, own


async def restored_results(
    records: Sequence[RestoredRecord],
) -> tuple[list[HeldResult], list[RestoredRecord]]:
    """A restore's held results (parsed and checked in a thread) and the kind's own records."""
    outbox, own = split_records(records)
    held = await asyncio.to_thread(held_results, outbox) if outbox else []
    return held, own


def held_results(records: Sequence[RestoredRecord]) -> list[HeldResult]:
    """The results of restored outbox records, each held under its restored attempt N+1;
    `rejected_checkpoint` names the first invalid one. CPU-bound (every result is parsed
    and its digest checked): run it in a thread."""
    held = []
    for record in records:
        try:
            held.append(HeldResult.from_record(record.restored_as, record.fields))
        except ValueError as exc:
            raise rejected_checkpoint(
                f"an outbox record is invalid: {exc}", capture_key=record.checkpointed.capture_key
            ) from None
    return held


@dataclass(frozen=True, slots=True)
class Lookup:
    """What the outbox says of a receipted request before it runs: the result it already
    holds for the rollout and route, and whether a new one would find room."""

    held: HeldResult | None
    full: bool


@dataclass
class Acknowledgement:
    """What one AcknowledgeResults did."""

    released: int = 0
    not_held: int = 0


@dataclass
class ResultOutbox:
    """The held results of one participant, one per rollout (a newer result of a rollout
    replaces an older one), in the order they were put."""

    cap: int = DEFAULT_OUTBOX_CAP
    _held: OrderedDict[str, HeldResult] = field(default_factory=OrderedDict)
    """By rollout id."""
    _acknowledged: OrderedDict[tuple[str, int], str] = field(default_factory=OrderedDict)
    """(rollout, attempt) -> digest of receipts acknowledged and released."""
    offered_again: int = 0
    """Late runs answered from the outbox (counter)."""
    restored: bool = False
    """A Restore installed results here: the process has restored (its `has_served`), until
    a rejoining Restore makes it forget so (the results stay)."""
    _ordered: list[HeldResult] | None = None

    def __len__(self) -> int:
        return len(self._held)

    @property
    def full(self) -> bool:
        return len(self._held) >= self.cap

    def find(self, rollout_id: str, route: str) -> HeldResult | None:
        """The result held for `rollout_id` from `route`, if any."""
        held = self._held.get(rollout_id)
        return held if held is not None and held.route == route else None

    def lookup(self, episode: EpisodeId, route: str) -> Lookup:
        """Before a receipted run: its rollout's held result (counted as offered again), or
        whether there is room for a new one."""
        held = self.find(episode.rollout_id, route)
        if held is not None:
            self.offered_again += 1
        return Lookup(held, self.full)

    def hold(self, produced: Produced, lineage: Sequence[str]) -> Receipt:
        """Hold the result a run just produced; its receipt."""
        held = held_result(produced, lineage)
        self.put(held)
        return held.receipt

    def put(self, held: HeldResult) -> None:
        """Hold `held` (replacing what its rollout held). The cap is checked before the run
        starts (`full`), not here: a run admitted is never refused its result."""
        self._held.pop(held.receipt.rollout_id, None)
        self._held[held.receipt.rollout_id] = held
        self._ordered = None

    def acknowledge(self, receipts: Sequence[Receipt]) -> Acknowledgement:
        """Release every held result these receipts name; all or nothing (the module
        docstring says why a contradicting digest refuses the whole call)."""
        releases: list[str] = []
        for receipt in receipts:
            issued = self._issued_digest(receipt)
            if issued is not None and issued != receipt.result_sha256:
                raise CheckpointError(
                    Reason.RECEIPT_MISMATCH,
                    f"the receipt of {receipt.capture_key} was issued with another digest",
                    metadata={"captureKey": receipt.capture_key, "resultSha256": issued},
                )
            held = self._held.get(receipt.rollout_id)
            if held is not None and held.receipt.attempt == receipt.attempt:
                releases.append(receipt.rollout_id)
        outcome = Acknowledgement()
        for rollout_id in releases:
            held = self._held.pop(rollout_id, None)
            self._ordered = None
            if held is None:  # named twice in one call
                continue
            outcome.released += 1
            self._remember(held.receipt)
        outcome.not_held = len(receipts) - outcome.released
        return outcome

    def drop(self, covered: Callable[[EpisodeId], bool]) -> None:
        """Release every held result whose producing attempt is `covered` (a Retire or
        Forget: the controller gave the rollout up)."""
        for rollout_id in [
            r for r, held in self._held.items() if covered(_produced_by(held.receipt))
        ]:
            del self._held[rollout_id]
            self._ordered = None

    def retired(self, episode: EpisodeId) -> None:
        """A Retire of `episode`: release the result of any attempt <= it of its rollout."""
        self.drop(
            lambda produced: (
                produced.rollout_id == episode.rollout_id and produced.attempt <= episode.attempt
            )
        )

    def forgotten(self, rollout_ids: Iterable[str]) -> None:
        """A Forget of these rollouts: release their results."""
        forgotten = set(rollout_ids)
        self.drop(lambda produced: produced.rollout_id in forgotten)

    def answer_worker(self, op: str, body: Mapping[str, Any], lineage: Sequence[str]) -> Any:
        """A worker's call to the outbox its main process holds (`outbox_lookup`,
        `outbox_put`: worker_bridge.BridgedOutbox); KeyError for another call."""
        episode = EpisodeId.from_capture_key(body["episode"])
        if op == "outbox_lookup":
            found = self.lookup(episode, body["route"])
            held = None if found.held is None else bridged_result(found.held)
            return {"held": held, "full": found.full}
        if op == "outbox_put":
            produced = Produced(
                episode, body["route"], body["request"], body["canonical"], body["digest"]
            )
            return self.hold(produced, lineage).as_json()
        raise KeyError(op)

    def drop_held_as(self, episodes: set[EpisodeId]) -> None:
        """Release the results held under these keys (a failed restore undoes its install)."""
        for rollout_id in [r for r, held in self._held.items() if held.episode_id in episodes]:
            del self._held[rollout_id]
            self._ordered = None

    def results(self) -> list[HeldResult]:
        """Every held result, in capture-key order: sorted once per change, so paging
        through a large outbox (ListResults) does not sort it again for every page."""
        if self._ordered is None:
            self._ordered = sorted(self._held.values(), key=lambda h: h.episode_id.capture_key)
        return self._ordered

    def export(self) -> list[ExportRecord]:
        """A record of every held result, under the key it is held by: every checkpoint
        carries the whole outbox, whatever its scope."""
        return [ExportRecord(held.episode_id, held.record_fields()) for held in self._held.values()]

    def install(self, held: Iterable[HeldResult]) -> None:
        """Hold restored results, except for rollouts that hold one already: a survivor
        rejoining a restore keeps what it produced after the checkpoint (newer, and never
        acknowledged either) over the checkpoint's."""
        for result in held:
            self.restored = True
            if result.receipt.rollout_id not in self._held:
                self.put(result)

    @classmethod
    def of(cls, context: Any) -> ResultOutbox:
        """The outbox of a participant attached to `context` (its cap, when it says one)."""
        return cls(cap=getattr(context, "outbox_cap", DEFAULT_OUTBOX_CAP))

    def counters(self) -> dict[str, int]:
        return {"outbox_held": len(self._held), "outbox_offered_again": self.offered_again}

    def _issued_digest(self, receipt: Receipt) -> str | None:
        held = self._held.get(receipt.rollout_id)
        if held is not None and held.receipt.attempt == receipt.attempt:
            return held.receipt.result_sha256
        return self._acknowledged.get((receipt.rollout_id, receipt.attempt))

    def _remember(self, receipt: Receipt) -> None:
        self._acknowledged[(receipt.rollout_id, receipt.attempt)] = receipt.result_sha256
        while len(self._acknowledged) > ACKNOWLEDGED_KEPT:
            self._acknowledged.popitem(last=False)


@dataclass(frozen=True, slots=True)
class Produced:
    """What a receipted run produced: its episode, route and request digest, and its
    result's canonical JSON and digest (receipts.py computes them, off the loop when large)."""

    episode: EpisodeId
    route: str
    request_sha256: str
    canonical: str
    result_sha256: str

    def bridged(self) -> dict[str, Any]:
        """As a worker's `outbox_put` carries it to the main process."""
        return {
            "episode": self.episode.capture_key,
            "route": self.route,
            "request": self.request_sha256,
            "canonical": self.canonical,
            "digest": self.result_sha256,
        }


def held_result(produced: Produced, lineage: Sequence[str]) -> HeldResult:
    """The outbox entry of what a run just produced."""
    episode = produced.episode
    receipt = Receipt(episode.rollout_id, episode.attempt, produced.result_sha256, tuple(lineage))
    return HeldResult(episode, receipt, produced.route, produced.canonical, produced.request_sha256)


def bridged_result(held: HeldResult) -> dict[str, Any]:
    """A held result as the worker bridge carries it."""
    return {
        "episode": held.episode_id.capture_key,
        "receipt": held.receipt.as_json(),
        "route": held.route,
        "canonical": held.canonical,
        "request": held.request_sha256,
    }


def unbridged_result(body: Mapping[str, Any]) -> HeldResult:
    return HeldResult(
        EpisodeId.from_capture_key(body["episode"]),
        Receipt.from_json(body["receipt"]),
        body["route"],
        body["canonical"],
        body["request"],
    )


def _produced_by(receipt: Receipt) -> EpisodeId:
    return EpisodeId(receipt.rollout_id, receipt.attempt)


def receipts_from(values: Iterable[tuple[str, int, str]]) -> list[Receipt]:
    """Receipts to acknowledge from (rollout id, attempt, digest); INVALID_REQUEST names the
    first bad one (`receipts[i]`)."""
    receipts = []
    for index, (rollout_id, attempt, digest) in enumerate(values):
        try:
            receipts.append(checked_receipt(rollout_id, attempt, digest))
        except ValueError as exc:
            raise invalid_request(f"receipts[{index}]", str(exc)) from None
    return receipts
