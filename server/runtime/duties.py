"""The control plane's background duties: the lease watcher and the start-closed timer.

A duty is what keeps the fleet from staying closed when nobody calls any more, so its death
must not go unnoticed: a duty that fails is logged as critical and reported to the fatal
listeners, and the runtime turns that into liveness NOT_SERVING (the pod gets restarted). A
participant whose lease can no longer expire could otherwise leave the fleet closed forever.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")


class Duties:
    """Background tasks of one control plane, and who hears of their failure."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()
        self._fatal_listeners: list[Callable[[BaseException], None]] = []

    def add_fatal_listener(self, listener: Callable[[BaseException], None]) -> None:
        self._fatal_listeners.append(listener)

    def spawn(self, coro: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
        """Run `coro` as a duty on the running loop."""
        # A fresh context: a duty outlives the RPC that started it and must not log under
        # (or parent spans to) that RPC's checkpoint id.
        task = asyncio.get_running_loop().create_task(coro, context=contextvars.Context())
        self._tasks.add(task)
        task.add_done_callback(self._ended)
        return task

    async def stop(self) -> None:
        """Cancel every duty and wait until they ended.

        A duty's own failure was reported when it ended (`_ended`); a cancellation of the
        caller propagates (the duties are cancelled already)."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)

    def _ended(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if task.cancelled() or task.exception() is None:
            return
        error = task.exception()
        assert error is not None
        log.critical("a background duty of the control plane failed", exc_info=error)
        for listener in list(self._fatal_listeners):
            listener(error)
