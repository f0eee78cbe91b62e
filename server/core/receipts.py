"""A completion receipt: what a trainer acknowledges once it persisted a finished result.

The entry participant issues one with every receipted result (server.runtime.result_outbox)
and the trainer's ledger keeps it (client.ledger): one value for both sides, which import
nothing but the core. Its JSON form is what the `x-rollout-receipt` reply header carries and
`ResultReceipt` of the contract names field by field.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from rollout_checkpoint.server.core.episodes import EpisodeId, rollout_id_problem

DIGEST = re.compile(r"[0-9a-f]{64}")
"""A SHA-256 digest as the contract writes it: 64 lowercase hex characters."""


@dataclass(frozen=True, slots=True)
class Receipt:
    """What a trainer acknowledges: which attempt produced the result, the digest of the
    result as issued, and the checkpoints the producing fleet state was restored from."""

    rollout_id: str
    """The rollout whose result it is."""
    attempt: int
    """The attempt that produced the result (0 for the first)."""
    result_sha256: str
    """The SHA-256 of the result's canonical JSON, as the entry issued it (echo it)."""
    lineage: tuple[str, ...] = ()
    """The checkpoints the producing fleet state was restored from (informational)."""

    @property
    def capture_key(self) -> str:
        """The capture key of the attempt that produced the result."""
        return EpisodeId(self.rollout_id, self.attempt).capture_key

    def as_json(self) -> dict[str, Any]:
        """The receipt as the `x-rollout-receipt` header and the ledger's state carry it."""
        return {
            "rollout_id": self.rollout_id,
            "attempt": self.attempt,
            "result_sha256": self.result_sha256,
            "lineage": list(self.lineage),
        }

    @classmethod
    def from_json(cls, value: Any) -> Receipt:
        """A receipt from its JSON form; ValueError for anything else."""
        if not isinstance(value, dict) or set(value) != {
            "rollout_id",
            "attempt",
            "result_sha256",
            "lineage",
        }:
            raise ValueError("a receipt holds exactly rollout_id, attempt, result_sha256, lineage")
        lineage = value["lineage"]
        if not isinstance(lineage, list) or not all(isinstance(c, str) for c in lineage):
            raise ValueError("a receipt's lineage is a list of checkpoint ids")
        return checked_receipt(
            value["rollout_id"], value["attempt"], value["result_sha256"], tuple(lineage)
        )


def checked_receipt(
    rollout_id: Any, attempt: Any, digest: Any, lineage: tuple[str, ...] = ()
) -> Receipt:
    """A receipt from its parts, each checked (ValueError names the first bad one)."""
    if not isinstance(rollout_id, str) or (problem := rollout_id_problem(rollout_id)):
        raise ValueError(
            f"rollout_id: {problem if isinstance(rollout_id, str) else 'not a string'}"
        )
    if not isinstance(attempt, int) or isinstance(attempt, bool) or not 0 <= attempt < 2**31:
        raise ValueError("attempt: must be an integer from 0")
    if not isinstance(digest, str) or not DIGEST.fullmatch(digest):
        raise ValueError("result_sha256: must be 64 lowercase hex characters")
    return Receipt(rollout_id, attempt, digest, lineage)
