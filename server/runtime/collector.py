"""The cyclic garbage collector around a large restore or commit: paused while records are
decoded or exported, and the restored heap frozen once decoded and again once installed.

Measured on 10,000 records of 5 KB (51.6 MB of JSON, about 1.5 million objects kept):

* Decoding them with the collector running takes 540 ms, paused 136 ms. Every object a
  decoder allocates is a container the collector must track, and each generation-2 pass
  rescans everything decoded so far; nothing decoded is garbage (a restore keeps it all), so
  that work finds nothing. The pause ends when the read does, and garbage made meanwhile is
  collected then, so it only defers work, never leaks.
* Once installed, the restored state stays for the whole episode, and every later full
  collection walks it again: 170 ms per pass at this size, a stall of the data plane that the
  process cannot schedule. `gc.freeze()` moves everything alive into the permanent
  generation, which no pass scans (0.002 ms after it). What it costs: an object alive at the
  freeze that later becomes part of a reference cycle is never collected. The state the
  kinds restore is trees of JSON values (freed by reference counting when a session goes),
  so what could leak is a few cycles of the process's own, once per restore. It is frozen
  twice: once decoded, before the install allocates (an install of 10,000 sessions otherwise
  spent 0.3 s in one full pass over the records just decoded), and once installed.
* A commit's export allocates a record per episode beside the live state of every session
  (seeded over the data plane, so never frozen); one full collection landing in it cost
  0.25 s of a 0.7 s commit of 10,000 sessions, while admission was closed. Paused there, the
  pass runs after the commit, when the data plane is open again and would have paid it anyway.
  A hook that runs long (a sandbox snapshot) keeps the collector paused as long: garbage in
  reference cycles waits for the export's end.

What the restored heap costs in memory (not time), and what brings it down, is in
`restored_memory.py`.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

_lock = threading.Lock()
_pauses = 0
_was_enabled = False


@contextlib.contextmanager
def collection_paused() -> Iterator[None]:
    """Disable the cyclic collector for the block (any thread; nested and concurrent blocks
    count, and the collector comes back on only if it was on before the first)."""
    global _pauses, _was_enabled
    with _lock:
        if _pauses == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _pauses += 1
    try:
        yield
    finally:
        with _lock:
            _pauses -= 1
            if _pauses == 0 and _was_enabled:
                gc.enable()


def freeze_restored_heap() -> None:
    """Keep later full collections from rescanning what a restore installed (the module
    docstring): `gc.freeze()`, once the install succeeded."""
    gc.freeze()
