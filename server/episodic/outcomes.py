"""What an owner keeps of its finished episodes, and the rule that releases each outcome.

An owner (agent, environment) answers the caller of a finished episode with its outcome. A
checkpoint needs that outcome only while the caller may not have it yet, so a restored
replacement (attempt N+1) can deliver it instead of running the whole episode again:

* **On the wire** (`finished`, until the HTTP server took the last body of the reply): the
  caller does not have it. ListEpisodes lists the episode, so a derived scope names it.
* **Delivered** (`delivered`): the caller has it, but a caller that prepared before this owner
  (an environment relaying an agent's run) may hold it unread until resume, its own episode
  cut at the boundary before the call — and that caller's episode names this one in the
  scope. So the outcome stays, unlisted, until this owner's next commit or reopening ends
  the checkpoint that could need it, and only as one of the last `max(DELIVERED_KEPT_MIN,
  most episodes live here at once)` deliveries: a caller holds at most one reply per episode
  it had running here. Released at once instead, a reply delivered between the caller's
  close and this owner's would be run again after a crash.
* **Failed** (`failed`: the send raised): nobody has it. Kept, unlisted, for a controller
  that still counts the episode in flight and names it in a scope; released at the first
  commit whose scope leaves it out.

Nothing else releases an outcome but a retire or a forget of its rollout. Before these rules
an owner kept its last 10,000 outcomes for a checkpoint and a derived scope named them all:
a fleet driven by hand grew every checkpoint with its history.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

from rollout_checkpoint.server.core.episodes import EpisodeId

FINISHED_KEPT = 10_000
"""At most this many outcomes on the wire, and as many failed ones (the oldest go first): a
server whose replies keep failing, or that never learns of delivery (its requests carry no
rollout prefix), still runs forever in bounded memory."""
DELIVERED_KEPT_MIN = 64
"""The delivered outcomes kept are the last `max(DELIVERED_KEPT_MIN, peak live episodes)`."""


class FinishedOutcomes:
    """The outcomes of finished episodes by capture key, each in one of three states (see
    the module docstring); every method is O(1) amortized but the scans of a release."""

    def __init__(self) -> None:
        self._on_wire: OrderedDict[str, Any] = OrderedDict()
        self._delivered: OrderedDict[str, Any] = OrderedDict()
        self._failed: OrderedDict[str, Any] = OrderedDict()
        self._peak_live = 0
        """The most episodes live at once since the last release: the delivered bound."""

    def __len__(self) -> int:
        return len(self._on_wire) + len(self._delivered) + len(self._failed)

    def __contains__(self, key: object) -> bool:
        return key in self._on_wire or key in self._delivered or key in self._failed

    def saw_live(self, count: int) -> None:
        """`count` episodes are live now (called as one begins)."""
        self._peak_live = max(self._peak_live, count)

    def finished(self, key: str, outcome: Any) -> None:
        """The episode ended with `outcome`; its reply is about to go on the wire."""
        self.discard(key)
        self._on_wire[key] = outcome
        _trim(self._on_wire, FINISHED_KEPT)

    def delivered(self, key: str) -> None:
        """The HTTP server took the reply's last body: keep it only for a holding caller."""
        if key in self._on_wire:
            self._delivered[key] = self._on_wire.pop(key)
            _trim(self._delivered, max(DELIVERED_KEPT_MIN, self._peak_live))

    def failed(self, key: str) -> None:
        """The reply never reached the HTTP server (its send raised, or the app did)."""
        if key in self._on_wire:
            self._failed[key] = self._on_wire.pop(key)
            _trim(self._failed, FINISHED_KEPT)

    def discard(self, key: str) -> None:
        """Forget the outcome of `key` (a new run of that key supersedes it)."""
        for outcomes in (self._on_wire, self._delivered, self._failed):
            outcomes.pop(key, None)

    def checkpoint_ended(self, live: int) -> None:
        """Admission reopened: no caller holds a reply for a checkpoint any more."""
        self._delivered.clear()
        self._peak_live = live

    def committed(self, scope: frozenset[EpisodeId] | None, live: int) -> None:
        """A commit's part is written: it exported every outcome its scope names. Delivered
        ones go; with an explicit scope, so do the others it leaves out (the controller no
        longer continues them)."""
        self.checkpoint_ended(live)
        if scope is not None:
            self.drop(lambda episode: episode not in scope)

    def drop(self, covered: Callable[[EpisodeId], bool]) -> None:
        """Release every outcome whose episode is `covered`."""
        for outcomes in (self._on_wire, self._delivered, self._failed):
            for key in [k for k in outcomes if covered(EpisodeId.from_capture_key(k))]:
                del outcomes[key]

    def on_wire(self) -> list[str]:
        """Capture keys whose reply is on the wire: what ListEpisodes lists."""
        return list(self._on_wire)

    def items(self) -> Iterator[tuple[str, Any]]:
        """Every kept outcome by capture key, whatever its state (a scope may name any)."""
        for outcomes in (self._on_wire, self._delivered, self._failed):
            yield from outcomes.items()


def _trim(outcomes: OrderedDict[str, Any], bound: int) -> None:
    while len(outcomes) > bound:
        outcomes.popitem(last=False)
