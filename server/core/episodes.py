"""Episode identity: ids, capture keys and the id rules shared by servers and controllers.

This is the one runtime module controllers may import (it is a pure leaf of value types), so
it imports nothing of the runtime and nothing outside the standard library.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

ID_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
"""What checkpoint ids, rollout ids, kinds and instance names may look like.

The first character is never `.` or `-`, so an id is never a path component like `..` and
never looks like a command-line flag. The pattern is the documented one, so messages can
quote it; test a value with `is_valid_id` (or `ID_PATTERN.fullmatch`), never `.match`:
Python's `$` also matches before a final newline, so `.match` would accept an id followed by a
newline, which a Go or Java controller applying the same pattern to the whole string refuses."""

MAX_ID_LENGTH = 128

MAX_ATTEMPT = 2**31 - 2
"""The highest attempt an episode may carry: its restore installs attempt N+1, which must
still fit below 2^31 - 1 in every language's signed 32-bit integer."""

# `\Z`, not `$`: a capture key `r-a1` followed by a newline must not parse as attempt 1 of `r`.
_ATTEMPT_SUFFIX = re.compile(r"-a([1-9][0-9]*)\Z")


def is_valid_id(value: str) -> bool:
    """Whether `value` is a valid checkpoint id, kind or instance name."""
    return 0 < len(value) <= MAX_ID_LENGTH and ID_PATTERN.fullmatch(value) is not None


def rollout_id_problem(rollout_id: str) -> str | None:
    """Why `rollout_id` is not a valid rollout id, or None when it is.

    A rollout id that itself ended in `-a<N>` would make `r-a1` mean both attempt 0 of rollout
    `r-a1` and attempt 1 of rollout `r`, so such ids are refused."""
    if not is_valid_id(rollout_id):
        return f"rollout id must be 1-{MAX_ID_LENGTH} characters matching {ID_PATTERN.pattern}"
    if _ATTEMPT_SUFFIX.search(rollout_id):
        return "rollout id must not end in -a<N>: its capture keys would be ambiguous"
    return None


@dataclass(frozen=True, order=True, slots=True)
class EpisodeId:
    """One attempt of one rollout.

    Attempt 0 is a rollout's first run; a restore continues attempt N as N+1, and a rollout
    restarted from its input after a retire runs as a later attempt. Construction raises
    ValueError for an invalid rollout id (see `rollout_id_problem`) or an attempt outside
    0..`MAX_ATTEMPT`, so an EpisodeId that exists is always valid. Immutable, hashable, and
    ordered by (rollout id, attempt), which is the order records and blockers are sorted in.
    """

    rollout_id: str
    attempt: int = 0

    def __post_init__(self) -> None:
        problem = rollout_id_problem(self.rollout_id)
        if problem is not None:
            raise ValueError(problem)
        if not 0 <= self.attempt <= MAX_ATTEMPT:
            raise ValueError(f"attempt must be between 0 and {MAX_ATTEMPT}")

    @property
    def capture_key(self) -> str:
        """`r` for attempt 0, `r-a<N>` otherwise: the key the data plane and storage use."""
        return self.rollout_id if self.attempt == 0 else f"{self.rollout_id}-a{self.attempt}"

    def next_attempt(self) -> EpisodeId:
        """The attempt a restore installs this checkpointed episode as."""
        return EpisodeId(self.rollout_id, self.attempt + 1)

    @classmethod
    def from_capture_key(cls, capture_key: str) -> EpisodeId:
        """Parse a capture key back into exactly one episode (ValueError when invalid)."""
        match = _ATTEMPT_SUFFIX.search(capture_key)
        if match is None:
            return cls(capture_key, 0)
        return cls(capture_key[: match.start()], int(match.group(1)))

    def to_json(self) -> dict[str, object]:
        """The form stored in records: `{"rollout_id": ..., "attempt": ...}`."""
        return {"rollout_id": self.rollout_id, "attempt": self.attempt}

    @classmethod
    def from_json(cls, value: object) -> EpisodeId:
        """Parse the stored form; ValueError when it is not exactly that shape."""
        if not isinstance(value, dict) or set(value) != {"rollout_id", "attempt"}:
            raise ValueError("episode_id must be an object with rollout_id and attempt")
        rollout_id, attempt = value["rollout_id"], value["attempt"]
        if not isinstance(rollout_id, str) or type(attempt) is not int:
            raise ValueError("episode_id must hold a string rollout_id and an integer attempt")
        return cls(rollout_id, attempt)
