"""Every store call of a controller, bounded by its operation's deadline.

A root's methods block (file I/O, fsync, object-store requests). On a frozen filesystem, a
hung NFS mount or an object store that accepts connections but never answers they block
until the store comes back (the object-store client's own request timeout is minutes, sized
for a large upload): a `checkpoint --timeout 10` answered after 120 s, or never. So a
controller never calls a root directly from asyncio code: `store_call` runs the method on a
daemon thread (`server.core.daemon_threads`) and stops waiting at the deadline with
`StorageFailed`, the store's failure, never the checkpoint's.

The thread cannot be cancelled; it is abandoned and ends when its system call returns.
Publication checks `daemon_threads.abandoned()` before each step that others trust (the
fleet manifest, `LATEST`, each deletion of retention), so an abandoned publication that wakes
up stops at its next step. A step it was already inside completes, atomically (each one is a
temp file and a link or rename, or a conditional PUT), and the steps are ordered so that
whatever is complete is consistent: at worst the checkpoint it was publishing is published
after all, whole and verified, as if the controller had crashed after publishing it.

A root's lock is held by its thread: a call behind an abandoned one waits on it in its own
thread, so it too ends at its deadline.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable
from typing import Any, TypeVar

from rollout_checkpoint.client.checkpointing.publication.errors import StorageFailed
from rollout_checkpoint.server.core import daemon_threads

T = TypeVar("T")


async def store_call(
    deadline: float, location: str, function: Callable[..., T], /, *args: Any, **kwargs: Any
) -> T:
    """`function(*args, **kwargs)` on a daemon thread, awaited until `deadline` (epoch
    seconds); `StorageFailed` naming `location` and the call when it has not returned by
    then (also when the deadline has already passed)."""
    call = daemon_threads.StorageCall(
        functools.partial(function, *args, **kwargs), _thread_name(function)
    )
    try:
        async with asyncio.timeout(max(0.0, deadline - time.time())):
            return await call.wait()
    except TimeoutError:
        raise _no_answer(location, function) from None


def store_call_sync(deadline: float, location: str, function: Callable[[], T]) -> T:
    """`store_call` for a synchronous caller (a verb without an event loop)."""
    call = daemon_threads.StorageCall(function, _thread_name(function))
    try:
        return call.result(max(0.0, deadline - time.time()))
    except TimeoutError:
        raise _no_answer(location, function) from None


def _name_of(function: Callable[..., Any]) -> str:
    while isinstance(function, functools.partial):
        function = function.func
    return getattr(function, "__name__", "call")


def _thread_name(function: Callable[..., Any]) -> str:
    return f"store call: {_name_of(function)}"


def _no_answer(location: str, function: Callable[..., Any]) -> StorageFailed:
    what = _name_of(function).strip("_").replace("_", " ")
    return StorageFailed(
        f"{location}: the checkpoint store did not answer by the deadline ({what}); "
        "is the filesystem frozen or the object store unreachable?"
    )
