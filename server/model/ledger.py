"""What the policy model records of an episode: its calls, and the ledger of delivered ones.

The record of an episode is its ledger of *delivered* calls (request digest and response): a
held or undelivered call is not part of the cut, because an undelivered response leaves its
agent at the boundary before the call, and a restored agent simply re-issues it. The stored
record is `{"calls": [...]}`, with at most one `generation_cut` beside it (generation_cuts.py);
`restored_ledger` refuses anything else, so a Restore never installs a ledger it cannot
continue.

Each call carries the weight version it was admitted under (`"weight_version"`, see
`ModelParticipant.set_weight_version`). The field is additive: a call stored before versions
were recorded has none and reads as unknown, which `oldest_weight_version` skips; a call
whose version is not an integer from 0 to 2^63-1 is refused like any other malformed record.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rollout_checkpoint.server.core.episodes import EpisodeId
from rollout_checkpoint.server.core.errors import rejected_checkpoint
from rollout_checkpoint.server.model.generation_cuts import GenerationCut, GenerationPrefix
from rollout_checkpoint.server.runtime.participant import MAX_WEIGHT_VERSION, RestoredRecord

WEIGHT_VERSION_KEY = "weight_version"
"""A ledger row's field: the weight version its call was admitted under."""


@dataclass(eq=False)
class ModelCall:
    """One generation call admitted by the middleware: its episode (None without a rollout
    prefix: never recorded), the SHA-256 of its request body, the task serving it (a retire
    cancels it), and whether its response is streaming (a blocker) or held until resume."""

    episode: EpisodeId | None
    request_sha256: str
    task: asyncio.Task[Any] | None
    streaming: bool = False
    held: bool = False
    retired: bool = False
    """Cancelled by a retire: answered 409 `stale_attempt` (request_endings.py), not a 500."""
    body: bytes = b""
    """The request body: its conversation digest is computed only if the call is cut."""
    sequence: int = 0
    """Admission order: of several undelivered calls of one episode, the last one is cut."""
    weight_version: int = 0
    """The weight version current when the call was admitted: what its reply and its ledger
    row are stamped with, whatever the version is by the time it is delivered."""
    staged: GenerationCut | None = None
    """The prefix its backend staged at this checkpoint's close (dropped at resume)."""
    prefix: GenerationPrefix | None = None
    """The restored cut attached to this (re-issued) call: the backend continues it."""


@dataclass
class Ledger:
    """The delivered calls of one episode, in order: `{"request_sha256", "response"}` each.
    This is the model's record of the episode; a held or undelivered call is never in it.
    `cut` is a restored generation cut not yet claimed by the re-issued call.

    Each row is kept as its compact JSON (`rows`), decoded only by `calls` (an export): a
    parsed response is some thirty small objects, its JSON one. Measured with 10,050 ledgers
    of four tool-call replies held (what an agent that never reports its episodes finished
    leaves until the next commit): 25 MB of heap instead of 147 MB. glibc keeps most of those
    25 MB mapped after the release, for reuse by later ledgers."""

    rows: list[bytes] = field(default_factory=list)
    cut: GenerationCut | None = None
    oldest_weight_version: int | None = None
    """The lowest known weight version among `rows` (None: none known), kept as rows are
    added so that ListEpisodes never decodes a ledger."""

    @property
    def calls(self) -> list[dict[str, Any]]:
        """The rows decoded (a fresh copy: the caller may keep or change it)."""
        return [json.loads(row) for row in self.rows]

    def append(self, call: Mapping[str, Any]) -> None:
        """Add a delivered call (`{"request_sha256", "response", "weight_version"}`) as its
        compact JSON."""
        self.rows.append(_compact(call))
        version = call.get(WEIGHT_VERSION_KEY)
        if version is not None and (
            self.oldest_weight_version is None or version < self.oldest_weight_version
        ):
            self.oldest_weight_version = version

    @classmethod
    def of(cls, calls: Sequence[Mapping[str, Any]], cut: GenerationCut | None = None) -> Ledger:
        """A ledger of stored rows (a restored record's `calls`) and its restored cut."""
        ledger = cls(cut=cut)
        for call in calls:
            ledger.append(call)
        return ledger


def _valid_weight_version(call: Mapping[str, Any]) -> bool:
    """A stored call's version is absent (unknown: recorded before versions were) or an
    integer SetWeightVersion could have set (JSON `true` is no version)."""
    if WEIGHT_VERSION_KEY not in call:
        return True
    version = call[WEIGHT_VERSION_KEY]
    return type(version) is int and 0 <= version <= MAX_WEIGHT_VERSION


def _compact(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()  # ASCII: a lone surrogate too


def restored_ledger(record: RestoredRecord) -> Ledger:
    """The ledger (and its generation cut) of a restored model record; the Restore is refused
    `INVALID_CHECKPOINT_STATE`, naming the record's episode, for a record of another shape."""
    calls = record.fields.get("calls")
    if (
        not {"calls"} <= set(record.fields) <= {"calls", "generation_cut"}
        or not isinstance(calls, list)
        or not all(isinstance(c, dict) for c in calls)
    ):
        raise rejected_checkpoint(
            "a model record holds a list of calls and at most one generation cut",
            capture_key=record.checkpointed.capture_key,
        )
    if not all(_valid_weight_version(c) for c in calls):
        raise rejected_checkpoint(
            "a model record's call has a weight_version that is not an integer from 0 to "
            f"{MAX_WEIGHT_VERSION}",
            capture_key=record.checkpointed.capture_key,
        )
    cut = None
    if "generation_cut" in record.fields:
        try:
            cut = GenerationCut.from_json(record.fields["generation_cut"])
        except ValueError as exc:
            raise rejected_checkpoint(
                str(exc), capture_key=record.checkpointed.capture_key
            ) from None
    try:
        return Ledger.of(calls, cut)
    except (TypeError, ValueError) as exc:  # not JSON (NaN is refused at commit too)
        raise rejected_checkpoint(
            f"a model record's calls are not JSON: {exc}",
            capture_key=record.checkpointed.capture_key,
        ) from None
