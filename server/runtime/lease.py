"""The lease and the start-closed timer: no fleet stays closed because its controller died.

A controller that closes a participant (Prepare) or restores into it holds a lease: the
deadline of its last call plus a grace period. Every call of the checkpoint renews it; when it
expires the participant resumes on its own, exactly as if the controller had sent Resume, so a
controller that crashed between Prepare and Resume leaves the fleet closed for at most the
grace period, never forever.

* The lease only ever moves later: a call with an earlier deadline than the last one must not
  shorten the time the controller was promised.
* An expiry acts only if the lease it saw is still the current one: a renew or a Resume that
  raced with it wins, and the watcher never resumes a newer checkpoint on an older lease.
* An expiry whose resume is refused (a restore still installing, a commit still cleaning up)
  is retried every `LEASE_RETRY_SECONDS` until it goes through.
* The watcher stops when the lease ends; left asleep until the old expiry it would notice the
  next checkpoint's lease only then, however much earlier that one ends.

The start-closed timer is the same promise for a replacement process started closed: if no
restore or resume arrives in time it opens on its own (waiting for a restore that is running
at the timeout rather than skipping it: a failed restore must still end in an open process).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Protocol

from rollout_checkpoint.server.core.clock import Clock
from rollout_checkpoint.server.core.errors import CheckpointError
from rollout_checkpoint.server.runtime.observe import ControlObserver

log = logging.getLogger(__name__)

LEASE_RETRY_SECONDS = 30.0

Spawn = Callable[[Coroutine[Any, Any, None]], "asyncio.Task[None]"]


class LeaseHolder(Protocol):
    """What the lease acts on: the control plane's active checkpoint and its Resume."""

    @property
    def active_checkpoint_id(self) -> str | None: ...

    async def resume_on_expiry(
        self, checkpoint_id: str, deadline: float, lease_expiry: float
    ) -> bool:
        """Resume `checkpoint_id` if `lease_expiry` is still its lease (else do nothing).

        Raises `CheckpointError` when the resume cannot happen yet."""
        ...


class Lease:
    """The lease of the active checkpoint and the task that watches it.

    Used under the control plane's lock; the watcher runs as one of its background duties
    (`spawn`), so a watcher that dies is reported as fatal rather than lost."""

    def __init__(
        self,
        holder: LeaseHolder,
        *,
        clock: Clock,
        grace_seconds: float,
        observer: ControlObserver,
        spawn: Spawn,
    ) -> None:
        self._holder = holder
        self._clock = clock
        self._grace_seconds = grace_seconds
        self._observer = observer
        self._spawn = spawn
        self._expires_at: float | None = None
        self._watcher: asyncio.Task[None] | None = None

    @property
    def expires_at(self) -> float | None:
        return self._expires_at

    def renew(self, deadline: float) -> float:
        """Extend the lease to `deadline` plus the grace period (never shorten it); returns
        the new expiry and makes sure a watcher runs."""
        lease = deadline + self._grace_seconds
        self._expires_at = max(self._expires_at or lease, lease)
        if self._watcher is None or self._watcher.done():
            self._watcher = self._spawn(self._watch())
        return self._expires_at

    def end(self) -> None:
        """The checkpoint ended (resumed, or its Prepare undone): no lease, no watcher."""
        self._expires_at = None
        task, self._watcher = self._watcher, None
        if task is not None and task is not asyncio.current_task():
            task.cancel()

    async def _watch(self) -> None:
        while (lease := self._expires_at) is not None:
            await self._clock.sleep_until(lease)
            expires = self._expires_at
            if expires is None or self._clock.now() < expires:
                continue
            checkpoint_id = self._holder.active_checkpoint_id
            if checkpoint_id is None:
                return
            tagged = {"checkpoint_id": checkpoint_id}
            log.warning(
                "lease of checkpoint %s expired: resuming on our own", checkpoint_id, extra=tagged
            )
            self._observer.lease_expired(checkpoint_id)
            try:
                await self._holder.resume_on_expiry(
                    checkpoint_id, self._clock.now() + LEASE_RETRY_SECONDS, expires
                )
            except CheckpointError as exc:
                log.warning(
                    "lease expiry could not reopen yet (%s); retrying", exc.message, extra=tagged
                )
                await self._clock.sleep_until(self._clock.now() + LEASE_RETRY_SECONDS)


async def open_after_start_closed(
    clock: Clock,
    when: float,
    open_unless_restoring: Callable[[], Awaitable[asyncio.Future[Any] | None]],
) -> None:
    """At `when`, open a `start_closed` process nobody restored or resumed in time.

    `open_unless_restoring` opens (if still pending) and returns None, or returns the running
    restore to wait for first: if that restore then fails, the process must still open on its
    own rather than stay closed forever."""
    await clock.sleep_until(when)
    while (restore := await open_unless_restoring()) is not None:
        await asyncio.wait({restore})
