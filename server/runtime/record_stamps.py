"""When each record of an episodic participant or the policy model last changed.

An incremental export (`Participant.export_changes`) may reference a record of the base part
instead of storing it again only if nothing changed it since the base's cut. The environment,
the agent and the model hold one record per episode, and every change of one goes through a
method of their own (a boundary recorded, an episode begun, finished, ended, retired or
installed, a reply delivered into a ledger, a restored ledger claimed): each such method
stamps the record's key with the next value of one clock, which `change_clock` reads at the
cut. The rules each keep a changed record from being taken for an unchanged one:

* A key that was never stamped, or whose stamp was forgotten, is changed: forgetting
  (`prune`) can cost a record stored again, never a change missed.
* The clock is read at the cut before the export, so a change during the export or during
  an asynchronous write is stamped above the cut and stays changed for the next part.
* Stamps only rise; a key that leaves and comes back (a new run of a capture key) is stamped
  when it comes back.
* Bounded by what is held, not by what ever ran: stamps are pruned at every commit, and also
  whenever they outgrow twice what the last pruning kept (plus `PRUNE_FLOOR`), against the
  owner's `held` test. A server that never commits, or whose commits keep failing, would
  otherwise keep a stamp for every episode it ever began (about 135 bytes each: 0.5 GB an
  hour at 1,000 episodes a second).

Callers run on the event loop: no lock.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

from rollout_checkpoint.server.runtime.participant import ExportBase

Key = TypeVar("Key", bound=Hashable)

PRUNE_FLOOR = 1024
"""Stamps kept past what the last pruning kept before the next one: amortizes each pruning
(a pass over every stamp) over at least this many touches."""


class RecordStamps(Generic[Key]):
    """The change clock of one participant and the last change of each record's key."""

    def __init__(self, held: Callable[[Key], bool]) -> None:
        self.clock = 0
        """Raised by every `touch`: the value `Participant.change_clock` reports."""
        self._stamps: dict[Key, int] = {}
        self._held = held
        """Whether the owner may still export a record of the key (pruning's test)."""
        self._limit = PRUNE_FLOOR

    def touch(self, key: Key) -> None:
        """The record of `key` changed (or appeared, or went) now."""
        self.clock += 1
        self._stamps[key] = self.clock
        if len(self._stamps) > self._limit:
            self.prune()

    def unchanged(self, key: Key, identity: Hashable, base: ExportBase | None) -> bool:
        """Whether the base part holds the record `identity` of `key` and nothing changed
        that key since the base's cut (a key never stamped counts as changed)."""
        if base is None:
            return False
        stamp = self._stamps.get(key)
        return stamp is not None and stamp <= base.cut and base.holds(identity)

    def prune(self) -> None:
        """Forget the stamps of keys the owner no longer holds (`held`): bounded by what is
        held, and a key that comes back is stamped again (or counts as changed)."""
        held = self._held
        for key in [k for k in self._stamps if not held(k)]:
            del self._stamps[key]
        self._limit = 2 * len(self._stamps) + PRUNE_FLOOR

    def holds(self, key: Key) -> bool:
        """Whether the owner may still export a record of `key` (its `held` test)."""
        return self._held(key)

    def __len__(self) -> int:
        return len(self._stamps)

    def __contains__(self, key: object) -> bool:
        return key in self._stamps
