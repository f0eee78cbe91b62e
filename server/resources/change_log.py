"""The sessions touched since a cut, so an incremental export costs what changed.

An incremental export must tell which sessions changed since the cut of the part it
references. Asking each session (its `last_change` against the cut) walked every session
held inside the pause, touched or not: most of an incremental pause at 10,000 sessions.
The log keeps the session objects in the order of their last touch, each with the change
clock of that touch, so the sessions touched after a cut are a suffix of it, read from the
end in O(touched).

The rules each keep an unchanged session from hiding a change:

* Entries are session objects, not ids: a closed session and a new one seeded under the same
  cookie are two entries, so the closed one's record is dropped from the next part and the
  new one exported.
* The log is pruned only below a cut every later base is at or above (`forget_until`), and
  `horizon` remembers how far: a cut below it cannot be answered (`since` returns None) and
  the export walks every session instead. The log is cleared whole when it outgrows the
  sessions held (a server that never exports incrementally would otherwise grow it forever),
  which costs one walking export, never a missed change.
* Callers hold the data plane's change lock around every method: a touch may come from a
  thread of the server's own (`checkpoint_session_changed`).
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rollout_checkpoint.server.resources.session_table import TrackedSession

SLACK = 1024
"""Entries the log may hold beyond twice the sessions tracked before it is cleared."""


class ChangeLog:
    """Sessions by last touch, with that touch's change clock (see the module docstring)."""

    def __init__(self) -> None:
        self._touched: dict[TrackedSession, int] = {}
        self.horizon = 0
        """No cut below this can be answered: touches at or below it may have been forgotten."""

    def __len__(self) -> int:
        return len(self._touched)

    def note(self, session: TrackedSession, clock: int, tracked: int) -> None:
        """`session` was touched at `clock` (`tracked`: how many sessions are held now)."""
        touched = self._touched
        touched.pop(session, None)
        touched[session] = clock
        if len(touched) > 2 * tracked + SLACK:
            touched.clear()
            self.horizon = clock

    def since(self, cut: int) -> list[TrackedSession] | None:
        """Every session touched after `cut`, latest first; None when the log no longer
        reaches back to `cut`."""
        if cut < self.horizon:
            return None
        touched = self._touched
        found: list[TrackedSession] = []
        for session in reversed(touched):
            if touched[session] <= cut:
                break
            found.append(session)
        return found

    def forget_until(self, cut: int) -> None:
        """Drop the touches at or below `cut`: no later export asks about an earlier cut."""
        touched = self._touched
        stale = 0
        for clock in touched.values():
            if clock > cut:
                break
            stale += 1
        if stale == len(touched):
            touched.clear()
        elif stale:
            # Rebuilt, not deleted from the front: a dict iterated from its start after
            # deletions there skips every deleted slot, so popping the oldest entry one by
            # one is quadratic (70 ms of a pause for 10,000 stale entries).
            self._touched = dict(itertools.islice(touched.items(), stale, None))
        self.horizon = max(self.horizon, cut)
