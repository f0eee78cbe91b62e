"""What a restore's state costs in memory, and the two things that bring it down: equal short
strings shared while the records are decoded, and glibc's free heap returned afterwards.

Measured on a prompt-injection server restoring 10,000 records of 5 KB (51.7 MB of JSON; the
benchmark's `throughput` case), the process's RSS grew by 3.34x the records' bytes. Almost
all of it was live objects, not waste: pymalloc's arenas grew by 160 MB (3.25x), of which
5.6 MB were free blocks; glibc's heap by 5.2 MB, 3.1 MB of it free; no raw bytes or encoded
copy of a record stayed referenced after the install. The live objects were the decoded
states themselves, 2.84x their JSON: 1.68x in strings, 0.93x in dicts, 0.25x in lists. A JSON
decoder (msgspec here, but every one) makes a new string object for every string value it
reads, and states repeat their short values across sessions — statuses, tags, roles and tool
names, e-mail addresses, timestamps, ids: 953,000 string values, 196,000 distinct, and 1.0x
of the records' bytes were string objects equal to another one. (Dict keys are shared
already: msgspec caches short keys.)

`StringTable.share` makes equal strings of up to `SHARED_LENGTH` characters one object. It
runs in the reading thread on each record as soon as it is decoded, which is what makes it
work: the duplicates it drops are freed before the next record is decoded, so their memory is
reused at once. The same walk run after the whole part was decoded saved nothing in RSS
(3.13x either way in a plain script): the freed strings were scattered over arenas that stay
mapped while a live object remains in them. Measured in the benchmark's server, RSS growth
went from 3.34x to 2.37x (10,000 x 5 KB) and from 2.74x to 1.96x (1,000 x 50 KB).

What it costs is CPU in the read, one table lookup per string shared: about 0.13 s on
10,000 x 5 KB (the read's hash, parse and selection take 0.31 s) and 0.15 s on 1,000 x 50 KB
(0.18 s), in a plain script. Almost every lookup finds its string (95% on both), so the walk
pays for what it saves and no sampling would make it cheaper. The length limit decides what
is looked up. The short values are the ones that repeat (identifiers, UUIDs in hex,
timestamps, e-mail addresses, statuses, roles and tool names fit in 32 characters) and the
ones whose object costs most beside their text (49 bytes of header for a few characters);
longer text is mostly prose that no other session holds, whose lookup finds nothing. On
10,000 x 5 KB a limit of 16 gave 2.58x, 32 gave 2.22x, 64 gave 2.12x (a plain script's RSS
growth), their costs within the machine's noise of each other; sharing strings of any length
rather than up to 64 characters took the read of 1,000 x 50 KB from 0.38 s to 0.70 s. In the
benchmark (two interleaved runs on a busy 2-core machine), restore / raw read went from
0.65-0.77x to 0.82-0.97x on 10,000 x 5 KB, and from 0.71x to 1.27-1.32x on 1,000 x 50 KB,
whose parse is the cheapest per string. The strings are immutable, so sessions that share
one cannot see each other's changes; containers are never shared.

`release_free_heap` then returns glibc's free heap pages to the system (`malloc_trim(0)`):
the reading thread's line buffers and the table itself are freed by then. It took 0.5 ms and
gave back 1.2 MB (0.025x) of a 1,000 x 50 KB restore, 0.3 MB of a 10,000 x 5 KB one —
small, since what dominates is pymalloc's arenas, which CPython returns itself when one
empties. It is a no-op where the C library is not glibc.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from collections.abc import Callable
from typing import Any, Final

log = logging.getLogger(__name__)

SHARED_LENGTH: Final = 32
"""Strings up to this many characters are shared (the module docstring says why 32)."""


class StringTable:
    """One object per distinct short string across everything `share`d into this table.

    Made for one restore and dropped after it: the table holds the strings only while the
    records are read, so a string no session keeps is freed with the session as before.
    Not thread-safe; one reading thread uses it."""

    __slots__ = ("_max_length", "_strings")

    def __init__(self, max_length: int = SHARED_LENGTH) -> None:
        self._strings: dict[str, str] = {}
        self._max_length = max_length

    def __len__(self) -> int:
        """How many distinct strings the table holds."""
        return len(self._strings)

    def clear(self) -> None:
        """Drop the table (the strings stay wherever they were shared into)."""
        self._strings = {}

    def share(self, value: dict[str, Any] | list[Any]) -> None:
        """Replace, in place, every string value of up to `max_length` characters anywhere
        in `value` (a decoded JSON object or array) by the equal string the table saw first.

        Only exact `str` values of dicts and lists are replaced (keys are left: a decoder
        shares them already, and a dict cannot swap its keys in place); numbers, booleans
        and containers are never touched, so `1`, `1.0` and `True` keep their types.
        Iterative, so any nesting depth the decoder accepted is walked without recursion."""
        limit = self._max_length
        canonical = self._strings.setdefault
        pending: list[Any] = [value]
        pop = pending.pop
        push = pending.append
        while pending:
            container = pop()
            if type(container) is dict:
                for key, item in container.items():
                    kind = type(item)
                    if kind is str:
                        if len(item) <= limit:
                            shared = canonical(item, item)
                            if shared is not item:
                                container[key] = shared  # same key: the dict keeps its size
                    elif kind is dict or kind is list:
                        push(item)
            else:
                for index, item in enumerate(container):
                    kind = type(item)
                    if kind is str:
                        if len(item) <= limit:
                            shared = canonical(item, item)
                            if shared is not item:
                                container[index] = shared
                    elif kind is dict or kind is list:
                        push(item)


def release_free_heap() -> bool:
    """Return glibc's free heap pages to the system (`malloc_trim(0)`); False, doing
    nothing, where the C library is not glibc. Blocks for a moment (0.5 ms measured after
    a 50 MB restore): call it off the event loop."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        libc_version = os.confstr("CS_GNU_LIBC_VERSION") or ""
    except (ValueError, OSError):  # not a GNU C library
        return None
    if not libc_version.startswith("glibc"):
        return None
    try:
        # The symbols the interpreter is linked with: its glibc, without a search for the
        # library file (`ctypes.util.find_library` runs ldconfig in a subprocess).
        trim: Callable[[int], int] = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError) as exc:  # a glibc without it
        log.debug("malloc_trim is not available: %s", exc)
        return None
    trim.argtypes = [ctypes.c_size_t]  # type: ignore[attr-defined]
    trim.restype = ctypes.c_int  # type: ignore[attr-defined]
    return trim
