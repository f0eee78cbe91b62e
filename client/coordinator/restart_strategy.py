"""The restart strategy: how many recovery tries the supervisor makes before it gives up.

Like Flink's failure-rate strategy, at most `max_tries` recovery tries within `window_seconds`
count, succeeded or not: a member that is recovered and dies again, over and over, is a crash
loop, and recovering it forever would keep the fleet closed forever. A failed try is followed
by a doubling backoff (announced as `recovery_failed.retry_in`). A replacement that answered
and died again before its recovery finished counts as a failed try too: a crash loop whose
replacements live a second would otherwise never reach a try. Its own module because which
deaths count (once per process) is a rule of its own that the supervisor's loop only asks
about, and because every try is announced (`recovery_started` with its number,
`recovery_failed`) from the count it makes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Collection, Iterable
from dataclasses import dataclass

from rollout_checkpoint.client.coordinator.calls import encodable, status_of
from rollout_checkpoint.client.coordinator.fleet_events import FleetEventLog
from rollout_checkpoint.client.fleet.membership import MemberEvent
from rollout_checkpoint.server.core.errors import CheckpointError, Reason
from rollout_checkpoint.server.core.rpc.wire import duration
from rollout_checkpoint.v1 import coordinator_service_pb2 as cpb

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RestartStrategy:
    """How often the supervisor tries to recover before it gives up."""

    max_tries: int = 3
    """Recovery tries allowed within `window_seconds`; one more gives up."""
    window_seconds: float = 600.0
    """The window `max_tries` counts tries in (a failure rate, like Flink's)."""
    backoff_seconds: float = 1.0
    """The wait after the first failed try; doubled after each further one."""
    max_backoff_seconds: float = 30.0
    """The longest wait between two tries, however many failed."""


class RecoveryTries:
    """The recovery tries of one supervisor, counted against a `RestartStrategy` and announced
    on the fleet's event stream, and the replacements that died before their recovery
    finished (the give-up reason names them)."""

    def __init__(self, strategy: RestartStrategy, events: FleetEventLog) -> None:
        self.strategy = strategy
        self.events = events
        self._tries: deque[float] = deque()
        self._tried_boot_ids: set[str] = set()
        """Boot ids of replacements a try was counted for: their death is that try's failure,
        not another one."""
        self._crashes: list[str] = []
        """Replacements that died before their recovery finished (for the give-up reason)."""
        self.last_error: BaseException | None = None
        """Why the last try failed (None: none failed yet)."""

    def start(
        self, now: float, replaced: Collection[str], latest: str | None = None, control_id: str = ""
    ) -> int:
        """Count a try of recovering `replaced` that starts at `now` and announce it; returns
        its number."""
        self._tries.append(now)
        number = len(self._tries)
        log.info(
            "supervisor: recovery try %d starts (replaced: %s)", number, ", ".join(sorted(replaced))
        )
        self.events.emit(
            recovery_started=cpb.RecoveryStarted(
                recovery_id=control_id,
                replaced_members=sorted(replaced),
                try_number=number,
                source_checkpoint_id=latest or "",
            )
        )
        return number

    def trying(self, boot_ids: Iterable[str]) -> None:
        """The replacements (by boot id) the try about to start restores: a death of one of
        them is that try's failure."""
        self._tried_boot_ids.update(boot_ids)

    async def failed(self, try_number: int, error: BaseException) -> None:
        """Report a failed try and wait out its backoff (the members are left as they are:
        the next try replays where this one succeeded)."""
        self.last_error = error
        strategy = self.strategy
        backoff = min(
            strategy.max_backoff_seconds, strategy.backoff_seconds * 2.0 ** (try_number - 1)
        )
        self.events.emit(
            recovery_failed=cpb.RecoveryFailed(
                error=status_of(encodable(error)), retry_in=duration(backoff)
            )
        )
        log.warning(
            "supervisor: recovery try %d failed (%s); next in %g s", try_number, error, backoff
        )
        await asyncio.sleep(backoff)

    def replacement_died(self, event: MemberEvent, *, counting: bool) -> None:
        """A member awaiting its recovery answered and died again: a failed try, counted (when
        `counting`: the supervisor has not given up) unless a try already counted for this
        process (a try it breaks fails by itself, and its failure may be reported before or
        after this death)."""
        text = f"{event.name} (boot id {event.boot_id}) died before the fleet was reopened"
        self._crashes.append(text)
        if not counting or event.boot_id in self._tried_boot_ids:
            return
        self._tried_boot_ids.add(event.boot_id)
        self._tries.append(event.at)
        log.warning("supervisor: %s; recovery try %d counted failed", text, len(self._tries))
        self.events.emit(
            recovery_failed=cpb.RecoveryFailed(
                error=status_of(
                    CheckpointError(Reason.PARTICIPANT_UNREACHABLE, text, code="UNAVAILABLE")
                ),
                retry_in=duration(0.0),
            )
        )

    def exhausted(self) -> bool:
        """Whether `max_tries` tries (a replacement dying before its recovery finished counts
        as one) fall within the window: every further try would be beyond the limit."""
        window = self.strategy.window_seconds
        while self._tries and self._tries[0] < time.time() - window:
            self._tries.popleft()
        return len(self._tries) >= self.strategy.max_tries

    def all_recovered(self) -> None:
        """No replacement awaits its recovery any more: the deaths seen so far are over."""
        self._crashes.clear()
        self._tried_boot_ids.clear()

    def limit_reached(self, awaiting: Iterable[str]) -> str:
        """Why the supervisor gives up: the tries, the members `awaiting` their recovery, the
        last replacements that died and the last failure."""
        strategy = self.strategy
        reason = (
            f"{len(self._tries)} recovery tries within {strategy.window_seconds:g} s "
            f"(strategy limit {strategy.max_tries})"
        )
        reason += f"; awaiting recovery: {', '.join(sorted(awaiting))}"
        if self._crashes:
            reason += f"; replacements that died: {'; '.join(self._crashes[-5:])}"
        error = self.last_error
        return f"{reason}; last failure: {error}" if error is not None else reason
