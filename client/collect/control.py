"""The collector's control calls to the fleet (Retire, Forget, Resume, checkpoints): their
ids, their batches, and backing off when they fail."""

from __future__ import annotations

import time

from rollout_checkpoint.client.collect.view import CollectView

BATCH = 1024
"""Rollouts per Retire or Forget call (upstream retires failed rows in batches of 1024)."""
CONTROL_FAILURES_FATAL = 6
"""Consecutive failed Retire/Forget rounds after which the fleet counts as lost."""


class ControlCalls:
    """Ids for the collector's control calls, and the backoff between failed rounds.

    Every id is `<run id>-<what>-<n>`: unique per run, so a participant's idempotent replay
    never answers one call with another's reply, and readable in the participants' logs."""

    def __init__(self, run_id: str, view: CollectView) -> None:
        self.run_id = run_id
        self.view = view
        self.failures = 0
        """Consecutive failed rounds."""
        self.retry_at = 0.0
        """`time.monotonic()` before which no Retire/Forget round is tried again."""
        self._ids = 0

    def new_id(self, what: str) -> str:
        """A fresh control id for a `what` call (`retire`, `forget`, `restore`, `open`)."""
        self._ids += 1
        return f"{self.run_id}-{what}-{self._ids}"

    def failed(self, what: str, error: Exception) -> bool:
        """Note a failed round and back off (exponentially, up to 30 s); True once the fleet
        has failed `CONTROL_FAILURES_FATAL` rounds in a row."""
        self.failures += 1
        delay = min(0.5 * 2**self.failures, 30.0)
        self.retry_at = time.monotonic() + delay
        self.view.note(f"collect: {what} failed ({error}); retrying in {delay:.1f}s")
        return self.failures >= CONTROL_FAILURES_FATAL

    def succeeded(self) -> None:
        """A round went through: the next failure starts the backoff afresh."""
        self.failures = 0
