"""Waiting on the control plane's work without cancelling it.

A deadline ends the wait of one call, never the work: an export, a write or an install that
outlives its caller's deadline goes on, and the controller's retry (with a later deadline)
awaits the same work instead of starting it a second time. Exporting twice could store
state from after the cut; installing twice could install over a half-finished install.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Sequence
from typing import Any, TypeVar

from rollout_checkpoint.server.core.clock import Clock
from rollout_checkpoint.server.core.errors import deadline_exceeded

T = TypeVar("T")


async def await_until(
    clock: Clock, deadline: float, awaitable: Awaitable[T], message: str, *, swallow: bool = False
) -> T:
    """Await `awaitable` until the (`clock`'s) deadline without cancelling it.

    Returns its result, or raises its exception; past the deadline raises
    `CheckpointError(DEADLINE_EXCEEDED, message)` while the work goes on. With `swallow`, the
    work's own failure is ignored and None returned (only its end matters: the work's owner
    reports the failure to whoever awaits it for its result). A cancellation of the caller
    propagates and leaves the work running.
    """
    future = asyncio.ensure_future(awaitable)
    if not future.done():
        sleeper = asyncio.ensure_future(clock.sleep_until(deadline))
        try:
            await asyncio.wait({future, sleeper}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            sleeper.cancel()
    if not future.done():
        raise deadline_exceeded(message, deadline)
    if swallow:
        return None  # type: ignore[return-value]
    return future.result()


def retrieve_exception(task: asyncio.Future[Any]) -> None:
    """A done callback for jobs: a job may fail after every caller gave up on it; its error is
    then reported to the next caller (a retry), not logged as "never retrieved"."""
    if not task.cancelled():
        task.exception()


async def first_of(awaitables: Sequence[Awaitable[Any]]) -> int:
    """Wait for the first of several awaitables; cancel the rest; return its index."""
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        return min(i for i, t in enumerate(tasks) if t in done)
    finally:
        for task in tasks:
            task.cancel()


async def cancel_and_wait(task: asyncio.Task[Any]) -> None:
    """Cancel `task` and wait until it ended; raises what it raised other than its own
    cancellation.

    Its cancellation is expected and swallowed, the caller's is not: a shutdown that is itself
    cancelled (uvicorn's, a test's timeout) must stop here rather than carry on as if
    nothing happened, so a `CancelledError` is re-raised while the current task is being
    cancelled (`Task.cancelling()`)."""
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        current = asyncio.current_task()
        if current is not None and current.cancelling():
            raise
