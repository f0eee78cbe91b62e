"""Retire and Forget: free finished or abandoned attempts, then drop their marks.

A rejoining Restore discards what a survivor holds through the same two steps (`mark` under
the lock, then `free`), so its episodes are retired exactly as by Retire and a discard cut
short blocks Forget the same way.

* Retire marks the attempts first, under the lock: from then on late requests of these
  attempts are refused, whether or not this retire finishes (a late request could otherwise
  recreate state nothing frees).
* A Retire waits for a running restore's install before freeing anything: an episode freed
  while it is being installed would come back.
* Forget drops a rollout's marks (and the participant's memory of it) only once nothing of it
  can still run: while a retire of the rollout is running, or one ended before it freed
  everything (its deadline passed, a hook failed), Forget is RETIRE_INCOMPLETE and the
  controller retires again first. Dropping the mark earlier would let a late request of the
  attempt recreate state after all.
* Both are refused while a checkpoint is open (resume first); while RESTORED they must use the
  restore's id and renew its lease.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from rollout_checkpoint.server.core.episodes import EpisodeId, rollout_id_problem
from rollout_checkpoint.server.core.errors import CheckpointError, Reason, invalid_request
from rollout_checkpoint.server.runtime.refusals import call_hook
from rollout_checkpoint.server.runtime.state_machine import StateMachine
from rollout_checkpoint.server.runtime.waiting import await_until


class Retirement:
    """Retire and Forget of one control plane, and the retires still running or cut short."""

    def __init__(self, machine: StateMachine) -> None:
        self._machine = machine
        self._running: dict[str, int] = {}
        self._cut_short: set[str] = set()

    async def retire(
        self, checkpoint_id: str, deadline: float, episodes: Sequence[EpisodeId]
    ) -> tuple[str, ...]:
        """Mark `episodes`' attempts retired and free them through the participant's hook.

        Returns their capture keys. Raises DEADLINE_EXCEEDED when the hooks did not finish in
        time (they go on; the marks stay), HOOK_FAILED when one failed."""
        machine = self._machine
        if not episodes:
            raise invalid_request("episodes", "must name at least one episode")
        async with machine.lock:
            machine.check_not_shutting_down()
            machine.check_retire_phase(checkpoint_id, deadline, "Retire")
            self.mark(episodes)
        await self.free(episodes, deadline, wait_for_install=True)
        return tuple(e.capture_key for e in episodes)

    def mark(self, episodes: Sequence[EpisodeId]) -> None:
        """With the lock held: mark the attempts retired and count their rollouts as being
        retired (Forget is RETIRE_INCOMPLETE for them until `free` finished).

        Marks come first: from here on late requests of these attempts are refused, whether
        or not the retire finishes. Every `mark` must be followed by one `free` of the same
        episodes (which ends the count)."""
        machine = self._machine
        for episode in episodes:
            machine.retired_attempts.mark(episode)
        for rollout in {e.rollout_id for e in episodes}:
            self._running[rollout] = self._running.get(rollout, 0) + 1
        machine.changed()

    async def free(
        self, episodes: Sequence[EpisodeId], deadline: float, *, wait_for_install: bool
    ) -> None:
        """Free marked episodes through the participant's `retire` hook, all at once, until
        the deadline (the hooks go on after it; DEADLINE_EXCEEDED, HOOK_FAILED).

        `wait_for_install`: first wait for a running restore's install (a Retire: an episode
        freed while it is being installed would come back). A rejoining restore's own discard
        passes False: the restore it would wait for is itself, and nothing is installed yet."""
        machine = self._machine
        rollouts = {e.rollout_id for e in episodes}
        finished = False
        try:
            restore = machine.restore_job
            if wait_for_install and restore is not None and restore.task is not None:
                await await_until(
                    machine.clock,
                    deadline,
                    restore.task,
                    "an install is still running",
                    swallow=True,
                )
            hooks = asyncio.gather(
                *(call_hook("retire", machine.participant.retire(e)) for e in episodes)
            )
            await await_until(
                machine.clock, deadline, hooks, "the retire did not finish before its deadline"
            )
            finished = True
        finally:
            for rollout in rollouts:
                self._running[rollout] -= 1
                if not self._running[rollout]:
                    del self._running[rollout]
                if finished:
                    self._cut_short.discard(rollout)
                else:
                    self._cut_short.add(rollout)
            machine.changed()

    async def forget(
        self, checkpoint_id: str, deadline: float, rollout_ids: Sequence[str]
    ) -> tuple[str, ...]:
        """Drop the marks and the participant's memory of `rollout_ids`; returns them sorted.

        Raises RETIRE_INCOMPLETE while a retire of one of them runs or was cut short."""
        machine = self._machine
        if not rollout_ids:
            raise invalid_request("rollout_ids", "must name at least one rollout")
        for rollout_id in rollout_ids:
            problem = rollout_id_problem(rollout_id)
            if problem is not None:
                raise invalid_request("rollout_ids", problem)
        async with machine.lock:
            machine.check_not_shutting_down()
            machine.check_retire_phase(checkpoint_id, deadline, "Forget")
            blocked = sorted(
                r for r in set(rollout_ids) if r in self._cut_short or r in self._running
            )
            if blocked:
                raise CheckpointError(
                    Reason.RETIRE_INCOMPLETE,
                    "a retire of these rollouts has not freed everything yet; retire them again",
                    metadata={"rolloutIds": ",".join(blocked)},
                )
            machine.retired_attempts.forget(rollout_ids)
            machine.participant.forget(rollout_ids)
            machine.changed()
            return tuple(sorted(set(rollout_ids)))
