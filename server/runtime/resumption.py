"""Resume: reopen admission, waiting outside the lock for whatever must end first.

No lock is held while waiting on storage or hooks: a write stuck in a frozen filesystem must
not keep every other RPC (and the lease watcher) from answering. Each look at what must end
is one short step of the state machine (`StateMachine.resume_step`), taken under its lock:

* A write that has not begun publishing is fenced off at once and never waited for.
* One whose manifest link is under way (it cannot be withdrawn) and a cancelled export are
  waited for until the deadline, so none of them runs after the reopen when it ends in time;
  admission reopens at the deadline regardless (the fleet must not stay closed).
* A restore still reading is abandoned (a rejoin's still discarding too: its retires go on
  to their end, as a Retire's do).
* A restore installing, and a commit's cleanup, are waited for; past the deadline the Resume
  is refused and nothing changed (retry it): reopening while they run would let a request
  claim state that is being installed or freed.
* While a Resume waits for a stopped job its id is fenced already (`StateMachine.resuming`),
  so no call can start new work for the checkpoint being abandoned.
"""

from __future__ import annotations

from rollout_checkpoint.server.core.errors import CheckpointError
from rollout_checkpoint.server.runtime.state_machine import StateMachine
from rollout_checkpoint.server.runtime.waiting import await_until


async def resume(
    machine: StateMachine,
    checkpoint_id: str,
    deadline: float,
    *,
    lease_expiry: float | None = None,
) -> bool:
    """Resume `checkpoint_id`; returns whether there was nothing to end (idempotent).

    With `lease_expiry` (the lease watcher's Resume) nothing happens unless it is still the
    current lease of `checkpoint_id`."""
    try:
        while True:
            async with machine.lock:
                if lease_expiry is not None and (
                    machine.active_id != checkpoint_id or machine.lease.expires_at != lease_expiry
                ):
                    return True
                step = machine.resume_step(checkpoint_id)
            if isinstance(step, bool):
                return step
            awaited, required = step
            try:
                await await_until(machine.clock, deadline, awaited, required or "", swallow=True)
            except CheckpointError:
                if required is not None:
                    raise
            if required is None:
                break
        async with machine.lock:
            return machine.finish_resume(checkpoint_id)
    finally:
        machine.resuming.discard(checkpoint_id)
