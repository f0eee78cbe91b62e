"""The argument checks every control call makes before it takes the lock.

They run first, so a malformed call is INVALID_REQUEST and changes nothing: no transition, no
lease, no job. A deadline too far ahead is refused because the lease is the deadline plus
the grace period: a far deadline would make an unbounded lease, and a controller that died
would leave the fleet closed until then. A deadline already past is DEADLINE_EXCEEDED
before any work starts, except for the calls that only end work (Resume, the wait of an
asynchronous commit): those must run whatever their deadline.
"""

from __future__ import annotations

from rollout_checkpoint.server.core.clock import Clock
from rollout_checkpoint.server.core.episodes import is_valid_id
from rollout_checkpoint.server.core.errors import deadline_exceeded, invalid_request


def check_checkpoint_id(checkpoint_id: str) -> None:
    if not is_valid_id(checkpoint_id):
        raise invalid_request(
            "checkpoint_id", "must be 1-128 characters matching ^[A-Za-z0-9][A-Za-z0-9._-]*$"
        )


def check_deadline(
    clock: Clock, max_deadline_seconds: float, deadline: float, *, allow_past: bool = False
) -> None:
    now = clock.now()
    if deadline - now > max_deadline_seconds:
        raise invalid_request("deadline", f"lies more than {max_deadline_seconds:g} s ahead")
    if not allow_past and deadline <= now:
        raise deadline_exceeded("the deadline has already passed", deadline)
