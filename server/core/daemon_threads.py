"""Blocking storage calls on threads that a hung filesystem or store cannot hold hostage.

A thread stuck in a write to a frozen filesystem (or waiting on an object store that accepts
connections but never answers) cannot be cancelled. `asyncio.to_thread` runs calls on the
loop's default executor, whose threads are joined twice when the process ends
(`asyncio.run` shuts the executor down, then `concurrent.futures` joins its workers at
interpreter exit): one stuck call kept a SIGTERMed participant alive until the thaw. The
calls here run on daemon threads of their own, which nothing joins, so a caller that stops
waiting (its deadline, a shutdown) can end the process.

A caller that stops waiting marks the call abandoned (`StorageCall.abandon`). The thread goes
on until its blocked system call returns; code that runs in it checks `abandoned()` before
each step that makes something durable and others trust, so a thread that wakes up after
its caller gave up does not go on to publish what the caller already reported as failed.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")

_current = threading.local()


class StorageCall(Generic[T]):
    """One blocking call running on a daemon thread of its own."""

    def __init__(self, function: Callable[[], T], name: str) -> None:
        self.future: concurrent.futures.Future[T] = concurrent.futures.Future()
        self.abandoned = threading.Event()
        self._started = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(function,), name=name, daemon=True)
        self.thread.start()
        self._started.set()

    def _run(self, function: Callable[[], T]) -> None:
        # `Thread.start` returns once the new thread runs; a thread that then went straight
        # into CPU work (composing an incremental part) held the GIL for a whole switch
        # interval (5 ms) before the starter, on the event loop, could go on: a pause paid
        # that for every asynchronous commit. Waiting here hands the GIL back first.
        self._started.wait()
        _current.abandoned = self.abandoned
        if not self.future.set_running_or_notify_cancel():
            return
        try:
            result = function()
        except BaseException as error:
            self.future.set_exception(error)
        else:
            self.future.set_result(result)

    def abandon(self) -> None:
        """The caller stopped waiting: steps not yet begun must not run (see `abandoned`)."""
        self.abandoned.set()

    async def wait(self) -> T:
        """The call's result. Cancelled (by a timeout around it, a shutdown), the call is
        abandoned; the thread is left to end by itself."""
        try:
            return await asyncio.wrap_future(self.future)
        except asyncio.CancelledError:
            self.abandon()
            raise

    def result(self, timeout: float | None = None) -> T:
        """The call's result, waited for at most `timeout` seconds from a synchronous caller
        (TimeoutError after it, and the call is abandoned)."""
        try:
            return self.future.result(timeout)
        except concurrent.futures.TimeoutError:
            self.abandon()
            raise TimeoutError from None


async def run_in_daemon_thread(function: Callable[[], T], name: str) -> T:
    """`asyncio.to_thread` for a storage call: the same, on a daemon thread (module doc)."""
    return await StorageCall(function, name).wait()


def abandoned() -> bool:
    """Whether the caller of the storage call running on this thread stopped waiting for it
    (always False outside such a call)."""
    event: threading.Event | None = getattr(_current, "abandoned", None)
    return event is not None and event.is_set()
