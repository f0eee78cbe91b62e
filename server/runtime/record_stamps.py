"""When each record of an episodic participant or the policy model last changed.

An incremental export (`Participant.export_changes`) may reference a record of the base part
instead of storing it again only if nothing changed it since the base's cut. The environment,
the agent and the model hold one record per episode, and every change of one goes through a
method of their own (a boundary recorded, an episode begun, finished, ended, retired or
installed, a reply delivered into a ledger, a restored ledger claimed): each such method
stamps the record's key with the next value of one clock, which `change_clock` reads at the
cut. The rules each keep a changed record from being taken for an unchanged one:

* A key that was never stamped, or whose stamp was forgotten, is changed: forgetting
  (`keep_only`) can cost a record stored again, never a change missed.
* The clock is read at the cut before the export, so a change during the export or during
  an asynchronous write is stamped above the cut and stays changed for the next part.
* Stamps only rise; a key that leaves and comes back (a new run of a capture key) is stamped
  when it comes back.

Callers run on the event loop: no lock.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

from rollout_checkpoint.server.runtime.participant import ExportBase

Key = TypeVar("Key", bound=Hashable)


class RecordStamps(Generic[Key]):
    """The change clock of one participant and the last change of each record's key."""

    def __init__(self) -> None:
        self.clock = 0
        """Raised by every `touch`: the value `Participant.change_clock` reports."""
        self._stamps: dict[Key, int] = {}

    def touch(self, key: Key) -> None:
        """The record of `key` changed (or appeared, or went) now."""
        self.clock += 1
        self._stamps[key] = self.clock

    def unchanged(self, key: Key, identity: Hashable, base: ExportBase | None) -> bool:
        """Whether the base part holds the record `identity` of `key` and nothing changed
        that key since the base's cut (a key never stamped counts as changed)."""
        if base is None:
            return False
        stamp = self._stamps.get(key)
        return stamp is not None and stamp <= base.cut and base.holds(identity)

    def keep_only(self, held: Callable[[Key], bool]) -> None:
        """Forget the stamps of keys no longer `held`: bounded by what is held, and a key
        that comes back is stamped again (or counts as changed)."""
        for key in [k for k in self._stamps if not held(k)]:
            del self._stamps[key]

    def __len__(self) -> int:
        return len(self._stamps)
